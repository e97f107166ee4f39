"""Decoder-only hybrid-attention MoE model on compact rows (paper Sections 4, 5.1, Table 1).

One model, two executions over the same rows abstraction (:class:`~harts_runtime.layout.rows.RowLayout`):

* compact (HARTS): rows are the compact physical rows of one microbatch's call plan; KDA runs the
  plan's rounds with replay and boundary-state handoffs, full attention reads ancestor-KV views,
  MoE routes each row once with its multiplicity weighting the router statistics;
* trajectory (baseline): rows are the microbatch's trajectories expanded and packed back to back;
  KDA runs one packed call from zero states, attention views have no ancestors, multiplicities are 1.

Block ``i`` (pre-norm): ``x += mixer_i(norm(x), layout); x += ffn_i(norm(x), layout)`` with
``mixer_i`` in ``{"kda", "mla", "gqa", "gated_attention", "gdn", "mamba2"}`` and ``ffn_i`` in
``{"dense", "moe", "relu2"}``, either half ``"none"`` (skipped: Nemotron-H's one-sublayer layers), built from the
tables :data:`MIXER_BUILDERS` and :data:`FFN_BUILDERS` (name -> builder of the layer from the
:class:`~harts_runtime.models.hybrid.args.ModelConfig`: each passes its kind's option group,
``config.kda`` / ``.mla`` / ``.gqa`` / ``.gated_attention`` / ``.gdn`` / ``.mamba2`` / ``.moe``, through to the layer's
config with the model-wide values added); any order. Recomputation is block-level
(:func:`harts_runtime.recompute.apply_recompute`); the MoE expert-load counts are accumulated once
per forward, in :meth:`HybridModel.forward_hidden`, outside any checkpoint.

The LM head never materialises ``[C, V]`` logits: :meth:`HybridModel.logprobs` computes the mapped
log-probs of Equation 17 a row chunk at a time and recomputes each chunk's logits in backward
(:func:`harts_runtime.loss.logprobs.lm_head_logprobs`, a fused linear cross-entropy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import torch
from torch import nn
from torch.profiler import record_function

from harts_runtime.errors import InvalidInputError
from harts_runtime.layers.attention import AttentionConfig, CompactAttention
from harts_runtime.layers.ffn import DenseFFN
from harts_runtime.layers.kda import KDAConfig, KDALayer
from harts_runtime.layers.mla import CompactMLA, MLAConfig
from harts_runtime.layers.moe import CompactMoE, MoEConfig, MoEOutput
from harts_runtime.layers.relu2_mlp import Relu2MLP
from harts_runtime.layout.rows import RowLayout, lm_chunks
from harts_runtime.loss.logprobs import lm_head_logprobs
from harts_runtime.models.hybrid.args import ModelConfig
from harts_runtime.modules.fused import use_fla
from harts_runtime.modules.norms import RMSNorm
from harts_runtime.ops.attention import resolve_backend

__all__ = ["FFN_BUILDERS", "MIXER_BUILDERS", "Block", "HybridModel"]


def _kda(cfg: ModelConfig, attn_backend: str) -> nn.Module:
    args = asdict(cfg.kda) | {"num_heads": cfg.kda.num_heads or cfg.num_heads}
    model_wide = dict(conv_size=cfg.conv_size, chunk_size=cfg.chunk_size, backend=cfg.kda_backend)
    return KDALayer(KDAConfig(hidden_size=cfg.hidden_size, **model_wide, **args))


def _mla(cfg: ModelConfig, attn_backend: str) -> nn.Module:
    model_wide = dict(num_heads=cfg.num_heads, rope_theta=cfg.rope_theta, backend=attn_backend)
    return CompactMLA(MLAConfig(hidden_size=cfg.hidden_size, **model_wide, **asdict(cfg.mla)))


def _none(cfg: ModelConfig, *_) -> None:
    """The absent half of a one-sublayer block (Nemotron-H): no module."""
    return None


def _mamba2(cfg: ModelConfig, attn_backend: str) -> nn.Module:
    from harts_runtime.layers.mamba2 import Mamba2Config, Mamba2Mixer  # lazy: optional layer

    model_wide = dict(conv_kernel_size=cfg.conv_size, norm_eps=cfg.norm_eps, backend=cfg.kda_backend)
    return Mamba2Mixer(Mamba2Config(hidden_size=cfg.hidden_size, **model_wide, **asdict(cfg.mamba2)))


def _gqa(cfg: ModelConfig, attn_backend: str) -> nn.Module:
    model_wide = dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, rope_theta=cfg.rope_theta)
    args = asdict(cfg.gqa)
    return CompactAttention(
        AttentionConfig(hidden_size=cfg.hidden_size, backend=attn_backend, **model_wide, **args)
    )


def _gated_attention(cfg: ModelConfig, attn_backend: str) -> nn.Module:
    from harts_runtime.layers.gated_attention import CompactGatedAttention, GatedAttentionConfig

    model_wide = dict(
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        backend=attn_backend,
    )
    args = asdict(cfg.gated_attention)
    return CompactGatedAttention(GatedAttentionConfig(hidden_size=cfg.hidden_size, **model_wide, **args))


def _gdn(cfg: ModelConfig, attn_backend: str) -> nn.Module:
    from harts_runtime.layers.gdn import CompactGatedDeltaNet, GatedDeltaNetConfig  # lazy: optional layer

    model_wide = dict(conv_kernel_size=cfg.conv_size, norm_eps=cfg.norm_eps, backend=cfg.kda_backend)
    return CompactGatedDeltaNet(
        GatedDeltaNetConfig(hidden_size=cfg.hidden_size, **model_wide, **asdict(cfg.gdn))
    )


def _dense(cfg: ModelConfig, layer: int) -> nn.Module:
    return DenseFFN(cfg.hidden_size, cfg.dense_intermediate)


def _per_layer(cfg: ModelConfig, name: str, layer: int) -> float:
    """Layer ``layer``'s entry of the per-layer MoE option ``name`` (none given: 0)."""
    values = getattr(cfg.moe, name)
    if not values:
        return 0.0
    if layer >= len(values):
        raise InvalidInputError(f"moe.{name}", f"has {len(values)} entries, none for layer {layer}")
    return values[layer]


def _moe(cfg: ModelConfig, layer: int) -> nn.Module:
    args = asdict(cfg.moe)
    del args["swiglu_limits"], args["shared_swiglu_limits"]  # per layer: this layer's
    args.update(
        swiglu_limit=_per_layer(cfg, "swiglu_limits", layer),
        shared_swiglu_limit=_per_layer(cfg, "shared_swiglu_limits", layer),
    )
    # counts: HybridModel.forward_hidden counts once, outside recomputation
    return CompactMoE(MoEConfig(hidden_size=cfg.hidden_size, accumulate_counts=False, **args))


MIXER_BUILDERS: dict[str, Callable[[ModelConfig, str], nn.Module]] = {
    "kda": _kda,
    "mla": _mla,
    "gqa": _gqa,
    "gated_attention": _gated_attention,
    "gdn": _gdn,
    "mamba2": _mamba2,
    "none": _none,
}
"""Mixer name -> ``builder(config, attention_backend)`` (one entry per name of ``args.MIXERS``)."""


def _relu2(cfg: ModelConfig, layer: int) -> nn.Module:
    return Relu2MLP(cfg.hidden_size, cfg.dense_intermediate)


FFN_BUILDERS: dict[str, Callable[[ModelConfig, int], nn.Module]] = {
    "dense": _dense,
    "moe": _moe,
    "relu2": _relu2,
    "none": _none,
}
"""FFN name -> ``builder(config, layer index)`` (one entry per name of ``args.FFNS``; the index
picks per-layer options such as ``moe.swiglu_limits``)."""


class Block(nn.Module):
    """Pre-norm block: mixer then FFN, each with a residual. A half of kind ``"none"`` (Nemotron-H's
    one-sublayer layers) has no norm and no module (``mixer`` / ``ffn`` None) and is skipped."""

    def __init__(self, cfg: ModelConfig, mixer: str, ffn: str, attn_backend: str, layer: int = 0):
        super().__init__()
        self.mixer_kind, self.ffn_kind = mixer, ffn  # names, for profiler ranges and reports
        zc = cfg.zero_centered_norms
        self.norm1, self.norm2 = (
            None if kind == "none" else RMSNorm(cfg.hidden_size, cfg.norm_eps, zero_centered=zc)
            for kind in (mixer, ffn)
        )
        self.mixer = MIXER_BUILDERS[mixer](cfg, attn_backend)
        self.ffn = FFN_BUILDERS[ffn](cfg, layer)

    def forward(self, x: torch.Tensor, layout: RowLayout):
        """x [N, D] -> (x [N, D], router_loss scalar fp32, tokens_per_expert [E] or empty)."""
        if self.mixer is not None:
            with record_function(f"harts.mixer.{self.mixer_kind}"):
                x = x + self.mixer(self.norm1(x), layout)
        if self.ffn is None:
            return x, x.new_zeros((), dtype=torch.float32), x.new_zeros(0, dtype=torch.float32)
        h = self.norm2(x)
        with record_function(f"harts.ffn.{self.ffn_kind}"):
            out = self.ffn(h, layout)
        if isinstance(out, MoEOutput):  # an FFN with router statistics
            return x + out.hidden, out.router_loss.float(), out.tokens_per_expert
        return x + out, x.new_zeros((), dtype=torch.float32), x.new_zeros(0, dtype=torch.float32)


class HybridModel(nn.Module):
    """Embedding, blocks, final RMSNorm and an untied LM head [V, D]."""

    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        self.config = c = config
        dev = torch.device(device) if device is not None else torch.device("cpu")
        resolve_backend(c.attn_backend, dev)  # checks the name; "auto" itself is resolved per call
        backend = c.attn_backend  # (ops.attention.compact_attention: this device, the layer's head dims)
        with dev:  # build and initialise on the target device
            self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
            self.blocks = nn.ModuleList(
                Block(c, m, f, backend, i) for i, (m, f) in enumerate(zip(c.mixers, c.ffns))
            )
            self.norm = RMSNorm(c.hidden_size, c.norm_eps, zero_centered=c.zero_centered_norms)
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
            self._init_weights()
        self.to(device=dev, dtype=c.torch_dtype)
        for moe in self.moe_layers():  # expert-load counts and the bias stay fp32 (exact counts)
            moe.expert_bias.data = moe.expert_bias.data.float()
            moe.local_tokens_per_expert.data = moe.local_tokens_per_expert.data.float()
        if c.fp32_params and c.dtype == "bfloat16":  # never narrower than the model dtype
            for name, p in self.named_parameters():
                if name.endswith(c.fp32_params):
                    p.data = p.data.float()

    def _init_weights(self):
        std = self.config.init_std
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=std)
                if getattr(mod, "bias", None) is not None:
                    nn.init.zeros_(mod.bias)

    @property
    def device(self) -> torch.device:
        """Where the microbatches run: the embedding's device, or the compute device that CPU
        offloading recorded (``harts_runtime.parallel.apply_fsdp``: the weights rest on the host)."""
        return self.__dict__.get("_compute_device") or self.embed.weight.device

    def moe_layers(self) -> list[nn.Module]:
        """The blocks' MoE FFNs (modules with expert-load counts), in block order."""
        return [b.ffn for b in self.blocks if hasattr(b.ffn, "local_tokens_per_expert")]

    def forward_hidden(self, layout: RowLayout):
        """Rows -> final normed hidden states.

        Returns ``(hidden [N, D], router_loss)``: ``router_loss`` is the sum over MoE layers of
        their multiplicity-weighted ``aux_coef * aux + z_coef * z`` for this layout's rows (each
        normalised by the layout's semantic-token count, as :mod:`harts_runtime.layers.moe` defines
        it). In training mode the MoE expert-load counts are added to ``local_tokens_per_expert``
        once (a recomputed block does not count twice).
        """
        x = self.embed(layout.need("input_ids"))
        router = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, r, counts = block(x, layout)
            router = router + r
            if counts.numel() and self.training:
                block.ffn.local_tokens_per_expert += counts.detach()
        return self.norm(x), router

    def forward(
        self,
        layout: RowLayout,
        row_index: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        chunks: tuple | None = None,
    ):
        """One microbatch: ``(hidden [N, D], logprobs [P] or None, router_loss)``.

        :meth:`forward_hidden`, then (with ``row_index`` and ``labels``) the mapped log-probs
        :meth:`logprobs` of the layout's rows. Training calls the model through this method, so
        module hooks on the model (FSDP2's root all-gather of the final norm and LM head) run.
        """
        hidden, router = self.forward_hidden(layout)
        lp = None
        if row_index is not None:
            lp = self.logprobs(hidden, row_index, labels, chunks, layout.num_rows)
        return hidden, lp, router

    def logprobs(
        self,
        hidden: torch.Tensor,
        row_index: torch.Tensor,
        labels: torch.Tensor,
        chunks: tuple | None = None,
        num_rows: int | None = None,
    ) -> torch.Tensor:
        """Mapped log-probs ``log_softmax(hidden @ W^T)[row_index, labels]`` (Equation 17) without
        ``[N, V]`` logits; see :func:`harts_runtime.loss.logprobs.lm_head_logprobs`. ``chunks`` from
        :func:`harts_runtime.layout.rows.lm_chunks`.

        A head that provides its own ``mapped_logprobs(hidden, row_index, labels, chunks, rows,
        num_rows)`` (the vocabulary-parallel head installed by ``harts_runtime.parallel``) computes
        them instead; this keeps the single-process path free of any parallel import. ``num_rows``:
        the microbatch's row count N (``hidden`` may hold only this rank's block of it under
        sequence parallelism; the layout's ``num_rows``).
        """
        rows = self.config.lm_head_rows
        head = getattr(self.lm_head, "mapped_logprobs", None)
        if head is not None:
            with record_function("harts.lm_head"):
                return head(hidden, row_index, labels, chunks, rows, num_rows)
        if chunks is None:
            chunks = lm_chunks(row_index.cpu().numpy(), hidden.shape[0], rows)
        with record_function("harts.lm_head"):
            return lm_head_logprobs(
                hidden,
                self.lm_head.weight,
                row_index,
                labels,
                chunks,
                rows,
                fla_kernels=use_fla(hidden, self.config.kda_backend),
            )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits of some rows (evaluation only): [n, D] -> [n, V] in the model dtype (under
        vocabulary parallelism the rows must be the same on every TP rank; the columns are gathered)."""
        return self.lm_head(hidden)

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free bias step of every MoE layer (no-op without ``use_expert_bias``)."""
        for moe in self.moe_layers():
            if moe.config.use_expert_bias:
                moe.update_expert_bias()
