"""A sampling profiler for every process of a run (``benchmarks/sync_profile.py --in-run``).

:func:`start` runs in each Ray worker process as Ray's ``worker_process_setup_hook`` (and in the
job's process): when ``RAY_DILOCO_STACKS`` names a folder, a daemon thread samples every Python
thread's stack every ``RAY_DILOCO_STACKS_EVERY`` seconds (default 0.01) while the file ``ON``
exists in that folder (the window the caller measures) and counts, per thread
name, the innermost frame and the innermost frame of this project's code (``ray_diloco/``) as
``"function (file:line) <- project function"``; every second it writes ``<pid>.json`` there
(atomically): the counts, the process's title (Ray names an actor's process ``ray::Class``), each
OS thread's CPU seconds in the window (``/proc/self/task/*/stat``: threads that run no Python, e.g. OpenMP
pools, appear only here), and the thread settings it sees (torch's, numba's threads and
threading layer, OMP/MKL/NUMBA variables).

Samples are taken with the GIL, so a thread running a kernel that holds the GIL is seen when it
returns: the counts are a Python-level picture, the CPU seconds the native one.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

_started = False


def _label(frame) -> str:
    inner = frame
    own = None
    f = frame
    while f is not None:
        if "/ray_diloco/" in f.f_code.co_filename:
            own = f
            break
        f = f.f_back
    where = f"{inner.f_code.co_name} ({os.path.basename(inner.f_code.co_filename)}:{inner.f_lineno})"
    if own is not None and own is not inner:
        where += f" <- {own.f_code.co_name} ({os.path.basename(own.f_code.co_filename)}:{own.f_lineno})"
    return where


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each OS thread of this process, by ``tid:name`` (a Python thread's name,
    else the OS's)."""
    out = {}
    py = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                s = fh.read()
        except OSError:
            continue
        name = s[s.index("(") + 1 : s.rindex(")")]
        fields = s[s.rindex(")") + 2 :].split()
        out[f"{tid}:{py.get(int(tid), name)}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _settings() -> dict:
    info: dict = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS",
                                                   "OMP_WAIT_POLICY", "NUMBA_THREADING_LAYER")}
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_interop_threads"):  # not while it imports
        info["torch_threads"] = torch.get_num_threads()
        info["torch_interop_threads"] = torch.get_num_interop_threads()
    numba = sys.modules.get("numba")
    if numba is not None and hasattr(numba, "threading_layer"):
        info["numba_config_threads"] = numba.config.NUMBA_NUM_THREADS
        try:
            info["numba_layer"] = numba.threading_layer()
        except ValueError:
            info["numba_layer"] = None
    try:
        info["affinity"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    return info


def _run(folder: str, every: float) -> None:
    me = threading.get_ident()
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    t0 = time.time()
    last = 0.0
    path = os.path.join(folder, f"{os.getpid()}.json")
    window = os.path.join(folder, "ON")
    on = False
    cpu_on: dict[str, float] = {}
    cpu_off: dict[str, float] = {}
    seconds = 0.0
    while True:
        now = time.time()
        is_on = os.path.exists(window)
        if is_on != on:  # the window opened or closed: the threads' CPU seconds at that moment
            on, last = is_on, 0.0
            if on:
                cpu_on, seconds = _thread_cpu(), now
            else:
                cpu_off, seconds = _thread_cpu(), now - seconds
        if on:
            names = {t.ident: t.name for t in threading.enumerate()}
            for tid, frame in sys._current_frames().items():
                if tid != me:
                    counts[names.get(tid, str(tid))][_label(frame)] += 1
        if now - last >= 1.0:
            last = now
            try:
                title = open("/proc/self/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
            except OSError:
                title = "?"
            doc = {"pid": os.getpid(), "title": title, "every_s": every, "start": t0, "now": now,
                   "counts": {k: dict(v) for k, v in counts.items()}, "window_s": seconds if not on else now - seconds,
                   "thread_cpu_s": {k: v - cpu_on.get(k, 0.0) for k, v in (cpu_off if not on else _thread_cpu()).items()},
                   "settings": _settings()}
            tmp = path + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(doc, fh)
            os.replace(tmp, path)
        time.sleep(every)


def start() -> None:
    """Start sampling this process when ``RAY_DILOCO_STACKS`` names a folder (once per process)."""
    global _started
    folder = os.environ.get("RAY_DILOCO_STACKS")
    if not folder or _started:
        return
    _started = True
    os.makedirs(folder, exist_ok=True)
    every = float(os.environ.get("RAY_DILOCO_STACKS_EVERY", "0.01"))
    threading.Thread(target=_run, args=(folder, every), daemon=True, name="stack-sampler").start()
