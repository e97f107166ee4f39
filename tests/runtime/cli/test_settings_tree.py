"""The settings tree (``harts_runtime.job_config``) generates both commands' flags and config-file
keys: every declared field of every group a command takes is a flag (or, a table, a config key)
that parses to its setting, and a config file's key sets the same; errors name the flag or the key;
``--mode both`` refuses a setting it does not take (``--cp 2``) instead of ignoring it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from harts_runtime import job_config
from harts_runtime.cli.flags import COMMAND_GROUPS, NOT_FLAGS, NOT_SETTINGS, flag_settings
from harts_runtime.options import ExecutionOptions, OptimizerOptions


def _parser(command):
    if command == "harts-train":
        from harts_runtime.cli.parser import build_parser

        return build_parser()
    from harts_runtime.cli.rl import build_parser

    return build_parser()


def _sample(s, action):
    """A valid value for setting ``s`` (its flag ``action``): ``(flag argv, expected parsed value,
    config value)``."""
    if s.kind is bool:
        if s.default:
            return [s.flag.replace("--", "--no-", 1)], False, False
        return [s.flag], True, True
    choices = [c for c in (action.choices or s.choices or ()) if c != "both"]
    if choices:
        v = choices[-1]
        if s.kind is tuple:
            return [s.flag, v], v, [v]
        return [s.flag, v], v, v
    if s.kind is int:
        return [s.flag, "2"], 2, 2
    if s.kind is float:
        return [s.flag, "2.5"], 2.5, 2.5
    return [s.flag, "x"], "x", "x"


def test_the_tree_covers_every_declared_field():
    """Each group is its declaration's fields: the options classes', ParallelDims' degrees,
    PolicyLossConfig's (read from source, no torch) plus the objective, RLConfig's (but the model's
    and the job's keys), and ModelOptions'."""
    from harts_runtime.loss.objectives import PolicyLossConfig
    from harts_runtime.rl.config import RLConfig

    names = lambda g: [s.name for s in job_config.group_settings(g)]  # noqa: E731
    assert names("execution") == [f.name for f in dataclasses.fields(ExecutionOptions)]
    assert names("optimizer") == [f.name for f in dataclasses.fields(OptimizerOptions)]
    assert names("loss") == ["objective"] + [f.name for f in dataclasses.fields(PolicyLossConfig)]
    assert names("model") == [f.name for f in dataclasses.fields(job_config.ModelOptions)]
    assert names("parallel") == ["tp", "cp", "ep", "dp_replicate", "sequence_parallel"]
    elsewhere = set(names("model")) | {"steps", "seed", "save_every"}
    assert names("rl") == [f.name for f in dataclasses.fields(RLConfig) if f.name not in elsewhere]
    # defaults as declared (the loss group's flags default to None: the objective's defaults apply)
    for f in dataclasses.fields(RLConfig):
        if f.name in names("rl"):
            d = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert job_config.setting(f.name).default == d, f.name
    from harts_runtime.parallel.dims import ParallelDims

    for s in job_config.group_settings("parallel"):
        assert s.default == getattr(ParallelDims(), s.name)
        assert s.help  # the field's docstring


@pytest.mark.parametrize("command", ["harts-train", "harts-rl"])
def test_every_setting_is_a_flag_and_a_config_key(command, tmp_path):
    """Walk the tree: each setting of the command's groups parses from its flag and from its
    config-file key to the same value."""
    from harts_runtime.cli.settings import load_config

    parser = _parser(command)
    actions = {a.dest: a for a in parser._actions}
    seen = 0
    for group in COMMAND_GROUPS[command]:
        flags = {s.name for s in flag_settings(command, group)}
        for s in job_config.group_settings(group):
            if s.name in NOT_SETTINGS[command]:
                assert s.key not in actions, s.name
                continue
            if s.name not in flags:  # a table, or an option without a flag: a config key only
                assert s.name in NOT_FLAGS or s.kind is dict, s.name
                continue
            argv, want, value = _sample(s, actions[s.key])
            args = parser.parse_args(argv)
            got = getattr(args, s.key)
            assert got == want, (s.name, argv, got)
            cfg = tmp_path / f"{command}-{s.key}.json"
            cfg.write_text(json.dumps({s.key: value}))
            loaded = load_config(cfg, parser, command=command)
            assert loaded[s.key] in (want, value), (s.name, loaded)
            seen += 1
    assert seen >= 40


def test_mode_both_refuses_cp_instead_of_ignoring_it(capsys):
    from harts_runtime.cli import main

    assert main(["--mode", "both", "--cp", "2", "--steps", "1", "--device", "cpu", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "harts-train: error: --cp: --mode both compares two model copies on the synthetic step; it takes no --cp"
    ]
    for argv, flag in (
        (["--tp", "2"], "--tp"),
        (["--sp"], "--sp"),
        (["--save", "ckpt"], "--save"),
        (["--metrics", "m.jsonl"], "--metrics"),
    ):
        assert main(["--mode", "both", *argv, "--steps", "1", "--device", "cpu"]) == 2
        assert f"error: {flag}: --mode both" in capsys.readouterr().err
    # what the two runs take reaches both (the offline trainer's settings): a bad value is named
    assert main(["--mode", "both", "--chunk-size", "24", "--steps", "1", "--device", "cpu"]) == 2
    assert "--chunk-size: must be a power of two, got 24" in capsys.readouterr().err


def test_a_bad_flag_and_a_bad_config_key_are_named(tmp_path, capsys):
    from harts_runtime.cli import main

    assert main(["--chunk-size", "24", "--steps", "1", "--device", "cpu", "--preset", "tiny"]) == 2
    assert (
        capsys.readouterr().err.strip() == "harts-train: error: --chunk-size: must be a power of two, got 24"
    )
    cfg = tmp_path / "run.toml"
    cfg.write_text("cp = 0\n")
    assert main(["--config", str(cfg), "--steps", "1", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == f"harts-train: error: {cfg}: cp: must be >= 1, got 0"
    cfg.write_text('kl_estimator = "k9"\n')
    assert main(["--config", str(cfg), "--steps", "1", "--device", "cpu"]) == 2
    assert f"{cfg}: kl_estimator: invalid choice 'k9'" in capsys.readouterr().err


def test_chunk_size_reaches_the_model(capsys):
    from harts_runtime.cli import main

    argv = ["--preset", "tiny", "--steps", "1", "--device", "cpu", "--progress", "off", "--json"]
    assert main([*argv, "--chunk-size", "16"]) == 0
    assert "layers=" in capsys.readouterr().err
    from harts_runtime.cli.parser import build_parser
    from harts_runtime.trainer.checks import model_config

    cfg, _ = model_config(build_parser().parse_args(["--chunk-size", "16"]), cpu=True)
    assert cfg.chunk_size == 16


def test_help_text_is_generated_from_the_declarations():
    """The defaults --help states are those the job resolves (capacity by device, lr by source), the
    flavors are every declared one, and harts-rl offers no --mode both."""
    train = _parser("harts-train").format_help()
    rl = _parser("harts-rl").format_help()
    for name in job_config.declared_flavors():
        assert name in " ".join(train.split()).replace("- ", "-"), name
    for text in (train, rl):
        flat = " ".join(text.split())
        assert (
            f"{job_config.CAPACITY_DEFAULTS['cpu']} on CPU, {job_config.CAPACITY_DEFAULTS['cuda']} on CUDA"
            in flat
        )
    assert f"{job_config.LR_DEFAULTS['online flavor']:g} for a flavor" in " ".join(rl.split())
    assert f"{job_config.LR_DEFAULTS['flavor']:g} for a flavor" in " ".join(train.split())
    flat_rl = " ".join(rl.split()).replace("- ", "-")
    for name in job_config.declared_flavors(families_only=True):  # the flavors a rollout engine runs
        assert name in flat_rl, name
    assert "debug," not in flat_rl and "(default: 30)" in flat_rl and "(default: cpu)" in flat_rl
    assert "(default for an online run: token-mean)" in flat_rl
    assert "both" not in [c for a in _parser("harts-rl")._actions if a.dest == "mode" for c in a.choices]
    assert "both" in [c for a in _parser("harts-train")._actions if a.dest == "mode" for c in a.choices]
    r = job_config.JobConfig().resolve("cpu", "online")
    assert (r.capacity, r.lr) == (4096, job_config.LR_DEFAULTS["online flavor"])
    r = job_config.JobConfig(model={"model": "x"}).resolve("cuda:1", "file")
    assert (r.capacity, r.lr) == (job_config.CAPACITY_DEFAULTS["cuda"], job_config.LR_DEFAULTS["model"])


def test_harts_rl_names_a_bad_loss_key_and_flag(tmp_path, capsys, monkeypatch):
    """The loss group is harts-rl's too: a config key of the wrong type or choice names the file and
    key, a flag names the flag; both before any work."""
    from harts_runtime.cli.rl import main
    from harts_runtime.rl import run as loop

    def no_work(*a, **k):
        raise AssertionError("RLRun was built: the bad value was not refused before any work")

    monkeypatch.setattr(loop.RLRun, "__init__", no_work)
    out = str(tmp_path / "o")
    for body, words in (
        ('kl_coef = "x"\n', "kl_coef: must be a number, got 'x'"),
        ('kl_estimator = "k9"\n', "kl_estimator: unknown 'k9'"),
    ):
        cfg = tmp_path / "rl.toml"
        cfg.write_text(body)
        assert main(["--flavor", "qwen3.5-tiny", "--config", str(cfg), "--out", out]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"harts-rl: error: {cfg}: ") and words in err[0], err
    assert main(["--flavor", "qwen3.5-tiny", "--kl-estimator", "k9", "--out", out]) == 2
    assert "argument --kl-estimator: invalid choice: 'k9'" in capsys.readouterr().err
    assert main(["--flavor", "qwen3.5-tiny", "--param-dtype", "bfloat16", "--out", out]) == 2
    assert "harts-rl: error: --param-dtype: applies to the sharded model" in capsys.readouterr().err
