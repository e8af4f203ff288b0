"""Throughput overhead of ray-diloco against a plain single-process PyTorch loop.

Same model (the `tiny` preset), batch (12 x 64 tokens), inner optimiser and threads (1):
ray-diloco runs M=1 replica x 1 worker with H=50 (one outer step every 50 inner steps, the
pseudo-gradient and new global parameters through the object store); the plain loop is a
nanoGPT-style loop in this process. Prints tokens/s of both and their ratio (target >= 0.95).

    python benchmarks/overhead.py [--steps 600] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

os.environ.setdefault("WANDB_MODE", "disabled")


def plain_loop(cfg, corpus, steps: int, warmup: int) -> float:
    """nanoGPT-style loop: random windows, AdamW, clipping, same lr schedule; returns tokens/s."""
    from ray_diloco.core.schedules import inner_lr
    from ray_diloco.models.transformer import build_model, lm_loss, logits_of, make_inner_optimizer

    torch.set_num_threads(1)
    model = build_model(cfg, corpus.vocab_size)
    opt = make_inner_optimizer(model, cfg)
    T, B, i = cfg.data.seq_len, cfg.inner.global_batch, cfg.inner
    data = torch.from_numpy(np.asarray(corpus.train).astype(np.int64))
    g = torch.Generator().manual_seed(0)
    t0 = None
    for step in range(steps + warmup):
        if step == warmup:
            t0 = time.perf_counter()
        for grp in opt.param_groups:
            grp["lr"] = inner_lr(step, i.lr, i.warmup_steps, steps + warmup, i.min_lr_ratio)
        ix = torch.randint(len(data) - T - 1, (B,), generator=g)
        x = torch.stack([data[j : j + T] for j in ix])
        y = torch.stack([data[j + 1 : j + T + 1] for j in ix])
        loss, _ = lm_loss(logits_of(model(x)), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), i.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * B * T / (time.perf_counter() - t0)


def ray_diloco_run(steps: int, out_dir: str) -> dict:
    import ray_diloco

    summary = ray_diloco.train(None, [
        "diloco.replicas=1", "diloco.workers_per_replica=1", "diloco.H=50", "diloco.cpus_per_worker=1",
        f"run.steps={steps}", "run.eval_every=0", "run.checkpoint_every=0", f"run.output_dir={out_dir}",
        "run.name=overhead", "tracking.wandb=false", "tracking.progress=false",
    ])
    rows = [json.loads(x) for x in open(os.path.join(out_dir, "overhead", "metrics.jsonl"))]
    rounds = rows[1:]  # the first round includes worker warm-up, as the plain loop's warm-up steps do
    return {
        "tokens_per_s_rounds": sum(r["tokens"] - p["tokens"] for p, r in zip(rows, rows[1:])) / sum(r["round_s"] for r in rounds),
        "tokens_per_s_loop": summary["tokens_per_s"],
        "outer_wait_s_per_outer_step": float(np.mean([r["outer_wait_s"] for r in rounds])),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600, help="inner steps of each run")
    ap.add_argument("--json", default=None, help="write the figures as JSON to this path")
    a = ap.parse_args()
    from ray_diloco.components.data import load_corpus
    from ray_diloco.config import load_config

    cfg = load_config(None, ["diloco.replicas=1"])
    corpus = load_corpus(cfg.data)
    plain = plain_loop(cfg, corpus, a.steps, warmup=50)
    with tempfile.TemporaryDirectory() as d:
        rd = ray_diloco_run(a.steps, d)
    result = {
        "model": "tiny", "batch": "12 x 64", "threads": 1, "steps": a.steps,
        "plain_tokens_per_s": plain,
        "ray_diloco_tokens_per_s": rd["tokens_per_s_rounds"],
        "ray_diloco_tokens_per_s_incl_final_eval": rd["tokens_per_s_loop"],
        "outer_wait_s_per_outer_step": rd["outer_wait_s_per_outer_step"],
        "ratio": rd["tokens_per_s_rounds"] / plain,
    }
    print(f"{'loop':<38}{'tokens/s':>12}")
    print(f"{'plain PyTorch (1 process, 1 thread)':<38}{plain:>12,.0f}")
    print(f"{'ray-diloco M=1 H=50 (1 worker)':<38}{rd['tokens_per_s_rounds']:>12,.0f}")
    print(f"{'  incl. start of loop + final eval':<38}{rd['tokens_per_s_loop']:>12,.0f}")
    print(f"ratio ray-diloco / plain: {result['ratio']:.3f} (target >= 0.95); "
          f"outer step + exchange: {rd['outer_wait_s_per_outer_step'] * 1000:.1f} ms per 50 inner steps")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
