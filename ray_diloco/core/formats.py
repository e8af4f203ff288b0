"""The wire formats of the outer exchange, each one object, and the frame a message is sent in
(Streaming DiLoCo, arXiv 2501.18512, section 2: each replica's unreduced pseudo-gradient leaves
the replica in low precision; the reduction and accumulation happen in fp32).

Scaling scheme (the paper does not give one): the flat fp32 vector is cut into blocks of
``BLOCK`` values; each block is divided by its own scale ``absmax / max_value`` (fp32 division,
at least ``MIN_SCALE``; 1 for an all-zero block), so its largest value lands on the format's
largest finite value. Formats (``streaming.quantization``):

============  ==============================================  =====================
format        values                                          bytes per value
============  ==============================================  =====================
``none``      fp32, unscaled, sent raw (no frame)             4
``bf16``      bfloat16, unscaled (fp32's exponent range)      2
``fp8_e4m3``  float8 e4m3fn (max 448), round to nearest even  1 + scales
``int8``      round(x / scale) in [-127, 127]                 1 + scales
``fp4_e3m0``  sign + 3-bit exponent, no mantissa: 0 and       0.5 + scales
              +-2^k for k in -2..4 (max 16), two per byte
============  ==============================================  =====================

A :class:`WireFormat` knows its sizes, its torch encode and decode (any device: a GPU's codec,
and the tests' oracle of the fused CPU codec, ``core.codec``, which reads the scaled formats'
``kernel``, ``max_value`` and ``table`` from here), and the planner's measured codec cost. A new
format is one subclass added to :data:`FORMATS` (and to the config's ``QuantFormat``); nothing
else branches on a format's name.

The frame (:func:`new_frame`, :func:`set_frame_scales`, :func:`parse`): a 13-byte header (magic,
format id, numel), the fp32 block scales, then the packed values; its length is the exact number
of bytes the exchange counts.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_diloco.config.schema import QUANTIZATION_FORMATS

#: Values per scale block (the fused codec's kernels index by it).
BLOCK = 256
#: The least block scale, fp32's smallest subnormal 2^-149: a block whose absmax is below
#: ``max_value * 2^-150`` (6e-43 for fp8) would get scale 0 and every value 0 / 0.
MIN_SCALE = 2.0**-149

_HEADER = struct.Struct("<4sBQ")  # magic, format id, numel
_MAGIC = b"RDQ1"
#: Bytes of a frame's header.
HEADER_NBYTES = _HEADER.size


def all_finite(x: torch.Tensor) -> bool:
    """Whether every value of ``x`` is finite, in one read pass: a finite sum proves it (a NaN or
    an infinity makes the sum non-finite; CPU torch's ``isfinite().all()`` is 20x slower); only
    an overflowing sum of finite values needs the element-wise check."""
    return math.isfinite(float(x.sum())) or bool(torch.isfinite(x).all())


def check_finite(x: torch.Tensor) -> None:
    """Raise ``ValueError`` (how many values) when ``x`` holds a NaN or an infinity."""
    if not all_finite(x):
        raise ValueError(f"cannot encode a pseudo-gradient with {int((~torch.isfinite(x)).sum())} non-finite values")


@dataclass(frozen=True)
class WireFormat:
    """One wire format: what a value costs on the wire and how it is encoded.

    Attributes:
        name: the ``streaming.quantization`` value. id: its byte in a frame's header.
        bits: bits per value in the payload.
        max_value: the largest finite value a block's absmax is scaled onto; None: unscaled.
        raw: fp32 values sent as they are (no frame: zero-copy through the object store); its
            downlink carries the new global values, a lossy format's the quantised update.
        kernel: the fused CPU codec's kernel id (``core.codec``); -1: not a scaled format.
        encode_s, decode_s: seconds per value and thread of the fused codec (the planner's model,
            ``analysis.plan.codec_crossover``): the encode with error feedback, the decode added
            into an fp32 buffer; measured with ``python benchmarks/codec.py`` (100M values, 2
            threads, 2026-12-03, docs/benchmarks.md). 0 for unscaled formats.
    """

    name: str
    id: int
    bits: int
    max_value: float | None = None
    raw: bool = False
    kernel: int = -1
    encode_s: float = 0.0
    decode_s: float = 0.0

    @property
    def scaled(self) -> bool:
        """Whether the format has a scale per block (the fused CPU codec encodes it on the host)."""
        return self.max_value is not None

    @property
    def table(self) -> np.ndarray:
        """fp32 value of each payload code (a scaled format's decode table, ``[2^bits]``)."""
        raise ValueError(f"quantization format {self.name!r} has no decode table")

    def payload_nbytes(self, numel: int) -> int:
        """Bytes of the packed values of ``numel`` values."""
        return (numel * self.bits + 7) // 8

    def n_scales(self, numel: int) -> int:
        """fp32 block scales of ``numel`` values (0 unscaled)."""
        return -(-numel // BLOCK) if self.scaled else 0

    def message_nbytes(self, numel: int) -> int:
        """Bytes of a frame of ``numel`` values (header + scales + payload); a raw message counts
        as its frame would."""
        return HEADER_NBYTES + 4 * self.n_scales(numel) + self.payload_nbytes(numel)

    def encode_torch(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode fp32 ``x`` (flattened) in torch operations on its device: ``(payload, scales)``,
        uint8 ``[payload_nbytes]`` and fp32 ``[n_scales]``, both on ``x``'s device, the bits of
        the fused CPU codec. Does not check finiteness."""
        a = x.detach().reshape(-1).float()
        if not self.scaled:
            return self._pack(a), torch.zeros(0, dtype=torch.float32, device=a.device)
        n = a.numel()
        blocks = _blocks(a)
        s = _scales(blocks, float(self.max_value))  # type: ignore[arg-type]
        return self._pack_scaled(blocks, s, n), s

    def decode_torch(self, payload: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        """fp32 ``[numel]`` from ``payload`` (uint8) and ``scales`` (fp32) on their device (the
        inverse of :meth:`encode_torch`; a new tensor)."""
        vals = self._unpack(payload, numel)
        if not self.scaled:
            return vals
        if numel % BLOCK == 0:  # in place: no padded copy
            vals.view(-1, BLOCK).mul_(scales[:, None])
            return vals
        return (_blocks(vals) * scales[:, None]).reshape(-1)[:numel].contiguous()

    def _pack(self, a: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _pack_scaled(self, blocks: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
        raise NotImplementedError

    def _unpack(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        """The payload's ``n`` values as fp32 (before scaling)."""
        raise NotImplementedError


class _Fp32(WireFormat):
    def _pack(self, a: torch.Tensor) -> torch.Tensor:
        return a.contiguous().view(torch.uint8).clone()

    def _unpack(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        return payload[: 4 * n].view(torch.float32).clone()


class _Bf16(WireFormat):
    def _pack(self, a: torch.Tensor) -> torch.Tensor:
        return a.to(torch.bfloat16).view(torch.uint8)

    def _unpack(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        return payload[: 2 * n].view(torch.bfloat16).float()


class _Int8(WireFormat):
    """``round_half_even(x / scale)`` clamped to [-127, 127]."""

    @property
    def table(self) -> np.ndarray:
        return _INT8_VALUES

    def _pack_scaled(self, blocks: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
        q = torch.clamp(torch.round(blocks / scales[:, None]), -127, 127).to(torch.int8)
        return q.reshape(-1)[:n].view(torch.uint8).clone()

    def _unpack(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        return payload[:n].view(torch.int8).float()


class _Fp8(WireFormat):
    """``x / scale`` clamped to [-448, 448], rounded to nearest even float8 e4m3fn."""

    @property
    def table(self) -> np.ndarray:
        return _FP8_VALUES

    def _pack_scaled(self, blocks: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
        m = float(self.max_value)  # type: ignore[arg-type]
        y = torch.clamp(blocks / scales[:, None], -m, m)
        return y.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1)[:n].clone()

    def _unpack(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        return payload[:n].view(torch.float8_e4m3fn).float()


class _Fp4(WireFormat):
    """``|x / scale|`` rounded to the nearest of {0, 2^-2, ..., 2^4} (midpoints in linear scale),
    bit 3 the sign of a non-zero code, two values per byte (the first in the low nibble)."""

    @property
    def table(self) -> np.ndarray:
        return _FP4_VALUES.numpy()

    def _pack_scaled(self, blocks: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
        nib = _fp4_nibbles(blocks, scales)[:n]
        if n % 2:
            nib = torch.cat([nib, nib.new_zeros(1)])
        return nib[0::2] | (nib[1::2] << 4)

    def _unpack(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        nib = torch.stack([payload & 0x0F, payload >> 4], dim=1).reshape(-1)[:n]
        return _FP4_VALUES.to(payload.device).index_select(0, nib.int())


#: Every format, in the config's order (a format's id on the wire is its index).
FORMATS: tuple[WireFormat, ...] = (
    _Fp32("none", 0, 32, raw=True),
    _Bf16("bf16", 1, 16),
    _Fp8("fp8_e4m3", 2, 8, max_value=448.0, kernel=2, encode_s=6.6e-9, decode_s=0.40e-9),
    _Int8("int8", 3, 8, max_value=127.0, kernel=1, encode_s=1.7e-9, decode_s=0.42e-9),
    _Fp4("fp4_e3m0", 4, 4, max_value=16.0, kernel=0, encode_s=1.8e-9, decode_s=0.36e-9),
)
assert tuple(f.name for f in FORMATS) == QUANTIZATION_FORMATS and all(i == f.id for i, f in enumerate(FORMATS))
_BY_NAME = {f.name: f for f in FORMATS}
#: The format of fp32 values sent raw (a resync's, and ``none``'s).
RAW = FORMATS[0]


def wire_format(fmt: str | WireFormat) -> WireFormat:
    """The :class:`WireFormat` named ``fmt`` (a format is returned as it is).

    Raises:
        ValueError: an unknown name (naming the allowed ones)."""
    if isinstance(fmt, WireFormat):
        return fmt
    f = _BY_NAME.get(fmt)
    if f is None:
        raise ValueError(f"quantization format {fmt!r}: must be one of {', '.join(_BY_NAME)}")
    return f


# -- the torch codec's pieces ----------------------------------------------------------------

#: fp32 value of each fp4 nibble: code 0..7 (0, 2^-2 .. 2^4), bit 3 the sign (-0.0 for code 0).
_FP4_VALUES = torch.tensor([0.0, 0.25, 0.5, 1, 2, 4, 8, 16, -0.0, -0.25, -0.5, -1, -2, -4, -8, -16])
#: The fp4 rounding thresholds: midpoints between 0, 2^-2, ..., 2^4 (exact in fp32).
_FP4_MIDS = torch.tensor([0.125, 0.375, 0.75, 1.5, 3.0, 6.0, 12.0], dtype=torch.float32)
#: Blocks per chunk of the fp4 encoder (1M values): its temporaries stay small.
_FP4_CHUNK_BLOCKS = 4096
#: fp32 value of each float8 e4m3fn byte (NaN for 0x7F and 0xFF, which the encoder never makes).
_FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
#: fp32 value of each int8 byte (its two's-complement integer).
_INT8_VALUES = np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32 ``[n]``) as ``[blocks, BLOCK]`` (a view when no padding is needed, else a
    zero-padded copy)."""
    pad = (-x.numel()) % BLOCK
    return (torch.nn.functional.pad(x, (0, pad)) if pad else x).reshape(-1, BLOCK)


def _scales(blocks: torch.Tensor, max_value: float) -> torch.Tensor:
    """Per-block scale ``absmax / max_value`` (fp32 division, correctly rounded on every device)
    raised to ``MIN_SCALE`` (a block of subnormals whose scale would round to 0 and encode as
    NaN), 1 for an all-zero block."""
    absmax = torch.maximum(blocks.amax(dim=1), -blocks.amin(dim=1))  # max |x|, 4x faster than abs().amax on CPU
    # divided by a tensor, not a Python number: CUDA computes `t / scalar` as `t * (1 / scalar)`,
    # an ulp off the correctly rounded quotient the CPU (and the fused codec) computes for 127 and 448
    scale = torch.div(absmax, torch.full_like(absmax, max_value)).clamp_min(MIN_SCALE)
    return torch.where(absmax > 0, scale, torch.ones_like(absmax))


def _fp4_nibbles(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp4 nibble (sign << 3 | code) of every value of ``blocks`` ``[nb, BLOCK]`` divided by its
    block's scale, as uint8 ``[nb * BLOCK]`` on their device; computed in chunks of blocks (fp32
    division, then the code is the number of thresholds <= |y|: searchsorted 'right')."""
    out = torch.empty(blocks.numel(), dtype=torch.uint8, device=blocks.device)
    mids = _FP4_MIDS.to(blocks.device)
    for b0 in range(0, blocks.shape[0], _FP4_CHUNK_BLOCKS):
        y = (blocks[b0 : b0 + _FP4_CHUNK_BLOCKS] / scales[b0 : b0 + _FP4_CHUNK_BLOCKS, None]).reshape(-1)
        code = torch.searchsorted(mids, y.abs(), right=True, out_int32=True)
        code |= ((y < 0) & (code > 0)).to(torch.int32) << 3
        out[b0 * BLOCK : b0 * BLOCK + code.numel()] = code.to(torch.uint8)
    return out


# -- the frame -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Packed:
    """An encoded fp32 vector: ``payload`` (uint8 bytes on the wire), ``scales`` (fp32 per block,
    empty for unscaled formats), ``numel`` and ``format`` (its name)."""

    format: str
    numel: int
    payload: np.ndarray
    scales: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes this encoding puts on the wire (payload + scales)."""
        return int(self.payload.nbytes + self.scales.nbytes)


def new_frame(fmt: WireFormat, numel: int) -> tuple[np.ndarray, np.ndarray]:
    """An uninitialised message of ``numel`` values in ``fmt`` (uint8 ``[message_nbytes]``, its
    header written) and the view of it the packed values go into: an encoder writes there
    directly (no copy of the payload into a message)."""
    buf = np.empty(fmt.message_nbytes(numel), dtype=np.uint8)
    buf[:HEADER_NBYTES] = np.frombuffer(_HEADER.pack(_MAGIC, fmt.id, numel), np.uint8)
    return buf, buf[HEADER_NBYTES + 4 * fmt.n_scales(numel) :]


def set_frame_scales(buf: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Write fp32 ``scales`` into a :func:`new_frame` message; returns it."""
    buf[HEADER_NBYTES : HEADER_NBYTES + scales.nbytes] = scales.view(np.uint8)
    return buf


def parse(msg: Any) -> Packed:
    """The encoding a frame carries (zero-copy views into ``msg``).

    Raises:
        ValueError: if ``msg`` is not a well-formed message."""
    if len(msg) < HEADER_NBYTES:
        raise ValueError(f"wire message of {len(msg)} bytes is shorter than its header")
    magic, fid, numel = _HEADER.unpack_from(msg)
    if magic != _MAGIC or fid >= len(FORMATS):
        raise ValueError("not a ray-diloco wire message (bad magic or format id)")
    fmt = FORMATS[fid]
    if len(msg) != fmt.message_nbytes(numel):
        raise ValueError(f"wire message of {len(msg)} bytes does not match its header ({fmt.name}, {numel} values)")
    buf, n_scales = memoryview(msg), fmt.n_scales(numel)
    scales = np.frombuffer(buf, np.float32, n_scales, HEADER_NBYTES)
    payload = np.frombuffer(buf, np.uint8, fmt.payload_nbytes(numel), HEADER_NBYTES + 4 * n_scales)
    return Packed(fmt.name, int(numel), payload, scales)


def to_message(p: Packed) -> bytes:
    """The frame of an encoding: the bytes sent on the wire (``len()`` is what the exchange
    counts)."""
    buf, payload = new_frame(wire_format(p.format), p.numel)
    payload[:] = p.payload.reshape(-1)
    return set_frame_scales(buf, np.ascontiguousarray(p.scales, np.float32)).tobytes()
