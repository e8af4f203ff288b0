"""The outer-optimiser shard (runtime/outer_shards.py's OuterShard) without Ray: its maths runs off the
actor's event loop, so the driver answers pings, joins and other replicas' messages while it
decodes pseudo-gradients and steps a large fragment (the same property on a real actor, counted:
integration/test_elastic.py::test_the_driver_answers_pings_and_joins_while_it_steps_a_large_fragment)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import torch

from ray_diloco.config import load_config
from ray_diloco.core.quantize import quantize_message
from ray_diloco.runtime import outer_shards as D


def test_decoding_and_the_outer_step_run_off_the_event_loop(monkeypatch):
    shard = D.OuterShard(load_config({"diloco": {"replicas": 2}, "inner": {"global_batch": 4}}).to_dict())
    shard.set_global([np.zeros(10, np.float32)])
    ran: dict[str, threading.Thread] = {}

    def decode(message):  # stands in for the decode and finiteness check of a pseudo-gradient
        ran["decode"] = threading.current_thread()
        return np.ones(10, np.float32), 1.0

    def step(fragment, mean, average_only):  # stands in for step_ordered and the reply's encoding
        ran["step"] = threading.current_thread()
        return None, 0, 0.0, 1

    monkeypatch.setattr(D, "_decode_and_check", decode)
    monkeypatch.setattr(shard, "_step", step)

    async def round_() -> threading.Thread:
        await shard.check(0, 5, 0, quantize_message(torch.ones(10), "none")[0])
        await shard.step(0, 5, [(0, 1.0)], False)
        return threading.current_thread()

    loop_thread = asyncio.run(round_())
    assert set(ran) == {"decode", "step"}
    assert ran["decode"] is not loop_thread and ran["step"] is not loop_thread, ran
    assert ran["step"].name.startswith("outer-maths")  # the one FIFO maths thread: steps stay in order


def test_a_shard_rebuilt_from_its_neighbours_copy_holds_and_steps_the_same_bits():
    """diloco.outer_shard_backup without Ray: the copy a shard's neighbour keeps (``_backup_entry``
    -> ``_keep``: copied into the keeper's own arrays; the global values may come from the step's
    reply; an older copy arriving late is ignored) restores a new shard (``_restore``) holding the
    original's global slice, Nesterov momentum, step counts, downlink residual (int8 with error
    feedback) and versions bit for bit, whatever the original does afterwards; the rebuilt shard's
    next outer step gives the original's bits."""
    from ray_diloco.core.outer import OrderedMean

    cfg = load_config({"diloco": {"replicas": 2, "outer_shards": 2}, "inner": {"global_batch": 4},
                       "streaming": {"quantization": "int8", "error_feedback": True}}).to_dict()
    rng = np.random.default_rng(0)
    theta = [rng.standard_normal(n).astype(np.float32) for n in (1001, 5000)]

    def step(shard, f, seed):  # an outer step and its quantised downlink, as OuterShard._step takes them
        n = shard.bounds[f].stop - shard.bounds[f].start
        mean = OrderedMean(n)
        mean.add(np.random.default_rng(seed).standard_normal(n).astype(np.float32), 1.0)
        _, update = shard.opt.step_ordered(f, mean, keep_update=True)
        shard.downlink.encode_update(shard.opt, f, update)
        shard.opt.fragments[f].version += 1

    def state(shard):
        fs = shard.opt.fragments
        return ([f.param.numpy().copy() for f in fs], [f.opt.state[f.param]["momentum_buffer"].numpy().copy() for f in fs],
                [f.steps for f in fs], [f.residual.numpy().copy() for f in fs], [f.version for f in fs])

    a = D.OuterShard(cfg, 1, 2)
    a.set_global(theta)
    for s in range(3):
        for f in range(2):
            step(a, f, 10 * s + f)
    keeper = D.OuterShard(cfg, 0, 2)
    keeper._keep(1, {0: a._backup_entry(0)})
    keeper._keep(1, {1: a._backup_entry(1, with_global=False)}, a.opt.fragments[1].param.numpy())  # values: the reply's
    stale = {0: {**a._backup_entry(0), "version": 1, "global": np.zeros_like(a.opt.fragments[0].param.numpy())}}
    keeper._keep(1, stale)  # older than the copy kept: ignored
    before = state(a)
    step(a, 0, 99)  # the original moves on: the copy does not (no view of its arrays)
    b = D.OuterShard(cfg, 1, 2)
    b._restore(keeper.held[1])
    for x, y in zip(state(b), before):
        assert all(np.array_equal(u, v) for u, v in zip(x, y)) if isinstance(x[0], np.ndarray) else x == y
    assert b.bounds == a.bounds and keeper.memory()["backup_bytes"] > 0
    step(b, 0, 99)
    for x, y in zip(state(b), state(a)):
        assert all(np.array_equal(u, v) for u, v in zip(x, y)) if isinstance(x[0], np.ndarray) else x == y


def test_a_shard_and_the_shard_keeping_its_copy_never_share_a_node_when_there_are_two():
    """Shard i's copy is kept by shard i + 1 (mod K): placed round-robin, shard K - 1 and shard 0
    met on one node when K % nodes == 1 (K = 3 on 2 nodes, K = 4 on 3: one node's loss lost both,
    found by a break-it run). Every K on 2 to 5 nodes now keeps ring neighbours apart (on 2 nodes
    with K odd one shard goes to the driver's node), and uses every node when K >= nodes."""
    for n in range(1, 6):
        pool = [f"node{j}" for j in range(n)]
        for k in range(1, 10):
            nodes = D.ring_placement(k, pool, spare="driver")
            assert len(nodes) == k and set(pool[: min(k, n)]) <= set(nodes)
            if n >= 2 and k >= 2:
                assert all(nodes[i] != nodes[(i + 1) % k] for i in range(k)), (n, k, nodes)
            assert nodes.count("driver") == (1 if n == 2 and k % 2 == 1 and k > 1 else 0)
    assert D.ring_placement(3, ["a", "b"]) == ["a", "b", "a"]  # no spare node: as before
    assert D.ring_placement(2, []) == [None, None]


def test_a_rebuilt_shard_goes_where_one_node_loss_cannot_take_it_with_a_neighbour(monkeypatch):
    """K = 3 on two replica nodes p0, p1 (shard 2 on the driver's node): p0 dies. Shard 0's ring
    neighbours are on p1 and the driver's node; the rebuild went to p1, beside its keeper (a
    break-it run: the next loss of p1 ended the run). The driver's node comes first now (a
    neighbour there costs nothing: its loss ends the run anyway), the dead node, still listed, last."""
    group = object.__new__(D.ShardGroup)
    group.k, group.nodes = 3, ["p0", "p1", "head"]
    monkeypatch.setattr(D, "_live_nodes", lambda: (["p0", "p1"], "head"))
    assert group._rebuild_nodes(0) == ["head", "p1", "p0"]
    monkeypatch.setattr(D, "_live_nodes", lambda: (["new", "p0", "p1"], "head"))  # a node joined: it first
    assert group._rebuild_nodes(0)[0] == "new"
    group.k, group.nodes = 4, ["a", "b", "c", "b"]  # K = 4 on 3 nodes: b lost with shards 1 and 3
    monkeypatch.setattr(D, "_live_nodes", lambda: (["a", "b", "c"], "head"))
    assert group._rebuild_nodes(1) == ["head", "a", "c", "b"] and group._rebuild_nodes(3)[0] == "head"
