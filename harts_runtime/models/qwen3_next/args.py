"""Qwen3-Next configuration <-> :class:`~harts_runtime.models.hybrid.args.ModelConfig`.

:func:`from_hf_config` reads a transformers ``Qwen3NextConfig`` or its ``config.json`` dict;
options our model cannot reproduce raise :class:`~harts_runtime.errors.InvalidInputError` naming
the field. :func:`to_hf_config` writes the ``config.json`` dict that ``transformers.AutoConfig``
reads back to the same model. The Qwen3.5-MoE text configs share this code
(:mod:`harts_runtime.models.qwen3_5_moe` calls it): ``family`` selects the differences.

The map: ``layer_types`` ``linear_attention`` -> ``gdn``, ``full_attention`` -> ``gated_attention``;
layer ``i`` is MoE when ``i`` is not in ``mlp_only_layers``, ``num_experts > 0`` and
``(i + 1) % decoder_sparse_step == 0``, else a dense SwiGLU (``intermediate_size``); MoE layers are
softmax top-k (``norm_topk_prob``) with one shared expert (``shared_expert_intermediate_size``)
behind a sigmoid gate; every RMSNorm is zero-centred.
"""

from __future__ import annotations

from collections.abc import Mapping

from harts_runtime.errors import InvalidInputError
from harts_runtime.models.hf_config import as_dict
from harts_runtime.models.hybrid.args import GatedAttentionArgs, GDNArgs, ModelConfig, MoEArgs
from harts_runtime.options import DEFAULT_CHUNK_SIZE

__all__ = ["FAMILIES", "from_hf_config", "full_attention_interval", "to_hf_config"]

_MIXER = {"linear_attention": "gdn", "full_attention": "gated_attention"}

FAMILIES = {
    # model_type written by to_hf_config -> (architecture, GDN projection, has dense layers)
    "qwen3_next": ("Qwen3NextForCausalLM", "fused", True),
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", "split", False),
}

_DEFAULTS = {  # Qwen3NextConfig's defaults (Qwen3.5-MoE: its own, below)
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10,
    "num_experts": 512,
    "norm_topk_prob": True,
    "mlp_only_layers": [],
}
_DEFAULTS_35 = {
    **_DEFAULTS,
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 8,
    "num_experts": 256,
}


def _as_dict(cfg) -> dict:
    return as_dict(cfg, "a transformers config")


def text_config(d: dict) -> dict:
    """The text part of a config dict (``qwen3_5_moe``'s ``text_config``; others as they are)."""
    if d.get("model_type") == "qwen3_5_moe" or ("text_config" in d and "vision_config" in d):
        text = d.get("text_config")
        text = _as_dict(text) if text is not None else {}
        for key in ("tie_word_embeddings", "dtype", "torch_dtype"):
            if key not in text and key in d:
                text[key] = d[key]
        return text
    return d


def _require(d: dict, name: str, ok, what: str):
    value = d.get(name)
    if value is not None and not ok(value):
        raise InvalidInputError(name, f"unsupported value {value!r}; HybridModel supports {what}")


def from_hf_config(
    cfg,
    *,
    dtype: str | None = None,
    family: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    **overrides,
) -> ModelConfig:
    """Our :class:`ModelConfig` of a Qwen3-Next (or, with ``family="qwen3_5_moe_text"``, a Qwen3.5-MoE
    text) config: a transformers config or a ``config.json`` dict (None: from its ``model_type``).

    ``dtype``: ``float32``, ``bfloat16`` or ``float64`` (None: the config's when it is one of these,
    else ``float32``). ``chunk_size``: our GDN chunk size (does not change the math; default
    :data:`~harts_runtime.options.DEFAULT_CHUNK_SIZE`, the Triton path's). ``overrides``: further
    :class:`ModelConfig` fields (execution options; an
    option group as a dict changes only the fields it names, as :meth:`ModelConfig.replace`).

    Raises :class:`InvalidInputError` naming the field for options HybridModel cannot reproduce:
    ``hidden_act`` other than silu, ``tie_word_embeddings``, ``attention_bias``, a non-zero
    ``attention_dropout``, ``use_sliding_window``, ``attn_output_gate`` false, a RoPE type other
    than ``default``, unknown layer types, a wrong-length ``layer_types``, ``decoder_sparse_step``
    < 1, value heads not a multiple of key heads (``gdn.num_v_heads``).
    """
    d = text_config(_as_dict(cfg))
    if family is None:
        family = "qwen3_5_moe_text" if str(d.get("model_type", "")).startswith("qwen3_5") else "qwen3_next"
    if family not in FAMILIES:
        raise InvalidInputError("family", f"unknown {family!r}; choose one of {sorted(FAMILIES)}")
    _, projection, has_dense = FAMILIES[family]
    defaults = _DEFAULTS if has_dense else _DEFAULTS_35

    def get(name):
        v = d.get(name)
        return defaults.get(name) if v is None else v

    _require(d, "hidden_act", lambda v: v == "silu", "silu")
    _require(d, "tie_word_embeddings", lambda v: not v, "an untied LM head")
    _require(d, "attention_bias", lambda v: not v, "bias-free attention projections")
    _require(d, "attention_dropout", lambda v: float(v) == 0.0, "attention_dropout 0")
    _require(d, "use_sliding_window", lambda v: not v, "full attention (no sliding window)")
    _require(d, "attn_output_gate", bool, "the gated attention output (attn_output_gate true)")
    rope = dict(d.get("rope_parameters") or {})
    if d.get("rope_scaling"):
        rope = {**dict(d["rope_scaling"]), **rope}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise InvalidInputError(
            "rope_parameters", f"rope_type {rope.get('rope_type', rope.get('type'))!r}; only default"
        )
    theta = rope.get("rope_theta", d.get("rope_theta", 10_000.0))
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    n = int(get("num_hidden_layers"))
    types = d.get("layer_types")
    if types is None:
        interval = int(d.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if len(types) != n:
        raise InvalidInputError("layer_types", f"needs {n} entries (num_hidden_layers), got {len(types)}")
    for i, t in enumerate(types):
        if t not in _MIXER:
            raise InvalidInputError(f"layer_types[{i}]", f"unsupported {t!r}; choose one of {sorted(_MIXER)}")
    experts = int(get("num_experts"))
    if has_dense:
        step = int(get("decoder_sparse_step"))
        if step < 1:
            raise InvalidInputError("decoder_sparse_step", f"must be >= 1, got {step}")
        dense_only = {int(i) for i in get("mlp_only_layers")}
        ffns = tuple(
            "moe" if i not in dense_only and experts > 0 and (i + 1) % step == 0 else "dense"
            for i in range(n)
        )
        norm_topk = bool(get("norm_topk_prob"))
    else:
        if experts < 1:
            raise InvalidInputError("num_experts", f"Qwen3.5-MoE needs >= 1 expert, got {experts}")
        ffns, norm_topk = ("moe",) * n, True  # Qwen3.5-MoE: every layer sparse, top-k always renormalised
    if dtype is None:
        dtype = str(d.get("dtype") or d.get("torch_dtype") or "float32").removeprefix("torch.")
        dtype = dtype if dtype in ("float32", "bfloat16", "float64") else "float32"
    heads = int(get("num_attention_heads"))
    fields = dict(
        vocab_size=int(get("vocab_size")),
        hidden_size=int(get("hidden_size")),
        mixers=tuple(_MIXER[t] for t in types),
        ffns=ffns,
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads")),
        rope_theta=float(theta),
        gated_attention=GatedAttentionArgs(
            head_dim=int(get("head_dim")), partial_rotary_factor=float(partial)
        ),
        gdn=GDNArgs(
            num_k_heads=int(get("linear_num_key_heads")),
            num_v_heads=int(get("linear_num_value_heads")),
            head_k_dim=int(get("linear_key_head_dim")),
            head_v_dim=int(get("linear_value_head_dim")),
            projection=projection,
        ),
        conv_size=int(get("linear_conv_kernel_dim")),
        chunk_size=chunk_size,
        dense_intermediate=int(get("intermediate_size")) if has_dense else 1,
        moe=MoEArgs(
            num_experts=max(experts, 1),
            top_k=int(get("num_experts_per_tok")),
            intermediate_size=int(get("moe_intermediate_size")),
            score_func="softmax",
            norm_topk_prob=norm_topk,
            num_shared_experts=1,
            shared_intermediate_size=int(get("shared_expert_intermediate_size")),
            shared_expert_gate=True,
            aux_loss_coef=0.0,
            z_loss_coef=0.0,
        ),
        norm_eps=float(get("rms_norm_eps")),
        zero_centered_norms=True,
        init_std=float(get("initializer_range")),
        dtype=dtype,
    )
    return ModelConfig(**fields).replace(**overrides)


def full_attention_interval(mixers) -> int | None:
    """The ``full_attention_interval`` ``k`` whose schedule is ``mixers`` (layer ``i`` is full
    attention when ``(i + 1) % k == 0``, else GDN: transformers' rule when ``layer_types`` is absent,
    the only one SGLang's Qwen3-Next config knows); None when no period gives ``mixers``. A model
    without full attention gets ``len(mixers) + 1``."""
    full = [i for i, m in enumerate(mixers) if m == "gated_attention"]
    k = full[0] + 1 if full else len(mixers) + 1
    periodic = all((m == "gated_attention") == ((i + 1) % k == 0) for i, m in enumerate(mixers))
    return k if periodic else None


def to_hf_config(cfg: ModelConfig, base: Mapping | None = None, family: str = "qwen3_next") -> dict:
    """The ``config.json`` dict of ``cfg`` as ``family`` (``qwen3_next`` or ``qwen3_5_moe_text``);
    ``base``: fields to keep (token ids, ...; a ``qwen3_5_moe`` base contributes its text part).
    Besides ``layer_types`` it writes ``full_attention_interval``
    (:func:`full_attention_interval`), which SGLang's config requires, when a period gives the
    layer schedule; a schedule no period gives has no such key (SGLang cannot build it).

    Raises :class:`InvalidInputError` naming the :class:`ModelConfig` field the family cannot
    express (other mixers, sigmoid routing, no gated shared expert, plain RMSNorms, ...).
    """
    if family not in FAMILIES:
        raise InvalidInputError("family", f"unknown {family!r}; choose one of {sorted(FAMILIES)}")
    arch, projection, has_dense = FAMILIES[family]

    def need(name, ok, what):
        value = cfg.field_value(name)
        if not ok(value):
            raise InvalidInputError(name, f"{value!r} has no {family} equivalent; needs {what}")

    gdn, moe = cfg.gdn, cfg.moe

    need("mixers", lambda v: all(m in ("gdn", "gated_attention") for m in v), "only gdn and gated_attention")
    need("zero_centered_norms", bool, "True")
    if "gdn" in cfg.mixers:
        need("gdn.projection", lambda v: v == projection, projection)
    if not has_dense:
        need("ffns", lambda v: all(f == "moe" for f in v), "every layer moe")
    if "moe" in cfg.ffns:
        need("moe.score_func", lambda v: v == "softmax", "softmax")
        need("moe.use_expert_bias", lambda v: not v, "False")
        need("moe.routed_scaling_factor", lambda v: v == 1.0, "1.0")
        need("moe.num_expert_groups", lambda v: v == 1, "1")
        need("moe.num_shared_experts", lambda v: v == 1, "1")
        need("moe.shared_expert_gate", bool, "True")
        if not has_dense:
            need("moe.norm_topk_prob", bool, "True")
    out = dict(text_config(dict(base or {})))
    for key in ("auto_map", "rope_scaling", "rope_theta", "partial_rotary_factor", "full_attention_interval"):
        out.pop(key, None)
    rope = {
        "rope_type": "default",
        "rope_theta": cfg.rope_theta,
        "partial_rotary_factor": cfg.gated_attention.partial_rotary_factor,
    }
    old = out.get("rope_parameters") or {}
    for key in ("mrope_section", "mrope_interleaved"):  # Qwen3.5's; text positions make them a no-op
        if key in old:
            rope[key] = old[key]
    out.update(
        model_type=family,
        architectures=[arch],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
        head_dim=cfg.gated_attention.head_dim or cfg.hidden_size // cfg.num_heads,
        hidden_act="silu",
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=False,
        attention_bias=False,
        attention_dropout=0.0,
        rope_parameters=rope,
        linear_conv_kernel_dim=cfg.conv_size,
        linear_key_head_dim=gdn.head_k_dim,
        linear_value_head_dim=gdn.head_v_dim,
        linear_num_key_heads=gdn.num_k_heads,
        linear_num_value_heads=gdn.num_v_heads,
        moe_intermediate_size=moe.intermediate_size,
        shared_expert_intermediate_size=moe.shared_intermediate_size or moe.intermediate_size,
        num_experts_per_tok=moe.top_k,
        num_experts=moe.num_experts if "moe" in cfg.ffns else 0,
        layer_types=["linear_attention" if m == "gdn" else "full_attention" for m in cfg.mixers],
        dtype=cfg.dtype,
    )
    interval = full_attention_interval(cfg.mixers)
    if interval is not None:  # the engines' spelling of layer_types (SGLang reads only this)
        out["full_attention_interval"] = interval
    if has_dense:
        out.update(
            intermediate_size=cfg.dense_intermediate,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, f in enumerate(cfg.ffns) if f == "dense"],
            norm_topk_prob=moe.norm_topk_prob,
        )
    else:
        for key in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):
            out.pop(key, None)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        out.setdefault(key, None)
    return out
