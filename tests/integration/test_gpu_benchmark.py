"""benchmarks/gpu.py is prepared for the few sessions that are lent a GPU: its CPU smoke mode runs
the whole script here (the plain loop, the 2-replica streaming run with micro-batches and
checkpoints, and its resume; the FSDP run, not resumed in smoke mode; the compiled, fp4 and 1B-class
rows are GPU-only), so a GPU session does not find a broken script."""

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
    """Its ``ray-diloco train`` processes join the session's Ray cluster (``RAY_ADDRESS``), as
    they would join a GPU machine's running cluster, instead of starting one each."""
    out = tmp_path / "gpu.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=dict(os.environ, RAY_ADDRESS=ray_address))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = res["rows"]
    d = rows["ray-diloco"]
    assert d["resumed"] is True and d["checkpoints"] >= 2
    assert rows["plain loop, eager"]["tokens_per_s"] > 0 and d["tokens_per_s"] > 0 and d["ratio"] > 0
    # it trained: the last outer step's loss is below the first's and below ln(65) = 4.17, the
    # loss of the uniform prediction an untrained model makes
    assert d["final_train_loss"] < d["first_train_loss"] - 0.1, res
    assert d["final_train_loss"] < math.log(65) - 0.25, res
    assert d["compile_s"] == 0  # run.compile: auto compiles on CUDA only
    assert "ray-diloco" in p.stdout and "FSDP" in p.stdout
    assert rows["FSDP"]["tokens_per_s"] > 0 and rows["FSDP"]["checkpoints"] >= 2  # FSDP2 over gloo on CPU (resumed on a GPU)
