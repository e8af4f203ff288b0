"""The shard layout of the outer exchange, designed once for every sharded part (issue 14).

A fragment's flat fp32 parameters ``[numel_p]`` are split into K contiguous slices; slice k is
owned by outer-optimiser shard k (``runtime.driver.OuterShard``), which holds those global
values and their outer-optimiser state, receives every replica's pseudo-gradient of that slice
and sends back that slice of the reply. Each node then moves about ``2 U (M-1)/M`` per outer step
when the K shards sit on the M replica nodes: a ring all-reduce's bytes (Streaming DiLoCo,
arXiv 2501.18512, section 2 discusses the exchange's bandwidth; the parameter-server layout is
arXiv 2311.08105's K = 1).

Boundaries are multiples of :data:`ALIGN` values (``quantize.BLOCK``, itself a multiple of every
SIMD width), so that quantising a slice packs exactly the blocks the whole fragment would, and
the element-wise maths (mean, Nesterov step, downlink) of a slice gives the bits of the same
values computed over the whole fragment: a run's results do not depend on K. An FSDP replica
whose ranks each hold a contiguous slice of a fragment can send its pieces to the owners whose
slices they overlap.

No Ray here.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ray_diloco.core.quantize import BLOCK

#: Shard boundaries are multiples of this many values.
ALIGN = BLOCK


def shard_bounds(numel: int, shards: int) -> list[slice]:
    """The K contiguous slices of a fragment of ``numel`` values: slice k starts at
    ``numel * k / K`` rounded to the nearest multiple of ``ALIGN`` (the last ends at ``numel``),
    so sizes differ by at most ``ALIGN``; a fragment of fewer
    than ``K * ALIGN`` values leaves some slices short or empty (every slice is still sent, as an
    empty message).

    Raises:
        ValueError: ``numel`` < 0 or ``shards`` < 1.
    """
    if numel < 0 or shards < 1:
        raise ValueError(f"shard_bounds: numel {numel} must be >= 0 and shards {shards} >= 1")
    starts = [min(numel, (2 * numel * k + shards * ALIGN) // (2 * shards * ALIGN) * ALIGN)
              for k in range(shards)] + [numel]
    return [slice(starts[k], starts[k + 1]) for k in range(shards)]


def _sliceable(v: Any, numel: int) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == numel


def slice_optimizer_state(state: dict[str, Any], sl: slice, numel: int) -> dict[str, Any]:
    """A torch optimiser ``state_dict`` of one fragment's flat parameter ``[numel]`` cut to slice
    ``sl``: every per-value buffer (momentum, Adam moments) is sliced, other tensors (Adam's
    step) are copied whole (every tensor a copy: shards step their own), the param groups kept."""
    def cut(v: Any) -> Any:
        if _sliceable(v, numel):
            return v[sl].clone()
        return v.clone() if isinstance(v, torch.Tensor) else v

    per_param = {k: {n: cut(v) for n, v in s.items()} for k, s in state.get("state", {}).items()}
    return {"state": per_param, "param_groups": copy.deepcopy(state["param_groups"])}


def join_optimizer_states(states: list[dict[str, Any]], bounds: list[slice]) -> dict[str, Any]:
    """The inverse of :func:`slice_optimizer_state`: one fragment's optimiser ``state_dict`` from
    its K shards' (in shard order), per-value buffers concatenated, everything else from shard 0
    (identical in every shard). A buffer that only some shards have (an empty shard never
    stepped) is zero-filled for the others."""
    numel = bounds[-1].stop
    out: dict[str, Any] = {"state": {}, "param_groups": states[0]["param_groups"]}
    keys = set().union(*(s.get("state", {}).keys() for s in states))
    for key in keys:
        names: dict[str, Any] = {}
        for s, sl in zip(states, bounds):
            for n, v in s.get("state", {}).get(key, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == sl.stop - sl.start:
                    buf = names.setdefault(n, torch.zeros(numel, dtype=v.dtype))
                    if isinstance(buf, torch.Tensor) and buf.numel() == numel:
                        buf[sl] = v
                else:
                    names.setdefault(n, v)
        out["state"][key] = names
    return out
