"""``harts-rl`` around the loop: PPO epochs and mini-batches per rollout batch (a tree whole in one
mini-batch, the old log-probs the rollout's, so the clip acts), zero-variance group filtering (a
step left with nothing is skipped with a line), checkpoint retention (``--keep-last``, both
commands), resume falling back to the newest intact checkpoint (``--fallback``, saying which it
skipped), evaluation on held-out prompts (``--eval-every``), ``--export-hf`` and SIGTERM with the
default ``save_every`` 0."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch

from harts_runtime.rl import RLConfig, RLRun
from harts_runtime.rl.sampler import Leaf
from harts_runtime.rl.source import OnlineSource
from harts_runtime.rl.tasks import TokenSetTask
from harts_runtime.rollouts import Rollouts
from harts_runtime.trainer_state import latest_checkpoint

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

FLAVOR = "qwen3.5-tiny"
SMALL = dict(flavor=FLAVOR, prompts=2, forks={0: 2}, sync_sequences=1, seed=3)


def _source(**kw) -> OnlineSource:
    src = object.__new__(OnlineSource)
    src.config = RLConfig(flavor="x", **kw)
    src.forks = {0: 2}
    return src


def _leaves(rng, prompts: int, per: int, rewards=None) -> list[Leaf]:
    out = []
    for p in range(prompts):
        for i in range(per):
            n = int(rng.integers(3, 7))
            tokens = [1] + rng.integers(0, 16, n).tolist()
            r = float(rng.integers(0, 3)) if rewards is None else rewards[p]
            out.append(Leaf(p, tokens, (i,), [(0, 1, 1 + n)], rng.normal(-1, 0.1, n).tolist(), r))
    return out


class _Vocab:
    vocab_size = 16


@pytest.mark.parametrize("prompts,parts,epochs", [(5, 2, 1), (4, 4, 2), (3, 8, 3), (6, 1, 2)])
def test_updates_keep_each_tree_whole_and_the_rollouts_old_logprobs(prompts, parts, epochs):
    rng = np.random.default_rng(prompts * 10 + parts)
    src = _source(mini_batches=parts, ppo_epochs=epochs)
    leaves = _leaves(rng, prompts, 2)
    src._trained = leaves
    old = torch.tensor(rng.normal(-2, 0.5, sum(len(lf.tokens) - 1 for lf in leaves)))
    batch = src.rollouts(_Vocab(), leaves)
    batch.old_logprobs = old.float() * batch.loss_mask
    updates = src.updates(batch)
    used = min(parts, prompts)
    assert len(updates) == used * epochs
    full = {name: batch.to_lists(getattr(batch, name), name) for name in ("advantages", "old_logprobs")}
    for e in range(epochs):
        seen = []
        for k, (mb, rows) in enumerate(zip(updates[e * used : (e + 1) * used], src._plan[e * used :])):
            assert isinstance(mb, Rollouts) and mb.num_trajectories == len(rows)
            owners = {leaves[i].prompt for i in rows}
            assert all(
                leaves[j].prompt not in owners for j in range(len(leaves)) if j not in rows
            )  # whole trees
            for name, values in full.items():
                got = mb.to_lists(getattr(mb, name), name)
                assert [values[i] for i in rows] == got, (name, k)
            seen += rows
        assert sorted(seen) == list(range(len(leaves)))  # each epoch one pass over the batch
    assert src.updates(None) == []


def test_group_filtering_drops_the_groups_of_one_reward():
    rng = np.random.default_rng(0)
    for trial in range(20):
        rewards = rng.integers(0, 2, 5).astype(float)
        leaves = _leaves(rng, 5, 3, rewards=rewards)
        for lf in leaves[: trial % 4]:
            lf.reward += 1.0  # some groups get a differing leaf
        src = _source(filter_groups=True)
        kept = src._filter(leaves)
        flat = {p for p in range(5) if len({lf.reward for lf in leaves if lf.prompt == p}) == 1}
        assert src._filtered == len(flat)
        assert kept == [lf for lf in leaves if lf.prompt not in flat]
    src = _source(filter_groups=False)
    assert src._filter(leaves) == leaves and src._filtered == 0


def test_ppo_epochs_and_mini_batches_train_each_batch_several_times_and_the_clip_acts(tmp_path):
    recs = {}
    for name, kw in (("one", {}), ("ppo", dict(ppo_epochs=2, mini_batches=2))):
        run = RLRun(RLConfig(**SMALL, steps=1, **kw), {"lr": 5e-2}, tmp_path / name)
        recs[name] = run.run_step()
        assert run.engine.step == recs[name]["updates"]
    assert recs["one"]["updates"] == 1 and recs["ppo"]["updates"] == 4
    assert recs["one"]["reward_mean"] == recs["ppo"]["reward_mean"]  # the same rollout
    assert recs["one"]["objective/clipfrac"] == 0.0  # one update on the rollout's own log-probs
    assert recs["ppo"]["objective/clipfrac"] > 0.0  # later updates move past the clip


class _Flat(TokenSetTask):
    """Every leaf earns 0: every group has one reward."""

    def reward(self, state, tokens, actions):
        return 0.0


def test_a_step_whose_groups_are_all_filtered_is_skipped_with_a_line(tmp_path):
    run = RLRun(RLConfig(**SMALL, steps=2, filter_groups=True), {"lr": 1e-2}, tmp_path / "r", task=_Flat())
    lines = []
    recs = run.run(progress=lines.append)
    assert [r["updates"] for r in recs] == [0, 0] and run.engine.step == 0
    assert all(r["filtered_groups"] == 2 and r["skipped"] for r in recs)
    assert all("skipped" in line and "filter_groups" in line for line in lines)
    assert latest_checkpoint(tmp_path / "r").name == "step-2"


def test_keep_last_keeps_the_newest_checkpoints(tmp_path, capsys):
    run = RLRun(RLConfig(**SMALL, steps=3, save_every=1, keep_last=2), {"lr": 1e-2}, tmp_path / "r")
    run.run()
    assert sorted(os.listdir(tmp_path / "r" / "checkpoints")) == ["step-2", "step-3"]
    from harts_runtime.cli import main

    base = ["--preset", "tiny", "--device", "cpu", "--progress", "off", "--flavor", "debug", "--layers", "1"]
    save = tmp_path / "t"
    assert main([*base, "--steps", "3", "--save-every", "1", "--keep-last", "1", "--save", str(save)]) == 0
    assert sorted(os.listdir(save)) == ["step-3"]
    assert "removed" in capsys.readouterr().err


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_resume_falls_back_to_the_newest_intact_checkpoint_saying_which_it_skipped(tmp_path, capsys):
    from harts_runtime.cli.rl import main

    out = tmp_path / "r"
    RLRun(RLConfig(**SMALL, steps=3, save_every=1), {"lr": 1e-2}, out).run()
    _flip(out / "checkpoints" / "step-3" / "engine" / "rl.json")
    _flip(out / "checkpoints" / "step-2" / "engine" / "rl.json")
    assert main(["--resume", str(out), "--steps", "3"]) == 2  # without --fallback: refused, with a hint
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rl.json" in err[0] and "older checkpoints: step-2, step-1" in err[0], err
    assert main(["--resume", str(out), "--steps", "3", "--fallback"]) == 0
    err = capsys.readouterr().err
    skipped = [line for line in err.splitlines() if line.startswith("skipped ")]
    assert [s.split(":")[0].rsplit("/", 1)[-1] for s in skipped] == ["step-3", "step-2"], err
    assert "resumed" in err and "at step 1" in err
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [1, 2, 3]
    assert latest_checkpoint(out).name == "step-3"
    assert main(["--steps", "1", "--fallback", "--out", str(tmp_path / "x"), "--flavor", FLAVOR]) == 2
    assert "--fallback: applies to --resume" in capsys.readouterr().err


def test_evaluation_reports_the_greedy_reward_and_changes_no_training_step(tmp_path):
    plain = RLRun(RLConfig(**SMALL, steps=2), {"lr": 1e-2}, tmp_path / "a").run()
    evald = RLRun(
        RLConfig(**SMALL, steps=2, eval_every=1, eval_prompts=3), {"lr": 1e-2}, tmp_path / "b"
    ).run()
    for a, b in zip(plain, evald):
        assert (a["reward_mean"], a["loss"]) == (b["reward_mean"], b["loss"])
        assert "eval_reward_mean" not in a and 0.0 <= b["eval_reward_mean"] <= 1.0
    from harts_runtime.rl.evaluate import Evaluation

    run = RLRun(RLConfig(**SMALL, steps=0, eval_prompts=3), {"lr": 1e-2}, tmp_path / "c")
    ev = Evaluation(run.config, run.source)
    first, again = ev(1), ev(2)
    assert (
        first["eval_reward_mean"] == again["eval_reward_mean"]
    )  # the same prompts, greedy: the same episodes


def test_export_hf_writes_a_transformers_folder(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from harts_runtime.cli.rl import main

    out, hf = tmp_path / "r", tmp_path / "hf"
    argv = ["--flavor", FLAVOR, "--prompts", "2", "--sync-sequences", "1", "--steps", "1"]
    assert main([*argv, "--out", str(out), "--export-hf", str(hf)]) == 0
    assert f"exported {hf}" in capsys.readouterr().err
    model = transformers.AutoModelForCausalLM.from_pretrained(hf)
    run = RLRun.resume(out)
    want = dict(run.engine.export_weights(names="transformers"))
    got = model.state_dict()
    assert set(want) <= set(got)
    assert all(torch.equal(want[k].to(got[k].dtype), got[k]) for k in want)
    (tmp_path / "file").write_text("x")
    assert main(["--resume", str(out), "--export-hf", str(tmp_path / "file")]) == 2
    assert "--export-hf: " in capsys.readouterr().err


def test_sigterm_with_the_default_save_every_leaves_a_resumable_checkpoint(tmp_path):
    from harts_runtime.trainer.job import Stopped

    run = RLRun(RLConfig(**SMALL, steps=5), {"lr": 1e-2}, tmp_path / "r")
    assert run.config.save_every == 0
    sample = run.source.sampler.sample

    def preempted(rollout):
        if run.step == 1:  # the scheduler's SIGTERM arrives during step 2
            os.kill(os.getpid(), signal.SIGTERM)
        return sample(rollout)

    run.source.sampler.sample = preempted
    with pytest.raises(Stopped, match="after step 2; saved step 2"):
        run.run()
    assert latest_checkpoint(tmp_path / "r").name == "step-2"
    assert RLRun.resume(tmp_path / "r").step == 2


@pytest.mark.parametrize("name", ["token-set", "calculator", "ragged-set"])
def test_built_in_tasks_take_their_prompts_from_a_jsonl_file(tmp_path, name):
    from harts_runtime.errors import InvalidInputError
    from harts_runtime.rl.tasks import make_task

    rng = np.random.default_rng(4)
    if name == "calculator":
        records = [{"a": int(a), "b": int(b)} for a, b in rng.integers(0, 100, (5, 2))]
    else:
        records = [
            {"prompt": [1] + rng.integers(70, 120, int(rng.integers(2, 6))).tolist()} for _ in range(5)
        ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    task = make_task(name, prompts_file=str(path))
    expect = [make_task(name).prompt_record(r) for r in records]
    env = np.random.default_rng(9)
    oracle = np.random.default_rng(9)  # the same draws: one line index per prompt
    for _ in range(12):
        assert task.prompt(env) == expect[int(oracle.integers(len(records)))]
    assert (
        RLConfig(flavor="x", task=name, task_args={"prompts_file": str(path)}).check_task(task).leaves == 32
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(records[0]) + "\n" + ('{"a": 1}' if name == "calculator" else '{"prompt": [1, -2]}')
    )
    with pytest.raises(InvalidInputError) as e:
        make_task(name, prompts_file=str(bad))
    assert e.value.field == "task_args.prompts_file" and f"{bad}:2:" in str(e.value)
    with pytest.raises(InvalidInputError, match="no such file"):
        make_task(name, prompts_file=str(tmp_path / "nope.jsonl"))


def test_harts_rl_trains_on_a_prompts_file(tmp_path, capsys, monkeypatch):
    from harts_runtime.cli.rl import main

    (tmp_path / "p.jsonl").write_text('{"prompt": [1, 80, 81]}\n{"prompt": [1, 90]}\n')
    (tmp_path / "rl.toml").write_text('task_args = {prompts_file = "p.jsonl"}\nforks = {0 = 2}\n')
    monkeypatch.chdir(tmp_path)
    argv = ["--flavor", FLAVOR, "--config", "rl.toml", "--prompts", "2", "--sync-sequences", "1"]
    assert main([*argv, "--steps", "1", "--out", "r", "--dump-episodes", "2"]) == 0
    recorded = json.loads((tmp_path / "r" / "run.json").read_text())["rl"]["task_args"]["prompts_file"]
    assert recorded == str(tmp_path / "p.jsonl")  # absolute: the run resumes from any folder
    prompts = {
        tuple(r["prompt_tokens"]) for r in map(json.loads, (tmp_path / "r/episodes/step-1.jsonl").open())
    }
    assert prompts <= {(1, 80, 81), (1, 90)}
    capsys.readouterr()
