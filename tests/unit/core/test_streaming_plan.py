"""Streaming DiLoCo's plan (arXiv 2501.18512 section 2): fragments of the real model families, the
sync schedule, the wire protocol and its byte formulas. No Ray."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import downlink_encode, outer_step, quantize_with_feedback

from ray_diloco.config import QUANTIZATION_FORMATS as FORMATS
from ray_diloco.config import load_config, num_fragments
from ray_diloco.core.formats import parse as from_message
from ray_diloco.core.formats import to_message, wire_format
from ray_diloco.core.fragments import block_index, param_specs, plan_fragments
from ray_diloco.core.outer import OuterOptimizer
from ray_diloco.core.quantize import decode, quantize_message
from ray_diloco.core.schedules import SyncSchedule, outer_step_bounds
from ray_diloco.core.wire import Downlink, apply_downlink, dp_equivalent_bytes
from ray_diloco.errors import ConfigError
from ray_diloco.models.transformer import build_transformers_model, resolve_model_shape

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
    assert len(msg) == wire_format(fmt).message_nbytes(1001)
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
        driver, downlink = OuterOptimizer([theta0], cfg), Downlink(fmt, ef)
        replicas = [torch.tensor(theta0) for _ in range(3)]
        for _ in range(4):
            deltas = [rng.standard_normal(777).astype(np.float32) * 0.01 for _ in range(2)]
            out = outer_step(driver, 0, [1.0, 1.0], *deltas)
            out["message"] = downlink_encode(downlink, driver, 0, out["before"])
            assert len(out["message"]) == wire_format(fmt).message_nbytes(777) < 4 * 777
            replicas = [apply_downlink(r, out["message"]) for r in replicas]
            for r in replicas:
                assert torch.equal(r, driver.fragments[0].param)


def test_error_feedback_carries_the_residual():
    """Error feedback (arXiv 2501.18512 section 2.3) as the replica's link encodes: what the
    receiver decodes from a sequence of fp4 messages sums to the true values up to the last
    residual (one quantisation error), while without feedback the error of every message adds up."""
    rng = np.random.default_rng(2)
    xs = [torch.from_numpy(rng.standard_normal(500).astype(np.float32)) for _ in range(50)]
    received = {}
    for feedback in (True, False):
        residual, total = None, torch.zeros(500)
        for x in xs:
            message, new_residual = quantize_with_feedback(x, "fp4_e3m0", residual)
            total += torch.from_numpy(decode(from_message(message)))  # what the receiver adds up
            residual = new_residual if feedback else None
        received[feedback] = (total, new_residual)
    true_total = torch.stack(xs).sum(0)
    (with_ef, last_residual), (without_ef, _) = received[True], received[False]
    # the difference is exactly what is still owed: the last residual, not a sum of 50 errors
    torch.testing.assert_close(true_total - with_ef, last_residual, rtol=0, atol=1e-4)
    one_error = float((xs[-1] - torch.from_numpy(decode(from_message(quantize_with_feedback(xs[-1], "fp4_e3m0", None)[0]))))
                      .norm())
    assert float(last_residual.norm()) < 2 * one_error
    assert float((true_total - with_ef).norm()) < 0.3 * float((true_total - without_ef).norm())


def test_dp_equivalent_formula():
    assert dp_equivalent_bytes(1000, 10, 2, 4) == 2 * 1000 * 4 * 10 // 2
    assert dp_equivalent_bytes(1000, 10, 4, 2) == int(2 * 1000 * 3 / 4 * 2 * 10)
    assert dp_equivalent_bytes(1000, 10, 1, 4) == 0


