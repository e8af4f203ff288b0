"""The outer-optimiser shard layout (``core.shards``) and the sharded driver (``diloco.outer_shards``):
every K gives the bits of K = 1."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import outer_step

from ray_diloco.config import OuterConfig
from ray_diloco.core.formats import BLOCK
from ray_diloco.core.outer import OuterOptimizer
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
    outer_step(whole, 0, [1.0], rng.standard_normal(n).astype(np.float32))
    bounds = shard_bounds(n, k)
    state = whole.state_dict()
    parts = []
    for sl in bounds:
        p = OuterOptimizer([theta[sl]], cfg)
        p.load_state_dict({"global": [state["global"][0][sl]],
                           "optimizers": [slice_optimizer_state(state["optimizers"][0], sl, n)], "steps": [1]})
        parts.append(p)
    d = rng.standard_normal(n).astype(np.float32)
    outer_step(whole, 0, [2.0], d)
    for p, sl in zip(parts, bounds):
        outer_step(p, 0, [2.0], d[sl])
    assert np.array_equal(np.concatenate([p.fragments[0].param.numpy() for p in parts]), whole.fragments[0].param.numpy())
    joined = join_optimizer_states([p.state_dict()["optimizers"][0] for p in parts], bounds)
    for key, v in whole.state_dict()["optimizers"][0]["state"][0].items():
        assert torch.equal(joined["state"][0][key], v), key


def _split(message_fn, delta, k):
    return [message_fn(delta[sl]) for sl in shard_bounds(delta.numel(), k)]


def test_fsdp_rank_parts_are_fully_shards_layout_and_join_back():
    """Rank parts cut every parameter's first dimension as FSDP2's Shard(0) does (ceil(rows/W) per
    rank, trailing ranks short or empty); joining the W parts gives the fragment back exactly."""
    from ray_diloco.core.fragments import Fragment, ParamSpec
    from ray_diloco.core.shards import (
        exchange_index,
        join_rank_parts,
        rank_fragment,
        rank_rows,
        read_fragment_range,
        split_rank_part,
    )

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
            reads.append(b - a)  # noqa: B023 - called in this iteration only
            return parts[rank][a:b].numpy()  # noqa: B023

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
