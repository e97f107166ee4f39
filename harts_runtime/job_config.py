"""A training job's settings, one tree (:class:`JobConfig`): ``model``, ``parallel``, ``execution``,
``optimizer``, ``loss`` and ``rl``, each group read from the one place it is declared, and the
defaults that depend on the device and the data source decided once (:meth:`JobConfig.resolve`).

=============  ====================================================================================
group          declared by
=============  ====================================================================================
``model``      :class:`ModelOptions` (below): the flavor or checkpoint folder, layers, dtype,
               ``chunk_size``, device
``parallel``   :class:`harts_runtime.parallel.dims.ParallelDims`: the degrees a job sets (``tp``,
               ``cp``, ``ep``, ``dp_replicate``, ``sequence_parallel``; ``dp_shard`` follows from
               the world size)
``execution``  :class:`harts_runtime.options.ExecutionOptions`
``optimizer``  :class:`harts_runtime.options.OptimizerOptions`
``loss``       ``objective`` and :class:`harts_runtime.loss.objectives.PolicyLossConfig` (its
               defaults per objective: :func:`harts_runtime.step_inputs.default_loss_config`)
``rl``         :class:`harts_runtime.rl.config.RLConfig` (but the model's and the job's own keys;
               the built-in tasks: :data:`harts_runtime.rl.tasks.TASKS`)
=============  ====================================================================================

Every group is a list of :class:`Setting` (:data:`TREE`): its name, type, default, help, choices
and bounds, taken from the declaration (a field's docstring is its help). The command line of
``harts-train`` and ``harts-rl`` (:mod:`harts_runtime.cli.flags`), their config-file keys
(:mod:`harts_runtime.cli.settings`) and the verl backend's ``harts.*`` fields
(:mod:`harts_runtime.integrations.verl.config`) are generated from it. The declarations that need
torch to import (``ParallelDims``, ``PolicyLossConfig``), and those of the packages above this
module (``RLConfig``), are read from their source text (:func:`ast.parse`: names, annotations,
defaults, docstrings and ``metadata``), so that ``--help`` and every settings check run without
torch and every package of the runtime may read the tree.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from harts_runtime.errors import InvalidInputError
from harts_runtime.options import DEFAULT_CAPACITY, ExecutionOptions, OptimizerOptions

__all__ = [
    "CAPACITY_DEFAULTS",
    "GROUPS",
    "LR_DEFAULTS",
    "JobConfig",
    "ModelOptions",
    "Resolved",
    "Setting",
    "declared_flavors",
    "group_settings",
    "resolve_total_steps",
    "setting",
    "settings",
]

_ROOT = Path(__file__).resolve().parent

GROUPS = ("model", "parallel", "execution", "optimizer", "loss", "rl")

CAPACITY_DEFAULTS = {"cpu": 4096, "cuda": DEFAULT_CAPACITY}
"""``capacity`` when not given, by device type (a CPU runs the reference kernels: short microbatches)."""
LR_DEFAULTS = {"model": 1e-6, "flavor": 1e-3, "online flavor": 1e-2}
"""``lr`` when not given: a checkpoint folder's weights are trained gently; a flavor's random
weights faster (and on an online RL task, whose tiny policies learn in tens of steps, faster still)."""
CHUNK_SIZE_DEFAULT = "the model's (each family's config declares it)"
"""What ``chunk_size`` None means offline (:meth:`JobConfig.resolve`)."""
ONLINE_CHUNK_SIZE_DEFAULT = (
    "chosen for the task's trees: the power of two at most half their shortest segment between "
    "forks, in [8, 64] (32 to 64 on CUDA)"
)
"""What ``chunk_size`` None means for the online source (:func:`harts_runtime.rl.source.tree_chunk_size`)."""
ONLINE_LOSS = {"kl_coef": 0.0, "loss_agg_mode": "token-mean"}
"""The loss an online RL run trains when no loss setting is given: the objective's (GRPO) without a
KL term, token-mean. A ``kl_coef > 0`` gives the run a reference policy: the initial weights, frozen
(:attr:`harts_runtime.rl.source.OnlineSource.reference`; one process only)."""


@cache
def rl_defaults() -> dict:
    """The declared defaults of every :class:`~harts_runtime.rl.config.RLConfig` field (read from
    its source), the job's and the model group's keys among them (``steps``, ``seed``, ``device``)."""
    path = _ROOT / "rl" / "config.py"
    docs = _field_docs(path, "RLConfig", _constants([path]))
    return {name: d[1] for name, d in docs.items()}


# ----------------------------------------------------------------------------- the model group
def _opt(default, help: str, **meta):
    return field(default=default, metadata={"help": help, **meta})


@cache
def declared_flavors(families_only: bool = False) -> tuple[str, ...]:
    """Every flavor name, read from the families' declarations (``FLAVORS`` / ``HYBRID_FLAVORS``
    dicts in ``harts_runtime/models/*/``) without importing them (they need torch);
    ``families_only``: those of a checkpoint family (``FLAVORS``: a transformers model, what an
    online source's rollout engine runs)."""
    names: list[str] = []
    wanted = ("FLAVORS",) if families_only else ("FLAVORS", "HYBRID_FLAVORS")
    for path in sorted((_ROOT / "models").glob("*/*.py")):
        for node in ast.parse(path.read_text()).body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
            if isinstance(target, ast.Name) and target.id in wanted:
                if isinstance(node.value, ast.Dict):
                    names += [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
    return tuple(dict.fromkeys(names))


@dataclass(kw_only=True, frozen=True)
class ModelOptions:
    """What is trained: a flavor with random weights or a transformers checkpoint folder, and where."""

    flavor: str | None = _opt(
        None,
        "a flavor with random weights ({flavors}; default: debug on CPU, ling-tiny on CUDA)",
        metavar="NAME",
    )
    model: str | None = _opt(
        None,
        "a transformers checkpoint folder (Kimi-Linear, Qwen3-Next, Qwen3.5-MoE, ...) instead of a flavor",
        metavar="PATH",
    )
    layers: int | None = _opt(
        None, "keep the first N layers of the flavor's pattern (default: all)", metavar="N", lo=1
    )
    dtype: str | None = _opt(
        None,
        "weight dtype (default: the flavor's; a checkpoint's config.json dtype)",
        choices=("float32", "bfloat16"),
    )
    chunk_size: int | None = _opt(
        None,
        "KDA / Gated DeltaNet / Mamba2 chunk size, a power of two (does not change the math)",
        metavar="C",
        lo=1,
    )
    device: str | None = _opt(
        None,
        "cpu or cuda[:i] (default: cuda when available; under torchrun cuda:LOCAL_RANK)",
        metavar="DEVICE",
    )

    def __post_init__(self):
        c = self.chunk_size
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1 or c & (c - 1)):
            raise InvalidInputError("chunk_size", f"must be a power of two, got {c!r}")


# ----------------------------------------------------------------------------- declarations read
@dataclass(frozen=True)
class Setting:
    """One setting of the tree: ``group``, ``name`` (the declaration's field), ``key`` (its
    command-line dest and config-file key: the name but where a flag always had another spelling,
    ``sp``), ``kind`` (``bool``, ``int``, ``float``, ``str``, ``tuple``, ``dict``), ``default`` (the
    declared one), ``help``, ``choices``, ``metavar``, ``lo`` / ``hi`` bounds the flag checks,
    ``nullable``."""

    group: str
    name: str
    kind: type
    default: object
    help: str
    choices: tuple | None = None
    metavar: str | None = None
    lo: float | None = None
    hi: float | None = None
    positive: bool = False
    nullable: bool = False
    key: str = ""

    def __post_init__(self):
        if not self.key:
            object.__setattr__(self, "key", self.name)

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


def _kind(annotation: str) -> tuple[type, bool]:
    """``(kind, nullable)`` of a type annotation's text (``"float | None"``: float, nullable)."""
    text = str(annotation).replace(" ", "")
    nullable = "|None" in text or "None|" in text
    text = text.replace("|None", "").replace("None|", "")
    kinds = {"bool": bool, "int": int, "float": float, "str": str}
    if text in kinds:
        return kinds[text], nullable
    for prefix, k in (("tuple", tuple), ("dict", dict)):
        if text.startswith(prefix):
            return k, nullable
    raise TypeError(f"no setting kind for the annotation {annotation!r}")


def _class_node(path: Path, name: str) -> tuple[ast.Module, ast.ClassDef]:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return tree, node
    raise LookupError(f"{path} declares no class {name}")


def _constants(paths) -> dict[str, object]:
    """The module-level literal constants of the files ``paths`` (``AGG_MODES = (...)``)."""
    consts: dict[str, object] = {}
    for path in paths:
        for node in ast.parse(Path(path).read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                if isinstance(target, ast.Name):
                    try:
                        consts[target.id] = ast.literal_eval(node.value)
                    except ValueError:
                        pass
    return consts


def _value(node, consts):
    if isinstance(node, ast.Name) and node.id in consts:
        return consts[node.id]
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _field_docs(path: Path, name: str, consts: dict) -> dict[str, tuple[str, object, str, dict]]:
    """``field -> (annotation text, default, docstring, metadata)`` of the dataclass ``name`` in
    ``path``, read from its source (``x: int = 3`` or ``x: str = field(default=..., metadata=...)``;
    names of ``consts`` resolved)."""
    _, cls = _class_node(path, name)
    out: dict[str, tuple[str, object, str, dict]] = {}
    body = cls.body
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        default, meta = None, {}
        v = node.value
        if isinstance(v, ast.Call) and getattr(v.func, "id", None) == "field":
            for k in v.keywords:
                if k.arg == "default":
                    default = _value(k.value, consts)
                elif k.arg == "metadata" and isinstance(k.value, ast.Dict):
                    for mk, mv in zip(k.value.keys, k.value.values):
                        if isinstance(mk, ast.Constant):
                            meta[mk.value] = _value(mv, consts)
        elif v is not None:
            default = _value(v, consts)
        doc = ""
        nxt = body[i + 1] if i + 1 < len(body) else None
        if (
            isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            doc = " ".join(nxt.value.value.split())
        out[node.target.id] = (ast.unparse(node.annotation), default, doc, meta)
    return out


def _objective_defaults() -> dict[str, dict]:
    """``objective -> {field: value}`` of :func:`harts_runtime.step_inputs.default_loss_config`,
    read from its source: ``if objective == "grpo": return PolicyLossConfig(kl_coef=0.001, ...)``."""
    tree = ast.parse((_ROOT / "step_inputs.py").read_text())
    out: dict[str, dict] = {}
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "default_loss_config":
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.If)
                    and isinstance(node.test, ast.Compare)
                    and isinstance(node.test.comparators[0], ast.Constant)
                    and isinstance(node.body[0], ast.Return)
                    and isinstance(node.body[0].value, ast.Call)
                ):
                    call = node.body[0].value
                    out[node.test.comparators[0].value] = {
                        k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg
                    }
    return out


def _plain(text: str) -> str:
    """A docstring as help text: reST roles and literals as plain words."""
    text = re.sub(r":\w+:`~?(?:[\w.]*\.)?([^`]+)`", r"\1", text)
    return text.replace("``", "")


# Where a setting's flag differs from its declaration (help appended, choices and bounds the
# declaration states in words). Choices and bounds that the declaration's own check enforces are
# not repeated here: the flag parses its type, the class checks the value.
_LOSS_META = {
    "clip_ratio_low": dict(lo=0.0),
    "clip_ratio_high": dict(lo=0.0),
    "clip_ratio_c": dict(lo=1.0),
    "kl_coef": dict(lo=0.0),
    "loss_norm": dict(positive=True),
}
_PARALLEL = ("tp", "cp", "ep", "dp_replicate", "sequence_parallel")
"""The degrees a job sets (``dp_shard`` follows from the world size, ``pp`` is 1, ``world_size``
is the launcher's)."""
_PARALLEL_KEYS = {"sequence_parallel": "sp"}
_PARALLEL_METAVAR = {"tp": "N", "cp": "C", "ep": "N", "dp_replicate": "N"}
_RL_ELSEWHERE = ("flavor", "model", "layers", "chunk_size", "device", "steps", "seed", "save_every")
"""RLConfig keys that are the model group's or the job's own settings (one flag each)."""
_RL_META = {
    "task": dict(metavar="NAME"),
    "prompts": dict(metavar="N"),
    "sync_sequences": dict(metavar="N"),
    "max_leaves": dict(metavar="N"),
    "max_step_tokens": dict(metavar="N"),
    "ppo_epochs": dict(metavar="N"),
    "mini_batches": dict(metavar="N"),
    "dump_episodes": dict(metavar="N"),
    "eval_every": dict(metavar="K"),
    "eval_prompts": dict(metavar="N"),
    "gamma": dict(metavar="G"),
    "keep_last": dict(metavar="K"),
    "max_staleness": dict(metavar="K"),
}


def _option_settings(group: str, cls) -> list[Setting]:
    """The settings of a dataclass whose fields carry ``metadata`` (``help``, ``choices``,
    ``metavar``, ``lo``): the options classes, :class:`ModelOptions`."""
    out = []
    for f in dataclasses.fields(cls):  # annotations are text here (``from __future__ import annotations``)
        kind, nullable = _kind(f.type)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        meta = dict(f.metadata)
        text = meta.get("help", "").replace("{flavors}", ", ".join(declared_flavors()))
        choices = tuple(meta["choices"]) if "choices" in meta else None
        out.append(
            Setting(
                group,
                f.name,
                kind,
                default,
                text,
                choices,
                meta.get("metavar"),
                meta.get("lo"),
                nullable=nullable,
            )
        )
    return out


def _loss_settings() -> list[Setting]:
    consts = _constants(sorted((_ROOT / "loss").glob("*.py")))
    docs = _field_docs(_ROOT / "loss" / "objectives.py", "PolicyLossConfig", consts)
    per = _objective_defaults()
    out = [Setting("loss", "objective", str, "grpo", "the built-in policy loss", tuple(per))]
    for name, (ann, default, doc, meta) in docs.items():
        kind, _ = _kind(ann)
        extra = dict(_LOSS_META.get(name, {}))
        if "choices" not in extra and meta.get("choices") is not None:
            extra["choices"] = tuple(meta["choices"])
        m = re.match(r"One of :data:`~?([\w.]+)`", doc)
        if "choices" not in extra and m and isinstance(consts.get(m.group(1).rsplit(".", 1)[-1]), tuple):
            extra["choices"] = consts[m.group(1).rsplit(".", 1)[-1]]
        if "metavar" in meta:
            extra["metavar"] = meta["metavar"]
        by = {obj: d.get(name, default) for obj, d in per.items()}
        values = ["none" if v is None else str(v) for v in by.values()]
        said = values[0] if len(set(values)) == 1 else ", ".join(f"{v} for {o}" for v, o in zip(values, by))
        if m and extra.get("choices"):
            doc = "one of " + ", ".join(extra["choices"])
        text = (meta.get("help") or _plain(doc)).rstrip(".") + f" (default: {said})"
        out.append(Setting("loss", name, kind, None, text, nullable=True, **extra))
    return out


def _parallel_settings() -> list[Setting]:
    docs = _field_docs(_ROOT / "parallel" / "dims.py", "ParallelDims", {})
    out = []
    for name in _PARALLEL:
        ann, default, doc, _ = docs[name]
        kind, _ = _kind(ann)
        lo = 1 if kind is int else None
        meta = dict(metavar=_PARALLEL_METAVAR.get(name), lo=lo, key=_PARALLEL_KEYS.get(name, name))
        out.append(Setting("parallel", name, kind, default, _plain(doc), **meta))
    return out


def _rl_settings() -> list[Setting]:
    path = _ROOT / "rl" / "config.py"
    docs = _field_docs(path, "RLConfig", _constants([path]))
    tasks = []
    for node in ast.parse((_ROOT / "rl" / "tasks.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "TASKS":
            tasks = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]  # type: ignore[attr-defined]
    out = []
    for name, (ann, default, doc, _) in docs.items():
        if name in _RL_ELSEWHERE:
            continue
        kind, nullable = _kind(ann)
        if kind is dict and default is None and not nullable:
            default = {}
        text = _plain(doc)
        if name == "task":
            text = f"built-in task: {' or '.join(tasks)}"
        meta = _RL_META.get(name, {})
        out.append(Setting("rl", name, kind, default, text, nullable=nullable, **meta))
    return out


@cache
def group_settings(group: str) -> tuple[Setting, ...]:
    """The settings of one group of the tree, in declaration order."""
    if group == "model":
        return tuple(_option_settings("model", ModelOptions))
    if group == "parallel":
        return tuple(_parallel_settings())
    if group == "execution":
        return tuple(_option_settings("execution", ExecutionOptions))
    if group == "optimizer":
        return tuple(_option_settings("optimizer", OptimizerOptions))
    if group == "loss":
        return tuple(_loss_settings())
    if group == "rl":
        return tuple(_rl_settings())
    raise KeyError(group)


def settings(groups=GROUPS) -> tuple[Setting, ...]:
    """The settings of ``groups`` (default: the whole tree)."""
    return tuple(s for g in groups for s in group_settings(g))


def setting(key: str) -> Setting:
    """The setting whose key (or field name) is ``key``."""
    for s in settings():
        if key in (s.key, s.name):
            return s
    raise KeyError(key)


# ----------------------------------------------------------------------------- the tree and resolve
def resolve_total_steps(total_steps: int | None, steps: int, schedule: str) -> int | None:
    """Where a decaying schedule ends: ``total_steps`` when given, else the job's ``steps`` (a
    resumed run's new total: its schedule stretches to the new end). One rule for both commands."""
    if total_steps is not None:
        return total_steps
    return max(1, steps) if schedule in ("linear", "cosine") else None


@dataclass(frozen=True)
class Resolved:
    """The device- and source-dependent values :meth:`JobConfig.resolve` decided."""

    capacity: int
    lr: float
    chunk_size: int | None
    """None: the model's own."""


@dataclass
class JobConfig:
    """One job's settings by group: each group the values given (a dict of its keys; what is not
    given takes the declared default, or what :meth:`resolve` decides)."""

    model: dict = field(default_factory=dict)
    parallel: dict = field(default_factory=dict)
    execution: dict = field(default_factory=dict)
    optimizer: dict = field(default_factory=dict)
    loss: dict = field(default_factory=dict)
    rl: dict = field(default_factory=dict)

    @classmethod
    def of(cls, values: dict, groups=GROUPS) -> JobConfig:
        """The tree of a flat table of settings (a namespace's ``vars``, a config file), by key."""
        job = cls()
        for s in settings(groups):
            if s.key in values:
                getattr(job, s.group)[s.name] = values[s.key]
        return job

    def resolve(self, device: str, source: str, *, chunk_size=None) -> Resolved:
        """The defaults decided by the device (``"cpu"`` or ``"cuda"``) and the source (``"file"``,
        ``"synthetic"`` or ``"online"``), for the settings not given: ``capacity``
        (:data:`CAPACITY_DEFAULTS`), ``lr`` (:data:`LR_DEFAULTS`: a checkpoint folder's, a flavor's,
        or an online flavor's) and ``chunk_size`` (``chunk_size()``, the online source's choice for
        its trees, else None: the model's own)."""
        kind = "cuda" if str(device).startswith("cuda") else "cpu"
        capacity = self.execution.get("capacity") or CAPACITY_DEFAULTS[kind]
        lr = self.optimizer.get("lr")
        if lr is None:
            if self.model.get("model") is not None:
                lr = LR_DEFAULTS["model"]
            else:
                lr = LR_DEFAULTS["online flavor" if source == "online" else "flavor"]
        chunk = self.model.get("chunk_size")
        if chunk is None and chunk_size is not None:
            chunk = chunk_size()
        return Resolved(capacity=int(capacity), lr=float(lr), chunk_size=chunk)
