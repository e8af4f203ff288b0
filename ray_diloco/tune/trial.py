"""One Ray Tune trial: a full DiLoCo (or DP) run on the bundles Tune reserved for it, reported
outer step by outer step, stopped at an outer-step boundary, resumed from its own run directory.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from ray.tune import Trainable

from ray_diloco.components.storage import join_uri
from ray_diloco.config import Config
from ray_diloco.errors import ConfigError, RayDilocoError
from ray_diloco.tune.space import SweepSpec


class TrialError(RuntimeError):
    """A trial's run failed with a one-line reason (shown in the results table's ``error``)."""


def _trial_run(s: SweepSpec, trial: str, params: dict[str, Any]) -> tuple[Config, Path, Path | None, Path]:
    """A trial's config, run directory and what to resume (a run directory left by an interrupted
    sweep; with remote storage, fetched from there).

    Raises:
        TrialError: an invalid value in ``params``.
    """
    import shutil

    from ray_diloco.components.checkpoint import list_checkpoints
    from ray_diloco.components.storage import is_uri

    remote = is_uri(s.storage_path)
    local_root = s.local_dir / "trials"
    try:
        cfg = s.trial_config(params)
    except ConfigError as e:
        raise TrialError("; ".join(e.lines())) from None
    cfg.run.name, cfg.run.output_dir = trial, str(local_root)
    cfg.run.storage_path = join_uri(s.sweep_dir, "trials") if remote else None
    if not any(o.startswith("run.eval_every=") for o in s.overrides(params)):  # a grouped value may set it
        cfg.run.eval_every = 1
    cfg.tracking.progress = False
    cfg.tracking.group = cfg.tracking.group or s.name
    cfg.tracking.name = cfg.tracking.name or f"{s.name}/{trial}"
    cfg.tracking.tags = list(cfg.tracking.tags) + ["sweep"]
    run_dir = local_root / trial
    resume = None
    if remote:
        from ray_diloco.components.mirror import download_run

        assert cfg.run.storage_path is not None  # set above when remote
        try:
            resume = download_run(join_uri(cfg.run.storage_path, trial), local_root)
        except RayDilocoError:
            resume = None
    if resume is None and run_dir.exists():  # restored sweep: continue this trial's run (the sweep's lock
        if (run_dir / "config.yaml").is_file():  # is held, so no other process uses it; without a checkpoint
            resume = run_dir  # the resume starts it again from step 0)
        elif not list_checkpoints(run_dir):  # it died before writing its config: nothing to keep
            shutil.rmtree(run_dir)
    return cfg, run_dir, resume, local_root


class _StopTrial(Exception):
    """Raised in the training thread at an outer-step boundary when Tune stops the trial."""


class DilocoTrial(Trainable):
    """Ray Tune class trainable: one full run with the trial's parameters on its reserved bundles.

    The run (:func:`ray_diloco.runtime.trainer.train`) goes on in a thread, one outer step per
    :meth:`step` call: each returns that outer step's metrics (see :mod:`ray_diloco.tune.sweep`), the
    last one with ``done``, and the thread waits at the boundary until Tune asks for the next.
    When Tune stops the trial (ASHA, Ctrl-C), :meth:`cleanup` ends the run at that boundary the
    normal way, so no outer step is trained past the last report, its W&B run is finished and its
    replicas and placement bundles are released.

    Raises (from :meth:`step`):
        TrialError: the run failed (invalid value, cluster error); Tune marks only this trial.
    """

    # tune.with_parameters passes spec as a second argument (Ray's documented pattern; its Trainable.setup
    # is typed with config alone)
    def setup(self, config: dict[str, Any], spec: dict[str, Any], verbosity: int | None = None) -> None:  # type: ignore[override]  # noqa: D401 - Tune hook
        import queue
        import threading

        import ray

        from ray_diloco.log import setup
        from ray_diloco.runtime import cluster

        if verbosity is not None:  # the command line's handler, as in the sweep's own process
            setup(verbosity)

        self._spec = SweepSpec(**spec)
        self._rows: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._go = threading.Semaphore(0)  # released by step(): one more outer step is wanted
        self._steps = 0
        self._error: BaseException | None = None
        self._last: dict[str, Any] = {}
        self._thread: threading.Thread | None = None
        try:
            cfg, self._run_dir, resume, local_root = _trial_run(self._spec, self.trial_id, config)
        except TrialError as e:  # reported by the first step(): raised here, Ray would print the stack
            self._error = e
            return
        self._final = cfg.num_outer_steps
        self._best = best_eval_loss(metrics_rows(self._run_dir)) if resume is not None else math.inf
        cluster.HOST_PLACEMENT_GROUP = ray.util.get_current_placement_group()
        self._thread = threading.Thread(
            target=self._train, args=(cfg, resume, local_root), daemon=True, name="diloco-trial"
        )
        self._thread.start()

    def _train(self, cfg: Config, resume: Path | None, local_root: Path) -> None:
        from ray_diloco.runtime.launcher import train

        try:
            if resume is not None:
                train(
                    None,
                    [f"run.output_dir={local_root}", "tracking.progress=false"],
                    resume=resume,
                    on_outer_step=self._on_outer_step,
                )
            else:
                train(cfg, on_outer_step=self._on_outer_step)
        except _StopTrial:
            pass
        except RayDilocoError as e:
            self._error = TrialError("; ".join(e.lines()))
        except BaseException as e:  # noqa: BLE001 - handed to Tune through step()
            self._error = e
        finally:
            self._rows.put(None)

    def _metrics(self, row: dict[str, Any]) -> dict[str, Any]:
        loss = row.get("eval_loss")
        if loss is not None and math.isfinite(loss):
            self._best = min(self._best, loss)
        return tune_metrics(row, self._best, self._run_dir)

    def _on_outer_step(self, row: dict[str, Any]) -> None:
        """In the training thread: hand the row to :meth:`step`, then wait until Tune asks for the
        next one (or stops the trial: then end here, at the boundary, without another outer step)."""
        self._rows.put(self._metrics(row))
        if row["outer_step"] >= self._final:  # the last one goes on to the export
            return
        while not self._go.acquire(timeout=1.0):
            if self._stop.is_set():
                raise _StopTrial
        if self._stop.is_set():
            raise _StopTrial

    def step(self) -> dict[str, Any]:
        """The next outer step's metrics; ``done`` once the run has finished (export included)."""
        if self._thread is None:  # the trial's values were invalid (setup kept the one-line reason)
            assert self._error is not None
            raise self._error
        if self._steps:
            self._go.release()  # the run may start its next outer step
        self._steps += 1
        row = self._rows.get()
        if row is not None and row["outer_step"] >= self._final:
            self._thread.join()  # export and summary
            return {**row, "done": True}
        if row is None:
            if self._error is not None:
                raise self._error
            if not self._last:  # restored after its last outer step: report that step again
                self._last = self._metrics(metrics_rows(self._run_dir)[-1])
            return {**self._last, "done": True}
        self._last = row
        return row

    def save_checkpoint(self, checkpoint_dir: str) -> dict[str, Any]:
        """Tune's checkpoint holds only where the run is: the run's own atomic checkpoints (in its
        run directory, found again by trial id on restore) are what a resume loads."""
        return {"run_dir": str(self._run_dir)}

    def load_checkpoint(self, checkpoint: dict[str, Any] | None) -> None:
        """Nothing to load: :meth:`setup` already resumed the run from its run directory."""

    def cleanup(self) -> None:
        """Stop the run at its outer-step boundary (30 s at most) and let it clean up."""
        self._stop.set()
        self._go.release()
        if self._thread is not None:
            self._thread.join(timeout=30)
        quiet_teardown()


def quiet_teardown() -> None:
    """Silence the SystemExit that ends a stopped trial's actor when it lands in a finaliser.

    Tune terminates a trial's actor right after :meth:`DilocoTrial.cleanup`, and Ray's raylet
    sends it SIGTERM about 10 ms later; Ray's handler raises ``SystemExit``. While the actor's
    objects are being freed that exception can be raised inside a weakref callback or
    ``__del__``, where Python cannot propagate it and prints it as an ignored exception with a
    traceback in the sweep's output, although the trial ended normally. This hook drops exactly
    those reports; every other unraisable exception is still printed by the previous hook.
    """
    previous = sys.unraisablehook

    def hook(args: Any) -> None:
        if args.exc_type is not None and issubclass(args.exc_type, SystemExit):
            return
        previous(args)

    sys.unraisablehook = hook


def tune_metrics(row: dict[str, Any], best: float, run_dir: Path) -> dict[str, Any]:
    """What a trial reports to Tune for one outer step's ``metrics.jsonl`` row: ``eval_loss`` (NaN
    when the step had no evaluation), ``best_eval_loss`` (``best``; inf before any), steps, tokens,
    cumulative bytes, the run directory and any W&B fallback warning."""
    loss = row.get("eval_loss")
    return {
        "outer_step": row["outer_step"],
        "inner_step": row.get("inner_step"),
        "eval_loss": loss if loss is not None else math.nan,
        "best_eval_loss": best,
        "train_loss": row.get("train_loss"),
        "tokens": row.get("tokens"),
        "bytes_sent": row.get("bytes_sent_total"),
        "bytes_received": row.get("bytes_received_total"),
        "run_dir": str(run_dir),
        "wandb_warning": row.get("wandb_warning"),
    }


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The outer-step rows of a run's ``metrics.jsonl``, in order (``[]`` when there is none); a
    line cut short by a kill is skipped."""
    import json

    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("outer_step") is not None:
            rows.append(row)
    return rows


def best_eval_loss(rows: list[dict[str, Any]]) -> float:
    """The lowest finite ``eval_loss`` of ``rows`` (inf when none has one)."""
    losses = [
        r["eval_loss"] for r in rows if isinstance(r.get("eval_loss"), (int, float)) and math.isfinite(r["eval_loss"])
    ]
    return min(losses, default=math.inf)
