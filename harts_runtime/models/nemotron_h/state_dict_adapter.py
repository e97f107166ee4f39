"""Nemotron-H state dicts <-> :class:`HybridModel` state dicts.

Every tensor is mapped (``{i}``: layer; HF prefix ``model.layers.{i}.`` in memory,
``backbone.layers.{i}.`` in checkpoints, both read; ours ``blocks.{i}.``, one block per HF layer):

=====================================================  ==============================================
transformers                                           ours
=====================================================  ==============================================
``model.embeddings.weight``, ``model.norm_f.weight``,  ``embed.weight``, ``norm.weight``,
``lm_head.weight``                                     ``lm_head.weight``
``norm.weight`` of a mixer / an FFN layer              ``norm1.weight`` / ``norm2.weight``
Mamba2 ``mixer.in_proj.{weight,bias}``                 ``mixer.in_proj_{z,x,B,C,dt}.*`` (its row blocks)
Mamba2 ``mixer.conv1d.{weight,bias}``                  ``mixer.{x,B,C}_conv1d.*`` (its channel blocks)
Mamba2 ``mixer.*`` (other)                             ``mixer.*`` (same names and shapes)
attention ``mixer.{q,k,v,o}_proj.weight``              ``mixer.{q,k,v,o}_proj.weight``
MLP ``mixer.{up,down}_proj.weight``                    ``ffn.{up,down}_proj.weight``
MoE ``mixer.gate.weight``, ``e_score_correction_bias`` ``ffn.router``, ``ffn.expert_bias``
MoE ``mixer.experts.up_proj`` [E, I, D]                ``ffn.w_up`` [E, D, I]
MoE ``mixer.experts.down_proj`` [E, D, I]              ``ffn.w_down`` [E, I, D]
(checkpoint: ``mixer.experts.{j}.{up,down}_proj.weight``)  (expert slot ``j``, transposed)
MoE ``mixer.shared_experts.{up,down}_proj.weight``     ``ffn.shared_experts.{up,down}_proj.weight``
=====================================================  ==============================================

Our ``ffn.local_tokens_per_expert`` has no HF counterpart: :meth:`from_hf` returns zeros,
:meth:`to_hf` drops it. Unknown or missing tensors and shape mismatches raise
:class:`~harts_runtime.errors.InvalidInputError` whose ``field`` is the tensor's name. MTP tensors
(``mtp.*``) are skipped, as transformers skips them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.layers.mamba2 import HF_CONCATENATED as MAMBA2_CONCATENATED
from harts_runtime.models.hybrid.args import ModelConfig
from harts_runtime.models.state_dict_adapter import HFStateDictAdapter

__all__ = ["NemotronHStateDictAdapter", "from_hf", "to_hf"]

_CKPT_PREFIX = "backbone."


class NemotronHStateDictAdapter(HFStateDictAdapter):
    """The tensor map of one Nemotron-H :class:`ModelConfig` (shapes from a meta-device model).

    Two HF spellings are read: the in-memory one (``state_dict()`` of the transformers model:
    ``model.`` prefix, stacked ``mixer.experts.up_proj`` / ``down_proj``) and the checkpoint one
    (released checkpoints: ``backbone.`` prefix, ``mixer.experts.{j}.{up,down}_proj.weight``).
    :meth:`to_hf` writes the in-memory spelling, :meth:`to_checkpoint` the checkpoint one."""

    family = "Nemotron-H"

    def __init__(self, config: ModelConfig, prefix: str = "model."):
        from harts_runtime.models.hybrid.model import HybridModel

        self.config, self.prefix = config, prefix
        meta = HybridModel(config, device="meta").state_dict()
        self.our_shapes = {k: tuple(v.shape) for k, v in meta.items()}
        self._rules = dict(self._memory_table())
        self.hf_shapes = {k: tuple(v.shape) for k, v in self._to_hf_items(meta, check=False)}
        self._ckpt = {}  # checkpoint name -> (kind, our name, expert slot, shape)
        for name, (kind, ours) in self._rules.items():
            ck = _CKPT_PREFIX + name[len(prefix) :] if name.startswith(prefix) else name
            if kind in ("same", "cat"):  # checkpoints store both as in memory
                self._ckpt[ck] = (kind, ours if kind == "cat" else ours[0], None, self.hf_shapes[name])
                continue
            base, w = ck.rsplit(".", 1)  # ...mixer.experts, up_proj / down_proj
            e, rows, cols = self.our_shapes[ours[0]]
            for j in range(e):
                self._ckpt[f"{base}.{j}.{w}.weight"] = ("t", ours[0], j, (cols, rows))
        self.checkpoint_names = list(self._ckpt)

    def _memory_table(self) -> Iterator[tuple[str, tuple]]:
        c, p = self.config, self.prefix
        yield p + "embeddings.weight", ("same", ("embed.weight",))
        yield p + "norm_f.weight", ("same", ("norm.weight",))
        yield "lm_head.weight", ("same", ("lm_head.weight",))
        for i, (mixer, ffn) in enumerate(zip(c.mixers, c.ffns)):
            h, o = f"{p}layers.{i}.", f"blocks.{i}."
            if (mixer == "none") == (ffn == "none"):
                raise InvalidInputError(
                    f"mixers[{i}]", f"a {self.family} layer is a mixer or an FFN, got {mixer}/{ffn}"
                )
            if mixer in ("mamba2", "gqa"):
                yield h + "norm.weight", ("same", (o + "norm1.weight",))
                m = o + "mixer."
                cat = MAMBA2_CONCATENATED if mixer == "mamba2" else {}
                parts = {our: hf for hf, ours in cat.items() for our in ours}  # our suffix -> HF name
                for k in self.our_shapes:
                    if not k.startswith(m):
                        continue
                    name = k[len(m) :]
                    if name not in parts:
                        yield h + "mixer." + name, ("same", (k,))
                    elif name == cat[parts[name]][0]:  # the first block of a fused tensor: all of them
                        yield h + "mixer." + parts[name], ("cat", tuple(m + n for n in cat[parts[name]]))
            elif mixer != "none":
                raise InvalidInputError(f"mixers[{i}]", f"{mixer!r} has no {self.family} equivalent")
            if ffn == "none":
                continue
            yield h + "norm.weight", ("same", (o + "norm2.weight",))
            f, q = o + "ffn.", h + "mixer."
            if ffn == "relu2":
                for w in ("up_proj", "down_proj"):
                    yield q + w + ".weight", ("same", (f + w + ".weight",))
            elif ffn == "moe":
                if (
                    f + "shared_experts.up_proj.weight" not in self.our_shapes
                    or f + "w_gate" in self.our_shapes
                ):
                    raise InvalidInputError(
                        "moe.activation", f"{self.family} MoE needs relu2 experts and a shared expert"
                    )
                yield q + "gate.weight", ("same", (f + "router",))
                yield q + "gate.e_score_correction_bias", ("same", (f + "expert_bias",))
                yield q + "experts.up_proj", ("transpose", (f + "w_up",))
                yield q + "experts.down_proj", ("transpose", (f + "w_down",))
                for w in ("up_proj", "down_proj"):
                    yield (
                        q + "shared_experts." + w + ".weight",
                        ("same", (f + "shared_experts." + w + ".weight",)),
                    )
            else:
                raise InvalidInputError(f"ffns[{i}]", f"{ffn!r} has no {self.family} equivalent")

    def _canonical(self, name: str) -> str:
        """``name`` with the checkpoint prefix ``backbone.`` read as the in-memory ``model.``
        where the in-memory table has it (stacked expert names stay checkpoint names)."""
        if name.startswith(_CKPT_PREFIX):
            alt = self.prefix + name[len(_CKPT_PREFIX) :]
            if alt in self._rules:
                return alt
        return name

    def ignored(self, name: str) -> bool:
        """MTP tensors: skipped on load."""
        return name.startswith("mtp.")

    def extra_ours(self) -> dict[str, torch.Tensor]:
        """Our tensors with no HF counterpart: zero expert-load counts."""
        return {
            k: torch.zeros(s) for k, s in self.our_shapes.items() if k.endswith(".local_tokens_per_expert")
        }

    def missing(self, seen) -> list[str]:
        """HF names this config needs that ``seen`` lacks, in the spelling ``seen`` uses (the
        in-memory one if it holds a stacked expert tensor or a ``model.`` name, else the checkpoint one)."""
        seen = set(seen)
        memory = any(k.startswith(self.prefix) for k in seen)
        if memory:
            canon = {self._canonical(k) for k in seen}
            return [k for k in self._rules if k not in canon]
        return [k for k in self._ckpt if k not in seen]


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A transformers ``NemotronHForCausalLM`` state dict -> our :class:`HybridModel` state dict."""
    return NemotronHStateDictAdapter(config).from_hf(hf_state_dict)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our :class:`HybridModel` state dict -> a ``NemotronHForCausalLM`` state dict."""
    return NemotronHStateDictAdapter(config).to_hf(state_dict)
