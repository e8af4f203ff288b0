"""The outer-optimiser driver actor (runtime/driver/) on a real local Ray: rounds through the
object store, K outer-shard actors giving the bits of one, and a replica's link (runtime/link.py)
encoding on the training device sending the bits of the host path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import downlink_encode, outer_step, pending_rounds, pseudo_gradients, quantize_with_feedback

from ray_diloco.config import load_config
from ray_diloco.core.outer import OuterOptimizer
from ray_diloco.core.shards import shard_bounds
from ray_diloco.core.staging import DeviceStaging
from ray_diloco.core.sync import SyncBuffers
from ray_diloco.runtime.link import Link

SIZES = [1001, 70_000]


def _split(message_fn, delta, k):
    return [message_fn(delta[sl]) for sl in shard_bounds(delta.numel(), k)]


@pytest.mark.parametrize("fmt", ["none", "fp4_e3m0"])
def test_driver_completes_a_round_once_every_replica_sent(ray_session, fmt):
    """Two replicas' wire messages reach the driver actor through the object store; the round
    completes once both are in, both get the same reply, and the driver's global parameters
    equal a local OuterOptimizer's (the quantised downlink applied exactly as replicas do). With
    fp4 the driver starts without global parameters and gets them later, as the trainer does it
    (its process starts while the replicas start); they can be given only once."""
    from ray_diloco.config import load_config
    from ray_diloco.core.quantize import quantize_message
    from ray_diloco.core.wire import Downlink, apply_downlink, message_values
    from ray_diloco.runtime.driver import OuterDriverActor
    from ray_diloco.runtime.link import resolve_reply

    ray = ray_session
    cfg = load_config({"streaming": {"quantization": fmt}})
    theta0 = np.random.default_rng(5).standard_normal(1001).astype(np.float32)
    if fmt == "none":
        driver = OuterDriverActor.remote([theta0], cfg.to_dict())
    else:
        driver = OuterDriverActor.remote(None, cfg.to_dict())
        ray.get(driver.init_global.remote([theta0]))
    with pytest.raises(RuntimeError, match="global parameters are already set"):
        ray.get(driver.init_global.remote([theta0 + 1]))
    local, downlink = OuterOptimizer([theta0], cfg.outer), Downlink(fmt, False)
    held = torch.tensor(theta0)  # what a replica holds
    for k in (1, 2, 3):
        ds = pseudo_gradients(10 + k, 1001, 2)
        msgs = [[quantize_message(torch.from_numpy(d), fmt)[0]] for d in ds]  # one message per shard (K = 1)
        first = driver.exchange.remote(0, k, 0, 1.0, msgs[0], k - 1)
        ready, _ = ray.wait([first], timeout=0.5)
        assert not ready  # the round waits for the second replica
        replies = ray.get([first, driver.exchange.remote(0, k, 1, 1.0, msgs[1], k - 1)])
        assert replies[0] == replies[1] and replies[0].status == "ok" and replies[0].version == k
        (ref,) = replies[0].message  # one message per shard (K = 1): one object for every receiver
        assert isinstance(ref, ray.ObjectRef)
        reply = resolve_reply(replies[0])
        out = outer_step(local, 0, [1.0, 1.0], *[quantize_message(torch.from_numpy(d), fmt)[1].numpy() for d in ds])
        out["message"] = downlink_encode(downlink, local, 0, out["before"])
        fmt_got, values = message_values(reply.message[0])
        assert fmt_got.name == fmt and np.array_equal(values, message_values(out["message"])[1]) and not reply.resync
        assert reply.nbytes == len(out["message"])
        held = apply_downlink(held, reply.message[0])
        (glob,) = ray.get(driver.global_params.remote())
        assert np.array_equal(glob, local.fragments[0].param.numpy()) and np.array_equal(glob, held.numpy())
    assert ray.get(driver.state_hash.remote()) == local.state_hash()
    assert pending_rounds(driver) == 0  # no round left open
    late = ray.get(driver.exchange.remote(0, 3, 0, 1.0, msgs[0], 2))  # the newest completed round
    assert late.status == "ok" and late.version == 3  # its own reply again (replica 0 was in it)
    old = ray.get(driver.exchange.remote(0, 2, 0, 1.0, msgs[0], 1))  # forgotten (one kept per fragment)
    assert old.status == "dropped" and old.resync and old.version == 3
    stale = ray.get(driver.exchange.remote(0, 1, 0, 1.0, msgs[0], 2))  # a version not the round's base: resync
    assert stale.resync and stale.version == 3
    for bad in [(5, 9, 0, 1.0, msgs[0]),  # no such fragment
                (0, 9, 7, 1.0, msgs[0]),  # no such replica
                (0, 9, 0, 1.0, [b"junk"]),  # not a wire message
                (0, 9, 0, 1.0, msgs[0][0])]:  # not a list of one message per shard
        with pytest.raises(ray.exceptions.RayTaskError, match="ValueError"):
            ray.get(driver.exchange.remote(*bad))
    ray.kill(driver)


@pytest.mark.parametrize("fmt", ["fp4_e3m0"])  # fp32 (none): K = 2 against K = 1 in test_elastic's resume
def test_a_sharded_driver_gives_the_bits_of_one_driver(ray_session, fmt):
    """K = 1 and K = 3 drivers get the same pseudo-gradients (K = 3: one object per shard's slice,
    by reference, as a replica's link sends them; fp4 with error feedback on the downlink) for
    three rounds of two fragments: the replies decode to the same global fragments bit for bit,
    the drivers' global parameters, outer state hashes and (K = 1 layout) state dicts are
    equal; a stale receiver's resync, a checkpoint of the K = 3 driver restored into a K = 2
    one, and a message in the wrong number of parts and the globals' refs (a list of K slices per
    fragment) behave as they must."""
    from ray_diloco.config import load_config
    from ray_diloco.core.wire import decode_reply
    from ray_diloco.runtime.driver import OuterDriverActor
    from ray_diloco.runtime.link import fetch_global, resolve_reply

    ray = ray_session
    sizes = [1001, 70_000]
    rng = np.random.default_rng(1)
    theta = [rng.standard_normal(n).astype(np.float32) for n in sizes]

    def driver(k):
        cfg = load_config({"diloco": {"outer_shards": k}, "streaming": {"quantization": fmt, "error_feedback": True}})
        d = OuterDriverActor.remote(None, cfg.to_dict())
        ray.get(d.init_global.remote([ray.put(t) for t in theta]))
        return d

    one, three = driver(1), driver(3)

    def encode(x):
        if fmt == "none":
            return x.numpy().copy()
        return np.frombuffer(quantize_with_feedback(x, fmt, None)[0], np.uint8)

    def rounds(d, k, steps):
        held = [torch.tensor(t) for t in theta]
        for s in steps:
            for f, n in enumerate(sizes):
                ds = [torch.from_numpy(np.random.default_rng(100 * s + 10 * f + m).standard_normal(n).astype(np.float32))
                      for m in range(2)]
                msgs = [[ray.put(encode(x)) for x in (_split(lambda y: y, dd, k))] for dd in ds]
                replies = ray.get([d.exchange.remote(f, s, m, 1.0 + m, msgs[m], s // 5 - 1) for m in range(2)])
                assert replies[0] == replies[1] and replies[0].status == "ok"
                # decoded into a NaN-filled buffer (as SyncBuffers may hand out): every value is written
                held[f] = decode_reply(held[f], resolve_reply(replies[0]),
                                       alloc=lambda n: torch.full((n,), float("nan"))).clone()
        return held

    a, b = rounds(one, 1, (5, 10, 15)), rounds(three, 3, (5, 10, 15))
    for x, y, g in zip(a, b, ray.get(three.global_params.remote())):
        assert torch.equal(x, y) and np.array_equal(g, y.numpy())
    for d, k in ((one, 1), (three, 3)):  # a joiner's fetch: a list of K slices whatever K
        refs = ray.get(d.global_refs.remote())
        assert [len(r) for r in refs] == [k, k]
        assert all(np.array_equal(fetch_global(r), y.numpy()) for r, y in zip(refs, b))
    with pytest.raises(TypeError, match="a non-empty list of ObjectRefs, got ObjectRef"):
        fetch_global(refs[0][0])
    # a range read across the shards' slices (what the export reads, a parameter at a time)
    for lo, hi in [(5, 69_000), (0, 70_000), (23_400, 23_500), (7, 7)]:
        assert np.array_equal(ray.get(three.read_unit.remote(1, lo, hi)), b[1].numpy()[lo:hi])
    assert ray.get(one.state_hash.remote()) == ray.get(three.state_hash.remote())
    s1, s3 = ray.get(one.state_dict.remote()), ray.get(three.state_dict.remote())
    for f in range(2):
        assert np.array_equal(s1["global"][f], s3["global"][f])
        assert (s1["residuals"][f] is None) == (s3["residuals"][f] is None)
        if s1["residuals"][f] is not None:
            assert np.array_equal(s1["residuals"][f], s3["residuals"][f])
        assert torch.equal(s1["optimizers"][f]["state"][0]["momentum_buffer"],
                           s3["optimizers"][f]["state"][0]["momentum_buffer"])
    stale = ray.get(three.exchange.remote(0, 5, 0, 1.0, None, 0))  # forgotten round, old version: resync
    assert stale.resync and stale.version == 3 and isinstance(stale.message, list) and len(stale.message) == 3
    assert np.array_equal(decode_reply(torch.zeros(sizes[0]), resolve_reply(stale)).numpy(), s1["global"][0])
    two = driver(2)
    ray.get(two.load_state_dict.remote(s3))  # a checkpoint does not depend on K
    c, d = rounds(one, 1, (20,)), rounds(two, 2, (20,))
    assert all(torch.equal(x, y) for x, y in zip(c, d))
    assert ray.get(one.state_hash.remote()) == ray.get(two.state_hash.remote())
    assert all(np.array_equal(x, y) for x, y in zip(ray.get(one.global_params.remote()),
                                                    ray.get(two.global_params.remote())))
    with pytest.raises(ray.exceptions.RayTaskError, match="in 1 parts, expected diloco.outer_shards = 3"):
        ray.get(three.exchange.remote(0, 25, 0, 1.0, [ray.put(encode(torch.zeros(sizes[0])))], 4))
    with pytest.raises(ray.exceptions.RayTaskError, match=r"shard \d of fragment 0 has \d+ values, got 10"):
        ray.get(three.exchange.remote(0, 25, 1, 1.0, [ray.put(encode(torch.zeros(10)))] * 3, 4))
    for d in (one, two, three):
        ray.kill(d)


def _rounds(ray, cfg, mirror: bool):
    """Three rounds of two fragments for replicas 0 and 1 through their links; returns every
    new global value each replica received, the links' residuals and whether values were staged."""
    from ray_diloco.runtime.driver import OuterDriverActor

    rng = np.random.default_rng(0)
    theta = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    driver = OuterDriverActor.remote(None, cfg.to_dict())
    ray.get(driver.init_global.remote([ray.put(t) for t in theta]))
    s = cfg.streaming
    links = [Link(driver, m, 0, s.quantization, s.error_feedback, shards=cfg.diloco.outer_shards,
                  buffers=SyncBuffers(), staging=DeviceStaging("cpu", mirror=True) if mirror else None)
             for m in range(2)]
    held = [[torch.from_numpy(t.copy()) for t in theta] for _ in range(2)]
    received, staged = [], []
    for k, step in enumerate((5, 10, 15)):
        for f, n in enumerate(SIZES):
            futures = []
            for m, link in enumerate(links):
                d = torch.from_numpy(np.random.default_rng(100 * step + 10 * f + m).standard_normal(n).astype(np.float32))
                if mirror:  # a "device" tensor, handed off as FragmentSync does
                    futures.append(link.exchange(f, step, 1.0 + m, d, held[m][f], k, ready=link.staging.hand_off(d)))
                else:  # into a host buffer, as FragmentSync does without staging
                    futures.append(link.exchange(f, step, 1.0 + m, link.buffers.take(n).copy_(d), held[m][f], k))
            for m, fut in enumerate(futures):
                res = fut.result(timeout=60)
                assert res.status == "ok" and res.version == k + 1
                held[m][f] = res.new_global.clone()
                received.append(res.new_global.clone())
                staged.append(res.staged is not None and torch.equal(res.staged, res.new_global))
    residuals = [link.residual_state() for link in links]
    for link in links:
        link.close()
    ray.kill(driver)
    return received, residuals, staged


@pytest.mark.parametrize("fmt,shards", [("none", 1), ("int8", 2)])
def test_a_link_encoding_on_the_device_sends_the_bits_of_the_host(ray_session, fmt, shards):
    """With error feedback and K outer shards: the new global values and the residuals are bit for
    bit those of the host path, and every new global value came back staged on the device."""
    cfg = load_config({"diloco": {"outer_shards": shards}, "streaming": {"quantization": fmt, "error_feedback": True}})
    host, host_res, host_staged = _rounds(ray_session, cfg, mirror=False)
    dev, dev_res, dev_staged = _rounds(ray_session, cfg, mirror=True)
    assert len(host) == len(dev) == 12
    assert all(torch.equal(a, b) for a, b in zip(host, dev))
    assert not any(host_staged) and all(dev_staged)
    for a, b in zip(host_res, dev_res):
        assert a.keys() == b.keys() and all(np.array_equal(a[f], b[f]) for f in a)
    assert fmt == "none" or all(len(r) == 2 for r in dev_res)  # quantised: a residual per fragment


def test_a_lost_outer_shard_is_rebuilt_with_the_same_bits(ray_session):
    """K = 2 outer shards, fp4 with error feedback on the downlink (residuals, momentum and versions
    are in the copies, diloco.outer_shard_backup): four rounds of two fragments with a shard's
    process SIGKILLed (what its node's loss looks like to the driver) at three points: between
    rounds, in an open round (one replica's pseudo-gradient checked by the dead shard, the other's
    not yet sent: checked again on the rebuilt one), and after a round closed but before the
    replicas fetched its reply (its owner died: on one node its bytes may stay readable, else the
    replicas resync). Every new global value, the final globals, the outer state and its hash equal
    those of the same rounds computed in this process (one driver's bits) bit for bit; each kill
    shows as a ``shard_recovered`` event. With the copies off, a shard's death makes every ping
    raise (the run stops)."""
    import os
    import signal

    from helpers import alive, wait_for

    from ray_diloco.core.quantize import quantize_message
    from ray_diloco.core.wire import Downlink, apply_downlink, decode_reply
    from ray_diloco.runtime.driver import OuterDriverActor
    from ray_diloco.runtime.link import fetch_reply

    ray = ray_session
    fmt, sizes = "fp4_e3m0", [1001, 70_000]
    rng = np.random.default_rng(3)
    theta = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    cfg = load_config({"diloco": {"outer_shards": 2}, "streaming": {"quantization": fmt, "error_feedback": True}})

    def message(s, f, m):
        d = torch.from_numpy(np.random.default_rng(100 * s + 10 * f + m).standard_normal(sizes[f]).astype(np.float32))
        return [ray.put(np.frombuffer(quantize_with_feedback(x, fmt, None)[0], np.uint8)) for x in _split(lambda y: y, d, 2)]

    def kill_shard(d, k):
        pid = ray.get(d.outer_pids.remote())[1 + k]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not alive(pid), 10, f"shard {k} (pid {pid}) to die")
        return pid

    def run():
        d = OuterDriverActor.remote(None, cfg.to_dict())
        ray.get(d.init_global.remote([ray.put(t) for t in theta]))
        held = [[torch.tensor(t) for t in theta] for _ in range(2)]
        received, killed = [], []
        for k, s in enumerate((5, 10, 15, 20)):
            if s == 10:
                killed.append(kill_shard(d, 0))  # between rounds: the next check finds it dead
            for f in range(2):
                first = d.exchange.remote(f, s, 0, 1.0, message(s, f, 0), k)
                if s == 10 and f == 1:  # replica 0's slices are held by the shards: kill one
                    wait_for(lambda: pending_rounds(d) == 1, 30, "the round to open")
                    killed.append(kill_shard(d, 1))
                replies = ray.get([first, d.exchange.remote(f, s, 1, 2.0, message(s, f, 1), k)])
                assert [r.status for r in replies] == ["ok", "ok"] and replies[0].version == k + 1
                if s == 15 and f == 1:  # the reply's owner dies
                    killed.append(kill_shard(d, 0))
                for m in range(2):
                    reply = fetch_reply(d, replies[m], f, s, m)
                    held[m][f] = decode_reply(held[m][f], reply).clone()
                    received.append(held[m][f])
        events = [e for e in ray.get(d.take_events.remote()) if e["event"] == "shard_recovered"]
        out = received, ray.get(d.global_params.remote()), ray.get(d.state_hash.remote()), ray.get(d.state_dict.remote())
        pids = ray.get(d.outer_pids.remote())
        ray.kill(d)
        return out, events, killed, pids

    off_cfg = load_config({"diloco": {"outer_shards": 2, "outer_shard_backup": False}})
    off = OuterDriverActor.remote(list(theta), off_cfg.to_dict())
    ray.get(off.ping.remote())
    kill_shard(off, 1)
    with pytest.raises(ray.exceptions.RayTaskError, match="shard 1 died .*outer_shard_backup is off"):
        ray.get(off.ping.remote())  # the run stops (Membership and the watchdog turn it into one line)
    ray.kill(off)
    def oracle():  # the same rounds written out in this process (one driver's bits: the tests above)
        local, downlink = OuterOptimizer([t.copy() for t in theta], cfg.outer), Downlink(fmt, True)
        held, received = [[torch.tensor(t) for t in theta] for _ in range(2)], []
        for s in (5, 10, 15, 20):
            for f in range(2):
                ds = [quantize_message(torch.from_numpy(np.random.default_rng(100 * s + 10 * f + m).standard_normal(
                    sizes[f]).astype(np.float32)), fmt)[1].numpy() for m in range(2)]
                out = outer_step(local, f, [1.0, 2.0], *ds)
                msg = downlink_encode(downlink, local, f, out["before"])
                for m in range(2):
                    held[m][f] = apply_downlink(held[m][f], msg)
                    received.append(held[m][f])
        state = {"residuals": [f.residual.numpy() for f in local.fragments],
                 "optimizers": [{"state": {0: f.opt.state[f.param]}} for f in local.fragments]}
        return received, local.global_params(), local.state_hash(), state

    (a, ga, ha, sa) = oracle()
    (b, gb, hb, sb), events, killed, pids = run()
    assert [e["shard"] for e in events] == [0, 1, 0], events
    assert not set(killed) & set(pids)  # the shards now serving are new processes
    assert len(a) == len(b) == 16 and all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(np.array_equal(x, y) for x, y in zip(ga, gb)) and ha == hb
    for f in range(2):
        assert np.array_equal(sa["residuals"][f], sb["residuals"][f])
        assert torch.equal(sa["optimizers"][f]["state"][0]["momentum_buffer"],
                           sb["optimizers"][f]["state"][0]["momentum_buffer"])
    assert sb["versions"] == [4, 4]


def test_a_shard_rebuilt_on_a_node_that_is_gone_is_started_on_the_next(ray_session, monkeypatch):
    """A node can die after Ray last listed it alive: the rebuilt shard's actor, pinned to it, is
    never started (seen on a 3-node cluster as "cancelled before it started running"). The
    rebuild starts it on the next live node instead, restored with the same bits."""
    import asyncio

    from ray_diloco.runtime import outer_shards
    from ray_diloco.runtime.outer_shards import ShardGroup

    ray = ray_session
    cfg = load_config({"diloco": {"outer_shards": 2}}).to_dict()
    theta = [np.arange(1001, dtype=np.float32), np.ones(5000, np.float32)]

    async def scenario():
        group = ShardGroup(cfg, 2)
        await group.all("init_global", [ray.put(t) for t in theta])
        for i in range(2):  # each shard keeps its buddy's copy, as the driver seeds them
            await group.one(group.buddy(i), "keep", i, await group.one(i, "backup_all"))
        before = await group.all("state_hash")
        ray.kill(group.actors[0])
        gone = "ab" * 28  # a node id Ray no longer has
        here = ray.get_runtime_context().get_node_id()
        monkeypatch.setattr(outer_shards, "_live_nodes", lambda: ([gone, here], here))
        info = await group.replace(0)
        after = await group.all("state_hash")
        return group, before, info, after

    group, before, info, after = asyncio.run(scenario())
    assert info["node"] == ray.get_runtime_context().get_node_id() and group.nodes[0] != "ab" * 28
    assert after == before and group.gens == [1, 0]
    for a in group.actors:
        ray.kill(a)


def test_two_shards_lost_together_that_do_not_keep_each_others_copy_are_both_rebuilt(ray_session):
    """K = 4: shards 1 and 3 (on one node, as placement puts them on 3 nodes) die together. Their
    keepers (2 and 0) live, so both are rebuilt and the rounds go on with the bits of a driver that
    lost nothing. (They were rebuilt one by one, and the first one's copies sent to every shard
    found the second still dead: the run stopped as if a keeper had died; a break-it run.)"""
    import os
    import signal

    from helpers import alive, wait_for

    from ray_diloco.runtime.driver import OuterDriverActor

    ray = ray_session
    cfg = load_config({"diloco": {"outer_shards": 4}})
    theta = [np.random.default_rng(9).standard_normal(n).astype(np.float32) for n in SIZES]

    def rounds(kill: bool):
        d = OuterDriverActor.remote([t.copy() for t in theta], cfg.to_dict())
        for k, s in enumerate((5, 10, 15)):
            if kill and s == 10:
                pids = ray.get(d.outer_pids.remote())
                for shard in (1, 3):
                    os.kill(pids[1 + shard], signal.SIGKILL)
                wait_for(lambda p=pids: not alive(p[2]) and not alive(p[4]), 10, "shards 1 and 3 to die")
            for f, n in enumerate(SIZES):
                ds = [torch.from_numpy(d_) for d_ in pseudo_gradients(100 * s + f, n, 2)]
                replies = ray.get([d.exchange.remote(f, s, m, 1.0, _split(lambda y: y.numpy(), ds[m], 4), k)
                                   for m in range(2)])  # fmt: skip
                assert [r.status for r in replies] == ["ok", "ok"], replies
        events = [e for e in ray.get(d.take_events.remote()) if e["event"] == "shard_recovered"]
        out = ray.get(d.global_params.remote()), ray.get(d.state_hash.remote()), events
        ray.kill(d)
        return out

    g0, h0, _ = rounds(kill=False)
    g1, h1, events = rounds(kill=True)
    assert sorted(e["shard"] for e in events) == [1, 3], events
    assert h1 == h0 and all(np.array_equal(a, b) for a, b in zip(g0, g1))
