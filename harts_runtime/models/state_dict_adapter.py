"""What every transformers <-> :class:`HybridModel` state-dict adapter shares.

A family's adapter (``models/<family>/state_dict_adapter.py``) builds two tables from a
meta-device model of its :class:`ModelConfig`: ``_rules`` (in-memory spelling, the
``state_dict()`` of the transformers model: hf name -> (kind, our names)) and ``_ckpt``
(checkpoint spelling, what ``save_pretrained`` stores: name -> (kind, our name, expert slot,
shape)), and says which HF names it reads (``convert_slots``), which are missing (``missing``) and
which of our tensors have no HF counterpart (``extra_ours``). This base turns the tables into
``from_hf`` / ``to_hf`` / ``to_checkpoint`` and their checks.

Kinds of the in-memory table: ``same``; ``a_log`` (HF [1, 1, H, 1], ours [H]); ``split3`` (one HF
tensor, three of ours of equal size stacked on dim 0); ``cat`` (one HF tensor, ours concatenated on
dim 0 in order, their sizes from ``our_shapes``); ``gate_up`` (HF [E, 2I, D], ours gate and up
[E, D, I]); ``transpose`` (HF [E, D, I], ours [E, I, D]). Of the checkpoint table: ``t`` (expert
slot, transposed), ``a_log``, ``cat`` (our names a tuple, concatenated), or as is.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from harts_runtime.errors import InvalidInputError

__all__ = ["HFStateDictAdapter"]


class HFStateDictAdapter:
    """Base of the family adapters; subclasses set the tables (module docstring) and
    ``zero_only`` ((suffix, reason) of our tensors with no HF counterpart, which must be zero to be
    written)."""

    zero_only: tuple[tuple[str, str], ...] = ()

    # ------------------------------------------------------------------ conversions
    def _memory_to_ours(self, rule, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        kind, ours = rule
        if kind == "same":
            return [(ours[0], tensor)]
        if kind == "a_log":
            return [(ours[0], tensor.reshape(-1))]
        if kind == "split3":
            return list(zip(ours, tensor.chunk(3, dim=0)))
        if kind == "cat":
            return list(zip(ours, tensor.split([self.our_shapes[k][0] for k in ours], dim=0)))
        if kind == "gate_up":
            gate, up = tensor.chunk(2, dim=1)
            return [(ours[0], gate.transpose(1, 2)), (ours[1], up.transpose(1, 2))]
        if kind == "transpose":
            return [(ours[0], tensor.transpose(1, 2))]
        raise AssertionError(kind)

    @staticmethod
    def _checkpoint_to_ours(kind: str, tensor: torch.Tensor) -> torch.Tensor:
        if kind == "t":
            return tensor.t()
        if kind == "a_log":
            return tensor.reshape(-1)
        return tensor

    def ignored(self, name: str) -> bool:
        """HF tensors outside the model (skipped on load); none by default."""
        return False

    # ------------------------------------------------------------------ hf -> ours
    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A transformers state dict (either spelling) -> ours (``load_state_dict(strict=True)``
        takes it); unknown, misshapen and missing tensors raise InvalidInputError naming them."""
        out = {}
        for name, tensor in hf_state_dict.items():
            if self.ignored(name):
                continue
            for k, slot, v in self.convert_slots(name, tensor):
                if slot is None:
                    out[k] = v.contiguous()
                else:
                    if k not in out:
                        out[k] = torch.empty(self.our_shapes[k], dtype=v.dtype, device=v.device)
                    out[k][slot] = v
        missing = self.missing(k for k in hf_state_dict if not self.ignored(k))
        if missing:
            raise InvalidInputError(
                missing[0], f"missing from the checkpoint ({len(missing)} tensors missing)"
            )
        out.update(self.extra_ours())
        return out

    # ------------------------------------------------------------------ ours -> hf
    def _check_ours(self, sd: Mapping[str, torch.Tensor]) -> None:
        for k, v in sd.items():
            if k not in self.our_shapes:
                raise InvalidInputError(k, "not a tensor of this model config")
            if tuple(v.shape) != self.our_shapes[k]:
                raise InvalidInputError(k, f"shape {tuple(v.shape)} != {self.our_shapes[k]} of this config")
        for k in self.our_shapes:
            if k not in sd:
                raise InvalidInputError(k, "missing from the state dict")
        for k, v in sd.items():
            for suffix, reason in self.zero_only:
                if k.endswith(suffix) and bool((v != 0).any()):
                    raise InvalidInputError(k, f"non-zero; {reason}")

    def _to_hf_items(self, sd: Mapping[str, torch.Tensor], check: bool = True):
        if check:
            self._check_ours(sd)
        for hf_name, (kind, ours) in self._rules.items():
            t = [sd[k] for k in ours]
            if kind == "same":
                yield hf_name, t[0]
            elif kind == "a_log":
                yield hf_name, t[0].reshape(1, 1, -1, 1)
            elif kind in ("split3", "cat"):
                yield hf_name, torch.cat(t, dim=0)
            elif kind == "gate_up":
                yield hf_name, torch.cat([t[0].transpose(1, 2), t[1].transpose(1, 2)], dim=1)
            elif kind == "transpose":
                yield hf_name, t[0].transpose(1, 2)
            else:
                raise AssertionError(kind)

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our state dict -> the transformers model's ``state_dict()`` (in-memory spelling)."""
        return {k: v.contiguous() for k, v in self._to_hf_items(state_dict)}

    def to_checkpoint(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our state dict -> the checkpoint spelling (per-expert tensors; views, not copies, except
        an ``A_log`` reshape and a ``cat``)."""
        self._check_ours(state_dict)
        out = {}
        for name in self.checkpoint_names:
            kind, ours, slot, _ = self._ckpt[name]
            if kind == "cat":
                out[name] = torch.cat([state_dict[k] for k in ours], dim=0)
                continue
            t = state_dict[ours]
            if kind == "t":
                out[name] = t[slot].t()
            elif kind == "a_log":
                out[name] = t.reshape(1, 1, -1, 1)
            else:
                out[name] = t
        return out
