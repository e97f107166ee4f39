"""Episodes as text (:func:`render_episodes`) and as records (:func:`episode_records`): what a run's
``--dump-episodes N`` writes.

Per prompt tree, per leaf (its path below the forks): the prompt; each turn's action, whether it
ended at a stop token or its cap, and every action token with its advantage; the observation after
it; the leaf's reward (and its per-turn rewards). An action the cap cut short of a stop token says
so. Token ids are decoded with ``tokenizer`` when one
is given (a token shown as its text, ``repr``-quoted), else shown as ids. A leaf's tokens up to its
last fork are its siblings' too: the text repeats them per leaf, so each leaf reads on its own.
:func:`write_episodes` writes both for a step into a run folder.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl.sampler import Leaf

__all__ = ["episode_records", "render_episodes", "write_episodes"]


def _text(ids: Sequence[int], tokenizer) -> str:
    if tokenizer is None:
        return " ".join(str(int(t)) for t in ids)
    return repr(tokenizer.decode([int(t) for t in ids]))


def _token(t: int, tokenizer) -> str:
    return str(int(t)) if tokenizer is None else repr(tokenizer.decode([int(t)]))


def _pick(leaves: Sequence[Leaf], advantages, prompts: int | None):
    if advantages is not None and len(advantages) != len(leaves):
        raise InvalidInputError("advantages", f"one list per leaf ({len(leaves)}), got {len(advantages)}")
    chosen = sorted({lf.prompt for lf in leaves})
    if prompts is not None:
        chosen = chosen[: max(0, int(prompts))]
    keep = set(chosen)
    return [i for i, lf in enumerate(leaves) if lf.prompt in keep]


def episode_records(
    leaves: Sequence[Leaf], advantages=None, tokenizer=None, prompts: int | None = None
) -> list[dict]:
    """One JSON-ready record per leaf of the first ``prompts`` prompts (all: None): ``prompt``,
    ``path``, ``reward``, ``turn_rewards``, ``prompt_tokens`` and per turn ``action_tokens``,
    ``advantages`` (one per action token; absent without ``advantages``), ``truncated``,
    ``observation_tokens``; with a tokenizer also ``prompt_text``, ``action_text`` and
    ``observation_text``."""
    out = []
    for i in _pick(leaves, advantages, prompts):
        lf = leaves[i]
        adv = None if advantages is None else [float(a) for a in advantages[i]]
        first = lf.segments[0][1] if lf.segments else len(lf.tokens)
        obs = {t: (a, b) for t, a, b in lf.observation_spans()}
        rec: dict = {
            "prompt": lf.prompt,
            "path": list(lf.path),
            "reward": lf.reward,
            "turn_rewards": lf.turn_rewards,
            "prompt_tokens": lf.tokens[:first],
            "turns": [],
        }
        if tokenizer is not None:
            rec["prompt_text"] = tokenizer.decode(lf.tokens[:first])
        k = 0
        for j, (turn, a, b) in enumerate(lf.segments):
            t_rec: dict = {
                "turn": turn,
                "action_tokens": lf.tokens[a:b],
                "truncated": lf.truncated[j] if j < len(lf.truncated) else False,
            }
            if adv is not None:
                t_rec["advantages"] = adv[k : k + b - a]
            k += b - a
            if turn in obs:
                oa, ob = obs[turn]
                t_rec["observation_tokens"] = lf.tokens[oa:ob]
            if tokenizer is not None:
                t_rec["action_text"] = tokenizer.decode(lf.tokens[a:b])
                if turn in obs:
                    t_rec["observation_text"] = tokenizer.decode(t_rec["observation_tokens"])
            rec["turns"].append(t_rec)
        out.append(rec)
    return out


def render_episodes(
    leaves: Sequence[Leaf],
    advantages=None,
    tokenizer=None,
    prompts: int | None = None,
    step: int | None = None,
) -> str:
    """The trees of the first ``prompts`` prompts (all: None) as text (module docstring);
    ``advantages``: per leaf, one per action token (as :func:`harts_runtime.rl.advantages.advantages`
    returns them); ``step``: shown in the heading."""
    lines = []
    head = "episodes" if step is None else f"episodes of step {step}"
    recs = episode_records(leaves, advantages, tokenizer, prompts)
    lines.append(f"# {head}: {len({r['prompt'] for r in recs})} prompts, {len(recs)} leaves")
    last_prompt = None
    for r in recs:
        if r["prompt"] != last_prompt:
            last_prompt = r["prompt"]
            lines.append("")
            lines.append(
                f"## prompt {r['prompt']} ({len(r['prompt_tokens'])} tokens): {_text(r['prompt_tokens'], tokenizer)}"
            )
        rewards = f"reward {r['reward']:+.4f}"
        if r["turn_rewards"] is not None:
            rewards += " (turns " + ", ".join(f"{v:+.4f}" for v in r["turn_rewards"]) + ")"
        lines.append(f"- leaf {tuple(r['path'])}: {rewards}")
        for t in r["turns"]:
            ids = t["action_tokens"]
            end = ", cut at its cap" if t["truncated"] else ""
            lines.append(f"  turn {t['turn']} action ({len(ids)} tokens{end}): {_text(ids, tokenizer)}")
            if "advantages" in t:
                pairs = " ".join(f"{_token(x, tokenizer)}:{a:+.3f}" for x, a in zip(ids, t["advantages"]))
                lines.append(f"    advantages: {pairs}")
            if "observation_tokens" in t:
                obs = t["observation_tokens"]
                lines.append(f"  turn {t['turn']} observation ({len(obs)} tokens): {_text(obs, tokenizer)}")
    return "\n".join(lines) + "\n"


def write_episodes(
    folder, step: int, leaves: Sequence[Leaf], advantages=None, tokenizer=None, prompts: int | None = None
) -> Path:
    """Write step ``step``'s trees (the first ``prompts`` prompts) to ``folder/episodes/``:
    ``step-N.txt`` (:func:`render_episodes`) and ``step-N.jsonl`` (one :func:`episode_records`
    record a line); returns the text file's path."""
    out = Path(folder) / "episodes"
    out.mkdir(parents=True, exist_ok=True)
    text = out / f"step-{int(step)}.txt"
    text.write_text(render_episodes(leaves, advantages, tokenizer, prompts, step))
    recs = episode_records(leaves, advantages, tokenizer, prompts)
    (out / f"step-{int(step)}.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in recs))
    return text
