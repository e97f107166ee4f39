"""The regions whose activations recomputation can keep (selective recomputation), named once.

``"attention"``: every full-attention core (:func:`harts_runtime.ops.attention.compact_attention`);
``"linear_attention"``: every chunkwise linear-attention schedule (KDA and Gated DeltaNet:
:func:`harts_runtime.layers.kda.run_kda_schedule`; Mamba2:
:func:`harts_runtime.layers.mamba2.run_ssd_schedule`). :mod:`harts_runtime.ops.keep` marks them;
:class:`harts_runtime.options.ExecutionOptions` checks ``keep`` against them. No torch, no planner.
"""

KEEPABLE = ("attention", "linear_attention")

__all__ = ["KEEPABLE"]
