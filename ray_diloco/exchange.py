"""The replica side of the outer exchange: a link thread per worker, the wire protocol, WAN emulation.

Streaming DiLoCo (arXiv 2501.18512, section 2) hides communication behind compute: a replica
sends a fragment's pseudo-gradient at its sync step and keeps training; the new global value
is merged ``tau`` steps later. Here each worker owns a :class:`Link`, one background thread
that (rank 0) quantises and sends the pseudo-gradient to the outer-optimiser driver and
(every rank) receives the driver's reply and rebuilds the new global fragment. The training
thread only copies the pseudo-gradient out and, at the merge step, waits on a future, so
the time it spends blocked is exactly the communication the overlap failed to hide.

Both directions are low precision (``streaming.quantization``). Uplink: each replica's
unreduced pseudo-gradient ``delta = global - local`` (fp32 ``[numel_p]``), plus its error
feedback residual when enabled. Downlink (see ``outer.OuterOptimizer.step``): with ``none``
the new global fragment in fp32; otherwise the quantised outer update ``u = new - old``,
which every receiver (and the driver itself) applies with :func:`apply_downlink`, so the
driver and every replica hold bitwise-identical global parameters.

Bytes counted are the lengths of the serialised messages (``quantize.to_message``: 13-byte
header + fp32 block scales + packed values); Ray adds a few dozen bytes of object metadata.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .quantize import decode, from_message, quantize_with_feedback


def apply_downlink(old_global: torch.Tensor, message: bytes) -> torch.Tensor:
    """The new global fragment (fp32 ``[numel_p]``, a new tensor) from the driver's reply.

    A ``none`` message carries the new global values themselves; any other format carries the
    quantised outer update, and the result is ``old_global + dequantised update`` computed in
    fp32 by this one function on the driver and on every replica (bitwise-identical globals).

    Raises:
        ValueError: malformed message or wrong number of values.
    """
    packed = from_message(message)
    if packed.numel != old_global.numel():
        raise ValueError(f"downlink has {packed.numel} values, the fragment has {old_global.numel()}")
    values = torch.from_numpy(decode(packed))
    return values if packed.format == "none" else old_global + values


OK, DROPPED, REJECTED, FAILED = "ok", "dropped", "rejected", "failed"


@dataclass
class Reply:
    """The driver's answer to one receiver for one round.

    Attributes:
        status: ``ok`` (this replica's pseudo-gradient was averaged), ``dropped`` (the round
            completed without it: late, timed out, or not expected), ``rejected`` (it was not
            finite: reset to the global parameters), ``failed`` (no quorum: no outer step).
        version: the fragment's global version the receiver holds after applying ``message``.
        message: the downlink bytes: the quantised outer update (``resync`` False), the full
            fp32 global fragment (``resync`` True), or None (nothing to apply).
        resync: ``message`` is a full-precision copy of the global fragment.
    """

    status: str
    version: int
    message: bytes | None = None
    resync: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes on the wire for this reply (the message; 0 without one)."""
        return len(self.message) if self.message is not None else 0


def decode_reply(old_global: torch.Tensor, reply: Reply) -> torch.Tensor:
    """The global fragment a receiver holds after ``reply`` (fp32 ``[numel_p]``): unchanged
    without a message, the resync values, or ``exchange.apply_downlink(old, message)``.

    Raises:
        ValueError: malformed message or wrong number of values.
    """
    if reply.message is None:
        return old_global
    if reply.resync:
        packed = from_message(reply.message)
        if packed.numel != old_global.numel():
            raise ValueError(f"resync has {packed.numel} values, the fragment has {old_global.numel()}")
        return torch.from_numpy(decode(packed))
    return apply_downlink(old_global, reply.message)


def link_delay_s(nbytes: int, bandwidth_gbps: float | None, latency_ms: float) -> float:
    """Emulated one-way transfer time of a message: ``latency + 8 * nbytes / bandwidth`` seconds."""
    return latency_ms / 1e3 + (8.0 * nbytes / (bandwidth_gbps * 1e9) if bandwidth_gbps else 0.0)


@dataclass
class LinkStats:
    """Seconds on one worker's link thread (bytes are counted by the worker when it merges)."""

    emulated_delay_s: float = 0.0
    busy_s: float = 0.0  # wall seconds the link thread spent on exchanges (encode, transfer, wait)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for metrics."""
        return dict(self.__dict__)


@dataclass
class SyncResult:
    """What a finished exchange hands to the training thread."""

    new_global: torch.Tensor  # fp32 [numel_p]
    bytes_up: int  # this worker's message to the driver (0 on ranks > 0)
    bytes_down: int  # the driver's reply
    status: str = "ok"  # Reply.status: ok, dropped, rejected or failed
    version: int = 0  # the fragment's global version new_global is


@dataclass
class Link:
    """A worker's connection to the outer-optimiser driver, served by one background thread.

    Args:
        driver: the ``OuterDriver`` actor handle.
        replica, rank: who this worker is; only rank 0 sends (all ranks of a replica hold the
            same parameters), every rank receives.
        fmt: ``streaming.quantization``. error_feedback: keep per-fragment residuals (rank 0).
        bandwidth_gbps, latency_ms: WAN emulation, slept on this thread per message.
    """

    driver: Any
    replica: int
    rank: int
    fmt: str = "none"
    error_feedback: bool = False
    bandwidth_gbps: float | None = None
    latency_ms: float = 0.0
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    stats: LinkStats = field(default_factory=LinkStats)

    def __post_init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"diloco-link-{self.replica}-{self.rank}")
        self._lock = threading.Lock()

    def exchange(self, fragment: int, step: int, weight: float, delta: torch.Tensor | None,
                 old_global: torch.Tensor, version: int = 0, average_only: bool = False) -> Future:
        """Start the sync of ``fragment`` sent at inner step ``step`` in the background; returns a
        ``Future[SyncResult]``.

        ``delta`` (fp32 ``[numel_p]``, owned by the link from now on) is required on rank 0 and
        ignored on other ranks; a non-finite one is not sent (the replica abstains and the
        driver rejects it). ``old_global`` (the global version ``version``) must not change
        until the future is done. ``average_only``: the driver averages instead of taking an
        outer step (a closing round). With error feedback, a pseudo-gradient the round did not
        use (dropped, rejected, failed) leaves the residual as it was: the replica's next
        pseudo-gradient still contains it.
        """
        return self._pool.submit(self._run, fragment, step, weight, delta, old_global, version, average_only)

    def _sleep(self, nbytes: int) -> None:
        d = link_delay_s(nbytes, self.bandwidth_gbps, self.latency_ms)
        if d > 0:
            time.sleep(d)
            with self._lock:
                self.stats.emulated_delay_s += d

    def _run(self, fragment: int, step: int, weight: float, delta: torch.Tensor | None,
             old_global: torch.Tensor, version: int, average_only: bool) -> SyncResult:
        import ray

        t0 = time.perf_counter()
        up = 0
        if self.rank == 0:
            before = self.residuals.get(fragment)
            message = None
            if bool(torch.isfinite(delta).all()):
                message, residual = quantize_with_feedback(delta, self.fmt, before)
                if self.error_feedback:
                    self.residuals[fragment] = residual
            up = len(message) if message is not None else 0
            self._sleep(up)
            reply = ray.get(self.driver.exchange.remote(fragment, step, self.replica, weight, message, version,
                                                        average_only))
            if reply.status != OK and self.error_feedback:
                if before is None:
                    self.residuals.pop(fragment, None)
                else:
                    self.residuals[fragment] = before
        else:
            reply = ray.get(self.driver.result.remote(fragment, step, self.replica, version, average_only))
        down = reply.nbytes
        self._sleep(down)
        new_global = decode_reply(old_global, reply)
        with self._lock:
            self.stats.busy_s += time.perf_counter() - t0
        return SyncResult(new_global, up, down, reply.status, reply.version)

    def take_stats(self) -> dict[str, Any]:
        """The counters since the last call, then reset."""
        with self._lock:
            out, self.stats = self.stats.as_dict(), LinkStats()
        return out

    def close(self) -> None:
        """Stop the thread (pending exchanges are abandoned)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


DP_FORMULA = ("ring all-reduce: each of R ranks sends and receives 2 N (R-1)/R values per step in each "
              "direction, b bytes per value (4 fp32, 2 bf16), R = M replicas")


def dp_equivalent_bytes(num_params: int, steps: int, ranks: int, bytes_per_value: int = 4) -> int:
    """Bytes one rank sends (and, equally, receives) in ``steps`` steps of data-parallel training
    with a ring all-reduce of ``num_params`` gradients over ``ranks`` ranks:
    ``2 N (R-1)/R x b`` per step (about ``2 N b`` for large R)."""
    return int(round(2 * num_params * (ranks - 1) / ranks * bytes_per_value * steps)) if ranks > 1 else 0


def communication_summary(num_params: int, steps: int, replicas: int, bytes_up: int, bytes_down: int,
                          peak_sync_bytes: int) -> dict[str, Any]:
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
