"""A replica's layout: how its workers hold the model and what each one exchanges, decided once
from the config (``diloco.sharding``, ``diloco.workers_per_replica``; ``streaming.device_globals``
on a GPU) and the worker's rank and device. A worker's parts are built on it in one go
(``runtime.inner_loop.WorkerParts.build``, through :meth:`ReplicaLayout.wrap`), never patched
afterwards, and everything that differs between layouts (which rank owns which state, what an
evaluation must do together, how an inner-optimiser state is loaded) is asked of it: DDP, FSDP
and HSDP (FSDP2 on a 2-D mesh) are its cases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ray_diloco.core.fragments import Fragment
from ray_diloco.core.shards import rank_fragment
from ray_diloco.core.staging import DeviceStaging


@dataclass(frozen=True)
class ReplicaLayout:
    """The layout of one worker's replica.

    Attributes:
        sharded: FSDP2 over the replica's workers (``diloco.sharding: fsdp`` or ``hsdp`` with
            more than one worker): each rank holds its own rows of every parameter.
        world_size: the replica's workers (W). rank: this worker's rank.
        device_globals: a GPU worker keeps device copies of the global fragments
            (``core.staging``; ``streaming.device_globals``).
        shard_size: S, the ranks one copy of the model is sharded over: W under ``fsdp``, the
            shard group under ``hsdp`` (ranks ``g*S ... g*S+S-1`` form group g; the W / S groups
            hold the same rows and all-reduce their gradients), 1 unsharded.
    """

    sharded: bool
    world_size: int
    rank: int
    device_globals: bool
    shard_size: int = 1

    @classmethod
    def of(cls, cfg: Any, world_size: int, rank: int, device: torch.device) -> ReplicaLayout:
        """The layout a worker of ``cfg`` with ``rank`` of ``world_size`` on ``device`` has."""
        sharded = cfg.exchange_units > 1 and world_size > 1
        return cls(
            sharded=sharded,
            world_size=world_size,
            rank=rank,
            device_globals=device.type == "cuda" and cfg.streaming.device_globals,
            shard_size=cfg.exchange_units if sharded else 1,
        )

    @property
    def shard_rank(self) -> int:
        """This worker's rank in its shard group: which rows it holds (0 unsharded)."""
        return self.rank % self.shard_size

    def owner(self, rank: int) -> int:
        """The rank whose own state worker ``rank``'s is a copy of (itself when it :meth:`owns`
        one): DDP rank 0; FSDP itself; HSDP the first shard group's rank holding the same rows."""
        return rank % self.shard_size

    @classmethod
    def of_run(cls, cfg: Any) -> ReplicaLayout:
        """The layout every replica of ``cfg`` has, as the job sees it (rank 0, globals on the
        host): what the checkpoint, the evaluation, the round metrics and joiners ask of it."""
        return cls.of(cfg, cfg.diloco.workers_per_replica, 0, torch.device("cpu"))

    def summary(self, sharding: str) -> str | None:
        """The run header's line on how a replica holds the model (None: unsharded)."""
        if not self.sharded:
            return None
        groups = self.world_size // self.shard_size
        line = f"inside a replica: {sharding}, the model sharded over {self.shard_size} ranks"
        return line + (f", {groups} shard groups all-reducing gradients" if groups > 1 else "")

    def owns(self, rank: int) -> bool:
        """Whether worker ``rank`` holds a part of the replica's state of its own: it sends
        pseudo-gradients, writes and reads its own checkpoint state and hands a joiner's same
        rank its inner-optimiser state (FSDP: every rank, its rows; HSDP: the first shard group's
        ranks, whose rows the other groups hold too; DDP: rank 0, whose state the others copy)."""
        return rank < self.shard_size

    @property
    def units(self) -> int:
        """Exchange units per fragment: S (each rank of a shard group exchanges its own rows)."""
        return self.shard_size

    def loads_own_rows(self, cfg: Any) -> bool:
        """Whether the worker builds its model on the meta device and reads only its own rows of
        ``model.init_from``'s weights once sharded (:meth:`wrap`), never holding the whole model."""
        return self.sharded and bool(cfg.model.init_from)

    def staging(self, device: torch.device) -> DeviceStaging | None:
        """The worker's device staging of the global fragments (None: globals on the host)."""
        return DeviceStaging(device) if self.device_globals else None

    @property
    def sync_rank(self) -> int:
        """The rank this worker's fragment syncs act as (only rank 0 computes and sends a
        pseudo-gradient): sharded, a rank is rank ``g`` (its shard group) of its own rows, so the
        first group sends; otherwise its rank."""
        return self.rank // self.shard_size

    def wrap(self, cfg: Any, model: torch.nn.Module, device: torch.device,
             fragments: list[Fragment]) -> tuple[torch.nn.Module, dict[str, torch.Tensor], list[Fragment]]:  # fmt: skip
        """The model on this layout, once the replica's process group exists: sharded with FSDP2
        (this rank's rows of its parameters and fragments; a model built on the meta device gets
        its rows from ``model.init_from``'s files), wrapped in DDP, or, alone in its replica, as it is. Returns (what the inner loop calls, name -> parameter, the fragments
        this worker exchanges)."""
        if self.sharded:
            from ray_diloco.runtime.fsdp import local_params, shard_model

            shard_model(model, self.world_size, self.shard_size, device, cfg.run.precision == "bf16")
            if next(model.parameters()).is_meta:  # built on meta (model.init_from): this rank's rows read
                from ray_diloco.runtime.fsdp import load_own_rows

                load_own_rows(model, cfg.model.init_from, self.shard_size, self.shard_rank, device)
            mine = [rank_fragment(f, self.shard_size, self.shard_rank) for f in fragments]
            return model, local_params(model), mine
        net: torch.nn.Module = model
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(model, device_ids=[0] if device.type == "cuda" else None)
        return net, dict(model.named_parameters()), fragments

    def own_units(self, per_unit: list[Any]) -> list[Any]:
        """This worker's entries, one per fragment, of a list over the outer exchange's units
        (sharded: unit ``f * S + shard_rank`` is its part of fragment f; otherwise the fragments)."""
        return per_unit[self.shard_rank :: self.shard_size]

    def local_unit(self, unit: int) -> int | None:
        """This worker's fragment index of exchange unit ``unit`` (None: other rows' unit)."""
        return unit // self.shard_size if unit % self.shard_size == self.shard_rank else None

    def eval_min_batches(self, batches: int, device: torch.device) -> int:
        """Forward passes this worker runs at least in an evaluation of ``batches`` of its own:
        sharded, every forward gathers parameters with the replica's other ranks, so as many as
        the rank with the most (an all-reduce over the replica's group); otherwise 0."""
        if not self.sharded:
            return 0
        import torch.distributed as dist

        t = torch.tensor([batches], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def after_eval(self, model: torch.nn.Module) -> None:
        """Sharded: drop the root group's gathered (global) copy, which no backward resharded."""
        if self.sharded:
            model.reshard()  # type: ignore[operator]  # an FSDPModule

    def load_inner_optimizer(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load an inner-optimiser ``state_dict`` as a worker's ``state_dict`` left it (sharded:
        this rank's rows, host copies of its DTensors' shards)."""
        if self.sharded:
            from ray_diloco.runtime.fsdp import optimizer_state_in

            optimizer_state_in(optimizer, state)
        else:
            optimizer.load_state_dict(state)
