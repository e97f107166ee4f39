"""The token-id range check shared by :class:`~harts_runtime.rollouts.Rollouts` and
:class:`~harts_runtime.step_inputs.StepInputs` (:func:`check_token_range`).

It sits on the bottom floor (numpy and :mod:`harts_runtime.errors` only), so both callers import it
without importing each other.
"""

from __future__ import annotations

import numpy as np

from harts_runtime.errors import InvalidInputError

__all__ = ["TOKEN_LIMIT", "check_token_range"]

TOKEN_LIMIT = 2**31
"""Token ids are int32 in HARTS's ingestion: an id at or above this would wrap."""


def check_token_range(tokens: np.ndarray, offsets: np.ndarray, vocab_size: int | None, field: str) -> None:
    """Raise :class:`InvalidInputError` naming the first token id outside ``[0, vocab_size)`` (or
    outside ``[0, 2^31)`` when ``vocab_size`` is None: ids are int32 in HARTS, a larger one would
    wrap) as ``field[trajectory][position]``; O(S).

    ``tokens``: int [S], the trajectories' ids back to back; ``offsets``: int64 [N + 1], trajectory
    ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``."""
    bad = tokens < 0
    top = vocab_size if vocab_size is not None else TOKEN_LIMIT
    bad |= tokens >= top
    if len(tokens) and bad.any():
        j = int(np.argmax(bad))
        i = int(np.searchsorted(offsets, j, side="right") - 1)
        limit = f"[0, {vocab_size})" if vocab_size is not None else "[0, 2^31) (token ids are int32)"
        raise InvalidInputError(
            f"{field}[{i}][{j - offsets[i]}]", f"token id {int(tokens[j])} is outside {limit}"
        )
