"""Text tasks through the tree sampler: a checkpoint folder's tokenizer (a char-level one built here
with ``tokenizers`` and saved as a transformers tokenizer with a chat template) renders the chat
prompt, encodes the observations, decodes the actions for the reward; the EOS and a one-token stop
string end an action. A text task without a tokenizer, or a tokenizer wider than the model, is
refused naming the field. A plain tokenizer object (no library) works the same way."""

from __future__ import annotations

import math
import string

import pytest
import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl.rollout_engine import Frontier, RolloutEngine
from harts_runtime.rl.sampler import TreeSampler
from harts_runtime.rl.text import TextTask, bind_tokenizer, load_tokenizer

SPECIAL = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<call>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {t: i for i, t in enumerate(SPECIAL + chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=SPECIAL[3:],
    )  # fmt: skip
    tok.chat_template = TEMPLATE
    folder = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(folder)
    return folder


class Spell(TextTask):
    """Write text with an 'a' in it; the environment says whether it had one."""

    name = "spell"
    turns = 2
    stop_texts = ("<call>",)

    def __init__(self, tokenizer=None, chat=True):
        super().__init__(tokenizer)
        self.chat = chat
        self.seen: list[list[str]] = []

    def prompt_text(self, rng):
        word = "".join(rng.choice(list("abc"), 3))
        if self.chat:
            return [{"role": "user", "content": f"say {word}"}], word
        return f"say {word}", word

    def action_tokens(self, turn):
        return 5

    def observe_text(self, state, turn, action):
        return "yes" if "a" in action else "no!"[: 1 + len(action) % 3]

    def reward_text(self, state, actions):
        self.seen.append(actions)
        return [float("a" in a) for a in actions]


class _Frontier(Frontier):
    """Uniform over ``vocab`` ids, half the mass on ``favour`` (the stop ids): actions stop often."""

    def __init__(self, prompts, vocab, favour):
        self.tokens, self.vocab, self.favour = [list(p) for p in prompts], vocab, list(favour)

    def sample(self, n, generator, temperature=1.0, stop=()):
        p = torch.full((self.vocab,), 1.0)
        p[self.favour] = self.vocab / (2 * len(self.favour))
        p /= p.sum()
        out = torch.zeros(len(self.tokens), n)
        for b, row in enumerate(self.tokens):
            for j in range(n):
                t = int(torch.multinomial(p, 1, generator=generator))
                row.append(t)
                out[b, j] = math.log(p[t])
                if t in stop:
                    break
        return out

    def extend(self, rows):
        for row, r in zip(self.tokens, rows):
            row.extend(int(t) for t in r)

    def fork(self, index):
        self.tokens = [list(self.tokens[i]) for i in index]


class _Rollout(RolloutEngine):
    def __init__(self, vocab, favour=()):
        self.vocab_size, self.favour = vocab, favour

    def load_weights(self, pairs):
        pass

    def logprobs(self, sequences):
        raise NotImplementedError

    def open(self, prompts):
        return _Frontier(prompts, self.vocab_size, self.favour)


@pytest.mark.parametrize("chat", [True, False])
def test_text_episodes_round_trip_through_the_tokenizer(tok_dir, chat):
    tok = load_tokenizer(tok_dir)
    task = Spell(chat=chat)
    assert bind_tokenizer(task, tok_dir) is task.tokenizer and task.tokenizer is not None
    eos, call = tok.eos_token_id, tok.convert_tokens_to_ids("<call>")
    assert set(task.stop_tokens) == {eos, call}
    sampler = TreeSampler(task, {0: 2, 1: 2}, 3, 1.0, 0)
    leaves = sampler.sample(_Rollout(len(tok), favour=[eos, call]))
    assert len(leaves) == 12
    stopped = 0
    for lf in leaves:
        first = lf.segments[0][1]
        prompt = tok.decode(lf.tokens[:first])
        if chat:
            assert prompt.startswith("<|im_start|>user\nsay ") and prompt.endswith("<|im_start|>assistant\n")
        else:
            assert prompt.startswith("<s>say ") and len(prompt) == len("<s>say abc")
        for _, a, b in lf.segments:
            action = lf.tokens[a:b]
            ends = action[-1] in (eos, call)
            stopped += ends
            assert len(action) == 5 or ends
            assert (eos in action[:-1], call in action[:-1]) == (False, False)
        (_, a, _), (_, c, _) = lf.observation_spans()[0], lf.segments[1]
        text = task.action_text(lf.tokens[lf.segments[0][1] : lf.segments[0][2]])
        assert tok.decode(lf.tokens[a:c]) == task.observe_text(None, 0, text)
        assert lf.turn_rewards == [float("a" in task.action_text(x)) for x in lf.actions()]
    assert stopped > 0
    assert all("</s>" not in a and "<call>" not in a for seen in task.seen for a in seen)


def test_a_text_task_needs_a_tokenizer_that_fits_the_model(tok_dir, tmp_path):
    with pytest.raises(InvalidInputError) as e:
        TreeSampler(Spell(), {0: 2}, 1, 1.0, 0).sample(_Rollout(512))
    assert e.value.field == "task" and "task_args.tokenizer" in str(e.value)
    task = Spell(tokenizer=str(tok_dir))
    with pytest.raises(InvalidInputError) as e:
        TreeSampler(task, {0: 2}, 1, 1.0, 0).sample(_Rollout(50))
    assert e.value.field == "tokenizer" and "more than the model's vocabulary of 50" in str(e.value)
    assert load_tokenizer(tmp_path) is None and bind_tokenizer(Spell(), tmp_path) is None
    with pytest.raises(InvalidInputError) as e:
        Spell(tokenizer=str(tmp_path))
    assert e.value.field == "task_args.tokenizer"
    task.stop_texts = ("ab",)
    with pytest.raises(InvalidInputError) as e:
        TreeSampler(task, {0: 2}, 1, 1.0, 0).sample(_Rollout(512))
    assert e.value.field == "stop_texts" and "2 tokens" in str(e.value)


class CharTokenizer:
    """A tokenizer object without any library: one id per character, EOS 1, a chat template of
    its own (what a user may bring instead of a transformers tokenizer)."""

    eos_token_id = 1
    chat_template = "plain"

    def __init__(self):
        self.chars = "\x00\x01" + string.printable

    def __len__(self):
        return len(self.chars)

    def encode(self, text, add_special_tokens=False):
        return [self.chars.index(c) for c in text]

    def decode(self, ids):
        return "".join(self.chars[i] if i > 1 else "<eos>" for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


def test_a_plain_tokenizer_object_works_without_transformers():
    tok = CharTokenizer()
    task = Spell(tokenizer=tok)
    with pytest.raises(InvalidInputError) as e:  # "<call>" is 6 characters here
        _ = task.stop_tokens
    assert e.value.field == "stop_texts"
    task.stop_texts = ("!",)
    assert task.stop_tokens == (1, tok.encode("!")[0])
    leaves = TreeSampler(task, {0: 2}, 2, 1.0, 0).sample(_Rollout(len(tok), favour=[1, tok.encode("!")[0]]))
    for lf in leaves:
        assert tok.decode(lf.tokens[: lf.segments[0][1]]).startswith("user: say ")
        assert tok.decode(lf.tokens[: lf.segments[0][1]]).endswith("\nassistant: ")
        assert lf.turn_rewards == [float("a" in task.action_text(x)) for x in lf.actions()]
    with pytest.raises(InvalidInputError) as e:
        Spell(tokenizer=object())
    assert e.value.field == "task_args.tokenizer"
