"""``harts-train``'s entry point (:func:`main`): resolve the settings, run the trainer (or, for
``--mode both``, the two-copy demo), and turn every error into one line on stderr with its exit code.
"""

from __future__ import annotations

import os
import sys
import traceback

from harts_runtime.cli.flags import option_error, option_flag
from harts_runtime.cli.parser import PROG
from harts_runtime.cli.settings import resolve_settings
from harts_runtime.errors import InvalidInputError, UsageError

__all__ = ["main"]


def _fail(message: str, code: int, err=None) -> int:
    err = err or sys.stderr
    text = " ".join(str(message).split()) or "unknown error"
    print(f"{PROG}: error: {text}", file=err)
    err.flush()
    return code


def _rank() -> int:
    """This process's rank (0 when not distributed)."""
    if sys.modules.get("torch") is not None:  # never import torch just to report an error
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return dist.get_rank()
        except ImportError:
            pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _run(argv) -> int:
    args, given, saved = resolve_settings(argv)
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise UsageError(f"{e.name or e} is not installed: pip install '.[runtime]' torch==2.13.0") from None
    try:
        if args.mode == "both":
            from harts_runtime.cli.demo import run_demo

            return run_demo(args, given)
        from harts_runtime.trainer import train

        return train(args, given, saved)
    except InvalidInputError as e:
        if option_flag(e):  # an option's own check: said as its flag (or config file key)
            raise option_error(e, given) from e
        raise


def main(argv=None) -> int:
    """The ``harts-train`` entry point; returns the exit code: 0, 2 for bad input (a flag, the
    config file, the rollout file, a checkpoint), 1 for any other failure, 130 on Ctrl-C; every
    error is one line on stderr (``HARTS_TRACEBACK=1``: the traceback first)."""
    try:
        return _run(argv)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except BrokenPipeError:  # `harts-train ... | head`
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes stdout at exit
        except OSError:
            pass
        return 0
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM after a whole step (trainer.job.Stopped)
        return _fail(str(e) or "interrupted", 130)
    except Exception as e:
        code = 2 if isinstance(e, ValueError) else 1  # UsageError, InvalidInputError: bad input
        if os.environ.get("HARTS_TRACEBACK"):
            traceback.print_exc()
        rank = _rank()
        if rank and code == 2:
            return code  # every rank reads the same inputs: rank 0 says it once
        msg = str(e) if code == 2 else f"{type(e).__name__}: {e}"
        if code == 1 and not os.environ.get("HARTS_TRACEBACK"):
            msg += " (set HARTS_TRACEBACK=1 for the traceback)"
        if rank:
            msg = f"rank {rank}: {msg}"
        return _fail(msg, code)
