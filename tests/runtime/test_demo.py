"""``harts-planner demo``'s model step (:func:`harts_runtime.model_demo`) and the plain progress lines
of long steps in logs (:class:`harts_runtime.demo.StepProgress`)."""

from __future__ import annotations

import io

import pytest
import torch

from harts_planner import measured
from harts_runtime import InvalidInputError, model_demo
from harts_runtime.demo import StepProgress


def test_model_demo_shows_rows_work_equal_losses_and_the_measured_gpu_speedup():
    out = io.StringIO()
    threads = torch.get_num_threads()
    (res,) = model_demo(out=out)
    assert torch.get_num_threads() == threads  # restored after its one-thread run
    text = out.getvalue()
    c, t = res["compact"], res["trajectory"]
    assert t["rows"] == t["semantic_tokens"] > 3 * c["rows"]  # S / C > 3 on the demo trees
    assert c["num_calls"] >= 2 and c["replay_tokens"] > 0  # forks, a state handoff, replay
    assert res["abs_loss_diff"] < 1e-5 and res["work"]["ideal_work_compression"] > 3
    assert f"rows executed {c['rows']:>7,}" in text and f"loss {c['loss']:.6f}" in text
    assert f"|loss(compact) - loss(trajectory)| = {res['abs_loss_diff']:.3e}" in text
    h = measured.GPU_HEADLINE
    assert f"{h['speedup']:.2f}x faster compact than trajectory-wise" in text and h["source"] in text
    assert "fbg=" not in text and "plan=" not in text  # no CPU timings


def test_model_demo_names_a_bad_preset():
    with pytest.raises(InvalidInputError) as e:
        model_demo(preset="swe-like")
    assert e.value.field == "preset"


def test_step_progress_prints_plain_lines_off_a_terminal():
    stream = io.StringIO()  # not a TTY: lines, no bar
    with StepProgress("step 0 compact", every=0.0, stream=stream) as progress:
        for done in range(1, 4):
            progress(done, 3)
    lines = stream.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "step 0 compact: microbatch 1/3 (33%)",
        "step 0 compact: microbatch 2/3 (67%)",
        "step 0 compact: microbatch 3/3 (100%)",
    ]
    quiet = io.StringIO()
    with StepProgress("x", quiet=True, stream=quiet) as progress:
        progress(1, 1)
    assert quiet.getvalue() == ""
    sparse = io.StringIO()  # every 10 s: only the last microbatch of a fast step
    with StepProgress("y", stream=sparse) as progress:
        for done in range(1, 6):
            progress(done, 5)
    assert [line.split(",")[0] for line in sparse.getvalue().splitlines()] == ["y: microbatch 5/5 (100%)"]


def test_the_runtime_registers_the_demo_s_model_step_where_the_planner_looks(tmp_path, monkeypatch):
    """pyproject.toml registers ``harts_runtime:model_demo`` as the ``model`` entry point of the
    planner's ``harts.demo`` group, and the planner's lookup (which imports nothing of the runtime)
    loads it from any installed distribution's metadata: here a stand-in dist-info on sys.path with
    pyproject's entry, so that the test does not depend on when this checkout was installed."""
    from pathlib import Path

    from harts_planner.commands import synthetic

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    value = project["entry-points"][synthetic.DEMO_STEPS]["model"]
    assert value == "harts_runtime:model_demo"
    dist = tmp_path / "harts_demo_stand_in-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: harts-demo-stand-in\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[{synthetic.DEMO_STEPS}]\nmodel = {value}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    step, why = synthetic._model_step()
    assert step is model_demo and why is None
