"""The hybrid family's configuration and named flavors (as torchtitan's ``models/llama3/model/args.py``).

:class:`ModelConfig` holds the shape, the layer pattern and the execution options of a
:class:`harts_runtime.models.hybrid.model.HybridModel`; it validates itself on construction and
raises :class:`~harts_runtime.errors.InvalidInputError` naming the field.

Named flavors (:data:`FLAVORS`, :func:`model_config`; looked up through
:mod:`harts_runtime.models.registry`, so this module imports no checkpoint family, each family
package brings its own): ``ling-tiny`` (Table 1; the table does not
give head dims or the MLA ranks, so KDA uses 16 heads of 128 and MLA follows DeepSeek-V2-Lite:
KV rank 512, 128 + 64 query/key dims, 128 value dims; sigmoid routing with an expert bias as in
Ling 2.0) and ``debug`` (tiny, fp32, CPU). ``model_config("ling-tiny", num_layers=8)`` keeps the
first 8 layers of the pattern (2 x (3 KDA + 1 MLA), layer 1 dense) for a smaller GPU run;
``model_config("debug", moe={"num_experts": 8})`` changes one field of an option group.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.models.hybrid.layer_options import (
    GROUPS,
    GatedAttentionArgs,
    GDNArgs,
    GQAArgs,
    KDAArgs,
    Mamba2Args,
    MLAArgs,
    MoEArgs,
    group_from,
)
from harts_runtime.models.registry import family_flavors
from harts_runtime.options import DEFAULT_CHUNK_SIZE

__all__ = [
    "FFNS",
    "FLAVORS",
    "HYBRID_FLAVORS",
    "MIXERS",
    "GDNArgs",
    "GQAArgs",
    "GatedAttentionArgs",
    "KDAArgs",
    "MLAArgs",
    "Mamba2Args",
    "MoEArgs",
    "ModelConfig",
    "ffn_pattern",
    "model_config",
]

MIXERS = ("kda", "mla", "gqa", "gated_attention", "gdn", "mamba2", "none")
"""Token-mixer names of :attr:`ModelConfig.mixers` (the model's builder table has one entry each)."""
FFNS = ("dense", "moe", "relu2", "none")
"""FFN names of :attr:`ModelConfig.ffns`."""


@dataclass(kw_only=True)
class ModelConfig:
    """Shape, layer pattern and execution options of a :class:`HybridModel`.

    Flat: the model-wide fields (read by several layer kinds, the norms, the LM head or the
    plan). Nested: one option group per mixer / FFN kind with the options only that kind reads
    (:mod:`harts_runtime.models.hybrid.layer_options`): ``kda``, ``mla``, ``gated_attention``,
    ``gdn``, ``moe``, ``gqa``, ``mamba2``; each is passed through to its layer's config. A group can be given as its
    dataclass (``moe=MoEArgs(num_experts=8)``) or as a dict of its fields (a YAML / JSON config):
    on construction a dict is applied over the group's defaults, in :meth:`replace` (and so in
    :func:`model_config` and the families' ``from_hf_config`` overrides) over this config's group.
    An unknown key raises :class:`~harts_runtime.errors.InvalidInputError` naming ``moe.<key>``.
    """

    vocab_size: int = 64
    """V."""
    hidden_size: int = 32
    """D."""
    mixers: tuple = ("kda", "mla")
    """Token mixer of each layer: ``kda``, ``gdn`` or ``mamba2`` (linear), ``mla``, ``gqa`` or
    ``gated_attention`` (full attention; ``gated_attention`` is Qwen3-Next / Qwen3.5's, ``gdn`` their
    gated delta net, ``mamba2`` Nemotron-H's), or ``none`` (a layer that is only its FFN)."""
    ffns: tuple = ("dense", "moe")
    """FFN of each layer: ``dense`` (SwiGLU), ``relu2`` (Nemotron-H's non-gated MLP), ``moe``
    (routed experts, ``moe.activation``) or ``none`` (a layer that is only its mixer)."""
    num_heads: int = 2
    """Attention heads (MLA / GQA / gated-attention query heads, and KDA's unless ``kda.num_heads``)."""
    num_kv_heads: int | None = None
    """GQA and gated-attention KV heads (None: MHA)."""
    rope_theta: float = 10_000.0
    """RoPE base (MLA, GQA, gated attention)."""
    conv_size: int = 4
    """Causal convolution width w of the KDA and GDN layers (the plan's)."""
    chunk_size: int = 8
    """KDA chunk size B (32 or 64 on the Triton path; the plan's)."""
    dense_intermediate: int = 64
    """Dense SwiGLU width."""
    kda: KDAArgs = field(default_factory=KDAArgs)
    """KDA options (:class:`~harts_runtime.models.hybrid.layer_options.KDAArgs`)."""
    mla: MLAArgs = field(default_factory=MLAArgs)
    """MLA options (:class:`~harts_runtime.models.hybrid.layer_options.MLAArgs`)."""
    gated_attention: GatedAttentionArgs = field(default_factory=GatedAttentionArgs)
    """Gated-attention options (:class:`~harts_runtime.models.hybrid.layer_options.GatedAttentionArgs`)."""
    gdn: GDNArgs = field(default_factory=GDNArgs)
    """Gated delta net options (:class:`~harts_runtime.models.hybrid.layer_options.GDNArgs`)."""
    moe: MoEArgs = field(default_factory=MoEArgs)
    """Routed-expert FFN options (:class:`~harts_runtime.models.hybrid.layer_options.MoEArgs`)."""
    gqa: GQAArgs = field(default_factory=GQAArgs)
    """MHA / GQA options (:class:`~harts_runtime.models.hybrid.layer_options.GQAArgs`)."""
    mamba2: Mamba2Args = field(default_factory=Mamba2Args)
    """Mamba2 options (:class:`~harts_runtime.models.hybrid.layer_options.Mamba2Args`)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    zero_centered_norms: bool = False
    """Block and final RMSNorms as ``x_normed * (1 + weight)`` (Qwen3-Next / Qwen3.5)."""
    # execution
    dtype: str = "float32"
    """Parameter and activation dtype: ``float32`` or ``bfloat16`` (KDA states are always fp32)."""
    attn_backend: str = "auto"
    """Full-attention backend (``auto``: ``reference`` on CPU, ``varlen`` on CUDA)."""
    kda_backend: str = "auto"
    """The fla-or-reference switch (:mod:`harts_runtime.modules.fused`) of the KDA / GDN layers
    (cores and token-wise modules) and of the LM head's cross-entropy (``auto``: Triton on CUDA,
    reference on CPU)."""
    lm_head_rows: int = 2048
    """Rows per LM-head chunk (temporaries are ``[rows, V]`` fp32)."""
    init_std: float = 0.02
    """Std of the normal init of linear and embedding weights."""
    fp32_params: tuple = ()
    """Name suffixes of parameters kept in float32 when ``dtype`` is bfloat16 (Kimi-Linear keeps
    ``("ffn.router", "mixer.dt_bias")`` so, as transformers does)."""

    def __post_init__(self):
        self.mixers, self.ffns = tuple(self.mixers), tuple(self.ffns)
        self.fp32_params = tuple(self.fp32_params)
        if not self.mixers:
            raise InvalidInputError("mixers", "needs at least one layer")
        if len(self.mixers) != len(self.ffns):
            raise InvalidInputError(
                "ffns", f"needs one entry per layer ({len(self.mixers)}), got {len(self.ffns)}"
            )
        for i, m in enumerate(self.mixers):
            if m not in MIXERS:
                raise InvalidInputError(f"mixers[{i}]", f"unknown {m!r}; choose one of {MIXERS}")
        for i, f in enumerate(self.ffns):
            if f not in FFNS:
                raise InvalidInputError(f"ffns[{i}]", f"unknown {f!r}; choose one of {FFNS}")
            if f == "none" and self.mixers[i] == "none":
                raise InvalidInputError(f"ffns[{i}]", "a layer needs a mixer or an FFN (both are 'none')")
        if self.dtype not in ("float32", "bfloat16", "float64"):
            raise InvalidInputError("dtype", f"choose float32, bfloat16 or float64, got {self.dtype!r}")
        for name in ("vocab_size", "hidden_size", "num_heads", "conv_size", "chunk_size", "lm_head_rows"):
            if getattr(self, name) < 1:
                raise InvalidInputError(name, f"must be >= 1, got {getattr(self, name)}")
        for name in GROUPS:
            setattr(self, name, group_from(name, getattr(self, name)))
        moe = self.moe
        if "moe" in self.ffns and not 1 <= moe.top_k <= moe.num_experts:
            raise InvalidInputError(
                "moe.top_k", f"must be in [1, moe.num_experts={moe.num_experts}], got {moe.top_k}"
            )
        g = moe.num_expert_groups
        if g > 1 and "moe" in self.ffns and moe.top_k > moe.topk_groups * (moe.num_experts // g):
            raise InvalidInputError(
                "moe.top_k",
                f"{moe.top_k} > the {moe.topk_groups} x {moe.num_experts // g} selectable experts",
            )

    @property
    def num_layers(self) -> int:
        return len(self.mixers)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes``; an option group given as a dict (``moe={"top_k": 4}``) changes
        those fields of this config's group and keeps the others."""
        for name in GROUPS.keys() & changes.keys():
            changes[name] = group_from(name, changes[name], getattr(self, name))
        return dataclasses.replace(self, **changes)

    def field_value(self, name: str):
        """The value of ``name``: a field (``hidden_size``) or a group's (``moe.top_k``)."""
        return functools.reduce(getattr, name.split("."), self)


def ffn_pattern(num_layers: int, first_k_dense: int = 0, moe_layer_freq: int = 1) -> tuple:
    """The DeepSeek-V3 / Kimi FFN pattern: layer ``i`` is ``moe`` when ``i >= first_k_dense`` and
    ``i % moe_layer_freq == 0``, else ``dense``."""
    if moe_layer_freq < 1:
        raise InvalidInputError("moe_layer_freq", f"must be >= 1, got {moe_layer_freq}")
    if first_k_dense < 0:
        raise InvalidInputError("first_k_dense", f"must be >= 0, got {first_k_dense}")
    return tuple(
        "moe" if i >= first_k_dense and i % moe_layer_freq == 0 else "dense" for i in range(num_layers)
    )


# ------------------------------------------------------------------------------- flavors
def _ling_tiny(num_layers: int | None = None, **overrides) -> ModelConfig:
    n = 24 if num_layers is None else num_layers
    mixers = (("kda",) * 3 + ("mla",)) * 6
    cfg = ModelConfig(
        vocab_size=157_184,
        hidden_size=1536,
        mixers=mixers[:n],
        ffns=(("dense",) + ("moe",) * 23)[:n],
        num_heads=16,
        kda=KDAArgs(head_k_dim=128, head_v_dim=128),
        conv_size=4,
        chunk_size=DEFAULT_CHUNK_SIZE,
        mla=MLAArgs(
            kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
        ),
        dense_intermediate=4608,
        moe=MoEArgs(
            num_experts=128,
            top_k=8,
            intermediate_size=512,
            num_shared_experts=1,  # Ling-3.0-tiny: 128 routed experts top-8 plus 1 shared
            score_func="sigmoid",
            norm_topk_prob=True,
            use_expert_bias=True,
            aux_loss_coef=0.0,
            z_loss_coef=1e-6,
        ),
        dtype="bfloat16",
        lm_head_rows=2048,
    )
    return cfg.replace(**overrides) if overrides else cfg


def _debug(num_layers: int | None = None, **overrides) -> ModelConfig:
    n = 4 if num_layers is None else num_layers
    mixers = ("kda", "mla", "kda", "gqa")
    cfg = ModelConfig(
        vocab_size=512,
        mixers=(mixers * 8)[:n],
        ffns=(("dense", "moe", "moe", "dense") * 8)[:n],
        num_kv_heads=1,
        lm_head_rows=16,
    )
    return cfg.replace(**overrides) if overrides else cfg


HYBRID_FLAVORS = {"ling-tiny": _ling_tiny, "debug": _debug}
"""The hybrid shapes without a checkpoint family (``save_pretrained`` refuses them: their options
have no checkpoint format): name -> ``(num_layers=None, **overrides) -> ModelConfig``."""


class _Flavors(Mapping):
    """:data:`HYBRID_FLAVORS` and every registered family's flavors
    (:func:`harts_runtime.models.registry.family_flavors`, read on each lookup, so the family
    packages load on first use and a family registered later is included)."""

    def _all(self) -> dict:
        families = family_flavors()
        for name in families:
            if name in HYBRID_FLAVORS:
                raise InvalidInputError("flavor", f"{name!r} is both a hybrid flavor and a family's")
        return {**HYBRID_FLAVORS, **families}

    def __getitem__(self, name):
        return self._all()[name]

    def __iter__(self):
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __repr__(self) -> str:
        return f"FLAVORS({sorted(self._all())})"


FLAVORS: Mapping = _Flavors()
"""Named flavors: name -> ``(num_layers=None, **overrides) -> ModelConfig``. ``debug`` and
``ling-tiny`` are the hybrid family's shapes (:data:`HYBRID_FLAVORS`); the checkpoint families
bring theirs (:attr:`harts_runtime.models.registry.Family.flavors`): ``kimi-linear-tiny``
(:mod:`harts_runtime.models.kimi_linear.flavors`), ``qwen3.5-35b-a3b`` and ``qwen3.5-tiny``
(:mod:`harts_runtime.models.qwen3_5_moe.flavors`; the tiny ones for a small folder
``save_pretrained`` writes and transformers loads)."""


def model_config(flavor: str, num_layers: int | None = None, **overrides) -> ModelConfig:
    """The config of a named flavor (:data:`FLAVORS`), optionally cut to its first ``num_layers``
    layers.

    ``overrides``: :class:`ModelConfig` fields; an option group as a dict changes only the fields
    it names (``moe={"num_experts": 8}``, as :meth:`ModelConfig.replace`).

    Raises :class:`~harts_runtime.errors.InvalidInputError` (alias ``ConfigError``) naming
    ``flavor``, ``num_layers`` or an override field (``moe.num_expertz`` for a group's).
    """
    flavors = dict(FLAVORS)
    if flavor not in flavors:
        raise InvalidInputError("flavor", f"unknown {flavor!r}; choose one of {sorted(flavors)}")
    cfg = flavors[flavor](num_layers)
    if num_layers is not None and (num_layers < 1 or cfg.num_layers != num_layers):
        raise InvalidInputError(
            "num_layers", f"flavor {flavor!r} supports 1..{cfg.num_layers} layers, got {num_layers}"
        )
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    for name in overrides:
        if name not in known:
            raise InvalidInputError(name, "not a ModelConfig field")
    return cfg.replace(**overrides) if overrides else cfg
