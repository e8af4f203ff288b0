"""The fused CPU codec of the scaled wire formats (``fp4_e3m0``, ``int8``, ``fp8_e4m3``): one pass
per direction over the data, multi-threaded over blocks (numba, ``@njit(parallel=True)``).

The bytes are those of ``core.quantize``'s torch codec, bit for bit (that codec stays for tensors
on a GPU and as the tests' oracle): per block of ``BLOCK`` values, scale = ``absmax / max``
(fp32 division; 1 for an all-zero block), ``y = x / scale`` (fp32 division), then

* ``fp4_e3m0``: the code is the number of midpoints ``0.125, 0.375, ..., 12`` that are <= ``|y|``
  (0 and ``+-2^k``, k in -2..4), bit 3 the sign of a non-zero code, two values per byte (the
  first in the low nibble);
* ``int8``: ``round_half_even(y)`` clamped to [-127, 127];
* ``fp8_e4m3``: ``y`` clamped to [-448, 448], then rounded to nearest even float8 e4m3fn
  (subnormals below 2^-6).

Decoding is a table look-up (or an int8 conversion) times the block's scale (fp32 multiply).

Fused with what surrounds them (Streaming DiLoCo, arXiv 2501.18512, section 2: quantised
exchange with error feedback): :func:`encode` adds an error-feedback residual and writes the new
one (``(x + r) - dequantised``) in the same pass; :func:`decode_into` writes (or adds) a chunk of
decoded values into a caller's buffer, so the outer side never holds a decoded copy of a message;
:func:`apply_update` is the downlink's whole encode: residual in, quantise, apply the dequantised
update to the global values, new residual out, in one pass. Each result equals the composition of
the torch operations it replaces (fp32 ops, one rounding each), so the globals stay bitwise
identical to the torch codec's.

Compiled on first use and cached next to this file (``cache=True``): a fresh process loads the
machine code in well under a second.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import njit, prange

BLOCK = 256  # values per scale block (core.quantize.BLOCK)
#: Largest finite value of each scaled format (the scale maps a block's absmax onto it).
MAX = {"fp4_e3m0": 16.0, "int8": 127.0, "fp8_e4m3": 448.0}
_KIND = {"fp4_e3m0": 0, "int8": 1, "fp8_e4m3": 2}

_FP4_MIDS = np.array([0.125, 0.375, 0.75, 1.5, 3.0, 6.0, 12.0], dtype=np.float32)
#: fp32 value of each fp4 nibble (code 0..7: 0, 2^-2 .. 2^4; bit 3 the sign, -0.0 for code 0).
_FP4_VALUES = np.array([0.0, 0.25, 0.5, 1, 2, 4, 8, 16, -0.0, -0.25, -0.5, -1, -2, -4, -8, -16], dtype=np.float32)
#: fp32 value of each float8 e4m3fn byte (NaN for 0x7F and 0xFF, which the encoder never makes).
_FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
#: fp32 value of each int8 byte (its two's-complement integer).
_INT8_VALUES = np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32)


def payload_nbytes(numel: int, fmt: str) -> int:
    """Bytes of the packed values of ``numel`` values in scaled format ``fmt``."""
    return (numel + 1) // 2 if fmt == "fp4_e3m0" else numel


@njit(inline="always", cache=True)
def _fp8_code(y):  # pragma: no cover - compiled
    """float8 e4m3fn byte of fp32 ``y`` (|y| <= 448), round to nearest even."""
    a = abs(y)
    sign = 128 if y < 0 or (y == 0 and math.copysign(1.0, y) < 0) else 0
    if a < np.float32(0.015625):  # below 2^-6: subnormal steps of 2^-9 (an exact power-of-two scale)
        return sign | np.int64(np.rint(a * np.float32(512.0)))
    m, e = math.frexp(a)  # a = m 2^e, m in [0.5, 1): 1.fff x 2^(e - 1), biased exponent e + 6
    q = np.int64(np.rint(m * 16.0))  # 8..16, ties to even (16: a carry into the exponent)
    return sign | (((e + 6) << 3) + q - 8)


@njit(inline="always", cache=True)
def _code(y, kind, vmax, mids):  # pragma: no cover - compiled
    """The code of fp32 ``y`` (a value divided by its block's scale) in format ``kind``."""
    if kind == 0:  # fp4: how many midpoints are <= |y|; bit 3 the sign of a non-zero code
        ay = abs(y)
        c = 0
        for m in range(7):
            if ay >= mids[m]:
                c += 1
        if y < 0 and c > 0:
            c |= 8
        return c
    if kind == 1:  # int8: round half to even, clamp
        return np.int64(min(max(np.rint(y), np.float32(-127.0)), np.float32(127.0))) & 0xFF
    return _fp8_code(min(max(y, np.float32(-vmax)), np.float32(vmax)))  # fp8 e4m3fn: clamp, round to nearest even


@njit(parallel=True, cache=True)
def _scale_pass(x, r, vmax, scales):  # pragma: no cover - compiled
    """Each block's scale of ``x (+ r)`` into ``scales``; returns the number of blocks holding a
    non-finite value (their scales are meaningless)."""
    n = x.size
    use_r = r.size > 0
    bad = 0
    for b in prange(scales.size):
        lo = b * 256
        hi = min(lo + 256, n)
        amax = np.float32(0.0)
        finite = True
        for i in range(lo, hi):
            v = x[i] + r[i] if use_r else x[i]
            finite = finite and np.isfinite(v)
            a = abs(v)
            if a > amax:
                amax = a
        if not finite:
            bad += 1
        scales[b] = amax / np.float32(vmax) if amax > 0 else np.float32(1.0)
    return bad


@njit(parallel=True, cache=True)
def _code_pass(x, r, r_out, p, kind, vmax, mids, table, payload, scales):  # pragma: no cover - compiled
    """Codes of ``x (+ r)`` with the given block ``scales`` into ``payload``; where given (size
    > 0), ``r_out = (x + r) - dequantised`` and ``p += dequantised``. Returns the sum of squares
    of the dequantised values (fp64)."""
    n = x.size
    use_r, fb, upd = r.size > 0, r_out.size > 0, p.size > 0
    sq = 0.0
    for b in prange(scales.size):
        lo = b * 256
        hi = min(lo + 256, n)
        s = scales[b]
        part = 0.0
        for i in range(lo, hi):
            v = x[i] + r[i] if use_r else x[i]
            c = _code(v / s, kind, vmax, mids)
            if kind == 0:
                if i & 1:
                    payload[i >> 1] = np.uint8(payload[i >> 1] | (c << 4))
                else:
                    payload[i >> 1] = np.uint8(c)
            else:
                payload[i] = np.uint8(c)
            if fb or upd:
                sent = table[c] * s
                if fb:
                    r_out[i] = v - sent
                if upd:
                    p[i] = p[i] + sent
                    part += np.float64(sent) * np.float64(sent)
        sq += part
    return sq


@njit(parallel=True, cache=True)
def _decode(payload, scales, kind, table, start, out, accumulate):  # pragma: no cover - compiled
    """Decoded values ``[start, start + out.size)`` into ``out`` (``accumulate``: added to it)."""
    n = out.size
    for c in prange((n + 255) // 256):
        lo = c * 256
        hi = min(lo + 256, n)
        for i in range(lo, hi):
            k = start + i
            code = (payload[k >> 1] >> (4 * (k & 1))) & 15 if kind == 0 else payload[k]
            v = table[code] * scales[k >> 8]
            if accumulate:
                out[i] = out[i] + v
            else:
                out[i] = v


@njit(parallel=True, cache=True)
def _norm(payload, scales, kind, table, n):  # pragma: no cover - compiled
    """(non-finite decoded values, sum of their squares in fp64) of the first ``n`` values."""
    bad = 0
    sq = 0.0
    for b in prange(scales.size):
        lo = b * 256
        hi = min(lo + 256, n)
        part = 0.0
        for k in range(lo, hi):
            code = (payload[k >> 1] >> (4 * (k & 1))) & 15 if kind == 0 else payload[k]
            v = np.float64(table[code] * scales[b])
            if not np.isfinite(v):
                bad += 1
            part += v * v
        sq += part
    return bad, sq


def _table(fmt: str) -> np.ndarray:
    return {"fp4_e3m0": _FP4_VALUES, "int8": _INT8_VALUES, "fp8_e4m3": _FP8_VALUES}[fmt]


_EMPTY = np.zeros(0, dtype=np.float32)


def _threads() -> None:
    """numba's threads follow torch's (a Ray actor's CPU share), never more than numba started."""
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]


def _check(fmt: str) -> None:
    if fmt not in _KIND:
        raise ValueError(f"quantization format {fmt!r}: the fused codec takes {', '.join(_KIND)}")


def _nonfinite(x: np.ndarray, r: np.ndarray | None) -> ValueError:
    value = x if r is None else x + r
    return ValueError(f"cannot encode a pseudo-gradient with {int((~np.isfinite(value)).sum())} non-finite values")


def _encode(
    x: np.ndarray, fmt: str, residual: np.ndarray | None, new_residual: np.ndarray | None, params: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, float]:
    _check(fmt)
    n = x.size
    payload = np.empty(payload_nbytes(n, fmt), dtype=np.uint8)
    scales = np.empty(-(-n // BLOCK), dtype=np.float32)
    x = x.reshape(-1)
    r = _EMPTY if residual is None else residual.reshape(-1)
    _threads()
    if _scale_pass(x, r, MAX[fmt], scales):  # before anything is written: a refusal leaves all as it was
        raise _nonfinite(x, residual)
    sq = _code_pass(
        x,
        r,
        _EMPTY if new_residual is None else new_residual.reshape(-1),
        _EMPTY if params is None else params.reshape(-1),
        _KIND[fmt],
        MAX[fmt],
        _FP4_MIDS,
        _table(fmt),
        payload,
        scales,
    )
    return payload, scales, float(np.sqrt(sq))


def encode(
    x: np.ndarray, fmt: str, residual: np.ndarray | None = None, new_residual: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Encode fp32 ``x`` ``[n]`` (plus ``residual`` ``[n]`` when given) in scaled format ``fmt``:
    ``(payload, scales)``, uint8 ``[payload_nbytes(n)]`` and fp32 ``[ceil(n / BLOCK)]``. With
    ``new_residual`` (fp32 ``[n]``, may be ``residual`` itself) it receives ``(x + residual) -
    dequantised`` (error feedback) in the same pass. Two reads of the input (the scales, then the
    codes), one write of each output.

    Raises:
        ValueError: a non-finite value (how many; nothing written), or an unknown format.
    """
    payload, scales, _ = _encode(x, fmt, residual, new_residual, None)
    return payload, scales


def apply_update(
    update: np.ndarray,
    residual: np.ndarray | None,
    params: np.ndarray,
    fmt: str,
    new_residual: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """The downlink's encode in one pass over fp32 ``[n]`` arrays (Streaming DiLoCo, arXiv
    2501.18512, section 2): encode ``update + residual``, add the dequantised values to ``params``
    in place (what every receiver adds) and write ``(update + residual) - dequantised`` to
    ``new_residual`` (may be ``residual`` itself; None: no error feedback). Returns ``(payload,
    scales, L2 norm of the dequantised update)`` (the norm summed in fp64).

    Raises:
        ValueError: a non-finite value (nothing written), or an unknown format."""
    return _encode(update, fmt, residual, new_residual, params)


def decode_into(
    payload: np.ndarray, scales: np.ndarray, fmt: str, out: np.ndarray, start: int = 0, accumulate: bool = False
) -> np.ndarray:
    """Decoded values ``[start, start + out.size)`` of an encoding (``payload`` uint8, ``scales``
    fp32 per block) written into fp32 ``out`` (or added to it: ``accumulate``); returns ``out``.
    ``start`` must be a multiple of ``BLOCK`` (a chunk of whole blocks).

    Raises:
        ValueError: ``start`` not a multiple of ``BLOCK``, or an unknown format."""
    _check(fmt)
    if start % BLOCK:
        raise ValueError(f"decode start {start} is not a multiple of {BLOCK}")
    if out.size:
        _threads()
        _decode(payload, scales, _KIND[fmt], _table(fmt), start, out.reshape(-1), accumulate)
    return out


def norm(payload: np.ndarray, scales: np.ndarray, fmt: str, numel: int) -> float | None:
    """The L2 norm of an encoding's ``numel`` decoded values (summed in fp64, one pass, nothing
    decoded into memory), or None when one is not finite (a malformed or hostile message: the
    encoder never makes one).

    Raises:
        ValueError: an unknown format, or fewer bytes or scales than ``numel`` values need."""
    _check(fmt)
    if payload.size < payload_nbytes(numel, fmt) or scales.size < -(-numel // BLOCK):
        raise ValueError(
            f"an encoding of {numel} {fmt} values needs more than {payload.size} bytes and {scales.size} scales"
        )
    _threads()
    bad, sq = _norm(payload, scales[: -(-numel // BLOCK)], _KIND[fmt], _table(fmt), numel)
    return None if bad or not np.isfinite(sq) else float(np.sqrt(sq))
