"""Bit-for-bit fingerprints of short training runs: does a change keep what every run computes?

Runs five variants of the bundled Tiny Shakespeare run on one fixed seed with
``run.log_hashes`` and ``run.deterministic`` (``tiny`` model, M=2, H=12, 48 inner steps, one Ray
session for all):

    ddp              2 replicas x 1 worker, one fragment, fp32
    ddp_2x2          2 replicas x 2 workers (DDP)
    fsdp_2x2         2 replicas x 2 workers, diloco.sharding=fsdp
    streaming_fp4    3 fragments, overlap 2 (tau), fp4_e3m0 both ways
    outer_shards_2   the outer side in 2 shards (diloco.outer_shards=2), int8

and writes, per variant and outer step, every ``*_sha256`` field of ``metrics.jsonl`` (the outer
side's global parameters and outer state, each worker's global copy and local parameters, the
data read) and the final evaluation loss. ``--compare A B`` lists every field that differs
between two such files and exits 1 if any does: a refactor that claims "behaviour unchanged"
shows it with a file written before the change and one after.

    python benchmarks/hashes.py --json before.json
    python benchmarks/hashes.py --json after.json
    python benchmarks/hashes.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("WANDB_MODE", "disabled")

COMMON = ["diloco.replicas=2", "diloco.H=12", "run.steps=48", "inner.warmup_steps=2", "run.eval_every=2",
          "run.checkpoint_every=0", "run.log_hashes=true", "run.deterministic=true", "run.seed=7",
          "tracking.wandb=false", "tracking.progress=false", "inner.global_batch=8"]  # fmt: skip

VARIANTS: dict[str, list[str]] = {
    "ddp": [],
    "ddp_2x2": ["diloco.workers_per_replica=2"],
    "fsdp_2x2": ["diloco.workers_per_replica=2", "diloco.sharding=fsdp"],
    "streaming_fp4": ["streaming.fragments=3", "streaming.overlap_steps=2", "streaming.quantization=fp4_e3m0"],
    "outer_shards_2": ["diloco.outer_shards=2", "streaming.fragments=2", "streaming.quantization=int8"],
}


def fingerprint(name: str, extra: list[str], out_dir: str) -> dict[str, Any]:
    """Run one variant; its outer steps' hash fields and final evaluation loss."""
    import ray_diloco

    summary = ray_diloco.train(None, [*COMMON, f"run.output_dir={out_dir}", f"run.name={name}", *extra])
    steps = []
    with open(os.path.join(out_dir, name, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "outer_step" not in row:
                continue
            keep = {k: v for k, v in row.items() if k.endswith("_sha256") or k == "data_digest"}
            if "eval_loss" in row:
                keep["eval_loss"] = row["eval_loss"]
            steps.append({"outer_step": row["outer_step"], **keep})
    return {"overrides": extra, "outer_steps": steps, "final_eval_loss": summary.get("final_eval_loss")}


def compare(a_path: str, b_path: str) -> int:
    """Print every differing field of two fingerprint files; 0 if none differ, else 1."""
    with open(a_path) as f:
        a = json.load(f)["variants"]
    with open(b_path) as f:
        b = json.load(f)["variants"]
    diffs = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            diffs.append(f"{name}: only in {a_path if name in a else b_path}")
            continue
        if a[name]["final_eval_loss"] != b[name]["final_eval_loss"]:
            diffs.append(f"{name}: final_eval_loss {a[name]['final_eval_loss']} != {b[name]['final_eval_loss']}")
        sa, sb = a[name]["outer_steps"], b[name]["outer_steps"]
        if len(sa) != len(sb):
            diffs.append(f"{name}: {len(sa)} outer steps != {len(sb)}")
        for ra, rb in zip(sa, sb):
            for key in sorted(set(ra) | set(rb)):
                if ra.get(key) != rb.get(key):
                    diffs.append(f"{name} outer step {ra['outer_step']}: {key} differs")
    fields = sum(len(r) - 1 for v in a.values() for r in v["outer_steps"])
    for d in diffs:
        print(d)
    print(f"{len(a)} variants, {fields} fields: " + ("identical" if not diffs else f"{len(diffs)} differ"))
    return 1 if diffs else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="write the fingerprints here")
    ap.add_argument("--only", nargs="+", choices=sorted(VARIANTS), help="run these variants only")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two files written by --json")
    a = ap.parse_args()
    if a.compare:
        sys.exit(compare(*a.compare))
    res: dict[str, Any] = {"common": COMMON, "variants": {}}
    with tempfile.TemporaryDirectory() as out:
        for name in a.only or VARIANTS:
            res["variants"][name] = fingerprint(name, VARIANTS[name], out)
            v = res["variants"][name]
            print(f"{name:16} {len(v['outer_steps'])} outer steps, final eval loss {v['final_eval_loss']}")
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, a.json)


if __name__ == "__main__":
    main()
