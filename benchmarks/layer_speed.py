"""Per-layer speed against the production reference of the same math (issue 15's benchmark).

Every case builds its layers with the same weights, checks parity first (relative error
``||ours - ref|| / ||ref||`` of the output and of every gradient, printed and stored), then times
warm repeats only (``--reps``, median / min / max ms): the parity pass is each side's first call
(compilation, autotuning), excluded from the timings and reported as the case's ``first_pass_s``;
every measurement also excludes and reports its own first pass. Device times come from CUDA events
(``time.perf_counter`` after a synchronize on the CPU). bf16 on CUDA, float32 on the CPU. Cases
(``--cases``):

* ``kda``: the KDA layer at ``ling-tiny``'s shape (D = 1,536, H = 16, K = V = 128, conv 4, chunk 64)
  on 65,536 packed rows in 8 trajectories (24k, 16k, 9k, 6k, 4k, 3k, 2k, 1.5k tokens scaled to
  sum exactly to ``--rows``): fla's ``fla.layers.KimiDeltaAttention`` (flash-linear-attention 0.6,
  ``mode="chunk"``, packed input ``[1, T, D]`` with ``cu_seqlens``; our state dict loaded with
  ``strict=True``) against ``KDALayer.forward_trajectories(x, offsets)``; fwd and fwd+bwd ms.
* ``kda_compact``: ``KDALayer.forward(x, layout)`` on a real ``swe-like`` compact microbatch (one
  HARTS microbatch at T = ``--rows``, built as ``train_eval.py`` builds it), against the trajectory
  path on the same number of packed rows (compact rows + replay rows: the rounds'
  ``cu_seqlens[-1]`` summed), in the same 8-trajectory profile and, as a detail, in the rounds' own
  sequence lengths. ``kda_compact_vs_trajectory`` = (compact ms / packed rows) / (trajectory ms /
  its rows). Parity: the compact layer against the trajectory layer on the microbatch's expanded
  trajectories (outputs mapped to their rows, gradients accumulated onto them).
* ``gdn``: the Gated DeltaNet layer at Qwen3.5-35B-A3B's shape (D = 2,048, Hk = 16, Hv = 32,
  K = V = 128, conv 4, chunk 64): ``CompactGatedDeltaNet.forward_trajectories`` against fla's
  ``fla.layers.GatedDeltaNet`` with our weights mapped onto it (``in_proj_q`` / ``in_proj_k`` /
  ``in_proj_v`` / ``in_proj_a`` / ``in_proj_b`` / ``in_proj_z`` = ``q_proj`` / ``k_proj`` /
  ``v_proj`` / ``a_proj`` / ``b_proj`` / ``g_proj``, the q / k / v convolutions under the same
  names, ``norm`` = ``o_norm``, ``out_proj`` = ``o_proj``). Each side is caught on its own:
  fla 0.6's gated-delta-rule backward may raise on Hopper with some Triton builds, which is then
  recorded as ``status: "error: ..."``.
* ``attention``: the compact attention op alone (``harts_runtime.ops.attention.compact_attention``,
  views gather + kernel + scatter; for view backends also the kernel on pre-gathered Q / KV) at MLA
  (Hq = Hkv = 16, Dqk = 192, Dv = 128) and GQA (16 / 4 / 128 / 128) shapes on the compact
  microbatch's views, every backend of ``available_backends(device)``; the fastest fwd+bwd is
  marked. Parity: every backend against the first that ran (``varlen`` on CUDA).
* ``moe``: ``CompactMoE`` at ``ling-tiny``'s shape (``--rows`` rows, D = 1,536, 128 experts top-8,
  width 512, 1 shared expert) fwd+bwd against a roofline: the same FLOPs on one dense bf16 GEMM
  timed in the same run; host time (until the call returns) next to wall and device time, and the
  host synchronizations counted (``torch.cuda.set_sync_debug_mode``). Parity: grouped experts
  against the per-expert loop reference with the same weights.

Top-level keys: ``kda_fwdbwd_vs_fla`` (ours / fla, trajectory path), ``kda_compact_vs_trajectory``
(per packed row), and from a ``train_eval.py`` result (``--train-eval PATH``, its JSON or --out
folder) ``model_tflops`` (F/B/Grad TFLOP/s of the compact mode, ``harts_runtime.flops``),
``device_busy`` (its breakdown's device-busy share of wall) and ``speedup_vs_ideal`` (F/B/Grad
speedup / ideal work compression); null where unavailable. The JSON is rewritten after every case
(a killed run keeps what finished); a progress line is printed per case.

GPU run (H200; the full train_eval run first, then this)::

    python benchmarks/train_eval.py --layers 24 --out benchmarks/results/train_eval_24 --budget-s 420
    python benchmarks/layer_speed.py --train-eval benchmarks/results/train_eval_24

CPU smoke test (tiny shapes, float32, a few hundred rows, fla skipped: its kernels need CUDA)::

    python benchmarks/layer_speed.py --tiny --out /tmp/layer_speed.json

A non-tiny run also replaces the generated block of ``benchmarks/README.md`` (between the
``layer_speed`` markers; ``--no-readme`` to skip).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for extra in (str(ROOT / "kernels"), str(ROOT), str(HERE)):
    if extra not in sys.path:
        sys.path.insert(0, extra)
sys.path.append(str(ROOT / "python_client"))

from readme_blocks import update_readme  # noqa: E402

from harts_planner import DEFAULT_CAPACITY  # noqa: E402

CASES = ("kda", "kda_compact", "gdn", "attention", "moe")
TOP_KEYS = (
    "kda_fwdbwd_vs_fla",
    "kda_compact_vs_trajectory",
    "model_tflops",
    "device_busy",
    "speedup_vs_ideal",
)
BEGIN, END = "<!-- layer_speed:begin -->", "<!-- layer_speed:end -->"
PROFILE = (24_000, 16_000, 9_000, 6_000, 4_000, 3_000, 2_000, 1_500)
"""Trajectory lengths of the packed trajectory cases, scaled to sum to the row count."""
ATTN_SHAPES = {"mla": (16, 16, 192, 128), "gqa": (16, 4, 128, 128)}  # Hq, Hkv, Dqk, Dv
TINY_ATTN_SHAPES = {"mla": (2, 2, 12, 8), "gqa": (4, 2, 8, 8)}
KDA_SHAPE = {"hidden_size": 1536, "num_heads": 16, "head_k_dim": 128, "head_v_dim": 128, "conv_size": 4}
TINY_KDA_SHAPE = {"hidden_size": 32, "num_heads": 2, "head_k_dim": 16, "head_v_dim": 16, "conv_size": 4}
GDN_SHAPE = {"hidden_size": 2048, "num_k_heads": 16, "num_v_heads": 32, "head_k_dim": 128, "head_v_dim": 128}
TINY_GDN_SHAPE = {"hidden_size": 32, "num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 8, "head_v_dim": 8}
SDPA_MASK_LIMIT = 4 * 2**30  # bytes of the padded boolean mask beyond which sdpa is skipped
DENSE_TREE_ROWS = 8192  # dense_tree builds a [C, C] mask: only below this many rows


def log(msg: str) -> None:
    print(f"[layer_speed {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def short_error(e: BaseException) -> str:
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


# ------------------------------------------------------------------------------ timing
def bench(fn, dev: torch.device, reps: int, warmup: int = 1) -> dict:
    """Time ``fn()``: one first pass (compilation, autotuning; reported, not counted), ``warmup``
    more untimed passes, then ``reps`` timed warm repeats (CUDA events, or perf_counter after a
    synchronize on the CPU). Returns milliseconds (median, min, max) and ``first_pass_s``."""
    sync(dev)
    t = time.perf_counter()
    fn()
    sync(dev)
    first = time.perf_counter() - t
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(dev)
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return {
        "ms": statistics.median(times),
        "ms_min": min(times),
        "ms_max": max(times),
        "reps": reps,
        "first_pass_s": first,
    }


class FirstPasses(dict):
    """Seconds of each side's first forward + backward, taken in its parity pass, which is the
    first call of every kernel (compilation and autotuning included): ``with passes("ours"): ...``."""

    def __init__(self, dev: torch.device):
        super().__init__()
        self.dev = dev

    @contextlib.contextmanager
    def __call__(self, name: str):
        sync(self.dev)
        t = time.perf_counter()
        yield
        sync(self.dev)
        self[name] = time.perf_counter() - t


def fwd_and_fwdbwd(call, inputs: list, params: list, gy: torch.Tensor, dev, reps: int) -> dict:
    """Time ``call()`` under no_grad (``fwd``) and ``call()`` plus ``torch.autograd.grad`` of
    ``<y, gy>`` into ``inputs`` and ``params`` (``fwdbwd``; nothing accumulates between repeats)."""
    wrt = [t for t in inputs + params if t.requires_grad]

    def fwd():
        with torch.no_grad():
            call()

    def fwdbwd():
        torch.autograd.grad(call(), wrt, gy, allow_unused=True)

    return {"fwd": bench(fwd, dev, reps), "fwdbwd": bench(fwdbwd, dev, reps)}


def try_time(call, inputs, params, gy, dev, reps) -> dict:
    """:func:`fwd_and_fwdbwd` with its failure recorded as ``status`` instead of raised."""
    try:
        out = fwd_and_fwdbwd(call, inputs, params, gy, dev, reps)
        out["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - one side failing (e.g. an fla backward) must not end the case
        out = {"status": short_error(e), "traceback": traceback.format_exc()}
        free(dev)
    return out


def fla_runs_on(dev: torch.device) -> bool:
    """fla's layers run through Triton: on CUDA, or on the CPU under ``TRITON_INTERPRET=1`` (checks)."""
    return dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def free(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ parity
def rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    """``||a - b|| / ||b||`` in float64 (None when a gradient is missing on either side)."""
    if a is None or b is None:
        return None
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def grads_of(y: torch.Tensor, gy: torch.Tensor, named: dict) -> dict:
    """Gradients of ``<y, gy>`` into every tensor of ``named`` (name -> tensor)."""
    names = [n for n, t in named.items() if t.requires_grad]
    g = torch.autograd.grad(y, [named[n] for n in names], gy, allow_unused=True)
    return dict(zip(names, g))


def parity_record(y, y_ref, g, g_ref) -> dict:
    """Output and per-tensor gradient relative errors (ours against the reference), and the max."""
    errs = {"y": rel(y, y_ref)}
    for n in g_ref:
        errs["d" + n] = rel(g.get(n), g_ref[n])
    vals = [v for v in errs.values() if v is not None]
    return {
        "status": "ok",
        "y_rel_err": errs["y"],
        "max_grad_rel_err": max((v for k, v in errs.items() if k != "y" and v is not None), default=None),
        "max_rel_err": max(vals) if vals else None,
        "rel_err": errs,
    }


def print_parity(name: str, p: dict) -> None:
    if p.get("status") != "ok":
        log(f"{name} parity: {p.get('status')}")
        return
    worst = max(((k, v) for k, v in p["rel_err"].items() if v is not None), key=lambda kv: kv[1])
    log(
        f"{name} parity: y {p['y_rel_err']:.2e}, max grad {p['max_grad_rel_err']:.2e} "
        f"(worst {worst[0]} {worst[1]:.2e})"
    )


# ------------------------------------------------------------------------------ shapes and data
def scaled_lengths(total: int, base=PROFILE) -> list[int]:
    """``base`` scaled to integers summing exactly to ``total`` (largest remainders first)."""
    base = np.asarray(base, dtype=np.float64)
    raw = base * total / base.sum()
    out = np.floor(raw).astype(np.int64)
    for i in np.argsort(-(raw - out), kind="stable")[: total - int(out.sum())]:
        out[i] += 1
    out = np.maximum(out, 1)
    out[int(np.argmax(out))] += total - int(out.sum())
    return out.tolist()


def scan_critical_chunks(sched, chunk: int, packed: int) -> dict:
    """Chunk steps on the state scan's critical path (each (sequence, head) scans its chunks one
    after another; rounds run one after another): the compact schedule (the sum over rounds of
    each round's longest sequence), its sequences in one call, and the 8-trajectory profile on
    the same packed rows. The scan is latency-bound, so its time follows these, not the rows."""
    steps = lambda lengths: max((-(-int(n) // chunk) for n in lengths), default=0)  # noqa: E731
    rounds = [np.diff(np.asarray(rd.cu_seqlens)) for rd in sched.rounds]
    return {
        "compact": int(sum(steps(r) for r in rounds)),
        "trajectory_same_sequences": steps(np.concatenate(rounds)) if rounds else 0,
        "trajectory": steps(scaled_lengths(packed)),
    }


def offsets_of(lengths) -> list[int]:
    return [0, *np.cumsum(lengths).tolist()]


def randn(shape, dev, dtype, gen, scale=1.0, grad=False) -> torch.Tensor:
    t = (torch.randn(shape, generator=gen, device=dev, dtype=torch.float32) * scale).to(dtype)
    return t.requires_grad_(grad)


def kda_config(args, chunk: int):
    from harts_runtime.layers.kda import KDAConfig

    shape = TINY_KDA_SHAPE if args.tiny else KDA_SHAPE
    return KDAConfig(**shape, chunk_size=chunk, norm_eps=1e-5)


class Context:
    """What the cases share: device, dtype, generator, and the compact microbatch (built once)."""

    def __init__(self, args):
        self.args = args
        self.dev = torch.device(args.device)
        self.dtype = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        self.chunk = 16 if args.tiny else 64
        self._mb = None

    def gen(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.dev).manual_seed(self.args.seed * 1000 + seed)

    def microbatch(self):
        """One compact microbatch of a ``swe-like`` step at T = --rows (``train_eval.make_slice``:
        the step's microbatch of median compression), with its call plan and the step."""
        if self._mb is None:
            import train_eval

            from harts_runtime import compact_microbatch, model_config, plan_microbatches

            a = self.args
            cfg = model_config("ling-tiny", 1)
            if a.tiny:
                cfg = train_eval.tiny_config(cfg).replace(chunk_size=self.chunk)
            slice_args = argparse.Namespace(tiny=a.tiny, preset=a.preset, chunk_size=cfg.chunk_size)
            t = time.perf_counter()
            step = train_eval.make_slice(slice_args, a.rows, None, 1, a.seed, cfg.vocab_size, preset=a.preset)
            mbs, plans, _ = plan_microbatches(step, "compact", a.rows, cfg)
            mb = compact_microbatch(step, plans[0], cfg, self.dev)
            kda = mb.layout.kda
            packed = kda.replay.packed_rows
            seqs = [int(n) for rd in kda.replay.rounds for n in np.diff(rd.cu_seqlens)]
            self._mb = {
                "step": step,
                "plan": plans[0],
                "mb": mb,
                "cfg": cfg,
                "packed_rows": packed,
                "sequence_lengths": seqs,
                "info": {
                    **train_eval.batch_info(step),
                    "preset": a.preset,
                    "capacity": a.rows,
                    "microbatch_trajectories": len(mb.trajectories),
                    "compact_rows": mb.num_rows,
                    "semantic_rows": mb.semantic_tokens,
                    "replay_rows": int(plans[0].replay_tokens),
                    "packed_rows": packed,
                    "rounds": kda.num_calls,
                    "packed_sequences": len(seqs),
                    "attention_branches": mb.layout.views.num_branches,
                    "attention_kv_rows": int(mb.layout.views.kv_index.numel()),
                    "scan_critical_chunks": scan_critical_chunks(kda.replay, cfg.chunk_size, packed),
                    "build_s": time.perf_counter() - t,
                },
            }
            log(f"compact microbatch: {self._mb['info']}")
        return self._mb


# ------------------------------------------------------------------------------ cases
def case_kda(ctx: Context) -> dict:
    from harts_runtime.layers.kda import KDALayer

    a, dev, dt = ctx.args, ctx.dev, ctx.dtype
    rows = a.tiny_rows if a.tiny else a.rows
    lengths = scaled_lengths(rows)
    offsets = offsets_of(lengths)
    cfg = kda_config(a, ctx.chunk)
    torch.manual_seed(a.seed)
    ours = KDALayer(cfg)
    res = {
        "shape": vars(cfg),
        "rows": rows,
        "trajectory_lengths": lengths,
        "dtype": str(dt).replace("torch.", ""),
    }
    g = ctx.gen(1)
    x = randn((rows, cfg.hidden_size), dev, dt, g, grad=True)
    gy = randn((rows, cfg.hidden_size), dev, dt, g)
    ours = ours.to(dev, dt)
    theirs, why = None, None
    if not fla_runs_on(dev):
        why = "skipped: fla's KimiDeltaAttention runs only through Triton on CUDA"
    else:
        try:
            from fla.layers import KimiDeltaAttention

            theirs = KimiDeltaAttention(
                hidden_size=cfg.hidden_size,
                head_dim=cfg.head_k_dim,
                expand_v=cfg.head_v_dim / cfg.head_k_dim,
                num_heads=cfg.num_heads,
                mode="chunk",
                use_short_conv=True,
                conv_size=cfg.conv_size,
                norm_eps=cfg.norm_eps,
            )
            theirs.load_state_dict(ours.state_dict(), strict=True)
            theirs = theirs.to(dev, dt)
        except Exception as e:  # noqa: BLE001 - a missing or incompatible fla is a recorded result
            why, theirs = f"unavailable: {short_error(e)}", None
    cu = torch.tensor(offsets, device=dev, dtype=torch.int32)
    call_ours = lambda: ours.forward_trajectories(x, offsets)
    call_fla = lambda: theirs(x[None], cu_seqlens=cu)[0][0]
    passes = res["first_pass_s"] = FirstPasses(dev)
    if theirs is not None:
        try:
            named_o = {"x": x, **dict(ours.named_parameters())}
            named_t = {"x": x, **dict(theirs.named_parameters())}
            with passes("ours"):
                y_o = call_ours()
                g_o = grads_of(y_o, gy, named_o)
            with passes("fla"):
                y_t = call_fla()
                g_t = grads_of(y_t, gy, named_t)
            res["parity"] = parity_record(y_o, y_t, g_o, g_t)
            del y_o, y_t, g_o, g_t
        except Exception as e:  # noqa: BLE001
            res["parity"] = {"status": short_error(e), "traceback": traceback.format_exc()}
    else:
        res["parity"] = {"status": why}
    print_parity("kda", res["parity"])
    return time_against_fla(res, (call_ours, ours), (call_fla, theirs), why, x, gy, dev, a.reps)


def time_against_fla(res: dict, ours, theirs, why, x, gy, dev, reps: int) -> dict:
    """Warm fwd / fwd+bwd timings of our layer and fla's (``(call, module)`` each; fla's None:
    ``why``) into ``res``, with the two ratios; returns ``res``."""
    res["ours"] = try_time(ours[0], [x], list(ours[1].parameters()), gy, dev, reps)
    if theirs[1] is not None:
        res["fla"] = try_time(theirs[0], [x], list(theirs[1].parameters()), gy, dev, reps)
    else:
        res["fla"] = {"status": why}
    res["fwd_vs_fla"] = ratio(res["ours"], res["fla"], "fwd")
    res["fwdbwd_vs_fla"] = ratio(res["ours"], res["fla"], "fwdbwd")
    return res


def ratio(a: dict, b: dict, key: str) -> float | None:
    try:
        return a[key]["ms"] / b[key]["ms"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def case_kda_compact(ctx: Context) -> dict:
    from harts_runtime.layers.kda import KDALayer

    a, dev, dt = ctx.args, ctx.dev, ctx.dtype
    m = ctx.microbatch()
    mb, plan, step = m["mb"], m["plan"], m["step"]
    cfg = kda_config(a, m["cfg"].chunk_size)
    torch.manual_seed(a.seed)
    layer = KDALayer(cfg).to(dev, dt)
    params = list(layer.parameters())
    c, packed = mb.num_rows, m["packed_rows"]
    res = {"shape": vars(cfg), "microbatch": m["info"], "dtype": str(dt).replace("torch.", "")}
    g = ctx.gen(2)
    x = randn((c, cfg.hidden_size), dev, dt, g, grad=True)
    gy = randn((c, cfg.hidden_size), dev, dt, g)
    layout = mb.layout

    # parity: the compact layer against the same layer on the microbatch's expanded trajectories
    passes = res["first_pass_s"] = FirstPasses(dev)
    try:
        s2p = torch.from_numpy(np.asarray(plan.semantic_to_physical, dtype=np.int64)).to(dev)
        off = np.asarray(step.batch.offsets, dtype=np.int64)
        traj = np.asarray(plan.trajectories, dtype=np.int64)
        t_off = offsets_of((off[traj + 1] - off[traj]).tolist())
        gy_sem = randn((s2p.numel(), cfg.hidden_size), dev, dt, g)
        # a compact row's output gradient is the sum over the positions that share it (fp32 sums)
        gy_c = torch.zeros(c, cfg.hidden_size, device=dev).index_add_(0, s2p, gy_sem.float()).to(dt)
        named = {"x": x, **dict(layer.named_parameters())}
        with passes("compact"):
            y_c = layer(x, layout)
            g_c = grads_of(y_c, gy_c, named)
        x_sem = x.detach()[s2p].requires_grad_(True)
        with passes("trajectory_expanded"):
            y_t = layer.forward_trajectories(x_sem, t_off)
            g_t = grads_of(y_t, gy_sem, {"x": x_sem, **dict(layer.named_parameters())})
        g_t["x"] = torch.zeros(x.shape, device=dev).index_add_(0, s2p, g_t["x"].float())
        res["parity"] = parity_record(y_c[s2p], y_t, g_c, g_t)
        res["parity"]["reference"] = f"forward_trajectories on the {s2p.numel():,} expanded rows"
        del y_c, y_t, g_c, g_t, x_sem, gy_sem, gy_c
    except Exception as e:  # noqa: BLE001
        res["parity"] = {"status": short_error(e), "traceback": traceback.format_exc()}
    free(dev)
    print_parity("kda_compact", res["parity"])

    res["compact"] = try_time(lambda: layer(x, layout), [x], params, gy, dev, a.reps)
    res["compact"].update(compact_rows=c, packed_rows=packed)
    if res["compact"].get("status") == "ok":
        try:
            res["compact_kernels"] = kernel_profile(lambda: layer(x, layout), [x], params, gy, dev)
        except Exception as e:  # noqa: BLE001
            res["compact_kernels"] = {"status": short_error(e)}
    variants = {
        "trajectory": scaled_lengths(packed),  # the 8-trajectory profile on the packed row count
        "trajectory_same_sequences": m["sequence_lengths"],  # the rounds' own sequences, one call
    }
    for name, lengths in variants.items():
        offs = offsets_of(lengths)
        xt = randn((packed, cfg.hidden_size), dev, dt, g, grad=True)
        gyt = randn((packed, cfg.hidden_size), dev, dt, g)
        r = try_time(
            lambda xt=xt, offs=offs: layer.forward_trajectories(xt, offs), [xt], params, gyt, dev, a.reps
        )
        r.update(rows=packed, sequences=len(lengths))
        if name == "trajectory" and r.get("status") == "ok":
            try:
                r["kernels"] = kernel_profile(
                    lambda xt=xt, offs=offs: layer.forward_trajectories(xt, offs), [xt], params, gyt, dev
                )
            except Exception as e:  # noqa: BLE001
                r["kernels"] = {"status": short_error(e)}
        res[name] = r
        del xt, gyt
        free(dev)
    for name in variants:
        for key in ("fwd", "fwdbwd"):
            try:
                per_c = res["compact"][key]["ms"] / packed
                per_t = res[name][key]["ms"] / res[name]["rows"]
                res[f"{key}_compact_vs_{name}"] = per_c / per_t
            except (KeyError, TypeError, ZeroDivisionError):
                res[f"{key}_compact_vs_{name}"] = None
    res["compact_vs_trajectory"] = res["fwdbwd_compact_vs_trajectory"]
    return res


_GDN_FLA_NAMES = {
    "A_log": "A_log",
    "dt_bias": "dt_bias",
    "in_proj_q.weight": "q_proj.weight",
    "in_proj_k.weight": "k_proj.weight",
    "in_proj_v.weight": "v_proj.weight",
    "in_proj_a.weight": "a_proj.weight",
    "in_proj_b.weight": "b_proj.weight",
    "q_conv1d.weight": "q_conv1d.weight",
    "k_conv1d.weight": "k_conv1d.weight",
    "v_conv1d.weight": "v_conv1d.weight",
    "in_proj_z.weight": "g_proj.weight",
    "norm.weight": "o_norm.weight",
    "out_proj.weight": "o_proj.weight",
}
"""Our split-projection GDN parameter names -> fla ``GatedDeltaNet``'s."""


def gdn_to_fla(sd: dict) -> dict:
    """Our split-projection GDN state dict as fla ``GatedDeltaNet``'s."""
    return {fla: sd[ours] for ours, fla in _GDN_FLA_NAMES.items()}


def fla_grads_as_ours(g: dict) -> dict:
    """fla GatedDeltaNet gradients under our parameter names."""
    return {"x": g.get("x"), **{ours: g.get(fla) for ours, fla in _GDN_FLA_NAMES.items()}}


def case_gdn(ctx: Context) -> dict:
    from harts_runtime.layers.gdn import CompactGatedDeltaNet, GatedDeltaNetConfig

    a, dev, dt = ctx.args, ctx.dev, ctx.dtype
    rows = a.tiny_rows if a.tiny else a.rows
    lengths = scaled_lengths(rows)
    offsets = offsets_of(lengths)
    shape = TINY_GDN_SHAPE if a.tiny else GDN_SHAPE
    cfg = GatedDeltaNetConfig(
        **shape, conv_kernel_size=4, norm_eps=1e-6, projection="split", chunk_size=ctx.chunk
    )
    torch.manual_seed(a.seed)
    ours = CompactGatedDeltaNet(cfg).to(dev, dt)
    res = {
        "shape": vars(cfg),
        "rows": rows,
        "trajectory_lengths": lengths,
        "dtype": str(dt).replace("torch.", ""),
    }
    g = ctx.gen(3)
    x = randn((rows, cfg.hidden_size), dev, dt, g, grad=True)
    gy = randn((rows, cfg.hidden_size), dev, dt, g)
    theirs, why = None, None
    if not fla_runs_on(dev):
        why = "skipped: fla's GatedDeltaNet runs only through Triton on CUDA"
    else:
        try:
            from fla.layers import GatedDeltaNet

            theirs = GatedDeltaNet(
                hidden_size=cfg.hidden_size,
                expand_v=cfg.head_v_dim / cfg.head_k_dim,
                head_dim=cfg.head_k_dim,
                num_heads=cfg.num_k_heads,
                num_v_heads=cfg.num_v_heads,
                mode="chunk",
                use_gate=True,
                use_short_conv=True,
                conv_size=cfg.conv_kernel_size,
                norm_eps=cfg.norm_eps,
                output_gate_activation="swish",
            )
            theirs.load_state_dict(gdn_to_fla(ours.state_dict()), strict=True)
            theirs = theirs.to(dev, dt)
        except Exception as e:  # noqa: BLE001
            why, theirs = f"unavailable: {short_error(e)}", None
    res["reference"] = "fla.layers.GatedDeltaNet (mapped weights)" if theirs is not None else why
    cu = torch.tensor(offsets, device=dev, dtype=torch.int32)
    call_ours = lambda: ours.forward_trajectories(x, offsets, chunk_size=ctx.chunk)
    call_fla = lambda: theirs(x[None], cu_seqlens=cu)[0][0]
    passes = res["first_pass_s"] = FirstPasses(dev)
    if theirs is not None:
        try:
            with passes("ours"):
                y_o = call_ours()
                g_o = grads_of(y_o, gy, {"x": x, **dict(ours.named_parameters())})
            y_t = None
            try:
                with passes("fla"):
                    y_t = call_fla()
                    g_t = grads_of(y_t, gy, {"x": x, **dict(theirs.named_parameters())})
                g_t = fla_grads_as_ours(g_t)
            except Exception as e:  # noqa: BLE001 - fla's backward may fail on some GPUs / Tritons
                res["parity"] = {
                    "status": short_error(e),
                    "stage": "fla forward" if y_t is None else "fla backward",
                    "y_rel_err": rel(y_o, y_t),
                    "traceback": traceback.format_exc(),
                }
            else:
                res["parity"] = parity_record(y_o, y_t, g_o, g_t)
            del y_o, y_t
        except Exception as e:  # noqa: BLE001
            res["parity"] = {"status": short_error(e), "traceback": traceback.format_exc()}
    else:
        res["parity"] = {"status": why}
    free(dev)
    print_parity("gdn", res["parity"])
    return time_against_fla(res, (call_ours, ours), (call_fla, theirs), why, x, gy, dev, a.reps)


def _attention_skip(name: str, views, tiny: bool) -> str | None:
    if name == "reference" and not tiny:
        return "skipped: the per-branch float32 loop oracle (tiny runs only)"
    if name == "dense_tree" and views.num_rows > DENSE_TREE_ROWS:
        return f"skipped: a dense [C, C] mask at C = {views.num_rows:,}"
    if name == "sdpa":
        mask = views.num_branches * views.max_seqlen_q * views.max_seqlen_k
        if mask > SDPA_MASK_LIMIT:
            return f"skipped: padded mask of {mask / 2**30:.1f} GiB ({views.num_branches} branches)"
    return None


def case_attention(ctx: Context) -> dict:
    from harts_runtime.ops.attention import BACKENDS, available_backends, compact_attention

    a, dev, dt = ctx.args, ctx.dev, ctx.dtype
    m = ctx.microbatch()
    views = m["mb"].layout.views
    c = views.num_rows
    names = available_backends(dev)
    if a.attn_backends:
        wanted = [n for n in a.attn_backends.split(",") if n]
        missing = [n for n in wanted if n not in names]
        if missing:
            raise ValueError(f"--attn-backends: {missing} not available here (available: {names})")
        names = wanted
    if dev.type == "cuda" and "varlen" in names:  # the parity reference first
        names = ["varlen"] + [n for n in names if n != "varlen"]
    res = {"microbatch": m["info"], "backends": names, "dtype": str(dt).replace("torch.", ""), "shapes": {}}
    shapes = TINY_ATTN_SHAPES if a.tiny else ATTN_SHAPES
    for sname, (hq, hkv, dqk, dv) in shapes.items():
        g = ctx.gen(4)
        q = randn((c, hq, dqk), dev, dt, g, grad=True)
        k = randn((c, hkv, dqk), dev, dt, g, grad=True)
        v = randn((c, hkv, dv), dev, dt, g, grad=True)
        gy = randn((c, hq, dv), dev, dt, g)
        named = {"q": q, "k": k, "v": v}
        out = {"shape": {"Hq": hq, "Hkv": hkv, "Dqk": dqk, "Dv": dv}, "backends": {}}
        ref = None
        for name in names:
            skip = _attention_skip(name, views, a.tiny)
            if skip:
                out["backends"][name] = {"status": skip}
                log(f"attention {sname} {name}: {skip}")
                continue
            r = {}
            call = lambda name=name, q=q, k=k, v=v: compact_attention(q, k, v, views, backend=name)
            passes = FirstPasses(dev)
            try:
                with passes("op"):
                    y = call()
                    gr = grads_of(y, gy, named)
                if ref is None:
                    ref = (name, y.detach(), {n: t.detach() for n, t in gr.items()})
                    r["parity"] = {"status": "reference"}
                else:
                    r["parity"] = parity_record(y, ref[1], gr, ref[2])
                    r["parity"]["against"] = ref[0]
                del y, gr
            except Exception as e:  # noqa: BLE001
                r["parity"] = {"status": short_error(e), "traceback": traceback.format_exc()}
            r["first_pass_s"] = passes.get("op")
            free(dev)
            r["op"] = try_time(call, [q, k, v], [], gy, dev, a.reps)
            if BACKENDS[name].kind == "views" and r["op"].get("status") == "ok":
                qp = q.detach().index_select(0, views.q_index).requires_grad_(True)
                kp = k.detach().index_select(0, views.kv_index).requires_grad_(True)
                vp = v.detach().index_select(0, views.kv_index).requires_grad_(True)
                gyp = gy.index_select(0, views.q_index)
                scale = dqk**-0.5
                kern = lambda name=name, qp=qp, kp=kp, vp=vp, scale=scale: BACKENDS[name].fn(
                    qp, kp, vp, views, scale
                )
                r["kernel"] = try_time(kern, [qp, kp, vp], [], gyp, dev, a.reps)
                del qp, kp, vp, gyp
            r["status"] = r["op"]["status"]
            out["backends"][name] = r
            free(dev)
            fb = r["op"].get("fwdbwd", {}).get("ms")
            log(
                f"attention {sname} {name}: {r['status']}"
                + (f", fwd {r['op']['fwd']['ms']:.2f} ms, fwd+bwd {fb:.2f} ms" if fb is not None else "")
            )
        ok = {n: r["op"]["fwdbwd"]["ms"] for n, r in out["backends"].items() if r.get("status") == "ok"}
        out["fastest"] = min(ok, key=ok.get) if ok else None
        for n, r in out["backends"].items():
            r["fastest"] = n == out["fastest"]
        res["shapes"][sname] = out
        del q, k, v, gy
        free(dev)
    res["views"] = {
        "rows": c,
        "branches": views.num_branches,
        "q_rows": int(views.q_index.numel()),
        "kv_rows": int(views.kv_index.numel()),
        "max_seqlen_q": views.max_seqlen_q,
        "max_seqlen_k": views.max_seqlen_k,
    }
    return res


def moe_flops(cfg, rows: int) -> dict:
    """Forward FLOPs of the MoE layer on ``rows`` rows (matmuls, 2 * in * out): routed experts,
    shared experts, router; training = 3x forward."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    routed = rows * cfg.top_k * 3 * 2 * d * i
    shared_i = cfg.shared_intermediate_size or cfg.num_shared_experts * i
    shared = rows * 3 * 2 * d * shared_i if cfg.num_shared_experts else 0
    router = rows * 2 * d * cfg.num_experts
    return {"routed_fwd": routed, "shared_fwd": shared, "router_fwd": router, "fwd": routed + shared + router}


def dense_gemm(flops: float, dev, dt, reps: int, tiny: bool) -> dict:
    """One square dense GEMM of about ``flops`` (side rounded to 256, at most 16,384), timed; its
    throughput gives the time ``flops`` would take at that rate."""
    n = int(round((flops / 2) ** (1 / 3) / 256)) * 256
    n = max(64 if tiny else 1024, min(n, 16_384))
    g = torch.Generator(device=dev).manual_seed(7)
    a = torch.randn(n, n, generator=g, device=dev).to(dt)
    b = torch.randn(n, n, generator=g, device=dev).to(dt)
    t = bench(lambda: a @ b, dev, reps)
    tflops = 2 * n**3 / (t["ms"] * 1e-3) / 1e12
    return {"n": n, "gemm": t, "tflops": tflops}


def case_moe(ctx: Context) -> dict:
    import train_eval

    from harts_runtime import model_config
    from harts_runtime.models.hybrid.model import FFN_BUILDERS

    a, dev, dt = ctx.args, ctx.dev, ctx.dtype
    rows = a.tiny_rows if a.tiny else a.rows
    mcfg = model_config("ling-tiny", 2)
    if a.tiny:
        mcfg = train_eval.tiny_config(mcfg)
    torch.manual_seed(a.seed)
    moe = FFN_BUILDERS["moe"](mcfg, 0).to(dev, dt)
    for buf in ("expert_bias", "local_tokens_per_expert"):  # fp32 as in HybridModel
        getattr(moe, buf).data = getattr(moe, buf).data.float()
    cfg = moe.config
    res = {
        "shape": {k: getattr(cfg, k) for k in vars(cfg)},
        "rows": rows,
        "dtype": str(dt).replace("torch.", ""),
    }
    g = ctx.gen(5)
    x = randn((rows, cfg.hidden_size), dev, dt, g, grad=True)
    gy = randn((rows, cfg.hidden_size), dev, dt, g)
    params = list(moe.parameters())
    passes = res["first_pass_s"] = FirstPasses(dev)
    try:
        ref = copy.deepcopy(moe)
        ref.config.grouped = False
        with passes("ours"):
            y = moe(x).hidden
            gr = grads_of(y, gy, {"x": x, **dict(moe.named_parameters())})
        with passes("loop_reference"):
            y_r = ref(x).hidden
            gr_r = grads_of(y_r, gy, {"x": x, **dict(ref.named_parameters())})
        res["parity"] = parity_record(y, y_r, gr, gr_r)
        res["parity"]["reference"] = "the per-expert loop (MoEConfig.grouped=False), same weights"
        del ref, y, y_r, gr, gr_r
    except Exception as e:  # noqa: BLE001
        res["parity"] = {"status": short_error(e), "traceback": traceback.format_exc()}
    free(dev)
    print_parity("moe", res["parity"])
    call = lambda: moe(x).hidden
    res["ours"] = try_time(call, [x], params, gy, dev, a.reps)
    fl = moe_flops(cfg, rows)
    res["flops"] = {**fl, "fwdbwd": 3 * fl["fwd"], "routed_fwdbwd": 3 * fl["routed_fwd"]}
    try:
        dense = dense_gemm(3 * fl["fwd"], dev, dt, a.reps, a.tiny)
        per_flop_ms = dense["gemm"]["ms"] / (2 * dense["n"] ** 3)
        res["dense_gemm"] = dense
        res["roofline_fwdbwd_ms"] = per_flop_ms * 3 * fl["fwd"]
        res["roofline_routed_fwdbwd_ms"] = per_flop_ms * 3 * fl["routed_fwd"]
        res["roofline_fwd_ms"] = per_flop_ms * fl["fwd"]
        ours = res["ours"]
        if ours.get("status") == "ok":
            res["fwdbwd_vs_roofline"] = ours["fwdbwd"]["ms"] / res["roofline_fwdbwd_ms"]
            res["fwd_vs_roofline"] = ours["fwd"]["ms"] / res["roofline_fwd_ms"]
            res["tflops_fwdbwd"] = 3 * fl["fwd"] / (ours["fwdbwd"]["ms"] * 1e-3) / 1e12
    except Exception as e:  # noqa: BLE001
        res["dense_gemm"] = {"status": short_error(e)}
    if res["ours"].get("status") == "ok":
        res["host"] = host_vs_device(call, [x], params, gy, dev, a.reps)
        try:
            res["kernels"] = kernel_profile(call, [x], params, gy, dev)
        except Exception as e:  # noqa: BLE001
            res["kernels"] = {"status": short_error(e)}
    return res


def kernel_profile(call, inputs, params, gy, dev, top: int = 15) -> dict:
    """One warm fwd+bwd of ``call`` under ``torch.profiler``: device seconds per kernel (self time,
    the ``top`` largest) and their total, to say where a layer's time goes against its roofline
    (our ``harts.*`` ranges are annotations, not kernels: left out)."""
    from torch.profiler import ProfilerActivity, profile

    wrt = [t for t in inputs + params if t.requires_grad]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sync(dev)
    with profile(activities=acts) as prof:
        torch.autograd.grad(call(), wrt, gy, allow_unused=True)
        sync(dev)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t and str(getattr(e, "device_type", "")).endswith("CUDA") and not e.key.startswith("harts."):
            rows.append({"kernel": e.key[:160], "calls": e.count, "ms": t / 1e3})
    rows.sort(key=lambda r: -r["ms"])
    return {"total_ms": sum(r["ms"] for r in rows), "kernels": len(rows), "top": rows[:top]}


def host_vs_device(call, inputs, params, gy, dev, reps: int) -> dict:
    """fwd+bwd of ``call``: host time (until the call returns, synchronized before), wall time
    (until the device is done), device time (CUDA events) and host synchronizations per pass."""
    wrt = [t for t in inputs + params if t.requires_grad]
    host, wall, device = [], [], []
    for _ in range(reps):
        sync(dev)
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t = time.perf_counter()
        torch.autograd.grad(call(), wrt, gy, allow_unused=True)
        host.append((time.perf_counter() - t) * 1e3)
        if dev.type == "cuda":
            b.record()
        sync(dev)
        wall.append((time.perf_counter() - t) * 1e3)
        if dev.type == "cuda":
            device.append(a.elapsed_time(b))
    out = {
        "host_ms": statistics.median(host),
        "wall_ms": statistics.median(wall),
        "device_ms": statistics.median(device) if device else None,
        "host_syncs_per_pass": None,
    }
    if dev.type == "cuda":
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    torch.autograd.grad(call(), wrt, gy, allow_unused=True)
                    sync(dev)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            out["host_syncs_per_pass"] = sum("synchroniz" in str(w.message) for w in caught)
        except Exception as e:  # noqa: BLE001
            out["host_syncs_per_pass"] = short_error(e)
    return out


FUNCS = {
    "kda": case_kda,
    "kda_compact": case_kda_compact,
    "gdn": case_gdn,
    "attention": case_attention,
    "moe": case_moe,
}


# ------------------------------------------------------------------------------ train_eval
def read_train_eval(path: str | None) -> dict:
    """``model_tflops``, ``device_busy`` and ``speedup_vs_ideal`` from a train_eval result (its
    JSON file, or its --out folder holding ``train_eval.json`` / ``results.json``); None where
    the file or the section is missing."""
    out = {"model_tflops": None, "device_busy": None, "speedup_vs_ideal": None, "source": path}
    if not path:
        return out
    p = Path(path)
    if p.is_dir():
        p = next(
            (p / n for n in ("train_eval.json", "results.json") if (p / n).is_file()), p / "train_eval.json"
        )
    if not p.is_file():
        out["error"] = f"{p} not found"
        return out
    doc = json.loads(p.read_text())
    out["source"] = str(p)
    out["model"] = doc.get("meta", {}).get("model")
    s, b = doc.get("speedup") or {}, doc.get("breakdown") or {}
    out["model_tflops"] = (s.get("tflops") or {}).get("compact")
    out["trajectory_tflops"] = (s.get("tflops") or {}).get("trajectory")
    out["model_tflops_mfu"] = (s.get("mfu_tflops") or {}).get("compact")  # no recomputation counted
    out["kept_regions"] = s.get("keep")
    out["attention_backend"] = doc.get("meta", {}).get("attention_backend")
    out["speedup_vs_ideal"] = s.get("fbg_speedup_over_ideal")
    out["fbg_speedup"] = s.get("fbg_speedup")
    out["ideal_work_compression"] = s.get("ideal_work_compression")
    busy = b.get("device_busy")
    if (
        busy is None
        and b.get("wall_s")
        and b.get("device_kernel_s") is not None
        and b.get("host_overhead_s") is not None
    ):
        busy = min(b["device_kernel_s"] / b["wall_s"], 1.0)  # older results: kernel time sum / wall
        out["device_busy_note"] = "sum of kernel times / wall (result without device_busy)"
    out["device_busy"] = busy
    return out


# ------------------------------------------------------------------------------ report
def headline(res: dict) -> None:
    cases = res["cases"]
    kda, kc = cases.get("kda") or {}, cases.get("kda_compact") or {}
    res["kda_fwdbwd_vs_fla"] = kda.get("fwdbwd_vs_fla")
    res["kda_compact_vs_trajectory"] = kc.get("compact_vs_trajectory")
    te = res.get("train_eval") or {}
    for k in ("model_tflops", "device_busy", "speedup_vs_ideal"):
        res[k] = te.get(k)


def write(path: Path, res: dict) -> None:
    headline(res)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = json.loads(json.dumps(res, default=lambda o: None))
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(clean, indent=1))
    os.replace(tmp, path)


def _status_word(d) -> str:
    """The first word of a record's status ("skipped", "unavailable", "error", ...; full text in the JSON)."""
    st = d.get("status") if isinstance(d, dict) else None
    return st.split(":")[0] if isinstance(st, str) and st else "-"


def _ms(d: dict | None, key: str) -> str:
    try:
        return f"{d[key]['ms']:.2f}"
    except (KeyError, TypeError):
        return _status_word(d)


def _num(x, fmt=".3f", suffix="") -> str:
    return "n/a" if x is None else f"{x:{fmt}}{suffix}"


def _err(p: dict | None) -> str:
    if not isinstance(p, dict) or p.get("status") != "ok":
        return _status_word(p)
    return f"{p['y_rel_err']:.1e} / {_num(p['max_grad_rel_err'], '.1e')}"


def _first(case: dict, side: str, rec) -> str:
    """Cold first pass of one side: its parity pass (the first call of its kernels), else the first
    (excluded) pass of its forward measurement."""
    v = (case.get("first_pass_s") or {}).get(side)
    if v is None and isinstance(rec, dict):
        v = (rec.get("fwd") or {}).get("first_pass_s")
    return _num(v, ".1f")


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [
        BEGIN,
        f"`python benchmarks/layer_speed.py` ({m['device']}, {m['dtype']}, {m['date']}"
        + (", `--fast-autotune`" if m["args"].get("fast_autotune") else "")
        + "): `results/layer_speed.json`."
        + (
            " Merged from partial runs: "
            + "; ".join(f"{', '.join(x['cases']) or 'no cases'} ({x['date']})" for x in m["sources"])
            + "."
            if m.get("sources")
            else ""
        ),
        "",
        "| headline | value | target |",
        "|---|---:|---:|",
        f"| KDA fwd+bwd ours / fla (trajectory path) | {_num(res.get('kda_fwdbwd_vs_fla'), '.2f', 'x')} | <= 1.15x |",
        f"| KDA compact / trajectory per packed row | {_num(res.get('kda_compact_vs_trajectory'), '.2f', 'x')} | <= 1.15x |",
        f"| model TFLOP/s, executed FLOPs (compact microbatch) | {_num(res.get('model_tflops'), '.1f')} | >= 250 |",
        f"| model TFLOP/s, model FLOPs only (recomputation not counted) | "
        f"{_num((res.get('train_eval') or {}).get('model_tflops_mfu'), '.1f')} | |",
        f"| device busy | {_num(res.get('device_busy'), '.1%')} | >= 95% |",
        f"| F/B/Grad speedup / ideal | {_num(res.get('speedup_vs_ideal'), '.3f')} | >= 0.95 |",
        "",
        "| case | ours fwd ms | ours fwd+bwd ms | reference | ref fwd ms | ref fwd+bwd ms | "
        "ratio fwd+bwd | parity y / max grad | first pass s (ours / ref) |",
        "|---|---:|---:|---|---:|---:|---:|---|---|",
    ]
    c = res["cases"]
    for name, ref_key, label in (
        ("kda", "fla", "fla KimiDeltaAttention"),
        ("gdn", "fla", "fla GatedDeltaNet"),
    ):
        d = c.get(name)
        if not isinstance(d, dict) or "ours" not in d:
            continue
        o, r = d["ours"], d.get(ref_key) or {}
        lines.append(
            f"| {name} ({d['rows']:,} rows, 8 trajectories) | {_ms(o, 'fwd')} | {_ms(o, 'fwdbwd')} | {label} | "
            f"{_ms(r, 'fwd')} | {_ms(r, 'fwdbwd')} | {_num(d.get('fwdbwd_vs_fla'), '.2f', 'x')} | "
            f"{_err(d.get('parity'))} | {_first(d, 'ours', o)} / {_first(d, 'fla', r)} |"
        )
    d = c.get("kda_compact")
    if isinstance(d, dict) and "compact" in d:
        o, mb = d["compact"], d["microbatch"]
        for v in ("trajectory", "trajectory_same_sequences"):
            t = d.get(v) or {}
            lines.append(
                f"| kda compact ({mb['compact_rows']:,} + {mb['replay_rows']:,} replay rows, {mb['rounds']} rounds) | "
                f"{_ms(o, 'fwd')} | {_ms(o, 'fwdbwd')} | {v.replace('_', ' ')} on {mb['packed_rows']:,} rows "
                f"({t.get('sequences', '?')} sequences) | {_ms(t, 'fwd')} | {_ms(t, 'fwdbwd')} | "
                f"{_num(d.get(f'fwdbwd_compact_vs_{v}'), '.2f', 'x')} per row | {_err(d.get('parity'))} | "
                f"{_first(d, 'compact', o)} / {_first(d, 'none', t)} |"
            )
    d = c.get("moe")
    if isinstance(d, dict) and "ours" in d:
        o = d["ours"]
        lines.append(
            f"| moe ({d['rows']:,} rows) | {_ms(o, 'fwd')} | {_ms(o, 'fwdbwd')} | dense GEMM roofline "
            f"({_num(d.get('dense_gemm', {}).get('tflops'), '.0f')} TFLOP/s) | {_num(d.get('roofline_fwd_ms'), '.2f')} | "
            f"{_num(d.get('roofline_fwdbwd_ms'), '.2f')} | {_num(d.get('fwdbwd_vs_roofline'), '.2f', 'x')} | "
            f"{_err(d.get('parity'))} | {_first(d, 'ours', o)} |"
        )
    lines.append("")
    if isinstance(d, dict) and isinstance(d.get("host"), dict):
        h = d["host"]
        lines += [
            f"MoE fwd+bwd: host {h['host_ms']:.2f} ms until the call returns, wall {h['wall_ms']:.2f} ms, "
            f"device {_num(h.get('device_ms'), '.2f')} ms; host synchronizations per pass: "
            f"{h.get('host_syncs_per_pass')}.",
            "",
        ]
    a = c.get("attention")
    if isinstance(a, dict) and "shapes" in a:
        lines += [
            "| attention shape | backend | op fwd ms | op fwd+bwd ms | kernel fwd ms | kernel fwd+bwd ms | "
            "parity y / max grad | first pass s |",
            "|---|---|---:|---:|---:|---:|---|---:|",
        ]
        for sname, s in a["shapes"].items():
            sh = s["shape"]
            for b, r in s["backends"].items():
                op, k = r.get("op") or {}, r.get("kernel") or {}
                mark = "**" if r.get("fastest") else ""
                lines.append(
                    f"| {sname} {sh['Hq']}/{sh['Hkv']}/{sh['Dqk']}/{sh['Dv']} | {mark}{b}{mark} | "
                    f"{_ms(op, 'fwd') if op else r.get('status')} | {_ms(op, 'fwdbwd') if op else ''} | "
                    f"{_ms(k, 'fwd') if k else ''} | {_ms(k, 'fwdbwd') if k else ''} | {_err(r.get('parity'))} | "
                    f"{_first({'first_pass_s': {'op': r.get('first_pass_s')}}, 'op', op)} |"
                )
        lines.append("")
    for name, d in c.items():
        if isinstance(d, dict) and "error" in d:
            lines += [f"**{name} failed:** `{d['error']}`", ""]
        elif isinstance(d, dict) and "skipped" in d:
            lines += [f"**{name} skipped:** {d['skipped']}", ""]
    lines.append(END)
    return "\n".join(lines)


# ------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "results" / "layer_speed.json")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--reps", type=int, default=10, help="timed warm repeats per measurement")
    ap.add_argument(
        "--attn-backends",
        default="",
        help="comma-separated attention backends of the attention case (default: every available one)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=DEFAULT_CAPACITY, help="packed rows / microbatch capacity T")
    ap.add_argument("--preset", default="swe-like", help="synthetic preset of the compact microbatch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=540.0, help="skip cases that would start after this")
    ap.add_argument(
        "--train-eval", default=None, metavar="PATH", help="train_eval.py result (JSON or --out folder)"
    )
    ap.add_argument(
        "--fast-autotune", action="store_true", help="one Triton config per kernel (ours and fla's)"
    )
    ap.add_argument(
        "--tiny", action="store_true", help="CPU smoke sizes: tiny shapes, float32, a few hundred rows"
    )
    ap.add_argument("--readme", type=Path, default=HERE / "README.md")
    ap.add_argument(
        "--no-readme", action="store_true", help="leave benchmarks/README.md alone (tiny runs always do)"
    )
    ap.add_argument(
        "--merge",
        default="",
        metavar="FILES",
        help="comma-separated layer_speed.json results of partial runs: combine their measured cases (a later "
        "file's case replaces an earlier one's; skipped and failed cases are not carried; meta from the "
        "last file, each case's date in meta.sources) into --out and the README, run nothing",
    )
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in FUNCS]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    if args.tiny:
        args.preset, args.rows, args.reps = "tiny", 64, min(args.reps, 2)
    args.tiny_rows = 320  # packed rows of the tiny trajectory and MoE cases
    if args.fast_autotune:
        from harts_kernels.tuning import use_first_config_only

        use_first_config_only()  # before fla's and our kernels are first imported
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    ctx = Context(args)
    res = {
        **dict.fromkeys(TOP_KEYS),
        "meta": {
            "device": torch.cuda.get_device_name(dev)
            if dev.type == "cuda"
            else platform.processor() or "cpu",
            "dtype": str(ctx.dtype).replace("torch.", ""),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "fla": _version("fla"),
            "triton": _version("triton"),
            "python": platform.python_version(),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "train_eval": read_train_eval(args.train_eval),
        "cases": {},
    }
    write(args.out, res)
    start = time.perf_counter()
    for name in cases:
        t = time.perf_counter()
        if t - start > args.budget_s:
            res["cases"][name] = {"skipped": f"budget: {t - start:.0f}s elapsed > {args.budget_s:.0f}s"}
            log(f"skip {name}: {res['cases'][name]['skipped']}")
            write(args.out, res)
            continue
        log(f"case {name} (elapsed {t - start:.0f}s)")
        try:
            res["cases"][name] = FUNCS[name](ctx)
        except Exception as e:  # noqa: BLE001 - every case reports its own failure
            res["cases"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            log(f"{name} failed: {e}")
        res["cases"][name]["seconds"] = time.perf_counter() - t
        free(dev)
        write(args.out, res)
        log(f"case {name} done in {res['cases'][name]['seconds']:.1f}s: {summary(name, res['cases'][name])}")
    res["meta"]["total_seconds"] = time.perf_counter() - start
    write(args.out, res)
    block = markdown(json.loads(args.out.read_text()))
    print(block)
    if not args.tiny and not args.no_readme:
        update_readme(
            args.readme, block, BEGIN, END, "Layer speed against production references: `layer_speed.py`"
        )
    return 0


def merge(args) -> int:
    """``--merge``: one result from the cases of several partial runs (device time comes in short
    calls), each case keeping the meta of the run that measured it (``meta.sources``)."""
    res: dict = {**dict.fromkeys(TOP_KEYS), "meta": None, "train_eval": None, "cases": {}}
    sources = []
    for f in [p for p in args.merge.split(",") if p]:
        doc = json.loads(Path(f).read_text())
        cases = {k: v for k, v in (doc.get("cases") or {}).items() if "skipped" not in v and "error" not in v}
        for name, case in cases.items():
            case["measured"] = doc["meta"].get("date")
            res["cases"][name] = case
        sources.append({"file": f, "date": doc["meta"].get("date"), "cases": sorted(cases)})
        res["meta"] = dict(doc["meta"])
        if doc.get("train_eval", {}).get("model_tflops") is not None:
            res["train_eval"] = doc["train_eval"]
    if res["meta"] is None:
        raise SystemExit("--merge: no files")
    res["meta"]["sources"] = sources
    if args.train_eval:
        res["train_eval"] = read_train_eval(args.train_eval)
    res["train_eval"] = res["train_eval"] or read_train_eval(None)
    write(args.out, res)
    block = markdown(json.loads(args.out.read_text()))
    print(block)
    if not args.no_readme:
        update_readme(
            args.readme, block, BEGIN, END, "Layer speed against production references: `layer_speed.py`"
        )
    return 0


def summary(name: str, d: dict) -> str:
    if "error" in d:
        return d["error"]
    if name in ("kda", "gdn"):
        return (
            f"ours fwd {_ms(d.get('ours'), 'fwd')} / fwd+bwd {_ms(d.get('ours'), 'fwdbwd')} ms; "
            f"fla fwd {_ms(d.get('fla'), 'fwd')} / fwd+bwd {_ms(d.get('fla'), 'fwdbwd')}; "
            f"ratio {_num(d.get('fwdbwd_vs_fla'), '.2f', 'x')}"
        )
    if name == "kda_compact":
        return (
            f"compact fwd+bwd {_ms(d.get('compact'), 'fwdbwd')} ms, trajectory {_ms(d.get('trajectory'), 'fwdbwd')} "
            f"ms; per packed row {_num(d.get('compact_vs_trajectory'), '.2f', 'x')}"
        )
    if name == "attention":
        return ", ".join(f"{s}: fastest {v.get('fastest')}" for s, v in d.get("shapes", {}).items())
    if name == "moe":
        return (
            f"fwd+bwd {_ms(d.get('ours'), 'fwdbwd')} ms vs roofline {_num(d.get('roofline_fwdbwd_ms'), '.2f')} ms "
            f"({_num(d.get('fwdbwd_vs_roofline'), '.2f', 'x')})"
        )
    return ""


def _version(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001 - optional packages
        return None


if __name__ == "__main__":
    sys.exit(main())
