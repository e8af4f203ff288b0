"""A replica's layout: how its workers hold the model and what each one exchanges, decided once
from the config (``diloco.sharding``, ``diloco.workers_per_replica``; ``streaming.device_globals``
on a GPU) and the worker's rank and device. The worker's parts are built from it in one go
(:meth:`ReplicaLayout.parts`), never patched afterwards. A new layout (HSDP) is one more case
here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ray_diloco.core.fragments import Fragment, ParamSpec
from ray_diloco.core.shards import rank_fragment
from ray_diloco.core.staging import DeviceStaging
from ray_diloco.models.transformer import make_inner_optimizer
from ray_diloco.runtime.inner_loop import WorkerParts


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

    @property
    def units(self) -> int:
        """Exchange units per fragment: the replica's workers when sharded, else 1."""
        return self.world_size if self.sharded else 1

    def staging(self, device: torch.device) -> DeviceStaging | None:
        """The worker's device staging of the global fragments (None: globals on the host)."""
        return DeviceStaging(device) if self.device_globals else None

    def parts(self, cfg: Any, ids: tuple[int, int, int], device: torch.device, model: torch.nn.Module,
              specs: list[ParamSpec], fragments: list[Fragment]) -> WorkerParts:  # fmt: skip
        """The worker's parts on this layout, once the replica's process group exists (the worker's
        ``setup``): the model sharded with FSDP2 (this rank's rows of its parameters and
        fragments), wrapped in DDP, or, alone in its replica, used as it is. ``ids``: (replica,
        data shard, number of shards)."""
        replica, shard, num_shards = ids
        net: torch.nn.Module = model
        params: dict[str, torch.Tensor] = dict(model.named_parameters())
        mine = fragments
        if self.sharded:
            from ray_diloco.runtime.fsdp import local_params, shard_model

            shard_model(model, self.world_size, device, cfg.run.precision == "bf16")
            params, mine = local_params(model), [rank_fragment(f, self.world_size, self.rank) for f in fragments]
        elif self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(model, device_ids=[0] if device.type == "cuda" else None)
        parts = WorkerParts(
            cfg, replica, self.rank, self.world_size, shard, num_shards, device, model, specs, fragments,
            fsdp=self.sharded, params=params, sync_fragments=mine, optimizer=make_inner_optimizer(model, cfg), net=net,
        )  # fmt: skip
        parts.new_sync()
        return parts
