"""The rules of a sync round, in one synchronous book: no Ray, no asyncio, no arrays.

A round is keyed ``(fragment, send step)`` from the pure schedule (``core.schedules``), so every
process agrees on it after any restart or join. :class:`RoundBook` owns every decision about it;
the outer-optimiser driver (``runtime.driver``) feeds it arrivals and timers and carries its
decisions out on the outer shards (check, step, reply, resync).

Elasticity (DiLoCo, arXiv 2311.08105, section 3, "dropping outer gradients"):

- A round expects the *members* that joined before its send step. It is complete as soon as all
  of them have answered (:meth:`RoundBook.arrive`), or is closed ``diloco.sync_timeout_s`` after
  it opened plus the transfer allowance of its bytes (:meth:`RoundBook.time_out`); a member that died
  (:meth:`RoundBook.remove_member`) or missed the timeout is left out of that average.
- With at least ``diloco.min_replicas`` valid pseudo-gradients and a positive total weight the
  round takes an outer step on their token-weighted mean, in replica-id order
  (:meth:`RoundBook.terms`); otherwise it *fails*: global parameters and outer state stay as they
  are, and the replicas keep their local progress for the next round.
- A non-finite pseudo-gradient (the replica abstains, or a shard finds one when it checks it) is
  *rejected*: recorded, left out, and the replica is told to reset to the global parameters.
- A message for a round that is closed (or forgotten) is *late*: recorded, not counted.
- Every fragment has a version (outer steps applied). A receiver whose version is the round's
  base gets the round's update (bitwise-identical globals everywhere); any other receiver (a late
  or stale one) gets a full-precision resync of the fragment (:meth:`RoundBook.answer`).
- At most ``keep_finished`` finished rounds per fragment are kept for receivers that ask late;
  an older one is answered ``dropped`` with a resync.

Events (``join``, ``leave``, ``death``, ``timeout``, ``late``, ``rejected``, ``lost``,
``round_failed``, ...) are dicts ``{"event", "replica", "time", **info}``, oldest first.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray_diloco.core.wire import DROPPED, FAILED, OK, REJECTED

__all__ = ["Finished", "Round", "RoundBook"]


@dataclass
class Round:
    """One open fragment sync: checked pseudo-gradients in, then one outcome."""

    opened: float  # monotonic seconds
    arrived: set[int] = field(default_factory=set)  # submitted and checked, valid or not
    weights: dict[int, float] = field(default_factory=dict)  # valid ones: tokens trained
    norms: dict[int, float] = field(default_factory=dict)  # valid ones: L2 norm of the pseudo-gradient
    rejected: set[int] = field(default_factory=set)
    bytes_up: int = 0
    average_only: bool = False  # a closing round (schedule.averages): the mean, no outer step
    closing: bool = False
    parts: dict[int, list[Any]] = field(default_factory=dict)  # valid ones' messages (opaque), until stepped
    stepping: bool = False  # its outer step was started
    stepped: bool = False  # its outer step was taken
    lost: dict[int, set[int]] = field(default_factory=dict)  # rebuilt shard -> replicas whose part died


@dataclass
class Finished:
    """The outcome of a closed round, kept for receivers that ask for it."""

    failed: bool
    base_version: int  # the fragment's version before the round
    message: Any  # the round's reply message (opaque to the book), or None when it failed
    size: int  # bytes of ``message``
    included: frozenset[int]
    rejected: frozenset[int]


@dataclass
class FragmentRounds:
    """One fragment's place in the book: ``version`` (outer steps applied to its global value),
    ``last_finished`` (send step of its newest finished round), ``kept`` (its finished rounds
    kept for late receivers, oldest first) and ``must_resync`` (members whose next answer is a
    resync, :meth:`RoundBook.resync_all`)."""

    version: int = 0
    last_finished: int = 0
    kept: deque = field(default_factory=deque)
    must_resync: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Answer:
    """What a replica is answered about a round: ``status`` (``core.wire``: ok, rejected, failed,
    dropped) and either the round's update (``message``: the receiver held the round's base
    version) or, with ``resync``, the current global fragment (the caller reads it)."""

    status: str
    version: int
    message: Any = None
    size: int = 0
    resync: bool = False


class RoundBook:
    """Every rule of the outer rounds of one run.

    Args:
        members: ``{replica id: join step}`` of the replicas the run starts with.
        quorum: ``diloco.min_replicas``, valid pseudo-gradients a round needs to step.
        timeout_s: ``diloco.sync_timeout_s``, seconds a round waits after it opened.
        keep_finished: finished rounds kept per fragment for late receivers.
        max_events: events kept until :meth:`take_events`.
        clock: monotonic seconds (a test passes its own).
    """

    def __init__(self, members: dict[int, int], quorum: int, timeout_s: float, keep_finished: int = 1,
                 max_events: int = 1000, clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.members = {int(m): int(s) for m, s in members.items()}
        self.removed: set[int] = set()
        self.quorum, self.timeout_s, self.keep_finished = quorum, timeout_s, keep_finished
        self.clock = clock
        self.rounds: dict[tuple[int, int], Round] = {}
        self.finished: dict[tuple[int, int], Finished] = {}
        self.events: deque = deque(maxlen=max_events)
        self.stats: list[dict[str, Any]] = []
        self.failed_rounds = 0
        self.fragments: list[FragmentRounds] = []
        self._checking: set[tuple[int, int, int]] = set()

    def set_fragments(self, n: int) -> None:
        """Start ``n`` fragments at version 0 with no finished round."""
        self.fragments = [FragmentRounds() for _ in range(n)]

    def restore(self, versions: list[int], completed: list[int], stats: list[dict[str, Any]]) -> None:
        """Versions, newest finished send step per fragment and unreported stats from a checkpoint."""
        if len(self.fragments) != len(versions):
            self.set_fragments(len(versions))
        for f, v, c in zip(self.fragments, versions, completed, strict=True):
            f.version, f.last_finished = int(v), int(c)
        self.stats = list(stats)

    @property
    def versions(self) -> list[int]:
        """Each fragment's version (a copy)."""
        return [f.version for f in self.fragments]

    @property
    def last_finished(self) -> list[int]:
        """Each fragment's newest finished send step (a copy)."""
        return [f.last_finished for f in self.fragments]

    # -- membership ------------------------------------------------------------------------
    def add_member(self, replica: int, join_step: int, **info: Any) -> None:
        """Expect ``replica`` in every round sent after inner step ``join_step`` (``info`` goes
        into the join event)."""
        self.members[int(replica)] = int(join_step)
        self.removed.discard(int(replica))
        self.event("join", replica, step=join_step, **info)

    def remove_member(self, replica: int, reason: str, kind: str = "death") -> list[tuple[int, int]]:
        """Stop expecting ``replica`` (``kind``: ``death`` or ``leave``). Returns the open rounds
        that are complete without it, closed (the caller finishes them)."""
        if self.members.pop(int(replica), None) is None:
            return []
        self.removed.add(int(replica))
        self.event(kind, replica, reason=reason)
        return [key for key in list(self.rounds) if self._close_if_complete(*key)]

    def event(self, kind: str, replica: int | None = None, **info: Any) -> None:
        """Record an event (see the module's docstring)."""
        self.events.append({"event": kind, "replica": replica, "time": time.time(), **info})

    def take_events(self) -> list[dict[str, Any]]:
        """Events since the last call, oldest first."""
        out = list(self.events)
        self.events.clear()
        return out

    def take_stats(self, max_send_step: int | None = None) -> list[dict[str, Any]]:
        """Per-round figures of the stepped rounds sent at or before ``max_send_step`` (all if
        None); later ones stay for a later call."""
        due = [r for r in self.stats if max_send_step is None or r["step"] <= max_send_step]
        self.stats = [r for r in self.stats if not (max_send_step is None or r["step"] <= max_send_step)]
        return due

    # -- arrivals --------------------------------------------------------------------------
    def validate(self, fragment: int, replica: int) -> None:
        """Raises ValueError for a fragment out of range or a replica that never was a member."""
        if not 0 <= fragment < len(self.fragments):
            raise ValueError(f"fragment {fragment}: not in [0, {len(self.fragments)})")
        if replica not in self.members and replica not in self.removed:
            raise ValueError(f"replica {replica}: not a member of this run (members: {sorted(self.members)})")

    def expected(self, step: int) -> set[int]:
        """The members a round sent at ``step`` waits for (joined before it)."""
        return {m for m, joined in self.members.items() if joined < step}

    def is_closed(self, fragment: int, step: int) -> bool:
        """Whether the round takes no more pseudo-gradients (closing, finished or forgotten)."""
        r = self.rounds.get((fragment, step))
        if r is not None:
            return r.closing
        return (fragment, step) in self.finished or step <= self.fragments[fragment].last_finished

    def admits(self, fragment: int, step: int, replica: int) -> bool:
        """Whether ``replica``'s pseudo-gradient counts for the round: it is a member that joined
        before ``step`` and the round is open. A member's message for a closed round is recorded
        ``late``. Call again after checking the message (the round may have closed meanwhile)."""
        if replica not in self.members:
            return False
        if self.is_closed(fragment, step):  # a member's, whenever it joined
            self.event("late", replica, fragment=fragment, step=step)
            return False
        return self.members[replica] < step

    def not_twice(self, fragment: int, step: int, replica: int) -> None:
        """Raises ValueError when ``replica`` already sent (or is sending) this round."""
        r = self.rounds.get((fragment, step))
        if (fragment, step, replica) in self._checking or (r is not None and replica in r.arrived):
            raise ValueError(f"replica {replica}: sent fragment {fragment} at step {step} twice")

    def begin_check(self, fragment: int, step: int, replica: int) -> None:
        """Mark ``replica``'s message as being checked (until :meth:`end_check`).

        Raises:
            ValueError: it already sent (or is sending) this round (:meth:`not_twice`)."""
        self.not_twice(fragment, step, replica)
        self._checking.add((fragment, step, replica))

    def end_check(self, fragment: int, step: int, replica: int) -> None:
        self._checking.discard((fragment, step, replica))

    def open(self, fragment: int, step: int, average_only: bool = False) -> Round:
        """The round, opened now if it is not open (``average_only``: a closing round)."""
        r = self.rounds.get((fragment, step))
        if r is None:
            r = self.rounds[(fragment, step)] = Round(self.clock())
        r.average_only = r.average_only or average_only
        return r

    def arrive(self, fragment: int, step: int, replica: int, weight: float, norm: float | None,
               size: int = 0, parts: Any = None, average_only: bool = False) -> bool:  # fmt: skip
        """Count ``replica``'s checked pseudo-gradient: ``norm`` its L2 norm, None when it is not
        finite (or the replica abstained); ``weight`` tokens trained (not finite or negative:
        rejected); ``size`` its bytes; ``parts`` what the caller keeps of it until the round is
        stepped. Returns whether the round is now complete (closed: the caller finishes it)."""
        r = self.open(fragment, step, average_only)
        r.arrived.add(replica)
        r.bytes_up += size
        if norm is None or not math.isfinite(weight) or weight < 0:
            r.rejected.add(replica)
            self.event("rejected", replica, fragment=fragment, step=step, reason="non-finite pseudo-gradient")
        else:
            r.weights[replica], r.norms[replica] = float(weight), float(norm)
            if parts is not None:
                r.parts[replica] = parts
        return self._close_if_complete(fragment, step)

    def drop(self, fragment: int, step: int, replica: int, reason: str) -> None:
        """Leave out a counted pseudo-gradient of a round not yet stepped (its object died with
        its sender's node: as the sender's death), with a ``lost`` event."""
        r = self.rounds[(fragment, step)]
        r.weights.pop(replica, None), r.norms.pop(replica, None), r.parts.pop(replica, None)
        self.event("lost", replica, fragment=fragment, step=step, reason=reason)

    # -- closing ---------------------------------------------------------------------------
    def _close_if_complete(self, fragment: int, step: int) -> bool:
        r = self.rounds.get((fragment, step))
        if r is None or r.closing or not r.arrived or not self.expected(step) <= r.arrived:
            return False
        r.closing = True
        return True

    def deadline(self, fragment: int, step: int, allowance_s: float = 0.0) -> float:
        """Monotonic time at which the open round times out (``allowance_s``: the transfer time
        of the fragment's bytes on top of ``timeout_s``)."""
        return self.rounds[(fragment, step)].opened + self.timeout_s + allowance_s

    def time_out(self, fragment: int, step: int) -> bool:
        """Close the round at its deadline: each expected member that did not answer gets a
        ``timeout`` event. Returns False when it was closed (or finished) already."""
        r = self.rounds.get((fragment, step))
        if r is None or r.closing:
            return False
        r.closing = True
        for m in sorted(self.expected(step) - r.arrived):
            self.event("timeout", m, fragment=fragment, step=step, timeout_s=self.timeout_s)
        return True

    def terms(self, fragment: int, step: int) -> list[tuple[int, float]] | None:
        """The closed round's ``(replica, weight)`` terms in replica-id order, or None when it
        fails (fewer valid pseudo-gradients than the quorum, or no weight)."""
        r = self.rounds[(fragment, step)]
        order = sorted(r.weights)
        if len(order) >= self.quorum and sum(r.weights.values()) > 0:
            return [(m, r.weights[m]) for m in order]
        return None

    def stepped(self, fragment: int, step: int, version: int, message: Any, size: int,
                update_norm: float) -> Finished:  # fmt: skip
        """The round's outer step was taken: the fragment is at ``version``; ``message`` (of
        ``size`` bytes) is every receiver's reply. Records its stats."""
        r = self.rounds[(fragment, step)]
        base, order = self.fragments[fragment].version, sorted(r.weights)
        self.fragments[fragment].version, r.stepped = version, True
        self.stats.append({"fragment": fragment, "step": step, "update_norm": update_norm,
                           "delta_norms": {m: r.norms[m] for m in order}, "replicas": order,
                           "bytes_up": r.bytes_up, "bytes_down": size * len(self.expected(step) | set(order))})  # fmt: skip
        return Finished(False, base, message, size, frozenset(order), frozenset(r.rejected))

    def failed(self, fragment: int, step: int, error: str | None = None) -> Finished:
        """The round fails (no quorum, or ``error``: its step raised): a ``round_failed`` event."""
        r = self.rounds[(fragment, step)]
        if error is not None:
            self.event("round_failed", None, fragment=fragment, step=step, error=error)
        else:
            self.event("round_failed", None, fragment=fragment, step=step, valid=len(r.weights), quorum=self.quorum,
                       cause="timeout" if self.expected(step) - r.arrived else "complete")  # fmt: skip
        return Finished(True, self.fragments[fragment].version, None, 0, frozenset(), frozenset(r.rejected))

    def finish(self, fragment: int, step: int, outcome: Finished) -> None:
        """Keep the closed round's outcome for its receivers (the newest ``keep_finished`` per
        fragment) and forget the open round."""
        self.failed_rounds += outcome.failed
        self.finished[(fragment, step)] = outcome
        fr = self.fragments[fragment]
        fr.kept.append((fragment, step))
        while len(fr.kept) > self.keep_finished:
            self.finished.pop(fr.kept.popleft(), None)
        fr.last_finished = max(fr.last_finished, step)
        self.rounds.pop((fragment, step), None)

    def resync_all(self, fragment: int) -> None:
        """Answer every current member's next round of ``fragment`` with a resync (the current
        global fragment), whatever its version: a step already answered was taken again
        differently (a rebuilt shard redid it without a pseudo-gradient that died with its
        sender's node), so the global fragment some replicas applied is not the outer side's."""
        self.fragments[fragment].must_resync = set(self.members)

    def answer(self, fragment: int, step: int, replica: int, version: int) -> Answer:
        """What ``replica``, holding ``version`` of ``fragment``, is answered about the round sent
        at ``step`` once it is finished (or forgotten: ``dropped``). The round's update when it
        stepped from ``version``; nothing to apply when ``version`` is current; else a resync
        (``resync``: the caller sends the current fragment)."""
        rec = self.finished.get((fragment, step))
        if rec is None:  # forgotten (very late): catch up with the current global fragment
            status = DROPPED
        else:
            status = OK if replica in rec.included else REJECTED if replica in rec.rejected else \
                FAILED if rec.failed else DROPPED  # fmt: skip
        fr = self.fragments[fragment]
        if replica in fr.must_resync:  # its global fragment may differ from the outer side's (resync_all)
            fr.must_resync.discard(replica)
            return Answer(status, fr.version, resync=True)
        if rec is not None and not rec.failed and version == rec.base_version:
            return Answer(status, rec.base_version + 1, rec.message, rec.size)
        if version == fr.version:
            return Answer(status, version)
        return Answer(status, fr.version, resync=True)
