"""Shared fixtures: one real local Ray for the session, a small real corpus, tiny configs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the small path's token cache (data.cache_dir): one per test session, not the user's ~/.cache
os.environ.setdefault("RAY_DILOCO_CACHE", __import__("tempfile").mkdtemp(prefix="ray-diloco-test-cache-"))

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "ray_diloco" / "data" / "tinyshakespeare.txt"


def tiny_overrides(tmp_path: Path, **extra) -> dict:
    """A config dict for a ~24k-parameter model (the `tiny` preset's family, shrunk) that trains
    in seconds on 2 cores."""
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


class TorchLM(torch.nn.Module):
    """A tiny pure-torch decoder (token + position embeddings, pre-norm blocks of causal attention
    and a GELU MLP, final norm, head): ``[B, T]`` int64 ids to ``[B, T, vocab]`` fp32 logits.

    Tests of the DiLoCo machinery (outer steps, elasticity, streaming) train it instead of the
    transformers presets: a Ray actor that builds it imports no transformers, which saves about 4 s
    of CPU per actor on this machine. Its blocks are ``blocks.<i>.``, so fragments follow them.
    The transformers path is what the CLI, export and model tests train."""

    def __init__(self, shape: dict, vocab_size: int):
        super().__init__()
        d, self.heads = shape["d_model"], shape["n_heads"]
        self.embed = torch.nn.Embedding(vocab_size, d)
        self.pos = torch.nn.Embedding(shape["context"], d)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "norm1": torch.nn.LayerNorm(d), "qkv": torch.nn.Linear(d, 3 * d), "proj": torch.nn.Linear(d, d),
            "norm2": torch.nn.LayerNorm(d), "up": torch.nn.Linear(d, shape["d_ff"]),
            "down": torch.nn.Linear(shape["d_ff"], d)}) for _ in range(shape["n_layers"]))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        x = self.embed(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](a.transpose(1, 2).reshape(b, t, -1))
            x = x + blk["down"](torch.nn.functional.gelu(blk["up"](blk["norm2"](x))))
        return self.head(self.norm(x))


def torch_lm(shape: dict, vocab_size: int) -> torch.nn.Module:
    """``model_fn`` building :class:`TorchLM` from the resolved model shape."""
    return TorchLM(shape, vocab_size)


@pytest.fixture(scope="session")
def small_text(tmp_path_factory) -> Path:
    """The first 60k characters of Tiny Shakespeare (real text, quick to tokenise)."""
    p = tmp_path_factory.mktemp("data") / "shakespeare_60k.txt"
    p.write_text(SHAKESPEARE.read_text()[:60000])
    return p


@pytest.fixture(scope="session")
def corpus(small_text):
    from ray_diloco.config import DataConfig
    from ray_diloco.components.data import load_corpus

    return load_corpus(DataConfig(path=str(small_text), seq_len=16))


@pytest.fixture(scope="session")
def ray_session():
    """One real local Ray cluster (2 CPUs) shared by every test that needs it."""
    import ray

    if not ray.is_initialized():
        # workers inherit this environment (WANDB_MODE above; PYTHONPATH: they import model builders
        # defined in test modules); no job runtime_env, so Ray's prestarted workers can host actors
        # every folder of test files: pytest imports each test module by its base name from its folder
        test_dirs = sorted({str(p.parent) for p in (ROOT / "tests").rglob("test_*.py")})
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), *test_dirs, str(ROOT),
                                                    os.environ.get("PYTHONPATH", "")])
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


def start_trainer(cfg, corpus, model_fn=None, resume_state=None):
    """A started :class:`~ray_diloco.runtime.trainer.Trainer` in a new run directory of ``cfg``:
    the outer-step loop driven by hand (``t.outer_step(k)``) in integration tests."""
    from ray_diloco.runtime.launcher import _new_run_dir
    from ray_diloco.runtime.trainer import Trainer

    t = Trainer(cfg, _new_run_dir(cfg), corpus, model_fn, resume_state)
    t.start()
    return t
