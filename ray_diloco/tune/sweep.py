"""Ray Tune sweeps: each trial is a full DiLoCo (or DP) run with its own replicas.

A search space is a YAML file (``tune_spaces/*.yaml``, format in docs/sweeps.md)::

    description: outer lr x H on the tiny model
    config: tiny                    # base config: a preset name or a YAML path (default: built-in)
    set: {run.steps: 200}           # fixed overrides for every trial
    params:                         # swept config fields (dotted keys)
      outer.lr: {grid: [0.2, 0.4, 0.6, 0.8, 1.0]}
      diloco.H: {grid: [10, 30]}
      inner.lr: {geometric: {start: 1.0e-3, factor: 1.4142135623730951, count: 5}}   # a grid
      inner.warmup_steps: {choice: [50, 100]}
      inner.weight_decay: {loguniform: [1.0e-3, 0.3]}
    metric: eval_loss               # what is minimised (the global parameters' validation loss)
    mode: min
    num_samples: 1                  # samples of the random parameters per grid point
    scheduler: fifo                 # or asha (early stopping on the outer step)
    asha: {grace_period: 1, reduction_factor: 2}
    search: basic                   # or optuna
    resources: {cpus_per_worker: 1, trial_cpus: 0.5}
    max_concurrent_trials: null     # default: as many as the cluster holds at once

Each trial reserves one :class:`~ray.tune.PlacementGroupFactory`: a bundle for the trial
itself (its outer-optimiser driver takes no CPU) and one bundle per replica worker, so a trial
starts only when all its replicas fit and trials never deadlock on each other. Inside, the
replicas are placed in those bundles (``cluster.HOST_PLACEMENT_GROUP``).

Trials report, after every outer step, the global parameters' ``eval_loss`` (trials evaluate
every outer step unless the space sets ``run.eval_every``), ``best_eval_loss``, train loss,
tokens and bytes; ASHA stops trials on ``outer_step``. Each trial's run directory
(``SWEEP_DIR/trials/TRIAL``, with checkpoints, ``metrics.jsonl`` and its W&B run in the sweep's
W&B group) is resumed, not restarted, when an interrupted sweep is restored
(``ray-diloco tune --resume SWEEP_DIR``, ``Tuner.restore``).

The sweep directory gets ``results.csv`` / ``results.parquet`` (one row per trial: swept
values, the config fields the scaling-law fits use, final and best eval loss, tokens, bytes,
status, error) and ``best_config.yaml`` (a config ``ray-diloco train --config`` accepts).
"""

from __future__ import annotations

import io
import logging
import math
import os
import signal
import threading
from pathlib import Path
from typing import Any

import yaml

from ray_diloco.components.storage import is_uri, join_uri, read_text, write_bytes, write_text
from ray_diloco.config import load_config
from ray_diloco.errors import ConfigError
from ray_diloco.log import RESULT, installed
from ray_diloco.runtime.strategy import strategy_class
from ray_diloco.tune.space import SPEC_FILE, SweepSpec, fmt_value, group_label, load_space, load_spec
from ray_diloco.tune.trial import DilocoTrial, best_eval_loss, metrics_rows, tune_metrics

logger = logging.getLogger(__name__)

__all__ = ["tune", "load_space", "load_spec", "SweepSpec", "DilocoTrial", "results_rows", "write_results"]


def _max_outer_steps(spec: SweepSpec) -> int:
    """ASHA's max_t: the most outer steps of any trial (with a token budget, counted with a
    vocabulary of 2^18 tokens, an upper bound: the scheduler must not cut a trial short)."""
    import itertools

    from ray_diloco.models.transformer import budget_steps

    base = spec.examples()[0]
    keys = [
        k
        for k in spec.params
        if k.startswith(("model.", "run.", "diloco.H", "inner.global_batch", "data.seq_len"))
        or any(isinstance(v, dict) for v in spec.grid_values(k) or [])
    ]
    values = [spec.grid_values(k) or [v for v in spec.examples() for v in [v[k]]] for k in keys]
    most = 1
    for combo in itertools.product(*values):
        cfg = spec.trial_config({**base, **dict(zip(keys, combo))}, validate=False)
        if cfg.run.tokens_per_parameter is not None:
            try:
                cfg.run.steps = budget_steps(cfg, cfg.model.vocab_size or 2**18)
            except ConfigError:  # an invalid trial fails on its own
                continue
        most = max(most, cfg.num_outer_steps)
    return most


def _trainable(spec: SweepSpec) -> Any:
    from ray import tune

    def resources(params: dict[str, Any]) -> Any:
        try:
            cfg = spec.trial_config(params, validate=False)
            bundles = spec.bundles(cfg)
        except Exception:  # an invalid trial: the smallest bundle, it fails at once with its own error
            bundles = [{"CPU": float(spec.resources.get("trial_cpus", 0.5))}]
        return tune.PlacementGroupFactory(bundles, strategy="PACK")

    trial = tune.with_parameters(DilocoTrial, spec=spec.to_dict(), verbosity=installed())
    return tune.with_resources(trial, resources)


def _concurrency(spec: SweepSpec) -> int:
    """Trials that fit the cluster at once (the largest trial's bundles against its CPUs/GPUs)."""
    import ray

    if spec.max_concurrent_trials:
        return int(spec.max_concurrent_trials)
    res = ray.cluster_resources()
    need_cpu = need_gpu = 0.0
    for p in spec.examples():
        try:
            b = spec.bundles(spec.trial_config(p, validate=False))
        except ConfigError:
            continue
        need_cpu = max(need_cpu, sum(x.get("CPU", 0) for x in b))
        need_gpu = max(need_gpu, sum(x.get("GPU", 0) for x in b))
    n = int(res.get("CPU", 0) // need_cpu) if need_cpu else 1
    if need_gpu:
        n = min(n, int(res.get("GPU", 0) // need_gpu))
    if n < 1:
        from ray_diloco.errors import ClusterError

        raise ClusterError(
            f"a trial needs {need_cpu:g} CPUs and {need_gpu:g} GPUs (its driver bundle + one bundle per "
            f"replica worker) but the Ray cluster has {res.get('CPU', 0):g} CPUs and "
            f"{res.get('GPU', 0):g} GPUs: lower resources.cpus_per_worker or diloco.replicas"
        )
    return n


def _tune_config(spec: SweepSpec) -> Any:
    from ray import tune

    scheduler = search_alg = None
    if spec.scheduler == "asha":
        from ray.tune.schedulers import ASHAScheduler

        scheduler = ASHAScheduler(
            time_attr="outer_step",
            max_t=_max_outer_steps(spec),
            grace_period=int(spec.asha.get("grace_period", 1)),
            reduction_factor=float(spec.asha.get("reduction_factor", 2)),
        )
    if spec.search == "optuna":
        try:
            from ray.tune.search.optuna import OptunaSearch

            search_alg = OptunaSearch(metric=spec.metric, mode=spec.mode, seed=0)
        except (ImportError, AssertionError):
            raise ConfigError(
                [
                    "search = 'optuna': needs the optuna package (pip install optuna, or "
                    "pip install 'ray-diloco[optuna]')"
                ]
            ) from None
    return tune.TuneConfig(
        metric=spec.metric,
        mode=spec.mode,
        scheduler=scheduler,
        search_alg=search_alg,
        num_samples=spec.num_samples,
        max_concurrent_trials=_concurrency(spec),
        trial_dirname_creator=lambda t: t.trial_id,
    )


def _num_trials(spec: SweepSpec) -> int:
    n = spec.num_samples
    if spec.search == "basic":
        for key in spec.params:
            g = spec.grid_values(key)
            n *= len(g) if g is not None else 1
    return n


def tune(
    space: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    resume: str | None = None,
    name: str | None = None,
    storage_path: str | None = None,
    scheduler: str | None = None,
    search: str | None = None,
    num_samples: int | None = None,
    max_concurrent: int | None = None,
    address: str | None = None,
) -> dict[str, Any]:
    """Run (or, with ``resume``, continue) a sweep; write the results table and the best config.

    Returns ``{"sweep_dir", "rows", "best", "interrupted"}`` (``rows``: one dict per trial as
    in ``results.csv``; ``best``: the best row, None when no trial produced a finite loss;
    ``interrupted``: Ctrl-C/SIGTERM stopped it with trials unfinished: ``resume`` continues it).

    Raises:
        ConfigError: bad space or option. ClusterError: the cluster cannot host one trial.
        CheckpointError: another ``ray-diloco tune`` process runs this sweep.
    """
    if resume is not None:
        if space is not None:
            raise ConfigError([f"--space {space}: cannot be combined with --resume (the sweep's {SPEC_FILE} is used)"])
        spec = load_spec(resume)
    else:
        if space is None:
            raise ConfigError(["--space: required (a search-space YAML, for example tune_spaces/cpu_outer_lr.yaml)"])
        spec = load_space(space, overrides, name, storage_path, scheduler, search, num_samples, max_concurrent)
    try:
        cfg0 = load_config(spec.config, [f"{k}={fmt_value(v)}" for k, v in spec.set.items()], validate=False)
    except ConfigError as e:
        if resume is None:
            raise
        raise ConfigError([f"--resume {resume}: {SPEC_FILE}: {line}" for line in e.problems]) from None
    if is_uri(spec.storage_path):
        spec.staging_dir = str(Path(cfg0.run.output_dir).expanduser().resolve() / "sweep-staging" / spec.name)
    if address is not None:
        cfg0.run.address = address
    lock = _lock(spec)  # a second tune of the same sweep (run or resume) is refused while this one runs
    try:
        return _run(spec, resume is not None, cfg0)
    finally:
        lock.close()


def _run(spec: SweepSpec, resume: bool, cfg0: Any) -> dict[str, Any]:
    """:func:`tune` with the sweep's lock held."""
    import logging

    import ray
    from ray import tune as rt

    from ray_diloco.runtime.cluster import init_ray

    if not resume and read_text(join_uri(spec.sweep_dir, SPEC_FILE)) is not None:
        raise ConfigError(
            [
                f"--name {spec.name}: sweep directory {spec.sweep_dir} already exists (continue it with "
                f"--resume {spec.sweep_dir}, or choose another --name)"
            ]
        )
    restore = resume and rt.Tuner.can_restore(spec.sweep_dir)
    if resume and not restore:
        logger.warning(
            f"note: {spec.sweep_dir} holds no saved Tune state (the sweep stopped before its first trial "
            "started): starting it from the beginning"
        )
    started = init_ray(cfg0)
    # outer steps without an evaluation report eval_loss NaN; Tune's TensorBoard logger warns on each
    logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
    controller = logging.getLogger("ray.tune.execution.tune_controller")
    one_line = _OneLineTrialErrors()
    controller.addFilter(one_line)
    if threading.current_thread() is threading.main_thread():  # SIGTERM (ray job stop) stops like Ctrl-C:
        signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))  # Tune saves its state
    try:
        tune_cfg = _tune_config(spec)
        logger.info(
            f"sweep {spec.name}: {_num_trials(spec)} trial(s), up to {tune_cfg.max_concurrent_trials} at once, "
            f"scheduler {spec.scheduler}, search {spec.search}, minimising {spec.metric}"
        )
        logger.info(f"sweep directory: {spec.sweep_dir}")
        run_cfg = rt.RunConfig(
            name=spec.name,
            storage_path=spec.storage_path,
            verbose=1,
            failure_config=rt.FailureConfig(max_failures=0, fail_fast=False),
        )
        if restore:
            tuner = rt.Tuner.restore(
                spec.sweep_dir,
                trainable=_trainable(spec),
                resume_unfinished=True,
                resume_errored=False,
                restart_errored=False,
            )
        else:
            write_text(join_uri(spec.sweep_dir, SPEC_FILE), yaml.safe_dump(spec.to_dict(), sort_keys=False))
            tuner = rt.Tuner(
                _trainable(spec),
                param_space=spec.param_space(for_optuna=spec.search == "optuna"),
                tune_config=tune_cfg,
                run_config=run_cfg,
            )
        grid = tuner.fit()
    finally:
        controller.removeFilter(one_line)
        if started:
            ray.shutdown()
    rows = results_rows(spec, grid)
    best = write_results(spec, rows)
    interrupted = not _finished(rows)
    return {"sweep_dir": spec.sweep_dir, "rows": rows, "best": best, "interrupted": interrupted}


def _lock(spec: SweepSpec) -> Any:
    """The sweep's lock (:func:`~ray_diloco.components.checkpoint.lock_dir` on its local directory; with a
    URI storage path, on this machine's staging directory).

    Raises:
        CheckpointError: another ``ray-diloco tune`` runs or resumes this sweep.
        ConfigError: the local directory cannot be created.
    """
    from ray_diloco.components.checkpoint import lock_dir

    d = spec.local_dir
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError([f"--storage-path {spec.storage_path}: cannot create {d} ({e.strerror or e})"]) from None
    return lock_dir(d, f"sweep directory {spec.sweep_dir}")


class _OneLineTrialErrors:
    """A logging filter for Tune's controller: a trial that failed with our one-line reason
    (:class:`~ray_diloco.tune.trial.TrialError`) is logged as that line, not as Ray's traceback of the
    actor that raised it (the results table and the summary name it again)."""

    def filter(self, record: Any) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        line = _error_line(exc) if exc is not None and "TrialError" in str(exc) else None
        if line is not None:
            record.msg, record.args, record.exc_info, record.exc_text = f"{record.getMessage()}: {line}", (), None, None
        return True


def _error_line(err: BaseException | None) -> str | None:
    if err is None:
        return None
    text = str(err).strip().splitlines()
    for ln in reversed(text):  # Tune wraps the trial's exception: keep our one-line reason
        if "TrialError" in ln:
            return ln.split("TrialError:", 1)[-1].strip()
    return next((ln.strip() for ln in reversed(text) if ln.strip()), type(err).__name__)[:300]


def results_rows(spec: SweepSpec, grid: Any) -> list[dict[str, Any]]:
    """One dict per trial: ``trial``, ``status``, the swept values, ``algorithm``,
    ``num_parameters`` (N), ``replicas`` (M; 0 for DP), ``H``, ``inner_lr``, ``outer_lr``,
    ``global_batch``, ``tokens``, ``final_eval_loss``, ``best_eval_loss``, ``outer_steps``,
    ``bytes_sent``, ``bytes_received``, ``run_dir``, ``error``."""
    import json

    rows = []
    saved: dict[Any, str] = _saved_statuses(spec.sweep_dir)  # looked up by trial id, which may be None
    for r, t in zip(grid, _trials(grid)):
        conf = r.config or getattr(t, "config", None) or {}  # a trial that never ran has no result config
        params = {k: conf.get(k) for k in spec.params}
        m = r.metrics or {}
        try:
            cfg = spec.trial_config(params, validate=False)
        except ConfigError:
            cfg = None
        status = (
            saved.get(getattr(t, "trial_id", None))
            or getattr(t, "status", None)
            or ("ERROR" if r.error else "TERMINATED")
        )
        row: dict[str, Any] = {
            "trial": getattr(t, "trial_id", None) or (Path(r.path).name if r.path else None),
            "status": status,
        }
        row.update({k: group_label(v) if isinstance(v, dict) else v for k, v in params.items()})
        here = spec.local_dir / "trials" / str(row["trial"])  # where it is now (the sweep may have been moved)
        run_dir = str(here) if here.is_dir() else m.get("run_dir")
        summary = {}
        if run_dir and (Path(run_dir) / "summary.json").is_file():  # written when the run finished
            summary = json.loads((Path(run_dir) / "summary.json").read_text())
        last = _last_metrics(Path(run_dir)) if run_dir else {}
        if last and (m.get("outer_step") is None or last["outer_step"] > m["outer_step"]):
            # the run's own record is ahead of Tune's last result (an interruption came between them)
            m = {**m, **{k: v for k, v in last.items() if v is not None}}
        started = bool(run_dir and (Path(run_dir) / "config.yaml").is_file())
        if status == "TERMINATED" and not summary and m.get("outer_step") is not None:
            row["status"] = "STOPPED"  # by the scheduler (ASHA) before its last outer step
        elif status in ("PENDING", "RUNNING", "PAUSED") and summary:
            row["status"] = "TERMINATED"  # it finished while the sweep was being interrupted
        elif status in ("PENDING", "RUNNING", "PAUSED") and started:
            row["status"] = "INTERRUPTED"  # started, then the sweep was interrupted: --resume continues it
        row.update(
            {
                "algorithm": cfg.algorithm if cfg else None,
                "model": cfg.model.preset if cfg else None,
                "num_parameters": summary.get("num_parameters") or _num_parameters(run_dir),
                "replicas": strategy_class(cfg).reported_replicas(cfg) if cfg else None,
                "H": cfg.diloco.H if cfg else None,
                "inner_lr": cfg.inner.lr if cfg else None,
                "outer_lr": cfg.outer.lr if cfg else None,
                "global_batch": cfg.inner.global_batch if cfg else None,
                "seq_len": cfg.data.seq_len if cfg else None,
                "tokens": m.get("tokens"),
                "final_eval_loss": m.get("eval_loss"),
                "best_eval_loss": m.get("best_eval_loss") if m.get("best_eval_loss") != math.inf else None,
                "outer_steps": m.get("outer_step"),
                "bytes_sent": m.get("bytes_sent"),
                "bytes_received": m.get("bytes_received"),
                "run_dir": run_dir,
                "wandb_warning": m.get("wandb_warning"),
                "error": _error_line(r.error),
            }
        )
        rows.append(row)
    return rows


def _trials(grid: Any) -> list[Any]:
    """Tune's trial objects in the ResultGrid's order."""
    trials = list(getattr(getattr(grid, "_experiment_analysis", None), "trials", None) or [])
    return trials if len(trials) == len(grid) else [None] * len(grid)


def _saved_statuses(sweep_dir: str) -> dict[str, str]:
    """Each trial's status in the experiment state Tune saved when the sweep stopped:
    TERMINATED, ERROR, or PENDING/RUNNING/PAUSED when it was interrupted (the live trial objects
    are all stopped by then, so they cannot tell)."""
    import logging

    from ray.tune import ExperimentAnalysis

    log = logging.getLogger("ray.tune")
    level = log.level
    log.setLevel(logging.CRITICAL)  # it warns about trials that never reported
    try:
        return {t.trial_id: t.status for t in ExperimentAnalysis(sweep_dir).trials}
    except Exception:
        return {}
    finally:
        log.setLevel(level)


def _last_metrics(run_dir: Path) -> dict[str, Any]:
    """A trial's metrics (as it reports them to Tune) from its run's ``metrics.jsonl``: the last
    outer step's, with the best eval loss so far; ``{}`` when it has none."""
    rows = metrics_rows(run_dir)
    return tune_metrics(rows[-1], best_eval_loss(rows), run_dir) if rows else {}


def _num_parameters(run_dir: str | None) -> int | None:
    """Parameter count from the run's exported or checkpointed model when there is no summary."""
    if not run_dir:
        return None
    from ray_diloco.components.checkpoint import global_params, latest_checkpoint, load_checkpoint

    try:
        _, path = latest_checkpoint(Path(run_dir))
        return int(sum(p.size for p in global_params(load_checkpoint(path, lazy=True))))
    except Exception:
        return None


def _finished(rows: list[dict[str, Any]]) -> bool:
    """True when no trial is left to run (every status final: the sweep was not interrupted)."""
    return all(r["status"] in ("TERMINATED", "STOPPED", "ERROR") for r in rows)


def write_results(spec: SweepSpec, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``results.csv``, ``results.parquet`` and ``best_config.yaml`` in the sweep directory;
    prints the table's best trial. Returns the best row (None: no finite loss)."""
    import pandas as pd

    df = pd.DataFrame(rows)
    key = "final_eval_loss" if spec.metric == "eval_loss" else "best_eval_loss"
    finite = [
        r for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and r["status"] != "ERROR"
    ]
    best = (min if spec.mode == "min" else max)(finite, key=lambda r: r[key]) if finite else None
    write_text(join_uri(spec.sweep_dir, "results.csv"), df.to_csv(index=False))
    parquet = io.BytesIO()
    df.to_parquet(parquet, index=False)
    write_bytes(join_uri(spec.sweep_dir, "results.parquet"), parquet.getvalue())
    counts = df["status"].value_counts().to_dict() if len(df) else {}
    logger.info(
        f"{len(rows)} trial(s): " + ", ".join(f"{v} {k.lower()}" for k, v in sorted(counts.items())), extra=RESULT
    )
    for r in rows:
        if r["error"]:
            shown = " ".join(f"{k}={r[k]}" for k in spec.params)
            logger.info(f"trial {r['trial']} ({shown}) failed: {r['error']}", extra=RESULT)
    warned = [r for r in rows if r.get("wandb_warning")]
    if warned:  # the trials print it too, but a trial's last log lines can miss a driver that exits
        logger.warning(
            f"warning: trial {warned[0]['trial']}: {warned[0]['wandb_warning']}"
            + (f"; {len(warned) - 1} more trial(s) likewise (results column wandb_warning)" if len(warned) > 1 else ""),
            extra=RESULT,
        )
    logger.info(f"results: {spec.sweep_dir}/results.csv", extra=RESULT)
    if best is None:
        if _finished(rows):  # not when interrupted
            logger.info("no trial reached a finite eval loss", extra=RESULT)
        return None
    swept = {k: best[k] for k in spec.params}
    cfg = spec.trial_config(swept, validate=False)
    cfg.run.name = None
    stored = join_uri(spec.sweep_dir, "best_config.yaml")
    write_text(stored, cfg.to_yaml())
    local = spec.local_dir / "best_config.yaml"  # --config reads local files: a remote sweep keeps a copy here
    if is_uri(spec.sweep_dir):
        write_text(str(local), cfg.to_yaml())
    logger.info(
        f"best trial {best['trial']}: {key} {best[key]:.4f} at outer step {best['outer_steps']} with "
        + " ".join(f"{k}={v}" for k, v in swept.items()),
        extra=RESULT,
    )
    logger.info(f"best config: {stored} (ray-diloco train --config {local})", extra=RESULT)
    return best
