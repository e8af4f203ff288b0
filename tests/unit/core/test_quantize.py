"""Wire encodings of pseudo-gradients: packed sizes and round-trip error bounds on edge tensors."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import encode

from ray_diloco.config import QUANTIZATION_FORMATS as FORMATS
from ray_diloco.core.formats import BLOCK
from ray_diloco.core.quantize import decode


def _block_scale(x: np.ndarray, max_value: float) -> np.ndarray:
    """Per-element scale of its block (what encode uses), for the error bounds."""
    flat = x.reshape(-1)
    pad = (-flat.size) % BLOCK
    absmax = np.abs(np.pad(flat, (0, pad)).reshape(-1, BLOCK)).max(1)
    s = np.where(absmax > 0, absmax / max_value, 1.0)
    return np.repeat(s, BLOCK)[: flat.size]


def _bound(fmt: str, x: np.ndarray) -> np.ndarray:
    a = np.abs(x.reshape(-1)).astype(np.float64)
    if fmt == "none":
        return np.zeros_like(a)
    if fmt == "bf16":
        return a * 2.0**-8
    if fmt == "int8":
        return _block_scale(x, 127.0) / 2 * (1 + 1e-6)
    if fmt == "fp8_e4m3":
        return a * 2.0**-4 + _block_scale(x, 448.0) * 2.0**-9
    return a / 3 + _block_scale(x, 16.0) * 0.125 * (1 + 1e-6)  # fp4_e3m0


rng = np.random.default_rng(0)
CASES = {
    "scalar": np.array(0.37, np.float32),
    "1d": rng.standard_normal(1001).astype(np.float32),
    "3d": rng.standard_normal((3, 5, 7)).astype(np.float32),
    "zeros": np.zeros(300, np.float32),
    "constant": np.full(513, -2.5, np.float32),
    "huge": (rng.standard_normal(700) * 1e30).astype(np.float32),
    "tiny": (rng.standard_normal(700) * 1e-30).astype(np.float32),
    "mixed": np.concatenate([rng.standard_normal(256) * 1e3, rng.standard_normal(256) * 1e-3]).astype(np.float32),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_round_trip_within_bound_and_finite(fmt, case):
    x = CASES[case]
    y = decode(encode(x, fmt))
    assert y.dtype == np.float32 and y.shape == (x.size,)
    assert np.isfinite(y).all()
    err = np.abs(y.astype(np.float64) - x.reshape(-1).astype(np.float64))
    assert (err <= _bound(fmt, x) + 1e-45).all(), (fmt, case, float(err.max()))
    if case == "zeros":
        assert (y == 0).all()
    if case == "constant":
        assert np.array_equal(y, x.reshape(-1))  # the block max lands exactly on the format's max


@pytest.mark.parametrize("fmt, per_value", [("none", 4), ("bf16", 2), ("int8", 1), ("fp8_e4m3", 1), ("fp4_e3m0", 0.5)])
def test_packed_bytes_on_the_wire(fmt, per_value):
    n = 1001
    p = encode(np.ones(n, np.float32), fmt)
    scales = 0 if fmt in ("none", "bf16") else 4 * -(-n // BLOCK)
    assert p.nbytes == int(np.ceil(n * per_value)) + scales
    assert p.payload.dtype == np.uint8


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_input_is_rejected(fmt):
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(10, np.float32)
        x[3] = bad
        with pytest.raises(ValueError, match="non-finite"):
            encode(x, fmt)


def test_unknown_format():
    with pytest.raises(ValueError, match="must be one of"):
        encode(np.ones(3, np.float32), "fp2")


def test_fp4_codes_on_the_thresholds_and_the_sign_of_zero():
    """The fp4 encoder's rounding (the nibble is the number of midpoints <= |y|, ties go up): every
    midpoint between 0, 2^-2, ..., 2^4 and the values just below it, both signs, zeros; a decoded
    nibble with the sign bit and code 0 is -0.0. Blocks of one scale (max 16) make y = x."""
    from ray_diloco.core.formats import BLOCK
    from ray_diloco.core.quantize import decode

    mids = np.array([0.125, 0.375, 0.75, 1.5, 3.0, 6.0, 12.0], np.float32)
    below = np.nextafter(mids, np.float32(0))
    x = np.zeros(BLOCK, np.float32)
    vals = np.concatenate([mids, below, -mids, -below, [16.0, -0.0, 0.0]]).astype(np.float32)
    x[: vals.size] = vals
    got = decode(encode(x, "fp4_e3m0"))[: vals.size]
    levels = np.array([0.25, 0.5, 1, 2, 4, 8, 16], np.float32)
    want = np.concatenate([levels, [0, 0.25, 0.5, 1, 2, 4, 8], -levels, [0, -0.25, -0.5, -1, -2, -4, -8],
                           [16.0, 0.0, 0.0]]).astype(np.float32)
    assert np.array_equal(got, want) and not np.signbit(got[-2])  # code 0 never carries a sign
    from ray_diloco.core.formats import Packed
    neg_zero = decode(Packed("fp4_e3m0", 2, np.array([0x88], np.uint8), np.ones(1, np.float32)))
    assert np.signbit(neg_zero).all() and not neg_zero.any()
