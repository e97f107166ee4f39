"""Checkpoints of parallelized models (``harts_runtime.parallel.checkpoint``, ``harts_runtime.hf``),
2-process gloo runs (4 for one case) against one process:

* DCP training checkpoints: saved under ``dp_shard=2`` after one AdamW step, loaded into
  ``tp=2`` + sequence parallelism and into a plain single-process model: weights, buffers and
  AdamW's state equal exactly, ``extra`` comes back, and the next two steps' losses equal those of
  the run that went on in the original configuration; saved by one process, loaded into
  ``dp_shard=2 x tp=2 x ep=2`` on 4 processes; clear errors for a missing folder, another model
  config and a missing optimizer state.
* Hugging Face folders, for Qwen3.5-MoE (split Gated DeltaNet, gated attention, per-expert
  tensors; also the fused in-memory spelling) and Kimi-Linear (KDA, MLA, ``A_log``, the split
  convolution) checkpoints written by transformers: ``load_pretrained(path, mesh=...)`` under
  ``tp=2`` + SP, ``dp_shard=2 x ep=2`` and (4 processes) ``dp_shard=2 x tp=2 x ep=2`` equals the
  single-process load (gathered), with the same loss; every rank reads exactly its shards'
  elements through ``get_slice`` (each once, nothing else, no other EP rank's expert tensors);
  ``save_pretrained`` of the sharded model with a small ``max_shard_bytes`` writes the same files,
  index and config as the single-process save, and transformers loads the folder; a broken
  folder raises the same named error on every rank.
* The adapters' pieces (single process): assembling every HF tensor from ours equals
  ``to_checkpoint`` / ``to_hf``, and reading any box of ours back from the pieces is exact.
"""

import contextlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from harts_runtime.parallel import ParallelDims
from harts_runtime.parallel.launch import run_distributed

pytest.importorskip("safetensors")
hp = pytest.importorskip("harts_planner")
needs_transformers = pytest.mark.skipif(  # not imported here: the spawned ranks never need it
    importlib.util.find_spec("transformers") is None, reason="needs transformers"
)

RUNTIME_TESTS = str(Path(__file__).resolve().parents[1] / "runtime" / "models")
CAPACITY = 30
LR = 1e-2


def _runtime_tests():
    """The tiny transformers checkpoint builders of tests/runtime/models (imported in the parent only:
    spawned ranks never import transformers)."""
    if RUNTIME_TESTS not in sys.path:
        sys.path.insert(0, RUNTIME_TESTS)
    import test_kimi_linear
    import test_qwen3_next

    return test_kimi_linear, test_qwen3_next


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()  # a copy: Replicate aliases


def _gather(model, optimizer=None):
    """Full weights and buffers (and AdamW state by parameter name), gathered in a fixed order."""
    out = {"model": {k: _full(v) for k, v in model.state_dict().items()}}
    if optimizer is not None:
        names = {p: n for n, p in model.named_parameters()}
        out["optim"] = {
            f"{names[p]}.{k}": _full(v) for p, st in optimizer.state.items() for k, v in sorted(st.items())
        }
    return out


def _step_inputs(vocab, dp, chunk_size, seed=3):
    from harts_runtime import StepInputs
    from harts_runtime.testing import random_batch

    batch = random_batch(seed, num=12, vocab=vocab, max_new=10)
    step = StepInputs.synthetic(batch, seed=1, vocab_size=vocab)
    return step, hp.plan_step(batch, dp, CAPACITY, chunk_size)


def _parallel_step(model, optimizer, mesh, step, plan) -> float:
    """One training step of a parallelized model (``optimizer`` None: forward and backward only)."""
    from harts_runtime import run_microbatch
    from harts_runtime.engine import microbatch_call_plan
    from harts_runtime.parallel import run_replica_step, sync_expert_load

    model.train()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    res = run_replica_step(
        plan,
        mesh,
        lambda s, t: run_microbatch(
            model, step, t, "compact", call_plan=microbatch_call_plan(model, step, t)
        )[0],
    )
    if optimizer is not None:
        optimizer.step()
        sync_expert_load(model, mesh)
        model.update_expert_bias()
    return res.loss


# ------------------------------------------------------------------------------ DCP
def _debug_model(seed):
    from harts_runtime import HybridModel, model_config

    cfg = model_config("debug", moe={"use_expert_bias": True}, dtype="float32")
    torch.manual_seed(seed)
    return HybridModel(cfg)


def _dcp_worker(rank, world, path):
    from harts_runtime.parallel import load_checkpoint, parallelize, save_checkpoint

    out = {}
    # original configuration: FSDP over both ranks; one step, save, two more steps
    mesh = ParallelDims(dp_shard=2, world_size=world).build_mesh()
    model = parallelize(_debug_model(0), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    step, plan = _step_inputs(model.config.vocab_size, 2, model.config.chunk_size)
    _parallel_step(model, opt, mesh, step, plan)
    save_checkpoint(path, model, opt, extra={"step": 1, "note": "dp_shard=2"})
    out["saved"] = _gather(model, opt)
    out["losses"] = [_parallel_step(model, opt, mesh, step, plan) for _ in range(2)]
    # another configuration on the same ranks: TP + SP, other initial weights and learning rate
    mesh = ParallelDims(tp=2, sequence_parallel=True, world_size=world).build_mesh()
    model = parallelize(_debug_model(1), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR / 10)
    out["extra"] = load_checkpoint(path, model, opt)
    out["loaded"] = _gather(model, opt)
    _, plan = _step_inputs(model.config.vocab_size, 1, model.config.chunk_size)
    out["loaded_losses"] = [_parallel_step(model, opt, mesh, step, plan) for _ in range(2)]
    return out


def _assert_same(got: dict, want: dict, what: str):
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want))[:5])
    for k, v in want.items():
        assert torch.equal(got[k], v), (what, k)


@pytest.mark.slow
def test_dcp_round_trip_across_configurations(tmp_path):
    from harts_runtime import train_step
    from harts_runtime.parallel import load_checkpoint

    path = tmp_path / "ckpt"
    r0, r1 = run_distributed(_dcp_worker, 2, str(path), timeout=240)
    saved = r0["saved"]
    assert any(v.abs().sum() > 0 for k, v in saved["optim"].items() if k.endswith("exp_avg"))
    for r in (r0, r1):
        assert r["extra"] == {"step": 1, "note": "dp_shard=2"}
        _assert_same(r["loaded"]["model"], saved["model"], "tp=2 weights")
        _assert_same(r["loaded"]["optim"], saved["optim"], "tp=2 AdamW state")
        np.testing.assert_allclose(r["loaded_losses"], r0["losses"], rtol=1e-5)
    # a plain model in one process (no process group)
    model = _debug_model(2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR / 10)
    assert load_checkpoint(path, model, opt) == {"step": 1, "note": "dp_shard=2"}
    got = _gather(model, opt)
    _assert_same(got["model"], saved["model"], "single-process weights")
    _assert_same(got["optim"], saved["optim"], "single-process AdamW state")
    assert opt.param_groups[0]["lr"] == LR
    step, plan = _step_inputs(model.config.vocab_size, 1, model.config.chunk_size)
    losses = [train_step(model, opt, step, step_plan=plan).loss for _ in range(2)]
    np.testing.assert_allclose(losses, r0["losses"], rtol=1e-5)


def test_checkpoint_errors_name_the_field(tmp_path):
    from harts_runtime import HybridModel, InvalidInputError, model_config
    from harts_runtime.parallel import load_checkpoint, save_checkpoint

    cfg = model_config("debug", num_layers=2, dtype="float32")
    model = HybridModel(cfg)
    with pytest.raises(InvalidInputError) as e:
        load_checkpoint(tmp_path / "nowhere", model)
    assert e.value.field == "path" and "does not exist" in str(e.value)
    with pytest.raises(InvalidInputError) as e:
        save_checkpoint(tmp_path / "bad", model, extra={"x": object()})
    assert e.value.field == "extra"
    save_checkpoint(tmp_path / "ck", model, extra={"step": 7})
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(InvalidInputError) as e:
        load_checkpoint(tmp_path / "ck", model, opt)
    assert e.value.field == "optimizer"
    with pytest.raises(InvalidInputError) as e:  # another width: the first tensor is named
        load_checkpoint(tmp_path / "ck", HybridModel(cfg.replace(hidden_size=48)))
    assert e.value.field == "embed.weight" and "shape" in str(e.value)
    with pytest.raises(InvalidInputError) as e:  # more layers than saved
        load_checkpoint(tmp_path / "ck", HybridModel(model_config("debug", num_layers=3, dtype="float32")))
    assert e.value.field.startswith("blocks.2.") and "missing" in str(e.value)
    with pytest.raises(InvalidInputError) as e:  # fewer
        load_checkpoint(tmp_path / "ck", HybridModel(model_config("debug", num_layers=1, dtype="float32")))
    assert e.value.field.startswith("blocks.1.") and "not a tensor of this model" in str(e.value)
    assert load_checkpoint(tmp_path / "ck", HybridModel(cfg)) == {"step": 7}


# ------------------------------------------------------------------------------ HF folders
@contextlib.contextmanager
def _recorded_reads():
    """Route ``safetensors.safe_open`` through a wrapper; yields the list of ``(name, elements)``
    of every tensor read (``get_slice(name)[...]``, or ``get_tensor``: elements None)."""
    import safetensors

    real, reads = safetensors.safe_open, []

    class Slice:
        def __init__(self, s, name):
            self._s, self._name = s, name

        def get_shape(self):
            return self._s.get_shape()

        def get_dtype(self):
            return self._s.get_dtype()

        def __getitem__(self, index):
            t = self._s[index]
            reads.append((self._name, t.numel()))
            return t

    class Handle:
        def __init__(self, *args, **kwargs):
            self._h = real(*args, **kwargs)

        def __enter__(self):
            self._h.__enter__()
            return self

        def __exit__(self, *exc):
            return self._h.__exit__(*exc)

        def keys(self):
            return self._h.keys()

        def get_slice(self, name):
            return Slice(self._h.get_slice(name), name)

        def get_tensor(self, name):
            reads.append((name, None))
            return self._h.get_tensor(name)

    safetensors.safe_open = Handle
    try:
        yield reads
    finally:
        safetensors.safe_open = real


def _local_elements(model, folder) -> int:
    """Elements of this rank's shards of every tensor the folder holds (all but the adapter's
    ``extra_ours``: expert-load counts, zero biases)."""
    from harts_runtime.hf.folder import open_folder
    from harts_runtime.parallel.checkpoint import local_box

    extra = open_folder(folder, None, {})[-1].extra_ours()
    return sum(local_box(t)[0].numel() for k, t in model.state_dict().items() if k not in extra)


def _hf_worker(rank, world, cases, out_dir, loss=True, dcp=None):
    """For each (name, folder, dims): the sharded load with its reads recorded, the gathered
    weights, the step loss (``loss``), the sharded save; the error of a broken folder's sharded
    load (when ``out_dir`` has one); with ``dcp`` the debug model and AdamW of that training
    checkpoint loaded under the last case's configuration, gathered."""
    from harts_runtime import InvalidInputError, load_pretrained, save_pretrained
    from harts_runtime.parallel import load_checkpoint, parallelize

    out = {}
    for name, folder, dims_kw in cases:
        mesh = ParallelDims(world_size=world, **dims_kw).build_mesh()
        with _recorded_reads() as reads:
            model = load_pretrained(folder, mesh=mesh, chunk_size=16)
        save_pretrained(model, Path(out_dir) / name, max_shard_bytes=MAX_SHARD_BYTES)
        if loss:
            step, plan = _step_inputs(model.config.vocab_size, mesh.dims.dp, 16)
        out[name] = {
            "reads": reads,
            "local_elements": _local_elements(model, folder),
            "coords": mesh.coords,
            "state": _gather(model)["model"],
            "loss": _parallel_step(model, None, mesh, step, plan) if loss else None,
        }
    if (Path(out_dir) / "broken").is_dir():
        try:
            load_pretrained(Path(out_dir) / "broken", mesh=mesh)
        except InvalidInputError as e:
            out["error"] = e.field
    if dcp is not None:
        model = parallelize(_debug_model(1), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=LR / 10)
        out["dcp_extra"] = load_checkpoint(dcp, model, opt)
        out["dcp"] = _gather(model, opt)
    return out


MAX_SHARD_BYTES = 40_000


def _hf_folders(tmp_path):
    """Tiny random checkpoints written by transformers: {family: folder}; ``qwen_memory`` holds
    the Qwen weights in the in-memory spelling (fused ``gate_up_proj`` / ``down_proj`` of all
    experts, as ``state_dict()`` has them)."""
    from safetensors.torch import save_file

    kimi, qwen = _runtime_tests()
    folders = {k: tmp_path / k for k in ("qwen", "kimi", "qwen_memory")}
    hf = qwen.random_hf_model("qwen3_5_moe_text")
    hf.save_pretrained(folders["qwen"])
    folders["qwen_memory"].mkdir()
    (folders["qwen_memory"] / "config.json").write_text((folders["qwen"] / "config.json").read_text())
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(sd, str(folders["qwen_memory"] / "model.safetensors"))
    kimi.random_hf_model().save_pretrained(folders["kimi"])
    return folders


def _safetensors(folder: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(folder / f)))
    return index, tensors


def _check_hf_case(results, folder, dims_kw, name, out_dir):
    """A case of :func:`_hf_worker` against the single-process load and save of ``folder``."""
    from harts_runtime import load_pretrained, save_pretrained, train_step

    ref = load_pretrained(folder, chunk_size=16)
    dims = ParallelDims(world_size=len(results), **dims_kw)
    ref_state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    if results[0][name]["loss"] is not None:
        step, plan = _step_inputs(ref.config.vocab_size, dims.dp, 16)
        ref_loss = train_step(ref, None, step, step_plan=plan).loss
    single = out_dir / f"{name}-single"
    save_pretrained(ref, single, max_shard_bytes=MAX_SHARD_BYTES)
    want_index, want = _safetensors(single)
    assert len(set(want_index["weight_map"].values())) > 2  # several files and an index
    got_index, got = _safetensors(out_dir / name)
    assert got_index == want_index
    _assert_same(got, want, f"{name}: save_pretrained")
    assert (out_dir / name / "config.json").read_text() == (single / "config.json").read_text()
    experts = ref.config.moe.num_experts
    for r in results:
        res = r[name]
        _assert_same(res["state"], ref_state, f"{name}: load_pretrained")
        if res["loss"] is not None:
            assert res["loss"] == pytest.approx(ref_loss, rel=1e-5)
        # each rank read exactly its shards' elements, each once, all through get_slice
        assert all(n is not None for _, n in res["reads"]), name
        assert sum(n for _, n in res["reads"]) == res["local_elements"], name
        if dims.ep > 1:  # and no other EP rank's experts' tensors
            per = experts // dims.ep
            mine = set(range(res["coords"]["ep"] * per, (res["coords"]["ep"] + 1) * per))
            opened = {int(m[1]) for k, _ in res["reads"] if (m := re.search(r"\.experts\.(\d+)\.", k))}
            assert opened == (mine if "memory" not in name else set()), (name, opened, mine)


HF_CASES = (
    ("tp", {"tp": 2, "sequence_parallel": True}),
    ("ep", {"dp_shard": 2, "ep": 2}),
)


@pytest.mark.slow
@needs_transformers
def test_hf_folders_load_and_save_sharded(tmp_path):
    """Both families, both configurations, in one 2-process run."""
    folders = _hf_folders(tmp_path)
    out_dir = tmp_path / "out"
    broken = out_dir / "broken"
    broken.mkdir(parents=True)
    _broken_copy(folders["qwen"], broken)
    cases = [(f"{fam}-{cfg}", str(folders[fam]), kw) for fam in ("qwen", "kimi") for cfg, kw in HF_CASES]
    cases.append(("qwen_memory-ep", str(folders["qwen_memory"]), dict(HF_CASES)["ep"]))
    results = run_distributed(_hf_worker, 2, cases, str(out_dir), timeout=240)
    assert results[0]["error"] == results[1]["error"] == MISSING
    for name, folder, kw in cases:
        _check_hf_case(results, Path(folder), kw, name, out_dir)
    import transformers

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out_dir / "qwen-ep", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


MISSING = "model.layers.2.mlp.experts.3.down_proj.weight"


def _broken_copy(src: Path, dst: Path) -> None:
    """``src`` without one expert tensor."""
    from safetensors.torch import load_file, save_file

    (dst / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if k != MISSING}, str(dst / "model.safetensors"))


# ------------------------------------------------------------------------------ adapter pieces
@needs_transformers
def test_adapter_pieces_tile_every_hf_tensor():
    from harts_runtime import HybridModel
    from harts_runtime.models import kimi_linear, qwen3_5_moe, qwen3_next

    kimi, qwen = _runtime_tests()
    cases = [(kimi_linear, kimi.hf_config(), kimi_linear.KimiLinearStateDictAdapter)]
    for fam, mod in (("qwen3_next", qwen3_next), ("qwen3_5_moe_text", qwen3_5_moe)):
        cases.append((mod, qwen.hf_config(fam), lambda cfg, fam=fam: qwen._adapter(cfg, fam)))
    for mod, hf_cfg, make in cases:
        cfg = mod.from_hf_config(hf_cfg)
        torch.manual_seed(0)
        sd = {k: v.detach() for k, v in HybridModel(cfg).state_dict().items()}
        for k, v in sd.items():
            if k.endswith(("g_proj.1.bias", "expert_bias")):
                v.zero_()
        adapter = make(cfg)
        extra = adapter.extra_ours()
        for spelling in (adapter.to_checkpoint(sd), adapter.to_hf(sd)):
            back = {k: torch.full_like(v, float("nan")) for k, v in sd.items() if k not in extra}
            for name, tensor in spelling.items():
                assert torch.equal(adapter.assemble(name, sd.__getitem__), tensor), name
                for p in adapter.pieces(name):  # read back in two boxes split on the first free dim
                    t = back[p.ours] if p.slot is None else back[p.ours][p.slot]
                    h = t.shape[0] // 2
                    for lo, hi in ((0, h), (h, t.shape[0])):
                        box = ((lo, hi), *((0, s) for s in t.shape[1:]))
                        t[lo:hi] = p.to_ours(tensor[p.hf_index(box)])
            _assert_same(back, {k: v for k, v in sd.items() if k not in extra}, type(adapter).__name__)


@pytest.mark.slow
@needs_transformers
def test_four_ranks_fsdp_tp_ep(tmp_path):
    """``dp_shard=2 x tp=2 (+ SP) x ep=2`` on 4 processes (FSDP's ``_StridedShard`` over TP's
    shards, experts over EP): Qwen3.5-MoE loads and saves as in one process (no training step:
    four processes on a small machine), and a training checkpoint saved by one process (no
    process group) after an AdamW step loads exactly."""
    from harts_runtime import train_step
    from harts_runtime.parallel import save_checkpoint

    model = _debug_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    step, plan = _step_inputs(model.config.vocab_size, 1, model.config.chunk_size)
    train_step(model, opt, step, step_plan=plan)
    save_checkpoint(tmp_path / "dcp", model, opt, extra={"step": 1})
    saved = _gather(model, opt)
    folder = tmp_path / "qwen"
    _runtime_tests()[1].random_hf_model("qwen3_5_moe_text").save_pretrained(folder)
    out_dir = tmp_path / "out"
    kw = {"dp_shard": 2, "tp": 2, "ep": 2, "sequence_parallel": True}
    case = [("qwen-4", str(folder), kw)]
    results = run_distributed(_hf_worker, 4, case, str(out_dir), False, str(tmp_path / "dcp"), timeout=240)
    _check_hf_case(results, folder, kw, "qwen-4", out_dir)
    for r in results:
        assert r["dcp_extra"] == {"step": 1}
        _assert_same(r["dcp"]["model"], saved["model"], "4 ranks: weights")
        _assert_same(r["dcp"]["optim"], saved["optim"], "4 ranks: AdamW state")


@needs_transformers
def test_save_pretrained_shards_and_replaces_a_previous_save(tmp_path):
    """One process: small ``max_shard_bytes`` gives several files and an index, a later save into
    the same folder replaces them (transformers would prefer a stale ``model.safetensors``), both
    load back to the same weights; a bad ``max_shard_bytes`` is named."""
    from harts_runtime import HybridModel, InvalidInputError, load_pretrained, save_pretrained
    from harts_runtime.models import qwen3_5_moe

    cfg = qwen3_5_moe.from_hf_config(_runtime_tests()[1].hf_config("qwen3_5_moe_text"), chunk_size=16)
    torch.manual_seed(0)
    model = HybridModel(cfg)
    path = tmp_path / "out"
    save_pretrained(model, path)
    assert sorted(f.name for f in path.iterdir()) == ["config.json", "model.safetensors"]
    save_pretrained(model, path, max_shard_bytes=MAX_SHARD_BYTES)
    index, tensors = _safetensors(path)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and sorted(f.name for f in path.iterdir()) == sorted(
        ["config.json", "model.safetensors.index.json", *files]
    )
    sizes = [(path / f).stat().st_size for f in files]
    biggest = max(t.numel() * t.element_size() for t in tensors.values())
    assert max(sizes) <= max(MAX_SHARD_BYTES, biggest) + 20_000  # + the safetensors header
    want = model.state_dict()
    for k, v in load_pretrained(path, chunk_size=16).state_dict().items():
        assert torch.equal(v, want[k]), k
    save_pretrained(model, path)
    assert sorted(f.name for f in path.iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(InvalidInputError) as e:
        save_pretrained(model, path, max_shard_bytes=0)
    assert e.value.field == "max_shard_bytes"
