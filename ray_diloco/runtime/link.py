"""The replica side of the outer exchange: a link thread per worker and WAN emulation.

Streaming DiLoCo (arXiv 2501.18512, section 2) hides communication behind compute: a replica
sends a fragment's pseudo-gradient at its sync step and keeps training; the new global value
is merged ``tau`` steps later. Here each worker owns a :class:`Link`, one background thread
that (rank 0) quantises and sends the pseudo-gradient to the outer-optimiser driver and
(every rank) receives the driver's reply and rebuilds the new global fragment. The training
thread only copies the pseudo-gradient out and, at the merge step, waits on a future, so
the time it spends blocked is exactly the communication the overlap failed to hide.

The wire format itself (statuses, replies, the downlink rule) is ``core/wire.py``; the
replica's sync state machine that drives the link is ``core/sync.py``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ray_diloco.core.fragments import PseudoGradient
from ray_diloco.core.shards import exchange_index
from ray_diloco.core.staging import DeviceStaging
from ray_diloco.core.sync import SyncBuffers
from ray_diloco.core.wire import OK, Reply, SyncResult, Uplink, decode_reply, link_delay_s, message_size


def resolve_reply(reply: Reply) -> Reply:
    """The reply with its messages fetched from the object store (one shared object per outer
    shard, ``diloco.outer_shards`` K; a ``none`` message is a read-only fp32 view of it, not a
    copy)."""
    import ray

    if reply.message is None:
        return reply
    return Reply(reply.status, reply.version, ray.get(reply.message), reply.resync, reply.size)


def fetch_reply(driver: Any, reply: Reply, unit: int, step: int, replica: int) -> Reply:
    """:func:`resolve_reply`, or when the reply's objects died with the outer shard that held them
    (``runtime.outer_shards``: its node was lost and it was rebuilt) a full-precision resync of the
    fragment from the driver, with the round's status: the same bits the reply would have given."""
    import ray

    try:
        return resolve_reply(reply)
    except ray.exceptions.ObjectLostError:
        again = ray.get(driver.result.remote(unit, step, replica, -1))  # -1: no version, always a resync
        return resolve_reply(Reply(reply.status, again.version, again.message, True, again.size))


def fetch_global(slices: list[Any]) -> np.ndarray:
    """A global fragment (fp32 ``[numel_p]``) from what the driver's ``global_refs`` gives for it:
    its K outer shards' slices in shard order, each an ObjectRef (fetched) or an array. One slice
    is returned as it is (an object-store value is a read-only view, no copy); K > 1 are joined
    into a new array.

    Raises:
        TypeError: ``slices`` is not a list (a bare ObjectRef or array)."""
    import ray

    if not isinstance(slices, list) or not slices:
        raise TypeError(f"a global fragment's slices: a non-empty list of ObjectRefs, got {type(slices).__name__}")
    parts = [ray.get(v) if isinstance(v, ray.ObjectRef) else v for v in slices]
    if len(parts) == 1:
        return np.asarray(parts[0], dtype=np.float32).reshape(-1)
    return np.concatenate([np.asarray(v, dtype=np.float32).reshape(-1) for v in parts])


@dataclass
class LinkStats:
    """Seconds on one worker's link thread (bytes are counted by the worker when it merges)."""

    emulated_delay_s: float = 0.0
    busy_s: float = 0.0  # wall seconds the link thread spent on exchanges (encode, transfer, wait)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for metrics."""
        return dict(self.__dict__)


@dataclass
class Link:
    """A worker's connection to the outer-optimiser driver, served by one background thread
    (the Ray :class:`~ray_diloco.core.sync.Transport` of ``core.sync.FragmentSync``).

    Args:
        driver: the ``OuterDriver`` actor handle.
        replica, rank: who this worker is (rank: the rows it holds, its rank in its shard group;
            0 unsharded). sends: it sends pseudo-gradients (a worker's link:
            ``ReplicaLayout.owns``, the replica's rank 0 or the first shard group's ranks); every
            rank receives.
        fmt: ``streaming.quantization``. error_feedback: keep per-fragment residuals (rank 0).
        bandwidth_gbps, latency_ms: WAN emulation, slept on this thread per message.
        shards: ``diloco.outer_shards`` K: the pseudo-gradient is sent as K slices
            (``core.shards.shard_bounds``), one object per outer-optimiser shard.
        buffers: the worker's ``core.sync.SyncBuffers`` (``FragmentSync.buffers``): a sent
            pseudo-gradient's buffer goes back to it once its bytes are in the object store, and
            a new global value that needs memory of its own (K > 1 slices joined, a quantised
            update applied) is written into one of its buffers (``none`` with K = 1 and resyncs
            stay read-only views of the shared reply).
        units: exchange units per fragment (``diloco.sharding: fsdp``: W, every rank sends its
            own rows of fragment f as unit ``f * W + rank``, ``core.shards.exchange_index``; 1:
            rank 0 sends the fragment).
        staging: the worker's ``core.staging.DeviceStaging`` when it keeps device globals: a
            pseudo-gradient arrives on the device; this thread encodes it there, on the side
            stream after the training stream's kernels (error-feedback residuals stay on the
            device), copies only the message bytes to the host, and copies each new global value
            to the device before the training thread merges it.
    """

    driver: Any
    replica: int
    rank: int
    fmt: str = "none"
    error_feedback: bool = False
    bandwidth_gbps: float | None = None
    latency_ms: float = 0.0
    shards: int = 1
    buffers: SyncBuffers | None = None
    stats: LinkStats = field(default_factory=LinkStats)
    units: int = 1
    staging: DeviceStaging | None = None
    sends: bool = True

    def __post_init__(self):
        self.uplink = Uplink(self.fmt, self.error_feedback, self.shards, self.buffers)  # owns the residuals
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"diloco-link-{self.replica}-{self.rank}")
        self._lock = threading.Lock()

    @property
    def reads_lazily(self) -> bool:
        """(``core.sync.Transport``) A pseudo-gradient may come as a ``core.fragments.PseudoGradient``:
        a scaled format encoded on the host by one sender per fragment (``core.wire.Uplink``)."""
        return self.staging is None and self.units == 1 and self.uplink.reads_lazily()

    def exchange(
        self,
        fragment: int,
        step: int,
        weight: float,
        delta: torch.Tensor | PseudoGradient | None,
        old_global: torch.Tensor,
        version: int = 0,
        average_only: bool = False,
        ready: Any = None,
    ) -> Future:
        """Start the sync of ``fragment`` sent at inner step ``step`` in the background; returns a
        ``Future[SyncResult]``. ``ready``: with device globals (``core.staging``), called on the
        link thread before its work on ``delta`` (a device tensor the training stream may still be
        computing): that work then waits for it on the side stream.

        ``delta`` (fp32 ``[numel_p]``, owned by the link from now on, then handed back to
        :attr:`buffers`) is required on rank 0 and
        ignored on other ranks; a non-finite one is not sent (the replica abstains and the
        driver rejects it). ``old_global`` (the global version ``version``) must not change
        until the future is done. ``average_only``: the driver averages instead of taking an
        outer step (a closing round). With error feedback, a pseudo-gradient the round did not
        use (dropped, rejected, failed) leaves the residual as it was: the replica's next
        pseudo-gradient still contains it.
        """
        return self._pool.submit(self._run, fragment, step, weight, delta, old_global, version, average_only, ready)

    def _sleep(self, nbytes: int) -> None:
        d = link_delay_s(nbytes, self.bandwidth_gbps, self.latency_ms)
        if d > 0:
            time.sleep(d)
            with self._lock:
                self.stats.emulated_delay_s += d

    def _run(
        self,
        fragment: int,
        step: int,
        weight: float,
        delta: torch.Tensor | PseudoGradient | None,
        old_global: torch.Tensor,
        version: int,
        average_only: bool,
        ready: Any = None,
    ) -> SyncResult:
        import ray

        t0 = time.perf_counter()
        up = 0
        unit = exchange_index(fragment, self.units, self.rank) if self.units > 1 else fragment
        if self.sends:
            assert delta is not None  # computed by every sender (core.sync: its sync rank 0)
            if ready is not None:
                ready()
            with self.staging.side() if self.staging is not None else nullcontext():
                parts, host = self.uplink.encode(fragment, delta, host_copy=self.staging is not None)
            up = 0 if parts is None else sum(message_size(m) for m in parts)
            self._sleep(up)
            refs = None if parts is None else [ray.put(m) for m in parts]  # once; the owners read them in place
            del parts  # the bytes are in the object store: the buffer is free for the next sync
            if self.buffers is not None:
                self.buffers.give(host)
            del delta, host
            call = self.driver.exchange.remote(unit, step, self.replica, weight, refs, version, average_only)
            del refs  # the driver holds them now: each is freed as soon as its owner has summed it
            reply = ray.get(call)
            self.uplink.settle(fragment, reply.status == OK)
        else:
            reply = ray.get(self.driver.result.remote(unit, step, self.replica, version, average_only))
        down = reply.nbytes
        self._sleep(down)
        resolved = fetch_reply(self.driver, reply, unit, step, self.replica)
        new_global = decode_reply(old_global, resolved, alloc=None if self.buffers is None else self.buffers.take)
        staged = None
        if self.staging is not None and new_global is not old_global:
            staged = self.staging.to_device(new_global)
        with self._lock:
            self.stats.busy_s += time.perf_counter() - t0
        return SyncResult(new_global, up, down, reply.status, reply.version, staged)

    def residual_state(self) -> dict[int, np.ndarray]:
        """Copies of the error-feedback residuals (fp32 ``[numel_p]``) by fragment (rank 0; empty
        without error feedback; ``core.wire.Uplink``). Call when no exchange is in flight."""
        return self.uplink.state_dict()

    def load_residual_state(self, residuals: dict[int, Any]) -> None:
        """Replace the error-feedback residuals with copies of fp32 arrays by fragment."""
        self.uplink.load_state_dict(residuals)

    def take_stats(self) -> dict[str, Any]:
        """The counters since the last call, then reset."""
        with self._lock:
            out, self.stats = self.stats.as_dict(), LinkStats()
        return out

    def close(self) -> None:
        """Stop the thread (pending exchanges are abandoned)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
