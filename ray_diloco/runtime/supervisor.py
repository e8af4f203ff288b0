"""The supervisor: gathers what the replica workers return, and acts on failures and membership.

Everything the trainer asks of the workers goes through :meth:`Supervisor.gather`. When the
sync strategy is elastic (DiLoCo), a replica whose call fails (actor or node death, a
process-group error inside it) or that falls behind the others by ``diloco.sync_timeout_s`` is
removed at once (:meth:`~ray_diloco.runtime.membership.Membership.lose`), so the driver stops
waiting for it and the round completes with the survivors (DiLoCo, arXiv 2311.08105, section 3);
otherwise (the DP baseline) the first failure raises. Between outer steps,
:meth:`Supervisor.at_boundary` admits replicas that finished starting, requests replacements or
a scale-up, and waits when none is left (the rules themselves are in ``runtime/membership.py``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from ray_diloco.config import Config
from ray_diloco.errors import ClusterError
from ray_diloco.runtime.cluster import Replica, all_workers, error_cause, outer_side_failed
from ray_diloco.runtime.membership import Membership, read_scale
from ray_diloco.runtime.strategy import SyncStrategy

logger = logging.getLogger(__name__)


def describe_event(ev: dict[str, Any]) -> str:
    """One log line for a membership event."""
    info = ", ".join(f"{k}={v}" for k, v in ev.items() if k not in ("event", "replica", "time"))
    who = "" if ev.get("replica") is None else f"replica {ev['replica']} "
    return f"{who}{ev['event']}" + (f" ({info})" if info else "")


class Supervisor:
    """Calls on the live workers, with failure handling and membership at outer-step boundaries.

    Args:
        cfg: the run config. run_dir: where ``scale`` requests are read from.
        sync: the run's sync strategy (its driver is pinged while waiting; it says whether
            failures are survived). members: the replicas' membership (``members.live`` is the
            list of live replicas, shared with the trainer).
    """

    def __init__(self, cfg: Config, run_dir: Path, sync: SyncStrategy, members: Membership):
        self.cfg, self.run_dir, self.sync, self.members = cfg, run_dir, sync, members
        self.slowest_round: float | None = None  # wall seconds of the slowest outer step completed so far
        # one for the run: a ping still in flight when a gather returns is read by the next one (a
        # dropped ref whose call failed is printed by Ray as an "Unhandled error" with its stack)
        self.watch = _Watchdog(sync, cfg.diloco.sync_timeout_s)

    def close(self) -> None:
        """Read the sync side's last ping (before the run's actors are killed)."""
        self.watch.drain()

    def round_done(self, wall: float) -> None:
        """An outer step's training took ``wall`` seconds (the unresponsive-replica limit grows with the slowest)."""
        self.slowest_round = max(self.slowest_round or 0.0, wall)

    @property
    def replicas(self) -> list[Replica]:
        """The live replicas (the same list object as ``members.live``)."""
        return self.members.live

    # -- results ---------------------------------------------------------------------------
    def gather(self, calls: dict[Any, Replica], straggler_s: float | None = None) -> list[Any]:
        """Results of the remote ``calls`` (object ref -> the replica it runs on), in call order.

        Elastic: a replica whose call fails is removed and its other calls are dropped. With
        ``straggler_s``, replicas still running that many seconds after the first one finished
        are removed as unresponsive; so are all of them when none finished within twice the
        slowest outer step so far plus ``straggler_s`` (every replica frozen). Not elastic: the
        first failure raises.

        Raises:
            ClusterError: the sync side (driver) stopped answering for ``diloco.sync_timeout_s``.
            ray.exceptions.RayError: a call failed and the strategy is not elastic.
        """
        import ray

        order = list(calls)
        results: dict[Any, Any] = {}
        pending = dict(calls)
        first_done = None
        t0 = time.monotonic()
        while pending:
            self.watch.check()
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.25)
            for ref in ready:
                r = pending.pop(ref, None)
                if r is None:
                    continue
                try:
                    results[ref] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    if not self.sync.elastic:
                        raise
                    self.lose(r, error_cause(e))
                    for other in [x for x, rr in pending.items() if rr is r]:
                        pending.pop(other)
            if ready and first_done is None:
                first_done = time.monotonic()
            stuck = self._stuck(straggler_s, first_done, t0)
            if stuck is not None:
                for r in {id(rr): rr for rr in pending.values()}.values():
                    self.lose(r, f"unresponsive: {stuck}")
                pending = {}
            if self.sync.elastic:
                self.members.poll()
        return [results[ref] for ref in order if ref in results]

    def _stuck(self, straggler_s: float | None, first_done: float | None, t0: float) -> str | None:
        """Why the replicas still running are to be removed as unresponsive, or None."""
        if straggler_s is None:
            return None
        now = time.monotonic()
        if first_done is not None and now - first_done > straggler_s:
            return (
                f"still training {straggler_s:g} s after the other replicas finished the outer step "
                "(diloco.sync_timeout_s)"
            )
        if first_done is None and self.slowest_round is not None and now - t0 > 2 * self.slowest_round + straggler_s:
            return (
                f"no replica finished the outer step within {2 * self.slowest_round + straggler_s:.0f} s "
                "(twice the slowest one so far + diloco.sync_timeout_s)"
            )
        return None

    def on_live(self, method: str, args_of: Any) -> dict[tuple[int, int], Any]:
        """Call ``method(*args_of(replica, rank, i, n))`` on every live worker (``i``: position in
        the flat worker list of ``n``, ``args_of`` returns None to skip a worker); a replica lost
        meanwhile makes the whole call start again with the survivors. Returns
        ``{(id, rank): result}``."""
        while True:
            live = list(self.replicas)
            n = len(all_workers(live))
            calls, keys = {}, {}
            i = 0
            for r in live:
                for rank, w in enumerate(r.workers):
                    args = args_of(r, rank, i, n)
                    i += 1
                    if args is None:
                        continue
                    ref = getattr(w, method).remote(*args)
                    calls[ref], keys[ref] = r, (r.index, rank)
            results = self.gather(calls)
            if [r.index for r in self.replicas] == [r.index for r in live]:
                return dict(zip([keys[ref] for ref in calls], results))

    def settle(self) -> None:
        """Wait until every sync sent so far is answered (before eval, checkpoint or export); a
        replica that fails meanwhile is removed (elastic) or raises."""
        self.gather(self.sync.settle_calls(list(self.replicas)))

    # -- failures and membership -------------------------------------------------------------
    def lose(self, r: Replica, reason: str) -> None:
        """A replica failed: check the driver is alive, then remove the replica."""
        self.members.lose(r, reason)

    def at_boundary(self, step: int) -> None:
        """At an outer-step boundary (elastic only): admit replicas that finished starting,
        request replacements (or scale-up) for missing ones, and wait
        (``diloco.placement_timeout_s``) when no replica is left."""
        if not self.sync.elastic:
            return
        m = self.members
        wanted = read_scale(self.run_dir, self.cfg)
        if wanted is not None:
            leaving = m.set_target(wanted)
            if leaving:
                self.settle()
                for r in leaving:
                    m.lose(r, f"scaled down to {wanted} replica(s)", kind="leave")
        m.admit(m.poll(), step, self.settle)
        m.top_up()
        deadline = time.monotonic() + self.cfg.diloco.placement_timeout_s
        while not m.live:
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"diloco.placement_timeout_s = {self.cfg.diloco.placement_timeout_s:g}: no replica "
                    "is alive and none could be started again in time"
                )
            time.sleep(0.2)
            m.admit(m.poll(), step, self.settle)

    def membership_fields(self, k: int, metrics: list[dict[str, Any]], counts: dict[str, int]) -> dict[str, Any]:
        """(Elastic) Outer step ``k``'s membership: each slot's data position noted from the round's
        worker ``metrics``; this side's and the sync side's events counted into ``counts`` (event
        kind -> count, the run's) and logged (failed sync rounds: one line per outer step).
        Returns the row's ``replicas_target``, ``membership`` (the counts) and ``events``."""
        self.members.note_positions(metrics)
        events = self.members.take_events() + self.sync.take_events()
        failed = [ev for ev in events if ev["event"] == "round_failed"]
        for ev in events:
            counts[ev["event"]] = counts.get(ev["event"], 0) + 1
            if ev["event"] not in ("launch", "round_failed"):
                logger.info(f"membership: {describe_event(ev)}")
        if failed:  # one line per outer step: with a small H these come every step
            logger.warning(
                f"membership: {len(failed)} sync round(s) failed in outer step {k} (the last: "
                f"{describe_event(failed[-1])})"
            )
        row: dict[str, Any] = {"replicas_target": self.members.target, "membership": dict(counts)}
        return {**row, "events": events} if events else row


class _Watchdog:
    """Pings the sync side while the supervisor waits: a frozen driver would stall every replica."""

    def __init__(self, sync: SyncStrategy, timeout_s: float):
        self.sync, self.timeout_s = sync, timeout_s
        self.ping: Any = None
        self.sent = self.answered = time.monotonic()

    def check(self) -> None:
        """Send a ping when none is in flight; raise when one has gone unanswered too long.

        Raises:
            ClusterError: no answer for ``timeout_s`` seconds, or the answer is an error (the driver
                died, or its outer state cannot go on: a lost shard that could not be rebuilt).
        """
        import ray

        if self.ping is None:
            self.ping, self.sent = self.sync.ping(), time.monotonic()
        elif ray.wait([self.ping], timeout=0)[0]:
            ping, self.ping = self.ping, None
            try:
                ray.get(ping)
                self.answered = time.monotonic()
            except ray.exceptions.ActorUnavailableError:  # transient (a network blip), up to the timeout
                if time.monotonic() - self.answered > self.timeout_s:
                    raise outer_side_failed(
                        f"has been unreachable for {self.timeout_s:g} s (diloco.sync_timeout_s)"
                    ) from None
            except ray.exceptions.RayError as e:
                raise outer_side_failed(
                    f"(or one of its diloco.outer_shards actors) failed: {error_cause(e)}"
                ) from None
        elif time.monotonic() - self.sent > self.timeout_s:
            raise outer_side_failed(f"has not answered for {self.timeout_s:g} s (diloco.sync_timeout_s)")

    def drain(self) -> None:
        """Read the ping in flight, if any (waiting up to 2 s), whatever it answers: the run is
        ending, and a failed call's result that is never read is printed by Ray with its stack."""
        import ray

        ping, self.ping = self.ping, None
        if ping is not None:
            ray.wait([ping], timeout=2)
            try:
                ray.get(ping, timeout=0)
            except Exception:  # noqa: BLE001 - the driver died or broke: the run's error says so
                pass
