"""The shard layout of the outer exchange, designed once for every sharded part.

A fragment's flat fp32 parameters ``[numel_p]`` are split into K contiguous slices; slice k is
owned by outer-optimiser shard k (``runtime.outer_shards.OuterShard``), which holds those global
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

Inside an FSDP replica (``diloco.sharding: fsdp``, FSDP2's ``fully_shard``) rank r of W holds
rows :func:`rank_rows` of every parameter's first dimension. Each rank exchanges its own part
of every fragment (:func:`rank_fragment`) as exchange unit ``f * W + r`` (:func:`exchange_index`):
the outer optimiser is element-wise, so the W parts of a fragment step exactly as the whole
would, and nothing is gathered on one rank. The K outer shards then slice each part as above.
:func:`join_rank_parts` / :func:`split_rank_part` convert between the W parts and a fragment's
flat vector (checkpoints, export, evaluation offline).

No Ray here.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from ray_diloco.core.formats import BLOCK
from ray_diloco.core.fragments import Fragment, ParamSpec

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
    starts = [min(numel, (2 * numel * k + shards * ALIGN) // (2 * shards * ALIGN) * ALIGN) for k in range(shards)] + [
        numel
    ]
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


def join_outer_states(states: list[dict[str, Any]], numels: list[int]) -> dict[str, Any]:
    """The outer optimiser's state (``core.outer.OuterOptimizer.state_dict``: ``global``,
    ``optimizers``, ``steps``, ``residuals``) of a whole run from its K outer shards' (in shard
    order, each holding ``shard_bounds(numel, K)``'s slice of every fragment): the K = 1 layout
    whatever K. A shard without a downlink residual contributes zeros when another has one."""
    if len(states) == 1:
        return dict(states[0])
    bounds = [shard_bounds(n, len(states)) for n in numels]
    residuals: list[np.ndarray | None] = []
    for f, per in enumerate(bounds):
        if all(s["residuals"][f] is None for s in states):
            residuals.append(None)
            continue
        parts = [
            np.zeros(b.stop - b.start, np.float32) if s["residuals"][f] is None else s["residuals"][f]
            for s, b in zip(states, per)
        ]
        residuals.append(np.concatenate(parts))
    return {
        "global": [np.concatenate([s["global"][f] for s in states]) for f in range(len(numels))],
        "optimizers": [
            join_optimizer_states([s["optimizers"][f] for s in states], bounds[f]) for f in range(len(numels))
        ],
        "steps": list(states[0]["steps"]),
        "residuals": residuals,
    }


def rank_rows(rows: int, ranks: int, rank: int) -> slice:
    """The rows of a parameter's first dimension that FSDP2 (``Shard(0)``) keeps on ``rank`` of
    ``ranks``: ``ceil(rows / ranks)`` per rank in order, the last ranks' shorter or empty."""
    per = -(-rows // ranks)
    return slice(min(rows, rank * per), min(rows, (rank + 1) * per))


def exchange_index(fragment: int, ranks: int, rank: int) -> int:
    """The outer exchange's unit for rank ``rank``'s part of ``fragment`` (``ranks`` = 1: the
    fragment itself)."""
    return fragment * ranks + rank


def rank_fragment(fragment: Fragment, ranks: int, rank: int) -> Fragment:
    """Rank ``rank``'s part of ``fragment``: every parameter cut to its :func:`rank_rows` (same
    names and order, shapes as the rank's local tensors).

    Raises:
        ValueError: a 0-dimensional parameter (FSDP shards dimension 0).
    """
    params = []
    for p in fragment.params:
        if not p.shape:
            raise ValueError(f"parameter {p.name} has no dimension to shard")
        rows = rank_rows(p.shape[0], ranks, rank)
        params.append(ParamSpec(p.name, (rows.stop - rows.start,) + tuple(p.shape[1:])))
    return Fragment(fragment.index, tuple(params))


def _row_runs(fragment: Fragment, ranks: int, rank: int):
    """``(start in the full flat vector, start in the rank's flat part, length)`` per parameter."""
    full, part = 0, 0
    for p in fragment.params:
        inner = p.numel // p.shape[0] if p.shape[0] else 0
        rows = rank_rows(p.shape[0], ranks, rank)
        n = (rows.stop - rows.start) * inner
        yield full + rows.start * inner, part, n
        full += p.numel
        part += n


def read_fragment_range(fragment: Fragment, ranks: int, read_part: Any, start: int, stop: int) -> np.ndarray:
    """Values ``[start, stop)`` of a fragment's full flat fp32 vector (a new array) from its
    ``ranks`` rank parts (:func:`rank_fragment` layout), reading only the pieces that fall in the
    range: ``read_part(rank, part_start, part_stop)`` gives that many fp32 values of a rank's part.
    ``ranks`` = 1: one read of ``[start, stop)``. Used to export a parameter at a time."""
    if ranks == 1:
        return np.asarray(read_part(0, start, stop), dtype=np.float32).reshape(-1)
    out = np.empty(stop - start, dtype=np.float32)
    for rank in range(ranks):
        for full, at, n in _row_runs(fragment, ranks, rank):
            lo, hi = max(full, start), min(full + n, stop)
            if lo < hi:
                out[lo - start : hi - start] = read_part(rank, at + lo - full, at + hi - full)
    return out


def join_rank_parts(parts: list[Any], fragment: Fragment) -> torch.Tensor:
    """A fragment's flat fp32 ``[numel]`` from its W ranks' flat parts (rank order; arrays, also
    read-only ones from the object store, or tensors of :func:`rank_fragment` sizes).

    Raises:
        ValueError: a part's size is not its rank's.
    """
    ranks = len(parts)
    out = np.empty(fragment.numel, dtype=np.float32)
    for r, part in enumerate(parts):
        part = (part.detach().cpu().numpy() if isinstance(part, torch.Tensor) else np.asarray(part)).reshape(-1)
        if part.size != rank_fragment(fragment, ranks, r).numel:
            raise ValueError(
                f"fragment {fragment.index}: rank {r}'s part has {part.size} values, expected "
                f"{rank_fragment(fragment, ranks, r).numel}"
            )
        for full, at, n in _row_runs(fragment, ranks, r):
            out[full : full + n] = part[at : at + n]
    return torch.from_numpy(out)


def join_units(values: list[Any], fragments: list[Fragment], units: int) -> list[Any]:
    """The global parameters per fragment from the outer exchange's values per unit (``units`` per
    fragment, :func:`exchange_index` order): the W rank parts of each fragment joined into fp32
    ``[numel]`` arrays; ``units`` = 1: ``values`` as they are."""
    if units == 1:
        return values
    return [join_rank_parts(values[f.index * units : (f.index + 1) * units], f).numpy() for f in fragments]


def split_rank_part(flat: Any, fragment: Fragment, ranks: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s flat part (a copy) of a fragment's flat fp32 ``[numel]`` (the inverse of
    :func:`join_rank_parts`)."""
    flat = (flat if isinstance(flat, torch.Tensor) else torch.from_numpy(np.array(flat, np.float32))).reshape(-1)
    out = torch.empty(rank_fragment(fragment, ranks, rank).numel, dtype=torch.float32)
    for full, at, n in _row_runs(fragment, ranks, rank):
        out[at : at + n] = flat[full : full + n]
    return out
