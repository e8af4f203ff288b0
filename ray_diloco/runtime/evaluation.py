"""``ray-diloco eval`` on a Ray cluster: a checkpoint's validation loss spread over tasks that
take the devices the run's workers took (``diloco.gpus_per_worker`` GPUs and
``diloco.cpus_per_worker`` CPUs each).

Each task builds the model on its device from the checkpoint's ``outer.pt``, which it reads
itself (the calling process never holds the model); a task whose node does not see the run
directory answers ``unseen``, and only then are the global parameters read here and shipped
through the object store. The validation windows are split as the run's own evaluation splits
them (``numpy.array_split``, in order), the sums (fp64) are added here.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np


def _part(
    state: dict[str, Any],
    params: Any,
    vocab_size: int,
    tokens: np.ndarray,
    windows: np.ndarray,
    model_fn: Any,
    gpus: float,
    cpus: float = 1.0,
) -> dict[str, Any]:
    """One task: the summed loss of ``windows`` (int ``[k]``) under the checkpoint's global
    parameters (from ``params``, an object-store list, when given; else read from ``outer.pt``)."""
    import ray

    from ray_diloco.components.checkpoint import read_own_state
    from ray_diloco.components.evaluate import evaluate_checkpoint
    from ray_diloco.components.threads import thread_plan
    from ray_diloco.runtime.replica import worker_device

    thread_plan("evaluation", cpus, gpu=gpus > 0).apply()
    device, problem = worker_device(gpus)
    if problem:
        return {"error": problem}
    outer = state.get("outer") or {}
    if params is not None:
        state = {**state, "outer": {"global": params}}
    elif "file" in outer:  # read here (checked: its size, this checkpoint's id)
        own = read_own_state(outer, state.get("checkpoint_id"))
        if own is None:
            return {"unseen": True}
        state = {**state, "outer": own}
    total, count = evaluate_checkpoint(state, vocab_size, tokens, windows, device, model_fn)
    return {
        "total": total,
        "count": count,
        "pid": os.getpid(),
        "node": ray.util.get_node_ip_address(),
        "device": str(device),
        "windows": len(windows),
        "params": "file" if params is None else "object store",
    }


@contextmanager
def on_cluster(cfg: Any, address: str | None) -> Iterator[None]:
    """Connected to a Ray cluster for the block: the one already connected, ``address``
    (``auto``, ``HOST:PORT``), ``RAY_ADDRESS``, or a local one started here and stopped after.

    Raises:
        ClusterError: the address cannot be reached.
    """
    import ray

    from ray_diloco.runtime.cluster import init_ray

    c = copy.deepcopy(cfg)
    c.run.address = address
    started = init_ray(c)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def evaluate_on_cluster(
    state: dict[str, Any],
    cfg: Any,
    tokens: np.ndarray,
    vocab_size: int,
    workers: int | None = None,
    model_fn: Any = None,
) -> tuple[float, int, list[dict[str, Any]]]:
    """Summed loss (nats), token count and one record per task (``pid``, ``node``, ``device``,
    ``windows``, ``params``: read from ``file`` or from the ``object store``) of the checkpoint ``state`` (as ``load_checkpoint(..., lazy=True)`` gives it) over
    the validation ``tokens`` (int32, already cut to ``run.eval_tokens``), on the connected Ray
    cluster. ``workers``: tasks (default: the run's ``replicas x workers_per_replica``), at most one
    per validation window.

    Raises:
        ClusterError: a task found no CUDA while the run asked for GPUs.
    """
    import ray

    from ray_diloco.components.checkpoint import global_params
    from ray_diloco.components.data import val_windows
    from ray_diloco.errors import ClusterError

    n = val_windows(tokens, cfg.data.seq_len)
    k = workers or cfg.diloco.replicas * cfg.diloco.workers_per_replica
    parts = [w for w in np.array_split(np.arange(n), max(1, min(k, n))) if len(w)]
    from ray_diloco.components.threads import thread_plan

    gpus, cpus = float(cfg.diloco.gpus_per_worker or 0), float(cfg.diloco.cpus_per_worker or 1)
    plan = thread_plan("evaluation", cpus, gpu=gpus > 0)
    task = ray.remote(_part).options(num_cpus=cpus, num_gpus=gpus, max_retries=0, runtime_env=plan.runtime_env())
    tokens_ref = ray.put(np.asarray(tokens))
    out = ray.get([task.remote(state, None, vocab_size, tokens_ref, w, model_fn, gpus, cpus) for w in parts])
    unseen = [i for i, r in enumerate(out) if r.get("unseen")]
    if unseen:  # their nodes do not see the run directory: the parameters go through the object store
        ref = ray.put(global_params(state))
        again = ray.get(
            [task.remote(state, ref, vocab_size, tokens_ref, parts[i], model_fn, gpus, cpus) for i in unseen]
        )
        for i, r in zip(unseen, again):
            out[i] = r
    errors = [r["error"] for r in out if "error" in r]
    if errors:
        raise ClusterError(errors[0])
    return sum(r["total"] for r in out), sum(r["count"] for r in out), out


def evaluate_run_on_cluster(
    run_dir: str | Path,
    step: int | None = None,
    address: str | None = None,
    workers: int | None = None,
    model_fn: Any = None,
    corpus: Any = None,
) -> tuple[float, int, Path]:
    """As :func:`ray_diloco.components.evaluate.evaluate_run` (same arguments and result), on a Ray
    cluster (:func:`on_cluster`: the connected one, ``address``, ``RAY_ADDRESS`` or a local one) in
    ``workers`` tasks (:func:`evaluate_on_cluster`).

    Raises:
        CheckpointError: as ``evaluate_run``. ClusterError: the cluster cannot be reached, or a
            task has no CUDA where the run used GPUs.
    """
    from ray_diloco.components.evaluate import eval_input

    e = eval_input(run_dir, step, corpus)
    with on_cluster(e.cfg, address):
        total, count, _ = evaluate_on_cluster(e.state, e.cfg, e.val, e.vocab_size, workers, model_fn)
    return total / count, e.step, e.path
