"""The unit layer runs without Ray: a test here that starts a Ray cluster fails (it belongs in
tests/integration)."""

from __future__ import annotations

import pytest


def _refuse(*args, **kwargs):
    # pytest.fail raises a BaseException: the CLI's `except Exception` cannot turn it into an error line
    pytest.fail("a unit test started Ray (ray.init): unit tests run without a Ray cluster; "
                "move the test to tests/integration")


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    """``ray.init`` raises in every unit test, whichever code calls it (Ray Data, Tune and
    ``ray.remote`` calls start a cluster through it)."""
    import ray

    if ray.is_initialized():
        pytest.fail("Ray is already running in this process: an integration test ran before the unit layer "
                    "(run tests/unit on its own)")
    monkeypatch.setattr(ray, "init", _refuse)
    yield
    if ray.is_initialized():
        ray.shutdown()  # so the next unit test does not fail for this one
        pytest.fail("a unit test left a Ray cluster running")


@pytest.fixture
def ray_session():
    pytest.fail("unit tests run without Ray: a test that needs ray_session belongs in tests/integration")
