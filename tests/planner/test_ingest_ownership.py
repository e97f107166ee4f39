"""What a batch holds: writing to the caller's arrays after ingestion cannot change it.

`RolloutBatch.from_arrays` keeps read-only copies of writable inputs (and immutable inputs as
they are); these tests refill the caller's buffers after ingestion and compare everything a
training step reads (tokens per compact row against a brute-force trie, the plan, the tree, a
saved file) with what was there before.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import forests
from trie_oracle import naive_ingest

import harts_planner as hp

token = st.integers(min_value=0, max_value=3)
batches = st.one_of(
    st.lists(st.lists(token, min_size=1, max_size=7), min_size=1, max_size=9),
    forests(max_num=9, vocab=4, max_new=5),
)


def _packed(trajs, slack=5, dtype=np.int32):
    """A reused caller buffer: the tokens packed at the front of a larger writable array (the
    batch gets a view of it), and the offsets."""
    lengths = [len(t) for t in trajs]
    buffer = np.full(sum(lengths) + slack, 7, dtype=dtype)
    buffer[: sum(lengths)] = np.concatenate([np.asarray(t) for t in trajs])
    offsets = np.zeros(len(trajs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return buffer, offsets


def _row_tokens(batch) -> np.ndarray:
    """The token of each compact row, as a compact forward reads it (the token at any semantic
    position of the row); -1 where two positions of one row disagree."""
    tokens, rows = batch.tokens, batch.compact_map
    out = np.full(batch.compact_tokens, -2, dtype=np.int64)
    out[rows] = tokens
    out[rows[out[rows] != tokens]] = -1
    return out


def _expected_row_tokens(trajs, batch) -> np.ndarray:
    """Row tokens from the brute-force trie: row of prefix ``t[:p+1]`` holds ``t[p]``."""
    assert batch.compact_tokens == naive_ingest(trajs).compact_tokens
    out = np.full(batch.compact_tokens, -2, dtype=np.int64)
    for i, t in enumerate(trajs):
        for p, x in enumerate(t):
            out[batch.compact_map[batch.offsets[i] + p]] = x
    return out


def _snapshot(batch) -> dict:
    plan = hp.Planner().plan_step(batch, dp_size=1, capacity=16)
    tree = batch.segment_tree()
    return {
        "tokens": batch.tokens.copy(),
        "offsets": batch.offsets.copy(),
        "tree_ids": batch.tree_ids.copy(),
        "trajectories": [batch.trajectory(i).copy() for i in range(batch.num_trajectories)],
        "row_tokens": _row_tokens(batch),
        "plan": [mb.tolist() for mb in plan.microbatches] + [plan.work.tolist()],
        "tree": [tree.parent.copy(), tree.length.copy(), tree.trajectory_end.copy()],
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, list) and x and isinstance(x[0], np.ndarray):
            assert len(x) == len(y) and all(np.array_equal(u, v) for u, v in zip(x, y)), key
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, y), key
        else:
            assert x == y, key


@settings(max_examples=150, deadline=None)
@given(batches, st.data())
def test_refilling_the_callers_buffers_leaves_the_batch_unchanged(trajs, data):
    buffer, offsets = _packed(trajs)
    tree_ids = np.arange(len(trajs), dtype=np.int64)
    batch = hp.RolloutBatch.from_arrays(buffer[: offsets[-1]], offsets, tree_ids)
    before = _snapshot(batch)
    assert np.array_equal(before["row_tokens"], _expected_row_tokens(trajs, batch))

    # a natural reuse: the next step's tokens and offsets written into the same buffers
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    buffer[:] = rng.integers(0, 4, size=buffer.size)
    offsets[1:] = np.sort(rng.integers(1, offsets[-1] + 1, size=len(offsets) - 1))
    tree_ids[:] = rng.integers(0, 3, size=tree_ids.size)

    _assert_same(_snapshot(batch), before)
    assert np.array_equal(_row_tokens(batch), _expected_row_tokens(trajs, batch))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16])
def test_batch_arrays_are_read_only_and_not_the_callers(dtype):
    trajs = [[1, 2, 3], [1, 2, 4], [5]]
    buffer, offsets = _packed(trajs, dtype=dtype)
    batch = hp.RolloutBatch.from_arrays(buffer[:7], offsets)
    assert not np.shares_memory(batch.tokens, buffer)
    assert not np.shares_memory(batch.offsets, offsets)
    for name in ("tokens", "offsets"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(batch, name)[0] = 9
    with pytest.raises(ValueError, match="read-only"):
        batch.trajectory(0)[0] = 9
    assert batch.tokens.tolist() == [1, 2, 3, 1, 2, 4, 5]


def test_immutable_inputs_are_kept_without_a_copy():
    data = np.array([1, 2, 3, 1, 2, 4], dtype="<i4").tobytes()
    tokens = np.frombuffer(data, dtype=np.int32)
    batch = hp.RolloutBatch.from_arrays(tokens, np.array([0, 3, 6]))
    assert np.shares_memory(batch.tokens, tokens)  # bytes cannot change: no copy needed
    assert batch.compact_tokens == 4

    # read-only views of something writable are copied: a bytearray, a writable base, a read-only
    # memoryview of a bytearray
    mutable = bytearray(data)
    base = np.array([1, 2, 3, 1, 2, 4], dtype=np.int32)
    view = base[:]
    view.flags.writeable = False
    for source in (
        np.frombuffer(mutable, dtype=np.int32),
        view,
        np.frombuffer(memoryview(mutable).toreadonly(), dtype=np.int32),
    ):
        batch = hp.RolloutBatch.from_arrays(source, np.array([0, 3, 6]))
        assert not np.shares_memory(batch.tokens, source)
        mutable[:] = bytes(len(mutable))
        base[:] = 0
        assert batch.tokens.tolist() == [1, 2, 3, 1, 2, 4]
        mutable[:] = data
        base[:] = [1, 2, 3, 1, 2, 4]


def test_packed_tokens_and_lists_ingest_like_from_arrays():
    trajs = [[3, 1], [3, 1, 2], [0]]
    buffer, offsets = _packed(trajs)
    via_ingest = hp.batch.ingest(hp.PackedTokens(buffer[:6], offsets))
    via_lists = hp.RolloutBatch.from_token_lists(trajs)
    buffer[:] = 0
    for b in (via_ingest, via_lists):
        assert b.tokens.tolist() == [3, 1, 3, 1, 2, 0]
        assert not b.tokens.flags.writeable


def test_no_memory_for_the_copy_is_a_resource_limit_naming_the_field():
    # in a child process whose address space is capped 64 MiB above what it has mapped: a 256 MiB
    # writable token array cannot be copied
    code = textwrap.dedent(
        """
        import json, resource
        import numpy as np
        import harts_planner as hp
        tokens = np.zeros(1 << 26, np.int32)
        offsets = np.array([0, 1 << 26])
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), vm + (64 << 20)))
        try:
            hp.RolloutBatch.from_arrays(tokens, offsets)
            print(json.dumps({"result": "ingested"}))
        except hp.ResourceLimitError as e:
            print(json.dumps({"result": "limit", "field": e.field, "message": str(e)}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    out = json.loads(proc.stdout)
    assert out["result"] == "limit" and out["field"] == "tokens", (out, proc.stderr)
    assert str(4 << 26) in out["message"]
