"""The outer-optimiser shard layout (``core.shards``) and the sharded driver (``diloco.outer_shards``):
every K gives the bits of K = 1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_diloco.config import OuterConfig
from ray_diloco.core.outer import OuterOptimizer
from ray_diloco.core.quantize import BLOCK, quantize_with_feedback
from ray_diloco.core.shards import ALIGN, join_optimizer_states, shard_bounds, slice_optimizer_state


@pytest.mark.parametrize("numel,k", [(0, 1), (1, 3), (255, 2), (256, 2), (1001, 2), (70_000, 3), (10**6, 7)])
def test_shard_bounds_cover_the_fragment_in_aligned_contiguous_slices(numel, k):
    bounds = shard_bounds(numel, k)
    assert len(bounds) == k and bounds[0].start == 0 and bounds[-1].stop == numel
    assert all(a.stop == b.start for a, b in zip(bounds, bounds[1:]))
    assert all(b.start % ALIGN == 0 or b.start == numel for b in bounds) and ALIGN % BLOCK == 0
    sizes = [b.stop - b.start for b in bounds]
    if numel >= k * ALIGN:  # balanced within one block
        assert max(sizes) - min(sizes) <= ALIGN
    with pytest.raises(ValueError, match="shards"):
        shard_bounds(numel, 0)


@pytest.mark.parametrize("name", ["nesterov", "adam"])
def test_optimizer_state_sliced_and_joined_round_trips_and_steps_the_same(name):
    """Slicing a fragment's optimiser state into K shards, stepping each slice, and joining the
    states gives bitwise the state (and parameters) of stepping the whole fragment."""
    n, k = 5000, 3
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(n).astype(np.float32)
    cfg = OuterConfig(name=name, lr=0.7, momentum=0.9)
    whole = OuterOptimizer([theta], cfg)
    whole.step(0, [1.0], rng.standard_normal(n).astype(np.float32))
    bounds = shard_bounds(n, k)
    state = whole.state_dict()
    parts = []
    for sl in bounds:
        p = OuterOptimizer([theta[sl]], cfg)
        p.load_state_dict({"global": [state["global"][0][sl]],
                           "optimizers": [slice_optimizer_state(state["optimizers"][0], sl, n)], "steps": [1]})
        parts.append(p)
    d = rng.standard_normal(n).astype(np.float32)
    whole.step(0, [2.0], d)
    for p, sl in zip(parts, bounds):
        p.step(0, [2.0], d[sl])
    assert np.array_equal(np.concatenate([p.params[0].numpy() for p in parts]), whole.params[0].numpy())
    joined = join_optimizer_states([p.state_dict()["optimizers"][0] for p in parts], bounds)
    for key, v in whole.state_dict()["optimizers"][0]["state"][0].items():
        assert torch.equal(joined["state"][0][key], v), key


def _split(message_fn, delta, k):
    return [message_fn(delta[sl]) for sl in shard_bounds(delta.numel(), k)]


@pytest.mark.parametrize("fmt", ["none", "fp4_e3m0"])
def test_a_sharded_driver_gives_the_bits_of_one_driver(ray_session, fmt):
    """K = 1 and K = 3 drivers get the same pseudo-gradients (K = 3: one object per shard's slice,
    by reference, as a replica's link sends them; fp4 with error feedback on the downlink) for
    three rounds of two fragments: the replies decode to the same global fragments bit for bit,
    the drivers' global parameters, outer state hashes and (K = 1 layout) state dicts are
    equal; a stale receiver's resync, a checkpoint of the K = 3 driver restored into a K = 2
    one, and a message in the wrong number of parts behave as they must."""
    from ray_diloco.config import load_config
    from ray_diloco.core.wire import decode_reply
    from ray_diloco.runtime.driver import OuterDriverActor
    from ray_diloco.runtime.link import resolve_reply

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
                if k == 1:
                    msgs = [m[0] for m in msgs]
                replies = ray.get([d.exchange.remote(f, s, m, 1.0 + m, msgs[m], s // 5 - 1) for m in range(2)])
                assert replies[0] == replies[1] and replies[0].status == "ok"
                # decoded into a NaN-filled buffer (as SyncBuffers may hand out): every value is written
                held[f] = decode_reply(held[f], resolve_reply(replies[0]),
                                       alloc=lambda n: torch.full((n,), float("nan"))).clone()
        return held

    a, b = rounds(one, 1, (5, 10, 15)), rounds(three, 3, (5, 10, 15))
    for x, y, g in zip(a, b, ray.get(three.global_params.remote())):
        assert torch.equal(x, y) and np.array_equal(g, y.numpy())
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


def test_fsdp_rank_parts_are_fully_shards_layout_and_join_back():
    """Rank parts cut every parameter's first dimension as FSDP2's Shard(0) does (ceil(rows/W) per
    rank, trailing ranks short or empty); joining the W parts gives the fragment back exactly."""
    from ray_diloco.core.fragments import Fragment, ParamSpec
    from ray_diloco.core.shards import (exchange_index, join_rank_parts, rank_fragment, rank_rows, read_fragment_range,
                                        split_rank_part)

    assert [rank_rows(5, 3, r) for r in range(3)] == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert [rank_rows(2, 3, r) for r in range(3)] == [slice(0, 1), slice(1, 2), slice(2, 2)]
    frag = Fragment(1, (ParamSpec("a", (5, 3)), ParamSpec("b", (2,)), ParamSpec("c", (7, 2, 2))))
    flat = torch.arange(frag.numel, dtype=torch.float32)
    for W in (1, 2, 3, 8):
        parts = [split_rank_part(flat, frag, W, r) for r in range(W)]
        assert [p.numel() for p in parts] == [rank_fragment(frag, W, r).numel for r in range(W)]
        assert sum(p.numel() for p in parts) == frag.numel
        assert torch.equal(join_rank_parts(parts, frag), flat)
        reads = []

        def part(rank, a, b):
            reads.append(b - a)
            return parts[rank][a:b].numpy()

        for lo, hi in [(0, 15), (15, 17), (17, frag.numel), (3, 40), (0, frag.numel), (9, 9)]:
            reads.clear()
            assert np.array_equal(read_fragment_range(frag, W, part, lo, hi), flat[lo:hi].numpy()), (W, lo, hi)
            assert sum(reads) == hi - lo  # only the pieces in the range are read
        # each part is the rank's rows of each parameter, in order
        r = W - 1
        rows_a = rank_rows(5, W, r)
        assert torch.equal(parts[r][: (rows_a.stop - rows_a.start) * 3], flat[:15].view(5, 3)[rows_a].reshape(-1))
    assert [exchange_index(f, 3, r) for f in range(2) for r in range(3)] == list(range(6))
    with pytest.raises(ValueError, match="rank 1's part has 4 values"):
        join_rank_parts([split_rank_part(flat, frag, 2, 0), torch.zeros(4)], frag)
