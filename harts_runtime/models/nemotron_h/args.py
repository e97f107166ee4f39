"""Nemotron-H configuration <-> :class:`~harts_runtime.models.hybrid.args.ModelConfig`.

:func:`from_hf_config` reads a transformers ``NemotronHConfig`` or its ``config.json`` dict;
options our model cannot reproduce raise :class:`~harts_runtime.errors.InvalidInputError` naming
the field. :func:`to_hf_config` writes the ``config.json`` dict that ``transformers.AutoConfig``
reads back to the same model.

The map: a Nemotron-H layer holds one sublayer behind one pre-norm, so HF layer ``i`` is our
block ``i`` with the other half ``none``. ``hybrid_override_pattern`` (or ``layers_block_type``)
``M`` / ``linear_attention`` -> mixer ``mamba2`` (:class:`~harts_runtime.layers.mamba2.Mamba2Mixer`),
``*`` / ``full_attention`` -> mixer ``gqa`` without RoPE (``gqa.use_rope`` False, ``gqa.head_dim``),
``-`` / ``mlp`` -> FFN ``relu2`` (``intermediate_size``), ``E`` / ``moe`` -> FFN ``moe`` with
relu2 experts (``moe.activation``), sigmoid group routing with ``e_score_correction_bias``
(our expert bias), renormalised and scaled top-k, one relu2 shared expert. All RMSNorms use
``layer_norm_epsilon``. MTP layers (``num_nextn_predict_layers``) and latent MoE projections
(``moe_latent_size``) are refused.
"""

from __future__ import annotations

from collections.abc import Mapping

from harts_runtime.errors import InvalidInputError
from harts_runtime.models.hf_config import as_dict
from harts_runtime.models.hybrid.args import ModelConfig
from harts_runtime.options import DEFAULT_CHUNK_SIZE

__all__ = ["LAYER_KINDS", "from_hf_config", "to_hf_config"]

LAYER_KINDS = {  # HF layer type -> (our mixer, our ffn, pattern char)
    "linear_attention": ("mamba2", "none", "M"),
    "full_attention": ("gqa", "none", "*"),
    "mlp": ("none", "relu2", "-"),
    "moe": ("none", "moe", "E"),
}
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}
_CHARS = {v[2]: k for k, v in LAYER_KINDS.items()}

_DEFAULTS = {  # NemotronHConfig's defaults (transformers 5.25)
    "vocab_size": 131072,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 21504,
    "mlp_hidden_act": "relu2",
    "ssm_state_size": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "n_groups": 8,
    "conv_kernel": 4,
    "time_step_limit": (0.0, float("inf")),
    "use_conv_bias": True,
    "use_bias": False,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "layer_norm_epsilon": 1e-5,
    "initializer_range": 0.02,
}
_ALIASES = {  # legacy config.json names -> NemotronHConfig's
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias",
}


def _as_dict(cfg) -> dict:
    return as_dict(cfg, "a transformers config")


def layer_types(d: Mapping) -> list[str]:
    """The HF layer types of a config dict: ``layers_block_type`` / ``layer_types`` (legacy names
    ``mamba`` / ``attention`` read too) or else ``hybrid_override_pattern``."""
    types = d.get("layers_block_type") or d.get("layer_types")
    if types is None:
        pattern = d.get("hybrid_override_pattern")
        if pattern is None:
            raise InvalidInputError("hybrid_override_pattern", "missing (and no layers_block_type)")
        for i, ch in enumerate(pattern):
            if ch not in _CHARS:
                raise InvalidInputError(
                    f"hybrid_override_pattern[{i}]", f"unknown {ch!r}; choose from {sorted(_CHARS)}"
                )
        return [_CHARS[ch] for ch in pattern]
    types = [_LEGACY.get(t, t) for t in types]
    for i, t in enumerate(types):
        if t not in LAYER_KINDS:
            raise InvalidInputError(
                f"layers_block_type[{i}]", f"unsupported {t!r}; choose one of {sorted(LAYER_KINDS)}"
            )
    return types


def _number(v) -> float:
    """A config number; transformers writes an infinite one as ``{"__float__": "Infinity"}``."""
    if isinstance(v, Mapping) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


def _json_number(x: float):
    """``x`` as transformers' ``config.json`` spells it (an infinite one as ``{"__float__": ...}``)."""
    return {"__float__": "Infinity" if x > 0 else "-Infinity"} if x in (float("inf"), float("-inf")) else x


def _require(d: dict, name: str, ok, what: str):
    value = d.get(name)
    if value is not None and not ok(value):
        raise InvalidInputError(name, f"unsupported value {value!r}; HybridModel supports {what}")


def from_hf_config(
    cfg, *, dtype: str | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE, **overrides
) -> ModelConfig:
    """Our :class:`ModelConfig` of a Nemotron-H config (a transformers config or a ``config.json``
    dict).

    ``dtype``: ``float32``, ``bfloat16`` or ``float64`` (None: the config's when it is one of these,
    else ``float32``). ``chunk_size``: our SSD chunk size (does not change the math; default
    :data:`~harts_runtime.options.DEFAULT_CHUNK_SIZE`, the Triton path's). ``overrides``: further
    :class:`ModelConfig` fields.

    Raises :class:`InvalidInputError` naming the field for options HybridModel cannot reproduce:
    activations other than relu2 / silu, ``tie_word_embeddings``, ``attention_bias``, ``mlp_bias``,
    a non-zero ``attention_dropout``, ``sliding_window``, ``moe_latent_size``,
    ``num_nextn_predict_layers`` > 0, ``n_shared_experts`` other than 1, unknown layer types.
    """
    d = _as_dict(cfg)
    for old, new in _ALIASES.items():
        if d.get(new) is None and d.get(old) is not None:
            d[new] = d[old]

    def get(name):
        v = d.get(name)
        return _DEFAULTS.get(name) if v is None else v

    _require(d, "mlp_hidden_act", lambda v: v == "relu2", "relu2")
    _require(d, "mamba_hidden_act", lambda v: v == "silu", "silu")
    _require(d, "tie_word_embeddings", lambda v: not v, "an untied LM head")
    _require(d, "attention_bias", lambda v: not v, "bias-free attention projections")
    _require(d, "mlp_bias", lambda v: not v, "bias-free MLPs")
    _require(d, "attention_dropout", lambda v: float(v) == 0.0, "attention_dropout 0")
    _require(d, "sliding_window", lambda v: False, "full attention (no sliding window)")
    _require(d, "moe_latent_size", lambda v: False, "MoE without latent projections")
    _require(d, "num_nextn_predict_layers", lambda v: int(v) == 0, "no MTP layers")
    types = layer_types(d)
    mixers = tuple(LAYER_KINDS[t][0] for t in types)
    ffns = tuple(LAYER_KINDS[t][1] for t in types)
    if "moe" in ffns and int(get("n_shared_experts")) != 1:
        raise InvalidInputError("n_shared_experts", f"{get('n_shared_experts')}; HybridModel supports 1")
    if dtype is None:
        dtype = str(d.get("dtype") or d.get("torch_dtype") or "float32").removeprefix("torch.")
        dtype = dtype if dtype in ("float32", "bfloat16", "float64") else "float32"
    lo, hi = get("time_step_limit")
    fields = dict(
        vocab_size=int(get("vocab_size")),
        hidden_size=int(get("hidden_size")),
        mixers=mixers,
        ffns=ffns,
        num_heads=int(get("num_attention_heads")),
        num_kv_heads=int(get("num_key_value_heads")),
        gqa={"head_dim": int(get("head_dim")), "use_rope": False},
        mamba2={
            "num_heads": int(get("mamba_num_heads")),
            "head_dim": int(get("mamba_head_dim")),
            "state_size": int(get("ssm_state_size")),
            "n_groups": int(get("n_groups")),
            "use_conv_bias": bool(get("use_conv_bias")),
            "use_bias": bool(get("use_bias")),
            "time_step_limit": (_number(lo), _number(hi)),
        },
        conv_size=int(get("conv_kernel")),
        chunk_size=chunk_size,
        dense_intermediate=int(get("intermediate_size")),
        moe={
            "num_experts": int(get("n_routed_experts")),
            "top_k": int(get("num_experts_per_tok")),
            "intermediate_size": int(get("moe_intermediate_size")),
            "score_func": "sigmoid",
            "norm_topk_prob": bool(get("norm_topk_prob")),
            "routed_scaling_factor": float(get("routed_scaling_factor")),
            "use_expert_bias": True,
            "num_expert_groups": int(get("n_group")),
            "topk_groups": int(get("topk_group")),
            "num_shared_experts": 1,
            "shared_intermediate_size": int(get("moe_shared_expert_intermediate_size")),
            "activation": "relu2",
            "aux_loss_coef": 0.0,
            "z_loss_coef": 0.0,
        },
        norm_eps=float(get("layer_norm_epsilon")),
        init_std=float(get("initializer_range")),
        dtype=dtype,
        fp32_params=("ffn.router",),  # transformers keeps gate.weight in float32
    )
    return ModelConfig().replace(**fields).replace(**overrides)


def to_hf_config(cfg: ModelConfig, base: Mapping | None = None) -> dict:
    """The ``config.json`` dict of ``cfg`` (``model_type`` ``nemotron_h``); ``base``: fields to
    keep (token ids, ...). Raises :class:`InvalidInputError` naming the :class:`ModelConfig` field
    Nemotron-H cannot express (a block with both a mixer and an FFN, other mixers or FFNs, RoPE,
    softmax routing, zero-centred norms, ...)."""

    def need(name, ok, what):
        value = cfg.field_value(name)
        if not ok(value):
            raise InvalidInputError(name, f"{value!r} has no nemotron_h equivalent; needs {what}")

    kind_of = {(m, f): t for t, (m, f, _) in LAYER_KINDS.items()}
    for i, pair in enumerate(zip(cfg.mixers, cfg.ffns)):
        if pair not in kind_of:
            raise InvalidInputError(
                f"mixers[{i}]",
                f"block {i} is {pair}; nemotron_h blocks are one of {sorted(kind_of)}",
            )
    need("zero_centered_norms", lambda v: not v, "False")
    if "gqa" in cfg.mixers:
        need("gqa.use_rope", lambda v: not v, "False")
    if "moe" in cfg.ffns:
        need("moe.activation", lambda v: v == "relu2", "relu2")
        need("moe.score_func", lambda v: v == "sigmoid", "sigmoid")
        need("moe.use_expert_bias", bool, "True")
        need("moe.num_shared_experts", lambda v: v == 1, "1")
        need("moe.shared_expert_gate", lambda v: not v, "False")
    types = [kind_of[p] for p in zip(cfg.mixers, cfg.ffns)]
    m, moe = cfg.mamba2, cfg.moe
    out = dict(base or {})
    for key in ("layer_types", "hybrid_override_pattern", "mamba_n_groups", "mamba_d_conv", "mamba_dt_limit"):
        out.pop(key, None)
    out.update(
        model_type="nemotron_h",
        architectures=["NemotronHForCausalLM"],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        layers_block_type=types,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
        head_dim=cfg.gqa.head_dim or cfg.hidden_size // cfg.num_heads,
        attention_bias=False,
        attention_dropout=0.0,
        intermediate_size=cfg.dense_intermediate,
        mlp_hidden_act="relu2",
        mlp_bias=False,
        ssm_state_size=m.state_size,
        mamba_num_heads=m.num_heads,
        mamba_head_dim=m.head_dim,
        mamba_hidden_act="silu",
        n_groups=m.n_groups,
        conv_kernel=cfg.conv_size,
        use_conv_bias=m.use_conv_bias,
        use_bias=m.use_bias,
        time_step_limit=[_json_number(x) for x in m.time_step_limit],
        n_routed_experts=moe.num_experts,
        n_shared_experts=1,
        moe_intermediate_size=moe.intermediate_size,
        moe_shared_expert_intermediate_size=moe.shared_intermediate_size or moe.intermediate_size,
        moe_latent_size=None,
        num_experts_per_tok=moe.top_k,
        routed_scaling_factor=moe.routed_scaling_factor,
        n_group=moe.num_expert_groups,
        topk_group=moe.topk_groups,
        norm_topk_prob=moe.norm_topk_prob,
        num_nextn_predict_layers=0,
        layer_norm_epsilon=cfg.norm_eps,
        initializer_range=cfg.init_std,
        tie_word_embeddings=False,
        dtype=cfg.dtype,
    )
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        out.setdefault(key, None)
    return out
