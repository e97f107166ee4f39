"""The transformers rollout engine (:class:`TransformersRollout`): the embedded default backend,
CPU or GPU.

It holds a transformers model of the policy's family (Kimi-Linear, Qwen3-Next, Qwen3.5-MoE, Ling-3.0, Nemotron-H), built
from the trainer's model config (:func:`harts_runtime.hf.save_setup`), and takes the weights in
memory from :meth:`HartsEngine.export_weights(names="transformers") <harts_runtime.engine.HartsEngine.export_weights>`
copied into its tensors in place as they stream in: a missing, unexpected or misshapen tensor raises. Sampling runs the model
incrementally on its own cache (a transformers ``Cache``); a fork repeats cache rows
(``Cache.reorder_cache``), so forked branches share their prefix state as a prefix cache would.

The branches of a frontier advance in lockstep: every branch gets the same number of sampled
tokens, and the observation rows of one :meth:`~_Frontier.extend` must have one length (the
built-in tasks' observations do). A ragged frontier is refused naming the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl.rollout_engine import Frontier, RolloutEngine

__all__ = ["TransformersRollout"]


def _quiet_transformers() -> None:
    import logging

    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _decode_numbers(value):
    """``value`` (a config.json value) with transformers' spelling of a non-finite number,
    ``{"__float__": "Infinity"}``, read as the float (``AutoConfig.for_model`` takes keywords, not
    JSON, and refuses the mapping); lists and mappings are decoded throughout."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _decode_numbers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_decode_numbers(v) for v in value)
    return value


class TransformersRollout(RolloutEngine):
    """A transformers causal LM of the trainer's family, synced in memory.

    :meth:`from_engine` builds it from a :class:`~harts_runtime.engine.HartsEngine` (its model must
    have a transformers family: not the ``debug`` flavor) and loads the engine's weights."""

    def __init__(self, model, vocab_size: int):
        self.model = model.eval()
        self.vocab_size = int(vocab_size)
        self.device = next(model.parameters()).device
        self._cache_kw: str | None = None

    @classmethod
    def from_engine(cls, engine, device=None) -> TransformersRollout:
        import transformers

        from harts_runtime.hf import save_setup

        _quiet_transformers()
        hf_config, _ = save_setup(engine.model)
        hf_config = _decode_numbers(dict(hf_config))
        model_type = hf_config.pop("model_type")
        config = transformers.AutoConfig.for_model(model_type, **hf_config)
        dtype = next(engine.model.parameters()).dtype
        with torch.device(device if device is not None else next(engine.model.parameters()).device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        rollout = cls(model, engine.vocab_size)
        rollout.load_weights(engine.export_weights(names="transformers"))
        return rollout

    @torch.no_grad()
    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        """Copy the pairs (transformers' in-memory names) into the model's tensors in place, one
        at a time as they stream in (no state dict of them all is built, nothing is reallocated).
        An unknown name or a wrong shape raises :class:`InvalidInputError` naming the tensor;
        ``strict``: so does a tensor of the model that the stream left out."""
        own = self.model.state_dict(keep_vars=True)
        seen: set[str] = set()
        for name, tensor in pairs:
            dst = own.get(name)
            if dst is None:
                if strict:
                    raise InvalidInputError(name, "not a tensor of the rollout engine's model")
                continue
            if tuple(dst.shape) != tuple(tensor.shape):
                raise InvalidInputError(
                    name, f"shape {tuple(tensor.shape)} != the rollout model's {tuple(dst.shape)}"
                )
            dst.data.copy_(tensor.detach())
            seen.add(name)
        missing = [n for n in own if n not in seen]
        if strict and missing:
            raise InvalidInputError(
                missing[0], f"not synced: {len(missing)} tensors of the rollout model missing"
            )

    @torch.no_grad()
    def _logits(self, ids: torch.Tensor, cache=None):
        """float64 logits of ``ids`` (``[B, L]``), extending ``cache`` in place when given (the
        keyword is ``cache`` in newer transformers, ``past_key_values`` before)."""
        kw = {}
        if cache is not None:
            if self._cache_kw is None:
                import inspect

                params = inspect.signature(self.model.forward).parameters
                self._cache_kw = "cache" if "cache" in params else "past_key_values"
            kw = {self._cache_kw: cache, "use_cache": True}
        out = self.model(input_ids=ids.to(self.device), **kw)
        return out.logits.double(), cache

    @torch.no_grad()
    def logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(sequences)
        by_len: dict[int, list[int]] = {}
        for i, s in enumerate(sequences):
            by_len.setdefault(len(s), []).append(i)
        for _, rows in sorted(by_len.items()):
            ids = torch.tensor([list(sequences[i]) for i in rows], dtype=torch.long)
            logits, _ = self._logits(ids)
            lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None].to(self.device))[..., 0]
            for j, i in enumerate(rows):
                out[i] = lp[j].cpu()
        return out

    def open(self, prompts: Sequence[Sequence[int]]) -> Frontier:
        return _Frontier(self, prompts)


class _Frontier(Frontier):
    """Branches advancing in lockstep on one transformers cache; :attr:`_next` holds the log-softmax
    of each branch's next token."""

    def __init__(self, rollout: TransformersRollout, prompts: Sequence[Sequence[int]]):
        from transformers import DynamicCache

        lengths = {len(p) for p in prompts}
        if len(lengths) != 1 or 0 in lengths:
            raise InvalidInputError(
                "prompts", f"a frontier needs prompts of one non-zero length, got {sorted(lengths)}"
            )
        self.rollout = rollout
        self.tokens = [list(p) for p in prompts]
        self._cache = DynamicCache(config=rollout.model.config)
        logits, self._cache = rollout._logits(torch.tensor(self.tokens, dtype=torch.long), self._cache)
        self._next = logits[:, -1]

    def _feed(self, ids: torch.Tensor) -> None:
        logits, self._cache = self.rollout._logits(ids, self._cache)
        self._next = logits[:, -1]

    def sample(self, n: int, generator: torch.Generator, temperature: float = 1.0) -> torch.Tensor:
        out_lp = []
        for _ in range(n):
            logp = torch.log_softmax(self._next / temperature, -1).cpu()
            tok = torch.multinomial(logp.exp(), 1, generator=generator)  # [B, 1]
            out_lp.append(logp.gather(-1, tok)[:, 0])
            for row, t in zip(self.tokens, tok[:, 0].tolist()):
                row.append(t)
            self._feed(tok)
        return torch.stack(out_lp, 1).float() if out_lp else torch.zeros(len(self.tokens), 0)

    def extend(self, rows: Sequence[Sequence[int]]) -> None:
        if len(rows) != len(self.tokens):
            raise InvalidInputError("observations", f"expected {len(self.tokens)} rows, got {len(rows)}")
        lengths = {len(r) for r in rows}
        if len(lengths) != 1:
            raise InvalidInputError(
                "observations",
                f"the transformers frontier needs one observation length per turn, got {sorted(lengths)}",
            )
        if 0 in lengths:
            return
        for row, r in zip(self.tokens, rows):
            row.extend(int(t) for t in r)
        self._feed(torch.tensor([list(r) for r in rows], dtype=torch.long))

    def fork(self, index: Sequence[int]) -> None:
        idx = torch.as_tensor(list(index), dtype=torch.long)
        self._cache.reorder_cache(idx.to(self.rollout.device))
        self._next = self._next[idx.to(self._next.device)]
        self.tokens = [list(self.tokens[i]) for i in idx.tolist()]
