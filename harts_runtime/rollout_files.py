"""Rollout files: what ``harts-train --data FILE`` reads (:func:`read_rollout_file`).

One trajectory per JSONL line (``.jsonl``, ``.ndjson``, ``.json``) or per Parquet row (``.parquet``,
``.pq``; needs ``pyarrow``, the ``train`` extra), with the same keys / columns:

========================  ========  ================================================================
key                       needed    value
========================  ========  ================================================================
``tokens``                yes       token ids of the whole trajectory, prompt and response (``L >= 1``)
``advantages``            yes       per-token values (below) or one number for the whole trajectory
``loss_mask``             yes       per-token 0 / 1 or true / false (or one value)
``old_logprobs``          yes       per-token log-probs of the rollout policy, finite and ``<= 0``
``ref_logprobs``          no        per-token reference log-probs (every row or none; needed by a KL
                                    penalty: GRPO's default ``kl_coef`` is 0.001)
``behaviour_logprobs``    no        per-token log-probs of the rollout engine, finite and ``<= 0``
                                    (every row or none; importance correction, ``is_correction``)
``weight_versions``       no        per-token integer >= -1: the weight version that sampled the token
                                    (-1: none, e.g. prompt tokens; one integer for the whole trajectory;
                                    every row or none; the mismatch metrics per version lag)
``group_id``              no        the GRPO group (an integer or a string; every row or none)
``step``                  no        an integer >= 0: rows with the same value form one training step,
                                    steps run in increasing order (every row or none; without it the
                                    whole file is one step)
========================  ========  ================================================================

Per-token fields come in either of two alignments, told apart by their length: ``L - 1`` values
*per target* (HARTS's layout: value ``t`` belongs to the prediction of token ``t + 1`` from tokens
``0 .. t``) or ``L`` values *per token* (RL frameworks' layout, verl's ``old_log_probs`` and
``response_mask``: value ``t`` belongs to token ``t``; the first value, which no prediction
scores, is ignored). Other keys (rewards, prompts, ids) are ignored and named once in
:attr:`RolloutFile.ignored`.

Every row is validated before any work; the first problem raises :class:`RolloutFileError`, an
:class:`~harts_runtime.errors.InvalidInputError` whose one-line message names the file, the line
(JSONL, 1-based like an editor's) or row (Parquet, 0-based like pyarrow's and pandas' index), the
field with its index in the list as given, and the limit::

    rollouts.jsonl:7: advantages[3]: must be finite, got nan
    rollouts.parquet: row 2: tokens[5]: token id 600 is outside [0, 512)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.rollouts import Rollouts
from harts_runtime.token_range import TOKEN_LIMIT

__all__ = ["FORMATS", "OPTIONAL", "REQUIRED", "RolloutFile", "RolloutFileError", "read_rollout_file"]

REQUIRED = ("tokens", "advantages", "loss_mask", "old_logprobs")
"""Keys every row has."""
OPTIONAL = ("ref_logprobs", "behaviour_logprobs", "weight_versions", "group_id", "step")
"""Keys that every row has or none does."""
FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
"""File name suffix -> format."""
_FLOAT_FIELDS = ("advantages", "old_logprobs", "ref_logprobs")


class RolloutFileError(InvalidInputError):
    """A bad rollout file; ``.path``, ``.where`` (``"line 7"``, ``"row 2"`` or None for the whole
    file) and ``.field`` (None: the line or file itself) say where; the message is one line:
    ``PATH:LINE: FIELD: what`` (JSONL) or ``PATH: row ROW: FIELD: what`` (Parquet)."""

    def __init__(self, path: str, where: str | None, field: str | None, message: str):
        if where is None:
            prefix = f"{path}"
        elif where.startswith("line "):
            prefix = f"{path}:{where[5:]}"
        else:
            prefix = f"{path}: {where}"
        ValueError.__init__(self, f"{prefix}: {field + ': ' if field else ''}{message}")
        self.path, self.where, self.field = path, where, field or "data"


@dataclass
class RolloutFile:
    """A validated rollout file: one :class:`~harts_runtime.rollouts.Rollouts` per training step."""

    path: str
    format: str
    """``jsonl`` or ``parquet``."""
    steps: list[Rollouts]
    """The steps in order (one when the file has no ``step`` key)."""
    step_keys: list[int] | None
    """The ``step`` value of each step, or None."""
    rows: int
    sha256: str
    """Of the file's bytes: tells a resumed run whether it reads the same data."""
    has_ref_logprobs: bool
    has_group_ids: bool
    ignored: list[str] = field(default_factory=list)
    """Keys / columns present but not read."""
    has_behaviour_logprobs: bool = False
    """The rollout engine's log-probs in every row (importance correction)."""
    has_weight_versions: bool = False

    @property
    def num_steps(self) -> int:
        return len(self.steps)


def file_format(path) -> str:
    """``jsonl`` or ``parquet`` from the name; :class:`InvalidInputError` (``data``) otherwise."""
    ext = os.path.splitext(str(path))[1].lower()
    if ext not in FORMATS:
        raise InvalidInputError(
            "data",
            f"{str(path)!r}: unknown rollout file type {ext or '(none)'!r}; expected {', '.join(FORMATS)}",
        )
    return FORMATS[ext]


# ---------------------------------------------------------------------------------- one row
def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _show(x) -> str:
    """``x`` for a one-line message: short whatever its size (a 10 MB binary value is "binary
    data (10,000,000 bytes)")."""
    if x is None:
        return "null"
    if isinstance(x, (bool, np.bool_)):
        return "true" if x else "false"
    if isinstance(x, (list, tuple, dict, np.ndarray)):
        return type(x).__name__ if not isinstance(x, tuple) else "list"
    if isinstance(x, (bytes, bytearray, memoryview)):
        return f"binary data ({len(x):,} bytes)"
    text = repr(x)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text):,} characters)"


def _array(v, dtype=None):
    """``np.asarray(v)``, or None where numpy cannot hold ``v`` as one array (nested lists of
    uneven lengths, integers beyond 64 bits): the caller then checks element by element."""
    try:
        return np.asarray(v, dtype=dtype) if not isinstance(v, np.ndarray) else v
    except (ValueError, TypeError, OverflowError):
        return None


class _Row:
    """Validation of one row; ``err`` raises :class:`RolloutFileError` at this row."""

    def __init__(self, path: str, where: str):
        self.path, self.where = path, where

    def err(self, name: str, message: str):
        raise RolloutFileError(self.path, self.where, name, message)

    def tokens(self, v, vocab_size: int | None) -> np.ndarray:
        if v is None:
            self.err("tokens", "is null")
        if not isinstance(v, (list, tuple, np.ndarray)):
            self.err("tokens", f"expected a list of token ids, got {_show(v)}")
        if len(v) == 0:
            self.err("tokens", "is empty (a trajectory has at least one token)")
        a = _array(v)
        if a is None or a.ndim != 1 or a.dtype.kind not in "iu":
            for j, x in enumerate(v):
                if not _is_int(x):
                    self.err(f"tokens[{j}]", f"expected an integer token id, got {_show(x)}")
            a = None  # integers numpy could not hold: range-checked below
        top = vocab_size if vocab_size is not None else TOKEN_LIMIT
        limit = f"[0, {vocab_size})" if vocab_size is not None else "[0, 2^31) (token ids are int32)"
        if a is None:
            for j, x in enumerate(v):
                if x < 0 or x >= top:
                    self.err(f"tokens[{j}]", f"token id {_show(x)} is outside {limit}")
            a = np.asarray(v, dtype=np.int64)
        bad = (a < 0) | (a >= top)  # before the cast: a uint64 id would wrap
        if bad.any():
            j = int(np.argmax(bad))
            self.err(f"tokens[{j}]", f"token id {int(a[j])} is outside {limit}")
        return a.astype(np.int64, copy=False)

    def values(self, v, n: int, name: str) -> np.ndarray:
        """The ``n - 1`` per-target values of field ``name`` (float32, or bool for the mask)."""
        mask = name == "loss_mask"
        if v is None:
            self.err(name, "is null")
        if _is_number(v) or (mask and isinstance(v, (bool, np.bool_))):
            kept, base, scalar = [v] * (n - 1), 0, True
        elif isinstance(v, (list, tuple, np.ndarray)):
            if len(v) == n:
                kept, base = v[1:], 1  # per token: the first value scores nothing
            elif len(v) == n - 1:
                kept, base = v, 0
            else:
                self.err(name, f"expected {n - 1} (per target) or {n} (per token) values, got {len(v)}")
            scalar = False
        else:
            what = "0 / 1 or true / false" if mask else "a number"
            self.err(name, f"expected {what} or a list of them, got {_show(v)}")
        at = (lambda j: name) if scalar else (lambda j: f"{name}[{j + base}]")
        a = _array(kept)
        ok_kinds = "biuf" if mask else "iuf"
        if a is None or a.ndim != 1 or a.dtype.kind not in ok_kinds:
            if a is not None and a.size == 0 and a.ndim == 1:
                a = np.zeros(0, dtype=bool if mask else np.float64)
            else:
                for j, x in enumerate(kept):
                    if not (_is_number(x) or (mask and isinstance(x, (bool, np.bool_)))):
                        self.err(
                            at(j),
                            f"expected {'0 / 1 or true / false' if mask else 'a number'}, got {_show(x)}",
                        )
                a = np.asarray(kept, dtype=np.float64)
        if mask:
            if a.dtype != np.bool_:
                bad = ~((a == 0) | (a == 1))
                if bad.any():
                    j = int(np.argmax(bad))
                    self.err(at(j), f"a loss mask is 0 / 1 or true / false, got {_show(kept[j])}")
            return a.astype(bool)
        f = a.astype(np.float32)
        bad = ~np.isfinite(f)
        logprob = name != "advantages"
        if logprob:
            bad |= f > 0
        if bad.any():
            j = int(np.argmax(bad))
            x = kept[j]
            what = "a log-prob is finite and <= 0" if logprob else "must be finite"
            extra = (
                " (not finite in float32)"
                if _is_number(x) and math.isfinite(float(x)) and not np.isfinite(f[j])
                else ""
            )
            self.err(at(j), f"{what}, got {_show(float(x)) if _is_number(x) else _show(x)}{extra}")
        return f

    def versions(self, v, n: int) -> np.ndarray:
        """The ``n - 1`` per-target weight versions (int64, each >= -1)."""
        name = "weight_versions"
        if _is_int(v):
            kept, base = [v] * (n - 1), None
        elif isinstance(v, (list, tuple, np.ndarray)) and len(v) in (n, n - 1):
            kept, base = (v[1:], 1) if len(v) == n else (v, 0)
        elif isinstance(v, (list, tuple, np.ndarray)):
            self.err(name, f"expected {n - 1} (per target) or {n} (per token) values, got {len(v)}")
        else:
            self.err(name, f"expected an integer or a list of them, got {_show(v)}")
        for j, x in enumerate(kept):
            if not _is_int(x) or x < -1:
                self.err(
                    name if base is None else f"{name}[{j + base}]",
                    f"expected an integer >= -1, got {_show(x)}",
                )
        return np.asarray(kept, dtype=np.int64).reshape(-1)

    def group(self, v):
        if _is_int(v) or isinstance(v, str):
            return v
        self.err("group_id", f"expected an integer or a string, got {_show(v)}")

    def step(self, v) -> int:
        if _is_int(v) and v >= 0:
            return int(v)
        self.err("step", f"expected an integer >= 0, got {_show(v)}")


# ---------------------------------------------------------------------------------- the file
class _Builder:
    """Rows in, steps out; enforces the every-row-or-none keys."""

    def __init__(self, path: str, vocab_size: int | None):
        self.path, self.vocab_size = path, vocab_size
        self.rows: list[tuple] = []
        self.first_with: dict[str, str] = {}
        self.first_without: dict[str, str] = {}
        self.ignored: set[str] = set()

    def add(self, rec: dict, where: str) -> None:
        row = _Row(self.path, where)
        for name in REQUIRED:
            if rec.get(name) is None:
                row.err(name, "missing" if name not in rec else "is null")
        for name in OPTIONAL:
            have = rec.get(name) is not None
            (self.first_with if have else self.first_without).setdefault(name, where)
            if name in self.first_with and name in self.first_without:
                if have:
                    said = f"given here but missing on {self.first_without[name]}"
                else:
                    said = f"missing here but given on {self.first_with[name]}"
                row.err(name, f"{said} (give it in every row or in none)")
        toks = row.tokens(rec["tokens"], self.vocab_size)
        n = len(toks)
        fields = {name: row.values(rec[name], n, name) for name in REQUIRED[1:]}
        for name in ("ref_logprobs", "behaviour_logprobs"):
            if rec.get(name) is not None:
                fields[name] = row.values(rec[name], n, name)
        if rec.get("weight_versions") is not None:
            fields["weight_versions"] = row.versions(rec["weight_versions"], n)
        gid = row.group(rec["group_id"]) if rec.get("group_id") is not None else None
        step = row.step(rec["step"]) if rec.get("step") is not None else None
        self.rows.append((toks, fields, gid, step))
        for k in rec:
            if k not in REQUIRED and k not in OPTIONAL:
                self.ignored.add(k)

    def build(self, fmt: str, sha: str) -> RolloutFile:
        if not self.rows:
            raise RolloutFileError(self.path, None, None, "no trajectories in the file")
        has_ref = "ref_logprobs" in self.first_with
        has_gid = "group_id" in self.first_with
        gids = None
        if has_gid:
            raw = [r[2] for r in self.rows]
            if all(_is_int(g) for g in raw):
                gids = np.asarray(raw, dtype=np.int64)
            else:  # strings (or a mix): dense ids in order of first appearance
                index: dict[str, int] = {}
                gids = np.asarray([index.setdefault(str(g), len(index)) for g in raw], dtype=np.int64)
        if "step" in self.first_with:
            keys = sorted({r[3] for r in self.rows})
            groups = {k: [] for k in keys}
            for i, r in enumerate(self.rows):
                groups[r[3]].append(i)
            order = [groups[k] for k in keys]
        else:
            keys, order = None, [list(range(len(self.rows)))]
        steps = []
        for idx in order:
            toks = [self.rows[i][0] for i in idx]
            lengths = np.asarray([len(t) for t in toks], dtype=np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            names = ["advantages", "loss_mask", "old_logprobs"] + (["ref_logprobs"] if has_ref else [])
            names += [k for k in ("behaviour_logprobs", "weight_versions") if k in self.first_with]
            cat = {
                name: torch.from_numpy(np.concatenate([self.rows[i][1][name] for i in idx])) for name in names
            }
            g = None if gids is None else torch.from_numpy(gids[idx])
            steps.append(Rollouts(np.concatenate(toks), offsets, group_ids=g, **cat).check(self.vocab_size))
        return RolloutFile(
            path=self.path,
            format=fmt,
            steps=steps,
            step_keys=keys,
            rows=len(self.rows),
            sha256=sha,
            has_ref_logprobs=has_ref,
            has_group_ids=has_gid,
            ignored=sorted(self.ignored),
            has_behaviour_logprobs="behaviour_logprobs" in self.first_with,
            has_weight_versions="weight_versions" in self.first_with,
        )


def _read_jsonl(path: str, b: _Builder) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            h.update(raw)
            where = f"line {lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise RolloutFileError(
                    path, where, None, f"not UTF-8 text ({e.reason} at byte {e.start})"
                ) from None
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                raise RolloutFileError(
                    path, where, None, f"not valid JSON: {e.msg} (column {e.colno})"
                ) from None
            except RecursionError:
                raise RolloutFileError(path, where, None, "JSON nested too deeply") from None
            except ValueError as e:  # an integer of more than 4,300 digits
                said = str(e).split(";")[0]
                raise RolloutFileError(path, where, None, f"not usable JSON: {said}") from None
            if not isinstance(rec, dict):
                raise RolloutFileError(
                    path,
                    where,
                    None,
                    f"expected a JSON object (one trajectory per line), got {type(rec).__name__}",
                )
            b.add(rec, where)
    return h.hexdigest()


def _read_parquet(path: str, b: _Builder) -> str:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise InvalidInputError(
            "data",
            f"{path!r}: reading Parquet needs pyarrow: pip install 'harts[train]' (or pip install pyarrow)",
        ) from None
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RolloutFileError(path, None, None, f"not a readable Parquet file ({first})") from None
    names = table.column_names
    for name in REQUIRED:
        if name not in names:
            raise RolloutFileError(path, None, name, f"missing column (columns: {', '.join(names)})")
    read = [n for n in names if n in REQUIRED or n in OPTIONAL]
    cols = {n: table.column(n).to_pylist() for n in read}
    b.ignored.update(n for n in names if n not in read)
    for i in range(table.num_rows):
        b.add({n: cols[n][i] for n in read}, f"row {i}")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_rollout_file(path, vocab_size: int | None = None, fmt: str | None = None) -> RolloutFile:
    """Read and validate a rollout file (module docstring) against a vocabulary of ``vocab_size``
    token ids; the format from the suffix unless ``fmt`` (``jsonl`` / ``parquet``) says."""
    path = str(path)
    fmt = fmt or file_format(path)
    if fmt not in ("jsonl", "parquet"):
        raise InvalidInputError("format", f"unknown {fmt!r}; choose jsonl or parquet")
    if not os.path.exists(path):
        raise InvalidInputError("data", f"{path!r}: no such file")
    if os.path.isdir(path):
        raise InvalidInputError("data", f"{path!r} is a directory, not a rollout file")
    if not os.path.isfile(path):  # a FIFO would block the reader forever; a device never ends
        raise InvalidInputError("data", f"{path!r} is not a regular file (a FIFO, socket or device)")
    b = _Builder(path, vocab_size)
    try:
        sha = _read_jsonl(path, b) if fmt == "jsonl" else _read_parquet(path, b)
    except OSError as e:  # unreadable (permissions, a vanished file): a bad --data, not a crash
        raise InvalidInputError("data", f"{path!r}: {e.strerror or e}") from None
    return b.build(fmt, sha)
