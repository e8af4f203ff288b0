"""Outer-step numerics (DiLoCo Algorithm 1, lines 8-12) on given pseudo-gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import average_pseudo_gradients, downlink_encode, encode_downlink, outer_step, pseudo_gradients

from ray_diloco.config import OuterConfig
from ray_diloco.core.outer import OuterOptimizer


def test_nesterov_matches_torch_sgd_over_three_steps():
    """The driver's update equals torch.optim.SGD(nesterov=True), momentum carried across steps."""
    theta0 = np.random.default_rng(0).standard_normal(37).astype(np.float32)
    outer = OuterOptimizer([theta0], OuterConfig(name="nesterov", lr=0.7, momentum=0.9))
    ref = torch.tensor(theta0.copy())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    buf = np.zeros(37, np.float64)
    manual = theta0.astype(np.float64)
    for step in range(3):
        ds = pseudo_gradients(step + 1, 37, 3)
        outer_step(outer, 0, [1.0, 1.0, 1.0], *ds)
        ref.grad = torch.tensor(np.mean(np.stack(ds).astype(np.float64), 0).astype(np.float32))
        sgd.step()
        mean = np.mean(np.stack(ds).astype(np.float64), 0)
        buf = 0.9 * buf + mean
        manual = manual - 0.7 * (mean + 0.9 * buf)
        np.testing.assert_allclose(outer.fragments[0].param.numpy(), ref.numpy(), rtol=0, atol=1e-6)
        np.testing.assert_allclose(outer.fragments[0].param.numpy(), manual, rtol=0, atol=1e-5)
    mom = outer.fragments[0].opt.state[outer.fragments[0].param]["momentum_buffer"].numpy()
    np.testing.assert_allclose(mom, sgd.state[ref]["momentum_buffer"].numpy(), rtol=0, atol=1e-6)


def test_sign_identity_and_midpoint():
    """lr 1, mu 0 lands on the local parameters; lr 0.5 on the midpoint of global and local."""
    theta = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    local = np.array([0.5, -1.0, 0.25, 2.5], np.float32)
    one = OuterOptimizer([theta], OuterConfig(name="sgd", lr=1.0, momentum=0.0))
    outer_step(one, 0, [1.0], theta - local)
    assert np.array_equal(one.fragments[0].param.numpy(), local)
    half = OuterOptimizer([theta], OuterConfig(name="sgd", lr=0.5, momentum=0.0))
    outer_step(half, 0, [1.0], theta - local)
    assert np.array_equal(half.fragments[0].param.numpy(), (theta + local) / 2)


def test_weighted_mean_by_tokens():
    a, b = np.ones(5, np.float32), 4 * np.ones(5, np.float32)
    assert np.allclose(average_pseudo_gradients([a, b], [3.0, 1.0]).numpy(), 1.75)
    with pytest.raises(ValueError):
        average_pseudo_gradients([a, np.ones(4, np.float32)], [1, 1])


def test_state_dict_round_trip_continues_identically():
    theta0 = np.arange(10, dtype=np.float32)
    a = OuterOptimizer([theta0], OuterConfig())
    outer_step(a, 0, [1.0, 1.0], *pseudo_gradients(1, 10, 2))
    b = OuterOptimizer([np.zeros(10, np.float32)], OuterConfig())
    b.load_state_dict(a.state_dict())
    ds = pseudo_gradients(2, 10, 2)
    outer_step(a, 0, [1.0, 1.0], *ds)
    outer_step(b, 0, [1.0, 1.0], *ds)
    assert a.state_hash() == b.state_hash()


@pytest.mark.parametrize("fmt", ["none", "int8", "fp4_e3m0"])
def test_the_step_is_maths_only_and_the_wire_encodes_the_downlink(fmt):
    """``step`` returns no message; the driver's sequence (step, ``wire.encode_downlink`` with the
    downlink residual, ``set_global``) leaves the optimiser on exactly what a receiver computes
    with ``apply_downlink``, and equals ``wire.Downlink`` (what the driver calls), over steps with
    error feedback."""
    from ray_diloco.core.wire import Downlink, apply_downlink

    theta0 = np.random.default_rng(3).standard_normal(600).astype(np.float32)
    maths, one_call = OuterOptimizer([theta0], OuterConfig()), OuterOptimizer([theta0], OuterConfig())
    downlink = Downlink(fmt, True)
    held, residual = torch.tensor(theta0), None
    for k in range(3):
        ds = pseudo_gradients(20 + k, 600, 2)
        out = outer_step(maths, 0, [1.0, 2.0], *ds)
        assert "message" not in out and torch.equal(out["before"], held)
        message, applied, residual = encode_downlink(out["before"], maths.fragments[0].param, fmt, residual)
        maths.set_global(0, applied)
        held = apply_downlink(held, message)
        ref = outer_step(one_call, 0, [1.0, 2.0], *ds)
        ref["message"] = downlink_encode(downlink, one_call, 0, ref["before"])
        ref["update_norm"] = float((one_call.fragments[0].param - ref["before"]).norm())
        assert ref["message"] == message and torch.equal(maths.fragments[0].param, held)
        assert torch.equal(one_call.fragments[0].param, held) and ref["update_norm"] == float((held - out["before"]).norm())
    assert maths.state_hash() == one_call.state_hash()


@pytest.mark.parametrize("name,momentum,average_only", [("nesterov", 0.9, False), ("sgd", 0.9, False),
                                                         ("sgd", 0.0, False), ("nesterov", 0.9, True)])
def test_the_chunked_step_is_bitwise_torch_sgd_on_the_ordered_mean(name, momentum, average_only):
    """``step_ordered`` computes the mean and the step chunk by chunk (a fragment of several
    chunks and a ragged end): bitwise torch's SGD on the whole mean (``OrderedMean.take``), the
    momentum buffer included, over three steps; ``keep_update`` returns bitwise ``new - old`` and
    leaves the global fragment as it was."""
    from ray_diloco.core.outer import CHUNK, OrderedMean

    n = 2 * CHUNK + 1001
    theta0 = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    cfg = OuterConfig(name=name, lr=0.7, momentum=momentum)
    outer, kept = OuterOptimizer([theta0], cfg), OuterOptimizer([theta0], cfg)
    ref = torch.tensor(theta0)
    sgd = torch.optim.SGD([ref], lr=1.0 if average_only else 0.7, momentum=0.0 if average_only else momentum,
                          nesterov=name == "nesterov" and not average_only)
    for k in range(3):
        ds, ws = pseudo_gradients(40 + k, n, 3), [1.0, 3.0, 2.0]
        means = []
        for _ in range(3):
            m = OrderedMean(n)
            for d, w in zip(ds, ws):
                m.add(d, w)
            means.append(m)
        norm, none = outer.step_ordered(0, means[0], average_only)
        ref.grad = means[1].take()
        sgd.step()
        assert none is None and torch.equal(outer.fragments[0].param, ref)
        before = kept.fragments[0].param.clone()
        knorm, update = kept.step_ordered(0, means[2], average_only, keep_update=True)
        assert torch.equal(kept.fragments[0].param, before) and torch.equal(update, ref - before)
        kept.set_global(0, ref)
        assert norm == pytest.approx(float((ref - before).norm()), rel=1e-5) and knorm == norm
    if momentum and not average_only:
        assert torch.equal(outer.fragments[0].opt.state[outer.fragments[0].param]["momentum_buffer"], sgd.state[ref]["momentum_buffer"])
    assert outer.state_hash() == kept.state_hash()
    if not average_only:  # torch's state dict, key for key: checkpoints load either way
        ours, theirs = outer.fragments[0].opt.state_dict(), sgd.state_dict()
        assert ours["param_groups"] == theirs["param_groups"] and ours["state"].keys() == theirs["state"].keys()
        assert all(torch.equal(ours["state"][0][k], v) for k, v in theirs["state"].get(0, {}).items())
        again = OuterOptimizer([theta0], cfg)
        again.fragments[0].opt.load_state_dict(theirs)
        sgd.load_state_dict(ours)
        assert again.fragments[0].opt.state_dict()["param_groups"] == sgd.state_dict()["param_groups"]


def test_an_sgd_outer_optimiser_imports_no_torch_dynamo():
    """Constructing and stepping the default outer optimiser leaves ``torch._dynamo`` unimported
    (a ``torch.optim`` optimiser imports it: about 1 s of CPU in every outer-optimiser process)."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from helpers import outer_step, pseudo_gradients\n"
        "from ray_diloco.config import OuterConfig\n"
        "from ray_diloco.core.outer import OuterOptimizer\n"
        "o = OuterOptimizer([np.zeros(8, np.float32)], OuterConfig())\n"
        "outer_step(o, 0, [1.0], *pseudo_gradients(1, 8, 1))\n"
        "o.load_state_dict(o.state_dict())\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
    )
    from helpers import ROOT

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT / "tests")
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout[-500:] + out.stderr[-2000:]


@pytest.mark.parametrize("fmt", ["int8", "fp4_e3m0"])
def test_the_downlink_from_the_update_is_bitwise_the_downlink_from_the_step(fmt):
    """The driver's path (``step_ordered(keep_update=True)`` then ``Downlink.encode_update``)
    gives bitwise the message, global fragment and residual of the step-then-``encode`` path,
    over three steps with error feedback; the norm is that of the dequantised update."""
    from ray_diloco.core.outer import OrderedMean
    from ray_diloco.core.wire import Downlink

    n = 5000
    theta0 = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    a, b = OuterOptimizer([theta0], OuterConfig()), OuterOptimizer([theta0], OuterConfig())
    da, db = Downlink(fmt, True), Downlink(fmt, True)
    for k in range(3):
        ds = pseudo_gradients(60 + k, n, 2)
        out = outer_step(a, 0, [1.0, 2.0], *ds)
        msg_a = downlink_encode(da, a, 0, out["before"])
        mean = OrderedMean(n)
        for d, w in zip(ds, [1.0, 2.0]):
            mean.add(d, w)
        old = b.fragments[0].param.clone()
        _, update = b.step_ordered(0, mean, keep_update=True)
        msg_b, norm = db.encode_update(b, 0, update)
        assert bytes(msg_a) == bytes(msg_b) and torch.equal(a.fragments[0].param, b.fragments[0].param)
        assert torch.equal(a.fragments[0].residual, b.fragments[0].residual)
        assert norm == pytest.approx(float((b.fragments[0].param - old).norm()), rel=1e-4)
    assert a.state_hash() == b.state_hash()
    with pytest.raises(ValueError, match="'none'"):
        Downlink("none", False).encode_update(b, 0, torch.zeros(n))


def test_finite_norm_one_pass_and_its_overflow_rule():
    """Huge finite values (squares beyond fp32) give a finite norm, any NaN or infinity gives
    None; the norm agrees with numpy's in fp64."""
    from ray_diloco.core.outer import CHUNK, finite_norm

    x = np.random.default_rng(4).standard_normal(CHUNK + 17).astype(np.float32)
    assert finite_norm(x) == pytest.approx(float(np.linalg.norm(x.astype(np.float64))), rel=1e-6)
    big = np.full(1000, 3e38, np.float32)
    assert finite_norm(big) == pytest.approx(3e38 * np.sqrt(1000), rel=1e-6)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[CHUNK + 3] = bad
        assert finite_norm(y) is None
