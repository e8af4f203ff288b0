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

import math
import struct
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_diloco.config.schema import QUANTIZATION_FORMATS

BLOCK = 256
# the config's streaming.quantization choices; a format's id on the wire is its index here
FORMATS = QUANTIZATION_FORMATS
_FP8_MAX = 448.0
_FP4_EXP = np.arange(-2, 5)  # codes 1..7 -> 2^-2 .. 2^4; code 0 -> 0
_FP4_MAX = 16.0
SCALED = ("fp8_e4m3", "int8", "fp4_e3m0")  # the formats with a scale per block
#: The least block scale, fp32's smallest subnormal 2^-149: a block whose absmax is below
#: ``max_value * 2^-150`` (6e-43 for fp8) would get scale 0 and every value 0 / 0.
MIN_SCALE = 2.0**-149


def fused_codec() -> Any:
    """``core.codec`` (the fused CPU codec), imported on first use: numba takes about a second to
    import and a process that never encodes a scaled format on the host never pays it."""
    from ray_diloco.core import codec

    return codec


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


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32 ``[n]``) as ``[blocks, BLOCK]`` (a view when no padding is needed, else a
    zero-padded copy)."""
    pad = (-x.numel()) % BLOCK
    return (torch.nn.functional.pad(x, (0, pad)) if pad else x).reshape(-1, BLOCK)


def _scales(blocks: torch.Tensor, max_value: float) -> torch.Tensor:
    """Per-block scale ``absmax / max_value`` (fp32 division, correctly rounded on every device)
    raised to ``MIN_SCALE`` (a block of
    subnormals whose scale would round to 0 and encode as NaN), 1 for an all-zero block."""
    absmax = torch.maximum(blocks.amax(dim=1), -blocks.amin(dim=1))  # max |x|, 4x faster than abs().amax on CPU
    # divided by a tensor, not a Python number: CUDA computes `t / scalar` as `t * (1 / scalar)`,
    # an ulp off the correctly rounded quotient the CPU (and the fused codec) computes for 127 and 448
    scale = torch.div(absmax, torch.full_like(absmax, max_value)).clamp_min(MIN_SCALE)
    return torch.where(absmax > 0, scale, torch.ones_like(absmax))


def _host(x: torch.Tensor, fmt: str) -> bool:
    """Whether the fused CPU codec (``core.codec``) encodes or decodes ``x``: a scaled format on
    the host."""
    return fmt in SCALED and x.device.type == "cpu"


def encode_tensor(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode fp32 ``x`` (any shape, flattened) in ``fmt`` on its own device (CPU or GPU: the
    same bits): ``(payload, scales)``, uint8 ``[payload bytes]`` and fp32 ``[blocks]`` (empty for
    the unscaled formats), both on ``x``'s device. A scaled format on the host goes through the
    fused codec (``core.codec``), elsewhere through :func:`encode_tensor_torch`.

    Raises:
        ValueError: unknown format; non-finite values (the fused codec checks them).
    """
    if _host(x, fmt):
        payload, scales = fused_codec().encode(x.detach().reshape(-1).float().contiguous().numpy(), fmt)
        return torch.from_numpy(payload), torch.from_numpy(scales)
    return encode_tensor_torch(x, fmt)


def encode_tensor_torch(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode_tensor` in torch operations, on any device (a GPU's codec, and the tests'
    oracle of ``core.codec``). Does not check finiteness (:func:`encode` does).

    Raises:
        ValueError: unknown format.
    """
    if fmt not in FORMATS:
        raise ValueError(f"quantization format {fmt!r}: must be one of {', '.join(FORMATS)}")
    a = x.detach().reshape(-1).float()
    empty = torch.zeros(0, dtype=torch.float32, device=a.device)
    if fmt == "none":
        return a.contiguous().view(torch.uint8).clone(), empty
    if fmt == "bf16":
        return a.to(torch.bfloat16).view(torch.uint8), empty
    n = a.numel()
    blocks = _blocks(a)
    if fmt == "int8":
        s = _scales(blocks, 127.0)
        q = torch.clamp(torch.round(blocks / s[:, None]), -127, 127).to(torch.int8)
        return q.reshape(-1)[:n].view(torch.uint8).clone(), s
    if fmt == "fp8_e4m3":
        s = _scales(blocks, _FP8_MAX)
        y = torch.clamp(blocks / s[:, None], -_FP8_MAX, _FP8_MAX)
        return y.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1)[:n].clone(), s
    # fp4_e3m0: round |y| to the nearest of {0, 2^-2, ..., 2^4} (midpoints in linear scale)
    s = _scales(blocks, _FP4_MAX)
    nib = _fp4_nibbles(blocks, s)[:n]
    if n % 2:
        nib = torch.cat([nib, nib.new_zeros(1)])
    return nib[0::2] | (nib[1::2] << 4), s


def _check_finite(t: torch.Tensor) -> None:
    """Raise ``ValueError`` (how many values) when ``t`` holds a NaN or an infinity."""
    # a finite sum proves every value finite in one cheap pass (CPU torch's isfinite().all() is 20x slower)
    if not math.isfinite(float(t.sum())) and not bool(torch.isfinite(t).all()):
        raise ValueError(f"cannot encode a pseudo-gradient with {int((~torch.isfinite(t)).sum())} non-finite values")


def encode(x: np.ndarray | torch.Tensor, fmt: str) -> Packed:
    """Encode a float vector (any shape, flattened; fp32 math) in ``fmt`` (on the host).

    Raises:
        ValueError: unknown format, or non-finite values in ``x``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"quantization format {fmt!r}: must be one of {', '.join(FORMATS)}")
    t = (
        x.detach().cpu().float().reshape(-1)
        if isinstance(x, torch.Tensor)
        else torch.from_numpy(np.ascontiguousarray(x, np.float32).reshape(-1))
    )
    if fmt not in SCALED:  # the fused codec checks as it encodes
        _check_finite(t)
    payload, scales = encode_tensor(t, fmt)
    return Packed(fmt, t.numel(), payload.numpy(), scales.numpy())


#: The fp4 rounding thresholds: midpoints between 0, 2^-2, ..., 2^4 (exact in fp32).
_FP4_MIDS = torch.tensor([0.125, 0.375, 0.75, 1.5, 3.0, 6.0, 12.0], dtype=torch.float32)
#: fp32 value of each fp4 nibble: code 0..7 (0, 2^-2 .. 2^4), bit 3 the sign (-0.0 for code 0).
_FP4_VALUES = torch.tensor([0.0, *(2.0**_FP4_EXP), -0.0, *(-(2.0**_FP4_EXP))], dtype=torch.float32)
#: Blocks per chunk of the fp4 encoder (1M values): its temporaries stay small.
_FP4_CHUNK_BLOCKS = 4096


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


def decode_tensor(payload: torch.Tensor, scales: torch.Tensor, numel: int, fmt: str) -> torch.Tensor:
    """fp32 ``[numel]`` from an encoding's ``payload`` (uint8) and ``scales`` (fp32), on their device
    (the inverse of :func:`encode_tensor`; a new tensor): the fused codec on the host.

    Raises:
        ValueError: unknown format."""
    if _host(payload, fmt):
        out = torch.empty(numel, dtype=torch.float32)
        fused_codec().decode_into(payload.numpy(), scales.numpy(), fmt, out.numpy())
        return out
    return decode_tensor_torch(payload, scales, numel, fmt)


def decode_tensor_torch(payload: torch.Tensor, scales: torch.Tensor, numel: int, fmt: str) -> torch.Tensor:
    """:func:`decode_tensor` in torch operations, on any device (a GPU's codec, the tests' oracle).

    Raises:
        ValueError: unknown format."""
    n = numel
    if fmt == "none":
        return payload[: 4 * n].view(torch.float32).clone()
    if fmt == "bf16":
        return payload[: 2 * n].view(torch.bfloat16).float()
    if fmt == "int8":
        vals = payload[:n].view(torch.int8).float()
    elif fmt == "fp8_e4m3":
        vals = payload[:n].view(torch.float8_e4m3fn).float()
    elif fmt == "fp4_e3m0":
        nib = torch.stack([payload & 0x0F, payload >> 4], dim=1).reshape(-1)[:n]
        vals = _FP4_VALUES.to(payload.device).index_select(0, nib.int())
    else:
        raise ValueError(f"quantization format {fmt!r}: must be one of {', '.join(FORMATS)}")
    if n % BLOCK == 0:  # in place: no padded copy
        vals.view(-1, BLOCK).mul_(scales[:, None])
        return vals
    return (_blocks(vals) * scales[:, None]).reshape(-1)[:n].contiguous()


def decode(p: Packed) -> np.ndarray:
    """fp32 vector ``[p.numel]`` from an encoding (on the host)."""
    with warnings.catch_warnings():  # a read-only payload (a message's bytes): read, never written
        warnings.simplefilter("ignore", UserWarning)
        payload = torch.from_numpy(np.ascontiguousarray(p.payload, dtype=np.uint8))
        scales = torch.from_numpy(np.ascontiguousarray(p.scales, dtype=np.float32))
    return decode_tensor(payload, scales, p.numel, p.format).numpy()


# ---------------------------------------------------------------------------------------
# the wire message: what one replica sends (or receives) for one fragment sync

_HEADER = struct.Struct("<4sBQ")  # magic, format id, numel
_MAGIC = b"RDQ1"


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
    n_scales = -(-numel // BLOCK) if fmt in SCALED else 0
    width = message_nbytes(numel, fmt) - _HEADER.size - 4 * n_scales
    if len(msg) != message_nbytes(numel, fmt):
        raise ValueError(f"wire message of {len(msg)} bytes does not match its header ({fmt}, {numel} values)")
    buf = memoryview(msg)
    scales = np.frombuffer(buf, np.float32, n_scales, _HEADER.size)
    payload = np.frombuffer(buf, np.uint8, width, _HEADER.size + 4 * n_scales)
    return Packed(fmt, int(numel), payload, scales)


def quantize_message(x: torch.Tensor, fmt: str, residual: torch.Tensor | None = None) -> tuple[bytes, torch.Tensor]:
    """Encode fp32 ``x`` ``[n]`` for the wire, with optional error feedback, on ``x``'s device (a
    GPU: only the encoded bytes are copied to the host; the bits are those of the host).

    With ``residual`` (fp32 ``[n]``, last round's quantisation error) the value encoded is
    ``x + residual``. Returns ``(message, dequantised)`` (host bytes, and fp32 ``[n]`` on ``x``'s
    device); the caller's new residual is ``(x + residual) - dequantised``.

    Raises:
        ValueError: non-finite values in ``x`` (or the residual).
    """
    value = (x if residual is None else x + residual).reshape(-1).float()
    _check_finite(value)
    payload, scales = encode_tensor(value, fmt)
    sent = decode_tensor(payload, scales, value.numel(), fmt)
    return to_message(Packed(fmt, value.numel(), payload.cpu().numpy(), scales.cpu().numpy())), sent


def new_frame(fmt: str, numel: int) -> tuple[np.ndarray, np.ndarray]:
    """An uninitialised wire message of ``numel`` values in scaled format ``fmt`` (uint8
    ``[message_nbytes]``, its header written) and the view of it its packed values go into: an
    encoder writes there directly (no copy of the payload into a message)."""
    n_scales = -(-numel // BLOCK)
    buf = np.empty(message_nbytes(numel, fmt), dtype=np.uint8)
    buf[: _HEADER.size] = np.frombuffer(_HEADER.pack(_MAGIC, FORMATS.index(fmt), numel), np.uint8)
    return buf, buf[_HEADER.size + 4 * n_scales :]


def set_frame_scales(buf: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Write fp32 ``scales`` into a :func:`new_frame` message; returns it."""
    buf[_HEADER.size : _HEADER.size + scales.nbytes] = scales.view(np.uint8)
    return buf


def encode_message(
    x: torch.Tensor, fmt: str, residual: torch.Tensor | None = None, new_residual: torch.Tensor | None = None
) -> Any:
    """The wire message of fp32 ``x`` ``[n]`` (plus ``residual`` ``[n]``, last round's quantisation
    error, when given), with error feedback: ``new_residual`` (fp32 ``[n]``, when given) receives
    what the encoding lost, ``(x + residual) - dequantised``, to add to the next round's value
    (Streaming DiLoCo, arXiv 2501.18512, section 2). On the host a scaled format is one fused pass
    (``core.codec.encode``: no fp32 temporaries; the packed values written into the message, a
    uint8 array); on a GPU the torch codec (the same bits, as bytes).

    Raises:
        ValueError: non-finite values (nothing written to ``new_residual``).
    """
    n = x.numel()
    if _host(x, fmt) and (residual is None or residual.device.type == "cpu"):
        message, payload = new_frame(fmt, n)
        _, scales = fused_codec().encode(
            x.detach().reshape(-1).contiguous().numpy(),
            fmt,
            None if residual is None else residual.reshape(-1).contiguous().numpy(),
            None if new_residual is None else new_residual.reshape(-1).numpy(),
            payload,
        )
        return set_frame_scales(message, scales)
    value = x if residual is None else x + residual
    framed, sent = quantize_message(value, fmt)
    if new_residual is not None:
        torch.sub(value.reshape(-1), sent, out=new_residual.reshape(-1))
    return framed


def quantize_with_feedback(x: torch.Tensor, fmt: str, residual: torch.Tensor | None) -> tuple[bytes, torch.Tensor]:
    """Error feedback: encode ``x + residual`` (fp32 ``[n]``; ``residual`` None: zero) and return
    ``(message, new residual)`` (:func:`encode_message` into a new tensor on ``x``'s device).

    Raises:
        ValueError: non-finite values.
    """
    new = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
    return bytes(encode_message(x, fmt, residual, new)), new


def message_nbytes(numel: int, fmt: str) -> int:
    """Length of :func:`to_message` for ``numel`` values in ``fmt`` (header + scales + payload)."""
    n_scales = -(-numel // BLOCK) if fmt in SCALED else 0
    width = {"none": 4 * numel, "bf16": 2 * numel, "fp8_e4m3": numel, "int8": numel, "fp4_e3m0": (numel + 1) // 2}[fmt]
    return _HEADER.size + 4 * n_scales + width
