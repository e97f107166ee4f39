"""Render plans as one self-contained HTML page with inline SVG (no scripts, no external files).

* A microbatch's rollout tree, drawn like the paper's Figures 6-8: one circle per segment showing
  its token count, named above (``names`` or ``s<id>``), filled with the colour of the call round
  that outputs it. Thick solid edges are direct continuations (the child runs in its parent's
  sequence); dashed edges start a new sequence and are labelled with its replay length
  ``r = s_head - a(s_head)``. Direct chains are drawn horizontally, side branches below them.
  Hovering a segment shows its positions, round, sequence, T_pre and T_in; every page also spells
  these out once in a key (:data:`KEY`).
* A step plan's microbatches laid out by slot (rows) and DP replica (columns), each with its compact
  work against the capacity T, its trajectories and its call count; each links to its tree.

The markup is well-formed XML (XHTML-compatible), so it can be checked with any XML parser.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import numpy as np

from harts_planner import checks
from harts_planner.call_plan import CallPlan
from harts_planner.errors import invalid
from harts_planner.step_plan import StepPlan

#: Round colours (Tableau 10), cycled after ten rounds.
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)
_DX, _DY, _R = 96, 46, 17  # column width, row height, circle radius (px)
_MARGIN = 30

_CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 8px 0; }
h2 { font-size: 16px; margin: 24px 0 8px 0; }
table.summary { border-collapse: collapse; font-size: 13px; }
table.summary td, table.summary th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
table.summary td.num { text-align: right; font-variant-numeric: tabular-nums; }
.legend span.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 6px; margin: 0 4px 0 12px;
  vertical-align: middle; }
.legend { font-size: 13px; margin: 6px 0; }
.key { font-size: 13px; max-width: 60em; color: #444; }
details { margin: 8px 0; border: 1px solid #e4e4e4; border-radius: 6px; padding: 6px 10px; }
summary { cursor: pointer; font-size: 14px; }
.scroll { overflow-x: auto; }
svg text { font-family: system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif; }
svg .name { font-size: 11px; fill: #222; }
svg .tokens { font-size: 9px; fill: #fff; font-weight: 600; }
svg .replay { font-size: 10px; fill: #444; }
svg .cell { font-size: 11px; fill: #222; }
p.note { font-size: 12px; color: #666; }
"""


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _shrink(digits: int) -> str:
    """A smaller font for token counts of five digits or more, to stay inside the circle."""
    return "" if digits <= 4 else f' style="font-size:{max(5, 9 - 2 * (digits - 4))}px"'


def _colour(round_: int) -> str:
    return PALETTE[round_ % len(PALETTE)]


def segment_names(plan: CallPlan, names: Sequence[str] | None) -> list[str]:
    """The label of every segment: ``names[v]`` or ``s<v>``."""
    if names is None:
        return [f"s{v}" for v in range(plan.num_segments)]
    if len(names) != plan.num_segments:
        raise invalid("names", f"needs one name per segment ({plan.num_segments}), got {len(names)}")
    return [str(n) for n in names]


def _layout(plan: CallPlan) -> tuple[np.ndarray, np.ndarray, int]:
    """(column, row) of every segment and the number of rows. Children are placed direct
    continuation first, so a sequence's chain is one row; other children take the rows below."""
    v_count = plan.num_segments
    col = np.zeros(v_count, dtype=np.int64)
    row = np.full(v_count, -1, dtype=np.int64)
    direct = plan.direct_child
    next_row = 0
    # Iterative DFS; post-order fixes internal rows to their direct child's row.
    stack: list[tuple[int, bool]] = [(int(r), False) for r in reversed(plan.segment_roots)]
    while stack:
        v, done = stack.pop()
        kids = [int(c) for c in plan.children(v)]
        if done:
            row[v] = row[int(direct[v])] if direct[v] >= 0 else row[kids[0]]
            continue
        if not kids:
            row[v] = next_row
            next_row += 1
            continue
        d = int(direct[v])
        ordered = ([d] if d >= 0 else []) + [c for c in kids if c != d]
        stack.append((v, True))
        for c in reversed(ordered):
            col[c] = col[v] + 1
            stack.append((c, False))
    return col, row, max(next_row, 1)


def tree_svg(plan: CallPlan, *, names: Sequence[str] | None = None, id_prefix: str = "mb0") -> str:
    """Inline SVG of one microbatch's segment forest coloured by call round (see the module doc)."""
    labels = segment_names(plan, names)
    col, row, rows = _layout(plan)
    width = int(col.max() + 1) * _DX + 2 * _MARGIN if plan.num_segments else 2 * _MARGIN
    height = rows * _DY + 2 * _MARGIN
    seq_of = plan.segment_sequence
    seq_round = plan.sequence_round
    replay = plan.sequence_replay_length
    chain_offsets = plan.sequence_chain_offsets
    head_of_seq = plan.sequence_chain[chain_offsets[:-1]] if plan.num_sequences else np.zeros(0, np.int32)
    is_head = np.zeros(plan.num_segments, dtype=bool)
    is_head[head_of_seq] = True
    start, end, parent = plan.segment_start, plan.segment_end, plan.segment_parent

    def xy(v: int) -> tuple[int, int]:
        return _MARGIN + _R + int(col[v]) * _DX, _MARGIN + 8 + int(row[v]) * _DY + _R

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="rollout tree {_e(id_prefix)}">'
    ]
    edges, nodes = [], []
    for v in range(plan.num_segments):
        x, y = xy(v)
        r = int(seq_round[seq_of[v]])
        colour = _colour(r)
        p = int(parent[v])
        if p >= 0:
            px, py = xy(p)
            if not is_head[v]:  # direct continuation
                edges.append(
                    f'<path d="M{px + _R},{py} L{x - _R},{y}" stroke="{colour}" stroke-width="4" '
                    f'fill="none"/>'
                )
            else:  # a new sequence: down from the parent, then right
                edges.append(
                    f'<path d="M{px},{py + _R} V{y} H{x - _R}" stroke="{colour}" '
                    f'stroke-width="1.6" stroke-dasharray="5,3" fill="none"/>'
                )
                rep = int(replay[seq_of[v]])
                edges.append(f'<text class="replay" x="{px + 5}" y="{y - 4}">r={rep}</text>')
        q = int(seq_of[v])
        tip = (
            f"{labels[v]} (segment {v}): positions [{int(start[v])}, {int(end[v])}), "
            f"{int(end[v] - start[v])} tokens; Call {r + 1} (round {r}), sequence {q}"
            f"{', head, replay ' + str(int(replay[q])) if is_head[v] else ', direct continuation'}; "
            f"T_pre={int(plan.t_pre[v])}, T_in={int(plan.t_in[v])}"
        )
        nodes.append(
            f'<g class="seg" id="{_e(id_prefix)}-s{v}" data-segment="{v}" data-round="{r}">'
            f"<title>{_e(tip)}</title>"
            f'<circle cx="{x}" cy="{y}" r="{_R}" fill="{colour}" stroke="#333" stroke-width="1"/>'
            f'<text class="tokens" x="{x}" y="{y + 3}" text-anchor="middle"'
            f"{_shrink(len(str(int(end[v] - start[v]))))}>{int(end[v] - start[v])}</text>"
            f'<text class="name" x="{x}" y="{y - _R - 4}" text-anchor="middle">{_e(labels[v])}</text></g>'
        )
    out += edges + nodes
    out.append("</svg>")
    return "\n".join(out)


#: How to read a tree, printed once above the trees of every page (the tooltips repeat it per segment).
KEY = (
    "How to read a tree: each circle is a segment (a fork-free run of tokens shared by every "
    "trajectory below it); the number inside is its token count, the name above it its id. The fill "
    "colour is the call round (one packed linear-attention call, Call 1, Call 2, ...) that outputs "
    "it. A thick solid edge is a direct continuation: the child runs in its parent's sequence, on "
    "the parent's state. A dashed edge starts a new sequence in a later round, labelled r = its "
    "replay: the ancestor tokens from the chunk anchor a(s) = B floor(s / B) up to the segment start "
    "s, re-run to rebuild the chunk's state (no outputs). Hover a circle for its positions, round, "
    "sequence and the two counts of Algorithm 1's dynamic program: T_pre, the fewest calls for its "
    "subtree when the state at its entry anchor exists before its call, and T_in, the fewest when it "
    "is entered as its parent's direct continuation (its entry state exists only inside that call)."
)


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n:,} {word if n == 1 else (plural or word + 's')}"


def rounds_legend(plan: CallPlan) -> str:
    """One swatch per call round with its sequences, replay and packed tokens."""
    so, po = plan.round_sequence_offsets, plan.packed_offsets
    parts = []
    for r in range(plan.num_calls):
        seqs = range(int(so[r]), int(so[r + 1]))
        rep = int(sum(int(plan.sequence_replay_length[q]) for q in seqs))
        parts.append(
            f'<span class="swatch" style="background:{_colour(r)}"></span>Call {r + 1}: '
            f"{_plural(len(seqs), 'sequence')}, replay {rep:,}, packed {_plural(int(po[r + 1] - po[r]), 'token')}"
        )
    return f'<div class="legend">{"".join(parts)}</div>'


def _calls_summary(plan: CallPlan) -> str:
    rows = [
        ("calls", plan.num_calls),
        ("compact tokens C", f"{plan.compact_tokens:,}"),
        ("replay tokens R (Eq. 15)", f"{plan.replay_tokens:,}"),
        ("segments", plan.num_segments),
        ("sequences", plan.num_sequences),
        ("state slots", plan.num_state_slots),
        ("chunk size B", plan.chunk_size),
    ]
    return _table(rows)


def _table(rows) -> str:
    body = "".join(f'<tr><th>{_e(k)}</th><td class="num">{_e(v)}</td></tr>' for k, v in rows)
    return f'<table class="summary">{body}</table>'


def microbatch_grid_svg(step: StepPlan, calls: Sequence[CallPlan] | None) -> str:
    """Microbatches by slot (rows) and replica (columns): compact work as a bar against T."""
    d, slots = step.dp_size, step.num_slots
    cw, ch, left, top = 210, 58, 70, 24
    width, height = left + d * cw + 10, top + slots * ch + 10
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="microbatches by replica and slot">'
    ]
    for rep in range(d):
        out.append(
            f'<text class="cell" x="{left + rep * cw + cw // 2}" y="{top - 8}" '
            f'text-anchor="middle">replica {rep}</text>'
        )
    for s in range(slots):
        out.append(
            f'<text class="cell" x="{left - 8}" y="{top + s * ch + ch // 2 + 4}" '
            f'text-anchor="end">slot {s}</text>'
        )
    for m in range(step.num_microbatches):
        rep, s = int(step.replica[m]), int(step.slot[m])
        x, y = left + rep * cw, top + s * ch
        w = int(step.work[m])
        frac = min(w / step.capacity, 1.0)
        extra = f" · {_plural(calls[m].num_calls, 'call')}" if calls is not None else ""
        tip = (
            f"microbatch {m}: replica {rep}, slot {s}, "
            f"{_plural(len(step.microbatches[m]), 'trajectory', 'trajectories')}, "
            f"compact work {w:,} of T = {step.capacity:,}{extra}"
        )
        out.append(
            f'<a href="#mb{m}"><g class="mb" id="cell-mb{m}"><title>{_e(tip)}</title>'
            f'<rect x="{x + 2}" y="{y + 2}" width="{cw - 4}" height="{ch - 4}" rx="4" fill="#f4f6f8" stroke="#999"/>'
            f'<rect x="{x + 2}" y="{y + ch - 14}" width="{(cw - 4) * frac:.1f}" height="12" rx="2" fill="#4e79a7"/>'
            f'<text class="cell" x="{x + 8}" y="{y + 17}">M{m}: {w:,} tok ({frac:.0%} of T)</text>'
            f'<text class="cell" x="{x + 8}" y="{y + 32}">{len(step.microbatches[m])} traj{_e(extra)}</text>'
            f"</g></a>"
        )
    out.append("</svg>")
    return "\n".join(out)


def _page(title: str, body: list[str]) -> str:
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html xmlns="http://www.w3.org/1999/xhtml" lang="en">',
            "<head>",
            '<meta charset="utf-8"/>',
            f"<title>{_e(title)}</title>",
            f"<style>{_CSS}</style>",
            "</head>",
            "<body>",
            f"<h1>{_e(title)}</h1>",
            *body,
            "</body>",
            "</html>",
            "",
        ]
    )


def render_call_plan(
    plan: CallPlan, *, title: str = "HARTS call plan", names: Sequence[str] | None = None
) -> str:
    """A page with one microbatch's tree, its rounds and totals."""
    if not isinstance(plan, CallPlan):
        raise invalid("plan", f"must be a CallPlan, got {type(plan).__name__}")
    return _page(
        title,
        [
            _calls_summary(plan),
            "<h2>Rollout tree by call round</h2>",
            f'<p class="key">{_e(KEY)}</p>',
            rounds_legend(plan),
            f'<div class="scroll" id="mb0">{tree_svg(plan, names=names, id_prefix="mb0")}</div>',
        ],
    )


def render_step_plan(
    step: StepPlan, *, title: str = "HARTS step plan", max_segments: int = 5000, open_trees: int = 4
) -> str:
    """A page with the step's summary, the microbatch grid and every microbatch's tree.

    Uses :meth:`StepPlan.call_plans` (computed if needed). Trees of microbatches with more than
    ``max_segments`` segments are summarized, not drawn; the first ``open_trees`` are expanded.
    """
    if not isinstance(step, StepPlan):
        raise invalid("step", f"must be a StepPlan, got {type(step).__name__}")
    max_segments = checks.integer(max_segments, "max_segments", 0)
    open_trees = checks.integer(open_trees, "open_trees", 0)
    calls = step.call_plans()
    j = step.objective
    metrics = step.metrics
    summary = _table(
        [
            ("DP degree D", step.dp_size),
            ("capacity T", f"{step.capacity:,}"),
            ("chunk size B", step.chunk_size),
            ("trajectories", f"{sum(len(m) for m in step.microbatches):,}"),
            ("microbatches K", step.num_microbatches),
            ("slots K / D", step.num_slots),
            ("J = (total, slot-critical, max replica) work", f"({j[0]:,}, {j[1]:,}, {j[2]:,})"),
            ("compact tokens of the batch G", f"{step.compact_tokens:,}"),
            (
                "slot imbalance P50 / P95",
                f"{metrics['slot_imbalance_p50']:.3%} / {metrics['slot_imbalance_p95']:.3%}",
            ),
            ("step imbalance", f"{metrics['step_imbalance']:.3%}"),
            ("calls per microbatch (max)", max(c.num_calls for c in calls)),
            ("selected candidate", step.source),
        ]
    )
    body = [
        summary,
        "<h2>Microbatches by replica and slot</h2>",
        f'<div class="scroll">{microbatch_grid_svg(step, calls)}</div>',
        "<h2>Rollout trees by call round</h2>",
        f'<p class="key">{_e(KEY)}</p>',
    ]
    for m, plan in enumerate(calls):
        head = (
            f"M{m}: replica {int(step.replica[m])}, slot {int(step.slot[m])}, "
            f"{_plural(len(step.microbatches[m]), 'trajectory', 'trajectories')}, "
            f"{_plural(int(step.work[m]), 'compact token')}, {_plural(plan.num_calls, 'call')}, "
            f"replay {plan.replay_tokens:,}, {_plural(plan.num_segments, 'segment')}"
        )
        if plan.num_segments > max_segments:
            inner = f'<p class="note">tree not drawn: {plan.num_segments} segments exceed {max_segments}</p>'
        else:
            inner = rounds_legend(plan) + f'<div class="scroll">{tree_svg(plan, id_prefix=f"mb{m}")}</div>'
        opened = ' open="open"' if m < open_trees else ""
        body.append(f'<details id="mb{m}"{opened}><summary>{_e(head)}</summary>{inner}</details>')
    return _page(title, body)


def render(plan, **kwargs) -> str:
    """:func:`render_step_plan` or :func:`render_call_plan` by the plan's type."""
    if isinstance(plan, StepPlan):
        return render_step_plan(plan, **kwargs)
    if isinstance(plan, CallPlan):
        return render_call_plan(plan, **kwargs)
    raise invalid("plan", f"must be a StepPlan or CallPlan, got {type(plan).__name__}")


__all__ = [
    "KEY",
    "PALETTE",
    "render",
    "render_call_plan",
    "render_step_plan",
    "tree_svg",
    "microbatch_grid_svg",
    "rounds_legend",
    "segment_names",
]
