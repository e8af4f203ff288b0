"""How many threads each process of a run uses: one rule, from the process's Ray CPU share.

Every process of a run (a replica worker, the outer-optimiser driver and its shards, an
evaluation task, the job's own process) gets a :class:`ThreadPlan` from :func:`thread_plan`,
computed from the CPUs Ray reserves for it, never from ``os.cpu_count()``: on a node shared by
several actors each one's thread pools would otherwise be sized for the whole machine. The plan
covers torch's intra-op and inter-op threads, numba's threads (the fused codec), and the
OpenMP / MKL / OpenBLAS variables of the process and of the processes it starts.

Inside the process :meth:`ThreadPlan.apply` sets torch's threads and the variables its children
inherit; numba's pool is sized from ``NUMBA_NUM_THREADS`` when its threads launch, and each codec
call uses as many of them as torch has (``core.codec``).
Only the wait policy must be in place before OpenMP loads (it reads it once): a plan whose idle
threads sleep starts its actor with it (:meth:`ThreadPlan.runtime_env`). Other actors get no
``runtime_env``, so Ray's prestarted worker processes can host them (a process started for a
``runtime_env`` costs about a second more on 2 cores).

Why idle pools sleep (``OMP_WAIT_POLICY=PASSIVE``) in the outer side and in GPU processes:
GNU OpenMP's threads spin for a while after every parallel region before they sleep. The codec
and the outer step run hundreds of short regions per outer step (one per chunk), so a spinning
pool holds its cores almost all the time. On a 16-core node, 2 replica workers with a
16-thread pool each (numba's default: every core, though Ray gave each one CPU) beside the
driver's made one fp4 sync of 100M values take 6.3 s instead of 0.8 s (``benchmarks/sync_profile.py --in-run``, docs/benchmarks.md). A process
training on the CPU keeps the spinning default: its training loop's many small operations ran
30% slower when each one woke its pool (the ``tiny`` model on 2 threads, this machine).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["replica worker", "outer side", "evaluation", "job"]

#: The environment variables a plan sets for its process and the processes it starts.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")


@dataclass(frozen=True)
class ThreadPlan:
    """The threads of one process.

    Attributes:
        role: what the process is (for messages). cpus: the Ray CPU share it was planned from
            (0: Ray reserves none for it, as for the outer side by default).
        intra_op: torch's intra-op threads, numba's threads and the ``*_NUM_THREADS`` variables:
            ``floor(cpus)``, at least 1.
        inter_op: torch's inter-op threads (1, or 2 with 4 CPUs or more).
        passive: idle OpenMP threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``).
    """

    role: Role
    cpus: float
    intra_op: int
    inter_op: int
    passive: bool

    def env(self) -> dict[str, str]:
        """The environment variables of the plan (for this process's children and Ray actors)."""
        env = {k: str(self.intra_op) for k in THREAD_VARIABLES}
        if self.passive:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        return env

    def runtime_env(self) -> dict[str, Any] | None:
        """A Ray ``runtime_env`` starting an actor's process with the plan's variables when its
        idle threads must sleep (Ray merges it with the job's own ``runtime_env``); None otherwise
        (:meth:`apply` sets the rest inside the process)."""
        return {"env_vars": self.env()} if self.passive else None

    def apply(self) -> None:
        """Set this process's torch threads (numba's follow them at each codec call) and its
        environment for the processes it starts. torch's inter-op threads can only be set before
        they start: if they have started, they are left as they are.

        numba sizes its pool from ``NUMBA_NUM_THREADS`` once, when its threads launch, and
        re-reads the variable at every compile afterwards: a value different from the launched
        pool's makes that compile fail ("Cannot set NUMBA_NUM_THREADS to a different value once
        the threads have been launched"). So the plan's value is written (and numba's config
        reloaded) only while numba's threads have not launched; after that the variable keeps
        the pool's size.
        """
        import torch

        env = {k: v for k, v in self.env().items() if k in THREAD_VARIABLES}
        numba = sys.modules.get("numba")
        config: Any = getattr(numba, "config", None)
        launched = config is not None and _numba_launched()
        if launched:
            env["NUMBA_NUM_THREADS"] = str(config.NUMBA_NUM_THREADS)
        os.environ.update(env)
        if config is not None and not launched:
            config.reload_config()
        torch.set_num_threads(self.intra_op)
        if torch.get_num_interop_threads() != self.inter_op:
            try:
                torch.set_num_interop_threads(self.inter_op)
            except RuntimeError:  # inter-op work already ran in this process
                pass

    def report(self) -> dict[str, Any]:
        """What this process actually uses: torch's threads, numba's pool size and the plan's
        variables as its environment has them (call inside the process)."""
        import torch

        numba = sys.modules.get("numba")
        numba_threads = numba.config.NUMBA_NUM_THREADS if numba is not None and hasattr(numba, "config") else None
        return {
            "role": self.role,
            "cpus": self.cpus,
            "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
            "numba_threads": numba_threads
            if numba_threads is not None
            else int(os.environ.get("NUMBA_NUM_THREADS", 0)),
            "env": {k: os.environ.get(k) for k in (*THREAD_VARIABLES, "OMP_WAIT_POLICY")},
        }


def _numba_launched() -> bool:
    """Whether numba's thread pool has started in this process (its size is fixed from then)."""
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    return bool(getattr(parallel, "_is_initialized", False))


def worker_threads(cfg: Any) -> ThreadPlan:
    """A replica worker's plan: ``diloco.cpus_per_worker`` (a GPU worker's pools sleep when idle)."""
    return thread_plan("replica worker", cfg.diloco.cpus_per_worker, gpu=bool(cfg.diloco.gpus_per_worker))


def outer_threads(cfg: Any, holds_state: bool = True) -> ThreadPlan:
    """A process of the outer side: ``diloco.outer_cpus`` for the one holding global parameters
    (the driver with K = 1, each shard with K > 1); a driver of K > 1 shards reserves nothing."""
    return thread_plan("outer side", cfg.diloco.outer_cpus if holds_state else 0)


def outer_reserved_cpus(cfg: Any) -> float:
    """CPUs the outer side reserves in all: ``diloco.outer_cpus`` x K."""
    return float(cfg.diloco.outer_cpus) * cfg.diloco.outer_shards


def job_threads() -> ThreadPlan:
    """The job's own process keeps one CPU: it schedules, the training runs in actors (or the
    ``OMP_NUM_THREADS`` its environment sets). Applied by a run that started its own Ray (the
    CLI's process); a process that calls ``train`` on a Ray it joined keeps its threads."""
    try:
        cpus = float(os.environ.get("OMP_NUM_THREADS") or 1)
    except ValueError:
        cpus = 1.0
    return thread_plan("job", cpus)


def thread_plan(role: Role, cpus: float | None, gpu: bool = False) -> ThreadPlan:
    """The :class:`ThreadPlan` of a process that Ray gives ``cpus`` CPUs (None or 0: one thread).

    The outer side's idle OpenMP threads sleep, and so do those of a process that computes on a
    GPU; a process that trains or evaluates on the CPU keeps them spinning (its many small
    operations need them awake). See the module docstring.

    Raises:
        ValueError: ``cpus`` negative or not finite.
    """
    c = 0.0 if cpus is None else float(cpus)
    if not math.isfinite(c) or c < 0:
        raise ValueError(f"a process's CPU share must be a finite number >= 0, got {cpus!r}")
    n = max(1, math.floor(c))
    return ThreadPlan(role, c, n, 2 if n >= 4 else 1, passive=role == "outer side" or gpu)
