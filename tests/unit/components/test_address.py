"""A Ray address is checked before ray.init gets it: nothing listening, or a malformed one, is one
line at once instead of minutes of Ray's retries (train's run.address, prepare's --address and
RAY_ADDRESS)."""

from __future__ import annotations

import socket

import pytest

from ray_diloco.components.address import check_reachable
from ray_diloco.errors import ClusterError


def test_an_address_nothing_answers_and_a_malformed_one_are_one_line():
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ClusterError, match=rf"RAY_ADDRESS = '127.0.0.1:{port}': no Ray cluster answers there"):
        check_reachable(f"127.0.0.1:{port}", "RAY_ADDRESS")
    with pytest.raises(ClusterError, match=r"--address = 'nohost': expected 'auto', HOST:PORT or ray://HOST:PORT"):
        check_reachable("nohost", "--address")
    for left_to_ray in (None, "", "auto", "ray://127.0.0.1:1"):
        check_reachable(left_to_ray, "run.address")
    with socket.socket() as s:  # something listening: accepted
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_reachable(f"127.0.0.1:{s.getsockname()[1]}", "run.address")
