"""benchmarks/gpu.py is prepared for the few sessions that are lent a GPU: its CPU smoke mode runs
the whole script here (the plain loop, the 2-replica streaming run with micro-batches and
checkpoints, and its resume; the FSDP run, not resumed in smoke mode), so a GPU session does not find a broken script."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_benchmark_runs_end_to_end_in_smoke_mode(tmp_path, ray_address):
    """Its four ``ray-diloco train`` processes join the session's Ray cluster (``RAY_ADDRESS``), as
    they would join a GPU machine's running cluster, instead of starting one each."""
    out = tmp_path / "gpu.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=dict(os.environ, RAY_ADDRESS=ray_address))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ddp_resumed"] is True and res["ddp_checkpoints"] >= 2
    assert res["plain_tokens_per_s"] > 0 and res["ddp_tokens_per_s"] > 0 and res["ddp_ratio_to_plain"] > 0
    # it trained: the last outer step's loss is below the first's and below ln(65) = 4.17, the
    # loss of the uniform prediction an untrained model makes
    assert res["ddp_final_train_loss"] < res["ddp_first_train_loss"] - 0.1, res
    assert res["ddp_final_train_loss"] < math.log(65) - 0.25, res
    assert "ray-diloco, DDP" in p.stdout and "ray-diloco, FSDP" in p.stdout
    assert res["fsdp_tokens_per_s"] > 0 and res["fsdp_checkpoints"] >= 2  # FSDP2 over gloo on CPU (resumed on a GPU)
