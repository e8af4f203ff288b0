"""The sync rounds on the driver: arrivals and timers fed into the
:class:`~ray_diloco.core.rounds.RoundBook` (every rule of a round: who it waits for, quorum,
timeouts, rejection, late and duplicate messages, versions; DiLoCo, arXiv 2311.08105, section 3),
and the book's decisions carried out on the outer shards (check, step, reply, resync), never
blocking the event loop."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ray_diloco.core.formats import RAW
from ray_diloco.core.rounds import Finished, Round, RoundBook
from ray_diloco.core.wire import Reply, transfer_allowance_s
from ray_diloco.runtime.driver.common import Fragments, KeptStep, RunHealth, combine_norms
from ray_diloco.runtime.driver.copies import Copies
from ray_diloco.runtime.driver.recovery import Recovery


class Rounds:
    """The driver's side of the sync rounds: it feeds arrivals and timers into the
    :class:`~ray_diloco.core.rounds.RoundBook` and carries the book's decisions out on the outer
    shards (check, step, reply, resync), never blocking the event loop.

    Args:
        book: the rounds' book. recovery: the shards' calls (a dead shard rebuilt and called
            again). copies: the shards' copies of each other (sent after each step). frags: the
            fragments' sizes and step locks. health: where shards found out of
            step are recorded.
    """

    def __init__(self, book: RoundBook, recovery: Recovery, copies: Copies, frags: Fragments, health: RunHealth):
        self.book, self.recovery, self.copies, self.frags, self.health = book, recovery, copies, frags, health
        self._done: dict[tuple[int, int], asyncio.Event] = {}  # an open round's end, for its waiters

    def open(self, fragment: int, step: int, average_only: bool) -> Round:
        self._done.setdefault((fragment, step), asyncio.Event())
        return self.book.open(fragment, step, average_only)

    def start_finish(self, fragment: int, step: int) -> None:
        """The book closed the round: take its step (or fail it) in the background."""
        asyncio.ensure_future(self._finish(fragment, step, self.book.rounds[(fragment, step)]))

    async def _finish(self, fragment: int, step: int, r: Round) -> None:
        async with self.frags.locks[fragment]:  # rounds of a fragment step in the order they closed
            await self.copies.settle(fragment)  # the previous step's copies are kept (or a rebuild redoes it)
            try:
                outcome = await self._step_round(fragment, step, r)
            except Exception as e:  # a bug, not a replica's fault: fail the round loudly, keep serving
                outcome = self.book.failed(fragment, step, error=repr(e))
                try:
                    await self.recovery.all("discard", fragment, step)
                except Exception:  # a shard is gone: the next ping says so
                    pass
        self.book.finish(fragment, step, outcome)
        self._done.pop((fragment, step)).set()

    async def _step_round(self, fragment: int, step: int, r: Round) -> Finished:
        """The outer step on every shard with the book's ordered terms (replica-id order), or a
        failed round without quorum."""
        # the terms after any rebuild in progress: its recheck drops a part that died with its node
        # (a rebuilt shard never holds it); nothing awaits between them and the step's calls
        await self.recovery.idle()
        terms = self.book.terms(fragment, step)
        if terms is None:
            await self.recovery.all("discard", fragment, step)
            return self.book.failed(fragment, step)
        outs = await self.recovery.step_all(fragment, step, terms, r)
        errors = [o for o in outs if isinstance(o, BaseException)]
        if errors and len(errors) < len(outs) or len({o.version for o in outs if not isinstance(o, BaseException)}) > 1:
            self.health.stop(f"outer-optimiser shards out of step after the round of fragment {fragment} at step "
                             f"{step}: {errors[0] if errors else 'versions differ'}")  # fmt: skip
        if errors:
            raise errors[0]
        refs, version = [o.ref for o in outs], outs[0].version
        outcome = self.book.stepped(fragment, step, version, list(refs), sum(o.nbytes for o in outs),
                                    combine_norms([o.norm for o in outs]))  # fmt: skip
        self.copies.after_step(fragment, KeptStep(step, terms, dict(r.parts), r.average_only, version), refs)
        return outcome

    async def wait(self, fragment: int, step: int) -> None:
        """Until the open round is finished; it is closed at its deadline (the timeout plus the
        transfer allowance of the fragment's bytes)."""
        done = self._done[(fragment, step)]
        allowance = transfer_allowance_s(RAW.message_nbytes(self.frags.numel(fragment)))
        remaining = self.book.deadline(fragment, step, allowance) - time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(done.wait()), timeout=max(0.0, remaining))
        except asyncio.TimeoutError:
            if self.book.time_out(fragment, step):
                self.start_finish(fragment, step)
        await done.wait()

    async def reply(self, fragment: int, step: int, replica: int, version: int) -> Reply:
        r = self.book.rounds.get((fragment, step))
        if r is not None and r.closing:
            await self._done[(fragment, step)].wait()
        a = self.book.answer(fragment, step, replica, version)
        if not a.resync:
            return Reply(a.status, a.version, a.message, size=a.size)
        async with self.frags.locks[fragment]:  # not in the middle of a step of this fragment
            outs = await self.recovery.all("current", fragment)
        return Reply(a.status, outs[0].version, [o.ref for o in outs], resync=True, size=sum(o.nbytes for o in outs))

    def parts(self, message: Any) -> list[Any] | None:
        """The message's K parts, one per shard (``[ref, ...]`` from a replica's link, whatever K).
        Raises ValueError when it is not a list of ``diloco.outer_shards`` K parts."""
        k = self.recovery.shards.k
        if message is not None and (not isinstance(message, list) or len(message) != k):
            got = f"in {len(message)} parts" if isinstance(message, list) else f"as a {type(message).__name__}"
            raise ValueError(f"a pseudo-gradient {got}, expected diloco.outer_shards = {k} parts in a list")
        return message

    async def checked(self, fragment: int, step: int, replica: int, parts: list[Any]) -> list[Any] | None:
        """Every shard's check of ``replica``'s parts (a duplicate refused first), or None when
        they died with their sender's node."""
        self.book.begin_check(fragment, step, replica)
        try:
            return await self.recovery.check(fragment, step, replica, parts)
        finally:
            self.book.end_check(fragment, step, replica)
