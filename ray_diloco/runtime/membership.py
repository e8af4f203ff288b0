"""Elastic replicas: who is live, who is starting, which data slot each reads, and what happens
when a replica dies, joins or leaves.

Replicas change only between outer steps (``Trainer.outer_step``), except that a death is acted on
as soon as Ray reports it: the replica's actors and placement group are removed and the
driver stops waiting for it, so the rounds in flight complete with the survivors (DiLoCo,
arXiv 2311.08105, section 3: dropped outer gradients cost little). Replacements and scale-up
replicas start in the background (:class:`~ray_diloco.runtime.cluster.ReplicaLaunch`) and are admitted
at the next outer-step boundary:

1. every live worker settles its syncs in flight, so the driver's global parameters are final;
2. the joiner loads the global parameters of every fragment (and their versions), takes the
   inner-optimiser state of a live replica (``diloco.join_inner_state: peer``, the default:
   AdamW moments that match the current lr, as torchft heals from a peer) or a fresh one
   (``fresh``), takes a free data slot at the position its last reader reached, and follows the
   global inner lr schedule from the current step (no second warm-up);
3. the driver expects it in every round sent after that step.

Events (join, leave, death with reason; the driver adds timeout, late, rejected and
round_failed) are collected each outer step for the log, ``metrics.jsonl`` and W&B.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from ray_diloco.components.storage import write_text
from ray_diloco.config import Config
from ray_diloco.core.schedules import SyncSchedule
from ray_diloco.errors import ClusterError, ConfigError
from ray_diloco.models.transformer import ModelFn
from ray_diloco.runtime.cluster import (
    Replica,
    ReplicaLaunch,
    error_cause,
    launch_replica,
    outer_side_failed,
    stop_replicas,
)
from ray_diloco.runtime.layout import ReplicaLayout

logger = logging.getLogger(__name__)

#: The file in a run directory that ``ray-diloco scale`` writes and a running trainer reads
#: at every outer-step boundary: ``{"replicas": N}``.
SCALE_FILE = "scale.json"


def request_scale(run_dir: str | Path, replicas: int) -> Path:
    """Ask the run in ``run_dir`` to run ``replicas`` replicas from its next outer step
    (``ray-diloco scale``): more start when the cluster has room, extra ones leave cleanly.
    Written atomically.

    Raises:
        ConfigError: not a run directory, or ``replicas`` outside
            ``[diloco.min_replicas, max(diloco.replicas, diloco.max_replicas)]``.
    """
    from ray_diloco.config import load_config
    from ray_diloco.runtime.strategy import strategy_class

    run_dir = Path(run_dir).expanduser()
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError([f"scale {run_dir}: not a run directory (no config.yaml)"])
    cfg = load_config(run_dir / "config.yaml")
    d = cfg.diloco
    if not strategy_class(cfg).elastic:
        raise ConfigError([f"scale {run_dir}: algorithm = {cfg.algorithm!r}; only diloco runs are elastic"])
    if not d.min_replicas <= replicas <= cfg.num_slots:
        raise ConfigError(
            [
                f"--replicas = {replicas}: must be in [diloco.min_replicas = {d.min_replicas}, "
                f"max(diloco.replicas, diloco.max_replicas) = {cfg.num_slots}]"
            ]
        )
    if (run_dir / "summary.json").is_file():
        logger.warning(
            f"note: {run_dir} has finished (summary.json); the request applies if the run is extended with "
            "--resume --set run.steps=..."
        )
    path = run_dir / SCALE_FILE
    write_text(path, json.dumps({"replicas": replicas}))
    return path


def read_scale(run_dir: Path, cfg: Config) -> int | None:
    """The replica count asked for with :func:`request_scale` (None: none, or unreadable)."""
    try:
        n = int(json.loads((Path(run_dir) / SCALE_FILE).read_text())["replicas"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return n if cfg.diloco.min_replicas <= n <= cfg.num_slots else None


class Membership:
    """The replicas of one run and their data slots.

    Args:
        cfg: the run config. corpus_refs: object refs of the train/val token arrays.
        vocab_size, model_fn: what a new worker needs to build the model.
        live: the replicas running now. next_id: the id the next new replica gets.
        driver: the outer-optimiser driver actor (None: the DP baseline, no joiners).
        schedule: the fragments' sync schedule joiners attach with (None with no driver).
    """

    def __init__(
        self,
        cfg: Config,
        corpus_refs: tuple[Any, Any],
        vocab_size: int,
        model_fn: ModelFn | None,
        live: list[Replica],
        next_id: int | None = None,
        driver: Any = None,
        schedule: SyncSchedule | None = None,
    ):
        self.cfg, self.corpus_refs, self.vocab_size, self.model_fn = cfg, corpus_refs, vocab_size, model_fn
        self.live = sorted(live, key=lambda r: r.index)
        self.launches: list[ReplicaLaunch] = []
        self.next_id = next_id if next_id is not None else max([r.index + 1 for r in live], default=0)
        self.target = cfg.diloco.max_replicas or cfg.diloco.replicas
        self.failures = 0
        self.slot_readers: dict[int, list[dict[str, Any] | None]] = {}
        self.driver, self.schedule = driver, schedule
        self.events: list[dict[str, Any]] = []  # trainer-side events (the driver keeps its own)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Members ``[id, slot, join step]``, the next id, the failure count and each slot's
        last data position (per rank)."""
        return {
            "members": [[r.index, r.slot, r.join_step] for r in self.live],
            "next_id": self.next_id,
            "failures": self.failures,
            "slot_readers": {int(k): v for k, v in self.slot_readers.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters and slot positions of :meth:`state_dict` (members are started by
        the trainer)."""
        self.next_id = int(state.get("next_id", self.next_id))
        self.failures = int(state.get("failures", 0))
        self.slot_readers = {int(k): v for k, v in state.get("slot_readers", {}).items()}

    def note_positions(self, metrics: list[dict[str, Any]]) -> None:
        """Remember each slot's data position from a round's worker metrics."""
        by_id = {r.index: r for r in self.live}
        W = self.cfg.diloco.workers_per_replica
        for m in metrics:
            r = by_id.get(m["replica"])
            if r is not None and "reader" in m:
                self.slot_readers.setdefault(r.slot, [None] * W)[m["rank"]] = m["reader"]

    def free_slots(self) -> list[int]:
        """Data slots no live replica reads (a starting replica gets its slot when it joins)."""
        used = {r.slot for r in self.live}
        return [s for s in range(self.cfg.num_slots) if s not in used]

    # -- changes -----------------------------------------------------------------------------
    def _event(self, kind: str, replica: int | None, **info: Any) -> None:
        self.events.append({"event": kind, "replica": replica, "time": time.time(), **info})

    def top_up(self) -> None:
        """Request new replicas until live + starting reaches the target plus
        ``diloco.spare_replicas`` (hot spares: started and set up, admitted the moment a
        replica is missing)."""
        want = self.target + self.cfg.diloco.spare_replicas - len(self.live) - len(self.launches)
        for _ in range(max(0, want)):
            self.launches.append(launch_replica(self.cfg, self.next_id, -1, 0))
            self._event("launch", self.next_id)
            self.next_id += 1

    def poll(self) -> list[ReplicaLaunch]:
        """Advance every launch without blocking; returns the ones ready to join. A launch whose
        actors die is removed (and counted as a failure)."""
        import ray

        ready = []
        for lc in list(self.launches):
            try:
                if lc.advance(self.cfg, self.corpus_refs, self.vocab_size, self.model_fn):
                    ready.append(lc)
            except ray.exceptions.RayError as e:
                self.launches.remove(lc)
                stop_replicas([lc.replica])
                self._count_failure(lc.replica.index, f"failed while starting: {error_cause(e)}")
        return ready

    def admit(self, ready: list[ReplicaLaunch], step: int, settle: Any) -> None:
        """Join set-up replicas at inner step ``step`` (an outer-step boundary): ``settle()``
        the live workers, load the global parameters into the joiners, add them to the driver.
        A joiner that fails here is removed like a death."""
        import ray

        ready = ready[: max(0, self.target - len(self.live))]  # the others stay as spares
        slots = self.free_slots()
        if not ready or not slots:
            return
        settle()
        refs = ray.get(self.driver.global_refs.remote())
        versions = ray.get(self.driver.global_versions.remote())
        peer = None
        if self.cfg.diloco.join_inner_state == "peer" and self.live:
            try:
                layout = ReplicaLayout.of_run(self.cfg)  # a joiner's rank r takes rank r's part
                peer = [w.inner_optimizer_state.remote() for k, w in enumerate(self.live[0].workers) if layout.owns(k)]
                ray.wait(peer, num_returns=len(peer), timeout=30)
            except ray.exceptions.RayError:
                peer = None
        for lc in ready:
            self.launches.remove(lc)
            r = lc.replica
            r.join_step, r.slot = step, slots.pop(0)
            positions = self.slot_readers.get(r.slot) or [None] * len(r.workers)
            try:
                ray.get([w.attach.remote(self.driver, self.schedule) for w in r.workers])
                W = len(r.workers)
                zero = ray.get(
                    [
                        w.join.remote(
                            refs,
                            versions,
                            step,
                            positions[rank],
                            peer and [peer[layout.owner(rank)]],
                            r.slot * W + rank,
                        )
                        for rank, w in enumerate(r.workers)
                    ]
                )
            except ray.exceptions.RayError as e:
                stop_replicas([r])
                self._count_failure(r.index, f"failed while joining: {error_cause(e)}")
                continue
            self.live.append(r)
            self.live.sort(key=lambda x: x.index)
            ray.get(
                self.driver.add_member.remote(
                    r.index,
                    step,
                    slot=r.slot,
                    admit_s=round(time.monotonic() - lc.requested, 3),
                    pseudo_gradient_sha256=zero[0][0],
                    inner_state=zero[0][1],
                )
            )

    def lose(self, r: Replica, reason: str, kind: str = "death") -> None:
        """Remove a replica that died (``kind="death"``) or is asked to leave (``"leave"``): the
        driver stops expecting it, its actors and placement group are removed.

        Raises:
            ClusterError: the driver itself is gone, or ``diloco.max_failures`` is exceeded.
        """
        import ray

        if r not in self.live:
            return
        try:  # first the driver: when it is the one that died, the replicas are not to blame
            ray.get(self.driver.ping.remote(), timeout=30)
        except (ray.exceptions.RayError, TimeoutError) as e:
            raise outer_side_failed(f"(or one of its diloco.outer_shards actors) failed: {error_cause(e)}") from None
        if kind == "death":  # said only now: a replica whose call failed because the driver did is not to blame
            logger.warning(f"replica {r.index} failed: {reason}")
        self.live.remove(r)
        stop_replicas([r])
        ray.get(self.driver.remove_member.remote(r.index, reason, kind))
        if kind == "death":
            self._count_failure(r.index, reason, recorded=True)
            self.top_up()  # the replacement starts now; it joins at an outer-step boundary

    def _count_failure(self, replica: int, reason: str, recorded: bool = False) -> None:
        self.failures += 1
        if not recorded:
            self._event("death", replica, reason=reason)
        if self.failures > self.cfg.diloco.max_failures:
            raise ClusterError(
                f"diloco.max_failures = {self.cfg.diloco.max_failures}: {self.failures} replica "
                f"failures in this run, the last: replica {replica} {reason}"
            )

    def take_events(self) -> list[dict[str, Any]]:
        """Trainer-side events since the last call."""
        out, self.events = self.events, []
        return out

    def set_target(self, n: int) -> list[Replica]:
        """Run ``n`` replicas from now on: launches beyond it are cancelled; returns the live
        replicas that must leave (the newest first), for the caller to remove with
        :meth:`lose` (``kind="leave"``) after their syncs settle."""
        if n == self.target:
            return []
        self._event("scale", None, target=n, previous=self.target, live=len(self.live))
        self.target = n
        while self.launches and len(self.live) + len(self.launches) > n + self.cfg.diloco.spare_replicas:
            stop_replicas([self.launches.pop().replica])
        return sorted(self.live, key=lambda r: r.index)[n:][::-1]

    def shutdown(self) -> None:
        """Remove the replicas still starting."""
        stop_replicas([lc.replica for lc in self.launches])
        self.launches = []
