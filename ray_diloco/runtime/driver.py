"""The outer-optimiser driver: sync rounds, the quorum, timeouts and replica membership.

The driver is an async Ray actor that holds the global parameters and the outer optimiser
(:class:`~ray_diloco.core.outer.OuterOptimizer`). Each replica's rank 0 submits its quantised
pseudo-gradient of a fragment with :meth:`OuterDriver.exchange`; the other ranks of the
replica wait for the same answer with :meth:`OuterDriver.result`. A round is keyed
``(fragment, send step)`` from the pure schedule, so every process agrees on it after any
restart or join.

Elasticity (DiLoCo, arXiv 2311.08105, section 3 "dropping outer gradients"):

- A round expects the *members* that joined before its send step. It completes as soon as all
  of them have answered, or ``diloco.sync_timeout_s`` after it opened; a member that died
  (:meth:`OuterDriver.remove_member`) or missed the timeout is left out of that average.
- With at least ``diloco.min_replicas`` valid pseudo-gradients the round takes an outer step
  on their token-weighted mean; otherwise it *fails*: global parameters and outer state stay
  as they are, and the replicas keep their local progress for the next round.
- A non-finite pseudo-gradient (the replica abstains, or the driver finds one after decoding)
  is *rejected*: logged, left out, and the replica is told to reset to the global parameters.
- Every fragment has a version (outer steps applied). A receiver whose version is the round's
  base gets the quantised update (bitwise-identical globals everywhere); any other receiver (a
  late or stale one) gets a full-precision resync of the fragment.

Transport and memory (issue 14): pseudo-gradients arrive as object-store references (numpy
buffers, pickle-5 out of band: a ``none`` one is the fp32 array itself, read without a copy) and
are checked (finite, norm) as they arrive and summed into the token-weighted mean
(``core.outer.OrderedMean``) in replica-id order, by reference, in one chunked pass when the
round closes (bitwise the plain fp32 DiLoCo mean); the reply of a round is one object put once
and shared by every receiver. Decoding, the mean,
the outer step and the encoding run on one maths thread (FIFO: the order of the sums is fixed),
never on the event loop, so pings and membership calls are answered during an outer step. Open
rounds close within the timeout (plus ``core.wire.transfer_allowance_s`` of the fragment's
bytes), and at most :data:`KEEP_FINISHED` finished round per fragment is kept.
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from ray_diloco.core.outer import OrderedMean, OuterOptimizer, finite_norm
from ray_diloco.core.quantize import from_message, message_nbytes
from ray_diloco.core.wire import (DROPPED, FAILED, OK, REJECTED, Downlink, Reply, message_size, message_values,
                                  transfer_allowance_s)

#: Finished rounds kept per fragment for receivers that ask late (older ones get a resync).
KEEP_FINISHED = 1
#: Membership events kept until the trainer collects them.
MAX_EVENTS = 1000


@dataclass
class _Round:
    """One open fragment sync on the driver: pseudo-gradients in (summed in replica order), then
    one outcome."""

    opened: float
    mean: OrderedMean
    arrived: set[int] = field(default_factory=set)  # submitted, valid or not
    held: dict[int, tuple[float, Any, int]] = field(default_factory=dict)  # weight, check, bytes: not yet added
    included: list[int] = field(default_factory=list)  # in the mean, in order
    norms: dict[int, float] = field(default_factory=dict)
    rejected: set[int] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    bytes_up: int = 0
    average_only: bool = False  # a closing round (schedule.averages): the mean, no outer step
    closing: bool = False


@dataclass
class _Finished:
    """The outcome of a closed round, kept for receivers that ask for it."""

    failed: bool
    base_version: int
    message: Any  # ObjectRef of the downlink message (one object for every receiver), or None
    size: int
    included: frozenset[int]
    rejected: frozenset[int]


def _maths_threads() -> int:
    """Threads for the outer step's tensor maths (Ray gives a ``num_cpus=0`` actor one)."""
    try:
        return max(1, min(4, len(os.sched_getaffinity(0))))
    except AttributeError:
        return max(1, min(4, os.cpu_count() or 1))


def _decode_and_check(message: Any) -> tuple[np.ndarray | None, float | None]:
    """(a check thread) A pseudo-gradient's fp32 values (a view of a ``none`` message) and their
    norm, or ``(None, None)`` when it is malformed or not finite."""
    try:
        values = message_values(message)[1]
    except ValueError:
        return None, None
    norm = finite_norm(values)
    return (values, norm) if norm is not None else (None, None)


class _DriverState:
    """The driver's read and checkpoint calls (a part of :class:`OuterDriver`): every access to the
    global parameters, versions, residuals and stats goes through the maths thread, after the
    outer steps submitted before it."""

    opt: OuterOptimizer
    stats: list[dict[str, Any]]
    _pool: ThreadPoolExecutor

    async def _maths(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the maths thread (after every job submitted before it)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def take_stats(self, max_send_step: int | None = None) -> list[dict[str, Any]]:
        """Per-round figures (fragment, send step, update norm, bytes) of the completed rounds sent
        at or before ``max_send_step`` (all if None); later ones are kept for a later call (and in
        :meth:`state_dict`), so each round is reported in the outer step its replicas merge it."""
        def take() -> list[dict[str, Any]]:
            due = [r for r in self.stats if max_send_step is None or r["step"] <= max_send_step]
            self.stats = [r for r in self.stats if not (max_send_step is None or r["step"] <= max_send_step)]
            return due

        return await self._maths(take)

    # -- global parameters and state (read and written on the maths thread) ------------------
    def ping(self) -> int:
        """The driver's process id (the trainer's liveness check; answered during an outer step)."""
        return os.getpid()

    async def global_refs(self) -> list[Any]:
        """Every global fragment (fp32 ``[numel_p]``) put once into the object store."""
        return await self._maths(lambda: [ray.put(p.numpy()) for p in self.opt.params])

    async def global_params(self) -> list[np.ndarray]:
        """Copies of every global fragment, fp32 ``[numel_p]``."""
        return await self._maths(self.opt.global_params)

    async def global_versions(self) -> list[int]:
        """Outer steps applied to each fragment (what a joiner's versions start from)."""
        return await self._maths(lambda: list(self.versions))

    async def state_dict(self) -> dict[str, Any]:
        """The outer optimiser's state, the downlink residuals, fragment versions, the newest
        finished round per fragment and the figures of completed rounds not yet reported."""
        return await self._maths(lambda: {
            **self.opt.state_dict(), "residuals": self.downlink.state_dict(),
            "versions": list(self.versions), "completed": list(self.last_finished),
            "stats": copy.deepcopy(self.stats)})

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        await self._maths(self._load_state_dict, state)

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state)
        n = len(self.opt.params)
        self.downlink.load_state_dict(state.get("residuals"))
        self.versions = list(state.get("versions", [0] * n))
        self.last_finished = list(state.get("completed", [0] * n))
        self.stats = copy.deepcopy(list(state.get("stats", [])))

    async def state_hash(self) -> dict[str, str]:
        """sha256 of the global parameters and of the outer optimiser buffers."""
        return await self._maths(self.opt.state_hash)

    def pending_rounds(self) -> int:
        """Open rounds (waiting for pseudo-gradients or closing)."""
        return len(self.rounds)

    def memory(self) -> dict[str, int]:
        """What the driver holds: open and finished rounds, their bytes (held pseudo-gradients,
        running means, kept replies), queued events and stats, and the process's resident
        memory (bytes, from /proc; 0 where unavailable)."""
        held = sum(size for r in self.rounds.values() for _, _, size in r.held.values())
        held += sum(r.mean.nbytes for r in self.rounds.values())
        held += sum(f.size for f in self.finished.values())
        try:
            with open("/proc/self/statm") as fh:
                rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            rss = 0
        return {"open_rounds": len(self.rounds), "finished_rounds": len(self.finished), "held_bytes": held,
                "events": len(self.events), "stats": len(self.stats), "failed_rounds": self.failed_rounds,
                "rss_bytes": rss}


class OuterDriver(_DriverState):
    """The outer-optimiser driver (use :data:`OuterDriverActor` for the Ray actor).

    Args:
        initial: fp32 ``[numel_p]`` per fragment (the replicas' common initialisation), or None
            to give it later with :meth:`init_global` (the trainer starts this actor's process
            while the replicas start, before their initialisation is known).
        cfg: the run config (dict). members: ``{replica id: join step}`` of the replicas that
            start with the run (default: ``0 .. diloco.replicas - 1`` at step 0).
    """

    def __init__(self, initial: list[np.ndarray] | None, cfg: dict[str, Any], members: dict[int, int] | None = None):
        from ray_diloco.config import load_config

        self.cfg = load_config(cfg, validate=False)
        c = self.cfg
        self.opt: OuterOptimizer | None = None
        self.quorum = c.diloco.min_replicas
        self.timeout_s = c.diloco.sync_timeout_s
        self.members: dict[int, int] = dict(members) if members is not None else \
            {m: 0 for m in range(c.diloco.replicas)}
        self.removed: set[int] = set()
        self.rounds: dict[tuple[int, int], _Round] = {}
        self.finished: dict[tuple[int, int], _Finished] = {}
        self.stats: list[dict[str, Any]] = []
        self.events: deque = deque(maxlen=MAX_EVENTS)
        self.failed_rounds = 0
        torch.set_num_threads(_maths_threads())
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outer-maths")  # FIFO: fixed order
        # decoding and checking a pseudo-gradient needs no order: they run side by side as they arrive
        self._checks = ThreadPoolExecutor(max_workers=_maths_threads(), thread_name_prefix="outer-check")
        if initial is not None:
            self._set_global(initial)

    async def init_global(self, initial: list[Any]) -> None:
        """Set the global parameters (fp32 ``[numel_p]`` per fragment, or an ObjectRef of one: the
        trainer passes rank 0's fragments by reference, so they never pass through the job's
        process) and a zero outer-optimiser state, once, before any round.

        Raises:
            RuntimeError: the global parameters were already set.
        """
        values = [await g if isinstance(g, ray.ObjectRef) else g for g in initial]
        self._set_global(values)

    def _set_global(self, initial: list[np.ndarray]) -> None:
        if self.opt is not None:
            raise RuntimeError("the outer driver's global parameters are already set")
        self.opt = OuterOptimizer(initial, self.cfg.outer)
        self.versions = [0] * len(self.opt.params)
        s = self.cfg.streaming
        self.downlink = Downlink(s.quantization, s.error_feedback, len(self.opt.params))
        self.finished_order: list[deque] = [deque() for _ in self.opt.params]
        self.last_finished = [0] * len(self.opt.params)  # send step of the newest finished round

    # -- membership --------------------------------------------------------------------------
    def add_member(self, replica: int, join_step: int, **info: Any) -> None:
        """Expect ``replica`` in every round sent after inner step ``join_step`` (``info`` goes
        into the join event)."""
        self.members[int(replica)] = int(join_step)
        self.removed.discard(int(replica))
        self._event("join", replica, step=join_step, **info)

    def remove_member(self, replica: int, reason: str, kind: str = "death") -> None:
        """Stop expecting ``replica`` (``kind``: ``death`` or ``leave``); open rounds that now
        have every remaining member's answer complete at once."""
        if self.members.pop(int(replica), None) is None:
            return
        self.removed.add(int(replica))
        self._event(kind, replica, reason=reason)
        for key in list(self.rounds):
            self._maybe_finish(*key)

    def member_ids(self) -> dict[int, int]:
        """``{replica id: join step}`` of the current members."""
        return dict(self.members)

    def take_events(self) -> list[dict[str, Any]]:
        """Membership events since the last call (join, leave, death, timeout, late, rejected,
        round_failed), oldest first."""
        out = list(self.events)
        self.events.clear()
        return out

    def _event(self, kind: str, replica: int | None = None, **info: Any) -> None:
        self.events.append({"event": kind, "replica": replica, "time": time.time(), **info})

    # -- rounds ------------------------------------------------------------------------------
    def _check(self, fragment: int, replica: int) -> None:
        if not 0 <= fragment < len(self.opt.params):
            raise ValueError(f"fragment {fragment}: not in [0, {len(self.opt.params)})")
        if replica not in self.members and replica not in self.removed:
            raise ValueError(f"replica {replica}: not a member of this run (members: {sorted(self.members)})")

    def _is_closed(self, fragment: int, step: int) -> bool:
        r = self.rounds.get((fragment, step))
        if r is not None:
            return r.closing
        return (fragment, step) in self.finished or step <= self.last_finished[fragment]

    def _open(self, fragment: int, step: int) -> _Round:
        r = self.rounds.get((fragment, step))
        if r is None:
            r = self.rounds[(fragment, step)] = _Round(time.monotonic(), OrderedMean(self.opt.params[fragment].numel()))
        return r

    def _expected(self, step: int) -> set[int]:
        return {m for m, joined in self.members.items() if joined < step}

    def _drain(self, fragment: int, step: int, r: _Round, final: bool = False) -> None:
        """Hand the held pseudo-gradients whose turn has come (no smaller expected replica still
        missing; all of them when ``final``) to the maths thread, in replica order."""
        waiting = self._expected(step) - r.arrived
        ready = []
        for m in sorted(r.held):
            if not final and any(w < m for w in waiting):
                break
            weight, check, _ = r.held.pop(m)
            ready.append((m, weight, check))
        if ready:
            asyncio.get_running_loop().run_in_executor(self._pool, self._add, fragment, step, r, ready)

    def _add(self, fragment: int, step: int, r: _Round, items: list[tuple[int, float, Any]]) -> None:
        """(maths thread) Add the checked pseudo-gradients to the round's mean, in order (waiting
        for their checks, :func:`_decode_and_check`); a non-finite one is rejected."""
        for m, weight, check in items:
            values, norm = check.result()
            del check
            if norm is None:
                r.rejected.add(m)
                self._event("rejected", m, fragment=fragment, step=step, reason="non-finite pseudo-gradient")
                continue
            if weight > 0:
                r.mean.add(values, weight)
            r.included.append(m)
            r.norms[m] = norm

    def _maybe_finish(self, fragment: int, step: int) -> None:
        r = self.rounds.get((fragment, step))
        if r is None or r.closing:
            return
        self._drain(fragment, step, r)
        if r.arrived and self._expected(step) <= r.arrived:
            self._close(fragment, step, "complete")

    def _close(self, fragment: int, step: int, cause: str) -> None:
        r = self.rounds[(fragment, step)]
        r.closing = True
        if cause == "timeout":
            for m in sorted(self._expected(step) - r.arrived):
                self._event("timeout", m, fragment=fragment, step=step, timeout_s=self.timeout_s)
        self._drain(fragment, step, r, final=True)
        asyncio.ensure_future(self._finish(fragment, step, r))

    async def _finish(self, fragment: int, step: int, r: _Round) -> None:
        base = self.versions[fragment]
        try:
            rec = await self._maths(self._step_round, fragment, step, r)
        except Exception as e:  # a bug, not a replica's fault: fail the round loudly, keep serving
            self._event("round_failed", None, fragment=fragment, step=step, error=repr(e))
            rec = _Finished(True, base, None, 0, frozenset(), frozenset(r.rejected))
        if rec.failed:
            self.failed_rounds += 1
        self.finished[(fragment, step)] = rec
        keep = self.finished_order[fragment]
        keep.append((fragment, step))
        while len(keep) > KEEP_FINISHED:
            self.finished.pop(keep.popleft(), None)
        self.last_finished[fragment] = max(self.last_finished[fragment], step)
        self.rounds.pop((fragment, step), None)
        r.done.set()

    def _step_round(self, fragment: int, step: int, r: _Round) -> _Finished:
        """(maths thread, after every ``_add`` of the round) The outer step on the mean, or a
        failed round without quorum."""
        base = self.versions[fragment]
        order = list(r.included)
        if len(order) >= self.quorum and r.mean.total > 0:
            ref, size, update_norm = self._downlink(fragment, r.mean, r.average_only)
            self.versions[fragment] += 1
            self.stats.append({"fragment": fragment, "step": step, "update_norm": update_norm,
                               "delta_norms": {m: r.norms[m] for m in order}, "replicas": order,
                               "bytes_up": r.bytes_up, "bytes_down": size * len(self._expected(step) | set(order))})
            return _Finished(False, base, ref, size, frozenset(order), frozenset(r.rejected))
        r.mean.clear()
        self._event("round_failed", None, fragment=fragment, step=step, valid=len(order), quorum=self.quorum,
                    cause="timeout" if self._expected(step) - r.arrived else "complete")
        return _Finished(True, base, None, 0, frozenset(), frozenset(r.rejected))

    def _downlink(self, fragment: int, mean: OrderedMean, average_only: bool) -> tuple[Any, int, float]:
        """(maths thread) The outer step of ``fragment`` (``OuterOptimizer.step_ordered``: the mean
        and the step in one chunked pass) and its reply, put once into the object store: with
        ``none`` the new global fragment itself; otherwise the quantised update, which the
        driver applies to its own copy exactly as every receiver does
        (``core.wire.Downlink.encode_update``). Returns the reference, the message's bytes and
        the norm of the update applied."""
        s, p = self.cfg.streaming, self.opt.params[fragment]
        if s.quantization == "none":
            norm, _ = self.opt.step_ordered(fragment, mean, average_only)
            return ray.put(p.numpy()), message_nbytes(p.numel(), "none"), norm
        _, update = self.opt.step_ordered(fragment, mean, average_only, keep_update=True)
        message, norm = self.downlink.encode_update(self.opt, fragment, update)
        del update
        return ray.put(np.frombuffer(message, np.uint8)), len(message), norm

    def _timeout_of(self, fragment: int) -> float:
        return self.timeout_s + transfer_allowance_s(message_nbytes(self.opt.params[fragment].numel(), "none"))

    async def _wait(self, fragment: int, step: int, r: _Round) -> None:
        remaining = r.opened + self._timeout_of(fragment) - time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(r.done.wait()), timeout=max(0.0, remaining))
        except asyncio.TimeoutError:
            if not r.closing:
                self._close(fragment, step, "timeout")
        await r.done.wait()

    async def _reply(self, fragment: int, step: int, replica: int, version: int) -> Reply:
        r = self.rounds.get((fragment, step))
        if r is not None and r.closing:
            await r.done.wait()
        rec = self.finished.get((fragment, step))
        if rec is None:  # forgotten (very late): catch up with the current global fragment
            status = DROPPED
        else:
            status = OK if replica in rec.included else REJECTED if replica in rec.rejected else \
                FAILED if rec.failed else DROPPED
        if rec is not None and not rec.failed and version == rec.base_version:
            return Reply(status, rec.base_version + 1, rec.message, size=rec.size)
        if version == self.versions[fragment]:
            return Reply(status, self.versions[fragment])
        current, ref = await self._maths(lambda: (self.versions[fragment], ray.put(self.opt.params[fragment].numpy())))
        return Reply(status, current, ref, resync=True, size=message_nbytes(self.opt.params[fragment].numel(), "none"))

    async def _receive(self, fragment: int, replica: int, message: Any) -> Any:
        """The message itself (``[ref]``: fetched from the object store, zero-copy), its size
        checked against the fragment before any state changes."""
        if isinstance(message, list):
            (ref,) = message
            message = await ref
        if message is None:
            return None
        n = self.opt.params[fragment].numel()
        if isinstance(message, np.ndarray) and message.dtype == np.float32:
            got = message.size
        else:
            got = from_message(message).numel  # malformed input is refused here
        if got != n:
            raise ValueError(f"replica {replica}: fragment {fragment} has {n} values, got {got}")
        return message

    async def exchange(self, fragment: int, step: int, replica: int, weight: float, message: Any,
                       version: int = 0, average_only: bool = False) -> Reply:
        """Submit replica ``replica``'s pseudo-gradient of ``fragment`` sent at inner step
        ``step`` (a ``core.wire`` message, fp32 ``[numel_p]`` once decoded, or ``[ObjectRef]``
        of one), weighted by ``weight`` (tokens trained since its last sync). ``message`` None:
        the replica found its pseudo-gradient non-finite and abstains. ``version``: the global
        version it holds. ``average_only``: a closing round (the weighted mean, no outer step).

        Returns the :class:`Reply` once the round is complete, timed out or failed (at most
        the round's timeout after it opened); its message is an ObjectRef shared by every
        receiver.

        Raises:
            ValueError: bad fragment or replica, a duplicate submission, a malformed message.
        """
        self._check(fragment, replica)
        message = await self._receive(fragment, replica, message)
        if replica not in self.members or self.members[replica] >= step or self._is_closed(fragment, step):
            if replica in self.members and self._is_closed(fragment, step):
                self._event("late", replica, fragment=fragment, step=step)
            return await self._reply(fragment, step, replica, version)
        r = self._open(fragment, step)
        r.average_only = r.average_only or average_only
        if replica in r.arrived:
            raise ValueError(f"replica {replica}: sent fragment {fragment} at step {step} twice")
        r.arrived.add(replica)
        r.bytes_up += message_size(message)
        if message is None or not np.isfinite(weight) or weight < 0:
            r.rejected.add(replica)
            self._event("rejected", replica, fragment=fragment, step=step, reason="non-finite pseudo-gradient")
        else:
            r.held[replica] = (float(weight), self._checks.submit(_decode_and_check, message), message_size(message))
        del message
        self._maybe_finish(fragment, step)
        if not r.done.is_set():
            await self._wait(fragment, step, r)
        return await self._reply(fragment, step, replica, version)

    async def result(self, fragment: int, step: int, replica: int = 0, version: int = 0,
                     average_only: bool = False) -> Reply:
        """The reply of a round for a rank > 0 of ``replica`` (waits for the round, at most its
        timeout after it opened)."""
        self._check(fragment, replica)
        if replica in self.members and not self._is_closed(fragment, step):
            r = self._open(fragment, step)
            r.average_only = r.average_only or average_only
            if not r.done.is_set():
                await self._wait(fragment, step, r)
        return await self._reply(fragment, step, replica, version)


#: The driver as a Ray actor. It reserves no CPU (it must not take a core a replica worker
#: needs); its maths thread sets its own torch threads (:func:`_maths_threads`).
OuterDriverActor = ray.remote(num_cpus=0)(OuterDriver)
