"""The outer-step loop: replicas train H inner steps, the syncs land, then eval and checkpoints.

The trainer drives outer steps of H inner steps (``train(start, end)`` on every worker); the
syncs themselves run inside the workers on the pure ``SyncSchedule`` (DiLoCo, arXiv 2311.08105,
Algorithm 1; Streaming DiLoCo, arXiv 2501.18512, section 2)::

    worker (training thread)   inner AdamW steps; at fragment p's sync step: delta_p = global_p - local_p
    worker (link thread)       quantise delta_p -> OuterDriver.exchange(p, round, ...) -> reply
    OuterDriver actor          once the live replicas sent (or the timeout, with a quorum): mean,
                               outer step, quantised reply
    worker (training thread)   tau steps later: local_p <- alpha*local_p + (1-alpha)*new global_p

Before an evaluation, a checkpoint or the export the trainer waits until the driver has
completed every sync sent so far. How replicas synchronise (DiLoCo or the DP baseline) is the
:class:`~ray_diloco.runtime.strategy.SyncStrategy`'s business; failures and joins are the
:class:`~ray_diloco.runtime.supervisor.Supervisor`'s; this loop has no algorithm branches. The
launcher (``runtime/launcher.py``, :func:`~ray_diloco.runtime.launcher.train`) creates the run
directory, starts Ray, runs this loop and exports the model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ray_diloco.components.checkpoint import global_params
from ray_diloco.components.data import Corpus, val_windows
from ray_diloco.components.export import check_sizes
from ray_diloco.components.mirror import Mirror
from ray_diloco.components.tracking import Tracker
from ray_diloco.config import Config
from ray_diloco.core.fragments import Fragment, fragment_plan
from ray_diloco.core.schedules import is_due, outer_step_bounds
from ray_diloco.errors import ConfigError
from ray_diloco.models.transformer import ModelFn
from ray_diloco.runtime.checkpointing import Checkpointer
from ray_diloco.runtime.cluster import Replica, all_workers, check_resources, start_replicas, stop_replicas
from ray_diloco.runtime.layout import ReplicaLayout
from ray_diloco.runtime.membership import Membership
from ray_diloco.runtime.resolved import ResolvedRun
from ray_diloco.runtime.run_state import RunState
from ray_diloco.runtime.strategy import SyncStrategy, make_strategy
from ray_diloco.runtime.supervisor import Supervisor

logger = logging.getLogger(__name__)


def _refuse_nonfinite(init_from: str | None, per_worker: list[list[str]]) -> None:
    """Raise :class:`ConfigError` when a worker's loaded ``model.init_from`` parameters hold a NaN
    or infinity (``per_worker``: each worker's such names): every outer round would be rejected as
    non-finite and the run would end at NaN."""
    bad = sorted({name for names in per_worker for name in names})
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise ConfigError([f"model.init_from = {init_from!r}: its weights hold NaN or infinity ({bad[0]}{more})"])


class Trainer:
    """A DiLoCo (or DP) run on Ray. Use :func:`ray_diloco.train` unless you need the pieces.

    Args:
        cfg: validated config (not changed: the run uses ``resolved.apply(cfg)``, :attr:`cfg`).
        run_dir: the run directory (created by the launcher).
        corpus: tokenised corpus. model_fn: optional model builder (see ``models.transformer.ModelFn``).
        resume_state: a loaded checkpoint to continue from, or None.
        resolved: what the launcher resolved (the token budget); default: ``run.steps`` as given.
        mirror: the copy of the run directory in ``run.storage_path`` (a URI), or None.
        on_outer_step: called with each outer step's metrics row (Ray Tune reports), or None.
    """

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        corpus: Corpus,
        model_fn: ModelFn | None = None,
        resume_state: dict[str, Any] | None = None,
        resolved: ResolvedRun | None = None,
        mirror: Mirror | None = None,
        on_outer_step: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.resolved = resolved or ResolvedRun.resolve(cfg)
        self.cfg = self.resolved.apply(cfg)  # config.yaml and checkpoints record the model trained, not a preset
        self.run_dir, self.corpus, self.model_fn = run_dir, corpus, model_fn
        self.resume_state = resume_state
        self.state = RunState()
        self.replicas: list[Replica] = []
        self.sync: SyncStrategy = make_strategy(self.cfg)
        self.mirror, self.on_outer_step = mirror, on_outer_step
        self.fragments: list[Fragment] = []  # the model's (set by start)
        self.num_params = self.num_tensors = 0
        self.members: Membership | None = None
        self.supervisor: Supervisor | None = None
        self.checkpointer: Checkpointer | None = None

    @property
    def driver(self) -> Any:
        """The outer-optimiser driver actor (None for the DP baseline)."""
        return self.sync.driver

    @property
    def schedule(self) -> Any:
        """The fragments' :class:`~ray_diloco.core.schedules.SyncSchedule` (None for the DP baseline)."""
        return self.sync.schedule

    @property
    def num_fragments(self) -> int:
        """How many fragments the model is exchanged in (1: plain DiLoCo)."""
        return len(self.fragments)

    # -- set-up ----------------------------------------------------------------------------
    def start(self) -> None:
        """Check resources, start the replicas and the sync side (DiLoCo: the outer-optimiser
        driver), load the global parameters into every worker, and restore a checkpoint when
        resuming.

        Raises:
            ConfigError: the model cannot be cut into ``streaming.fragments``, or the overlap
                does not fit the resulting number of fragments.
        """
        import ray

        self.resolved = self.resolved.with_cpus(check_resources(self.cfg))
        self.cfg.diloco.cpus_per_worker = self.resolved.cpus_per_worker
        assert self.cfg.diloco.cpus_per_worker is not None  # just resolved
        if self.cfg.diloco.cpus_per_worker < 1:
            logger.info(
                f"note: {self.cfg.num_shards} workers share the cluster's CPUs "
                f"({self.cfg.diloco.cpus_per_worker:g} CPU each)"
            )
        refs = (ray.put(self.corpus.train), ray.put(self.corpus.val))
        rs = self.resume_state
        saved = (rs or {}).get("membership") or {}
        members = [tuple(m) for m in saved.get("members", [])] or None
        self.sync.launch(members)  # its process starts (imports) while the replicas start
        self.replicas = start_replicas(
            self.cfg,
            refs,
            self.corpus.vocab_size,
            self.model_fn,
            self.sync.layout(self.cfg, members),
            self.sync.allreduce_emulation(self.cfg),
        )
        self._plan_fragments()
        m = self.members = Membership(self.cfg, refs, self.corpus.vocab_size, self.model_fn, self.replicas,
                                      driver=self.sync.driver, schedule=self.sync.schedule)  # fmt: skip
        m.load_state_dict(saved)
        self.replicas = m.live  # the same list: it changes as replicas die and join
        self._log_header(m.target)
        self.supervisor = Supervisor(self.cfg, self.run_dir, self.sync, m)
        self.checkpointer = Checkpointer(self.cfg, self.run_dir, self.supervisor, self.sync, m, self.mirror,
                                         self.corpus.fingerprint, custom_model=self.model_fn is not None)  # fmt: skip
        if rs is not None:
            check_sizes(self.fragments, rs["sizes"] if "sizes" in rs else global_params(rs))
        self.sync.attach(self.replicas, rs)
        if rs is not None:  # after the global parameters: a worker's local ones may differ from them
            self.checkpointer.restore_workers(rs)
            cnt = rs["counters"]
            self.state = RunState(
                **{k: cnt[k] for k in RunState.__dataclass_fields__ if k in cnt and k != "evals"},
                evals=[tuple(e) for e in cnt.get("evals", [])],
            )

    def _plan_fragments(self) -> None:
        """The fragments of the model the workers built, checked against the schedule (the
        strategy's :meth:`~ray_diloco.runtime.strategy.SyncStrategy.plan`)."""
        import ray

        specs = ray.get(self.replicas[0].rank0.param_specs.remote())
        try:
            self.fragments = fragment_plan(self.cfg, specs)
        except ValueError as e:
            raise ConfigError([str(e)]) from None
        problems = self.sync.plan(self.fragments)
        if problems:
            raise ConfigError(problems)
        self.num_params, self.num_tensors = sum(s.numel for s in specs), len(specs)

    def _log_header(self, target: int) -> None:
        """The start-up lines describing the run (``target``: the replicas it aims at)."""
        c = self.cfg
        tokens = c.run.steps * c.inner.global_batch * c.data.seq_len
        logger.info(
            f"model: {self.num_params:,} parameters ({self.num_params / 1e6:.2f}M), "
            f"{self.num_tensors} tensors, {self.num_fragments} fragment(s)"
        )
        shape, *more = self.sync.header(target)
        logger.info(
            f"{c.algorithm}: {shape}, global batch {c.inner.global_batch} x {c.data.seq_len} tokens, "
            f"{tokens / 1e6:.2f}M tokens"
        )
        for line in more:
            logger.info(line)

    # -- one outer step --------------------------------------------------------------------
    def outer_step(self, k: int) -> dict[str, Any]:
        """Run outer step ``k`` (1-based): inner steps ``outer_step_bounds(k)`` on every live
        worker, with the fragment syncs due in them running inside the workers
        (``ReplicaWorker.train``); membership changes at its start. Returns its metrics row
        (the fields of ``metrics.jsonl``) and advances :attr:`state`.

        A replica that fails is removed (DiLoCo); when every replica failed the step runs again
        once replacements joined.
        """
        cfg = self.cfg
        start, end = outer_step_bounds(k, cfg.diloco.H, cfg.run.steps)
        assert self.supervisor is not None  # set by start
        while True:
            self.supervisor.at_boundary(start)
            t0 = time.perf_counter()
            calls = {w.train.remote(start, end): r for r in self.replicas for w in r.workers}
            metrics = self.supervisor.gather(calls, straggler_s=self.sync.straggler_s())
            wall = time.perf_counter() - t0
            if metrics:
                self.supervisor.round_done(wall)
                break
            logger.warning(f"outer step {k}: every replica failed; running it again once replacements join")
        row: dict[str, Any] = {"outer_step": k, "inner_step": end}
        link, n_tokens = self.sync.round_traffic(metrics, start, end)
        sent, received = self.state.add_round(k, end, n_tokens, link)
        row.update(self.sync.outer_fields(end))
        if self.sync.elastic:
            row.update(self.supervisor.membership_fields(k, metrics, self.state.membership))
        row.update(self.state.round_fields(metrics, wall, n_tokens, sent, received))
        if cfg.run.log_hashes:
            row["data_digest"] = [mtr["data_digest"] for mtr in metrics]
            self.settle()
            row.update({f"{key}_sha256": v for key, v in self.sync.state_hashes().items()})
            row["worker_global_sha256"] = self.supervisor.gather(
                {w.global_hash.remote(): r for r in self.replicas for w in r.workers}
            )
            # each worker's local parameters after the round (a replica's ranks hold the same; FSDP: its rows)
            row["worker_params_sha256"] = self.supervisor.gather(
                {w.params_hash.remote(): r for r in self.replicas for w in r.workers}
            )
        if self.sync.elastic:
            row["replicas_live"] = len(self.replicas)  # after this step's deaths
        return row

    def settle(self) -> None:
        """Wait until every sync sent so far is answered by the driver (before eval, checkpoint
        or export); a replica that fails meanwhile is removed (DiLoCo) or raises (DP)."""
        assert self.supervisor is not None  # set by start
        self.supervisor.settle()

    def evaluate(self) -> float:
        """Validation loss (nats/token) of the global parameters over the whole validation split,
        spread across all workers."""
        self.settle()
        globals_ = self.sync.eval_globals()
        windows = np.arange(val_windows(self.corpus.val, self.cfg.data.seq_len))

        sharded = ReplicaLayout.of_run(self.cfg).sharded  # every rank forwards together, windows or not

        def chunk(r, rank, i, n_workers):
            c = np.array_split(windows, n_workers)[i]
            return (c, globals_) if len(c) or sharded else None

        assert self.supervisor is not None  # set by start
        parts = list(self.supervisor.on_live("evaluate", chunk).values())
        total = sum(p[0] for p in parts)
        count = sum(p[1] for p in parts)
        return total / count

    def checkpoint(self) -> Path:
        """Write a checkpoint atomically, each process its own state
        (:meth:`~ray_diloco.runtime.checkpointing.Checkpointer.write`)."""
        assert self.checkpointer is not None  # set by start
        return self.checkpointer.write(self.state, self.fragments)

    def global_params(self) -> list[np.ndarray]:
        """The global parameters, fp32 ``[numel_p]`` per fragment (DP: rank 0's parameters)."""
        self.settle()
        return self.sync.global_params(self.replicas)

    def starting_row(self) -> dict[str, Any]:
        """Row 0 of a run from ``model.init_from``: each worker's sha256 of its starting parameters
        (DDP: the loaded model's, equal everywhere; FSDP: a rank's rows) and, when the run
        evaluates, the loaded model's validation loss before any training. Raises ConfigError: the
        loaded weights hold a NaN or infinity."""
        assert self.supervisor is not None  # set by start
        workers = [(r, w) for r in self.replicas for w in r.workers]
        nonfinite = self.supervisor.gather({w.nonfinite_params.remote(): r for r, w in workers})
        _refuse_nonfinite(self.cfg.model.init_from, nonfinite)
        hashes = self.supervisor.gather({w.params_hash.remote(): r for r, w in workers})
        row: dict[str, Any] = {"outer_step": 0, "inner_step": 0, "start_params_sha256": hashes}
        if self.cfg.run.eval_every:
            row["eval_loss"] = self.evaluate()
        loss = f"validation loss {row['eval_loss']:.4f}, " if "eval_loss" in row else ""
        logger.info(
            f"model.init_from {self.cfg.model.init_from}: {loss}parameters sha256 "
            f"{', '.join(sorted(set(h[:16] for h in hashes)))} on {len(hashes)} worker(s)"
        )
        return row

    # -- the loop --------------------------------------------------------------------------
    def run(self, tracker: Tracker) -> dict[str, Any]:
        """The outer-step loop from the current state to ``run.steps``; evals and checkpoints
        when due. Returns wall, inner-compute and outer-wait seconds."""
        cfg = self.cfg
        last = cfg.num_outer_steps
        t_start = time.perf_counter()
        compute_total = wait_total = 0.0
        if self.state.outer_step == 0 and cfg.model.init_from:
            tracker.log(self.starting_row())
        for k in range(self.state.outer_step + 1, last + 1):
            row = self.outer_step(k)
            compute_total += row["inner_compute_s"]
            wait_total += row["outer_wait_s"]
            if is_due(k, cfg.run.eval_every, last):
                self.state.last_eval = self.evaluate()
                self.state.evals.append((k, self.state.last_eval))
                row["eval_loss"] = self.state.last_eval
            saved = is_due(k, cfg.run.checkpoint_every, last)
            tracker.log(row)  # before the checkpoint: a kill between them resumes from the previous one
            if saved:
                self.checkpoint()
            if saved and self.mirror is not None:  # after the row: the stored metrics reach the checkpoint
                self.mirror.sync()
            if self.on_outer_step is not None:
                self.on_outer_step({**row, "wandb_warning": tracker.wandb_warning} if tracker.wandb_warning else row)
            self._progress(tracker, k, last, row)
        wall = time.perf_counter() - t_start
        return {"wall_s": wall, "inner_compute_s": compute_total, "outer_wait_s": wait_total}

    def _progress(self, tracker: Tracker, k: int, last: int, row: dict[str, Any]) -> None:
        tracker.progress(
            row["inner_step"] - outer_step_bounds(k, self.cfg.diloco.H, self.cfg.run.steps)[0],
            outer=f"{k}/{last}",
            loss=f"{row['train_loss']:.3f}",
            eval=None if self.state.last_eval is None else f"{self.state.last_eval:.3f}",
            tok_s=f"{row['tokens_per_s']:.0f}",
            replicas=f"{row['replicas_live']}/{row['replicas_target']}" if "replicas_live" in row else None,
        )

    def shutdown(self) -> None:
        """Leave process groups, kill the actors, remove the placement groups. Workers still busy
        (blocked on a sync whose peer died) get 10 seconds in all, then are killed."""
        import ray

        if self.supervisor is not None:
            self.supervisor.close()
        refs = []
        for w in all_workers(self.replicas):
            try:
                refs.append(w.shutdown.remote())
            except Exception:  # an actor handle that is already dead
                pass
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=10)
        if self.members is not None:
            self.members.shutdown()
        stop_replicas(self.replicas)
        self.sync.shutdown()
        self.replicas = []


__all__ = ["Trainer"]
