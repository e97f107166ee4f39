"""Kimi-Linear state dicts (transformers ``KimiLinearForCausalLM``) <-> :class:`HybridModel` state dicts.

Every tensor is mapped (``{i}``: layer; HF prefix ``model.layers.{i}.``, ours ``blocks.{i}.``):

======================================================  =============================================
transformers                                            ours
======================================================  =============================================
``model.embed_tokens.weight``, ``model.norm.weight``,   ``embed.weight``, ``norm.weight``,
``lm_head.weight``                                      ``lm_head.weight``
``input_layernorm``, ``post_attention_layernorm``       ``norm1``, ``norm2``
KDA ``self_attn.{q,k,v,b,o}_proj``, ``o_norm``          ``mixer.`` same names (fla's)
KDA ``self_attn.conv1d.weight`` [3 H K, 1, w]           ``mixer.{q,k,v}_conv1d.weight`` (split in 3)
KDA ``forget_gate.f_a_proj``, ``f_b_proj``              ``mixer.f_proj.0``, ``mixer.f_proj.1``
KDA ``forget_gate.dt_bias``, ``forget_gate.A_log``      ``mixer.dt_bias``, ``mixer.A_log`` ([1,1,H,1] <-> [H])
KDA ``g_a_proj``, ``g_b_proj``                          ``mixer.g_proj.0``, ``mixer.g_proj.1`` (our bias
                                                        is zero; a non-zero one cannot be exported)
MLA ``q_proj`` / ``q_a_proj``, ``q_a_layernorm``,       ``mixer.q_proj`` / ``q_a_proj``, ``q_a_norm``,
``q_b_proj``, ``kv_a_proj_with_mqa``,                   ``q_b_proj``, ``kv_a_proj``, ``kv_a_norm``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``           ``kv_b_proj``, ``o_proj``
dense ``mlp.{gate,up,down}_proj``                       ``ffn.{gate,up,down}``
MoE ``mlp.gate.weight``, ``e_score_correction_bias``    ``ffn.router``, ``ffn.expert_bias``
MoE ``mlp.experts.gate_up_proj`` [E, 2I, D]             ``ffn.w_gate``, ``ffn.w_up`` [E, D, I]
MoE ``mlp.experts.down_proj`` [E, D, I]                 ``ffn.w_down`` [E, I, D]
MoE ``mlp.shared_experts.{gate,up,down}_proj``          ``ffn.shared_experts.{gate,up,down}``
======================================================  =============================================

Our ``ffn.local_tokens_per_expert`` (expert-load counts) has no HF counterpart: :func:`from_hf`
returns zeros, :func:`to_hf` drops it. Unknown or missing tensors and shape mismatches raise
:class:`~harts_runtime.errors.InvalidInputError` whose ``field`` is the tensor's name.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.models.hybrid.args import ModelConfig

__all__ = ["KimiLinearStateDictAdapter", "from_hf", "to_hf"]

_KDA_SAME = ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj", "o_norm")
_KDA_RENAME = {
    "forget_gate.f_a_proj": "f_proj.0",
    "forget_gate.f_b_proj": "f_proj.1",
    "g_a_proj": "g_proj.0",
    "g_b_proj": "g_proj.1",
}
_MLA_RENAME = {
    "q_proj": "q_proj",
    "q_a_proj": "q_a_proj",
    "q_a_layernorm": "q_a_norm",
    "q_b_proj": "q_b_proj",
    "kv_a_proj_with_mqa": "kv_a_proj",
    "kv_a_layernorm": "kv_a_norm",
    "kv_b_proj": "kv_b_proj",
    "o_proj": "o_proj",
}
_MLP_RENAME = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class KimiLinearStateDictAdapter:
    """The tensor map of one Kimi-Linear :class:`ModelConfig` (shapes from a meta-device model)."""

    def __init__(self, config: ModelConfig):
        from harts_runtime.models.hybrid.model import HybridModel

        self.config = config
        meta = HybridModel(config, device="meta").state_dict()
        self.our_shapes = {k: tuple(v.shape) for k, v in meta.items()}
        self._rules = {}  # hf name -> (kind, our names)
        for hf_name, kind, ours in self._table():
            self._rules[hf_name] = (kind, ours)
        self.hf_shapes = {k: tuple(v.shape) for k, v in self._to_hf_items(meta, check=False)}

    # ------------------------------------------------------------------ the table
    def _table(self) -> Iterator[tuple[str, str, tuple]]:
        """(hf name, kind, our names); kind is how the tensors convert (``same`` by default)."""
        c = self.config
        yield "model.embed_tokens.weight", "same", ("embed.weight",)
        yield "model.norm.weight", "same", ("norm.weight",)
        yield "lm_head.weight", "same", ("lm_head.weight",)
        for i, (mixer, ffn) in enumerate(zip(c.mixers, c.ffns)):
            h, o = f"model.layers.{i}.", f"blocks.{i}."
            yield h + "input_layernorm.weight", "same", (o + "norm1.weight",)
            yield h + "post_attention_layernorm.weight", "same", (o + "norm2.weight",)
            a, m = h + "self_attn.", o + "mixer."
            if mixer == "kda":
                for name in _KDA_SAME:
                    yield a + name + ".weight", "same", (m + name + ".weight",)
                for hf, ours in _KDA_RENAME.items():
                    yield a + hf + ".weight", "same", (m + ours + ".weight",)
                yield a + "conv1d.weight", "split3", tuple(m + f"{x}_conv1d.weight" for x in "qkv")
                yield a + "forget_gate.dt_bias", "same", (m + "dt_bias",)
                yield a + "forget_gate.A_log", "a_log", (m + "A_log",)
            elif mixer == "mla":
                for hf, ours in _MLA_RENAME.items():
                    if m + ours + ".weight" in self.our_shapes:
                        yield a + hf + ".weight", "same", (m + ours + ".weight",)
            else:
                raise InvalidInputError(f"mixers[{i}]", f"{mixer!r} has no Kimi-Linear equivalent")
            p, f = h + "mlp.", o + "ffn."
            if ffn == "dense":
                for hf, ours in _MLP_RENAME.items():
                    yield p + hf + ".weight", "same", (f + ours + ".weight",)
            else:
                yield p + "gate.weight", "same", (f + "router",)
                yield p + "gate.e_score_correction_bias", "same", (f + "expert_bias",)
                yield p + "experts.gate_up_proj", "gate_up", (f + "w_gate", f + "w_up")
                yield p + "experts.down_proj", "transpose", (f + "w_down",)
                for hf, ours in _MLP_RENAME.items():
                    yield (
                        p + "shared_experts." + hf + ".weight",
                        "same",
                        (f + "shared_experts." + ours + ".weight",),
                    )

    # ------------------------------------------------------------------ hf -> ours
    def convert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """One HF tensor -> its (our name, tensor) pairs (views where possible); checks the name and shape."""
        rule = self._rules.get(name)
        if rule is None:
            raise InvalidInputError(name, "not a tensor of this Kimi-Linear config")
        want = self.hf_shapes[name]
        if tuple(tensor.shape) != want:
            raise InvalidInputError(name, f"shape {tuple(tensor.shape)} != {want} of this config")
        kind, ours = rule
        if kind == "same":
            return [(ours[0], tensor)]
        if kind == "a_log":
            return [(ours[0], tensor.reshape(-1))]
        if kind == "split3":
            return list(zip(ours, tensor.chunk(3, dim=0)))
        if kind == "gate_up":
            gate, up = tensor.chunk(2, dim=1)
            return [(ours[0], gate.transpose(1, 2)), (ours[1], up.transpose(1, 2))]
        if kind == "transpose":
            return [(ours[0], tensor.transpose(1, 2))]
        raise AssertionError(kind)

    def extra_ours(self) -> dict[str, torch.Tensor]:
        """Our tensors with no HF counterpart (zero expert-load counts)."""
        return {
            k: torch.zeros(s) for k, s in self.our_shapes.items() if k.endswith(".local_tokens_per_expert")
        } | {k: torch.zeros(s) for k, s in self.our_shapes.items() if k.endswith("mixer.g_proj.1.bias")}

    def missing(self, seen) -> list[str]:
        """HF names of this config not in ``seen``."""
        return [k for k in self._rules if k not in seen]

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, tensor in hf_state_dict.items():
            for k, v in self.convert(name, tensor):
                out[k] = v.contiguous()
        missing = self.missing(hf_state_dict)
        if missing:
            raise InvalidInputError(
                missing[0], f"missing from the checkpoint ({len(missing)} tensors missing)"
            )
        out.update(self.extra_ours())
        return out

    # ------------------------------------------------------------------ ours -> hf
    def _to_hf_items(self, sd: Mapping[str, torch.Tensor], check: bool = True):
        if check:
            for k, v in sd.items():
                if k not in self.our_shapes:
                    raise InvalidInputError(k, "not a tensor of this model config")
                if tuple(v.shape) != self.our_shapes[k]:
                    raise InvalidInputError(
                        k, f"shape {tuple(v.shape)} != {self.our_shapes[k]} of this config"
                    )
            for k in self.our_shapes:
                if k not in sd:
                    raise InvalidInputError(k, "missing from the state dict")
            for k, v in sd.items():
                if k.endswith("mixer.g_proj.1.bias") and bool((v != 0).any()):
                    raise InvalidInputError(k, "non-zero; Kimi-Linear's g_b_proj has no bias")
        for hf_name, (kind, ours) in self._rules.items():
            t = [sd[k] for k in ours]
            if kind == "same":
                yield hf_name, t[0]
            elif kind == "a_log":
                yield hf_name, t[0].reshape(1, 1, -1, 1)
            elif kind == "split3":
                yield hf_name, torch.cat(t, dim=0)
            elif kind == "gate_up":
                yield hf_name, torch.cat([t[0].transpose(1, 2), t[1].transpose(1, 2)], dim=1)
            elif kind == "transpose":
                yield hf_name, t[0].transpose(1, 2)

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.contiguous() for k, v in self._to_hf_items(state_dict)}


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A transformers ``KimiLinearForCausalLM`` state dict -> our :class:`HybridModel` state dict
    (``load_state_dict(strict=True)`` takes it)."""
    return KimiLinearStateDictAdapter(config).from_hf(hf_state_dict)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our :class:`HybridModel` state dict -> a ``KimiLinearForCausalLM`` state dict."""
    return KimiLinearStateDictAdapter(config).to_hf(state_dict)
