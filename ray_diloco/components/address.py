"""Joining or starting Ray, the one way every command does it (training, sweeps, offline eval on a
cluster, ``prepare``): the address checked before ``ray.init`` is given it, a local cluster of
this process's own unless one is named, one error line, SIGTERM while starting."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from typing import Any

from ray_diloco.errors import ClusterError
from ray_diloco.log import error_line

#: Set by the CLI: after ``ray.init`` (whose core worker installs its own fatal-signal handler),
#: SIGTERM (``ray job stop``, ``kill``) is turned into KeyboardInterrupt again, so a run
#: stops its actors and its local cluster cleanly instead of aborting.
GRACEFUL_SIGTERM = False


def raise_keyboard_interrupt(signum, frame):
    """Signal handler: stop the way Ctrl-C does (``finally`` blocks run, actors are removed)."""
    raise KeyboardInterrupt


def connect_ray(address: str | None, field: str, local: dict[str, Any] | None = None, **options: Any) -> bool:
    """Join the Ray cluster at ``address`` (``auto``: the one running on this machine; HOST:PORT;
    ``ray://``), else the one ``RAY_ADDRESS`` names (a job under ``ray job submit``), else start
    a local cluster of this process's own (``local`` says so too), also when a cluster another
    process started runs on this machine (a plain ``ray.init()`` would join the one
    ``/tmp/ray/ray_current_cluster`` names). ``options`` go to ``ray.init``, and ``local`` too
    when it starts a local cluster (what only a new cluster may be given). Returns True when
    Ray was started or joined here (False: it already was).

    Raises:
        ClusterError: one line naming ``field`` (or ``RAY_ADDRESS``) and the address: malformed,
            nothing answers there, or Ray could not start or connect.
        KeyboardInterrupt: SIGTERM arrived while Ray started (with :data:`GRACEFUL_SIGTERM`)."""
    import ray

    if ray.is_initialized():
        return False
    env = os.environ.get("RAY_ADDRESS") or None
    target, where = (address, field) if address else (env, "RAY_ADDRESS") if env else (None, field)
    starts = target in (None, "local")
    if not starts:
        check_reachable(target, where)
    try:
        ray.init(
            address="local" if starts else target,
            logging_level=logging.ERROR,
            **options,
            **(local or {} if starts else {}),
        )
    except SystemExit as e:  # SIGTERM while ray.init runs: Ray's own handler calls sys.exit(15)
        if not (GRACEFUL_SIGTERM and e.code == signal.SIGTERM):
            raise
        ray.shutdown()  # what it had started
        raise KeyboardInterrupt from None
    except Exception as e:  # noqa: BLE001 - Ray raises bare Exception too ("node timed out during startup")
        what = "cannot start a local Ray cluster" if starts else "cannot connect to a Ray cluster"
        raise ClusterError(f"{where} = {target!r}: {what} ({error_line(e, typed=False)})") from None
    if GRACEFUL_SIGTERM and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    return True


def check_reachable(address: str | None, field: str, timeout_s: float = 10.0) -> None:
    """Fail fast on a ``HOST:PORT`` GCS address nothing listens on: ``ray.init`` would retry for
    minutes. ``field`` names where the address came from in the error (``run.address``,
    ``--address``; ``RAY_ADDRESS`` when it came from the environment). None, ``auto``, ``local``
    and ``ray://`` addresses are left to Ray.

    Raises:
        ClusterError: a malformed address, or nothing answers at it within ``timeout_s`` seconds.
    """
    if not address or address in ("auto", "local") or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterError(f"{field} = {address!r}: expected 'auto', 'local', HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ClusterError(
            f"{field} = {address!r}: no Ray cluster answers there ({e.strerror or type(e).__name__}); "
            "start one with `ray start --head` or use --address auto"
        ) from None
