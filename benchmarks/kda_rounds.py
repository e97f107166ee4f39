"""Cost of the ChunkLA contract on the GPU: returning k boundary states (and injecting their
gradients) versus plain fla ``chunk_kda``, and the cost of each extra round.

    PYTHONUNBUFFERED=1 python benchmarks/kda_rounds.py [--tokens 65536] [--heads 16] [--dim 128]

Cases (bf16, H heads, K = V = dim, packed varlen of --seqs equal sequences, fp32 initial states):
  plain          fla.ops.kda.chunk_kda fwd+bwd (output_final_state, initial_state, cu_seqlens)
  states_k       chunk_kda_with_states with k requested boundary states spread over the
                 sequences; backward feeds a gradient to every returned state (k = 0 is our scan
                 with nothing requested)
  rounds_r       the same tokens executed as r sequential rounds: every sequence is cut at chunk
                 boundaries into r parts; round j resumes from states returned by round j - 1
                 (the handoff is differentiable); cost per extra round = (t_r - t_1) / (r - 1).
                 Each round's inputs are gathered once outside the timed region (the gather is
                 the layer's cost, not the operator's), so rounds_1 is states_0's work.
Each case reports forward and forward+backward medians (CUDA events; cases are timed interleaved,
--reps times, and the median over reps is reported) and, for states_k, the overhead versus plain. The target (issue 6) is < 5% for 64 states at T = 65,536.

Robust for a one-shot batch run: every case is caught and reported on its own, and
benchmarks/results/kda_rounds.json is rewritten after each case.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "kda_rounds.json"


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def timed(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def make_inputs(T, H, D, N, dtype, seed=0):
    g_ = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, H, D, device="cuda", generator=g_, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, D, device="cuda", generator=g_), dim=-1).to(dtype)
    v = torch.randn(1, T, H, D, device="cuda", generator=g_, dtype=dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, D, device="cuda", generator=g_) + 3.0).to(dtype)
    beta = torch.rand(1, T, H, device="cuda", generator=g_, dtype=dtype)
    h0 = torch.randn(N, H, D, D, device="cuda", generator=g_) * 0.1
    L = T // N
    cu = [i * L for i in range(N)] + [T]
    return [t.requires_grad_(True) for t in (q, k, v, g, beta, h0)], cu


def spread_requests(cu, B, k):
    """k distinct boundaries spread round-robin over the sequences (c >= 1, c * B <= len)."""
    per_seq = [[(i, c) for c in range(1, (cu[i + 1] - cu[i]) // B + 1)] for i in range(len(cu) - 1)]
    out, depth = [], 0
    while len(out) < k and any(depth < len(p) for p in per_seq):
        for p in per_seq:
            if depth < len(p) and len(out) < k:
                out.append(p[depth])
        depth += 1
    if len(out) < k:
        raise ValueError(f"only {len(out)} boundaries exist, asked for {k}")
    return [r[0] for r in out], [r[1] for r in out]


def open_result(args, **sections):
    """``(result, save)``: the JSON document of a run (config, the given sections, errors) and a
    function that rewrites ``args.out`` with it, so a run cut short keeps what it measured."""
    result = {"config": vars(args) | {"out": str(args.out)}, **sections, "errors": {}}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))

    return result, save


def no_cuda(result, save, out) -> bool:
    """Record and report a missing GPU; True when there is none."""
    if torch.cuda.is_available():
        return False
    result["errors"]["setup"] = "CUDA is not available"
    save()
    log("CUDA is not available; wrote", out)
    return True


def summarize(cases: dict) -> dict:
    """Overheads of states_k versus plain and the cost per extra round, from per-case medians."""
    cases = {n: c for n, c in cases.items() if "fwd_bwd_ms" in c}
    out = {}
    if "plain" in cases:
        base = cases["plain"]["fwd_bwd_ms"]
        for name, c in cases.items():
            if name.startswith("states_"):
                out[f"{name}_overhead_vs_plain"] = c["fwd_bwd_ms"] / base - 1.0
        if "states_64" in cases:
            out["target_64_states_under_5pct"] = out["states_64_overhead_vs_plain"] < 0.05
    if "rounds_1" in cases:
        t1 = cases["rounds_1"]["fwd_bwd_ms"]
        for name, c in cases.items():
            if name.startswith("rounds_") and name != "rounds_1":
                r = int(name.split("_")[1])
                out[f"{name}_ms_per_extra_round"] = (c["fwd_bwd_ms"] - t1) / (r - 1)
    return out


def clear(xs):
    for t in xs:
        t.grad = None


def workload_args(doc: str, out: Path, states: str, iters: int) -> argparse.ArgumentParser:
    """The arguments shared by the KDA benchmarks: the packed call's shape, requested states,
    timing repetitions, output file."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--states", type=str, default=states, help="numbers of requested states to time")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=iters)
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions of every case")
    ap.add_argument("--out", type=Path, default=out)
    return ap


def main():
    ap = workload_args(__doc__, OUT, states="0,1,8,64,256,1024", iters=20)
    ap.add_argument("--rounds", type=str, default="1,2,4,8")
    args = ap.parse_args()

    result, save = open_result(args, env={}, cases={}, summary={})
    if no_cuda(result, save, args.out):
        return 1
    try:
        import fla
        import triton

        result["env"] = {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "fla": getattr(fla, "__version__", "?"),
            "python": platform.python_version(),
        }
    except Exception as e:  # noqa: BLE001
        result["errors"]["setup"] = repr(e)
        save()
        log("setup failed:", e)
        return 1
    save()
    log("env", result["env"])

    from fla.ops.kda import chunk_kda

    from harts_kernels.kda import chunk_kda_with_states

    T, H, D, N, B = args.tokens, args.heads, args.dim, args.seqs, args.chunk
    xs, cu = make_inputs(T, H, D, N, torch.bfloat16)
    cu_t = torch.tensor(cu, device="cuda", dtype=torch.long)
    do = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
    dht = torch.randn(N, H, D, D, device="cuda")

    cases = []  # (name, fwd, fwd+bwd), timed together below

    def add_case(name, fwd, bwd):
        cases.append((name, fwd, bwd))

    # ---------------------------------------------------------------- plain fla
    def plain_fwd():
        return chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu_t)

    def plain_bwd():
        clear(xs)
        o, ft = plain_fwd()
        torch.autograd.backward([o, ft], [do, dht])

    add_case("plain", plain_fwd, plain_bwd)

    # ---------------------------------------------------------------- k requested states
    for k in [int(s) for s in args.states.split(",") if s]:
        try:
            rs, rc = spread_requests(cu, B, k)
        except ValueError as e:
            result["errors"][f"states_{k}"] = str(e)
            save()
            continue
        dbs = torch.randn(k, H, D, D, device="cuda")

        def fwd(rs=rs, rc=rc):
            return chunk_kda_with_states(
                *xs[:5], initial_state=xs[5], cu_seqlens=cu, chunk_size=B, request_seq=rs, request_chunk=rc
            )

        def bwd(fwd=fwd, dbs=dbs, k=k):
            clear(xs)
            o, ft, bs = fwd()
            outs, grads = [o, ft], [do, dht]
            if k:
                outs.append(bs)
                grads.append(dbs)
            torch.autograd.backward(outs, grads)

        add_case(f"states_{k}", fwd, bwd)

    # ---------------------------------------------------------------- r sequential rounds
    L = T // N
    for r in [int(s) for s in args.rounds.split(",") if s]:
        nb = L // B
        if r > nb:
            result["errors"][f"rounds_{r}"] = f"{r} rounds need sequences of >= {r} chunks"
            continue
        cuts = [round(j * nb / r) * B for j in range(r + 1)]  # chunk-aligned parts
        parts = []
        for j in range(r):
            idx = torch.cat(
                [
                    torch.arange(cu[i] + cuts[j], cu[i] + (cuts[j + 1] if j < r - 1 else cu[i + 1] - cu[i]))
                    for i in range(N)
                ]
            ).cuda()
            lens = [(cuts[j + 1] if j < r - 1 else L) - cuts[j]] * (N - 1) + [
                (cuts[j + 1] if j < r - 1 else cu[N] - cu[N - 1]) - cuts[j]
            ]
            cu_j = [0]
            for n in lens:
                cu_j.append(cu_j[-1] + n)
            req_c = (cuts[j + 1] - cuts[j]) // B if j < r - 1 else 0
            # each round's packed inputs are leaves gathered once, outside the timed region: the
            # gather belongs to the layer (measured by train_eval), not to the operator
            sl = [t.detach().index_select(1, idx).requires_grad_(True) for t in xs[:5]]
            parts.append((sl, cu_j, req_c, do.index_select(1, idx)))

        def fwd(parts=parts):
            state = xs[5]
            outs = []
            for sl, cu_j, req_c, _ in parts:
                o, ft, bs = chunk_kda_with_states(
                    *sl,
                    initial_state=state,
                    cu_seqlens=cu_j,
                    chunk_size=B,
                    request_seq=list(range(N)) if req_c else [],
                    request_chunk=[req_c] * N if req_c else [],
                    output_final_state=not req_c,
                )
                outs.append(o)
                state = bs if req_c else ft
            return outs, state

        def bwd(fwd=fwd, parts=parts):
            clear(xs)
            for p in parts:
                clear(p[0])
            outs, ft = fwd()
            torch.autograd.backward(outs + [ft], [p[3] for p in parts] + [dht])

        add_case(f"rounds_{r}", fwd, bwd)

    # ---------------------------------------------------------------- timing
    # Warm every case first (compile + autotune), then time them interleaved, rep after rep, so
    # a drift of the clock or the card over the run hits every case alike; report per-case
    # medians over the reps.
    live = []
    for name, fwd, bwd in cases:
        log(f"case {name}: compiling / warming up ...")
        t0 = time.time()
        try:
            with torch.no_grad():
                fwd()
            bwd()
            torch.cuda.synchronize()
            live.append((name, fwd, bwd))
            result["cases"][name] = {"warmup_s": time.time() - t0}
        except Exception as e:  # noqa: BLE001
            result["errors"][name] = traceback.format_exc()
            log(f"case {name} FAILED: {e!r}")
        save()
    samples = {name: {"fwd": [], "fwd_bwd": []} for name, _, _ in live}
    for rep in range(args.reps):
        for name, fwd, bwd in live:
            try:
                with torch.no_grad():
                    samples[name]["fwd"].append(timed(fwd, args.warmup, args.iters))
                samples[name]["fwd_bwd"].append(timed(bwd, args.warmup, args.iters))
            except Exception as e:  # noqa: BLE001
                result["errors"][f"{name}_rep{rep}"] = traceback.format_exc()
                log(f"case {name} FAILED: {e!r}")
        for name in samples:
            c = result["cases"].setdefault(name, {})
            for kind in ("fwd", "fwd_bwd"):
                if samples[name][kind]:
                    c[f"{kind}_ms"] = statistics.median(samples[name][kind])
                    c[f"{kind}_ms_reps"] = samples[name][kind]
        log(
            f"rep {rep + 1}/{args.reps}: "
            + ", ".join(f"{n} {samples[n]['fwd_bwd'][-1]:.2f}" for n in samples if samples[n]["fwd_bwd"])
        )
        result["summary"] = summarize(result["cases"]) | {"reps_done": rep + 1}
        save()

    result["summary"] = summarize(result["cases"])
    save()
    log("summary", json.dumps(result["summary"], indent=2))
    log("errors:", list(result["errors"]) or "none")
    log("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
