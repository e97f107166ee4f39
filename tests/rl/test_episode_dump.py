"""The episode dump: a sampled tree as records and as text, per leaf its prompt, each turn's action
(cut at its cap or not) with one advantage per token, the observation after it, the reward and the
per-turn rewards; token ids decoded when a tokenizer is given."""

from __future__ import annotations

import json

import pytest

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl.advantages import advantages
from harts_runtime.rl.episodes import episode_records, render_episodes, write_episodes
from harts_runtime.rl.sampler import Leaf


def _tree():
    # prompt 0: [1, 2]; turn 0 action, observation [9], turn 1 action; two leaves forked at turn 0
    a = Leaf(
        0,
        [1, 2, 5, 6, 9, 7],
        (0,),
        [(0, 2, 4), (1, 5, 6)],
        [-1.0, -1.1, -1.2],
        0.0,
        [0.0, 0.0],
        [True, False],
    )
    b = Leaf(
        0,
        [1, 2, 3, 9, 8, 8],
        (1,),
        [(0, 2, 3), (1, 4, 6)],
        [-1.0, -1.3, -1.4],
        1.5,
        [0.5, 1.0],
        [False, True],
    )
    c = Leaf(1, [1, 4, 4, 9, 7], (0,), [(0, 2, 3), (1, 4, 5)], [-1.0, -1.0], 1.0)
    d = Leaf(1, [1, 4, 5, 9, 7], (1,), [(0, 2, 3), (1, 4, 5)], [-1.0, -1.0], 0.0)
    return [a, b, c, d]


def test_records_hold_each_turn_with_its_advantages():
    leaves = _tree()
    adv = advantages("grpo", leaves, {0: 2})
    recs = episode_records(leaves, adv)
    json.dumps(recs)  # JSON-ready
    assert [r["prompt"] for r in recs] == [0, 0, 1, 1]
    r = recs[1]
    assert r["prompt_tokens"] == [1, 2] and r["reward"] == 1.5 and r["turn_rewards"] == [0.5, 1.0]
    assert [t["action_tokens"] for t in r["turns"]] == [[3], [8, 8]]
    assert r["turns"][0]["observation_tokens"] == [9] and "observation_tokens" not in r["turns"][1]
    assert [t["truncated"] for t in r["turns"]] == [False, True]
    assert [a for t in r["turns"] for a in t["advantages"]] == adv[1]
    assert len(episode_records(leaves, adv, prompts=1)) == 2
    with pytest.raises(InvalidInputError) as e:
        episode_records(leaves, adv[:2])
    assert e.value.field == "advantages"


def test_text_shows_the_tree_token_by_token():
    leaves = _tree()
    adv = advantages("grpo", leaves, {0: 2})
    text = render_episodes(leaves, adv, prompts=1, step=3)
    assert text.startswith("# episodes of step 3: 1 prompts, 2 leaves")
    assert "## prompt 0 (2 tokens): 1 2" in text
    assert "- leaf (1,): reward +1.5000 (turns +0.5000, +1.0000)" in text
    assert "turn 0 action (2 tokens, cut at its cap): 5 6" in text
    assert f"advantages: 8:{adv[1][1]:+.3f} 8:{adv[1][2]:+.3f}" in text
    assert "turn 0 observation (1 tokens): 9" in text
    assert "prompt 1" not in text


def test_a_tokenizer_decodes_each_token():
    class Chars:
        def decode(self, ids):
            return "".join(chr(96 + i) for i in ids)

    text = render_episodes(_tree(), tokenizer=Chars())
    assert "## prompt 0 (2 tokens): 'ab'" in text and "turn 1 action (2 tokens, cut at its cap): 'hh'" in text
    assert "advantages" not in text
    assert episode_records(_tree(), tokenizer=Chars())[0]["turns"][0]["action_text"] == "ef"


def test_a_steps_dump_lands_in_the_run_folder(tmp_path):
    leaves = _tree()
    adv = advantages("tree", leaves, {0: 2})
    path = write_episodes(tmp_path, 7, leaves, adv, prompts=1)
    assert path == tmp_path / "episodes" / "step-7.txt"
    assert path.read_text() == render_episodes(leaves, adv, prompts=1, step=7)
    lines = (tmp_path / "episodes" / "step-7.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == json.loads(json.dumps(episode_records(leaves, adv, prompts=1)))
