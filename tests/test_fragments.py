"""Fragments: every parameter in exactly one fragment; flatten/unflatten round trip odd shapes."""

from __future__ import annotations

import torch

from ray_diloco.fragments import ParamSpec, flatten, plan_fragments, unflatten_into


def _params():
    g = torch.Generator().manual_seed(0)
    shapes = {"scalar": (), "vec": (13,), "cube": (3, 5, 7), "mat": (11, 2), "one": (1,)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def test_every_parameter_in_exactly_one_fragment():
    specs = [ParamSpec(n, tuple(t.shape)) for n, t in _params().items()]
    for k in range(1, len(specs) + 1):
        frags = plan_fragments(specs, k)
        names = [n for f in frags for n in f.names]
        assert sorted(names) == sorted(s.name for s in specs) and len(names) == len(set(names))
        assert sum(f.numel for f in frags) == 1 + 13 + 105 + 22 + 1


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
