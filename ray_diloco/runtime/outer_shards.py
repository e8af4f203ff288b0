"""The outer-optimiser shards: who holds the global parameters and the outer state, and how a
shard lost with its node is rebuilt.

With ``diloco.outer_shards`` K, each :class:`OuterShard` owns one contiguous slice of every fragment
(``core.shards.shard_bounds``): the fp32 global values, their outer-optimiser state (Nesterov
momentum) and downlink residuals. K = 1 is held in the driver's own process; K > 1 are Ray actors
(:data:`OuterShardActor`) SPREAD over the nodes, so the exchange's bytes spread over K links.

Surviving a shard's node (``diloco.outer_shard_backup``, K > 1): after every outer step a shard
puts a copy of the fragment's new slice state (global values, optimiser state, step count,
residual, version) into the object store and the next shard in the ring, ``(k + 1) % K``, keeps
it. When a shard's actor dies (its process or its node), :meth:`ShardGroup.replace` starts a new
shard on a live node, restores it from that copy (the exact bits of the dead one's last backed-up
step) and gives it the backup it holds for shard ``(k - 1) % K``. The driver then re-checks the
open rounds' pseudo-gradients on it and redoes a step the copy had not caught up with
(``runtime.driver``). The replicas' globals are not used: under Streaming DiLoCo's overlap a
replica's copy of a fragment lags the outer side's by up to tau steps, the backup never does.
Costs: each shard holds a second copy of its neighbour's slice state (2 U / K with SGD/Nesterov,
3 U / K with a downlink residual; U = 4 bytes x parameters), and moves as much per outer step.

No round logic here (that is the driver's); the maths is ``core.outer``.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import ray
import torch

from ray_diloco.components.threads import outer_threads
from ray_diloco.config import load_config
from ray_diloco.core.formats import RAW, Packed, parse, wire_format
from ray_diloco.core.outer import OrderedMean, OuterOptimizer, finite_norm
from ray_diloco.core.quantize import fused_codec
from ray_diloco.core.shards import shard_bounds, slice_optimizer_state
from ray_diloco.core.wire import Downlink, is_raw, message_numel, message_size, message_values


class Checked(NamedTuple):
    """A shard's check of its slice of a pseudo-gradient (:meth:`OuterShard.check`)."""

    norm: float | None  # its L2 norm; None: not finite (not kept)
    nbytes: int  # the bytes it counts for on the wire


class Stepped(NamedTuple):
    """A shard's outer step of its slice (:meth:`OuterShard.step`)."""

    ref: Any  # the reply's ObjectRef (the new global slice, or its quantised update)
    nbytes: int  # the reply's bytes on the wire
    norm: float  # the L2 norm of the slice's update
    version: int  # the fragment's version after the step


class Current(NamedTuple):
    """A shard's current global slice of a fragment (:meth:`OuterShard.current`, a resync)."""

    version: int
    ref: Any  # ObjectRef of the fp32 values
    nbytes: int


def _decode_and_check(message: Any) -> tuple[np.ndarray | Packed | None, float | None]:
    """(a check thread) A pseudo-gradient's values and their norm, or ``(None, None)`` when it is
    malformed or not finite: a ``none`` message's fp32 values (a view); a scaled format's encoding
    as it came (views of its bytes, decoded when summed: ``core.outer.OrderedMean``), its norm
    read in one pass (``core.codec.norm``); a bf16 one decoded."""
    try:
        if not is_raw(message):
            packed = parse(message)
            if wire_format(packed.format).scaled:
                norm = fused_codec().norm(packed.payload, packed.scales, packed.format, packed.numel)
                return (packed, norm) if norm is not None else (None, None)
        values = message_values(message)[1]
    except ValueError:
        return None, None
    norm = finite_norm(values)
    return (values, norm) if norm is not None else (None, None)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class OuterShard:
    """Slice ``shard`` of K of every fragment's global parameters (``core.shards.shard_bounds``):
    the fp32 values, their outer-optimiser state and downlink residuals; it checks the replicas'
    pseudo-gradient slices as they arrive and steps its slice when the driver closes a round.
    The driver holds it in process (K = 1) or as an :data:`OuterShardActor` (K > 1).

    The maths (the mean, the step, the encoding, every read of the state) runs on one FIFO thread,
    so reads see every step submitted before them; checks run on their own threads.

    Args:
        cfg: the run config (dict). shard, shards: which slice of how many.
    """

    def __init__(self, cfg: dict[str, Any], shard: int = 0, shards: int = 1):
        self.cfg = load_config(cfg, validate=False)
        self.shard, self.shards = int(shard), int(shards)
        self.opt: OuterOptimizer | None = None
        self.bounds: list[slice] = []
        self.pending: dict[tuple[int, int], dict[int, np.ndarray | Packed]] = {}  # checked, not yet summed
        self.held: dict[int, dict[int, dict[str, Any]]] = {}  # the copies this shard keeps: {shard: {fragment: ..}}
        self._held_lock = threading.Lock()
        self.threads = outer_threads(self.cfg)  # the process's plan (diloco.outer_cpus)
        self.threads.apply()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outer-maths")  # FIFO: fixed order
        # decoding and checking a pseudo-gradient needs no order: they run side by side as they arrive
        self._checks = ThreadPoolExecutor(max_workers=max(2, self.threads.intra_op), thread_name_prefix="outer-check")

    def __repr__(self) -> str:  # Ray's name for the actor in its logs and state API (`ray list actors`)
        return f"OuterShard({self.shard}/{self.shards})"

    async def _maths(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def ping(self) -> int:
        """This process's id (answered during an outer step)."""
        return os.getpid()

    async def init_global(self, initial: list[Any]) -> list[int]:
        """Take this shard's slice of every fragment (fp32 ``[numel_p]``, or an ObjectRef of one)
        and a zero outer-optimiser state; returns the fragments' sizes ``numel_p``.

        Raises:
            RuntimeError: already set."""
        if self.opt is not None:
            raise RuntimeError("the outer driver's global parameters are already set")
        return self.set_global([await g if isinstance(g, ray.ObjectRef) else g for g in initial])

    def set_global(self, initial: list[np.ndarray]) -> list[int]:
        """:meth:`init_global` with the values themselves."""
        if self.opt is not None:
            raise RuntimeError("the outer driver's global parameters are already set")
        values = [np.asarray(g, dtype=np.float32).reshape(-1) for g in initial]
        self._set_slices([v.size for v in values], [v[shard_bounds(v.size, self.shards)[self.shard]] for v in values])
        return [v.size for v in values]

    def _set_slices(self, numels: list[int], slices: list[np.ndarray]) -> None:
        """Hold ``slices`` (fp32, this shard's slice of fragments of ``numels`` values) with a zero
        outer-optimiser state, no residuals, versions 0."""
        self.numels = list(numels)
        self.bounds = [shard_bounds(n, self.shards)[self.shard] for n in numels]
        self.opt = OuterOptimizer(slices, self.cfg.outer)
        self.downlink = Downlink(self.cfg.streaming.quantization, self.cfg.streaming.error_feedback)

    # -- a round ------------------------------------------------------------------------------
    async def check(self, fragment: int, step: int, replica: int, message: Any) -> Checked:
        """Fetch (``[ObjectRef]``, zero-copy) and check replica ``replica``'s pseudo-gradient slice
        of ``fragment`` for round ``step``; keep its values for :meth:`step`. Returns its norm
        (None: not finite, not kept) and its bytes.

        Raises:
            ValueError: the message does not hold this slice's number of values, or is malformed."""
        if isinstance(message, list):
            (message,) = message
        if isinstance(message, ray.ObjectRef):
            message = await message
        n = self.bounds[fragment].stop - self.bounds[fragment].start
        got = message_numel(message)  # malformed input is refused here
        if got != n:
            what = "fragment" if self.shards == 1 else f"shard {self.shard} of fragment"
            raise ValueError(f"replica {replica}: {what} {fragment} has {n} values, got {got}")
        size = message_size(message)
        values, norm = await asyncio.get_running_loop().run_in_executor(self._checks, _decode_and_check, message)
        del message
        if norm is not None:
            assert values is not None  # kept with its norm
            self.pending.setdefault((fragment, step), {})[replica] = values
        return Checked(norm, size)

    def discard(self, fragment: int, step: int, replica: int | None = None) -> None:
        """Drop the kept pseudo-gradients of a round (``replica``: only that one's)."""
        if replica is None:
            self.pending.pop((fragment, step), None)
        else:
            held = self.pending.get((fragment, step), {})
            held.pop(replica, None)
            if not held:
                self.pending.pop((fragment, step), None)

    async def step(self, fragment: int, step: int, terms: list[tuple[int, float]], average_only: bool) -> Stepped:
        """The outer step of this slice on the token-weighted mean of ``terms`` (``(replica,
        weight)`` in the driver's order; weight 0: in the round, not in the sum), and its reply
        put once into the object store."""
        held = self.pending.pop((fragment, step), {})
        mean = OrderedMean(self.bounds[fragment].stop - self.bounds[fragment].start)
        for m, w in terms:
            if w > 0:
                mean.add(held[m], w)
        del held
        return await self._maths(self._step, fragment, mean, average_only)

    def _step(self, fragment: int, mean: OrderedMean, average_only: bool) -> Stepped:
        """(maths thread) ``OuterOptimizer.step_ordered`` (mean and step in one chunked pass) and
        the reply: with ``none`` the new global slice itself; otherwise the quantised update,
        which this shard applies to its own copy exactly as every receiver does
        (``core.wire.Downlink.step``)."""
        assert self.opt is not None  # set_global first
        frag = self.opt.fragments[fragment]
        p = frag.param
        if self.downlink.fmt.raw:
            norm, _ = self.opt.step_ordered(fragment, mean, average_only)
            ref, size = ray.put(p.numpy()), RAW.message_nbytes(p.numel())
        else:
            message, norm = self.downlink.step(self.opt, fragment, mean, average_only)
            ref, size = ray.put(np.frombuffer(message, np.uint8)), len(message)
        frag.version += 1
        return Stepped(ref, size, norm, frag.version)

    async def current(self, fragment: int) -> Current:
        """This slice's current global values (a resync)."""

        def put() -> Current:
            assert self.opt is not None  # set_global first
            f = self.opt.fragments[fragment]
            return Current(f.version, ray.put(f.param.numpy()), RAW.message_nbytes(f.param.numel()))

        return await self._maths(put)

    # -- state ---------------------------------------------------------------------------------
    async def global_refs(self) -> list[Any]:
        """This shard's slice of every fragment (fp32) put once into the object store."""
        assert self.opt is not None  # set_global first
        return await self._maths(lambda: [ray.put(f.param.numpy()) for f in self.opt.fragments])

    async def global_params(self) -> list[np.ndarray]:
        """Copies of this shard's slice of every fragment, fp32."""
        assert self.opt is not None  # set_global first
        return await self._maths(self.opt.global_params)

    def read(self, unit: int, start: int, stop: int) -> np.ndarray:
        """A copy of values ``[start, stop)`` of this shard's slice of exchange unit ``unit`` (fp32)."""
        assert self.opt is not None  # set_global first
        return self.opt.fragments[unit].param[start:stop].numpy().copy()

    async def state_dict(self) -> dict[str, Any]:
        """This slice's global values, optimiser state, step counts, residuals and versions."""
        assert self.opt is not None  # set_global first
        return await self._maths(self.opt.state_dict)

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take this shard's slice of a whole (K = 1 layout) outer state: the layout of a
        checkpoint does not depend on K, so a run resumes with any ``diloco.outer_shards``."""
        await self._maths(self._load_state_dict, state)

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.opt is not None  # set_global first
        n = len(self.opt.fragments)
        if len(state["global"]) != n:
            raise ValueError(f"checkpoint has {len(state['global'])} fragments, expected {n}")
        numels = [np.asarray(g).size for g in state["global"]]
        residuals = state.get("residuals") or [None] * n
        self.opt.load_state_dict(
            {
                "global": [
                    np.asarray(g, dtype=np.float32).reshape(-1)[sl] for g, sl in zip(state["global"], self.bounds)
                ],
                "optimizers": [
                    slice_optimizer_state(o, sl, k) for o, sl, k in zip(state["optimizers"], self.bounds, numels)
                ],
                "steps": state["steps"],
                "residuals": [
                    None if r is None else np.asarray(r, dtype=np.float32).reshape(-1)[sl]
                    for r, sl in zip(residuals, self.bounds)
                ],
                "versions": state.get("versions", [0] * n),
            }
        )

    async def state_hash(self) -> dict[str, str]:
        """sha256 of the global parameters and outer buffers (K = 1: the whole state's)."""
        assert self.opt is not None  # set_global first
        return await self._maths(self.opt.state_hash)

    def thread_report(self) -> dict[str, Any]:
        """The threads this shard's process uses (``components.threads.ThreadPlan.report``)."""
        return self.threads.report()

    def memory(self) -> dict[str, int]:
        """Bytes of the checked pseudo-gradients kept for open rounds, of the copies of another
        shard's state kept (:meth:`keep`), and this process's RSS."""
        with self._held_lock:
            backup = sum(_nbytes(e) for entries in self.held.values() for e in entries.values())
        return {
            "held_bytes": sum(v.nbytes for held in self.pending.values() for v in held.values()),
            "backup_bytes": backup,
            "rss_bytes": _rss_bytes(),
        }

    # -- the copy of a neighbour's state (diloco.outer_shard_backup) -----------------------------
    def _backup_entry(self, fragment: int, with_global: bool = True) -> dict[str, Any]:
        """(maths thread) This slice's state of ``fragment`` as numpy views (``ray.put`` copies them):
        ``{"numel", "version", "steps", "global" fp32 [n] (None: not ``with_global``), "optimizer"
        (torch state dict, tensors as numpy), "residual" fp32 [n] or None}``."""
        assert self.opt is not None  # set_global first
        frag = self.opt.fragments[fragment]
        opt, residual = frag.opt.state_dict(), frag.residual
        return {
            "numel": self.numels[fragment],
            "version": frag.version,
            "steps": frag.steps,
            "global": frag.param.detach().numpy() if with_global else None,
            "optimizer": {
                "state": {k: {n: _as_numpy(v) for n, v in st.items()} for k, st in opt["state"].items()},
                "param_groups": opt["param_groups"],
            },
            "residual": None if residual is None else residual.numpy(),
        }

    async def backup_all(self, fragments: list[int] | None = None, with_global: bool = True) -> Any:
        """The slice state (:meth:`_backup_entry`) of ``fragments`` (None: every one) put once into
        the object store, on the maths thread: after every step submitted before it (a new
        neighbour's first copy, a step's copy, a copy sent again). Without ``with_global`` the
        values are left out (with ``none`` the step's reply is the new global slice itself: the
        keeper takes it from there, :meth:`keep`)."""
        assert self.opt is not None  # set_global first
        todo = range(len(self.opt.fragments)) if fragments is None else fragments
        return await self._maths(lambda: ray.put({f: self._backup_entry(f, with_global) for f in todo}))

    async def keep(self, shard: int, backup: dict[int, dict[str, Any]], values: Any = None) -> int:
        """Keep a copy of shard ``shard``'s state of the fragments in ``backup`` (fetched by Ray:
        read-only views of the object store, copied into this process, into the arrays of the
        previous copy). ``values``: the global slice of the one fragment whose entry has none
        (the step's reply). A copy older than the one kept is ignored. Returns the bytes kept."""
        return await asyncio.get_running_loop().run_in_executor(self._checks, self._keep, shard, backup, values)

    def _keep(self, shard: int, backup: dict[int, dict[str, Any]], values: Any = None) -> int:
        kept = 0
        with self._held_lock:  # copied in place: no second copy at a time (held_backup waits for it)
            held = self.held.setdefault(int(shard), {})
            for f, e in ((int(f), e) for f, e in backup.items()):
                if f in held and e["version"] < held[f]["version"]:
                    continue
                held[f] = _copy_entry(e if e["global"] is not None else {**e, "global": values}, held.get(f))
                kept += _nbytes(held[f])
        return kept

    def held_backup(self, shard: int) -> Any:
        """The copy kept of shard ``shard``'s state, put once into the object store.

        Raises:
            LookupError: no copy of that shard is kept here."""
        with self._held_lock:
            if int(shard) not in self.held:
                raise LookupError(f"outer shard {self.shard} keeps no copy of shard {shard}")
            return ray.put(dict(self.held[int(shard)]))

    async def restore(self, backup: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """Become the shard whose copy ``backup`` is (every fragment, from :meth:`held_backup`):
        its global values, optimiser state, step counts, residuals and versions, bit for bit.
        Returns ``{"versions": [per fragment], "node": node id}``.

        Raises:
            RuntimeError: already set. LookupError: the copy lacks fragments."""
        await self._maths(self._restore, backup)
        assert self.opt is not None  # restored just now
        return {"versions": [f.version for f in self.opt.fragments], "node": ray.get_runtime_context().get_node_id()}

    def _restore(self, backup: dict[int, dict[str, Any]]) -> None:
        if self.opt is not None:
            raise RuntimeError("the outer driver's global parameters are already set")
        if sorted(backup) != list(range(len(backup))):
            raise LookupError(f"the copy of outer shard {self.shard} lacks fragments (holds {sorted(backup)})")
        entries = [backup[f] for f in sorted(backup)]
        self._set_slices([int(e["numel"]) for e in entries], [e["global"] for e in entries])
        assert self.opt is not None  # set just now
        for frag, e in zip(self.opt.fragments, entries):
            opt = e["optimizer"]
            state = {k: {n: _as_tensor(v) for n, v in st.items()} for k, st in opt["state"].items()}
            frag.opt.load_state_dict({"state": state, "param_groups": opt["param_groups"]})
            frag.steps, frag.version = int(e["steps"]), int(e["version"])
            r = e["residual"]
            frag.residual = None if r is None else torch.from_numpy(np.array(r, dtype=np.float32, copy=True))


def _as_numpy(v: Any) -> Any:
    return v.detach().numpy() if isinstance(v, torch.Tensor) else v


def _as_tensor(v: Any) -> Any:
    return torch.from_numpy(np.array(v, copy=True)) if isinstance(v, np.ndarray) else v


def _copy(a: Any, old: Any) -> Any:
    """``a`` (an array: a copy, into ``old`` when it has its shape and dtype) or ``a`` itself."""
    if not isinstance(a, np.ndarray):
        return a
    if isinstance(old, np.ndarray) and old.shape == a.shape and old.dtype == a.dtype:
        np.copyto(old, a)
        return old
    return np.array(a, copy=True)


def _copy_entry(e: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
    """A backup entry with every array copied out of the object store (into ``old``'s arrays)."""
    old = old or {"global": None, "residual": None, "optimizer": {"state": {}}}
    opt, old_state = e["optimizer"], old["optimizer"]["state"]
    state = {k: {n: _copy(v, old_state.get(k, {}).get(n)) for n, v in st.items()} for k, st in opt["state"].items()}
    return {
        **e,
        "global": _copy(np.asarray(e["global"], dtype=np.float32), old["global"]),
        "residual": None if e["residual"] is None else _copy(e["residual"], old["residual"]),
        "optimizer": {"state": state, "param_groups": opt["param_groups"]},
    }


def _nbytes(e: dict[str, Any]) -> int:
    arrays = [e["global"], e["residual"], *(v for st in e["optimizer"]["state"].values() for v in st.values())]
    return sum(a.nbytes for a in arrays if isinstance(a, np.ndarray))


#: A shard as a Ray actor (K > 1). No CPU reserved (like the driver): its maths sets its own threads.
OuterShardActor = ray.remote(num_cpus=0)(OuterShard)


def _live_nodes() -> tuple[list[str], str]:
    """``(pool, here)``: the live nodes to place outer shards on, sorted by node id (those with
    CPUs, the replicas', other than this process's; none such: every live node), and this
    process's node (the job's, where the driver runs)."""
    here = ray.get_runtime_context().get_node_id()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    workers = sorted(n["NodeID"] for n in alive if n["Resources"].get("CPU", 0) > 0 and n["NodeID"] != here)
    return workers or sorted(n["NodeID"] for n in alive), here


def ring_placement(k: int, pool: list[str], spare: str | None = None) -> list[str | None]:
    """The node of each of ``k`` shards whose copies go round a ring (shard i's is kept by shard
    ``(i + 1) % k``): round-robin over ``pool``, so with ``k`` nodes or more every shard has its
    own, and a shard and its keeper never share a node when there are two nodes or more. The
    wrap-around would put shard ``k - 1`` next to shard 0 when ``k % len(pool) == 1``: with three
    nodes or more it moves to ``pool[1]``; with two (``k`` odd) to ``spare``, the driver's node
    (lost only with the run), when given. ``pool`` empty: None each (the scheduler's choice)."""
    if not pool:
        return [None] * k
    n = len(pool)
    nodes: list[str | None] = [pool[i % n] for i in range(k)]
    if k > 1 and n > 1 and k % n == 1:
        nodes[-1] = pool[1] if n >= 3 else spare if spare is not None else nodes[-1]
    return nodes


class ShardLost(Exception):
    """Shard ``shard``'s actor (generation ``gen``: how many times it was replaced) is dead."""

    def __init__(self, shard: int, gen: int, cause: BaseException):
        super().__init__(f"outer shard {shard} died: {type(cause).__name__}")
        self.shard, self.gen, self.cause = shard, gen, cause


class ShardGroup:
    """The driver's K shards: calls run on all of them and are gathered in shard order; K = 1 is
    the in-process :class:`OuterShard`, K > 1 are actors, each replaceable (:meth:`replace`).

    A call to a dead shard actor raises :class:`ShardLost` (every other error as it is).

    Args:
        cfg: the run config (dict). k: ``diloco.outer_shards``.
    """

    def __init__(self, cfg: dict[str, Any], k: int):
        self.cfg, self.k = cfg, k
        self.gens = [0] * k  # times each shard was replaced
        self.nodes: list[str | None] = [None] * k  # the node each shard actor was placed on (None: the scheduler's)
        if k == 1:
            self.local: OuterShard | None = OuterShard(cfg)
            self.actors: list[Any] = []
        else:
            self.local = None
            pool, here = _live_nodes()
            self.nodes = ring_placement(k, pool, here if here not in pool else None)
            self.actors = [self._start(i) for i in range(k)]

    def _start(self, i: int) -> Any:
        """Shard ``i``'s actor on ``nodes[i]`` (hard affinity: a soft one lets a busy node's raylet
        send it elsewhere, onto another shard's node, seen on a 3-node cluster on 2 cores)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = self.nodes[i]
        where = "SPREAD" if node is None else NodeAffinitySchedulingStrategy(node, soft=False)
        plan = outer_threads(load_config(self.cfg, validate=False))
        return OuterShardActor.options(
            scheduling_strategy=where, num_cpus=plan.cpus, runtime_env=plan.runtime_env()
        ).remote(self.cfg, i, self.k)

    def buddy(self, i: int) -> int:
        """The shard that keeps a copy of shard ``i``'s state."""
        return (i + 1) % self.k

    async def one(self, i: int, name: str, *args: Any) -> Any:
        if self.local is not None:
            out = getattr(self.local, name)(*args)
            return await out if inspect.isawaitable(out) else out
        gen = self.gens[i]
        try:
            return await getattr(self.actors[i], name).remote(*args)
        except ray.exceptions.RayActorError as e:
            raise ShardLost(i, gen, e) from None

    async def all(self, name: str, *args: Any) -> list[Any]:
        return list(await asyncio.gather(*(self.one(i, name, *args) for i in range(self.k))))

    async def each(self, name: str, per_shard: list[tuple], only: list[int] | None = None) -> list[Any]:
        """Call shard i with ``per_shard[i]`` (``only``: just those shards, the others' places are
        None); every call finishes (an exception is returned in its place, not raised while others
        still run)."""
        idx = range(self.k) if only is None else only
        outs = await asyncio.gather(*(self.one(i, name, *per_shard[i]) for i in idx), return_exceptions=True)
        full: list[Any] = [None] * self.k
        for i, o in zip(idx, outs):
            full[i] = o
        return full

    def _rebuild_nodes(self, i: int) -> list[str]:
        """Where a rebuilt shard ``i`` may go, best first: a replica's node holding no other shard,
        then one holding others, then the driver's node, then its ring neighbours' nodes (its
        keeper's and the one whose copy it keeps: that node's loss would take both), and last the
        dead shard's own node (the cluster may still list it as alive for a while). A neighbour on
        the driver's node costs nothing: that node's loss ends the run anyway."""
        pool, here = _live_nodes()
        gone = self.nodes[i]
        near = {self.nodes[self.buddy(i)], self.nodes[(i - 1) % self.k]} - {here}
        held = {n for j, n in enumerate(self.nodes) if j != i}
        candidates = list(dict.fromkeys([*pool, here]))
        return sorted(candidates, key=lambda n: (n == gone, n in near, n == here, n in held, n))

    async def replace(self, i: int) -> dict[str, Any]:
        """Start a new shard ``i`` on a live node, restored from the copy its buddy keeps, and give
        it the copy of shard ``(i - 1) % K`` it is to keep. Returns ``{"versions", "node",
        "seconds"}``.

        Raises:
            ShardLost: the buddy (or the shard it keeps a copy of) is dead too.
            LookupError: no copy of shard ``i`` was kept."""
        t0 = time.monotonic()
        backup = await self.one(self.buddy(i), "held_backup", i)
        pool = self._rebuild_nodes(i)
        tried: list[str | None] = []
        while True:
            self.nodes[i] = next((n for n in pool if n not in tried), None)
            new = self._start(i)
            try:
                restored = await new.restore.remote(backup)
                prev = (i - 1) % self.k
                if prev != i:
                    await new.keep.remote(prev, await self.one(prev, "backup_all"))
                break
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError):
                # the new actor died or was never started: its node died before Ray listed it dead
                # (seen as "cancelled before it started running"); the next node, once each
                ray.kill(new)
                tried.append(self.nodes[i])
                if self.nodes[i] is None:
                    raise
            except BaseException:
                ray.kill(new)
                raise
        self.actors[i] = new
        self.gens[i] += 1
        return {**restored, "seconds": time.monotonic() - t0}
