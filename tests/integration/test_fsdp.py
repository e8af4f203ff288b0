"""FSDP2 inside a replica (``diloco.sharding: fsdp``) on a real local Ray with gloo groups: each
rank holds and exchanges its own rows of every parameter (nothing gathered on one rank), and the
outer steps match DDP replicas within fp32 rounding; checkpoints resume bitwise; export joins the
rows into a model transformers loads."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import read_metrics, start_trainer, tiny_overrides

from ray_diloco.config import load_config


def _cfg(tmp_path, mode: str, **extra):
    extra.setdefault("run__name", mode)
    extra.setdefault("run__steps", 10)
    extra.setdefault("diloco__workers_per_replica", 2)
    return load_config(tiny_overrides(tmp_path, diloco__sharding=mode, run__deterministic=True, **extra))


def test_fsdp_run_checkpoints_resume_bitwise_matches_ddp_and_export_loads_in_transformers(
    ray_session, tmp_path, corpus, small_text
):
    """A whole FSDP run: its evaluation (ranks of a replica forward together, rank 0's windows
    counted) equals the offline evaluation of its checkpoint (rows joined) and of the exported model
    in transformers; resuming from its first checkpoint gives the second bitwise, each rank holding
    and sending its own rows; DDP replicas of the same config give the same outer steps within fp32
    rounding (one set of runs serves all of it)."""
    import json

    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from ray_diloco.components.checkpoint import global_params, list_checkpoints, load_checkpoint
    from ray_diloco.components.data import val_windows
    from ray_diloco.components.evaluate import evaluate_loss, evaluate_run
    from ray_diloco.runtime.launcher import train

    cfg = _cfg(tmp_path, "fsdp", run__eval_every=1, data__path=str(small_text),
               streaming__overlap_steps=1)  # an eval between steps, while local and global parameters differ
    summary = train(cfg)
    run_dir = tmp_path / "runs" / "fsdp"
    ckpt_loss, step, _ = evaluate_run(run_dir)
    assert step == 2 and ckpt_loss == pytest.approx(summary["final_eval_loss"], abs=1e-5)
    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "final"))
    total, count = evaluate_loss(model, corpus.val, 16, np.arange(val_windows(corpus.val, 16)), 256)
    assert total / count == pytest.approx(ckpt_loss, abs=1e-6)

    (_, first), (_, second) = list_checkpoints(run_dir)[:2]
    s1, s2 = load_checkpoint(first), load_checkpoint(second)
    assert s1["exchange_units"] == 2 and len(s1["outer"]["global"]) == 2  # one part per rank
    assert all(isinstance(v, torch.Tensor) and type(v) is torch.Tensor  # host tensors, no DTensor
               for w in s1["workers"].values() for st in w["optimizer"]["state"].values() for v in st.values())
    t = start_trainer(_cfg(tmp_path, "fsdp", run__eval_every=1, data__path=str(small_text), run__name="again",
                           streaming__overlap_steps=1),
                      corpus, resume_state=s1)
    try:
        t.outer_step(2)
        again = t.global_params()
        parts = ray.get([w.local_fragment.remote(0) for w in t.replicas[0].workers])  # each rank: half the rows
        assert sum(p.size for p in parts) == again[0].size and all(p.size < again[0].size for p in parts)
        units = ray.get(t.driver.global_params.remote())
        assert len(units) == 2 and [u.size for u in units] == [p.size for p in parts]
    finally:
        t.shutdown()
    for a, b in zip(global_params(s2), again):
        assert np.array_equal(a, b)

    t = start_trainer(_cfg(tmp_path, "ddp", run__eval_every=1, data__path=str(small_text), streaming__overlap_steps=1),
                      corpus)
    try:
        ddp_losses = [t.outer_step(k)["train_loss"] for k in (1, 2)]
        ddp = t.global_params()
    finally:
        t.shutdown()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_loss"] for r in rows if "outer_step" in r] == pytest.approx(ddp_losses, rel=1e-5)
    # fp32 rounding only: reduce-scatter and all-reduce sum in different orders, and AdamW
    # normalises small gradients, so near-zero values differ by a few 1e-6; the two outer steps
    # moved the parameters by ~1e-2
    for a, b in zip(ddp, again):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=2e-5)
        assert np.abs(b - a).max() < 1e-3 * np.abs(a).max()


def test_an_fsdp_joiner_takes_its_ranks_rows_and_peer_state(ray_session, tmp_path, corpus):
    """What a joining FSDP replica does (``ReplicaWorker.join``, as ``Membership.admit`` calls it):
    each rank loads its own rows of the global parameters (its pseudo-gradient is then zero) and the
    same rank's inner state of a live replica (host tensors made DTensors again), then trains on."""
    import ray
    import torch

    from ray_diloco.core.fragments import tensor_hash

    t = start_trainer(_cfg(tmp_path, "fsdp", run__steps=15), corpus)
    try:
        t.outer_step(1)
        t.settle()
        live, joiner = t.replicas
        refs = ray.get(t.driver.global_refs.remote())
        versions = ray.get(t.driver.global_versions.remote())
        peers = [w.inner_optimizer_state.remote() for w in live.workers]
        out = ray.get([w.join.remote(refs, versions, 5, None, [peers[rank]])
                       for rank, w in enumerate(joiner.workers)])
        for rank, (zero, source) in enumerate(out):
            n = ray.get(joiner.workers[rank].local_fragment.remote(0)).size
            assert source == "peer" and zero == tensor_hash([torch.zeros(n)])
            assert ray.get(joiner.workers[rank].global_hash.remote()) == ray.get(live.workers[rank].global_hash.remote())
        mine = ray.get(joiner.workers[1].inner_optimizer_state.remote())
        theirs = ray.get(peers[1])
        assert all(torch.equal(mine["state"][k]["exp_avg"], theirs["state"][k]["exp_avg"]) for k in theirs["state"])
        row = t.outer_step(2)
        assert np.isfinite(row["train_loss"]) and row["replicas_live"] == 2
    finally:
        t.shutdown()


def test_hsdp_2x2_matches_fsdp_and_ddp_resumes_bitwise_and_exports(ray_session, tmp_path, corpus, small_text):
    """``diloco.sharding: hsdp``, 2 replicas of 4 workers as 2 shard groups of 2 (FSDP2 on a 2-D
    mesh): ranks 0 and 2 hold the same rows, 1 and 3 the other half, and only the first group
    sends them (2 exchange units per fragment); DDP over 4 on the same seed gives
    the same outer steps within fp32 rounding (checked here against DDP, ``tests/integration/
    test_fsdp.py``'s first test checks FSDP against DDP); the first checkpoint resumes to the second bitwise;
    the export loads in transformers with the checkpoint's loss."""
    import ray
    from transformers import AutoModelForCausalLM

    from ray_diloco.components.checkpoint import global_params, list_checkpoints, load_checkpoint
    from ray_diloco.components.data import val_windows
    from ray_diloco.components.evaluate import evaluate_loss, evaluate_run
    from ray_diloco.runtime.launcher import train

    def cfg(mode, **extra):
        return _cfg(tmp_path, mode, diloco__workers_per_replica=4, diloco__cpus_per_worker=0.2,
                    inner__global_batch=16, data__path=str(small_text), **extra)

    summary = train(cfg("hsdp", diloco__shard_group_size=2, run__log_hashes=True, run__eval_every=2))
    run_dir = tmp_path / "runs" / "hsdp"
    rows = read_metrics(run_dir)
    for r in rows:  # per replica: rows of shard 0, shard 1, then their copies in the second group
        h = r["worker_params_sha256"]
        assert h[0] == h[2] == h[4] == h[6] != h[1] == h[3] == h[5] == h[7], r["outer_step"]
    (_, first), (_, second) = list_checkpoints(run_dir)[:2]
    s1, s2 = load_checkpoint(first), load_checkpoint(second)
    assert s1["exchange_units"] == 2 and len(s1["outer"]["global"]) == 2
    assert [("optimizer" in s1["workers"][(0, k)]) for k in range(4)] == [True, True, False, False]
    ckpt_loss, _, _ = evaluate_run(run_dir)
    assert ckpt_loss == pytest.approx(summary["final_eval_loss"], abs=1e-5)
    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "final"))
    total, count = evaluate_loss(model, corpus.val, 16, np.arange(val_windows(corpus.val, 16)), 256)
    assert total / count == pytest.approx(ckpt_loss, abs=1e-6)

    t = start_trainer(cfg("hsdp", diloco__shard_group_size=2, run__name="again"), corpus, resume_state=s1)
    try:
        t.outer_step(2)
        again = t.global_params()
        assert len(ray.get(t.driver.global_params.remote())) == 2
    finally:
        t.shutdown()
    for a, b in zip(global_params(s2), again):
        assert np.array_equal(a, b)
    t = start_trainer(cfg("ddp"), corpus)  # FSDP against DDP: the test above
    try:
        losses = [t.outer_step(k)["train_loss"] for k in (1, 2)]
        ddp = t.global_params()
    finally:
        t.shutdown()
    assert [r["train_loss"] for r in rows] == pytest.approx(losses, rel=1e-5)
    for a, b in zip(ddp, again):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=2e-5)
