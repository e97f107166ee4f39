"""The tensor names vLLM's and SGLang's ``load_weights(weights: Iterable[tuple[str, Tensor]])`` take,
per model family: the rules of :func:`harts_runtime.engine.weights.weights` ``names="vllm"`` /
``names="sglang"``, as data (:data:`RULES`), read from each engine's model file.

Every loader below is written for the tensors of a released checkpoint folder: it takes the names and
shapes ``save_pretrained`` writes (our ``"checkpoint"`` spelling: per-expert MoE tensors, the
folder's prefixes, Mamba2 / GDN ``A_log`` as stored) and does its own fusing (q / k / v into one
projection, gate / up into one, experts into stacked parameters, ``A_log`` into ``A = -exp(A_log)``
for Nemotron-H) inside ``load_weights``. So a rule is the checkpoint spelling plus, where an engine's
registered classes need it, a prefix rename (:attr:`EngineRule.rename`) or a rename within the layers
of one mixer kind (:attr:`EngineRule.layer_renames`); the shapes are always the checkpoint's. What a
loader skips (:attr:`EngineRule.skips`: rotary ``inv_freq``, MTP layers) our stream never holds. A
family an engine has no loader for is refused naming both (:func:`engine_rule`).
"""

from __future__ import annotations

from dataclasses import dataclass

from harts_runtime.errors import InvalidInputError

__all__ = ["ENGINES", "RULES", "EngineRule", "engine_name", "engine_rule"]

ENGINES = ("vllm", "sglang")
"""The engines with a rule table."""


@dataclass(frozen=True)
class EngineRule:
    """How one engine's loader of one family names the checkpoint's tensors."""

    engine: str
    family: str
    """The family's registry name (:mod:`harts_runtime.models.registry`)."""
    loader: str
    """The engine's model class(es) whose ``load_weights`` the rule was read from (module: class)."""
    architectures: tuple[str, ...]
    """The ``config.json`` ``architectures`` the engine serves with that class."""
    rename: tuple[tuple[str, str], ...] = ()
    """``(checkpoint prefix, engine prefix)`` pairs, the first that matches applies; empty: the loader
    is fed exactly the checkpoint's names."""
    layer_renames: tuple[tuple[str, str, str], ...] = ()
    """``(mixer kind, checkpoint suffix, engine suffix)`` triples: in a layer (``layers.<N>.``) whose
    mixer is of that kind (:attr:`harts_runtime.models.hybrid.args.ModelConfig.mixers`), a name ending
    in ``.<checkpoint suffix>`` ends in ``.<engine suffix>`` instead; the first that matches applies."""
    skips: tuple[str, ...] = ()
    """What the loader drops without loading (names or name patterns, for the record)."""
    also: str = ""
    """Other spellings the loader accepts that the stream does not use."""

    @property
    def checkpoint_names(self) -> bool:
        """Whether the loader is fed exactly the checkpoint's names."""
        return not (self.rename or self.layer_renames)


def _rules() -> dict[tuple[str, str], EngineRule]:
    per_expert = "the experts one tensor each (w1/w2/w3 or gate/up/down_proj), as in the checkpoint"
    rules = [
        # ------------------------------------------------------------------ vLLM
        EngineRule(
            "vllm",
            "kimi_linear",
            "vllm.models.kimi_k3: KimiLinearForCausalLM",
            ("KimiLinearForCausalLM",),
            skips=("rotary_emb.inv_freq", "model.layers.{>= num_hidden_layers} (MTP)"),
            also="A_log as [H] as well as [1, 1, H, 1]; " + per_expert,
        ),
        EngineRule(
            "vllm",
            "qwen3_next",
            "vllm.model_executor.models.qwen3_next: Qwen3NextForCausalLM",
            ("Qwen3NextForCausalLM",),
            skips=("mtp.*",),
            also="fused 3-D experts.gate_up_proj / experts.down_proj (all experts in one tensor)",
        ),
        EngineRule(
            "vllm",
            "qwen3_5_moe",
            "vllm.models.qwen3_5: Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration",
            ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
            # the text class maps model.language_model. -> model., the vision-language class (the
            # released checkpoints') -> language_model.model.; plain model.layers. only the former
            rename=(("model.", "model.language_model."),),
            skips=("mtp.*", "model.visual.* (vision tower: not ours)"),
            also="model.* for Qwen3_5MoeForCausalLM only; fused experts.gate_up_proj / down_proj",
        ),
        EngineRule(
            "vllm",
            "nemotron_h",
            "vllm.model_executor.models.nemotron_h: NemotronHForCausalLM",
            ("NemotronHForCausalLM",),
            skips=("mtp.*",),
            also="model.* for backbone.* (its mapper renames backbone -> model, embeddings -> "
            "embed_tokens, A_log -> A loaded as -exp(A_log))",
        ),
        EngineRule(
            "vllm",
            "ling3",
            "vllm.model_executor.models.bailing_moe_v3: BailingMoeV3ForCausalLM",
            ("BailingMoeV3ForCausalLM",),
            # a KDA layer's output projection is its o_proj (the released checkpoints' name), an
            # MLA layer's its dense; save_pretrained writes dense for both
            layer_renames=(("kda", "attention.dense.weight", "attention.o_proj.weight"),),
            skips=("model.layers.{>= num_hidden_layers} (MTP)",),
            also="A_log as [1, 1, H, 1] as well as [H]; unknown names are dropped silently",
        ),
        # ------------------------------------------------------------------ SGLang
        EngineRule(
            "sglang",
            "kimi_linear",
            "sglang.srt.models.kimi_linear: KimiLinearForCausalLM",
            ("KimiLinearForCausalLM",),
            skips=("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached"),
            also=per_expert + " only",
        ),
        EngineRule(
            "sglang",
            "qwen3_next",
            "sglang.srt.models.qwen3_next: Qwen3NextForCausalLM",
            ("Qwen3NextForCausalLM",),
            skips=("rotary_emb.inv_freq", "mtp.*"),
        ),
        EngineRule(
            "sglang",
            "qwen3_5_moe",
            "sglang.srt.models.qwen3_5_text: Qwen3_5MoeForCausalLM; qwen3_5: "
            "Qwen3_5MoeForConditionalGeneration",
            ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
            # the text class strips model. and its body drops what then starts language_model.
            # (a logged warning at most)
            skips=("rotary_emb.inv_freq", "*mtp*", "*visual*"),
            also="model.language_model.* for the vision-language class only; fused "
            "experts.gate_up_proj / down_proj",
        ),
        EngineRule(
            "sglang",
            "nemotron_h",
            "sglang.srt.models.nemotron_h: NemotronHForCausalLM",
            ("NemotronHForCausalLM",),
            skips=("*mtp*",),
            also="model.* for backbone.* (remap_prefix backbone -> model, A_log -> A)",
        ),
        EngineRule(
            "sglang",
            "ling3",
            "sglang.srt.models.bailing_moe_v3: BailingMoeV3ForCausalLM",
            ("BailingMoeV3ForCausalLM",),
            # the released checkpoints' KDA name, as for vLLM (this loader's parameters are o_proj
            # in both layer kinds; it retries a name it lacks with .dense. -> .o_proj.)
            layer_renames=(("kda", "attention.dense.weight", "attention.o_proj.weight"),),
            skips=("model.mtp*", "model.layers.{>= num_hidden_layers} (MTP)", "inv_freq", "v_head"),
            also="A_log [H] only (reshaped to [1, 1, H, 1] by the loader); unknown names are "
            "dropped silently",
        ),
    ]
    return {(r.engine, r.family): r for r in rules}


RULES: dict[tuple[str, str], EngineRule] = _rules()
"""``(engine, family)`` -> :class:`EngineRule`; read from vLLM 0.34.0 and SGLang 0.5.23 (the wheels'
model files)."""


def engine_rule(engine: str, family: str) -> EngineRule:
    """The rule of ``engine`` for ``family``; raises :class:`InvalidInputError` naming ``names`` for
    an unknown engine or a family the engine has no loader for."""
    if engine not in ENGINES:
        raise InvalidInputError("names", f"choose one of {ENGINES}, got {engine!r}")
    rule = RULES.get((engine, family))
    if rule is None:
        raise InvalidInputError("names", f"{engine} has no loader for the {family} family")
    return rule


def engine_name(rule: EngineRule, checkpoint_name: str, mixer: str | None = None) -> str:
    """A checkpoint tensor's name as ``rule``'s engine takes it; ``mixer``: the mixer kind of the
    layer the tensor belongs to (None outside the layers)."""
    if mixer is not None:
        for kind, old, new in rule.layer_renames:
            if kind == mixer and checkpoint_name.endswith("." + old):
                checkpoint_name = checkpoint_name[: -len(old)] + new
                break
    for old, new in rule.rename:
        if checkpoint_name.startswith(old):
            return new + checkpoint_name[len(old) :]
    return checkpoint_name
