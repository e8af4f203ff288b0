"""The fused CPU codec of the scaled wire formats (``fp4_e3m0``, ``int8``, ``fp8_e4m3``): one pass
per direction over the data, multi-threaded over blocks (numba, ``@njit(parallel=True)``).

The bytes are those of the torch codec (``core.formats.WireFormat.encode_torch``), bit for bit (it stays for tensors
on a GPU and as the tests' oracle): per block of ``BLOCK`` values, scale = ``absmax / max``
(fp32 division, at least 2^-149; 1 for an all-zero block), ``y = x / scale`` (fp32 division), then

* ``fp4_e3m0``: the code is the number of midpoints ``0.125, 0.375, ..., 12`` that are <= ``|y|``
  (0 and ``+-2^k``, k in -2..4), bit 3 the sign of a non-zero code, two values per byte (the
  first in the low nibble). The kernel decides each ``|y| >= m`` without dividing, by comparing
  ``|x|`` with seven thresholds per block that give the same answer (see ``_FP4_TIES``);
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

import contextlib
import math
import threading
from typing import Any

import numba
import numpy as np
import torch
from numba import njit, prange

from ray_diloco.core.formats import BLOCK, MIN_SCALE, WireFormat, wire_format

#: 2^(9 - k) for k = 0..15 (the fp8 mantissa's scale in binade k - 6), then 2^j for j = -5..10.
_POW2 = np.array([2.0 ** (9 - k) for k in range(16)] + [2.0**j for j in range(-5, 11)], dtype=np.float32)
#: The fp4 code's midpoints ``m`` (0.125 .. 12), each lowered to the real number halfway to the fp32
#: value below it (exact in fp64): ``fl(a / s) >= m`` exactly when ``a >= s * t`` (fp32 division is
#: correctly rounded and each ``m``'s mantissa is even, so a tie rounds up to ``m``).
_FP4_TIES = np.array(
    [
        (np.float64(np.nextafter(np.float32(m), np.float32(0))) + m) / 2
        for m in (0.125, 0.375, 0.75, 1.5, 3.0, 6.0, 12.0)
    ],
    dtype=np.float64,
)


@njit(inline="always", cache=True)
def _fp8_code(y, pow2):  # pragma: no cover - compiled
    """float8 e4m3fn byte of fp32 ``y`` (|y| <= 448), round to nearest even, in vectorisable
    arithmetic: the binade ``e`` (2^e <= |y|, e in -6..8; -6 also for subnormals) by comparisons,
    then the 3-bit mantissa as ``rint(|y| 2^(3 - e))`` (an exact power-of-two scale; 16 carries
    into the exponent), the code ``(e + 7) << 3 | mantissa``; subnormals come out of the same
    formula."""
    a = abs(y)
    k = np.int32(0)
    for j in range(14):  # thresholds 2^-5 .. 2^8
        k += np.int32(a >= pow2[16 + j])
    q = np.int32(np.rint(a * pow2[k]))  # pow2[k] = 2^(9 - k) = 2^(3 - e)
    return ((k + 1) << 3) + q - 8 + (np.int32(math.copysign(1.0, y) < 0) << 7)  # the sign bit, -0.0's too


@njit(inline="always", cache=True)
def _up(s, t):  # pragma: no cover - compiled
    """The least fp32 value >= the real ``s * t`` (the product is exact in fp64: 24 + 25 bits)."""
    d = np.float64(s) * t
    f = np.float32(d)
    return np.nextafter(f, np.float32(np.inf)) if np.float64(f) < d else f


@njit(inline="always", cache=True)
def _fp4_codes(v, s, ties, codes):  # pragma: no cover - compiled
    """fp4 e3m0 nibbles of fp32 ``v / s`` into ``codes`` without a division: how many midpoints
    0.125 .. 12 are <= ``fl(|v| / s)``, decided exactly as ``|v| >= `` the midpoint's tie times
    ``s`` rounded up to fp32 (seven thresholds per block, see ``_FP4_TIES``); bit 3 the sign of a
    non-zero code (int32 sums of comparisons vectorise; a uint8 sum does not)."""
    t0, t1, t2, t3 = _up(s, ties[0]), _up(s, ties[1]), _up(s, ties[2]), _up(s, ties[3])
    t4, t5, t6 = _up(s, ties[4]), _up(s, ties[5]), _up(s, ties[6])
    for k in range(v.size):
        a = abs(v[k])
        c = (
            np.int32(a >= t0)
            + np.int32(a >= t1)
            + np.int32(a >= t2)
            + np.int32(a >= t3)
            + np.int32(a >= t4)
            + np.int32(a >= t5)
            + np.int32(a >= t6)
        )
        codes[k] = c + 8 * (np.int32(v[k] < 0) * np.int32(c > 0))


@njit(inline="always", cache=True)
def _int8_code(y):  # pragma: no cover - compiled
    """int8 byte of fp32 ``y``: round half to even, clamp to [-127, 127], two's complement."""
    return np.int32(min(max(np.rint(y), np.float32(-127.0)), np.float32(127.0))) & 0xFF


# Every kernel works on one block (or chunk) at a time through views indexed from 0: an index
# numba cannot prove non-negative gets a wrap-around branch per access, which stops LLVM from
# vectorising the loop (5-10x slower).


@njit(inline="always", cache=True, fastmath={"reassoc"})
def _apply_block(pb, codes, table, s):  # pragma: no cover - compiled
    """``pb += dequantised`` for one block (one fp32 add each: reassociation cannot change it)
    and the sum of squares of the dequantised values in fp64 (in any order: a metric)."""
    part = 0.0
    for k in range(pb.size):
        sent = table[codes[k]] * s
        pb[k] = pb[k] + sent
        part += np.float64(sent) * np.float64(sent)
    return part


@njit(inline="always", cache=True, fastmath={"reassoc", "nsz"})
def _block_absmax(xb, rb, use_r):  # pragma: no cover - compiled
    """``(max |xb + rb|, finite)`` of one block (max is exact in any order; a non-finite value
    makes ``sum(v * 0)`` NaN)."""
    amax = np.float32(0.0)
    z = np.float32(0.0)
    for k in range(xb.size):
        v = xb[k] + rb[k] if use_r else xb[k]
        amax = max(amax, abs(v))
        z += v * np.float32(0.0)
    return amax, z == 0


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
        amax, finite = _block_absmax(x[lo:hi], r[lo:hi], use_r)
        bad += np.int64(not finite)
        scales[b] = max(amax / np.float32(vmax), np.float32(MIN_SCALE)) if amax > 0 else np.float32(1.0)
    return bad


@njit(parallel=True, cache=True)
def _code_pass(x, r, r_out, p, kind, vmax, pow2, ties, table, payload, scales, scaled):  # pragma: no cover - compiled
    """Codes of ``x (+ r)`` into ``payload``, block by block; the block's scale computed here (a
    block is read twice while it is in cache) or, with ``scaled``, taken from ``scales``. Where
    given (size > 0), ``r_out = (x + r) - dequantised`` and ``p += dequantised``. Returns
    (blocks with a non-finite value: nothing meaningful written for them, sum of squares of the
    dequantised values in fp64 when ``p`` is given). Each step of a block is its own loop (codes,
    packing, residual, update), so each vectorises."""
    n = x.size
    nb = scales.size
    use_r, fb, upd = r.size > 0, r_out.size > 0, p.size > 0
    mx = np.float32(vmax)
    chunks = min(nb, 256)
    bads = np.zeros(chunks, dtype=np.int64)  # per chunk, summed after: no parfor reduction
    sqs = np.zeros(chunks, dtype=np.float64)
    for t in prange(chunks):
        codes = np.empty(256, dtype=np.int32)
        vb = np.empty(256, dtype=np.float32)
        part = 0.0
        nbad = 0
        for b in range(t * nb // chunks, (t + 1) * nb // chunks):
            lo = b * 256
            hi = min(lo + 256, n)
            m = hi - lo
            xb, rb, ob, pb = x[lo:hi], r[lo:hi], r_out[lo:hi], p[lo:hi]
            if scaled:
                s = scales[b]
            else:
                amax, finite = _block_absmax(xb, rb, use_r)
                if not finite:
                    nbad += 1
                    continue
                s = max(amax / mx, np.float32(MIN_SCALE)) if amax > 0 else np.float32(1.0)
                scales[b] = s
            if kind == 0:
                if use_r:
                    for k in range(m):
                        vb[k] = xb[k] + rb[k]
                    _fp4_codes(vb[:m], s, ties, codes)
                else:
                    _fp4_codes(xb, s, ties, codes)
                out = payload[lo >> 1 : (hi + 1) >> 1]
                for j in range(m >> 1):  # two values per byte, the first in the low nibble
                    out[j] = np.uint8(codes[2 * j] | (codes[2 * j + 1] << 4))
                if m & 1:
                    out[m >> 1] = np.uint8(codes[m - 1])
            elif kind == 1:
                for k in range(m):
                    codes[k] = _int8_code((xb[k] + rb[k] if use_r else xb[k]) / s)
                out = payload[lo:hi]
                for k in range(m):
                    out[k] = np.uint8(codes[k])
            else:
                for k in range(m):
                    codes[k] = _fp8_code(min(max((xb[k] + rb[k] if use_r else xb[k]) / s, -mx), mx), pow2)
                out = payload[lo:hi]
                for k in range(m):
                    out[k] = np.uint8(codes[k])
            if fb:
                for k in range(m):
                    ob[k] = (xb[k] + rb[k] if use_r else xb[k]) - table[codes[k]] * s
            if upd:
                part += _apply_block(pb, codes, table, s)
        sqs[t] = part
        bads[t] = nbad
    return bads.sum(), sqs.sum()


@njit(parallel=True, cache=True)
def _decode(payload, scales, kind, table, start, out, accumulate):  # pragma: no cover - compiled
    """Decoded values ``[start, start + out.size)`` into ``out`` (``accumulate``: added to it);
    ``start`` a multiple of 256."""
    n = out.size
    for c in prange((n + 255) // 256):
        lo = c * 256
        hi = min(lo + 256, n)
        m = hi - lo
        ob = out[lo:hi]
        s = scales[(start + lo) >> 8]
        if kind == 0:
            src = payload[(start + lo) >> 1 : (start + hi + 1) >> 1]
            for j in range(m >> 1):
                byte = src[j]
                v0 = table[byte & 15] * s
                v1 = table[byte >> 4] * s
                if accumulate:
                    ob[2 * j] = ob[2 * j] + v0
                    ob[2 * j + 1] = ob[2 * j + 1] + v1
                else:
                    ob[2 * j] = v0
                    ob[2 * j + 1] = v1
            if m & 1:
                v0 = table[src[m >> 1] & 15] * s
                ob[m - 1] = ob[m - 1] + v0 if accumulate else v0
        else:
            src = payload[start + lo : start + hi]
            for k in range(m):
                v = table[src[k]] * s
                ob[k] = ob[k] + v if accumulate else v


@njit(parallel=True, cache=True)
def _norm(payload, scales, kind, table, n):  # pragma: no cover - compiled
    """(non-finite decoded values, sum of their squares in fp64) of the first ``n`` values."""
    bad = 0
    sq = 0.0
    for b in prange(scales.size):
        lo = b * 256
        hi = min(lo + 256, n)
        m = hi - lo
        s = scales[b]
        part = 0.0
        nonfinite = 0
        src = payload[lo >> 1 : (hi + 1) >> 1] if kind == 0 else payload[lo:hi]
        for k in range(m):
            code = (src[k >> 1] >> (4 * (k & 1))) & 15 if kind == 0 else src[k]
            v = np.float64(table[code] * s)
            nonfinite += np.int64(not np.isfinite(v))
            part += v * v
        bad += nonfinite
        sq += part
    return bad, sq


_EMPTY = np.zeros(0, dtype=np.float32)


_LAYER_LOCK = threading.Lock()


def _serial() -> Any:
    """A lock around a kernel call where numba's threading layer is ``workqueue`` (not thread
    safe: two threads of one process launching kernels at once abort it; the outer side checks
    messages on several threads while it steps); nothing with ``omp`` (torch ships libgomp) or
    ``tbb``."""
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet: the first call serialises
        return _LAYER_LOCK
    return _LAYER_LOCK if layer == "workqueue" else contextlib.nullcontext()


def _threads() -> None:
    """numba's threads follow torch's (a Ray actor's CPU share), never more than numba started.

    The first call launches numba's pool; with the ``omp`` layer that launch resets OpenMP's
    thread count, which is torch's: torch's count is put back if it changed."""
    n = torch.get_num_threads()
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _check(fmt: str | WireFormat) -> WireFormat:
    """The scaled format ``fmt`` (a name or a format).

    Raises:
        ValueError: an unknown or unscaled format."""
    f = wire_format(fmt)
    if not f.scaled:
        raise ValueError(f"quantization format {f.name!r}: the fused codec takes only a scaled format")
    return f


def _nonfinite(x: np.ndarray, r: np.ndarray | None) -> ValueError:
    value = x if r is None else x + r
    return ValueError(f"cannot encode a pseudo-gradient with {int((~np.isfinite(value)).sum())} non-finite values")


def _encode(
    x: np.ndarray,
    fmt: str | WireFormat,
    residual: np.ndarray | None,
    new_residual: np.ndarray | None,
    params: np.ndarray | None,
    payload: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    f = _check(fmt)
    n = x.size
    if payload is None:
        payload = np.empty(f.payload_nbytes(n), dtype=np.uint8)
    elif payload.dtype != np.uint8 or payload.size != f.payload_nbytes(n) or not payload.flags.c_contiguous:
        raise ValueError(
            f"payload buffer: {payload.size} {payload.dtype} values, {f.name} needs {f.payload_nbytes(n)} uint8"
        )
    scales = np.empty(f.n_scales(n), dtype=np.float32)
    x = x.reshape(-1)
    r = _EMPTY if residual is None else residual.reshape(-1)
    _threads()
    # writing in place (the global values, or a residual overwritten): the scales first, so a
    # refusal leaves everything as it was; else one pass, a refused encoding is dropped
    in_place = params is not None or (
        new_residual is not None and residual is not None and np.shares_memory(new_residual, residual)
    )
    with _serial():
        bad = bool(in_place and _scale_pass(x, r, f.max_value, scales))
        if not bad:
            bad, sq = _code_pass(
                x,
                r,
                _EMPTY if new_residual is None else new_residual.reshape(-1),
                _EMPTY if params is None else params.reshape(-1),
                f.kernel,
                f.max_value,
                _POW2,
                _FP4_TIES,
                f.table,
                payload,
                scales,
                in_place,
            )
    if bad:
        raise _nonfinite(x, residual)
    return payload, scales, float(np.sqrt(sq))


def encode(
    x: np.ndarray,
    fmt: str | WireFormat,
    residual: np.ndarray | None = None,
    new_residual: np.ndarray | None = None,
    payload: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Encode fp32 ``x`` ``[n]`` (plus ``residual`` ``[n]`` when given) in scaled format ``fmt``:
    ``(payload, scales)``, uint8 ``[payload_nbytes(n)]`` and fp32 ``[ceil(n / BLOCK)]``. With
    ``new_residual`` (fp32 ``[n]``, may be ``residual`` itself) it receives ``(x + residual) -
    dequantised`` (error feedback) in the same pass: each block is read for its scale, then again
    from cache for its codes; one write of each output. ``payload``: where to write the packed
    values (uint8 ``[payload_nbytes(n)]``, e.g. a view of the wire message: no copy).

    Raises:
        ValueError: a non-finite value (how many; nothing written), or an unknown format.
    """
    payload, scales, _ = _encode(x, fmt, residual, new_residual, None, payload)
    return payload, scales


def apply_update(
    update: np.ndarray,
    residual: np.ndarray | None,
    params: np.ndarray,
    fmt: str | WireFormat,
    new_residual: np.ndarray | None = None,
    payload: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """The downlink's encode in one pass over fp32 ``[n]`` arrays (Streaming DiLoCo, arXiv
    2501.18512, section 2): encode ``update + residual``, add the dequantised values to ``params``
    in place (what every receiver adds) and write ``(update + residual) - dequantised`` to
    ``new_residual`` (may be ``residual`` itself; None: no error feedback). Returns ``(payload,
    scales, L2 norm of the dequantised update)`` (the norm summed in fp64); ``payload`` as in
    :func:`encode`.

    Raises:
        ValueError: a non-finite value (nothing written), or an unknown format."""
    return _encode(update, fmt, residual, new_residual, params, payload)


def decode_into(
    payload: np.ndarray,
    scales: np.ndarray,
    fmt: str | WireFormat,
    out: np.ndarray,
    start: int = 0,
    accumulate: bool = False,
) -> np.ndarray:
    """Decoded values ``[start, start + out.size)`` of an encoding (``payload`` uint8, ``scales``
    fp32 per block) written into fp32 ``out`` (or added to it: ``accumulate``); returns ``out``.
    ``start`` must be a multiple of ``BLOCK`` (a chunk of whole blocks).

    Raises:
        ValueError: ``start`` not a multiple of ``BLOCK``, or an unknown format."""
    f = _check(fmt)
    if start % BLOCK:
        raise ValueError(f"decode start {start} is not a multiple of {BLOCK}")
    if out.size:
        _threads()
        with _serial():
            _decode(payload, scales, f.kernel, f.table, start, out.reshape(-1), accumulate)
    return out


def norm(payload: np.ndarray, scales: np.ndarray, fmt: str | WireFormat, numel: int) -> float | None:
    """The L2 norm of an encoding's ``numel`` decoded values (summed in fp64, one pass, nothing
    decoded into memory), or None when one is not finite (a malformed or hostile message: the
    encoder never makes one).

    Raises:
        ValueError: an unknown format, or fewer bytes or scales than ``numel`` values need."""
    f = _check(fmt)
    if payload.size < f.payload_nbytes(numel) or scales.size < f.n_scales(numel):
        raise ValueError(
            f"an encoding of {numel} {f.name} values needs more than {payload.size} bytes and {scales.size} scales"
        )
    _threads()
    with _serial():
        bad, sq = _norm(payload, scales[: f.n_scales(numel)], f.kernel, f.table, numel)
    return None if bad or not np.isfinite(sq) else float(np.sqrt(sq))
