"""Qwen3-Next / Qwen3.5-MoE (text) state dicts <-> :class:`HybridModel` state dicts.

Every tensor is mapped (``{i}``: layer; HF prefix ``model.layers.{i}.``, or
``model.language_model.layers.{i}.`` in a ``qwen3_5_moe`` checkpoint; ours ``blocks.{i}.``):

=====================================================  ==============================================
transformers                                           ours
=====================================================  ==============================================
``model.embed_tokens.weight``, ``model.norm.weight``,  ``embed.weight``, ``norm.weight``,
``lm_head.weight``                                     ``lm_head.weight``
``input_layernorm``, ``post_attention_layernorm``      ``norm1``, ``norm2`` (zero-centred)
``self_attn.*`` (gated attention)                      ``mixer.*`` (same names and shapes)
``linear_attn.*`` (gated delta net)                    ``mixer.*`` (same names and shapes), but:
``linear_attn.in_proj_qkv.weight`` (Qwen3.5)           ``mixer.in_proj_{q,k,v}.weight`` (rows split)
``linear_attn.conv1d.weight`` [2 Hk K + Hv V, 1, w]    ``mixer.{q,k,v}_conv1d.weight`` (rows split)
dense ``mlp.{gate,up,down}_proj``                      ``ffn.{gate,up,down}``
MoE ``mlp.gate.weight``                                ``ffn.router``
MoE ``mlp.experts.gate_up_proj`` [E, 2I, D]            ``ffn.w_gate``, ``ffn.w_up`` [E, D, I]
MoE ``mlp.experts.down_proj`` [E, D, I]                ``ffn.w_down`` [E, I, D]
(checkpoint: ``mlp.experts.{j}.{gate,up,down}_proj``)  (expert slot ``j``, transposed)
MoE ``mlp.shared_expert.{gate,up,down}_proj``          ``ffn.shared_experts.{gate,up,down}``
MoE ``mlp.shared_expert_gate.weight`` [1, D]           ``ffn.shared_expert_gate.weight``
=====================================================  ==============================================

Our ``ffn.expert_bias`` (unused: no bias routing) and ``ffn.local_tokens_per_expert`` have no HF
counterpart: :meth:`from_hf` returns zeros, :meth:`to_hf` drops them (a non-zero bias is an error).
Unknown or missing tensors and shape mismatches raise
:class:`~harts_runtime.errors.InvalidInputError` whose ``field`` is the tensor's name. Of a
``qwen3_5_moe`` (vision-language) checkpoint the vision tower (``model.visual.*``) and the MTP head
(``mtp.*``) are skipped, as transformers' text model skips them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.layers.gdn import HF_CONCATENATED
from harts_runtime.models.hybrid.args import ModelConfig
from harts_runtime.models.state_dict_adapter import HFStateDictAdapter

__all__ = ["QwenStateDictAdapter", "from_hf", "to_hf"]

_MLP_RENAME = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_HF_MIXER = {"gated_attention": "self_attn.", "gdn": "linear_attn."}


class QwenStateDictAdapter(HFStateDictAdapter):
    """The tensor map of one Qwen3-Next / Qwen3.5-MoE :class:`ModelConfig` (shapes from a
    meta-device model).

    Two HF spellings are read: the in-memory one (``state_dict()`` of the transformers model: fused
    ``mlp.experts.gate_up_proj`` / ``down_proj``) and the checkpoint one (what ``save_pretrained``
    and the released checkpoints store: ``mlp.experts.{j}.{gate,up,down}_proj.weight``).
    :meth:`to_hf` writes the in-memory spelling, :meth:`to_checkpoint` the checkpoint one.
    ``prefix`` is the HF decoder prefix (``model.``; ``model.language_model.`` for ``qwen3_5_moe``);
    loading accepts both.
    """

    family = "Qwen3-Next"
    _IGNORED = ("mtp.", "model.visual.")

    def __init__(self, config: ModelConfig, prefix: str = "model."):
        from harts_runtime.models.hybrid.model import HybridModel

        self.config, self.prefix = config, prefix
        meta = HybridModel(config, device="meta").state_dict()
        self.our_shapes = {k: tuple(v.shape) for k, v in meta.items()}
        self._rules = dict(self._memory_table())  # hf name -> (kind, our names)
        self.hf_shapes = {k: tuple(v.shape) for k, v in self._to_hf_items(meta, check=False)}
        self._ckpt = {}  # checkpoint name -> (kind, our name, expert slot, shape)
        for name, (kind, ours) in self._rules.items():
            if kind in ("same", "cat"):  # checkpoints store both as in memory
                self._ckpt[name] = (kind, ours if kind == "cat" else ours[0], None, self.hf_shapes[name])
                continue
            base = name.rsplit(".", 1)[0]  # ...mlp.experts
            pairs = (
                (("gate_proj", ours[0]), ("up_proj", ours[1]))
                if kind == "gate_up"
                else (("down_proj", ours[0]),)
            )
            for w, our in pairs:
                e, rows, cols = self.our_shapes[our]
                for j in range(e):
                    self._ckpt[f"{base}.{j}.{w}.weight"] = ("t", our, j, (cols, rows))
        self.checkpoint_names = list(self._ckpt)

    # ------------------------------------------------------------------ the table
    def _memory_table(self) -> Iterator[tuple[str, tuple]]:
        c, p = self.config, self.prefix
        yield p + "embed_tokens.weight", ("same", ("embed.weight",))
        yield p + "norm.weight", ("same", ("norm.weight",))
        yield "lm_head.weight", ("same", ("lm_head.weight",))
        for i, (mixer, ffn) in enumerate(zip(c.mixers, c.ffns)):
            h, o = f"{p}layers.{i}.", f"blocks.{i}."
            yield h + "input_layernorm.weight", ("same", (o + "norm1.weight",))
            yield h + "post_attention_layernorm.weight", ("same", (o + "norm2.weight",))
            if mixer not in _HF_MIXER:
                raise InvalidInputError(f"mixers[{i}]", f"{mixer!r} has no {self.family} equivalent")
            m = o + "mixer."
            cat = HF_CONCATENATED if mixer == "gdn" else {}
            parts = {our: hf for hf, ours in cat.items() for our in ours}  # our suffix -> HF name
            for k in self.our_shapes:
                if not k.startswith(m):
                    continue
                name = k[len(m) :]
                if name not in parts:
                    yield h + _HF_MIXER[mixer] + name, ("same", (k,))
                elif name == cat[parts[name]][0]:  # the first of the q, k, v tensors: all three
                    yield h + _HF_MIXER[mixer] + parts[name], ("cat", tuple(m + n for n in cat[parts[name]]))
            f, q = o + "ffn.", h + "mlp."
            if ffn == "dense":
                for hf, ours in _MLP_RENAME.items():
                    yield q + hf + ".weight", ("same", (f + ours + ".weight",))
                continue
            if (
                f + "shared_experts.gate.weight" not in self.our_shapes
                or f + "shared_expert_gate.weight" not in self.our_shapes
            ):
                raise InvalidInputError(
                    "shared_expert_gate", f"{self.family} MoE needs a gated shared expert"
                )
            yield q + "gate.weight", ("same", (f + "router",))
            yield q + "experts.gate_up_proj", ("gate_up", (f + "w_gate", f + "w_up"))
            yield q + "experts.down_proj", ("transpose", (f + "w_down",))
            for hf, ours in _MLP_RENAME.items():
                yield (
                    q + "shared_expert." + hf + ".weight",
                    ("same", (f + "shared_experts." + ours + ".weight",)),
                )
            yield q + "shared_expert_gate.weight", ("same", (f + "shared_expert_gate.weight",))

    def _canonical(self, name: str) -> str:
        """``name`` with the other accepted decoder prefix replaced by this adapter's."""
        for other in ("model.language_model.", "model."):
            if other != self.prefix and name.startswith(other) and not name.startswith(self.prefix):
                return self.prefix + name[len(other) :]
        return name

    @property
    def zero_only(self) -> tuple[tuple[str, str], ...]:
        return ((".expert_bias", f"{self.family} routing has no expert bias"),)

    def ignored(self, name: str) -> bool:
        """Checkpoint tensors outside the text model (vision tower, MTP head): skipped on load."""
        return name.startswith(self._IGNORED)

    def extra_ours(self) -> dict[str, torch.Tensor]:
        """Our tensors with no HF counterpart: zero expert biases and expert-load counts."""
        ends = (".local_tokens_per_expert", ".expert_bias")
        return {k: torch.zeros(s) for k, s in self.our_shapes.items() if k.endswith(ends)}

    def missing(self, seen) -> list[str]:
        """HF names this config needs that ``seen`` lacks, in the spelling ``seen`` uses (the
        checkpoint one unless it holds a fused expert tensor)."""
        seen = {self._canonical(k) for k in seen}
        fused = any(k in self._rules and k not in self._ckpt for k in seen)
        names = self._rules if fused else self._ckpt
        return [k for k in names if k not in seen]


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A transformers ``Qwen3NextForCausalLM`` state dict -> our :class:`HybridModel` state dict."""
    return QwenStateDictAdapter(config).from_hf(hf_state_dict)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our :class:`HybridModel` state dict -> a ``Qwen3NextForCausalLM`` state dict."""
    return QwenStateDictAdapter(config).to_hf(state_dict)
