"""``harts-train`` as a trainer (``harts_runtime.cli``, ``trainer``, ``rollout_files``): JSONL and
Parquet rollout files train on the ``debug`` flavor (CPU, float32); save + resume gives the weights
of an uninterrupted run bit for bit (one process) and resumes under 2 gloo processes; metrics
JSONL, TensorBoard and progress lines; config files (TOML / YAML) with flags overriding them; every
bad flag, file or field is one line on stderr and exit code 2."""

import json
import random

import pytest
import torch

from harts_runtime.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

V = 512  # the debug flavor's vocabulary
BASE = ["--flavor", "debug", "--device", "cpu", "--progress", "off"]


def _rows(steps=2, seed=0, per_token=True, vocab=V):
    """A few tiny prefix-sharing trajectories per step: a shared prompt, 4 responses, GRPO fields.
    Scalar advantages on odd rows, lists elsewhere: per target (``L - 1`` values), or with
    ``per_token`` token-aligned (``L`` values: one more in front, which nothing reads)."""
    r = random.Random(seed)
    rows = []
    for step in range(steps):
        prompt = [r.randrange(vocab) for _ in range(12)]
        for g in range(4):
            toks = prompt + [r.randrange(vocab) for _ in range(r.randint(3, 9))]
            n = len(toks) - 1  # targets
            row = {
                "tokens": toks,
                "advantages": r.choice([1.0, -1.0, 0.5]) if g % 2 else [round(r.uniform(-1, 1), 3)] * n,
                "loss_mask": [0] * (len(prompt) - 1) + [1] * (n - len(prompt) + 1),
                "old_logprobs": [round(-6.2 + 0.2 * r.random(), 4) for _ in range(n)],
                "ref_logprobs": [round(-6.2 + 0.2 * r.random(), 4) for _ in range(n)],
                "group_id": f"q{step}",
                "step": step,
                "reward": 1.0,  # not read: named once on stderr
            }
            if per_token:
                for k, first in (
                    ("advantages", 9.0),
                    ("loss_mask", 1),
                    ("old_logprobs", 0.0),
                    ("ref_logprobs", -50.0),
                ):
                    if isinstance(row[k], list):
                        row[k] = [first] + row[k]
            rows.append(row)
    return rows


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return str(path)


def _parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    cols = {k: [row[k] for row in rows] for k in rows[0] if k != "advantages"}
    # a Parquet column has one type: the scalar advantages become per-target lists of that value
    cols["advantages"] = [
        x["advantages"] if isinstance(x["advantages"], list) else [x["advantages"]] * (len(x["tokens"]) - 1)
        for x in rows
    ]
    pq.write_table(pa.table(cols), str(path))
    return str(path)


def _records(path):
    return [json.loads(line) for line in open(path)]


def _json_lines(out: str):
    return [json.loads(line) for line in out.strip().splitlines()]


def _weights(folder):
    """The model weights and AdamW state of a harts-train checkpoint folder, loaded into one
    process's debug model."""
    from harts_runtime.engine import EngineConfig, HartsEngine
    from harts_runtime.models import HybridModel, model_config

    engine = HartsEngine(HybridModel(model_config("debug")), EngineConfig(lr=1e-3))
    engine.load(folder)
    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    for i, s in enumerate(engine.optimizer.state.values()):
        state.update({f"opt{i}.{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    return state


# ---------------------------------------------------------------------------------- training
def test_jsonl_trains_its_steps_with_metrics_and_progress_lines(tmp_path, capsys):
    data = _jsonl(tmp_path / "r.jsonl", _rows(steps=2))
    metrics = tmp_path / "m" / "metrics.jsonl"
    argv = ["--flavor", "debug", "--device", "cpu", "--data", data, "--metrics", str(metrics)]
    assert main([*argv, "--steps", "3", "--progress-every", "0"]) == 0
    cap = capsys.readouterr()
    lines = cap.out.strip().splitlines()
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"], lines
    assert all("loss=" in line and "grad_norm=" in line and "compression=" in line for line in lines)
    recs = _records(metrics)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert [r["data_step"] for r in recs] == [0, 1, 0]  # two steps in the file, by its 'step' key; cycled
    for r in recs:
        assert not r["skipped"] and r["rows"] < r["semantic_tokens"] and r["kda_calls"] > 0
        for k in ("loss", "policy_loss", "loss_fn/kl", "grad_norm", "lr", "compression", "step_seconds"):
            assert isinstance(r[k], float), k
    assert recs[0]["semantic_tokens"] == sum(len(x["tokens"]) for x in _rows(steps=2)[:4])
    # stderr (not a terminal): the data summary, the ignored key, plain progress lines
    assert "2 steps (by its 'step' key)" in cap.err and "ignored keys: reward" in cap.err
    assert "harts-train: step 1/3 (33%)" in cap.err and "harts-train: step 3/3 (100%)" in cap.err


def test_parquet_trains_like_jsonl_and_per_target_like_per_token(tmp_path, capsys):
    """The same trajectories as JSONL (per-token fields), JSONL (per-target fields) and Parquet
    (per-target lists) give the same losses, bit for bit."""
    losses = []
    for name, rows, write in (
        ("a.jsonl", _rows(per_token=True), _jsonl),
        ("b.jsonl", _rows(per_token=False), _jsonl),
        ("c.parquet", _rows(per_token=False), _parquet),
    ):
        assert main([*BASE, "--data", write(tmp_path / name, rows), "--steps", "2", "--json"]) == 0
        losses.append([(r["loss"], r["grad_norm"]) for r in _json_lines(capsys.readouterr().out)])
    assert len(losses[0]) == 2 and losses[0] == losses[1] == losses[2], losses


def test_save_and_resume_give_the_uninterrupted_weights_bit_for_bit(tmp_path, capsys):
    """2 steps + save, then --resume to 3 (settings, schedule and data position from the
    checkpoint) == 3 steps in one run: weights and AdamW state bit for bit in fp32; the metrics
    file continues."""
    data = _jsonl(tmp_path / "r.jsonl", _rows(steps=2))
    sched = ["--lr-schedule", "linear", "--warmup-steps", "1", "--total-steps", "3", "--lr", "2e-3"]
    metrics = tmp_path / "m.jsonl"
    first = [*BASE, "--data", data, *sched, "--save", str(tmp_path / "a"), "--metrics", str(metrics)]
    assert main([*first, "--steps", "2"]) == 0
    assert (tmp_path / "a" / "step-2" / "trainer.json").is_file()
    assert main(["--resume", str(tmp_path / "a"), "--steps", "3"]) == 0  # the rest from the checkpoint
    assert main([*BASE, "--data", data, *sched, "--steps", "3", "--save", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "resumed from" in err and "data position 2 (same data)" in err
    got, want = _weights(tmp_path / "a" / "step-3"), _weights(tmp_path / "b" / "step-3")
    assert set(got) == set(want) and any(k.startswith("opt") for k in got)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    recs = _records(metrics)
    assert [r["step"] for r in recs] == [1, 2, 3] and [r["data_step"] for r in recs] == [0, 1, 0]
    assert [r["lr"] for r in recs] == pytest.approx([1e-3, 2e-3, 1e-3])  # warm-up, then linear decay
    state = json.loads((tmp_path / "a" / "step-3" / "trainer.json").read_text())
    assert state["steps_done"] == 3 and state["data"]["position"] == 3 and state["args"]["lr"] == 2e-3
    # nothing left to do: says so, exits 0
    assert main(["--resume", str(tmp_path / "a")]) == 0
    assert "nothing to train" in capsys.readouterr().err


def _resume_worker(rank, world, argv):
    from harts_runtime.cli import main

    return main(argv)


@pytest.mark.slow
def test_resume_under_two_gloo_processes(tmp_path, capsys):
    """A one-process checkpoint resumes under 2 processes (dp_shard=2, the engine sharded with
    FSDP2): the resumed step's policy loss is the one-process run's, and the weights after it agree to
    float rounding (a different summation order; AdamW turns it into at most O(lr) changes)."""
    from harts_runtime.parallel.launch import run_distributed

    data = _jsonl(tmp_path / "r.jsonl", _rows(steps=2))
    assert main([*BASE, "--data", data, "--steps", "2", "--save", str(tmp_path / "a")]) == 0
    assert main([*BASE, "--data", data, "--steps", "3", "--save", str(tmp_path / "b"), "--json"]) == 0
    want = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    argv = ["--resume", str(tmp_path / "a" / "step-2"), "--steps", "3", "--save", str(tmp_path / "c")]
    argv += ["--metrics", str(tmp_path / "c.jsonl")]
    assert run_distributed(_resume_worker, 2, argv, timeout=240) == [0, 0]
    (rec,) = _records(tmp_path / "c.jsonl")
    # two replicas: two microbatches; the policy loss does not depend on the grouping, the MoE
    # router loss (per microbatch, as in Megatron) does, a little
    assert rec["step"] == 3 and rec["microbatches"] == 2
    assert rec["policy_loss"] == pytest.approx(want["policy_loss"], rel=1e-5, abs=1e-7)
    assert rec["loss"] == pytest.approx(want["loss"], rel=1e-3)
    state = json.loads((tmp_path / "c" / "step-3" / "trainer.json").read_text())
    assert state["world_size"] == 2 and state["steps_done"] == 3
    got, want = _weights(tmp_path / "c" / "step-3"), _weights(tmp_path / "b" / "step-3")
    for k in want:
        # local_tokens_per_expert: diagnostic expert-load counts; without expert-bias routing
        # nothing resets them, and the DP sum adds each rank's history again (engine issue)
        if not k.startswith("opt") and not k.endswith("local_tokens_per_expert"):
            torch.testing.assert_close(got[k], want[k], atol=3e-3, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def _cp_rows():
    """One step of two trajectories of 40 tokens sharing a 24-token prompt (longer than T = 32)."""
    r = random.Random(5)
    prompt = [r.randrange(V) for _ in range(24)]
    out = []
    for g in range(2):
        toks = prompt + [r.randrange(V) for _ in range(16)]
        n = len(toks) - 1
        out.append(
            {
                "tokens": toks,
                "advantages": 1.0 if g else -0.5,
                "loss_mask": [0] * (len(prompt) - 1) + [1] * (n - len(prompt) + 1),
                "old_logprobs": [-6.2] * n,
                "ref_logprobs": [-6.1] * n,
                "group_id": "q0",
                "step": 0,
            }
        )
    return out


@pytest.mark.slow
def test_cp_runs_trajectories_longer_than_the_capacity(tmp_path, capsys):
    """``--cp 2`` under two gloo processes trains trajectories longer than ``--capacity`` (one
    microbatch of up to 2 x 32 rows on both ranks), with the one-process loss at capacity 64; one
    process at capacity 32 refuses them naming --capacity and --cp."""
    from harts_runtime.parallel.launch import run_distributed

    data = _jsonl(tmp_path / "r.jsonl", _cp_rows())
    base = [*BASE, "--data", data, "--steps", "1"]
    assert main([*base, "--capacity", "32"]) == 2
    assert "--capacity: T = 32 rows per microbatch is below the longest trajectory (40 tokens" in (
        capsys.readouterr().err
    )
    assert main([*base, "--capacity", "64", "--json"]) == 0
    want = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    argv = [*base, "--capacity", "32", "--cp", "2", "--metrics", str(tmp_path / "cp.jsonl")]
    assert run_distributed(_resume_worker, 2, argv, timeout=240) == [0, 0]
    (rec,) = _records(tmp_path / "cp.jsonl")
    assert rec["microbatches"] == 1
    assert rec["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_config_file_keys_and_flags_override(tmp_path, capsys):
    data = _jsonl(tmp_path / "r.jsonl", _rows(steps=1))
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'data = "{data}"\nflavor = "debug"\ndevice = "cpu"\nsteps = 1\nlr = 5e-4\n'
        'max-grad-norm = 0.5\nprogress = "off"\nkeep = ["attention"]\nrecompute = true\njson = true\n'
    )
    assert main(["--config", str(toml), "--steps", "2", "--save", str(tmp_path / "ck")]) == 0
    recs = _json_lines(capsys.readouterr().out)
    assert [r["step"] for r in recs] == [1, 2]  # --steps 2 overrides the file's 1
    assert recs[0]["lr"] == 5e-4
    args = json.loads((tmp_path / "ck" / "step-2" / "trainer.json").read_text())["args"]
    assert args["max_grad_norm"] == 0.5 and args["keep"] == "attention" and args["recompute"] is True
    yaml_cfg = tmp_path / "run.yaml"
    yaml_cfg.write_text(
        f"data: {data}\nflavor: debug\ndevice: cpu\nsteps: 1\nlr: 5e-4\nprogress: 'off'\njson: true\n"
    )
    assert main(["--config", str(yaml_cfg), "--lr", "1e-4"]) == 0
    (rec,) = _json_lines(capsys.readouterr().out)
    assert rec["lr"] == 1e-4


def test_synthetic_step_and_help(capsys):
    """Without --data: the synthetic step through the same trainer; --help lists every flag with
    its default."""
    assert main(["--preset", "tiny", "--steps", "1", "--device", "cpu", "--progress", "off"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 1/1 loss=")
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--data", "--config", "--save", "--resume", "--metrics", "--tensorboard", "--tp", "--sp"):
        assert flag in text
    assert "(default: 1.0)" in text and "(default: constant)" in text and "default: one pass over" in text
    from harts_runtime.cli import build_parser

    parser = build_parser()
    fmt = parser._get_formatter()
    for a in parser._actions:
        if a.dest != "help":
            assert "default" in fmt._get_help_string(a), a.option_strings


def test_readme_synopsis_lists_every_flag_and_no_other():
    """README's "Training steps: `harts-train`" synopsis and the parser agree."""
    import re
    from pathlib import Path

    from harts_runtime.cli import build_parser

    text = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = text[text.index("## Training steps: `harts-train`") :]
    synopsis = section.split("```")[1]
    harts_lines = [line.split("#")[0] for line in synopsis.splitlines() if not line.startswith("torchrun")]
    documented = set(re.findall(r"(--[a-z][a-z0-9-]*)", "\n".join(harts_lines)))
    flags = {
        o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"
    }
    assert documented == flags, (sorted(documented - flags), sorted(flags - documented))


def test_option_flags_are_generated_from_the_options():
    """Every ExecutionOptions / OptimizerOptions field but the excluded ones is a flag, named after
    it, with its help text, choices and metavar (where the command line does not say otherwise)."""
    from harts_runtime.cli import build_parser
    from harts_runtime.cli.flags import CLI_FLAGS, NOT_FLAGS
    from harts_runtime.options import ExecutionOptions, OptimizerOptions, option_fields

    actions = {a.dest: a for a in build_parser()._actions}
    for cls in (ExecutionOptions, OptimizerOptions):
        for f in option_fields(cls):
            if f.name in NOT_FLAGS:
                assert f.name not in actions
                continue
            a = actions[f.name]
            assert a.option_strings == ["--" + f.name.replace("_", "-")]
            if "help" not in CLI_FLAGS.get(f.name, {}):
                assert a.help.startswith(f.metadata["help"]), f.name
            if "choices" in f.metadata and "choices" not in CLI_FLAGS.get(f.name, {}) and f.name != "keep":
                assert tuple(a.choices) == tuple(f.metadata["choices"]), f.name
            assert a.metavar == f.metadata.get("metavar"), f.name


def test_the_trainer_never_imports_the_cli():
    import subprocess
    import sys

    code = "import sys, harts_runtime.trainer; print(sorted(m for m in sys.modules if m.startswith('harts_runtime.cli')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_an_unexportable_model_fails_before_training(tmp_path, capsys):
    """The debug flavor has a GQA layer, which no transformers family here holds: --export is
    refused before any step runs."""
    data = _jsonl(tmp_path / "r.jsonl", _rows(steps=1))
    assert main([*BASE, "--data", data, "--export", str(tmp_path / "no")]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "has no Kimi-Linear equivalent" in cap.err and not (tmp_path / "no").exists()


@pytest.mark.slow
def test_model_folder_trains_and_exports(tmp_path, capsys):
    """--model PATH (a tiny Kimi-Linear folder written by transformers) trains; --export writes a
    folder load_pretrained reads back with the trained weights."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    import hf_configs

    from harts_runtime.hf import load_pretrained

    torch.manual_seed(0)
    transformers.KimiLinearForCausalLM(hf_configs.kimi_linear_config()).save_pretrained(tmp_path / "hf")
    data = _jsonl(tmp_path / "r.jsonl", _rows(steps=1, vocab=hf_configs.V))
    argv = ["--model", str(tmp_path / "hf"), "--device", "cpu", "--dtype", "float32", "--progress", "off"]
    assert main([*argv, "--data", data, "--lr", "1e-2", "--export", str(tmp_path / "out"), "--json"]) == 0
    (rec,) = _json_lines(capsys.readouterr().out)
    assert rec["lr"] == 1e-2 and not rec["skipped"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "kimi_linear"
    before = load_pretrained(tmp_path / "hf", dtype="float32").state_dict()
    after = load_pretrained(tmp_path / "out", dtype="float32").state_dict()
    assert set(before) == set(after)
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_tensorboard_event_files(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    data = _jsonl(tmp_path / "r.jsonl", _rows(steps=1))
    assert main([*BASE, "--data", data, "--steps", "2", "--tensorboard", str(tmp_path / "tb")]) == 0
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


# ---------------------------------------------------------------------------------- errors
def _bad_rows(change):
    rows = _rows(steps=1, per_token=True)
    change(rows)
    return rows


def _set(i, key, value):
    def change(rows):
        if value is _DROP:
            del rows[i][key]
        else:
            rows[i][key] = value(rows[i]) if callable(value) else value

    return change


_DROP = object()


def _put(i, key, j, value):
    def change(rows):
        rows[i][key] = (
            list(rows[i][key]) if isinstance(rows[i][key], list) else [rows[i][key]] * len(rows[i]["tokens"])
        )
        rows[i][key][j] = value

    return change


def _no_ref_after_first(rows):
    for r in rows[1:]:
        del r["ref_logprobs"]


def _no_ref(rows):
    for r in rows:
        del r["ref_logprobs"]


@pytest.mark.parametrize(
    "change,fragment",
    [
        (_set(1, "old_logprobs", _DROP), "r.jsonl:2: old_logprobs: missing"),
        (_set(0, "advantages", lambda r: [0.1, 0.2, 0.3]), "r.jsonl:1: advantages: expected"),
        (_put(0, "advantages", 3, float("nan")), "r.jsonl:1: advantages[3]: must be finite, got nan"),
        (_put(2, "tokens", 1, V), f"r.jsonl:3: tokens[1]: token id {V} is outside [0, {V})"),
        (_put(0, "tokens", 0, 1.5), "r.jsonl:1: tokens[0]: expected an integer token id, got 1.5"),
        (
            _put(0, "old_logprobs", 2, 0.5),
            "r.jsonl:1: old_logprobs[2]: a log-prob is finite and <= 0, got 0.5",
        ),
        (_put(3, "loss_mask", 4, 2), "r.jsonl:4: loss_mask[4]: a loss mask is 0 / 1 or true / false, got 2"),
        (
            _put(3, "loss_mask", 5, "yes"),
            "r.jsonl:4: loss_mask[5]: expected 0 / 1 or true / false, got 'yes'",
        ),
        (_set(0, "advantages", "high"), "r.jsonl:1: advantages: expected a number or a list of them"),
        (_set(0, "tokens", []), "r.jsonl:1: tokens: is empty"),
        (_no_ref_after_first, "r.jsonl:2: ref_logprobs: missing here but given on line 1"),
        (_no_ref, "ref_logprobs: the loss has a KL penalty (kl_coef=0.001, grpo's default)"),
        (_set(1, "step", -1), "r.jsonl:2: step: expected an integer >= 0, got -1"),
    ],
)
def test_bad_rollout_rows_are_one_line_naming_line_and_field(tmp_path, capsys, change, fragment):
    data = _jsonl(tmp_path / "r.jsonl", _bad_rows(change))
    assert main([*BASE, "--data", data]) == 2
    _one_error_line(capsys, fragment)


def _one_error_line(capsys, fragment):
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("harts-train: error: "), cap.err
    assert fragment in lines[0], (fragment, lines[0])
    assert "Traceback" not in cap.err and cap.out == ""


def test_malformed_json_names_the_line(tmp_path, capsys):
    rows = [json.dumps(r) for r in _rows(steps=1)]
    rows[2] = rows[2][:-5]
    (tmp_path / "r.jsonl").write_text("\n".join(rows) + "\n")
    assert main([*BASE, "--data", str(tmp_path / "r.jsonl")]) == 2
    _one_error_line(capsys, "r.jsonl:3: not valid JSON: ")
    (tmp_path / "s.jsonl").write_text(json.dumps(_rows(steps=1)[0]) + "\n[1, 2]\n")
    assert main([*BASE, "--data", str(tmp_path / "s.jsonl")]) == 2
    _one_error_line(capsys, "s.jsonl:2: expected a JSON object (one trajectory per line), got list")


def test_bad_parquet_columns_name_the_row_and_field(tmp_path, capsys):
    rows = _rows(steps=1, per_token=False)
    rows[2]["advantages"] = [float("inf")] * (len(rows[2]["tokens"]) - 1)
    assert main([*BASE, "--data", _parquet(tmp_path / "r.parquet", rows)]) == 2
    _one_error_line(capsys, "r.parquet: row 2: advantages[0]: must be finite, got inf")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"tokens": [[1, 2, 3]]}), str(tmp_path / "s.parquet"))
    assert main([*BASE, "--data", str(tmp_path / "s.parquet")]) == 2
    _one_error_line(capsys, "s.parquet: advantages: missing column (columns: tokens)")
    (tmp_path / "t.parquet").write_text("not parquet")
    assert main([*BASE, "--data", str(tmp_path / "t.parquet")]) == 2
    _one_error_line(capsys, "t.parquet: not a readable Parquet file")


@pytest.mark.parametrize(
    "config,fragment",
    [
        ("stepz = 3\n", "run.toml: stepz: unknown key; did you mean 'steps'?"),
        ("lr = -1\n", "run.toml: lr: must be a positive finite number, got -1.0"),
        ('lr_schedule = "exp"\n', "run.toml: lr_schedule: invalid choice 'exp'"),
        ("recompute = 1\n", "run.toml: recompute: expected true or false, got 1"),
        ("steps = [1]\n", "run.toml: steps: expected a single value, got list"),
        ("steps = \n", "run.toml: not valid TOML"),
        ('keep = ["attention"]\n', "run.toml: keep: needs --recompute (it names what recomputation keeps)"),
    ],
)
def test_bad_config_files_are_one_line(tmp_path, capsys, config, fragment):
    (tmp_path / "run.toml").write_text(config)
    assert main([*BASE, "--config", str(tmp_path / "run.toml")]) == 2
    _one_error_line(capsys, fragment)


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--data", "nowhere.jsonl"], "data: 'nowhere.jsonl': no such file"),
        (["--data", "r.csv"], "unknown rollout file type '.csv'"),
        (["--tp", "2"], "--tp 2: needs several processes: run under torchrun"),
        (["--cp", "2"], "--cp 2: needs several processes: run under torchrun"),
        (["--sp"], "--sp: needs --tp > 1"),
        (
            ["--data", "r.jsonl", "--capacity", "8"],
            "--capacity: T = 8 rows per microbatch is below the longest",
        ),
        (
            ["--data", "r.jsonl", "--capacity", "64", "--microbatch-cost", "65"],
            "--microbatch-cost: must be an integer in [0, 64], got 65",
        ),
        (["--microbatch-cost", "-1"], "--microbatch-cost: must be an integer in [0, 4096], got -1"),
        (["--resume", "nowhere"], "--resume: 'nowhere': no such folder"),
        (["--keep", "attention"], "--keep: needs --recompute (it names what recomputation keeps)"),
        (["--recompute", "--keep", "attention,bogus"], "--keep: unknown regions ['bogus']"),
        (["--mode", "both", "--keep", "attention"], "--keep: needs --recompute"),
        (["--lr", "0"], "--lr: must be a positive finite number, got 0.0"),
        (["--min-lr-ratio", "2"], "--min-lr-ratio: must be a finite number in [0.0, 1.0], got 2.0"),
        (["--max-grad-norm", "-1"], "--max-grad-norm: must be a positive finite number, got -1.0"),
        (["--mode", "both", "--data", "r.jsonl"], "--data: --mode both compares two model copies"),
        (["--config", "run.ini"], "--config: 'run.ini': no such file"),
        (["--steps", "x"], "argument --steps: expected an integer, got 'x'"),
        (["--lr-schedule", "exp"], "argument --lr-schedule: invalid choice: 'exp'"),
        (["--nope"], "unrecognized arguments: --nope"),
    ],
)
def test_bad_flags_are_one_line(tmp_path, monkeypatch, capsys, argv, fragment):
    monkeypatch.chdir(tmp_path)
    _jsonl(tmp_path / "r.jsonl", _rows(steps=1))
    assert main([*BASE, *argv]) == 2
    _one_error_line(capsys, fragment)


def test_tensorboard_asked_for_but_not_installed(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else real(n, *a)
    )
    data = _jsonl(tmp_path / "r.jsonl", _rows(steps=1))
    assert main([*BASE, "--data", data, "--tensorboard", str(tmp_path / "tb")]) == 2
    _one_error_line(capsys, "--tensorboard: tensorboard is not installed: pip install 'harts[train]'")


def test_traceback_on_request(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HARTS_TRACEBACK", "1")
    assert main([*BASE, "--data", str(tmp_path / "nowhere.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("harts-train: error: --data:")


def test_a_flavor_too_big_for_the_device_is_refused_before_it_is_built(monkeypatch, capsys):
    """``--flavor ling-tiny`` on a CPU was OOM-killed with no word: its weights, gradients and AdamW
    state are estimated first (on the meta device) and refused in one line naming the flag."""
    import harts_runtime.hf as hf

    monkeypatch.setattr(hf, "available_bytes", lambda device: (1 << 20, "the host (MemAvailable)"))
    assert main(["--flavor", "ling-tiny", "--steps", "1", "--preset", "tiny"]) == 2
    _one_error_line(capsys, "flavor: ling-tiny with 24 layers needs about")


def test_a_preset_with_more_trees_than_tokens_is_capped():
    """swe-like draws up to 1,000 trees, each starting with its own token: on the 512-token debug
    vocabulary the synthetic step caps the trees at the vocabulary (it failed with 'trees: must be in
    [1, 512]')."""
    from harts_runtime.demo import synthetic_step

    step = synthetic_step("swe-like", 0, 512, max_len=64)
    first = {int(step.batch.tokens[o]) for o in step.batch.offsets[:-1]}
    assert 0 < len(first) <= 512 and step.batch.num_trajectories >= len(first)
