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
        assert all(os.environ[k] == "1" for k in THREAD_VARIABLES)
        # set here it would reach Ray's processes started later (a CPU worker's pool must spin)
        assert "OMP_WAIT_POLICY" not in os.environ
        report = p.report()
        assert report["torch_threads"] == 1 and report["env"]["OMP_NUM_THREADS"] == "1" and report["cpus"] == 1.0
    finally:
        torch.set_num_threads(before)


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
