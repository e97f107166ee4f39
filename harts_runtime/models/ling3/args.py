"""Ling-3.0 configuration (transformers ``BailingHybridConfig``, ``model_type: bailing_hybrid``)
<-> :class:`~harts_runtime.models.hybrid.args.ModelConfig`.

:func:`from_hf_config` reads a ``BailingHybridConfig`` or its ``config.json`` dict, in either
spelling of the fields (transformers' ``n_group`` / ``num_local_experts`` / ``swiglu_limits`` /
... or the checkpoint's ``num_expert_group`` / ``num_experts`` / ``expert_swiglu_limit_list`` /
...). Options our model cannot reproduce raise :class:`~harts_runtime.errors.InvalidInputError`
naming the field. :func:`to_hf_config` writes the ``config.json`` dict that
``transformers.AutoConfig`` reads back to the same model.

What Ling-3.0 sets in our groups: KDA with the bounded forget gate (``kda.gate_lower_bound`` =
``kda_lower_bound`` when ``kda_safe_gate``, else None: the softplus gate) and full-rank gate
projections (``kda.low_rank_gates=False``, no output-gate bias); MLA with RoPE on interleaved
pairs (``mla.rope_interleave``) and the head-wise output gate (``mla.output_gate``); a sigmoid MoE
with ``e_score_correction_bias`` (our ``expert_bias``), group-limited top-k, renormalised and scaled
weights, shared experts, and per-layer SwiGLU limits (``moe.swiglu_limits``,
``moe.shared_swiglu_limits``: one per layer, 0 off). The KDA head dim is ``linear_head_dim``
(transformers' ``head_dim`` before it becomes ``qk_rope_head_dim``). MTP layers
(``num_nextn_predict_layers``) are not built: their tensors are kept and written back
(:mod:`harts_runtime.models.ling3.state_dict_adapter`).
"""

from __future__ import annotations

from collections.abc import Mapping

from harts_runtime.errors import InvalidInputError
from harts_runtime.models.hf_config import as_dict, config_value
from harts_runtime.models.hybrid.args import KDAArgs, MLAArgs, ModelConfig, MoEArgs
from harts_runtime.options import DEFAULT_CHUNK_SIZE

__all__ = [
    "ARCHITECTURE",
    "FP32_PARAMS",
    "MODEL_TYPE",
    "first_k_dense_replace",
    "from_hf_config",
    "layer_group_size",
    "to_hf_config",
]

MODEL_TYPE = "bailing_hybrid"
ARCHITECTURE = "BailingMoeV3ForCausalLM"
"""The released checkpoints' ``architectures`` (the class vLLM and SGLang serve them with);
transformers builds ``BailingHybridForCausalLM`` from ``model_type`` whatever it says."""
FP32_PARAMS = ("ffn.router", "mixer.dt_bias", "mixer.A_log")
"""Parameters kept in float32 in any dtype, as transformers' ``_keep_in_fp32_modules_strict``
(``gate.weight``, ``dt_bias``, ``A_log``; ``e_score_correction_bias`` is our always-fp32
``expert_bias``). transformers also keeps the KDA ``conv1d`` in float32; ours follow the model
dtype, as Kimi-Linear's (fla's varlen convolution takes one dtype)."""

_ALIASES = {  # transformers name -> the checkpoint's name (BailingHybridConfig.attribute_map)
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "num_mtp_layers": "num_nextn_predict_layers",
    "swiglu_limits": "expert_swiglu_limit_list",
    "swiglu_limits_shared": "share_expert_swiglu_limit_list",
    "linear_conv_kernel_dim": "short_conv_kernel_size",
}
_DEFAULTS = {  # BailingHybridConfig's defaults, for config.json files that leave a field out
    "vocab_size": 157184,
    "hidden_size": 2560,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 42,
    "num_attention_heads": 32,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 2,
    "norm_topk_prob": True,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "num_local_experts": 512,
    "rope_theta": 6_000_000.0,
    "head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "layer_group_size": 6,
    "kda_safe_gate": True,
    "kda_lower_bound": -5.0,
    "num_mtp_layers": 1,
}


def _as_dict(cfg) -> dict:
    return as_dict(cfg, "a BailingHybridConfig")


def _get(d: dict, name: str):
    return config_value(d, name, _ALIASES, _DEFAULTS)


def _require(d: dict, name: str, ok, what: str):
    value = d.get(name)
    if value is not None and not ok(value):
        raise InvalidInputError(name, f"unsupported value {value!r}; HybridModel supports {what}")


def _per_layer(d: dict, name: str, n: int, kinds: dict) -> tuple:
    """The per-layer list ``name`` mapped through ``kinds`` (its length and values checked)."""
    types = d.get(name)
    if len(types) != n:
        raise InvalidInputError(name, f"needs {n} entries (num_hidden_layers), got {len(types)}")
    for i, t in enumerate(types):
        if t not in kinds:
            raise InvalidInputError(f"{name}[{i}]", f"unsupported {t!r}; choose one of {sorted(kinds)}")
    return tuple(kinds[t] for t in types)


def _limits(d: dict, name: str, n: int) -> tuple:
    values = _get(d, name)
    if values is None:
        return (0.0,) * n
    if len(values) != n:
        raise InvalidInputError(
            _ALIASES[name], f"needs one limit per layer ({n}, num_hidden_layers), got {len(values)}"
        )
    for i, v in enumerate(values):
        if not float(v) >= 0:
            raise InvalidInputError(f"{_ALIASES[name]}[{i}]", f"must be >= 0 (0: no clipping), got {v}")
    return tuple(float(v) for v in values)


def _rope_theta(d: dict) -> float:
    rope = d.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise InvalidInputError("rope_parameters", f"rope_type {kind!r}; HybridModel supports default")
    return float(rope.get("rope_theta") or _get(d, "rope_theta"))


def from_hf_config(
    cfg, *, dtype: str | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE, **overrides
) -> ModelConfig:
    """Our :class:`ModelConfig` of a Ling-3.0 config (``BailingHybridConfig`` or ``config.json`` dict).

    ``dtype``: ``float32``, ``bfloat16`` or ``float64`` (None: the config's ``dtype`` /
    ``torch_dtype`` when it is one of these, else ``float32``). ``chunk_size``: our KDA chunk
    size (does not change the math). ``overrides``: further :class:`ModelConfig` fields.

    Raises :class:`InvalidInputError` naming the field for options HybridModel cannot reproduce:
    ``hidden_act`` other than silu, ``tie_word_embeddings``, ``attention_bias``,
    ``num_key_value_heads`` != ``num_attention_heads`` (or ``linear_num_heads``), no shared
    experts, a RoPE type other than default, unknown layer types, a SwiGLU limit list of the wrong
    length or with negative values.
    """
    d = _as_dict(cfg)
    _require(d, "hidden_act", lambda v: v == "silu", "silu")
    _require(d, "tie_word_embeddings", lambda v: not v, "an untied LM head")
    _require(d, "attention_bias", lambda v: not v, "bias-free attention projections")
    _require(d, "pretraining_tp", lambda v: v == 1, "pretraining_tp 1")
    heads = int(_get(d, "num_attention_heads"))
    for name in ("num_key_value_heads", "linear_num_heads"):
        value = d.get(name)
        if value is not None and int(value) != heads:
            raise InvalidInputError(name, f"must equal num_attention_heads ({heads}), got {value}")
    shared = int(_get(d, "n_shared_experts"))
    if shared < 1:
        raise InvalidInputError("n_shared_experts", f"Ling-3.0's MoE has >= 1 shared expert, got {shared}")
    n = int(_get(d, "num_hidden_layers"))
    if d.get("layer_types") is None:
        group = int(_get(d, "layer_group_size"))
        d["layer_types"] = [
            "full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(n)
        ]
    if d.get("mlp_layer_types") is None:
        first = int(_get(d, "first_k_dense_replace"))
        d["mlp_layer_types"] = ["dense" if i < first else "sparse" for i in range(n)]
    mixers = _per_layer(d, "layer_types", n, {"linear_attention": "kda", "full_attention": "mla"})
    ffns = _per_layer(d, "mlp_layer_types", n, {"dense": "dense", "sparse": "moe"})
    if dtype is None:
        dtype = str(d.get("dtype") or d.get("torch_dtype") or "float32").removeprefix("torch.")
        dtype = dtype if dtype in ("float32", "bfloat16", "float64") else "float32"
    experts_i = int(_get(d, "moe_intermediate_size"))
    groups = int(_get(d, "n_group"))
    head_dim = int(d.get("linear_head_dim") or _get(d, "head_dim"))
    q_rank = _get(d, "q_lora_rank")
    fields = dict(
        vocab_size=int(_get(d, "vocab_size")),
        hidden_size=int(_get(d, "hidden_size")),
        mixers=mixers,
        ffns=ffns,
        num_heads=heads,
        rope_theta=_rope_theta(d),
        conv_size=int(_get(d, "linear_conv_kernel_dim")),
        chunk_size=chunk_size,
        dense_intermediate=int(_get(d, "intermediate_size")),
        kda=KDAArgs(
            num_heads=heads,
            head_k_dim=head_dim,
            head_v_dim=head_dim,
            norm_eps=float(_get(d, "rms_norm_eps")),
            output_gate_bias=False,
            gate_lower_bound=float(_get(d, "kda_lower_bound")) if _get(d, "kda_safe_gate") else None,
            low_rank_gates=False,
        ),
        mla=MLAArgs(
            kv_lora_rank=int(_get(d, "kv_lora_rank")),
            q_lora_rank=None if q_rank is None else int(q_rank),
            qk_nope_head_dim=int(_get(d, "qk_nope_head_dim")),
            qk_rope_head_dim=int(_get(d, "qk_rope_head_dim")),
            v_head_dim=int(_get(d, "v_head_dim")),
            use_rope=True,
            rope_interleave=True,
            output_gate=True,
        ),
        moe=MoEArgs(
            num_experts=int(_get(d, "num_local_experts")),
            top_k=int(_get(d, "num_experts_per_tok")),
            intermediate_size=experts_i,
            score_func="sigmoid",
            norm_topk_prob=bool(_get(d, "norm_topk_prob")),
            use_expert_bias=True,
            routed_scaling_factor=float(_get(d, "routed_scaling_factor")),
            num_expert_groups=groups,
            topk_groups=int(_get(d, "topk_group")) if groups > 1 else 1,
            num_shared_experts=shared,
            shared_intermediate_size=shared * experts_i,
            swiglu_limits=_limits(d, "swiglu_limits", n),
            shared_swiglu_limits=_limits(d, "swiglu_limits_shared", n),
            aux_loss_coef=0.0,
            z_loss_coef=0.0,
        ),
        norm_eps=float(_get(d, "rms_norm_eps")),
        init_std=float(_get(d, "initializer_range")),
        dtype=dtype,
        fp32_params=FP32_PARAMS,
    )
    return ModelConfig(**fields).replace(**overrides)


def owns(cfg: ModelConfig) -> bool:
    """A model whose KDA has Ling's full-rank gates, or whose MLA has Ling's output gate, is a
    Ling-3.0 model (Kimi-Linear has neither)."""
    return ("kda" in cfg.mixers and not cfg.kda.low_rank_gates) or (
        "mla" in cfg.mixers and cfg.mla.output_gate
    )


def _mtp_layers(base: Mapping) -> int:
    """The MTP layers the base config declares (either spelling; none without a base)."""
    return int(base.get("num_nextn_predict_layers", base.get("num_mtp_layers")) or 0)


def layer_group_size(mixers) -> int | None:
    """The ``layer_group_size`` ``g`` whose schedule is ``mixers`` in the released checkpoints' rule
    (vLLM's and the checkpoints' own config code: layer ``i`` is MLA when ``(i + 1) % g == 0`` or it
    lies past the last whole group, ``i >= n // g * g``, else KDA); None when no ``g`` gives
    ``mixers`` (a model without MLA layers, or one whose last layers after a whole group are KDA
    layers). transformers reads ``layer_types`` instead (its own rule has no tail of MLA layers)."""
    n = len(mixers)
    for g in range(1, n + 1):
        if all((m == "mla") == ((i + 1) % g == 0 or i >= n // g * g) for i, m in enumerate(mixers)):
            return g
    return None


def first_k_dense_replace(ffns) -> int | None:
    """The number of leading dense layers when every later layer is MoE (``first_k_dense_replace``,
    the rule of the engines and transformers' default), else None."""
    k = next((i for i, f in enumerate(ffns) if f != "dense"), len(ffns))
    return k if all(f == "moe" for f in ffns[k:]) else None


def to_hf_config(cfg: ModelConfig, base: Mapping | None = None) -> dict:
    """The ``config.json`` dict of a Ling-3.0 ``cfg`` (``base``: fields to keep, e.g. the token
    ids and ``num_nextn_predict_layers`` of the config it was loaded from; the model fields are
    overwritten; without a base no MTP layers are declared).
    ``architectures`` is the released checkpoints' (:data:`ARCHITECTURE`), and the keys of their
    config that vLLM's ``BailingMoeV3ForCausalLM`` reads are written from ``cfg``: ``use_bias``,
    ``moe_shared_expert_intermediate_size``, ``no_kda_lora``,
    ``gated_attention_proj_granularity_type`` and, when their rule gives the layer schedule,
    ``layer_group_size`` (:func:`layer_group_size`) and ``first_k_dense_replace``
    (:func:`first_k_dense_replace`); transformers reads ``layer_types`` / ``mlp_layer_types``.

    Raises :class:`InvalidInputError` naming the :class:`ModelConfig` field a Ling-3.0 config
    cannot express (GQA layers, low-rank KDA gates, MLA without the output gate or with
    rotate-half RoPE, softmax routing, ...).
    """

    def need(name, ok, what):
        value = cfg.field_value(name)
        if not ok(value):
            raise InvalidInputError(name, f"{value!r} has no Ling-3.0 equivalent; needs {what}")

    kda, mla, moe = cfg.kda, cfg.mla, cfg.moe
    need("mixers", lambda v: all(m in ("kda", "mla") for m in v), "only kda and mla layers")
    need("zero_centered_norms", lambda v: not v, "False")
    if "kda" in cfg.mixers:
        need("kda.low_rank_gates", lambda v: not v, "False (one f_proj and one g_proj)")
        need("kda.output_gate_bias", lambda v: not v, "False")
        need("kda.norm_eps", lambda v: v == cfg.norm_eps, "kda.norm_eps == norm_eps (one rms_norm_eps)")
        need("kda.head_v_dim", lambda v: v == kda.head_k_dim, "kda.head_v_dim == kda.head_k_dim")
        need("kda.num_heads", lambda v: v in (None, cfg.num_heads), "num_heads (linear_num_heads)")
    if "mla" in cfg.mixers:
        need("mla.use_rope", lambda v: v, "True")
        need("mla.rope_interleave", lambda v: v, "True (DeepSeek-V3's interleaved pairs)")
        need("mla.output_gate", lambda v: v, "True (g_proj)")
    if "moe" in cfg.ffns:
        need("moe.score_func", lambda v: v == "sigmoid", "sigmoid")
        need("moe.use_expert_bias", lambda v: v, "True (e_score_correction_bias)")
        need("moe.shared_expert_gate", lambda v: not v, "False")
        need("moe.num_shared_experts", lambda v: v >= 1, ">= 1")
        need(
            "moe.shared_intermediate_size",
            lambda v: v in (None, moe.num_shared_experts * moe.intermediate_size),
            "moe.num_shared_experts * moe.intermediate_size",
        )
    n = cfg.num_layers
    out = dict(base or {})
    for key in (
        "auto_map",
        "layer_group_size",
        "first_k_dense_replace",
        "head_dim",
        "gated_attention_proj_granularity_type",
        *_ALIASES,
    ):
        out.pop(key, None)  # superseded by the explicit fields below
    out.update(
        model_type=MODEL_TYPE,
        architectures=[ARCHITECTURE],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.dense_intermediate,
        moe_intermediate_size=moe.intermediate_size,
        num_hidden_layers=n,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        num_shared_experts=max(moe.num_shared_experts, 1),
        routed_scaling_factor=moe.routed_scaling_factor,
        kv_lora_rank=mla.kv_lora_rank,
        q_lora_rank=mla.q_lora_rank,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        num_expert_group=moe.num_expert_groups,
        topk_group=moe.topk_groups,
        num_experts_per_token=moe.top_k,
        moe_renormalize=moe.norm_topk_prob,
        hidden_act="silu",
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=False,
        attention_bias=False,
        num_experts=moe.num_experts,
        rope_theta=cfg.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        head_dim=kda.head_k_dim,
        linear_head_dim=kda.head_k_dim,
        linear_num_heads=cfg.num_heads,
        short_conv_kernel_size=cfg.conv_size,
        linear_conv_kernel_dim=cfg.conv_size,
        kda_safe_gate=kda.gate_lower_bound is not None,
        kda_lower_bound=-5.0 if kda.gate_lower_bound is None else kda.gate_lower_bound,
        layer_types=["linear_attention" if m == "kda" else "full_attention" for m in cfg.mixers],
        mlp_layer_types=["sparse" if f == "moe" else "dense" for f in cfg.ffns],
        expert_swiglu_limit_list=list(moe.swiglu_limits or (0.0,) * n),
        share_expert_swiglu_limit_list=list(moe.shared_swiglu_limits or (0.0,) * n),
        num_nextn_predict_layers=_mtp_layers(base or {}),
        dtype=cfg.dtype,
        # the released checkpoints' keys that vLLM's BailingMoeV3ForCausalLM reads
        use_bias=False,  # HybridModel's SwiGLU MLPs have no bias
        moe_shared_expert_intermediate_size=moe.intermediate_size,  # per shared expert (checked above)
        no_kda_lora=True,  # full-rank f_proj / g_proj (kda.low_rank_gates False, checked above)
    )
    if "mla" in cfg.mixers:  # g_proj [H, D]: one gate per head
        out["gated_attention_proj_granularity_type"] = "head_wise"
    for key, value in (
        ("layer_group_size", layer_group_size(cfg.mixers)),
        ("first_k_dense_replace", first_k_dense_replace(cfg.ffns)),
    ):
        if value is not None:  # the engines' schedule keys, written when they give ours
            out[key] = value
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        out.setdefault(key, None)
    return out
