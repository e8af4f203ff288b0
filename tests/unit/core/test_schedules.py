"""Inner lr schedule and outer-step bounds are pure functions of the global step."""

from __future__ import annotations

import math

import pytest

from ray_diloco.core.schedules import inner_lr, is_due, outer_step_bounds


def test_warmup_is_linear_and_reaches_peak():
    assert inner_lr(0, 1.0, 4, 100, 0.1) == pytest.approx(0.25)
    assert inner_lr(3, 1.0, 4, 100, 0.1) == pytest.approx(1.0)


def test_cosine_decays_to_the_floor():
    peak, floor = 1e-3, 0.1
    assert inner_lr(4, peak, 4, 104, floor) == pytest.approx(peak)
    mid = inner_lr(54, peak, 4, 104, floor)
    assert mid == pytest.approx(peak * floor + 0.5 * (peak - peak * floor) * (1 + math.cos(math.pi * 0.5)))
    assert inner_lr(104, peak, 4, 104, floor) == pytest.approx(peak * floor)
    assert inner_lr(10_000, peak, 4, 104, floor) == pytest.approx(peak * floor)
    values = [inner_lr(s, peak, 4, 104, floor) for s in range(4, 105)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_outer_bounds_cover_every_step_once():
    covered = []
    for k in range(1, -(-103 // 10) + 1):
        s, e = outer_step_bounds(k, 10, 103)
        covered.extend(range(s, e))
    assert covered == list(range(103))


def test_is_due():
    assert [k for k in range(1, 8) if is_due(k, 3, 7)] == [3, 6, 7]
    assert [k for k in range(1, 8) if is_due(k, 0, 7)] == [7]
