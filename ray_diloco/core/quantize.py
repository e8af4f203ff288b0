"""Low-precision encodings of pseudo-gradients for the wire (Streaming DiLoCo, arXiv 2501.18512,
section 2: each replica's unreduced pseudo-gradient leaves the replica in low precision; the
reduction and accumulation happen in fp32).

Scaling scheme (the paper does not give one): the flat fp32 vector is cut into blocks of
``BLOCK`` values; each block is divided by its own scale ``absmax / max_representable`` (fp32,
4 bytes per block) so its largest value lands on the format's largest finite value. An all-zero
block gets scale 1. Formats:

============  ==============================================  =====================
format        values                                          bytes per value
============  ==============================================  =====================
``none``      fp32, unscaled                                  4
``bf16``      bfloat16, unscaled (fp32's exponent range)      2
``fp8_e4m3``  float8 e4m3fn (max 448), round to nearest even  1 + scales
``int8``      round(x / scale) in [-127, 127]                 1 + scales
``fp4_e3m0``  sign + 3-bit exponent, no mantissa: 0 and       0.5 + scales
              +-2^k for k in -2..4 (max 16), two per byte
============  ==============================================  =====================

:func:`encode` returns a :class:`Packed` whose ``payload`` is the real bytes sent; :func:`decode`
gives fp32 back. Non-finite input is rejected (:class:`ValueError`), so a replica's NaN never
reaches the outer optimiser through a scale.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from ray_diloco.config.schema import QUANTIZATION_FORMATS

BLOCK = 256
# the config's streaming.quantization choices; a format's id on the wire is its index here
FORMATS = QUANTIZATION_FORMATS
_FP8_MAX = 448.0
_FP4_EXP = np.arange(-2, 5)  # codes 1..7 -> 2^-2 .. 2^4; code 0 -> 0
_FP4_MAX = 16.0


@dataclass(frozen=True)
class Packed:
    """An encoded fp32 vector: ``payload`` (uint8 bytes on the wire), ``scales`` (fp32 per block,
    empty for unscaled formats), ``numel`` and ``format``."""

    format: str
    numel: int
    payload: np.ndarray
    scales: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes this encoding puts on the wire (payload + scales)."""
        return int(self.payload.nbytes + self.scales.nbytes)


def _blocks(x: np.ndarray) -> tuple[np.ndarray, int]:
    """``x`` as ``[blocks, BLOCK]`` (a view when no padding is needed, else a zero-padded copy)."""
    pad = (-x.size) % BLOCK
    return (np.pad(x, (0, pad)) if pad else x).reshape(-1, BLOCK), pad


def _scales(blocks: np.ndarray, max_value: float) -> np.ndarray:
    absmax = np.abs(blocks).max(axis=1)
    return np.where(absmax > 0, absmax / max_value, 1.0).astype(np.float32)


def encode(x: np.ndarray | torch.Tensor, fmt: str) -> Packed:
    """Encode a float vector (any shape, flattened; fp32 math) in ``fmt``.

    Raises:
        ValueError: unknown format, or non-finite values in ``x``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"quantization format {fmt!r}: must be one of {', '.join(FORMATS)}")
    a = (x.detach().cpu().float().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float32)).reshape(-1)
    if not np.isfinite(a).all():
        raise ValueError(f"cannot encode a pseudo-gradient with {int((~np.isfinite(a)).sum())} non-finite values")
    empty = np.zeros(0, np.float32)
    if fmt == "none":
        return Packed(fmt, a.size, a.astype(np.float32).view(np.uint8).copy(), empty)
    if fmt == "bf16":
        bits = torch.from_numpy(a.copy()).to(torch.bfloat16).view(torch.int16).numpy()
        return Packed(fmt, a.size, bits.view(np.uint8).copy(), empty)
    blocks, _ = _blocks(a)
    if fmt == "int8":
        s = _scales(blocks, 127.0)
        q = np.clip(np.rint(blocks / s[:, None]), -127, 127).astype(np.int8)
        return Packed(fmt, a.size, q.reshape(-1)[: a.size].view(np.uint8).copy(), s)
    if fmt == "fp8_e4m3":
        s = _scales(blocks, _FP8_MAX)
        y = np.clip(blocks / s[:, None], -_FP8_MAX, _FP8_MAX)
        q = torch.from_numpy(y.astype(np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return Packed(fmt, a.size, q.reshape(-1)[: a.size].copy(), s)
    # fp4_e3m0: round |y| to the nearest of {0, 2^-2, ..., 2^4} (midpoints in linear scale)
    s = _scales(blocks, _FP4_MAX)
    nib = _fp4_nibbles(blocks, s)[: a.size]
    if nib.size % 2:
        nib = np.append(nib, np.uint8(0))
    packed = nib[0::2] | (nib[1::2] << 4)
    return Packed(fmt, a.size, packed, s)


#: The fp4 rounding thresholds: midpoints between 0, 2^-2, ..., 2^4 (exact in fp32).
_FP4_MIDS = torch.tensor([0.125, 0.375, 0.75, 1.5, 3.0, 6.0, 12.0], dtype=torch.float32)
#: fp32 value of each fp4 nibble: code 0..7 (0, 2^-2 .. 2^4), bit 3 the sign (-0.0 for code 0).
_FP4_VALUES = np.array([0.0, *(2.0 ** _FP4_EXP), -0.0, *(-(2.0 ** _FP4_EXP))], np.float32)
#: Blocks per chunk of the fp4 encoder (1M values): its temporaries stay small.
_FP4_CHUNK_BLOCKS = 4096


def _fp4_nibbles(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The fp4 nibble (sign << 3 | code) of every value of ``blocks`` ``[nb, BLOCK]`` divided by its
    block's scale, as uint8 ``[nb * BLOCK]``; computed in chunks of blocks with torch (fp32
    division, then the code is the number of thresholds <= |y|: numpy's searchsorted 'right')."""
    out = np.empty(blocks.size, np.uint8)
    bt, st, ot = torch.from_numpy(blocks), torch.from_numpy(scales), torch.from_numpy(out)
    for b0 in range(0, blocks.shape[0], _FP4_CHUNK_BLOCKS):
        y = (bt[b0 : b0 + _FP4_CHUNK_BLOCKS] / st[b0 : b0 + _FP4_CHUNK_BLOCKS, None]).reshape(-1)
        code = torch.searchsorted(_FP4_MIDS, y.abs(), right=True, out_int32=True)
        code |= ((y < 0) & (code > 0)).to(torch.int32) << 3
        ot[b0 * BLOCK : b0 * BLOCK + code.numel()] = code.to(torch.uint8)
    return out


def decode(p: Packed) -> np.ndarray:
    """fp32 vector ``[p.numel]`` from an encoding."""
    n = p.numel
    if p.format == "none":
        return p.payload.view(np.float32)[:n].copy()
    if p.format == "bf16":
        return torch.from_numpy(p.payload.view(np.int16).copy()).view(torch.bfloat16).float().numpy()[:n]
    if p.format == "int8":
        vals = p.payload.view(np.int8).astype(np.float32)
    elif p.format == "fp8_e4m3":
        vals = torch.from_numpy(p.payload.copy()).view(torch.float8_e4m3fn).float().numpy()
    elif p.format == "fp4_e3m0":
        nib = np.empty(p.payload.size * 2, np.uint8)
        nib[0::2], nib[1::2] = p.payload & 0x0F, p.payload >> 4
        vals = _FP4_VALUES[nib[:n]]  # a new fp32 array
    else:
        raise ValueError(f"quantization format {p.format!r}: must be one of {', '.join(FORMATS)}")
    if n % BLOCK == 0:  # in place: no padded copy
        blocks = vals.reshape(-1, BLOCK)
        blocks *= p.scales[:, None]
        return vals
    pad = (-n) % BLOCK
    blocks = np.pad(vals, (0, pad)).reshape(-1, BLOCK) * p.scales[:, None]
    return blocks.reshape(-1)[:n].astype(np.float32)


# ---------------------------------------------------------------------------------------
# the wire message: what one replica sends (or receives) for one fragment sync

_HEADER = struct.Struct("<4sBQ")  # magic, format id, numel
_MAGIC = b"RDQ1"
_SCALED = ("fp8_e4m3", "int8", "fp4_e3m0")


def to_message(p: Packed) -> bytes:
    """Serialise an encoding to the bytes sent on the wire: a 13-byte header (magic, format,
    numel), the fp32 block scales, then the packed values. ``len()`` of the result is the
    exact number of bytes the exchange counts."""
    return _HEADER.pack(_MAGIC, FORMATS.index(p.format), p.numel) + p.scales.tobytes() + p.payload.tobytes()


def from_message(msg: bytes) -> Packed:
    """Inverse of :func:`to_message` (zero-copy views into ``msg``).

    Raises:
        ValueError: if ``msg`` is not a well-formed message.
    """
    if len(msg) < _HEADER.size:
        raise ValueError(f"wire message of {len(msg)} bytes is shorter than its header")
    magic, fid, numel = _HEADER.unpack_from(msg)
    if magic != _MAGIC or fid >= len(FORMATS):
        raise ValueError("not a ray-diloco wire message (bad magic or format id)")
    fmt = FORMATS[fid]
    n_scales = -(-numel // BLOCK) if fmt in _SCALED else 0
    width = message_nbytes(numel, fmt) - _HEADER.size - 4 * n_scales
    if len(msg) != message_nbytes(numel, fmt):
        raise ValueError(f"wire message of {len(msg)} bytes does not match its header ({fmt}, {numel} values)")
    buf = memoryview(msg)
    scales = np.frombuffer(buf, np.float32, n_scales, _HEADER.size)
    payload = np.frombuffer(buf, np.uint8, width, _HEADER.size + 4 * n_scales)
    return Packed(fmt, int(numel), payload, scales)


def quantize_message(x: torch.Tensor, fmt: str, residual: torch.Tensor | None = None) -> tuple[bytes, torch.Tensor]:
    """Encode fp32 ``x`` ``[n]`` for the wire, with optional error feedback.

    With ``residual`` (fp32 ``[n]``, last round's quantisation error) the value encoded is
    ``x + residual``. Returns ``(message, dequantised)``; the caller's new residual is
    ``(x + residual) - dequantised``.

    Raises:
        ValueError: non-finite values in ``x`` (or the residual).
    """
    value = x if residual is None else x + residual
    packed = encode(value, fmt)
    return to_message(packed), torch.from_numpy(decode(packed))


def quantize_with_feedback(x: torch.Tensor, fmt: str, residual: torch.Tensor | None) -> tuple[bytes, torch.Tensor]:
    """Error feedback: encode ``x + residual`` (fp32 ``[n]``; ``residual`` None: zero) and return
    ``(message, new residual)``, the new residual being what the encoding lost,
    ``(x + residual) - dequantised``, to add to the next round's value.

    Raises:
        ValueError: non-finite values.
    """
    value = x if residual is None else x + residual
    message, sent = quantize_message(value, fmt)
    return message, value - sent


def message_nbytes(numel: int, fmt: str) -> int:
    """Length of :func:`to_message` for ``numel`` values in ``fmt`` (header + scales + payload)."""
    n_scales = -(-numel // BLOCK) if fmt in _SCALED else 0
    width = {"none": 4 * numel, "bf16": 2 * numel, "fp8_e4m3": numel, "int8": numel, "fp4_e3m0": (numel + 1) // 2}[fmt]
    return _HEADER.size + 4 * n_scales + width
