"""Triton autotuning switch for short GPU leases.

A cold machine autotunes every Triton kernel on first use (fla's KDA stages and our state scan:
minutes at T = 65,536). Correctness runs, and comparisons in which both
sides use the same kernels, can skip that: :func:`use_first_config_only` makes every autotuner
created afterwards keep only its first candidate, so nothing is benchmarked and one variant per
kernel is compiled. Call it before the first GPU call (fla and our kernels are decorated when
their modules are imported, which ``harts_kernels.kda`` does lazily on that call).
"""

from __future__ import annotations

_patched = False


def use_first_config_only() -> None:
    """Every ``triton.autotune`` created from now on (ours and fla's) compiles its first config
    only. Idempotent; it cannot be undone within the process."""
    global _patched
    if _patched:
        return
    from triton.runtime.autotuner import Autotuner

    init = Autotuner.__init__

    def first_config_only(self, fn, arg_names, configs, *args, **kw):
        init(self, fn, arg_names, list(configs)[:1], *args, **kw)

    Autotuner.__init__ = first_config_only
    _patched = True
