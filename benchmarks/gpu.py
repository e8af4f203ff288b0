"""GPU benchmark (issue 16): a 2-replica Streaming DiLoCo run against a plain single-GPU PyTorch loop.

One short prepared script for one GPU (about 5 minutes on an H200 with the defaults):

1. the plain loop: the same model, per-replica batch, micro-batch, bf16 autocast and fused AdamW
   in this process, nanoGPT-style (no Ray): its tokens/s is the baseline;
2. ray-diloco: ``diloco.replicas=2`` on the one GPU (``gpus_per_worker=0.5``), bf16, streaming
   fragments with overlap, a checkpoint every few outer steps; tokens/s over the rounds after the
   first, compared with the loop (target >= 0.95: the same GPU does the same work, in two
   processes instead of one);
3. the run resumes from its last checkpoint and trains one more outer step (it must).

Prints tokens/s, MFU (6 N + attention FLOPs per token against the GPU's dense bf16 peak), peak GPU
memory (all processes, sampled with nvidia-smi) and the ratio; ``--json`` writes them.
4. the same run with ``diloco.sharding=fsdp`` (2 workers per replica, FSDP2) when there are 4 GPUs
   (NCCL cannot put two ranks of a group on one GPU; on one GPU the row says so) and in ``--smoke``
   (gloo on CPU).

    python benchmarks/gpu.py [--preset 180m] [--steps 240] [--json PATH]
    python benchmarks/gpu.py --smoke          # CPU, a tiny model: checks this script (a slow test runs it)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import nullcontext

import numpy as np
import torch

os.environ.setdefault("WANDB_MODE", "disabled")

#: Dense bf16 peak FLOP/s by GPU name (vendor datasheets, without sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "A10G": 125e12}


def peak_flops() -> float | None:
    """The dense bf16 peak of GPU 0, None on CPU or an unknown GPU."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def flops_per_token(n_params: int, layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 N for the weights plus 12 L d T for attention (PaLM, arXiv
    2204.02311, appendix B)."""
    return 6 * n_params + 12 * layers * d_model * seq_len


class GpuMemory:
    """Peak memory used on all GPUs by every process (summed), sampled with nvidia-smi every 0.5 s
    (0 on CPU, or where nvidia-smi reports no figure, as on MIG slices)."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self.ok = torch.cuda.is_available() and shutil.which("nvidia-smi") is not None
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True)
            try:
                used = sum(float(x) for x in out.stdout.split()) if out.returncode == 0 else 0.0
            except ValueError:  # "[N/A]"
                used = 0.0
            self.peak = max(self.peak, int(used * 2**20))
            self._stop.wait(0.5)

    def __enter__(self) -> GpuMemory:
        if self.ok:
            self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.ok:
            self._t.join()


def plain_loop(cfg, corpus, steps: int, warmup: int, device: torch.device) -> dict:
    """The baseline: one replica's batch (``global_batch / 2``), the same micro-batches, bf16
    autocast and AdamW, random windows; returns tokens/s and peak allocated memory."""
    from ray_diloco.core.schedules import inner_lr
    from ray_diloco.models.transformer import build_model, make_inner_optimizer
    from ray_diloco.runtime.inner_loop import accumulate_gradients

    model = build_model(cfg, corpus.vocab_size).to(device)
    opt = make_inner_optimizer(model, cfg)
    T, B, i = cfg.data.seq_len, cfg.inner.global_batch // 2, cfg.inner
    data = torch.from_numpy(np.asarray(corpus.train).astype(np.int64))
    g = torch.Generator().manual_seed(0)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if cfg.run.precision == "bf16" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = None
    for step in range(steps + warmup):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        for grp in opt.param_groups:
            grp["lr"] = inner_lr(step, i.lr, i.warmup_steps, steps + warmup, i.min_lr_ratio)
        ix = torch.randint(len(data) - T - 1, (B,), generator=g)
        x = torch.stack([data[j : j + T] for j in ix]).pin_memory() if device.type == "cuda" else \
            torch.stack([data[j : j + T] for j in ix])
        y = torch.stack([data[j + 1 : j + T + 1] for j in ix])
        accumulate_gradients(model, x, y, cfg.inner.micro_batch or B, 0.0, autocast or nullcontext, device)
        torch.nn.utils.clip_grad_norm_(model.parameters(), i.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del model, opt
    return {"tokens_per_s": steps * B * T / s, "peak_allocated_bytes": peak}


def run_rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f]


def ray_diloco_run(overrides: list[str], out: str, name: str, steps: int, H: int, resume: bool = True) -> dict:
    """The run and (``resume``) its resume (one more outer step from the last checkpoint), each in
    its own ``ray-diloco train`` process, as a user would; returns tokens/s over the rounds after
    the first."""
    base = [sys.executable, "-m", "ray_diloco.cli", "train"]
    sets = [x for o in overrides + [f"run.output_dir={out}", f"run.name={name}", f"run.steps={steps}"]
            for x in ("--set", o)]
    t0 = time.perf_counter()
    first = subprocess.run(base + sets, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if first.returncode != 0:
        raise SystemExit(f"the ray-diloco run failed:\n{first.stderr[-3000:]}")
    rows = run_rows(os.path.join(out, name))
    later = rows[1:] or rows
    tokens = sum(r["tokens"] - p["tokens"] for p, r in zip(rows, rows[1:])) if len(rows) > 1 else rows[0]["tokens"]
    if not resume:
        return {"tokens_per_s": tokens / sum(r["round_s"] for r in later), "wall_s": wall, "resumed": None,
                "first_train_loss": rows[0]["train_loss"], "final_train_loss": rows[-1]["train_loss"],
                "checkpoints": len(os.listdir(os.path.join(out, name, "checkpoints"))), "resume_error": None}
    resume = subprocess.run(base + ["--resume", os.path.join(out, name), "--set", f"run.steps={steps + H}"],
                            capture_output=True, text=True)
    after = run_rows(os.path.join(out, name))
    return {"tokens_per_s": tokens / sum(r["round_s"] for r in later), "wall_s": wall,
            "first_train_loss": rows[0]["train_loss"], "final_train_loss": rows[-1]["train_loss"], "checkpoints": len(os.listdir(os.path.join(out, name, "checkpoints"))),
            "resumed": resume.returncode == 0 and after[-1]["inner_step"] == steps + H,
            "resume_error": None if resume.returncode == 0 else resume.stderr.strip().splitlines()[-1:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="180m", help="model preset (180m: 150M parameters at the char vocabulary)")
    ap.add_argument("--steps", type=int, default=240, help="inner steps of the ray-diloco run (H=30)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=32, help="sequences per inner step over both replicas")
    ap.add_argument("--micro-batch", type=int, default=8, help="inner.micro_batch")
    ap.add_argument("--smoke", action="store_true", help="CPU, a 2-layer model, 20 steps: checks the script")
    ap.add_argument("--json", default=None, help="write the figures as JSON to this path")
    a = ap.parse_args()
    from ray_diloco.components.data import load_corpus
    from ray_diloco.config import load_config
    from ray_diloco.models.transformer import build_model, count_parameters, resolve_model_shape

    H = 5 if a.smoke else 30
    model = [f"model.preset={a.preset}"] if not a.smoke else [
        "model.preset=tiny", "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
        "model.context=16"]
    seq, batch, micro, steps = (16, 8, 2, 20) if a.smoke else (a.seq_len, a.global_batch, a.micro_batch, a.steps)
    gpu = torch.cuda.is_available() and not a.smoke
    common = model + [
        f"data.seq_len={seq}", f"inner.global_batch={batch}", f"inner.micro_batch={micro}",
        f"inner.warmup_steps={2 if a.smoke else 20}",
        "diloco.replicas=2", f"diloco.H={H}", f"diloco.gpus_per_worker={0.5 if gpu else 0}",
        f"run.precision={'bf16' if gpu else 'fp32'}", "streaming.fragments=3" if not a.smoke else "streaming.fragments=2",
        "streaming.overlap_steps=2" if not a.smoke else "streaming.overlap_steps=1",
        f"run.checkpoint_every={3 if not a.smoke else 2}", "run.eval_every=0", "run.eval_tokens=65536" if not a.smoke
        else "run.eval_tokens=512", "tracking.wandb=false", "tracking.progress=false"]
    cfg = load_config(None, common)
    corpus = load_corpus(cfg.data)
    shape = resolve_model_shape(cfg.model, corpus.vocab_size)
    with torch.device("meta"):
        n = count_parameters(build_model(cfg, corpus.vocab_size))
    fpt = flops_per_token(n, shape["n_layers"], shape["d_model"], seq)
    peak = peak_flops()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    out = tempfile.mkdtemp(prefix="gpu-bench-")
    try:
        with GpuMemory() as mem_loop:
            loop = plain_loop(cfg, corpus, steps=max(20, steps // 3), warmup=5, device=device)
        if gpu:
            torch.cuda.empty_cache()
        with GpuMemory() as mem_run:
            ddp = ray_diloco_run(common, out, "ddp", steps, H)
        fsdp, mem_fsdp = None, GpuMemory()
        if not gpu or torch.cuda.device_count() >= 4:
            with mem_fsdp:
                sets = [o.replace("diloco.gpus_per_worker=0.5", "diloco.gpus_per_worker=1")
                        .replace(f"inner.micro_batch={micro}", f"inner.micro_batch={min(micro, batch // 4)}") for o in common]
                # the smoke test resumes the DDP run only (the same code; FSDP resumes: tests/integration/test_fsdp.py)
                fsdp = ray_diloco_run(sets + ["diloco.sharding=fsdp", "diloco.workers_per_replica=2"], out, "fsdp",
                                      steps, H, resume=not a.smoke)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    def mfu(tps: float) -> float | None:
        return tps * fpt / peak if peak else None

    res = {
        "device": torch.cuda.get_device_name(0) if gpu else "cpu", "preset": cfg.model.preset, "parameters": n,
        "seq_len": seq, "global_batch": batch, "micro_batch": micro, "steps": steps, "H": H,
        "plain_tokens_per_s": loop["tokens_per_s"], "plain_mfu": mfu(loop["tokens_per_s"]),
        "plain_peak_allocated_bytes": loop["peak_allocated_bytes"],
        "plain_peak_gpu_memory_bytes": mem_loop.peak or None,
        "ddp_tokens_per_s": ddp["tokens_per_s"], "ddp_mfu": mfu(ddp["tokens_per_s"]),
        "ddp_peak_gpu_memory_bytes": mem_run.peak or None,
        "ddp_ratio_to_plain": ddp["tokens_per_s"] / loop["tokens_per_s"],
        "ddp_checkpoints": ddp["checkpoints"], "ddp_resumed": ddp["resumed"], "ddp_resume_error": ddp["resume_error"],
        "ddp_first_train_loss": ddp["first_train_loss"], "ddp_final_train_loss": ddp["final_train_loss"],
        "ddp_wall_s": ddp["wall_s"],
    }
    if fsdp is None:
        res["fsdp"] = f"not run: FSDP needs 2 GPUs per replica (4 in all); this machine has {torch.cuda.device_count()}"
    else:
        per_gpu = fsdp["tokens_per_s"] / (4 if gpu else 1)  # 2 replicas x 2 GPUs against the loop's one
        res.update({"fsdp_tokens_per_s": fsdp["tokens_per_s"], "fsdp_mfu": mfu(per_gpu),
                    "fsdp_peak_gpu_memory_bytes": mem_fsdp.peak or None,
                    "fsdp_ratio_to_plain": per_gpu / loop["tokens_per_s"],
                    "fsdp_checkpoints": fsdp["checkpoints"], "fsdp_resumed": fsdp["resumed"],
                    "fsdp_final_train_loss": fsdp["final_train_loss"]})
    gb = lambda b: f"{b / 2**30:.1f} GiB" if b else "-"  # noqa: E731
    pct = lambda x: f"{100 * x:.1f}%" if x else "-"  # noqa: E731
    print(f"{res['device']}: {cfg.model.preset} ({n / 1e6:.1f}M parameters), seq {seq}, batch {batch} "
          f"(micro {micro}), {steps} steps, H={H}, 2 replicas on one device")
    print(f"{'':24} {'tokens/s':>10} {'MFU':>7} {'peak GPU memory':>16} {'ratio':>6}")
    print(f"{'plain PyTorch loop':24} {loop['tokens_per_s']:>10.0f} {pct(res['plain_mfu']):>7} "
          f"{gb(res['plain_peak_gpu_memory_bytes']):>16} {1.0:>6.2f}")
    print(f"{'ray-diloco, DDP':24} {ddp['tokens_per_s']:>10.0f} {pct(res['ddp_mfu']):>7} "
          f"{gb(res['ddp_peak_gpu_memory_bytes']):>16} {res['ddp_ratio_to_plain']:>6.2f}")
    if fsdp is None:
        print(f"{'ray-diloco, FSDP':24} {res['fsdp']}")
    else:
        print(f"{'ray-diloco, FSDP':24} {fsdp['tokens_per_s']:>10.0f} {pct(res['fsdp_mfu']):>7} "
              f"{gb(res['fsdp_peak_gpu_memory_bytes']):>16} {res['fsdp_ratio_to_plain']:>6.2f}"
              + ("  (4 GPUs: ratio per GPU)" if gpu else ""))
    print(f"checkpoints: {ddp['checkpoints']}, resumed one more outer step: {ddp['resumed']}"
          + (f" ({ddp['resume_error']})" if ddp["resume_error"] else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ddp["resumed"] and (fsdp is None or fsdp["resumed"] is not False) else 1


if __name__ == "__main__":
    sys.exit(main())
