"""The wire protocol of the outer exchange: round statuses, the driver's reply, the downlink rule,
and the byte accounting (Streaming DiLoCo, arXiv 2501.18512, section 2; DiLoCo, arXiv 2311.08105).

Uplink: each replica's unreduced pseudo-gradient ``delta = global - local`` (fp32 ``[numel_p]``),
quantised with ``streaming.quantization`` (plus its error-feedback residual when enabled).
Downlink (:class:`Downlink`, used by the driver after each outer step of
``core.outer.OuterOptimizer``): with ``none`` the new global fragment in fp32; otherwise the
quantised outer update ``u = new - old``, which every receiver (and the driver itself) applies
with :func:`apply_downlink`, so the driver and every replica hold bitwise-identical global
parameters.

Bytes counted are the lengths of the serialised messages (``core.formats``' frame: 13-byte
header + fp32 block scales + packed values); Ray adds a few dozen bytes of object metadata.
No Ray here: the runtime's link (``runtime/link.py``) and driver (``runtime/driver/``) carry it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_diloco.core.formats import (
    BLOCK,
    RAW,
    WireFormat,
    all_finite,
    new_frame,
    parse,
    set_frame_scales,
    wire_format,
)
from ray_diloco.core.quantize import decode, encode_message, fused_codec, quantize_message
from ray_diloco.core.shards import shard_bounds

CHUNK = 1 << 20  # values a lazily read pseudo-gradient is encoded by (a multiple of BLOCK)

#: A wire message: a frame (``core.formats``; bytes or a uint8 array), or, for a raw format
#: (``none``), the fp32 values themselves as an array (zero-copy through the object store; counted
#: as the framed message's bytes).
Message = Any


def is_raw(message: Message) -> bool:
    """Whether ``message`` is a raw fp32 array (a ``none`` message sent as the values themselves),
    not framed bytes."""
    return isinstance(message, np.ndarray) and message.dtype == np.float32


def message_size(message: Message | None) -> int:
    """Bytes a message counts for on the wire (0 for None); a raw fp32 array counts as its framed
    ``none`` message would."""
    if message is None:
        return 0
    if is_raw(message):
        return RAW.message_nbytes(message.size)
    return len(message)


#: Bytes per second that waits for a transfer allow on top of ``diloco.sync_timeout_s`` (the
#: driver's round timeout, the trainer's straggler limit): a slow but live link moving a large
#: fragment is not a dead replica.
TRANSFER_FLOOR_BPS = 100e6


def transfer_allowance_s(nbytes: int) -> float:
    """Seconds allowed for moving ``nbytes`` at :data:`TRANSFER_FLOOR_BPS` (added to timeouts)."""
    return nbytes / TRANSFER_FLOOR_BPS


def as_tensor(values: np.ndarray) -> torch.Tensor:
    """A torch view of fp32 ``values`` without a copy, also of a read-only (object store) array:
    the caller must not write to it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns about non-writable arrays
        return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(-1))


def message_values(message: Message) -> tuple[WireFormat, np.ndarray]:
    """``(format, fp32 values [numel])`` of a message: a raw fp32 array as is (no copy), a framed
    one decoded (the pseudo-gradient or update it carries).

    Raises:
        ValueError: malformed message.
    """
    if is_raw(message):
        return RAW, message.reshape(-1)
    packed = parse(message)
    return wire_format(packed.format), decode(packed)


def apply_downlink(
    old_global: torch.Tensor, message: Message, out: torch.Tensor | None = None, values: torch.Tensor | None = None
) -> torch.Tensor:
    """The new global fragment (fp32 ``[numel_p]``, a new tensor, or ``out``: the driver writes
    into its own global fragment) from the driver's reply. ``values``: the message's decoded
    values when the caller already has them (the encoder does: ``quantize_message``'s
    dequantised output is ``decode`` of the same packing), so they are not decoded twice.

    A ``none`` message carries the new global values themselves; any other format carries the
    quantised outer update, and the result is ``old_global + dequantised update`` computed in
    fp32 by this one function on the driver and on every replica (bitwise-identical globals).

    Raises:
        ValueError: malformed message or wrong number of values.
    """
    if values is not None:
        if values.numel() != old_global.numel():
            raise ValueError(f"downlink has {values.numel()} values, the fragment has {old_global.numel()}")
        return torch.add(old_global, values, out=out)
    if not is_raw(message) and old_global.device.type == "cpu" and (out is None or out.is_contiguous()):
        packed = parse(message)
        if wire_format(packed.format).scaled:  # decoded straight into the result (core.codec): no decoded copy
            if packed.numel != old_global.numel():
                raise ValueError(f"downlink has {packed.numel} values, the fragment has {old_global.numel()}")
            new = torch.empty_like(old_global) if out is None else out
            if new.data_ptr() != old_global.data_ptr():
                new.copy_(old_global)
            fused_codec().decode_into(
                packed.payload, packed.scales, packed.format, new.reshape(-1).numpy(), accumulate=True
            )
            return new
    fmt, decoded = message_values(message)
    if decoded.size != old_global.numel():
        raise ValueError(f"downlink has {decoded.size} values, the fragment has {old_global.numel()}")
    if fmt.raw:  # a raw array stays a (read-only) view: nothing decoded or copied
        new = as_tensor(decoded) if isinstance(message, np.ndarray) else torch.from_numpy(decoded)
        return new if out is None else out.copy_(new)
    return torch.add(old_global, torch.from_numpy(decoded), out=out)


class Uplink:
    """A replica's side of the uplink (Streaming DiLoCo, arXiv 2501.18512, section 2): encodes each
    fragment's pseudo-gradient, one message per outer-optimiser slice, and owns its error-feedback
    residuals. After a send the round's answer settles them: kept when the pseudo-gradient was
    used, the previous residual restored when it was not (:meth:`settle`).

    Messages: with a raw format (``none``) the fp32 values themselves (slices of a host array: zero-copy through
    the object store; a device tensor is copied into a host buffer first); otherwise the framed
    bytes of each slice (``quantize.encode_message``: on the host one fused pass, which also
    writes the new residual), each slice starting at a multiple of ``quantize.BLOCK`` (the same
    blocks, bits and residual as the whole).

    Args:
        fmt: ``streaming.quantization`` (a name or a ``core.formats.WireFormat``). error_feedback:
            keep a residual per fragment.
        shards: ``diloco.outer_shards`` K (``core.shards.shard_bounds``).
        buffers: a ``core.sync.SyncBuffers`` the residuals (on the host) and host copies come
            from and go back to (None: fresh tensors).
    """

    def __init__(self, fmt: str | WireFormat, error_feedback: bool, shards: int = 1, buffers: Any = None):
        self.fmt, self.error_feedback, self.shards, self.buffers = wire_format(fmt), error_feedback, shards, buffers
        self.residuals: dict[int, torch.Tensor] = {}
        self._before: dict[int, tuple[bool, torch.Tensor | None]] = {}  # fragment -> (encoded, previous residual)
        self._deferred: dict[int, tuple[Any, list[Any]]] = {}  # fragment -> (lazy delta, messages): residual at settle

    def encode(self, fragment: int, delta: Any, host_copy: bool = False) -> tuple[list[Any] | None, Any]:
        """The messages of ``fragment``'s pseudo-gradient ``delta`` (fp32 ``[numel_p]``, on its
        device; ``host_copy``: a ``none`` message goes through a host buffer), one per shard
        slice, or None when ``delta`` is not finite (the replica abstains); and the tensor to
        hand back to the buffers once the messages are in the object store. ``delta`` may be a
        ``core.fragments.PseudoGradient`` on the host when the format is scaled
        (:meth:`reads_lazily`): it is read and encoded a chunk at a time (no fragment-sized
        buffer; the same bytes and residual), and None is handed back.

        Raises:
            ValueError: ``delta`` plus its residual holds a non-finite value."""
        before = self.residuals.get(fragment)
        if not isinstance(delta, torch.Tensor):
            return self._encode_chunks(fragment, delta, before), None
        if before is not None and before.device != delta.device:  # a residual restored from a checkpoint
            before = before.to(delta.device)
        if not all_finite(delta):
            self._before[fragment] = (False, before)
            return None, delta
        bounds = shard_bounds(delta.numel(), self.shards)
        self._before[fragment] = (True, before)
        if self.fmt.raw:
            if self.error_feedback:  # fp32 loses nothing: the residual is spent
                self.residuals.pop(fragment, None)
            value = delta if before is None else delta + before
            held = delta  # the buffer given back once sent (the values may be a new sum)
            if host_copy:  # on the device: into a (pinned) host buffer
                held = self.buffers.take(value.numel()) if self.buffers is not None else torch.empty(value.numel())
                value = held.copy_(value)
            values = value.numpy()
            return [values[sl] for sl in bounds], held
        residual = None
        if self.error_feedback:  # a reused buffer where one can be (no page faults); a new one, as
            # the previous residual comes back when the round does not use this message
            on_host = self.buffers is not None and delta.device.type == "cpu"
            residual = self.buffers.take(delta.numel()) if on_host else torch.empty_like(delta)
        messages = [
            encode_message(delta[sl], self.fmt, None if before is None else before[sl], _part(residual, sl))
            for sl in bounds
        ]
        if residual is not None:
            self.residuals[fragment] = residual
        return [np.frombuffer(m, np.uint8) if isinstance(m, bytes) else m for m in messages], delta

    def reads_lazily(self) -> bool:
        """Whether :meth:`encode` takes a ``core.fragments.PseudoGradient`` (a scaled format:
        the codec reads the pseudo-gradient chunk by chunk)."""
        return self.fmt.scaled

    def _encode_chunks(self, fragment: int, src: Any, before: torch.Tensor | None) -> list[Any] | None:
        """:meth:`encode` of a ``PseudoGradient`` on the host: each :data:`CHUNK` values (a
        multiple of ``BLOCK``: the same blocks as the whole) read into a scratch buffer, checked
        and encoded (plus the residual) straight into its shard slice's message; None when a value
        is not finite. The new residual is not written here: :meth:`settle` writes it over the
        previous one when the round used the message (no second residual kept for a rollback)."""
        if src.device.type != "cpu" or not self.reads_lazily():
            raise ValueError(f"a lazily read pseudo-gradient needs a scaled format on the host, got {self.fmt.name}")
        n, codec = src.numel, fused_codec()
        scratch = torch.empty(min(CHUNK, n), dtype=torch.float32)
        messages = []
        for sl in shard_bounds(n, self.shards):
            frame, payload = new_frame(self.fmt, sl.stop - sl.start)
            scales = np.empty(self.fmt.n_scales(sl.stop - sl.start), dtype=np.float32)
            for lo, hi in _spans(sl):
                x = src.read(lo, hi, scratch)
                if not all_finite(x):  # the replica abstains; the residual stays as it was
                    self._before[fragment] = (False, before)
                    return None
                off = lo - sl.start
                _, sc = codec.encode(
                    x.numpy(),
                    self.fmt,
                    None if before is None else before[lo:hi].numpy(),
                    None,
                    _chunk(payload, self.fmt, off, hi - sl.start),
                )
                scales[off // BLOCK : off // BLOCK + sc.size] = sc
            messages.append(set_frame_scales(frame, scales))
        self._before[fragment] = (False, before)  # nothing to roll back
        if self.error_feedback:
            self._deferred[fragment] = (src, messages)
        return messages

    def _residual_in_place(self, fragment: int, src: Any, messages: list[Any]) -> None:
        """(:meth:`settle`, a used lazily read message) The new residual ``(delta + residual) -
        dequantised``, a chunk at a time, over the previous residual (a new buffer the first time):
        the bits the encoder's pass writes (``core.codec.encode``)."""
        n, codec = src.numel, fused_codec()
        residual = self.residuals.get(fragment)
        first = residual is None
        if residual is None:
            residual = self.buffers.take(n) if self.buffers is not None else torch.empty(n)
        scratch, sent = torch.empty(min(CHUNK, n)), torch.empty(min(CHUNK, n))
        for sl, message in zip(shard_bounds(n, self.shards), messages):
            packed = parse(message)
            for lo, hi in _spans(sl):
                x, r = src.read(lo, hi, scratch), residual[lo:hi]
                d = sent[: hi - lo]
                codec.decode_into(packed.payload, packed.scales, self.fmt, d.numpy(), start=lo - sl.start)
                if first:
                    torch.sub(x, d, out=r)
                else:
                    torch.add(x, r, out=r).sub_(d)
        self.residuals[fragment] = residual

    def settle(self, fragment: int, used: bool) -> None:
        """The round of ``fragment``'s last :meth:`encode` is answered: ``used`` (status ok) keeps
        the new residual (the old one's buffer is given back); otherwise the previous residual
        is restored (the new one given back)."""
        deferred = self._deferred.pop(fragment, None)
        if deferred is not None and used:
            self._residual_in_place(fragment, *deferred)
        encoded, before = self._before.pop(fragment, (False, None))
        if not self.error_feedback or not encoded:
            return
        if used:
            self._give(before)
            return
        dropped = self.residuals.pop(fragment, None)
        if before is not None:
            self.residuals[fragment] = before
        if dropped is not before:
            self._give(dropped)

    def _give(self, t: torch.Tensor | None) -> None:
        if self.buffers is not None and t is not None and t.device.type == "cpu":
            self.buffers.give(t)

    def state_dict(self) -> dict[int, np.ndarray]:
        """Copies of the residuals (fp32 ``[numel_p]``) by fragment (empty without error
        feedback). Call when no exchange is in flight."""
        return {f: r.detach().to("cpu", copy=True).numpy() for f, r in self.residuals.items()}

    def load_state_dict(self, residuals: dict[int, Any]) -> None:
        """Replace the residuals with copies of fp32 arrays by fragment."""
        self.residuals = {
            int(f): torch.from_numpy(np.array(r, dtype=np.float32, copy=True)) for f, r in residuals.items()
        }


def _chunk(payload: np.ndarray, fmt: WireFormat, lo: int, hi: int) -> np.ndarray:
    """The bytes of a frame's ``payload`` that values ``[lo, hi)`` are packed into (``lo`` a
    multiple of ``BLOCK``: a chunk of whole blocks, as the encoders write them)."""
    return payload[fmt.payload_nbytes(lo) : fmt.payload_nbytes(hi)]


def _spans(sl: slice):
    """``(lo, hi)`` of each :data:`CHUNK` values of ``sl``."""
    for lo in range(sl.start, sl.stop, CHUNK):
        yield lo, min(lo + CHUNK, sl.stop)


def _part(t: torch.Tensor | None, sl: slice) -> torch.Tensor | None:
    """``t[sl]`` (a view), or None."""
    return None if t is None else t[sl]


class Downlink:
    """The outer-optimiser side of the downlink: encodes the reply of each outer step (the
    quantised update, :meth:`encode_update`) and makes the optimiser hold what every receiver
    decodes; with error feedback it updates each fragment's downlink residual
    (``core.outer.OuterFragment.residual``; Streaming DiLoCo, arXiv 2501.18512, section 2:
    quantised communication both ways).

    Args:
        fmt: ``streaming.quantization``. error_feedback: keep the residuals.
    """

    def __init__(self, fmt: str | WireFormat, error_feedback: bool):
        self.fmt, self.error_feedback = wire_format(fmt), error_feedback

    def step(self, opt: Any, fragment: int, mean: Any, average_only: bool = False) -> tuple[Message, float]:
        """The outer step of ``fragment`` (``opt``: a ``core.outer.OuterOptimizer``, ``mean`` its
        ``OrderedMean``) and its reply, quantised. On the host with a scaled format each chunk of
        the update is encoded, applied to the global fragment and its residual updated as soon as
        the step makes it (``OuterOptimizer.step_ordered(on_update=...)``, ``core.codec.
        apply_update``): one pass, no fragment-sized update; otherwise the step's whole update
        goes through :meth:`encode_update`. The same bits either way. Returns the message and the
        norm of the update applied (fp64 sum of squares).

        Raises:
            ValueError: ``none`` format, or a non-finite update."""
        frag = opt.fragments[fragment]
        p = frag.param.detach()
        if not self.fmt.scaled or p.device.type != "cpu":
            _, update = opt.step_ordered(fragment, mean, average_only, keep_update=True)
            return self.encode_update(opt, fragment, update)
        n = p.numel()
        residual = frag.residual
        if self.error_feedback and residual is None:
            residual = torch.empty(n, dtype=torch.float32)
            fresh = True  # no residual yet: the first update is encoded as it is
        else:
            fresh = False
        message, payload = new_frame(self.fmt, n)
        scales = np.empty(self.fmt.n_scales(n), dtype=np.float32)
        codec, sq = fused_codec(), [0.0]
        flat = p.reshape(-1).numpy()

        def on_update(sl: slice, update: torch.Tensor) -> None:
            r = None if residual is None else residual[sl].numpy()
            _, sc, norm = codec.apply_update(
                update.numpy(),
                None if fresh else r,
                flat[sl],
                self.fmt,
                r,
                _chunk(payload, self.fmt, sl.start, sl.stop),
            )
            scales[sl.start // BLOCK : sl.start // BLOCK + sc.size] = sc
            sq[0] += norm * norm

        with torch.no_grad():
            opt.step_ordered(fragment, mean, average_only, on_update=on_update)
        frag.residual = residual
        return set_frame_scales(message, scales), math.sqrt(sq[0])

    def encode_update(self, opt: Any, fragment: int, update: torch.Tensor) -> tuple[Message, float]:
        """The message of an outer step given as its update (``new - old``, fp32 ``[numel_p]``, as
        ``OuterOptimizer.step_ordered(keep_update=True)`` returns it, the global fragment still
        ``old``), without a copy of the old fragment.
        ``opt``'s global fragment becomes ``old + dequantised update`` in place (what every
        receiver computes with :func:`apply_downlink`). Not for ``none`` (the reply is the
        fragment itself). Returns the message and the norm of the update applied.

        Raises:
            ValueError: ``none`` format, or non-finite values."""
        if self.fmt.raw:
            raise ValueError(
                f"streaming.quantization = {self.fmt.name!r}: the reply is the global fragment, not an update"
            )
        frag = opt.fragments[fragment]
        p, residual = frag.param.detach(), frag.residual
        value = update if residual is None else update + residual
        del update
        framed, sent = quantize_message(value, self.fmt)  # sent: the dequantised values
        if self.error_feedback:  # what the encoding lost
            frag.residual = value - sent
        del value
        with torch.no_grad():
            apply_downlink(p, framed, out=p, values=sent)
        return framed, float(sent.norm())


OK, DROPPED, REJECTED, FAILED = "ok", "dropped", "rejected", "failed"


@dataclass
class Reply:
    """The driver's answer to one receiver for one round.

    Attributes:
        status: ``ok`` (this replica's pseudo-gradient was averaged), ``dropped`` (the round
            completed without it: late, timed out, or not expected), ``rejected`` (it was not
            finite: reset to the global parameters), ``failed`` (no quorum: no outer step).
        version: the fragment's global version the receiver holds after applying ``message``.
        message: the downlink: a list of K :data:`Message` s, one per outer-optimiser shard's
            slice (``core.shards.shard_bounds``; K = 1: one), each the quantised outer update
            (``resync`` False) or the fp32 values (format ``none``, or ``resync`` True); or None
            (nothing to apply). The runtime sends each as one object-store reference shared by
            every receiver (resolve them with ``runtime.link.resolve_reply`` before decoding).
        resync: ``message`` is a full-precision copy of the global fragment.
        size: bytes the message counts for (-1: :func:`message_size` of ``message``).
    """

    status: str
    version: int
    message: Any = None
    resync: bool = False
    size: int = -1

    @property
    def nbytes(self) -> int:
        """Bytes on the wire for this reply (the message; 0 without one)."""
        if self.size >= 0 or self.message is None:
            return max(self.size, 0)
        return sum(message_size(m) for m in self.message)


def message_numel(message: Message) -> int:
    """Values a message carries (a raw fp32 array's size, or a framed message's header count).

    Raises:
        ValueError: malformed framed message."""
    if is_raw(message):
        return message.size
    return parse(message).numel


def decode_reply(
    old_global: torch.Tensor, reply: Reply, alloc: Callable[[int], torch.Tensor] | None = None
) -> torch.Tensor:
    """The global fragment a receiver holds after ``reply`` (fp32 ``[numel_p]``): unchanged
    without a message; else each of its K messages (one per shard's slice, in order) decoded
    into its slice: the resync values, or :func:`apply_downlink` ``(old, message)``
    (element-wise: the same bits whatever K). One ``none`` message (K = 1) gives a read-only
    view of it, nothing allocated; a new tensor, where one is needed, comes from
    ``alloc(numel)`` (default ``torch.empty``; ``core.sync.SyncBuffers.take`` reuses buffers)
    and must not alias ``old_global``.

    Raises:
        ValueError: malformed message or wrong number of values.
    """
    if reply.message is None:
        return old_global
    n_all = old_global.numel()
    if len(reply.message) == 1:
        return _decode_part(old_global, reply.message[0], reply.resync, alloc)
    out, start = _new(alloc, n_all), 0
    for part in reply.message:
        n = message_numel(part)
        if start + n > n_all:
            raise ValueError(f"shard replies have more values than the fragment's {n_all}")
        dest = out[start : start + n]

        def into_dest(_n: int, d: torch.Tensor = dest) -> torch.Tensor:
            return d

        piece = _decode_part(old_global[start : start + n], part, reply.resync, into_dest)
        if piece.data_ptr() != dest.data_ptr():
            dest.copy_(piece)
        start += n
    if start != n_all:
        raise ValueError(f"shard replies have {start} values, the fragment has {n_all}")
    return out


def _decode_part(
    old: torch.Tensor, message: Message, resync: bool, alloc: Callable[[int], torch.Tensor] | None
) -> torch.Tensor:
    """(:func:`decode_reply`) One slice's new values from its message."""
    n_all = old.numel()
    if resync:
        fmt, values = message_values(message)
        if not fmt.raw or values.size != n_all:
            raise ValueError(f"resync has {values.size} {fmt.name} values, the fragment has {n_all}")
        return as_tensor(values) if isinstance(message, np.ndarray) else torch.from_numpy(values)
    if is_raw(message):
        return apply_downlink(old, message)  # a view: nothing allocated
    return apply_downlink(old, message, out=_new(alloc, n_all))


def _new(alloc: Callable[[int], torch.Tensor] | None, numel: int) -> torch.Tensor:
    return torch.empty(numel, dtype=torch.float32) if alloc is None else alloc(numel)


def link_delay_s(nbytes: int, bandwidth_gbps: float | None, latency_ms: float) -> float:
    """Emulated one-way transfer time of a message: ``latency + 8 * nbytes / bandwidth`` seconds."""
    return latency_ms / 1e3 + (8.0 * nbytes / (bandwidth_gbps * 1e9) if bandwidth_gbps else 0.0)


@dataclass
class SyncResult:
    """What a finished exchange hands to the training thread."""

    new_global: torch.Tensor  # fp32 [numel_p]
    bytes_up: int  # this worker's message to the driver (0 on ranks > 0)
    bytes_down: int  # the driver's reply
    status: str = "ok"  # Reply.status: ok, dropped, rejected or failed
    version: int = 0  # the fragment's global version new_global is
    staged: Any = (
        None  # new_global already copied to the training device (core.staging.DeviceStaging.to_device), or None
    )


DP_FORMULA = (
    "ring all-reduce: each of R ranks sends and receives 2 N (R-1)/R values per step in each "
    "direction, b bytes per value (4 fp32, 2 bf16), R = M replicas"
)


def dp_equivalent_bytes(num_params: int, steps: int, ranks: int, bytes_per_value: int = 4) -> int:
    """Bytes one rank sends (and, equally, receives) in ``steps`` steps of data-parallel training
    with a ring all-reduce of ``num_params`` gradients over ``ranks`` ranks:
    ``2 N (R-1)/R x b`` per step (about ``2 N b`` for large R)."""
    return int(round(2 * num_params * (ranks - 1) / ranks * bytes_per_value * steps)) if ranks > 1 else 0


def communication_summary(
    num_params: int, steps: int, replicas: int, bytes_up: int, bytes_down: int, peak_sync_bytes: int
) -> dict[str, Any]:
    """Bytes per replica for the whole run, next to the data-parallel equivalent (both directions).

    ``bytes_up``/``bytes_down`` are totals over all replicas; ``peak_sync_bytes`` is the largest
    up + down of one replica's fragment sync.
    """
    up, down = bytes_up / replicas, bytes_down / replicas
    dp32 = dp_equivalent_bytes(num_params, steps, replicas, 4)
    dp16 = dp_equivalent_bytes(num_params, steps, replicas, 2)
    ours = up + down
    return {
        "bytes_up_per_replica": int(up),
        "bytes_down_per_replica": int(down),
        "peak_sync_bytes_per_replica": int(peak_sync_bytes),
        "dp_fp32_bytes_per_replica": 2 * dp32,  # up + down
        "dp_bf16_bytes_per_replica": 2 * dp16,
        "dp_formula": DP_FORMULA,
        "fewer_bytes_than_dp_fp32": (2 * dp32 / ours) if ours > 0 and dp32 > 0 else None,
    }
