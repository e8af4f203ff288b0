"""Shared fixtures: one real local Ray for the session, a small real corpus, tiny configs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "ray_diloco" / "data" / "tinyshakespeare.txt"


def tiny_overrides(tmp_path: Path, **extra) -> dict:
    """A config dict for a ~20k-parameter llama that trains in seconds on 2 cores."""
    cfg = {
        "model": {"preset": "tiny", "n_layers": 2, "n_heads": 2, "d_model": 32, "d_ff": 64, "context": 16},
        "data": {"seq_len": 16},
        "inner": {"lr": 3e-3, "warmup_steps": 2, "global_batch": 4},
        "outer": {"lr": 0.7, "momentum": 0.9},
        "diloco": {"replicas": 2, "workers_per_replica": 1, "H": 5},
        "run": {"steps": 15, "eval_every": 1, "eval_batch": 256, "checkpoint_every": 1,
                "output_dir": str(tmp_path / "runs"), "keep_checkpoints": 10},
        "tracking": {"wandb": False, "progress": False},
    }
    for key, value in extra.items():
        if "__" not in key:
            cfg[key] = value
            continue
        section, name = key.split("__")
        cfg.setdefault(section, {})[name] = value
    return cfg


@pytest.fixture(scope="session")
def small_text(tmp_path_factory) -> Path:
    """The first 60k characters of Tiny Shakespeare (real text, quick to tokenise)."""
    p = tmp_path_factory.mktemp("data") / "shakespeare_60k.txt"
    p.write_text(SHAKESPEARE.read_text()[:60000])
    return p


@pytest.fixture(scope="session")
def corpus(small_text):
    from ray_diloco.config import DataConfig
    from ray_diloco.data import load_corpus

    return load_corpus(DataConfig(path=str(small_text), seq_len=16))


@pytest.fixture(scope="session")
def ray_session():
    """One real local Ray cluster (2 CPUs) shared by every test that needs it."""
    import ray

    if not ray.is_initialized():
        # workers inherit this environment (WANDB_MODE above; PYTHONPATH: they import model builders
        # defined in test modules); no job runtime_env, so Ray's prestarted workers can host actors
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


def run_cli(args: list[str], timeout: float = 600, env: dict | None = None):
    """Run ``ray-diloco ARGS`` in a fresh process; returns CompletedProcess (text)."""
    import subprocess

    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "ray_diloco.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=str(ROOT))
