"""The ray-diloco command as a user runs it: bad input, kill and resume, eval, generate."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, one_error_line, read_metrics, run_cli, run_main, tiny_overrides, wait_for
from wandb_records import run_contents


@pytest.mark.parametrize("override, needles", [
    ("diloco.H=0", ("diloco.H", "0", ">= 1")),
    ("diloco.replicas=0", ("diloco.replicas", ">= 1")),
    ("inner.lr=-1", ("inner.lr", "-1", "> 0")),
    ("outer.momentum=1", ("outer.momentum", "[0, 1)")),
    ("inner.global_batch=13", ("inner.global_batch", "13", "divisible")),
    ("data.seq_len=128", ("data.seq_len", "128", "model.context")),
    ("diloco.nope=3", ("diloco.nope", "unknown")),
    ("data.path=/no/such/file.txt", ("data.path", "/no/such/file.txt", "not found")),
    ("streaming.quantization=fp2", ("streaming.quantization", "fp2", "fp4_e3m0")),
    ("streaming.alpha=1.5", ("streaming.alpha", "1.5", "[0, 1]")),
    ("streaming.pattern=random", ("streaming.pattern", "strided")),
    ("streaming.closing_round=maybe", ("streaming.closing_round", "average")),
    ("network.latency_ms=1e300", ("network.latency_ms", "[0, 60000]")),
    ("network.bandwidth_gbps=1e-300", ("network.bandwidth_gbps", "[1e-6, 1e6]")),
])
def test_invalid_input_one_line_no_traceback(override, needles, tmp_path):
    """The CLI's main() in this process (the same code as the console script, which runs in the
    end-to-end test below): exit 2, one error line naming the field, nothing written."""
    one_error_line(run_main(["train", "--set", override, "--set", f"run.output_dir={tmp_path}"]), *needles)
    assert not any(tmp_path.iterdir())  # nothing was started or written


def test_bad_yaml_and_unknown_preset(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("diloco: [1, 2\n")
    one_error_line(run_main(["train", "--config", str(bad)]), "bad.yaml", "YAML")
    one_error_line(run_main(["train", "--config", "no-such-preset"]), "no-such-preset", "presets")


def test_more_workers_than_cpus_is_refused_before_starting(ray_session, tmp_path):
    """On the session's cluster (this process has joined it: the command joins it too)."""
    proc = run_main(["train", "--set", "diloco.replicas=4", "--set", "diloco.cpus_per_worker=1",
                     "--set", f"run.output_dir={tmp_path}", "--set", "run.name=x"])
    line = one_error_line(proc, "diloco.replicas", "4", "CPUs")
    cpus = ray_session.cluster_resources()["CPU"]
    assert f"= 4 CPUs, but the Ray cluster has {cpus:g}:" in line, (cpus, line)
    assert not (tmp_path / "x" / "checkpoints").exists()


def test_resume_of_missing_or_corrupt_run(ray_session, tmp_path):
    one_error_line(run_main(["train", "--resume", str(tmp_path / "nope")]), "nope")
    one_error_line(run_main(["eval", str(tmp_path / "nope")]), "nope")
    run = tmp_path / "run"
    ck = run / "checkpoints" / "step_000002"
    ck.mkdir(parents=True)
    (run / "config.yaml").write_text("run:\n  steps: 10\n")
    (ck / "state.pt").write_bytes(b"\x80\x02garbage that is not a checkpoint")
    before = (ck / "state.pt").read_bytes()
    line = one_error_line(run_main(["train", "--resume", str(run)]), "state.pt", "corrupt")
    assert str(ck) in line
    one_error_line(run_main(["eval", str(run)]), "corrupt")
    one_error_line(run_main(["eval", str(run), "--workers", "0"]), "--workers = 0", ">= 1")
    assert (ck / "state.pt").read_bytes() == before  # nothing already written is touched


def _write_config(tmp_path, small_text, **extra):
    cfg = tiny_overrides(tmp_path, data__path=str(small_text), run__log_hashes=True, run__deterministic=True, **extra)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _popen_train(*args: str) -> subprocess.Popen:
    """``ray-diloco train ARGS`` in its own session (a process group: the driver and the local Ray
    it starts), stderr captured."""
    return subprocess.Popen([sys.executable, "-m", "ray_diloco.cli", "train", *args], cwd=str(ROOT),
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for_checkpoint(proc: subprocess.Popen, run_dir, step: int) -> None:
    wait_for(lambda: proc.poll() is not None or (run_dir / "checkpoints" / f"step_{step:06d}").exists(), 300,
             f"checkpoint {step}")
    assert proc.poll() is None, f"the run ended before its checkpoint {step}: {proc.stderr.read()[-3000:]}"


@pytest.mark.slow
def test_train_eval_generate_then_stop_kill_and_resume_match_the_uninterrupted_run(tmp_path, small_text, ray_address):
    """`ray-diloco train` as a user runs it (the console script, W&B offline), then `eval` and
    `generate` on its run directory. A second run of the same config is stopped with SIGTERM
    (`ray job stop`, `kill`) after its second checkpoint: it exits 130 without a traceback, stops
    its actors and its local Ray, and leaves only complete checkpoints. Resumed, it is killed
    whole (SIGKILL to the driver and its Ray) after its fourth checkpoint, and resumed again: every
    outer update, the outer momentum and the data read equal those of the first run, bit for bit.
    The first run and the last resume join the session's Ray cluster (``RAY_ADDRESS``); the
    interrupted ones start their own, which the signals stop with them."""
    cfg = _write_config(tmp_path, small_text, run__steps=60, run__eval_every=0, run__keep_checkpoints=3,
                        tracking__wandb=True)
    script = str(Path(sys.executable).parent / "ray-diloco")
    full = subprocess.run([script, "train", "--config", str(cfg), "--set", "run.name=full"], capture_output=True,
                          text=True, timeout=600, cwd=str(ROOT),
                          env=dict(os.environ, WANDB_MODE="offline", RAY_ADDRESS=ray_address))
    assert full.returncode == 0, full.stderr[-3000:]
    full_dir = tmp_path / "runs" / "full"
    assert f"run directory: {full_dir}" in full.stdout
    summary = json.loads((full_dir / "summary.json").read_text())
    assert f"{summary['final_eval_loss']:.4f}" in full.stdout
    assert yaml.safe_load((full_dir / "config.yaml").read_text())["diloco"]["H"] == 5
    wb = run_contents(full_dir)  # the offline W&B run, read back from its protobuf log
    assert wb["config"]["diloco"]["H"] == 5 and wb["config"]["run"]["name"] == "full" and wb["name"] == "full"
    rows = read_metrics(full_dir)
    assert [h["eval_loss"] for h in wb["history"] if "eval_loss" in h] == [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert all("train_loss_replica/replica_1" in h for h in wb["history"] if "train_loss" in h)
    ev = run_main(["eval", str(full_dir)])
    assert ev.returncode == 0, ev.stderr
    assert f"validation loss {summary['final_eval_loss']:.4f}" in ev.stdout
    gen = run_main(["generate", str(full_dir), "--prompt", "ROMEO:", "--max-new-tokens", "40"])
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("ROMEO:") and len(gen.stdout.strip()) >= 40
    # a temperature near 0 is greedy decoding: the same text whatever the seed (no overflow to nan)
    greedy = [run_main(["generate", str(full_dir), "--prompt", "ROMEO:", "--max-new-tokens", "20", "--temperature",
                        "1e-40", "--seed", seed]) for seed in ("1", "2")]
    assert all(g.returncode == 0 for g in greedy), greedy[0].stderr[-2000:]
    assert greedy[0].stdout == greedy[1].stdout and len(greedy[0].stdout.strip()) >= 20
    one_error_line(run_main(["generate", str(full_dir), "--seed", str(2**64)]), "--seed", str(2**64))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(full_dir / "final"))  # truncation keeps inputs within the context
    assert tok.model_max_length == 16 and len(tok("ROMEO: " * 20, truncation=True)["input_ids"]) == 16

    # SIGTERM after the second checkpoint: a clean stop
    run_dir = tmp_path / "runs" / "stopped"
    proc = _popen_train("--config", str(cfg), "--set", "run.name=stopped")
    _wait_for_checkpoint(proc, run_dir, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "interrupted" in err
    wait_for(lambda: not _group_alive(proc.pid), 10, "the processes of the interrupted run to exit")
    steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert steps and all(p.startswith("step_") for p in steps) and not (run_dir / "summary.json").exists()
    # resumed, then SIGKILL to the whole process group after the fourth checkpoint
    proc = _popen_train("--resume", str(run_dir))
    _wait_for_checkpoint(proc, run_dir, 4)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray processes it started
    proc.communicate()
    assert not (run_dir / "summary.json").exists()
    # a worker's file cut short: one line naming it, no note that the worker does not see it (the
    # job read it after the worker took it for another node's); put back, the resume below is exact
    cut = sorted((run_dir / "checkpoints").iterdir())[-1] / "worker-1-0.pt"
    whole = cut.read_bytes()
    cut.write_bytes(whole[:1000])
    damaged = run_main(["train", "--resume", str(run_dir)], env={"RAY_ADDRESS": ray_address})
    one_error_line(damaged, str(cut), "corrupt or unreadable")
    assert "does not see" not in damaged.stderr, damaged.stderr
    cut.write_bytes(whole)
    resumed = run_cli(["train", "--resume", str(run_dir)], env={"RAY_ADDRESS": ray_address})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = rows, read_metrics(run_dir)
    assert [r["outer_step"] for r in b] == [r["outer_step"] for r in a] == list(range(1, 13))
    for ra, rb in zip(a, b):
        for key in ("global_sha256", "outer_state_sha256", "data_digest", "train_loss"):
            assert ra[key] == rb[key], (ra["outer_step"], key)
    sb = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_eval_loss"] == sb["final_eval_loss"] and summary["tokens"] == sb["tokens"]


def _group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` is left."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_signal_during_a_checkpoint_write_stops_the_run_after_it(tmp_path):
    """Ctrl-C or SIGTERM inside torch.save used to fail the write ("cannot be written"): the
    checkpoint is now written whole and the interrupt raised after it (SIGTERM as the CLI maps it)."""
    import torch

    from ray_diloco.components import address
    from ray_diloco.components.checkpoint import list_checkpoints, save_checkpoint
    from ray_diloco.runtime.checkpointing import signals_deferred

    state = {"outer_step": 1, "big": torch.arange(2_000_000, dtype=torch.float32)}
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, address.raise_keyboard_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_deferred(replay=True):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)  # the handler has run: without the deferral the interrupt is raised here
                save_checkpoint(tmp_path, 1, state, keep=1)
        assert signal.getsignal(signal.SIGTERM) is address.raise_keyboard_interrupt
    finally:
        signal.signal(signal.SIGTERM, before)
    (step, path), = list_checkpoints(tmp_path)
    assert step == 1 and torch.equal(torch.load(path / "state.pt", weights_only=True)["big"], state["big"])


def test_unreachable_ray_address_fails_fast(tmp_path):
    t = time.time()
    proc = run_cli(["train", "--address", "127.0.0.1:1", "--set", f"run.output_dir={tmp_path}"], timeout=120)
    one_error_line(proc, "run.address", "127.0.0.1:1")
    assert time.time() - t < 60 and not any(tmp_path.iterdir())


def test_more_bad_input_found_by_trying_to_break_it(ray_session, tmp_path):
    nonutf = tmp_path / "bad.yaml"
    nonutf.write_bytes(b"\xff\xfe\x00garbage")
    one_error_line(run_main(["config", "--config", str(nonutf)]), "bad.yaml", "UTF-8")
    one_error_line(run_main(["train", "--set", "run.output_dir=/etc/hostname"]), "run.output_dir",
                   "not a writable directory")
    numeric = tmp_path / "numbers.jsonl"
    numeric.write_text("".join(json.dumps({"text": i}) + "\n" for i in range(100)))
    one_error_line(run_main(["train", "--set", f"data.path={numeric}", "--set", f"run.output_dir={tmp_path / 'o'}"]),
                   "data.text_field", "strings")
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    import torch

    torch.save({"outer_step": 1, "config": {}}, run / "checkpoints" / "step_000001" / "state.pt")
    (run / "tokenizer").mkdir()
    one_error_line(run_main(["eval", str(run)]), "not a complete", "workers")
    one_error_line(run_main(["generate", str(run), "--temperature", "nan"]), "--temperature", "nan")
