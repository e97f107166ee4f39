"""Checks of the values a caller hands :class:`harts_runtime.rollouts.Rollouts`, one field at a time:
token ids, loss masks, group ids, per-token routes and jagged rows, each refused with a one-line
:class:`~harts_runtime.errors.InvalidInputError` naming the field (and row)."""

from __future__ import annotations

import numpy as np
import torch

from harts_runtime.errors import InvalidInputError


def _int_tokens(values, field: str) -> np.ndarray:
    a = np.asarray(values)
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise InvalidInputError(field, f"token ids must be integers, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def _check_mask(t: torch.Tensor, field: str) -> torch.Tensor:
    if t.dtype == torch.bool:
        return t
    if t.is_floating_point() or t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        bad = (t != 0) & (t != 1)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise InvalidInputError(f"{field}[{i}]", f"a loss mask is boolean or 0 / 1, got {float(t[i])}")
        return t.bool()
    raise InvalidInputError(field, f"a loss mask is boolean or 0 / 1, got dtype {t.dtype}")


def _group_ids(values, n: int) -> torch.Tensor:
    """``values`` as int64 group ids ``[n]``; InvalidInputError (``group_ids``) for another size or
    a value that is not an integer (NaN, 1.5, a string, a complex number)."""
    try:
        g = (
            torch.as_tensor(values)
            if isinstance(values, torch.Tensor)
            else torch.as_tensor(np.asarray(values))
        )
    except (TypeError, ValueError, RuntimeError):
        raise InvalidInputError("group_ids", "expected integers") from None
    if g.dim() != 1 or g.numel() != n:
        raise InvalidInputError("group_ids", f"expected {n} entries, got {tuple(g.shape)}")
    if g.is_complex() or g.dtype == torch.bool:
        raise InvalidInputError("group_ids", f"expected integers, got dtype {g.dtype}")
    if g.is_floating_point():
        bad = ~torch.isfinite(g) | (g != torch.round(g)) | (g.abs() >= 2.0**63)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise InvalidInputError(f"group_ids[{i}]", f"expected an integer, got {float(g[i])}")
    return g.long()


def _cat_routes(parts, lengths) -> torch.Tensor:
    """Per-trajectory routes ``[L_i, M, k]`` joined to ``[S, M, k]``; :class:`InvalidInputError`
    (``routes[i]``) for a part of another rank or token count or of another ``[M, k]``."""
    out = []
    for i, p in enumerate(parts):
        t = torch.as_tensor(p)
        if t.dim() != 3 or (lengths is not None and t.shape[0] != lengths[i]):
            want = f"[{lengths[i]}, M, k]" if lengths is not None else "[L_i, M, k]"
            raise InvalidInputError(
                f"routes[{i}]", f"expected {want} expert ids per token, got {tuple(t.shape)}"
            )
        if out and t.shape[1:] != out[0].shape[1:]:
            raise InvalidInputError(
                f"routes[{i}]", f"[M, k] = {tuple(t.shape[1:])}, row 0 has {tuple(out[0].shape[1:])}"
            )
        out.append(t)
    return torch.cat(out) if out else torch.zeros(0, 0, 0, dtype=torch.int32)


def _unbind(values, field: str) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        if values.is_nested:
            return list(values.unbind())
        raise InvalidInputError(field, "expected a nested (jagged) tensor or a list of 1-D tensors")
    if isinstance(values, (list, tuple)):
        out = [torch.as_tensor(v) for v in values]
        for i, v in enumerate(out):
            if v.dim() != 1:
                raise InvalidInputError(f"{field}[{i}]", f"expected a 1-D row, got {tuple(v.shape)}")
        return out
    raise InvalidInputError(field, f"expected a nested tensor or a list of rows, got {type(values).__name__}")
