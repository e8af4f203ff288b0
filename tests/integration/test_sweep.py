"""Ray Tune sweeps (issue 5): search-space checks, a real sweep with ASHA on this machine that is
interrupted and resumed, W&B offline runs per trial, a failing trial and a broken W&B."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers import ROOT, run_cli, run_main, wait_for
from wandb_records import run_contents

from ray_diloco.tune.sweep import load_space

# shrinks the shipped CPU space to a model that trains in seconds (the sweep machinery is unchanged)
SMALL = ["model.n_layers=2", "model.n_heads=2", "model.d_model=32", "model.d_ff=64", "model.context=16",
         "data.seq_len=16", "run.steps=20", "inner.warmup_steps=2", "inner.global_batch=4", "run.eval_batch=256"]


def _space(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "space.yaml"
    p.write_text(text)
    return p


def test_resume_is_refused_while_the_sweep_runs_and_starts_over_without_tune_state(tmp_path, small_text, ray_address):
    """A sweep directory another process holds is refused with one line (two resumes of one
    sweep at once destroyed a trial's run directory). A sweep that stopped before Tune saved its
    state (only sweep.yaml) resumes by starting over (on the session's Ray cluster); a failing trial
    is one line, no traceback."""
    from ray_diloco.components.checkpoint import lock_dir

    spec = load_space(_space(tmp_path, "params: {outer.lr: {grid: [-1.0]}}\nresources: {cpus_per_worker: 0.4}\n"),
                      [f"data.path={small_text}", *SMALL], name="sw", storage_path=str(tmp_path / "sweeps"))
    sweep = Path(spec.sweep_dir)
    sweep.mkdir(parents=True)
    (sweep / "sweep.yaml").write_text(yaml.safe_dump(spec.to_dict()))
    held = lock_dir(sweep, "test")
    try:
        busy = run_main(["tune", "--resume", str(sweep)])
    finally:
        held.close()
    assert busy.returncode == 2 and busy.stderr.strip() == \
        f"error: sweep directory {sweep}: in use by another ray-diloco process (pid {os.getpid()})"
    again = run_cli(["tune", "--resume", str(sweep)], timeout=300, env={"RAY_ADDRESS": ray_address})
    assert again.returncode == 1, again.stderr[-3000:]
    assert "holds no saved Tune state (the sweep stopped before its first trial started): starting it from the beginning" \
        in again.stderr
    assert "Traceback" not in again.stdout + again.stderr
    assert 'File "' not in again.stdout + again.stderr  # nor the stack of the trial's actor (its creation task)
    assert "failed: config error: outer.lr = -1.0: must be a finite number > 0" in again.stdout
    rows = pd.read_csv(sweep / "results.csv")
    assert list(rows["status"]) == ["ERROR"]


@pytest.mark.slow
def test_sweep_with_asha_is_interrupted_resumed_and_logs_each_trial_to_wandb(tmp_path, small_text, ray_address):
    """The shipped CPU space (shrunk model, M=1) with one more, invalid, outer lr: 6 trials with
    ASHA, 3 at a time. Interrupted (SIGINT) once one trial has finished and another is in the
    middle of its run, resumed with --resume while W&B is set online against a server that does not
    answer. Every valid trial ends, the 2 invalid ones fail with their one-line reason without
    stopping the sweep, the results table has 6 rows, the best config is printed and written,
    and each valid trial has offline W&B runs (written directly before the interruption, as the
    fallback after it) in the sweep's group with its config and every evaluation once. The first
    part joins the session's Ray cluster; the resume starts its own, whose workers see the broken
    W&B settings of its environment."""
    space = yaml.safe_load((ROOT / "tune_spaces" / "cpu_outer_lr.yaml").read_text())
    space["params"]["outer.lr"]["grid"].append(-1.0)
    space["set"]["diloco.replicas"] = 1
    space["params"]["diloco.H"]["grid"] = [2, 5]  # 20 and 8 outer steps: a trial is mid-run long enough to interrupt
    STEPS = 40
    path = _space(tmp_path, yaml.safe_dump(space))
    args = ["tune", "--space", str(path), "--name", "sw",
            "--storage-path", str(tmp_path / "sweeps"), "--set", f"data.path={small_text}",
            "--set", "tracking.wandb=true", "--set", "tracking.init_timeout_s=3",
            *[x for s in SMALL for x in ("--set", s)], "--set", f"run.steps={STEPS}"]
    sweep = tmp_path / "sweeps" / "sw"
    env = dict(os.environ, WANDB_MODE="offline", RAY_ADDRESS=ray_address)
    proc = subprocess.Popen([sys.executable, "-m", "ray_diloco.cli", *args], cwd=str(ROOT), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # interrupt once a trial has finished and another is live with at least three outer steps to
        # go: it has a row that is not an ASHA rung (ASHA stops trials only right after a rung row),
        # and the interruption lets it finish at most the outer step it is in and the next
        asha = space["asha"]
        rungs = {asha["grace_period"] * asha["reduction_factor"] ** k for k in range(8)}

        def mid_run(d: Path) -> bool:
            if (d / "summary.json").exists() or not (d / "metrics.jsonl").is_file():
                return False
            done = sum(1 for line in (d / "metrics.jsonl").read_text().splitlines() if '"outer_step"' in line)
            total = STEPS // yaml.safe_load((d / "config.yaml").read_text())["diloco"]["H"]
            return done >= 1 and done not in rungs and done + 2 < total

        wait_for(lambda: any(sweep.glob("trials/*/summary.json")) and any(map(mid_run, sweep.glob("trials/*"))),
                  300, "a finished trial and one in the middle of its run", poll=0.05)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-3000:]
    assert f"continue it with ray-diloco tune --resume {sweep}" in out
    first = pd.read_csv(sweep / "results.csv")
    assert 2 <= len(first) <= 6 and (first["status"] != "TERMINATED").any() and "Traceback" not in out
    live = first[first["status"] == "INTERRUPTED"]  # the trial that was mid-run: its metrics so far
    assert len(live) >= 1 and live["outer_steps"].notna().all() and live["final_eval_loss"].notna().all(), first
    assert " interrupted" in out
    broken_wandb = {"WANDB_MODE": "online", "WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9"}
    resumed = run_cli(["tune", "--resume", str(sweep)], env=broken_wandb, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "W&B unreachable" in resumed.stdout  # the driver's summary (a trial's own last lines can miss it)
    everything = pd.read_csv(sweep / "results.csv")
    assert len(everything) == len(pd.read_parquet(sweep / "results.parquet")) == 6
    bad, df = everything[everything["outer.lr"] < 0], everything[everything["outer.lr"] > 0]
    assert list(bad["status"]) == ["ERROR", "ERROR"]
    assert set(bad["error"]) == {"config error: outer.lr = -1.0: must be a finite number > 0"}
    assert "failed: config error: outer.lr = -1.0: must be a finite number > 0" in resumed.stdout + out
    assert 'File "' not in resumed.stdout + out  # an invalid trial is its one line, no stack
    assert set(df["status"]) <= {"TERMINATED", "STOPPED"}, df[["trial", "status"]]
    # every trial that started after the resume fell back to offline logging, and says so
    assert df["wandb_warning"].notna().any() and df["wandb_warning"].dropna().str.startswith("W&B unreachable").all()
    assert sorted(zip(df["outer.lr"], df["diloco.H"])) == [(0.4, 2), (0.4, 5), (0.8, 2), (0.8, 5)]
    assert (df["status"] == "TERMINATED").sum() >= 2  # ASHA keeps at least the best of each rung going
    for col in ("num_parameters", "replicas", "H", "inner_lr", "outer_lr", "global_batch", "tokens",
                "final_eval_loss", "best_eval_loss", "bytes_sent"):
        assert df[col].notna().all(), col
    best = df.loc[df["final_eval_loss"].idxmin()]
    assert f"best trial {best['trial']}: final_eval_loss {best['final_eval_loss']:.4f}" in resumed.stdout
    best_cfg = yaml.safe_load((sweep / "best_config.yaml").read_text())
    assert best_cfg["outer"]["lr"] == best["outer.lr"] and best_cfg["diloco"]["H"] == best["diloco.H"]
    resumed_trials = 0
    for _, row in df.iterrows():
        run_dir = Path(row["run_dir"])
        metrics = [yaml.safe_load(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [m["outer_step"] for m in metrics]
        assert steps == list(range(1, int(row["outer_steps"]) + 1)), steps  # a resumed trial repeats no step
        assert metrics[-1]["eval_loss"] == pytest.approx(row["final_eval_loss"], rel=1e-9)
        # one offline W&B log per process: a trial stopped by ASHA or by the interruption ends at an
        # outer-step boundary and finishes its W&B run, so together its logs hold every evaluation once
        logs = run_contents(run_dir, every=True)
        for wb in logs:
            assert wb["group"] == "sw" and "sweep" in wb["tags"]
            assert wb["config"]["outer"]["lr"] == row["outer.lr"] and wb["config"]["diloco"]["H"] == row["diloco.H"]
        logged = [h["eval_loss"] for wb in logs for h in wb["history"] if "eval_loss" in h]
        assert logged == pytest.approx([m["eval_loss"] for m in metrics], rel=1e-9)
        resumed_trials += len(logs) > 1
    assert resumed_trials >= 1, "no trial was interrupted mid-run and resumed"


