"""The fused CPU codec (``core.codec``) against the torch codec it replaces on the host
(``core.formats.WireFormat.encode_torch`` / ``decode_torch``, kept for tensors on a GPU and as
this oracle): the same bytes, decoded values, residuals and downlink globals, bit for bit, on
random, padded, zero, signed-zero, subnormal, huge, rounding-tie and raw-bit-pattern inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_diloco.core import codec
from ray_diloco.core.formats import BLOCK, wire_format

SCALED = ["fp4_e3m0", "int8", "fp8_e4m3"]
rng = np.random.default_rng(7)


def _bits() -> np.ndarray:
    b = rng.integers(0, 2**32, 60_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return b[np.isfinite(b)]


def _ties() -> np.ndarray:
    """Each block's absmax makes the scale 1 (max in the block), then values on and next to every
    rounding midpoint of fp4, int8 and fp8 (ties to even are where codecs differ)."""
    mids = np.array([0.125, 0.375, 0.75, 1.5, 3.0, 6.0, 12.0, 0.5, 1.5, 2.5, 126.5, 1.0625, 17.0, 208.0, 2**-10])
    near = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9)]).astype(np.float32)
    out = []
    for vmax in (16.0, 127.0, 448.0):
        v = near[near <= vmax]
        out += [np.float32(vmax), *v, *(-v)]
    return np.array(out, np.float32)


def _scaled_ties() -> np.ndarray:
    """Blocks whose scale is not a power of two (absmax random over fp32's range, subnormal
    included), each holding the fp32 values on and up to two ulps around ``scale * m`` for every
    fp4 midpoint ``m``: where ``fl(v / scale)`` lands on either side of ``m`` (the encoder decides
    that without dividing)."""
    mids = np.array([0.125, 0.375, 0.75, 1.5, 3.0, 6.0, 12.0])
    blocks = []
    for amax in np.exp(rng.uniform(-100, 85, 300)).astype(np.float32).tolist() + [3e-44, 1e-40, 3.3e38]:
        s = np.float32(amax) / np.float32(16.0)
        v = [np.float32(s * m) for m in mids]
        for _ in range(2):
            v += [np.nextafter(x, np.float32(0)) for x in v[:7]] + [np.nextafter(x, np.float32(np.inf)) for x in v[:7]]
        v = np.array(v, np.float32)
        v = v[(v <= np.float32(amax)) & (v > 0)]
        block = np.zeros(BLOCK, np.float32)
        block[0] = amax
        block[1 : 1 + v.size] = v
        block[1 + v.size : 1 + 2 * v.size] = -v
        blocks.append(block)
    return np.concatenate(blocks)


CASES = {
    "normal_padded": rng.standard_normal(3 * BLOCK + 17).astype(np.float32),
    "odd_one": np.array([0.3], np.float32),
    "zeros": np.zeros(2 * BLOCK, np.float32),
    "signed_zeros": np.where(rng.random(600) < 0.5, -0.0, 0.0).astype(np.float32),
    "subnormal": (rng.standard_normal(999) * 1e-41).astype(np.float32),
    "huge": (rng.standard_normal(1001) * 3e38).clip(-3.4e38, 3.4e38).astype(np.float32),
    "wide_range": (rng.standard_normal(5000) * np.exp(rng.uniform(-60, 60, 5000))).astype(np.float32),
    "raw_bits": _bits(),
    "ties": _ties(),
    "scaled_ties": _scaled_ties(),
}


@pytest.mark.parametrize("fmt", SCALED)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_codec_bytes_and_values_equal_the_torch_codec(fmt: str, case: str) -> None:
    x = CASES[case]
    payload, scales = codec.encode(x, fmt)
    want_p, want_s = wire_format(fmt).encode_torch(torch.from_numpy(x))
    assert np.array_equal(scales.view(np.uint32), want_s.numpy().view(np.uint32))
    assert np.array_equal(payload, want_p.numpy())
    got = codec.decode_into(payload, scales, fmt, np.empty(x.size, np.float32))
    want = wire_format(fmt).decode_torch(want_p, want_s, x.size).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # -0.0 included
    assert np.isfinite(got).all()  # a block of tiny subnormals too (its scale would round to 0)
    # a chunk of whole blocks, added to what is there (the outer side's decode-and-accumulate)
    start = BLOCK if x.size > BLOCK else 0
    acc = np.full(x.size - start, 0.5, np.float32)
    codec.decode_into(payload, scales, fmt, acc, start=start, accumulate=True)
    assert np.array_equal(acc, np.float32(0.5) + want[start:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: on one, run "
                    "python -m pytest tests/unit/core/test_codec.py -k cuda")
@pytest.mark.parametrize("fmt", SCALED)
@pytest.mark.parametrize("case", list(CASES))
def test_the_torch_codec_on_a_cuda_gpu_writes_the_fused_codecs_bytes(fmt: str, case: str) -> None:
    """A GPU replica's message equals a CPU replica's byte for byte: scales by true division
    (CUDA turns a division by a Python number into a multiplication by its reciprocal, an ulp
    off for int8's 127 and fp8's 448), the same codes, the same decoded values."""
    x = CASES[case]
    payload, scales = codec.encode(x, fmt)
    got_p, got_s = wire_format(fmt).encode_torch(torch.from_numpy(x).cuda())
    assert np.array_equal(got_s.cpu().numpy().view(np.uint32), scales.view(np.uint32))
    assert np.array_equal(got_p.cpu().numpy(), payload)
    want = codec.decode_into(payload, scales, fmt, np.empty(x.size, np.float32))
    got = wire_format(fmt).decode_torch(got_p, got_s, x.size).cpu().numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("fmt", SCALED)
def test_error_feedback_and_downlink_in_one_pass_equal_the_torch_steps(fmt: str) -> None:
    x = CASES["normal_padded"]
    r = (rng.standard_normal(x.size) * 0.05).astype(np.float32)
    value = torch.from_numpy(x) + torch.from_numpy(r)
    want_p, want_s = wire_format(fmt).encode_torch(value)
    sent = wire_format(fmt).decode_torch(want_p, want_s, x.size)
    new_r = np.empty_like(x)
    payload, scales = codec.encode(x, fmt, r, new_r)  # uplink: residual in, new residual out
    assert np.array_equal(payload, want_p.numpy()) and np.array_equal(scales, want_s.numpy())
    assert np.array_equal(new_r, (value - sent).numpy())
    params = rng.standard_normal(x.size).astype(np.float32)
    want_params = (torch.from_numpy(params) + sent).numpy()
    r_inplace = r.copy()
    payload, scales, norm = codec.apply_update(x, r_inplace, params, fmt, r_inplace)  # downlink: in place
    assert np.array_equal(payload, want_p.numpy())
    assert np.array_equal(params, want_params) and np.array_equal(r_inplace, (value - sent).numpy())
    assert norm == pytest.approx(float(sent.double().norm()), rel=1e-12)


def test_non_finite_input_is_refused_and_nothing_is_written() -> None:
    x = CASES["normal_padded"].copy()
    x[5], x[700] = np.nan, np.inf
    r = np.zeros_like(x)
    params = np.ones_like(x)
    with pytest.raises(ValueError, match="2 non-finite values"):
        codec.apply_update(x, r, params, "fp4_e3m0", r)
    assert not r.any() and (params == 1).all()
    with pytest.raises(ValueError, match="2 non-finite values"):
        codec.encode(x, "int8", r, r)
    assert not r.any()
    with pytest.raises(ValueError, match="bf16"):
        codec.encode(x, "bf16")
    with pytest.raises(ValueError, match="multiple of 256"):
        codec.decode_into(np.zeros(10, np.uint8), np.ones(1, np.float32), "int8", np.empty(3, np.float32), start=3)


@pytest.mark.parametrize("fmt", SCALED)
def test_the_outer_side_sums_encoded_pseudo_gradients_with_the_bits_of_decoded_ones(fmt: str) -> None:
    """``OrderedMean`` given the encodings (decoded a chunk at a time as it sums) equals it given
    the decoded values, bit for bit, across chunk edges; ``codec.norm`` reads the norm in one pass
    and refuses a message whose scale is not finite."""
    from ray_diloco.core import outer
    from ray_diloco.core.formats import Packed

    n = outer.CHUNK + 3 * BLOCK + 5
    xs = [(rng.standard_normal(n) * (m + 1)).astype(np.float32) for m in range(3)]
    enc = [codec.encode(x, fmt) for x in xs]
    packed, plain = outer.OrderedMean(n), outer.OrderedMean(n)
    for (p, s), w in zip(enc, (3.0, 1.0, 2.0)):
        packed.add(Packed(fmt, n, p, s), w)
        plain.add(codec.decode_into(p, s, fmt, np.empty(n, np.float32)), w)
    assert packed.nbytes < plain.nbytes / 3
    assert torch.equal(packed.take(), plain.take())
    p, s = enc[0]
    want = float(np.linalg.norm(codec.decode_into(p, s, fmt, np.empty(n, np.float32)).astype(np.float64)))
    assert codec.norm(p, s, fmt, n) == pytest.approx(want, rel=1e-12)
    bad = s.copy()
    bad[3] = np.inf
    assert codec.norm(p, bad, fmt, n) is None
    with pytest.raises(ValueError, match="needs more than"):
        codec.norm(p[:10], s, fmt, n)


@pytest.mark.parametrize("fmt", SCALED)
def test_the_downlink_encoded_chunk_by_chunk_inside_the_step_equals_the_whole_update(fmt: str) -> None:
    """``Downlink.step`` (each chunk of the outer update encoded, applied and its residual kept
    as the Nesterov step makes it) against the step's whole update then ``encode_update``: the
    same message, global values, residual and momentum, bit for bit, over three outer steps of an
    odd-sized fragment spanning three chunks (the first step has no residual yet)."""
    from ray_diloco.config import OuterConfig
    from ray_diloco.core import outer
    from ray_diloco.core.wire import Downlink

    n = 2 * outer.CHUNK + 3 * BLOCK + 7
    theta = rng.standard_normal(n).astype(np.float32)
    a, b = outer.OuterOptimizer([theta], OuterConfig()), outer.OuterOptimizer([theta], OuterConfig())
    da, db = Downlink(fmt, True), Downlink(fmt, True)
    fa, fb = a.fragments[0], b.fragments[0]
    for step in range(3):
        ds = [(rng.standard_normal(n) * 0.01).astype(np.float32) for _ in range(2)]
        means = [outer.OrderedMean(n), outer.OrderedMean(n)]
        for mean in means:
            for d, w in zip(ds, (1.0, 3.0)):
                mean.add(d, w)
        _, update = a.step_ordered(0, means[0], keep_update=True)
        msg_a, norm_a = da.encode_update(a, 0, update)
        msg_b, norm_b = db.step(b, 0, means[1])
        assert bytes(msg_a) == bytes(msg_b), step
        assert torch.equal(fa.param, fb.param) and torch.equal(fa.residual, fb.residual)
        assert torch.equal(fa.opt.state[fa.param]["momentum_buffer"], fb.opt.state[fb.param]["momentum_buffer"])
        assert norm_b == pytest.approx(norm_a, rel=1e-5)


def test_kernels_called_from_several_threads_are_serialised_under_numbas_workqueue_layer():
    """The outer side checks messages on several threads while it steps: with numba's
    ``workqueue`` threading layer (not thread safe; a machine without libgomp or TBB gets it)
    concurrent kernel launches abort the process unless ``codec`` serialises them (checked:
    without the lock this script is killed)."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import threading
        import numpy as np
        import numba
        from ray_diloco.core import codec
        x = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
        p, s = codec.encode(x, "fp4_e3m0")
        def work():
            for _ in range(10):
                codec.norm(p, s, "fp4_e3m0", x.size)
                codec.encode(x, "fp4_e3m0")
        ts = [threading.Thread(target=work) for _ in range(4)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        print(numba.threading_layer(), "ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NUMBA_THREADING_LAYER": "workqueue"})
    assert out.returncode == 0 and out.stdout.strip() == "workqueue ok", out.stderr[-2000:]
