"""The runtime's one error class.

Every bad input the runtime rejects (step inputs, model and layer configurations, plans, parallel
degrees) raises :class:`InvalidInputError`, a ``ValueError`` whose ``.field`` names the offending
field (``"advantages"``, ``"mixers[1]"``, ``"call_plan.chunk_size"``, ``"tp"``) and whose message reads
``"<field>: <what is wrong, with the limit>"``. Three aliases of it name the area an error comes
from: :data:`StepInputsError` (step inputs and train-step arguments),
:data:`ConfigError` (model configuration) and :data:`ParallelConfigError` (parallel configuration).
:class:`UsageError`, its subclass, is a bad command-line flag or config file of ``harts-train``: its
message is the whole line and names the flag itself.
"""

from __future__ import annotations

__all__ = ["ConfigError", "InvalidInputError", "ParallelConfigError", "StepInputsError", "UsageError"]


class InvalidInputError(ValueError):
    """A bad runtime input; ``.field`` names the offending field, the message says the limit."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class UsageError(InvalidInputError):
    """A bad ``harts-train`` flag, flag combination or config file: one line (``--keep: needs
    --recompute ...``), exit code 2. The message is used as given; ``.field`` is the flag it names
    (``"--keep"``), or ``""``."""

    def __init__(self, message: str, field: str = ""):
        ValueError.__init__(self, message)
        self.field = field


StepInputsError = InvalidInputError
"""Alias: bad step inputs or train-step arguments."""
ConfigError = InvalidInputError
"""Alias: a bad model configuration."""
ParallelConfigError = InvalidInputError
"""Alias: an invalid parallel configuration."""
