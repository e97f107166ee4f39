"""``harts_runtime.hf`` only reads: it never imports ``harts_runtime.parallel`` (a whole load runs
without it), refuses ``mesh`` / ``parallelize`` naming them, and its slice reader fills whatever
block a per-tensor ``local_box`` callback names (here blocks of plain tensors, checked against the
one-process load; the DTensor case is ``harts_runtime.load_pretrained(path, mesh=...)``'s, tested
in ``tests/parallel``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest
import torch

from harts_runtime import HybridModel, InvalidInputError, model_config
from harts_runtime.hf import load_pretrained, open_sliced, save_pretrained
from harts_runtime.hf.sharded import whole_box

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(importlib.util.find_spec("safetensors") is None, reason="needs the hf extra"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi")
    torch.manual_seed(0)
    save_pretrained(HybridModel(model_config("kimi-linear-tiny", 2)), path)
    return path


def test_a_whole_load_imports_no_parallel(folder):
    code = textwrap.dedent(f"""
        import sys
        from harts_runtime.hf import load_pretrained, open_sliced
        model = load_pretrained({str(folder)!r})
        with open_sliced({str(folder)!r}) as ckpt:
            pass
        loaded = sorted(m for m in sys.modules if m.startswith("harts_runtime.parallel"))
        assert not loaded, loaded
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("name", ["mesh", "parallelize"])
def test_hf_refuses_to_parallelize(folder, name):
    with pytest.raises(InvalidInputError) as e:
        load_pretrained(folder, **{name: object()})
    assert e.value.field == name and "harts_runtime.load_pretrained(path, mesh=" in str(e.value)


def _allocated(cfg, fill=float("nan")):
    model = HybridModel(cfg, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            t.fill_(fill) if t.is_floating_point() else t.zero_()
    return model


def test_the_slice_reader_with_whole_boxes_equals_the_load(folder):
    want = load_pretrained(folder).state_dict()
    with open_sliced(folder) as ckpt:
        got = ckpt.read_into(_allocated(ckpt.config), whole_box)
        assert got.hf_config == load_pretrained(folder).hf_config
    sd = got.state_dict()
    assert sd.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(sd[k], want[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("part", [0, 1, 2])
def test_the_slice_reader_fills_exactly_the_block_the_callback_names(folder, part):
    """A callback naming one third of every tensor's first dimension (the rest left NaN): the block
    equals the whole load's rows and nothing else is written."""
    want = load_pretrained(folder).state_dict()
    blocks = {}

    def third(t):
        if t.dim() == 0:
            return whole_box(t)
        n = t.shape[0]
        a, b = part * n // 3, (part + 1) * n // 3
        blocks[id(t)] = (a, b)
        return t[a:b], ((a, b),) + tuple((0, s) for s in t.shape[1:])

    with open_sliced(folder) as ckpt:
        model = ckpt.read_into(_allocated(ckpt.config), third)
    for k, t in model.state_dict(keep_vars=True).items():
        if not t.is_floating_point() or t.dim() == 0:
            continue
        a, b = blocks[id(t)]
        torch.testing.assert_close(t[a:b], want[k][a:b], rtol=0, atol=0, msg=k)
        rest = torch.cat([t[:a], t[b:]])
        assert rest.isnan().all(), k  # never written
