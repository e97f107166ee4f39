"""Predicted communication of context parallelism per mixer layer, and the ``auto`` choice between
its two modes. Pure Python: no torch, no process group (the benchmark's prediction and the runtime
call the same functions).

The two modes, per mixer layer and microbatch of ``N`` compact rows on ``C`` CP ranks:

* ``"heads"`` (head-parallel, :mod:`harts_runtime.parallel.context`): the normed input ``[N, D]``
  all-gathered, the one-process mixer on ``1 / C`` of the heads, the partial output ``[N, D]``
  reduce-scattered back to the row blocks (``ceil(N / C)`` rows each, DTensor pads every shard to
  it); MLA all-gathers its ``r_kv + rope`` latent instead and moves queries rows -> heads and outputs
  heads -> rows by all-to-all. Backward mirrors forward. Possible only when ``tp * C`` divides the
  layer's head counts (:meth:`Mixer.head_counts`) and the layer has a head plan.
* ``"states"`` (state passing, ``harts_runtime.parallel.context_states``): each rank keeps its row
  range of the planner's split. Linear layers (KDA, GDN, Mamba2) all-gather the affine summaries
  of the states each rank hands on (fp32, per state head a ``K x V`` state and a transition:
  ``K x K`` for the delta rule, one decay for Mamba2; every rank padded to the most states any rank
  hands on; no collective when no rank hands one on; backward: the reduce-scatter), and fetch their
  halo rows (the distinct replay and conv-context rows of their receives) as normed input rows
  ``[rows, D]`` by one all-to-all (backward: the reverse, so a rank then receives the gradients of
  the rows others fetched from it). An attention layer fetches the K/V (GQA, gated attention:
  ``2 H_kv d_h`` values per row) or the latent (MLA) of the rows of earlier ranks its queries see
  (in preorder the strict ancestors of the rank's first row) by one all-to-all, backward the
  reverse; without the split's numbers the bound is the all-gather of every rank's block.

Conventions (as ``benchmarks/cp_eval.py``, which counts the runtime's collectives on gloo and
asserts they equal these records): a record is ``{collective, calls, payload, received}``;
*payload* is the collective's full tensor (the all-gather's output, the reduce-scatter's input, the
all-to-all's output), *received* what one rank receives from the others. Costs are per rank: the
most any rank receives. A mode's time is ``sum(received) / link.bytes_per_s + calls *
link.latency_s`` over the forward, the backward and, under recomputation, the forward again (the CP
collectives run between a mixer's projections: not overlapped with compute), plus, for
``"states"``, ``states_extra_s`` (its summary pass, when the caller knows it).

Interface (the runtime's ``cp_mode="auto"`` calls it once per mixer layer and microbatch; every CP
rank must pass the same arguments, the split-wide :class:`SplitShape`, so that all ranks choose
alike)::

    from harts_runtime.parallel.cp_cost import Link, SplitShape, choose_cp_mode, mixers_of, mode_costs

    mixers = mixers_of(model.config)               # Mixer (or None: no mixer) per layer
    shape = SplitShape.of_split(split)             # harts_planner.plan_cp(...)'s CpSplit, or None
    mode = choose_cp_mode(
        mixers[i], hidden=cfg.hidden_size, rows=n, cp=C, link=Link.NVLINK, split=shape,
        act_bytes=2, recompute=True, tp=1, heads_available=True,  # False: no head plan (Mamba2)
    )                                              # "heads" | "states"
    costs = mode_costs(...same arguments...)       # {"heads": ModeCost, "states": ModeCost, "choice": ...}

:func:`choose_cp_mode` returns ``"states"`` whenever ``"heads"`` is impossible, else the faster
mode (``"heads"`` on a tie: it is the one-process math). Bad arguments raise
:class:`~harts_runtime.errors.InvalidInputError` naming the argument.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from harts_runtime.errors import InvalidInputError

__all__ = [
    "ATTENTION_KINDS",
    "FP32",
    "KINDS",
    "LINEAR_KINDS",
    "Link",
    "Mixer",
    "ModeCost",
    "ModelDims",
    "SplitShape",
    "all_reduce",
    "choose_cp_mode",
    "crossover_rows",
    "dims_of",
    "gather_rows",
    "head_parallel_mixer",
    "heads_possible",
    "heads_to_rows",
    "mixers_of",
    "mode_costs",
    "record",
    "row_block",
    "rows_of",
    "rows_to_heads",
    "scatter_rows",
    "state_passing_mixer",
]

FP32 = 4
LINEAR_KINDS = ("kda", "gdn", "mamba2")
ATTENTION_KINDS = ("mla", "gqa", "gated_attention")
KINDS = LINEAR_KINDS + ATTENTION_KINDS
MODES = ("heads", "states")


def _positive_int(v, name: str, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise InvalidInputError(name, f"must be an integer >= {lo}, got {v!r}")
    return v


# ================================================================================ the layer
@dataclass(frozen=True)
class Mixer:
    """What the collectives of one mixer layer depend on (:func:`mixers_of` reads them from a model
    config).

    ``kind``: one of :data:`KINDS`. ``heads``: the heads head-parallel CP splits (query heads; GDN's
    key heads; Mamba2's heads). ``state_heads``, ``k``, ``v``: a linear layer's state
    ``[state_heads, k, v]`` (Mamba2: ``k`` the state size N, ``v`` the head dim P); ``conv_channels``:
    its short convolutions' channels; ``conv_size``: their width w; ``groups``: Mamba2's B/C groups.
    MLA: ``latent`` (``r_kv + rope``), ``q_head`` (``nope + rope``), ``v_head``. Attention:
    ``kv_heads``, ``head_dim``."""

    kind: str
    heads: int
    state_heads: int = 0
    k: int = 0
    v: int = 0
    conv_channels: int = 0
    conv_size: int = 4
    latent: int = 0
    q_head: int = 0
    v_head: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    groups: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidInputError("kind", f"unknown mixer {self.kind!r}; choose one of {KINDS}")
        _positive_int(self.heads, "heads")
        for name in ("state_heads", "k", "v", "conv_channels", "latent", "q_head", "v_head"):
            _positive_int(getattr(self, name), name, 0)
        for name in ("kv_heads", "head_dim", "groups"):
            _positive_int(getattr(self, name), name, 0)
        _positive_int(self.conv_size, "conv_size")
        need = {
            "kda": ("state_heads", "k", "v"),
            "gdn": ("state_heads", "k", "v"),
            "mamba2": ("state_heads", "k", "v"),
            "mla": ("latent", "q_head", "v_head"),
            "gqa": ("kv_heads", "head_dim"),
            "gated_attention": ("kv_heads", "head_dim"),
        }[self.kind]
        for name in need:
            if getattr(self, name) < 1:
                raise InvalidInputError(
                    name, f"must be >= 1 for a {self.kind} layer, got {getattr(self, name)}"
                )

    @property
    def summary_elements(self) -> int:
        """fp32 values of one affine summary (one piece): per state head the ``k x v`` state and the
        transition (``k x k`` for KDA / GDN, one decay for Mamba2). 0 for attention."""
        if self.kind in ("kda", "gdn"):
            return self.state_heads * (self.k * self.k + self.k * self.v)
        if self.kind == "mamba2":
            return self.state_heads * (self.k * self.v + 1)
        return 0

    @property
    def kv_width(self) -> int:
        """Values per row an attention layer gathers under ``"states"``: the latent (MLA) or K and V."""
        if self.kind == "mla":
            return self.latent
        if self.kind in ("gqa", "gated_attention"):
            return 2 * self.kv_heads * self.head_dim
        return 0

    def head_counts(self) -> tuple[tuple[str, int], ...]:
        """The ``(config field, value)`` pairs ``tp * cp`` must divide for ``"heads"`` (the TP plan's
        head blocks, ``harts_runtime.parallel.plans``; Mamba2: heads and groups)."""
        if self.kind == "gdn":
            return (("num_k_heads", self.heads),)
        if self.kind == "mamba2":
            return (("mamba2.num_heads", self.heads), ("mamba2.n_groups", max(1, self.groups)))
        return (("num_heads", self.heads),)


@dataclass(frozen=True)
class ModelDims:
    """The mixers of a model (:func:`dims_of`): hidden width, one :class:`Mixer` or None per layer,
    the routed experts per layer (0: dense FFN or none) and the bytes per element of the rows the
    mixers exchange (2 in bf16, 4 in float32)."""

    hidden: int
    mixers: tuple
    experts: tuple
    act_bytes: int


def mixers_of(cfg) -> tuple:
    """One :class:`Mixer` (or None for a layer without one) per layer of a ``harts_runtime``
    ``ModelConfig`` (duck-typed: only its fields are read)."""
    d, h = cfg.hidden_size, cfg.num_heads
    out = []
    for i, m in enumerate(cfg.mixers):
        if m == "kda":
            hk = cfg.kda.num_heads or h
            k, v = cfg.kda.head_k_dim, cfg.kda.head_v_dim
            out.append(Mixer("kda", hk, hk, k, v, hk * (2 * k + v), cfg.conv_size))
        elif m == "gdn":
            g = cfg.gdn
            k, v = g.head_k_dim, g.head_v_dim
            ch = 2 * g.num_k_heads * k + g.num_v_heads * v
            out.append(Mixer("gdn", g.num_k_heads, g.num_v_heads, k, v, ch, cfg.conv_size))
        elif m == "mamba2":
            a = cfg.mamba2
            ch = a.num_heads * a.head_dim + 2 * a.n_groups * a.state_size
            out.append(
                Mixer(
                    "mamba2",
                    a.num_heads,
                    a.num_heads,
                    a.state_size,
                    a.head_dim,
                    ch,
                    cfg.conv_size,
                    groups=a.n_groups,
                )
            )
        elif m == "mla":
            a = cfg.mla
            q = a.qk_nope_head_dim + a.qk_rope_head_dim
            out.append(
                Mixer("mla", h, latent=a.kv_lora_rank + a.qk_rope_head_dim, q_head=q, v_head=a.v_head_dim)
            )
        elif m in ("gqa", "gated_attention"):
            sub = cfg.gqa if m == "gqa" else cfg.gated_attention
            hd = getattr(sub, "head_dim", None) or d // h
            out.append(Mixer(m, h, kv_heads=cfg.num_kv_heads or h, head_dim=hd))
        elif m in (None, "none"):
            out.append(None)
        else:
            raise InvalidInputError(f"mixers[{i}]", f"no CP cost model for {m!r}; known: {KINDS}")
    return tuple(out)


def dims_of(cfg, act_bytes: int | None = None) -> ModelDims:
    """:class:`ModelDims` of a ``ModelConfig`` (``act_bytes`` None: 2 for a bf16 / fp16 model, else 4)."""
    experts = tuple(cfg.moe.num_experts if f == "moe" else 0 for f in cfg.ffns)
    if act_bytes is None:
        act_bytes = 2 if str(cfg.dtype) in ("bfloat16", "float16") else 4
    return ModelDims(cfg.hidden_size, mixers_of(cfg), experts, act_bytes)


# ================================================================================ the link and the split
@dataclass(frozen=True)
class Link:
    """A CP group's interconnect: the per-rank receive rate of its collectives (bytes/s) and a fixed
    latency per collective call (s)."""

    bytes_per_s: float
    latency_s: float
    name: str = ""
    NVLINK: ClassVar[Link]  # set below the class
    INFINIBAND: ClassVar[Link]

    def __post_init__(self):
        if not (isinstance(self.bytes_per_s, (int, float)) and self.bytes_per_s > 0):
            raise InvalidInputError(
                "link.bytes_per_s", f"must be a positive number, got {self.bytes_per_s!r}"
            )
        if not (isinstance(self.latency_s, (int, float)) and self.latency_s >= 0):
            raise InvalidInputError("link.latency_s", f"must be a number >= 0, got {self.latency_s!r}")

    def seconds(self, received: float, calls: int) -> float:
        return received / self.bytes_per_s + calls * self.latency_s


#: One 8-GPU H200 NVSwitch node: nccl-tests bus bandwidth about 360 GB/s, 30 us per collective
#: (assumed, not measured here).
Link.NVLINK = Link(360e9, 30e-6, "nvlink")
#: Across nodes: 400 Gb/s InfiniBand per GPU, about 50 GB/s, 100 us per collective (assumed).
Link.INFINIBAND = Link(50e9, 100e-6, "infiniband")


@dataclass(frozen=True)
class SplitShape:
    """What the ``"states"`` bytes depend on in the split of one microbatch (split-wide maxima, so
    that every rank computes the same costs): ``pieces``, the most states one rank hands on (0: no
    summary is gathered); ``halo_rows`` / ``halo_sent``, the most halo rows one rank fetches / is
    fetched from it (None: ``w - 1``, one receive without replay, both ways); ``attention_rows`` /
    ``attention_sent``, the most rows whose K/V or latent one rank fetches / is fetched from it
    (None: the all-gather bound); ``rank_rows``, the largest rank block (None: ``ceil(N / C)``)."""

    pieces: int = 1
    halo_rows: int | None = None
    attention_rows: int | None = None
    rank_rows: int | None = None
    halo_sent: int | None = None
    attention_sent: int | None = None

    def __post_init__(self):
        _positive_int(self.pieces, "split.pieces", 0)
        for name in ("halo_rows", "attention_rows", "rank_rows", "halo_sent", "attention_sent"):
            if getattr(self, name) is not None:
                _positive_int(getattr(self, name), f"split.{name}", 0)

    @classmethod
    def of_split(cls, split) -> SplitShape:
        """From a ``harts_planner`` ``CpSplit`` (duck-typed: its CSR arrays), as the runtime moves
        rows: a rank's halo rows are the distinct replay and conv-context rows (position >= 0) of its
        receives; its attention rows the strict ancestors of its first row, ``pos`` of that row
        (anchor + replay rows of the receive entering it; 0 for a root). ``attention_sent`` is an
        upper bound (each later rank fetches at most its count, and at most the sender's rows)."""
        c = int(split.cp_size)
        w = int(split.conv_width) - 1
        offs = [int(x) for x in split.rank_row_offsets]
        send = [int(x) for x in split.send_offsets]
        recv = [int(x) for x in split.receive_offsets]
        rep = [int(x) for x in split.receive_replay_offsets]
        ent = [int(x) for x in split.receive_entry_offsets]
        anchor = [int(x) for x in split.receive_anchor]
        replay = [int(x) for x in split.replay_rows]
        entries = [int(x) for x in split.entry_rows]
        ctx = [int(x) for x in split.receive_conv_context]

        def rank_of(x):
            lo, hi = 0, c - 1
            while lo < hi:  # the last rank whose range starts at or before x
                mid = (lo + hi + 1) // 2
                if offs[mid] <= x:
                    lo = mid
                else:
                    hi = mid - 1
            return lo

        pieces = max([send[r + 1] - send[r] for r in range(c)] + [0])
        halo_in, halo_out, attn = [0] * c, [0] * c, [0] * c
        for r in range(c):
            rows = set()
            for i in range(recv[r], recv[r + 1]):
                rows.update(replay[rep[i] : rep[i + 1]])
                rows.update(x for x in ctx[i * w : (i + 1) * w] if x >= 0)
                if offs[r] in entries[ent[i] : ent[i + 1]]:
                    attn[r] = anchor[i] + rep[i + 1] - rep[i]
            halo_in[r] = len(rows)
            for x in rows:
                halo_out[rank_of(x)] += 1
        sent = [sum(min(attn[r], offs[s + 1] - offs[s]) for r in range(s + 1, c)) for s in range(c)]
        rank_rows = max(offs[r + 1] - offs[r] for r in range(c)) if c else 0
        return cls(
            pieces, max(halo_in + [0]), max(attn + [0]), rank_rows, max(halo_out + [0]), max(sent + [0])
        )


# ================================================================================ collectives
def row_block(n: int, c: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s rows under ``"heads"`` (``harts_runtime.parallel.tensor
    .row_block``: ``torch.chunk``'s ``ceil(n / c)`` rows per rank, the last ones fewer or none)."""
    per = -(-n // c) if n else 0
    start = min(n, rank * per)
    return start, min(n, start + per)


def rows_of(n: int, c: int, rank: int) -> int:
    s, e = row_block(n, c, rank)
    return e - s


def record(collective: str, payload: float, received: float, calls: int = 1) -> dict:
    """One collective's record (see the module docstring's conventions)."""
    return {"collective": collective, "calls": calls, "payload": payload, "received": received}


def gather_rows(n: int, c: int, width: int, s: int, per: int | None = None) -> dict:
    """All-gather of ``[n, width]`` rows split ``Shard(0)`` (each shard padded to ``per``, default
    ``ceil(n / c)`` rows)."""
    per = (-(-n // c) if n else 0) if per is None else per
    return record("all_gather", c * per * width * s, (c - 1) * per * width * s)


def scatter_rows(n: int, c: int, width: int, s: int, per: int | None = None) -> dict:
    """Reduce-scatter of partial ``[n, width]`` rows to ``Shard(0)`` (input padded to ``c per``)."""
    per = (-(-n // c) if n else 0) if per is None else per
    return record("reduce_scatter", c * per * width * s, (c - 1) * per * width * s)


def all_reduce(numel: int, c: int, s: int) -> dict:
    """All-reduce of ``numel`` values: a ring's ``2 (c - 1) / c`` of the tensor received."""
    return record("all_reduce", numel * s, 2 * (c - 1) * numel * s / c)


def rows_to_heads(n: int, c: int, rank: int, width: int, s: int) -> dict:
    """``[n_c, H, d]`` row blocks -> ``[n, H / C, d]`` (``width = H d``): rank ``rank`` receives every
    other rank's rows of its heads."""
    w = width // c
    return record("all_to_all", n * w * s, (n - rows_of(n, c, rank)) * w * s)


def heads_to_rows(n: int, c: int, rank: int, width: int, s: int) -> dict:
    """The inverse: rank ``rank`` receives its own rows of the other ranks' heads."""
    w = width // c
    mine = rows_of(n, c, rank)
    return record("all_to_all", mine * c * w * s, (c - 1) * mine * w * s)


def head_parallel_mixer(mix: Mixer, d: int, n: int, c: int, rank: int, s: int) -> dict:
    """The collectives of one mixer layer and microbatch of ``n`` rows under ``"heads"`` on rank
    ``rank``, by pass (``forward``, ``backward``; recomputation repeats ``forward``)."""
    if mix.kind == "mla":
        q, o = mix.heads * mix.q_head, mix.heads * mix.v_head
        fwd = [
            gather_rows(n, c, mix.latent, s),
            rows_to_heads(n, c, rank, q, s),
            heads_to_rows(n, c, rank, o, s),
        ]
        bwd = [
            scatter_rows(n, c, mix.latent, s),  # d(latent) partial rows -> blocks
            heads_to_rows(n, c, rank, q, s),  # d(queries) heads -> rows
            rows_to_heads(n, c, rank, o, s),  # d(outputs) rows -> heads
        ]
    else:
        fwd = [gather_rows(n, c, d, s), scatter_rows(n, c, d, s)]
        bwd = [scatter_rows(n, c, d, s), gather_rows(n, c, d, s)]
    return {"forward": fwd, "backward": bwd}


def state_passing_mixer(
    mix: Mixer,
    d: int,
    n: int,
    c: int,
    s: int,
    pieces: int = 1,
    halo_rows: int | None = None,
    attention_rows: int | None = None,
    rank_rows: int | None = None,
    halo_sent: int | None = None,
    attention_sent: int | None = None,
) -> dict:
    """The collectives of one mixer layer and microbatch under ``"states"`` on a rank that fetches
    ``halo_rows`` halo rows and ``attention_rows`` attention rows and from which the other ranks
    fetch ``halo_sent`` / ``attention_sent`` (its backward receives; None: as forward), with
    ``pieces`` the most states any rank hands on (see the module docstring; None: the bounds of
    :class:`SplitShape`), by pass. With ``c == 1`` nothing moves."""
    if c == 1:
        return {"forward": [], "backward": []}
    if mix.kind in LINEAR_KINDS:
        summary = mix.summary_elements * pieces * FP32
        h_in = (mix.conv_size - 1 if halo_rows is None else halo_rows) * d * s
        h_out = h_in if halo_sent is None else halo_sent * d * s
        fwd, bwd = [record("all_to_all", h_in, h_in)], [record("all_to_all", h_out, h_out)]
        if pieces:
            fwd.append(record("all_gather", c * summary, (c - 1) * summary))
            bwd.append(record("reduce_scatter", c * summary, (c - 1) * summary))
        return {"forward": fwd, "backward": bwd}
    width = mix.kv_width
    if attention_rows is None:
        return {
            "forward": [gather_rows(n, c, width, s, rank_rows)],
            "backward": [scatter_rows(n, c, width, s, rank_rows)],
        }
    got = attention_rows * width * s
    back = got if attention_sent is None else attention_sent * width * s
    return {"forward": [record("all_to_all", got, got)], "backward": [record("all_to_all", back, back)]}


def crossover_rows(mix: Mixer, d: int, c: int, s: int, pieces: int = 1) -> float:
    """The microbatch rows above which ``"states"`` receives fewer bytes per linear layer than
    ``"heads"`` (forward; backward and recomputation scale alike): ``"heads"`` receives
    ``2 (C - 1) / C N D s``, ``"states"`` a fixed ``(C - 1) pieces summary 4 + (w - 1) D s``, so
    ``N* = C fixed / (2 (C - 1) D s)``. Attention has no crossover (both grow with N)."""
    if mix.kind not in LINEAR_KINDS:
        raise InvalidInputError("kind", f"no crossover for an attention layer ({mix.kind!r})")
    sp = state_passing_mixer(mix, d, 1, c, s, pieces)["forward"]
    fixed = sum(r["received"] for r in sp)
    return fixed * c / ((c - 1) * 2 * d * s)


# ================================================================================ the choice
@dataclass(frozen=True)
class ModeCost:
    """One mode's predicted cost for one layer and microbatch: the most bytes a rank receives and
    its collective calls over every pass, the seconds on the link (plus ``extra_s``), whether the
    mode is possible here (``reason`` says why not) and the rank's records by pass."""

    mode: str
    possible: bool
    received: float
    calls: int
    seconds: float
    extra_s: float = 0.0
    reason: str = ""
    records: dict = dataclasses.field(default_factory=dict, compare=False)


def heads_possible(mix: Mixer, cp: int, tp: int = 1, heads_available: bool = True) -> tuple[bool, str]:
    """Whether ``"heads"`` can run ``mix`` on ``cp`` CP ranks (times ``tp``), and why not."""
    if cp == 1:
        return True, ""
    if not heads_available:
        return False, f"{mix.kind} has no head-parallel plan"
    for field, value in mix.head_counts():
        if value % (tp * cp):
            return False, f"{field} = {value} is not divisible by tp * cp = {tp} * {cp}"
    if mix.kind in ("gqa", "gated_attention"):
        kv = mix.kv_heads
        local = kv // tp if kv % tp == 0 else kv
        if local % cp and cp % local:
            return (
                False,
                f"num_kv_heads = {kv}: cp = {cp} neither divides the local KV heads nor is a multiple",
            )
    return True, ""


def _passes(by: dict, recompute: bool) -> list:
    out = [("forward", by["forward"]), ("backward", by["backward"])]
    if recompute:
        out.append(("recompute", by["forward"]))
    return out


def _check(mix, hidden, rows, cp, link, act_bytes, tp, states_extra_s):
    if not isinstance(mix, Mixer):
        raise InvalidInputError("mixer", f"must be a Mixer, got {type(mix).__name__}")
    if not isinstance(link, Link):
        raise InvalidInputError("link", f"must be a Link, got {type(link).__name__}")
    _positive_int(hidden, "hidden")
    _positive_int(rows, "rows", 0)
    _positive_int(cp, "cp")
    _positive_int(tp, "tp")
    if act_bytes not in (1, 2, 4, 8):
        raise InvalidInputError("act_bytes", f"must be 1, 2, 4 or 8, got {act_bytes!r}")
    if not (isinstance(states_extra_s, (int, float)) and states_extra_s >= 0):
        raise InvalidInputError("states_extra_s", f"must be a number >= 0, got {states_extra_s!r}")


def mode_costs(
    mix: Mixer,
    hidden: int,
    rows: int,
    cp: int,
    link: Link,
    *,
    split: SplitShape | None = None,
    act_bytes: int = 2,
    recompute: bool = True,
    tp: int = 1,
    heads_available: bool = True,
    states_extra_s: float = 0.0,
) -> dict:
    """Both modes' :class:`ModeCost` for one mixer layer (``hidden`` = D) and microbatch of ``rows``
    rows on ``cp`` CP ranks, and the ``choice`` (see :func:`choose_cp_mode`). ``"heads"`` is taken
    at the rank receiving the most (all ranks evaluated), ``"states"`` at the split-wide maxima of
    ``split`` (None: ``SplitShape()``, one piece, the bounds)."""
    _check(mix, hidden, rows, cp, link, act_bytes, tp, states_extra_s)
    split = split or SplitShape()
    if not isinstance(split, SplitShape):
        raise InvalidInputError("split", f"must be a SplitShape, got {type(split).__name__}")
    s = act_bytes
    ok, why = heads_possible(mix, cp, tp, heads_available)
    best = None
    if cp > 1:
        for r in range(cp):
            by = head_parallel_mixer(mix, hidden, rows, cp, r, s)
            recv = sum(x["received"] for _, recs in _passes(by, recompute) for x in recs)
            if best is None or recv > best[0]:
                best = (recv, by)
    by_h = best[1] if best else {"forward": [], "backward": []}
    by_s = state_passing_mixer(
        mix,
        hidden,
        rows,
        cp,
        s,
        split.pieces,
        split.halo_rows,
        split.attention_rows,
        split.rank_rows,
        split.halo_sent,
        split.attention_sent,
    )
    out = {}
    for mode, by, possible, reason, extra in (
        ("heads", by_h, ok, why, 0.0),
        ("states", by_s, True, "", float(states_extra_s) if cp > 1 else 0.0),
    ):
        passes = _passes(by, recompute)
        recv = sum(x["received"] for _, recs in passes for x in recs)
        calls = sum(x["calls"] for _, recs in passes for x in recs)
        out[mode] = ModeCost(
            mode,
            possible,
            recv,
            calls,
            link.seconds(recv, calls) + extra,
            extra,
            reason,
            {name: recs for name, recs in passes},
        )
    h, st = out["heads"], out["states"]
    out["choice"] = "heads" if h.possible and h.seconds <= st.seconds else "states"
    return out


def choose_cp_mode(
    mix: Mixer,
    hidden: int,
    rows: int,
    cp: int,
    link: Link,
    *,
    split: SplitShape | None = None,
    act_bytes: int = 2,
    recompute: bool = True,
    tp: int = 1,
    heads_available: bool = True,
    states_extra_s: float = 0.0,
) -> str:
    """``"heads"`` or ``"states"`` for one mixer layer and microbatch (:func:`mode_costs`'s choice):
    ``"states"`` when ``"heads"`` is impossible (``tp * cp`` does not divide the heads, or no head
    plan), else the mode with the smaller predicted time, ``"heads"`` on a tie."""
    return mode_costs(
        mix,
        hidden,
        rows,
        cp,
        link,
        split=split,
        act_bytes=act_bytes,
        recompute=recompute,
        tp=tp,
        heads_available=heads_available,
        states_extra_s=states_extra_s,
    )["choice"]
