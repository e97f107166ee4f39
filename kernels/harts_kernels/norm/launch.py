"""How the norm kernels of this package are launched: a rule that never looks at the row count.

Contract: :func:`launch_config` ``(D, dtype)`` gives every compile-time choice of a launch (the
block's columns ``BD`` and rows ``BT``, ``num_warps``); it takes no row count, so one compiled
variant per (D, dtype, flags) serves every microbatch. The row count ``T`` reaches the kernels only
as a runtime argument that Triton does not specialize (``do_not_specialize=["T"]``), and through
the grid: ``cdiv(T, BT)`` programs of one block each (forwards, :func:`l2norm`'s backward), or
:func:`backward_programs` programs that loop over the row blocks with a runtime stride (the
backwards that reduce ``dweight`` into one partial row per program).

Why: fla's norm kernels put the row count into their compile keys (``NB = cdiv(T, 2048)`` or
``cdiv(T, 65536)`` as a ``tl.constexpr`` and autotune key, or the rows per program ``BS`` as a
constexpr), so a microbatch with a never-seen row count compiles them again: five kernels, most
of a never-seen step's first-pass overhead.

Against fla's functions (bf16, forward and backward, device time per call, PROGRAMS_PER_SM = 4)
these launches are at most 5% slower at the head dims (D = 128) and the hidden width (D = 2,304),
RMSNorm and the gated norm faster at D = 2,304; a never-seen row count costs no compile, where
fla's RMSNorm compiles again (with autotuning at D = 128). The numbers are in benchmarks/README.md,
"Numbers behind the source's design notes".

Besides the constexprs, Triton specializes a launch on its pointers' 16-byte alignment (as for every
kernel); the operators pass rows of fresh or contiguous tensors, whose alignment does not change.

Importing this module needs only torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Elements of one [BT, BD] block held in registers: rows per block are TILE // BD (at most
# MAX_ROWS, at least 1), so a block is about 16 float32 values per thread at TILE // 512 warps.
TILE = 4096
MAX_ROWS = 64
ELEMENTS_PER_WARP = 512
MAX_WARPS = 16
# Programs per SM of the looping backwards (more programs in flight than one per SM hides memory
# latency; each writes one partial dweight row of D float32).
PROGRAMS_PER_SM = 4
# fla's limit: a row of at most 64 KB
MAX_ROW_BYTES = 65536


@dataclass(frozen=True)
class LaunchConfig:
    """The compile-time parameters of a launch: ``BD`` columns (the next power of two of D),
    ``BT`` rows per block, ``num_warps``."""

    BD: int
    BT: int
    num_warps: int


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def launch_config(D: int, dtype: torch.dtype) -> LaunchConfig:
    """The launch parameters for rows of ``D`` elements of ``dtype`` (module docstring). Raises
    ``ValueError`` for a row over 64 KB (fla's limit)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if D < 1 or D * itemsize > MAX_ROW_BYTES:
        raise ValueError(
            f"norm kernels: feature dim {D} of {dtype} is not in [1, {MAX_ROW_BYTES // itemsize}]"
        )
    bd = _next_power_of_2(D)
    bt = max(1, min(MAX_ROWS, TILE // bd))
    return LaunchConfig(BD=bd, BT=bt, num_warps=max(1, min(MAX_WARPS, bt * bd // ELEMENTS_PER_WARP)))


def row_blocks(T: int, cfg: LaunchConfig) -> int:
    """Blocks of ``cfg.BT`` rows covering ``T`` rows: the grid of the one-block-per-program kernels."""
    return -(-T // cfg.BT)


def backward_programs(T: int, cfg: LaunchConfig, sms: int) -> int:
    """Programs of a looping backward: ``PROGRAMS_PER_SM`` per SM, never more than the row blocks
    (so none is idle); only the grid, not a compile parameter."""
    return max(1, min(PROGRAMS_PER_SM * sms, row_blocks(T, cfg)))


def sm_count(device: torch.device) -> int:
    """The SM count of a CUDA device; 2 elsewhere (the Triton interpreter: few programs, so the
    backwards' loops take several blocks)."""
    if device.type != "cuda":
        return 2
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` [..., D] as contiguous rows [T, D] (a view when it can be)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.is_contiguous() else t2.contiguous()
