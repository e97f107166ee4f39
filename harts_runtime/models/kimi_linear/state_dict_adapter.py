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
KDA ``g_a_proj``, ``g_b_proj``                          ``mixer.g_proj.0``, ``mixer.g_proj.1`` (no bias:
                                                        ``from_hf_config`` sets ``kda.output_gate_bias``
                                                        False; a model built with fla's bias exports
                                                        only while the bias is zero)
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
from harts_runtime.models.state_dict_adapter import HFStateDictAdapter

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


class KimiLinearStateDictAdapter(HFStateDictAdapter):
    """The tensor map of one Kimi-Linear :class:`ModelConfig` (shapes from a meta-device model).

    Two HF spellings are read: the in-memory one (``KimiLinearForCausalLM.state_dict()``:
    ``mlp.experts.gate_up_proj``, ``self_attn.conv1d``, ``forget_gate.*``) and the checkpoint one
    (what ``save_pretrained`` and the released checkpoints store, which transformers converts on
    load: ``block_sparse_moe.experts.{j}.w1/w2/w3``, ``self_attn.{q,k,v}_conv1d``,
    ``self_attn.f_a_proj`` / ``dt_bias`` / ``A_log``; ``mlp.`` or ``block_sparse_moe.`` as the FFN
    prefix). :meth:`to_hf` writes the in-memory spelling, :meth:`to_checkpoint` the checkpoint one.
    """

    family = "Kimi-Linear"

    def __init__(self, config: ModelConfig):
        from harts_runtime.models.hybrid.model import HybridModel

        self.config = config
        meta = HybridModel(config, device="meta").state_dict()
        self.our_shapes = {k: tuple(v.shape) for k, v in meta.items()}
        self._rules = dict(self._memory_table())  # hf name -> (kind, our names)
        self.hf_shapes = {k: tuple(v.shape) for k, v in self._to_hf_items(meta, check=False)}
        self._ckpt = {}  # checkpoint name -> (kind, our name, expert slot, shape)
        for name, kind, ours, slot, shape in self._checkpoint_table():
            self._ckpt[name] = (kind, ours, slot, shape)
        self.checkpoint_names = [k for k in self._ckpt if not self._alt(k)]

    @staticmethod
    def _alt(name: str) -> bool:
        """The second FFN prefix of a dense layer / MoE layer (accepted, not written)."""
        return name.endswith("#alt")

    # ------------------------------------------------------------------ the tables
    def _memory_table(self) -> Iterator[tuple[str, tuple]]:
        """(hf name, (kind, our names)) of the in-memory spelling."""
        c = self.config
        yield "model.embed_tokens.weight", ("same", ("embed.weight",))
        yield "model.norm.weight", ("same", ("norm.weight",))
        yield "lm_head.weight", ("same", ("lm_head.weight",))
        for i, (mixer, ffn) in enumerate(zip(c.mixers, c.ffns)):
            h, o = f"model.layers.{i}.", f"blocks.{i}."
            yield h + "input_layernorm.weight", ("same", (o + "norm1.weight",))
            yield h + "post_attention_layernorm.weight", ("same", (o + "norm2.weight",))
            a, m = h + "self_attn.", o + "mixer."
            if mixer == "kda":
                for name in _KDA_SAME:
                    yield a + name + ".weight", ("same", (m + name + ".weight",))
                for hf, ours in _KDA_RENAME.items():
                    yield a + hf + ".weight", ("same", (m + ours + ".weight",))
                yield a + "conv1d.weight", ("split3", tuple(m + f"{x}_conv1d.weight" for x in "qkv"))
                yield a + "forget_gate.dt_bias", ("same", (m + "dt_bias",))
                yield a + "forget_gate.A_log", ("a_log", (m + "A_log",))
            elif mixer == "mla":
                for hf, ours in _MLA_RENAME.items():
                    if m + ours + ".weight" in self.our_shapes:
                        yield a + hf + ".weight", ("same", (m + ours + ".weight",))
            else:
                raise InvalidInputError(f"mixers[{i}]", f"{mixer!r} has no Kimi-Linear equivalent")
            p, f = h + "mlp.", o + "ffn."
            if ffn == "dense":
                for hf, ours in _MLP_RENAME.items():
                    yield p + hf + ".weight", ("same", (f + ours + ".weight",))
            else:
                yield p + "gate.weight", ("same", (f + "router",))
                yield p + "gate.e_score_correction_bias", ("same", (f + "expert_bias",))
                yield p + "experts.gate_up_proj", ("gate_up", (f + "w_gate", f + "w_up"))
                yield p + "experts.down_proj", ("transpose", (f + "w_down",))
                for hf, ours in _MLP_RENAME.items():
                    yield (
                        p + "shared_experts." + hf + ".weight",
                        ("same", (f + "shared_experts." + ours + ".weight",)),
                    )

    def _checkpoint_table(self):
        """(checkpoint name, kind, our name, expert slot or None, shape); the FFN tensors twice,
        the second prefix marked ``#alt``."""
        c = self.config
        for name, (kind, ours) in self._memory_table():
            parts = name.split(".")
            if ".self_attn." in name and (kind == "split3" or "forget_gate" in name):
                if kind == "split3":
                    for x, our in zip("qkv", ours):
                        yield name.replace("conv1d", f"{x}_conv1d"), "same", our, None, self.our_shapes[our]
                else:
                    shape = self.hf_shapes[name]
                    yield name.replace("forget_gate.", ""), kind, ours[0], None, shape
                continue
            if ".mlp." not in name:
                yield name, kind, ours[0], None, self.hf_shapes[name]
                continue
            i = int(parts[2])
            first, second = (
                ("mlp", "block_sparse_moe") if c.ffns[i] == "dense" else ("block_sparse_moe", "mlp")
            )
            for prefix, tag in ((first, ""), (second, "#alt")):
                ck = name.replace(".mlp.", f".{prefix}.")
                if kind == "same":
                    yield ck + tag, kind, ours[0], None, self.hf_shapes[name]
                    continue
                e = c.moe.num_experts
                base = ck.rsplit(".", 1)[0]  # ...experts
                pairs = (("w1", ours[0]), ("w3", ours[1])) if kind == "gate_up" else (("w2", ours[0]),)
                for w, our in pairs:
                    _, rows, cols = self.our_shapes[our]
                    for j in range(e):
                        yield f"{base}.{j}.{w}.weight" + tag, "t", our, j, (cols, rows)

    def convert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """In-memory spelling only: one HF tensor -> its (our name, tensor) pairs."""
        rule = self._rules.get(name)
        if rule is None:
            raise InvalidInputError(name, f"not a tensor of this {self.family} config (in-memory spelling)")
        return [(k, v) for k, _, v in self.convert_slots(name, tensor)]

    def extra_ours(self) -> dict[str, torch.Tensor]:
        """Our tensors with no HF counterpart: zero expert-load counts, and zero KDA output-gate
        biases when the config has them (``kda.output_gate_bias``; a Kimi-Linear config does not)."""
        ends = (".local_tokens_per_expert", "mixer.g_proj.1.bias")
        return {k: torch.zeros(s) for k, s in self.our_shapes.items() if k.endswith(ends)}

    zero_only = (("mixer.g_proj.1.bias", "Kimi-Linear's g_b_proj has no bias"),)

    def missing(self, seen) -> list[str]:
        """HF names this config needs that ``seen`` lacks, in the spelling ``seen`` uses (the
        checkpoint one unless it holds an in-memory-only name)."""
        seen = set(seen)
        memory = any(k in self._rules and k not in self._ckpt and k + "#alt" not in self._ckpt for k in seen)
        if memory:
            return [k for k in self._rules if k not in seen]
        out = []
        for k in self.checkpoint_names:
            if k in seen:
                continue
            alt = (
                k.replace(".mlp.", ".#.")
                .replace(".block_sparse_moe.", ".mlp.")
                .replace(".#.", ".block_sparse_moe.")
            )
            if alt not in seen:
                out.append(k)
        return out


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A transformers ``KimiLinearForCausalLM`` state dict -> our :class:`HybridModel` state dict
    (``load_state_dict(strict=True)`` takes it)."""
    return KimiLinearStateDictAdapter(config).from_hf(hf_state_dict)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our :class:`HybridModel` state dict -> a ``KimiLinearForCausalLM`` state dict."""
    return KimiLinearStateDictAdapter(config).to_hf(state_dict)
