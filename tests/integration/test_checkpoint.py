"""Checkpoints written by the processes that hold the state (issue 16): each worker writes its own
file, the outer-optimiser driver writes the outer state, the job's process only a small
``state.pt``; a resume has each process read its own file. Where a process's node cannot see
the run directory, its state goes through the job instead, and the resume is still bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import start_trainer, tiny_overrides, torch_lm

from ray_diloco.components.checkpoint import STATE_FILE, list_checkpoints, load_checkpoint, read_state_file
from ray_diloco.config import load_config
from ray_diloco.errors import CheckpointError
from ray_diloco.runtime import checkpointing as trainer_module

KEYS = ("global_sha256", "outer_state_sha256", "worker_global_sha256", "data_digest", "train_loss")


def test_each_process_writes_its_own_state_and_a_resume_reads_it_bitwise(ray_session, tmp_path, corpus,
                                                                        monkeypatch, caplog):
    over = dict(run__log_hashes=True, run__deterministic=True, run__eval_every=0, run__checkpoint_every=1,
                diloco__H=6, run__steps=18, diloco__workers_per_replica=2, diloco__cpus_per_worker=0.25,
                streaming__fragments=2, streaming__overlap_steps=1, inner__global_batch=8)
    cfg = load_config(tiny_overrides(tmp_path, run__name="a", **over))
    t = start_trainer(cfg, corpus, torch_lm)
    try:
        rows = [t.outer_step(1)]
        t.checkpoint()
        real_begin = trainer_module.begin_checkpoint

        def blocked(run_dir, step):  # replica 1's rank 0 cannot write its file (a directory is in the way)
            tmp = real_begin(run_dir, step)
            (tmp / "worker-1-0.pt").mkdir()
            return tmp

        monkeypatch.setattr(trainer_module, "begin_checkpoint", blocked)
        with pytest.raises(CheckpointError, match="worker-1-0.pt: cannot be written"):
            t.checkpoint()

        def outer_blocked(run_dir, step):  # the outer side cannot write outer.pt: the same one writer
            tmp = real_begin(run_dir, step)
            (tmp / "outer.pt").mkdir()
            return tmp

        monkeypatch.setattr(trainer_module, "begin_checkpoint", outer_blocked)
        with pytest.raises(CheckpointError, match=r"step_000001: checkpoint file .*outer.pt: cannot be written"):
            t.checkpoint()
        monkeypatch.setattr(trainer_module, "begin_checkpoint", real_begin)
        assert [r.index for r in t.replicas] == [0, 1]  # the checkpoint failed, not the replica
        assert [p.name for p in (t.run_dir / "checkpoints").iterdir()] == ["step_000001"]  # no temporary left

        real_name = trainer_module.worker_file

        def unseen(replica, rank):  # replica 1's rank 1 is on a node that does not see the run directory
            return f"elsewhere/{real_name(replica, rank)}" if (replica, rank) == (1, 1) else real_name(replica, rank)

        monkeypatch.setattr(trainer_module, "worker_file", unseen)
        rows.append(t.outer_step(2))
        t.checkpoint()
        monkeypatch.setattr(trainer_module, "worker_file", real_name)
        rows.append(t.outer_step(3))
    finally:
        t.shutdown()
    assert "worker (1, 1) on node" in caplog.text  # a warning of the checkpoint's
    ckpts = dict(list_checkpoints(t.run_dir))
    first, second = ckpts[1], ckpts[2]
    names = sorted(p.name for p in first.iterdir())
    assert names == ["outer.pt", STATE_FILE, "worker-0-0.pt", "worker-0-1.pt", "worker-1-0.pt", "worker-1-1.pt"]
    raw = read_state_file(first / STATE_FILE)  # what the job's process wrote: names, no tensors
    assert raw["outer"]["file"] == "outer.pt" and raw["workers"][(1, 0)]["file"] == "worker-1-0.pt"
    assert raw["outer"]["bytes"] == (first / "outer.pt").stat().st_size
    assert read_state_file(first / "outer.pt")["checkpoint_id"] == raw["checkpoint_id"]
    assert raw["sizes"] == [f.numel for f in t.fragments]
    assert not any(isinstance(v, torch.Tensor) for v in _leaves(raw))
    assert (first / STATE_FILE).stat().st_size < (first / "outer.pt").stat().st_size / 4
    # rank 0 holds the replica's inner state; rank 1 only its position, RNG and syncs in flight
    assert "optimizer" in read_state_file(first / "worker-0-0.pt")
    assert "optimizer" not in read_state_file(first / "worker-0-1.pt")
    # the fallback: the hidden worker's state is inline in state.pt, the others are files
    raw2 = read_state_file(second / STATE_FILE)
    assert "file" not in raw2["workers"][(1, 1)] and raw2["workers"][(1, 1)]["rank"] == 1
    assert not (second / "worker-1-1.pt").exists() and (second / "worker-1-0.pt").is_file()
    # an eager load (offline eval, export) reads every file; the same values as the files
    eager = load_checkpoint(first)
    np.testing.assert_array_equal(eager["outer"]["global"][0], read_state_file(first / "outer.pt")["global"][0])
    assert isinstance(eager["workers"][(0, 0)]["local"][0], np.ndarray)

    # resume from checkpoint 1, each process reading its own file
    lazy = load_checkpoint(first, lazy=True)
    assert lazy["outer"]["file"] == str(first / "outer.pt")
    def resumed(name, state, k):  # outer step k of a new run started from ``state``
        t2 = start_trainer(load_config(tiny_overrides(tmp_path, run__name=name, **over)), corpus, torch_lm, state)
        try:
            return t2.outer_step(k)
        finally:
            t2.shutdown()

    again = resumed("b", lazy, 2)
    for key in KEYS:
        assert again[key] == rows[1][key], key

    # resume from checkpoint 2 (one state inline) where no worker nor the driver can see the files:
    # relative paths, valid in this process's directory only (Ray's workers run elsewhere)
    monkeypatch.chdir(second)
    lazy2 = load_checkpoint(second, lazy=True)
    lazy2["outer"] = {"file": "outer.pt"}
    lazy2["workers"] = {k: ({"file": f"worker-{k[0]}-{k[1]}.pt"} if "file" in w else w)
                        for k, w in lazy2["workers"].items()}
    again3 = resumed("c", lazy2, 3)
    for key in KEYS:
        assert again3[key] == rows[2][key], key


def _leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


def test_the_driver_writes_the_exported_weights_in_the_runs_precision(ray_session, tmp_path, corpus, monkeypatch):
    """A bf16 run's ``final/`` is bf16 safetensors written by the outer-optimiser driver (the job's
    process may not write weights: it would fail here), equal to the bf16 rounding of the last
    checkpoint's global parameters, and loads with ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    from ray_diloco.components import export
    from ray_diloco.components.checkpoint import global_params, latest_checkpoint
    from ray_diloco.core.fragments import param_specs, plan_fragments
    from ray_diloco.runtime.launcher import train

    def not_here(*a, **k):
        raise AssertionError("the job's process wrote the exported weights")

    monkeypatch.setattr(export, "write_hf_weights", not_here)
    cfg = tiny_overrides(tmp_path, run__precision="bf16", run__steps=10, model__family="qwen3", run__name="bf16")
    summary = train(cfg, corpus=corpus)
    run_dir = tmp_path / "runs" / "bf16"
    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "final"))
    assert model.dtype == torch.bfloat16 and summary["inner_steps"] == 10
    params = global_params(load_checkpoint(latest_checkpoint(run_dir)[1]))
    (frag,) = plan_fragments(param_specs(model), 1)
    named, off = dict(model.named_parameters()), 0
    for p in frag.params:
        want = torch.from_numpy(params[0][off:off + p.numel]).to(torch.bfloat16).view(p.shape)
        assert torch.equal(named[p.name].detach(), want), p.name
        off += p.numel
