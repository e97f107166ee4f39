"""Ling-3.0 state dicts (transformers ``BailingHybridForCausalLM``) <-> :class:`HybridModel` state dicts.

Two HF spellings are read: the in-memory one (``BailingHybridForCausalLM.state_dict()``) and the
checkpoint one (what the released checkpoints and transformers' ``save_pretrained`` store, which
transformers converts on load: ``model.word_embeddings``, ``attention.`` for ``self_attn.``,
``attention.dense`` for ``o_proj``, the KDA gate's ``f_proj`` / ``dt_bias`` / ``A_log`` directly
under ``attention.``, ``{q,k,v}_conv1d`` for the stacked ``conv1d``, ``mlp.gate.expert_bias`` for
``e_score_correction_bias``, per-expert ``mlp.experts.{j}.{gate,up,down}_proj``).
:meth:`~harts_runtime.models.state_dict_adapter.HFStateDictAdapter.to_hf` writes the in-memory
spelling, ``to_checkpoint`` (and :func:`harts_runtime.hf.save_pretrained`) the checkpoint one.

Every tensor is mapped (``{i}``: layer; HF prefix ``model.layers.{i}.``, ours ``blocks.{i}.``):

======================================================  =============================================
transformers (in memory)                                ours
======================================================  =============================================
``model.embed_tokens.weight``, ``model.norm.weight``,   ``embed.weight``, ``norm.weight``,
``lm_head.weight``                                      ``lm_head.weight``
``input_layernorm``, ``post_attention_layernorm``       ``norm1``, ``norm2``
KDA ``self_attn.{q,k,v,b,o}_proj``, ``o_norm``          ``mixer.`` same names
KDA ``self_attn.conv1d.weight`` [3 H K, 1, w]           ``mixer.{q,k,v}_conv1d.weight`` (split in 3)
KDA ``forget_gate.f_proj``, ``g_proj``                  ``mixer.f_proj.0``, ``mixer.g_proj.0``
KDA ``forget_gate.dt_bias``, ``forget_gate.A_log``      ``mixer.dt_bias``, ``mixer.A_log``
MLA ``q_proj`` / ``q_a_proj``, ``q_a_layernorm``,       ``mixer.q_proj`` / ``q_a_proj``, ``q_a_norm``,
``q_b_proj``, ``kv_a_proj_with_mqa``,                   ``q_b_proj``, ``kv_a_proj``, ``kv_a_norm``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``,          ``kv_b_proj``, ``o_proj``, ``g_proj``
``g_proj``
dense ``mlp.{gate,up,down}_proj``                       ``ffn.{gate,up,down}``
MoE ``mlp.gate.weight``, ``e_score_correction_bias``    ``ffn.router``, ``ffn.expert_bias``
MoE ``mlp.experts.gate_up_proj`` [E, 2I, D]             ``ffn.w_gate``, ``ffn.w_up`` [E, D, I]
MoE ``mlp.experts.down_proj`` [E, D, I]                 ``ffn.w_down`` [E, I, D]
MoE ``mlp.shared_experts.{gate,up,down}_proj``          ``ffn.shared_experts.{gate,up,down}``
======================================================  =============================================

MTP layers (``model.layers.{L + j}.``, ``L = num_hidden_layers``; causal training does not run
them) are :meth:`Ling3StateDictAdapter.kept`: loading skips them into ``model.hf_kept``
(:func:`harts_runtime.hf.load_pretrained`) and :func:`harts_runtime.hf.save_pretrained` writes them
back unchanged. Our ``ffn.local_tokens_per_expert`` has no HF counterpart (zeros on load, dropped
on save). Unknown or missing tensors and shape mismatches raise
:class:`~harts_runtime.errors.InvalidInputError` whose ``field`` is the tensor's name.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.models.hybrid.args import ModelConfig
from harts_runtime.models.state_dict_adapter import HFStateDictAdapter

__all__ = ["Ling3StateDictAdapter", "from_hf", "to_hf"]

_KDA = {  # in-memory name under self_attn. -> (ours under mixer., checkpoint name under attention.)
    "q_proj": ("q_proj", "q_proj"),
    "k_proj": ("k_proj", "k_proj"),
    "v_proj": ("v_proj", "v_proj"),
    "b_proj": ("b_proj", "b_proj"),
    "o_proj": ("o_proj", "dense"),
    "o_norm": ("o_norm", "o_norm"),
    "g_proj": ("g_proj.0", "g_proj"),
    "forget_gate.f_proj": ("f_proj.0", "f_proj"),
}
_MLA = {
    "q_proj": "q_proj",
    "q_a_proj": "q_a_proj",
    "q_a_layernorm": "q_a_norm",
    "q_b_proj": "q_b_proj",
    "kv_a_proj_with_mqa": "kv_a_proj",
    "kv_a_layernorm": "kv_a_norm",
    "kv_b_proj": "kv_b_proj",
    "o_proj": "o_proj",
    "g_proj": "g_proj",
}
_MLP = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _per_expert(shapes: dict, prefix: str, w: str, ours: str) -> list:
    """Checkpoint entries of one expert weight: ``{prefix}experts.{j}.{w}.weight`` [cols, rows] is
    our ``ours[j]`` [rows, cols] transposed."""
    e, rows, cols = shapes[ours]
    return [(f"{prefix}experts.{j}.{w}.weight", "t", ours, j, (cols, rows)) for j in range(e)]


class Ling3StateDictAdapter(HFStateDictAdapter):
    """The tensor map of one Ling-3.0 :class:`ModelConfig` (shapes from a meta-device model)."""

    family = "Ling-3.0"

    def __init__(self, config: ModelConfig):
        from harts_runtime.models.hybrid.model import HybridModel

        self.config = config
        meta = HybridModel(config, device="meta").state_dict()
        self.our_shapes = {k: tuple(v.shape) for k, v in meta.items()}
        self._rules = {}  # in-memory hf name -> (kind, our names)
        self._ckpt = {}  # checkpoint name -> (kind, our name, expert slot, shape)
        for name, rule, ckpt in self._tables():
            self._rules[name] = rule
            for entry in ckpt:
                self._ckpt[entry[0]] = entry[1:]
        self.hf_shapes = {k: tuple(v.shape) for k, v in self._to_hf_items(meta, check=False)}
        self.checkpoint_names = list(self._ckpt)

    # ------------------------------------------------------------------ the tables
    def _tables(self) -> Iterator[tuple[str, tuple, list]]:
        """(in-memory name, (kind, our names), [(checkpoint name, kind, our name, slot, shape)])."""
        c, s = self.config, self.our_shapes

        def same(hf: str, ours: str, ckpt: str | None = None):
            return hf, ("same", (ours,)), [(ckpt or hf, "same", ours, None, s[ours])]

        yield same("model.embed_tokens.weight", "embed.weight", "model.word_embeddings.weight")
        yield same("model.norm.weight", "norm.weight")
        yield same("lm_head.weight", "lm_head.weight")
        for i, (mixer, ffn) in enumerate(zip(c.mixers, c.ffns)):
            h, o = f"model.layers.{i}.", f"blocks.{i}."
            yield same(h + "input_layernorm.weight", o + "norm1.weight")
            yield same(h + "post_attention_layernorm.weight", o + "norm2.weight")
            a, ck, m = h + "self_attn.", h + "attention.", o + "mixer."
            if mixer == "kda":
                for hf, (ours, ckpt) in _KDA.items():
                    yield same(a + hf + ".weight", m + ours + ".weight", ck + ckpt + ".weight")
                yield same(a + "forget_gate.dt_bias", m + "dt_bias", ck + "dt_bias")
                yield same(a + "forget_gate.A_log", m + "A_log", ck + "A_log")
                convs = tuple(m + f"{x}_conv1d.weight" for x in "qkv")
                yield (
                    a + "conv1d.weight",
                    ("split3", convs),
                    [(ck + f"{x}_conv1d.weight", "same", our, None, s[our]) for x, our in zip("qkv", convs)],
                )
            elif mixer == "mla":
                for hf, ours in _MLA.items():
                    if m + ours + ".weight" in s:
                        ckpt = "dense" if hf == "o_proj" else hf
                        yield same(a + hf + ".weight", m + ours + ".weight", ck + ckpt + ".weight")
            else:
                raise InvalidInputError(f"mixers[{i}]", f"{mixer!r} has no Ling-3.0 equivalent")
            p, f = h + "mlp.", o + "ffn."
            if ffn == "dense":
                for hf, ours in _MLP.items():
                    yield same(p + hf + ".weight", f + ours + ".weight")
                continue
            yield same(p + "gate.weight", f + "router")
            yield same(p + "gate.e_score_correction_bias", f + "expert_bias", p + "gate.expert_bias")
            for hf, ours in _MLP.items():
                yield same(p + "shared_experts." + hf + ".weight", f + "shared_experts." + ours + ".weight")
            gate_up = _per_expert(s, p, "gate_proj", f + "w_gate") + _per_expert(s, p, "up_proj", f + "w_up")
            yield p + "experts.gate_up_proj", ("gate_up", (f + "w_gate", f + "w_up")), gate_up
            down = _per_expert(s, p, "down_proj", f + "w_down")
            yield p + "experts.down_proj", ("transpose", (f + "w_down",)), down

    # ------------------------------------------------------------------ kept tensors
    def kept(self, name: str) -> bool:
        """An MTP layer's tensor (``model.layers.{i}.`` with ``i >= num_hidden_layers``): not run,
        kept and written back unchanged."""
        match = _LAYER.match(name)
        return match is not None and int(match.group(1)) >= self.config.num_layers

    ignored = kept  # skipped by the loader's table checks (the loader keeps them aside)

    def convert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """In-memory spelling only: one HF tensor -> its (our name, tensor) pairs."""
        if name not in self._rules:
            raise InvalidInputError(name, f"not a tensor of this {self.family} config (in-memory spelling)")
        return [(k, v) for k, _, v in self.convert_slots(name, tensor)]

    def extra_ours(self) -> dict[str, torch.Tensor]:
        """Our tensors with no HF counterpart: zero expert-load counts."""
        return {
            k: torch.zeros(s) for k, s in self.our_shapes.items() if k.endswith(".local_tokens_per_expert")
        }

    def missing(self, seen) -> list[str]:
        """HF names this config needs that ``seen`` lacks, in the spelling ``seen`` uses (the
        checkpoint one unless it holds an in-memory-only name)."""
        seen = set(seen)
        memory = any(k in self._rules and k not in self._ckpt for k in seen)
        return [k for k in (self._rules if memory else self._ckpt) if k not in seen]


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A transformers ``BailingHybridForCausalLM`` state dict -> our :class:`HybridModel` state
    dict (``load_state_dict(strict=True)`` takes it; MTP tensors skipped)."""
    return Ling3StateDictAdapter(config).from_hf(hf_state_dict)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our :class:`HybridModel` state dict -> a ``BailingHybridForCausalLM`` state dict."""
    return Ling3StateDictAdapter(config).to_hf(state_dict)
