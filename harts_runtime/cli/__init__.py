"""``harts-train``: train a hybrid-attention model on rollout files (or on a synthetic step).

``harts-train --data FILE`` trains on a rollout file (JSONL or Parquet, one trajectory per line /
row; the schema is :mod:`harts_runtime.rollout_files` and ``docs/rollout-format.md``) through
:class:`harts_runtime.engine.HartsEngine`: optimizer steps with the learning-rate schedule and
gradient clipping, checkpoints (``--save`` / ``--resume``), metrics on stdout, in a JSON-lines file
and in TensorBoard, a progress bar, and, under ``torchrun``, the engine sharded over a device mesh
built from ``--tp`` / ``--ep`` / ``--dp-replicate`` / ``--sp``. Without ``--data`` it trains on a
synthetic step (``--preset``); ``--mode both`` trains two model copies, compact and trajectory-wise,
through the same job loop (:mod:`harts_runtime.cli.demo`). ``harts-rl`` (:mod:`harts_runtime.cli.rl`)
is the second command of this CLI, on the same settings tree.

The model, execution, objective, optimizer and parallel flags (``--flavor``, ``--chunk-size``,
``--capacity``, ``--keep``, ``--kl-coef``, ``--lr``, ``--cp``, ...) are generated from the settings
tree (:mod:`harts_runtime.job_config`), whose groups read each declaration once. A config file
(``--config FILE``: TOML, YAML or JSON) holds the same settings under the flags' long names
(``max_grad_norm = 0.5`` or ``max-grad-norm: 0.5``); flags given on the command line override it, and
on ``--resume`` both override the settings saved with the checkpoint.

Every error, from a bad flag to a bad value on line 7 of the rollout file, is one line on stderr
(``harts-train: error: ...``) and exit code 2 (1 for a failure that is not bad input);
``HARTS_TRACEBACK=1`` prints the traceback too. ``--help`` works without torch. Run it as
``harts-train``, ``python -m harts_runtime.cli``, or under ``torchrun --nproc-per-node N -m
harts_runtime.cli``.

One job per module:

================================  ====================================================================
:mod:`harts_runtime.cli.flags`    the flags generated from the settings tree; a setting's error
                                  said as its flag (:func:`option_error`)
:mod:`harts_runtime.cli.parser`   the parser (:func:`build_parser`): the other flags, help, one-line
                                  errors
:mod:`harts_runtime.cli.settings` config files (:func:`load_config`) and :func:`resolve_settings`
                                  (flags over a config file over a resumed checkpoint's settings)
:mod:`harts_runtime.cli.main`     :func:`main`: run, and every error as one line with its exit code
:mod:`harts_runtime.cli.demo`     ``--mode both``: the two-copy comparison
:mod:`harts_runtime.cli.rl`       ``harts-rl``: an RL run (the online source) through the same loop
================================  ====================================================================

The trainer itself is :mod:`harts_runtime.trainer` (it never imports this package).
"""

from harts_runtime.cli.main import main
from harts_runtime.cli.parser import build_parser
from harts_runtime.cli.settings import load_config, resolve_settings
from harts_runtime.errors import UsageError

__all__ = ["UsageError", "build_parser", "load_config", "main", "resolve_settings"]
