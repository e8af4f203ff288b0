"""Progress bar (tqdm), ``metrics.jsonl``, Weights & Biases and ``summary.json``.

W&B is offline unless an API key is configured (``WANDB_API_KEY`` or ``wandb login``) or
``tracking.mode=online``; a W&B failure is reported once and never stops training: when the
server cannot be reached within ``tracking.init_timeout_s`` the run logs offline instead.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Literal, cast

from ray_diloco.components.storage import write_text
from ray_diloco.config import Config
from ray_diloco.log import error_line, installed

logger = logging.getLogger(__name__)


def wandb_mode(mode: str) -> str:
    """Resolve ``tracking.mode``: "auto" is online only when an API key is configured."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    try:
        if netrc.is_file() and "api.wandb.ai" in netrc.read_text():
            return "online"
    except OSError:
        pass
    return "offline"


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class Tracker:
    """Writes one JSON object per outer step to ``metrics.jsonl`` and mirrors it to W&B.

    Args:
        cfg: the run config. run_dir: the run directory. total_steps: inner steps of the run.
        start_step: inner steps already done (resume). summary_only: no bar, no W&B (eval).
    """

    def __init__(self, cfg: Config, run_dir: Path, total_steps: int, start_step: int = 0):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._file = open(self.metrics_path, "a", buffering=1)
        self.wandb_run = None
        self.wandb_warning: str | None = None  # why W&B is offline or off when it was asked to be online
        self._events: list[list[Any]] = []  # membership events so far (W&B table rows)
        self._start_wandb()
        self.bar = None
        if cfg.tracking.progress and installed() != -1:  # --quiet: no bar either
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                dynamic_ncols=True,
                desc=f"{cfg.algorithm} M={cfg.diloco.replicas}",
                file=sys.stderr,
            )

    def _start_wandb(self) -> None:
        t = self.cfg.tracking
        mode = wandb_mode(t.mode)
        if not t.wandb or mode == "disabled":
            return
        try:
            self.wandb_run = self._init_wandb(mode)
        except Exception as e:  # unreachable server, not logged in: log offline, `wandb sync` uploads later
            why = error_line(e)
            self.wandb_run = None
            if mode == "online":
                import time

                import wandb

                for attempt in range(3):
                    # the failed online run can keep holding its run id ("run ID is in use"): after one
                    # retry under the run's own id, log offline under a new one
                    run_id = self._wandb_id() if attempt < 2 else self._wandb_id() + "-offline"
                    try:
                        wandb.teardown()
                        self.wandb_run = self._init_wandb("offline", run_id)
                        self.wandb_warning = (
                            f"W&B unreachable ({why}); logging offline in {self.run_dir / 'wandb'} "
                            f"as run {run_id} (upload later with `wandb sync`)"
                        )
                        logger.warning(f"warning: {self.wandb_warning}")
                        return
                    except Exception as e2:
                        last = error_line(e2)
                        if attempt < 2:
                            time.sleep(1.0 + attempt)
                why = last
            self.wandb_warning = f"W&B disabled for this run ({why})"
            logger.warning(f"warning: {self.wandb_warning}")

    def _init_wandb(self, mode: str, run_id: str | None = None) -> Any:
        t = self.cfg.tracking
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import wandb

            return wandb.init(
                project=t.project,
                entity=t.entity,
                name=t.name or self.run_dir.name,
                group=t.group,
                tags=t.tags or None,
                config=self.cfg.to_dict(),
                dir=str(self.run_dir),
                mode=cast(Literal["online", "offline", "disabled"], mode),  # wandb_mode of a validated tracking.mode
                id=run_id or self._wandb_id(),
                resume="allow",
                # flush the offline log every second (default 15 s): a process killed without
                # finishing (a trial stopped by ASHA, SIGKILL) keeps its history up to then
                settings=wandb.Settings(
                    silent=True, console="off", init_timeout=t.init_timeout_s, x_transaction_log_flush_interval=1.0
                ),
            )

    def _wandb_id(self) -> str:
        """A stable W&B run id stored in the run dir, so a resumed run continues the same W&B run."""
        p = self.run_dir / "wandb_id.txt"
        if p.is_file():
            return p.read_text().strip()
        import secrets

        rid = secrets.token_hex(4)
        p.write_text(rid)
        return rid

    def log(self, row: dict[str, Any]) -> None:
        """Append one row to ``metrics.jsonl``; mirror its numbers to W&B (nested dicts as ``key/sub``)."""
        row = {k: _clean(v) for k, v in row.items()}
        self._file.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            try:
                flat = {}
                for k, v in row.items():  # nested per-replica dicts become "key/replica_m"
                    items = v.items() if isinstance(v, dict) else [(None, v)]
                    for sub, x in items:
                        if isinstance(x, (int, float)) and not isinstance(x, bool) and x is not None:
                            flat[k if sub is None else f"{k}/{sub}"] = x
                if row.get("events"):  # membership events as a table (the counts are in membership/*)
                    import wandb

                    self._events += [
                        [
                            row.get("outer_step"),
                            e.get("event"),
                            e.get("replica"),
                            json.dumps({x: y for x, y in e.items() if x not in ("event", "replica")}),
                        ]
                        for e in row["events"]
                    ]
                    flat["membership_events"] = wandb.Table(
                        columns=["outer_step", "event", "replica", "info"], data=self._events
                    )
                self.wandb_run.log(flat, step=int(row.get("inner_step", 0)))
            except Exception as e:
                logger.warning(f"warning: W&B logging stopped ({type(e).__name__})")
                self.wandb_run = None

    def progress(self, steps: int, **postfix: Any) -> None:
        """Advance the progress bar by ``steps`` inner steps and show ``postfix``."""
        if self.bar is not None:
            self.bar.update(steps)
            self.bar.set_postfix({k: v for k, v in postfix.items() if v is not None}, refresh=True)

    def finish(self, summary: dict[str, Any]) -> None:
        """Close the bar and metrics file; put ``summary`` into the W&B run summary and finish it."""
        if self.bar is not None:
            self.bar.close()
        self._file.close()
        if self.wandb_run is not None:
            try:
                for k, v in summary.items():
                    if isinstance(v, (int, float, str)):
                        self.wandb_run.summary[k] = v
                if self.cfg.tracking.log_model and summary.get("export_dir"):
                    import wandb

                    art = wandb.Artifact(
                        f"model-{self.run_dir.name}",
                        type="model",
                        metadata={
                            k: summary.get(k) for k in ("final_eval_loss", "num_parameters", "tokens", "algorithm")
                        },
                    )
                    art.add_dir(summary["export_dir"])
                    self.wandb_run.log_artifact(art)
                self.wandb_run.finish()
                _wait_for_wandb_files()
            except Exception as e:
                logger.warning(f"warning: W&B finish failed ({type(e).__name__})")


def _wait_for_wandb_files() -> None:
    """Return once W&B has written the finished run's files (the ``.wandb`` log in ``run_dir``).

    ``run.finish()`` returns when wandb-core has *processed* the run's last records, not when it
    has written them: the core buffers the run's ``.wandb`` transaction log and flushes and
    closes it when the run's stream closes, which ``finish()`` only requests (a message with no
    reply) on its way out. Right after ``finish()`` the offline log of a short run can still be
    its 7-byte header alone; its history, summary and model artifact land a moment later (much
    later on a loaded machine). ``wandb.teardown()`` waits for the core process to close every
    stream and exit, so the log is complete when :meth:`Tracker.finish` returns and the launcher
    writes ``summary.json`` after it ("a finished run, W&B included"); the next ``wandb.init`` in
    this process starts a new core. Skipped while another W&B run of this process is still open
    (``wandb.run``): teardown would finish that one too (this log is then completed when its
    stream closes).
    """
    import wandb

    if wandb.run is not None:
        return
    try:
        wandb.teardown()
    except SystemExit as e:  # teardown exits the process when wandb-core itself exited non-zero
        raise RuntimeError(f"wandb-core exited with code {e.code}") from None


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """``summary.json`` (written atomically): final results for scripts and sweeps."""
    path = Path(run_dir) / "summary.json"
    write_text(path, json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2, default=str) + "\n")
    return path
