"""Cluster shapes a local single-node session cannot show, on a real multi-node Ray cluster on this
machine (``ray.cluster_utils.Cluster``: one raylet per node) in a subprocess: the start-up check
waiting for nodes (``diloco.wait_for_nodes``: a GPU node type with ``min_workers: 0`` comes up
while it waits), a replica spanning nodes (``diloco.replica_nodes: several``), and where the
outer-optimiser driver runs (``diloco.driver_resource``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    import ray
    from ray.cluster_utils import Cluster
    from ray_diloco.config import load_config
    from ray_diloco.errors import ClusterError
    from ray_diloco.runtime.cluster import check_resources, launch_replica, placed, stop_replicas, wait_placed

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    # torn down however the script ends: a failed script left its raylets running and
    # /tmp/ray/ray_current_cluster naming a dead head, which a later plain ray.init() waits on
    atexit.register(lambda: (ray.shutdown(), cluster.shutdown()))
    ray.init(address=cluster.address)
    base = ["diloco.replicas=2", "diloco.cpus_per_worker=0.5", "diloco.gpus_per_worker=1", "tracking.wandb=false"]

    # without waiting: the GPUs are missing now, one line at once
    t0 = time.monotonic()
    try:
        check_resources(load_config(None, base))
        print("NO-ERROR")
    except ClusterError as e:
        print("AT-ONCE", round(time.monotonic() - t0, 1), e)

    # waiting: a 2-GPU node joins after 3 s (what the autoscaler does), the check returns then
    got = []
    waiting = threading.Thread(target=lambda: got.append(check_resources(load_config(
        None, base + ["diloco.wait_for_nodes=true", "diloco.placement_timeout_s=60"]))))
    t0 = time.monotonic()
    waiting.start()
    time.sleep(3.0)
    cluster.add_node(num_cpus=1, num_gpus=2)  # Ray starts nodes from the main thread only
    waiting.join()
    print("WAITED", round(time.monotonic() - t0, 1), got[0])

    # waiting for more than ever comes: the same line, after the timeout
    try:
        check_resources(load_config(None, base + ["diloco.replicas=3", "diloco.wait_for_nodes=true",
                                                  "diloco.placement_timeout_s=2"]))
    except ClusterError as e:
        print("TIMED-OUT", e)

    # a replica of 2 workers x 1 CPU where every node has 1 CPU: only a PACK group (several nodes) places
    for nodes in ("one", "several"):
        cfg = load_config(None, ["diloco.replicas=1", "diloco.workers_per_replica=2", "diloco.cpus_per_worker=1",
                                 f"diloco.replica_nodes={nodes}", "tracking.wandb=false"])
        launch = launch_replica(cfg, 0, 0, 0)
        ok = wait_placed([launch.replica.placement_group], 2) is None  # PACK places in well under 2 s
        print("PLACED", nodes, ok)
        stop_replicas([launch.replica])

    # the outer-optimiser driver: pinned to the job's node (this process's), also when that node is
    # busy (the scheduler then prefers another node for an actor of 0 CPUs: a replica's); with
    # diloco.driver_resource on the node that offers that resource; a resource no node has is one line
    import numpy as np
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from ray_diloco.runtime.cluster import driver_placement
    from ray_diloco.runtime.driver import OuterDriverActor

    here = ray.get_runtime_context().get_node_id()
    busy = ray.remote(num_cpus=1)(lambda: time.sleep(600)).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()
    time.sleep(1.0)  # the head's CPU is taken

    def node_of(actor):
        return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))

    cfg = load_config(None, ["diloco.replicas=2", "tracking.wandb=false"])
    drivers = [OuterDriverActor.options(**driver_placement(cfg)).remote([np.zeros(4, np.float32)], cfg.to_dict())
               for _ in range(4)]
    print("DRIVERS-ON-THE-JOB-NODE", [node_of(d) == here for d in drivers])
    ray.cancel(busy, force=True)
    outer_node = cluster.add_node(num_cpus=0, resources={"outer_host": 1})
    cfg = load_config(None, ["diloco.replicas=2", "diloco.driver_resource=outer_host", "tracking.wandb=false"])
    check_resources(cfg)
    driver = OuterDriverActor.options(**driver_placement(cfg)).remote([np.zeros(4, np.float32)], cfg.to_dict())
    print("DRIVER-ON-THE-RESOURCE-NODE", node_of(driver) == outer_node.node_id)
    try:
        check_resources(load_config(None, ["diloco.replicas=2", "diloco.driver_resource=nope", "tracking.wandb=false"]))
    except ClusterError as e:
        print("NO-SUCH-RESOURCE", e)
""")


@pytest.mark.slow
def test_the_start_up_check_waits_for_nodes_and_a_replica_spans_nodes(tmp_path):
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = p.stdout
    assert p.returncode == 0, out + p.stderr[-3000:]
    at_once = next(line for line in out.splitlines() if line.startswith("AT-ONCE"))
    assert float(at_once.split()[1]) < 10 and "x diloco.gpus_per_worker 1 = 2 GPUs, but the Ray cluster has 0" in at_once
    waited = next(line for line in out.splitlines() if line.startswith("WAITED")).split()
    assert 2.5 <= float(waited[1]) < 30 and float(waited[2]) == 0.5
    assert "note: waiting up to 60 s for the autoscaler" in p.stderr
    timed_out = next(line for line in out.splitlines() if line.startswith("TIMED-OUT"))
    assert "= 3 GPUs, but the Ray cluster has 2 (after waiting diloco.placement_timeout_s = 2 s" in timed_out
    assert "PLACED one False" in out and "PLACED several True" in out
    assert "DRIVERS-ON-THE-JOB-NODE [True, True, True, True]" in out
    assert "DRIVER-ON-THE-RESOURCE-NODE True" in out
    no_such = next(line for line in out.splitlines() if line.startswith("NO-SUCH-RESOURCE"))
    assert "diloco.driver_resource = 'nope': no node of the Ray cluster offers this resource" in no_such
