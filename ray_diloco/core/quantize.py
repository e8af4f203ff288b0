"""Encoding and decoding pseudo-gradients and outer updates for the wire, on the device they are
on (Streaming DiLoCo, arXiv 2501.18512, section 2: quantised exchange with error feedback).

The formats themselves (sizes, torch codec, frame) are ``core.formats``; this module picks the
codec for a tensor: a scaled format on the host goes through the fused CPU codec
(``core.codec``, one pass, multi-threaded), anything else through the format's torch codec
(``WireFormat.encode_torch``: the same bits on every device). Non-finite input is rejected
(``ValueError``), so a replica's NaN never reaches the outer optimiser through a scale.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from ray_diloco.core.formats import (
    Packed,
    WireFormat,
    check_finite,
    new_frame,
    set_frame_scales,
    to_message,
    wire_format,
)


def fused_codec() -> Any:
    """``core.codec`` (the fused CPU codec), imported on first use: numba takes about a second to
    import and a process that never encodes a scaled format on the host never pays it."""
    from ray_diloco.core import codec

    return codec


def _host(x: torch.Tensor, f: WireFormat) -> bool:
    """Whether the fused CPU codec (``core.codec``) encodes or decodes ``x``: a scaled format on
    the host."""
    return f.scaled and x.device.type == "cpu"


def encode_tensor(x: torch.Tensor, fmt: str | WireFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode fp32 ``x`` (any shape, flattened) in ``fmt`` on its own device (CPU or GPU: the
    same bits): ``(payload, scales)``, uint8 ``[payload bytes]`` and fp32 ``[blocks]`` (empty for
    the unscaled formats), both on ``x``'s device.

    Raises:
        ValueError: unknown format; non-finite values (only the fused codec checks them).
    """
    f = wire_format(fmt)
    if _host(x, f):
        payload, scales = fused_codec().encode(x.detach().reshape(-1).float().contiguous().numpy(), f)
        return torch.from_numpy(payload), torch.from_numpy(scales)
    return f.encode_torch(x)


def decode_tensor(payload: torch.Tensor, scales: torch.Tensor, numel: int, fmt: str | WireFormat) -> torch.Tensor:
    """fp32 ``[numel]`` from an encoding's ``payload`` (uint8) and ``scales`` (fp32), on their device
    (the inverse of :func:`encode_tensor`; a new tensor).

    Raises:
        ValueError: unknown format."""
    f = wire_format(fmt)
    if _host(payload, f):
        out = torch.empty(numel, dtype=torch.float32)
        fused_codec().decode_into(payload.numpy(), scales.numpy(), f, out.numpy())
        return out
    return f.decode_torch(payload, scales, numel)


def decode(p: Packed) -> np.ndarray:
    """fp32 vector ``[p.numel]`` from an encoding (on the host)."""
    with warnings.catch_warnings():  # a read-only payload (a message's bytes): read, never written
        warnings.simplefilter("ignore", UserWarning)
        payload = torch.from_numpy(np.ascontiguousarray(p.payload, dtype=np.uint8))
        scales = torch.from_numpy(np.ascontiguousarray(p.scales, dtype=np.float32))
    return decode_tensor(payload, scales, p.numel, p.format).numpy()


def quantize_message(x: torch.Tensor, fmt: str | WireFormat) -> tuple[bytes, torch.Tensor]:
    """Encode fp32 ``x`` ``[n]`` for the wire on ``x``'s device (a GPU: only the encoded bytes are
    copied to the host; the bits are those of the host): ``(message, dequantised)``, the framed
    bytes and fp32 ``[n]`` on ``x``'s device (what every receiver decodes).

    Raises:
        ValueError: non-finite values in ``x``.
    """
    f = wire_format(fmt)
    value = x.reshape(-1).float()
    check_finite(value)
    payload, scales = encode_tensor(value, f)
    sent = decode_tensor(payload, scales, value.numel(), f)
    return to_message(Packed(f.name, value.numel(), payload.cpu().numpy(), scales.cpu().numpy())), sent


def encode_message(
    x: torch.Tensor,
    fmt: str | WireFormat,
    residual: torch.Tensor | None = None,
    new_residual: torch.Tensor | None = None,
) -> Any:
    """The wire message of fp32 ``x`` ``[n]`` (plus ``residual`` ``[n]``, last round's quantisation
    error, when given), with error feedback: ``new_residual`` (fp32 ``[n]``, when given) receives
    what the encoding lost, ``(x + residual) - dequantised``, to add to the next round's value
    (Streaming DiLoCo, arXiv 2501.18512, section 2). On the host a scaled format is one fused pass
    (``core.codec.encode``: no fp32 temporaries; the packed values written into the message, a
    uint8 array); elsewhere the torch codec (the same bits, as bytes).

    Raises:
        ValueError: non-finite values (nothing written to ``new_residual``).
    """
    f = wire_format(fmt)
    n = x.numel()
    if _host(x, f) and (residual is None or residual.device.type == "cpu"):
        message, payload = new_frame(f, n)
        _, scales = fused_codec().encode(
            x.detach().reshape(-1).contiguous().numpy(),
            f,
            None if residual is None else residual.reshape(-1).contiguous().numpy(),
            None if new_residual is None else new_residual.reshape(-1).numpy(),
            payload,
        )
        return set_frame_scales(message, scales)
    value = x if residual is None else x + residual
    framed, sent = quantize_message(value, f)
    if new_residual is not None:
        torch.sub(value.reshape(-1), sent, out=new_residual.reshape(-1))
    return framed
