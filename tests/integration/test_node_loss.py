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


SPARE = textwrap.dedent("""
    import glob, sys, threading, time
    from pathlib import Path
    import ray
    from ray.cluster_utils import Cluster
    from helpers import start_trainer, tiny_overrides, torch_lm
    from ray_diloco.components.checkpoint import latest_checkpoint, load_checkpoint
    from ray_diloco.components.data import load_corpus
    from ray_diloco.config import load_config
    from ray_diloco.errors import CheckpointError

    tmp = Path(sys.argv[1])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(3):  # two replicas and a hot spare, one per node
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    cfg = load_config(tiny_overrides(tmp, run__name="spare", run__steps=60, diloco__H=5, diloco__outer_shards=2,
                                     diloco__cpus_per_worker=1, diloco__spare_replicas=1, run__log_hashes=True,
                                     run__eval_every=0, run__checkpoint_every=0, network__latency_ms=100.0))
    t = start_trainer(cfg, load_corpus(cfg.data), torch_lm)

    def node_of(actor):
        return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))

    try:
        t.members.top_up()
        while not t.members.poll():  # the spare is set up
            time.sleep(0.1)
        rows = [t.outer_step(1), t.outer_step(2)]
        t.checkpoint()  # the checkpoint before the loss
        shard_nodes = set(t.sync.driver and ray.get(t.driver.__ray_call__.remote(lambda d: d.shards.nodes)))
        live = {r.index: node_of(r.rank0) for r in t.replicas}
        victim_replica, victim = next((i, n) for i, n in sorted(live.items(), reverse=True) if n in shard_nodes)
        print("VICTIM-HOLDS-A-SHARD-AND-REPLICA", victim_replica, flush=True)
        landed = []

        def kill_in_the_checkpoint():  # as soon as the checkpoint's temporary directory exists
            while not glob.glob(str(t.run_dir / "checkpoints" / ".tmp-step_*")):
                time.sleep(0.001)
            cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == victim), allow_graceful=False)
            landed.append(bool(glob.glob(str(t.run_dir / "checkpoints" / ".tmp-step_*"))))

        killer = threading.Thread(target=kill_in_the_checkpoint)
        killer.start()
        rows.append(t.outer_step(3))
        try:
            t.checkpoint()
            print("CHECKPOINT-3 written", flush=True)
        except CheckpointError as e:
            print("CHECKPOINT-3 failed:", e, flush=True)
        killer.join()
        print("LANDED-IN-CHECKPOINT", landed, flush=True)
        for k in range(4, 13):
            rows.append(t.outer_step(k))
        final = t.checkpoint()
        state = load_checkpoint(final)
        print("FINAL-CHECKPOINT", final.name, sorted(m[0] for m in state["membership"]["members"]), flush=True)
        print("TMP-LEFT", glob.glob(str(t.run_dir / "checkpoints" / ".tmp-*")), flush=True)
        kept = sorted(p.name for p in (t.run_dir / "checkpoints").glob("step_*"))
        print("CHECKPOINTS", kept, all(load_checkpoint(t.run_dir / "checkpoints" / n)["outer_step"] == int(n[5:])
                                       for n in kept), flush=True)
        print("EVENTS", [(r["outer_step"], e["event"], e.get("replica")) for r in rows for e in r.get("events", [])],
              flush=True)
        print("HASHES-AGREE", all(set(r["worker_global_sha256"]) <= {r["global_sha256"]} for r in rows), flush=True)
        print("STEPS", [r["outer_step"] for r in rows], flush=True)
    finally:
        t.shutdown()
    ray.shutdown()
    cluster.shutdown()
""")


@pytest.mark.slow
def test_a_node_lost_during_a_checkpoint_promotes_the_spare_on_another_node(tmp_path):
    """Two replicas and a hot spare on three nodes: the node of a live replica and an outer shard
    is removed while a checkpoint is being written (as soon as its temporary directory exists; the
    directory still exists after the removal, so it came before the rename). That checkpoint
    either completes (the writers were done) or fails with one line; the previous one stays, the spare (on another node) is promoted at the next outer step, every later checkpoint
    completes, no temporary directory is left, globals stay identical."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run([sys.executable, "-c", SPARE, str(tmp_path)], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path, env=env)
    out = p.stdout
    assert p.returncode == 0, out + p.stderr[-5000:]
    print(out)
    assert "LANDED-IN-CHECKPOINT [True]" in out  # the kill came before the checkpoint's rename
    assert "STEPS [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]" in out and "HASHES-AGREE True" in out
    assert "TMP-LEFT []" in out
    kept = next(line for line in out.splitlines() if line.startswith("CHECKPOINTS"))
    assert "'step_000002'" in kept and "'step_000012'" in kept and kept.endswith("True")  # each one loads
    victim = int(next(line for line in out.splitlines() if line.startswith("VICTIM")).split()[-1])
    final = next(line for line in out.splitlines() if line.startswith("FINAL-CHECKPOINT"))
    assert final.startswith("FINAL-CHECKPOINT step_000012") and str(victim) not in final.split("[")[1]
    assert len(eval(final.split(" ", 2)[2])) == 2  # two members: the survivor and the promoted spare
    events = next(line for line in out.splitlines() if line.startswith("EVENTS"))
    assert "'shard_recovered'" in events and f"'death', {victim})" in events and "'join'" in events
