"""A Ray cluster's address, checked before ``ray.init`` is given it (no Ray here)."""

from __future__ import annotations

import socket

from ray_diloco.errors import ClusterError


def check_reachable(address: str | None, field: str, timeout_s: float = 10.0) -> None:
    """Fail fast on a ``HOST:PORT`` GCS address nothing listens on: ``ray.init`` would retry for
    minutes. ``field`` names where the address came from in the error (``run.address``,
    ``--address``; ``RAY_ADDRESS`` when it came from the environment). None, ``auto`` and
    ``ray://`` addresses are left to Ray.

    Raises:
        ClusterError: a malformed address, or nothing answers at it within ``timeout_s`` seconds.
    """
    if not address or address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterError(f"{field} = {address!r}: expected 'auto', HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ClusterError(
            f"{field} = {address!r}: no Ray cluster answers there ({e.strerror or type(e).__name__}); "
            "start one with `ray start --head` or use --address auto"
        ) from None
