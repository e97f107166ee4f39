"""verl's loss on HARTS microbatches (:class:`VerlLoss`, its metric records combined by their own
aggregation) and the full-vocabulary entropy of compact rows (:func:`row_entropy`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric

from harts_runtime.integrations.verl.data import harts_logprobs_to_verl, step_denominators
from harts_runtime.loss.functions import MicrobatchInputs

__all__ = ["VerlLoss", "full_weight", "row_entropy"]


class VerlLoss:
    """A verl ``loss_function(model_output, data, dp_group) -> (loss, metrics)`` as a HARTS loss
    function (:mod:`harts_runtime.loss.functions`) over the gathered ``step``: for each microbatch
    HARTS runs, the rows of its trajectories with verl's global denominators (module docstring,
    step 3), the log-probs in verl's jagged layout; verl's metrics are kept per microbatch
    (:meth:`metrics`), the engine gets the loss alone."""

    def __init__(self, loss_function: Callable, step: TensorDict, *, dp_group=None):
        self.loss_function = loss_function
        self.dp_group = dp_group
        tokens, gbs = step_denominators(step)
        self.step = step = step.copy()  # shallow: the caller's TensorDict keeps its own metadata
        tu.assign_non_tensor(step, dp_size=1, batch_num_tokens=tokens, global_batch_size=gbs)
        ids = step.get("input_ids")
        self.lengths = ids.offsets().diff().cpu()
        self.records: list[dict] = []

    def microbatch_data(self, trajectories) -> TensorDict:
        """The gathered step's rows ``trajectories`` (with the step-level metadata)."""
        idx = torch.as_tensor(np.asarray(trajectories, dtype=np.int64))
        return tu.index_select_tensor_dict(self.step, idx)

    def __call__(self, logprobs: torch.Tensor, inputs: MicrobatchInputs):
        traj = inputs.trajectories.cpu()
        if traj.numel() == 0:
            return logprobs.sum()
        data = self.microbatch_data(traj).to(logprobs.device)
        model_output = {"log_probs": harts_logprobs_to_verl(logprobs, self.lengths[traj])}
        out = self.loss_function(model_output=model_output, data=data, dp_group=self.dp_group)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        self.records.append(dict(metrics or {}))
        return loss

    def metrics(self, group=None) -> dict:
        """verl's metrics of every microbatch of every rank, each :class:`Metric` combined by its
        aggregation into one value (same on every rank), plain values kept as this rank's list.
        Collective over ``group`` when it has more than one rank."""
        records = self.records
        if group is not None and dist.get_world_size(group) > 1:
            every: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, [_plain_record(r) for r in records], group=group)
            gathered = [r for rank_records in every for r in rank_records]
        else:
            gathered = [_plain_record(r) for r in records]
        values: dict = defaultdict(list)
        kinds: dict = {}
        for r in gathered:
            for k, (agg, vs) in r.items():
                if agg is not None:
                    kinds[k] = agg
                    values[k].extend(vs)
        out: dict = {}
        for k, agg in kinds.items():
            out[k] = Metric(aggregation=agg, value=float(Metric._aggregate(values[k], AggregationType(agg))))
        for r in records:
            for k, v in _plain_record(r).items():
                if v[0] is None:
                    out.setdefault(k, []).extend(v[1])
        return out


def _plain_record(metrics: dict) -> dict:
    """``{name: (aggregation or None, [floats])}``: a metrics dict without verl objects (picklable)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, Metric):
            out[k] = (v.aggregation.value, [float(x) for x in v.values])
        elif isinstance(v, (list, tuple)):
            out[k] = (None, [float(x) for x in v])
        else:
            out[k] = (None, [float(v)])
    return out


def full_weight(w: torch.Tensor) -> torch.Tensor:
    """``w`` whole (a DTensor gathered from its shards: collective over its mesh), detached."""
    from torch.distributed.tensor import DTensor

    return (w.full_tensor() if isinstance(w, DTensor) else w).detach()


@torch.no_grad()
def row_entropy(hidden: torch.Tensor, weight: torch.Tensor, rows: int = 2048) -> torch.Tensor:
    """Full-vocabulary entropy ``lse(z) - sum softmax(z) z`` of every row ``z = hidden @ W^T``,
    float32 ``[N]``, ``rows`` rows at a time (temporaries ``[rows, V]`` float32)."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    w = weight.float()
    for a in range(0, hidden.shape[0], rows):
        z = hidden[a : a + rows].float() @ w.T
        lse = torch.logsumexp(z, -1)
        out[a : a + rows] = lse - (torch.softmax(z, -1) * z).sum(-1)
    return out
