"""The copies the outer shards keep of each other (``diloco.outer_shard_backup``, K > 1): shard
``b`` keeps the state of shard ``b - 1`` (its buddy), sent whole once the global parameters are
set, then each outer step's new slices in the background; the steps not yet in every copy are
kept with their pseudo-gradients' references, so a shard rebuilt from an older copy takes them
again (``runtime.driver.recovery``)."""

from __future__ import annotations

import asyncio
from typing import Any

from ray_diloco.runtime.driver.common import KeptStep, object_lost
from ray_diloco.runtime.outer_shards import ShardGroup, ShardLost


class Copies:
    """Each shard's copy of its buddy's state, and the steps not yet in every copy.

    Args:
        shards: the outer shards. enabled: copies are kept (K > 1 and
            ``diloco.outer_shard_backup``). raw: the format sends fp32 values raw (its replies
            are the new global slices: a step's copy leaves them out and the buddy takes them from
            the replies).
    """

    def __init__(self, shards: ShardGroup, enabled: bool, raw: bool):
        self.shards, self.enabled, self.raw = shards, enabled, raw
        self.unbacked: dict[int, list[KeptStep]] = {}  # fragment -> its steps not yet in every copy, oldest first
        self.keeping: dict[int, list[asyncio.Future]] = {}  # fragment -> copies being sent, oldest first
        self.seeded = False  # every shard's whole state is in its buddy's copy

    async def seed(self) -> None:
        """Every shard's whole state copied to its buddy (after the global parameters are set or
        restored: copies are then sent per outer step)."""
        await self.send(None)
        self.seeded = True

    def unseed(self) -> None:
        """The state was replaced (a checkpoint loaded): the whole copies are sent again."""
        self.seeded = False

    async def send(self, fragments: list[int] | None) -> None:
        """Each shard's slice state of ``fragments`` (None: all) copied to its buddy (no rebuild on
        the way: the caller holds the recovery's lock)."""
        await self.keep(await self.shards.each("backup_all", [(fragments,)] * self.shards.k))

    async def keep(self, refs: list[Any], values: list[Any] | None = None) -> list[Any]:
        """Shard ``b`` keeps ``refs[(b - 1) % K]`` (each shard's copy goes to its buddy; with
        ``values``, the global slice left out of it); raises the first error, a copy that died
        with the shard that put it (its node was lost after it answered) as that shard's
        :class:`ShardLost`."""
        k, gens = self.shards.k, list(self.shards.gens)
        for o in refs:
            if isinstance(o, BaseException):
                raise o
        per = [((b - 1) % k, refs[(b - 1) % k], None if values is None else values[(b - 1) % k]) for b in range(k)]
        outs = await self.shards.each("keep", per)
        for b, o in enumerate(outs):
            if isinstance(o, BaseException) and object_lost(o):
                raise ShardLost((b - 1) % k, gens[(b - 1) % k], o)
            if isinstance(o, BaseException):
                raise o
        return outs

    def after_step(self, fragment: int, stepped: KeptStep, replies: list[Any]) -> None:
        """Send the copies of a step's new slice states to the buddies in the background (the
        round's replies do not wait for them; with ``none`` the global values are the replies,
        ``replies``: one per shard). The step (and its pseudo-gradients' references) is kept
        until every buddy holds its version or a newer one (:meth:`settle` bounds the lag).
        Nothing without copies (K = 1 or ``diloco.outer_shard_backup`` off)."""
        if not self.enabled:
            return
        self.unbacked.setdefault(fragment, []).append(stepped)

        async def send() -> None:
            try:  # the copy is taken on each shard's maths thread, after this step, before the next
                refs = await self.shards.each("backup_all", [([fragment], not self.raw)] * self.shards.k)
                await self.keep(refs, replies if self.raw else None)
            except Exception:  # a shard died: its rebuild takes the step again or sends a fresh copy
                return
            self.unbacked[fragment] = [u for u in self.unbacked.get(fragment, []) if u.version > stepped.version]

        tasks = self.keeping.setdefault(fragment, [])
        task = asyncio.ensure_future(send())
        tasks.append(task)
        task.add_done_callback(lambda t: tasks.remove(t) if t in tasks else None)

    async def settle(self, fragment: int) -> None:
        """Before ``fragment``'s next step: wait for the copies of all its steps but the last one
        (one step's copies may still travel while the next step is taken: they are off the
        rounds' path as long as an outer step lasts longer than a copy)."""
        for task in list(self.keeping.get(fragment, []))[:-1]:
            await task

    async def drain(self) -> None:
        """Wait for every copy being sent (its errors are the rebuild's to find)."""
        await asyncio.gather(*(t for ts in self.keeping.values() for t in ts), return_exceptions=True)

    def steps_after(self, fragment: int, version: int) -> list[KeptStep]:
        """The kept steps of ``fragment`` after ``version``, oldest first."""
        return [u for u in self.unbacked.get(fragment, []) if u.version > version]

    async def resend_missed(self) -> None:
        """After a rebuild: every shard's slices of the fragments with steps not yet in every copy
        sent again (a copy sent to the dead shard was lost with it); nothing kept after."""
        behind = sorted(f for f, us in self.unbacked.items() if us)
        if behind:
            await self.send(behind)
        self.unbacked.clear()
