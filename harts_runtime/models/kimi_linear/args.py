"""Kimi-Linear configuration <-> :class:`~harts_runtime.models.hybrid.args.ModelConfig`.

:func:`from_hf_config` reads a transformers ``KimiLinearConfig`` or a ``config.json`` dict, in
either spelling of the fields (transformers' ``num_local_experts`` / ``n_group`` / ... or the
original checkpoint's ``num_experts`` / ``num_expert_group`` / ``linear_attn_config`` /
``first_k_dense_replace`` / ``moe_layer_freq``). Options our model cannot reproduce raise
:class:`~harts_runtime.errors.InvalidInputError` naming the field. :func:`to_hf_config` writes the
``config.json`` dict that ``transformers.AutoConfig`` reads back to the same model.
"""

from __future__ import annotations

from collections.abc import Mapping

from harts_runtime.errors import InvalidInputError
from harts_runtime.models.hf_config import as_dict, config_value
from harts_runtime.models.hybrid.args import KDAArgs, MLAArgs, ModelConfig, MoEArgs, ffn_pattern
from harts_runtime.options import DEFAULT_CHUNK_SIZE

__all__ = ["FP32_PARAMS", "from_hf_config", "to_hf_config"]

FP32_PARAMS = ("ffn.router", "mixer.dt_bias")
"""Parameters kept in float32 in any dtype, as transformers' ``_keep_in_fp32_modules_strict``
(``gate.weight``, ``dt_bias``; ``e_score_correction_bias`` is our always-fp32 ``expert_bias``)."""

_MIXER = {"linear_attention": "kda", "full_attention": "mla"}
_FFN = {"dense": "dense", "sparse": "moe"}
_ALIASES = {  # transformers name -> the original checkpoint's name (KimiLinearConfig.attribute_map)
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
}
_DEFAULTS = {  # KimiLinearConfig's defaults, for config.json files that leave a field out
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "num_local_experts": 256,
    "linear_head_dim": 128,
    "linear_num_heads": 32,
    "linear_conv_kernel_dim": 4,
}


def _as_dict(cfg) -> dict:
    return as_dict(cfg, "a KimiLinearConfig")


def _get(d: dict, name: str):
    return config_value(d, name, _ALIASES, _DEFAULTS)


def _layer_types(d: dict, n: int) -> list:
    lin = d.get("linear_attn_config") or {}
    types = d.get("layer_types")
    if types is None and "full_attn_layers" in lin and "kda_layers" in lin:
        types = [None] * n
        for i in lin["full_attn_layers"]:
            types[i - 1] = "full_attention"  # 1-indexed in the checkpoint
        for i in lin["kda_layers"]:
            types[i - 1] = "linear_attention"
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n:
        raise InvalidInputError("layer_types", f"needs {n} entries (num_hidden_layers), got {len(types)}")
    for i, t in enumerate(types):
        if t not in _MIXER:
            raise InvalidInputError(f"layer_types[{i}]", f"unsupported {t!r}; choose one of {sorted(_MIXER)}")
    return [_MIXER[t] for t in types]


def _mlp_types(d: dict, n: int) -> tuple:
    types = d.get("mlp_layer_types")
    if types is None:
        first = d.get("first_k_dense_replace")
        return ffn_pattern(n, 1 if first is None else int(first), int(d.get("moe_layer_freq") or 1))
    if len(types) != n:
        raise InvalidInputError("mlp_layer_types", f"needs {n} entries (num_hidden_layers), got {len(types)}")
    for i, t in enumerate(types):
        if t not in _FFN:
            raise InvalidInputError(f"mlp_layer_types[{i}]", f"unsupported {t!r}; choose dense or sparse")
    return tuple(_FFN[t] for t in types)


def _require(d: dict, name: str, ok, what: str):
    value = d.get(name)
    if value is not None and not ok(value):
        raise InvalidInputError(name, f"unsupported value {value!r}; HybridModel supports {what}")


def from_hf_config(
    cfg, *, dtype: str | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE, **overrides
) -> ModelConfig:
    """Our :class:`ModelConfig` of a Kimi-Linear config (``KimiLinearConfig`` or ``config.json`` dict).

    ``dtype``: ``float32``, ``bfloat16`` or ``float64`` (None: the config's ``dtype`` /
    ``torch_dtype`` when it is one of these, else ``float32``). ``chunk_size``: our KDA chunk
    size (does not change the math). ``overrides``: further :class:`ModelConfig` fields
    (execution options such as ``attn_backend``, ``kda_backend``, ``lm_head_rows``; an option
    group as a dict changes only the fields it names, as :meth:`ModelConfig.replace`).

    The model has exactly Kimi-Linear's parameters: in particular its KDA output-gate
    up-projection has no bias (``kda.output_gate_bias=False``, unlike fla's layer).

    Raises :class:`InvalidInputError` naming the field for options HybridModel cannot reproduce:
    ``hidden_act`` other than silu, ``tie_word_embeddings``, ``attention_bias``,
    ``num_key_value_heads`` != ``num_attention_heads``, a non-sigmoid router, MLA with RoPE
    (``mla_use_nope`` false), no shared experts, unknown layer types, ``use_grouped_topk`` false
    with several expert groups (transformers limits groups regardless).
    """
    d = _as_dict(cfg)
    _require(d, "hidden_act", lambda v: v == "silu", "silu")
    _require(d, "tie_word_embeddings", lambda v: not v, "an untied LM head")
    _require(d, "attention_bias", lambda v: not v, "bias-free attention projections")
    _require(d, "moe_router_activation_func", lambda v: v == "sigmoid", "a sigmoid router")
    _require(d, "mla_use_nope", lambda v: bool(v), "MLA without RoPE (mla_use_nope true)")
    _require(d, "pretraining_tp", lambda v: v == 1, "pretraining_tp 1")
    heads = int(_get(d, "num_attention_heads"))
    kv_heads = _get(d, "num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != heads:
        raise InvalidInputError(
            "num_key_value_heads",
            f"MLA needs num_key_value_heads == num_attention_heads ({heads}), got {kv_heads}",
        )
    shared = int(_get(d, "n_shared_experts"))
    if shared < 1:
        raise InvalidInputError(
            "n_shared_experts", f"HybridModel's Kimi-Linear needs >= 1 shared expert, got {shared}"
        )
    lin = d.get("linear_attn_config") or {}
    n = int(_get(d, "num_hidden_layers"))
    groups = int(_get(d, "n_group"))
    if d.get("use_grouped_topk") is False and groups > 1:  # transformers groups regardless
        raise InvalidInputError(
            "use_grouped_topk",
            f"false with {groups} expert groups: the original code and transformers disagree",
        )
    if dtype is None:
        dtype = str(d.get("dtype") or d.get("torch_dtype") or "float32").removeprefix("torch.")
        dtype = dtype if dtype in ("float32", "bfloat16", "float64") else "float32"
    experts_i = int(_get(d, "moe_intermediate_size"))
    kda_head_dim = int(lin.get("head_dim") or _get(d, "linear_head_dim"))
    fields = dict(
        vocab_size=int(_get(d, "vocab_size")),
        hidden_size=int(_get(d, "hidden_size")),
        mixers=tuple(_layer_types(d, n)),
        ffns=_mlp_types(d, n),
        num_heads=heads,
        kda=KDAArgs(
            num_heads=int(lin.get("num_heads") or _get(d, "linear_num_heads")),
            head_k_dim=kda_head_dim,
            head_v_dim=kda_head_dim,
            norm_eps=float(_get(d, "rms_norm_eps")),
            output_gate_bias=False,  # g_b_proj has no bias
        ),
        conv_size=int(lin.get("short_conv_kernel_size") or _get(d, "linear_conv_kernel_dim")),
        chunk_size=chunk_size,
        mla=MLAArgs(
            kv_lora_rank=int(_get(d, "kv_lora_rank")),
            q_lora_rank=None if _get(d, "q_lora_rank") is None else int(_get(d, "q_lora_rank")),
            qk_nope_head_dim=int(_get(d, "qk_nope_head_dim")),
            qk_rope_head_dim=int(_get(d, "qk_rope_head_dim")),
            v_head_dim=int(_get(d, "v_head_dim")),
            use_rope=False,
        ),
        dense_intermediate=int(_get(d, "intermediate_size")),
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
            aux_loss_coef=0.0,
            z_loss_coef=0.0,
        ),
        norm_eps=float(_get(d, "rms_norm_eps")),
        init_std=float(_get(d, "initializer_range")),
        dtype=dtype,
        fp32_params=FP32_PARAMS,
    )
    return ModelConfig(**fields).replace(**overrides)


def to_hf_config(cfg: ModelConfig, base: Mapping | None = None) -> dict:
    """The ``config.json`` dict of a Kimi-Linear ``cfg`` (``base``: fields to keep, e.g. the token
    ids of the config it was loaded from; the model fields are overwritten).

    Raises :class:`InvalidInputError` naming the :class:`ModelConfig` field a Kimi-Linear config
    cannot express (GQA layers, softmax routing, MLA with RoPE, ...).
    """

    def need(name, ok, what):
        value = cfg.field_value(name)
        if not ok(value):
            raise InvalidInputError(name, f"{value!r} has no Kimi-Linear equivalent; needs {what}")

    kda, mla, moe = cfg.kda, cfg.mla, cfg.moe
    need("mixers", lambda v: all(m in ("kda", "mla") for m in v), "only kda and mla layers")
    need("mla.use_rope", lambda v: not v, "False (Kimi-Linear's MLA has no RoPE)")
    if "moe" in cfg.ffns:
        need("moe.score_func", lambda v: v == "sigmoid", "sigmoid")
        need("moe.num_shared_experts", lambda v: v >= 1, ">= 1")
        need(
            "moe.shared_intermediate_size",
            lambda v: v in (None, moe.num_shared_experts * moe.intermediate_size),
            "moe.num_shared_experts * moe.intermediate_size",
        )
    need("kda.norm_eps", lambda v: v == cfg.norm_eps, "kda.norm_eps == norm_eps (one rms_norm_eps)")
    need(
        "kda.head_v_dim",
        lambda v: v == kda.head_k_dim,
        "kda.head_v_dim == kda.head_k_dim (one linear_head_dim)",
    )
    out = dict(base or {})
    for key in (
        "linear_attn_config",
        "first_k_dense_replace",
        "moe_layer_freq",
        "auto_map",
        *_ALIASES.values(),
    ):
        out.pop(key, None)  # superseded by the explicit fields below
    out.update(
        model_type="kimi_linear",
        architectures=["KimiLinearForCausalLM"],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.dense_intermediate,
        moe_intermediate_size=moe.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        n_shared_experts=max(moe.num_shared_experts, 1),
        routed_scaling_factor=moe.routed_scaling_factor,
        kv_lora_rank=mla.kv_lora_rank,
        q_lora_rank=mla.q_lora_rank,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        n_group=moe.num_expert_groups,
        topk_group=moe.topk_groups,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob,
        hidden_act="silu",
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=False,
        attention_bias=False,
        num_local_experts=moe.num_experts,
        layer_types=["linear_attention" if m == "kda" else "full_attention" for m in cfg.mixers],
        mlp_layer_types=["sparse" if f == "moe" else "dense" for f in cfg.ffns],
        linear_head_dim=kda.head_k_dim,
        linear_num_heads=kda.num_heads or cfg.num_heads,
        linear_conv_kernel_dim=cfg.conv_size,
        dtype=cfg.dtype,
    )
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        out.setdefault(key, None)
    return out
