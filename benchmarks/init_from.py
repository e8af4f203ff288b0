"""What loading a saved model costs each worker (``model.init_from``): DDP against FSDP.

A llama of ``--params`` parameters (width 1024, 16 heads over 8 key/value heads, SwiGLU 2816,
as many layers as the size needs, Tiny Shakespeare's 65-character vocabulary) is saved in bf16 as
a released model is. One replica starts from it (``Trainer.start``: the workers build the model,
join their group, load, and the outer driver takes the global parameters), twice:

- ``ddp``: one worker, which loads the whole model (transformers' ``from_pretrained``, fp32);
- ``fsdp``: ``--workers`` ranks under ``diloco.sharding: fsdp``, each built on the meta device and
  reading only its own rows of the safetensors files (``runtime.fsdp.load_own_rows``).

Memory in U = 4 bytes x parameters (one fp32 copy of the model): each worker's peak private
memory (``RssAnon``, sampled every 20 ms) during the start, and that peak minus the same worker's
peak when the replica starts from a 23k-parameter model of the same family in the same run (the
process's own libraries: torch, transformers, Ray), so ``model_u`` is what the model costs it.
The outer driver's peak is reported too (it holds the global parameters: 1 U by design).

    python benchmarks/init_from.py [--params 3e8] [--workers 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

from exchange import _status  # noqa: E402  (/proc/PID/status fields)


def save_llama(path: Path, params: float, vocab: int) -> int:
    """A bf16 llama of about ``params`` parameters at ``path``; returns its exact count."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    per_layer = 2 * 1024 * 1024 + 2 * 1024 * 512 + 3 * 1024 * 2816 + 2 * 1024
    layers = max(1, round((params - 2 * vocab * 1024) / per_layer))
    conf = LlamaConfig(vocab_size=vocab, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=64,
                       bos_token_id=None, eos_token_id=None)  # fmt: skip
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(conf).parameters())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16)
    model.save_pretrained(str(path))
    del model
    return n


class Peaks:
    """Per-process peak ``RssAnon`` of every process whose title starts with one of ``titles``."""

    def __init__(self, titles: tuple[str, ...], every: float = 0.02):
        import psutil

        self.psutil, self.titles, self.every = psutil, titles, every
        self.peak: dict[tuple[str, int], int] = {}
        self.before = set(self._matching())  # an earlier start's processes, still exiting
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _matching(self) -> dict[int, str]:
        """pid -> title kind of the processes now running with one of the titles."""
        out = {}
        for p in self.psutil.process_iter(["pid", "cmdline"]):
            title = " ".join(p.info["cmdline"] or [])
            kind = next((t for t in self.titles if title.startswith(f"ray::{t}")), None)
            if kind is not None:
                out[p.info["pid"]] = kind
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid, kind in self._matching().items():
                if pid not in self.before:
                    self.peak[(kind, pid)] = max(self.peak.get((kind, pid), 0), _status(pid, "RssAnon"))
            self._stop.wait(self.every)

    def stop(self) -> dict[tuple[str, int], int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def start_once(model_dir: Path, workers: int, out: str) -> tuple[list[int], int]:
    """Start one replica of ``workers`` from ``model_dir`` (FSDP when ``workers`` > 1); the peak
    ``RssAnon`` of each worker (sorted) and of the driver, in bytes."""
    from ray_diloco.components.data import load_corpus
    from ray_diloco.config import load_config
    from ray_diloco.runtime.launcher import new_run_dir
    from ray_diloco.runtime.trainer import Trainer

    cfg = load_config({
        "model": {"init_from": str(model_dir)},
        "data": {"path": str(ROOT / "ray_diloco" / "data" / "tinyshakespeare.txt"), "seq_len": 32},
        "inner": {"global_batch": workers},
        "diloco": {"replicas": 1, "workers_per_replica": workers, "sharding": "fsdp" if workers > 1 else "ddp",
                   "H": 1},
        "run": {"steps": 1, "eval_every": 0, "checkpoint_every": 0, "output_dir": out, "name": f"w{workers}"},
        "tracking": {"wandb": False, "progress": False},
    })  # fmt: skip
    corpus = load_corpus(cfg.data)
    peaks = Peaks(("ReplicaWorker", "OuterDriver"))
    t = Trainer(cfg, new_run_dir(cfg), corpus, None)
    try:
        t.start()
    finally:
        found = peaks.stop()
        t.shutdown()
    for _ in range(100):  # the actors' processes gone before the next start is sampled
        if not peaks._matching():
            break
        time.sleep(0.1)
    return sorted(v for (k, _), v in found.items() if k == "ReplicaWorker"), max(
        [v for (k, _), v in found.items() if k == "OuterDriver"] or [0]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=3e8)
    ap.add_argument("--workers", type=int, default=2, help="FSDP ranks of the sharded start")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import ray
    from tiny_llama import SHAKESPEARE, save_tiny_model

    ray.init(num_cpus=max(2, a.workers + 1), include_dashboard=False, log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        big, tiny = Path(tmp) / "big", Path(tmp) / "tiny"
        save_tiny_model(tiny, SHAKESPEARE.read_text())
        vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
        n = save_llama(big, a.params, vocab)
        for f in tiny.glob("tokenizer*"):  # the same tokenizer
            (big / f.name).write_bytes(f.read_bytes())
        unit = 4 * n
        for workers in (1, a.workers):
            base, _ = start_once(tiny, workers, tmp)
            peak, driver = start_once(big, workers, tmp)
            rows.append({
                "layout": "fsdp" if workers > 1 else "ddp", "workers": workers, "params": n,
                "worker_peak_u": [round(p / unit, 3) for p in peak],
                "model_u": [round((p - b) / unit, 3) for p, b in zip(peak, base)],
                "libraries_gb": [round(b / 1e9, 3) for b in base], "driver_peak_u": round(driver / unit, 3),
            })  # fmt: skip
    print(f"model: {n:,} parameters, U = {unit / 1e9:.2f} GB (fp32); file bf16")
    print(f"{'layout':8} {'workers':>7}  {'peak per worker (U)':>22}  {'model per worker (U)':>22}  {'driver (U)':>10}")
    for r in rows:
        peak, model = ", ".join(f"{x:.2f}" for x in r["worker_peak_u"]), ", ".join(f"{x:.2f}" for x in r["model_u"])
        print(f"{r['layout']:8} {r['workers']:>7}  {peak:>22}  {model:>22}  {r['driver_peak_u']:>10.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
