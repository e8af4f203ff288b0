"""Two node losses per run with many outer shards: does the run finish with every outer step once
and the same global parameters on every worker?

Each seed runs ``ray-diloco train --address`` (a subprocess, as a user's job) on a multi-node Ray
cluster started on this machine (``ray.cluster_utils.Cluster``: a head without CPUs where the
job and the outer-optimiser driver run, ``--nodes`` nodes of one CPU), the tiny model, M =
``--replicas`` replicas, K = ``--shards`` outer shards (K = 7 on 3 nodes: 2-3 shards per node),
``run.log_hashes`` on. A random 3-15 s after the shards are up, the node holding most of them is
removed (every process on it killed, its object store gone) and a new node added; once every
shard runs again on a live node, a random 0.5-10 s later, the node then holding most shards is
removed and a node added. The seed draws both points.

Per seed it prints the outcome, the outer steps taken (of those planned) and how many twice, the
shard rebuilds, the steps a rebuilt shard redid without a pseudo-gradient lost with its node
(``partial_round``), the outer steps at which a worker's global parameters hashed differently
from the driver's (expected only at a partially redone step, until the resync of every replica
at its next round), whether they are equal at the end, the shards each loss took and the run's
last line on error. A run may rightly stop when a shard and the
shard keeping its copy are lost before the copy is sent again (docs/elasticity.md, the failure
model): such a stop prints ``outer state lost`` and is counted apart from failures.

    python benchmarks/node_losses.py [--seeds 1-10] [--shards 7] [--replicas 3] [--nodes 3]
                                     [--steps 600] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = ["model.preset=tiny", "model.n_layers=2", "model.n_heads=2", "model.d_model=32", "model.d_ff=64",
        "model.context=16", "data.seq_len=16", "inner.lr=3e-3", "inner.warmup_steps=2", "inner.global_batch=6",
        "diloco.H=5", "diloco.cpus_per_worker=1", "run.eval_every=0", "run.log_hashes=true",
        "run.checkpoint_every=2", "tracking.wandb=false", "tracking.progress=false", "network.latency_ms=50"]  # fmt: skip


def one_seed(seed: int, args: argparse.Namespace, out: Path) -> dict:
    """One run with two node losses; its row."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    rng = random.Random(seed)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(args.nodes):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR")
    sets = [*TINY, f"diloco.outer_shards={args.shards}", f"diloco.replicas={args.replicas}",
            f"run.steps={args.steps}", f"run.seed={seed}", f"run.output_dir={out}", "run.name=losses"]  # fmt: skip
    cmd = [sys.executable, "-m", "ray_diloco.cli", "train", "--address", cluster.address]
    for s in sets:
        cmd += ["--set", s]
    err_path = out / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    removed: set[str] = set()
    losses: list[list[str]] = []

    def shards() -> dict[str, list[str]]:  # live node -> its shards (Ray lists a removed node's actors alive a while)
        by: dict[str, list[str]] = {}
        for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000, detail=True):
            if a.class_name == "OuterShard" and a.node_id not in removed:
                by.setdefault(a.node_id, []).append(a.repr_name)
        return by

    def wait(seconds: float, until_all_shards: bool = False) -> bool:
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < seconds:
            if until_all_shards and sum(map(len, shards().values())) >= args.shards:
                return True
            time.sleep(0.2)
        return proc.poll() is None and not until_all_shards

    def lose_busiest() -> None:
        workers = {n.node_id: n for n in cluster.worker_nodes}
        node, held = max(((n, s) for n, s in shards().items() if n in workers), key=lambda x: (len(x[1]), x[0]))
        removed.add(node)
        cluster.remove_node(workers[node], allow_graceful=False)
        losses.append(sorted(held))
        cluster.add_node(num_cpus=1)

    try:
        if wait(300, until_all_shards=True) and wait(rng.uniform(3, 15)):
            lose_busiest()
            if wait(1) and wait(120, until_all_shards=True) and wait(rng.uniform(0.5, 10)):
                lose_busiest()
        try:
            rc: int | str = proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
    finally:
        ray.shutdown()
        cluster.shutdown()
    rows = [
        json.loads(line) for f in out.glob("*/metrics.jsonl") for line in f.read_text().splitlines() if line.strip()
    ]
    steps = [r["outer_step"] for r in rows if "outer_step" in r]
    lines = [
        ln
        for ln in err_path.read_text().splitlines()
        if ln.startswith(("error:", "membership: shard_recovered", "membership: partial_round"))
    ]
    last = next((ln for ln in reversed(lines) if ln.startswith("error:")), "")
    return {
        "seed": seed,
        "rc": rc,
        "outer_steps": len(set(steps)),
        "planned": args.steps // 5,
        "twice": len(steps) - len(set(steps)),
        "unequal_steps": sorted(
            r["outer_step"]
            for r in rows
            if "global_sha256" in r and not set(r.get("worker_global_sha256", [])) <= {r["global_sha256"]}
        ),
        "final_equal": bool(rows) and set(rows[-1].get("worker_global_sha256", [])) <= {rows[-1].get("global_sha256")},
        "partial_redos": sum("partial_round" in ln for ln in lines),
        "losses": losses,
        "rebuilds": sum(ln.startswith("membership: shard_recovered") for ln in lines),
        "outcome": "finished" if rc == 0 else "outer state lost" if "outer state is lost" in last else "failed",
        "error": last,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1-10", help="seeds A-B or a comma list (default 1-10)")
    ap.add_argument("--shards", type=int, default=7, help="diloco.outer_shards K (default 7)")
    ap.add_argument("--replicas", type=int, default=3, help="diloco.replicas M (default 3)")
    ap.add_argument("--nodes", type=int, default=3, help="1-CPU nodes besides the head (default 3)")
    ap.add_argument("--steps", type=int, default=600, help="inner steps of each run (H = 5; default 600)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()
    a, _, b = args.seeds.partition("-")
    seeds = list(range(int(a), int(b) + 1)) if b else [int(s) for s in args.seeds.split(",")]
    os.environ.setdefault("WANDB_MODE", "disabled")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            print(f"-- seed {seed}", file=sys.stderr)
            out = Path(tmp) / f"seed{seed}"
            out.mkdir()
            rows.append(one_seed(seed, args, out))
    print(f"\n{'seed':>4} {'outcome':<17} {'steps':>9} {'twice':>5} {'rebuilds':>8} {'partial':>7} "
          f"{'globals differ at':>17} {'end equal':>9}  shards lost")  # fmt: skip
    for r in rows:
        differ = ",".join(map(str, r["unequal_steps"])) or "-"
        print(f"{r['seed']:>4} {r['outcome']:<17} {r['outer_steps']:>4}/{r['planned']:<4} {r['twice']:>5} "
              f"{r['rebuilds']:>8} {r['partial_redos']:>7} {differ:>17} {str(r['final_equal']):>9}  "
              f"{' then '.join(','.join(x) for x in r['losses'])}")  # fmt: skip
        if r["outcome"] != "finished":
            print(f"     {r['error'][:200]}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
