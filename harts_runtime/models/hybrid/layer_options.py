"""The per-layer-kind option groups of a :class:`~harts_runtime.models.hybrid.args.ModelConfig`.

Each group holds the options only one mixer or FFN kind reads, under the name of that kind's
layer config field (:mod:`harts_runtime.layers`), so the model's builders pass a group through
(``dataclasses.asdict``) and add the model-wide values (``hidden_size``, ``num_heads``, the
backends, ``chunk_size``, ``conv_size``, ``norm_eps``) themselves:

* :class:`KDAArgs` (``ModelConfig.kda``) -> :class:`~harts_runtime.layers.kda.KDAConfig`;
* :class:`MLAArgs` (``ModelConfig.mla``) -> :class:`~harts_runtime.layers.mla.MLAConfig`;
* :class:`GatedAttentionArgs` (``ModelConfig.gated_attention``) ->
  :class:`~harts_runtime.layers.gated_attention.GatedAttentionConfig`;
* :class:`GDNArgs` (``ModelConfig.gdn``) -> :class:`~harts_runtime.layers.gdn.GatedDeltaNetConfig`;
* :class:`MoEArgs` (``ModelConfig.moe``) -> :class:`~harts_runtime.layers.moe.MoEConfig`; its
  per-layer tuples ``swiglu_limits`` / ``shared_swiglu_limits`` (Ling-3.0) give each MoE layer its
  entry as ``swiglu_limit`` / ``shared_swiglu_limit``;
* :class:`GQAArgs` (``ModelConfig.gqa``) -> :class:`~harts_runtime.layers.attention.AttentionConfig`
  (with the shared ``num_heads``, ``num_kv_heads``, ``rope_theta``);
* :class:`Mamba2Args` (``ModelConfig.mamba2``) -> :class:`~harts_runtime.layers.mamba2.Mamba2Config`.

(The dense FFNs, SwiGLU and relu2, read only ``dense_intermediate``.) Each group validates itself on construction and raises
:class:`~harts_runtime.errors.InvalidInputError` naming the field as ``<group>.<field>``
(``moe.top_k``); checks that need model-wide values stay in ``ModelConfig``.
:func:`group_from` builds a group from a dict (a YAML / JSON config), naming an unknown key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from harts_runtime.errors import InvalidInputError

__all__ = [
    "GROUPS",
    "GDNArgs",
    "GQAArgs",
    "GatedAttentionArgs",
    "KDAArgs",
    "MLAArgs",
    "Mamba2Args",
    "MoEArgs",
    "group_from",
]


def _at_least(group, names, low: int) -> None:
    for name in names:
        value = getattr(group, name)
        if value is not None and value < low:
            raise InvalidInputError(f"{group.GROUP}.{name}", f"must be >= {low}, got {value}")


@dataclass(kw_only=True)
class KDAArgs:
    """KDA (Kimi delta attention) options; ``hidden_size``, ``conv_size``, ``chunk_size`` and the
    backend (``kda_backend``) are the model's."""

    GROUP: ClassVar[str] = "kda"
    num_heads: int | None = None
    """KDA heads (None: the model's ``num_heads``)."""
    head_k_dim: int = 8
    """Key/query head dim (the state is K x V per head)."""
    head_v_dim: int = 8
    """Value head dim."""
    norm_eps: float = 1e-5
    """Epsilon of the gated output RMSNorm."""
    output_gate_bias: bool = True
    """Whether the output-gate up-projection has a bias (fla's layer: yes; Kimi-Linear: no)."""
    gate_lower_bound: float | None = None
    """None: the softplus decay gate (fla, Kimi-Linear); a negative number: Ling-3.0's bounded gate
    ``lb * sigmoid(exp(A_log) (f + dt_bias))`` (``kda_lower_bound``)."""
    low_rank_gates: bool = True
    """Low-rank decay / output-gate projections through V (fla, Kimi-Linear); False: one full
    projection each (Ling-3.0)."""

    def __post_init__(self):
        _at_least(self, ("num_heads", "head_k_dim", "head_v_dim"), 1)
        lb = self.gate_lower_bound
        if lb is not None and not -float("inf") < lb < 0:
            raise InvalidInputError(
                "kda.gate_lower_bound", f"must be a finite negative number or None, got {lb}"
            )


@dataclass(kw_only=True)
class MLAArgs:
    """MLA (multi-head latent attention) options; ``hidden_size``, ``num_heads``, ``rope_theta``
    and the backend (``attn_backend``) are the model's."""

    GROUP: ClassVar[str] = "mla"
    kv_lora_rank: int = 16
    """KV latent width."""
    q_lora_rank: int | None = None
    """Query latent width (None: direct query projection)."""
    qk_nope_head_dim: int = 8
    """Per-head query/key dims without RoPE."""
    qk_rope_head_dim: int = 4
    """Per-head query/key dims with RoPE."""
    v_head_dim: int = 8
    """Per-head value dim."""
    use_rope: bool = True
    """Rotate the ``qk_rope_head_dim`` parts (False: NoPE, as Kimi-Linear)."""
    rope_interleave: bool = False
    """Rotate interleaved pairs (DeepSeek-V3, Ling-3.0) instead of halves."""
    output_gate: bool = False
    """Ling-3.0's head-wise sigmoid output gate ``g_proj`` [H, D]."""

    def __post_init__(self):
        _at_least(self, ("kv_lora_rank", "q_lora_rank", "v_head_dim"), 1)
        _at_least(self, ("qk_nope_head_dim", "qk_rope_head_dim"), 0)


@dataclass(kw_only=True)
class GatedAttentionArgs:
    """Qwen3-Next / Qwen3.5 gated-attention options; ``hidden_size``, ``num_heads``,
    ``num_kv_heads``, ``rope_theta``, ``norm_eps`` (its q/k norms) and the backend are the model's."""

    GROUP: ClassVar[str] = "gated_attention"
    head_dim: int | None = None
    """Head dim (None: ``hidden_size // num_heads``)."""
    partial_rotary_factor: float = 0.25
    """Fraction of each head's dims that RoPE rotates."""

    def __post_init__(self):
        _at_least(self, ("head_dim",), 1)
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise InvalidInputError(
                "gated_attention.partial_rotary_factor",
                f"must be in (0, 1], got {self.partial_rotary_factor}",
            )


@dataclass(kw_only=True)
class GDNArgs:
    """Qwen3-Next / Qwen3.5 gated delta net options; ``hidden_size``, ``conv_size`` (its
    ``conv_kernel_size``), ``norm_eps`` and the backend (``kda_backend``) are the model's."""

    GROUP: ClassVar[str] = "gdn"
    num_k_heads: int = 2
    """Query/key heads."""
    num_v_heads: int = 2
    """Value heads (a multiple of ``num_k_heads``)."""
    head_k_dim: int = 8
    """Query/key head dim."""
    head_v_dim: int = 8
    """Value head dim."""
    projection: str = "fused"
    """Input projections: ``fused`` (Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``) or ``split``
    (Qwen3.5's ``in_proj_qkv`` (ours ``in_proj_q`` / ``in_proj_k`` / ``in_proj_v``) / ``in_proj_z`` /
    ``in_proj_b`` / ``in_proj_a``)."""

    def __post_init__(self):
        _at_least(self, ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"), 1)
        if self.num_v_heads % self.num_k_heads:
            raise InvalidInputError(
                "gdn.num_v_heads",
                f"{self.num_v_heads} is not a multiple of gdn.num_k_heads={self.num_k_heads}",
            )
        if self.projection not in ("fused", "split"):
            raise InvalidInputError("gdn.projection", f"choose fused or split, got {self.projection!r}")


@dataclass(kw_only=True)
class MoEArgs:
    """Routed-expert FFN options; ``hidden_size`` is the model's. (``top_k`` against
    ``num_experts`` is checked by ``ModelConfig`` only when a layer is ``moe``.)"""

    GROUP: ClassVar[str] = "moe"
    num_experts: int = 4
    """E."""
    top_k: int = 2
    """Experts per row."""
    intermediate_size: int = 16
    """Expert SwiGLU width."""
    score_func: str = "softmax"
    """Router scores: ``softmax`` or ``sigmoid``."""
    norm_topk_prob: bool = False
    """Renormalise the k selected scores."""
    use_expert_bias: bool = False
    """Aux-loss-free balancing bias (selection only)."""
    routed_scaling_factor: float = 1.0
    """Multiplier on the routed experts' combine weights."""
    num_expert_groups: int = 1
    """Expert groups of group-limited routing (1: plain top-k)."""
    topk_groups: int = 1
    """Groups a row may route to (with ``num_expert_groups > 1``)."""
    num_shared_experts: int = 0
    """Always-on shared experts per MoE layer (0: none)."""
    shared_intermediate_size: int | None = None
    """Width of the shared-expert SwiGLU (None: ``num_shared_experts * intermediate_size``)."""
    shared_expert_gate: bool = False
    """Qwen's sigmoid gate on the shared experts: ``routed + sigmoid(shared_expert_gate(x)) * shared(x)``."""
    aux_loss_coef: float = 1e-2
    """Load-balancing loss weight."""
    z_loss_coef: float = 1e-3
    """Router z-loss weight."""
    activation: str = "swiglu"
    """Expert FFN: ``swiglu`` (gated) or ``relu2`` (Nemotron-H's non-gated squared ReLU; the shared
    experts too)."""
    swiglu_limits: tuple = ()
    """Clipped SwiGLU of the routed experts, one limit per layer of the model (Ling-3.0's
    ``expert_swiglu_limit_list``; 0: plain SwiGLU; empty: none clipped); layer ``i``'s MoE gets
    ``swiglu_limits[i]`` as :attr:`~harts_runtime.layers.moe.MoEConfig.swiglu_limit`."""
    shared_swiglu_limits: tuple = ()
    """The same for the shared experts (``share_expert_swiglu_limit_list``)."""

    def __post_init__(self):
        self.swiglu_limits = tuple(float(v) for v in self.swiglu_limits)
        self.shared_swiglu_limits = tuple(float(v) for v in self.shared_swiglu_limits)
        for name in ("swiglu_limits", "shared_swiglu_limits"):
            for i, v in enumerate(getattr(self, name)):
                if not v >= 0:
                    raise InvalidInputError(f"moe.{name}[{i}]", f"must be >= 0 (0: no clipping), got {v}")
        _at_least(self, ("num_experts",), 1)
        _at_least(self, ("num_shared_experts",), 0)
        g = self.num_expert_groups
        if g < 1 or self.num_experts % g:
            raise InvalidInputError(
                "moe.num_expert_groups", f"must be >= 1 and divide num_experts={self.num_experts}, got {g}"
            )
        if g > 1 and not 1 <= self.topk_groups <= g:
            raise InvalidInputError("moe.topk_groups", f"must be in [1, {g}], got {self.topk_groups}")


@dataclass(kw_only=True)
class GQAArgs:
    """MHA / GQA options; ``hidden_size``, ``num_heads``, ``num_kv_heads``, ``rope_theta`` and the
    backend (``attn_backend``) are the model's."""

    GROUP: ClassVar[str] = "gqa"
    head_dim: int | None = None
    """Head dim (None: ``hidden_size // num_heads``)."""
    use_rope: bool = True
    """Rotate q and k (False: no positional encoding, as Nemotron-H's attention)."""

    def __post_init__(self):
        _at_least(self, ("head_dim",), 1)


@dataclass(kw_only=True)
class Mamba2Args:
    """Mamba2 (SSD) mixer options (:class:`~harts_runtime.layers.mamba2.Mamba2Config`);
    ``hidden_size``, ``conv_size`` (its ``conv_kernel_size``), ``chunk_size``, ``norm_eps`` and the
    backend (``kda_backend``) are the model's."""

    GROUP: ClassVar[str] = "mamba2"
    num_heads: int = 2
    """H (``mamba_num_heads``)."""
    head_dim: int = 8
    """P (``mamba_head_dim``)."""
    state_size: int = 8
    """N (``ssm_state_size``)."""
    n_groups: int = 1
    """Groups sharing B and C (``n_groups``); divides ``num_heads``."""
    use_conv_bias: bool = True
    """The convolution has a bias (``use_conv_bias``)."""
    use_bias: bool = False
    """``in_proj`` / ``out_proj`` have biases (``use_bias``)."""
    time_step_limit: tuple = (0.0, float("inf"))
    """Clamp of dt after the softplus (``time_step_limit``)."""

    def __post_init__(self):
        _at_least(self, ("num_heads", "head_dim", "state_size", "n_groups"), 1)
        if self.num_heads % self.n_groups:
            raise InvalidInputError(
                "mamba2.n_groups", f"{self.n_groups} does not divide mamba2.num_heads={self.num_heads}"
            )
        self.time_step_limit = tuple(float(t) for t in self.time_step_limit)


GROUPS: dict[str, type] = {
    "kda": KDAArgs,
    "mla": MLAArgs,
    "gated_attention": GatedAttentionArgs,
    "gdn": GDNArgs,
    "moe": MoEArgs,
    "gqa": GQAArgs,
    "mamba2": Mamba2Args,
}
"""``ModelConfig`` field -> its option group's class."""


def group_from(name: str, value, base=None):
    """The ``name`` group (:data:`GROUPS`) of ``value``: a copy of the group itself, or a mapping of its
    fields applied over ``base`` (None: the group's defaults). Raises :class:`InvalidInputError`
    naming ``<name>.<key>`` for an unknown key, ``name`` for a value of another type."""
    cls = GROUPS[name]
    if isinstance(value, cls):
        return dataclasses.replace(value)  # a copy: configs never share a mutable group
    if not isinstance(value, Mapping):
        raise InvalidInputError(name, f"expected a {cls.__name__} or a dict of its fields, got {value!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    for key in value:
        if key not in known:
            raise InvalidInputError(
                f"{name}.{key}", f"not a {cls.__name__} field; choose one of {sorted(known)}"
            )
    return dataclasses.replace(base, **value) if base is not None else cls(**value)
