"""What a checkpoint costs the job's process (issue 16): memory and time of ``Trainer.checkpoint``.

A model of P parameters that costs almost no compute but has a real AdamW state (``[P]`` fp32
weights whose gradient is dense, so AdamW keeps two ``[P]`` buffers): M replicas x 1 worker,
DiLoCo (the outer-optimiser driver holds the global parameters and Nesterov momentum). After one
outer step, for each way of writing a checkpoint:

- ``per_process`` (today's ``Trainer.checkpoint``): each worker writes its own state file, the
  driver writes ``outer.pt``, the job's process writes only ``state.pt``;
- ``through_job`` (what checkpoints did before, measured in the same run): the job's process
  gathers every worker's and the driver's state and writes one ``state.pt``.

Figures, memory in units of U = 4 P bytes (one fp32 copy of the model):

- ``job_extra_u``: the peak private memory (``RssAnon``, sampled every 5 ms) of the job's
  process during the checkpoint, minus before it; ``job_peak_u`` the peak itself;
- ``workers_extra_u`` / ``driver_extra_u``: the same for the largest worker and for the driver;
- ``written_u``: bytes written; ``seconds``: wall time (median of ``--repeats``);
- ``save_s``: ``torch.save`` + fsync of one fp32 ``[P]`` tensor in this process (the baseline),
  and ``ratio`` = ``seconds / (written_u x save_s)`` (1.0: as fast as writing the same bytes
  from one process).

The export (``--export``): the outer-optimiser driver writes the exported model's safetensors
(bf16) from global parameters shaped like a transformer's (``--params`` values in 4 fragments of
16 matrices of 1024 rows), reading one parameter at a time from its K outer shards
(``OuterDriver.export_weights``); the baseline, in the same run, is the export as it was: the
whole global parameters fetched into one process (``global_params``), then written. Figures:
the writing process's peak extra memory (``RssAnon``) in U, and the seconds.

    python benchmarks/checkpoint.py [--params 1e8] [--replicas 2] [--repeats 2] [--export] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class StateModel(torch.nn.Module):
    """``w``: ``[P]`` fp32 with a dense gradient (the loss adds ``0 * w.sum()``: AdamW keeps two
    ``[P]`` buffers for it) and a ``[vocab]`` bias as logits for every position."""

    def __init__(self, params: int, vocab_size: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(params).normal_(0.0, 0.02))
        self.bias = torch.nn.Parameter(torch.zeros(vocab_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        return self.bias.view(1, 1, -1).expand(b, t, -1) + 0.0 * self.w.sum()


class StateModelFn:
    """A picklable ``model_fn`` building :class:`StateModel` with ``params`` values."""

    def __init__(self, params: int):
        self.params = params

    def __call__(self, shape: dict, vocab_size: int) -> torch.nn.Module:
        return StateModel(self.params, vocab_size)


def _anon(pid: int) -> int:
    """``RssAnon`` of process ``pid`` in bytes (0 if gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Peak:
    """Each process's peak ``RssAnon``, sampled every 5 ms until :meth:`stop`."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.base = {p: _anon(p) for p in pids}
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for p in self.pids:
                self.peak[p] = max(self.peak[p], _anon(p))
            self._stop.wait(0.005)

    def stop(self) -> dict[int, tuple[int, int]]:
        """``{pid: (before, peak)}``."""
        self._stop.set()
        self._thread.join()
        return {p: (self.base[p], self.peak[p]) for p in self.pids}


def through_job(t) -> Path:
    """The checkpoint as written before per-process files: every state gathered into this process."""
    import dataclasses

    from ray_diloco.components.checkpoint import save_checkpoint

    t.settle()
    workers = t.supervisor.on_live("state_dict", lambda r, rank, i, n: (rank == 0,))
    state = {"format": 1, "outer_step": t.state.outer_step, "config": t.cfg.to_dict(),
             "corpus_fingerprint": t.corpus.fingerprint, "custom_model": True,
             "counters": dataclasses.asdict(t.state), "outer": t.sync.state_dict(), "workers": workers,
             "membership": t.members.state_dict()}
    return save_checkpoint(t.run_dir, t.state.outer_step + 1000, state, keep=100)


def save_baseline(params: int, directory: Path) -> float:
    from ray_diloco.components.checkpoint import write_state_file

    x = torch.randn(params)
    times = []
    for i in range(2):
        t0 = time.perf_counter()
        write_state_file(directory / f"baseline-{i}.pt", {"x": x})
        times.append(time.perf_counter() - t0)
        (directory / f"baseline-{i}.pt").unlink()
    return min(times)


def measure(params: int, replicas: int, repeats: int, out_dir: str) -> dict:
    import ray

    from ray_diloco.components.data import load_corpus
    from ray_diloco.config import load_config
    from ray_diloco.runtime.cluster import all_workers
    from ray_diloco.runtime.launcher import new_run_dir
    from ray_diloco.runtime.trainer import Trainer

    cfg = load_config({
        "model": {"preset": "tiny", "n_layers": 1, "n_heads": 1, "d_model": 8, "d_ff": 8, "context": 16},
        "data": {"seq_len": 16},
        "inner": {"global_batch": 2 * replicas, "warmup_steps": 1},
        "diloco": {"replicas": replicas, "H": 2, "cpus_per_worker": 0.5, "sync_timeout_s": 1800.0},
        "run": {"steps": 2, "eval_every": 0, "checkpoint_every": 0, "keep_checkpoints": 100,
                "output_dir": out_dir, "name": f"ckpt-p{params}"},
        "tracking": {"wandb": False, "progress": False},
    })
    corpus = load_corpus(cfg.data)
    U = 4 * params
    t = Trainer(cfg, new_run_dir(cfg), corpus, StateModelFn(params))
    t.start()
    res: dict = {"params": params, "replicas": replicas}
    try:
        t.outer_step(1)
        driver = ray.get(t.driver.outer_pids.remote())[0]
        workers = ray.get([w.pid.remote() for w in all_workers(t.replicas)])
        for name, write in (("per_process", t.checkpoint), ("through_job", lambda: through_job(t))):
            runs = []
            for _ in range(repeats):
                peak = Peak([os.getpid(), driver, *workers])
                t0 = time.perf_counter()
                path = write()
                seconds = time.perf_counter() - t0
                mem = peak.stop()
                written = sum(f.stat().st_size for f in Path(path).iterdir())
                job_before, job_peak = mem[os.getpid()]
                runs.append({"seconds": seconds, "written_u": written / U,
                             "job_extra_u": (job_peak - job_before) / U, "job_peak_u": job_peak / U,
                             "driver_extra_u": (mem[driver][1] - mem[driver][0]) / U,
                             "workers_extra_u": max((mem[w][1] - mem[w][0]) / U for w in workers)})
            res[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        res["save_s"] = save_baseline(params, Path(t.run_dir))
    finally:
        t.shutdown()
    for name in ("per_process", "through_job"):
        r = res[name]
        r["ratio"] = r["seconds"] / (r["written_u"] * res["save_s"])
    return res


def measure_export(params: int, shards: int, out_dir: str) -> dict:
    """The driver's export (per-parameter reads from ``shards`` outer shards) against fetching the
    whole global parameters into this process and writing them (the export before)."""
    import numpy as np
    import ray

    from ray_diloco.components.checkpoint import place_marker
    from ray_diloco.components.export import write_hf_weights
    from ray_diloco.config import load_config
    from ray_diloco.core.fragments import ParamSpec, plan_fragments
    from ray_diloco.runtime.driver import OuterDriverActor

    cols = max(1, params // (4 * 16 * 1024))
    specs = [ParamSpec(f"model.layers.{b}.m{j}.weight", (1024, cols)) for b in range(4) for j in range(16)]
    frags = plan_fragments(specs, 4)
    frags = [f for f in frags if f.numel]
    U = 4 * sum(f.numel for f in frags)
    cfg = load_config({"diloco": {"outer_shards": shards}})
    driver = OuterDriverActor.remote(None, cfg.to_dict())
    rng = np.random.default_rng(0)
    ray.get(driver.init_global.remote([ray.put(rng.standard_normal(f.numel, dtype=np.float32)) for f in frags]))
    pids = ray.get(driver.outer_pids.remote())
    res = {"params": U // 4, "shards": shards}
    for name in ("driver_reads", "fetch_whole"):
        d = Path(out_dir) / f"export-{name}-{shards}"
        d.mkdir()
        me = os.getpid()
        peak = Peak([me, *pids])
        t0 = time.perf_counter()
        if name == "driver_reads":
            ray.get(driver.export_weights.remote(str(d), frags, 1, torch.bfloat16, place_marker(d)))
            writer = pids[0]
        else:
            # the driver's copies (as its global_params made them), not read-only object-store views
            write_hf_weights(frags, [np.array(x) for x in ray.get(driver.global_params.remote())], d, torch.bfloat16)
            writer = me
        seconds = time.perf_counter() - t0
        mem = peak.stop()
        res[name] = {"seconds": seconds, "writer_extra_u": (mem[writer][1] - mem[writer][0]) / U,
                     "shards_extra_u": max(((mem[p][1] - mem[p][0]) / U for p in pids[1:]), default=0.0),
                     "written_u": sum(f.stat().st_size for f in d.iterdir()) / U}
    ray.kill(driver)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--export", action="store_true", help="measure the driver's export instead")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import ray

    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, logging_level="ERROR")
    try:
        with tempfile.TemporaryDirectory(dir=str(ROOT)) as tmp:
            if a.export:
                res = {"export": [measure_export(int(a.params), k, tmp) for k in (1, 2)]}
            else:
                res = measure(int(a.params), a.replicas, a.repeats, tmp)
    finally:
        ray.shutdown()
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    (print_export if a.export else print_checkpoint)(res)


def print_export(res: dict) -> None:
    """The export table of :func:`measure_export`'s rows."""
    print(f"export of {res['export'][0]['params']:,} parameters in bf16 (U = 4 bytes x parameters)")
    print(f"{'K':>2s} {'export':14s} {'seconds':>8s} {'writer extra U':>15s} {'shard actors extra U':>21s}")
    for r in res["export"]:
        for name in ("driver_reads", "fetch_whole"):
            x = r[name]
            print(f"{r['shards']:2d} {name:14s} {x['seconds']:8.2f} {x['writer_extra_u']:15.2f} "
                  f"{x['shards_extra_u']:21.2f}")


def print_checkpoint(res: dict) -> None:
    """The checkpoint table of :func:`measure`'s result."""
    print(f"P = {res['params']:,} parameters, M = {res['replicas']}, U = {4 * res['params'] / 1e9:.2f} GB; "
          f"baseline torch.save of [P] fp32: {res['save_s']:.2f} s")
    print(f"{'checkpoint':12s} {'seconds':>8s} {'ratio':>6s} {'written U':>10s} {'job extra U':>12s} "
          f"{'job peak U':>11s} {'driver extra U':>15s} {'worker extra U':>15s}")
    for name in ("per_process", "through_job"):
        r = res[name]
        print(f"{name:12s} {r['seconds']:8.2f} {r['ratio']:6.2f} {r['written_u']:10.2f} {r['job_extra_u']:12.2f} "
              f"{r['job_peak_u']:11.2f} {r['driver_extra_u']:15.2f} {r['workers_extra_u']:15.2f}")


if __name__ == "__main__":
    main()
