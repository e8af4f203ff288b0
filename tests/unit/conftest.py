"""The unit layer runs without Ray: a test here that starts a Ray cluster fails (it belongs in
tests/integration)."""

from __future__ import annotations

import pytest


def _refuse(*args, **kwargs):
    raise AssertionError("a unit test started Ray (ray.init): unit tests run without a Ray cluster; "
                         "move the test to tests/integration")


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    """``ray.init`` raises in every unit test, whichever code calls it (Ray Data, Tune and
    ``ray.remote`` calls start a cluster through it)."""
    import ray

    monkeypatch.setattr(ray, "init", _refuse)
    yield
    assert not ray.is_initialized(), "a unit test left a Ray cluster running"


@pytest.fixture
def ray_session():
    pytest.fail("unit tests run without Ray: a test that needs ray_session belongs in tests/integration")
