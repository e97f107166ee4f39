"""A task of your own for ``harts-rl``: the shape of an agent's episode in a few lines.

Each episode starts from a prompt of 2 to 5 random "words" (token ids 100..199). Turn 0: the policy
"calls a tool" (up to 6 tokens, ending early at the stop token 7); the tool answers with the call's
words (an observation whose length varies per branch). Turn 1: the policy answers (up to 6 tokens,
stop token 7). Reward per turn: the share of the call's tokens that are words, then the share of the
answer's tokens that repeat the tool's answer. Run it from this folder:

    harts-rl --task echo_env:EchoTask --flavor kimi-linear-tiny --steps 30 --out runs/echo --dump-episodes 1

``runs/echo/metrics.jsonl`` and ``runs/echo/reward.png`` hold the curve, ``runs/echo/episodes/`` the
trees as text; ``harts-rl --resume runs/echo --steps 40`` goes on (the class is recorded in
``runs/echo/run.json``).
"""

from __future__ import annotations

from harts_runtime.rl import Task

STOP = 7
WORDS = range(100, 200)


class EchoTask(Task):
    name = "echo"
    turns = 2
    default_forks = {0: 4, 1: 2}  # 8 leaves per prompt: 4 tool calls, 2 answers after each
    stop_tokens = (STOP,)

    def __init__(self, cap: int = 6):
        self.cap = int(cap)

    def prompt(self, rng):
        words = [int(w) for w in rng.integers(WORDS.start, WORDS.stop, int(rng.integers(2, 6)))]
        return [1, *words], None  # token ids, and the episode's state (read-only)

    def action_tokens(self, turn: int) -> int:
        return self.cap  # a cap: the stop token ends an action earlier

    @staticmethod
    def _body(action):
        return [t for t in action if t != STOP]

    @staticmethod
    def _words(action):
        return [t for t in action if t in WORDS]

    def observe(self, state, turn, tokens, action):
        return [2, *self._words(action)]  # ragged: 1 to 7 tokens

    def reward(self, state, tokens, actions):
        call, answer = (self._body(a) for a in actions)
        said = set(self._words(call))
        return [  # one reward per turn
            len(self._words(call)) / max(len(call), 1),
            sum(t in said for t in answer) / max(len(answer), 1),
        ]
