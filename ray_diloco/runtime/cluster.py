"""Ray plumbing: joining or starting a cluster, checking it can host the run, and starting or
stopping the replicas (placement groups + worker actors + their process groups).

A replica is ``workers_per_replica`` :class:`~ray_diloco.runtime.replica.ReplicaWorker` actors in one
STRICT_PACK placement group (same node: DDP traffic stays local), or a PACK one when it may span
nodes (``diloco.replica_nodes: several``); the DP baseline puts all ``M x W`` workers in one PACK
group that forms a single DDP group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray_diloco.components.address import connect_ray
from ray_diloco.config import Config
from ray_diloco.errors import ClusterError, RunStopped

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # torch: the CLI imports this module for every command, fit and simulate included
    from ray_diloco.models.transformer import ModelFn


@dataclass
class Replica:
    """The Ray actors of one replica (rank 0 first) and their placement group.

    ``index`` is the replica's id (unique in a run: a replacement gets a new one), ``slot`` the
    data slot it reads (shards ``slot * W + rank``), ``join_step`` the inner step it joined at.
    """

    index: int
    workers: list[Any]
    placement_group: Any
    slot: int = 0
    join_step: int = 0
    bundle_offset: int = 0  # index of rank 0's bundle in ``placement_group``
    owns_placement_group: bool = True  # False: the bundles belong to a Tune trial's group

    @property
    def rank0(self) -> Any:
        """The worker that computes and sends this replica's pseudo-gradient."""
        return self.workers[0]


#: Set inside a Ray Tune trial (:mod:`ray_diloco.tune.trial`): the trial's placement group, whose
#: bundle 0 hosts the trial itself and bundles ``1 + slot * W + rank`` the replicas' workers.
#: Replicas are then placed in those reserved bundles instead of groups of their own, so
#: concurrent trials never wait on each other's resources.
HOST_PLACEMENT_GROUP: Any = None


def init_ray(cfg: Config) -> bool:
    """Join (``run.address`` / ``RAY_ADDRESS``) or start a Ray cluster of this run's own
    (:func:`~ray_diloco.components.address.connect_ray`); True if this call did.

    Raises:
        ClusterError: when the address cannot be reached or Ray cannot start.
    """
    return connect_ray(cfg.run.address, "run.address", local={"include_dashboard": False}, log_to_driver=True)


MIN_AUTO_CPUS = 0.5  # the least CPU share per worker that "auto" hands out


def replica_strategy(cfg: Config) -> str:
    """The placement strategy of a DiLoCo replica's group: STRICT_PACK (one node) or, with
    ``diloco.replica_nodes: several``, PACK (as few nodes as possible)."""
    return "PACK" if cfg.diloco.replica_nodes == "several" else "STRICT_PACK"


def check_resources(cfg: Config) -> float:
    """Fail before starting anything when the cluster cannot host every worker at once; with
    ``diloco.wait_for_nodes`` ask the autoscaler for the workers' bundles first and wait up to
    ``diloco.placement_timeout_s`` for the cluster to have them (checked every 2 s).

    Returns the CPUs per worker: ``diloco.cpus_per_worker`` when set, else the cluster's CPUs
    shared evenly (whole CPUs when there are enough, else a fraction of at least 0.5).

    Raises:
        ClusterError: naming the fields, their product and the cluster's CPUs/GPUs.
    """
    import time

    import ray

    d = cfg.diloco
    _check_driver_resource(cfg, ray.cluster_resources())
    if HOST_PLACEMENT_GROUP is not None:  # a Tune trial: its bundles were sized from this config
        assert d.cpus_per_worker is not None  # set by the trial's config (tune.space)
        return d.cpus_per_worker
    if not d.wait_for_nodes:
        return _check_resources(cfg, ray.cluster_resources())
    from ray.autoscaler.sdk import request_resources

    # a replica on one node needs one node with all its workers' resources; else one bundle per worker
    one_node = d.replica_nodes == "one"
    per, count = (d.workers_per_replica, d.replicas) if one_node else (1, d.replicas * d.workers_per_replica)
    request_resources(
        bundles=[
            {"CPU": (d.cpus_per_worker or 1) * per, **({"GPU": d.gpus_per_worker * per} if d.gpus_per_worker else {})}
            for _ in range(count)
        ]
    )
    deadline, told = time.monotonic() + d.placement_timeout_s, False
    try:
        while True:
            try:
                return _check_resources(cfg, ray.cluster_resources())
            except ClusterError as e:
                if time.monotonic() >= deadline:
                    raise ClusterError(
                        f"{e} (after waiting diloco.placement_timeout_s = {d.placement_timeout_s:g} s "
                        "for the autoscaler: diloco.wait_for_nodes)"
                    ) from None
                if not told:
                    logger.warning(
                        f"note: waiting up to {d.placement_timeout_s:g} s for the autoscaler to add nodes ({e})"
                    )
                    told = True
                time.sleep(2.0)
    finally:  # the request persists until replaced; the replicas' placement groups hold the nodes from now on
        request_resources(bundles=[])


DRIVER_RESOURCE_SHARE = 0.001  # of diloco.driver_resource: any number of runs can share that node


def driver_placement(cfg: Config) -> dict[str, Any]:
    """Ray actor options that place the outer-optimiser driver (``diloco.driver_resource``): on a
    node offering that custom resource, or else pinned to the node of this process (the job's),
    so it never lands on a replica's node by the scheduler's choice (arXiv 2311.08105's replicas
    come and go; the outer state stays with the job)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ray_diloco.components.threads import outer_threads

    plan = outer_threads(cfg, holds_state=cfg.diloco.outer_shards == 1)
    process = {"num_cpus": plan.cpus, "runtime_env": plan.runtime_env()}
    if cfg.diloco.driver_resource:  # outside a Tune trial's placement group, whose bundles hold only CPUs
        return {
            "resources": {cfg.diloco.driver_resource: DRIVER_RESOURCE_SHARE},
            "scheduling_strategy": "DEFAULT",
            **process,
        }
    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False), **process}


def wait_outer_placed(cfg: Config, driver: Any) -> None:
    """Wait until the outer side's processes (the driver, its shards) run: they reserve
    ``diloco.outer_cpus`` on a given node each (the driver the job's, pinned), which a replica's
    placement group started first could take, leaving them pending for ever. Returns at once when
    they reserve none (``diloco.outer_cpus`` 0).

    Raises:
        ClusterError: they found no room in ``diloco.placement_timeout_s``."""
    import ray

    d = cfg.diloco
    if not d.outer_cpus:
        return
    where = "the driver on the job's node" if not d.driver_resource else f"the driver on a {d.driver_resource!r} node"
    if d.outer_shards > 1:
        where += f", {d.outer_shards} shards on the replicas' nodes"
    try:
        ray.get(driver.outer_pids.remote(), timeout=d.placement_timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnschedulableError):  # no room now / ever
        ray.kill(driver)
        raise ClusterError(
            f"diloco.outer_cpus = {d.outer_cpus:g}: the outer side ({where}) found no node with that many "
            f"free CPUs in {d.placement_timeout_s:g} s: lower it, or give those nodes CPUs"
        ) from None


def _check_driver_resource(cfg: Config, res: dict[str, float]) -> None:
    """``diloco.driver_resource`` must be offered by some node."""
    d = cfg.diloco
    if d.driver_resource and res.get(d.driver_resource, 0) < DRIVER_RESOURCE_SHARE:
        raise ClusterError(
            f"diloco.driver_resource = {d.driver_resource!r}: no node of the Ray cluster offers this resource "
            "(start the driver's node with ray start --resources='{\"NAME\": 1}', or leave it "
            "empty to run the driver on the job's node)"
        )


def _beside(outer: float) -> str:
    return f" beside the {outer:g} of diloco.outer_cpus" if outer else ""


def _check_resources(cfg: Config, res: dict[str, float]) -> float:
    """:func:`check_resources` against the cluster's resources ``res`` now."""
    from ray_diloco.components.threads import outer_reserved_cpus

    d = cfg.diloco
    n = d.replicas * d.workers_per_replica
    outer = outer_reserved_cpus(cfg)
    have_cpu = res.get("CPU", 0) - outer  # what the outer side reserves is not the workers'
    product = f"diloco.replicas x diloco.workers_per_replica = {d.replicas} x {d.workers_per_replica} = {n} workers"
    if outer > have_cpu + outer - 0.5:
        raise ClusterError(
            f"diloco.outer_cpus = {d.outer_cpus:g} (x {d.outer_shards} outer shards = {outer:g} CPUs): the Ray cluster "
            f"has {have_cpu + outer:g} CPUs, and the workers need some: lower diloco.outer_cpus or add nodes"
        )
    if d.cpus_per_worker is None:
        per = have_cpu / n
        if per < MIN_AUTO_CPUS:
            raise ClusterError(
                f"{product}, but the Ray cluster has {have_cpu:g} CPUs{_beside(outer)} (fewer than {MIN_AUTO_CPUS:g} per worker): "
                "lower diloco.replicas or diloco.workers_per_replica, add nodes, or set diloco.cpus_per_worker"
            )
        cpus = float(int(per)) if per >= 1 else per
    else:
        cpus = d.cpus_per_worker
        if n * cpus > have_cpu:
            raise ClusterError(
                f"{product} x diloco.cpus_per_worker {cpus:g} = {n * cpus:g} CPUs, "
                f"but the Ray cluster has {have_cpu:g}{_beside(outer)}: lower one of them or add nodes"
            )
    need_gpu = n * d.gpus_per_worker
    if need_gpu > res.get("GPU", 0):
        raise ClusterError(
            f"{product} x diloco.gpus_per_worker {d.gpus_per_worker:g} = {need_gpu:g} GPUs, "
            f"but the Ray cluster has {res.get('GPU', 0):g}"
        )
    return cpus


def _bundle(cfg: Config) -> dict[str, float]:
    d = cfg.diloco
    assert d.cpus_per_worker is not None  # resolved (runtime.resolved) before anything is placed
    bundle = {"CPU": d.cpus_per_worker}
    if d.gpus_per_worker:
        bundle["GPU"] = d.gpus_per_worker
    return bundle


def _place(cfg: Config, index: int, slot: int, world: int, strategy: str, join_step: int = 0) -> Replica:
    from ray.util.placement_group import placement_group

    if HOST_PLACEMENT_GROUP is not None:
        if slot < 0:
            raise ClusterError("diloco.spare_replicas: spares have no reserved bundles inside a Tune trial")
        return Replica(
            index, [], HOST_PLACEMENT_GROUP, slot, join_step, bundle_offset=1 + slot * world, owns_placement_group=False
        )
    pg = placement_group([_bundle(cfg) for _ in range(world)], strategy=strategy, name=f"diloco-replica-{index}")
    return Replica(index, [], pg, slot, join_step)


def placed(pg: Any) -> bool:
    """True once the placement group's bundles are reserved (asked of the GCS: unlike
    ``pg.ready()`` this needs no worker process, so it answers in milliseconds)."""
    from ray.util.placement_group import placement_group_table

    return placement_group_table(pg).get("state") == "CREATED"


def wait_placed(pgs: list[Any], timeout_s: float) -> Any | None:
    """Wait until every placement group is placed; returns the first one still pending at
    ``timeout_s`` seconds (None when all are placed)."""
    import time

    deadline = time.monotonic() + timeout_s
    for pg in pgs:
        while not placed(pg):
            if time.monotonic() > deadline:
                return pg
            time.sleep(0.02)
    return None


def ranks_by_node(bundle_nodes: list[str]) -> list[int]:
    """The bundle (an index into ``bundle_nodes``, each bundle's node id) each rank of a replica
    runs in: ranks fill the node of bundle 0 first, then the next node's bundles, in bundle
    order within a node. An HSDP shard group (consecutive ranks) then shares one node wherever
    the placement group put enough bundles on it (PACK fills as few nodes as it can)."""
    first: dict[str, int] = {}
    for i, node in enumerate(bundle_nodes):
        first.setdefault(node, i)
    return sorted(range(len(bundle_nodes)), key=lambda i: (first[bundle_nodes[i]], i))


def _spawn(
    cfg: Config, r: Replica, world: int, vocab_size: int, model_fn: ModelFn | None, allreduce_emulation: bool = False
) -> None:
    """Create the replica's worker actors in its (placed) placement group."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ray_diloco.components.threads import worker_threads
    from ray_diloco.runtime.replica import ReplicaWorkerActor as Worker

    d = cfg.diloco
    bundles = [r.bundle_offset + rank for rank in range(world)]
    if d.sharding == "hsdp":  # a shard group's consecutive ranks on one node where the bundles allow
        from ray.util.placement_group import placement_group_table

        nodes = placement_group_table(r.placement_group)["bundles_to_node_id"]
        bundles = [bundles[i] for i in ranks_by_node([nodes[b] for b in bundles])]
    for rank in range(world):
        r.workers.append(
            Worker.options(
                num_cpus=d.cpus_per_worker,
                num_gpus=d.gpus_per_worker,
                runtime_env=worker_threads(cfg).runtime_env(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    r.placement_group, placement_group_bundle_index=bundles[rank]
                ),
            ).remote(
                cfg.to_dict(),
                r.index,
                rank,
                world,
                max(r.slot, 0) * world + rank,
                cfg.num_shards,
                vocab_size,
                model_fn,
                **({"allreduce_emulation": True} if allreduce_emulation else {}),
            )
        )
        # slot -1: not known until the replica joins (it then moves to its shard)


def initial_members(cfg: Config, members: list[tuple[int, int, int]] | None = None) -> list[tuple[int, int, int]]:
    """``(replica id, slot, join step)`` of the replicas a run starts with: ``members`` (restored
    from a checkpoint) or ``(m, m, 0)`` for each of the ``diloco.replicas``."""
    return members or [(m, m, 0) for m in range(cfg.diloco.replicas)]


def start_replicas(
    cfg: Config,
    corpus_refs: tuple[Any, Any],
    vocab_size: int,
    model_fn: ModelFn | None,
    layout: list[tuple[int, int, int, int, str]],
    allreduce_emulation: bool = False,
) -> list[Replica]:
    """Placement groups and worker actors; process groups formed; data shards opened. Blocks
    until every replica is placed (``diloco.placement_timeout_s``) and set up.

    ``layout``: ``(replica id, slot, join step, workers, placement strategy)`` per placement
    group, from the sync strategy (``runtime/strategy.py``: one group per DiLoCo replica, or
    one DDP group of every worker for the DP baseline). ``allreduce_emulation``: the workers'
    DDP all-reduce sleeps the emulated WAN time (the DP baseline under ``network.*``).

    Raises:
        ClusterError: a placement group was not placed in time.
    """
    import ray

    d = cfg.diloco
    replicas: list[Replica] = []
    try:
        for m, slot, j, world, strategy in layout:
            replicas.append(_place(cfg, m, slot, world, strategy, j))
        stuck = wait_placed([r.placement_group for r in replicas], d.placement_timeout_s)
        if stuck is not None:
            r = next(r for r in replicas if r.placement_group is stuck)
            raise ClusterError(
                f"diloco.placement_timeout_s = {d.placement_timeout_s:g}: replica {r.index}'s placement group "
                f"({len(stuck.bundle_specs)} x {_bundle(cfg)}, {layout[0][4]}) was not placed in time"
            )
        for (_, _, _, world, _), r in zip(layout, replicas):
            _spawn(cfg, r, world, vocab_size, model_fn, allreduce_emulation)
        masters = ray.get([r.rank0.node_address.remote() for r in replicas])
        train_ref, val_ref = corpus_refs
        ray.get([w.setup.remote(addr, train_ref, val_ref) for r, addr in zip(replicas, masters) for w in r.workers])
    except BaseException:
        stop_replicas(replicas)  # kills the actors and removes the placement groups
        raise
    return replicas


@dataclass
class ReplicaLaunch:
    """A replica being started in the background (a replacement or a scale-up): placed, then
    its actors started, then set up. :meth:`advance` never blocks, so the run keeps training
    while it waits for resources (a pending placement group is what makes the Ray autoscaler
    add a node)."""

    replica: Replica
    requested: float  # time.monotonic() of the request
    stage: str = "placing"  # placing -> starting -> setup -> ready
    refs: list[Any] | None = None

    def advance(self, cfg: Config, corpus_refs: tuple[Any, Any], vocab_size: int, model_fn: ModelFn | None) -> bool:
        """One non-blocking step; True once the replica is set up and can join.

        Raises:
            ray.exceptions.RayError: an actor of the new replica died while starting.
        """
        import ray

        r, world = self.replica, cfg.diloco.workers_per_replica
        if self.stage == "placing":
            if not placed(r.placement_group):
                return False
            _spawn(cfg, r, world, vocab_size, model_fn)
            self.refs, self.stage = [r.rank0.node_address.remote()], "starting"
        if self.stage == "starting":
            assert self.refs is not None  # set with the stage
            ready, _ = ray.wait(self.refs, timeout=0)
            if not ready:
                return False
            addr = ray.get(self.refs[0])
            self.refs = [w.setup.remote(addr, *corpus_refs) for w in r.workers]
            self.stage = "setup"
        if self.stage == "setup":
            assert self.refs is not None  # set with the stage
            ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
            if len(ready) < len(self.refs):
                return False
            ray.get(self.refs)
            self.stage = "ready"
        return self.stage == "ready"


def launch_replica(cfg: Config, index: int, slot: int, join_step: int) -> ReplicaLaunch:
    """Request a new replica ``index`` in data slot ``slot`` (its placement group only; see
    :class:`ReplicaLaunch`)."""
    import time

    return ReplicaLaunch(
        _place(cfg, index, slot, cfg.diloco.workers_per_replica, replica_strategy(cfg), join_step), time.monotonic()
    )


def stop_replicas(replicas: list[Replica]) -> None:
    """Kill the replicas' actors and remove their placement groups (errors ignored: best effort)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for r in replicas:
        for w in r.workers:
            try:
                ray.kill(w)
            except Exception:
                pass
        if not r.owns_placement_group:
            continue
        try:
            remove_placement_group(r.placement_group)
        except Exception:
            pass


def all_workers(replicas: list[Replica]) -> list[Any]:
    """Every worker actor, replica by replica, rank 0 first."""
    return [w for r in replicas for w in r.workers]


def outer_side_failed(what: str) -> RunStopped:
    """The one line that stops a run whose outer-optimiser side (the driver or one of its shard
    actors) failed or stopped answering; ``what`` says how (after "the outer-optimiser driver").
    The launcher adds how to go on."""
    return RunStopped(f"the outer-optimiser driver {what}")


def error_cause(e: BaseException) -> str:
    """The last non-empty line of a Ray error's cause (at most 300 characters), for one-line
    messages; an actor's death is said in a few words (its exit type, from Ray's message)."""
    import re

    import ray

    if isinstance(e, ray.exceptions.RayActorError) and not isinstance(e, ray.exceptions.RayTaskError):
        kind = re.search(r"Worker exit type: (\w+)", str(e))
        return "its worker process died" + (f" ({kind.group(1)})" if kind else "")
    if isinstance(e, ray.exceptions.ObjectLostError):  # Ray's message ends on the owner's address
        return f"an object it needed was lost with the process or node that held it ({type(e).__name__})"
    text = str(getattr(e, "cause", None) or e).strip().splitlines()
    return next((ln for ln in reversed(text) if ln.strip()), type(e).__name__)[:300]
