"""Kernel-level cost of our KDA state scan versus fla's, on the same stage inputs.

    PYTHONUNBUFFERED=1 python benchmarks/kda_scan.py [--tokens 65536] [--heads 16] [--dim 128]

The two sequential stages of chunk KDA are the only ones we replace (harts_kernels.kda.state_scan):
  fwd   fla ``chunk_gated_delta_rule_fwd_h``  vs ours ``state_scan_fwd`` with k requested states
  bwd   fla ``chunk_gated_delta_rule_bwd_dhu`` vs ours ``state_scan_bwd`` with k injected gradients
Stage inputs (kg, w, u, qg, gk) come from fla's own forward stages on random KDA inputs, so the
numbers are those of a real call. Every variant is checked against fla's outputs first (error
ratio rmse / rms per tensor), then all variants are timed interleaved, --reps times (median of
--iters CUDA-event timings each), and the median over reps is reported with the ratios
ours / fla. Results go to benchmarks/results/kda_scan.json (rewritten as the run goes).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kda_rounds import log, make_inputs, no_cuda, open_result, spread_requests, timed, workload_args  # noqa: E402,I001

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "kda_scan.json"


def err_ratio(ref, got):
    ref, got = ref.double(), got.double()
    return ((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def main():
    ap = workload_args(__doc__, OUT, states="0,64,1024", iters=30)
    args = ap.parse_args()
    result, save = open_result(args, checks={}, cases={}, summary={})
    if no_cuda(result, save, args.out):
        return 1

    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.kda.wy_fast import recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum

    from harts_kernels.kda.chunk import RCP_LN2, _Plan
    from harts_kernels.kda.state_scan import state_scan_bwd, state_scan_fwd
    from harts_kernels.kda.utils import validate_requests

    T, H, D, N, B = args.tokens, args.heads, args.dim, args.seqs, args.chunk
    scale = D**-0.5
    with torch.no_grad():
        xs, cu = make_inputs(T, H, D, N, torch.bfloat16)
        q, k, v, g, beta, h0 = (t.detach() for t in xs)
        lens = [cu[i + 1] - cu[i] for i in range(N)]
        plan0 = _Plan(validate_requests(lens, B), cu, q.device)
        cu_t, co, ci, nt = plan0.cu_seqlens, plan0.chunk_offsets, plan0.chunk_indices, plan0.num_chunks
        gk = chunk_local_cumsum(g, chunk_size=B, scale=RCP_LN2, cu_seqlens=cu_t, chunk_indices=ci)
        w, u, _, kg, _, Akk = chunk_kda_fwd_intra(
            q=q,
            k=k,
            v=v,
            gk=gk,
            beta=beta,
            scale=scale,
            cu_seqlens=cu_t,
            chunk_size=B,
            chunk_indices=ci,
            safe_gate=False,
            disable_recompute=False,
        )
        _, _, qg, _ = recompute_w_u_fwd(
            k=k, v=v, beta=beta, A=Akk, gk=gk, q=q, cu_seqlens=cu_t, chunk_indices=ci
        )
        gen = torch.Generator(device="cuda").manual_seed(7)
        do = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        dv = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.1
        dht = torch.randn(N, H, D, D, device="cuda", generator=gen)

    def fla_fwd():
        return chunk_gated_delta_rule_fwd_h(
            k=kg,
            w=w,
            u=u,
            gk=gk,
            initial_state=h0,
            output_final_state=True,
            chunk_size=B,
            cu_seqlens=cu_t,
            chunk_indices=ci,
            chunk_offsets=co,
        )

    def fla_bwd():
        return chunk_gated_delta_rule_bwd_dhu(
            q=qg,
            k=kg,
            w=w,
            do=do,
            dv=dv,
            gk=gk,
            h0=h0,
            dht=dht,
            scale=scale,
            cu_seqlens=cu_t,
            chunk_size=B,
            chunk_indices=ci,
            chunk_offsets=co,
        )

    cases = [("fwd_fla", fla_fwd), ("bwd_fla", fla_bwd)]
    with torch.no_grad():
        ref_f, ref_b = fla_fwd(), fla_bwd()
    for kk in [int(s) for s in args.states.split(",") if s]:
        try:
            rs, rc = spread_requests(cu, B, kk)
        except ValueError as e:
            result["errors"][f"states_{kk}"] = str(e)
            continue
        plan = _Plan(validate_requests(lens, B, rs, rc), cu, q.device)
        dbs = torch.randn(plan.num_boundaries, H, D, D, device="cuda", generator=gen) if kk else None

        def ours_fwd(plan=plan):
            return state_scan_fwd(kg, w, u, gk, h0, cu_t, co, nt, B, True, requests=plan.requests)

        def ours_bwd(plan=plan, dbs=dbs):
            return state_scan_bwd(
                qg, kg, w, gk, do, dv, scale, h0, dht, cu_t, co, nt, B, requests=plan.requests, d_boundary=dbs
            )

        # correctness against fla on the shared outputs (h, v_new, ht; dh, dh0, dv2)
        try:
            with torch.no_grad():
                h, vn, ht, bs = ours_fwd()
                dh, dh0, dv2 = ours_bwd()
            chk = {
                "h": err_ratio(ref_f[0], h),
                "v_new": err_ratio(ref_f[1], vn),
                "ht": err_ratio(ref_f[2], ht),
            }
            if kk == 0:
                chk |= {
                    "dh": err_ratio(ref_b[0], dh),
                    "dh0": err_ratio(ref_b[1], dh0),
                    "dv2": err_ratio(ref_b[2], dv2),
                }
            else:  # requested states equal fla's h at those chunks (h is bf16: bf16-level error)
                offs = validate_requests(lens, B).chunk_offsets  # distinct requests: rows in request order
                inside = [r for r in range(kk) if rc[r] < (lens[rs[r]] + B - 1) // B]  # not final
                if inside:
                    idx = torch.tensor([offs[rs[r]] + rc[r] for r in inside], device="cuda")
                    chk["states_vs_fla_h"] = err_ratio(
                        ref_f[0][0, idx].float(), bs[torch.tensor(inside, device="cuda")]
                    )
            result["checks"][f"states_{kk}"] = chk
            log(f"check states_{kk}: " + ", ".join(f"{n} {e:.2e}" for n, e in chk.items()))
        except Exception as e:  # noqa: BLE001
            result["errors"][f"check_{kk}"] = traceback.format_exc()
            log(f"check states_{kk} FAILED: {e!r}")
        cases += [(f"fwd_ours_{kk}", ours_fwd), (f"bwd_ours_{kk}", ours_bwd)]
    save()

    samples = {name: [] for name, _ in cases}
    for rep in range(args.reps):
        for name, fn in cases:
            try:
                with torch.no_grad():
                    samples[name].append(timed(fn, args.warmup, args.iters))
            except Exception as e:  # noqa: BLE001
                result["errors"][f"{name}_rep{rep}"] = traceback.format_exc()
                log(f"{name} FAILED: {e!r}")
        for name, ts in samples.items():
            if ts:
                result["cases"][name] = {"ms": statistics.median(ts), "ms_reps": ts}
        log(
            f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{n} {ts[-1]:.3f}" for n, ts in samples.items() if ts)
        )
        save()

    c = result["cases"]
    for stage in ("fwd", "bwd"):
        if f"{stage}_fla" in c:
            base = c[f"{stage}_fla"]["ms"]
            for name in c:
                if name.startswith(f"{stage}_ours_"):
                    result["summary"][f"{name}_vs_fla"] = c[name]["ms"] / base
    save()
    log("summary", json.dumps(result["summary"], indent=2))
    log("errors:", list(result["errors"]) or "none")
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    log(f"done in {time.time() - t0:.0f} s")
    sys.exit(rc)
