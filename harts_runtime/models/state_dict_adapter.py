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
slot, transposed), ``a_log``, ``cat`` (our names a tuple, concatenated), or as is; a checkpoint
name ending in ``#alt`` is a second spelling that is read but never written.

Both tables also give each HF tensor as :class:`TensorPiece` s (:meth:`HFStateDictAdapter.pieces`):
which block of the HF tensor is which of our tensors (or one expert slot of it), and along which
dimensions. That is all a sharded reader or writer needs: :mod:`harts_runtime.hf.sharded`
reads each rank's block of each of our tensors as slices of the HF tensors it comes from, and
:func:`harts_runtime.hf.save_pretrained` assembles one HF tensor at a time
(:meth:`HFStateDictAdapter.assemble`) from our gathered tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from harts_runtime.errors import InvalidInputError

__all__ = ["HFStateDictAdapter", "TensorPiece"]


@dataclass(frozen=True)
class TensorPiece:
    """A block of one HF tensor that is one of our tensors (or one expert slot of it), possibly with
    its dimensions permuted and size-1 dimensions added.

    The piece covers all of ``ours`` (or all of ``ours[slot]``): its *free* dimensions are our
    tensor's (after dropping dim 0 when ``slot`` is set). HF dimension ``k`` runs along free
    dimension ``dims[k]`` starting at ``offsets[k]``, or is a size-1 dimension (``dims[k]`` None)
    at index ``offsets[k]``. E.g. ``gate_up``'s up half: ``dims=(0, 2, 1)``,
    ``offsets=(0, I, 0)``; a per-expert checkpoint tensor ``[I, D]`` of our ``[E, D, I]``:
    ``slot=j``, ``dims=(1, 0)``; ``A_log`` ``[1, 1, H, 1]`` of our ``[H]``:
    ``dims=(None, None, 0, None)``.
    """

    hf: str
    """The HF tensor's name, as asked for."""
    ours: str
    """Our tensor's name."""
    slot: int | None
    """Index on our dim 0 (an expert), or None: the whole tensor."""
    dims: tuple[int | None, ...]
    """Per HF dimension: the free dimension of ours it runs along, or None (size 1)."""
    offsets: tuple[int, ...]
    """Per HF dimension: where the piece starts."""

    def hf_index(self, box: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
        """The HF slices holding the block ``box`` of the piece's free dimensions (``[start, stop)``
        per free dimension, in our coordinates)."""
        return tuple(
            slice(o, o + 1) if d is None else slice(o + box[d][0], o + box[d][1])
            for d, o in zip(self.dims, self.offsets)
        )

    def to_ours(self, block: torch.Tensor) -> torch.Tensor:
        """A block read with :meth:`hf_index` -> our free dimensions' order (a view)."""
        mapped = [d for d in self.dims if d is not None]
        block = block.reshape([block.shape[k] for k, d in enumerate(self.dims) if d is not None])
        return block.permute(sorted(range(len(mapped)), key=mapped.__getitem__))

    def from_ours(self, ours: torch.Tensor) -> torch.Tensor:
        """Our free dimensions' tensor -> the piece's block in HF dimension order (a view)."""
        mapped = [d for d in self.dims if d is not None]
        t = ours.permute(mapped)
        return t.reshape([1 if d is None else ours.shape[d] for d in self.dims])


class HFStateDictAdapter:
    """Base of the family adapters; subclasses set the tables (module docstring) and
    ``zero_only`` ((suffix, reason) of our tensors with no HF counterpart, which must be zero to be
    written)."""

    zero_only: tuple[tuple[str, str], ...] = ()
    family = "model"
    """The family's name in error messages."""

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

    def convert_slots(self, name: str, tensor: torch.Tensor) -> list[tuple[str, int | None, torch.Tensor]]:
        """One HF tensor (either spelling) -> (our name, expert slot or None, tensor) triples
        (views where possible); checks the name and shape."""
        key = self._canonical(name)
        rule = self._rules.get(key)
        if rule is not None:
            want = self.hf_shapes[key]
            if tuple(tensor.shape) != want:
                raise InvalidInputError(name, f"shape {tuple(tensor.shape)} != {want} of this config")
            return [(k, None, v) for k, v in self._memory_to_ours(rule, tensor)]
        ck = self._ckpt.get(key) or self._ckpt.get(key + "#alt")
        if ck is None:
            raise InvalidInputError(name, f"not a tensor of this {self.family} config")
        kind, ours, slot, want = ck
        if tuple(tensor.shape) != tuple(want):
            raise InvalidInputError(name, f"shape {tuple(tensor.shape)} != {tuple(want)} of this config")
        return [(ours, slot, self._checkpoint_to_ours(kind, tensor))]

    def ignored(self, name: str) -> bool:
        """HF tensors outside the model (skipped on load); none by default."""
        return False

    def kept(self, name: str) -> bool:
        """HF tensors skipped on load but kept aside and written back on save (``model.hf_kept``;
        Ling-3.0's MTP layers); none by default. Each is also :meth:`ignored`."""
        return False

    # ------------------------------------------------------------------ pieces
    def _canonical(self, name: str) -> str:
        """``name`` as the tables spell it (families with several accepted prefixes override)."""
        return name

    def _entry(self, name: str):
        """``(kind, our names, expert slot, HF shape, table)`` of an HF name of either table (``table``
        ``"memory"`` or ``"checkpoint"``), or None for an unknown name."""
        key = self._canonical(name)
        rule = self._rules.get(key)
        if rule is not None:
            return rule[0], tuple(rule[1]), None, tuple(self.hf_shapes[key]), "memory"
        ck = self._ckpt.get(key) or self._ckpt.get(key + "#alt")
        if ck is None:
            return None
        kind, ours, slot, shape = ck
        return kind, (tuple(ours) if kind == "cat" else (ours,)), slot, tuple(shape), "checkpoint"

    def hf_shape(self, name: str) -> tuple[int, ...]:
        """The shape this config gives the HF tensor ``name`` (either spelling); an unknown name
        raises :class:`InvalidInputError` naming it."""
        entry = self._entry(name)
        if entry is None:
            raise InvalidInputError(name, "not a tensor of this model config")
        return entry[3]

    def pieces(self, name: str) -> list[TensorPiece]:
        """The HF tensor ``name`` (either spelling) as blocks of our tensors; their blocks tile it
        exactly. An unknown name raises :class:`InvalidInputError` naming it."""
        entry = self._entry(name)
        if entry is None:
            raise InvalidInputError(name, "not a tensor of this model config")
        kind, ours, slot, shape, table = entry
        ident = tuple(range(len(shape)))
        zero = (0,) * len(shape)
        if table == "checkpoint" and kind not in ("t", "a_log", "cat"):
            kind = "same"  # stored as is
        if kind == "same":
            return [TensorPiece(name, ours[0], None, ident, zero)]
        if kind == "a_log":  # HF [1, 1, H, 1], ours [H]
            return [TensorPiece(name, ours[0], None, (None, None, 0, None), zero)]
        if kind in ("split3", "cat"):  # ours stacked on dim 0
            out, start = [], 0
            for k in ours:
                out.append(TensorPiece(name, k, None, ident, (start,) + zero[1:]))
                start += self.our_shapes[k][0]
            return out
        if kind == "gate_up":  # HF [E, 2I, D], ours gate and up [E, D, I]
            i = self.our_shapes[ours[0]][2]
            return [TensorPiece(name, k, None, (0, 2, 1), (0, h * i, 0)) for h, k in enumerate(ours)]
        if kind == "transpose":  # HF [E, D, I], ours [E, I, D]
            return [TensorPiece(name, ours[0], None, (0, 2, 1), zero)]
        if kind == "t":  # HF [cols, rows], ours[slot] [rows, cols]
            return [TensorPiece(name, ours[0], slot, (1, 0), zero)]
        raise AssertionError(f"no pieces for kind {kind!r} ({name})")

    def assemble(self, name: str, ours: Callable[[str], torch.Tensor], device="cpu") -> torch.Tensor:
        """The HF tensor ``name`` (a new contiguous tensor on ``device``; None: on our tensors'
        device) from our full tensors ``ours(our_name)``; equals :meth:`to_checkpoint` /
        :meth:`to_hf`'s tensor of that name."""
        out = None
        for p in self.pieces(name):
            t = ours(p.ours)
            t = t if p.slot is None else t[p.slot]
            if out is None:
                out = torch.empty(
                    self.hf_shape(name), dtype=t.dtype, device=t.device if device is None else device
                )
            out[p.hf_index(tuple((0, s) for s in t.shape))] = p.from_ours(t)
        return out

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

    @property
    def memory_names(self) -> list[str]:
        """The transformers model's ``state_dict()`` names (the in-memory table), in order."""
        return list(self._rules)

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
