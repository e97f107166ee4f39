"""Decoder-only hybrid-attention MoE model on compact rows (paper Sections 4, 5.1, Table 1).

One model, two executions over the same rows abstraction (:class:`RowLayout`):

* compact (HARTS): rows are the compact physical rows of one microbatch's call plan; KDA runs the
  plan's rounds with replay and boundary-state handoffs, full attention reads ancestor-KV views,
  MoE routes each row once with its multiplicity weighting the router statistics;
* trajectory (baseline): rows are the microbatch's trajectories expanded and packed back to back;
  KDA runs one packed call from zero states, attention views have no ancestors, multiplicities are 1.

Block ``i`` (pre-norm): ``x += mixer_i(norm(x)); x += ffn_i(norm(x))`` with ``mixer_i`` in
``{"kda", "mla", "gqa"}`` and ``ffn_i`` in ``{"dense", "moe"}``; any order (``ModelConfig.mixers``,
``ModelConfig.ffns``). Full-layer activation recomputation checkpoints each whole block; the MoE
expert-load counts are accumulated once per forward, outside the checkpoint.

Named flavors (:data:`FLAVORS`, :func:`model_config`): ``ling-tiny`` (Table 1; the table does not
give head dims or the MLA ranks, so KDA uses 16 heads of 128 and MLA follows DeepSeek-V2-Lite:
KV rank 512, 128 + 64 query/key dims, 128 value dims; sigmoid routing with an expert bias as in
Ling 2.0) and ``debug`` (tiny, fp32, CPU). ``model_config("ling-tiny", num_layers=8)`` keeps the
first 8 layers of the pattern (2 x (3 KDA + 1 MLA), layer 1 dense) for a smaller GPU run.

The LM head never materialises ``[C, V]`` logits: :class:`ChunkedLMHeadLogProbs` computes the
mapped log-probs of Equation 17 a row chunk at a time and recomputes each chunk's logits in
backward (a fused linear cross-entropy).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from harts_runtime.attention import AttentionConfig, CompactAttention, CompactMLA, MLAConfig
from harts_runtime.kda import KDAConfig, KDAExecutionPlan, KDALayer
from harts_runtime.moe import CompactMoE, MoEConfig
from harts_runtime.views import AttentionViews

__all__ = [
    "FLAVORS",
    "ChunkedLMHeadLogProbs",
    "ConfigError",
    "HybridModel",
    "ModelConfig",
    "RowLayout",
    "model_config",
]

MIXERS = ("kda", "mla", "gqa")
FFNS = ("dense", "moe")


class ConfigError(ValueError):
    """A bad model configuration; ``.field`` names the offending field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass
class ModelConfig:
    """Shape, layer pattern and execution options of a :class:`HybridModel`."""

    vocab_size: int = 64
    """V."""
    hidden_size: int = 32
    """D."""
    mixers: tuple = ("kda", "mla")
    """Token mixer of each layer: ``kda`` (linear), ``mla`` or ``gqa`` (full attention)."""
    ffns: tuple = ("dense", "moe")
    """FFN of each layer: ``dense`` (SwiGLU) or ``moe`` (routed SwiGLU experts)."""
    num_heads: int = 2
    """Attention heads (MLA/GQA query heads and KDA heads)."""
    # KDA
    kda_head_dim: int = 8
    """KDA key and value head dim (the state is K x V per head)."""
    conv_size: int = 4
    """KDA causal convolution width w."""
    chunk_size: int = 8
    """KDA chunk size B (32 or 64 on the Triton path)."""
    # MLA
    kv_lora_rank: int = 16
    """MLA KV latent width."""
    q_lora_rank: int | None = None
    """MLA query latent width (None: direct query projection)."""
    qk_nope_head_dim: int = 8
    """MLA per-head query/key dims without RoPE."""
    qk_rope_head_dim: int = 4
    """MLA per-head query/key dims with RoPE."""
    v_head_dim: int = 8
    """MLA per-head value dim."""
    # GQA
    num_kv_heads: int | None = None
    """GQA KV heads (None: MHA)."""
    rope_theta: float = 10_000.0
    """RoPE base."""
    # FFN
    dense_intermediate: int = 64
    """Dense SwiGLU width."""
    num_experts: int = 4
    """E."""
    top_k: int = 2
    """Experts per row."""
    expert_intermediate: int = 16
    """Expert SwiGLU width."""
    score_func: str = "softmax"
    """Router scores: ``softmax`` or ``sigmoid``."""
    norm_topk_prob: bool = False
    """Renormalise the k selected scores."""
    use_expert_bias: bool = False
    """Aux-loss-free balancing bias (selection only)."""
    aux_loss_coef: float = 1e-2
    """Load-balancing loss weight."""
    z_loss_coef: float = 1e-3
    """Router z-loss weight."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    # execution
    dtype: str = "float32"
    """Parameter and activation dtype: ``float32`` or ``bfloat16`` (KDA states are always fp32)."""
    attn_backend: str = "auto"
    """Full-attention backend (``auto``: ``reference`` on CPU, ``varlen`` on CUDA)."""
    kda_backend: str = "auto"
    """KDA core backend (``auto``: Triton on CUDA, reference on CPU)."""
    lm_head_rows: int = 2048
    """Rows per LM-head chunk (temporaries are ``[rows, V]`` fp32)."""
    init_std: float = 0.02
    """Std of the normal init of linear and embedding weights."""

    def __post_init__(self):
        self.mixers, self.ffns = tuple(self.mixers), tuple(self.ffns)
        if not self.mixers:
            raise ConfigError("mixers", "needs at least one layer")
        if len(self.mixers) != len(self.ffns):
            raise ConfigError("ffns", f"needs one entry per layer ({len(self.mixers)}), got {len(self.ffns)}")
        for i, m in enumerate(self.mixers):
            if m not in MIXERS:
                raise ConfigError(f"mixers[{i}]", f"unknown {m!r}; choose one of {MIXERS}")
        for i, f in enumerate(self.ffns):
            if f not in FFNS:
                raise ConfigError(f"ffns[{i}]", f"unknown {f!r}; choose one of {FFNS}")
        if self.dtype not in ("float32", "bfloat16", "float64"):
            raise ConfigError("dtype", f"choose float32, bfloat16 or float64, got {self.dtype!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_heads",
            "kda_head_dim",
            "conv_size",
            "chunk_size",
            "lm_head_rows",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if "moe" in self.ffns and not 1 <= self.top_k <= self.num_experts:
            raise ConfigError("top_k", f"must be in [1, num_experts={self.num_experts}], got {self.top_k}")

    @property
    def num_layers(self) -> int:
        return len(self.mixers)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _ling_tiny(num_layers: int = 24) -> ModelConfig:
    mixers = (("kda",) * 3 + ("mla",)) * 6
    return ModelConfig(
        vocab_size=157_184,
        hidden_size=1536,
        mixers=mixers[:num_layers],
        ffns=(("dense",) + ("moe",) * 23)[:num_layers],
        num_heads=16,
        kda_head_dim=128,
        conv_size=4,
        chunk_size=64,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        dense_intermediate=4608,
        num_experts=128,
        top_k=8,
        expert_intermediate=512,
        score_func="sigmoid",
        norm_topk_prob=True,
        use_expert_bias=True,
        aux_loss_coef=0.0,
        z_loss_coef=1e-6,
        dtype="bfloat16",
        lm_head_rows=2048,
    )


def _debug(num_layers: int = 4) -> ModelConfig:
    mixers = ("kda", "mla", "kda", "gqa")
    return ModelConfig(
        vocab_size=512,
        mixers=(mixers * 8)[:num_layers],
        ffns=(("dense", "moe", "moe", "dense") * 8)[:num_layers],
        num_kv_heads=1,
        lm_head_rows=16,
    )


FLAVORS = {"ling-tiny": _ling_tiny, "debug": _debug}
"""Named flavors: a function of ``num_layers`` returning a :class:`ModelConfig`."""


def model_config(flavor: str, num_layers: int | None = None, **overrides) -> ModelConfig:
    """The config of a named flavor, optionally cut to its first ``num_layers`` layers.

    Raises :class:`ConfigError` naming ``flavor``, ``num_layers`` or an override field.
    """
    if flavor not in FLAVORS:
        raise ConfigError("flavor", f"unknown {flavor!r}; choose one of {sorted(FLAVORS)}")
    cfg = FLAVORS[flavor]() if num_layers is None else FLAVORS[flavor](num_layers)
    if num_layers is not None and (num_layers < 1 or cfg.num_layers != num_layers):
        raise ConfigError(
            "num_layers", f"flavor {flavor!r} supports 1..{cfg.num_layers} layers, got {num_layers}"
        )
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    for name in overrides:
        if name not in known:
            raise ConfigError(name, "not a ModelConfig field")
    return cfg.replace(**overrides) if overrides else cfg


# ------------------------------------------------------------------------------- layouts
@dataclass
class RowLayout:
    """Everything the model needs about one microbatch's rows, built once on the host and moved
    to the device once; shared by every layer and by recomputation.

    ``N`` rows (compact physical rows, or expanded trajectory rows).
    """

    input_ids: torch.Tensor  # [N] int64 token of each row
    positions: torch.Tensor  # [N] int64 absolute trajectory position (RoPE)
    multiplicity: torch.Tensor  # [N] float32 semantic positions per row (MoE statistics)
    kda: KDAExecutionPlan  # KDA rounds (trivial: one packed call) and conv windows
    views: AttentionViews  # full-attention Q / ancestor-KV views
    info: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device) -> RowLayout:
        return RowLayout(
            self.input_ids.to(device, non_blocking=True),
            self.positions.to(device, non_blocking=True),
            self.multiplicity.to(device, non_blocking=True),
            self.kda.to(device),
            self.views.to(device),
            dict(self.info),
        )


# ------------------------------------------------------------------------------- modules
class RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class DenseFFN(nn.Module):
    """SwiGLU FFN."""

    def __init__(self, d: int, inter: int):
        super().__init__()
        self.gate = nn.Linear(d, inter, bias=False)
        self.up = nn.Linear(d, inter, bias=False)
        self.down = nn.Linear(inter, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm block: mixer then FFN, each with a residual."""

    def __init__(self, cfg: ModelConfig, mixer: str, ffn: str, attn_backend: str):
        super().__init__()
        self.mixer_kind, self.ffn_kind = mixer, ffn
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if mixer == "kda":
            self.mixer = KDALayer(
                KDAConfig(
                    cfg.hidden_size,
                    cfg.num_heads,
                    cfg.kda_head_dim,
                    cfg.kda_head_dim,
                    cfg.conv_size,
                    cfg.chunk_size,
                    backend=cfg.kda_backend,
                )
            )
        elif mixer == "mla":
            self.mixer = CompactMLA(
                MLAConfig(
                    cfg.hidden_size,
                    cfg.num_heads,
                    cfg.kv_lora_rank,
                    cfg.qk_nope_head_dim,
                    cfg.qk_rope_head_dim,
                    cfg.v_head_dim,
                    cfg.q_lora_rank,
                    cfg.rope_theta,
                    backend=attn_backend,
                )
            )
        else:
            self.mixer = CompactAttention(
                AttentionConfig(
                    cfg.hidden_size,
                    cfg.num_heads,
                    cfg.num_kv_heads,
                    rope_theta=cfg.rope_theta,
                    backend=attn_backend,
                )
            )
        if ffn == "dense":
            self.ffn = DenseFFN(cfg.hidden_size, cfg.dense_intermediate)
        else:
            self.ffn = CompactMoE(
                MoEConfig(
                    cfg.hidden_size,
                    cfg.num_experts,
                    cfg.top_k,
                    cfg.expert_intermediate,
                    cfg.score_func,
                    cfg.norm_topk_prob,
                    1.0,
                    cfg.use_expert_bias,
                    aux_loss_coef=cfg.aux_loss_coef,
                    z_loss_coef=cfg.z_loss_coef,
                )
            )

    def forward(self, x: torch.Tensor, layout: RowLayout, no_replay: bool):
        """x [N, D] -> (x [N, D], router_loss scalar fp32, tokens_per_expert [E] or empty)."""
        h = self.norm1(x)
        with record_function(f"harts.mixer.{self.mixer_kind}"):
            if self.mixer_kind == "kda":
                h = self.mixer(h, layout.kda, no_replay=no_replay, recompute=False)
            else:
                h = self.mixer(h, layout.views, layout.positions)
        x = x + h
        h = self.norm2(x)
        with record_function(f"harts.ffn.{self.ffn_kind}"):
            if self.ffn_kind == "moe":
                out = self.ffn(h, layout.multiplicity, count=False)
                return x + out.hidden, out.router_loss.float(), out.tokens_per_expert
            zero = x.new_zeros((), dtype=torch.float32)
            return x + self.ffn(h), zero, x.new_zeros(0, dtype=torch.float32)


class HybridModel(nn.Module):
    """Embedding, blocks, final RMSNorm and an untied LM head [V, D]."""

    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        self.config = c = config
        dev = torch.device(device) if device is not None else torch.device("cpu")
        backend = c.attn_backend
        if backend == "auto":
            backend = "varlen" if dev.type == "cuda" else "reference"
        with dev:  # build and initialise on the target device
            self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
            self.blocks = nn.ModuleList(Block(c, m, f, backend) for m, f in zip(c.mixers, c.ffns))
            self.norm = RMSNorm(c.hidden_size, c.norm_eps)
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
            self._init_weights()
        self.to(device=dev, dtype=c.torch_dtype)
        for block in self.blocks:  # expert-load counts and the bias stay fp32 (exact counts)
            if block.ffn_kind == "moe":
                block.ffn.expert_bias.data = block.ffn.expert_bias.data.float()
                block.ffn.local_tokens_per_expert.data = block.ffn.local_tokens_per_expert.data.float()

    def _init_weights(self):
        std = self.config.init_std
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=std)
                if getattr(mod, "bias", None) is not None:
                    nn.init.zeros_(mod.bias)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def forward_hidden(self, layout: RowLayout, *, recompute: bool = False, no_replay: bool = False):
        """Rows -> final normed hidden states.

        Returns ``(hidden [N, D], router_loss)``: ``router_loss`` is the sum over MoE layers of
        their multiplicity-weighted ``aux_coef * aux + z_coef * z`` for this layout's rows (each
        normalised by the layout's semantic-token count, as :mod:`harts_runtime.moe` defines it).
        In training mode the MoE expert-load counts are added to ``local_tokens_per_expert`` once.
        """
        x = self.embed(layout.input_ids)
        router = x.new_zeros((), dtype=torch.float32)
        use_ckpt = recompute and torch.is_grad_enabled()
        for block in self.blocks:
            if use_ckpt:
                x, r, counts = checkpoint(block, x, layout, no_replay, use_reentrant=False)
            else:
                x, r, counts = block(x, layout, no_replay)
            router = router + r
            if block.ffn_kind == "moe" and self.training:
                block.ffn.local_tokens_per_expert += counts.detach()
        return self.norm(x), router

    def logprobs(
        self, hidden: torch.Tensor, row_index: torch.Tensor, labels: torch.Tensor, chunks: list | None = None
    ) -> torch.Tensor:
        """Mapped log-probs ``log_softmax(hidden @ W^T)[row_index, labels]`` (Equation 17) without
        ``[N, V]`` logits; see :class:`ChunkedLMHeadLogProbs`. ``chunks`` from :func:`lm_chunks`.

        A head that provides its own ``mapped_logprobs(hidden, row_index, labels, chunks, rows)``
        (the vocabulary-parallel head installed by ``harts_runtime.parallel``) computes them instead;
        this keeps the single-process path free of any parallel import.
        """
        head = getattr(self.lm_head, "mapped_logprobs", None)
        if head is not None:
            with record_function("harts.lm_head"):
                return head(hidden, row_index, labels, chunks, self.config.lm_head_rows)
        if chunks is None:
            chunks = lm_chunks(row_index.cpu().numpy(), hidden.shape[0], self.config.lm_head_rows)
        order, bounds = chunks[0].to(hidden.device), chunks[1]
        with record_function("harts.lm_head"):
            return ChunkedLMHeadLogProbs.apply(
                hidden, self.lm_head.weight, row_index, labels, order, bounds, self.config.lm_head_rows
            )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits of some rows (evaluation only): [n, D] -> [n, V] in the model dtype (under
        vocabulary parallelism the rows must be the same on every TP rank; the columns are gathered)."""
        return self.lm_head(hidden)

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free bias step of every MoE layer (no-op without ``use_expert_bias``)."""
        for block in self.blocks:
            if block.ffn_kind == "moe" and block.ffn.config.use_expert_bias:
                block.ffn.update_expert_bias()


def lm_chunks(row_index: np.ndarray, num_rows: int, rows_per_chunk: int):
    """Host precomputation for :class:`ChunkedLMHeadLogProbs`: targets sorted by row and the
    target range of every row chunk. Returns ``(order int64 Tensor [P], bounds list[int])``."""
    row_index = np.asarray(row_index, dtype=np.int64)
    order = np.argsort(row_index, kind="stable")
    edges = np.arange(0, num_rows + rows_per_chunk, rows_per_chunk)
    bounds = np.searchsorted(row_index[order], edges, side="left").tolist()
    return torch.from_numpy(order), bounds


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class ChunkedLMHeadLogProbs(torch.autograd.Function):
    """``lp[i] = z[r_i, y_i] - logsumexp(z[r_i])`` with ``z = hidden @ W^T``, row chunk by row chunk.

    forward(hidden [N, D], weight [V, D], row_index [P], labels [P], order [P], bounds, rows)
    -> float32 [P]. Logits are computed in the model dtype and reduced in float32 (as
    :class:`harts_runtime.logprobs.MappedLogProbs` on materialised logits). Backward recomputes
    each chunk's logits; ``dz = (onehot-sum - rowgrad * softmax)`` per chunk, then
    ``dhidden = dz @ W`` and ``dW += dz^T @ hidden`` (fp32 accumulation).
    """

    @staticmethod
    def forward(ctx, hidden, weight, row_index, labels, order, bounds, rows):
        acc = _acc_dtype(hidden.dtype)
        out = torch.empty(row_index.numel(), device=hidden.device, dtype=acc)
        n = hidden.shape[0]
        lse_all = torch.empty(n, device=hidden.device, dtype=acc)
        for i, a in enumerate(range(0, n, rows)):
            z = (hidden[a : a + rows] @ weight.t()).to(acc)  # [r, V]
            lse = torch.logsumexp(z, -1)
            lse_all[a : a + rows] = lse
            lo, hi = bounds[i], bounds[i + 1]
            if hi > lo:
                sel = order[lo:hi]
                r = row_index[sel] - a
                out[sel] = z[r, labels[sel]] - lse[r]
        ctx.save_for_backward(hidden, weight, row_index, labels, order, lse_all)
        ctx.bounds, ctx.rows = bounds, rows
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, row_index, labels, order, lse_all = ctx.saved_tensors
        bounds, rows = ctx.bounds, ctx.rows
        acc = _acc_dtype(hidden.dtype)
        g = grad.to(acc)
        n = hidden.shape[0]
        row_grad = torch.zeros(n, device=hidden.device, dtype=acc).index_add_(0, row_index, g)
        dh = torch.empty_like(hidden)
        dw = torch.zeros(weight.shape, device=weight.device, dtype=acc)
        for i, a in enumerate(range(0, n, rows)):
            h = hidden[a : a + rows]
            z = (h @ weight.t()).to(acc)
            d = torch.exp(z - lse_all[a : a + rows, None]).mul_(-row_grad[a : a + rows, None])
            lo, hi = bounds[i], bounds[i + 1]
            if hi > lo:
                sel = order[lo:hi]
                d.index_put_((row_index[sel] - a, labels[sel]), g[sel], accumulate=True)
            d = d.to(hidden.dtype)
            dh[a : a + rows] = d @ weight
            dw.add_((d.t() @ h).to(acc))
        return dh, dw.to(weight.dtype), None, None, None, None, None
