"""Tests for harts_planner.batch_io: exact round trips and one test per malformed-file class."""

from __future__ import annotations

import json
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_planner import synth
from harts_planner.batch_io import BatchFormatError, load_batch, save_batch

INT32_MAX = 2**31 - 1
INT64 = (-(2**63), 2**63 - 1)


def write_raw_hrb(
    path: Path,
    offsets: list[int],
    tokens: list[int],
    tree_ids: list[int] | None = None,
    *,
    magic: bytes = b"HARTSRB\0",
    version: int = 1,
    flags: int | None = None,
    n: int | None = None,
    s: int | None = None,
) -> bytes:
    """Write an ``.hrb`` file field by field, with a correct CRC32, bypassing every check."""
    if flags is None:
        flags = 0 if tree_ids is None else 1
    body = struct.pack(
        "<8sIIQQ",
        magic,
        version,
        flags,
        len(offsets) - 1 if n is None else n,
        len(tokens) if s is None else s,
    )
    body += np.asarray(offsets, dtype="<i8").tobytes() + np.asarray(tokens, dtype="<i4").tobytes()
    if tree_ids is not None:
        body += np.asarray(tree_ids, dtype="<i8").tobytes()
    data = body + struct.pack("<I", zlib.crc32(body))
    path.write_bytes(data)
    return data


def assert_same_batch(
    loaded: tuple, tokens: np.ndarray, offsets: np.ndarray, tree_ids: np.ndarray | None
) -> None:
    """Loaded arrays equal the originals with the documented dtypes."""
    got_tokens, got_offsets, got_tree_ids = loaded
    assert got_tokens.dtype == np.int32 and got_offsets.dtype == np.int64
    assert np.array_equal(got_tokens, tokens) and np.array_equal(got_offsets, offsets)
    if tree_ids is None:
        assert got_tree_ids is None
    else:
        assert got_tree_ids.dtype == np.int64 and np.array_equal(got_tree_ids, tree_ids)


@st.composite
def batches(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Random valid batches, including the empty one, with or without tree ids."""
    seqs = draw(st.lists(st.lists(st.integers(0, INT32_MAX), min_size=1, max_size=30), max_size=20))
    tokens = np.asarray([t for seq in seqs for t in seq], dtype=np.int32)
    offsets = np.concatenate(([0], np.cumsum([len(seq) for seq in seqs]))).astype(np.int64)
    tree_ids = draw(st.none() | st.lists(st.integers(*INT64), min_size=len(seqs), max_size=len(seqs)))
    return tokens, offsets, None if tree_ids is None else np.asarray(tree_ids, dtype=np.int64)


@pytest.mark.parametrize("suffix", [".hrb", ".jsonl"])
@settings(max_examples=60, deadline=None)
@given(batch=batches())
def test_round_trip_is_exact(suffix: str, batch: tuple) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"batch{suffix}"
        save_batch(path, *batch)
        tokens, offsets, tree_ids = batch
        if suffix == ".jsonl" and offsets.size == 1:
            tree_ids = None  # an empty JSONL file cannot record that tree ids were given
        assert_same_batch(load_batch(path), tokens, offsets, tree_ids)


@pytest.mark.parametrize("suffix", [".hrb", ".jsonl"])
def test_synthetic_batch_round_trips(tmp_path: Path, suffix: str) -> None:
    syn = synth.generate("small" if suffix == ".hrb" else "tiny", 3)
    path = tmp_path / f"syn{suffix}"
    save_batch(path, syn.tokens, syn.offsets, syn.tree_ids)
    assert_same_batch(load_batch(path), syn.tokens, syn.offsets, syn.tree_ids)


def test_hrb_layout_matches_the_documented_header(tmp_path: Path) -> None:
    path = tmp_path / "b.hrb"
    save_batch(path, np.array([5, 6, 7]), np.array([0, 2, 3]), np.array([9, 9]))
    expected = write_raw_hrb(tmp_path / "raw.hrb", [0, 2, 3], [5, 6, 7], [9, 9])
    assert path.read_bytes() == expected
    assert expected[:8] == b"HARTSRB\0" and len(expected) == 32 + 8 * 3 + 4 * 3 + 8 * 2 + 4


def test_explicit_format_overrides_the_extension(tmp_path: Path) -> None:
    path = tmp_path / "batch.bin"
    save_batch(path, [1, 2], [0, 1, 2], format="jsonl")
    assert json.loads(path.read_text().splitlines()[0]) == {"tokens": [1]}
    assert_same_batch(load_batch(path, format="jsonl"), np.array([1, 2]), np.array([0, 1, 2]), None)


@pytest.mark.parametrize(
    "call",
    [
        lambda p: save_batch(p / "batch.npz", [1], [0, 1]),
        lambda p: load_batch(p / "batch.txt"),
        lambda p: save_batch(p / "batch.hrb", [1], [0, 1], format="parquet"),
    ],
)
def test_unknown_format_is_rejected(tmp_path: Path, call) -> None:
    with pytest.raises(ValueError, match="format"):
        call(tmp_path)


@pytest.mark.parametrize(
    ("tokens", "offsets", "tree_ids", "field"),
    [
        ([1, 2], [0, 2, 1], None, "offsets: not non-decreasing"),
        ([1, 2], [1, 2], None, r"offsets: offsets\[0\] must be 0"),
        ([1, 2], [0, 1, 1, 2], None, "offsets: trajectory 1 is empty"),
        ([1, 2], [0, 1], None, r"offsets: offsets\[-1\] = 1 does not match S = 2"),
        ([1, -2], [0, 2], None, "tokens: token id -2"),
        ([1, 2**31], [0, 2], None, "tokens: token id 2147483648"),
        ([1.5], [0, 1], None, "tokens: expected a 1-D integer array"),
        ([1, 2], [0, 2], [1, 2], r"tree_ids: expected shape \(1,\)"),
        ([1], [], None, "offsets: expected a 1-D array of N \\+ 1 >= 1 entries"),
    ],
)
def test_save_rejects_invalid_batches(tmp_path: Path, tokens, offsets, tree_ids, field: str) -> None:
    with pytest.raises(BatchFormatError, match=field):
        save_batch(tmp_path / "bad.hrb", tokens, offsets, tree_ids)
    assert not (tmp_path / "bad.hrb").exists()


def good_hrb(path: Path) -> bytes:
    """A valid two-trajectory file with tree ids."""
    return write_raw_hrb(path, [0, 2, 5], [1, 2, 3, 4, 5], [7, 8])


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda p: write_raw_hrb(p, [0, 1], [1], magic=b"HARTSRX\0"), "magic: expected"),
        (lambda p: write_raw_hrb(p, [0, 1], [1], version=2), "version: unsupported format version 2"),
        (lambda p: write_raw_hrb(p, [0, 1], [1], flags=4), "flags: unknown flag bits 0x4"),
        (lambda p: p.write_bytes(good_hrb(p)[:20]), "header: file is truncated"),
        (lambda p: p.write_bytes(good_hrb(p)[:-9]), "file size: truncated"),
        (lambda p: p.write_bytes(good_hrb(p) + b"\0"), "file size: has trailing bytes"),
        (lambda p: write_raw_hrb(p, [0, 1], [1], n=2), "file size: truncated"),
        (lambda p: p.write_bytes(flip_byte(good_hrb(p), 32 + 8 * 3 + 1)), "crc32: checksum mismatch"),
        (lambda p: p.write_bytes(flip_byte(good_hrb(p), -1)), "crc32: checksum mismatch"),
        (lambda p: write_raw_hrb(p, [0, 3, 2, 5], [1, 2, 3, 4, 5]), "offsets: not non-decreasing"),
        (lambda p: write_raw_hrb(p, [0, 2, 2, 5], [1, 2, 3, 4, 5]), "offsets: trajectory 1 is empty"),
        (lambda p: write_raw_hrb(p, [0, 2, 4], [1, 2, 3, 4, 5]), r"offsets: offsets\[-1\] = 4"),
        (lambda p: write_raw_hrb(p, [1, 2, 5], [1, 2, 3, 4, 5]), r"offsets: offsets\[0\] must be 0"),
        (lambda p: write_raw_hrb(p, [0, 2, 5], [1, 2, -3, 4, 5]), "tokens: token id -3 at index 2"),
    ],
)
def test_malformed_hrb_raises_naming_the_field(tmp_path: Path, mutate, field: str) -> None:
    path = tmp_path / "bad.hrb"
    mutate(path)
    with pytest.raises(BatchFormatError, match=field):
        load_batch(path)


def flip_byte(data: bytes, index: int) -> bytes:
    """``data`` with the byte at ``index`` inverted."""
    mutable = bytearray(data)
    mutable[index] ^= 0xFF
    return bytes(mutable)


def test_batch_format_error_is_a_value_error() -> None:
    assert issubclass(BatchFormatError, ValueError)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"tokens": [1]}\n{"tokens": [1, 2\n', "line 2: invalid JSON"),
        ('{"tokens": [1]}\n\n[1, 2]\n', "line 3: expected a JSON object"),
        ('{"tokens": []}\n', "line 1: tokens: empty trajectory"),
        ('{"tree_id": 1}\n', "line 1: tokens: expected a list"),
        ('{"tokens": [1, -1]}\n', "line 1: tokens: entry 1 = -1"),
        ('{"tokens": [1, 2147483648]}\n', "line 1: tokens: entry 1 = 2147483648"),
        ('{"tokens": [1, 2.0]}\n', "line 1: tokens: entry 1 = 2.0"),
        ('{"tokens": [true]}\n', "line 1: tokens: entry 0 = True"),
        ('{"tokens": [1], "tree_id": "a"}\n', "line 1: tree_id: expected an int64"),
        ('{"tokens": [1], "tree_id": null}\n', "line 1: tree_id: expected an int64"),
        ('{"tokens": [1], "tree_id": 9223372036854775808}\n', "line 1: tree_id: expected an int64"),
        ('{"tokens": [1], "tree_id": 0}\n{"tokens": [2]}\n', "line 2: tree_id: missing here but given"),
        ('{"tokens": [1]}\n{"tokens": [2], "tree_id": 0}\n', "line 2: tree_id: given here but missing"),
        ('{"tokens": [1], "reward": 1.0}\n', "line 1: reward: unknown field"),
    ],
)
def test_malformed_jsonl_names_line_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(BatchFormatError, match=message):
        load_batch(path)


def test_jsonl_skips_blank_lines_and_accepts_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    path.write_text('\n{"tokens": [4, 5]}\n\n{"tokens": [4]}\n')
    assert_same_batch(load_batch(path), np.array([4, 5, 4]), np.array([0, 2, 3]), None)
    path.write_text("")
    assert_same_batch(load_batch(path), np.array([]), np.array([0]), None)
