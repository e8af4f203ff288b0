"""A worker's memory under each replica layout: DDP, FSDP and HSDP (``diloco.sharding``).

One replica of ``--workers`` W ranks (default 4) trains a llama of ``--params`` parameters
(width 1024, as ``benchmarks/init_from.py``'s, random initialisation) for one outer step of one
inner step, so every rank holds its parameters, gradients, AdamW moments and its copy of the global
parameters. For ``ddp`` (each rank the whole model), ``hsdp`` with shard groups of ``--group`` S
(default W / 2) and ``fsdp`` (S = W), each worker's private memory (``RssAnon``) after that step,
minus the same worker's after the same step on a 23k-parameter model (torch, transformers and Ray
themselves), in U = 4 bytes x parameters; and the peak during start-up and the step (a randomly
initialised model is built whole on every rank before it is sharded: 1 U more for a moment).

What to expect: DDP holds parameters, gradients, two AdamW moments and the global copy, 5 U; a
sharded layout 5 / S U.

    python benchmarks/sharding.py [--params 1e8] [--workers 4] [--group 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from exchange import _status  # noqa: E402  (/proc/PID/status fields)
from init_from import Peaks  # noqa: E402  (per-process peak RssAnon of Ray actors by title)


def measure(model: dict, workers: int, sharding: str, group: int, out: str) -> tuple[list[int], list[int], int]:
    """One replica of ``workers`` on ``sharding``: (each worker's RssAnon after one outer step,
    each worker's peak, the model's parameters), workers in rank order."""
    from ray_diloco.components.data import load_corpus
    from ray_diloco.config import load_config
    from ray_diloco.runtime.launcher import new_run_dir
    from ray_diloco.runtime.trainer import Trainer

    cfg = load_config({
        "model": model,
        "data": {"path": str(ROOT / "ray_diloco" / "data" / "tinyshakespeare.txt"), "seq_len": 32},
        "inner": {"global_batch": workers},
        "diloco": {"replicas": 1, "workers_per_replica": workers, "sharding": sharding, "H": 1,
                   "shard_group_size": group if sharding == "hsdp" else None, "cpus_per_worker": 0.5},
        "run": {"steps": 1, "eval_every": 0, "checkpoint_every": 0, "output_dir": out,
                "name": f"{sharding}-{model['d_model']}"},
        "tracking": {"wandb": False, "progress": False},
    })  # fmt: skip
    corpus = load_corpus(cfg.data)
    peaks = Peaks(("ReplicaWorker",))
    t = Trainer(cfg, new_run_dir(cfg), corpus, None)
    try:
        t.start()
        t.outer_step(1)
        t.settle()
        import ray

        pids = ray.get([w.pid.remote() for w in t.replicas[0].workers])
        now = [_status(p, "RssAnon") for p in pids]
        n = sum(s.numel for s in t.fragments)
    finally:
        found = peaks.stop()
        t.shutdown()
    return now, [found.get(("ReplicaWorker", p), 0) for p in pids], n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--group", type=int, default=None, help="HSDP shard group size (default workers / 2)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import ray

    group = a.group or a.workers // 2
    per_layer = 4 * 1024 * 1024 + 3 * 1024 * 2816 + 2 * 1024
    layers = max(1, round(a.params / per_layer))
    big = {"preset": "cpu-small", "family": "llama", "n_layers": layers, "n_heads": 16, "d_model": 1024,
           "d_ff": 2816, "context": 64}  # fmt: skip
    tiny = {"preset": "cpu-small", "family": "llama", "n_layers": 2, "n_heads": 2, "d_model": 32, "d_ff": 64,
            "context": 64}  # fmt: skip
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for sharding in ("ddp", "hsdp", "fsdp"):
            base, _, _ = measure(tiny, a.workers, sharding, group, tmp)
            now, peak, n = measure(big, a.workers, sharding, group, tmp)
            unit = 4 * n
            s = {"ddp": 1, "hsdp": group, "fsdp": a.workers}[sharding]
            rows.append({
                "sharding": sharding, "workers": a.workers, "shard_group": s, "params": n,
                "after_step_u": [round((x - b) / unit, 3) for x, b in zip(now, base)],
                "peak_u": [round((x - b) / unit, 3) for x, b in zip(peak, base)],
            })  # fmt: skip
    print(f"model: {n:,} parameters, U = {unit / 1e9:.2f} GB; one replica of {a.workers} workers")
    print(f"{'sharding':8} {'S':>3}  {'per worker after a step (U)':>30}  {'peak (U)':>26}")
    for r in rows:
        after, peak = ", ".join(f"{x:.2f}" for x in r["after_step_u"]), ", ".join(f"{x:.2f}" for x in r["peak_u"])
        print(f"{r['sharding']:8} {r['shard_group']:>3}  {after:>30}  {peak:>26}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
