"""Streaming DiLoCo (arXiv 2501.18512, section 2): fragments, the sync schedule, the wire protocol,
and exact numerics of overlapped, quantised syncs on a real local Ray."""

from __future__ import annotations

import json

import numpy as np
import torch
from helpers import (
    core_diloco_reference,
    record_syncs,
    run_main,
    start_trainer,
    sync_records,
    tiny_overrides,
    torch_lm,
    tree,
    two_blocks_fn,
)

from ray_diloco.config import load_config
from ray_diloco.core.formats import wire_format
from ray_diloco.core.schedules import outer_step_bounds
from ray_diloco.core.wire import dp_equivalent_bytes

# ---------------------------------------------------------------------------------------
# numerics on a real local Ray


def test_streaming_numerics_exact(ray_session, tmp_path, corpus):
    """2 replicas, 2 fragments, H=6, outer SGD lr 2 without momentum, tau = 1, alpha = 0.5, on
    real Ray actors: at every sync new_global == old_global - 2*(old_global - local_at_send) and
    merged == alpha*local + (1 - alpha)*new_global, bitwise; every worker holds the same. The
    closing round at T (``closing_round: average``, the default) is the replicas' mean:
    new_global == old - (old - local). One run of the general case: the merge's special cases
    (alpha 0 and 1, no overlap) and ``closing_round: outer`` are checked bit for bit against the
    outer optimiser through the in-memory transport (tests/unit/core/test_sync.py)."""
    import ray

    tau = 1
    alpha, closing = 0.5, "average"
    cfg = load_config(tiny_overrides(
        tmp_path, diloco__H=6, run__steps=18, run__eval_every=0, run__checkpoint_every=0,
        streaming__fragments=2, streaming__overlap_steps=tau, streaming__alpha=alpha,
        streaming__closing_round=closing, outer__name="sgd", outer__lr=2.0, outer__momentum=0.0,
        inner__lr=2.0 ** -6, inner__beta1=0.0, inner__beta2=0.0, inner__eps=2.0 ** -30, inner__weight_decay=0.0,
        inner__warmup_steps=0, inner__min_lr_ratio=1.0, inner__grad_clip=0.0,
        run__name=f"n-{tau}-{alpha}-{closing}"))
    t = start_trainer(cfg, corpus, two_blocks_fn)
    try:
        assert t.num_fragments == 2
        record_syncs([r.rank0 for r in t.replicas])
        for k in range(1, 4):
            t.outer_step(k)
        traces = sync_records([r.rank0 for r in t.replicas])
        assert traces[0] and len(traces[0]) == len(traces[1])
        assert [(r["send_step"], r["fragment"]) for r in traces[0]] == t.schedule.sends_between(0, 18)
        assert sum(t.schedule.is_closing(r["fragment"], r["send_step"]) for r in traces[0]) == 1
        step = 2.0 ** -6  # the known inner update: AdamW with betas 0 and unit gradients moves by lr
        for a, b in zip(*traces):
            for key in ("old_global", "local_at_send", "new_global", "local_before_merge", "merged"):
                assert torch.equal(a[key], b[key]), key  # replicas agree bitwise
            old, local = a["old_global"], a["local_at_send"]
            if closing == "average" and t.schedule.is_closing(a["fragment"], a["send_step"]):
                assert torch.equal(a["new_global"], old - (old - local))
            else:
                assert torch.equal(a["new_global"], old - 2 * (old - local))
            merge_local = a["local_before_merge"]
            assert torch.equal(a["merged"], alpha * merge_local + (1 - alpha) * a["new_global"])
            assert a["apply_step"] == min(a["send_step"] + tau, 18)
            n = a["apply_step"] - a["send_step"]
            torch.testing.assert_close(merge_local, local - n * step, rtol=0, atol=1e-6)
        final = ray.get(t.driver.global_params.remote())
        for f in (0, 1):
            last = [r for r in traces[0] if r["fragment"] == f][-1]
            assert last["send_step"] == 18 and np.array_equal(final[f], last["new_global"].numpy())
    finally:
        t.shutdown()


def test_one_fragment_no_overlap_no_quantisation_is_core_diloco_bitwise(ray_session, tmp_path, corpus):
    """Streaming with P=1, tau=0, fp32 reproduces plain DiLoCo bit for bit (M=2, Nesterov)."""
    import ray

    cfg = load_config(tiny_overrides(tmp_path, run__log_hashes=True, run__eval_every=0, run__checkpoint_every=0,
                                     streaming__fragments=1, streaming__overlap_steps=0,
                                     streaming__quantization="none"))
    ref = ray.remote(num_cpus=1)(core_diloco_reference).remote(cfg.to_dict(), corpus.train, corpus.vocab_size, 3)
    t = start_trainer(cfg, corpus, None)  # the transformers preset, as the reference builds it
    try:
        ours = [t.outer_step(k)["global_sha256"] for k in (1, 2, 3)]
    finally:
        t.shutdown()
    assert ours == ray.get(ref)


def test_fp4_streaming_keeps_every_replica_bitwise_on_the_driver(ray_session, tmp_path, corpus):
    """Quantised both ways with error feedback: after every outer step every worker's global
    parameters hash equal to the driver's; bytes match the plan's message sizes."""
    import ray

    cfg = load_config(tiny_overrides(tmp_path, run__log_hashes=True, run__eval_every=0, run__checkpoint_every=0,
                                     diloco__H=4, run__steps=12, streaming__fragments=2,
                                     streaming__quantization="fp4_e3m0", streaming__error_feedback=True))
    t = start_trainer(cfg, corpus, torch_lm)
    try:
        sizes = [wire_format("fp4_e3m0").message_nbytes(f.numel) for f in t.fragments]
        for k in (1, 2, 3):
            row = t.outer_step(k)
            assert set(row["worker_global_sha256"]) == {row["global_sha256"]}
            start, end = outer_step_bounds(k, 4, 12)
            expected = sum(sizes[f] for _, f in t.schedule.sends_between(start, end))
            assert row["bytes_sent"] == row["bytes_received"] == 2 * expected
        assert row["peak_sync_bytes"] == 2 * max(sizes) < 4 * t.num_params / 4
        residuals = ray.get(t.replicas[0].rank0.state_dict.remote())["residuals"]
        assert set(residuals) == set(range(len(t.fragments))) and all(np.abs(r).max() > 0 for r in residuals.values())
    finally:
        t.shutdown()


def test_streaming_resume_is_exact(ray_session, tmp_path, corpus):
    """tau=1 (a sync in flight at every checkpoint), fp4 + error feedback: resuming from the
    checkpoint after outer step 2 gives the same outer step 3 as the uninterrupted run."""
    from ray_diloco.components.checkpoint import list_checkpoints, load_checkpoint

    over = dict(run__log_hashes=True, run__deterministic=True, run__eval_every=0, run__checkpoint_every=1,
                diloco__H=8, run__steps=24, streaming__fragments=2, streaming__overlap_steps=1,
                streaming__quantization="fp4_e3m0", streaming__error_feedback=True)
    cfg = load_config(tiny_overrides(tmp_path, run__name="a", **over))
    t = start_trainer(cfg, corpus, torch_lm)
    try:
        rows = []
        for k in (1, 2, 3):
            rows.append(t.outer_step(k))
            t.checkpoint()
    finally:
        t.shutdown()
    ckpt = dict(list_checkpoints(t.run_dir))[2]
    state = load_checkpoint(ckpt / "state.pt")
    assert any(w["pending"] for w in state["workers"].values())  # fragment 0 was in flight
    cfg_b = load_config(tiny_overrides(tmp_path, run__name="b", **over))
    t2 = start_trainer(cfg_b, corpus, torch_lm, state)
    try:
        again = t2.outer_step(3)
    finally:
        t2.shutdown()
    for key in ("global_sha256", "outer_state_sha256", "worker_global_sha256", "data_digest", "train_loss",
                "bytes_sent", "bytes_received", "bytes_sent_total", "peak_sync_bytes", "sync_bytes_fragment"):
        assert again[key] == rows[2][key], key


def test_dp_under_emulation_counts_ring_allreduce_bytes(ray_session, tmp_path, corpus):
    """algorithm=dp with an emulated link: the bytes the DDP comm hook counts per step equal the
    ring all-reduce formula 2 N (R-1)/R x 4 for N fp32 gradients, R=2."""
    cfg = load_config(tiny_overrides(tmp_path, algorithm="dp", run__eval_every=0, run__checkpoint_every=0,
                                     run__steps=5, network__bandwidth_gbps=10.0))
    t = start_trainer(cfg, corpus, torch_lm)
    try:
        row = t.outer_step(1)
    finally:
        t.shutdown()
    assert row["bytes_sent"] == row["bytes_received"] == 2 * dp_equivalent_bytes(t.num_params, 5, 2, 4)


def test_plan_command_matches_what_a_run_exchanges(ray_session, tmp_path, small_text):
    """`ray-diloco plan` predicts the bytes a real run counts."""
    import ray_diloco

    over = ["streaming.fragments=2", "streaming.overlap_steps=1", "streaming.quantization=int8",
            "run.steps=14", "diloco.H=6", f"data.path={small_text}"]
    cfg_file = tmp_path / "c.yaml"
    cfg = load_config(tiny_overrides(tmp_path), over)
    cfg_file.write_text(cfg.to_yaml())
    out = tmp_path / "plan.json"
    r = run_main(["plan", str(cfg_file), "--json", str(out)])
    assert r.returncode == 0, r.stderr
    assert "4 fragment(s)" in r.stdout and "blocks 0" in r.stdout and "next syncs" in r.stdout
    plan = json.loads(out.read_text())
    summary = ray_diloco.train(cfg)
    comm = summary["communication"]
    assert comm["bytes_up_per_replica"] == plan["bytes_up_per_replica"]
    assert comm["bytes_down_per_replica"] == plan["bytes_down_per_replica"]
    assert comm["peak_sync_bytes_per_replica"] == plan["peak_sync_bytes"]
    assert summary["fragments"] == plan["fragments"] == 4
    bad = run_main(["plan", "--set", "streaming.overlap_steps=40", "--set", "streaming.fragments=2"])
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "streaming.overlap_steps = 40" in bad.stderr


def test_a_finished_streaming_run_can_be_extended(ray_session, tmp_path, corpus):
    """Rounds are keyed by send step, so the closing round at T does not collide with the
    extended schedule: resuming the final checkpoint with more steps trains on."""
    import ray_diloco
    from ray_diloco.components.checkpoint import latest_checkpoint
    from ray_diloco.runtime.launcher import prepare

    over = tiny_overrides(tmp_path, run__name="ext", run__steps=16, diloco__H=8, run__eval_every=0,
                          run__checkpoint_every=0, streaming__fragments=2, streaming__overlap_steps=1,
                          streaming__quantization="int8", tracking__wandb=False)
    first = ray_diloco.train(over, corpus=corpus, model_fn=torch_lm)
    assert first["inner_steps"] == 16
    from pathlib import Path

    before = tree(first["run_dir"])
    again = ray_diloco.train(resume=first["run_dir"], corpus=corpus, model_fn=torch_lm)  # finished: nothing to do
    assert again == json.loads((Path(first["run_dir"]) / "summary.json").read_text()) and tree(first["run_dir"]) == before
    # fragment 1 (phase 4) last sent at 12 and merged at 13 < T, so it closed with a send at 16; its
    # next regular send is at 20 in the extended schedule
    more = ray_diloco.train(resume=first["run_dir"], overrides=["run.steps=32"], corpus=corpus, model_fn=torch_lm)
    assert more["inner_steps"] == 32 and more["outer_steps"] == 4 and np.isfinite(more["final_eval_loss"])
    assert more["communication"]["bytes_up_per_replica"] > first["communication"]["bytes_up_per_replica"]
    step, _ = latest_checkpoint(first["run_dir"])
    assert step == 4 and prepare(resume=first["run_dir"])[2]["counters"]["inner_step"] == 32
    # an extension killed after its last checkpoint leaves the earlier summary: the resume redoes the end
    (Path(first["run_dir"]) / "summary.json").write_text(json.dumps(first))
    redone = ray_diloco.train(resume=first["run_dir"], corpus=corpus, model_fn=torch_lm)
    assert redone["inner_steps"] == 32 and redone["final_eval_loss"] == more["final_eval_loss"]
    assert json.loads((Path(first["run_dir"]) / "summary.json").read_text())["inner_steps"] == 32
