"""GPU benchmark (issues 16 and 37): ray-diloco on one GPU against a plain single-GPU PyTorch loop.

One prepared script for one GPU; each row in its own processes, as a user would run them:

1. ``plain loop, eager`` and ``plain loop, compiled``: the same model, one replica's batch
   (``global_batch / 2``), micro-batch, bf16 autocast and fused AdamW in this process, nanoGPT-
   style (no Ray); compiled as a run compiles it (``models.transformer.compile_blocks``: each
   decoder block, in place). The compiled loop is the baseline (``ratio``);
2. ``ray-diloco``: ``diloco.replicas=2`` on the one GPU (``gpus_per_worker=0.5``), bf16,
   ``run.compile: auto`` (compiled: a GPU), 3 streaming fragments with overlap, fp32 exchange,
   a checkpoint every 2 outer steps; tokens/s over the outer steps after the first (the first
   compiles: its ``compile_s`` is reported apart). It resumes from its last checkpoint and trains
   one more outer step (it must);
3. ``ray-diloco, fp4``: the same with ``streaming.quantization: fp4_e3m0`` (4-bit both ways,
   error feedback): the pseudo-gradients are encoded on the GPU (``streaming.device_globals``);
4. ``1.3b, fp4``: the 1.3b preset (1.2B parameters at the char vocabulary), 2 replicas on the one
   GPU, its peak memory (skipped where the GPU has less than 80 GiB, or after ``--big-timeout``);
5. ``FSDP``: 2 workers per replica (FSDP2) where there are 4 GPUs (NCCL cannot put two ranks of a
   group on one GPU: on one GPU the row says so), and in ``--smoke`` (gloo on CPU).

Each row: tokens/s, MFU and peak GPU memory (all processes, sampled with nvidia-smi). MFU counts
6 N FLOPs per token for the weights (N: every parameter, embeddings included; forward and
backward) plus 12 L d T for attention (PaLM, arXiv 2204.02311, appendix B: the full T x T
products, though causal attention needs half), against the GPU's dense bf16 peak (989 TFLOP/s
for an H100/H200, the datasheet's); activation recomputation is not counted. ``--json`` is
rewritten after every row (a run cut short keeps what it measured).

    python benchmarks/gpu.py [--quick] [--preset 180m] [--json PATH]   # --quick: about 4-5 minutes on an H200
    python benchmarks/gpu.py --micro-sweep 8 16 32 [--preset 180m]    # the plain loop per micro-batch
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


def plain_loop(cfg, corpus, steps: int, warmup: int, device: torch.device, compile: bool = False,
               batch: int | None = None) -> dict:
    """The baseline: one replica's batch (``global_batch / 2``, or ``batch``), the same
    micro-batches, bf16 autocast and AdamW, random windows, the model compiled (``torch.compile``)
    or eager; returns tokens/s, the seconds of the warm-up steps (the compilation) and peak
    allocated memory."""
    from ray_diloco.core.schedules import inner_lr
    from ray_diloco.models.transformer import build_model, compile_blocks, make_inner_optimizer
    from ray_diloco.runtime.inner_loop import accumulate_gradients

    model = build_model(cfg, corpus.vocab_size).to(device)
    opt = make_inner_optimizer(model, cfg)
    if compile:  # as a run compiles it: each decoder block in place
        compile_blocks(model)
    net = model
    T, B, i = cfg.data.seq_len, batch or cfg.inner.global_batch // 2, cfg.inner
    data = torch.from_numpy(np.asarray(corpus.train).astype(np.int64))
    g = torch.Generator().manual_seed(0)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if cfg.run.precision == "bf16" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0, t_start = None, time.perf_counter()
    for step in range(steps + warmup):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            warm_s = t0 - t_start
        for grp in opt.param_groups:
            grp["lr"] = inner_lr(step, i.lr, i.warmup_steps, steps + warmup, i.min_lr_ratio)
        ix = torch.randint(len(data) - T - 1, (B,), generator=g)
        x = torch.stack([data[j : j + T] for j in ix]).pin_memory() if device.type == "cuda" else \
            torch.stack([data[j : j + T] for j in ix])
        y = torch.stack([data[j + 1 : j + T + 1] for j in ix])
        y = y.pin_memory() if device.type == "cuda" else y  # as x: copied without waiting for the GPU
        accumulate_gradients(net, x, y, cfg.inner.micro_batch or B, 0.0, autocast or nullcontext, device)
        torch.nn.utils.clip_grad_norm_(model.parameters(), i.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del model, opt, net
    torch._dynamo.reset()  # the next row compiles its own model
    return {"tokens_per_s": steps * B * T / s, "peak_allocated_bytes": peak, "warmup_s": warm_s}


def micro_sweep(preset: str, seq: int, batch: int, micros: list[int], steps: int, compiled: list[bool]) -> list[dict]:
    """The plain loop of ``preset`` with a batch of ``batch`` sequences per step in micro-batches
    of each of ``micros``, eager and/or compiled: tokens/s and MFU of each (which micro-batch
    a preset should run at on this GPU)."""
    from ray_diloco.components.data import load_corpus
    from ray_diloco.config import load_config
    from ray_diloco.models.transformer import build_model, count_parameters, resolve_model_shape

    rows = []
    for c in compiled:
        for mb in micros:
            cfg = load_config(None, [f"model.preset={preset}", f"data.seq_len={seq}", f"inner.global_batch={2 * batch}",
                                     f"inner.micro_batch={mb}",
                                     f"run.precision={'bf16' if torch.cuda.is_available() else 'fp32'}"])
            corpus = load_corpus(cfg.data)
            shape = resolve_model_shape(cfg.model, corpus.vocab_size)
            with torch.device("meta"):
                n = count_parameters(build_model(cfg, corpus.vocab_size))
            fpt = flops_per_token(n, shape["n_layers"], shape["d_model"], seq)
            dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
            r = plain_loop(cfg, corpus, steps, 3, dev, compile=c, batch=batch)
            peak = peak_flops()
            row = {"preset": preset, "parameters": n, "seq_len": seq, "batch": batch, "micro_batch": mb, "compiled": c,
                   "tokens_per_s": r["tokens_per_s"], "mfu": r["tokens_per_s"] * fpt / peak if peak else None,
                   "warmup_s": r["warmup_s"], "peak_allocated_bytes": r["peak_allocated_bytes"]}
            rows.append(row)
            print(f"{preset} mb {mb:>3} {'compiled' if c else 'eager':>8}: {row['tokens_per_s']:>9.0f} tokens/s, "
                  f"MFU {100 * (row['mfu'] or 0):.1f}%, warm-up {row['warmup_s']:.0f} s, "
                  f"peak {(row['peak_allocated_bytes'] or 0) / 2**30:.1f} GiB", flush=True)
            torch.cuda.empty_cache()
    return rows


def run_rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f]


def ray_diloco_run(overrides: list[str], out: str, name: str, steps: int, H: int, resume: bool = True,
                   timeout: float | None = None) -> dict:
    """The run and (``resume``) its resume (one more outer step from the last checkpoint), each in
    its own ``ray-diloco train`` process, as a user would; tokens/s over the outer steps after the
    first (which compiles), the first one's ``compile_s``."""
    base = [sys.executable, "-m", "ray_diloco.cli", "train"]
    sets = [x for o in overrides + [f"run.output_dir={out}", f"run.name={name}", f"run.steps={steps}"]
            for x in ("--set", o)]
    t0 = time.perf_counter()
    try:
        first = subprocess.run(base + sets, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    if first.returncode != 0:
        return {"error": first.stderr.strip().splitlines()[-1:] or ["?"], "stderr": first.stderr[-3000:]}
    rows = run_rows(os.path.join(out, name))
    later = rows[1:] or rows
    tokens = sum(r["tokens"] - p["tokens"] for p, r in zip(rows, rows[1:])) if len(rows) > 1 else rows[0]["tokens"]
    res = {"tokens_per_s": tokens / sum(r["round_s"] for r in later), "wall_s": wall,
           "compile_s": rows[0].get("compile_s", 0.0), "first_round_s": rows[0]["round_s"],
           "first_train_loss": rows[0]["train_loss"], "final_train_loss": rows[-1]["train_loss"],
           # where a round's time went (the outer steps after the first, means): exposed communication
           "sync_wait_s": float(np.mean([r["sync_wait_s"] for r in later])),
           "outer_wait_s": float(np.mean([r["outer_wait_s"] for r in later])),
           "compute_utilisation": float(np.mean([r["compute_utilisation"] or 0 for r in later])),
           "checkpoints": len(os.listdir(os.path.join(out, name, "checkpoints"))), "resumed": None,
           "resume_error": None}
    if resume:
        again = subprocess.run(base + ["--resume", os.path.join(out, name), "--set", f"run.steps={steps + H}"],
                               capture_output=True, text=True)
        after = run_rows(os.path.join(out, name))
        res["resumed"] = again.returncode == 0 and after[-1]["inner_step"] == steps + H
        res["resume_error"] = None if again.returncode == 0 else again.stderr.strip().splitlines()[-1:]
    return res


def _model_flops(preset: str, seq: int, extra: list[str]) -> tuple[int, float]:
    """(parameters, training FLOPs per token) of ``preset`` at the char vocabulary."""
    from ray_diloco.components.data import load_corpus
    from ray_diloco.config import load_config
    from ray_diloco.models.transformer import build_model, count_parameters, resolve_model_shape

    cfg = load_config(None, [f"model.preset={preset}", f"data.seq_len={seq}", *extra])
    corpus = load_corpus(cfg.data)
    shape = resolve_model_shape(cfg.model, corpus.vocab_size)
    with torch.device("meta"):
        n = count_parameters(build_model(cfg, corpus.vocab_size))
    return n, flops_per_token(n, shape["n_layers"], shape["d_model"], seq)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="180m", help="model preset (180m: 150M parameters at the char vocabulary)")
    ap.add_argument("--quick", action="store_true", help="fewer steps: the whole script in about 4-5 minutes")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the preset's context (2048)")
    ap.add_argument("--global-batch", type=int, default=32, help="sequences per inner step over both replicas")
    ap.add_argument("--micro-batch", type=int, default=16,
                    help="inner.micro_batch (16 x 2048 tokens: the best measured for 180m on one H200)")
    ap.add_argument("--big-preset", default="1.3b", help="the 1B-class row's preset ('' to skip it)")
    ap.add_argument("--big-timeout", type=float, default=300.0, help="seconds the 1B-class run may take")
    ap.add_argument("--row-timeout", type=float, default=None,
                    help="seconds each other ray-diloco run may take (default: none; --quick: 150)")
    ap.add_argument("--smoke", action="store_true", help="CPU, a 2-layer model, 20 steps: checks the script")
    ap.add_argument("--json", default=None, help="write the figures as JSON to this path (after every row)")
    ap.add_argument("--micro-sweep", type=int, nargs="*", default=None,
                    help="only the plain loop at these micro-batches (batch --sweep-batch), eager and compiled")
    ap.add_argument("--sweep-batch", type=int, default=32)
    ap.add_argument("--sweep-steps", type=int, default=10)
    ap.add_argument("--sweep-modes", nargs="+", default=["eager", "compiled"])
    a = ap.parse_args()
    if a.micro_sweep:
        rows = micro_sweep(a.preset, a.seq_len or 2048, a.sweep_batch, a.micro_sweep, a.sweep_steps,
                           [m == "compiled" for m in a.sweep_modes])
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    from ray_diloco.components.data import load_corpus
    from ray_diloco.config import load_config
    from ray_diloco.config.presets import PRESETS

    gpu = torch.cuda.is_available() and not a.smoke
    H, outer = (5, 4) if a.smoke else ((10, 4) if a.quick else (30, 6))
    if a.smoke:
        model = ["model.preset=tiny", "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
                 "model.context=16"]
        seq, batch, micro = 16, 8, 2
    else:
        model = [f"model.preset={a.preset}"]
        seq = a.seq_len or PRESETS[a.preset][5]  # the preset's context
        batch, micro = a.global_batch, a.micro_batch
    steps = H * outer
    common = model + [
        f"data.seq_len={seq}", f"inner.global_batch={batch}", f"inner.micro_batch={micro}",
        f"inner.warmup_steps={2 if a.smoke else 20}",
        "diloco.replicas=2", f"diloco.H={H}", f"diloco.gpus_per_worker={0.5 if gpu else 0}",
        *([f"diloco.outer_cpus={max(1, (os.cpu_count() or 1) // 4)}"] if gpu else []),  # the outer step's threads
        f"run.precision={'bf16' if gpu else 'fp32'}", f"streaming.fragments={3 if not a.smoke else 2}",
        f"streaming.overlap_steps={1 if a.smoke or a.quick else 2}",  # < H / F (5 fragments: 3 + embeddings + head)
        f"run.checkpoint_every={2 if a.smoke or a.quick else 3}", "run.eval_every=0",
        f"run.eval_tokens={65536 if not a.smoke else 512}", "tracking.wandb=false", "tracking.progress=false"]
    cfg = load_config(None, common)
    corpus = load_corpus(cfg.data)
    n, fpt = _model_flops(cfg.model.preset, seq, model[1:])
    peak = peak_flops()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    res: dict = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "preset": cfg.model.preset,
                 "parameters": n, "seq_len": seq, "global_batch": batch, "micro_batch": micro, "steps": steps,
                 "H": H, "quick": a.quick, "flops_per_token": fpt, "peak_flops": peak, "rows": {}}

    def mfu(tps: float | None, f: float = fpt) -> float | None:
        return tps * f / peak if peak and tps else None

    def row(name: str, r: dict, mem: GpuMemory, f: float = fpt) -> dict:
        r = {**r, "mfu": mfu(r.get("tokens_per_s"), f), "peak_gpu_memory_bytes": mem.peak or None}
        res["rows"][name] = r
        if a.json:  # after every row: a run cut short keeps what it measured
            with open(a.json, "w") as fh:
                json.dump(res, fh, indent=1)
        return r

    if gpu and not os.environ.get("RAY_ADDRESS"):  # one Ray for every run (joined through RAY_ADDRESS)
        import ray

        ray.init(address="local", include_dashboard=False, logging_level="ERROR")
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    row_timeout = a.row_timeout or (150.0 if a.quick else None)
    out = tempfile.mkdtemp(prefix="gpu-bench-")
    loop_steps = 10 if a.smoke else (20 if a.quick else 50)
    try:
        with GpuMemory() as mem:
            row("plain loop, eager", plain_loop(cfg, corpus, loop_steps, 3, device), mem)
        if gpu:
            torch.cuda.empty_cache()
            with GpuMemory() as mem:
                row("plain loop, compiled", plain_loop(cfg, corpus, loop_steps, 3, device, compile=True), mem)
            torch.cuda.empty_cache()
        with GpuMemory() as mem:
            row("ray-diloco", ray_diloco_run(common, out, "diloco", steps, H, timeout=row_timeout), mem)
        if not a.smoke:
            with GpuMemory() as mem:
                row("ray-diloco, fp4", ray_diloco_run(common + ["streaming.quantization=fp4_e3m0"], out, "fp4",
                                                      steps, H, resume=False, timeout=row_timeout), mem)
        fsdp_ok = not gpu or torch.cuda.device_count() >= 4
        if fsdp_ok:
            with GpuMemory() as mem:
                sets = [o.replace("diloco.gpus_per_worker=0.5", "diloco.gpus_per_worker=1")
                        .replace(f"inner.micro_batch={micro}", f"inner.micro_batch={min(micro, batch // 4)}")
                        for o in common]
                # the smoke test resumes the DDP run only (the same code; FSDP resumes: tests/integration/test_fsdp.py)
                row("FSDP", ray_diloco_run(sets + ["diloco.sharding=fsdp", "diloco.workers_per_replica=2"], out,
                                           "fsdp", steps, H, resume=not a.smoke), mem)
        else:
            res["rows"]["FSDP"] = {"skipped": "FSDP needs 2 GPUs per replica (4 in all); this machine has "
                                              f"{torch.cuda.device_count()}"}
        if gpu and a.big_preset:
            total = torch.cuda.get_device_properties(0).total_memory
            if total < 80 * 2**30:
                res["rows"]["1B-class"] = {"skipped": f"the GPU has {total / 2**30:.0f} GiB (< 80)"}
            else:
                bh, bouter = (10, 2) if a.quick else (10, 4)
                big_model = [f"model.preset={a.big_preset}"]
                bn, bfpt = _model_flops(a.big_preset, seq, [])
                big = [o for o in common if not o.startswith(("model.", "inner.global_batch", "inner.micro_batch",
                                                              "diloco.H", "run.checkpoint_every"))]
                big += big_model + ["inner.global_batch=8", "inner.micro_batch=4", f"diloco.H={bh}",
                                    "run.checkpoint_every=0", "streaming.quantization=fp4_e3m0"]
                with GpuMemory() as mem:
                    r = ray_diloco_run(big, out, "big", bh * bouter, bh, resume=False, timeout=a.big_timeout)
                    row("1B-class", {**r, "preset": a.big_preset, "parameters": bn, "global_batch": 8,
                                     "micro_batch": 4, "H": bh}, mem, bfpt)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    base = res["rows"].get("plain loop, compiled") or res["rows"]["plain loop, eager"]
    for r in res["rows"].values():
        if r.get("tokens_per_s") and base.get("tokens_per_s") and r is not res["rows"].get("1B-class"):
            per_gpu = r["tokens_per_s"] / (4 if r is res["rows"].get("FSDP") and gpu else 1)
            r["ratio"] = per_gpu / base["tokens_per_s"]
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
    gb = lambda b: f"{b / 2**30:.1f} GiB" if b else "-"  # noqa: E731
    pct = lambda x: f"{100 * x:.1f}%" if x else "-"  # noqa: E731
    print(f"{res['device']}: {cfg.model.preset} ({n / 1e6:.1f}M parameters), seq {seq}, batch {batch} "
          f"(micro {micro}), {steps} steps, H={H}, 2 replicas on one device")
    print(f"{'':24} {'tokens/s':>10} {'MFU':>7} {'peak GPU memory':>16} {'ratio':>6} {'compile s':>9}")
    for name, r in res["rows"].items():
        if "tokens_per_s" not in r:
            print(f"{name:24} {r.get('skipped') or r.get('error')}")
            continue
        comp = r.get("compile_s") or r.get("warmup_s")
        print(f"{name:24} {r['tokens_per_s']:>10.0f} {pct(r['mfu']):>7} {gb(r['peak_gpu_memory_bytes']):>16} "
              f"{r.get('ratio', float('nan')):>6.2f} {comp or 0:>9.0f}")
    d = res["rows"]["ray-diloco"]
    print(f"checkpoints: {d.get('checkpoints')}, resumed one more outer step: {d.get('resumed')}"
          + (f" ({d['resume_error']})" if d.get("resume_error") else ""))
    ok = d.get("resumed") and all("error" not in r for r in res["rows"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
