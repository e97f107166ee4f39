"""Model FLOPs of a training step, for the ideal work compression of Section 5.3 / Table 4.

Row compression ``S / C`` is not the ceiling of the speedup: full-attention work grows with
position and shared tokens sit early in their trajectories. The *ideal work compression* is

    FLOPs(trajectory execution) / FLOPs(compact execution)

with the same per-row cost model on both sides:

* every executed row pays the per-row forward FLOPs of every layer (projections, short convolution,
  KDA core, dense or MoE FFN with ``top_k`` experts, router) and of the LM head;
* every full-attention layer additionally pays ``attn_flops_per_key`` for each key a query reads:
  a row at absolute position ``p`` reads ``p + 1`` keys (itself and its ancestors) in both
  executions, so a trajectory row and a compact row at the same position cost the same;
* KDA replay rows, ancestor-KV view copies, padding and recomputation are excluded (recomputation
  multiplies both sides alike; training FLOPs are taken as 3x forward).

Matmul FLOPs are ``2 * in * out``. The KDA core is estimated per row and head as
``4 B K + 2 B V + 6 K V`` (intra-chunk Q K^T and K K^T blocks, intra-chunk output, state read,
WY state correction and state update), independent of position; the Gated DeltaNet core the same
per value head (it runs on the KDA core). The Mamba2 (SSD) core per row and head as
``2 B N + 2 B P + 4 N P`` (intra-chunk C B^T block and its product with the values, state read and
state update; N the state size, P the head dim); its layer adds the input projection (z, x, B, C,
dt), the convolution over x, B and C, and the output projection. Shared experts count as a dense
SwiGLU (relu2 experts and MLPs: two matmuls instead of three) on every row; a ``none`` half of a
block costs nothing.
"""

from __future__ import annotations

import numpy as np

from harts_runtime.models import ModelConfig

__all__ = ["attended_keys", "layer_costs", "model_flops", "work_compression"]


def layer_costs(cfg: ModelConfig) -> dict:
    """Forward FLOPs per row: ``row`` (all per-row work of the model, LM head included),
    ``attn_per_key`` (summed over full-attention layers, per query-key pair),
    ``linear_core`` (the chunkwise cores of the KDA / Gated DeltaNet layers, part of ``row``) and
    ``linear_core_recompute`` (what a core's backward recomputes when its forward did not save
    it, fla's default: the WY factors and the state scan; outside the 3 x forward count), plus
    a breakdown."""
    d, h = cfg.hidden_size, cfg.num_heads
    kda_args, mla_args, moe_args, gdn_args = cfg.kda, cfg.mla, cfg.moe, cfg.gdn
    k, v = kda_args.head_k_dim, kda_args.head_v_dim
    mm = lambda i, o: 2 * i * o
    core = lambda heads, kk, vv: heads * (4 * cfg.chunk_size * kk + 2 * cfg.chunk_size * vv + 6 * kk * vv)
    hk = kda_args.num_heads or h
    if kda_args.low_rank_gates:  # decay and output-gate projections low-rank through V (fla, Kimi)
        kda_gates = mm(d, v) + mm(v, hk * k) + mm(d, v) + mm(v, hk * v)
    else:  # one full projection each (Ling-3.0)
        kda_gates = mm(d, hk * k) + mm(d, hk * v)
    kda = (
        mm(d, hk * k) * 2
        + mm(d, hk * v)
        + mm(d, hk)
        + kda_gates
        + mm(hk * v, d)
        + 2 * cfg.conv_size * (2 * hk * k + hk * v)
        + core(hk, k, v)
    )
    # Gated DeltaNet: q, k (Hk heads of K), v, z (Hv heads of V), beta and decay inputs (Hv each),
    # the convolution over q, k, v, the KDA-form core per value head, the output projection.
    gk, gv = gdn_args.num_k_heads, gdn_args.num_v_heads
    gkd, gvd = gdn_args.head_k_dim, gdn_args.head_v_dim
    gdn = (
        mm(d, 2 * gk * gkd + 2 * gv * gvd)
        + mm(d, 2 * gv)
        + 2 * cfg.conv_size * (2 * gk * gkd + gv * gvd)
        + core(gv, gkd, gvd)
        + mm(gv * gvd, d)
    )
    dqk = mla_args.qk_nope_head_dim + mla_args.qk_rope_head_dim
    if mla_args.q_lora_rank is None:
        mla_q = mm(d, h * dqk)
    else:
        mla_q = mm(d, mla_args.q_lora_rank) + mm(mla_args.q_lora_rank, h * dqk)
    mla = (
        mla_q
        + mm(d, mla_args.kv_lora_rank + mla_args.qk_rope_head_dim)
        + mm(mla_args.kv_lora_rank, h * (mla_args.qk_nope_head_dim + mla_args.v_head_dim))
        + mm(h * mla_args.v_head_dim, d)
        + (mm(d, h) if mla_args.output_gate else 0)  # Ling-3.0's head-wise output gate
    )
    mla_key = 2 * h * (dqk + mla_args.v_head_dim)
    hkv = cfg.num_kv_heads or h
    hd = cfg.gqa.head_dim or d // h  # MHA / GQA heads split the width unless given
    gqa = mm(d, h * hd) + 2 * mm(d, hkv * hd) + mm(h * hd, d)
    gqa_key = 2 * h * (2 * hd)
    ghd = cfg.gated_attention.head_dim or hd  # gated attention: its own head dim; q_proj also yields the gate
    gated = 2 * mm(d, h * ghd) + 2 * mm(d, hkv * ghd) + mm(h * ghd, d)
    gated_key = 2 * h * (2 * ghd)
    dense = 3 * mm(d, cfg.dense_intermediate)
    relu2 = 2 * mm(d, cfg.dense_intermediate)  # non-gated: up and down
    # Mamba2: in_proj to z, x (H P), B, C (G N each) and dt (H); the convolution over x, B, C; the
    # SSD core per head; out_proj
    m2 = cfg.mamba2
    m2_i, m2_conv = m2.num_heads * m2.head_dim, m2.num_heads * m2.head_dim + 2 * m2.n_groups * m2.state_size
    ssd = lambda heads, n, p: heads * (2 * cfg.chunk_size * (n + p) + 4 * n * p)  # noqa: E731
    mamba2 = (
        mm(d, m2_i + m2_conv + m2.num_heads)
        + 2 * cfg.conv_size * m2_conv
        + ssd(m2.num_heads, m2.state_size, m2.head_dim)
        + mm(m2_i, d)
    )
    n_mm = 2 if moe_args.activation == "relu2" else 3  # matmuls per expert row
    shared = moe_args.shared_intermediate_size or moe_args.num_shared_experts * moe_args.intermediate_size
    moe = (
        mm(d, moe_args.num_experts)
        + moe_args.top_k * n_mm * mm(d, moe_args.intermediate_size)
        + n_mm * mm(d, shared)
        + (mm(d, 1) if moe_args.shared_expert_gate and shared else 0)
    )
    mixer = {
        "kda": kda,
        "gdn": gdn,
        "mla": mla,
        "gqa": gqa,
        "gated_attention": gated,
        "mamba2": mamba2,
        "none": 0,
    }
    key = {
        "kda": 0,
        "gdn": 0,
        "mla": mla_key,
        "gqa": gqa_key,
        "gated_attention": gated_key,
        "mamba2": 0,
        "none": 0,
    }
    ffn = {"dense": dense, "moe": moe, "relu2": relu2, "none": 0}
    row = sum(mixer[m] + ffn[f] for m, f in zip(cfg.mixers, cfg.ffns)) + mm(d, cfg.vocab_size)
    linear = {
        "kda": core(hk, k, v),
        "gdn": core(gv, gkd, gvd),
        "mamba2": ssd(m2.num_heads, m2.state_size, m2.head_dim),
    }
    # w, u = A (beta k exp(g)), A (beta v): 2 B (K + V); the scan's u - w S and S + k^T v_new: 4 K V
    redo = lambda heads, kk, vv: heads * (2 * cfg.chunk_size * (kk + vv) + 4 * kk * vv)  # noqa: E731
    # SSD (fla's simple GLA): the backward recomputes the chunk states, 2 N P per row and head
    linear_redo = {
        "kda": redo(hk, k, v),
        "gdn": redo(gv, gkd, gvd),
        "mamba2": m2.num_heads * 2 * m2.state_size * m2.head_dim,
    }
    return {
        "row": row,
        "attn_per_key": sum(key[m] for m in cfg.mixers),
        "linear_core": sum(linear.get(m, 0) for m in cfg.mixers),
        "linear_core_recompute": sum(linear_redo.get(m, 0) for m in cfg.mixers),
        "per_layer": {
            "kda": kda,
            "gdn": gdn,
            "mla": mla,
            "gqa": gqa,
            "gated_attention": gated,
            "dense": dense,
            "moe": moe,
            "mamba2": mamba2,
            "relu2": relu2,
            "mla_per_key": mla_key,
            "gqa_per_key": gqa_key,
            "gated_attention_per_key": gated_key,
            "lm_head": mm(d, cfg.vocab_size),
        },
    }


def attended_keys(positions) -> int:
    """Query-key pairs of causal (or tree-ancestor) attention over rows at these absolute
    positions: ``sum(p + 1)``."""
    p = np.asarray(positions, dtype=np.int64)
    return int(p.sum() + p.size)


def model_flops(cfg: ModelConfig, num_rows: int, keys: int, training: bool = True) -> float:
    """FLOPs of ``num_rows`` rows reading ``keys`` query-key pairs per full-attention layer
    (forward; x3 for forward + backward when ``training``)."""
    c = layer_costs(cfg)
    f = float(num_rows) * c["row"] + float(keys) * c["attn_per_key"]
    return 3.0 * f if training else f


def work_compression(cfg: ModelConfig, lengths, compact_positions) -> dict:
    """Ideal work compression of a step.

    Parameters
    ----------
    lengths : array_like of int
        Trajectory lengths (the baseline executes ``sum(L)`` rows, ``sum L (L + 1) / 2`` keys).
    compact_positions : list of array_like of int
        Absolute positions of the non-replay compact rows of every microbatch
        (``CallPlan.position_ids``).

    Returns a dict: rows and keys of both executions, their training FLOPs, ``row_compression``
    and ``ideal_work_compression``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    t_rows = int(lengths.sum())
    t_keys = int((lengths * (lengths + 1) // 2).sum())
    c_rows = sum(int(np.asarray(p).size) for p in compact_positions)
    c_keys = sum(attended_keys(p) for p in compact_positions)
    tf, cf = model_flops(cfg, t_rows, t_keys), model_flops(cfg, c_rows, c_keys)
    return {
        "trajectory_rows": t_rows,
        "trajectory_keys": t_keys,
        "trajectory_flops": tf,
        "compact_rows": c_rows,
        "compact_keys": c_keys,
        "compact_flops": cf,
        "row_compression": t_rows / max(c_rows, 1),
        "ideal_work_compression": tf / max(cf, 1.0),
    }
