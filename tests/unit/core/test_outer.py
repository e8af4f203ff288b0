"""Outer-step numerics (DiLoCo Algorithm 1, lines 8-12) on given pseudo-gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_diloco.config import OuterConfig
from ray_diloco.core.outer import OuterOptimizer, average_pseudo_gradients


def _deltas(seed, n, m):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(m)]


def test_nesterov_matches_torch_sgd_over_three_steps():
    """The driver's update equals torch.optim.SGD(nesterov=True), momentum carried across steps."""
    theta0 = np.random.default_rng(0).standard_normal(37).astype(np.float32)
    outer = OuterOptimizer([theta0], OuterConfig(name="nesterov", lr=0.7, momentum=0.9))
    ref = torch.tensor(theta0.copy())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    buf = np.zeros(37, np.float64)
    manual = theta0.astype(np.float64)
    for step in range(3):
        ds = _deltas(step + 1, 37, 3)
        outer.step(0, [1.0, 1.0, 1.0], *ds)
        ref.grad = torch.tensor(np.mean(np.stack(ds).astype(np.float64), 0).astype(np.float32))
        sgd.step()
        mean = np.mean(np.stack(ds).astype(np.float64), 0)
        buf = 0.9 * buf + mean
        manual = manual - 0.7 * (mean + 0.9 * buf)
        np.testing.assert_allclose(outer.params[0].numpy(), ref.numpy(), rtol=0, atol=1e-6)
        np.testing.assert_allclose(outer.params[0].numpy(), manual, rtol=0, atol=1e-5)
    mom = outer.opts[0].state[outer.params[0]]["momentum_buffer"].numpy()
    np.testing.assert_allclose(mom, sgd.state[ref]["momentum_buffer"].numpy(), rtol=0, atol=1e-6)


def test_sign_identity_and_midpoint():
    """lr 1, mu 0 lands on the local parameters; lr 0.5 on the midpoint of global and local."""
    theta = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    local = np.array([0.5, -1.0, 0.25, 2.5], np.float32)
    one = OuterOptimizer([theta], OuterConfig(name="sgd", lr=1.0, momentum=0.0))
    one.step(0, [1.0], theta - local)
    assert np.array_equal(one.params[0].numpy(), local)
    half = OuterOptimizer([theta], OuterConfig(name="sgd", lr=0.5, momentum=0.0))
    half.step(0, [1.0], theta - local)
    assert np.array_equal(half.params[0].numpy(), (theta + local) / 2)


def test_weighted_mean_by_tokens():
    a, b = np.ones(5, np.float32), 4 * np.ones(5, np.float32)
    assert np.allclose(average_pseudo_gradients([a, b], [3.0, 1.0]).numpy(), 1.75)
    with pytest.raises(ValueError):
        average_pseudo_gradients([a, np.ones(4, np.float32)], [1, 1])


def test_state_dict_round_trip_continues_identically():
    theta0 = np.arange(10, dtype=np.float32)
    a = OuterOptimizer([theta0], OuterConfig())
    a.step(0, [1.0, 1.0], *_deltas(1, 10, 2))
    b = OuterOptimizer([np.zeros(10, np.float32)], OuterConfig())
    b.load_state_dict(a.state_dict())
    ds = _deltas(2, 10, 2)
    a.step(0, [1.0, 1.0], *ds)
    b.step(0, [1.0, 1.0], *ds)
    assert a.state_hash() == b.state_hash()


@pytest.mark.parametrize("fmt", ["none", "int8", "fp4_e3m0"])
def test_the_step_is_maths_only_and_the_wire_encodes_the_downlink(fmt):
    """``step`` returns no message; the driver's sequence (step, ``wire.encode_downlink`` with the
    downlink residual, ``set_global``) leaves the optimiser on exactly what a receiver computes
    with ``apply_downlink``, and equals ``wire.Downlink`` (what the driver calls), over steps with
    error feedback."""
    from ray_diloco.core.wire import Downlink, apply_downlink, encode_downlink

    theta0 = np.random.default_rng(3).standard_normal(600).astype(np.float32)
    maths, one_call = OuterOptimizer([theta0], OuterConfig()), OuterOptimizer([theta0], OuterConfig())
    downlink = Downlink(fmt, True, 1)
    held, residual = torch.tensor(theta0), None
    for k in range(3):
        ds = _deltas(20 + k, 600, 2)
        out = maths.step(0, [1.0, 2.0], *ds)
        assert "message" not in out and torch.equal(out["before"], held)
        message, applied, residual = encode_downlink(out["before"], maths.params[0], fmt, residual)
        maths.set_global(0, applied)
        held = apply_downlink(held, message)
        ref = one_call.step(0, [1.0, 2.0], *ds)
        ref["message"] = downlink.encode(one_call, 0, ref["before"])
        ref["update_norm"] = float((one_call.params[0] - ref["before"]).norm())
        assert ref["message"] == message and torch.equal(maths.params[0], held)
        assert torch.equal(one_call.params[0], held) and ref["update_norm"] == float((held - out["before"]).norm())
    assert maths.state_hash() == one_call.state_hash()


@pytest.mark.parametrize("fmt", ["none", "fp4_e3m0"])
def test_driver_completes_a_round_once_every_replica_sent(ray_session, fmt):
    """Two replicas' wire messages reach the driver actor through the object store; the round
    completes once both are in, both get the same reply, and the driver's global parameters
    equal a local OuterOptimizer's (the quantised downlink applied exactly as replicas do). With
    fp4 the driver starts without global parameters and gets them later, as the trainer does it
    (its process starts while the replicas start); they can be given only once."""
    from ray_diloco.config import load_config
    from ray_diloco.runtime.driver import OuterDriverActor
    from ray_diloco.core.wire import Downlink, apply_downlink, message_values
    from ray_diloco.core.quantize import quantize_message
    from ray_diloco.runtime.link import resolve_reply

    ray = ray_session
    cfg = load_config({"streaming": {"quantization": fmt}})
    theta0 = np.random.default_rng(5).standard_normal(1001).astype(np.float32)
    if fmt == "none":
        driver = OuterDriverActor.remote([theta0], cfg.to_dict())
    else:
        driver = OuterDriverActor.remote(None, cfg.to_dict())
        ray.get(driver.init_global.remote([theta0]))
    with pytest.raises(RuntimeError, match="global parameters are already set"):
        ray.get(driver.init_global.remote([theta0 + 1]))
    local, downlink = OuterOptimizer([theta0], cfg.outer), Downlink(fmt, False, 1)
    held = torch.tensor(theta0)  # what a replica holds
    for k in (1, 2, 3):
        ds = _deltas(10 + k, 1001, 2)
        msgs = [quantize_message(torch.from_numpy(d), fmt)[0] for d in ds]
        first = driver.exchange.remote(0, k, 0, 1.0, msgs[0], k - 1)
        ready, _ = ray.wait([first], timeout=0.5)
        assert not ready  # the round waits for the second replica
        replies = ray.get([first, driver.exchange.remote(0, k, 1, 1.0, msgs[1], k - 1)])
        assert replies[0] == replies[1] and replies[0].status == "ok" and replies[0].version == k
        assert isinstance(replies[0].message, ray.ObjectRef)  # one object for every receiver
        reply = resolve_reply(replies[0])
        out = local.step(0, [1.0, 1.0], *[quantize_message(torch.from_numpy(d), fmt)[1].numpy() for d in ds])
        out["message"] = downlink.encode(local, 0, out["before"])
        fmt_got, values = message_values(reply.message)
        assert fmt_got == fmt and np.array_equal(values, message_values(out["message"])[1]) and not reply.resync
        assert reply.nbytes == len(out["message"])
        held = apply_downlink(held, reply.message)
        (glob,) = ray.get(driver.global_params.remote())
        assert np.array_equal(glob, local.params[0].numpy()) and np.array_equal(glob, held.numpy())
    assert ray.get(driver.state_hash.remote()) == local.state_hash()
    assert ray.get(driver.pending_rounds.remote()) == 0  # no round left open
    late = ray.get(driver.exchange.remote(0, 3, 0, 1.0, msgs[0], 2))  # the newest completed round
    assert late.status == "ok" and late.version == 3  # its own reply again (replica 0 was in it)
    old = ray.get(driver.exchange.remote(0, 2, 0, 1.0, msgs[0], 1))  # forgotten (one kept per fragment)
    assert old.status == "dropped" and old.resync and old.version == 3
    stale = ray.get(driver.exchange.remote(0, 1, 0, 1.0, msgs[0], 2))  # a version not the round's base: resync
    assert stale.resync and stale.version == 3
    for bad in [(5, 9, 0, 1.0, msgs[0]),  # no such fragment
                (0, 9, 7, 1.0, msgs[0]),  # no such replica
                (0, 9, 0, 1.0, b"junk")]:  # not a wire message
        with pytest.raises(ray.exceptions.RayTaskError, match="ValueError"):
            ray.get(driver.exchange.remote(*bad))
    ray.kill(driver)
