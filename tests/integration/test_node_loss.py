"""A node's loss on a real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``:
each node its own raylet and object store; ``remove_node`` kills all of a node's processes, as a
spot preemption does), in a subprocess: the outer-optimiser driver stays on the job's node, and
the loss of a node holding a replica and an outer shard (``diloco.outer_shards: 2``) costs the run
neither its outer state nor a step (docs/elasticity.md, the failure model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from helpers import ROOT, read_metrics

SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    from pathlib import Path
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors
    from helpers import tiny_overrides, torch_lm
    from ray_diloco.runtime.launcher import train

    tmp = Path(sys.argv[1])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # the job's node: no replica fits
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    head = ray.get_runtime_context().get_node_id()
    # one replica per node (1 CPU each); 250 ms per message on the replica-driver links: every outer
    # step lasts >= 0.5 s, so the steps after the loss outlast a new node's and a replacement's start
    cfg = tiny_overrides(tmp, run__name="node", run__steps=150, diloco__H=5, diloco__outer_shards=2,
                         diloco__cpus_per_worker=1, diloco__sync_timeout_s=20, run__log_hashes=True,
                         run__eval_every=0, run__checkpoint_every=0, network__latency_ms=250.0)
    at = threading.Event()
    out = {}

    def on_row(row):
        if row["outer_step"] == 3:
            at.set()

    def run():
        try:
            out["summary"] = train(cfg, address=cluster.address, model_fn=torch_lm, on_outer_step=on_row)
        except BaseException as e:
            out["error"] = repr(e)
            at.set()

    th = threading.Thread(target=run)
    th.start()
    at.wait(300)
    nodes = {}
    for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        nodes.setdefault(a.node_id, []).append(a.class_name)
    driver = [n for n, cls in nodes.items() if "OuterDriver" in cls]
    print("DRIVER-ON-HEAD", driver == [head], flush=True)
    victim = next(n for n, cls in nodes.items() if n != head and "OuterShard" in cls and "ReplicaWorker" in cls)
    print("NODES", sorted(sorted(c) for c in nodes.values()), "VICTIM", sorted(nodes[victim]), flush=True)
    cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == victim), allow_graceful=False)
    t0 = time.monotonic()
    time.sleep(2.0)
    cluster.add_node(num_cpus=1)
    th.join(600)
    print("RESULT", json.dumps({k: (v if k == "error" else v.get("final_eval_loss")) for k, v in out.items()}), flush=True)
    ray.shutdown()
    cluster.shutdown()
""")


@pytest.mark.slow
def test_a_node_holding_a_replica_and_an_outer_shard_dies_and_the_run_goes_on(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path, env=env)
    out = p.stdout
    assert p.returncode == 0, out + p.stderr[-5000:]
    print(out)
    assert "DRIVER-ON-HEAD True" in out
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[7:])
    assert "error" not in result, result
    rows = read_metrics(tmp_path / "runs" / "node")
    events = [e for r in rows for e in r.get("events", [])]
    kinds = [e["event"] for e in events]
    assert kinds.count("shard_recovered") == 1 and kinds.count("death") >= 1 and "join" in kinds, kinds
    assert [r["outer_step"] for r in rows] == list(range(1, 31))
    for r in rows:  # every live replica holds the driver's global parameters after each outer step
        assert set(r["worker_global_sha256"]) <= {r["global_sha256"]}, (r["outer_step"], r.get("events"))
    assert rows[-1]["replicas_live"] == 2
    assert "ObjectLostError" not in p.stderr and "OwnerDiedError" not in p.stderr, p.stderr[-3000:]
