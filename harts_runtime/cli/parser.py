"""The ``harts-train`` argument parser (:func:`build_parser`): the job's own flags (data,
checkpoints, output) declared here, the model, execution, objective, optimizer and parallelism flags
generated from the settings tree (:mod:`harts_runtime.job_config`, by
:mod:`harts_runtime.cli.flags`). Errors are one line; ``--help`` shows every flag's default. No
torch here.
"""

from __future__ import annotations

import argparse

from harts_runtime.cli.flags import COMMAND_GROUPS, add_group_flags, float_type, int_type
from harts_runtime.errors import UsageError

__all__ = ["DESCRIPTION", "EPILOG", "PROG", "Formatter", "Parser", "build_parser"]

PROG = "harts-train"
DESCRIPTION = "train a hybrid-attention model on rollout files (or on a synthetic step)."


class Parser(argparse.ArgumentParser):
    """Errors are one line (``harts-train: error: MESSAGE (see harts-train --help)``), raised as
    :class:`UsageError` so that :func:`~harts_runtime.cli.main` reports them like every other
    error."""

    def error(self, message: str):  # noqa: D102 (argparse API)
        raise UsageError(f"{message} (see {self.prog} --help)")


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Help with every flag's default: ``(default: X)`` unless the text already says it (``none``
    for an unset value, ``off`` for a switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return text + " (default: off)"
        if action.default is None or action.default == "":
            return text + " (default: none)"
        return text + " (default: %(default)s)"


EPILOG = """\
examples:
  harts-train --data rollouts.jsonl --flavor debug --steps 20 --save ckpt --metrics m.jsonl
  harts-train --config run.toml --lr 2e-6                     # flags override the file
  harts-train --resume ckpt                                   # the latest ckpt/step-N, same settings
  torchrun --nproc-per-node 4 -m harts_runtime.cli --model PATH --data r.parquet --tp 2 --sp
  harts-train --preset small --steps 3                        # a synthetic step (no --data)

config file keys are the long flag names (with _ or -), e.g. in TOML:
  data = "rollouts.parquet"
  model = "ckpt/Kimi-Linear"
  lr = 1e-6
  lr_schedule = "cosine"
  keep = ["attention"]
  save = "ckpt"

rollout file (one trajectory per JSONL line or Parquet row; docs/rollout-format.md):
  tokens (ids), advantages (per token or one number), loss_mask, old_logprobs,
  optional ref_logprobs, group_id, step (rows of one step value train together)
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``harts-train`` parser (no torch needed)."""
    ap = Parser(prog=PROG, description=DESCRIPTION, formatter_class=Formatter, epilog=EPILOG)
    ap.add_argument(
        "--config", metavar="FILE", help="settings file (.toml, .yaml/.yml or .json) keyed by flag name"
    )
    _data_flags(ap.add_argument_group("data"))
    for group in COMMAND_GROUPS[PROG]:
        add_group_flags(ap, PROG, group)
    _checkpoint_flags(ap.add_argument_group("checkpoints"))
    _output_flags(ap.add_argument_group("output"))
    return ap


def _data_flags(g) -> None:
    g.add_argument(
        "--data",
        metavar="FILE",
        help="rollout file: .jsonl (one trajectory per line) or .parquet (one per row); "
        "default: none, train on the synthetic --preset step",
    )
    g.add_argument(
        "--steps",
        metavar="N",
        type=int_type(0),
        default=None,
        help="train until this many steps are done (a total: a resumed run continues to it); "
        "default: one pass over --data's steps (continuing a resumed run's total when --data is the "
        "same file, one more pass when it is a new one); 3 on the synthetic step",
    )
    g.add_argument(
        "--preset",
        metavar="NAME",
        default="small",
        help="synthetic step: harts_planner.synth preset (tiny, small, medium, swe-like)",
    )
    g.add_argument(
        "--max-len",
        metavar="L",
        type=int_type(1),
        default=None,
        help="synthetic step: cap trajectory length (default: 1024 on CPU, the preset's on CUDA)",
    )
    g.add_argument(
        "--seed",
        metavar="N",
        type=int_type(0),
        default=0,
        help="model initialisation (flavors) and synthetic step",
    )


def _checkpoint_flags(g) -> None:
    g.add_argument(
        "--save",
        metavar="DIR",
        default=None,
        help="save DIR/step-N (model, optimizer, schedule, RNG, data position) every --save-every steps "
        "and at the end; each checkpoint is written whole or not at all (staged beside it, renamed "
        "into place; SHA-256 checksums verified on --resume). A resumed run without --save saves "
        "beside the checkpoint it resumed from (copy/step-2 goes on to copy/step-3)",
    )
    g.add_argument(
        "--save-every",
        metavar="N",
        type=int_type(0),
        default=0,
        help="steps between saves (0: only at the end)",
    )
    g.add_argument(
        "--keep-last",
        metavar="K",
        type=int_type(0),
        default=0,
        help="keep the K newest DIR/step-N checkpoints, removing older ones after each save (0: all)",
    )
    g.add_argument(
        "--resume",
        metavar="PATH",
        default=None,
        help="continue from a checkpoint folder, or the latest DIR/step-N of a --save DIR: its weights, "
        "optimizer, step counter, schedule and data position, and its settings unless given again "
        "(its --save, --metrics, --tensorboard and --export only when the checkpoint is still in its "
        "run's --save DIR; a copied checkpoint saves beside itself)",
    )
    g.add_argument(
        "--fallback",
        action="store_true",
        help="with --resume DIR: a newest step-N that does not verify (damaged, unreadable) is skipped, "
        "said, for the newest one that does",
    )
    g.add_argument(
        "--export",
        metavar="DIR",
        default=None,
        help="at the end, write a transformers checkpoint folder (save_pretrained)",
    )


def _output_flags(g) -> None:
    g.add_argument(
        "--json", action="store_true", help="print one JSON object per step on stdout instead of a text line"
    )
    g.add_argument(
        "--metrics",
        metavar="FILE",
        default=None,
        help="append one JSON object per step to FILE (a resumed run drops records past its step)",
    )
    g.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="TensorBoard event files in DIR (needs tensorboard: pip install 'harts[train]')",
    )
    g.add_argument(
        "--progress",
        choices=("auto", "bar", "lines", "off"),
        default="auto",
        help="progress on stderr: auto = a tqdm bar on a terminal, plain lines otherwise (logs)",
    )
    g.add_argument(
        "--progress-every",
        metavar="SECONDS",
        type=float_type(lo=0.0),
        default=30.0,
        help="seconds between plain progress lines",
    )
