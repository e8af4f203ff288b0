"""Orchestration of a run: Ray start-up, replicas, the outer-step loop, eval, checkpoints, export.

One outer step of DiLoCo (arXiv 2311.08105, Algorithm 1), as the trainer drives it::

    every worker:  train(start, end)                 H inner AdamW steps on its own shard
    rank 0 of m:   pseudo_gradient(p) -> ObjectRef   global_p - local_p, fp32 numpy
    outer actor:   step(p, weights, *refs)           mean, Nesterov step, ray.put(new global_p)
    every worker:  load_global(p, ref)               local_p <- new global_p

``algorithm: dp`` runs the data-parallel baseline with the same workers, data, inner optimiser
and schedule: one DDP group over all M x W workers and no outer step.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import Config, load_config
from .data import Corpus, load_corpus, load_saved_tokenizer, val_windows
from .errors import CheckpointError, ClusterError, ConfigError, DataError
from .model import ModelFn
from .schedules import is_due, outer_step_bounds
from .tracking import Tracker, write_summary

log = logging.getLogger("ray_diloco")


@dataclass
class Replica:
    """The Ray actors of one replica (rank 0 first) and their placement group."""

    index: int
    workers: list[Any]
    placement_group: Any

    @property
    def rank0(self) -> Any:
        return self.workers[0]


@dataclass
class RunState:
    """Counters carried across outer steps and into checkpoints."""

    outer_step: int = 0
    inner_step: int = 0
    tokens: int = 0
    bytes_sent: int = 0  # replicas -> outer optimiser, all replicas
    bytes_received: int = 0  # outer optimiser -> replicas, all replicas
    last_eval: float | None = None
    evals: list[tuple[int, float]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------
# run directory


def _new_run_dir(cfg: Config) -> Path:
    name = cfg.run.name or datetime.now().strftime("%Y%m%d-%H%M%S") + f"-{cfg.algorithm}"
    run_dir = Path(cfg.run.output_dir).expanduser() / name
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError([f"run.name = {name!r}: run directory {run_dir} already exists and is not empty "
                           f"(resume it with --resume {run_dir}, or choose another run.name)"])
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
# Ray


def _init_ray(cfg: Config) -> bool:
    """Join (``run.address`` / ``RAY_ADDRESS``) or start a Ray cluster; True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.run.address or os.environ.get("RAY_ADDRESS")
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=True,
                 include_dashboard=False if address is None else None)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterError(f"run.address = {address!r}: cannot connect to a Ray cluster ({str(e).splitlines()[0]})") from None
    return True


MIN_AUTO_CPUS = 0.5  # the least CPU share per worker that "auto" hands out


def check_resources(cfg: Config) -> float:
    """Fail before starting anything when the cluster cannot host every worker at once.

    Returns the CPUs per worker: ``diloco.cpus_per_worker`` when set, else the cluster's CPUs
    shared evenly (whole CPUs when there are enough, else a fraction of at least 0.5).

    Raises:
        ClusterError: naming the fields, their product and the cluster's CPUs/GPUs.
    """
    import ray

    d = cfg.diloco
    res = ray.cluster_resources()
    n = cfg.num_shards
    have_cpu = res.get("CPU", 0)
    product = f"diloco.replicas x diloco.workers_per_replica = {d.replicas} x {d.workers_per_replica} = {n} workers"
    if d.cpus_per_worker is None:
        per = have_cpu / n
        if per < MIN_AUTO_CPUS:
            raise ClusterError(
                f"{product}, but the Ray cluster has {have_cpu:g} CPUs (fewer than {MIN_AUTO_CPUS:g} per worker): "
                "lower diloco.replicas or diloco.workers_per_replica, add nodes, or set diloco.cpus_per_worker"
            )
        cpus = float(int(per)) if per >= 1 else per
    else:
        cpus = d.cpus_per_worker
        if n * cpus > have_cpu:
            raise ClusterError(
                f"{product} x diloco.cpus_per_worker {cpus:g} = {n * cpus:g} CPUs, "
                f"but the Ray cluster has {have_cpu:g}: lower one of them or add nodes"
            )
    need_gpu = n * d.gpus_per_worker
    if need_gpu > res.get("GPU", 0):
        raise ClusterError(
            f"{product} x diloco.gpus_per_worker {d.gpus_per_worker:g} = {need_gpu:g} GPUs, "
            f"but the Ray cluster has {res.get('GPU', 0):g}"
        )
    return cpus


def _start_replicas(cfg: Config, corpus_refs: tuple[Any, Any], vocab_size: int,
                    model_fn: ModelFn | None) -> list[Replica]:
    """Placement groups and worker actors; process groups formed; data shards opened."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from .replica import ReplicaWorker

    d = cfg.diloco
    bundle = {"CPU": d.cpus_per_worker}
    if d.gpus_per_worker:
        bundle["GPU"] = d.gpus_per_worker
    if cfg.algorithm == "dp":  # one DDP group over every worker
        layout = [(0, cfg.num_shards, "PACK")]
    else:
        layout = [(m, d.workers_per_replica, "STRICT_PACK") for m in range(d.replicas)]
    Worker = ray.remote(ReplicaWorker)
    replicas: list[Replica] = []
    try:
        for m, world, strategy in layout:
            pg = placement_group([dict(bundle) for _ in range(world)], strategy=strategy, name=f"diloco-replica-{m}")
            replicas.append(Replica(m, [], pg))
        for r in replicas:
            try:
                ray.get(r.placement_group.ready(), timeout=d.placement_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise ClusterError(
                    f"diloco.placement_timeout_s = {d.placement_timeout_s:g}: replica {r.index}'s placement group "
                    f"({len(r.placement_group.bundle_specs)} x {bundle}, {layout[0][2]}) was not placed in time"
                ) from None
        for (m, world, _), r in zip(layout, replicas):
            for rank in range(world):
                shard = m * world + rank
                r.workers.append(Worker.options(
                    num_cpus=d.cpus_per_worker, num_gpus=d.gpus_per_worker,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(r.placement_group, placement_group_bundle_index=rank),
                    name=None,
                ).remote(cfg.to_dict(), m, rank, world, shard, cfg.num_shards, vocab_size, model_fn))
        masters = ray.get([r.rank0.node_address.remote() for r in replicas])
        train_ref, val_ref = corpus_refs
        ray.get([w.setup.remote(addr, train_ref, val_ref) for r, addr in zip(replicas, masters) for w in r.workers])
    except BaseException:
        _stop_replicas(replicas)
        for r in replicas:
            remove_placement_group(r.placement_group)
        raise
    return replicas


def _stop_replicas(replicas: list[Replica]) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for r in replicas:
        for w in r.workers:
            try:
                ray.kill(w)
            except Exception:
                pass
        try:
            remove_placement_group(r.placement_group)
        except Exception:
            pass


def _all_workers(replicas: list[Replica]) -> list[Any]:
    return [w for r in replicas for w in r.workers]


def _cause(e: BaseException) -> str:
    text = str(getattr(e, "cause", None) or e).strip().splitlines()
    return next((ln for ln in reversed(text) if ln.strip()), type(e).__name__)[:300]


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
        self.cfg, self.run_dir, self.corpus, self.model_fn = cfg, run_dir, corpus, model_fn
        self.resume_state = resume_state
        self.state = RunState()
        self.replicas: list[Replica] = []
        self.outer = None
        self.num_fragments = 1

    # -- set-up ----------------------------------------------------------------------------
    def start(self) -> None:
        import ray

        from .outer import OuterOptimizerActor

        self.cfg.diloco.cpus_per_worker = check_resources(self.cfg)
        if self.cfg.diloco.cpus_per_worker < 1:
            print(f"note: {self.cfg.num_shards} workers share the cluster's CPUs "
                  f"({self.cfg.diloco.cpus_per_worker:g} CPU each)", file=sys.stderr)
        refs = (ray.put(self.corpus.train), ray.put(self.corpus.val))
        self.replicas = _start_replicas(self.cfg, refs, self.corpus.vocab_size, self.model_fn)
        w0 = self.replicas[0].rank0
        self.num_fragments = ray.get(w0.num_fragments.remote())
        specs = ray.get(w0.param_specs.remote())
        self.num_params = sum(s.numel for s in specs)
        self.fragment_bytes = [4 * self.num_params] if self.num_fragments == 1 else None
        print(f"model: {self.num_params:,} parameters ({self.num_params / 1e6:.2f}M), "
              f"{len(specs)} tensors, {self.num_fragments} fragment(s)", file=sys.stderr)
        rs = self.resume_state
        if rs is not None:
            self._restore_workers(rs)
        if self.cfg.algorithm == "diloco":
            initial = ray.get([w0.local_fragment.remote(p) for p in range(self.num_fragments)])
            self.outer = OuterOptimizerActor.remote(initial, self.cfg.outer)
            if rs is not None:
                ray.get(self.outer.load_state_dict.remote(rs["outer"]))
            globals_ = ray.get([self.outer.global_ref.remote(p) for p in range(self.num_fragments)])
            ray.get([w.load_global.remote(p, g) for p, g in enumerate(globals_) for w in _all_workers(self.replicas)])
            if rs is not None:  # local params may differ from global (saved mid-flight); restore them
                self._restore_workers(rs, params_only=True)
        if rs is not None:
            c = rs["counters"]
            self.state = RunState(**{k: c[k] for k in ("outer_step", "inner_step", "tokens", "bytes_sent",
                                                       "bytes_received", "last_eval")},
                                  evals=[tuple(e) for e in c.get("evals", [])])

    def _restore_workers(self, rs: dict[str, Any], params_only: bool = False) -> None:
        import ray

        states = rs["workers"]
        calls = []
        for r in self.replicas:
            rank0_state = states[(r.index, 0)]
            for rank, w in enumerate(r.workers):
                s = dict(states[(r.index, rank)])
                s.setdefault("optimizer", rank0_state["optimizer"])
                s.setdefault("local", rank0_state["local"])
                if params_only:
                    calls.append(w.load_local.remote(s["local"]))
                else:
                    calls.append(w.load_state_dict.remote(s))
        ray.get(calls)

    # -- one outer step --------------------------------------------------------------------
    def _round(self, k: int) -> dict[str, Any]:
        import ray

        cfg = self.cfg
        start, end = outer_step_bounds(k, cfg.diloco.H, cfg.run.steps)
        t0 = time.perf_counter()
        workers = _all_workers(self.replicas)
        train_refs = [w.train.remote(start, end) for w in workers]
        row: dict[str, Any] = {"outer_step": k, "inner_step": end}
        n_tokens = (end - start) * cfg.inner.global_batch * cfg.data.seq_len
        if cfg.algorithm == "diloco":
            results = []
            for p in range(self.num_fragments):
                deltas = [r.rank0.pseudo_gradient.remote(p) for r in self.replicas]
                weights = [float(n_tokens / len(self.replicas))] * len(self.replicas)
                results.append(self.outer.step.remote(p, weights, *deltas))
            metrics = ray.get(train_refs)
            t_compute_done = time.perf_counter()
            outs = ray.get(results)
            ray.get([w.load_global.remote(p, out["global"]) for p, out in enumerate(outs) for w in workers])
            sent = sum(out["bytes_received"] for out in outs)
            received = sum(4 * self.num_params for _ in self.replicas)
            row["pseudo_grad_norm"] = {f"replica_{m}": v for m, v in enumerate(outs[0]["delta_norms"])} \
                if self.num_fragments == 1 else None
            row["outer_update_norm"] = float(np.sqrt(sum(out["update_norm"] ** 2 for out in outs)))
        else:
            metrics = ray.get(train_refs)
            t_compute_done = time.perf_counter()
            sent = received = 0
        wall = time.perf_counter() - t0
        self.state.outer_step, self.state.inner_step = k, end
        self.state.tokens += n_tokens
        self.state.bytes_sent += sent
        self.state.bytes_received += received
        by_replica: dict[int, dict[str, Any]] = {}
        for mtr in metrics:
            by_replica.setdefault(mtr["replica"], mtr)
        losses = [by_replica[m]["train_loss"] for m in sorted(by_replica)]
        compute_s = max(mtr["compute_s"] for mtr in metrics)
        row.update({
            "train_loss": float(np.mean(losses)),
            "train_loss_replica": {f"replica_{m}": v for m, v in enumerate(losses)},
            "inner_lr": metrics[0]["inner_lr"],
            "tokens": self.state.tokens,
            "tokens_per_s": n_tokens / wall if wall > 0 else None,
            "inner_compute_s": compute_s,
            "outer_wait_s": max(0.0, wall - (t_compute_done - t0)) if cfg.algorithm == "diloco" else 0.0,
            "round_s": wall,
            "bytes_sent": sent,
            "bytes_received": received,
            "bytes_sent_total": self.state.bytes_sent,
            "bytes_received_total": self.state.bytes_received,
        })
        if cfg.run.log_hashes:
            row["data_digest"] = [mtr["data_digest"] for mtr in metrics]
            if self.outer is not None:
                row.update({f"{k}_sha256": v for k, v in ray.get(self.outer.state_hash.remote()).items()})
            row["worker_global_sha256"] = ray.get([w.params_hash.remote() for w in workers])
        return row

    def evaluate(self) -> float:
        """Validation loss (nats/token) of the global parameters over the whole validation split,
        spread across all workers."""
        import ray

        workers = _all_workers(self.replicas)
        n = val_windows(self.corpus.val, self.cfg.data.seq_len)
        chunks = np.array_split(np.arange(n), len(workers))
        parts = ray.get([w.evaluate.remote(c) for w, c in zip(workers, chunks) if len(c)])
        total = sum(p[0] for p in parts)
        count = sum(p[1] for p in parts)
        return total / count

    def checkpoint(self) -> Path:
        import ray

        workers_state = {}
        calls = []
        keys = []
        for r in self.replicas:
            for rank, w in enumerate(r.workers):
                calls.append(w.state_dict.remote(full=rank == 0))
                keys.append((r.index, rank))
        for key, s in zip(keys, ray.get(calls)):
            workers_state[key] = s
        st = self.state
        state = {
            "format": 1,
            "outer_step": st.outer_step,
            "config": self.cfg.to_dict(),
            "corpus_fingerprint": self.corpus.fingerprint,
            "counters": {"outer_step": st.outer_step, "inner_step": st.inner_step, "tokens": st.tokens,
                         "bytes_sent": st.bytes_sent, "bytes_received": st.bytes_received,
                         "last_eval": st.last_eval, "evals": st.evals},
            "outer": ray.get(self.outer.state_dict.remote()) if self.outer is not None else None,
            "workers": workers_state,
        }
        return save_checkpoint(self.run_dir, st.outer_step, state, self.cfg.run.keep_checkpoints)

    def global_params(self) -> list[np.ndarray]:
        """The global parameters, fp32 ``[numel_p]`` per fragment (DP: rank 0's parameters)."""
        import ray

        if self.outer is not None:
            return ray.get(self.outer.global_params.remote())
        w0 = self.replicas[0].rank0
        return ray.get([w0.local_fragment.remote(p) for p in range(self.num_fragments)])

    # -- the loop --------------------------------------------------------------------------
    def run(self, tracker: Tracker) -> dict[str, Any]:
        cfg = self.cfg
        last = cfg.num_outer_steps
        t_start = time.perf_counter()
        compute_total = wait_total = 0.0
        for k in range(self.state.outer_step + 1, last + 1):
            row = self._round(k)
            compute_total += row["inner_compute_s"]
            wait_total += row["outer_wait_s"]
            if is_due(k, cfg.run.eval_every, last):
                self.state.last_eval = self.evaluate()
                self.state.evals.append((k, self.state.last_eval))
                row["eval_loss"] = self.state.last_eval
            if is_due(k, cfg.run.checkpoint_every, last):
                self.checkpoint()
            tracker.log(row)
            tracker.progress(row["inner_step"] - outer_step_bounds(k, cfg.diloco.H, cfg.run.steps)[0],
                             outer=f"{k}/{last}", loss=f"{row['train_loss']:.3f}",
                             eval=None if self.state.last_eval is None else f"{self.state.last_eval:.3f}",
                             tok_s=f"{row['tokens_per_s']:.0f}")
        wall = time.perf_counter() - t_start
        return {"wall_s": wall, "inner_compute_s": compute_total, "outer_wait_s": wait_total}

    def shutdown(self) -> None:
        import ray

        for w in _all_workers(self.replicas):
            try:
                ray.get(w.shutdown.remote(), timeout=10)
            except Exception:
                pass
        _stop_replicas(self.replicas)
        if self.outer is not None:
            ray.kill(self.outer)
        self.replicas, self.outer = [], None


# ---------------------------------------------------------------------------------------
# export


def export_model(cfg: Config, params: list[np.ndarray], vocab_size: int, tokenizer: Any, out_dir: Path,
                 model_fn: ModelFn | None = None) -> Path:
    """Write the global model: ``save_pretrained`` (+ tokenizer) for transformers models, so
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it; ``model.pt`` (state dict) otherwise."""
    import torch

    from .fragments import param_specs, plan_fragments, unflatten_into
    from .replica import build_model

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = build_model(cfg, vocab_size, model_fn)
    frags = plan_fragments(param_specs(model), len(params))
    named = dict(model.named_parameters())
    for f, arr in zip(frags, params):
        unflatten_into(named, f, torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)))
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    else:
        torch.save(model.state_dict(), tmp / "model.pt")
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------
# entry point


def prepare(config: Any = None, overrides: list[str] | None = None, resume: str | Path | None = None,
            address: str | None = None) -> tuple[Config, Path, dict[str, Any] | None]:
    """Resolve the config and run directory (new, or the one being resumed) and the checkpoint."""
    if resume is not None:
        run_dir = Path(resume).expanduser()
        if not (run_dir / "config.yaml").is_file():
            raise CheckpointError(f"--resume {run_dir}: not a run directory (no config.yaml)")
        cfg = load_config(run_dir / "config.yaml", overrides)
        _, ckpt_path = latest_checkpoint(run_dir)
        state = load_checkpoint(ckpt_path)
    else:
        cfg = load_config(config, overrides)
        run_dir, state = None, None
    if address is not None:
        cfg.run.address = address
    if run_dir is None:
        run_dir = _new_run_dir(cfg)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    return cfg, run_dir, state


def train(config: Any = None, overrides: list[str] | None = None, *, resume: str | Path | None = None,
          address: str | None = None, model_fn: ModelFn | None = None, corpus: Corpus | None = None) -> dict[str, Any]:
    """Run DiLoCo (or the DP baseline) and return the summary (also written to ``summary.json``).

    Args:
        config: a :class:`Config`, a dict, a YAML path or preset name, or None for the defaults.
        overrides: dotted ``KEY=VALUE`` strings applied on top (``["inner.lr=3e-4"]``).
        resume: a run directory to continue from its newest checkpoint.
        address: Ray address ("auto" to join a running cluster); default: start a local one.
        model_fn: ``(shape: dict, vocab_size: int) -> nn.Module`` to train instead of the presets.
        corpus: a pre-tokenised :class:`~ray_diloco.data.Corpus` instead of ``config.data``.

    Raises:
        ConfigError, DataError, CheckpointError, ClusterError: with a one-line message.
    """
    import ray

    cfg, run_dir, rs = prepare(config, overrides, resume, address)
    if corpus is None:
        tok_dir = run_dir / "tokenizer"
        tokenizer = load_saved_tokenizer(tok_dir) if (tok_dir / "tokenizer.json").is_file() else None
        corpus = load_corpus(cfg.data, tok_dir, tokenizer)
    elif corpus.tokenizer is not None and not (run_dir / "tokenizer").exists():
        corpus.tokenizer.save_pretrained(str(run_dir / "tokenizer"))
    if rs is not None:
        if rs.get("corpus_fingerprint") != corpus.fingerprint:
            raise CheckpointError(f"--resume {run_dir}: the corpus differs from the one the checkpoint was trained on")
        _truncate_metrics(run_dir, rs["outer_step"])
    started_ray = _init_ray(cfg)
    trainer = Trainer(cfg, run_dir, corpus, model_fn, rs)
    tracker = None
    try:
        trainer.start()
        print(f"run directory: {run_dir}", file=sys.stderr)
        tracker = Tracker(cfg, run_dir, cfg.run.steps, trainer.state.inner_step)
        timing = trainer.run(tracker)
        final_loss = trainer.state.last_eval
        export_dir = export_model(cfg, trainer.global_params(), corpus.vocab_size, corpus.tokenizer,
                                  run_dir / "final", model_fn)
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
            "run_dir": str(run_dir),
            "export_dir": str(export_dir),
            "config": cfg.to_dict(),
        }
        write_summary(run_dir, summary)
        tracker.finish(summary)
        tracker = None
    except ray.exceptions.RayError as e:
        raise ClusterError(f"a replica failed: {_cause(e)}") from None
    finally:
        if tracker is not None:
            tracker.finish({})
        trainer.shutdown()
        if started_ray:
            ray.shutdown()
    print(f"final validation loss of the global model: {final_loss:.4f}")
    print(f"run directory: {run_dir}")
    return summary


__all__ = ["train", "Trainer", "export_model", "check_resources", "DataError"]
