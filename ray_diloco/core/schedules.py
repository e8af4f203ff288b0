"""Pure functions of the global step: the inner learning rate and the outer-step plan.

Everything here depends only on the step and the config, so every replica, a joiner and a
resumed run agree without communicating (a restart or a join must not run the inner lr
warmup again: the schedule follows the global step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def inner_lr(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """AdamW lr at global inner step ``step`` (0-based).

    Linear warmup from ``peak/warmup`` to ``peak`` over ``warmup`` steps, then cosine decay to
    ``peak * min_ratio`` at ``total`` steps (DiLoCo Table 5; scaling-law paper section 3 uses a
    5% floor). Steps past ``total`` stay at the floor.
    """
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if total <= warmup:
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = peak * min_ratio
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def outer_step_bounds(outer_step: int, H: int, total_steps: int) -> tuple[int, int]:
    """Inner steps ``[start, end)`` trained before outer step ``outer_step`` (1-based).

    Outer step k follows inner steps ``(k-1)*H .. k*H - 1``; the last round is cut at
    ``total_steps`` so a run always does exactly ``total_steps`` inner steps.
    """
    start = (outer_step - 1) * H
    return start, min(start + H, total_steps)


def is_due(outer_step: int, every: int, last: int) -> bool:
    """Whether an every-k event (eval, checkpoint) happens after ``outer_step``; always at the last."""
    return outer_step == last or (every > 0 and outer_step % every == 0)


@dataclass(frozen=True)
class SyncSchedule:
    """When each fragment syncs, as a pure function of the global inner step (Streaming DiLoCo,
    arXiv 2501.18512, section 2).

    Step ``t`` counts completed inner steps (1 .. ``total_steps``). Fragment ``f`` of ``F``
    sends its pseudo-gradient at every ``t >= 1`` with ``(t - t_f) mod H == 0``, where
    ``t_f = floor(f * H / F)``, so every fragment syncs every H steps and some fragment every
    H/F. The new global value of a fragment sent at ``s`` is merged at ``s + tau`` (``tau`` =
    ``overlap``). At the last step ``T`` the run closes: a send still in flight is merged at
    ``T``, and a fragment whose last merge came before ``T`` sends once more at ``T`` (a closing
    round), so the global parameters hold all the training except the up to ``tau`` steps the
    merge rule discards. A closing round averages the replicas instead of taking an outer step
    (``OuterOptimizer.step_ordered``, ``average_only``): a momentum step on a partial round would add
    an extrapolation the run never trains after. With F=1, tau=0 and T a multiple of H this is
    DiLoCo's schedule: sends at H, 2H, ..., T.

    Args:
        H: inner steps between two syncs of a fragment. num_fragments: F.
        overlap: tau in inner steps (< H / F). total_steps: T.
        closing: ``"average"``, ``"outer"`` or ``"none"`` (``streaming.closing_round``).
    """

    H: int
    num_fragments: int
    overlap: int
    total_steps: int
    closing: str = "average"

    def offset(self, f: int) -> int:
        """``t_f``, the fragment's phase in ``[0, H)`` (steps)."""
        return (f * self.H) // self.num_fragments

    def _scheduled(self, f: int, t: int) -> bool:
        return 1 <= t <= self.total_steps and (t - self.offset(f)) % self.H == 0

    def last_scheduled(self, f: int, t: int) -> int:
        """The latest scheduled send step of ``f`` at or before ``t`` (0 if none)."""
        if t < 1:
            return 0
        s = t - ((t - self.offset(f)) % self.H)
        return s if s >= 1 else 0

    def sends_at(self, t: int) -> list[int]:
        """Fragments that send their pseudo-gradient at step ``t``, in fragment order."""
        T = self.total_steps
        out = []
        for f in range(self.num_fragments):
            if self._scheduled(f, t):
                out.append(f)
            elif t == T and self.closing != "none":
                last = self.last_scheduled(f, T)
                if last == 0 or last + self.overlap < T:
                    out.append(f)
        return out

    def is_closing(self, f: int, t: int) -> bool:
        """Whether ``f``'s send at ``t`` is the run's closing round (at T, off its regular phase)."""
        return t == self.total_steps and not self._scheduled(f, t) and f in self.sends_at(t)

    def averages(self, f: int, t: int) -> bool:
        """Whether the driver averages (instead of stepping) ``f``'s round sent at ``t``."""
        return self.closing == "average" and self.is_closing(f, t)

    def apply_step(self, send_step: int) -> int:
        """The step at which a send at ``send_step`` is merged: ``min(send_step + tau, T)``."""
        return min(send_step + self.overlap, self.total_steps)

    def sends_between(self, start: int, end: int) -> list[tuple[int, int]]:
        """``(step, fragment)`` of every send with ``start < step <= end``, in order. A sync
        round is keyed by its fragment and send step everywhere."""
        return [(t, f) for t in self._candidate_steps(start, end) for f in self.sends_at(t)]

    def _candidate_steps(self, start: int, end: int) -> list[int]:
        steps = {self.total_steps} if start < self.total_steps <= end else set()
        for f in range(self.num_fragments):
            t = self.last_scheduled(f, end)
            while t > start:
                steps.add(t)
                t -= self.H
        return sorted(steps)
