"""Ray Tune sweeps without Ray (issue 5): search-space checks, saved sweeps, the papers' grids,
the results row of an interrupted trial, a trial's quiet teardown, the tune CLI's bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, run_main

from ray_diloco.errors import ConfigError
from ray_diloco.tune.sweep import load_space


def _space(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "space.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text, expected", [
    ("params: {outer.lr: {grid: [0.4]}}\nschedule: asha\n", "schedule: unknown search-space key"),
    ("params: {outer.lr: {grid: []}}\n", "params.outer.lr.grid = []: must be a non-empty list"),
    ("params: {}\n", "params = {}: must be a non-empty mapping"),
    ("params: {outer.bogus: {grid: [1]}}\n", "outer.bogus: unknown config field"),
    ("params: {diloco.H: {grid: [ten]}}\n", "diloco.H = 'ten': expected int"),
    ("params: {inner.lr: {loguniform: [0, 1]}}\n", "params.inner.lr.loguniform = [0, 1]: must be [low, high]"),
    ("params: {inner.lr: {normal: [0, 1]}}\n", "params.inner.lr = {'normal': [0, 1]}: expected one of"),
    ("params: {inner.lr: {grid: [1e-3]}}\nscheduler: hyperband\n", "scheduler = 'hyperband': must be one of fifo, asha"),
    ("params: {inner.lr: {grid: [1e-3]}}\nset: {run.stepz: 3}\n", "run.stepz: unknown config field"),
    ("params: {inner.lr: {grid: [1e-3]}}\nasha: {grace_period: x}\n", "asha.grace_period = 'x': must be an integer >= 1"),
    ("params: {inner.lr: {grid: [1e-3]}}\nasha: {grace_period: null}\n", "asha.grace_period = None: must be an integer"),
    ("params: {inner.lr: {grid: [1e-3]}}\nasha: {reduction_factor: [2]}\n", "asha.reduction_factor = [2]: must be a number > 1"),
    ("params: {inner.lr: {grid: [1e-3]}}\nnum_samples: true\n", "num_samples = True: must be an integer in 1..10000"),
    ("params: {inner.lr: {uniform: [0, .inf]}}\n", "params.inner.lr.uniform = [0, inf]: must be [low, high], finite numbers"),
    ("params: {run.steps: {geometric: {start: 2, factor: 2, count: 1.0e+7}}}\n",
     "params.run.steps.geometric = {'start': 2, 'factor': 2, 'count': 10000000.0}: must be {start: > 0, factor: > 0, count: "
     "integer in 1..10000} with every value finite"),
    ("params: {inner.lr: {geometric: {start: 1.0e-3, factor: 10, count: 400}}}\n", "with every value finite"),
    ("params: {inner.lr: {grid: [1e-3]}}\nresources: {cpus_per_worker: .inf}\n",
     "resources.cpus_per_worker = inf: must be a finite number > 0"),
    ("params: [inner.lr]\n", "params = ['inner.lr']: must be a non-empty mapping"),
    ("params: {outer.lr: {grid: [.nan, 0.4]}}\n", "params.outer.lr.grid = [nan, 0.4]: numbers must be finite"),
    ("params: {method: {grid: [{algorithm: dp}, 2]}}\n",
     "params.method.grid = [{'algorithm': 'dp'}, 2]: grouped values must all be non-empty mappings"),
    ("params: {method: {grid: [{algorithm: dp, diloco.replicaz: 1}]}}\n", "diloco.replicaz: unknown config field"),
    ("params: {inner.lr: {geometric: {start: 1.0e-4, factor: 1.01, count: 1000}}, inner.warmup_steps: "
     "{geometric: {start: 1, factor: 1, count: 1000}}}\n", "params: the grids make 1,000,000 trials"),
])
def test_bad_search_space_gives_one_line_naming_the_key(tmp_path, text, expected):
    with pytest.raises(ConfigError) as e:
        load_space(_space(tmp_path, text))
    assert len(e.value.lines()) == 1, e.value.lines()
    assert expected in e.value.lines()[0]


def test_bad_name_space_path_and_saved_sweep_are_one_line(tmp_path):
    """--name must be a plain directory name; --space a file; a sweep.yaml that is corrupt or
    holds invalid options is refused on --resume with the field named."""
    from ray_diloco.tune.space import load_spec

    ok = _space(tmp_path, "params: {outer.lr: {grid: [0.4]}}\n")
    for name in ("../up", "a/b", ".", ""):
        with pytest.raises(ConfigError, match=r"--name .*: must be 1-100 letters, digits"):
            load_space(ok, name=name, storage_path=str(tmp_path))
    with pytest.raises(ConfigError, match="is a directory; expected a search-space YAML file"):
        load_space(tmp_path)
    sweep = tmp_path / "sw"
    sweep.mkdir()
    (sweep / "sweep.yaml").write_bytes(b"\x00\xff\xfe")
    with pytest.raises(ConfigError, match="sweep.yaml cannot be read"):
        load_spec(str(sweep))
    for text, expected in [("params: [unclosed\n", "sweep.yaml is not valid YAML"),
                           ("- 1\n", "sweep.yaml is not a saved sweep"),
                           ("params: {outer.lr: {grid: [0.4]}}\nbogus: 1\n", "sweep.yaml is not a saved sweep"),
                           ("params: {outer.lr: {grid: [0.4]}}\nasha: {grace_period: x}\n",
                            "sweep.yaml: asha.grace_period = 'x': must be an integer >= 1")]:
        (sweep / "sweep.yaml").write_text(text)
        with pytest.raises(ConfigError) as e:
            load_spec(str(sweep))
        assert len(e.value.lines()) == 1 and expected in e.value.lines()[0], e.value.lines()


def test_a_moved_sweep_resumes_where_it_is_now(tmp_path):
    """--resume DIR locates the sweep by DIR, not by the storage path saved when it started
    (a copied or moved sweep directory does not write back into the old place)."""
    from ray_diloco.components.storage import join_uri, split_uri
    from ray_diloco.tune.space import load_spec

    spec = load_space(_space(tmp_path, "params: {outer.lr: {grid: [0.4]}}\n"), name="first",
                      storage_path=str(tmp_path / "old"))
    new = tmp_path / "elsewhere" / "renamed"
    new.mkdir(parents=True)
    (new / "sweep.yaml").write_text(yaml.safe_dump(spec.to_dict()))
    moved = load_spec(str(new))
    assert moved.sweep_dir == str(new) and moved.local_dir == new and moved.params == spec.params
    uri = "s3://bucket/sweeps/renamed?endpoint_override=localhost:9000"
    assert split_uri(uri) == ("s3://bucket/sweeps?endpoint_override=localhost:9000", "renamed")
    assert join_uri(*split_uri(uri)) == uri


def test_papers_grids_and_trial_bundles():
    """The shipped spaces load; geometric grids give the papers' powers of sqrt(2) and of 2; a
    trial's placement group is its own bundle + one bundle per replica worker."""
    for p in sorted((ROOT / "tune_spaces").glob("*.yaml")):
        load_space(p, name="check", storage_path="/tmp/unused")
    s = load_space(ROOT / "tune_spaces" / "scaling_law_grid.yaml", name="check", storage_path="/tmp/unused")
    lrs = s.grid_values("inner.lr")
    assert all(math.isclose(b / a, math.sqrt(2), rel_tol=1e-4) for a, b in zip(lrs, lrs[1:]))
    batches = s.grid_values("inner.global_batch")
    assert all(isinstance(b, int) for b in batches) and all(b == 2 * a for a, b in zip(batches, batches[1:]))
    s = load_space(ROOT / "tune_spaces" / "cpu_outer_lr_h_m.yaml", name="check", storage_path="/tmp/unused")
    assert s.grid_values("outer.lr") == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert s.grid_values("diloco.H") == [1, 5, 10, 30, 100, 300] and s.grid_values("diloco.replicas") == [1, 2, 4, 8]
    cfg = s.trial_config({"outer.lr": 0.2, "diloco.H": 5, "diloco.replicas": 4}, validate=False)
    b = s.bundles(cfg)
    assert len(b) == 1 + 4 * cfg.diloco.workers_per_replica
    assert all(x == {"CPU": cfg.diloco.cpus_per_worker} for x in b[1:])


def test_a_grouped_grid_value_sets_several_fields_and_reads_back_from_its_label(tmp_path):
    """The study's grid pairs d_model with d_ff and DP with one worker (not DP x every M): each
    grouped value is one trial's several fields, and the results table's label of it (what
    best_config.yaml is rebuilt from) gives the same config."""
    from ray_diloco.tune.space import group_label

    s = load_space(ROOT / "tune_spaces" / "cpu_scaling_study.yaml", name="check", storage_path="/tmp/unused")
    methods = s.grid_values("method")
    assert len(methods) == 4 and methods[0] == {"algorithm": "dp", "diloco.replicas": 1}
    params = {"size": s.grid_values("size")[1], "method": methods[3], "inner.lr": 4e-3, "inner.global_batch": 16}
    cfg = s.trial_config(params)
    assert (cfg.model.d_model, cfg.model.d_ff, cfg.algorithm, cfg.diloco.replicas) == (36, 96, "diloco", 4)
    labels = {k: group_label(v) if isinstance(v, dict) else v for k, v in params.items()}
    assert labels["method"] == "algorithm=diloco diloco.replicas=4"
    assert s.trial_config(labels).to_yaml() == cfg.to_yaml()
    assert len(s.bundles(s.trial_config({**params, "method": methods[0]}))) == 2  # DP: its own bundle + 1 worker

    from ray_diloco.tune.trial import _trial_run

    s.storage_path = str(tmp_path)  # a grouped value that sets run.eval_every keeps it in the trial
    del s.set["run.eval_every"]
    cfg, *_ = _trial_run(s, "t0", {**params, "size": {**params["size"], "run.eval_every": 7}})
    assert cfg.run.eval_every == 7 and _trial_run(s, "t1", params)[0].run.eval_every == 1  # a trial's default


def test_tune_cli_bad_input_is_one_line(tmp_path):
    bad = _space(tmp_path, "params: {outer.lr: {grid: []}}\nsearchh: optuna\n")
    proc = run_main(["tune", "--space", str(bad)])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["error: config error: searchh: unknown search-space key (allowed: description, config, set, params, metric, "
                     "mode, num_samples, scheduler, asha, search, resources, max_concurrent_trials)",
                     "error: config error: params.outer.lr.grid = []: must be a non-empty list of values"], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


def test_last_metrics_of_an_interrupted_trial_come_from_its_run(tmp_path):
    """A trial stopped by an interruption before Tune kept its result: its row is filled from its
    run's metrics.jsonl (last outer step, best eval loss so far), a line cut short is skipped."""
    from ray_diloco.tune.sweep import _last_metrics

    rows = [{"outer_step": 1, "inner_step": 5, "eval_loss": 3.5, "train_loss": 3.6, "tokens": 320,
             "bytes_sent_total": 10, "bytes_received_total": 12},
            {"outer_step": 2, "inner_step": 10, "eval_loss": 3.2, "train_loss": 3.3, "tokens": 640,
             "bytes_sent_total": 20, "bytes_received_total": 24},
            {"outer_step": 3, "inner_step": 15, "eval_loss": 3.4, "train_loss": 3.1, "tokens": 960,
             "bytes_sent_total": 30, "bytes_received_total": 36}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"outer_step": 4, "inn')
    m = _last_metrics(tmp_path)
    assert (m["outer_step"], m["eval_loss"], m["best_eval_loss"], m["tokens"], m["bytes_sent"], m["bytes_received"]) \
        == (3, 3.4, 3.2, 960, 30, 36)
    assert _last_metrics(tmp_path / "missing") == {}


def test_a_stopped_trials_teardown_sigterm_prints_no_traceback():
    """After a trial's cleanup, the SystemExit that Ray's SIGTERM handler raises while the actor's
    objects are freed (inside a finaliser, where Python reports it as an ignored exception) prints
    nothing; any other exception raised in a finaliser is still reported. A real process, a real
    SIGTERM delivered while a finaliser runs."""
    code = """
import os, signal, sys, time
from ray_diloco.tune.trial import quiet_teardown

def sigterm(signum, frame):  # what Ray's worker main loop installs
    raise SystemExit(1)

signal.signal(signal.SIGTERM, sigterm)

class Freed:
    def __init__(self, kill):
        self.kill = kill
    def __del__(self):
        if self.kill:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the handler runs here, inside the finaliser
        else:
            raise ValueError("a real error in a finaliser")

def free(kill):
    Freed(kill)

if sys.argv[1] == "quiet":
    quiet_teardown()
free(True)
free(False)
print("still running")
"""
    runs = {mode: subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=60)
            for mode in ("quiet", "default")}
    assert "SystemExit" in runs["default"].stderr and "Traceback" in runs["default"].stderr  # what CI showed
    quiet = runs["quiet"]
    assert "SystemExit" not in quiet.stderr, quiet.stderr
    assert "ValueError: a real error in a finaliser" in quiet.stderr
    assert quiet.stdout.strip() == "still running"
