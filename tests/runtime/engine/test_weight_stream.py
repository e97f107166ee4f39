"""The rollout engine's weight contract (:mod:`harts_runtime.engine.weights`): the manifest describes
the stream (names, dtypes, full shapes, layer groups contiguous); the bucketed stream equals the
full state dict in both spellings (the adapter's ``to_hf`` / ``to_checkpoint``), buckets stay under
``bucket_bytes`` and the stream's held bytes stay bounded by the bucket plus one tensor's gathered
parameters; re-iterable; in one process and under 2-process FSDP (gloo), where every rank gets the
one-process tensors and the manifest names both ranks."""

from types import SimpleNamespace

import pytest
import torch

from harts_runtime.parallel import ParallelDims, run_distributed

pytestmark = pytest.mark.usefixtures("one_thread")


def _model():
    from harts_runtime import HybridModel, model_config

    cfg = model_config("qwen3.5-35b-a3b", 2).replace(
        vocab_size=128,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        gated_attention={"head_dim": 8},
        gdn={"num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 8, "head_v_dim": 8},
        moe={"num_experts": 4, "top_k": 2, "intermediate_size": 16, "shared_intermediate_size": 16},
        dtype="float32",
        chunk_size=8,
    )
    torch.manual_seed(0)
    return HybridModel(cfg)


def _reference(model, names):
    from harts_runtime.hf.save import save_setup

    _, adapter = save_setup(model)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    return adapter.to_hf(sd) if names == "transformers" else adapter.to_checkpoint(sd)


def _stream(model, names, bucket_bytes):
    from harts_runtime.engine.weights import weights

    stream = weights(model, names, bucket_bytes)
    buckets = [[(n, t.detach().clone()) for n, t in b] for b in stream]
    return stream, buckets


def _check(stream, buckets, ref, bucket_bytes):
    man = stream.manifest
    flat = [(n, t) for b in buckets for n, t in b]
    assert [n for n, _ in flat] == [e.name for e in man]  # manifest order
    assert sorted(ref) == sorted(e.name for e in man)  # every tensor, once
    for (n, t), e in zip(flat, man):
        assert (tuple(t.shape), t.dtype) == (e.shape, e.dtype), n
        torch.testing.assert_close(t, ref[n], rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= bucket_bytes or len(b) == 1
    layers = [e.layer for e in man]
    seen = []
    for g in layers:  # each layer group contiguous
        if not seen or seen[-1] != g:
            assert g not in seen, f"layer {g} split"
            seen.append(g)
    assert {g for g in layers if g is not None} == {0, 1}
    largest = max(e.nbytes for e in man)
    assert stream.peak_bytes <= max(bucket_bytes, largest) + 3 * largest  # the bucket + a tensor's pieces


@pytest.mark.parametrize("names", ["transformers", "checkpoint"])
def test_stream_equals_the_state_dict_in_one_process(names):
    model = _model()
    ref = _reference(model, names)
    for bucket_bytes in (1, 4096, 1 << 30):
        stream, buckets = _stream(model, names, bucket_bytes)
        _check(stream, buckets, ref, bucket_bytes)
        assert len(buckets) == (len(ref) if bucket_bytes == 1 else len(buckets))
        assert all(e.ranks == (0,) for e in stream.manifest)
        largest = max(e.nbytes for e in stream.manifest)
        assert stream.peak_bytes <= max(bucket_bytes, largest)  # nothing gathered in one process
    assert len(buckets) == 1  # everything fits one bucket of 1 GiB
    again = [n for b in stream for n, _ in b]  # re-iterable
    assert again == [e.name for e in stream.manifest]


def test_bad_arguments_are_refused_naming_them():
    from harts_runtime import InvalidInputError
    from harts_runtime.engine.weights import weight_manifest, weights

    model = _model()
    with pytest.raises(InvalidInputError, match="^names: choose one of"):
        weight_manifest(model, "vlm")
    for bad in (0, -5, 1.5, True):
        with pytest.raises(InvalidInputError, match="^bucket_bytes: must be a positive integer"):
            weights(model, "transformers", bad)


def _worker(rank, world, names, bucket_bytes):
    from harts_runtime.parallel import parallelize

    model = _model()
    mesh = ParallelDims(world_size=world, dp_shard=2).build_mesh()
    parallelize(model, mesh)
    stream, buckets = _stream(model, names, bucket_bytes)
    return {"manifest": stream.manifest, "buckets": buckets, "peak": stream.peak_bytes}


@pytest.mark.slow
@pytest.mark.parametrize("names", ["transformers", "checkpoint"])
def test_stream_under_fsdp_equals_one_process(names):
    bucket_bytes = 8192
    results = run_distributed(_worker, 2, names, bucket_bytes, timeout=240)
    ref = _reference(_model(), names)
    for r in results:
        _check(SimpleNamespace(manifest=r["manifest"], peak_bytes=r["peak"]), r["buckets"], ref, bucket_bytes)
        assert any(e.ranks == (0, 1) for e in r["manifest"])  # sharded parameters on both ranks
        assert r["peak"] > 0
