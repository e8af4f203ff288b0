"""The replica's fragment-sync state machine (Streaming DiLoCo, arXiv 2501.18512, section 2).

A replica holds, per fragment, the global value it last received and that value's version
(outer steps applied). At the fragment's sync step ``s`` (``SyncSchedule.sends_at``) it sends
its pseudo-gradient ``global - local`` (DiLoCo, arXiv 2311.08105, Algorithm 1 line 8) through a
:class:`Transport` and keeps training; at ``apply_step(s) = s + tau`` it merges the new global
value, ``local <- alpha * local + (1 - alpha) * new_global``.

By the round's status (``core.wire``): ``ok``/``dropped`` merge; ``failed`` (no quorum) keeps
the local parameters and restores the fragment's previous send step, so the next
pseudo-gradient carries this round's work too (DiLoCo, arXiv 2311.08105, section 3, dropped
outer gradients); ``rejected`` (non-finite) resets every fragment to the global parameters
and calls ``on_reset`` (the runtime clears the inner optimiser).

No Ray here: :class:`FragmentSync` is driven by the training thread of ``runtime/inner_loop.py`` (``InnerLoop.train``)
and talks to the driver through any :class:`Transport` (``runtime/link.py``'s ``Link``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, cast

import numpy as np
import torch

from ray_diloco.core.fragments import Fragment, PseudoGradient, flatten, pseudo_gradient, tensor_hash, unflatten_into
from ray_diloco.core.schedules import SyncSchedule
from ray_diloco.core.staging import DeviceStaging
from ray_diloco.core.wire import FAILED, OK, REJECTED, SyncResult, as_tensor


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` on the host (itself when it is there already)."""
    return None if t is None else t.to("cpu")


class Transport(Protocol):
    """How a replica's worker exchanges fragments with the outer optimiser.

    ``exchange`` starts one sync in the background and returns a ``Future[SyncResult]``:
    ``delta`` (fp32 ``[numel_p]``, owned by the transport from then on; it may hand it back to
    ``FragmentSync.buffers`` once sent, and then must not touch it) is given on rank 0 and
    None on other ranks; with device globals (``core.staging``) it is on the training device
    and ``ready`` is given: call it before the work on ``delta``, which then runs on the
    staging's side stream (``DeviceStaging.side``); ``old_global`` (the global value at
    ``version``, host) does not change until the future is done; the result's ``new_global`` is ``old_global`` itself (nothing changed)
    or a tensor with storage of its own; ``average_only``: a closing round. With error
    feedback the transport keeps a residual per fragment, which ``residual_state`` /
    ``load_residual_state`` checkpoint (fp32 ``[numel_p]`` arrays by fragment; empty without
    error feedback). ``reads_lazily``: ``delta`` may instead be a ``core.fragments.PseudoGradient``
    (read chunk by chunk while the parameters stay put), which the replica gives when the merge
    of the sync is at its send step (no overlap: the training thread waits for the future).
    """

    @property
    def reads_lazily(self) -> bool:
        """Whether ``delta`` may be a ``core.fragments.PseudoGradient``."""

    def exchange(
        self,
        fragment: int,
        step: int,
        weight: float,
        delta: torch.Tensor | PseudoGradient | None,
        old_global: torch.Tensor,
        version: int = 0,
        average_only: bool = False,
        ready: Callable[[], None] | None = None,
    ) -> Future:
        """Start a sync; the future resolves to a :class:`~ray_diloco.core.wire.SyncResult`
        (its ``staged``: the new global value already on the training device, or None)."""

    def residual_state(self) -> dict[int, np.ndarray]:
        """Copies of the error-feedback residuals by fragment."""

    def load_residual_state(self, residuals: dict[int, Any]) -> None:
        """Replace the error-feedback residuals (fp32 arrays by fragment)."""

    def take_stats(self) -> dict[str, Any]:
        """Transport counters since the last call (then reset)."""

    def close(self) -> None:
        """Stop; exchanges still pending are abandoned."""


class SyncBuffers:
    """fp32 buffers reused from one sync to the next for the pseudo-gradient a replica sends and
    the new global value a receiver joins or decodes. A fresh buffer costs its page faults on
    first touch (measured: 0.28 s to fault 100M fp32 values in, against 0.09 s for the
    subtraction that fills them), a reused one does not.

    The training thread takes a pseudo-gradient buffer; the transport gives it back once the
    bytes are in the object store and may take one for the value it decodes; the training
    thread gives the old global value back at the merge. A request is served by the smallest
    free buffer that holds it and is at most 25% larger (a view of its first ``numel`` values),
    so streaming fragments of about the same size share buffers. Free buffers are kept up to
    twice the largest size asked for (the oldest given back go first). Thread-safe. Only
    tensors this object handed out are taken back (by identity); anything else given is ignored.
    """

    def __init__(self, pin: bool = False):
        self.pin = pin  # page-locked host memory (a CUDA worker: asynchronous copies to and from the GPU)
        self._free: list[torch.Tensor] = []  # whole buffers, in the order given back
        self._ours: dict[int, weakref.ref] = {}  # id -> a whole buffer handed out (identity, not value)
        self._largest = 0
        self._lock = threading.Lock()
        self.allocated = 0  # buffers made (not reused) so far

    def take(self, numel: int) -> torch.Tensor:
        """``numel`` fp32 values, uninitialised: a free buffer (or a view of its start) when one
        is large enough, else a new one."""
        numel = int(numel)
        with self._lock:
            self._largest = max(self._largest, numel)
            fits = [i for i, f in enumerate(self._free) if numel <= f.numel() <= numel * 5 // 4]
            if fits:
                base = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                return base if base.numel() == numel else base[:numel]
        t = torch.empty(numel, dtype=torch.float32, pin_memory=self.pin)
        with self._lock:
            self._ours = {k: r for k, r in self._ours.items() if r() is not None}
            self._ours[id(t)] = weakref.ref(t)
            self.allocated += 1
        return t

    def give(self, t: torch.Tensor | None) -> None:
        """Hand back ``t`` (from :meth:`take`); the caller must hold no other reference to its
        values. Kept within the bound above, else dropped."""
        if t is None:
            return
        base = t if t._base is None else t._base
        if t.data_ptr() != base.data_ptr():  # a slice further in is not what take handed out
            return
        with self._lock:
            ref = self._ours.get(id(base))
            if ref is None or ref() is not base or any(f is base for f in self._free):
                return
            self._free.append(base)
            while sum(f.numel() for f in self._free) > 2 * self._largest:
                self._free.pop(0)

    @property
    def free_bytes(self) -> int:
        """Bytes of the free buffers kept."""
        with self._lock:
            return sum(t.numel() * 4 for t in self._free)


@dataclasses.dataclass
class PendingSync:
    """A fragment sent at ``send_step`` whose new global value is merged at ``apply_step``.
    ``future`` resolves to a ``core.wire.SyncResult``; after a resume ``result`` holds it (the
    new global value restored from the driver's checkpoint, bytes and status from the
    worker's). ``prev_send``: the fragment's previous send step, restored if the round fails."""

    fragment: int
    send_step: int
    apply_step: int
    future: Future | None
    prev_send: int = 0
    result: SyncResult | None = None

    def outcome(self) -> SyncResult:
        """The finished exchange (waits for it); re-raises a failed one."""
        if self.result is None:
            assert self.future is not None  # None only with a restored result
            self.result = self.future.result()
        return self.result

    def row(self) -> list[Any]:
        """As checkpointed: fragment, send and merge steps, bytes up and down, status, the
        version its new global value is, and the fragment's previous send step (waits)."""
        res = self.outcome()
        return [
            self.fragment,
            self.send_step,
            self.apply_step,
            res.bytes_up,
            res.bytes_down,
            res.status,
            res.version,
            self.prev_send,
        ]


@dataclasses.dataclass
class HeldFragment:
    """One fragment as a replica's worker holds it (Streaming DiLoCo, arXiv 2501.18512, section 2).

    ``spec``: which parameters it covers (``core.fragments.Fragment``). ``global_``: the global
    value last received (host fp32 ``[numel]``; None until loaded), ``version`` outer steps old;
    ``device``: its copy on the training device (device globals, ``core.staging``), else None;
    ``last_send``: the inner step of its last send (a pseudo-gradient's weight counts the steps
    since). Its error-feedback residual is the transport's (``Transport.residual_state``) and a
    sync in flight is a :class:`PendingSync` in ``FragmentSync.pending``."""

    spec: Fragment
    global_: torch.Tensor | None = None
    version: int = 0
    device: torch.Tensor | None = None
    last_send: int = 0

    def current(self) -> torch.Tensor | None:
        """The global value merges and resets read: the device copy when there is one."""
        return self.global_ if self.device is None else self.device


@dataclasses.dataclass
class CommCounters:
    """Bytes of the syncs this worker merged (counted at the merge, so a sync belongs to the
    outer step it lands in, also across a resume)."""

    bytes_up: int = 0
    bytes_down: int = 0
    events: int = 0
    peak_event_bytes: int = 0  # largest up + down of one sync

    def add(self, up: int, down: int) -> None:
        """Count one merged sync."""
        self.bytes_up += up
        self.bytes_down += down
        self.events += 1
        self.peak_event_bytes = max(self.peak_event_bytes, up + down)


class FragmentSync:
    """One worker's side of the fragment syncs: global fragments and their versions, last send
    steps, syncs in flight, byte counters.

    Args:
        params: the model's parameters by name (updated in place by merges and resets).
        fragments: the exchange plan (``core.fragments``).
        alpha: the merge factor (``streaming.alpha``).
        batch, seq_len, world_size: a pseudo-gradient's weight is the tokens the replica trained
            since the fragment's last send, ``steps * batch * seq_len * world_size``.
        rank: the worker's rank in its replica; only rank 0 computes pseudo-gradients.
        on_reset: called after a reset to the global parameters (clear the inner optimiser).

    ``held`` (:class:`HeldFragment`, one per fragment) holds each fragment's global value,
    version, device copy and last send step; its host global value is always current:
    checkpoints, hashes and the transport read it. ``buffers`` (:class:`SyncBuffers`) are shared
    with the transport: pseudo-gradients are computed into them (or copied there from the
    device) and old global values go back to them at the merge.
    """

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        fragments: list[Fragment],
        *,
        alpha: float,
        batch: int,
        seq_len: int,
        world_size: int,
        rank: int = 0,
        on_reset: Callable[[], None] | None = None,
    ):
        self.params, self.alpha = params, alpha
        self.batch, self.seq_len, self.world_size, self.rank = batch, seq_len, world_size, rank
        self.on_reset = on_reset
        self.on_sync: Callable[[str, dict[str, Any]], None] | None = None  # see observe
        self.held = [HeldFragment(f) for f in fragments]
        self.staging: DeviceStaging | None = None  # see attach
        self.schedule: SyncSchedule | None = None
        self.transport: Transport | None = None
        self.pending: list[PendingSync] = []
        self.comm = CommCounters()
        self.buffers = SyncBuffers()

    # -- set-up ----------------------------------------------------------------------------
    def observe(self, on_sync: Callable[[str, dict[str, Any]], None] | None) -> None:
        """Call ``on_sync(event, tensors)`` at each send (``"sent"``: fragment, send step, the
        global and local fp32 values then) and merge (``"merged"``: the apply step, new global,
        local values before the merge, merged values); host copies, for inspection (tests,
        debugging). None: stop. Nothing is recorded otherwise."""
        self.on_sync = on_sync

    def attach(self, schedule: SyncSchedule, transport: Transport, staging: DeviceStaging | None = None) -> None:
        """From now on :meth:`step` syncs fragments on ``schedule`` through ``transport``.

        ``staging``: the worker's :class:`~ray_diloco.core.staging.DeviceStaging` (the transport's
        too); when it is ``on_device`` (a CUDA worker, ``streaming.device_globals``) a device copy of
        every global fragment is kept (``HeldFragment.device``), pseudo-gradients and merges are
        computed on the device and copied to and from (pinned) host memory off the training
        stream. None: the parameters are read and written through host copies."""
        self.schedule, self.transport = schedule, transport
        if staging is not None and staging.on_device:
            self.staging, self.buffers.pin = staging, staging.pin
            for h in self.held:
                h.device = None if h.global_ is None else staging.put(h.global_)

    @property
    def attached(self) -> bool:
        """Whether a transport is attached (DiLoCo); False for the DP baseline."""
        return self.transport is not None

    def close(self) -> None:
        """Close the transport (pending exchanges are abandoned)."""
        if self.transport is not None:
            self.transport.close()

    # -- global fragments ------------------------------------------------------------------
    def load_global(self, fragment: int, global_p: np.ndarray, version: int = 0) -> None:
        """Adopt the global fragment (fp32 ``[numel_p]``, at ``version`` outer steps) and overwrite the
        local parameters with it. A read-only array (an object-store value, shared by the workers
        of a node) is kept as a view, as the replies are; a writable one is copied."""
        arr = np.asarray(global_p, dtype=np.float32).reshape(-1)
        h = self.held[fragment]
        h.global_, h.version = as_tensor(arr) if not arr.flags.writeable else torch.from_numpy(arr.copy()), int(version)
        if self.staging is not None:
            h.device = self.staging.put(h.global_)
        unflatten_into(self.params, h.spec, cast(torch.Tensor, h.current()))

    def global_fragment(self, fragment: int) -> np.ndarray:
        """The global value of ``fragment`` held (fp32 ``[numel_p]``, a copy)."""
        g = self.held[fragment].global_
        assert g is not None  # loaded
        return g.numpy().copy()

    def global_hash(self) -> str:
        """sha256 of the global parameters held (all fragments loaded so far)."""
        return tensor_hash([h.global_ for h in self.held if h.global_ is not None])

    def pseudo_gradient_hash(self) -> str:
        """sha256 of ``global - local`` of every fragment."""
        # every fragment loaded
        return tensor_hash([cast(torch.Tensor, h.global_) - flatten(self.params, h.spec) for h in self.held])

    def reset_to_global(self) -> None:
        """Local parameters of every fragment <- the global ones held; then ``on_reset``."""
        for h in self.held:
            if (g := h.current()) is not None:
                unflatten_into(self.params, h.spec, g)
        if self.on_reset is not None:
            self.on_reset()

    def join(self, globals_: list[np.ndarray], versions: list[int], step: int) -> None:
        """Start as a joiner at inner step ``step``: local and global parameters <- ``globals_``
        at ``versions``; no sync in flight, every fragment last sent at ``step``, counters zero."""
        for f, g in enumerate(globals_):
            self.load_global(f, g, versions[f])
        self.pending = []
        for h in self.held:
            h.last_send = step
        self.comm = CommCounters()

    # -- the syncs -------------------------------------------------------------------------
    def step(self, t: int) -> float:
        """Every send and merge due after inner step ``t``; returns seconds blocked on the
        transport. Merges happen at their ``apply_step`` (``send + tau``), never before."""
        assert self.schedule is not None  # attached
        for f in self.schedule.sends_at(t):
            self._send(f, t)
        waited = 0.0
        while self.pending and self.pending[0].apply_step <= t:
            waited += self._merge(self.pending.pop(0))
        return waited

    def _send(self, f: int, t: int) -> None:
        """Start fragment ``f``'s sync at step ``t``: copy out ``global - local`` (rank 0) and hand
        it to the transport; the merge is queued for ``schedule.apply_step(t)``."""
        h = self.held[f]
        frag, g = h.spec, h.global_
        assert g is not None and self.transport is not None and self.schedule is not None  # loaded, attached
        # DiLoCo Algorithm 1 line 8: global minus local, computed on rank 0 only into a reused
        # buffer (SyncBuffers), handed back by the transport once it has sent it; with device
        # globals computed on the device and handed to the transport there (core.staging)
        delta: torch.Tensor | PseudoGradient | None = None
        ready = None
        if self.rank == 0 and self.staging is None and self.transport.reads_lazily and self._waits_for(t):
            delta = PseudoGradient(g, self.params, frag)  # read as it is encoded: no fragment-sized buffer
        elif self.rank == 0 and self.staging is None:
            delta = pseudo_gradient(g, self.params, frag, out=self.buffers.take(frag.numel))
        elif self.rank == 0:
            assert self.staging is not None  # the branch above takes None
            delta = pseudo_gradient(cast(torch.Tensor, h.device), self.params, frag)  # kept with staging
            ready = self.staging.hand_off(delta)
        weight = float((t - h.last_send) * self.batch * self.seq_len * self.world_size)
        prev, h.last_send = h.last_send, t
        fut = self.transport.exchange(f, t, weight, delta, g, h.version, self.schedule.averages(f, t), ready=ready)
        self.pending.append(PendingSync(f, t, self.schedule.apply_step(t), fut, prev))
        if self.on_sync is not None:
            self.on_sync("sent", {"fragment": f, "send_step": t, "old_global": g.clone(),
                                  "local_at_send": flatten(self.params, frag)})  # fmt: skip

    def _waits_for(self, t: int) -> bool:
        """Whether the training thread does nothing but wait for the one sync it starts at step
        ``t`` until it is answered (no overlap, one fragment sent, nothing else pending): the
        parameters stay put while a transport reads the pseudo-gradient lazily."""
        assert self.schedule is not None  # attached
        return self.schedule.apply_step(t) == t and len(self.schedule.sends_at(t)) == 1 and not self.pending

    def _merge(self, e: PendingSync) -> float:
        """Merge a finished sync by its status (see the module); returns seconds blocked."""
        t0 = time.perf_counter()
        res = e.outcome()
        waited = time.perf_counter() - t0
        new = res.new_global
        self.comm.add(res.bytes_up, res.bytes_down)
        f, alpha, h = e.fragment, self.alpha, self.held[e.fragment]
        frag, old = h.spec, h.global_
        h.global_, h.version = new, res.version
        same = old is not None and old.untyped_storage().data_ptr() == new.untyped_storage().data_ptr()
        if self.staging is not None and not same:  # the device copy: staged by the transport, else copied now
            h.device = self.staging.adopt(res.staged) if res.staged is not None else self.staging.put(new)
        held = h.current()
        assert held is not None  # a device copy is kept of every loaded fragment
        # the local values are read only where the merge or an observer needs them (not for alpha 0)
        local = flatten(self.params, frag, held.device) if self.on_sync is not None or 0 < alpha < 1 else None
        merged: torch.Tensor | None
        if res.status == FAILED:
            h.last_send = e.prev_send
            merged = local
        elif res.status == REJECTED:
            self.reset_to_global()
            merged = held
        elif alpha == 1:
            merged = local
        else:
            # local is read for 0 < alpha < 1
            merged = held if alpha == 0 else alpha * cast(torch.Tensor, local) + (1 - alpha) * held
            unflatten_into(self.params, frag, merged)
        if self.on_sync is not None:
            assert merged is not None  # an observer reads the local values
            self.on_sync("merged", {"fragment": f, "send_step": e.send_step, "apply_step": e.apply_step,
                                    "new_global": new.clone(), "local_before_merge": _host(local),
                                    "merged": merged.to("cpu", copy=True)})  # fmt: skip
        # an exchange reads its old global only while its sync is pending (join and
        # load_state_dict replace the globals before dropping pending syncs, so an abandoned
        # exchange never reads a buffer given here); an observer is given clones
        if old is not None and not same and not any(p.fragment == f for p in self.pending):
            self.buffers.give(old)
        del old
        return waited

    def settle(self) -> int:
        """Wait until every sync started is answered (not merged: merges stay at their step);
        re-raises a failed exchange. Returns the number of syncs in flight."""
        for e in self.pending:
            e.outcome()
        return len(self.pending)

    def link_metrics(self, since: CommCounters) -> dict[str, Any]:
        """Bytes and events merged since the ``since`` snapshot of :attr:`comm`, the largest sync,
        and the transport's counters (taken)."""
        c = self.comm
        assert self.transport is not None  # attached
        return {
            "bytes_up": c.bytes_up - since.bytes_up,
            "bytes_down": c.bytes_down - since.bytes_down,
            "events": c.events - since.events,
            "peak_event_bytes": c.peak_event_bytes,
            **self.transport.take_stats(),
        }

    # -- checkpoint ------------------------------------------------------------------------
    def state_dict(self, residuals: bool = True) -> dict[str, Any]:
        """``last_send``, ``pending`` (rows, see :meth:`PendingSync.row`; waits for them) and
        ``comm``; with ``residuals`` also the transport's error-feedback ``residuals`` when
        there are any. Call :meth:`settle` first so residuals are settled."""
        state = {
            "last_send": [h.last_send for h in self.held],
            "pending": [e.row() for e in self.pending],
            "comm": dataclasses.asdict(self.comm),
        }
        if residuals and self.transport is not None:
            res = self.transport.residual_state()
            if res:
                state["residuals"] = res
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (older checkpoints: missing keys and 5-column pending rows).
        Call after :meth:`load_global`: syncs that were in flight at the checkpoint merge the
        global values loaded, at their original merge step."""
        for h, last in zip(self.held, state.get("last_send", [0] * len(self.held)), strict=True):
            h.last_send = int(last)
        self.pending = []
        for p in state.get("pending", []):
            h = self.held[int(p[0])]
            status, version, prev = (p[5], int(p[6]), int(p[7])) if len(p) > 5 else (OK, h.version, 0)
            res = SyncResult(cast(torch.Tensor, h.global_), int(p[3]), int(p[4]), status, version)
            self.pending.append(PendingSync(int(p[0]), int(p[1]), int(p[2]), None, prev, res))
        self.comm = CommCounters(**state.get("comm", {}))
        if self.transport is not None:
            self.transport.load_residual_state(state.get("residuals", {}))
