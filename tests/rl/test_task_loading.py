"""A user's task class by name (``make_task("pkg.mod:Class", **task_args)``): loaded from the Python
path or the current folder, each failure one line naming ``task`` or ``task_args.<key>``; the name a
run records (``task_identity``) loads the same class again."""

from __future__ import annotations

import sys
import textwrap

import pytest

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl.tasks import TASKS, load_task_class, make_task, task_identity

MODULE = """
from harts_runtime.rl.environment import Task

class Echo(Task):
    name = "echo"
    def __init__(self, length, repeat=1):
        self.length, self.repeat = length, repeat
    def prompt(self, rng):
        return [1, 2], None
    def action_tokens(self, turn):
        return self.length
    def reward(self, state, tokens, actions):
        return 0.0

class Outer:
    class Inner(Echo):
        pass

class Loose(Echo):
    def __init__(self, **kw):
        super().__init__(3)
        self.kw = kw

class Half(Task):
    def prompt(self, rng):
        return [1], None

def not_a_class():
    pass
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    pkg = tmp_path / "my_agents"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "envs.py").write_text(textwrap.dedent(MODULE))
    (pkg / "broken.py").write_text("import no_such_dependency_xyz\n")
    (pkg / "syntax.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_agents"
    for name in [m for m in sys.modules if m.startswith("my_agents")]:
        del sys.modules[name]


def test_a_user_class_loads_with_its_task_args(user_module):
    task = make_task("my_agents.envs:Echo", length=4, repeat=2)
    assert (task.length, task.repeat) == (4, 2)
    assert task_identity(task) == "my_agents.envs:Echo"
    again = make_task(task_identity(task), length=5)
    assert type(again) is type(task)
    assert task_identity(make_task("my_agents.envs:Outer.Inner", length=1)) == "my_agents.envs:Outer.Inner"
    assert make_task("my_agents.envs:Loose", anything=1).kw == {"anything": 1}  # **kwargs takes any key


def test_built_in_tasks_keep_their_names():
    for name, cls in TASKS.items():
        assert task_identity(make_task(name)) == name and task_identity(cls) == name


@pytest.mark.parametrize(
    "spec, kwargs, field, words",
    [
        ("my_agents.nope:Echo", {}, "task", "no module 'my_agents.nope'"),
        ("my_agents.broken:X", {}, "task", "importing 'my_agents.broken' failed: ModuleNotFoundError"),
        ("my_agents.syntax:X", {}, "task", "importing 'my_agents.syntax' failed: SyntaxError"),
        ("my_agents.envs:Nope", {}, "task", "module 'my_agents.envs' has no 'Nope'"),
        ("my_agents.envs:not_a_class", {}, "task", "is a function, not a subclass of"),
        ("my_agents.envs:Half", {}, "task", "abstract methods unimplemented: action_tokens, reward"),
        ("my_agents.envs:", {}, "task", "'package.module:Class'"),
        (":Echo", {}, "task", "'package.module:Class'"),
        ("my_agents.envs:Echo", {"length": 1, "bogus": 2}, "task_args.bogus", "takes length, repeat"),
        ("my_agents.envs:Echo", {}, "task_args.length", "needs this argument"),
        ("chess", {}, "task", "unknown task 'chess'"),
    ],
)
def test_each_failure_names_the_field(user_module, spec, kwargs, field, words):
    with pytest.raises(InvalidInputError) as e:
        make_task(spec, **kwargs)
    assert e.value.field == field and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_a_module_in_the_current_folder_loads(tmp_path, monkeypatch):
    (tmp_path / "cwd_task_mod.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        assert load_task_class("cwd_task_mod:Echo").__name__ == "Echo"
    finally:
        sys.modules.pop("cwd_task_mod", None)
