"""`harts-planner`: command-line entry point (``harts_planner.cli:main``; ``python -m harts_planner.cli``).

:func:`main` parses the command line (:func:`~harts_planner.commands.parser.build_parser`) and
:func:`run` runs the command, turning every failure into one line on stderr and an exit code. The
subcommands (demo, synth, plan, serve, bench, show) live in :mod:`harts_planner.commands`, one module
per group.
"""

from __future__ import annotations

import argparse
import os
import sys

from harts_planner.commands.parser import build_parser


def _fail(message: str, code: int) -> int:
    """One line on stderr, then the exit code."""
    text = " ".join(str(message).split()) or "unknown error"
    print(f"harts-planner: error: {text}", file=sys.stderr)
    return code


def _os_error(e: OSError) -> str:
    where = f"{e.filename!r}: " if getattr(e, "filename", None) else ""
    return f"{where}{e.strerror or e}"


def _stdout_gone() -> int:
    """The reader of our stdout went away (``plan --json | head``): stop quietly, as a killed
    ``yes | head`` does (exit 128 + SIGPIPE), without Python's 'Exception ignored' at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 128 + 13


def run(args: argparse.Namespace) -> int:
    """Run a parsed command; every failure becomes one line on stderr and a non-zero exit code:
    2 for bad input (any ValueError: HartsError, BatchFormatError, ...), 1 for everything else
    (a file that cannot be read or written, an unreachable sidecar, a server that cannot bind, and,
    set HARTS_TRACEBACK=1 to see where, an internal error), 130 for Ctrl-C."""
    from harts_planner.rpc.client import SidecarError

    try:
        code = args.func(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _stdout_gone()
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except SidecarError as e:  # before OSError: SidecarUnavailableError is a ConnectionError
        return _fail(str(e), 1)
    except RecursionError as e:  # deeply nested input: a ValueError in spirit, a RuntimeError in type
        return _fail(f"input nested too deeply ({e})", 2)
    except ValueError as e:  # HartsError and friends: the message names the field
        return _fail(str(e), 2)
    except OSError as e:
        return _fail(_os_error(e), 1)
    except MemoryError:
        return _fail("out of memory", 1)
    except RuntimeError as e:  # a sidecar that cannot bind or start
        return _fail(str(e), 1)
    except Exception as e:
        if os.environ.get("HARTS_TRACEBACK"):
            raise
        return _fail(f"internal error: {type(e).__name__}: {e} (set HARTS_TRACEBACK=1 for the traceback)", 1)


def main(argv: list[str] | None = None) -> int:
    """The ``harts-planner`` entry point: the exit code (0 for ``--help``, 2 for a usage error,
    already printed as one line; else :func:`run`'s)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["build_parser", "main", "run"]
