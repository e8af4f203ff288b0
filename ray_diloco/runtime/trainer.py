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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ray_diloco.components.checkpoint import global_params
from ray_diloco.components.data import Corpus, val_windows
from ray_diloco.components.export import check_sizes
from ray_diloco.components.mirror import Mirror
from ray_diloco.components.tracking import Tracker
from ray_diloco.config import Config
from ray_diloco.core.fragments import fragment_plan
from ray_diloco.core.schedules import is_due, outer_step_bounds
from ray_diloco.errors import ConfigError
from ray_diloco.models.transformer import ModelFn
from ray_diloco.runtime.checkpointing import restore_workers, write_checkpoint
from ray_diloco.runtime.cluster import Replica, all_workers, check_resources, start_replicas, stop_replicas
from ray_diloco.runtime.membership import Membership
from ray_diloco.runtime.resolved import ResolvedRun
from ray_diloco.runtime.strategy import SyncStrategy, make_strategy
from ray_diloco.runtime.supervisor import Supervisor

logger = logging.getLogger(__name__)


@dataclass
class RunState:
    """Counters carried across outer steps and into checkpoints."""

    outer_step: int = 0
    inner_step: int = 0
    tokens: int = 0
    bytes_sent: int = 0  # replicas -> outer optimiser, all replicas (serialised messages)
    bytes_received: int = 0  # outer optimiser -> replicas, all replicas
    peak_sync_bytes: int = 0  # largest up + down of one fragment sync of one replica
    sync_events: int = 0  # fragment syncs, summed over replicas
    inner_compute_s: float = 0.0  # mean over workers
    train_wall_s: float = 0.0  # wall seconds of the training rounds (no eval/checkpoint)
    sync_wait_s: float = 0.0  # seconds a worker's training thread was blocked on the link (mean over workers)
    membership: dict[str, int] = field(default_factory=dict)  # event kind -> count (death, join, rejected, ...)
    last_eval: float | None = None
    evals: list[tuple[int, float]] = field(default_factory=list)

    def add_round(self, k: int, end: int, tokens: int, link: list[dict[str, Any]]) -> tuple[int, int]:
        """Count outer step ``k`` (ending at inner step ``end``): its tokens and the bytes of
        ``link`` (the metrics of the ranks on the slow link). Returns ``(sent, received)``."""
        sent = sum(mtr["link"]["bytes_up"] for mtr in link)
        received = sum(mtr["link"]["bytes_down"] for mtr in link)
        self.outer_step, self.inner_step = k, end
        self.tokens += tokens
        self.bytes_sent += sent
        self.bytes_received += received
        self.peak_sync_bytes = max([self.peak_sync_bytes] + [mtr["link"].get("peak_event_bytes", 0) for mtr in link])
        self.sync_events += sum(mtr["link"].get("events", 0) for mtr in link)
        return sent, received


class Trainer:
    """A DiLoCo (or DP) run on Ray. Use :func:`ray_diloco.train` unless you need the pieces.

    Args:
        cfg: validated config (not changed: the run uses ``resolved.apply(cfg)``, :attr:`cfg`).
        run_dir: the run directory (created by the launcher).
        corpus: tokenised corpus. model_fn: optional model builder (see ``models.transformer.ModelFn``).
        resume_state: a loaded checkpoint to continue from, or None.
        resolved: what the launcher resolved (the token budget); default: ``run.steps`` as given.
    """

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        corpus: Corpus,
        model_fn: ModelFn | None = None,
        resume_state: dict[str, Any] | None = None,
        resolved: ResolvedRun | None = None,
    ):
        self.user_cfg = cfg
        self.resolved = resolved or ResolvedRun.resolve(cfg)
        self.cfg = self.resolved.apply(cfg)  # config.yaml and checkpoints record the model trained, not a preset
        self.run_dir, self.corpus, self.model_fn = run_dir, corpus, model_fn
        self.resume_state = resume_state
        self.state = RunState()
        self.replicas: list[Replica] = []
        self.sync: SyncStrategy = make_strategy(self.cfg)
        self.num_fragments = 1
        self.members: Membership | None = None
        self.supervisor: Supervisor | None = None
        self.mirror: Mirror | None = None  # run.storage_path is a URI: copy of the run directory there
        self.on_outer_step: Any = None  # called with each outer step's metrics row (Ray Tune reports)

    @property
    def driver(self) -> Any:
        """The outer-optimiser driver actor (None for the DP baseline)."""
        return self.sync.driver

    @property
    def schedule(self) -> Any:
        """The fragments' :class:`~ray_diloco.core.schedules.SyncSchedule` (None for the DP baseline)."""
        return self.sync.schedule

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
        self.members = Membership(self.cfg, refs, self.corpus.vocab_size, self.model_fn, self.replicas)
        self.members.load_state_dict(saved)
        self.replicas = self.members.live  # the same list: it changes as replicas die and join
        self.supervisor = Supervisor(self.cfg, self.run_dir, self.sync, self.members)
        self._plan_fragments()
        if rs is not None:
            check_sizes(self.fragments, rs["sizes"] if "sizes" in rs else global_params(rs))
        self.sync.attach(self, rs)
        if rs is not None:  # after the global parameters: a worker's local ones may differ from them
            self._restore_workers(rs)
            cnt = rs["counters"]
            self.state = RunState(
                **{k: cnt[k] for k in RunState.__dataclass_fields__ if k in cnt and k != "evals"},
                evals=[tuple(e) for e in cnt.get("evals", [])],
            )

    def _plan_fragments(self) -> None:
        """The fragments of the model the workers built, checked against the schedule, and the
        start-up lines describing the run."""
        import ray

        c = self.cfg
        specs = ray.get(self.replicas[0].rank0.param_specs.remote())
        try:
            self.fragments = fragment_plan(c, specs)
        except ValueError as e:
            raise ConfigError([str(e)]) from None
        self.num_fragments = len(self.fragments)
        problems = self.sync.check_fragments(self.num_fragments)
        if problems:
            raise ConfigError(problems)
        self.num_params = sum(s.numel for s in specs)
        tokens = c.run.steps * c.inner.global_batch * c.data.seq_len
        logger.info(
            f"model: {self.num_params:,} parameters ({self.num_params / 1e6:.2f}M), "
            f"{len(specs)} tensors, {self.num_fragments} fragment(s)"
        )
        assert self.members is not None  # set by start
        shape, *more = self.sync.header(self.members.target)
        logger.info(
            f"{c.algorithm}: {shape}, global batch {c.inner.global_batch} x {c.data.seq_len} tokens, "
            f"{tokens / 1e6:.2f}M tokens"
        )
        for line in more:
            logger.info(line)

    def _restore_workers(self, rs: dict[str, Any]) -> None:
        """Each worker's state from the checkpoint ``rs`` (:func:`~ray_diloco.runtime.checkpointing.restore_workers`)."""
        restore_workers(self, rs)

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
                self.supervisor.slowest_round = max(self.supervisor.slowest_round or 0.0, wall)
                break
            logger.warning(f"outer step {k}: every replica failed; running it again once replacements join")
        row: dict[str, Any] = {"outer_step": k, "inner_step": end}
        link, n_tokens = self.sync.round_traffic(metrics, start, end)
        sent, received = self.state.add_round(k, end, n_tokens, link)
        self.sync.outer_metrics(self, row, metrics, end)
        row.update(self._round_fields(metrics, wall, n_tokens, sent, received))
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
        self.sync.final_fields(self, row)
        return row

    def _round_fields(
        self, metrics: list[dict[str, Any]], wall: float, n_tokens: int, sent: int, received: int
    ) -> dict[str, Any]:
        """Loss, lr, throughput, time split and bytes of one outer step (and the running totals)."""
        st = self.state
        by_replica: dict[int, dict[str, Any]] = {}
        for mtr in metrics:
            by_replica.setdefault(mtr["replica"], mtr)
        loss_ids = sorted(by_replica)
        losses = [by_replica[m]["train_loss"] for m in loss_ids]
        compute_s = float(np.mean([mtr["compute_s"] for mtr in metrics]))
        st.inner_compute_s += compute_s
        st.train_wall_s += wall
        sync_wait = float(np.mean([mtr["sync_wait_s"] for mtr in metrics]))  # part of outer_wait_s
        st.sync_wait_s += sync_wait
        return {
            "train_loss": float(np.mean(losses)),
            "train_loss_replica": {f"replica_{m}": v for m, v in zip(loss_ids, losses)},
            "inner_lr": metrics[0]["inner_lr"],
            "tokens": st.tokens,
            "tokens_per_s": n_tokens / wall if wall > 0 else None,
            "inner_compute_s": compute_s,
            "sync_wait_s": sync_wait,
            "outer_wait_s": max(0.0, wall - compute_s),
            "compute_utilisation": compute_s / wall if wall > 0 else None,
            "round_s": wall,
            "bytes_sent": sent,
            "bytes_received": received,
            "bytes_sent_total": st.bytes_sent,
            "bytes_received_total": st.bytes_received,
            "peak_sync_bytes": st.peak_sync_bytes,
        }

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

        fsdp = self.cfg.exchange_units > 1  # every rank of a replica forwards together, windows or not

        def chunk(r, rank, i, n_workers):
            c = np.array_split(windows, n_workers)[i]
            return (c, globals_) if len(c) or fsdp else None

        assert self.supervisor is not None  # set by start
        parts = list(self.supervisor.on_live("evaluate", chunk).values())
        total = sum(p[0] for p in parts)
        count = sum(p[1] for p in parts)
        return total / count

    def checkpoint(self) -> Path:
        """Write a checkpoint atomically, each process its own state
        (:func:`~ray_diloco.runtime.checkpointing.write_checkpoint`)."""
        return write_checkpoint(self)

    def global_params(self) -> list[np.ndarray]:
        """The global parameters, fp32 ``[numel_p]`` per fragment (DP: rank 0's parameters)."""
        self.settle()
        return self.sync.global_params(self)

    # -- the loop --------------------------------------------------------------------------
    def run(self, tracker: Tracker) -> dict[str, Any]:
        """The outer-step loop from the current state to ``run.steps``; evals and checkpoints
        when due. Returns wall, inner-compute and outer-wait seconds."""
        cfg = self.cfg
        last = cfg.num_outer_steps
        t_start = time.perf_counter()
        compute_total = wait_total = 0.0
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


__all__ = ["Trainer", "RunState"]
