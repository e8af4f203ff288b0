"""Communication and compute utilisation of DP, DiLoCo and Streaming DiLoCo over a slow link.

Five runs on the same tiny model (the `tiny` shape in the llama family, FFN 352: the model of
docs/benchmarks.md's figures, measured before `tiny` became nanoGPT's GPT-2 family), data, batch (12 x 64 tokens), inner
optimiser and token budget, M=2 replicas x 1 worker, every replica-to-driver link (and DP's
all-reduce) emulated at 0.1 Gbit/s with 50 ms one-way latency (``network.*``):

    DP                      all-reduce every step (DDP comm hook adds the ring's emulated time)
    DiLoCo                  H=100, one fragment, fp32, blocking
    Streaming               H=100, P=4 block fragments (+ embeddings, + head), fp32, blocking
    Streaming+overlap       the same with tau=5 (merge 5 steps after the send), alpha=0
    Streaming+overlap+FP4   the same with fp4_e3m0 both ways

Prints final validation loss of the global model, bytes per replica (up + down, serialised
messages) and their ratio to DP, peak bytes in one sync (DP: one step's all-reduce), and
compute utilisation = inner-compute seconds / wall seconds of the training rounds.

    python benchmarks/streaming.py [--steps 1000] [--seeds 0 1] [--only DiLoCo ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("WANDB_MODE", "disabled")

METHODS = {
    "DiLoCo": [],
    "Streaming": ["streaming.fragments=4"],
    "Streaming+overlap": ["streaming.fragments=4", "streaming.overlap_steps=5"],
    "Streaming+overlap+FP4": ["streaming.fragments=4", "streaming.overlap_steps=5", "streaming.quantization=fp4_e3m0"],
    "DP": ["algorithm=dp"],
}


MODEL = ["model.family=llama", "model.d_ff=352"]  # the llama-family tiny model docs/benchmarks.md's table was measured with


def run(name: str, extra: list[str], steps: int, out_dir: str, bandwidth: float, latency: float, seed: int) -> dict:
    import ray_diloco

    s = ray_diloco.train(None, [
        "diloco.replicas=2", "diloco.H=100", f"run.steps={steps}", "run.eval_every=0", "run.checkpoint_every=0",
        f"run.output_dir={out_dir}", f"run.name={name}-seed{seed}", "tracking.wandb=false", "tracking.progress=false",
        f"network.bandwidth_gbps={bandwidth}", f"network.latency_ms={latency}", f"run.seed={seed}", *MODEL, *extra])
    c = s["communication"]
    total = c["bytes_up_per_replica"] + c["bytes_down_per_replica"]
    peak = c["peak_sync_bytes_per_replica"] if s["algorithm"] == "diloco" else total / s["inner_steps"]
    return {"method": name, "seed": seed, "final_eval_loss": s["final_eval_loss"], "bytes_per_replica": total,
            "dp_fp32_bytes_per_replica": c["dp_fp32_bytes_per_replica"], "peak_sync_bytes": peak,
            "compute_utilisation": s["compute_utilisation"], "wall_s": s["wall_s"], "fragments": s["fragments"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--bandwidth-gbps", type=float, default=0.1)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--only", nargs="*", default=None, help="run only these methods")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                    help="seeds of the DiLoCo-family runs; the loss column is their mean (DP runs the first only: "
                         "under the emulated link it takes ~9 minutes)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    runs, rows = [], []
    with tempfile.TemporaryDirectory() as out:
        for name, extra in METHODS.items():
            if a.only and name not in a.only:
                continue
            seeds = a.seeds[:1] if name == "DP" else a.seeds
            per_seed = []
            for seed in seeds:
                per_seed.append(run(name, extra, a.steps, out, a.bandwidth_gbps, a.latency_ms, seed))
                print(f"done: {per_seed[-1]}", flush=True)
            runs += per_seed
            row = dict(per_seed[0])  # bytes are the same for every seed; utilisation and wall: the mean
            for key in ("final_eval_loss", "compute_utilisation", "wall_s"):
                row[key] = sum(r[key] for r in per_seed) / len(per_seed)
            row["seeds"] = seeds
            row["loss_per_seed"] = [r["final_eval_loss"] for r in per_seed]
            rows.append(row)
    dp = next((r for r in rows if r["method"] == "DP"), None)
    diloco = next((r for r in rows if r["method"] == "DiLoCo"), None)
    for r in rows:
        r["fewer_bytes_than_dp"] = dp["bytes_per_replica"] / r["bytes_per_replica"] if dp else None
        r["peak_vs_diloco"] = r["peak_sync_bytes"] / diloco["peak_sync_bytes"] if diloco else None
        r["loss_vs_diloco"] = r["final_eval_loss"] / diloco["final_eval_loss"] - 1 if diloco else None
    print(f"\n{a.steps} inner steps, M=2, tiny model, link {a.bandwidth_gbps} Gbit/s + {a.latency_ms} ms; "
          f"loss, utilisation and wall: mean over seeds {a.seeds} (DP: seed {a.seeds[0]})\n")
    print(f"{'method':<23} {'val loss':>8} {'vs DiLoCo':>9} {'MB/replica':>11} {'x fewer than DP':>15} "
          f"{'peak MB/sync':>12} {'peak/DiLoCo':>11} {'utilisation':>11} {'wall s':>7}  loss per seed")
    for r in rows:
        fewer = f"{r['fewer_bytes_than_dp']:,.0f}" if r["fewer_bytes_than_dp"] else "-"
        pk = f"{r['peak_vs_diloco']:.3f}" if r["peak_vs_diloco"] is not None else "-"
        lv = f"{100 * r['loss_vs_diloco']:+.2f}%" if r["loss_vs_diloco"] is not None else "-"
        print(f"{r['method']:<23} {r['final_eval_loss']:>8.4f} {lv:>9} {r['bytes_per_replica'] / 1e6:>11.3f} "
              f"{fewer:>15} {r['peak_sync_bytes'] / 1e6:>12.3f} {pk:>11} {r['compute_utilisation']:>11.3f} "
              f"{r['wall_s']:>7.0f}  {' '.join(f'{x:.4f}' for x in r['loss_per_seed'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"steps": a.steps, "bandwidth_gbps": a.bandwidth_gbps, "latency_ms": a.latency_ms,
                       "seeds": a.seeds, "rows": rows, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
