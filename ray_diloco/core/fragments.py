"""Partition of the model's parameters into fragments, and flatten/unflatten of a fragment.

A fragment is an ordered list of named parameters exchanged as one flat fp32 vector.
Plain DiLoCo uses one fragment holding every parameter; Streaming DiLoCo (arXiv 2501.18512,
section 2) splits transformer blocks into several. Every parameter belongs to exactly one
fragment, and the order is a pure function of the parameter names, so every replica and the
outer-optimiser actor agree on it after any restart.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class ParamSpec:
    """A parameter's name (``model.named_parameters()``), shape and element count."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


@dataclass(frozen=True)
class Fragment:
    """Parameters exchanged together; ``offsets[i]`` is where ``params[i]`` starts in the flat vector."""

    index: int
    params: tuple[ParamSpec, ...]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return sum(p.numel for p in self.params)

    @property
    def names(self) -> tuple[str, ...]:
        """Parameter names in exchange order."""
        return tuple(p.name for p in self.params)


def param_specs(model: torch.nn.Module) -> list[ParamSpec]:
    """Specs of every trainable parameter in ``named_parameters`` order (tied weights once)."""
    return [ParamSpec(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]


_BLOCK = re.compile(r"^(?P<container>.*?)\.(?P<index>\d+)\.")


def block_index(name: str) -> int | None:
    """The transformer block a parameter belongs to: the first dotted integer in its name
    (``model.layers.3.mlp.up_proj.weight``, ``transformer.h.3.mlp.c_fc.weight`` -> 3), or None for
    embeddings, final norm, LM head."""
    m = _BLOCK.match(name)
    return int(m.group("index")) if m else None


def plan_fragments(specs: list[ParamSpec], num_block_fragments: int = 1, pattern: str = "strided") -> list[Fragment]:
    """Partition the parameters into fragments (Streaming DiLoCo, arXiv 2501.18512, section 2).

    ``num_block_fragments`` P = 1: one fragment holding every parameter (plain DiLoCo). P >= 2:
    fragment 0 holds the parameters before the first block (embeddings), fragments 1..P the
    blocks, ``strided`` (fragment j gets blocks j, j+P, j+2P, ...) or ``sequential``
    (consecutive runs of blocks, the first ones one longer when they do not divide evenly), and
    the last fragment the parameters after the blocks (final norm, LM head). The embedding and
    head fragments are left out when empty. Within a fragment parameters keep
    ``named_parameters`` order. The result depends only on the names, so every process agrees.

    Raises:
        ValueError: unknown pattern, or P >= 2 with fewer than P numbered blocks.
    """
    if pattern not in ("strided", "sequential"):
        raise ValueError(f"streaming.pattern = {pattern!r}: must be one of strided, sequential")
    if num_block_fragments < 1:
        raise ValueError(f"streaming.fragments = {num_block_fragments}: must be >= 1")
    if num_block_fragments == 1:
        return [Fragment(0, tuple(specs))]
    blocks = sorted({b for s in specs if (b := block_index(s.name)) is not None})
    P = num_block_fragments
    if len(blocks) < P:
        raise ValueError(
            f"streaming.fragments = {P}: the model has {len(blocks)} numbered blocks "
            "(parameters named like layers.<i>.*); need at least one block per fragment"
        )
    if pattern == "strided":
        group = {b: i % P for i, b in enumerate(blocks)}
    else:
        bounds = np.linspace(0, len(blocks), P + 1)
        group = {b: int(np.searchsorted(bounds, i, side="right")) - 1 for i, b in enumerate(blocks)}
    first = next(i for i, s in enumerate(specs) if block_index(s.name) is not None)
    embed = [s for i, s in enumerate(specs) if block_index(s.name) is None and i < first]
    head = [s for i, s in enumerate(specs) if block_index(s.name) is None and i > first]
    parts = (
        [embed]
        + [[s for s in specs if (b := block_index(s.name)) is not None and group[b] == j] for j in range(P)]
        + [head]
    )
    parts = [p for p in parts if p]
    return [Fragment(i, tuple(p)) for i, p in enumerate(parts)]


def flatten(params: dict[str, torch.Tensor], fragment: Fragment, device: torch.device | str = "cpu") -> torch.Tensor:
    """Concatenate the fragment's parameters into a new fp32 tensor ``[fragment.numel]`` on ``device``."""
    return torch.cat([params[p.name].detach().reshape(-1).to(device, torch.float32) for p in fragment.params])


def pseudo_gradient(
    global_flat: torch.Tensor, params: dict[str, torch.Tensor], fragment: Fragment, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``global - local`` for ``fragment`` (fp32 ``[fragment.numel]`` on ``global_flat``'s device:
    ``out`` when given, else a new tensor), computed parameter by parameter straight into the
    result: bitwise ``global_flat - flatten(params, fragment)`` without the flattened copy
    (DiLoCo, arXiv 2311.08105, Algorithm 1 line 8). The parameters are read onto that device
    (host globals: copied to the host; ``core.staging``'s device globals: read in place)."""
    if out is None:
        out = torch.empty(fragment.numel, dtype=torch.float32, device=global_flat.device)
    off = 0
    for p in fragment.params:
        local = params[p.name].detach().reshape(-1).to(global_flat.device, torch.float32)
        torch.sub(global_flat[off : off + p.numel], local, out=out[off : off + p.numel])
        off += p.numel
    return out


class PseudoGradient:
    """``global - local`` of one fragment, read a range at a time (fp32, on ``global_flat``'s
    device) instead of into a fragment-sized buffer (DiLoCo, arXiv 2311.08105, Algorithm 1 line
    8): a transport that encodes chunk by chunk (``core.wire.Uplink``) reads it while the
    parameters stay put. :meth:`read` of every range gives the bits of :func:`pseudo_gradient`.

    Args:
        global_flat: the fragment's global values (fp32 ``[fragment.numel]``).
        params: the replica's parameters by name; they and ``global_flat`` must not change until
            the reader is done.
        fragment: the fragment.
    """

    def __init__(self, global_flat: torch.Tensor, params: dict[str, torch.Tensor], fragment: Fragment):
        self.global_flat, self.params, self.fragment = global_flat, params, fragment
        self.numel = fragment.numel
        self.device = global_flat.device
        self._starts = np.cumsum([0] + [p.numel for p in fragment.params])

    def read(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """Values ``[lo, hi)`` written into ``out[: hi - lo]`` (fp32, on :attr:`device`) and
        returned (a view of ``out``)."""
        dest = out[: hi - lo]
        first = int(np.searchsorted(self._starts, lo, side="right")) - 1
        for i in range(max(first, 0), len(self.fragment.params)):
            a, b = int(self._starts[i]), int(self._starts[i + 1])
            if a >= hi:
                break
            s, e = max(lo, a), min(hi, b)
            if s >= e:
                continue
            p = self.fragment.params[i]
            local = self.params[p.name].detach().reshape(-1)[s - a : e - a].to(self.device, torch.float32)
            torch.sub(self.global_flat[s:e], local, out=dest[s - lo : e - lo])
        return dest


def unflatten_into(params: dict[str, torch.Tensor], fragment: Fragment, flat: torch.Tensor) -> None:
    """Copy ``flat`` (``[fragment.numel]``, any float dtype, any device) into the parameters in place.

    Raises:
        ValueError: if ``flat`` has the wrong number of elements.
    """
    if flat.numel() != fragment.numel:
        raise ValueError(f"fragment {fragment.index}: got {flat.numel()} values, expected {fragment.numel}")
    off = 0
    with torch.no_grad():
        for p in fragment.params:
            t = params[p.name]
            t.copy_(flat[off : off + p.numel].view(p.shape).to(t.device, t.dtype))
            off += p.numel


def fragment_plan(cfg: Any, specs: list[ParamSpec]) -> list[Fragment]:
    """The run's fragments (``cfg``: a ``Config``): every parameter in one for plain DiLoCo and the
    DP baseline (``cfg.sync_block_fragments`` = 1), else by transformer block.

    Raises:
        ValueError: the model has fewer numbered blocks than ``streaming.fragments``.
    """
    return plan_fragments(specs, cfg.sync_block_fragments, cfg.streaming.pattern)


def tensor_hash(tensors: list[torch.Tensor]) -> str:
    """sha256 of the tensors' fp32 bytes, in order (parameter identity across processes)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()
