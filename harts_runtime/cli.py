"""``harts-train``: train a hybrid-attention model on rollout files (or on a synthetic step).

``harts-train --data FILE`` trains on a rollout file (JSONL or Parquet, one trajectory per line /
row; the schema is :mod:`harts_runtime.rollout_files` and ``docs/rollout-format.md``) through
:class:`harts_runtime.engine.HartsEngine`: optimizer steps with the learning-rate schedule and
gradient clipping, checkpoints (``--save`` / ``--resume``), metrics on stdout, in a JSON-lines file
and in TensorBoard, a progress bar, and, under ``torchrun``, the engine sharded over a device mesh
built from ``--tp`` / ``--ep`` / ``--dp-replicate`` / ``--sp``. Without ``--data`` it trains on a
synthetic step (``--preset``), as it always did; ``--mode both`` is
:func:`harts_runtime.demo.train_demo` (two model copies, compact and trajectory-wise).

A config file (``--config FILE``: TOML, YAML or JSON) holds the same settings under the flags' long
names (``max_grad_norm = 0.5`` or ``max-grad-norm: 0.5``); flags given on the command line override
it, and on ``--resume`` both override the settings saved with the checkpoint.

Every error, from a bad flag to a bad value on line 7 of the rollout file, is one line on stderr
(``harts-train: error: ...``) and exit code 2 (1 for a failure that is not bad input);
``HARTS_TRACEBACK=1`` prints the traceback too. ``--help`` works without torch. Run it as
``harts-train``, ``python -m harts_runtime.cli``, or under ``torchrun --nproc-per-node N -m
harts_runtime.cli``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import traceback
from pathlib import Path

__all__ = ["build_parser", "load_config", "main"]

PROG = "harts-train"
MODES = ("compact", "trajectory")  # harts_runtime.layout.rows.MODES, without importing torch for --help
NOT_CONFIG = ("config", "help")
"""Flags a config file cannot set."""
NOT_INHERITED = ("config", "resume", "steps")
"""Settings a resumed run does not take from the checkpoint (``steps``: the trainer decides)."""
TRAINER_ONLY = (
    "data",
    "save",
    "save_every",
    "resume",
    "export",
    "metrics",
    "tensorboard",
    "tp",
    "ep",
    "dp_replicate",
    "sp",
)
"""Settings of the engine trainer that ``--mode both`` (the two-copy demo) does not take."""


class UsageError(ValueError):
    """A bad flag, flag combination or config file: one line, exit code 2."""


# ---------------------------------------------------------------------------------- flag types
def _int(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


def _float(lo: float | None = None, hi: float | None = None, positive: bool = False):
    import math

    def parse(text: str) -> float:
        try:
            v = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        if positive and v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
        if lo is not None and v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi}, got {v}")
        return v

    parse.__name__ = "float"
    return parse


class _Parser(argparse.ArgumentParser):
    """Errors are one line (``harts-train: error: MESSAGE (see harts-train --help)``), raised as
    :class:`UsageError` so that :func:`main` reports them like every other error."""

    def error(self, message: str):  # noqa: D102 (argparse API)
        raise UsageError(f"{message} (see {self.prog} --help)")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help with every flag's default: ``(default: X)`` unless the text already says it (``none``
    for an unset value, ``off`` for a switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return text + " (default: off)"
        return text + (" (default: none)" if action.default is None else " (default: %(default)s)")


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
    ap = _Parser(
        prog=PROG,
        description=__doc__.split("\n")[0].split(": ", 1)[1],
        formatter_class=_Formatter,
        epilog=EPILOG,
    )
    ap.add_argument(
        "--config", metavar="FILE", help="settings file (.toml, .yaml/.yml or .json) keyed by flag name"
    )

    g = ap.add_argument_group("data")
    g.add_argument(
        "--data",
        metavar="FILE",
        help="rollout file: .jsonl (one trajectory per line) or .parquet (one per row); "
        "default: none, train on the synthetic --preset step",
    )
    g.add_argument(
        "--steps",
        metavar="N",
        type=_int(0),
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
        type=_int(1),
        default=None,
        help="synthetic step: cap trajectory length (default: 1024 on CPU, the preset's on CUDA)",
    )
    g.add_argument(
        "--seed",
        metavar="N",
        type=_int(0),
        default=0,
        help="model initialisation (flavors) and synthetic step",
    )

    g = ap.add_argument_group("model")
    g.add_argument(
        "--flavor",
        metavar="NAME",
        default=None,
        help="model flavor with random weights: debug, ling-tiny or qwen3.5-35b-a3b (default: debug on CPU, ling-tiny on CUDA)",
    )
    g.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="a transformers checkpoint folder (Kimi-Linear, Qwen3-Next, Qwen3.5-MoE) instead of a flavor",
    )
    g.add_argument(
        "--layers",
        metavar="N",
        type=_int(1),
        default=None,
        help="keep the first N layers of the flavor's pattern (default: all)",
    )
    g.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="weight dtype (default: the flavor's; a checkpoint's config.json dtype)",
    )
    g.add_argument(
        "--device",
        metavar="DEVICE",
        default=None,
        help="cpu or cuda[:i] (default: cuda when available; under torchrun cuda:LOCAL_RANK)",
    )
    g.add_argument(
        "--capacity",
        metavar="T",
        type=_int(1),
        default=None,
        help="T: compact rows per microbatch (default: 4096 on CPU, 65536 on CUDA)",
    )
    g.add_argument(
        "--microbatch-cost",
        metavar="TOKENS",
        type=_int(0),
        default=0,
        help="the planner's fixed cost of a microbatch in compact tokens, at most T (default 0: the paper's "
        "selection; benchmarks/train_eval.py's microbatches section fits it for a model and GPU)",
    )
    g.add_argument(
        "--mode",
        choices=MODES + ("both",),
        default="compact",
        help="compact (HARTS), trajectory (the trajectory-wise baseline) or both (the synthetic two-copy comparison)",
    )
    g.add_argument("--recompute", action="store_true", help="full-block activation recomputation")
    g.add_argument(
        "--keep",
        default="",
        metavar="REGIONS",
        help="with --recompute: op regions whose activations are kept instead of recomputed "
        "(comma-separated; 'attention': the attention cores, a third of their cost, ~1.4 GB per MLA layer "
        "of a 65,536-row ling-tiny microbatch; 'linear_attention': the KDA / Gated DeltaNet rounds, "
        "~1.9 GB per KDA layer there); default: none",
    )

    g = ap.add_argument_group("objective and optimizer (AdamW)")
    g.add_argument("--objective", choices=("grpo", "ppo"), default="grpo", help="built-in policy loss")
    g.add_argument(
        "--lr",
        type=_float(positive=True),
        default=None,
        help="peak learning rate (default: 1e-6 with --model, 1e-3 for a flavor's random weights)",
    )
    g.add_argument("--weight-decay", type=_float(lo=0.0), default=0.0, help="AdamW weight decay")
    g.add_argument(
        "--warmup-steps",
        metavar="N",
        type=_int(0),
        default=0,
        help="linear warm-up from 0 to --lr over this many optimizer steps",
    )
    g.add_argument(
        "--lr-schedule", choices=("constant", "linear", "cosine"), default="constant", help="after warm-up"
    )
    g.add_argument(
        "--total-steps",
        metavar="N",
        type=_int(1),
        default=None,
        help="where linear / cosine decay ends (default: --steps)",
    )
    g.add_argument(
        "--min-lr-ratio", type=_float(0.0, 1.0), default=0.0, help="decay floor as a fraction of --lr"
    )
    g.add_argument(
        "--max-grad-norm",
        type=_float(lo=0.0),
        default=1.0,
        help="clip the global gradient norm (0: no clipping)",
    )
    g.add_argument(
        "--clip-ratio-low", type=_float(lo=0.0), default=None, help="ratio >= 1 - this (default: 0.2)"
    )
    g.add_argument(
        "--clip-ratio-high",
        type=_float(lo=0.0),
        default=None,
        help="ratio <= 1 + this (default: --clip-ratio-low)",
    )
    g.add_argument(
        "--clip-ratio-c",
        type=_float(lo=1.0),
        default=None,
        help="dual-clip bound for negative advantages (default: off for grpo, 3 for ppo)",
    )
    g.add_argument(
        "--kl-coef",
        type=_float(lo=0.0),
        default=None,
        help="KL-to-reference penalty weight, needs ref_logprobs (default: 0.001 for grpo, 0 for ppo)",
    )
    g.add_argument(
        "--kl-estimator", choices=("k1", "k2", "k3"), default=None, help="KL estimator (default: k3)"
    )
    g.add_argument(
        "--loss-agg-mode",
        choices=("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
        default=None,
        help="loss aggregation (default: seq-mean-token-mean for grpo, token-mean for ppo)",
    )
    g.add_argument(
        "--loss-norm",
        type=_float(positive=True),
        default=None,
        help="constant of seq-mean-token-sum-norm (default: none)",
    )

    g = ap.add_argument_group("parallelism (under torchrun; dp_shard = world / (dp_replicate * tp))")
    g.add_argument("--tp", metavar="N", type=_int(1), default=1, help="tensor-parallel degree")
    g.add_argument(
        "--ep", metavar="N", type=_int(1), default=1, help="expert-parallel degree (divides dp_shard)"
    )
    g.add_argument("--dp-replicate", metavar="N", type=_int(1), default=1, help="HSDP replica groups")
    g.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    g.add_argument(
        "--param-dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="FSDP2 compute dtype (default: the weights')",
    )
    g.add_argument(
        "--reduce-dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="FSDP2 gradient reduction dtype (default: --param-dtype's)",
    )
    g.add_argument(
        "--cpu-offload",
        action="store_true",
        help="FSDP2 CPU offload of weights, gradients and optimizer state",
    )

    g = ap.add_argument_group("checkpoints")
    g.add_argument(
        "--save",
        metavar="DIR",
        default=None,
        help="save DIR/step-N (model, optimizer, schedule, RNG, data position) every --save-every steps and at the end",
    )
    g.add_argument(
        "--save-every", metavar="N", type=_int(0), default=0, help="steps between saves (0: only at the end)"
    )
    g.add_argument(
        "--resume",
        metavar="PATH",
        default=None,
        help="continue from a checkpoint folder, or the latest DIR/step-N of a --save DIR: its weights, "
        "optimizer, step counter, schedule and data position, and its settings unless given again",
    )
    g.add_argument(
        "--export",
        metavar="DIR",
        default=None,
        help="at the end, write a transformers checkpoint folder (save_pretrained)",
    )

    g = ap.add_argument_group("output")
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
        type=_float(lo=0.0),
        default=30.0,
        help="seconds between plain progress lines",
    )
    return ap


# ---------------------------------------------------------------------------------- config files
def load_config(path, parser: argparse.ArgumentParser | None = None) -> dict:
    """The settings of a config file (``.toml``, ``.yaml`` / ``.yml`` or ``.json``: a flat table of
    flag long names, ``-`` or ``_``), each checked and converted as its flag would be; raises
    :class:`UsageError` naming the file and key."""
    parser = parser or build_parser()
    p = Path(path)
    where = str(path)
    if not p.is_file():
        raise UsageError(f"--config: {where!r}: {'is a directory' if p.is_dir() else 'no such file'}")
    ext = p.suffix.lower()
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise UsageError(f"--config: {where!r}: {e.strerror or e}") from None
    try:
        if ext == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                try:
                    import tomli as tomllib
                except ImportError:
                    raise UsageError(
                        "--config: reading TOML on Python 3.10 needs tomli: pip install 'harts[train]'"
                    ) from None
            data = tomllib.loads(raw.decode("utf-8"))
        elif ext in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise UsageError("--config: reading YAML needs pyyaml: pip install 'harts[train]'") from None
            data = yaml.safe_load(raw.decode("utf-8"))
        elif ext == ".json":
            data = json.loads(raw.decode("utf-8"))
        else:
            raise UsageError(
                f"--config: {where!r}: unknown config type {ext or '(none)'!r}; expected .toml, .yaml, .yml or .json"
            )
    except UsageError:
        raise
    except UnicodeDecodeError as e:
        raise UsageError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except Exception as e:  # tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError
        msg = " ".join(str(e).split())
        raise UsageError(f"{where}: not valid {ext[1:].upper()}: {msg}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(
            f"{where}: expected a table of settings keyed by flag name, got {type(data).__name__}"
        )
    actions = {a.dest: a for a in parser._actions if a.dest not in NOT_CONFIG and a.option_strings}
    out = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in actions:
            close = difflib.get_close_matches(dest, list(actions), n=1)
            hint = (
                f"; did you mean {close[0]!r}?"
                if close
                else "; keys are the long flag names (see harts-train --help)"
            )
            raise UsageError(f"{where}: {key}: unknown key{hint}")
        out[dest] = _config_value(actions[dest], value, f"{where}: {key}")
    return out


def _config_value(action: argparse.Action, value, where: str):
    if value is None:
        return action.default
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise UsageError(f"{where}: expected true or false, got {value!r}")
        return value
    if action.dest == "keep" and isinstance(value, list):
        if not all(isinstance(v, str) for v in value):
            raise UsageError(f"{where}: expected a list of region names, got {value!r}")
        value = ",".join(value)
    if isinstance(value, (list, dict)):
        raise UsageError(f"{where}: expected a single value, got {type(value).__name__}")
    if isinstance(value, bool):
        raise UsageError(f"{where}: expected a {getattr(action.type, '__name__', 'string')}, got {value!r}")
    if action.type is not None:
        try:
            value = action.type(str(value))
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"{where}: {e}") from None
    else:
        value = str(value)
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise UsageError(f"{where}: invalid choice {value!r} (choose from {choices})")
    return value


# ---------------------------------------------------------------------------------- settings
def resolve_settings(argv) -> tuple[argparse.Namespace, set, dict | None]:
    """``(settings, given, saved)``: the flag defaults, overridden by a resumed checkpoint's saved
    settings, then by ``--config``, then by the command line; ``given`` names the settings set by the
    config file or the command line; ``saved`` is the resumed checkpoint's ``trainer.json`` record
    (or None)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    explicit = build_parser()
    for a in explicit._actions:
        a.default = argparse.SUPPRESS
    given_cli = vars(explicit.parse_args(argv))
    config = load_config(args.config, parser) if args.config else {}
    resume = given_cli.get("resume", config.get("resume"))
    saved = None
    settings = {a.dest: a.default for a in parser._actions if a.dest != "help"}
    if resume:
        from harts_runtime.trainer_state import read_trainer_state, resolve_checkpoint

        folder = resolve_checkpoint(resume)
        saved = read_trainer_state(folder)
        saved["folder"] = str(folder)
        for k, v in saved.get("args", {}).items():
            if k in settings and k not in NOT_INHERITED:
                settings[k] = v
    settings.update(config)
    settings.update(given_cli)
    settings["resume"] = resume
    return argparse.Namespace(**settings), set(config) | set(given_cli), saved


# ---------------------------------------------------------------------------------- main
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
    if args.mode == "both":
        return _run_demo(args, given)
    from harts_runtime.trainer import train

    return train(args, given, saved)


def _run_demo(args, given) -> int:
    """``--mode both``: compact and trajectory-wise copies of one model on the synthetic step."""
    import torch

    from harts_runtime.demo import train_demo, train_modes
    from harts_runtime.ops.keep import checked_keep

    bad = [k for k in TRAINER_ONLY if k in given and getattr(args, k) not in (None, False, 0, 1)]
    if bad:
        flag = "--" + bad[0].replace("_", "-")
        raise UsageError(
            f"{flag}: --mode both compares two model copies on the synthetic step; it takes no {flag}"
        )
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device: not a device: {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device: {device} requested but CUDA is not available here")
    keep = tuple(k for k in args.keep.split(",") if k)
    if keep and not args.recompute:
        raise UsageError("--keep: needs --recompute (it names what recomputation keeps)")
    checked_keep(keep)
    if args.model is not None and (args.flavor is not None or args.layers is not None):
        raise UsageError("--model: a checkpoint folder replaces --flavor and --layers; give one")
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"--model: {args.model!r} is not a checkpoint folder (no config.json)")
    cpu = dev.type == "cpu"
    opts = dict(
        model_path=args.model,
        flavor=args.flavor,
        layers=args.layers,
        capacity=args.capacity,
        recompute=args.recompute,
        keep=keep,
        objective=args.objective,
        lr=args.lr if args.lr is not None else (1e-6 if args.model else 1e-3),
    )
    max_len = args.max_len if args.max_len is not None else (1024 if cpu else None)
    steps = 3 if args.steps is None else args.steps
    if args.json:
        train_modes(
            MODES,
            preset=args.preset,
            steps=steps,
            seed=args.seed,
            max_len=max_len,
            device=device,
            json_lines=True,
            out=None,
            **opts,
        )
    else:
        train_demo(args.preset, steps, args.seed, max_len, device, **opts)
    return 0


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
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
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


if __name__ == "__main__":
    sys.exit(main())
