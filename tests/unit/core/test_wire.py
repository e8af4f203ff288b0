"""The wire protocol (core/wire.py): what the driver encodes is what every receiver decodes, bit for
bit; replies without a message leave the global fragment alone; resyncs carry full precision; the
byte accounting follows its formulas."""

from __future__ import annotations

import pytest
import torch
from helpers import encode, encode_downlink

from ray_diloco.config import QUANTIZATION_FORMATS
from ray_diloco.core.wire import (
    OK,
    Reply,
    apply_downlink,
    communication_summary,
    decode_reply,
    dp_equivalent_bytes,
    link_delay_s,
)


@pytest.mark.parametrize("fmt", QUANTIZATION_FORMATS)
def test_the_driver_adopts_exactly_what_receivers_decode(fmt):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(1000, generator=g)
    new = old + 0.01 * torch.randn(1000, generator=g)
    message, applied, residual = encode_downlink(old, new, fmt)
    received = decode_reply(old, Reply(OK, 1, [message]))  # K = 1: a list of one message
    assert torch.equal(received, applied) and torch.equal(apply_downlink(old, message), applied)
    if fmt == "none":
        assert torch.equal(applied, new) and residual is None
    else:  # quantised update: close to the step, and the residual is exactly what was lost
        assert not torch.equal(applied, new) and torch.allclose(applied, new, atol=0.05)
        assert torch.allclose(residual, (new - old) - (applied - old), atol=1e-6)


def test_replies_without_a_message_and_resyncs():
    old = torch.arange(8, dtype=torch.float32)
    assert decode_reply(old, Reply(OK, 3)) is old and Reply(OK, 3).nbytes == 0
    current = torch.full((8,), 2.5)
    message, _, _ = encode_downlink(old, current, "none")
    resync = Reply("dropped", 5, [message], resync=True)
    assert torch.equal(decode_reply(old, resync), current) and resync.nbytes == len(message)
    with pytest.raises(ValueError, match="values"):
        decode_reply(torch.zeros(7), resync)
    with pytest.raises(ValueError, match="values"):
        apply_downlink(torch.zeros(7), encode_downlink(torch.zeros(8), torch.ones(8), "int8")[0])


def test_byte_accounting():
    assert link_delay_s(10**9, 8.0, 20.0) == pytest.approx(1.02)  # 8 Gbit over 8 Gbit/s + 20 ms
    assert link_delay_s(10**9, None, 0.0) == 0.0
    assert dp_equivalent_bytes(1000, 10, 4, 4) == 2 * 1000 * 3 // 4 * 4 * 10 and dp_equivalent_bytes(1000, 10, 1) == 0
    s = communication_summary(1000, 10, 2, bytes_up=800, bytes_down=400, peak_sync_bytes=60)
    assert (s["bytes_up_per_replica"], s["bytes_down_per_replica"]) == (400, 200)
    assert s["dp_fp32_bytes_per_replica"] == 2 * dp_equivalent_bytes(1000, 10, 2, 4)
    assert s["fewer_bytes_than_dp_fp32"] == pytest.approx(s["dp_fp32_bytes_per_replica"] / 600)


def test_all_finite_in_one_pass_and_on_an_overflowing_sum():
    """A finite sum proves finiteness; an overflowing sum of finite values is still finite; any
    NaN or infinity is found."""
    from ray_diloco.core.formats import all_finite

    x = torch.randn(10_000)
    assert all_finite(x)
    assert all_finite(torch.full((100,), 3e38))  # the sum overflows, the values are finite
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1234] = bad
        assert not all_finite(y)


def test_the_uplink_keeps_its_residual_when_used_and_restores_the_previous_one_when_not():
    """``Uplink`` with error feedback and K = 2 slices: the first send's residual is what the
    encoding lost; a dropped round restores the residual before it (its buffer back to the pool);
    an abstention (non-finite) leaves it; the slices' messages decode to the whole's bits."""
    import numpy as np
    import torch

    from ray_diloco.core.formats import parse as from_message
    from ray_diloco.core.quantize import decode
    from ray_diloco.core.sync import SyncBuffers
    from ray_diloco.core.wire import Uplink

    buffers = SyncBuffers()
    up = Uplink("fp4_e3m0", True, shards=2, buffers=buffers)
    d = torch.from_numpy(np.random.default_rng(3).standard_normal(1000).astype(np.float32))
    parts, _ = up.encode(0, d)
    whole = decode(encode(d, "fp4_e3m0"))
    got = np.concatenate([decode(from_message(p)) for p in parts])
    assert len(parts) == 2 and np.array_equal(got, whole)
    first = up.residuals[0]
    assert torch.equal(first, d - torch.from_numpy(whole))
    up.settle(0, True)
    parts, _ = up.encode(0, d)  # second round: d + residual encoded
    assert not torch.equal(up.residuals[0], first)
    up.settle(0, False)  # dropped: the first residual back
    assert up.residuals[0] is first and buffers.allocated == 2
    bad = d.clone()
    bad[7] = float("nan")
    assert up.encode(0, bad)[0] is None
    up.settle(0, False)
    assert up.residuals[0] is first


@pytest.mark.parametrize("fmt", ["fp4_e3m0", "int8", "fp8_e4m3"])
def test_a_lazily_read_pseudo_gradient_encodes_to_the_bytes_and_residual_of_the_buffer(fmt):
    """``Uplink.encode`` of a ``PseudoGradient`` (global - local read a chunk at a time, no
    fragment-sized buffer) gives the messages and, once the round is settled, the error-feedback
    residual of the same pseudo-gradient computed into a buffer (written over the previous one at
    the settle, not at the encode): over several chunks (``wire.CHUNK``), parameter boundaries
    that are not block boundaries, K = 2 slices, rounds with a residual, a dropped round; a
    non-finite value anywhere abstains (None) and leaves the residual as it was."""
    import numpy as np
    import torch

    from ray_diloco.core.fragments import Fragment, ParamSpec, PseudoGradient, pseudo_gradient
    from ray_diloco.core.wire import CHUNK, Uplink

    rng = np.random.default_rng(5)
    sizes = [1000, CHUNK + 777, 333, CHUNK // 2 + 1]
    frag = Fragment(0, tuple(ParamSpec(f"p{i}", (n,)) for i, n in enumerate(sizes)))
    glob = torch.from_numpy(rng.standard_normal(frag.numel, dtype=np.float32))
    params = {f"p{i}": torch.from_numpy(rng.standard_normal(n, dtype=np.float32)) for i, n in enumerate(sizes)}
    eager, lazy = Uplink(fmt, True, shards=2), Uplink(fmt, True, shards=2)
    for used in (True, False, True):  # later rounds add the residual; a dropped round keeps it
        want, _ = eager.encode(0, pseudo_gradient(glob, params, frag))
        got, held = lazy.encode(0, PseudoGradient(glob, params, frag))
        assert held is None and len(got) == len(want) == 2
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want))
        kept = lazy.residuals.get(0)
        kept = None if kept is None else kept.clone()
        eager.settle(0, used), lazy.settle(0, used)  # the lazy residual is written here, over the old one
        assert torch.equal(lazy.residuals[0], eager.residuals[0])
        if not used:
            assert torch.equal(lazy.residuals[0], kept)
        for p in params.values():
            p.add_(0.01)
    kept = lazy.residuals[0].clone()
    params["p3"][-1] = float("inf")  # in the last chunk: earlier chunks were encoded already
    assert lazy.encode(0, PseudoGradient(glob, params, frag))[0] is None
    lazy.settle(0, False)
    assert torch.equal(lazy.residuals[0], kept)
