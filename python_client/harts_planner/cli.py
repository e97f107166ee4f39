"""`harts-planner`: command-line entry point.

Subcommands
-----------
demo    generate the built-in SWE-like synthetic step, ingest it and print what was found.
synth   write a synthetic batch to a file (``.hrb`` binary or ``.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from harts_planner._progress import Progress


def _ingest_with_progress(tokens, offsets, tree_ids, quiet: bool):
    from harts_planner.batch import RolloutBatch

    bar = Progress("ingest", enabled=not quiet)
    bar(0, 1)
    batch = RolloutBatch.from_arrays(tokens, offsets, tree_ids)
    bar(1, 1)
    return batch, bar.close()


def cmd_demo(args: argparse.Namespace) -> int:
    from harts_planner import synth

    t0 = time.perf_counter()
    bar = Progress("generate", enabled=not args.quiet)
    syn = synth.generate(args.preset, seed=args.seed, progress=bar)
    gen_s = bar.close()
    batch, ingest_s = _ingest_with_progress(syn.tokens, syn.offsets, syn.tree_ids, args.quiet)
    stats = batch.stats()
    stats.update(preset=args.preset, seed=args.seed, generate_seconds=gen_s, ingest_seconds=ingest_s,
                 ingest_tokens_per_second=batch.semantic_tokens / ingest_s if ingest_s else None,
                 total_seconds=time.perf_counter() - t0)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    rows = [
        ("preset", f"{args.preset} (seed {args.seed})"),
        ("trajectories", f"{stats['trajectories']:,}"),
        ("rollout trees", f"{stats['trees']:,}"),
        ("semantic tokens S", f"{stats['semantic_tokens']:,}"),
        ("compact tokens C", f"{stats['compact_tokens']:,}"),
        ("compression S/C", f"{stats['compression']:.2f}x"),
        ("segments", f"{stats['segments']:,}"),
        ("tree depth", f"{stats['max_depth_segments']} segments max, "
                       f"{stats['max_trajectory_tokens']:,} tokens max "
                       f"({stats['mean_trajectory_tokens']:,.0f} mean per trajectory)"),
        ("fan-out", f"{stats['forks']:,} forks, max {stats['max_fanout']}, "
                    f"mean {stats['mean_fanout_at_forks']:.2f} at forks"),
        ("time", f"generate {gen_s:.2f}s, ingest {ingest_s:.2f}s "
                 f"({stats['ingest_tokens_per_second'] / 1e6:.1f}M tokens/s)"),
    ]
    width = max(len(k) for k, _ in rows)
    print("HARTS demo: synthetic rollout step -> compact trie")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from harts_planner import synth
    from harts_planner.batch_io import save_batch

    bar = Progress("generate", enabled=not args.quiet)
    syn = synth.generate(args.preset, seed=args.seed, progress=bar)
    bar.close()
    save_batch(args.output, syn.tokens, syn.offsets, syn.tree_ids)
    print(f"wrote {args.output}: {len(syn.offsets) - 1:,} trajectories, {len(syn.tokens):,} tokens")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harts-planner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="generate a SWE-like synthetic step, ingest it, print a summary")
    d.add_argument("--preset", default="swe-like", help="synthetic preset (default: swe-like)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    d.add_argument("--quiet", action="store_true", help="no progress bars")
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("synth", help="write a synthetic batch (.hrb or .jsonl)")
    s.add_argument("output")
    s.add_argument("--preset", default="swe-like")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=cmd_synth)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # HartsError and friends: clear message, no traceback
        print(f"harts-planner: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
