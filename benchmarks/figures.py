"""The measured GPU figures the docs quote, each read from one results file.

Every figure that README.md, docs/*.md, benchmarks/README.md or ``harts-planner demo`` quotes is
computed here from ``benchmarks/results/*.json``:

* :data:`RUNS`: the ``train_eval.py`` runs (one row each in the generated table of
  ``benchmarks/README.md``), :data:`HEADLINE` the one the README and the demo quote;
* :func:`layer_figures`: the headlines of ``results/layer_speed.json``.

``python benchmarks/figures.py`` rewrites the generated block of ``benchmarks/README.md`` and
``python_client/harts_planner/measured.py`` (the constants the demo prints; the installed package
has no results folder). ``tests/test_docs_figures.py`` fails when either is stale, when a quoted
headline sentence differs from :func:`quotes`, or when prose quotes a TFLOP/s or roofline figure
that no results file holds.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"
MEASURED = ROOT / "python_client" / "harts_planner" / "measured.py"
BEGIN, END = "<!-- gpu_figures:begin -->", "<!-- gpu_figures:end -->"


@dataclasses.dataclass(frozen=True)
class Run:
    """One ``train_eval.py`` speedup run: ``path`` under ``benchmarks/results/``."""

    key: str
    path: str
    label: str


#: Every train_eval run the docs mention, newest configuration first.
RUNS: tuple[Run, ...] = (
    Run(
        "ling_tiny_24_tuned",
        "issue26_gpu/tuned/te24_tuned/train_eval.json",
        "`ling-tiny`, 24 layers (7.8B), attention and KDA cores kept, tuned kernels (full autotune, "
        "no `--fast-autotune`; issue 26)",
    ),
    Run(
        "ling_tiny_24_router",
        "issue26_gpu/tuned/te24_mb1/train_eval.json",
        "`ling-tiny`, 24 layers, attention and KDA cores kept, the router's backward on tensor cores (issue 26)",
    ),
    Run(
        "ling_tiny_24_fused_moe",
        "issue26_gpu/fused_moe/te24_mb1/train_eval.json",
        "`ling-tiny`, 24 layers (7.8B), attention and KDA cores kept, fused MoE kernels (issue 26)",
    ),
    Run(
        "ling_tiny_24",
        "issue15_gpu_s5/te24_kept2/train_eval.json",
        "`ling-tiny`, 24 layers, attention and KDA cores kept (before issue 26's MoE kernels)",
    ),
    Run(
        "ling_tiny_24_attention_kept",
        "issue15_gpu_s5/te24_kept1/train_eval.json",
        "`ling-tiny`, 24 layers, attention cores kept",
    ),
    Run(
        "ling_tiny_24_before_fused_moe",
        "train_eval_24/train_eval.json",
        "`ling-tiny`, 24 layers, attention cores kept (before issue 15's MoE work)",
    ),
    Run("ling_tiny_8", "train_eval/train_eval.json", "`ling-tiny`, 8 layers, full recomputation"),
    Run(
        "qwen35_4_fused",
        "issue15_gpu_s5/te_qwen35_keep2/train_eval.json",
        "`qwen3.5-35b-a3b`, 4 layers, fused path, attention and GDN cores kept",
    ),
    Run(
        "qwen35_4_fused_attention_kept",
        "issue15_gpu_s5/te_qwen35_keep1/train_eval.json",
        "`qwen3.5-35b-a3b`, 4 layers, fused path, attention cores kept",
    ),
    Run(
        "qwen35_8_fused",
        "issue15_gpu_s5/te_qwen35_8/train_eval.json",
        "`qwen3.5-35b-a3b`, 8 layers, fused path, attention and GDN cores kept",
    ),
    Run(
        "qwen35_4_reference",
        "train_eval_qwen35/train_eval.json",
        "`qwen3.5-35b-a3b`, 4 layers, PyTorch token-wise path (before the fused path)",
    ),
)
#: The run the README, docs/architecture.md and ``harts-planner demo`` quote.
HEADLINE = "ling_tiny_24_tuned"


@dataclasses.dataclass(frozen=True)
class Step:
    """One whole-step measurement (issue 26): result folders under ``benchmarks/results/`` holding
    ``train_eval.json`` of the sections ``speedup`` (+ ``microbatches``, ``newshapes``), ``first``,
    or None where the call did not run them."""

    label: str
    slice: str | None
    first: str | None = None


#: Whole steps: the one-microbatch line and the 8-microbatch slice of one device call, then the
#: slice after each shape-specialization fix (24-layer ling-tiny, both cores kept, fast autotune).
STEPS: tuple[Step, ...] = (
    Step("one microbatch (12 trajectories)", "issue26_gpu/te24_mb1"),
    Step(
        "8 microbatches (100 trajectories, 11 compact microbatches)",
        "issue26_gpu/te24_slice8",
        "issue26_gpu/te24_first",
    ),
    Step(
        "the same, RMSNorm rows per program bucketed",
        "issue26_gpu/after_norm_fix/te24_slice8",
        "issue26_gpu/after_norm_fix/te24_first",
    ),
    Step(
        "never-seen steps of a new process (the first is its first step), programs per group fixed too",
        "issue26_gpu/after_norm_fix/te24_newshapes",
    ),
    Step(
        "fused MoE kernels, norms without a compile per row count: one microbatch",
        "issue26_gpu/fused_moe/te24_mb1",
    ),
    Step(
        "the same code: 8 microbatches (100 trajectories; 8 compact microbatches, the planner's tie rule)",
        "issue26_gpu/fused_moe/te24_slice8",
        "issue26_gpu/fused_moe/te24_first",
    ),
    Step(
        "the same code, a new process's first microbatch with Python bytecode compiled (a fresh lent machine: "
        "its Triton and FA4 caches warmed by one earlier process)",
        None,
        "issue26_gpu/fused_moe/te24_first_pyc_warm",
    ),
    Step(
        "`qwen3.5-35b-a3b`, 8 layers, the same 8-microbatch slice (96 trajectories; torch varlen attention, "
        "FA4 not installed on that machine)",
        "issue26_gpu/fused_moe/te_qwen35_slice8",
    ),
    Step(
        "the router's backward on bf16 tensor cores: one microbatch",
        "issue26_gpu/tuned/te24_mb1",
    ),
    Step(
        "the same code: 8 microbatches (the same 100 trajectories; the first microbatch without bytecode, "
        "Triton and FA4 caches warm)",
        "issue26_gpu/tuned/te24_slice8",
        "issue26_gpu/tuned/te24_first",
    ),
    Step(
        "the same code, **tuned** kernels (full autotune, cold cache; `issue26_runs.sh t`): one microbatch",
        "issue26_gpu/tuned/te24_tuned",
    ),
    Step(
        "the same code, **tuned** kernels (that run's Triton cache): 8 microbatches",
        "issue26_gpu/tuned/te24_tuned_slice8",
    ),
    Step(
        "`qwen3.5-35b-a3b`, 8 layers, the same 8-microbatch slice with FlashAttention-4 (96 trajectories)",
        "issue26_gpu/tuned/te_qwen35_slice8",
    ),
)


def step_figures(step: Step) -> dict:
    """The whole-step figures of one :class:`Step` (None where not measured)."""
    data = _load(f"{step.slice}/train_eval.json") if step.slice else {}
    first = _load(f"{step.first}/train_eval.json").get("first") if step.first else None
    sp, mb, ns = data.get("speedup"), data.get("microbatches"), data.get("newshapes")
    date = data.get("meta", {}).get("date", "") or (
        _load(f"{step.first}/train_eval.json")["meta"]["date"] if step.first else ""
    )
    out = {"label": step.label, "date": date[:10], "source": step.slice or step.first}
    if sp:
        out.update(
            microbatches=min(sp["runs"]["compact"], key=lambda r: r["fbg_seconds"])["num_microbatches"],
            speedup=sp["fbg_speedup"],
            of_ideal=sp["fbg_speedup_over_ideal"],
            ideal=sp["ideal_work_compression"],
            tflops=(sp["tflops"]["compact"], sp["tflops"]["trajectory"]),
        )
    if mb:
        warm = mb["summary"]["fbg_speedup_sum_of_microbatches"]
        out.update(
            warm_speedup=warm,
            warm_of_ideal=warm / mb["summary"]["ideal_work_compression"],
            tflops=(mb["compact"]["tflops_step"], mb["trajectory"]["tflops_step"]),
        )
    if ns:
        out["newshapes"] = [x["overhead"] for x in ns.get("steps") or [ns]]
    if first:
        out["first_s"] = first["first_s"]
    return out


def steps_block() -> list[str]:
    """The whole-step table of the generated block."""
    rows = [
        "Whole steps (issue 26; `train_eval.py --layers 24 --slice-microbatches 8 --sections "
        "speedup,microbatches,newshapes,breakdown`, then `--sections first` in a new process; one H200, bf16, "
        "`--fast-autotune` unless a row says tuned, both cores kept). *First pass*: the step's `train_step` right after one "
        "microbatch per mode warmed up, so every other microbatch shape is new to the process; *warm*: each "
        "microbatch timed alone after that, summed; *never-seen step*: a new step's first compact pass against "
        "its warm repeat, steps in order. *First microbatch*: on the lent machine Python writes no bytecode "
        "(`PYTHONDONTWRITEBYTECODE=1`, torch installed without `.pyc`), so every process compiled from source the torch modules "
        "first imported inside its first microbatch (`torch._dynamo`, inductor prims, FSDP, sympy: 2,043 modules, "
        "8.9 s of `compile` under cProfile; FlashAttention-4's `quack` decorates functions with "
        "`torch.compiler.disable`, which imports `torch._dynamo`); the bytecode-compiled row is a normal install's case.",
        "",
        "| run | date | compact microbatches | speedup, first pass (of ideal) | speedup, warm (of ideal) "
        "| TFLOP/s executed, compact / trajectory | never-seen step overhead | first microbatch, warm cache | results |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for f in (step_figures(s) for s in STEPS):
        first_pass = f"{f['speedup']:.3f}x ({f['of_ideal']:.3f})" if "speedup" in f else "-"
        warm = f"{f['warm_speedup']:.3f}x ({f['warm_of_ideal']:.3f})" if "warm_speedup" in f else "-"
        if "warm_speedup" not in f and f.get("microbatches") == 1:
            warm = first_pass  # one microbatch, warmed up: its first pass is warm
        tflops = f"{f['tflops'][0]:.1f} / {f['tflops'][1]:.1f}" if "tflops" in f else "-"
        new = ", ".join(f"{x:+.1%}" for x in f["newshapes"]) if "newshapes" in f else "-"
        rows.append(
            f"| {f['label']} | {f['date']} | {_num(f.get('microbatches'), 'd')} | {first_pass} | {warm} | {tflops} "
            f"| {new} | {_num(f.get('first_s'), '.1f', ' s')} | `results/{f['source']}` |"
        )
    return rows


def _load(path: str) -> dict:
    return json.loads((RESULTS / path).read_text())


def _pair(value, side: str):
    """``value[side]`` for a ``{"compact": ..., "trajectory": ...}`` figure, else ``value``."""
    return value.get(side) if isinstance(value, dict) else (value if side == "compact" else None)


def run_figures(run: Run) -> dict:
    """The figures of one run (None where that run did not record one)."""
    data = _load(run.path)
    sp = data["speedup"]
    # train_eval.py compares the fastest repeat of each mode
    compact, trajectory = (
        min(sp["runs"][m], key=lambda r: r["fbg_seconds"]) for m in ("compact", "trajectory")
    )
    breakdown = data.get("breakdown") or {}
    return {
        "key": run.key,
        "label": run.label,
        "source": f"benchmarks/results/{run.path}",
        "device": data["meta"]["device"],
        "date": data["meta"]["date"][:10],
        "trajectories": sp["batch"]["trajectories"],
        "semantic_tokens": sp["batch"]["semantic_tokens"],
        "compact_rows": sp["batch"]["compact_tokens"],
        "row_compression": sp["non_replay_row_compression"],
        "speedup": sp["fbg_speedup"],
        "ideal": sp["ideal_work_compression"],
        "of_ideal": sp["fbg_speedup_over_ideal"],
        "compact_seconds": compact["fbg_seconds"],
        "trajectory_seconds": trajectory["fbg_seconds"],
        "tflops_executed": _pair(sp.get("tflops"), "compact"),
        "tflops_model": _pair(sp.get("mfu_tflops"), "compact"),
        "tflops_trajectory": _pair(sp.get("tflops"), "trajectory"),
        "device_busy": breakdown.get("device_busy"),
        "abs_loss_diff": abs(compact["loss"] - trajectory["loss"]),
    }


def layer_figures() -> dict:
    """Headlines of ``results/layer_speed.json``."""
    data = _load("layer_speed.json")
    cases = data["cases"]
    return {
        "kda_vs_fla": cases["kda"]["fwdbwd_vs_fla"],
        "kda_compact_vs_trajectory": cases["kda_compact"]["fwdbwd_compact_vs_trajectory"],
        "moe_vs_roofline": cases["moe"]["fwdbwd_vs_roofline"],
    }


def runs() -> dict[str, dict]:
    return {r.key: run_figures(r) for r in RUNS}


def _num(value, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def block() -> str:
    """The generated table of ``benchmarks/README.md``."""
    rows = [
        BEGIN,
        "",
        "Generated by `python benchmarks/figures.py` from the files named in the last column (one "
        "`swe-like` microbatch: 12 trajectories, S = 261,665, C = 65,303, T = 65,536; bf16, one H200, "
        "`--fast-autotune` unless a row says tuned, recomputation on). The README, `docs/architecture.md` and "
        "`harts-planner demo` quote the first row.",
        "",
        "| run | date | F/B/Grad compact s | trajectory s | speedup | ideal work compression | speedup / ideal "
        "| TFLOP/s executed (model) | device busy | results |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for f in runs().values():
        tflops = _num(f["tflops_executed"], ".1f")
        if f["tflops_model"] is not None:
            tflops += f" ({f['tflops_model']:.1f})"
        rows.append(
            f"| {f['label']} | {f['date']} | {f['compact_seconds']:.3f} | {f['trajectory_seconds']:.3f} | "
            f"{f['speedup']:.3f}x | {f['ideal']:.3f}x | {f['of_ideal']:.3f} | {tflops} | "
            f"{_num(f['device_busy'], '.1%')} | `{f['source'].removeprefix('benchmarks/')}` |"
        )
    layer = layer_figures()
    rows += ["", *steps_block()]
    rows += [
        "",
        f"Layers (`results/layer_speed.json`): KDA fwd+bwd {layer['kda_vs_fla']:.2f}x fla's "
        f"`KimiDeltaAttention`; compact KDA {layer['kda_compact_vs_trajectory']:.2f}x the trajectory "
        f"path per packed row; MoE fwd+bwd {layer['moe_vs_roofline']:.2f}x its GEMM roofline.",
        "",
        END,
    ]
    return "\n".join(rows)


def quotes() -> dict[str, str]:
    """The headline sentences the docs quote, by name (``tests/test_docs_figures.py`` checks that each
    doc holds its sentence verbatim)."""
    h = runs()[HEADLINE]
    layer = layer_figures()
    return {
        "headline": (
            f"{h['speedup']:.2f}x faster compact than trajectory-wise (ideal work compression "
            f"{h['ideal']:.2f}x), {h['tflops_executed']:.1f} TFLOP/s executed "
            f"({h['tflops_model']:.1f} model)"
            + ("" if h["device_busy"] is None else f", device busy {h['device_busy']:.1%}")
        ),
        "layers": (
            f"KDA layer {layer['kda_vs_fla']:.2f}x fla's `KimiDeltaAttention` fwd+bwd, compact KDA "
            f"{layer['kda_compact_vs_trajectory']:.2f}x the trajectory path per packed row, MoE "
            f"{layer['moe_vs_roofline']:.2f}x its GEMM roofline"
        ),
    }


def measured_module() -> str:
    """Source of ``harts_planner/measured.py``."""
    h = runs()[HEADLINE]
    keep = (
        "device",
        "date",
        "source",
        "trajectories",
        "semantic_tokens",
        "compact_rows",
        "speedup",
        "ideal",
        "compact_seconds",
        "trajectory_seconds",
        "tflops_executed",
    )
    body = ",\n".join(f"    {json.dumps(k)}: {json.dumps(h[k])}" for k in keep)
    # The docs' label without its issue reference: the package's comments carry no history.
    label = re.sub(r" \(issue \d+\)|; issue \d+", "", h["label"]).replace("`", "")
    return (
        '"""Measured GPU figures quoted by ``harts-planner demo``. Generated by\n'
        "``python benchmarks/figures.py`` from the results file named in ``source``; do not edit\n"
        '(``tests/test_docs_figures.py`` checks it is current)."""\n\n'
        f"#: {label}: one swe-like microbatch, compact vs trajectory-wise.\n"
        f"GPU_HEADLINE = {{\n{body},\n}}\n"
    )


def readme_text(text: str) -> str:
    """``text`` (benchmarks/README.md) with the generated block replaced (or appended)."""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        return head + block() + rest.split(END, 1)[1]
    return text.rstrip() + "\n\n## GPU figures\n\n" + block() + "\n"


def main(argv: list[str]) -> int:
    if argv:
        print("usage: python benchmarks/figures.py   (rewrites the generated block and measured.py)")
        return 2
    README.write_text(readme_text(README.read_text()))
    MEASURED.write_text(measured_module())
    print(f"wrote the {BEGIN} block of {README.relative_to(ROOT)} and {MEASURED.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
