"""A Ray address is checked before ray.init gets it: nothing listening, or a malformed one, is one
line at once instead of minutes of Ray's retries (train's run.address, prepare's --address and
RAY_ADDRESS)."""

from __future__ import annotations

import socket

import pytest

from ray_diloco.components.address import check_reachable, connect_ray
from ray_diloco.errors import ClusterError


def test_an_address_nothing_answers_and_a_malformed_one_are_one_line():
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ClusterError, match=rf"RAY_ADDRESS = '127.0.0.1:{port}': no Ray cluster answers there"):
        check_reachable(f"127.0.0.1:{port}", "RAY_ADDRESS")
    with pytest.raises(ClusterError, match=r"--address = 'nohost': expected 'auto', 'local', HOST:PORT or ray://HOST:PORT"):
        check_reachable("nohost", "--address")
    for left_to_ray in (None, "", "auto", "local", "ray://127.0.0.1:1"):
        check_reachable(left_to_ray, "run.address")
    with socket.socket() as s:  # something listening: accepted
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_reachable(f"127.0.0.1:{s.getsockname()[1]}", "run.address")


def test_with_no_address_a_command_starts_a_ray_of_its_own(monkeypatch):
    """A plain ``ray.init()`` joins the cluster ``/tmp/ray/ray_current_cluster`` names (one that
    ``ray start`` or a test script started on the machine; a fresh user's first run trained on
    another user's cluster and failed). With no address and no ``RAY_ADDRESS`` every command now
    starts a local Ray of its own; ``RAY_ADDRESS`` (``ray job submit``) and an address given are
    joined. (``ray.init`` is recorded here: a unit test starts no Ray.)"""
    import ray

    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert connect_ray(None, "run.address", local={"object_store_memory": 1 << 30}, log_to_driver=True)
    assert calls[-1]["address"] == "local" and calls[-1]["log_to_driver"] is True
    assert calls[-1]["object_store_memory"] == 1 << 30  # what only a new cluster is given
    connect_ray("auto", "run.address", local={"object_store_memory": 1 << 30})
    assert calls[-1]["address"] == "auto"  # joins the cluster running on this machine, asked for
    assert "object_store_memory" not in calls[-1]
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    connect_ray(None, "run.address")
    assert calls[-1]["address"] == "ray://head:10001"  # a job's cluster
    connect_ray("local", "run.address")
    assert calls[-1]["address"] == "local"

    def refuse(**kw):
        raise ConnectionError("no GCS")

    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(ClusterError, match=r"^RAY_ADDRESS = 'ray://head:10001': cannot connect to a Ray cluster"):
        connect_ray(None, "run.address")
