"""Streaming DiLoCo (algorithms.md section 2): fragments, the sync schedule, the wire protocol,
and exact numerics of overlapped, quantised syncs on a real local Ray."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import run_cli, start_trainer, tiny_overrides, torch_lm

from ray_diloco.config import load_config, num_fragments
from ray_diloco.errors import ConfigError
from ray_diloco.core.wire import Downlink, apply_downlink, dp_equivalent_bytes
from ray_diloco.core.fragments import block_index, param_specs, plan_fragments
from ray_diloco.models.transformer import build_transformers_model, resolve_model_shape
from ray_diloco.core.outer import OuterOptimizer
from ray_diloco.core.quantize import FORMATS, from_message, message_nbytes, quantize_message, to_message
from ray_diloco.core.schedules import SyncSchedule, outer_step_bounds

# ---------------------------------------------------------------------------------------
# fragments


def _specs(preset: str, **shape):
    cfg = load_config({"model": {"preset": preset, **shape}})
    s = resolve_model_shape(cfg.model, 97)
    with torch.device("meta"):
        return param_specs(build_transformers_model(s, 97))


EMBEDDINGS = {"tiny": {"transformer.wte.weight", "transformer.wpe.weight"},  # gpt2: token + learned positions
              "cpu-small": {"model.embed_tokens.weight"}, "1.3b": {"model.embed_tokens.weight"}}  # llama, qwen3: RoPE


@pytest.mark.parametrize("preset", ["tiny", "cpu-small", "1.3b"])
@pytest.mark.parametrize("pattern", ["strided", "sequential"])
def test_every_parameter_in_exactly_one_fragment(preset, pattern):
    specs = _specs(preset)
    layers = max(block_index(s.name) for s in specs if block_index(s.name) is not None) + 1
    for P in range(1, layers + 1):
        frags = plan_fragments(specs, P, pattern)
        names = [n for f in frags for n in f.names]
        assert sorted(names) == sorted(s.name for s in specs) and len(names) == len(set(names))
        assert [f.index for f in frags] == list(range(len(frags)))
        assert len(frags) == num_fragments(P)
        if P == 1:
            continue
        # embeddings first, final norm + LM head last, each alone; blocks never split
        assert {block_index(n) for n in frags[0].names} == {None} == {block_index(n) for n in frags[-1].names}
        tied = not any("lm_head" in s.name for s in specs)  # the scaling-law presets tie the LM head to the embeddings
        assert set(frags[0].names) == EMBEDDINGS[preset] and (tied or any("lm_head" in n for n in frags[-1].names))
        groups = [sorted({block_index(n) for n in f.names}) for f in frags[1:-1]]
        assert sorted(b for g in groups for b in g) == list(range(layers))
        if pattern == "strided":
            assert groups == [list(range(j, layers, P)) for j in range(P)]
        else:
            assert all(g == list(range(g[0], g[-1] + 1)) for g in groups)
            assert max(map(len, groups)) - min(map(len, groups)) <= 1


def test_too_many_fragments_is_a_clear_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"streaming.fragments = 5: must be <= model.n_layers = 4"):
        load_config({"streaming": {"fragments": 5}})
    with pytest.raises(ConfigError, match=r"set either it or streaming.fragments"):
        load_config({"streaming": {"fragments": 2, "layers_per_fragment": 2}})
    assert load_config({"streaming": {"layers_per_fragment": 3}}).block_fragments == 2  # ceil(4 / 3)


# ---------------------------------------------------------------------------------------
# schedule


@pytest.mark.parametrize("H, F, tau, T", [(50, 1, 0, 2000), (6, 2, 1, 20), (100, 6, 5, 1000), (7, 3, 1, 23),
                                          (10, 4, 2, 9), (50, 4, 12, 130)])
def test_schedule_every_fragment_every_H_steps(H, F, tau, T):
    s = SyncSchedule(H, F, tau, T)
    sends = s.sends_between(0, T)
    assert sends == sorted(sends)
    # pieces of the run enumerate the same sends (the trainer asks per outer step)
    assert [x for k in range(1, -(-T // H) + 1) for x in s.sends_between(*outer_step_bounds(k, H, T))] == sends
    offsets = [s.offset(f) for f in range(F)]
    assert offsets == sorted(set(offsets)) and offsets[0] == 0 and offsets[-1] < H
    assert max(np.diff(offsets + [H])) - min(np.diff(offsets + [H])) <= 1  # spread evenly
    for f in range(F):
        steps = [t for t, g in sends if g == f]
        regular = [t for t in steps if (t - offsets[f]) % H == 0]
        assert all(b - a == H for a, b in zip(regular, regular[1:]))
        assert regular == [t for t in range(1, T + 1) if (t - offsets[f]) % H == 0]
        # the run closes: a fragment's last merge is at T, or its last send was within tau of T
        last = steps[-1] if steps else 0
        assert last == T or T - tau <= last, (f, steps)
        assert all(s.apply_step(t) == min(t + tau, T) for t in steps)
        # merges land before the fragment sends again
        assert all(s.apply_step(a) <= b for a, b in zip(steps, steps[1:]))


def test_closing_round_variants():
    avg, outer, none = (SyncSchedule(6, 2, 1, 20, c) for c in ("average", "outer", "none"))
    assert avg.sends_between(0, 20) == outer.sends_between(0, 20) == none.sends_between(0, 20) + [(20, 0), (20, 1)]
    assert [avg.averages(f, 20) for f in (0, 1)] == [True, True] and not outer.averages(0, 20)
    assert not avg.averages(0, 18) and not none.is_closing(0, 20)
    # a fragment whose last send is within tau of T only merges early: no closing round for it
    s = SyncSchedule(6, 2, 2, 17, "average")
    assert s.sends_between(11, 17) == [(12, 0), (15, 1), (17, 0)]


def test_schedule_with_one_fragment_is_diloco():
    for H, T in [(50, 2000), (5, 15), (4, 14)]:
        s = SyncSchedule(H, 1, 0, T)
        ends = [outer_step_bounds(k, H, T)[1] for k in range(1, -(-T // H) + 1)]
        assert [t for t, _ in s.sends_between(0, T)] == ends


def test_overlap_must_fit_between_fragment_syncs():
    with pytest.raises(ConfigError, match=r"streaming.overlap_steps = 13: must be < diloco.H / F = 50 / 4 = 12.5 "
                                          r"\(F = 4 fragments: 2 of blocks"):
        load_config({"streaming": {"fragments": 2, "overlap_steps": 13}})
    load_config({"streaming": {"fragments": 2, "overlap_steps": 12}})
    with pytest.raises(ConfigError, match=r"streaming.overlap_steps = 50: must be < diloco.H / F = 50 / 1 = 50 "
                                          r"\(F = 1 fragment;"):
        load_config({"streaming": {"overlap_steps": 50}})


# ---------------------------------------------------------------------------------------
# wire protocol


@pytest.mark.parametrize("fmt", FORMATS)
def test_message_round_trip_and_size(fmt):
    x = torch.randn(1001)
    msg, sent = quantize_message(x, fmt)
    assert len(msg) == message_nbytes(1001, fmt)
    p = from_message(msg)
    assert p.numel == 1001 and to_message(p) == msg
    with pytest.raises(ValueError):
        from_message(msg[:-1])
    with pytest.raises(ValueError):
        from_message(b"XXXX" + msg[4:])


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "int8", "fp4_e3m0"])
def test_quantised_downlink_keeps_driver_and_replicas_bitwise_identical(fmt):
    """The driver sets its global to old + dequant(q(u)) with the same function replicas use."""
    rng = np.random.default_rng(1)
    theta0 = rng.standard_normal(777).astype(np.float32)
    for ef in (False, True):
        cfg = load_config({"outer": {"lr": 0.7, "momentum": 0.9}}).outer
        driver, downlink = OuterOptimizer([theta0], cfg), Downlink(fmt, ef, 1)
        replicas = [torch.tensor(theta0) for _ in range(3)]
        for _ in range(4):
            deltas = [rng.standard_normal(777).astype(np.float32) * 0.01 for _ in range(2)]
            out = driver.step(0, [1.0, 1.0], *deltas)
            out["message"] = downlink.encode(driver, 0, out["before"])
            assert len(out["message"]) == message_nbytes(777, fmt) < 4 * 777
            replicas = [apply_downlink(r, out["message"]) for r in replicas]
            for r in replicas:
                assert torch.equal(r, driver.params[0])


def test_error_feedback_carries_the_residual():
    """With error feedback the sum of what was sent tracks the sum of the true values: the
    difference is exactly the last residual, bounded by one quantisation error."""
    rng = np.random.default_rng(2)
    residual, sent_total, true_total = None, torch.zeros(500), torch.zeros(500)
    for _ in range(20):
        x = torch.from_numpy(rng.standard_normal(500).astype(np.float32))
        _, sent = quantize_message(x, "fp4_e3m0", residual)
        residual = (x if residual is None else x + residual) - sent
        sent_total += sent
        true_total += x
    torch.testing.assert_close(true_total - sent_total, residual, rtol=0, atol=1e-4)
    assert float(residual.abs().max()) < 3 * float(true_total.abs().max()) / 20 + 4


def test_dp_equivalent_formula():
    assert dp_equivalent_bytes(1000, 10, 2, 4) == 2 * 1000 * 4 * 10 // 2
    assert dp_equivalent_bytes(1000, 10, 4, 2) == int(2 * 1000 * 3 / 4 * 2 * 10)
    assert dp_equivalent_bytes(1000, 10, 1, 4) == 0


# ---------------------------------------------------------------------------------------
# numerics on a real local Ray


class _UnitGrad(torch.autograd.Function):
    """Passes ``logits`` through; the gradient reaching ``s`` is exactly 1, whatever the data."""

    @staticmethod
    def forward(ctx, s, logits):
        return logits.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.ones(()), grad


class TwoBlocks(torch.nn.Module):
    """Two 'blocks' whose every parameter gets gradient exactly 1: with AdamW betas (0, 0), no
    weight decay, no clipping, eps far below one ulp of 1 and a constant lr, every inner step
    moves every parameter by exactly -lr (a known constant inner update)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(3, 5), torch.nn.Linear(4, 2)])

    def forward(self, input_ids):
        s = sum(p.sum() for p in self.parameters())
        return _UnitGrad.apply(s, torch.zeros(*input_ids.shape, self.vocab))


def two_blocks_fn(shape, vocab_size):
    return TwoBlocks(vocab_size)


@pytest.mark.parametrize("tau", [0, 1])
def test_streaming_numerics_exact(ray_session, tmp_path, corpus, tau):
    """2 replicas, 2 fragments, H=6, outer SGD lr 2 without momentum, tau in {0, 1}, alpha in
    {0, 0.5, 1}: at every sync new_global == old_global - 2*(old_global - local_at_send) and
    merged == alpha*local + (1 - alpha)*new_global, bitwise; every worker holds the same.
    With ``closing_round: outer`` the closing round at T is an outer step like the others; with
    ``average`` (the default) it is the replicas' mean: new_global == old - (old - local)."""
    import ray

    # alpha 0 and 1 are special cases in the merge, 0.5 the general formula: each is checked with
    # and without overlap across the two parametrisations
    runs = [(alpha, "outer") for alpha in ((0.0, 0.5) if tau == 0 else (0.5, 1.0))] + ([(0.5, "average")] if tau else [])
    for alpha, closing in runs:
        cfg = load_config(tiny_overrides(
            tmp_path, diloco__H=6, run__steps=18, run__trace_syncs=True, run__eval_every=0, run__checkpoint_every=0,
            streaming__fragments=2, streaming__overlap_steps=tau, streaming__alpha=alpha,
            streaming__closing_round=closing, outer__name="sgd", outer__lr=2.0, outer__momentum=0.0,
            inner__lr=2.0 ** -6, inner__beta1=0.0, inner__beta2=0.0, inner__eps=2.0 ** -30, inner__weight_decay=0.0,
            inner__warmup_steps=0, inner__min_lr_ratio=1.0, inner__grad_clip=0.0,
            run__name=f"n-{tau}-{alpha}-{closing}"))
        t = start_trainer(cfg, corpus, two_blocks_fn)
        try:
            assert t.num_fragments == 2
            for k in range(1, 4):
                t.outer_step(k)
            traces = ray.get([r.rank0.sync_trace.remote() for r in t.replicas])
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


def _core_diloco_reference(cfg_dict, train_tokens, vocab_size, rounds):
    """Plain DiLoCo (algorithms.md section 1) written out in one process, for comparison: each
    replica's AdamW loop on its own shard, the mean pseudo-gradient, torch's Nesterov SGD.
    Returns sha256 of the global parameters after each outer step."""
    import hashlib

    from ray_diloco.components.data import ShardReader
    from ray_diloco.models.transformer import lm_loss, logits_of
    from ray_diloco.models.transformer import build_model, make_inner_optimizer
    from ray_diloco.core.schedules import inner_lr

    torch.set_num_threads(1)
    cfg = load_config(cfg_dict, validate=False)
    M, i = cfg.diloco.replicas, cfg.inner
    models = [build_model(cfg, vocab_size) for _ in range(M)]
    opts = [make_inner_optimizer(m, cfg) for m in models]
    readers = [ShardReader(train_tokens, cfg.data.seq_len, m, M, cfg.run.seed) for m in range(M)]
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    theta = flat(models[0]).clone()
    outer = torch.optim.SGD([theta], lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=True)
    hashes = []
    for k in range(1, rounds + 1):
        start, end = outer_step_bounds(k, cfg.diloco.H, cfg.run.steps)
        for model, opt, reader in zip(models, opts, readers):
            for step in range(start, end):
                for g in opt.param_groups:
                    g["lr"] = inner_lr(step, i.lr, i.warmup_steps, cfg.run.steps, i.min_lr_ratio)
                x, y, _ = reader.next_batch(cfg.batch_per_worker)
                loss, _ = lm_loss(logits_of(model(x)), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), i.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
        mean = torch.zeros_like(theta)
        for model in models:
            mean.add_(theta - flat(model), alpha=1 / M)
        theta.grad = mean
        outer.step()
        with torch.no_grad():
            for model in models:
                off = 0
                for p in model.parameters():
                    p.copy_(theta[off:off + p.numel()].view_as(p))
                    off += p.numel()
        hashes.append(hashlib.sha256(theta.numpy().tobytes()).hexdigest())
    return hashes


def test_one_fragment_no_overlap_no_quantisation_is_core_diloco_bitwise(ray_session, tmp_path, corpus):
    """Streaming with P=1, tau=0, fp32 reproduces plain DiLoCo bit for bit (M=2, Nesterov)."""
    import ray

    cfg = load_config(tiny_overrides(tmp_path, run__log_hashes=True, run__eval_every=0, run__checkpoint_every=0,
                                     streaming__fragments=1, streaming__overlap_steps=0,
                                     streaming__quantization="none"))
    ref = ray.remote(num_cpus=1)(_core_diloco_reference).remote(cfg.to_dict(), corpus.train, corpus.vocab_size, 3)
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
        sizes = [message_nbytes(f.numel, "fp4_e3m0") for f in t.fragments]
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


def test_overlap_hides_the_emulated_link(ray_session, tmp_path, corpus):
    """With a 30 ms link each way, blocking syncs (tau=0) wait for it; with tau=8 the link
    thread's transfer runs while the inner loop trains, so the training thread barely waits."""
    waits = {}
    for tau in (0, 8):
        cfg = load_config(tiny_overrides(
            tmp_path, run__name=f"wan-{tau}", run__eval_every=0, run__checkpoint_every=0, diloco__H=10, run__steps=40,
            model__n_layers=4, model__d_model=128, model__d_ff=352, model__n_heads=4, model__context=64,
            data__seq_len=64, inner__global_batch=16, streaming__overlap_steps=tau, network__latency_ms=30.0))
        t = start_trainer(cfg, corpus, torch_lm)
        try:
            rows = [t.outer_step(k) for k in (1, 2, 3)]
        finally:
            t.shutdown()
        waits[tau] = sum(r["sync_wait_s"] for r in rows)  # syncs at 10, 20, 30 (not the closing one at 40)
    assert waits[0] > 3 * 0.06 * 0.9, waits  # three blocking syncs of >= 60 ms each
    assert waits[8] < 0.3 * waits[0], waits


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
    r = run_cli(["plan", str(cfg_file), "--json", str(out)], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "4 fragment(s)" in r.stdout and "blocks 0" in r.stdout and "next syncs" in r.stdout
    plan = json.loads(out.read_text())
    summary = ray_diloco.train(cfg)
    comm = summary["communication"]
    assert comm["bytes_up_per_replica"] == plan["bytes_up_per_replica"]
    assert comm["bytes_down_per_replica"] == plan["bytes_down_per_replica"]
    assert comm["peak_sync_bytes_per_replica"] == plan["peak_sync_bytes"]
    assert summary["fragments"] == plan["fragments"] == 4
    bad = run_cli(["plan", "--set", "streaming.overlap_steps=40", "--set", "streaming.fragments=2"], timeout=120)
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

    tree = lambda: sorted((str(p), p.stat().st_mtime_ns) for p in Path(first["run_dir"]).rglob("*"))  # noqa: E731
    before = tree()
    again = ray_diloco.train(resume=first["run_dir"], corpus=corpus, model_fn=torch_lm)  # finished: nothing to do
    assert again == json.loads((Path(first["run_dir"]) / "summary.json").read_text()) and tree() == before
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


def test_extending_a_run_that_ends_part_way_through_an_outer_step_is_refused(tmp_path):
    """Outer step k covers inner steps [(k-1)H, kH): a checkpoint at T = 14 with H = 8 cannot be
    continued to 30 without skipping or re-keying steps 14-15, so --resume refuses it with one
    line and leaves the run as it was; resuming it unchanged is still allowed."""
    from ray_diloco.components.checkpoint import save_checkpoint
    from ray_diloco.config import load_config
    from ray_diloco.errors import ConfigError
    from ray_diloco.runtime.launcher import prepare

    cfg = load_config(tiny_overrides(tmp_path, run__name="odd", run__steps=14, diloco__H=8))
    run_dir = tmp_path / "runs" / "odd"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    state = {"format": 1, "outer_step": 2, "config": cfg.to_dict(), "counters": {"inner_step": 14},
             "outer": None, "workers": {}, "corpus_fingerprint": ""}
    save_checkpoint(run_dir, 2, state, keep=1)
    before = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    with pytest.raises(ConfigError, match=r"run.steps = 30: the checkpoint ends at inner step 14, part way through "
                                          r"an outer step of diloco.H = 8 .* cannot be extended"):
        prepare(resume=run_dir, overrides=["run.steps=30"])
    assert sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before
    assert prepare(resume=run_dir)[2]["counters"]["inner_step"] == 14
