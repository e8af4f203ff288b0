"""Orchestration of a run: Ray start-up, replicas, the outer-step loop, eval, checkpoints, export.

The trainer drives outer steps of H inner steps (``train(start, end)`` on every worker); the
syncs themselves run inside the workers on the pure ``SyncSchedule`` (DiLoCo, arXiv 2311.08105,
Algorithm 1; Streaming DiLoCo, arXiv 2501.18512, section 2)::

    worker (training thread)   inner AdamW steps; at fragment p's sync step: delta_p = global_p - local_p
    worker (link thread)       quantise delta_p -> OuterDriver.exchange(p, round, ...) -> reply
    OuterDriver actor          once the live replicas sent (or the timeout, with a quorum): mean,
                               outer step, quantised reply
    worker (training thread)   tau steps later: local_p <- alpha*local_p + (1-alpha)*new global_p

Before an evaluation, a checkpoint or the export the trainer waits until the driver has
completed every sync sent so far. Replica deaths, replacements and joins are handled by
:class:`~ray_diloco.runtime.membership.Membership` (see there) between and during outer steps.

``algorithm: dp`` runs the data-parallel baseline with the same workers, data, inner optimiser
and schedule: one DDP group over all M x W workers and no outer step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from ray_diloco.components.checkpoint import (
    checkpoint_config,
    global_params,
    list_checkpoints,
    load_checkpoint,
    lock_run_dir,
    remove_partial_checkpoints,
    save_checkpoint,
)
from ray_diloco.runtime.cluster import (Replica, all_workers, check_resources, error_cause, init_ray, initial_members, start_replicas,
                      stop_replicas)
from ray_diloco.runtime.membership import Membership, read_scale
from ray_diloco.config import Config, check_overlap, load_config
from ray_diloco.components.data import Corpus, load_corpus, load_saved_tokenizer, num_train_windows, val_windows
from ray_diloco.errors import CheckpointError, ClusterError, ConfigError, DataError
from ray_diloco.core.wire import communication_summary
from ray_diloco.components.export import check_sizes, export_model
from ray_diloco.models.transformer import ModelFn, pin_model_fields
from ray_diloco.core.fragments import fragment_plan
from ray_diloco.core.schedules import SyncSchedule, is_due, outer_step_bounds
from ray_diloco.components.storage import Mirror, download_run, filesystem, is_uri, join_uri, write_text
from ray_diloco.components.tracking import Tracker, write_summary


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


# ---------------------------------------------------------------------------------------
# run directory


def _run_dir_for(cfg: Config) -> Path:
    """The new run's directory (not created yet).

    Raises:
        ConfigError: if it exists and is not empty (an existing run is never overwritten).
    """
    if cfg.run.name is None:  # fixed once, so checking and creating name the same directory
        cfg.run.name = datetime.now().strftime("%Y%m%d-%H%M%S") + f"-{cfg.algorithm}-{secrets.token_hex(2)}"
    remote = is_uri(cfg.run.storage_path)
    out = Path(cfg.run.storage_path if cfg.run.storage_path and not remote else cfg.run.output_dir).expanduser()
    blocker = next((p for p in [out, *out.parents] if p.exists()), None)
    if blocker is not None and (not blocker.is_dir() or not os.access(blocker, os.W_OK | os.X_OK)):
        raise ConfigError([f"run.output_dir = {cfg.run.output_dir!r}: {blocker} is not a writable directory"])
    run_dir = out / cfg.run.name
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError([f"run.name = {cfg.run.name!r}: {run_dir} exists and is not a directory"])
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError([f"run.name = {cfg.run.name!r}: run directory {run_dir} already exists and is not empty "
                           f"(resume it with --resume {run_dir}, or choose another run.name)"])
    if remote:
        uri = join_uri(cfg.run.storage_path, cfg.run.name)
        fs, path = filesystem(uri)
        try:
            exists = fs.get_file_info(f"{path}/config.yaml").type.name == "File"
        except Exception as e:
            raise ConfigError([f"run.storage_path = {cfg.run.storage_path!r}: cannot reach it "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"]) from None
        if exists:
            raise ConfigError([f"run.name = {cfg.run.name!r}: {uri} already holds a run (resume it with --resume "
                               f"{uri}, or choose another run.name)"])
    return run_dir


def _new_run_dir(cfg: Config) -> Path:
    run_dir = _run_dir_for(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _truncate_metrics(run_dir: Path, outer_step: int) -> None:
    """Drop metric rows written after the checkpoint a resume starts from."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("outer_step", 0) <= outer_step:
                keep.append(line)
        except json.JSONDecodeError:
            continue
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(k + "\n" for k in keep))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------
# the run


class Trainer:
    """A DiLoCo (or DP) run on Ray. Use :func:`train` unless you need the pieces.

    Args:
        cfg: validated config. run_dir: the run directory (created by :func:`train`).
        corpus: tokenised corpus. model_fn: optional model builder (see ``model.ModelFn``).
        resume_state: a loaded checkpoint to continue from, or None.
    """

    def __init__(self, cfg: Config, run_dir: Path, corpus: Corpus, model_fn: ModelFn | None = None,
                 resume_state: dict[str, Any] | None = None):
        pin_model_fields(cfg.model)  # config.yaml and checkpoints record the model trained, not a preset name
        self.cfg, self.run_dir, self.corpus, self.model_fn = cfg, run_dir, corpus, model_fn
        self.resume_state = resume_state
        self.state = RunState()
        self.replicas: list[Replica] = []
        self.outer = None
        self.schedule: SyncSchedule | None = None
        self.num_fragments = 1
        self.members: Membership | None = None
        self._slowest_round: float | None = None  # wall seconds of the slowest outer step completed so far
        self.mirror: Mirror | None = None  # run.storage_path is a URI: copy of the run directory there
        self.on_outer_step: Any = None  # called with each outer step's metrics row (Ray Tune reports)
        self.log = lambda msg: print(msg, file=sys.stderr)  # run() routes it through the progress bar

    # -- set-up ----------------------------------------------------------------------------
    def start(self) -> None:
        """Check resources, start the replicas and the outer-optimiser driver, load the global
        parameters into every worker, and restore a checkpoint when resuming.

        Raises:
            ConfigError: the model cannot be cut into ``streaming.fragments``, or the overlap
                does not fit the resulting number of fragments.
        """
        import ray

        from ray_diloco.runtime.driver import OuterDriverActor

        self.cfg.diloco.cpus_per_worker = check_resources(self.cfg)
        if self.cfg.diloco.cpus_per_worker < 1:
            print(f"note: {self.cfg.num_shards} workers share the cluster's CPUs "
                  f"({self.cfg.diloco.cpus_per_worker:g} CPU each)", file=sys.stderr)
        refs = (ray.put(self.corpus.train), ray.put(self.corpus.val))
        rs = self.resume_state
        saved = (rs or {}).get("membership") or {}
        members = [tuple(m) for m in saved.get("members", [])] or None
        c = self.cfg
        if c.algorithm == "diloco":  # its process starts (imports) while the replicas start
            joins = {m: j for m, _, j in initial_members(c, members)}
            self.outer = OuterDriverActor.remote(None, c.to_dict(), joins)
        self.replicas = start_replicas(self.cfg, refs, self.corpus.vocab_size, self.model_fn, members)
        self.members = Membership(self.cfg, refs, self.corpus.vocab_size, self.model_fn, self.replicas)
        self.members.load_state_dict(saved)
        self.replicas = self.members.live  # the same list: it changes as replicas die and join
        w0 = self.replicas[0].rank0
        specs = ray.get(w0.param_specs.remote())
        try:
            self.fragments = fragment_plan(c, specs)
        except ValueError as e:
            raise ConfigError([str(e)]) from None
        self.num_fragments = len(self.fragments)
        problems: list[str] = []
        check_overlap(c.diloco.H, self.num_fragments, c.streaming.overlap_steps, problems)
        if problems and c.algorithm == "diloco":
            raise ConfigError(problems)
        self.num_params = sum(s.numel for s in specs)
        tokens = c.run.steps * c.inner.global_batch * c.data.seq_len
        print(f"model: {self.num_params:,} parameters ({self.num_params / 1e6:.2f}M), "
              f"{len(specs)} tensors, {self.num_fragments} fragment(s)", file=sys.stderr)
        if c.algorithm == "dp":  # no replicas, no outer steps: H only sets the metrics/checkpoint round
            shape = (f"DDP over {c.diloco.replicas * c.diloco.workers_per_replica} worker(s), {c.run.steps} inner steps "
                     f"(metrics every {c.diloco.H}: {c.num_outer_steps} rounds)")
        else:
            shape = (f"M={c.diloco.replicas} replicas x {c.diloco.workers_per_replica} worker(s), "
                     f"H={c.diloco.H}, {c.run.steps} inner steps ({c.num_outer_steps} outer)")
        print(f"{c.algorithm}: {shape}, global batch {c.inner.global_batch} x {c.data.seq_len} tokens, "
              f"{tokens / 1e6:.2f}M tokens", file=sys.stderr)
        if c.algorithm == "diloco" and (c.diloco.min_replicas > 1 or self.members.target > c.diloco.replicas):
            print(f"elastic: quorum {c.diloco.min_replicas}, up to {self.members.target} replicas, "
                  f"sync timeout {c.diloco.sync_timeout_s:g} s", file=sys.stderr)
        if rs is not None:
            check_sizes(self.fragments, global_params(rs))
        if c.algorithm == "diloco":
            self.schedule = SyncSchedule(c.diloco.H, self.num_fragments, c.streaming.overlap_steps, c.run.steps,
                                         c.streaming.closing_round)
            # the global parameters start as rank 0's initialisation (identical in every worker)
            initial = rs["outer"]["global"] if rs is not None else \
                ray.get([w0.local_fragment.remote(p) for p in range(self.num_fragments)])
            ray.get(self.outer.init_global.remote(initial))
            self.members.driver, self.members.schedule = self.outer, self.schedule
            if rs is not None:
                ray.get(self.outer.load_state_dict.remote(rs["outer"]))
            workers = all_workers(self.replicas)
            ray.get([w.attach.remote(self.outer, self.schedule) for w in workers])
            globals_ = ray.get(self.outer.global_refs.remote())
            versions = ray.get(self.outer.global_versions.remote())
            ray.get([w.load_global.remote(p, g, versions[p]) for p, g in enumerate(globals_) for w in workers])
        if rs is not None:  # after load_global: a worker's local parameters may differ from the global ones
            self._restore_workers(rs)
            cnt = rs["counters"]
            self.state = RunState(**{k: cnt[k] for k in RunState.__dataclass_fields__ if k in cnt and k != "evals"},
                                  evals=[tuple(e) for e in cnt.get("evals", [])])

    def _restore_workers(self, rs: dict[str, Any]) -> None:
        """Inner-optimiser state and local parameters (rank 0's, for every rank of its replica),
        data position, RNG and syncs in flight (each worker's own) from a checkpoint."""
        import ray

        states = rs["workers"]
        calls = []
        for r in self.replicas:
            rank0_state = states[(r.index, 0)]
            for rank, w in enumerate(r.workers):
                s = {**states[(r.index, rank)], "optimizer": rank0_state["optimizer"], "local": rank0_state["local"]}
                calls.append(w.load_state_dict.remote(s))
        ray.get(calls)

    # -- one outer step --------------------------------------------------------------------
    def _gather(self, calls: dict[Any, Replica], straggler_s: float | None = None) -> list[Any]:
        """Results of the remote ``calls`` (object ref -> the replica it runs on), in call order.

        DiLoCo: a replica whose call fails (actor or node death, a process-group error inside
        it) is removed at once (:meth:`Membership.lose`), so the driver stops waiting for it; its
        other calls are dropped. With ``straggler_s``, replicas still running that many seconds
        after the first one finished are removed as unresponsive; so are all of them when none
        finished within twice the slowest outer step so far plus ``straggler_s`` (every replica
        frozen). DP: the first failure raises.
        """
        import ray

        order = list(calls)
        results: dict[Any, Any] = {}
        pending = dict(calls)
        first_done = None
        t0 = time.monotonic()
        ping, ping_sent = None, t0
        while pending:
            if self.outer is not None:  # a frozen driver would stall every replica: check it answers
                if ping is None:
                    ping, ping_sent = self.outer.ping.remote(), time.monotonic()
                elif ray.wait([ping], timeout=0)[0]:
                    ping = None
                elif time.monotonic() - ping_sent > self.cfg.diloco.sync_timeout_s:
                    raise ClusterError(f"the outer-optimiser driver has not answered for "
                                       f"{self.cfg.diloco.sync_timeout_s:g} s (diloco.sync_timeout_s); resume the run "
                                       "with --resume RUN_DIR: it restarts from the last checkpoint")
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.25)
            for ref in ready:
                r = pending.pop(ref, None)
                if r is None:
                    continue
                try:
                    results[ref] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    if self.outer is None:
                        raise
                    self._lose(r, error_cause(e))
                    for other in [x for x, rr in pending.items() if rr is r]:
                        pending.pop(other)
            if ready and first_done is None:
                first_done = time.monotonic()
            stuck = None  # why the replicas still running are removed as unresponsive
            if straggler_s is not None and first_done is not None and time.monotonic() - first_done > straggler_s:
                stuck = (f"still training {straggler_s:g} s after the other replicas finished the outer step "
                         "(diloco.sync_timeout_s)")
            elif (straggler_s is not None and first_done is None and self._slowest_round is not None
                  and time.monotonic() - t0 > 2 * self._slowest_round + straggler_s):
                stuck = (f"no replica finished the outer step within {2 * self._slowest_round + straggler_s:.0f} s "
                         "(twice the slowest one so far + diloco.sync_timeout_s)")
            if stuck is not None:
                for r in {id(rr): rr for rr in pending.values()}.values():
                    self._lose(r, f"unresponsive: {stuck}")
                pending = {}
            if self.members is not None and self.outer is not None:
                self.members.poll()
        return [results[ref] for ref in order if ref in results]

    def _lose(self, r: Replica, reason: str) -> None:
        """A replica failed: check the driver is alive, then remove the replica."""
        self.log(f"replica {r.index} failed: {reason}")
        self.members.lose(r, reason)

    def _membership(self, step: int) -> None:
        """At an outer-step boundary: admit replicas that finished starting, request
        replacements (or scale-up) for missing ones, and wait (``diloco.placement_timeout_s``)
        when no replica is left."""
        m = self.members
        if self.outer is None:
            return
        wanted = read_scale(self.run_dir, self.cfg)
        if wanted is not None:
            leaving = m.set_target(wanted)
            if leaving:
                self._settle()
                for r in leaving:
                    m.lose(r, f"scaled down to {wanted} replica(s)", kind="leave")
        m.admit(m.poll(), step, self._settle)
        m.top_up()
        deadline = time.monotonic() + self.cfg.diloco.placement_timeout_s
        while not m.live:
            if time.monotonic() > deadline:
                raise ClusterError(f"diloco.placement_timeout_s = {self.cfg.diloco.placement_timeout_s:g}: no replica "
                                   "is alive and none could be started again in time")
            time.sleep(0.2)
            m.admit(m.poll(), step, self._settle)

    def outer_step(self, k: int) -> dict[str, Any]:
        """Inner steps of outer step ``k`` on every live worker; the fragment syncs due in them
        run inside the workers (``ReplicaWorker.train``). Returns the metrics row."""
        import ray

        cfg = self.cfg
        start, end = outer_step_bounds(k, cfg.diloco.H, cfg.run.steps)
        while True:
            self._membership(start)
            t0 = time.perf_counter()
            calls = {w.train.remote(start, end): r for r in self.replicas for w in r.workers}
            metrics = self._gather(calls, straggler_s=cfg.diloco.sync_timeout_s if self.outer is not None else None)
            wall = time.perf_counter() - t0
            if metrics:
                self._slowest_round = max(self._slowest_round or 0.0, wall)
                break
            # every replica died during this outer step: run it again with the replacements
            self.log(f"outer step {k}: every replica failed; running it again once replacements join")
        row: dict[str, Any] = {"outer_step": k, "inner_step": end}
        # bytes on the slow link: each replica's rank 0 (DiLoCo), every rank (DP's all-reduce)
        rank0 = metrics if cfg.algorithm == "dp" else [mtr for mtr in metrics if mtr["rank"] == 0]
        # tokens trained: DP's one group reads the global batch; each live replica counts its own
        n_tokens = (end - start) * cfg.inner.global_batch * cfg.data.seq_len if cfg.algorithm == "dp" else \
            int(sum(mtr["tokens"] for mtr in rank0))
        sent = sum(mtr["link"]["bytes_up"] for mtr in rank0)
        received = sum(mtr["link"]["bytes_down"] for mtr in rank0)
        st = self.state
        st.outer_step, st.inner_step = k, end
        st.tokens += n_tokens
        st.bytes_sent += sent
        st.bytes_received += received
        st.peak_sync_bytes = max([st.peak_sync_bytes] + [mtr["link"].get("peak_event_bytes", 0) for mtr in rank0])
        st.sync_events += sum(mtr["link"].get("events", 0) for mtr in rank0)
        if self.outer is not None:
            self.members.note_positions(metrics)
            # rounds merged by the end of this outer step (apply step = min(send + tau, T))
            merged_by = end if end >= cfg.run.steps else end - self.schedule.overlap
            rounds = ray.get(self.outer.take_stats.remote(merged_by))
            if rounds:
                row["outer_update_norm"] = float(np.sqrt(sum(r["update_norm"] ** 2 for r in rounds)))
                sq: dict[int, float] = {}
                for r in rounds:
                    for m, v in r["delta_norms"].items():
                        sq[m] = sq.get(m, 0.0) + v * v
                row["pseudo_grad_norm"] = {f"replica_{m}": float(np.sqrt(v)) for m, v in sorted(sq.items())}
                row["fragment_syncs"] = len(rounds)
                per_fragment: dict[str, int] = {}
                for r in rounds:  # up + down, all replicas, per fragment sync completed in this outer step
                    key = f"fragment_{r['fragment']}"
                    per_fragment[key] = per_fragment.get(key, 0) + r["bytes_up"] + r["bytes_down"]
                row["sync_bytes_fragment"] = per_fragment
            events = self.members.take_events() + ray.get(self.outer.take_events.remote())
            failed = [ev for ev in events if ev["event"] == "round_failed"]
            for ev in events:
                st.membership[ev["event"]] = st.membership.get(ev["event"], 0) + 1
                if ev["event"] not in ("launch", "round_failed"):
                    self.log(f"membership: {_describe(ev)}")
            if failed:  # one line per outer step: with a small H these come every step
                self.log(f"membership: {len(failed)} sync round(s) failed in outer step {k} (the last: "
                         f"{_describe(failed[-1])})")
            row["replicas_target"] = self.members.target
            row["membership"] = dict(st.membership)
            if events:
                row["events"] = events
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
        row.update({
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
        })
        if cfg.run.log_hashes:
            row["data_digest"] = [mtr["data_digest"] for mtr in metrics]
            if self.outer is not None:
                self._settle()
                row.update({f"{k}_sha256": v for k, v in ray.get(self.outer.state_hash.remote()).items()})
            row["worker_global_sha256"] = self._gather({w.global_hash.remote(): r for r in self.replicas
                                                        for w in r.workers})
        if self.outer is not None:
            row["replicas_live"] = len(self.replicas)  # after this step's deaths
        return row

    def _settle(self) -> None:
        """Wait until every sync sent so far is answered by the driver (before eval, checkpoint
        or export); a replica that fails meanwhile is removed (DiLoCo) or raises (DP)."""
        if self.outer is not None:
            self._gather({w.settle.remote(): r for r in list(self.replicas) for w in r.workers})

    def _on_live(self, method: str, args_of: Any) -> dict[tuple[int, int], Any]:
        """Call ``method(*args_of(replica, rank, i, n))`` on every live worker (``i``: position in
        the flat worker list of ``n``, ``args_of`` returns None to skip a worker); a replica lost
        meanwhile makes the whole call start again with the survivors. Returns
        ``{(id, rank): result}``."""
        while True:
            live = list(self.replicas)
            n = len(all_workers(live))
            calls, keys = {}, {}
            i = 0
            for r in live:
                for rank, w in enumerate(r.workers):
                    args = args_of(r, rank, i, n)
                    i += 1
                    if args is None:
                        continue
                    ref = getattr(w, method).remote(*args)
                    calls[ref], keys[ref] = r, (r.index, rank)
            results = self._gather(calls)
            if [r.index for r in self.replicas] == [r.index for r in live]:
                return dict(zip([keys[ref] for ref in calls], results))

    def evaluate(self) -> float:
        """Validation loss (nats/token) of the global parameters over the whole validation split,
        spread across all workers."""
        import ray

        self._settle()
        globals_ = ray.get(self.outer.global_refs.remote()) if self.outer is not None else None
        windows = np.arange(val_windows(self.corpus.val, self.cfg.data.seq_len))

        def chunk(r, rank, i, n_workers):
            c = np.array_split(windows, n_workers)[i]
            return (c, globals_) if len(c) else None

        parts = list(self._on_live("evaluate", chunk).values())
        total = sum(p[0] for p in parts)
        count = sum(p[1] for p in parts)
        return total / count

    def checkpoint(self) -> Path:
        """Gather the outer state and every worker's state and write them atomically."""
        import ray

        self._settle()
        workers_state = self._on_live("state_dict", lambda r, rank, i, n: (rank == 0,))
        st = self.state
        state = {
            "format": 1,
            "outer_step": st.outer_step,
            "config": self.cfg.to_dict(),
            "corpus_fingerprint": self.corpus.fingerprint,
            "custom_model": self.model_fn is not None,
            "counters": dataclasses.asdict(st),
            "outer": ray.get(self.outer.state_dict.remote()) if self.outer is not None else None,
            "workers": workers_state,
            "membership": self.members.state_dict() if self.members is not None else None,
        }
        with _signals_deferred(replay=True):  # Ctrl-C / SIGTERM inside torch.save would fail the write
            return save_checkpoint(self.run_dir, st.outer_step, state, self.cfg.run.keep_checkpoints)

    def global_params(self) -> list[np.ndarray]:
        """The global parameters, fp32 ``[numel_p]`` per fragment (DP: rank 0's parameters)."""
        import ray

        self._settle()
        if self.outer is not None:
            return ray.get(self.outer.global_params.remote())
        w0 = self.replicas[0].rank0
        return ray.get([w0.local_fragment.remote(p) for p in range(self.num_fragments)])

    # -- the loop --------------------------------------------------------------------------
    def run(self, tracker: Tracker) -> dict[str, Any]:
        """The outer-step loop from the current state to ``run.steps``; evals and checkpoints
        when due. Returns wall, inner-compute and outer-wait seconds."""
        cfg = self.cfg
        self.log = tracker.write
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
            if saved:
                self.checkpoint()
            tracker.log(row)
            if saved and self.mirror is not None:  # after the row: the stored metrics reach the checkpoint
                self.mirror.sync()
            if self.on_outer_step is not None:
                self.on_outer_step({**row, "wandb_warning": tracker.wandb_warning} if tracker.wandb_warning else row)
            tracker.progress(row["inner_step"] - outer_step_bounds(k, cfg.diloco.H, cfg.run.steps)[0],
                             outer=f"{k}/{last}", loss=f"{row['train_loss']:.3f}",
                             eval=None if self.state.last_eval is None else f"{self.state.last_eval:.3f}",
                             tok_s=f"{row['tokens_per_s']:.0f}",
                             replicas=f"{row['replicas_live']}/{row['replicas_target']}" if "replicas_live" in row else None)
        wall = time.perf_counter() - t_start
        return {"wall_s": wall, "inner_compute_s": compute_total, "outer_wait_s": wait_total}

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
        if self.outer is not None:
            ray.kill(self.outer)
        self.replicas, self.outer = [], None


# ---------------------------------------------------------------------------------------
# entry point


#: Fields a resumed run cannot change: they shape the parameters, the shards or the data stream.
FIXED_ON_RESUME = ("algorithm", "diloco.replicas", "diloco.max_replicas", "diloco.workers_per_replica", "diloco.H",
                   "model", "data",
                   "run.seed", "inner.global_batch", "streaming.fragments", "streaming.layers_per_fragment",
                   "streaming.pattern", "streaming.overlap_steps")


def _describe(ev: dict[str, Any]) -> str:
    """One log line for a membership event."""
    info = ", ".join(f"{k}={v}" for k, v in ev.items() if k not in ("event", "replica", "time"))
    who = "" if ev.get("replica") is None else f"replica {ev['replica']} "
    return f"{who}{ev['event']}" + (f" ({info})" if info else "")


def _check_resumable(cfg: Config, saved: Config) -> None:
    """Raise :class:`ConfigError` naming each structural field that differs from the checkpoint's."""
    now, then = cfg.to_dict(), saved.to_dict()
    problems = []
    for key in FIXED_ON_RESUME:
        section, _, name = key.partition(".")
        a, b = now[section], then[section]
        if name:
            a, b = a[name], b[name]
        if isinstance(a, dict):
            problems += [f"{section}.{k} = {a[k]!r}: the checkpoint was trained with {b[k]!r}; it cannot change "
                         "on resume" for k in a if a[k] != b.get(k) and k != "cpus_per_worker"]
        elif a != b:
            problems.append(f"{key} = {a!r}: the checkpoint was trained with {b!r}; it cannot change on resume")
    if problems:
        raise ConfigError(problems)


@contextlib.contextmanager
def _signals_deferred(replay: bool = False):
    """Hold SIGINT/SIGTERM inside the block (main thread only), then restore the handlers. With
    ``replay`` the first signal that arrived meanwhile is delivered after the block (a checkpoint
    write finishes, then the run stops); without, it is dropped (clean-up already under way)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    pending: list[int] = []
    for sig in saved:
        signal.signal(sig, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if replay and pending:
            signal.raise_signal(pending[0])


def prepare(config: Any = None, overrides: list[str] | None = None, resume: str | Path | None = None,
            address: str | None = None) -> tuple[Config, Path, dict[str, Any] | None]:
    """Resolve the config, the run directory (checked, not created) and, on resume, the checkpoint.

    Raises:
        ConfigError, CheckpointError: before anything is started or written.
    """
    if resume is not None:
        if config is not None:
            raise ConfigError([f"--config {config}: cannot be combined with --resume (the run's config.yaml is "
                               "used; change fields such as run.steps with --set)"])
        if is_uri(str(resume)):  # a mirrored run (run.storage_path): fetch it into run.output_dir
            resume = download_run(str(resume), load_config(None, overrides, validate=False).run.output_dir)
        run_dir = Path(resume).expanduser()
        if not (run_dir / "config.yaml").is_file():
            raise CheckpointError(f"--resume {run_dir}: not a run directory (no config.yaml)")
        cfg = load_config(run_dir / "config.yaml", overrides)
        ckpts = list_checkpoints(run_dir)
        if ckpts:
            state = load_checkpoint(ckpts[-1][1])
            saved = checkpoint_config(state)
            pin_model_fields(cfg.model, recorded_before_pinning=True)  # config.yaml of a run from before: its shape
            _check_resumable(cfg, saved)
            done = int(state["counters"]["inner_step"])
            if cfg.run.steps < done:
                raise ConfigError([f"run.steps = {cfg.run.steps}: the checkpoint has already trained {done} inner steps; "
                                   f"give at least {done} (more extends the run)"])
            if cfg.run.steps > saved.run.steps and done % cfg.diloco.H:
                raise ConfigError([f"run.steps = {cfg.run.steps}: the checkpoint ends at inner step {done}, part way "
                                   f"through an outer step of diloco.H = {cfg.diloco.H} (its run.steps = "
                                   f"{saved.run.steps} is not a multiple of H), so the run cannot be extended"])
        else:  # it stopped before its first checkpoint (a failed start-up): run it again from step 0
            print(f"note: {run_dir} has no checkpoint yet; starting it again from step 0 with its config.yaml",
                  file=sys.stderr)
            state = None
    else:
        cfg = load_config(config, overrides)
        run_dir, state = _run_dir_for(cfg), None
    if address is not None:
        cfg.run.address = address
    return cfg, run_dir, state


def _finished(run_dir: Path, steps: int) -> dict[str, Any] | None:
    """A finished run resumed with nothing left to train: its summary, nothing started or written.
    None when summary.json cannot be read or is not that of the checkpoint's ``steps`` (an extension
    interrupted after its last checkpoint leaves the earlier summary and export): the run then
    goes through its end again, export and summary included."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("inner_steps") != steps:
        return None
    loss = summary.get("final_eval_loss")
    print(f"{run_dir} has finished its {steps} inner steps: nothing to train (--set run.steps=N with N > {steps} "
          "trains it further)", file=sys.stderr)
    print("final validation loss of the global model: " + (f"{loss:.4f}" if isinstance(loss, float) else str(loss)))
    print(f"run directory: {run_dir}")
    return summary


def train(config: Any = None, overrides: list[str] | None = None, *, resume: str | Path | None = None,
          address: str | None = None, model_fn: ModelFn | None = None, corpus: Corpus | None = None,
          on_outer_step: Any = None) -> dict[str, Any]:
    """Run DiLoCo (or the DP baseline) and return the summary (also written to ``summary.json``).

    Args:
        config: a :class:`Config`, a dict, a YAML path or preset name, or None for the defaults.
        overrides: dotted ``KEY=VALUE`` strings applied on top (``["inner.lr=3e-4"]``).
        resume: a run directory to continue from its newest checkpoint.
        address: Ray address ("auto" to join a running cluster); default: start a local one.
        model_fn: ``(shape: dict, vocab_size: int) -> nn.Module`` to train instead of the presets.
        corpus: a pre-tokenised :class:`~ray_diloco.components.data.Corpus` instead of ``config.data``.
        on_outer_step: called with each outer step's metrics row (a dict, as in ``metrics.jsonl``, plus
            ``wandb_warning`` when W&B fell back to offline or off)
            after its evaluation and checkpoint; Ray Tune trials report through it.

    Raises:
        ConfigError, DataError, CheckpointError, ClusterError: with a one-line message.
    """
    import ray

    cfg, run_dir, rs = prepare(config, overrides, resume, address)
    if rs is not None and int(rs["counters"]["inner_step"]) >= cfg.run.steps and (run_dir / "summary.json").is_file():
        finished = _finished(run_dir, int(rs["counters"]["inner_step"]))
        if finished is not None:
            return finished
    tok_dir = run_dir / "tokenizer"
    if corpus is None:
        tokenizer = load_saved_tokenizer(tok_dir) if (tok_dir / "tokenizer.json").is_file() else None
        corpus = load_corpus(cfg.data, tokenizer=tokenizer)
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < corpus.vocab_size:
        raise ConfigError([f"model.vocab_size = {cfg.model.vocab_size}: smaller than the tokenizer's "
                           f"{corpus.vocab_size} tokens (leave it unset to use the tokenizer's)"])
    if cfg.run.tokens_per_parameter is not None and rs is None:
        from ray_diloco.models.transformer import budget_steps

        cfg.run.steps = budget_steps(cfg, corpus.vocab_size, model_fn)
        print(f"run.steps = {cfg.run.steps}: run.tokens_per_parameter = {cfg.run.tokens_per_parameter:g} x the model's "
              f"parameters / (inner.global_batch x data.seq_len)", file=sys.stderr)
    per_shard = num_train_windows(len(corpus.train), cfg.data.seq_len) // cfg.num_shards
    if per_shard < cfg.batch_per_worker:
        raise DataError(f"data: {len(corpus.train):,} training tokens give {per_shard} sequences of {cfg.data.seq_len} "
                        f"tokens per shard, fewer than one batch of {cfg.batch_per_worker} "
                        f"(inner.global_batch / (diloco.replicas x diloco.workers_per_replica)); use more text")
    if rs is not None and rs.get("corpus_fingerprint") != corpus.fingerprint:
        raise CheckpointError(f"--resume {run_dir}: the corpus differs from the one the checkpoint was trained on")
    started_ray = init_ray(cfg)
    trainer = Trainer(cfg, run_dir, corpus, model_fn, rs)
    trainer.on_outer_step = on_outer_step
    tracker = lock = None
    try:
        check_resources(cfg)  # before the run directory is written
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = lock_run_dir(run_dir)  # held until this process ends
        if resume is None and any(p.name != ".lock" for p in run_dir.iterdir()):
            raise CheckpointError(f"run directory {run_dir}: another run started in it at the same time")
        remove_partial_checkpoints(run_dir)
        if resume is None:  # a resume rewrites it (with its --set changes) only once it has started
            write_text(str(run_dir / "config.yaml"), cfg.to_yaml())  # atomic
        if corpus.tokenizer is not None and not tok_dir.exists():
            corpus.tokenizer.save_pretrained(str(tok_dir))
        if is_uri(cfg.run.storage_path):
            trainer.mirror = Mirror(run_dir, cfg.run.storage_path)
            print(f"mirrored to {trainer.mirror.uri} (resume anywhere with --resume {trainer.mirror.uri})",
                  file=sys.stderr)
        trainer.start()
        if resume is not None:  # only now: a resume that fails to start leaves the run directory as it was
            write_text(str(run_dir / "config.yaml"), cfg.to_yaml())  # atomic
            _truncate_metrics(run_dir, rs["outer_step"] if rs is not None else 0)
        if rs is not None:
            print(f"resumed from the checkpoint of outer step {rs['outer_step']} "
                  f"(inner step {trainer.state.inner_step} of {cfg.run.steps})", file=sys.stderr)
        print(f"run directory: {run_dir}", file=sys.stderr)
        tracker = Tracker(cfg, run_dir, cfg.run.steps, trainer.state.inner_step)
        timing = trainer.run(tracker)
        final_loss = trainer.state.last_eval
        export_dir = export_model(cfg, trainer.global_params(), corpus.vocab_size, corpus.tokenizer,
                                  run_dir / "final", model_fn, trainer.fragments)
        st = trainer.state
        summary = {
            "final_eval_loss": final_loss,
            "evals": st.evals,
            "algorithm": cfg.algorithm,
            "replicas": cfg.diloco.replicas,
            "workers_per_replica": cfg.diloco.workers_per_replica,
            "H": cfg.diloco.H,
            "num_parameters": trainer.num_params,
            "tokens": st.tokens,
            "inner_steps": st.inner_step,
            "outer_steps": st.outer_step,
            "wall_s": timing["wall_s"],
            "inner_compute_s": timing["inner_compute_s"],
            "outer_wait_s": timing["outer_wait_s"],
            "tokens_per_s": (st.tokens - (rs["counters"]["tokens"] if rs else 0)) / timing["wall_s"]
            if timing["wall_s"] > 0 else None,
            "bytes_sent": st.bytes_sent,
            "bytes_received": st.bytes_received,
            "communication": communication_summary(
                trainer.num_params, st.inner_step, cfg.num_shards if cfg.algorithm == "dp" else cfg.diloco.replicas,
                st.bytes_sent, st.bytes_received, st.peak_sync_bytes),
            "compute_utilisation": st.inner_compute_s / st.train_wall_s if st.train_wall_s > 0 else None,
            "sync_wait_s": st.sync_wait_s,
            "fragments": trainer.num_fragments,
            "membership": dict(st.membership),
            "replicas_live": len(trainer.replicas),
            "run_dir": str(run_dir),
            "storage_uri": trainer.mirror.uri if trainer.mirror is not None else None,
            "export_dir": str(export_dir),
            "config": cfg.to_dict(),
        }
        tracker.finish(summary)  # first: summary.json marks a finished run, W&B included
        tracker = None
        write_summary(run_dir, summary)
        if trainer.mirror is not None:
            trainer.mirror.sync(final=True)
    except ray.exceptions.RayError as e:
        raise ClusterError(f"a replica worker or the outer-optimiser driver failed: {error_cause(e)}") from None
    finally:
        with _signals_deferred():  # a second Ctrl-C must not cut the clean-up short
            if tracker is not None:
                tracker.finish({})
            trainer.shutdown()
            if started_ray:
                ray.shutdown()
            if lock is not None:
                lock.close()
    print(f"final validation loss of the global model: {final_loss:.4f}")
    print(f"run directory: {run_dir}")
    return summary


__all__ = ["train", "prepare", "Trainer", "RunState"]
