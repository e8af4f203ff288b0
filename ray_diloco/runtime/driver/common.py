"""What the driver's parts share: the run's health, the fragments' sizes and step locks, a step
kept for a rebuild, and two small rules (norms of slices, an object lost with its node)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import ray

#: Finished rounds kept per fragment for receivers that ask late (older ones get a resync).
KEEP_FINISHED = 1
#: Membership events kept until the trainer collects them.
MAX_EVENTS = 1000


class RunHealth:
    """Whether the run can go on: once a part of the driver finds it cannot (a shard lost with its
    copy, shards out of step), every later ping raises the reason, which the trainer turns into
    the run's error line."""

    def __init__(self) -> None:
        self.broken: str | None = None

    def stop(self, why: str) -> RuntimeError:
        """Record ``why`` the run cannot go on; returns the error to raise."""
        self.broken = why
        return RuntimeError(why)

    def check(self) -> None:
        """Raise ``RuntimeError`` (the recorded reason) once the run cannot go on."""
        if self.broken:
            raise RuntimeError(self.broken)


class Fragments:
    """The global fragments' sizes (fp32 values each, set once with the global parameters) and one
    lock per fragment: its outer steps are taken one at a time, in the order their rounds closed,
    and a read of every slice (holding every lock) sees one version of each."""

    def __init__(self) -> None:
        self.numels: list[int] | None = None
        self.locks: list[asyncio.Lock] = []

    def set(self, numels: list[int]) -> None:
        self.numels = list(numels)
        self.locks = [asyncio.Lock() for _ in numels]

    def numel(self, fragment: int) -> int:
        assert self.numels is not None  # init_global first
        return self.numels[fragment]


@dataclass
class KeptStep:
    """An outer step every shard took whose copies (``diloco.outer_shard_backup``) are not all
    kept yet: what a shard rebuilt from the older copy needs to take it again."""

    step: int
    terms: list[tuple[int, float]]
    parts: dict[int, list[Any]]  # replica -> its K pseudo-gradient parts (ObjectRefs the replica owns)
    average_only: bool
    version: int  # the fragment's version after it


def combine_norms(norms: list[float]) -> float:
    """The L2 norm of a vector from its K slices' norms (the norm itself for K = 1)."""
    return norms[0] if len(norms) == 1 else math.sqrt(sum(n * n for n in norms))


def object_lost(e: BaseException) -> bool:
    """An object that died with its node or its owner (a pseudo-gradient: the sending replica; a
    copy: the shard that put it), raised as is or as the cause of a task's error."""
    cause = getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else None
    return isinstance(e, ray.exceptions.ObjectLostError) or isinstance(cause, ray.exceptions.ObjectLostError)
