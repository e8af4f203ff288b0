"""Partition of the model's parameters into fragments, and flatten/unflatten of a fragment.

A fragment is an ordered list of named parameters exchanged as one flat fp32 vector.
Plain DiLoCo uses one fragment holding every parameter; Streaming DiLoCo (arXiv 2501.18512,
section 2) splits transformer blocks into several. Every parameter belongs to exactly one
fragment, and the order is a pure function of the parameter names, so every replica and the
outer-optimiser actor agree on it after any restart.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    def nbytes_fp32(self) -> int:
        """Bytes of the fragment as fp32 (4 per element)."""
        return 4 * self.numel

    @property
    def names(self) -> tuple[str, ...]:
        """Parameter names in exchange order."""
        return tuple(p.name for p in self.params)


def param_specs(model: torch.nn.Module) -> list[ParamSpec]:
    """Specs of every trainable parameter in ``named_parameters`` order (tied weights once)."""
    return [ParamSpec(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]


def plan_fragments(specs: list[ParamSpec], num_fragments: int = 1) -> list[Fragment]:
    """Split ``specs`` into ``num_fragments`` contiguous groups (1: plain DiLoCo, all parameters).

    Raises:
        ValueError: if ``num_fragments`` is not in ``[1, len(specs)]``.
    """
    if not 1 <= num_fragments <= max(1, len(specs)):
        raise ValueError(f"num_fragments = {num_fragments}: must be in [1, {len(specs)}]")
    bounds = np.linspace(0, len(specs), num_fragments + 1).round().astype(int)
    return [Fragment(i, tuple(specs[bounds[i] : bounds[i + 1]])) for i in range(num_fragments)]


def flatten(params: dict[str, torch.Tensor], fragment: Fragment) -> torch.Tensor:
    """Concatenate the fragment's parameters into a new fp32 CPU tensor ``[fragment.numel]``."""
    return torch.cat([params[p.name].detach().reshape(-1).to("cpu", torch.float32) for p in fragment.params])


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
