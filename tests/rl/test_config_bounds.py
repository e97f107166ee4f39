"""Every bad ``harts-rl`` setting is refused before any work: exit code 2 and one line naming the
key (a config file's ``FILE: key: ...``, a flag's ``--flag: ...``), never a traceback; the tree's
size (leaves per prompt, leaves and tokens per step) is bounded; a task's prompt ids and arguments
are checked; empty episodes are refused; a missing ``--model`` folder is said as such. The sampler's
own checks (prompts drawn each step, observations that would overflow the step) run on a fake
rollout engine, no model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from harts_runtime.cli.rl import main
from harts_runtime.errors import InvalidInputError
from harts_runtime.rl import RLConfig, Task
from harts_runtime.rl.config import BOUNDS, DEFAULT_MAX_LEAVES, DEFAULT_MAX_STEP_TOKENS
from harts_runtime.rl.rollout_engine import Frontier, RolloutEngine
from harts_runtime.rl.sampler import TreeSampler
from harts_runtime.rl.tasks import CalculatorTask, TokenSetTask, make_task

BIG = 10**30

# (key, bad value as a config file holds it, what the message must also say[, the key named when
# the bound is on a size the value makes, not on the value])
BAD_VALUES = [
    # unknown keys
    ("turns", 0, "unknown key"),
    ("foo", 1, "unknown key"),
    ("_out", "x", "unknown key"),
    # integers: wrong types, negative, zero where it is not allowed, huge
    ("steps", -1, "[0, 1,000,000,000]"),
    ("steps", "3", "integer"),
    ("steps", 2.5, "integer"),
    ("steps", True, "integer"),
    ("steps", BIG, "1,000,000,000"),
    ("seed", -1, "[0, "),
    ("seed", 2**64, "9,223,372,036,854,775,806"),
    ("seed", "0", "integer"),
    ("seed", 1.0, "integer"),
    ("prompts", 0, "[1, "),
    ("prompts", -4, "[1, "),
    ("prompts", 10**6, "8,000,000 leaves per step, over the limit max_leaves = 4,096"),
    ("prompts", 2**40, "1,048,576"),
    ("prompts", [4], "integer"),
    ("layers", 0, "[1, 1,024]"),
    ("layers", 10**9, "[1, 1,024]"),
    ("layers", "2", "integer"),
    ("sync_sequences", -1, "[0, 1,024]"),
    ("sync_sequences", 10**7, "[0, 1,024]"),
    ("save_every", -2, "[0, "),
    ("save_every", False, "integer"),
    ("chunk_size", 0, "[1, 1,024]"),
    ("chunk_size", 24, "power of two"),
    ("chunk_size", 1 << 20, "[1, 1,024]"),
    ("max_leaves", 0, "[1, "),
    ("max_leaves", 2**40, "16,777,216"),
    ("max_step_tokens", -1, "[1, "),
    ("max_step_tokens", 20, "over the limit 20"),
    # forks
    ("forks", {"0": 100000}, "100,000 leaves per prompt, over the limit max_leaves = 4,096"),
    ("forks", {"0": 1000, "1": 1000}, "1,000,000 leaves per prompt"),
    ("forks", {"0": 0}, "[1, "),
    ("forks", {"0": -2}, "[1, "),
    ("forks", {"0": 2.5}, "integer"),
    ("forks", {"0": "4"}, "integer"),
    ("forks", {"0": True}, "integer"),
    ("forks", {"x": 2}, "turns are integers"),
    ("forks", {"-1": 2}, "turns are integers"),
    ("forks", {"5": 2}, "no turn 5"),
    ("forks", {"0": 1}, "1 leaf"),
    ("forks", {str(t): 2 for t in range(100)}, "at most 64 turns"),
    ("forks", 4, "table"),
    ("forks", [4, 2], "table"),
    # numbers
    ("temperature", 0, "(0, 100]"),
    ("temperature", -1.0, "(0, 100]"),
    ("temperature", 1e9, "(0, 100]"),
    ("temperature", "hot", "number"),
    ("temperature", True, "number"),
    ("sync_atol", 0, "(0, "),
    ("sync_atol", "tight", "number"),
    # strings, choices, bools
    ("advantage", "ppo", "grpo or tree"),
    ("advantage", 3, "grpo or tree"),
    ("recompute_logprobs", "no", "true or false"),
    ("recompute_logprobs", 0, "true or false"),
    ("task", "chess", "unknown task"),
    ("task", 7, "string"),
    ("task", "", "string"),
    ("device", "tpu", "cpu, cuda or cuda:N"),
    ("device", 0, "cpu, cuda or cuda:N"),
    ("model", 5, "string"),
    # task arguments
    ("task_args", {"set_start": 600}, "vocabulary of 512 ids"),
    ("task_args", {"bogus": 1}, "takes prompt_len, tokens_per_turn, set_start, set_size"),
    ("task_args", {"set_size": 0}, "[1, "),
    ("task_args", {"prompt_len": -3}, "[1, "),
    ("task_args", {"tokens_per_turn": "8"}, "integer"),
    ("task_args", {"tokens_per_turn": 0}, "[1, "),
    (
        "task_args",
        {"tokens_per_turn": 5000},
        "320,160 tokens (before observations), over the limit 262,144",
        "max_step_tokens",
    ),
    ("task_args", {"prompt_len": 10**7}, "[1, 1,048,576]"),
    ("task_args", {"set_start": [1]}, "a number, a bool or a string"),
    ("task_args", 5, "table of keywords"),
    ("task_args", [1], "table of keywords"),
    # engine options from the config file
    ("keep", 5, "list"),
    ("keep", ["nope"], "unknown regions"),
    ("lr", "fast", "number"),
    ("lr", -1.0, "lr"),
    ("capacity", "big", "integer"),
    ("capacity", 0, "capacity"),
    ("mode", 3, "string"),
    ("mode", "fast", "mode"),
    ("recompute", "yes", "true or false"),
    ("betas", "x", "list"),
    ("betas", [0.9], "betas"),
    ("warmup_steps", -1, "warmup_steps"),
    ("total_steps", 0.5, "integer"),
    ("planner", 1, "string"),
]
ASSERTED_KINDS = len(BAD_VALUES)


def _run(tmp_path, capsys, argv, monkeypatch):
    """``main(argv)`` with the loop's constructor made to fail: a refusal must come before it."""
    from harts_runtime.rl import run as loop

    def no_work(*a, **k):
        raise AssertionError("RLRun was built: the bad value was not refused before any work")

    monkeypatch.setattr(loop.RLRun, "__init__", no_work)
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def _assert_refused(code, err, key, words):
    lines = err.splitlines()
    assert code == 2, (key, code, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("harts-rl: error: "), err
    assert key in lines[0], (key, err)
    assert words in lines[0], (words, err)


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_every_bad_config_value_exits_2_naming_the_key(tmp_path, capsys, monkeypatch, suffix):
    """The table's values in a config file (TOML and JSON): each exit 2, one line naming the file
    and the key with the bound, before any work."""
    assert ASSERTED_KINDS >= 61
    import tomllib

    failures = []
    for i, (key, value, words, *named) in enumerate(BAD_VALUES):
        path = tmp_path / f"c{i}{suffix}"
        if suffix == ".json":
            path.write_text(json.dumps({key: value}))
        else:
            try:
                path.write_text(_toml(key, value))
                tomllib.loads(path.read_text())
            except (TypeError, ValueError):  # TOML cannot spell this value (10**30): JSON has it
                continue
        code, err = _run(
            tmp_path,
            capsys,
            ["--flavor", "qwen3.5-tiny", "--config", str(path), "--out", str(tmp_path / f"o{i}")],
            monkeypatch,
        )
        try:
            _assert_refused(code, err, named[0] if named else key, words)
            assert named or str(path) in err, err
        except AssertionError as e:
            failures.append(f"{key}={value!r}: {e}")
    assert not failures, "\n".join(failures)


def _toml(key, value) -> str:
    def one(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):
            if abs(v) >= 2**63:
                raise ValueError("TOML integers are 64-bit")
            return str(v)
        if isinstance(v, (float, str)):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(one(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {one(x)}" for k, x in v.items()) + "}"
        raise TypeError(v)

    return f"{key} = {one(value)}\n"


FLAG_VALUES = [
    (["--steps", "-1"], "--steps"),
    (["--steps", "x"], "--steps"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--prompts", "0"], "--prompts"),
    (["--prompts", "1000000"], "--prompts"),
    (["--layers", "0"], "--layers"),
    (["--layers", "5000"], "--layers"),
    (["--layers", "50"], "--layers: flavor 'qwen3.5-tiny' supports 1..16 layers"),
    (["--chunk-size", "24"], "--chunk-size"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "1e9"], "--temperature"),
    (["--device", "tpu"], "--device"),
    (["--max-leaves", "0"], "--max-leaves"),
    (["--max-leaves", "4"], "max_leaves = 4"),  # 4 prompts x 8 leaves = 32 leaves
    (["--max-step-tokens", "100"], "--max-step-tokens"),
    (["--save-every", "-1"], "--save-every"),
    (["--advantage", "ppo"], "--advantage"),
    (["--lr", "nan"], "--lr"),
    (["--capacity", "0"], "--capacity"),
    (["--task", "chess"], "task"),
    (["--flavor", "nope"], "flavor"),
]


@pytest.mark.parametrize("argv, key", FLAG_VALUES, ids=[" ".join(a) for a, _ in FLAG_VALUES])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, monkeypatch, argv, key):
    base = [] if "--flavor" in argv else ["--flavor", "qwen3.5-tiny"]
    code, err = _run(tmp_path, capsys, [*base, *argv, "--out", str(tmp_path / "o")], monkeypatch)
    _assert_refused(code, err, key, "")


def test_a_missing_model_folder_names_model_not_a_flavor(tmp_path, capsys, monkeypatch):
    code, err = _run(
        tmp_path, capsys, ["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], monkeypatch
    )
    _assert_refused(code, err, "--model", "no such folder")
    assert "flavor" not in err
    (tmp_path / "file").write_text("x")
    code, err = _run(
        tmp_path, capsys, ["--model", str(tmp_path / "file"), "--out", str(tmp_path / "o")], monkeypatch
    )
    _assert_refused(code, err, "--model", "not a folder")


def test_an_unusable_out_folder_or_device_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    for out, words in (
        (tmp_path / "file", "is a file, not a folder"),
        (tmp_path / "file" / "sub", "is a file"),
    ):
        code, err = _run(tmp_path, capsys, ["--flavor", "qwen3.5-tiny", "--out", str(out)], monkeypatch)
        _assert_refused(code, err, "--out", words)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    code, err = _run(
        tmp_path,
        capsys,
        ["--flavor", "qwen3.5-tiny", "--device", f"cuda:{n}", "--out", str(tmp_path / "o")],
        monkeypatch,
    )
    _assert_refused(code, err, "--device", "this machine has")


def test_tree_bombs_are_refused_at_once(tmp_path, capsys, monkeypatch):
    """``forks = {0 = 100000}`` ran 240 s until killed and ``prompts = 10**6`` reached 6.8 GB; both
    are refused before anything is allocated (the constructor of the loop fails the test)."""
    for body, words in (
        ("forks = {0 = 100000}", "forks: the tree would have 100,000 leaves per prompt, over the limit"),
        ("prompts = 1000000", "prompts: 1,000,000 prompts x 8 leaves = 8,000,000 leaves per step"),
        ("forks = {0 = 4096, 1 = 4096}", "16,777,216 leaves per prompt"),
    ):
        path = tmp_path / "c.toml"
        path.write_text(body + "\n")
        code, err = _run(
            tmp_path,
            capsys,
            ["--flavor", "kimi-linear-tiny", "--config", str(path), "--out", str(tmp_path / "o")],
            monkeypatch,
        )
        _assert_refused(code, err, "", words)


def test_a_tree_bomb_is_refused_without_importing_torch(tmp_path):
    """The command answers from its settings alone (about 0.5 s for the whole process on a CPU,
    most of it Python and numpy starting): torch is imported only once the settings passed."""
    import subprocess
    import sys

    path = tmp_path / "c.toml"
    path.write_text("forks = {0 = 100000}\n")
    code = (
        "import sys; from harts_runtime.cli.rl import main; "
        f"rc = main(['--flavor', 'kimi-linear-tiny', '--config', {str(path)!r}, '--out', {str(tmp_path / 'o')!r}]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().endswith(
        "forks: the tree would have 100,000 leaves per prompt, over the limit max_leaves = 4,096"
    )


# ------------------------------------------------------------------------------ RLConfig.check_task
class _Task(Task):
    name = "custom"

    def __init__(
        self, turns=2, actions=(3, 3), prompt=(1, 2, 3), obs=0, default_forks=None, prompt_tokens=None
    ):
        self.turns, self.actions, self._prompt, self.obs = turns, actions, list(prompt), obs
        self.default_forks = default_forks or {0: 2}
        self.prompt_tokens = prompt_tokens

    def prompt(self, rng):
        return list(self._prompt), None

    def action_tokens(self, turn):
        return self.actions[turn]

    def observe(self, state, turn, tokens, action):
        return [5] * self.obs

    def reward(self, state, tokens, actions):
        return float(sum(a.count(7) for a in actions))


@pytest.mark.parametrize(
    "task, kw, field, words",
    [
        (_Task(turns=0), {}, "turns", "1 to 1024 turns"),
        (_Task(turns=True), {}, "turns", "1 to 1024 turns"),
        (_Task(turns=10**6), {}, "turns", "got 1000000"),
        (_Task(actions=(0, 0)), {}, "action_tokens", "episodes are empty"),
        (_Task(actions=(-1, 3)), {}, "action_tokens[0]", "got -1"),
        (_Task(actions=(3, 2.0)), {}, "action_tokens[1]", "got 2.0"),
        (_Task(actions=(3, 10**12)), {}, "action_tokens[1]", "262,144"),
        (_Task(prompt_tokens=0), {}, "prompt_tokens", "got 0"),
        (_Task(prompt_tokens=300_000), {}, "prompt_tokens", "got 300000"),
        (_Task(prompt_tokens=40_000), {}, "max_step_tokens", "8 leaves x 40,006 tokens = 320,048"),
        (_Task(actions=(100_000, 1)), {}, "max_step_tokens", "x at least 100,002 tokens = at least 800,016"),
        (_Task(), {"forks": {3: 2}}, "forks[3]", "has 2 turns (0 to 1): no turn 3"),
        (_Task(default_forks={0: 1}), {}, "forks", "1 leaf"),
        (_Task(default_forks={0: 10**4}), {}, "forks", "10,000 leaves per prompt"),
        (TokenSetTask(set_start=600), {"vocab_size": 512}, "task_args.set_start", "1,263"),
        (TokenSetTask(set_start=200, set_size=57), {"vocab_size": 512}, "task_args.set_start", "at most 256"),
        (CalculatorTask(), {"vocab_size": 16}, "task", "ids up to 26"),
    ],
)
def test_check_task_bounds_the_tree_and_checks_the_task(task, kw, field, words):
    kw = dict(kw)
    vocab = kw.pop("vocab_size", None)
    cfg = RLConfig(flavor="qwen3.5-tiny", prompts=4, **kw)
    with pytest.raises(InvalidInputError) as e:
        cfg.check_task(task, vocab)
    assert e.value.field == field, str(e.value)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_check_task_shape_is_the_product_of_forks_and_prompts():
    """The oracle: a brute-force count of the tree's leaves (branches grown turn by turn)."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        turns = int(rng.integers(1, 5))
        forks = {
            int(t): int(rng.integers(1, 4))
            for t in rng.choice(turns, int(rng.integers(1, turns + 1)), replace=False)
        }
        if math.prod(forks.values()) < 2:
            forks[0] = 2
        actions = tuple(int(x) for x in rng.integers(1, 5, turns))
        prompts = int(rng.integers(1, 6))
        plen = int(rng.integers(1, 9))
        task = _Task(turns=turns, actions=actions, prompt=[1] * plen, prompt_tokens=plen)
        shape = RLConfig(flavor="x", prompts=prompts, forks=forks).check_task(task, 64)
        branches = prompts
        for t in range(turns):
            branches *= forks.get(t, 1)
        assert shape.leaves == branches and shape.leaves_per_prompt == branches // prompts
        assert shape.tokens == branches * (len(task._prompt) + sum(actions))


def test_defaults_pass_and_are_documented():
    cfg = RLConfig(flavor="qwen3.5-tiny")
    assert (cfg.max_leaves, cfg.max_step_tokens) == (DEFAULT_MAX_LEAVES, DEFAULT_MAX_STEP_TOKENS)
    for name in ("token-set", "calculator"):
        shape = cfg.check_task(make_task(name), 512)
        assert shape.leaves == 32
    from pathlib import Path

    docs = (Path(__file__).parents[2] / "docs" / "rl.md").read_text()
    for text in (f"{DEFAULT_MAX_LEAVES:,}", f"{DEFAULT_MAX_STEP_TOKENS:,}", "max_leaves", "max_step_tokens"):
        assert text in docs, text
    for key in BOUNDS:
        assert f"`{key}`" in docs, key


def test_check_task_draws_no_prompt():
    """A stateful task (one that reads a dataset) must not lose a prompt to the size check."""
    task = _Drifting()
    RLConfig(flavor="x").check_task(task, 64)
    assert task.calls == 0


def test_make_task_names_a_bad_task_args_key():
    with pytest.raises(InvalidInputError) as e:
        make_task("calculator", digits=3)
    assert e.value.field == "task_args.digits" and "takes no arguments" in str(e.value)
    with pytest.raises(InvalidInputError) as e:
        make_task("token-set", set_size=True)
    assert e.value.field == "task_args.set_size"


# ------------------------------------------------------------------------------ the sampler
class _FakeFrontier(Frontier):
    def __init__(self, prompts, vocab):
        self.tokens, self.vocab = [list(p) for p in prompts], vocab

    def sample(self, n, generator, temperature=1.0):
        tok = torch.randint(0, self.vocab, (len(self.tokens), n), generator=generator)
        for row, t in zip(self.tokens, tok.tolist()):
            row.extend(t)
        return torch.full((len(self.tokens), n), -math.log(self.vocab))

    def extend(self, rows):
        for row, r in zip(self.tokens, rows):
            row.extend(int(t) for t in r)

    def fork(self, index):
        self.tokens = [list(self.tokens[i]) for i in index]


class _FakeRollout(RolloutEngine):
    """Uniform sampling over ``vocab_size`` ids: no model."""

    def __init__(self, vocab_size=64):
        self.vocab_size = vocab_size
        self.opened = 0

    def load_weights(self, pairs):
        pass

    def logprobs(self, sequences):
        return [torch.full((len(s) - 1,), -math.log(self.vocab_size), dtype=torch.float64) for s in sequences]

    def open(self, prompts):
        self.opened += 1
        return _FakeFrontier(prompts, self.vocab_size)


class _Drifting(_Task):
    """Prompts and observations that change from step to step (what a static check cannot see)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = 0
        self.bad_prompt = None

    def prompt(self, rng):
        self.calls += 1
        return (self.bad_prompt if self.bad_prompt is not None else list(self._prompt)), None


@pytest.mark.parametrize(
    "bad, field, words",
    [
        ([], "prompt[0]", "non-empty"),
        ("abc", "prompt[0]", "got str"),
        ([1, 99], "prompt[0][1]", "[0, 64)"),
        ([1] * 5000, "prompt", "over the limit max_step_tokens = 1,000"),
    ],
)
def test_the_sampler_checks_each_steps_prompts_before_the_rollout_engine(bad, field, words):
    task = _Drifting()
    sampler = TreeSampler(task, {0: 2}, 2, 1.0, 0, max_step_tokens=1000)
    ro = _FakeRollout()
    leaves = sampler.sample(ro)
    assert len(leaves) == 4 and all(len(lf.tokens) == 3 + 6 for lf in leaves)
    task.bad_prompt = bad
    with pytest.raises(InvalidInputError) as e:
        sampler.sample(ro)
    assert e.value.field == field and words in str(e.value), str(e.value)
    assert ro.opened == 1  # the rollout engine never saw the bad prompts


def test_observations_that_would_overflow_the_step_are_refused():
    task = _Task(obs=10)  # 2 prompts x 2 forks x (3 + 3 + 10 + 3) = 76 tokens
    assert len(TreeSampler(task, {0: 2}, 2, 1.0, 0, max_step_tokens=76).sample(_FakeRollout())) == 4
    task = _Task(obs=100_000)
    with pytest.raises(InvalidInputError) as e:
        TreeSampler(task, {0: 2}, 2, 1.0, 0, max_step_tokens=DEFAULT_MAX_STEP_TOKENS).sample(_FakeRollout())
    assert (
        e.value.field == "observation"
        and "400,036 tokens, over the limit max_step_tokens = 262,144" in str(e.value)
    )
    with pytest.raises(InvalidInputError) as e:
        TreeSampler(_Task(obs=1), {0: 2, 1: 3}, 2, 1.0, 0, max_step_tokens=119).sample(_FakeRollout())
    assert "step 120 tokens" in str(e.value)  # 2 x 2 x 3 x (3 + 3 + 1 + 3): the later fork counted


def test_the_sampler_checks_the_tasks_settings_against_the_rollout_vocabulary():
    """A model folder's vocabulary is known once the rollout engine exists: token-set with
    ``set_start = 600`` on a 512-id model names ``task_args.set_start``, not an IndexError."""
    sampler = TreeSampler(TokenSetTask(set_start=600), {0: 2}, 2, 1.0, 0)
    with pytest.raises(InvalidInputError) as e:
        sampler.sample(_FakeRollout(512))
    assert e.value.field == "task_args.set_start"
    leaves = TreeSampler(TokenSetTask(set_start=100), {0: 2}, 2, 1.0, 0).sample(_FakeRollout(512))
    assert max(t for lf in leaves for t in lf.tokens) < 512
