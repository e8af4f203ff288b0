"""Recovery from replica deaths on the tiny model: how long until training goes on, how long a
replacement takes to join, and what the faults cost in loss.

Runs on a local Ray cluster, the `tiny` shape in the llama family (FFN 352: the model of docs/benchmarks.md's
figures, measured before `tiny` became nanoGPT's GPT-2 family), M=2 replicas, H=50, the bundled corpus:

    fault-free      no faults (the reference loss)
    kill            one replica's process is SIGKILLed at a random point of outer step K; the
                    replacement is started then (actor start-up, model build, data shard)
    kill+spare      the same with ``diloco.spare_replicas=1``: a set-up spare joins instead

With ``--nodes N`` (N >= 3) it runs on a multi-node Ray cluster started on this machine
(``ray.cluster_utils.Cluster``: a head without CPUs where the job and the outer-optimiser driver
run, N - 1 nodes of one CPU, each its own raylet and object store), one replica per node, the
outer optimiser split over two shard actors (``diloco.outer_shards: 2``) on the replicas' nodes:

    fault-free      no faults
    node loss       at a random point of outer step K the node holding replica 1 and an outer
                    shard is removed (every process on it killed, its object store gone); a new
                    node joins after the outer step; the shard is rebuilt from its copy
                    (``diloco.outer_shard_backup``) and a replacement replica starts on the new node

For each faulty run it prints: seconds from the kill until Ray reports the death and the driver
stops waiting (detect), seconds from the kill until the next outer step completes (next step), seconds from the
joiner's launch request until it joins (start-up; for the spare that is since the run began),
seconds from the kill until a replica joins in its place, and the final validation loss of the
global parameters beside the fault-free one; with ``--nodes``, also the seconds the shard's rebuild
took and the outer steps lost (outer steps the run took minus the global version: 0 when no
step was lost).

    python benchmarks/faults.py [--steps 600] [--kill-step 5] [--seed 0] [--nodes N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time

os.environ.setdefault("WANDB_MODE", "disabled")


def run(name: str, steps: int, kill_step: int | None, spare: int, out_dir: str, seed: int, cluster=None) -> dict:
    import ray

    from ray_diloco.components.data import load_corpus
    from ray_diloco.config import load_config
    from ray_diloco.runtime.launcher import new_run_dir
    from ray_diloco.runtime.trainer import Trainer

    cfg = load_config(None, ["diloco.replicas=2", "diloco.H=50", f"run.steps={steps}", "run.eval_every=0",
                             "run.checkpoint_every=0", f"run.output_dir={out_dir}", f"run.name={name}",
                             "tracking.wandb=false", "tracking.progress=false", "diloco.cpus_per_worker=0.5",
                             f"diloco.spare_replicas={spare}", f"run.seed={seed}", "model.family=llama", "model.d_ff=352",
                             *(["diloco.cpus_per_worker=1", "diloco.outer_shards=2"] if cluster else [])])
    corpus = load_corpus(cfg.data)
    t = Trainer(cfg, new_run_dir(cfg), corpus)
    t.start()
    out: dict = {"run": name}
    try:
        if spare:  # the run starts with its spare set up
            t.members.top_up()
            while not t.members.poll():
                time.sleep(0.1)
        killed_at: list[float] = []

        def kill() -> None:
            time.sleep(random.Random(seed).uniform(0.2, 1.5))
            victim = t.replicas[-1].rank0
            if cluster is not None:  # its whole node
                node = ray.get(victim.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
                killed_at.append(time.monotonic())
                cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node), allow_graceful=False)
                return
            pid = ray.get(victim.pid.remote())
            killed_at.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)

        events = []
        for k in range(1, cfg.num_outer_steps + 1):
            killer = threading.Thread(target=kill) if k == kill_step else None
            if killer:
                killer.start()
            row = t.outer_step(k)
            done = time.monotonic()
            if killer:
                killer.join()
                if cluster is not None:
                    cluster.add_node(num_cpus=1)  # a new node for the replacement (from the main thread)
            for ev in row.get("events", []):
                events.append({**ev, "seen": done, "outer_step": k})
            if killed_at and "next_step_s" not in out and k > kill_step - 1 and done > killed_at[0]:
                if any(e["event"] == "death" for e in events):
                    out["next_step_s"] = done - killed_at[0]
        out["final_eval_loss"] = t.evaluate()
        if cluster is not None:
            out["outer_steps_lost"] = cfg.num_outer_steps - min(ray.get(t.driver.global_versions.remote()))
            rebuilt = [e for e in events if e["event"] == "shard_recovered"]
            if rebuilt:
                out["shard_rebuild_s"] = rebuilt[0]["seconds"]
        if killed_at:
            death = next(e for e in events if e["event"] == "death")
            join = next((e for e in events if e["event"] == "join"), None)
            wall_now = time.time() - time.monotonic()  # event times are wall-clock
            out["detect_s"] = death["time"] - wall_now - killed_at[0]
            if join is not None:
                out["admit_s"] = join["admit_s"]
                out["kill_to_join_s"] = join["time"] - wall_now - killed_at[0]
                out["join_outer_step"] = join["outer_step"]
    finally:
        t.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600, help="inner steps of each run (default 600)")
    ap.add_argument("--kill-step", type=int, default=5, help="outer step in which a replica is killed")
    ap.add_argument("--seed", type=int, default=0, help="the runs' seed and the kill's point in its outer step (default 0)")
    ap.add_argument("--nodes", type=int, default=1, help="N >= 3: a node's loss on an N-node Ray cluster")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()
    import ray

    cluster = None
    if args.nodes >= 3:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for _ in range(args.nodes - 1):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR")
        plan = [("fault-free", None, 0), ("node loss", args.kill_step, 0)]
    elif args.nodes != 1:
        ap.error(f"--nodes {args.nodes}: 1 (one local node) or at least 3 (a head and a node per replica)")
    else:
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
        plan = [("fault-free", None, 0), ("kill", args.kill_step, 0), ("kill+spare", args.kill_step, 1)]
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        for name, kill_step, spare in plan:
            print(f"-- {name}", file=sys.stderr)
            rows.append(run(name, args.steps, kill_step, spare, out_dir, args.seed, cluster))
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()
    ref = rows[0]["final_eval_loss"]
    print(f"\n{'run':<12} {'detect s':>9} {'next step s':>12} {'start-up s':>10} {'kill->join s':>13} {'join step':>10} "
          f"{'final loss':>11} {'gap':>7}" + (f" {'rebuild s':>9} {'steps lost':>10}" if cluster else ""))
    fmt = lambda v, f: format(v, f) if v is not None else format("-", ">" + f[:-1].split(".")[0])  # noqa: E731
    for r in rows:
        r["loss_gap"] = r["final_eval_loss"] / ref - 1
        print(f"{r['run']:<12} {fmt(r.get('detect_s'), '9.2f')} {fmt(r.get('next_step_s'), '12.2f')} "
              f"{fmt(r.get('admit_s'), '10.2f')} {fmt(r.get('kill_to_join_s'), '13.2f')} "
              f"{fmt(r.get('join_outer_step'), '10d')} {r['final_eval_loss']:11.4f} {r['loss_gap']:+7.2%}"
              + (f" {fmt(r.get('shard_rebuild_s'), '9.2f')} {r['outer_steps_lost']:10d}" if cluster else ""))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
