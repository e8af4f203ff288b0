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

Memory is bounded whatever happens: open rounds close within the timeout, and at most
:data:`KEEP_FINISHED` finished rounds per fragment are kept for late receivers.
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from ray_diloco.core.outer import OuterOptimizer
from ray_diloco.core.wire import DROPPED, FAILED, OK, REJECTED, Downlink, Reply
from ray_diloco.core.quantize import decode, encode, from_message, to_message

#: Finished rounds kept per fragment for receivers that ask late (older ones get a resync).
KEEP_FINISHED = 4
#: Membership events kept until the trainer collects them.
MAX_EVENTS = 1000

@dataclass
class _Round:
    """One open fragment sync on the driver: pseudo-gradients in, then one outcome."""

    opened: float
    deltas: dict[int, tuple[float, np.ndarray]] = field(default_factory=dict)  # replica -> (tokens, delta)
    rejected: set[int] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    bytes_up: int = 0
    average_only: bool = False  # a closing round (schedule.averages): the mean, no outer step


@dataclass
class _Finished:
    """The outcome of a closed round, kept for receivers that ask for it."""

    failed: bool
    base_version: int
    message: bytes | None
    included: frozenset[int]
    rejected: frozenset[int]


class OuterDriver:
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
        if initial is not None:
            self.init_global(initial)

    def init_global(self, initial: list[np.ndarray]) -> None:
        """Set the global parameters (fp32 ``[numel_p]`` per fragment) and a zero outer-optimiser
        state, once, before any round.

        Raises:
            RuntimeError: the global parameters were already set.
        """
        if self.opt is not None:
            raise RuntimeError("the outer driver's global parameters are already set")
        c = self.cfg
        self.opt = OuterOptimizer(initial, c.outer)
        self.versions = [0] * len(self.opt.params)
        self.downlink = Downlink(c.streaming.quantization, c.streaming.error_feedback, len(self.opt.params))
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
        return (fragment, step) in self.finished or ((fragment, step) not in self.rounds
                                                      and step <= self.last_finished[fragment])

    def _open(self, fragment: int, step: int) -> _Round:
        r = self.rounds.get((fragment, step))
        if r is None:
            r = self.rounds[(fragment, step)] = _Round(opened=time.monotonic())
        return r

    def _expected(self, step: int) -> set[int]:
        return {m for m, joined in self.members.items() if joined < step}

    def _maybe_finish(self, fragment: int, step: int) -> None:
        r = self.rounds.get((fragment, step))
        if r is not None and (r.deltas or r.rejected) and self._expected(step) <= set(r.deltas) | r.rejected:
            self._finish(fragment, step, "complete")

    def _finish(self, fragment: int, step: int, cause: str) -> None:
        r = self.rounds.pop((fragment, step))
        order = sorted(r.deltas)
        weights = [r.deltas[m][0] for m in order]
        base = self.versions[fragment]
        if cause == "timeout":
            for m in sorted(self._expected(step) - set(r.deltas) - r.rejected):
                self._event("timeout", m, fragment=fragment, step=step, timeout_s=self.timeout_s)
        if len(order) >= self.quorum and sum(weights) > 0:
            out = self.opt.step(fragment, weights, *[r.deltas[m][1] for m in order], average_only=r.average_only)
            message = self.downlink.encode(self.opt, fragment, out["before"])
            update_norm = float((self.opt.params[fragment] - out["before"]).norm())
            self.versions[fragment] += 1
            self.stats.append({"fragment": fragment, "step": step, "update_norm": update_norm,
                               "delta_norms": dict(zip(order, out["delta_norms"])), "replicas": order,
                               "bytes_up": r.bytes_up, "bytes_down": len(message) * len(self._expected(step) | set(order))})
            rec = _Finished(False, base, message, frozenset(order), frozenset(r.rejected))
        else:
            self.failed_rounds += 1
            self._event("round_failed", None, fragment=fragment, step=step, valid=len(order), quorum=self.quorum,
                        cause=cause)
            rec = _Finished(True, base, None, frozenset(), frozenset(r.rejected))
        self.finished[(fragment, step)] = rec
        keep = self.finished_order[fragment]
        keep.append((fragment, step))
        while len(keep) > KEEP_FINISHED:
            self.finished.pop(keep.popleft(), None)
        self.last_finished[fragment] = max(self.last_finished[fragment], step)
        r.deltas.clear()
        r.done.set()

    async def _wait(self, fragment: int, step: int, r: _Round) -> None:
        remaining = r.opened + self.timeout_s - time.monotonic()
        try:
            await asyncio.wait_for(r.done.wait(), timeout=max(0.0, remaining))
        except asyncio.TimeoutError:
            if not r.done.is_set():
                self._finish(fragment, step, "timeout")

    def _reply(self, fragment: int, step: int, replica: int, version: int) -> Reply:
        rec = self.finished.get((fragment, step))
        if rec is None:  # forgotten (very late): catch up with the current global fragment
            status = DROPPED
        else:
            status = OK if replica in rec.included else REJECTED if replica in rec.rejected else \
                FAILED if rec.failed else DROPPED
        current = self.versions[fragment]
        if rec is not None and not rec.failed and version == rec.base_version:
            return Reply(status, rec.base_version + 1, rec.message)
        if version == current:
            return Reply(status, current)
        return Reply(status, current, to_message(encode(self.opt.params[fragment], "none")), resync=True)

    async def exchange(self, fragment: int, step: int, replica: int, weight: float, message: bytes | None,
                       version: int = 0, average_only: bool = False) -> Reply:
        """Submit replica ``replica``'s pseudo-gradient of ``fragment`` sent at inner step
        ``step`` (a wire message, fp32 ``[numel_p]`` once decoded), weighted by ``weight``
        (tokens trained since its last sync). ``message`` None: the replica found its
        pseudo-gradient non-finite and abstains. ``version``: the global version it holds.
        ``average_only``: a closing round (the weighted mean, no outer step).

        Returns the :class:`Reply` once the round is complete, timed out or failed (at most
        ``sync_timeout_s`` after it opened).

        Raises:
            ValueError: bad fragment or replica, a duplicate submission, a malformed message.
        """
        self._check(fragment, replica)
        delta = None
        if message is not None:
            delta = decode(from_message(message))  # malformed input is refused before any state changes
            if delta.size != self.opt.params[fragment].numel():
                raise ValueError(f"replica {replica}: fragment {fragment} has {self.opt.params[fragment].numel()} "
                                 f"values, got {delta.size}")
        if replica not in self.members or self.members[replica] >= step or self._is_closed(fragment, step):
            if replica in self.members and self._is_closed(fragment, step):
                self._event("late", replica, fragment=fragment, step=step)
            return self._reply(fragment, step, replica, version)
        r = self._open(fragment, step)
        r.average_only = r.average_only or average_only
        if replica in r.deltas or replica in r.rejected:
            raise ValueError(f"replica {replica}: sent fragment {fragment} at step {step} twice")
        if delta is None or not np.isfinite(delta).all() or not np.isfinite(weight) or weight < 0:
            r.rejected.add(replica)
            self._event("rejected", replica, fragment=fragment, step=step, reason="non-finite pseudo-gradient")
        else:
            r.deltas[replica] = (float(weight), delta)
        r.bytes_up += len(message) if message is not None else 0
        self._maybe_finish(fragment, step)
        if not r.done.is_set():
            await self._wait(fragment, step, r)
        return self._reply(fragment, step, replica, version)

    async def result(self, fragment: int, step: int, replica: int = 0, version: int = 0,
                     average_only: bool = False) -> Reply:
        """The reply of a round for a rank > 0 of ``replica`` (waits for the round, at most
        ``sync_timeout_s`` after it opened)."""
        self._check(fragment, replica)
        if replica in self.members and not self._is_closed(fragment, step):
            r = self._open(fragment, step)
            r.average_only = r.average_only or average_only
            if not r.done.is_set():
                await self._wait(fragment, step, r)
        return self._reply(fragment, step, replica, version)

    def take_stats(self, max_send_step: int | None = None) -> list[dict[str, Any]]:
        """Per-round figures (fragment, send step, update norm, bytes) of the completed rounds sent
        at or before ``max_send_step`` (all if None); later ones are kept for a later call (and in
        :meth:`state_dict`), so each round is reported in the outer step its replicas merge it."""
        due = [r for r in self.stats if max_send_step is None or r["step"] <= max_send_step]
        self.stats = [r for r in self.stats if not (max_send_step is None or r["step"] <= max_send_step)]
        return due

    # -- global parameters and state ----------------------------------------------------------
    def ping(self) -> int:
        """The driver's process id (the trainer's liveness check)."""
        return os.getpid()

    def global_refs(self) -> list[Any]:
        """Every global fragment (fp32 ``[numel_p]``) put once into the object store."""
        return [ray.put(g) for g in self.opt.global_params()]

    def global_params(self) -> list[np.ndarray]:
        """Copies of every global fragment, fp32 ``[numel_p]``."""
        return self.opt.global_params()

    def global_versions(self) -> list[int]:
        """Outer steps applied to each fragment (what a joiner's versions start from)."""
        return list(self.versions)

    def state_dict(self) -> dict[str, Any]:
        """The outer optimiser's state, the downlink residuals, fragment versions, the newest
        finished round per fragment and the figures of completed rounds not yet reported."""
        return {**self.opt.state_dict(),
                "residuals": self.downlink.state_dict(),
                "versions": list(self.versions), "completed": list(self.last_finished),
                "stats": copy.deepcopy(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.opt.load_state_dict(state)
        n = len(self.opt.params)
        self.downlink.load_state_dict(state.get("residuals"))
        self.versions = list(state.get("versions", [0] * n))
        self.last_finished = list(state.get("completed", [0] * n))
        self.stats = copy.deepcopy(list(state.get("stats", [])))

    def state_hash(self) -> dict[str, str]:
        """sha256 of the global parameters and of the outer optimiser buffers."""
        return self.opt.state_hash()

    def pending_rounds(self) -> int:
        """Open rounds (waiting for pseudo-gradients)."""
        return len(self.rounds)

    def memory(self) -> dict[str, int]:
        """What the driver holds: open and finished rounds, their bytes, queued events and stats,
        and the process's resident memory (bytes, from /proc; 0 where unavailable)."""
        held = sum(d.nbytes for r in self.rounds.values() for _, d in r.deltas.values())
        held += sum(len(f.message or b"") for f in self.finished.values())
        try:
            with open("/proc/self/statm") as fh:
                rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            rss = 0
        return {"open_rounds": len(self.rounds), "finished_rounds": len(self.finished), "held_bytes": held,
                "events": len(self.events), "stats": len(self.stats), "failed_rounds": self.failed_rounds,
                "rss_bytes": rss}


#: The driver as a Ray actor. It needs no CPU reservation: its work is a few vector operations
#: per sync, and it must not take a core a replica worker needs.
OuterDriverActor = ray.remote(num_cpus=0)(OuterDriver)
