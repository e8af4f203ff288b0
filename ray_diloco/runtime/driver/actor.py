"""The outer-optimiser driver: the Ray side of the sync rounds, the outer shards and their recovery.

The driver is an async Ray actor that holds the global parameters and the outer optimiser
(:class:`~ray_diloco.core.outer.OuterOptimizer`, in its outer shards). Each replica's rank 0
submits its quantised pseudo-gradient of a fragment with :meth:`OuterDriver.exchange`; the other
ranks of the replica wait for the same answer with :meth:`OuterDriver.result`. Every rule of a
round (who it waits for, quorum, timeouts, rejection, late and duplicate messages, versions and
what each replica is answered; DiLoCo, arXiv 2311.08105, section 3) lives in
:class:`~ray_diloco.core.rounds.RoundBook`, synchronous and tested without Ray; here
:class:`~ray_diloco.runtime.driver.rounds.Rounds` feeds it arrivals and timers and carries
its decisions out on the shards.

Transport and memory: pseudo-gradients arrive as object-store references (numpy
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

A shard lost with its process or node (K > 1, ``diloco.outer_shard_backup``):
:class:`~ray_diloco.runtime.driver.recovery.Recovery` rebuilds it from the copy its ring neighbour keeps (``runtime.outer_shards``), checks the open
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
import os
from typing import Any

import numpy as np
import ray
import torch

from ray_diloco.components.threads import outer_threads
from ray_diloco.core.formats import wire_format
from ray_diloco.core.outer import outer_state_hash
from ray_diloco.core.rounds import RoundBook
from ray_diloco.core.shards import join_outer_states, shard_bounds
from ray_diloco.core.wire import DROPPED, Reply
from ray_diloco.runtime.driver.common import KEEP_FINISHED, MAX_EVENTS, Fragments, RunHealth, combine_norms
from ray_diloco.runtime.driver.copies import Copies
from ray_diloco.runtime.driver.files import DriverFiles
from ray_diloco.runtime.driver.recovery import Recovery
from ray_diloco.runtime.driver.rounds import Rounds
from ray_diloco.runtime.outer_shards import ShardGroup, _rss_bytes

__all__ = ["OuterDriver", "OuterDriverActor"]


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
        self.frags = Fragments()
        start = dict(members) if members is not None else {m: 0 for m in range(c.diloco.replicas)}
        self.book = RoundBook(start, c.diloco.min_replicas, c.diloco.sync_timeout_s, KEEP_FINISHED, MAX_EVENTS)
        self.shards = ShardGroup(self.cfg.to_dict(), c.diloco.outer_shards)
        self.health = RunHealth()  # why the run cannot go on: every ping raises it
        backup = self.shards.k > 1 and c.diloco.outer_shard_backup
        self.copies = Copies(self.shards, backup, wire_format(c.streaming.quantization).raw)
        self.recovery = Recovery(self.shards, self.book, self.health, self.copies)
        self.files = DriverFiles(self.state_dict, self.read_unit, self.init_global, self.load_state_dict)
        self.rounds = Rounds(self.book, self.recovery, self.copies, self.frags, self.health)
        self._pending_init: list[Any] = []  # the shard actors' init_global calls (every caller awaits them)
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
        if self.frags.numels is not None:
            raise RuntimeError("the outer driver's global parameters are already set")
        numels = await self.recovery.starting(self.shards.all("init_global", list(initial)))
        self._set_numels(numels[0])

    def _set_numels(self, numels: list[int]) -> None:
        self.frags.set(numels)
        self.book.set_fragments(len(numels))

    async def _ready(self) -> None:
        """Wait for the shard actors' initialisation (every caller awaits the same calls) and their
        first copies to their buddies."""
        if self._pending_init:
            await self.recovery.starting(asyncio.gather(*self._pending_init))
        if self.copies.enabled and not self.copies.seeded and self.frags.numels is not None:
            await self.recovery.starting(self.recovery.seed())

    # -- liveness and membership -------------------------------------------------------------
    async def ping(self) -> int:
        """The driver's process id (the trainer's liveness check; answered during an outer step).
        With K > 1 every shard must answer too.

        Raises:
            ray.exceptions.RayActorError: a shard actor died (the run's global state is lost).
            RuntimeError: the shards got out of step (a shard's step failed while others' did not)."""
        self.health.check()
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

    def take_events(self) -> list[dict[str, Any]]:
        """Membership and round events since the last call (``core.rounds``), oldest first."""
        return self.book.take_events()

    async def take_stats(self, max_send_step: int | None = None) -> list[dict[str, Any]]:
        """Per-round figures (fragment, send step, update norm, bytes) of the completed rounds sent
        at or before ``max_send_step`` (all if None); later ones are kept for a later call (and in
        :meth:`state_dict`), so each round is reported in the outer step its replicas merge it."""
        return self.book.take_stats(max_send_step)

    # -- reads (while no outer step runs) ------------------------------------------------------
    async def _quiet(self, name: str, *args: Any) -> list[Any]:
        """``name`` on every shard while no outer step runs (every fragment's lock held, taken in
        fragment order): reads see one version of every slice."""
        await self._ready()
        held = []
        try:
            for lock in self.frags.locks:
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
        parts = []
        for k, b in enumerate(shard_bounds(self.frags.numel(unit), self.shards.k)):
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
        assert self.frags.numels is not None  # init_global first
        out = join_outer_states(await self._quiet("state_dict"), self.frags.numels)
        book = self.book
        out.update({"versions": list(book.versions), "completed": list(book.last_finished),
                    "stats": copy.deepcopy(book.stats)})  # fmt: skip
        return out

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (each shard takes its slice of the one object)."""
        await self._quiet("load_state_dict", ray.put(state) if self.shards.actors else state)
        self.copies.unseed()  # the copies are sent again before the next round
        assert self.frags.numels is not None  # init_global first
        n = len(self.frags.numels)
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
        await self._ready()
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
        book = self.book
        shards = await self.recovery.all("memory")
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
        if self.shards.actors:
            out["shard_rss_bytes"] = [m["rss_bytes"] for m in shards]
        return out

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
                return Reply(DROPPED, self.book.fragments[fragment].version)
            norms, size = [c.norm for c in checks], sum(c.nbytes for c in checks)
            if not self.book.admits(fragment, step, replica):  # closed while it was checked
                await self.recovery.all("discard", fragment, step, replica)
                return await self.rounds.reply(fragment, step, replica, version)
            norm = None if any(n is None for n in norms) else combine_norms(norms)
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
