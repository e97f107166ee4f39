"""`harts-planner plan` and `harts-planner show`: plan a saved batch, in-process or on a sidecar
(``--target``), and print the plan (a summary table or JSON) or render it as an HTML/SVG page.

:func:`load_batch` and :func:`tls_client` are shared with ``bench``
(:mod:`harts_planner.commands.sidecar`).
"""

from __future__ import annotations

import argparse
import json


def load_batch(path: str):
    from harts_planner.batch import RolloutBatch

    return RolloutBatch.load(path)


def tls_client(args: argparse.Namespace) -> dict:
    """The Planner's TLS arguments of a command with --target (``--tls-ca`` / ``--tls-cert`` /
    ``--tls-key``)."""
    return {
        "tls_ca": getattr(args, "tls_ca", None),
        "tls_cert": getattr(args, "tls_cert", None),
        "tls_key": getattr(args, "tls_key", None),
    }


def _plan_file(args: argparse.Namespace, call_plans: bool):
    """Plan args.file with the step arguments of ``plan`` / ``show``."""
    from harts_planner.bench import payload
    from harts_planner.planner import Planner

    batch = load_batch(args.file)
    with Planner(args.target, **tls_client(args)) as planner:
        source = batch if args.target is None else payload(batch, args.request)
        return batch, planner.plan_step(
            source, args.dp, args.capacity, args.chunk_size, call_plans=call_plans
        )


def cmd_plan(args: argparse.Namespace) -> int:
    batch, plan = _plan_file(args, call_plans=args.call_plans)
    if args.json:
        out = plan.to_dict()
        if args.call_plans:
            out["call_plans"] = [c.to_dict(segments=False) for c in plan.call_plans()]
        print(json.dumps(out, indent=2))
        return 0
    j, m = plan.objective, plan.metrics
    where = f"sidecar {args.target} ({args.request} request)" if args.target else "in-process"
    print(
        f"HARTS step plan of {args.file}: {batch.num_trajectories:,} trajectories, "
        f"{batch.semantic_tokens:,} tokens, {batch.compact_tokens:,} compact ({where})"
    )
    rows = [
        ("D / T / B", f"{plan.dp_size} / {plan.capacity:,} / {plan.chunk_size}"),
        ("microbatches K (slots)", f"{plan.num_microbatches} ({plan.num_slots})"),
        ("J (total, slot-critical, max replica)", f"({j[0]:,}, {j[1]:,}, {j[2]:,})"),
        ("total work / batch compact tokens", f"{j[0] / plan.compact_tokens:.4f}"),
        ("slot imbalance P50 / P95", f"{m['slot_imbalance_p50']:.3%} / {m['slot_imbalance_p95']:.3%}"),
        ("step imbalance", f"{m['step_imbalance']:.3%}"),
        ("selected candidate", f"{plan.source} ({len(plan.candidates)} compared)"),
        ("time", f"{plan.wall_seconds * 1e3:.1f} ms (planner {plan.planning_seconds * 1e3:.1f} ms)"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    calls = plan.call_plans() if args.call_plans else None
    print(
        f"\n  {'mb':>4} {'replica':>7} {'slot':>5} {'traj':>6} {'work':>10} {'of T':>6}"
        + (f" {'calls':>5} {'replay':>8}" if calls else "")
    )
    for i in range(plan.num_microbatches):
        line = (
            f"  {i:>4} {int(plan.replica[i]):>7} {int(plan.slot[i]):>5} {len(plan.microbatches[i]):>6} "
            f"{int(plan.work[i]):>10,} {int(plan.work[i]) / plan.capacity:>6.1%}"
        )
        if calls:
            line += f" {calls[i].num_calls:>5} {calls[i].replay_tokens:>8,}"
        print(line)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from harts_planner import viewer

    _, plan = _plan_file(args, call_plans=True)
    html = viewer.render_step_plan(
        plan, title=args.title or f"HARTS plan of {args.file}", max_segments=args.max_segments
    )
    output = args.output or (str(args.file).rsplit(".", 1)[0] + ".html")
    with open(output, "w", encoding="utf-8") as f:
        f.write(html)
    k, segments = plan.num_microbatches, sum(c.num_segments for c in plan.call_plans())
    print(
        f"wrote {output}: {k} microbatch{'' if k == 1 else 'es'}, "
        f"{segments:,} segment{'' if segments == 1 else 's'}"
    )
    return 0


__all__ = ["cmd_plan", "cmd_show", "load_batch", "tls_client"]
