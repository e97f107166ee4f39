"""Parallel degrees and their device meshes (paper Sections 2.4, 4.3).

Glossary
--------
* ``dp_replicate`` x ``dp_shard`` = ``dp``: the data-parallel degree D of the step plan; a *DP
  replica* is one logical model copy that receives one local microbatch per slot of the step plan
  (:class:`harts_planner.StepPlan` ``replica`` / ``slot``). FSDP2 shards parameters, gradients and
  optimizer state over ``dp_shard`` and replicates them over ``dp_replicate`` (HSDP when both are
  > 1).
* ``tp``: tensor-parallel degree; the ranks of a TP group jointly execute one microbatch of one
  replica (heads, the FFN width and the vocabulary are sharded; with sequence parallelism also
  the compact physical rows between TP regions).
* ``ep``: expert-parallel degree; each rank of an EP group holds ``num_experts / ep`` routed
  experts and exchanges compact rows with its group (all-to-all). EP groups are ``ep``
  consecutive ``dp_shard`` ranks at one TP rank (``ep`` divides ``dp_shard``); the routed experts
  are FSDP-sharded over the rest, ``efsdp = dp_shard / ep``, as torchtitan does for MoE.
* ``cp``: context-parallel degree C; the ranks of a CP group jointly execute one microbatch of
  one replica (up to ``C x T`` compact rows): each holds a block of its rows for everything
  row-local and runs the mixers on ``1 / C`` of their heads over all rows
  (:mod:`harts_runtime.parallel.context`). Parameters are FSDP-sharded over ``dp_shard x cp``.
* ``pp``: pipeline stages; must be 1 for now (``docs/parallel.md`` says how it will fit).

Meshes (:meth:`ParallelDims.build_mesh`), TP fastest, as torchtitan and Megatron order them::

    dense  ("dp_replicate", "dp_shard", "cp", "tp")        rank = ((r * dp_shard + s) * cp + c) * tp + t
    expert ("dp_replicate", "efsdp", "cp", "ep", "tp")     s = f * ep + e

Both meshes cover the same ranks, so the ``tp`` ranks of a replica are adjacent (one NVLink
island), then its ``cp`` ranks; an EP group is ``ep`` ranks of one ``(cp, tp)`` coordinate. The
dense mesh also has the flattened ``"dp"`` (``dp_replicate x dp_shard``) and ``"dp_shard_cp"``
(what FSDP2 shards over), the expert mesh ``"efsdp_cp"``. Pipeline parallelism will add an outer
``pp`` dimension without changing the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

from harts_runtime.errors import ParallelConfigError

__all__ = ["ParallelConfigError", "ParallelDims", "ParallelMesh"]

_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "ep", "pp", "world_size")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallelism; validates itself on construction (every error names its field).

    ``world_size`` must equal ``dp_replicate * dp_shard * cp * tp * pp``; EP borrows ``dp_shard``
    ranks, it does not multiply the world.
    """

    dp_replicate: int = 1
    """HSDP replica groups: parameters are replicated over this dimension."""
    dp_shard: int = 1
    """FSDP degree: parameters, gradients and optimizer state are sharded over this dimension."""
    cp: int = 1
    """Context-parallel degree C: one microbatch of up to ``C x T`` rows runs on C ranks (rows split
    between them, mixer heads split between them)."""
    tp: int = 1
    """Tensor-parallel degree (heads, FFN width, vocabulary; rows under sequence parallelism)."""
    ep: int = 1
    """Expert-parallel degree; divides ``dp_shard``."""
    pp: int = 1
    """Pipeline stages; only 1 (pipeline parallelism is planned)."""
    world_size: int = 1
    """Processes in the job (``torch.distributed.get_world_size()``)."""
    sequence_parallel: bool = False
    """Split the compact physical rows across the TP group between TP regions (needs ``tp > 1``)."""

    def __post_init__(self):
        for name in _DEGREES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ParallelConfigError(name, f"must be an integer, got {value!r}")
            if value < 1:
                raise ParallelConfigError(name, f"must be >= 1, got {value}")
        if self.pp != 1:
            raise ParallelConfigError(
                "pp",
                f"pipeline parallelism is not implemented yet (got pp={self.pp}); "
                "see docs/parallel.md for how it will fit",
            )
        want = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if want != self.world_size:
            raise ParallelConfigError(
                "cp" if self.cp > 1 and self.world_size % self.cp else "world_size",
                f"world_size {self.world_size} != dp_replicate * dp_shard * cp * tp * pp = "
                f"{self.dp_replicate} * {self.dp_shard} * {self.cp} * {self.tp} * {self.pp} = {want}",
            )
        if self.dp_shard % self.ep:
            raise ParallelConfigError(
                "ep",
                f"{self.ep} does not divide dp_shard={self.dp_shard} (EP groups are made of dp_shard ranks)",
            )
        if not isinstance(self.sequence_parallel, bool):
            raise ParallelConfigError("sequence_parallel", f"must be a bool, got {self.sequence_parallel!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ParallelConfigError("sequence_parallel", "needs tp > 1")

    @property
    def dp(self) -> int:
        """D = ``dp_replicate * dp_shard``: the step plan's ``dp_size``."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """FSDP degree of the routed experts: ``dp_shard / ep``."""
        return self.dp_shard // self.ep

    @classmethod
    def from_world(
        cls, world_size: int, *, tp: int = 1, ep: int = 1, dp_replicate: int = 1, cp: int = 1, **kw
    ):
        """The dims with ``dp_shard`` filled in from the world size (``world / (dp_replicate * cp *
        tp)``)."""
        for name, v in (("world_size", world_size), ("tp", tp), ("dp_replicate", dp_replicate), ("cp", cp)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ParallelConfigError(name, f"must be an integer >= 1, got {v!r}")
        if world_size % cp:
            raise ParallelConfigError("cp", f"{cp} does not divide the world size {world_size}")
        if world_size % (dp_replicate * cp * tp):
            raise ParallelConfigError(
                "world_size",
                f"{world_size} is not divisible by dp_replicate * cp * tp = {dp_replicate * cp * tp}",
            )
        return cls(
            dp_replicate=dp_replicate,
            dp_shard=world_size // (dp_replicate * cp * tp),
            cp=cp,
            tp=tp,
            ep=ep,
            world_size=world_size,
            **kw,
        )

    # ------------------------------------------------------------------ coordinates
    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of ``rank``: ``dp_replicate``, ``dp_shard``, ``tp``, ``efsdp``, ``ep``,
        ``replica`` (the DP replica index, ``dp_replicate * dp_shard + dp_shard``) and, with
        ``cp > 1``, ``cp``."""
        if not 0 <= rank < self.world_size:
            raise ParallelConfigError("rank", f"{rank} is outside [0, {self.world_size})")
        t = rank % self.tp
        c = (rank // self.tp) % self.cp
        s = (rank // (self.tp * self.cp)) % self.dp_shard
        r = rank // (self.tp * self.cp * self.dp_shard)
        out = {
            "dp_replicate": r,
            "dp_shard": s,
            "tp": t,
            "efsdp": s // self.ep,
            "ep": s % self.ep,
            "replica": r * self.dp_shard + s,
        }
        if self.cp > 1:
            out["cp"] = c
        return out

    def build_mesh(self, device_type: str | None = None) -> ParallelMesh:
        """Create the dense and (with ``ep > 1``) expert device meshes. Collective: every rank calls
        it. Needs an initialised default process group of ``world_size`` ranks; ``device_type``
        defaults to ``"cuda"`` with NCCL, else ``"cpu"``."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if not dist.is_initialized():
            raise ParallelConfigError("world_size", "torch.distributed is not initialised")
        if dist.get_world_size() != self.world_size:
            raise ParallelConfigError(
                "world_size", f"{self.world_size} != the process group's {dist.get_world_size()}"
            )
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        names = ("dp_replicate", "dp_shard", "cp", "tp")
        dense = init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard, self.cp, self.tp), mesh_dim_names=names
        )
        dense[("dp_replicate", "dp_shard")]._flatten("dp")
        dense[("dp_shard", "cp")]._flatten("dp_shard_cp")
        expert = None
        if self.ep > 1:
            ranks = torch.arange(self.world_size).view(
                self.dp_replicate, self.efsdp, self.ep, self.cp, self.tp
            )
            ranks = ranks.permute(0, 1, 3, 2, 4).contiguous()  # (r, f, c, e, t): efsdp next to cp
            expert = DeviceMesh(
                device_type, ranks, mesh_dim_names=("dp_replicate", "efsdp", "cp", "ep", "tp")
            )
            expert[("efsdp", "cp")]._flatten("efsdp_cp")
        return ParallelMesh(self, dense, expert)


@dataclass
class ParallelMesh:
    """The device meshes of one job (:meth:`ParallelDims.build_mesh`)."""

    dims: ParallelDims
    dense: DeviceMesh
    """DeviceMesh ``("dp_replicate", "dp_shard", "cp", "tp")`` (with the flattened ``"dp"`` and
    ``"dp_shard_cp"``)."""
    expert: DeviceMesh | None = None
    """DeviceMesh ``("dp_replicate", "efsdp", "cp", "ep", "tp")`` (with ``"efsdp_cp"``), or None
    without EP."""

    @property
    def rank(self) -> int:
        return self.dense.get_rank()

    @property
    def coords(self) -> dict[str, int]:
        return self.dims.coords(self.rank)

    @property
    def replica(self) -> int:
        """This rank's DP replica index (= the step plan's ``replica``)."""
        return self.coords["replica"]

    @property
    def tp(self) -> DeviceMesh:
        """The TP submesh (1-D)."""
        return self.dense["tp"]

    @property
    def cp(self) -> DeviceMesh:
        """The CP submesh (1-D): the ranks that run one microbatch together."""
        return self.dense["cp"]

    @property
    def dp(self) -> DeviceMesh:
        """All DP ranks at this rank's TP coordinate (1-D, flattened ``dp_replicate`` x ``dp_shard``):
        the group over which replicas' losses and expert-load counts are summed."""
        return self.dense["dp"]

    def fsdp(self) -> DeviceMesh:
        """The mesh FSDP2 shards dense parameters over: ``dp_shard`` (``dp_shard x cp`` flattened
        under CP: each CP rank's gradients are partial), or with ``dp_replicate`` that and
        ``dp_replicate`` (HSDP)."""
        shard = "dp_shard_cp" if self.dims.cp > 1 else "dp_shard"
        if self.dims.dp_replicate > 1:
            return self.dense[("dp_replicate", shard)]
        return self.dense[shard]

    def expert_fsdp(self) -> DeviceMesh:
        """The mesh FSDP2 shards the MoE layers over under EP: ``efsdp`` (``efsdp x cp`` under CP;
        HSDP with ``dp_replicate``)."""
        assert self.expert is not None, "no expert mesh without EP"
        shard = "efsdp_cp" if self.dims.cp > 1 else "efsdp"
        if self.dims.dp_replicate > 1:
            return self.expert[("dp_replicate", shard)]
        return self.expert[shard]

    def expert_spmd(self) -> DeviceMesh:
        """The mesh the MoE parameters are DTensors on under EP: ``ep`` (``(ep, tp)`` with TP)."""
        assert self.expert is not None, "no expert mesh without EP"
        return self.expert[("ep", "tp")] if self.dims.tp > 1 else self.expert["ep"]
