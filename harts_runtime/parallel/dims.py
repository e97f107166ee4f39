"""Parallel degrees and their process groups (paper Section 2.4, 4.3).

Glossary
--------
* ``dp``: data-parallel degree; a *DP replica* is one logical model copy that receives one local
  microbatch per slot of the step plan (:class:`harts_planner.StepPlan`, ``replica``/``slot``).
* ``tp``: tensor-parallel degree; the ranks of a TP group jointly execute one microbatch of one
  replica (heads and vocabulary are sharded; with sequence parallelism the compact physical rows).
* ``ep``: expert-parallel degree; each rank of an EP group holds ``num_experts / ep`` experts and
  exchanges compact rows with its group (all-to-all). EP groups are formed from DP replicas at the
  same TP rank (``ep`` divides ``dp``), as in Megatron with ``expert_tensor_parallel_size = 1``.
* ``pp``: pipeline-parallel degree; must be 1 for now (planned; see ``docs/parallel.md``).

Rank layout (the torchtitan / Megatron order, TP fastest)::

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

so the ``tp`` ranks of one replica are adjacent (one NVLink island), and the EP group of a rank is the
``ep`` consecutive DP ranks sharing its TP rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harts_runtime.errors import ParallelConfigError

__all__ = ["ParallelConfigError", "ParallelDims", "ParallelGroups"]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallelism; validates itself on construction.

    ``world_size`` must equal ``dp * tp * pp`` (EP reuses DP ranks, it does not multiply the world).
    """

    dp: int = 1
    """Data-parallel replicas D (= the step plan's ``dp_size``)."""
    tp: int = 1
    """Tensor-parallel degree (heads, vocabulary, and rows under sequence parallelism)."""
    ep: int = 1
    """Expert-parallel degree; divides ``dp``."""
    pp: int = 1
    """Pipeline stages; only 1 is supported (pipeline parallelism is planned)."""
    world_size: int = 1
    """Processes in the job (``torch.distributed.get_world_size()``)."""
    sequence_parallel: bool = False
    """Split the compact physical rows across the TP group between TP regions (needs ``tp > 1``)."""

    def __post_init__(self):
        for name in ("dp", "tp", "ep", "pp", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ParallelConfigError(name, f"must be an integer, got {value!r}")
            if value < 1:
                raise ParallelConfigError(name, f"must be >= 1, got {value}")
        if self.pp != 1:
            raise ParallelConfigError(
                "pp",
                f"pipeline parallelism is not implemented yet (got pp={self.pp}); "
                "see docs/parallel.md for what it needs",
            )
        if self.dp * self.tp * self.pp != self.world_size:
            raise ParallelConfigError(
                "world_size", f"{self.world_size} != dp * tp * pp = {self.dp} * {self.tp} * {self.pp}"
            )
        if self.dp % self.ep:
            raise ParallelConfigError(
                "ep", f"{self.ep} does not divide dp={self.dp} (EP groups are formed from DP replicas)"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ParallelConfigError("sequence_parallel", "needs tp > 1")

    # ------------------------------------------------------------------ coordinates
    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp", "dp", "tp", "ep"}`` coordinates of ``rank`` (``ep`` is the rank inside its EP group)."""
        if not 0 <= rank < self.world_size:
            raise ParallelConfigError("rank", f"{rank} is outside [0, {self.world_size})")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank, "ep": dp_rank % self.ep}

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def group_ranks(self) -> dict[str, list[list[int]]]:
        """Every group of every kind as lists of global ranks (each rank in exactly one group per kind).

        ``dp``: same (pp, tp), all replicas. ``tp``: same (pp, dp). ``ep``: ``ep`` consecutive replicas
        at the same (pp, tp). ``edp`` (expert data parallel): replicas holding the same expert shard.
        """
        out: dict[str, list[list[int]]] = {"dp": [], "tp": [], "ep": [], "edp": []}
        for p in range(self.pp):
            for t in range(self.tp):
                out["dp"].append([self.rank_of(p, d, t) for d in range(self.dp)])
                for g in range(self.dp // self.ep):
                    out["ep"].append([self.rank_of(p, g * self.ep + e, t) for e in range(self.ep)])
                for e in range(self.ep):
                    out["edp"].append(
                        [self.rank_of(p, g * self.ep + e, t) for g in range(self.dp // self.ep)]
                    )
            for d in range(self.dp):
                out["tp"].append([self.rank_of(p, d, t) for t in range(self.tp)])
        return out

    def build_groups(self, rank: int | None = None) -> ParallelGroups:
        """Create the process groups with ``torch.distributed.new_group`` (collective: every rank
        must call it, in the same order). Needs an initialised default process group whose world
        size equals ``world_size``."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ParallelConfigError("world_size", "torch.distributed is not initialised")
        if dist.get_world_size() != self.world_size:
            raise ParallelConfigError(
                "world_size", f"{self.world_size} != the process group's {dist.get_world_size()}"
            )
        rank = dist.get_rank() if rank is None else rank
        mine = {}
        for kind, groups in self.group_ranks().items():
            for ranks in groups:
                g = dist.new_group(ranks)  # every rank creates every group, same order
                if rank in ranks:
                    mine[kind] = (g, ranks)
        return ParallelGroups(
            self, rank, **{k: v[0] for k, v in mine.items()}, ranks={k: v[1] for k, v in mine.items()}
        )


@dataclass
class ParallelGroups:
    """The process groups of one rank (``None``-free; a group of size 1 still exists)."""

    dims: ParallelDims
    rank: int
    dp: object
    """All replicas at this rank's (pp, tp): dense-parameter gradient all-reduce."""
    tp: object
    """This replica's TP ranks."""
    ep: object
    """This rank's EP group (token all-to-all)."""
    edp: object
    """Replicas holding the same expert shard: expert-parameter gradient all-reduce."""
    ranks: dict = field(default_factory=dict)
    """Global ranks of each group, by kind."""

    @property
    def coords(self) -> dict[str, int]:
        return self.dims.coords(self.rank)

    @property
    def dp_rank(self) -> int:
        """This rank's DP replica index (= the step plan's ``replica``)."""
        return self.coords["dp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def ep_rank(self) -> int:
        return self.coords["ep"]
