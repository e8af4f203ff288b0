"""How the replicas synchronise: DiLoCo or the data-parallel baseline, behind one interface.

This is the one module that reads ``algorithm``. The outer-step loop (``runtime/trainer.py``),
the supervisor and the cluster code talk to a :class:`SyncStrategy` and never ask which
algorithm runs:

- :class:`DiLoCoSync` (DiLoCo, arXiv 2311.08105, Algorithm 1; Streaming DiLoCo, arXiv
  2501.18512, section 2): M replicas of W workers, each its own DDP group; an outer-optimiser
  driver actor (``runtime/driver/``) holds the global parameters; the workers sync fragments
  on the pure :class:`~ray_diloco.core.schedules.SyncSchedule`; replica failures are survived
  (``runtime/membership.py``).
- :class:`DataParallelSync`: one DDP group over all M x W workers, no outer step, no driver;
  the global parameters are rank 0's parameters; the first failure ends the run.

Both give the trainer the same things: the global parameters (for eval and export), the
sync state for checkpoints, per-outer-step metric fields, and the accounting of bytes on the
slow link.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ray_diloco.config import Config, check_overlap
from ray_diloco.core.fragments import Fragment
from ray_diloco.core.schedules import SyncSchedule
from ray_diloco.runtime.layout import ReplicaLayout

if TYPE_CHECKING:
    from ray_diloco.runtime.cluster import Replica

logger = logging.getLogger(__name__)

#: ``(replica id, slot, join step, workers, placement strategy)`` of one placement group.
Layout = list[tuple[int, int, int, int, str]]


class SyncStrategy:
    """The interface; see the module docstring. Subclasses set the class facts and override the
    life-cycle methods they need (the defaults do nothing)."""

    name: ClassVar[str]
    #: A failed replica is removed and the run goes on (True), or the run fails (False).
    elastic: ClassVar[bool]
    #: Gradients are all-reduced every inner step (no outer step): what the simulator models.
    all_reduces_every_step: ClassVar[bool]
    driver: Any = None  # the outer-optimiser actor handle, when there is one
    schedule: SyncSchedule | None = None  # when each fragment syncs, when there is an exchange (set by plan)
    num_params: int = 0  # parameters of the model (set by plan): sizes the transfer allowances

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.fragments: list[Fragment] = []  # the model's fragments (set by plan)

    # -- facts from the config (no Ray) -------------------------------------------------------
    @staticmethod
    def layout(cfg: Config, members: list[tuple[int, int, int]] | None = None) -> Layout:
        """The placement groups to start (``members``: restored ``(replica id, slot, join step)``)."""
        raise NotImplementedError

    @staticmethod
    def allreduce_emulation(cfg: Config) -> bool:
        """Whether the workers' DDP all-reduce sleeps the emulated WAN time (``network.*``)."""
        return False

    @staticmethod
    def workers(cfg: Config) -> int:
        """Workers started (each takes ``diloco.cpus_per_worker`` CPUs)."""
        return cfg.diloco.replicas * cfg.diloco.workers_per_replica

    @staticmethod
    def link_ranks(cfg: Config) -> int:
        """Processes whose traffic crosses the slow link (the communication summary's R)."""
        raise NotImplementedError

    @staticmethod
    def reported_replicas(cfg: Config) -> int:
        """Replicas as a sweep's trial table reports them (0: the baseline has none)."""
        return cfg.diloco.replicas

    def header(self, target: int) -> list[str]:
        """The start-up lines describing the run's shape."""
        raise NotImplementedError

    def plan(self, fragments: list[Fragment]) -> list[str]:
        """The model's ``fragments``, known once the model is built (DiLoCo: the schedule); returns
        the problems with them (ConfigError lines)."""
        self.fragments, self.num_params = fragments, sum(f.numel for f in fragments)
        return []

    # -- life cycle ---------------------------------------------------------------------------
    def launch(self, members: list[tuple[int, int, int]] | None) -> None:
        """Before the replicas start (DiLoCo: the driver's process starts meanwhile)."""

    def attach(self, replicas: list[Replica], resume_state: dict[str, Any] | None) -> None:
        """After the replicas started and :meth:`plan`: the global parameters into every worker
        of ``replicas``, the saved sync state restored."""

    def ping(self) -> Any | None:
        """An object ref that resolves while the sync side is alive (None: nothing to watch)."""
        return None

    def straggler_s(self) -> float | None:
        """Seconds a replica may lag the first one to finish an outer step (None: wait)."""
        return None

    def round_traffic(self, metrics: list[dict[str, Any]], start: int, end: int) -> tuple[list[dict], int]:
        """The metrics of the ranks whose bytes cross the slow link, and the tokens trained in
        inner steps ``[start, end)``."""
        raise NotImplementedError

    def outer_fields(self, end: int) -> dict[str, Any]:
        """The sync fields (update norms, bytes per fragment) of an outer step ending at inner step ``end``."""
        return {}

    def take_events(self) -> list[dict[str, Any]]:
        """Membership events the sync side recorded since the last call (timeouts, late, rejected)."""
        return []

    def settle_calls(self, replicas: list[Replica]) -> dict[Any, Replica]:
        """Calls (object ref -> replica) that return once every sync sent so far is answered."""
        return {}

    def eval_globals(self) -> list[Any] | None:
        """Object refs of the global fragments for workers to evaluate (None: their own parameters)."""
        return None

    def state_dict(self) -> dict[str, Any] | None:
        """The sync side's state for a checkpoint (``"outer"``)."""
        return None

    def save_state(self, path: Path, token: str | None = None, upload: str | None = None) -> dict[str, Any] | None:
        """Write :meth:`state_dict` to ``path`` from the process that holds it (``token``: the
        checkpoint's marker and id, ``components.checkpoint.place_marker``; ``upload``: the file's
        URI in ``run.storage_path``, copied there by that process too); returns ``{"file",
        "bytes", "node"}`` or ``{"unseen": True, "node"}``, or None when there is no sync-side state."""
        return None

    def export_weights(self, out_dir: Path, dtype: Any) -> bool:
        """Have the process holding the global parameters write them as the exported model's
        safetensors into ``out_dir`` (torch ``dtype``); False when this strategy has none such
        or the files are not visible here (the job's process then writes them)."""
        return False

    def global_params(self, replicas: list[Replica]) -> list[np.ndarray]:
        """The global parameters, fp32 ``[numel_p]`` per fragment (``replicas``: the live ones)."""
        raise NotImplementedError

    def state_hashes(self) -> dict[str, str]:
        """sha256 of the sync side's state (``run.log_hashes``)."""
        return {}

    def shutdown(self) -> None:
        """Stop what :meth:`launch` started."""


class DiLoCoSync(SyncStrategy):
    """DiLoCo and Streaming DiLoCo through the outer-optimiser driver actor."""

    name = "diloco"
    elastic = True
    all_reduces_every_step = False

    @staticmethod
    def layout(cfg: Config, members: list[tuple[int, int, int]] | None = None) -> Layout:
        from ray_diloco.runtime.cluster import initial_members, replica_strategy

        return [
            (m, slot, j, cfg.diloco.workers_per_replica, replica_strategy(cfg))
            for m, slot, j in initial_members(cfg, members)
        ]

    @staticmethod
    def workers(cfg: Config) -> int:
        return cfg.num_shards  # every slot's workers: replacements and joiners take free slots

    @staticmethod
    def link_ranks(cfg: Config) -> int:
        return cfg.diloco.replicas  # each replica's rank 0 talks to the driver

    def header(self, target: int) -> list[str]:
        c, d = self.cfg, self.cfg.diloco
        lines = [
            f"M={c.diloco.replicas} replicas x {c.diloco.workers_per_replica} worker(s), H={c.diloco.H}, "
            f"{c.run.steps} inner steps ({c.num_outer_steps} outer)",
            *filter(None, [ReplicaLayout.of_run(c).summary(c.diloco.sharding)]),
        ]
        if c.diloco.min_replicas > 1 or target > c.diloco.replicas:
            lines.append(
                f"elastic: quorum {c.diloco.min_replicas}, up to {target} replicas, "
                f"sync timeout {c.diloco.sync_timeout_s:g} s"
            )
        where = f"on a node with resource {d.driver_resource!r}" if d.driver_resource else "on the job's node"
        shards = (
            f"{d.outer_shards} shards (kept apart from their copies), each copied to the next: {'on' if d.outer_shard_backup else 'off'}"
            if d.outer_shards > 1
            else "its state in the driver"
        )
        lines.append(f"outer optimiser: driver {where}, {shards}")
        return lines

    def plan(self, fragments: list[Fragment]) -> list[str]:
        c, problems = self.cfg, super().plan(fragments)
        check_overlap(c.diloco.H, len(fragments), c.streaming.overlap_steps, problems)
        if not problems:
            self.schedule = SyncSchedule(
                c.diloco.H, len(fragments), c.streaming.overlap_steps, c.run.steps, c.streaming.closing_round
            )
        return problems

    def launch(self, members: list[tuple[int, int, int]] | None) -> None:
        from ray_diloco.runtime.cluster import driver_placement, initial_members, wait_outer_placed
        from ray_diloco.runtime.driver import OuterDriverActor

        joins = {m: j for m, _, j in initial_members(self.cfg, members)}
        self.driver = OuterDriverActor.options(**driver_placement(self.cfg)).remote(None, self.cfg.to_dict(), joins)
        wait_outer_placed(self.cfg, self.driver)  # before the replicas' placement groups can take its CPUs

    def attach(self, replicas: list[Replica], resume_state: dict[str, Any] | None) -> None:
        """The global parameters start as rank 0's initialisation (identical in every worker),
        or the checkpoint's; every worker gets them and the schedule."""
        import ray

        from ray_diloco.runtime.cluster import all_workers

        c, rs = self.cfg, resume_state
        r0, units = replicas[0], c.exchange_units  # FSDP: each rank's rows of each fragment
        outer = rs["outer"] if rs is not None else None
        if outer is not None and "file" in outer:  # the checkpoint's outer.pt: read by the driver itself
            assert rs is not None  # outer came from it
            if ray.get(self.driver.load_state_file.remote(outer, rs.get("checkpoint_id"))):
                outer = None
            else:  # not visible from the driver's node: read here, sent
                from ray_diloco.components.checkpoint import read_state_file

                outer = read_state_file(Path(outer["file"]))  # a damaged file fails here, with no note
                logger.warning(f"note: the outer-optimiser driver does not see {rs['outer']['file']}: it was read here")
        if outer is not None or rs is None:
            initial = (
                outer["global"]
                if outer is not None
                else [r0.workers[r].local_fragment.remote(p) for p in range(len(self.fragments)) for r in range(units)]
            )
            ray.get(self.driver.init_global.remote(initial))
            if outer is not None:
                ray.get(self.driver.load_state_dict.remote(outer))
        workers = all_workers(replicas)
        ray.get([w.attach.remote(self.driver, self.schedule) for w in workers])
        globals_ = ray.get(self.driver.global_refs.remote())
        versions = ray.get(self.driver.global_versions.remote())
        ray.get([w.load_global.remote(p, g, versions[p]) for p, g in enumerate(globals_) for w in workers])

    def ping(self) -> Any:
        return self.driver.ping.remote()

    def straggler_s(self) -> float:
        """``diloco.sync_timeout_s`` plus the time a slow link needs to move the model's fp32 bytes
        (``core.wire.transfer_allowance_s``): a replica still in a large exchange is not stuck."""
        from ray_diloco.core.wire import transfer_allowance_s

        return self.cfg.diloco.sync_timeout_s + transfer_allowance_s(4 * self.num_params)

    def round_traffic(self, metrics: list[dict[str, Any]], start: int, end: int) -> tuple[list[dict], int]:
        rank0, owns = [mtr for mtr in metrics if mtr["rank"] == 0], ReplicaLayout.of_run(self.cfg).owns
        senders = [mtr for mtr in metrics if owns(mtr["rank"])]
        return senders, int(sum(mtr["tokens"] for mtr in rank0))  # each live replica counts its own

    def outer_fields(self, end: int) -> dict[str, Any]:
        """Rounds merged by the end of this outer step (apply step = min(send + tau, T)): update
        norm, per-replica pseudo-gradient norms, bytes per fragment."""
        import ray

        assert self.schedule is not None  # set by plan
        merged_by = end if end >= self.cfg.run.steps else end - self.schedule.overlap
        rounds = ray.get(self.driver.take_stats.remote(merged_by))
        return round_fields(rounds, self.cfg.exchange_units) if rounds else {}

    def take_events(self) -> list[dict[str, Any]]:
        import ray

        return ray.get(self.driver.take_events.remote())

    def settle_calls(self, replicas: list[Replica]) -> dict[Any, Replica]:
        return {w.settle.remote(): r for r in replicas for w in r.workers}

    def eval_globals(self) -> list[Any]:
        import ray

        return ray.get(self.driver.global_refs.remote())

    def state_dict(self) -> dict[str, Any]:
        import ray

        return ray.get(self.driver.state_dict.remote())

    def save_state(self, path: Path, token: str | None = None, upload: str | None = None) -> dict[str, Any]:
        import ray

        return ray.get(self.driver.save_state.remote(str(path), token, upload))

    def export_weights(self, out_dir: Path, dtype: Any) -> bool:
        import ray

        from ray_diloco.components.checkpoint import MARKER, place_marker, visible_file

        out_dir = out_dir.resolve()
        token = place_marker(out_dir)
        try:
            files = ray.get(
                self.driver.export_weights.remote(str(out_dir), self.fragments, self.cfg.exchange_units, dtype, token)
            )
        finally:
            (out_dir / MARKER).unlink(missing_ok=True)
        seen = files is not None and all(visible_file({"file": str(out_dir / f), "bytes": n}) for f, n in files.items())
        if not seen:
            logger.warning(
                f"note: the outer-optimiser driver's node does not see {out_dir}: "
                "the exported weights are written by this process"
            )
        return seen

    def global_params(self, replicas: list[Replica]) -> list[np.ndarray]:
        import ray

        from ray_diloco.core.shards import join_units

        return join_units(ray.get(self.driver.global_params.remote()), self.fragments, self.cfg.exchange_units)

    def state_hashes(self) -> dict[str, str]:
        import ray

        return ray.get(self.driver.state_hash.remote())

    def shutdown(self) -> None:
        import ray

        if self.driver is not None:
            ray.kill(self.driver)
        self.driver = None


class DataParallelSync(SyncStrategy):
    """The data-parallel baseline: one DDP group over every worker, the same workers, data,
    inner optimiser and schedule as DiLoCo; H only sets the metrics and checkpoint round."""

    name = "dp"
    elastic = False
    all_reduces_every_step = True

    @staticmethod
    def layout(cfg: Config, members: list[tuple[int, int, int]] | None = None) -> Layout:
        return [(0, 0, 0, cfg.num_shards, "PACK")]

    @staticmethod
    def allreduce_emulation(cfg: Config) -> bool:
        return bool(cfg.network.bandwidth_gbps or cfg.network.latency_ms)

    @staticmethod
    def link_ranks(cfg: Config) -> int:
        return cfg.num_shards  # every rank takes part in the all-reduce

    @staticmethod
    def reported_replicas(cfg: Config) -> int:
        return 0

    def header(self, target: int) -> list[str]:
        c = self.cfg
        return [
            f"DDP over {c.diloco.replicas * c.diloco.workers_per_replica} worker(s), {c.run.steps} inner steps "
            f"(metrics every {c.diloco.H}: {c.num_outer_steps} rounds)"
        ]

    def round_traffic(self, metrics: list[dict[str, Any]], start: int, end: int) -> tuple[list[dict], int]:
        return metrics, (end - start) * self.cfg.inner.global_batch * self.cfg.data.seq_len  # one group, one batch

    def global_params(self, replicas: list[Replica]) -> list[np.ndarray]:
        import ray

        w0 = replicas[0].rank0
        return ray.get([w0.local_fragment.remote(p) for p in range(len(self.fragments))])


def round_fields(rounds: list[dict[str, Any]], units: int = 1) -> dict[str, Any]:
    """Metric fields of the fragment syncs completed in one outer step (the driver's
    ``take_stats`` rows, one per exchange unit: ``units`` per fragment with FSDP): the outer
    update's norm, each replica's pseudo-gradient norm over every fragment, the number of syncs,
    and up + down bytes (all replicas) per fragment."""
    sq: dict[int, float] = {}
    per_fragment: dict[str, int] = {}
    for r in rounds:
        for m, v in r["delta_norms"].items():
            sq[m] = sq.get(m, 0.0) + v * v
        key = f"fragment_{r['fragment'] // units}"
        per_fragment[key] = per_fragment.get(key, 0) + r["bytes_up"] + r["bytes_down"]
    return {
        "outer_update_norm": float(np.sqrt(sum(r["update_norm"] ** 2 for r in rounds))),
        "pseudo_grad_norm": {f"replica_{m}": float(np.sqrt(v)) for m, v in sorted(sq.items())},
        "fragment_syncs": len(rounds) // units,
        "sync_bytes_fragment": per_fragment,
    }


STRATEGIES: dict[str, type[SyncStrategy]] = {"diloco": DiLoCoSync, "dp": DataParallelSync}


def strategy_class(cfg: Config) -> type[SyncStrategy]:
    """The strategy of ``cfg.algorithm`` (validated by the config: one of :data:`STRATEGIES`)."""
    return STRATEGIES[cfg.algorithm]


def make_strategy(cfg: Config) -> SyncStrategy:
    """A new strategy object for a run."""
    return strategy_class(cfg)(cfg)
