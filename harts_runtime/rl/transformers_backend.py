"""The transformers rollout engine (:class:`TransformersRollout`): the embedded default backend,
CPU or GPU.

It holds a transformers model of the policy's family (Kimi-Linear, Qwen3-Next, Qwen3.5-MoE, Ling-3.0, Nemotron-H), built
from the trainer's model config (:func:`harts_runtime.hf.save_setup`), and takes the weights in
memory from the trainer's weight stream (:meth:`HartsEngine.weights(names="transformers", bucket_bytes=...)
<harts_runtime.engine.HartsEngine.weights>`, :func:`weight_pairs`), each bucket's tensors copied into
the model's in place as they stream in: a missing, unexpected or misshapen tensor raises. Sampling runs the model
incrementally on its own cache (a transformers ``Cache``); a fork repeats cache rows
(``Cache.reorder_cache``), so forked branches share their prefix state as a prefix cache would.

Branches are ragged: prompts and observations may differ in length, and with stop tokens each
branch's action ends at its own length. The frontier keeps its branches in *groups* of one
sequence length, each on its own cache (a transformers cache holds rows of one length): the
prompts open one group per distinct length; a group splits when its branches' observations differ
in length or some of its branches stop while others sample on (the split-off rows' cache is a copy
of theirs); a fork repeats rows within each group; before each turn's sampling, groups whose
branches have come to one length again join (their caches' rows concatenated). Each sampled token is drawn for every sampling
branch at once (one ``torch.multinomial`` over the groups' rows) and fed to each group in one
forward, so a frontier whose branches all have one length (the built-in tasks) runs exactly as one
batch, and a ragged one costs one forward per group (of one length) per token.

Routes (MoE families): a forward hook on each MoE layer's router module (transformers'
``*TopKRouter`` / ``*TopkRouter``, in model order) records the expert ids the model ran each token
through, the router's own third output: plain top-k of the softmax for Qwen3.5-MoE, the
group-limited top-k of the sigmoid scores plus ``e_score_correction_bias`` for Kimi-Linear and
Ling-3.0. The frontier keeps them per branch and token, prompts (the prefill) and observations
included (:meth:`Frontier.routes`), as int ``[L, M, k]`` for the trainer's routing replay.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl.rollout_engine import Frontier, RolloutEngine

__all__ = ["SYNC_BUCKET_BYTES", "TransformersRollout", "weight_pairs"]

SYNC_BUCKET_BYTES = 1 << 28
"""The weight sync's bucket (:meth:`HartsEngine.weights`): at most this many bytes of assembled
full tensors held at once beyond the model."""


def weight_pairs(engine, bucket_bytes: int = SYNC_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's weights as ``(name, tensor)`` pairs in transformers' in-memory spelling, read
    bucket by bucket from :meth:`HartsEngine.weights(names="transformers", bucket_bytes=...)
    <harts_runtime.engine.HartsEngine.weights>` (the next bucket is assembled only once the
    consumer has taken the previous one's tensors)."""
    for bucket in engine.weights(names="transformers", bucket_bytes=bucket_bytes):
        yield from bucket


def _routers(model) -> list[torch.nn.Module]:
    """The MoE layers' router modules of a transformers model, in model order (none: dense)."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


def _quiet_transformers() -> None:
    import logging

    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _decode_numbers(value: Any) -> Any:
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
    have a transformers family: not the ``debug`` flavor) and loads the engine's weights.
    :attr:`routers`: the MoE routers whose expert ids each forward records (:attr:`last_routes`)."""

    def __init__(self, model, vocab_size: int):
        self.model = model.eval()
        self.vocab_size = int(vocab_size)
        self.device = next(model.parameters()).device
        self._cache_kw: str | None = None
        self.routers = _routers(model)
        self._captured: list[torch.Tensor] = []
        self.last_routes: torch.Tensor | None = None
        """The last forward's expert ids, int64 ``[B, L, M, k]`` (None: no MoE router)."""
        self.scored_routes: list[torch.Tensor] | None = None
        """Per sequence of the last :meth:`logprobs` call, the expert ids it scored with, int64
        ``[L, M, k]`` (None: no MoE router)."""
        for r in self.routers:
            r.register_forward_hook(self._record)

    def _record(self, module, args, output) -> None:
        self._captured.append(output[2].detach())

    @classmethod
    def from_engine(cls, engine, device=None, bucket_bytes: int = SYNC_BUCKET_BYTES) -> TransformersRollout:
        import transformers

        from harts_runtime.hf import save_setup
        from harts_runtime.models.registry import get_family

        _quiet_transformers()
        hf_config, _ = save_setup(engine.model)
        hf_config = _decode_numbers(dict(hf_config))
        model_type = hf_config.pop("model_type")
        get_family(model_type).check_transformers()
        config = transformers.AutoConfig.for_model(model_type, **hf_config)
        dtype = next(engine.model.parameters()).dtype
        with torch.device(device if device is not None else next(engine.model.parameters()).device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        rollout = cls(model, engine.vocab_size)
        rollout.load_weights(weight_pairs(engine, bucket_bytes))
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
        self._captured = []
        out = self.model(input_ids=ids.to(self.device), **kw)
        self.last_routes = None
        if self.routers:
            got, self._captured = self._captured, []
            if len(got) != len(self.routers):
                raise RuntimeError(f"{len(got)} router calls in a forward of {len(self.routers)} MoE layers")
            b, length = ids.shape
            self.last_routes = torch.stack(got, 1).view(b, length, len(got), -1).cpu()
        return out.logits.double(), cache

    @torch.no_grad()
    def logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(sequences)
        routes: list[torch.Tensor | None] = [None] * len(sequences)
        self.scored_routes = None
        by_len: dict[int, list[int]] = {}
        for i, s in enumerate(sequences):
            by_len.setdefault(len(s), []).append(i)
        for _, rows in sorted(by_len.items()):
            ids = torch.tensor([list(sequences[i]) for i in rows], dtype=torch.long)
            logits, _ = self._logits(ids)
            lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None].to(self.device))[..., 0]
            for j, i in enumerate(rows):
                out[i] = lp[j].cpu()
                if self.last_routes is not None:
                    routes[i] = self.last_routes[j].long()
        assert all(t is not None for t in out)  # every sequence is in one length group
        if self.routers:
            self.scored_routes = cast(list[torch.Tensor], routes)
        return cast(list[torch.Tensor], out)

    def open(self, prompts: Sequence[Sequence[int]]) -> Frontier:
        return _Frontier(self, prompts)


class _Group:
    """Branches of one sequence length on one cache: ``branches[r]`` is row ``r``'s branch index;
    ``next``: the log-softmax input (logits) of each row's next token."""

    __slots__ = ("branches", "cache", "next")

    def __init__(self, branches: list[int], cache, next_logits: torch.Tensor):
        self.branches, self.cache, self.next = branches, cache, next_logits


_ROW_TENSORS = {
    "DynamicLayer": ("keys", "values"),
    "LinearAttentionLayer": ("conv_states", "recurrent_states"),
    "LinearAttentionAndFullAttentionLayer": ("keys", "values", "conv_states", "recurrent_states"),
    "DummyLayer": (),
}
"""The transformers cache layers whose per-row tensors (batch first; a dict of them per state
index for the linear-attention states) two groups of one length can concatenate."""


def _concat_rows(a: _Group, b: _Group) -> bool:
    """Append ``b``'s rows to ``a`` (caches of one sequence length); False (nothing changed) when
    a cache layer is of another kind or its tensors do not line up."""
    la_all, lb_all = a.cache.layers, b.cache.layers
    if len(la_all) != len(lb_all):
        return False
    plan = []
    for la, lb in zip(la_all, lb_all):
        names = _ROW_TENSORS.get(type(la).__name__)
        if names is None or type(lb) is not type(la):
            return False
        for name in names:
            x, y = getattr(la, name, None), getattr(lb, name, None)
            if torch.is_tensor(x) and torch.is_tensor(y):
                if x.shape[0] != len(a.branches) or x.shape[1:] != y.shape[1:]:
                    return False
                plan.append((la, name, None, x, y))
            elif isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys():
                for k in x:
                    u, v = x[k], y[k]
                    if not (torch.is_tensor(u) and torch.is_tensor(v)):
                        if u is None and v is None:
                            continue
                        return False
                    if u.shape[0] != len(a.branches) or u.shape[1:] != v.shape[1:]:
                        return False
                    plan.append((la, name, k, u, v))
            elif not (x is None and y is None):
                return False
    for layer, name, key, x, y in plan:
        joined = torch.cat([x, y])
        if key is None:
            setattr(layer, name, joined)
        else:
            getattr(layer, name)[key] = joined
    a.next = torch.cat([a.next, b.next])
    a.branches = a.branches + b.branches
    return True


class _Frontier(Frontier):
    """Ragged branches on groups of one length each (module docstring)."""

    def __init__(self, rollout: TransformersRollout, prompts: Sequence[Sequence[int]]):
        if len(prompts) == 0 or any(len(p) == 0 for p in prompts):
            lengths = sorted({len(p) for p in prompts})
            raise InvalidInputError("prompts", f"a frontier needs non-empty prompts, got lengths {lengths}")
        self.rollout = rollout
        self.tokens = [list(p) for p in prompts]
        self._routes: list[list[torch.Tensor]] = [[] for _ in prompts]
        by_len: dict[int, list[int]] = {}
        for b, p in enumerate(self.tokens):
            by_len.setdefault(len(p), []).append(b)
        self._groups = [self._open(rows) for rows in by_len.values()]

    @property
    def groups(self) -> int:
        """How many groups (caches) the branches are on now."""
        return len(self._groups)

    def _open(self, branches: list[int]) -> _Group:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.rollout.model.config)
        ids = torch.tensor([self.tokens[b] for b in branches], dtype=torch.long)
        logits, cache = self.rollout._logits(ids, cache)
        self._keep_routes(branches)
        return _Group(branches, cache, logits[:, -1])

    def _feed(self, group: _Group, ids: torch.Tensor) -> None:
        logits, group.cache = self.rollout._logits(ids, group.cache)
        self._keep_routes(group.branches)
        group.next = logits[:, -1]

    def _keep_routes(self, branches: list[int]) -> None:
        routes = self.rollout.last_routes
        if routes is not None:
            for r, b in enumerate(branches):
                self._routes[b].append(routes[r])

    def routes(self) -> list[torch.Tensor] | None:
        if not self.rollout.routers:
            return None
        return [torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long) for parts in self._routes]

    def _take(self, group: _Group, branches: list[int]) -> _Group:
        """Split ``branches`` (some of ``group``'s) off into a new group (a copy of their cache);
        ``group`` keeps the others."""
        device = self.rollout.device
        taken = set(branches)
        rows = [r for r, b in enumerate(group.branches) if b in taken]
        keep = [r for r, b in enumerate(group.branches) if b not in taken]
        new = _Group([group.branches[r] for r in rows], copy.deepcopy(group.cache), group.next[rows])
        new.cache.reorder_cache(torch.tensor(rows, dtype=torch.long, device=device))
        group.cache.reorder_cache(torch.tensor(keep, dtype=torch.long, device=device))
        group.next = group.next[keep]
        group.branches = [group.branches[r] for r in keep]
        return new

    def _merge(self) -> None:
        """Join the groups whose branches have one length into one group (their caches'
        rows concatenated), when every cache layer is of a kind whose per-row tensors are known
        (:data:`_ROW_TENSORS`); otherwise the groups stay apart (same results, more forwards)."""
        by_len: dict[int, list[_Group]] = {}
        for g in self._groups:
            by_len.setdefault(len(self.tokens[g.branches[0]]), []).append(g)
        if all(len(gs) == 1 for gs in by_len.values()):
            return
        groups = []
        for gs in by_len.values():
            while len(gs) > 1 and _concat_rows(gs[0], gs[1]):
                gs.pop(1)
            groups.extend(gs)
        self._groups = groups

    def sample(
        self, n: int, generator: torch.Generator, temperature: float = 1.0, stop: Sequence[int] = ()
    ) -> torch.Tensor:
        self._merge()
        stop_set = {int(t) for t in stop}
        out = torch.zeros(len(self.tokens), n, dtype=torch.float64)
        live = list(self._groups)
        for step in range(n):
            if not live:
                break
            order = [b for g in live for b in g.branches]
            logits = live[0].next if len(live) == 1 else torch.cat([g.next for g in live])
            logp = torch.log_softmax(logits / temperature, -1).cpu()
            tok = torch.multinomial(logp.exp(), 1, generator=generator)  # [rows, 1]
            out[order, step] = logp.gather(-1, tok)[:, 0]
            for b, t in zip(order, tok[:, 0].tolist()):
                self.tokens[b].append(t)
            at = 0
            for g in live:
                self._feed(g, tok[at : at + len(g.branches)])
                at += len(g.branches)
            if stop_set:
                still = []
                for g in live:
                    done = [b for b in g.branches if self.tokens[b][-1] in stop_set]
                    if len(done) < len(g.branches):
                        if done:
                            self._groups.append(self._take(g, done))
                        still.append(g)
                live = still
        return out.float()

    def extend(self, rows: Sequence[Sequence[int]]) -> None:
        if len(rows) != len(self.tokens):
            raise InvalidInputError("observations", f"expected {len(self.tokens)} rows, got {len(rows)}")
        for row, r in zip(self.tokens, rows):
            row.extend(int(t) for t in r)
        for g in list(self._groups):
            by_len: dict[int, list[int]] = {}
            for b in g.branches:
                by_len.setdefault(len(rows[b]), []).append(b)
            parts = list(by_len.items())
            split = [(length, self._take(g, idx)) for length, idx in parts[1:]]
            self._groups.extend(part for _, part in split)
            for length, part in [(parts[0][0], g), *split]:
                if length:
                    self._feed(part, torch.tensor([list(rows[b]) for b in part.branches], dtype=torch.long))

    def fork(self, index: Sequence[int]) -> None:
        index = [int(i) for i in index]
        where = {b: (g, r) for g in self._groups for r, b in enumerate(g.branches)}
        picks: dict[int, list[tuple[int, int]]] = {id(g): [] for g in self._groups}
        for j, i in enumerate(index):
            g, r = where[i]
            picks[id(g)].append((j, r))
        groups = []
        for g in self._groups:
            sel = picks[id(g)]
            if not sel:
                continue
            idx = torch.tensor([r for _, r in sel], dtype=torch.long)
            g.cache.reorder_cache(idx.to(self.rollout.device))
            g.next = g.next[idx.to(g.next.device)]
            g.branches = [j for j, _ in sel]
            groups.append(g)
        self._groups = groups
        self.tokens = [list(self.tokens[i]) for i in index]
        self._routes = [list(self._routes[i]) for i in index]
