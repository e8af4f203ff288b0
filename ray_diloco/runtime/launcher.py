"""The launcher: config and run directory, resume checks, Ray start-up, the run, its summary.

:func:`train` is ``ray_diloco.train`` and ``ray-diloco train``: it resolves the config (and on
resume the checkpoint, :func:`prepare`), fixes what the run decides at start in a
:class:`ResolvedRun` (the token budget's step count, the model's pinned shape, the CPUs per
worker; the user's config object is never changed), starts or joins Ray, runs the
:class:`~ray_diloco.runtime.trainer.Trainer`, exports the model and writes ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

from ray_diloco.components.checkpoint import (
    checkpoint_config,
    list_checkpoints,
    load_checkpoint,
    lock_run_dir,
    remove_partial_checkpoints,
)
from ray_diloco.components.data import Corpus, eval_split, load_corpus, num_train_windows
from ray_diloco.components.export import export_model
from ray_diloco.components.mirror import Mirror, download_run
from ray_diloco.components.storage import filesystem, is_uri, join_uri, write_text
from ray_diloco.components.threads import job_threads
from ray_diloco.components.token_store import load_saved_tokenizer
from ray_diloco.components.tracking import Tracker, write_summary
from ray_diloco.config import Config, load_config
from ray_diloco.core.wire import communication_summary
from ray_diloco.errors import CheckpointError, ClusterError, ConfigError, DataError, RayDilocoError, RunStopped
from ray_diloco.log import RESULT, error_line
from ray_diloco.models.transformer import ModelFn, pin_model_fields
from ray_diloco.runtime.checkpointing import signals_deferred
from ray_diloco.runtime.cluster import check_resources, error_cause, init_ray
from ray_diloco.runtime.resolved import ResolvedRun
from ray_diloco.runtime.strategy import strategy_class
from ray_diloco.runtime.trainer import Trainer

logger = logging.getLogger(__name__)


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
        raise ConfigError(
            [
                f"run.name = {cfg.run.name!r}: run directory {run_dir} already exists and is not empty "
                f"(resume it with --resume {run_dir}, or choose another run.name)"
            ]
        )
    if remote:
        assert cfg.run.storage_path is not None  # remote: a URI
        uri = join_uri(cfg.run.storage_path, cfg.run.name)
        fs, path = filesystem(uri)
        try:
            exists = fs.get_file_info(f"{path}/config.yaml").type.name == "File"
        except Exception as e:
            raise ConfigError(
                [f"run.storage_path = {cfg.run.storage_path!r}: cannot reach it ({error_line(e)})"]
            ) from None
        if exists:
            raise ConfigError(
                [
                    f"run.name = {cfg.run.name!r}: {uri} already holds a run (resume it with --resume "
                    f"{uri}, or choose another run.name)"
                ]
            )
    return run_dir


def new_run_dir(cfg: Config) -> Path:
    """A new run's directory, created (``run.output_dir``/``run.name``; an unnamed run is named
    here, in ``cfg``): what a ``Trainer`` built in a program of its own (the benchmarks) writes to.

    Raises:
        ConfigError: it exists and is not empty, or its parent is not a writable directory."""
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
    write_text(path, "".join(k + "\n" for k in keep))


# ---------------------------------------------------------------------------------------
# the run


FIXED_ON_RESUME = (
    "algorithm",
    "diloco.replicas",
    "diloco.max_replicas",
    "diloco.workers_per_replica",
    "diloco.H",
    "diloco.sharding",
    "diloco.shard_group_size",
    "model",
    "data",
    "run.seed",
    "inner.global_batch",
    "streaming.fragments",
    "streaming.layers_per_fragment",
    "streaming.pattern",
    "streaming.overlap_steps",
)


def _check_resumable(cfg: Config, saved: Config) -> None:
    """Raise :class:`ConfigError` naming each structural field that differs from the checkpoint's."""
    now, then = cfg.to_dict(), saved.to_dict()
    now["model"]["init_from"] = then["model"]["init_from"]  # where the model is may change (_follow_moved_model)
    now["diloco"]["shard_group_size"], then["diloco"]["shard_group_size"] = cfg.shard_group_size, saved.shard_group_size
    if cfg.data.tokenizer == cfg.model.init_from and saved.data.tokenizer == saved.model.init_from:
        now["data"]["tokenizer"] = then["data"]["tokenizer"]
    problems = []
    for key in FIXED_ON_RESUME:
        section, _, name = key.partition(".")
        a, b = now[section], then[section]
        if name:
            a, b = a[name], b[name]
        if isinstance(a, dict):
            problems += [
                f"{section}.{k} = {a[k]!r}: the checkpoint was trained with {b[k]!r}; it cannot change on resume"
                for k in a
                if a[k] != b.get(k)
            ]
        elif a != b:
            problems.append(f"{key} = {a!r}: the checkpoint was trained with {b!r}; it cannot change on resume")
    if problems:
        raise ConfigError(problems)


def _load_run_config(run_dir: Path, overrides: list[str] | None) -> Config:
    """A resumed run's ``config.yaml`` with ``overrides``; a ``model.init_from`` no longer there
    gets a hint (its weights are the checkpoint's now; only its config.json is read)."""
    try:
        return load_config(run_dir / "config.yaml", overrides)
    except ConfigError as e:
        began = load_config(run_dir / "config.yaml", validate=False).model.init_from
        hint = " (the run started from it; --set model.init_from=PATH names where that model is now)"
        raise ConfigError(
            [p + hint if p.startswith(f"model.init_from = {began!r}: no such directory") else p for p in e.problems]
        ) from None


def _follow_moved_model(cfg: Config, saved: Config) -> None:
    """A resume that names where its ``model.init_from`` model is now: the data's tokenizer,
    which was that model's, follows it (the model's shape was checked against the run's pinned one
    when the config loaded; the weights and tokenizer are the checkpoint's and the run's)."""
    now = cfg.model.init_from
    if now and now != saved.model.init_from and cfg.data.tokenizer == saved.data.tokenizer == saved.model.init_from:
        cfg.data.tokenizer = now


def prepare(
    config: Any = None, overrides: list[str] | None = None, resume: str | Path | None = None, address: str | None = None
) -> tuple[Config, Path, dict[str, Any] | None]:
    """Resolve the config, the run directory (checked, not created) and, on resume, the checkpoint.

    Raises:
        ConfigError, CheckpointError: before anything is started or written.
    """
    if resume is not None:
        if config is not None:
            raise ConfigError(
                [
                    f"--config {config}: cannot be combined with --resume (the run's config.yaml is "
                    "used; change fields such as run.steps with --set)"
                ]
            )
        if is_uri(str(resume)):  # a mirrored run (run.storage_path): fetch it into run.output_dir
            resume = download_run(str(resume), load_config(None, overrides, validate=False).run.output_dir)
        run_dir = Path(resume).expanduser()
        if not (run_dir / "config.yaml").is_file():
            raise CheckpointError(f"--resume {run_dir}: not a run directory (no config.yaml)")
        cfg = _load_run_config(run_dir, overrides)
        ckpts = list_checkpoints(run_dir)
        if ckpts:
            state = load_checkpoint(ckpts[-1][1], lazy=True)  # each process reads its own state file
            saved = checkpoint_config(state)
            pin_model_fields(cfg.model, recorded_before_pinning=True)  # config.yaml of a run from before: its shape
            _follow_moved_model(cfg, saved)
            _check_resumable(cfg, saved)
            done = int(state["counters"]["inner_step"])
            if cfg.run.steps < done:
                raise ConfigError(
                    [
                        f"run.steps = {cfg.run.steps}: the checkpoint has already trained {done} inner steps; "
                        f"give at least {done} (more extends the run)"
                    ]
                )
            if cfg.run.steps > saved.run.steps and done % cfg.diloco.H:
                raise ConfigError(
                    [
                        f"run.steps = {cfg.run.steps}: the checkpoint ends at inner step {done}, part way "
                        f"through an outer step of diloco.H = {cfg.diloco.H} (its run.steps = "
                        f"{saved.run.steps} is not a multiple of H), so the run cannot be extended"
                    ]
                )
        else:  # it stopped before its first checkpoint (a failed start-up): run it again from step 0
            logger.warning(f"note: {run_dir} has no checkpoint yet; starting it again from step 0 with its config.yaml")
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
    logger.warning(
        f"{run_dir} has finished its {steps} inner steps: nothing to train (--set run.steps=N with N > {steps} "
        "trains it further)"
    )
    shown = f"{loss:.4f}" if isinstance(loss, float) else str(loss)
    logger.info(f"final validation loss of the global model: {shown}", extra=RESULT)
    logger.info(f"run directory: {run_dir}", extra=RESULT)
    return summary


def _start_ray(cfg: Config) -> bool:
    """``init_ray``; a run that started its own Ray owns this process (the CLI's): its threads then
    follow the job's plan (``components.threads``), set after Ray started so that Ray's own
    processes keep Ray's settings. Returns whether it started Ray."""
    started = init_ray(cfg)
    if started:
        job_threads().apply()
    return started


def train(config: Any = None, overrides: list[str] | None = None, *, resume: str | Path | None = None,
          address: str | None = None, model_fn: ModelFn | None = None, corpus: Corpus | None = None,
          on_outer_step: Any = None) -> dict[str, Any]:  # fmt: skip
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
    done = int(rs["counters"]["inner_step"]) if rs is not None else 0
    if rs is not None and done >= cfg.run.steps and (run_dir / "summary.json").is_file():
        finished = _finished(run_dir, done)
        if finished is not None:
            return finished
    corpus = corpus if corpus is not None else _load_corpus(cfg, run_dir)
    resolved = _resolve(cfg, corpus, model_fn, rs)
    _check_corpus(cfg, corpus, run_dir, rs)
    started_ray = _start_ray(cfg)
    # run.storage_path a URI: a copy of the run directory there
    mirror = Mirror(run_dir, cfg.run.storage_path, cfg.run.keep_checkpoints) if is_uri(cfg.run.storage_path) else None
    trainer = Trainer(cfg, run_dir, corpus, model_fn, rs, resolved, mirror, on_outer_step)
    run = trainer.cfg  # the run's config: the user's with what it resolved (the user's is not changed)
    tracker = lock = None
    try:
        lock = _open_run_dir(trainer, fresh=resume is None)
        trainer.start()
        if resume is not None:  # only now: a resume that fails to start leaves the run directory as it was
            write_text(str(run_dir / "config.yaml"), run.to_yaml())  # atomic
            _truncate_metrics(run_dir, rs["outer_step"] if rs is not None else 0)
        if rs is not None:
            logger.info(
                f"resumed from the checkpoint of outer step {rs['outer_step']} "
                f"(inner step {trainer.state.inner_step} of {run.run.steps})"
            )
        logger.info(f"run directory: {run_dir}")
        tracker = Tracker(run, run_dir, run.run.steps, trainer.state.inner_step)
        timing = trainer.run(tracker)
        summary = _summary(trainer, timing, rs)
        tracker.finish(summary)  # first: summary.json marks a finished run, W&B included
        tracker = None
        write_summary(run_dir, summary)
        if trainer.mirror is not None and not trainer.mirror.sync(final=True):
            logger.warning(
                f"warning: the copy of the run at {trainer.mirror.uri} is incomplete (the uploads above "
                f"failed); the run directory {run_dir} is complete"
            )
    except RunStopped as e:
        raise ClusterError(f"{e} ({_resume_hint(run_dir)})") from None
    except ray.exceptions.RayError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, RayDilocoError):  # a worker's own one-line error
            raise cause from None
        raise ClusterError(
            f"a replica worker or the outer-optimiser driver failed: {error_cause(e)} ({_resume_hint(run_dir)})"
        ) from None
    finally:
        with signals_deferred():  # a second Ctrl-C must not cut the clean-up short
            if tracker is not None:
                tracker.finish({})
            trainer.shutdown()
            if started_ray:
                ray.shutdown()
            if lock is not None:
                lock.close()
    logger.info(f"final validation loss of the global model: {summary['final_eval_loss']:.4f}", extra=RESULT)
    logger.info(f"run directory: {run_dir}", extra=RESULT)
    return summary


def _load_corpus(cfg: Config, run_dir: Path) -> Corpus:
    """The run's corpus, tokenised with the run's saved tokenizer when it has one (a resume); a
    prepared store (``data.prepared``) is only opened (its manifest and tokenizer). Its validation
    split is cut to the ``run.eval_tokens`` an evaluation reads."""
    tok_dir = run_dir / "tokenizer"
    tokenizer = load_saved_tokenizer(tok_dir) if (tok_dir / "tokenizer.json").is_file() else None
    corpus = load_corpus(cfg.data, tokenizer=tokenizer, address=cfg.run.address)
    corpus.val = eval_split(corpus.val, cfg.run.eval_tokens)
    return corpus


def _resolve(cfg: Config, corpus: Corpus, model_fn: ModelFn | None, rs: dict[str, Any] | None) -> ResolvedRun:
    """The run's :class:`ResolvedRun`: the token budget's steps (a new run with
    ``run.tokens_per_parameter``; a resume keeps its recorded steps) and the pinned model shape.

    Raises:
        ConfigError: ``model.vocab_size`` below the tokenizer's, a budget over the step limit, or
            ``model.init_from``'s weights damaged or not those of its config (a new run).
    """
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < corpus.vocab_size:
        raise ConfigError(
            [
                f"model.vocab_size = {cfg.model.vocab_size}: smaller than the tokenizer's "
                f"{corpus.vocab_size} tokens (leave it unset to use the tokenizer's)"
            ]
        )
    if cfg.model.init_from:
        from ray_diloco.config.pretrained import model_dir, pretrained_shape

        model_dir(cfg.model.init_from)  # a hub id: its files fetched here once, before the workers read them
        if rs is None:  # a resume's weights are its checkpoint's
            from ray_diloco.models.pretrained import check_weights

            check_weights(cfg.model.init_from)
        vocab = pretrained_shape(cfg.model.init_from)["vocab_size"]
        if vocab is not None and vocab < corpus.vocab_size:
            raise ConfigError(
                [
                    f"model.init_from = {cfg.model.init_from!r}: its vocabulary has {vocab} tokens, the data's "
                    f"tokenizer (data.tokenizer = {cfg.data.tokenizer!r}) {corpus.vocab_size}: vocabularies differ"
                ]
            )
    if cfg.run.tokens_per_parameter is None or rs is not None:
        return ResolvedRun.resolve(cfg)
    from ray_diloco.models.transformer import budget_steps

    steps = budget_steps(cfg, corpus.vocab_size, model_fn)
    logger.info(
        f"run.steps = {steps}: run.tokens_per_parameter = {cfg.run.tokens_per_parameter:g} x the model's "
        f"parameters / (inner.global_batch x data.seq_len)"
    )
    return ResolvedRun.resolve(cfg, steps)


def _check_corpus(cfg: Config, corpus: Corpus, run_dir: Path, rs: dict[str, Any] | None) -> None:
    """Every data shard holds at least one batch; a resume reads the corpus it was trained on.

    Raises:
        DataError: too little text for the shards. CheckpointError: another corpus on resume.
    """
    per_shard = num_train_windows(len(corpus.train), cfg.data.seq_len) // cfg.num_shards
    if per_shard < cfg.batch_per_worker:
        raise DataError(
            f"data: {len(corpus.train):,} training tokens give {per_shard} sequences of {cfg.data.seq_len} "
            f"tokens per shard, fewer than one batch of {cfg.batch_per_worker} "
            f"(inner.global_batch / (diloco.replicas x diloco.workers_per_replica)); use more text"
        )
    if rs is not None and rs.get("corpus_fingerprint") != corpus.fingerprint:
        raise CheckpointError(f"--resume {run_dir}: the corpus differs from the one the checkpoint was trained on")


def _open_run_dir(trainer: Trainer, fresh: bool) -> Any:
    """Check the cluster, then create and lock the run directory (the lock is returned, held until
    this process ends), write a new run's ``config.yaml`` and tokenizer, and set up the mirror.

    Raises:
        ClusterError: the cluster cannot host the workers (before anything is written).
        CheckpointError: another run started in the same directory at the same time.
    """
    run, run_dir, corpus = trainer.cfg, trainer.run_dir, trainer.corpus
    check_resources(run)  # before the run directory is written
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_run_dir(run_dir)
    try:
        if fresh and any(p.name != ".lock" for p in run_dir.iterdir()):
            raise CheckpointError(f"run directory {run_dir}: another run started in it at the same time")
        remove_partial_checkpoints(run_dir)
        if fresh:  # a resume rewrites it (with its --set changes) only once it has started
            write_text(str(run_dir / "config.yaml"), run.to_yaml())  # atomic
        tok_dir = run_dir / "tokenizer"
        if corpus.tokenizer is not None and not tok_dir.exists():
            corpus.tokenizer.save_pretrained(str(tok_dir))
        if trainer.mirror is not None:
            logger.info(f"mirroring to {trainer.mirror.uri} (resume anywhere with --resume {trainer.mirror.uri})")
    except BaseException:  # the caller only closes a lock it was given
        lock.close()
        raise
    return lock


def _summary(trainer: Trainer, timing: dict[str, float], rs: dict[str, Any] | None) -> dict[str, Any]:
    """Export the global model to ``RUN_DIR/final`` and return the run's summary."""
    run, st, run_dir = trainer.cfg, trainer.state, trainer.run_dir
    compiled_before = float(rs["counters"].get("compile_s", 0.0)) if rs else 0.0  # a resumed run's earlier processes
    trainer.settle()
    export_dir = export_model(
        run,
        trainer.global_params,
        trainer.corpus.vocab_size,
        trainer.corpus.tokenizer,
        run_dir / "final",
        trainer.model_fn,
        trainer.fragments,
        trainer.sync.export_weights,
    )
    return {
        "final_eval_loss": st.last_eval,
        "evals": st.evals,
        "algorithm": run.algorithm,
        "replicas": run.diloco.replicas,
        "workers_per_replica": run.diloco.workers_per_replica,
        "H": run.diloco.H,
        "num_parameters": trainer.num_params,
        "tokens": st.tokens,
        "inner_steps": st.inner_step,
        "outer_steps": st.outer_step,
        "wall_s": timing["wall_s"],
        "inner_compute_s": timing["inner_compute_s"],
        "outer_wait_s": timing["outer_wait_s"],
        "compile_s": st.compile_s - compiled_before,
        "tokens_per_s": (st.tokens - (rs["counters"]["tokens"] if rs else 0))
        / (timing["wall_s"] - st.compile_s + compiled_before)
        if timing["wall_s"] > st.compile_s - compiled_before
        else None,
        "bytes_sent": st.bytes_sent,
        "bytes_received": st.bytes_received,
        "communication": communication_summary(
            trainer.num_params,
            st.inner_step,
            strategy_class(run).link_ranks(run),
            st.bytes_sent,
            st.bytes_received,
            st.peak_sync_bytes,
        ),
        "compute_utilisation": st.inner_compute_s / st.train_wall_s if st.train_wall_s > 0 else None,
        "sync_wait_s": st.sync_wait_s,
        "fragments": trainer.num_fragments,
        "membership": dict(st.membership),
        "replicas_live": len(trainer.replicas),
        "run_dir": str(run_dir),
        "storage_uri": trainer.mirror.uri if trainer.mirror is not None else None,
        "export_dir": str(export_dir),
        "config": run.to_dict(),
    }


__all__ = ["train", "prepare", "ResolvedRun"]


def _resume_hint(run_dir: Path) -> str:
    """How to go on after a run stopped: resume from its newest checkpoint, or start again."""
    from ray_diloco.components.checkpoint import list_checkpoints

    try:
        found = bool(list_checkpoints(run_dir))
    except Exception:  # an unreadable checkpoint directory: the resume says why
        found = True
    if found:
        return f"ray-diloco train --resume {run_dir} continues from its last checkpoint"
    return "it wrote no checkpoint yet: start it again"
