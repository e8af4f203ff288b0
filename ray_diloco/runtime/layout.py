"""A replica's layout: how its workers hold the model and what each one exchanges, decided once
from the config (``diloco.sharding``, ``diloco.workers_per_replica``; ``streaming.device_globals``
on a GPU) and the worker's rank and device. A worker's parts are built on it in one go
(``runtime.inner_loop.WorkerParts.build``, through :meth:`ReplicaLayout.wrap`), never patched
afterwards, and everything that differs between layouts (which rank owns which state, what an
evaluation must do together, how an inner-optimiser state is loaded) is asked of it. A new layout
(HSDP) is one more case here."""

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
        sharded: FSDP2 over the replica's workers (``diloco.sharding: fsdp`` with more than one
            worker): each rank holds and exchanges its own rows of every fragment.
        world_size: the replica's workers. rank: this worker's rank.
        device_globals: a GPU worker keeps device copies of the global fragments
            (``core.staging``; ``streaming.device_globals``).
    """

    sharded: bool
    world_size: int
    rank: int
    device_globals: bool

    @classmethod
    def of(cls, cfg: Any, world_size: int, rank: int, device: torch.device) -> ReplicaLayout:
        """The layout a worker of ``cfg`` with ``rank`` of ``world_size`` on ``device`` has."""
        return cls(
            sharded=cfg.exchange_units > 1 and world_size > 1,
            world_size=world_size,
            rank=rank,
            device_globals=device.type == "cuda" and cfg.streaming.device_globals,
        )

    @classmethod
    def of_run(cls, cfg: Any) -> ReplicaLayout:
        """The layout every replica of ``cfg`` has, as the job sees it (rank 0, globals on the
        host): what the checkpoint, the evaluation, the round metrics and joiners ask of it."""
        return cls.of(cfg, cfg.diloco.workers_per_replica, 0, torch.device("cpu"))

    def owns(self, rank: int) -> bool:
        """Whether worker ``rank`` holds a part of the replica's state of its own: it sends
        pseudo-gradients, writes and reads its own checkpoint state and hands a joiner's same
        rank its inner-optimiser state (sharded: every rank, its rows; otherwise rank 0, whose
        state the other ranks copy)."""
        return self.sharded or rank == 0

    @property
    def units(self) -> int:
        """Exchange units per fragment: the replica's workers when sharded, else 1."""
        return self.world_size if self.sharded else 1

    def loads_own_rows(self, cfg: Any) -> bool:
        """Whether the worker builds its model on the meta device and reads only its own rows of
        ``model.init_from``'s weights once sharded (:meth:`wrap`), never holding the whole model."""
        return self.sharded and bool(cfg.model.init_from)

    def staging(self, device: torch.device) -> DeviceStaging | None:
        """The worker's device staging of the global fragments (None: globals on the host)."""
        return DeviceStaging(device) if self.device_globals else None

    @property
    def sync_rank(self) -> int:
        """The rank this worker's fragment syncs act as: sharded, every rank is rank 0 of its own
        rows (it computes and sends their pseudo-gradients); otherwise its rank (only rank 0 sends)."""
        return 0 if self.sharded else self.rank

    def wrap(self, cfg: Any, model: torch.nn.Module, device: torch.device,
             fragments: list[Fragment]) -> tuple[torch.nn.Module, dict[str, torch.Tensor], list[Fragment]]:  # fmt: skip
        """The model on this layout, once the replica's process group exists: sharded with FSDP2
        (this rank's rows of its parameters and fragments; a model built on the meta device gets
        its rows from ``model.init_from``'s files), wrapped in DDP, or, alone in its replica, as it is. Returns (what the inner loop calls, name -> parameter, the fragments
        this worker exchanges)."""
        if self.sharded:
            from ray_diloco.runtime.fsdp import local_params, shard_model

            shard_model(model, self.world_size, device, cfg.run.precision == "bf16")
            if next(model.parameters()).is_meta:  # built on meta (model.init_from): this rank's rows read
                from ray_diloco.runtime.fsdp import load_own_rows

                load_own_rows(model, cfg.model.init_from, self.world_size, self.rank, device)
            return model, local_params(model), [rank_fragment(f, self.world_size, self.rank) for f in fragments]
        net: torch.nn.Module = model
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(model, device_ids=[0] if device.type == "cuda" else None)
        return net, dict(model.named_parameters()), fragments

    def own_units(self, per_unit: list[Any]) -> list[Any]:
        """This worker's entries, one per fragment, of a list over the outer exchange's units
        (sharded: unit ``f * W + rank`` is its part of fragment f; otherwise the fragments)."""
        return per_unit[self.rank :: self.world_size] if self.sharded else per_unit

    def local_unit(self, unit: int) -> int | None:
        """This worker's fragment index of exchange unit ``unit`` (None: another rank's unit)."""
        if not self.sharded:
            return unit
        return unit // self.world_size if unit % self.world_size == self.rank else None

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
