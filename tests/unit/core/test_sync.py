"""The replica's fragment-sync state machine (``core.sync.FragmentSync``) without Ray.

An in-process transport stands in for ``runtime/link.py``: each replica's exchanges run on its
own one-thread pool (futures resolve in the background, like the link), and a tiny in-memory
driver averages the replicas' pseudo-gradients with ``core.outer.OuterOptimizer`` and encodes
the reply with ``core.wire`` exactly as ``runtime/driver/`` does. The replicas' "inner steps"
add seeded noise, so an independent replay of the algorithm (Streaming DiLoCo, arXiv
2501.18512, section 2) can be compared with them bit for bit.
"""

from __future__ import annotations

import pickle
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from helpers import downlink_encode, outer_step, quantize_with_feedback

from ray_diloco.config import OuterConfig
from ray_diloco.core.formats import parse as from_message
from ray_diloco.core.fragments import ParamSpec, flatten, plan_fragments
from ray_diloco.core.outer import OuterOptimizer
from ray_diloco.core.quantize import decode, quantize_message
from ray_diloco.core.rounds import RoundBook
from ray_diloco.core.schedules import SyncSchedule
from ray_diloco.core.staging import DeviceStaging
from ray_diloco.core.sync import FragmentSync
from ray_diloco.core.wire import OK, Downlink, Reply, SyncResult, decode_reply

SHAPES = {"embed.weight": (7, 3), "blocks.0.w": (5,), "blocks.0.b": (4,), "blocks.1.w": (6,), "blocks.1.b": (2,),
          "blocks.2.w": (3, 2), "blocks.3.w": (5,), "head.weight": (3,)}
SPECS = [ParamSpec(n, s) for n, s in SHAPES.items()]
FRAGMENTS = plan_fragments(SPECS, 2)  # embeddings | blocks 0, 2 | blocks 1, 3 | head
BATCH, SEQ, WORLD = 2, 4, 1
TOKENS = BATCH * SEQ * WORLD  # a pseudo-gradient's weight per inner step
OUTER = OuterConfig(name="nesterov", lr=0.7, momentum=0.9)


def _initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _noise(replica: int, t: int) -> dict[str, torch.Tensor]:
    """The replica's "inner step" t: seeded, the same in the run and in the replay."""
    g = torch.Generator().manual_seed(1000 * (replica + 1) + t)
    return {n: 0.1 * torch.randn(s, generator=g) for n, s in SHAPES.items()}


class MemoryDriver:
    """The outer optimiser in process, synchronous: the round rules of ``core.rounds.RoundBook``
    (what ``runtime/driver/`` runs), the outer step of ``core.outer.OuterOptimizer`` and the
    downlink of ``core.wire``; a round completes when every replica has sent.

    ``fail``: rounds ``(fragment, step)`` that fail (as without a quorum). A replica that sends
    no message (a non-finite pseudo-gradient) is rejected.
    """

    def __init__(self, initial: list[torch.Tensor], replicas: int, fmt: str = "none", fail=()):
        self.opt = OuterOptimizer([g.numpy() for g in initial], OUTER)
        self.fmt, self.fail = fmt, set(fail)
        self.downlink = Downlink(fmt, False)
        self.book = RoundBook({m: 0 for m in range(replicas)}, quorum=1, timeout_s=10.0, keep_finished=1000)
        self.book.set_fragments(len(initial))
        self.lock = threading.Lock()
        self.done: dict[tuple[int, int], threading.Event] = {}
        self.deltas: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
        self.weights: dict[tuple[int, int], dict[int, float]] = {}

    @property
    def versions(self) -> list[int]:
        return self.book.versions

    def exchange(self, fragment: int, step: int, replica: int, weight: float, message: bytes | None,
                 version: int, average_only: bool) -> Reply:
        key = (fragment, step)
        with self.lock:
            assert version == self.book.versions[fragment]  # no resync in these tests
            done = self.done.setdefault(key, threading.Event())
            self.weights.setdefault(key, {})[replica] = weight
            if message is not None:
                self.deltas.setdefault(key, {})[replica] = decode(from_message(message))
            if self.book.arrive(fragment, step, replica, weight, None if message is None else 0.0,
                                average_only=average_only):
                self._finish(fragment, step)
        assert done.wait(10), f"round {key} never completed"
        with self.lock:
            a = self.book.answer(fragment, step, replica, version)
        return Reply(a.status, a.version, a.message)

    def _finish(self, fragment: int, step: int) -> None:
        key = (fragment, step)
        terms = None if key in self.fail else self.book.terms(fragment, step)
        deltas = self.deltas.pop(key, {})
        if terms is None:
            out = self.book.failed(fragment, step)
        else:
            res = outer_step(self.opt, fragment, [w for _, w in terms], *[deltas[m] for m, _ in terms],
                             average_only=self.book.rounds[key].average_only)
            message = downlink_encode(self.downlink, self.opt, fragment, res["before"])
            out = self.book.stepped(fragment, step, self.book.versions[fragment] + 1, [message], 0, 0.0)
        self.book.finish(fragment, step, out)
        self.done[key].set()

    def state_dict(self) -> dict[str, Any]:
        return {**self.opt.state_dict(), "versions": list(self.versions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state)
        self.book.restore(state["versions"], [0] * len(state["versions"]), [])


class MemoryTransport:
    """``core.sync.Transport`` over a :class:`MemoryDriver` (rank 0 of a replica), with the
    link's error feedback: a residual kept per fragment, restored when the round did not use it,
    and its device staging (waits for the pseudo-gradient's copy, stages the new global value)."""

    def __init__(self, driver: MemoryDriver, replica: int, fmt: str = "none", error_feedback: bool = False,
                 staging: DeviceStaging | None = None):
        self.driver, self.replica, self.fmt, self.error_feedback = driver, replica, fmt, error_feedback
        self.staging = staging
        self.residuals: dict[int, torch.Tensor] = {}
        self.exchanges = 0
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.buffers = None  # FragmentSync.buffers, used as runtime/link.py's Link uses them
        self.reads_lazily = False  # a materialised pseudo-gradient (core.wire.Uplink reads lazily)

    def exchange(self, fragment, step, weight, delta, old_global, version=0, average_only=False, ready=None) -> Future:
        return self.pool.submit(self._run, fragment, step, weight, delta, old_global, version, average_only, ready)

    def _run(self, fragment, step, weight, delta, old_global, version, average_only, ready) -> SyncResult:
        if ready is not None:
            ready()
        before, message = self.residuals.get(fragment), None
        if bool(torch.isfinite(delta).all()):
            message, residual = quantize_with_feedback(delta, self.fmt, before)
            if self.error_feedback:
                self.residuals[fragment] = residual
        if self.buffers is not None:
            self.buffers.give(delta)  # sent: the next pseudo-gradient may be computed into it
        reply = self.driver.exchange(fragment, step, self.replica, weight, message, version, average_only)
        if reply.status != OK and self.error_feedback:
            self.residuals.pop(fragment, None) if before is None else self.residuals.__setitem__(fragment, before)
        self.exchanges += 1
        alloc = None if self.buffers is None else self.buffers.take
        new = decode_reply(old_global, reply, alloc=alloc)
        staged = self.staging.to_device(new) if self.staging is not None and new is not old_global else None
        return SyncResult(new, len(message or b""), reply.nbytes, reply.status, reply.version, staged)

    def residual_state(self) -> dict[int, np.ndarray]:
        return {f: r.numpy().copy() for f, r in self.residuals.items()}

    def load_residual_state(self, residuals: dict[int, Any]) -> None:
        self.residuals = {int(f): torch.from_numpy(np.array(r, dtype=np.float32)) for f, r in residuals.items()}

    def take_stats(self) -> dict[str, Any]:
        out, self.exchanges = {"exchanges": self.exchanges}, 0
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Replica:
    """Parameters, a ``FragmentSync`` and the seeded inner steps of one replica."""

    def __init__(self, m: int, driver: MemoryDriver, schedule: SyncSchedule, alpha: float, fmt: str = "none",
                 error_feedback: bool = False, mirror: bool = False):
        self.m = m
        self.params = _initial()
        self.resets = 0
        # mirror: the device-globals path (core.staging) with CPU "device" copies
        staging = DeviceStaging("cpu", mirror=True) if mirror else None
        self.sync = FragmentSync(self.params, FRAGMENTS, alpha=alpha, batch=BATCH, seq_len=SEQ, world_size=WORLD,
                                 on_reset=self._on_reset)
        self.transport = MemoryTransport(driver, m, fmt, error_feedback, staging)
        self.transport.buffers = self.sync.buffers
        self.sync.attach(schedule, self.transport, staging)  # as the worker: attached, then the globals loaded
        for f, g in enumerate(driver.opt.global_params()):
            self.sync.load_global(f, g, driver.versions[f])

    def _on_reset(self) -> None:
        self.resets += 1

    def inner(self, t: int) -> None:
        for n, d in _noise(self.m, t).items():
            self.params[n].add_(d)

    def local(self, f: int) -> torch.Tensor:
        return flatten(self.params, FRAGMENTS[f])


def _lockstep(replicas: list[Replica], start: int, end: int) -> None:
    """Inner steps ``start+1 .. end`` of every replica, each followed by its syncs, run side by
    side (at T a closing round merges at its send step: a replica waits for the others' sends)."""
    with ThreadPoolExecutor(max_workers=len(replicas)) as pool:
        for t in range(start + 1, end + 1):
            for r in replicas:
                r.inner(t)
            for fut in [pool.submit(r.sync.step, t) for r in replicas]:
                fut.result()


def _setup(tau: int, T: int, alpha: float, fmt: str = "none", fail=(), error_feedback=False, M=2, H=12,
           mirror=False, closing="average"):
    schedule = SyncSchedule(H=H, num_fragments=len(FRAGMENTS), overlap=tau, total_steps=T, closing=closing)
    driver = MemoryDriver([flatten(_initial(), f) for f in FRAGMENTS], M, fmt, fail)
    return schedule, driver, [Replica(m, driver, schedule, alpha, fmt, error_feedback, mirror) for m in range(M)]


def _device_copies_current(r: Replica) -> bool:
    """With device globals: each fragment's device copy is its own storage and equals the host global."""
    return all(d is not None and d.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()
               and torch.equal(d, g) for d, g in ((h.device, h.global_) for h in r.sync.held))


def _replay(schedule: SyncSchedule, alpha: float, fmt: str, M: int = 2):
    """The algorithm written out directly (one OuterOptimizer and its ``wire.Downlink``): the
    fragment's outer step on the mean pseudo-gradient at the send, the merge
    ``alpha * local + (1 - alpha) * new_global`` tau steps later."""
    locals_ = [_initial() for _ in range(M)]
    glob = [flatten(_initial(), f) for f in FRAGMENTS]
    opt, downlink = OuterOptimizer([g.numpy() for g in glob], OUTER), Downlink(fmt, False)
    last, due = [0] * len(FRAGMENTS), []
    for t in range(1, schedule.total_steps + 1):
        for m in range(M):
            for n, d in _noise(m, t).items():
                locals_[m][n].add_(d)
        for f in schedule.sends_at(t):
            deltas = [quantize_message(glob[f] - flatten(locals_[m], FRAGMENTS[f]), fmt)[1].numpy() for m in range(M)]
            w = float((t - last[f]) * TOKENS)
            last[f] = t
            downlink_encode(downlink, opt, f, outer_step(opt, f, [w] * M, *deltas, average_only=schedule.averages(f, t))["before"])
            due.append((schedule.apply_step(t), f, opt.fragments[f].param.clone()))
        for a, f, new in [d for d in due if d[0] <= t]:
            due.remove((a, f, new))
            glob[f] = new
            for m in range(M):
                local = flatten(locals_[m], FRAGMENTS[f])
                merged = new if alpha == 0 else alpha * local + (1 - alpha) * new
                _unflatten(locals_[m], f, merged)
    return glob, locals_, opt


def _unflatten(params: dict[str, torch.Tensor], f: int, flat: torch.Tensor) -> None:
    off = 0
    for p in FRAGMENTS[f].params:
        params[p.name].copy_(flat[off: off + p.numel].view(p.shape))
        off += p.numel


@pytest.mark.parametrize("fmt,mirror,closing", [("none", False, "average"), ("fp4_e3m0", False, "average"),
                                                ("none", True, "outer"), ("fp4_e3m0", True, "average")])
@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_two_replicas_end_with_identical_globals_equal_to_the_outer_optimizer(fmt, alpha, mirror, closing):
    """Streaming fragments (4, strided), tau 2, a closing round at T=64 (the replicas' mean, or
    with ``closing_round: outer`` an outer step like the others): both replicas hold
    bitwise-identical global fragments, equal to the driver's and to a direct replay with
    ``OuterOptimizer``; the local parameters follow the replay too. ``mirror``: the same with
    device globals (``core.staging``: pseudo-gradients and merges computed on the device copies)."""
    schedule, driver, reps = _setup(tau=2, T=64, alpha=alpha, fmt=fmt, mirror=mirror, closing=closing)
    _lockstep(reps, 0, 36)
    [r.sync.settle() for r in reps]  # every round sent so far answered (merges stay at their step)
    made, rounds = [r.sync.buffers.allocated for r in reps], sum(driver.versions)
    _lockstep(reps, 36, 60)  # every fragment syncs twice more; the closing round at 64 needs more at once
    [r.sync.settle() for r in reps]
    steady = sum(driver.versions) - rounds, [r.sync.buffers.allocated for r in reps]
    _lockstep(reps, 60, 64)
    assert all(r.sync.settle() == 0 for r in reps)
    glob, locals_, opt = _replay(schedule, alpha, fmt)
    for f in range(len(FRAGMENTS)):
        a, b = (r.sync.global_fragment(f) for r in reps)
        assert np.array_equal(a, b) and np.array_equal(a, driver.opt.fragments[f].param.numpy())
        assert np.array_equal(a, glob[f].numpy()) and np.array_equal(a, opt.fragments[f].param.numpy())
        assert reps[0].sync.held[f].version == driver.versions[f] >= 64 // 12
    for r, ref in zip(reps, locals_):
        assert all(torch.equal(r.params[n], ref[n]) for n in SHAPES)
    assert reps[0].sync.global_hash() == reps[1].sync.global_hash()
    assert reps[0].sync.comm.events == sum(driver.versions)  # one merge per round, counted at the merge
    # once every fragment has synced, pseudo-gradients and decoded globals reuse buffers
    # (SyncBuffers) instead of two new ones per round; the results above are still the replay's
    assert steady == (2 * len(FRAGMENTS), made)
    assert all(_device_copies_current(r) for r in reps) if mirror else all(h.device is None for h in reps[0].sync.held)


def test_sync_buffers_reuse_only_their_own_tensors_and_keep_a_bounded_number():
    from ray_diloco.core.sync import SyncBuffers

    b = SyncBuffers()
    x = b.take(5)
    b.give(x)
    assert b.take(5) is x and b.allocated == 1
    b.give(torch.empty(5))  # not handed out by it: ignored
    y = b.take(3)
    assert y is not x and b.allocated == 2
    b.give(x), b.give(x)  # the same tensor twice is kept once
    assert b.free_bytes == 20
    assert b.take(2) is not x and b.allocated == 3  # x is more than 25% larger: not used
    v = b.take(4)  # served by the smallest free buffer that holds it: a view of x's start
    assert v._base is x and v.numel() == 4 and b.free_bytes == 0
    b.give(x[1:])  # a slice further in (a joined shard's part of a live global) is not given back
    assert b.free_bytes == 0
    b.give(v), b.give(y)  # the view gives x back whole
    assert b.free_bytes == 4 * 8 and b.take(5) is x
    c = SyncBuffers()
    big, six, four, three = c.take(10), c.take(6), c.take(4), c.take(3)
    for t in (big, six, four):
        c.give(t)
    assert c.free_bytes == 4 * 20  # twice the largest size (10) asked for
    c.give(three)  # over the bound: the oldest given back (the 10) goes
    assert c.free_bytes == 4 * 13 and c.take(6) is six and c.take(10) is not big and c.allocated == 5


def test_a_merge_happens_exactly_at_send_plus_tau():
    """tau 3: the round's answer is ready before, yet the new global value (alpha 0: the local
    parameters become it) is merged at send + tau, not one step earlier."""
    tau = 3
    schedule, driver, reps = _setup(tau=tau, T=30, alpha=0.0, H=16)
    f, s = 1, schedule.offset(1) + 16  # fragment 1's second send
    _lockstep(reps, 0, s)
    assert [e.apply_step for e in reps[0].sync.pending if e.fragment == f] == [s + tau]
    reps[0].sync.settle()  # every answer is in
    v0 = reps[0].sync.held[f].version
    for t in range(s + 1, s + tau):
        _lockstep(reps, t - 1, t)
        for r in reps:
            assert r.sync.held[f].version == v0 and not torch.equal(r.local(f), driver.opt.fragments[f].param)
    _lockstep(reps, s + tau - 1, s + tau)
    for r in reps:
        assert r.sync.held[f].version == v0 + 1
        new = driver.opt.fragments[f].param
        assert torch.equal(r.local(f), new) and torch.equal(r.sync.held[f].global_, new)


@pytest.mark.parametrize("alpha", [0.25, 1.0])
def test_alpha_blends_the_local_and_the_new_global_parameters(alpha):
    """At the merge: ``local <- alpha * local + (1 - alpha) * new_global``, bit for bit (alpha 1
    keeps the local parameters and only adopts the new global value)."""
    schedule, driver, reps = _setup(tau=1, T=30, alpha=alpha, H=8)
    s = schedule.offset(2) + 8
    _lockstep(reps, 0, s)
    for r in reps:
        r.inner(s + 1)
    before = [r.local(2) for r in reps]
    for r in reps:
        r.sync.step(s + 1)
    new = driver.opt.fragments[2].param
    for r, b in zip(reps, before):
        assert torch.equal(r.sync.held[2].global_, new)
        assert torch.equal(r.local(2), b if alpha == 1 else alpha * b + (1 - alpha) * new)
    assert not torch.equal(before[0], before[1])  # the replicas did differ


@pytest.mark.parametrize("mirror", [False, True])
def test_a_failed_round_keeps_the_local_parameters_and_the_previous_send_step(mirror):
    """No quorum for fragment 0's second round: global value and version unchanged, local
    parameters untouched, and the fragment's next pseudo-gradient is weighted by the tokens of
    both intervals (its last send step went back to the first send). Also with device globals."""
    H, tau = 8, 1
    first, second, third = H, 2 * H, 3 * H  # fragment 0 has offset 0
    schedule, driver, reps = _setup(tau=tau, T=40, alpha=0.5, H=H, fail=[(0, second)], mirror=mirror)
    _lockstep(reps, 0, second + tau - 1)
    g0, v0 = reps[0].sync.held[0].global_.clone(), reps[0].sync.held[0].version
    assert [r.sync.held[0].last_send for r in reps] == [second, second]
    for r in reps:
        r.inner(second + tau)
    before = [r.local(0) for r in reps]
    for r in reps:
        r.sync.step(second + tau)
    for r, b in zip(reps, before):
        assert torch.equal(r.local(0), b) and torch.equal(r.sync.held[0].global_, g0)
        assert r.sync.held[0].version == v0 and r.sync.held[0].last_send == first
    _lockstep(reps, second + tau, third)
    for r in reps:
        r.sync.settle()  # the round sent at `third` has reached the driver
    assert driver.weights[(0, second)] == {0: float(H * TOKENS), 1: float(H * TOKENS)}
    assert driver.weights[(0, third)] == {0: float(2 * H * TOKENS), 1: float(2 * H * TOKENS)}
    assert not mirror or all(_device_copies_current(r) for r in reps)


@pytest.mark.parametrize("mirror", [False, True])
def test_a_rejected_round_resets_the_replica_to_the_global_parameters(mirror):
    """Replica 1's pseudo-gradient of fragment 3 is not finite: it abstains, the driver steps on
    replica 0's alone and rejects 1, which at the merge resets every fragment to the global
    values (and its inner optimiser, ``on_reset``); replica 0 merges as usual. Also with device
    globals (the reset reads the device copies)."""
    schedule, driver, reps = _setup(tau=1, T=30, alpha=0.5, H=8, mirror=mirror)
    s = schedule.offset(3) + 8
    _lockstep(reps, 0, s - 1)
    for r in reps:
        r.inner(s)
    reps[1].params["head.weight"][1] = float("nan")
    for r in reps:
        r.sync.step(s)
    _lockstep(reps, s, s + 1)
    assert reps[1].resets == 1 and reps[0].resets == 0
    for f in range(len(FRAGMENTS)):
        assert torch.equal(reps[1].local(f), reps[1].sync.held[f].global_)
    assert torch.equal(reps[1].sync.held[3].global_, driver.opt.fragments[3].param)
    assert torch.isfinite(reps[1].local(3)).all() and not torch.equal(reps[0].local(3), driver.opt.fragments[3].param)
    _lockstep(reps, s + 1, 30)  # and the run goes on
    assert all(torch.equal(reps[0].sync.held[f].global_, reps[1].sync.held[f].global_) for f in range(len(FRAGMENTS)))
    assert not mirror or all(_device_copies_current(r) for r in reps)


def test_state_dict_round_trip_continues_bitwise_identically():
    """fp4 with error feedback, checkpointed while syncs are in flight: the state keeps the
    checkpoint format (last_send, pending rows of 8 columns, comm, residuals), and a fresh
    replica restored from it, with the driver's global fragments, finishes the run bitwise
    like the uninterrupted one. A row of an older checkpoint (5 columns) still loads."""
    T = 40
    schedule, driver, reps = _setup(tau=2, T=T, alpha=0.5, fmt="fp4_e3m0", error_feedback=True)
    k = schedule.offset(1) + 12  # a send step: that round is in flight at the checkpoint
    _lockstep(reps, 0, k)
    for r in reps:
        r.sync.settle()
    states = [pickle.loads(pickle.dumps(r.sync.state_dict())) for r in reps]
    assert set(states[0]) == {"last_send", "pending", "comm", "residuals"}
    row = states[0]["pending"][0]
    assert row[:3] == [1, k, k + 2] and row[5:] == [OK, driver.versions[1], k - 12] and len(row) == 8
    assert set(states[0]["residuals"]) == set(range(len(FRAGMENTS)))
    assert set(states[0]["comm"]) == {"bytes_up", "bytes_down", "events", "peak_event_bytes"}
    saved = {"driver": pickle.loads(pickle.dumps(driver.state_dict())),
             "locals": [[r.local(f).numpy().copy() for f in range(len(FRAGMENTS))] for r in reps]}
    _lockstep(reps, k, T)  # the uninterrupted run

    driver2 = MemoryDriver([flatten(_initial(), f) for f in FRAGMENTS], 2, "fp4_e3m0")
    driver2.load_state_dict(saved["driver"])
    reps2 = []
    for m, state in enumerate(states):
        r = Replica(m, driver2, schedule, 0.5, "fp4_e3m0", error_feedback=True)  # load_global from the driver
        for f, local in enumerate(saved["locals"][m]):
            _unflatten(r.params, f, torch.from_numpy(local))
        r.sync.load_state_dict(state)
        again = r.sync.state_dict()
        res, res0 = again.pop("residuals"), state["residuals"]
        assert again == {k: v for k, v in state.items() if k != "residuals"}
        assert res.keys() == res0.keys() and all(np.array_equal(res[f], v) for f, v in res0.items())
        reps2.append(r)
    _lockstep(reps2, k, T)
    for a, b in zip(reps, reps2):
        assert all(torch.equal(a.params[n], b.params[n]) for n in SHAPES)
        assert a.sync.global_hash() == b.sync.global_hash() and [h.version for h in a.sync.held] == [h.version for h in b.sync.held]
        assert [h.last_send for h in a.sync.held] == [h.last_send for h in b.sync.held] and a.transport.residual_state().keys() == \
            b.transport.residual_state().keys()
    assert driver.opt.state_hash() == driver2.opt.state_hash()

    old = FragmentSync(_initial(), FRAGMENTS, alpha=0.5, batch=BATCH, seq_len=SEQ, world_size=WORLD)
    for f, g in enumerate(driver.opt.global_params()):
        old.load_global(f, g, driver.versions[f])
    old.load_state_dict({"last_send": [k] * 4, "pending": [row[:5]]})
    (e,) = old.pending
    assert (e.fragment, e.send_step, e.apply_step, e.prev_send) == (1, k, k + 2, 0)
    assert e.outcome().status == OK and e.outcome().version == driver.versions[1]
    assert old.state_dict() == {"last_send": [k] * 4, "pending": [[*row[:5], OK, driver.versions[1], 0]],
                                "comm": {"bytes_up": 0, "bytes_down": 0, "events": 0, "peak_event_bytes": 0}}
