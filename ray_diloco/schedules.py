"""Pure functions of the global step: the inner learning rate and the outer-step plan.

Everything here depends only on the step and the config, so every replica, a joiner and a
resumed run agree without communicating (algorithms.md section 4: "schedule must follow the
global step").
"""

from __future__ import annotations

import math


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
