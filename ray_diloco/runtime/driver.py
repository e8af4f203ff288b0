"""The outer-optimiser driver: the Ray side of the sync rounds, the outer shards and their recovery.

The driver is an async Ray actor that holds the global parameters and the outer optimiser
(:class:`~ray_diloco.core.outer.OuterOptimizer`, in its outer shards). Each replica's rank 0
submits its quantised pseudo-gradient of a fragment with :meth:`OuterDriver.exchange`; the other
ranks of the replica wait for the same answer with :meth:`OuterDriver.result`. Every rule of a
round (who it waits for, quorum, timeouts, rejection, late and duplicate messages, versions and
what each replica is answered; DiLoCo, arXiv 2311.08105, section 3) lives in
:class:`~ray_diloco.core.rounds.RoundBook`, synchronous and tested without Ray; here
:class:`_Rounds` feeds it arrivals and timers and carries its decisions out on the shards.

Transport and memory (issue 14): pseudo-gradients arrive as object-store references (numpy
buffers, pickle-5 out of band: a ``none`` one is the fp32 array itself, read without a copy) and
are checked (finite, norm) as they arrive; when the round closes they are summed into the
token-weighted mean (``core.outer.OrderedMean``) in replica-id order, by reference, in one chunked
pass with the outer step (bitwise the plain fp32 DiLoCo mean); the reply of a round is one object
put once and shared by every receiver. Decoding, the mean, the outer step and the encoding run on
threads, never on the event loop, so pings and membership calls are answered during an outer
step. Open rounds close within the timeout (plus ``core.wire.transfer_allowance_s`` of the
fragment's bytes), and at most :data:`KEEP_FINISHED` finished round per fragment is kept.

Sharding (``diloco.outer_shards`` K): the maths and the state of the global parameters live in
``runtime.outer_shards.OuterShard`` objects, each owning one contiguous slice of every fragment
(``core.shards.shard_bounds``; ``runtime.outer_shards``). With K = 1 the driver holds the one
shard in its own process; with K > 1 the shards are Ray actors on the replicas' nodes: a replica
sends K object references, the driver hands each to its shard unresolved (the bytes go from the
replica's node to the shard's node, never through the driver), the driver alone decides the
round (members, quorum, timeouts, who is included, in which order), every shard steps its slice
with the same ordered terms, and the reply is the K shards' slices. Every operation is
element-wise over aligned slices, so globals are bitwise the same for every K (the per-round
norms in the stats are combined from the slices' norms: equal to K = 1's up to rounding).
A pseudo-gradient counts for its round once every shard has checked it (a malformed one changes
nothing); one still being checked when the round times out is late.

A shard lost with its process or node (K > 1, ``diloco.outer_shard_backup``): :class:`_Recovery`
rebuilds it from the copy its ring neighbour keeps (``runtime.outer_shards``), checks the open
rounds' pseudo-gradients again on it (a round keeps its arrivals' references until it is
stepped) and takes again the steps the copy had missed (kept with their references until every
copy holds them); calls that met the dead shard are made again. No outer step is lost or applied
twice, and the rebuilt shard holds the dead one's bits. A pseudo-gradient lost with its sender's
node counts as that sender's death. When a shard cannot be rebuilt (copies off, a shard and its
keeper lost together), or a shard's step fails while the others' succeed, the shards are out of
step: :meth:`OuterDriver.ping` raises from then on and the trainer stops the run (resume from
the last checkpoint).
"""

from __future__ import annotations

import asyncio
import copy
import math
import os
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from ray_diloco.components.threads import outer_threads
from ray_diloco.core.formats import RAW, wire_format
from ray_diloco.core.outer import outer_state_hash
from ray_diloco.core.rounds import Finished, Round, RoundBook
from ray_diloco.core.shards import join_outer_states, shard_bounds
from ray_diloco.core.wire import DROPPED, Reply, transfer_allowance_s
from ray_diloco.runtime.outer_shards import ShardGroup, ShardLost, _rss_bytes

__all__ = ["OuterDriver", "OuterDriverActor"]

#: Finished rounds kept per fragment for receivers that ask late (older ones get a resync).
KEEP_FINISHED = 1
#: Membership events kept until the trainer collects them.
MAX_EVENTS = 1000


def _combine_norms(norms: list[float]) -> float:
    """The L2 norm of a vector from its K slices' norms (the norm itself for K = 1)."""
    return norms[0] if len(norms) == 1 else math.sqrt(sum(n * n for n in norms))


def _object_lost(e: BaseException) -> bool:
    """An object that died with its node or its owner (a pseudo-gradient: the sending replica; a
    copy: the shard that put it), raised as is or as the cause of a task's error."""
    cause = getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else None
    return isinstance(e, ray.exceptions.ObjectLostError) or isinstance(cause, ray.exceptions.ObjectLostError)


@dataclass
class _Stepped:
    """An outer step every shard took whose copies (``diloco.outer_shard_backup``) are not all
    kept yet: what a shard rebuilt from the older copy needs to take it again."""

    step: int
    terms: list[tuple[int, float]]
    parts: dict[int, list[Any]]  # replica -> its K pseudo-gradient parts (ObjectRefs the replica owns)
    average_only: bool
    version: int  # the fragment's version after it


async def _replace_shard(d: OuterDriver, i: int) -> dict[str, Any]:
    """``ShardGroup.replace`` of the driver ``d``'s shard ``i``, its failure the run's end (one line).

    Raises:
        RuntimeError: (stop_run) its keeper or the shard whose copy it keeps is lost too, or it
            could not be started."""
    try:
        return await d.shards.replace(i)
    except ShardLost as e:  # its keeper (or the shard it keeps a copy of) died too
        raise d.stop_run(f"outer-optimiser shard {i} died and so did shard {e.shard}, which kept its copy "
                         "or whose copy it kept: the outer state is lost") from None  # fmt: skip
    except Exception as e:
        raise d.stop_run(f"outer-optimiser shard {i} died and could not be rebuilt: {type(e).__name__}: {e}") from None


class _Recovery:
    """The driver's side of surviving a shard's loss (``runtime.outer_shards``): calls that rebuild
    a dead shard and call it again, the copies sent after each outer step, and the rebuild itself
    (new shard from its buddy's copy, open rounds' pseudo-gradients checked again, a step the copy
    missed taken again), one at a time.

    Args:
        driver: the :class:`OuterDriver` it serves (its rounds, versions, events, shards).
    """

    def __init__(self, driver: OuterDriver):
        self.d = driver
        self.lock = asyncio.Lock()
        self.enabled = driver.shards.k > 1 and driver.cfg.diloco.outer_shard_backup
        self.unbacked: dict[int, list[_Stepped]] = {}  # fragment -> its steps not yet in every copy, oldest first
        self.keeping: dict[int, list[asyncio.Future]] = {}  # fragment -> copies being sent, oldest first
        self.seeded = False

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
        shards = self.d.shards
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
        outs = await self.call(name, [args] * self.d.shards.k)
        for o in outs:
            if isinstance(o, BaseException):
                raise o
        return outs

    async def one(self, i: int, name: str, *args: Any) -> Any:
        """:meth:`call` on shard ``i`` only; returns its answer or raises its error."""
        out = (await self.call(name, [args] * self.d.shards.k, [i]))[i]
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
            raise self.d.stop_run(
                f"outer-optimiser shard{shard} died while the run started, before a copy of it was kept"
            ) from None

    async def seed(self) -> None:
        """Every shard's whole state copied to its buddy (after the global parameters are set or
        restored: copies are then sent per outer step)."""
        if not self.enabled:
            return
        async with self.lock:
            await self._send_copies(None)
            self.seeded = True

    async def _send_copies(self, fragments: list[int] | None) -> None:
        """Each shard's slice state of ``fragments`` (None: all) copied to its buddy (no rebuild on
        the way: the caller holds the lock)."""
        await self.all_keep(await self.d.shards.each("backup_all", [(fragments,)] * self.d.shards.k))

    async def all_keep(self, refs: list[Any], values: list[Any] | None = None) -> list[Any]:
        """Shard ``b`` keeps ``refs[(b - 1) % K]`` (each shard's copy goes to its buddy; with
        ``values``, the global slice left out of it); raises the first error, a copy that died
        with the shard that put it (its node was lost after it answered) as that shard's
        :class:`ShardLost`."""
        k, gens = self.d.shards.k, list(self.d.shards.gens)
        for o in refs:
            if isinstance(o, BaseException):
                raise o
        per = [((b - 1) % k, refs[(b - 1) % k], None if values is None else values[(b - 1) % k]) for b in range(k)]
        outs = await self.d.shards.each("keep", per)
        for b, o in enumerate(outs):
            if isinstance(o, BaseException) and _object_lost(o):
                raise ShardLost((b - 1) % k, gens[(b - 1) % k], o)
            if isinstance(o, BaseException):
                raise o
        return outs

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
        if all(_object_lost(e) for e in errors):
            self.d.book.event("lost", replica, fragment=fragment, step=step, reason="pseudo-gradient lost")
            return None
        raise errors[0]

    async def step_all(self, fragment: int, step: int, terms: list[tuple[int, float]], r: Round) -> list[Any]:
        """Every shard's outer step of round ``r`` (``OuterShard.step``: outputs or errors, in shard
        order). A shard lost meanwhile is rebuilt (at the version before this step, the round's
        pseudo-gradients checked again) and takes the step then (:func:`_partial` when some of its
        part died with it)."""
        d = self.d
        args = [(fragment, step, terms, r.average_only)] * d.shards.k
        r.stepping = True  # the caller waited for any rebuild (idle) just before: no await since
        gens = list(d.shards.gens)
        outs = await d.shards.each("step", args)
        for _ in range(d.shards.k + 1):  # each round of losses rebuilds at least one shard
            await self.recover([o for o in outs if isinstance(o, ShardLost)])  # also waits for one another call began
            # every shard rebuilt since its step steps again: also one whose (dead) actor had
            # answered (a node held it and a lost one) or that another call rebuilt meanwhile:
            # its rebuild restored the state before this step
            again_on = [i for i in range(d.shards.k) if isinstance(outs[i], ShardLost) or d.shards.gens[i] != gens[i]]
            if not again_on:
                break
            args = [(fragment, step, _partial(d, i, fragment, step, terms, r.lost.get(i, set())) if i in again_on
                     else terms, r.average_only) for i in range(d.shards.k)]  # fmt: skip
            gens = list(d.shards.gens)
            again = await d.shards.each("step", args, again_on)
            for i in again_on:
                outs[i] = again[i]
        return outs

    def after_step(self, fragment: int, stepped: _Stepped, replies: list[Any]) -> None:
        """Send the copies of a step's new slice states to the buddies in the background (the
        round's replies do not wait for them; with ``none`` the global values are the replies,
        ``replies``: one per shard). The step (and its pseudo-gradients' references) is kept
        until every buddy holds its version or a newer one (:meth:`settle` bounds the lag).
        Nothing without copies (K = 1 or ``diloco.outer_shard_backup`` off)."""
        if not self.enabled:
            return
        self.unbacked.setdefault(fragment, []).append(stepped)
        plain = wire_format(self.d.cfg.streaming.quantization).raw

        async def send() -> None:
            try:  # the copy is taken on each shard's maths thread, after this step, before the next
                refs = await self.d.shards.each("backup_all", [([fragment], not plain)] * self.d.shards.k)
                await self.all_keep(refs, replies if plain else None)
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

    async def recover(self, lost: list[ShardLost]) -> None:
        """Rebuild the shards in ``lost`` that were not rebuilt since (one rebuild at a time).

        Raises:
            RuntimeError: the run cannot go on (no copies kept, a shard and its buddy both lost, a
                step that cannot be taken again); every later ping raises it too."""
        d = self.d
        async with self.lock:
            todo = sorted({e.shard for e in lost if d.shards.gens[e.shard] == e.gen})
            if not todo:
                return
            if d.broken:
                raise RuntimeError(d.broken)
            why = next(e for e in lost if e.shard == todo[0]).cause
            if not self.enabled or not self.seeded:
                off = "diloco.outer_shard_backup is off" if not self.enabled else "no copy of it was kept yet"
                raise d.stop_run(f"outer-optimiser shard {todo[0]} died ({type(why).__name__}) and {off}")
            await asyncio.gather(*(t for ts in self.keeping.values() for t in ts), return_exceptions=True)
            infos: dict[int, dict[str, Any]] = {}
            redone: dict[int, list[int]] = {}
            start, behind = todo, list(todo)
            for _ in range(2 * d.shards.k):
                for i in start:  # every lost shard started again first: a node may hold several
                    infos[i] = await _replace_shard(d, i)
                try:
                    await self._catch_up(behind, infos, redone)
                    break
                except ShardLost as e:  # another shard of a lost node, or a new one, found dead on the way
                    start = [e.shard] if d.shards.gens[e.shard] == e.gen else []  # rebuilt again from its copy
                    behind = sorted(set(behind) | set(start))  # _catch_up left out those it finished
            else:
                raise d.stop_run(f"outer-optimiser shards {sorted(infos)} kept dying while they were rebuilt")
            for i in sorted(infos):
                d.book.event("shard_recovered", None, shard=i, node=infos[i]["node"][:12],
                             seconds=round(infos[i]["seconds"], 2), redone=redone.get(i, []))  # fmt: skip

    async def _catch_up(self, todo: list[int], infos: dict[int, dict[str, Any]], redone: dict[int, list[int]]) -> None:
        """The rebuilt shards ``todo`` brought level with the run: open rounds checked again, missed
        steps taken again (into ``redone``); each is removed from ``todo`` once caught up; then the
        steps whose copies went to a dead shard sent again from every shard.

        Raises:
            ShardLost: a shard found dead on the way, another or a new one (the caller rebuilds it).
            RuntimeError: (stop_run) a step cannot be taken again."""
        try:
            for i in list(todo):
                await self._recheck(i)
                redone[i] = await self._redo(i, infos[i]["versions"])
                todo.remove(i)  # caught up: not again if another shard dies below
            behind = sorted(f for f, us in self.unbacked.items() if us)
            if behind:
                await self._send_copies(behind)
            self.unbacked.clear()
        except ShardLost:
            raise
        except Exception as e:
            raise self.d.stop_run(
                f"outer-optimiser shard(s) {todo} died and could not be rebuilt: {type(e).__name__}: {e}"
            ) from None

    async def _recheck(self, i: int) -> None:
        """The open rounds' kept pseudo-gradients checked again on the new shard ``i``. A part whose
        object died (its sender died with the shard's node) leaves its replica out of a round not
        yet stepped; in a round whose step the other shards already took, it is left out of shard
        ``i``'s slice only (:func:`_partial`).

        Raises:
            RuntimeError: a part could not be checked for another reason."""
        d = self.d
        for (f, s), r in list(d.book.rounds.items()):
            if r.stepped:
                continue
            for m, parts in sorted(r.parts.items()):
                out = (await d.shards.each("check", [(f, s, m, [parts[i]])] * d.shards.k, [i]))[i]
                if isinstance(out, ShardLost):
                    raise out
                if isinstance(out, BaseException):
                    if not _object_lost(out):
                        raise RuntimeError(f"replica {m}'s pseudo-gradient of fragment {f}: {out}")
                    if r.stepping:
                        r.lost.setdefault(i, set()).add(m)
                        continue
                    d.book.drop(f, s, m, "its pseudo-gradient died with its node")

    async def _redo(self, i: int, versions: list[int]) -> list[int]:
        """Take again, on the new shard ``i`` restored at ``versions``, the steps its copy had not
        caught up with, in order, from their kept pseudo-gradients; returns their fragments (one
        entry per step).

        Raises:
            RuntimeError: a step missing from those kept, or a pseudo-gradient of one is gone."""
        d, redone = self.d, []
        for f, v in enumerate(versions):
            chain = [u for u in self.unbacked.get(f, []) if u.version > v]
            if [u.version for u in chain] != list(range(v + 1, d.book.versions[f] + 1)):
                raise RuntimeError(f"its copy of fragment {f} is at version {v}, the run at {d.book.versions[f]}")
            for u in chain:
                await _take_again(d, i, f, u)
                redone.append(f)
        return redone


async def _take_again(d: OuterDriver, i: int, f: int, u: _Stepped) -> None:
    """Step ``u`` of fragment ``f`` on the driver ``d``'s rebuilt shard ``i`` again (its
    pseudo-gradients checked again; :meth:`_Recovery._redo`).

    Raises:
        ShardLost: the new shard died too. RuntimeError: the step cannot be taken again."""
    lost: set[int] = set()
    for m, parts in sorted(u.parts.items()):
        out = (await d.shards.each("check", [(f, u.step, m, [parts[i]])] * d.shards.k, [i]))[i]
        if isinstance(out, ShardLost):
            raise out
        if isinstance(out, BaseException):
            if not _object_lost(out):
                raise RuntimeError(f"replica {m}'s pseudo-gradient of fragment {f} at step {u.step}: {out}")
            lost.add(m)
    terms = _partial(d, i, f, u.step, u.terms, lost)
    if lost:  # the round's replies went out with the dead shard's slice of the full step
        d.book.resync_all(f)
    out = (await d.shards.each("step", [(f, u.step, terms, u.average_only)] * d.shards.k, [i]))[i]
    if isinstance(out, ShardLost):
        raise out
    if isinstance(out, BaseException) or out[3] != u.version:
        raise RuntimeError(f"taking the step of fragment {f} at step {u.step} again: {out}")
    rec = d.book.finished.get((f, u.step))
    if rec is not None and rec.message is not None:  # later receivers fetch the new slice
        rec.message[i] = out[0]


def _partial(d: OuterDriver, i: int, f: int, step: int, terms: list[tuple[int, float]],
             lost: set[int]) -> list[tuple[int, float]]:  # fmt: skip
    """The terms rebuilt shard ``i`` steps its slice of a round with when the other shards took the
    round's step already and some of its pseudo-gradients died with the dead shard's node (their
    senders died with it): the others, as their weights stand. The slice's mean then leaves those
    replicas out (as a round that went on without them); every receiver still gets the same reply.
    Recorded as a ``partial_round`` event. A round answered already (its step taken again from a
    copy that missed it, :func:`_take_again`) resyncs every member at its next round
    of the fragment (``RoundBook.resync_all``): some applied the dead shard's full step (a break-
    it run: workers' globals differed from the outer side's from then on)."""
    if not lost:
        return terms
    d.book.event("partial_round", None, fragment=f, step=step, shard=i, left_out=sorted(lost))
    kept = [(m, w) for m, w in terms if m not in lost]
    return kept if kept else [(m, 0.0) for m, _ in terms]  # nothing left: an empty mean (no move)


class _DriverFiles:
    """The driver's checkpoint and export files, written and read from its own process (the job's
    never holds the global parameters).

    Args:
        driver: the :class:`OuterDriver` whose state they hold.
    """

    def __init__(self, driver: OuterDriver):
        self.d = driver

    async def save_state(self, path: str, token: str | None, upload: str | None) -> dict[str, Any]:
        """See :meth:`OuterDriver.save_state`."""
        from pathlib import Path

        from ray_diloco.components.checkpoint import write_own_file

        node, loop = ray.get_runtime_context().get_node_id(), asyncio.get_running_loop()

        def state() -> dict[str, Any]:  # on the writing thread: the state is gathered on the event loop
            return asyncio.run_coroutine_threadsafe(self.d.state_dict(), loop).result()

        return await asyncio.to_thread(write_own_file, Path(path), token, state, upload, node)

    async def export_weights(
        self, out_dir: str, fragments: list[Any], units: int, dtype: torch.dtype, token: str
    ) -> dict[str, int] | None:
        """See :meth:`OuterDriver.export_weights`."""
        from pathlib import Path

        from ray_diloco.components.checkpoint import sees_marker
        from ray_diloco.components.export import write_hf_weights
        from ray_diloco.core.shards import read_fragment_range

        if not sees_marker(out_dir, token):
            return None
        await self.d._ready()
        loop = asyncio.get_running_loop()

        def read(i: int, start: int, stop: int) -> np.ndarray:  # on the writer's thread
            def part(rank: int, a: int, b: int) -> np.ndarray:
                return asyncio.run_coroutine_threadsafe(self.d.read_unit(i * units + rank, a, b), loop).result()

            return read_fragment_range(fragments[i], units, part, start, stop)

        names = await asyncio.to_thread(write_hf_weights, fragments, read, Path(out_dir), dtype)
        return {n: (Path(out_dir) / n).stat().st_size for n in names}

    async def load_state_file(self, entry: dict[str, Any], checkpoint_id: str | None) -> bool:
        """See :meth:`OuterDriver.load_state_file`."""
        from ray_diloco.components.checkpoint import read_own_state

        state = await asyncio.to_thread(read_own_state, entry, checkpoint_id)
        if state is None:
            return False
        await self.d.init_global(state["global"])
        await self.d.load_state_dict(state)
        return True

    async def memory(self) -> dict[str, int]:
        """See :meth:`OuterDriver.memory`."""
        d, book = self.d, self.d.book
        shards = await d.recovery.all("memory")
        held = sum(m["held_bytes"] for m in shards) + sum(f.size for f in book.finished.values())
        out = {
            "backup_bytes": sum(m["backup_bytes"] for m in shards),  # copies of neighbours' state
            "open_rounds": len(book.rounds),
            "finished_rounds": len(book.finished),
            "held_bytes": held,
            "events": len(book.events),
            "stats": len(book.stats),
            "failed_rounds": book.failed_rounds,
            "rss_bytes": _rss_bytes(),
        }
        if d.shards.actors:
            out["shard_rss_bytes"] = [m["rss_bytes"] for m in shards]
        return out


class _Rounds:
    """The driver's side of the sync rounds: it feeds arrivals and timers into the
    :class:`~ray_diloco.core.rounds.RoundBook` and carries the book's decisions out on the outer
    shards (check, step, reply, resync), never blocking the event loop.

    Args:
        driver: the :class:`OuterDriver` whose book, shards and recovery it uses.
    """

    def __init__(self, driver: OuterDriver):
        self.d = driver
        self._done: dict[tuple[int, int], asyncio.Event] = {}  # an open round's end, for its waiters

    def open(self, fragment: int, step: int, average_only: bool) -> Round:
        self._done.setdefault((fragment, step), asyncio.Event())
        return self.d.book.open(fragment, step, average_only)

    def start_finish(self, fragment: int, step: int) -> None:
        """The book closed the round: take its step (or fail it) in the background."""
        asyncio.ensure_future(self._finish(fragment, step, self.d.book.rounds[(fragment, step)]))

    async def _finish(self, fragment: int, step: int, r: Round) -> None:
        async with self.d._locks[fragment]:  # rounds of a fragment step in the order they closed
            await self.d.recovery.settle(fragment)  # the previous step's copies are kept (or a rebuild redoes it)
            try:
                outcome = await self._step_round(fragment, step, r)
            except Exception as e:  # a bug, not a replica's fault: fail the round loudly, keep serving
                outcome = self.d.book.failed(fragment, step, error=repr(e))
                try:
                    await self.d.recovery.all("discard", fragment, step)
                except Exception:  # a shard is gone: the next ping says so
                    pass
        self.d.book.finish(fragment, step, outcome)
        self._done.pop((fragment, step)).set()

    async def _step_round(self, fragment: int, step: int, r: Round) -> Finished:
        """The outer step on every shard with the book's ordered terms (replica-id order), or a
        failed round without quorum."""
        # the terms after any rebuild in progress: its recheck drops a part that died with its node
        # (a rebuilt shard never holds it); nothing awaits between them and the step's calls
        await self.d.recovery.idle()
        terms = self.d.book.terms(fragment, step)
        if terms is None:
            await self.d.recovery.all("discard", fragment, step)
            return self.d.book.failed(fragment, step)
        outs = await self.d.recovery.step_all(fragment, step, terms, r)
        errors = [o for o in outs if isinstance(o, BaseException)]
        if errors and len(errors) < len(outs) or len({o[3] for o in outs if not isinstance(o, BaseException)}) > 1:
            self.d.stop_run(f"outer-optimiser shards out of step after the round of fragment {fragment} at step "
                              f"{step}: {errors[0] if errors else 'versions differ'}")  # fmt: skip
        if errors:
            raise errors[0]
        refs, version = [o[0] for o in outs], outs[0][3]
        outcome = self.d.book.stepped(fragment, step, version, list(refs), sum(o[1] for o in outs),
                                      _combine_norms([o[2] for o in outs]))  # fmt: skip
        self.d.recovery.after_step(fragment, _Stepped(step, terms, dict(r.parts), r.average_only, version), refs)
        return outcome

    async def wait(self, fragment: int, step: int) -> None:
        """Until the open round is finished; it is closed at its deadline (the timeout plus the
        transfer allowance of the fragment's bytes)."""
        assert self.d.numels is not None  # init_global first
        done = self._done[(fragment, step)]
        allowance = transfer_allowance_s(RAW.message_nbytes(self.d.numels[fragment]))
        remaining = self.d.book.deadline(fragment, step, allowance) - time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(done.wait()), timeout=max(0.0, remaining))
        except asyncio.TimeoutError:
            if self.d.book.time_out(fragment, step):
                self.start_finish(fragment, step)
        await done.wait()

    async def reply(self, fragment: int, step: int, replica: int, version: int) -> Reply:
        r = self.d.book.rounds.get((fragment, step))
        if r is not None and r.closing:
            await self._done[(fragment, step)].wait()
        a = self.d.book.answer(fragment, step, replica, version)
        if not a.resync:
            return Reply(a.status, a.version, a.message, size=a.size)
        async with self.d._locks[fragment]:  # not in the middle of a step of this fragment
            outs = await self.d.recovery.all("current", fragment)
        return Reply(a.status, outs[0][0], [o[1] for o in outs], resync=True, size=sum(o[2] for o in outs))

    def parts(self, message: Any) -> list[Any] | None:
        """The message's K parts, one per shard (``[ref, ...]`` from a replica's link, whatever K).
        Raises ValueError when it is not a list of ``diloco.outer_shards`` K parts."""
        if message is not None and (not isinstance(message, list) or len(message) != self.d.shards.k):
            got = f"in {len(message)} parts" if isinstance(message, list) else f"as a {type(message).__name__}"
            raise ValueError(
                f"a pseudo-gradient {got}, expected diloco.outer_shards = {self.d.shards.k} parts in a list"
            )
        return message

    async def checked(self, fragment: int, step: int, replica: int, parts: list[Any]) -> list[Any] | None:
        """Every shard's check of ``replica``'s parts (a duplicate refused first), or None when
        they died with their sender's node."""
        self.d.book.begin_check(fragment, step, replica)
        try:
            return await self.d.recovery.check(fragment, step, replica, parts)
        finally:
            self.d.book.end_check(fragment, step, replica)


class OuterDriver:
    """The outer-optimiser driver (use :data:`OuterDriverActor` for the Ray actor): it feeds
    arrivals and timers into its :class:`~ray_diloco.core.rounds.RoundBook` (every rule of a
    round) and carries the book's decisions out on the outer shards (check, step, reply, resync).

    Args:
        initial: fp32 ``[numel_p]`` per fragment (the replicas' common initialisation), or None
            to give it later with :meth:`init_global` (the trainer starts this actor's process
            while the replicas start, before their initialisation is known).
        cfg: the run config (dict). members: ``{replica id: join step}`` of the replicas that
            start with the run (default: ``0 .. diloco.replicas - 1`` at step 0).
    """

    def __init__(self, initial: list[np.ndarray] | None, cfg: dict[str, Any], members: dict[int, int] | None = None):
        from ray_diloco.config import load_config

        self.cfg = c = load_config(cfg, validate=False)
        self.threads = outer_threads(c, holds_state=c.diloco.outer_shards == 1)  # K = 1: the shard's own plan
        self.threads.apply()
        self.numels: list[int] | None = None
        start = dict(members) if members is not None else {m: 0 for m in range(c.diloco.replicas)}
        self.book = RoundBook(start, c.diloco.min_replicas, c.diloco.sync_timeout_s, KEEP_FINISHED, MAX_EVENTS)
        self.shards = ShardGroup(self.cfg.to_dict(), c.diloco.outer_shards)
        self.recovery = _Recovery(self)
        self.files = _DriverFiles(self)
        self.rounds = _Rounds(self)
        self._pending_init: list[Any] = []  # the shard actors' init_global calls (every caller awaits them)
        self.broken: str | None = None  # why the run cannot go on (stop_run): every ping raises it
        if initial is not None:
            values = [np.asarray(g, dtype=np.float32).reshape(-1) for g in initial]
            if self.shards.local is not None:  # in process: at once
                self._set_numels(self.shards.local.set_global(values))
            else:  # actors: they take their slices while the driver starts serving (put once, by reference)
                refs = [ray.put(v) for v in values]
                self._pending_init = [a.init_global.remote(refs) for a in self.shards.actors]
                self._set_numels([v.size for v in values])

    async def init_global(self, initial: list[Any]) -> None:
        """Set the global parameters (fp32 ``[numel_p]`` per fragment, or an ObjectRef of one: the
        trainer passes rank 0's fragments by reference, so they never pass through the job's
        process) and a zero outer-optimiser state, once, before any round. Each shard fetches
        the fragments and keeps its slice.

        Raises:
            RuntimeError: the global parameters were already set.
        """
        if self.numels is not None:
            raise RuntimeError("the outer driver's global parameters are already set")
        numels = await self.recovery.starting(self.shards.all("init_global", list(initial)))
        self._set_numels(numels[0])

    def _set_numels(self, numels: list[int]) -> None:
        self.numels = list(numels)
        self.book.set_fragments(len(numels))
        self._locks = [asyncio.Lock() for _ in numels]  # outer steps of a fragment, one at a time, in order

    async def _ready(self) -> None:
        """Wait for the shard actors' initialisation (every caller awaits the same calls) and their
        first copies to their buddies."""
        if self._pending_init:
            await self.recovery.starting(asyncio.gather(*self._pending_init))
        if self.recovery.enabled and not self.recovery.seeded and self.numels is not None:
            await self.recovery.starting(self.recovery.seed())

    # -- liveness and membership -------------------------------------------------------------
    def stop_run(self, why: str) -> RuntimeError:
        """The run cannot go on (a shard lost with its copy, shards out of step): every later ping
        raises ``why``, which the trainer turns into the run's error line. Returns that error."""
        self.broken = why
        return RuntimeError(why)

    async def ping(self) -> int:
        """The driver's process id (the trainer's liveness check; answered during an outer step).
        With K > 1 every shard must answer too.

        Raises:
            ray.exceptions.RayActorError: a shard actor died (the run's global state is lost).
            RuntimeError: the shards got out of step (a shard's step failed while others' did not)."""
        if self.broken:
            raise RuntimeError(self.broken)
        if self.shards.actors and not self.recovery.lock.locked():
            # a dead shard is rebuilt first (diloco.outer_shard_backup); during a rebuild the driver
            # answers alone (the rebuild may wait on Ray to declare a dead node's objects lost, and
            # its own failure stops the run: the next ping raises it)
            await self.recovery.all("ping")
        return os.getpid()

    async def outer_pids(self) -> list[int]:
        """Process ids of the outer-optimiser side: this driver, then its shard actors (K > 1),
        once each runs (the trainer waits for it when they reserve CPUs)."""
        return [os.getpid(), *(await asyncio.gather(*(a.ping.remote() for a in self.shards.actors)))]

    def add_member(self, replica: int, join_step: int, **info: Any) -> None:
        """Expect ``replica`` in every round sent after inner step ``join_step`` (``info`` goes
        into the join event)."""
        self.book.add_member(replica, join_step, **info)

    def remove_member(self, replica: int, reason: str, kind: str = "death") -> None:
        """Stop expecting ``replica`` (``kind``: ``death`` or ``leave``); open rounds that now
        have every remaining member's answer complete at once."""
        for fragment, step in self.book.remove_member(replica, reason, kind):
            self.rounds.start_finish(fragment, step)

    def member_ids(self) -> dict[int, int]:
        """``{replica id: join step}`` of the current members."""
        return dict(self.book.members)

    def take_events(self) -> list[dict[str, Any]]:
        """Membership and round events since the last call (``core.rounds``), oldest first."""
        return self.book.take_events()

    async def take_stats(self, max_send_step: int | None = None) -> list[dict[str, Any]]:
        """Per-round figures (fragment, send step, update norm, bytes) of the completed rounds sent
        at or before ``max_send_step`` (all if None); later ones are kept for a later call (and in
        :meth:`state_dict`), so each round is reported in the outer step its replicas merge it."""
        return self.book.take_stats(max_send_step)

    def pending_rounds(self) -> int:
        """Open rounds (waiting for pseudo-gradients or closing)."""
        return len(self.book.rounds)

    # -- reads (while no outer step runs) ------------------------------------------------------
    async def _quiet(self, name: str, *args: Any) -> list[Any]:
        """``name`` on every shard while no outer step runs (every fragment's lock held, taken in
        fragment order): reads see one version of every slice."""
        await self._ready()
        held = []
        try:
            for lock in self._locks:
                await lock.acquire()
                held.append(lock)
            return await self.recovery.all(name, *args)
        finally:
            for lock in held:
                lock.release()

    async def global_refs(self) -> list[Any]:
        """Every global fragment (fp32 ``[numel_p]``) put once into the object store: per
        fragment, a list of its K slices' ObjectRefs in shard order (K = 1: one;
        ``runtime.link.fetch_global`` joins them)."""
        per_shard = await self._quiet("global_refs")
        return [list(refs) for refs in zip(*per_shard)]

    async def global_params(self) -> list[np.ndarray]:
        """Copies of every global fragment, fp32 ``[numel_p]``."""
        per_shard = await self._quiet("global_params")
        return [parts[0] if len(parts) == 1 else np.concatenate(parts) for parts in zip(*per_shard)]

    async def read_unit(self, unit: int, start: int, stop: int) -> np.ndarray:
        """Global values ``[start, stop)`` of exchange unit ``unit`` (fp32, a copy), read from the
        shards holding them (only those slices: no shard sends its whole state)."""
        await self._ready()
        assert self.numels is not None  # init_global first
        parts = []
        for k, b in enumerate(shard_bounds(self.numels[unit], self.shards.k)):
            lo, hi = max(start, b.start), min(stop, b.stop)
            if lo < hi:
                parts.append(await self.recovery.one(k, "read", unit, lo - b.start, hi - b.start))
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.float32)

    async def global_versions(self) -> list[int]:
        """Outer steps applied to each fragment (what a joiner's versions start from)."""
        return list(self.book.versions)

    # -- checkpoints -------------------------------------------------------------------------
    async def state_dict(self) -> dict[str, Any]:
        """The outer optimiser's state (global parameters, optimiser buffers, steps), the downlink
        residuals, fragment versions, the newest finished round per fragment and the figures of
        completed rounds not yet reported: the K = 1 layout whatever K (shards' slices joined)."""
        assert self.numels is not None  # init_global first
        out = join_outer_states(await self._quiet("state_dict"), self.numels)
        book = self.book
        out.update({"versions": list(book.versions), "completed": list(book.last_finished),
                    "stats": copy.deepcopy(book.stats)})  # fmt: skip
        return out

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (each shard takes its slice of the one object)."""
        await self._quiet("load_state_dict", ray.put(state) if self.shards.actors else state)
        self.recovery.seeded = False  # the copies are sent again before the next round
        assert self.numels is not None  # init_global first
        n = len(self.numels)
        self.book.restore(state.get("versions", [0] * n), state.get("completed", [0] * n),
                          copy.deepcopy(list(state.get("stats", []))))  # fmt: skip

    async def state_hash(self) -> dict[str, str]:
        """sha256 of the global parameters and of the outer optimiser buffers (the same for every
        K: computed over the whole state's bytes in fragment order)."""
        if self.shards.local is not None:
            return await self.shards.local.state_hash()
        state = await self.state_dict()
        return outer_state_hash(state["global"], [o["state"].get(0, {}) for o in state["optimizers"]])

    async def save_state(self, path: str, token: str | None = None, upload: str | None = None) -> dict[str, Any]:
        """Write :meth:`state_dict` with ``checkpoint_id`` ``token`` to ``path`` (a checkpoint's
        ``outer.pt``) from this process, on a thread (pings are answered meanwhile), and with
        ``upload`` (its URI in ``run.storage_path``) copy it there too. Returns ``{"file", "bytes",
        "node"}`` (+ ``"uploaded"`` or ``"upload_error"``), ``{"unseen": True, "node"}`` when this
        node does not see the directory (the job then fetches :meth:`state_dict`), or ``{"error":
        line}`` when the file cannot be written (the job fails the checkpoint; the outer side goes
        on): ``components.checkpoint.write_own_file``, as a replica worker's."""
        return await self.files.save_state(path, token, upload)

    async def export_weights(
        self, out_dir: str, fragments: list[Any], units: int, dtype: torch.dtype, token: str
    ) -> dict[str, int] | None:
        """Write the global parameters as the exported model's safetensors into ``out_dir``
        (``components.export.write_hf_weights``: named as in the model, in ``dtype``, file by
        file), from this process (the job's never holds them), reading one parameter at a time
        from the outer shards (:meth:`read_unit`; FSDP: its rows from each rank's unit,
        ``core.shards.read_fragment_range``): besides the file being written no copy of the model
        is made. ``fragments``: the run's plan, ``units`` the exchange units per fragment (FSDP:
        W). Call when no outer step runs (the end of a run). Returns ``{file: bytes}``, or None
        when this node does not see ``out_dir`` (no ``token`` marker there)."""
        return await self.files.export_weights(out_dir, fragments, units, dtype, token)

    async def load_state_file(self, entry: dict[str, Any], checkpoint_id: str | None = None) -> bool:
        """Set the global parameters and restore the outer state from a checkpoint's ``outer.pt``
        (``{"file", "bytes"}``), read here (a resume: the job's process never holds them). Returns
        False, setting nothing, when this node does not see the file with its recorded size and
        ``checkpoint_id`` (the job then reads it and sends the state).

        Raises:
            CheckpointError: the file is unreadable. RuntimeError: already set."""
        return await self.files.load_state_file(entry, checkpoint_id)

    async def thread_reports(self) -> list[dict[str, Any]]:
        """The threads of the outer side's processes (``components.threads.ThreadPlan.report``):
        the driver's, then each shard actor's (K > 1)."""
        shards = await self.shards.all("thread_report") if self.shards.actors else []
        return [self.threads.report(), *shards]

    async def memory(self) -> dict[str, int]:
        """What the driver holds: open and finished rounds, their bytes (checked pseudo-gradients
        held by the shards, kept replies), the shards' copies of each other's state
        (``diloco.outer_shard_backup``; as many bytes move per outer step), queued events and
        stats, and the resident memory (bytes, from /proc; 0 where unavailable) of the driver
        and of each shard."""
        return await self.files.memory()

    # -- rounds ------------------------------------------------------------------------------
    async def exchange(self, fragment: int, step: int, replica: int, weight: float, message: Any,
                       version: int = 0, average_only: bool = False) -> Reply:  # fmt: skip
        """Submit replica ``replica``'s pseudo-gradient of ``fragment`` sent at inner step
        ``step`` (a list of K ``core.wire`` messages or their ObjectRefs, one per shard's slice,
        fp32 ``[numel_p]`` once decoded and joined), weighted by ``weight`` (tokens trained since its last
        sync). ``message`` None: the replica found its pseudo-gradient non-finite and abstains.
        ``version``: the global version it holds. ``average_only``: a closing round (the
        weighted mean, no outer step).

        Returns the :class:`Reply` once the round is complete, timed out or failed (at most
        the round's timeout after it opened); its message is a list of K ObjectRefs (one per
        shard) shared by every receiver.

        Raises:
            ValueError: bad fragment or replica, a duplicate submission, a malformed message.
        """
        await self._ready()
        self.book.validate(fragment, replica)
        parts = self.rounds.parts(message)
        del message
        if not self.book.admits(fragment, step, replica):
            return await self.rounds.reply(fragment, step, replica, version)
        norm, size = None, 0
        if parts is not None and bool(np.isfinite(weight)) and weight >= 0:  # checked before the round counts it
            checks = await self.rounds.checked(fragment, step, replica, parts)
            if checks is None:  # it died with its sender's node: as its death, no error
                return Reply(DROPPED, self.book.versions[fragment])
            norms, size = [c[0] for c in checks], sum(c[1] for c in checks)
            if not self.book.admits(fragment, step, replica):  # closed while it was checked
                await self.recovery.all("discard", fragment, step, replica)
                return await self.rounds.reply(fragment, step, replica, version)
            norm = None if any(n is None for n in norms) else _combine_norms(norms)
        else:
            self.book.not_twice(fragment, step, replica)  # a duplicate is refused all the same
        self.rounds.open(fragment, step, average_only)
        # a rejected one's slices a shard kept are dropped by the round's step; a valid one's
        # references are kept to rebuild a lost shard (until stepped)
        if self.book.arrive(fragment, step, replica, weight, norm, size, parts, average_only):
            self.rounds.start_finish(fragment, step)
        del parts
        if (fragment, step) in self.book.rounds:
            await self.rounds.wait(fragment, step)
        return await self.rounds.reply(fragment, step, replica, version)

    async def result(self, fragment: int, step: int, replica: int = 0, version: int = 0,
                     average_only: bool = False) -> Reply:  # fmt: skip
        """The reply of a round for a rank > 0 of ``replica`` (waits for the round, at most its
        timeout after it opened)."""
        await self._ready()
        self.book.validate(fragment, replica)
        if replica in self.book.members and not self.book.is_closed(fragment, step):
            self.rounds.open(fragment, step, average_only)
            await self.rounds.wait(fragment, step)
        return await self.rounds.reply(fragment, step, replica, version)


#: The driver as a Ray actor. It reserves no CPU (it must not take a core a replica worker
#: needs); its maths thread sets its own torch threads (:func:`_maths_threads`).
OuterDriverActor = ray.remote(num_cpus=0)(OuterDriver)
