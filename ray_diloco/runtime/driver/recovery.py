"""Surviving an outer shard's loss (``diloco.outer_shard_backup``, ``runtime.outer_shards``): the
calls that rebuild a dead shard and call it again, the copies each shard's buddy keeps after
every outer step, and the rebuild itself (a new shard from its buddy's copy, the open rounds'
pseudo-gradients checked again, the steps the copy missed taken again). No outer step is lost or
applied twice, and the rebuilt shard holds the dead one's bits; what cannot be survived stops the
run (:class:`~ray_diloco.runtime.driver.common.RunHealth`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import ray

from ray_diloco.core.rounds import Round, RoundBook
from ray_diloco.runtime.driver.common import KeptStep, RunHealth, object_lost
from ray_diloco.runtime.driver.copies import Copies
from ray_diloco.runtime.outer_shards import ShardGroup, ShardLost


class Recovery:
    """The driver's side of surviving a shard's loss (``runtime.outer_shards``): calls that rebuild
    a dead shard and call it again, the copies sent after each outer step, and the rebuild itself
    (new shard from its buddy's copy, open rounds' pseudo-gradients checked again, a step the copy
    missed taken again), one at a time.

    Args:
        shards: the outer shards. book: the rounds' book (open rounds' pseudo-gradients, versions,
            events). health: where a loss the run cannot survive is recorded.
        copies: the copies the shards keep of each other (what a rebuild starts from).
    """

    def __init__(self, shards: ShardGroup, book: RoundBook, health: RunHealth, copies: Copies):
        self.shards, self.book, self.health, self.copies = shards, book, health, copies
        self.lock = asyncio.Lock()

    async def idle(self) -> None:
        """Wait for a rebuild in progress (an outer step is not sent to a shard being rebuilt)."""
        async with self.lock:
            pass

    async def call(self, name: str, per_shard: list[tuple], only: list[int] | None = None) -> list[Any]:
        """``ShardGroup.each`` where a dead shard is rebuilt (:meth:`recover`) and called again, as is
        one replaced after it answered (its answer came from the dead one): an answer counts only
        if its shard is still the one that gave it once no rebuild is in progress, so whatever the
        caller does next (no await between) sees the shards that answered. For idempotent calls.

        Raises:
            RuntimeError: a shard was lost and cannot be rebuilt."""
        shards = self.shards
        mine = list(range(shards.k)) if only is None else list(only)
        outs: list[Any] = [None] * shards.k
        answered = [-1] * shards.k  # the generation of the shard actor each answer came from
        todo = mine
        for _ in range(shards.k + 2):  # each pass rebuilds at least one shard
            await self.idle()  # never a shard in the middle of its rebuild
            gens = list(shards.gens)
            got = await shards.each(name, per_shard, todo)
            for i in todo:
                outs[i], answered[i] = got[i], gens[i]
            # also waits for a rebuild another call began meanwhile (a shard replaced after it answered)
            await self.recover([o for o in got if isinstance(o, ShardLost)])
            todo = [i for i in mine if isinstance(outs[i], ShardLost) or shards.gens[i] != answered[i]]
            if not todo:
                break
        return outs

    async def all(self, name: str, *args: Any) -> list[Any]:
        """:meth:`call` on every shard with the same arguments; raises the first error."""
        outs = await self.call(name, [args] * self.shards.k)
        for o in outs:
            if isinstance(o, BaseException):
                raise o
        return outs

    async def one(self, i: int, name: str, *args: Any) -> Any:
        """:meth:`call` on shard ``i`` only; returns its answer or raises its error."""
        out = (await self.call(name, [args] * self.shards.k, [i]))[i]
        if isinstance(out, BaseException):
            raise out
        return out

    async def starting(self, call: Awaitable[Any]) -> Any:
        """Await a start-up call on the shards; a shard that dies then (before any copy of it was
        kept) stops the run with one message.

        Raises:
            RuntimeError: a shard died while the run started."""
        try:
            return await call
        except (ShardLost, ray.exceptions.RayActorError) as e:
            shard = f" {e.shard}" if isinstance(e, ShardLost) else ""
            raise self.health.stop(
                f"outer-optimiser shard{shard} died while the run started, before a copy of it was kept"
            ) from None

    async def seed(self) -> None:
        """Every shard's whole state copied to its buddy (after the global parameters are set or
        restored: copies are then sent per outer step)."""
        if not self.copies.enabled:
            return
        async with self.lock:
            await self.copies.seed()

    async def check(self, fragment: int, step: int, replica: int, parts: list[Any]) -> list[Any] | None:
        """Every shard's check of its part of ``replica``'s pseudo-gradient (``OuterShard.check``;
        a shard rebuilt meanwhile checks again). None when the parts died with their sender's node
        (a ``lost`` event: as the sender's death); nothing is kept after an error.

        Raises:
            ValueError: a malformed part (the first error of the checks)."""
        checks = await self.call("check", [(fragment, step, replica, [p]) for p in parts])
        errors = [c for c in checks if isinstance(c, BaseException)]
        if not errors:
            return checks
        await self.all("discard", fragment, step, replica)  # every check has finished: nothing kept after it
        if all(object_lost(e) for e in errors):
            self.book.event("lost", replica, fragment=fragment, step=step, reason="pseudo-gradient lost")
            return None
        raise errors[0]

    async def step_all(self, fragment: int, step: int, terms: list[tuple[int, float]], r: Round) -> list[Any]:
        """Every shard's outer step of round ``r`` (``OuterShard.step``: outputs or errors, in shard
        order). A shard lost meanwhile is rebuilt (at the version before this step, the round's
        pseudo-gradients checked again) and takes the step then (:meth:`_partial` when some of its
        part died with it)."""
        shards = self.shards
        args = [(fragment, step, terms, r.average_only)] * shards.k
        r.stepping = True  # the caller waited for any rebuild (idle) just before: no await since
        gens = list(shards.gens)
        outs = await shards.each("step", args)
        for _ in range(shards.k + 1):  # each round of losses rebuilds at least one shard
            await self.recover([o for o in outs if isinstance(o, ShardLost)])  # also waits for one another call began
            # every shard rebuilt since its step steps again: also one whose (dead) actor had
            # answered (a node held it and a lost one) or that another call rebuilt meanwhile:
            # its rebuild restored the state before this step
            again_on = [i for i in range(shards.k) if isinstance(outs[i], ShardLost) or shards.gens[i] != gens[i]]
            if not again_on:
                break
            args = [(fragment, step, self._partial(i, fragment, step, terms, r.lost.get(i, set())) if i in again_on
                     else terms, r.average_only) for i in range(shards.k)]  # fmt: skip
            gens = list(shards.gens)
            again = await shards.each("step", args, again_on)
            for i in again_on:
                outs[i] = again[i]
        return outs

    async def recover(self, lost: list[ShardLost]) -> None:
        """Rebuild the shards in ``lost`` that were not rebuilt since (one rebuild at a time).

        Raises:
            RuntimeError: the run cannot go on (no copies kept, a shard and its buddy both lost, a
                step that cannot be taken again); every later ping raises it too."""
        shards = self.shards
        async with self.lock:
            todo = sorted({e.shard for e in lost if shards.gens[e.shard] == e.gen})
            if not todo:
                return
            self.health.check()
            why = next(e for e in lost if e.shard == todo[0]).cause
            if not self.copies.enabled or not self.copies.seeded:
                off = "diloco.outer_shard_backup is off" if not self.copies.enabled else "no copy of it was kept yet"
                raise self.health.stop(f"outer-optimiser shard {todo[0]} died ({type(why).__name__}) and {off}")
            await self.copies.drain()
            infos: dict[int, dict[str, Any]] = {}
            redone: dict[int, list[int]] = {}
            start, behind = todo, list(todo)
            for _ in range(2 * shards.k):
                for i in start:  # every lost shard started again first: a node may hold several
                    infos[i] = await self._replace(i)
                try:
                    await self._catch_up(behind, infos, redone)
                    break
                except ShardLost as e:  # another shard of a lost node, or a new one, found dead on the way
                    start = [e.shard] if shards.gens[e.shard] == e.gen else []  # rebuilt again from its copy
                    behind = sorted(set(behind) | set(start))  # _catch_up left out those it finished
            else:
                raise self.health.stop(f"outer-optimiser shards {sorted(infos)} kept dying while they were rebuilt")
            for i in sorted(infos):
                self.book.event("shard_recovered", None, shard=i, node=infos[i]["node"][:12],
                             seconds=round(infos[i]["seconds"], 2), redone=redone.get(i, []))  # fmt: skip

    async def _replace(self, i: int) -> dict[str, Any]:
        """``ShardGroup.replace`` of shard ``i``, its failure the run's end (one line).

        Raises:
            RuntimeError: (stop) its keeper or the shard whose copy it keeps is lost too, or it
                could not be started."""
        try:
            return await self.shards.replace(i)
        except ShardLost as e:  # its keeper (or the shard it keeps a copy of) died too
            raise self.health.stop(f"outer-optimiser shard {i} died and so did shard {e.shard}, which kept its "
                                   "copy or whose copy it kept: the outer state is lost") from None  # fmt: skip
        except Exception as e:
            raise self.health.stop(
                f"outer-optimiser shard {i} died and could not be rebuilt: {type(e).__name__}: {e}"
            ) from None

    async def _catch_up(self, todo: list[int], infos: dict[int, dict[str, Any]], redone: dict[int, list[int]]) -> None:
        """The rebuilt shards ``todo`` brought level with the run: open rounds checked again, missed
        steps taken again (into ``redone``); each is removed from ``todo`` once caught up; then the
        steps whose copies went to a dead shard sent again from every shard.

        Raises:
            ShardLost: a shard found dead on the way, another or a new one (the caller rebuilds it).
            RuntimeError: (stopped) a step cannot be taken again."""
        try:
            for i in list(todo):
                await self._recheck(i)
                redone[i] = await self._redo(i, infos[i]["versions"])
                todo.remove(i)  # caught up: not again if another shard dies below
            await self.copies.resend_missed()
        except ShardLost:
            raise
        except Exception as e:
            raise self.health.stop(
                f"outer-optimiser shard(s) {todo} died and could not be rebuilt: {type(e).__name__}: {e}"
            ) from None

    async def _recheck(self, i: int) -> None:
        """The open rounds' kept pseudo-gradients checked again on the new shard ``i``. A part whose
        object died (its sender died with the shard's node) leaves its replica out of a round not
        yet stepped; in a round whose step the other shards already took, it is left out of shard
        ``i``'s slice only (:meth:`_partial`).

        Raises:
            RuntimeError: a part could not be checked for another reason."""
        for (f, s), r in list(self.book.rounds.items()):
            if r.stepped:
                continue

            def died(m: int, f: int = f, s: int = s, r: Round = r) -> None:
                if r.stepping:
                    r.lost.setdefault(i, set()).add(m)
                else:
                    self.book.drop(f, s, m, "its pseudo-gradient died with its node")

            await self._check_again(i, f, s, r.parts, died)

    async def _check_again(
        self, i: int, f: int, step: int, parts: dict[int, list[Any]], died: Callable[[int], None]
    ) -> None:
        """Each replica's kept part (``parts``: replica -> its K parts) of fragment ``f``'s round
        at ``step`` checked again on the rebuilt shard ``i``, in replica order; ``died(replica)``
        for one whose part died with its sender's node.

        Raises:
            ShardLost: shard ``i`` died too. RuntimeError: a part could not be checked otherwise."""
        for m, p in sorted(parts.items()):
            out = (await self.shards.each("check", [(f, step, m, [p[i]])] * self.shards.k, [i]))[i]
            if isinstance(out, ShardLost):
                raise out
            if isinstance(out, BaseException):
                if not object_lost(out):
                    raise RuntimeError(f"replica {m}'s pseudo-gradient of fragment {f} at step {step}: {out}")
                died(m)

    async def _redo(self, i: int, versions: list[int]) -> list[int]:
        """Take again, on the new shard ``i`` restored at ``versions``, the steps its copy had not
        caught up with, in order, from their kept pseudo-gradients; returns their fragments (one
        entry per step).

        Raises:
            RuntimeError: a step missing from those kept, or a pseudo-gradient of one is gone."""
        redone: list[int] = []
        for f, v in enumerate(versions):
            chain, now = self.copies.steps_after(f, v), self.book.fragments[f].version
            if [u.version for u in chain] != list(range(v + 1, now + 1)):
                raise RuntimeError(f"its copy of fragment {f} is at version {v}, the run at {now}")
            for u in chain:
                await self._take_again(i, f, u)
                redone.append(f)
        return redone

    async def _take_again(self, i: int, f: int, u: KeptStep) -> None:
        """Step ``u`` of fragment ``f`` on the rebuilt shard ``i`` again (its pseudo-gradients
        checked again; :meth:`_redo`).

        Raises:
            ShardLost: the new shard died too. RuntimeError: the step cannot be taken again."""
        lost: set[int] = set()
        await self._check_again(i, f, u.step, u.parts, lost.add)
        terms = self._partial(i, f, u.step, u.terms, lost)
        if lost:  # the round's replies went out with the dead shard's slice of the full step
            self.book.resync_all(f)
        out = (await self.shards.each("step", [(f, u.step, terms, u.average_only)] * self.shards.k, [i]))[i]
        if isinstance(out, ShardLost):
            raise out
        if isinstance(out, BaseException) or out.version != u.version:
            raise RuntimeError(f"taking the step of fragment {f} at step {u.step} again: {out}")
        rec = self.book.finished.get((f, u.step))
        if rec is not None and rec.message is not None:  # later receivers fetch the new slice
            rec.message[i] = out.ref

    def _partial(self, i: int, f: int, step: int, terms: list[tuple[int, float]],
                 lost: set[int]) -> list[tuple[int, float]]:  # fmt: skip
        """The terms rebuilt shard ``i`` steps its slice of a round with when the other shards took the
        round's step already and some of its pseudo-gradients died with the dead shard's node (their
        senders died with it): the others, as their weights stand. The slice's mean then leaves those
        replicas out (as a round that went on without them); every receiver still gets the same reply.
        Recorded as a ``partial_round`` event. A round answered already (its step taken again from a
        copy that missed it, :meth:`_take_again`) resyncs every member at its next round
        of the fragment (``RoundBook.resync_all``): some applied the dead shard's full step, and
        their globals would differ from the outer side's from then on."""
        if not lost:
            return terms
        self.book.event("partial_round", None, fragment=f, step=step, shard=i, left_out=sorted(lost))
        kept = [(m, w) for m, w in terms if m not in lost]
        return kept if kept else [(m, 0.0) for m, _ in terms]  # nothing left: an empty mean (no move)
