"""Fragments: every parameter in exactly one fragment; flatten/unflatten round trip odd shapes."""

from __future__ import annotations

import pytest
import torch

from ray_diloco.core.fragments import ParamSpec, flatten, plan_fragments, unflatten_into


def _params():
    g = torch.Generator().manual_seed(0)
    shapes = {"scalar": (), "vec": (13,), "cube": (3, 5, 7), "mat": (11, 2), "one": (1,)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def test_every_parameter_in_exactly_one_fragment():
    """Odd shapes spread over numbered blocks, with loose parameters before and after them."""
    names = ["emb", "h.0.scalar", "h.0.vec", "h.1.cube", "h.2.mat", "h.3.one", "final"]
    params = _params()
    shapes = [(5,), *[tuple(t.shape) for t in params.values()], ()]
    specs = [ParamSpec(n, s) for n, s in zip(names, shapes)]
    for pattern in ("strided", "sequential"):
        for k in range(1, 5):
            frags = plan_fragments(specs, k, pattern)
            got = [n for f in frags for n in f.names]
            assert sorted(got) == sorted(names) and len(got) == len(set(got))
            assert sum(f.numel for f in frags) == 5 + 1 + 13 + 105 + 22 + 1 + 1
            assert len(frags) == (1 if k == 1 else k + 2)
    with pytest.raises(ValueError, match="numbered blocks"):
        plan_fragments([ParamSpec(n, tuple(t.shape)) for n, t in params.items()], 2)
    with pytest.raises(ValueError, match="pattern"):
        plan_fragments(specs, 2, "random")


def test_flatten_unflatten_round_trip_is_exact():
    params = _params()
    specs = [ParamSpec(n, tuple(t.shape)) for n, t in params.items()]
    (frag,) = plan_fragments(specs, 1)
    flat = flatten(params, frag)
    assert flat.dtype == torch.float32 and flat.shape == (frag.numel,)
    target = {n: torch.zeros_like(t) for n, t in params.items()}
    unflatten_into(target, frag, flat)
    for n in params:
        assert torch.equal(target[n], params[n]), n


def test_pseudo_gradient_is_bitwise_global_minus_the_flattened_local():
    """Computed parameter by parameter into one buffer: bitwise ``global - flatten(local)``."""
    from ray_diloco.core.fragments import Fragment, ParamSpec, flatten, pseudo_gradient

    params = {"a": torch.randn(3, 4), "b": torch.randn(7), "c": torch.randn(2, 2, 2)}
    frag = Fragment(0, tuple(ParamSpec(k, tuple(v.shape)) for k, v in params.items()))
    g = torch.randn(frag.numel)
    assert torch.equal(pseudo_gradient(g, params, frag), g - flatten(params, frag))
