"""The thread plan (``components.threads``): each process's threads from its Ray CPU share, never
from the machine's cores; which processes' idle OpenMP threads sleep; what a plan sets in its
process. (A run's processes on a 16-CPU Ray node: tests/integration/test_threads.py.)"""

from __future__ import annotations

import os

import pytest
import torch

from ray_diloco.components.threads import THREAD_VARIABLES, job_threads, outer_threads, thread_plan, worker_threads
from ray_diloco.config import load_config


@pytest.mark.parametrize(("cpus", "intra", "inter"), [(None, 1, 1), (0, 1, 1), (0.5, 1, 1), (1, 1, 1), (2.9, 2, 1),
                                                     (4, 4, 2), (7.5, 7, 2), (64, 64, 2)])
def test_threads_are_the_floor_of_the_cpu_share_at_least_one(cpus, intra, inter):
    p = thread_plan("replica worker", cpus)
    assert (p.intra_op, p.inter_op) == (intra, inter)
    assert p.env() == {k: str(intra) for k in THREAD_VARIABLES}  # a CPU worker's pools keep spinning
    assert p.runtime_env() is None  # so a prestarted Ray worker process can host it


def test_the_outer_side_and_gpu_processes_let_idle_threads_sleep_from_process_start():
    for p in (thread_plan("outer side", 3), thread_plan("replica worker", 6, gpu=True),
              thread_plan("evaluation", 2, gpu=True)):
        assert p.passive and p.env()["OMP_WAIT_POLICY"] == "PASSIVE"
        assert p.runtime_env() == {"env_vars": p.env()}  # OpenMP reads it once, when it loads
    assert not thread_plan("evaluation", 2).passive and not thread_plan("job", 1).passive


def test_the_run_config_decides_each_role():
    cfg = load_config(None, ["diloco.cpus_per_worker=6", "diloco.gpus_per_worker=1", "diloco.outer_cpus=3",
                             "diloco.outer_shards=2"])
    w, shard, driver = worker_threads(cfg), outer_threads(cfg), outer_threads(cfg, holds_state=False)
    assert (w.intra_op, w.passive) == (6, True)
    assert (shard.intra_op, shard.cpus, shard.passive) == (3, 3.0, True)
    assert (driver.intra_op, driver.cpus) == (1, 0.0)  # a driver of K > 1 shards holds no state, reserves nothing


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf")])
def test_a_share_that_is_not_a_cpu_count_is_refused(bad):
    with pytest.raises(ValueError, match="CPU share"):
        thread_plan("job", bad)


def test_apply_sets_torch_and_the_variables_children_inherit_not_the_wait_policy(monkeypatch):
    for k in (*THREAD_VARIABLES, "OMP_WAIT_POLICY"):
        monkeypatch.delenv(k, raising=False)
    before = torch.get_num_threads()
    try:
        p = thread_plan("outer side", 1)
        p.apply()
        assert torch.get_num_threads() == 1
        assert all(os.environ[k] == "1" for k in THREAD_VARIABLES if k != "NUMBA_NUM_THREADS")  # numba's: below
        # set here it would reach Ray's processes started later (a CPU worker's pool must spin)
        assert "OMP_WAIT_POLICY" not in os.environ
        report = p.report()
        assert report["torch_threads"] == 1 and report["env"]["OMP_NUM_THREADS"] == "1" and report["cpus"] == 1.0
    finally:
        torch.set_num_threads(before)


_NUMBA_SCRIPT = r"""
import os, sys
import numba, torch
from ray_diloco.components.threads import thread_plan
from ray_diloco.core import codec

thread_plan("outer side", 1).apply()  # numba imported, its threads not launched: the plan sizes its pool
assert os.environ["NUMBA_NUM_THREADS"] == "1" and numba.config.NUMBA_NUM_THREADS == 1, numba.config.NUMBA_NUM_THREADS
codec._threads()  # launches numba's pool, which resets OpenMP's (torch's) thread count
assert torch.get_num_threads() == 1, torch.get_num_threads()
thread_plan("replica worker", 2).apply()  # after the launch: torch follows the plan, numba's variable keeps the pool's size
assert torch.get_num_threads() == 2 and os.environ["NUMBA_NUM_THREADS"] == "1"
codec._threads()
assert torch.get_num_threads() == 2 and numba.get_num_threads() == 1

@numba.njit(parallel=True, cache=False)
def total(x):
    s = 0.0
    for i in numba.prange(x.shape[0]):
        s += x[i]
    return s

print(total(torch.ones(10).numpy()))  # a compile after the launch re-reads NUMBA_NUM_THREADS: it must still match
"""


def test_apply_before_and_after_numbas_threads_launch_keeps_torch_and_numbas_pool_consistent(tmp_path):
    """numba's first launch resets OpenMP's thread count (torch's); a NUMBA_NUM_THREADS changed
    after the launch fails numba's next compile. Both broke a fresh clone's suite (empty numba
    cache): a plan applied in the test process, then every codec kernel compiled after it."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in (*THREAD_VARIABLES, "OMP_WAIT_POLICY")}
    env["NUMBA_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", _NUMBA_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "10.0"


def test_the_jobs_process_keeps_one_cpu_or_what_its_environment_says(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert job_threads().intra_op == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # e.g. Ray's job entrypoint with --entrypoint-num-cpus 3
    assert job_threads().intra_op == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    assert job_threads().intra_op == 1


@pytest.mark.parametrize(("value", "want"), [(True, "true"), (False, "false"), ("True", "true"), ("auto", "auto")])
def test_run_compile_reads_yaml_booleans_and_auto(value, want):
    assert load_config({"run": {"compile": value}}).run.compile == want


def test_run_compile_outside_its_choices_is_one_line():
    from ray_diloco.errors import ConfigError

    with pytest.raises(ConfigError, match="run.compile"):
        load_config(None, ["run.compile=sometimes"])


@pytest.mark.parametrize("bad", ["-1", "nan", "inf"])
def test_outer_cpus_that_is_not_a_cpu_count_is_one_line(bad):
    from ray_diloco.errors import ConfigError

    with pytest.raises(ConfigError, match=r"diloco.outer_cpus = .*must be >= 0 CPUs"):
        load_config(None, [f"diloco.outer_cpus={bad}"])
