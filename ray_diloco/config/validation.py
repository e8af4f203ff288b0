"""Validation of a built :class:`~ray_diloco.config.schema.Config`: one line per problem.

Each section has its own check; they run in the order of :data:`_CHECKS` and append to one list,
so a config with several problems reports all of them. The checks of the resolved model shape and
of the fragments against it run only when nothing before them failed (they need sane fields).
Cluster-dependent checks (CPUs available) happen in the trainer before any actor starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray_diloco.config.presets import PRESETS, resolve_model_shape
from ray_diloco.config.schema import (
    ALGORITHMS,
    BPE_VOCAB_RULE,
    CLOSING_ROUNDS,
    COMPILE_MODES,
    FAMILIES,
    JOIN_INNER_STATES,
    MAX_STEPS,
    MIN_BPE_VOCAB,
    OUTER_OPTIMIZERS,
    PATTERNS,
    PRECISIONS,
    QUANTIZATION_FORMATS,
    REPLICA_NODES,
    SHARDINGS,
    TRACKING_MODES,
    Config,
)
from ray_diloco.errors import ConfigError


def num_fragments(block_fragments: int, extra: int = 2) -> int:
    """Fragments exchanged in a run: 1 for plain DiLoCo, else P block fragments + ``extra``
    (embeddings, final norm + LM head)."""
    return 1 if block_fragments == 1 else block_fragments + extra


def check_overlap(H: int, fragments: int, tau: int, errors: list[str]) -> None:
    """Streaming DiLoCo requires tau < H / F (F: all fragments), so a fragment's merge lands
    before the next fragment syncs; appends one line to ``errors`` when it does not hold."""
    if H >= 1 and tau >= 1 and tau * fragments >= H:
        what = (
            "1 fragment"
            if fragments == 1
            else f"{fragments} fragments: {fragments - 2} of blocks + embeddings + head"
            if fragments > 2
            else f"{fragments} fragments"
        )
        errors.append(
            f"streaming.overlap_steps = {tau}: must be < diloco.H / F = {H} / {fragments} "
            f"= {H / fragments:g} (F = {what}; each fragment's merge must land before the next one syncs)"
        )


def _need(e: list[str], ok: bool, key: str, value: Any, allowed: str) -> None:
    """Append ``KEY = VALUE: allowed`` to ``e`` unless ``ok``."""
    if not ok:
        e.append(f"{key} = {value!r}: {allowed}")


def _one_of(e: list[str], key: str, value: Any, allowed: tuple[str, ...]) -> None:
    _need(e, value in allowed, key, value, f"must be one of {', '.join(allowed)}")


def _check_algorithm(cfg: Config, e: list[str]) -> None:
    _one_of(e, "algorithm", cfg.algorithm, ALGORITHMS)
    d = cfg.diloco
    if cfg.algorithm != "dp":
        return
    if d.spare_replicas:  # the DP baseline: one fixed DDP group, no outer optimiser
        e.append(f"diloco.spare_replicas = {d.spare_replicas}: spares need algorithm: diloco")
    if d.outer_shards != 1:
        e.append(
            f"diloco.outer_shards = {d.outer_shards}: outer shards need algorithm: diloco "
            "(the DP baseline has no outer optimiser); leave it at 1"
        )
    if (d.max_replicas or d.replicas) != d.replicas:
        e.append(
            f"diloco.max_replicas = {d.max_replicas!r}: elastic replicas need algorithm: diloco "
            "(the DP baseline is one fixed DDP group)"
        )


#: Ray's own resources: an actor asks for them with num_cpus/num_gpus/memory, never by name
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def _check_diloco(cfg: Config, e: list[str]) -> None:
    d = cfg.diloco
    _need(e, d.H >= 1, "diloco.H", d.H, "must be an integer >= 1")
    _need(e, d.replicas >= 1, "diloco.replicas", d.replicas, "must be an integer >= 1")
    _need(e, d.workers_per_replica >= 1, "diloco.workers_per_replica", d.workers_per_replica, "must be an integer >= 1")
    _need(e, d.cpus_per_worker is None or d.cpus_per_worker > 0, "diloco.cpus_per_worker", d.cpus_per_worker,
          "must be > 0 (or none: share the cluster's CPUs evenly)")  # fmt: skip
    _need(e, d.gpus_per_worker >= 0, "diloco.gpus_per_worker", d.gpus_per_worker, "must be >= 0")
    _need(e, math.isfinite(d.outer_cpus) and d.outer_cpus >= 0, "diloco.outer_cpus", d.outer_cpus,
          "must be >= 0 CPUs (0: none reserved, one thread)")  # fmt: skip
    _need(e, d.pg_timeout_s > 0, "diloco.pg_timeout_s", d.pg_timeout_s, "must be > 0 seconds")
    _need(e, d.placement_timeout_s > 0, "diloco.placement_timeout_s", d.placement_timeout_s, "must be > 0 seconds")
    _need(
        e,
        1 <= d.min_replicas <= max(d.replicas, 1),
        "diloco.min_replicas",
        d.min_replicas,
        f"must be an integer in [1, diloco.replicas = {d.replicas}]",
    )
    _need(
        e,
        d.max_replicas is None or d.max_replicas >= d.replicas,
        "diloco.max_replicas",
        d.max_replicas,
        f"must be >= diloco.replicas = {d.replicas} (or none: no scale-up)",
    )
    _need(
        e,
        d.sync_timeout_s > 0 and math.isfinite(d.sync_timeout_s),
        "diloco.sync_timeout_s",
        d.sync_timeout_s,
        "must be a finite number of seconds > 0",
    )
    _need(
        e,
        1 <= d.outer_shards <= 64,
        "diloco.outer_shards",
        d.outer_shards,
        "must be an integer in [1, 64] (outer-optimiser shard actors)",
    )
    _need(e, d.max_failures >= 0, "diloco.max_failures", d.max_failures, "must be an integer >= 0")
    _need(e, d.driver_resource not in RAY_BUILTIN_RESOURCES and d.driver_resource.strip() == d.driver_resource, "diloco.driver_resource", d.driver_resource, "must be a custom Ray resource name (not CPU, GPU, memory or object_store_memory, no surrounding spaces), or empty")  # fmt: skip
    _need(
        e,
        0 <= d.spare_replicas <= cfg.num_slots,
        "diloco.spare_replicas",
        d.spare_replicas,
        f"must be an integer in [0, max(diloco.replicas, diloco.max_replicas) = {cfg.num_slots}]",
    )
    _one_of(e, "diloco.join_inner_state", d.join_inner_state, JOIN_INNER_STATES)
    _one_of(e, "diloco.replica_nodes", d.replica_nodes, REPLICA_NODES)
    _one_of(e, "diloco.sharding", d.sharding, SHARDINGS)
    if d.workers_per_replica >= 2 and 0 < d.gpus_per_worker < 1:
        e.append(
            f"diloco.gpus_per_worker = {d.gpus_per_worker:g}: a replica of {d.workers_per_replica} workers forms an "
            "NCCL group, which cannot put two ranks on one GPU: give each worker a whole GPU (or use "
            "diloco.workers_per_replica = 1)"
        )
    _check_sharding(cfg, e)


def _check_sharding(cfg: Config, e: list[str]) -> None:
    """``diloco.sharding`` and ``diloco.shard_group_size`` (FSDP, HSDP inside a replica)."""
    d = cfg.diloco
    if d.sharding in ("fsdp", "hsdp"):
        least = 2 if d.sharding == "fsdp" else 4
        _need(
            e,
            d.workers_per_replica >= least,
            "diloco.sharding",
            d.sharding,
            f"{d.sharding} shards a replica over its workers: needs diloco.workers_per_replica >= {least} "
            f"(it is {d.workers_per_replica})",
        )
        _need(
            e,
            cfg.algorithm == "diloco",
            "diloco.sharding",
            d.sharding,
            f"{d.sharding} is for DiLoCo replicas; the {cfg.algorithm} baseline uses DDP",
        )
    w, g = d.workers_per_replica, d.shard_group_size
    if d.sharding == "hsdp" and w >= 4 and g is not None:
        _need(e, 2 <= g < w and w % g == 0, "diloco.shard_group_size", g,
              f"must divide diloco.workers_per_replica = {w}, with 2 <= S < {w} (S = {w}: sharding fsdp)")  # fmt: skip
    elif d.sharding == "hsdp" and w >= 4:
        _need(e, cfg.shard_group_size > 1, "diloco.workers_per_replica", w,
              "hsdp needs shard groups of S ranks, 2 <= S < W dividing W, and it has no such divisor "
              "(use a W with one, such as 4 or 6, or sharding fsdp)")  # fmt: skip
    if d.shard_group_size is not None and d.sharding != "hsdp":
        _need(e, False, "diloco.shard_group_size", d.shard_group_size,
              f"is read only with diloco.sharding = hsdp (it is {d.sharding})")  # fmt: skip


def _check_inner(cfg: Config, e: list[str]) -> None:
    i, d = cfg.inner, cfg.diloco
    _need(e, i.lr > 0 and math.isfinite(i.lr), "inner.lr", i.lr, "must be a finite number > 0")
    _need(e, 0 <= i.beta1 < 1, "inner.beta1", i.beta1, "must be in [0, 1)")
    _need(e, 0 <= i.beta2 < 1, "inner.beta2", i.beta2, "must be in [0, 1)")
    _need(e, i.eps > 0 and math.isfinite(i.eps), "inner.eps", i.eps, "must be a finite number > 0")
    _need(e, i.weight_decay >= 0, "inner.weight_decay", i.weight_decay, "must be >= 0")
    _need(e, i.warmup_steps >= 0, "inner.warmup_steps", i.warmup_steps, "must be >= 0")
    _need(e, 0 <= i.min_lr_ratio <= 1, "inner.min_lr_ratio", i.min_lr_ratio, "must be in [0, 1]")
    _need(e, i.grad_clip >= 0, "inner.grad_clip", i.grad_clip, "must be >= 0 (0 disables clipping)")
    _need(e, i.global_batch >= 1, "inner.global_batch", i.global_batch, "must be an integer >= 1")
    workers = d.replicas * d.workers_per_replica
    if i.global_batch >= 1 and d.replicas >= 1 and d.workers_per_replica >= 1 and i.global_batch % workers:
        e.append(
            f"inner.global_batch = {i.global_batch}: must be divisible by diloco.replicas x "
            f"diloco.workers_per_replica = {d.replicas} x {d.workers_per_replica} = {workers}"
        )
    elif i.micro_batch is not None and i.global_batch >= 1 and workers >= 1:
        share = i.global_batch // workers
        _need(
            e,
            1 <= i.micro_batch <= share and share % i.micro_batch == 0,
            "inner.micro_batch",
            i.micro_batch,
            f"must divide a worker's share of the batch, inner.global_batch / (diloco.replicas x "
            f"diloco.workers_per_replica) = {share} (or none: one pass of it)",
        )


def _check_outer(cfg: Config, e: list[str]) -> None:
    o = cfg.outer
    _one_of(e, "outer.name", o.name, OUTER_OPTIMIZERS)
    _need(e, o.lr > 0 and math.isfinite(o.lr), "outer.lr", o.lr, "must be a finite number > 0")
    _need(e, 0 <= o.momentum < 1, "outer.momentum", o.momentum, "must be in [0, 1)")
    _need(e, 0 <= o.adam_beta2 < 1, "outer.adam_beta2", o.adam_beta2, "must be in [0, 1)")
    _need(e, o.adam_eps > 0, "outer.adam_eps", o.adam_eps, "must be > 0")


def _check_model(cfg: Config, e: list[str]) -> None:
    m = cfg.model
    _one_of(e, "model.preset", m.preset, tuple(PRESETS))
    _need(
        e, m.family is None or m.family in FAMILIES, "model.family", m.family, f"must be one of {', '.join(FAMILIES)}"
    )
    for k in ("n_layers", "n_heads", "d_model", "d_ff", "context", "vocab_size"):
        v = getattr(m, k)
        _need(e, v is None or v >= 1, f"model.{k}", v, "must be an integer >= 1")
    _need(e, m.z_loss is None or m.z_loss >= 0, "model.z_loss", m.z_loss, "must be >= 0")
    _need(e, m.init_std > 0, "model.init_std", m.init_std, "must be > 0")
    _need(e, m.init_from is None or bool(m.init_from.strip()), "model.init_from", m.init_from,
          "must name a model directory or a hub id (leave it unset for a preset)")  # fmt: skip
    if m.init_from is not None and not e:  # its config.json (a hub id: that file is fetched)
        from ray_diloco.config.pretrained import init_from_problems

        try:
            e += init_from_problems(cfg)
        except ConfigError as err:
            e += err.problems


def _check_data(cfg: Config, e: list[str]) -> None:
    dc = cfg.data
    _need(e, dc.seq_len >= 1, "data.seq_len", dc.seq_len, "must be an integer >= 1")
    _need(e, 0 < dc.val_fraction < 1, "data.val_fraction", dc.val_fraction, "must be in (0, 1)")
    _need(e, dc.bpe_vocab_size >= MIN_BPE_VOCAB, "data.bpe_vocab_size", dc.bpe_vocab_size, BPE_VOCAB_RULE)
    _need(e, dc.max_documents is None or dc.max_documents >= 1, "data.max_documents", dc.max_documents, "must be >= 1")
    _need(e, dc.in_process_bytes >= 0, "data.in_process_bytes", dc.in_process_bytes, "must be >= 0")
    if dc.prepared is not None and (dc.path is not None or dc.dataset is not None):
        e.append(
            f"data.prepared = {dc.prepared!r}: a prepared store replaces data.path and data.dataset; "
            "set only one of them"
        )
    _need(
        e,
        dc.prepared is None or (isinstance(dc.prepared, str) and dc.prepared.strip() != ""),
        "data.prepared",
        dc.prepared,
        "must be a store directory or URI (made by ray-diloco prepare)",
    )
    if dc.path is not None and not Path(dc.path).expanduser().exists():
        e.append(f"data.path = {dc.path!r}: file not found")
    elif dc.path is not None and not Path(dc.path).expanduser().is_file():
        e.append(f"data.path = {dc.path!r}: not a file")


def _check_model_shape(cfg: Config, e: list[str]) -> None:
    """The resolved shape (preset + overrides): heads divide the width, RoPE's even head size, and
    a training sequence within the context. Only when every field checked so far is valid."""
    if cfg.model.preset not in PRESETS or e:
        return
    shape = resolve_model_shape(cfg.model, vocab_size=1)
    if shape["d_model"] % shape["n_heads"]:
        e.append(f"model.d_model = {shape['d_model']}: must be divisible by model.n_heads = {shape['n_heads']}")
    elif shape["family"] != "gpt2" and (shape["d_model"] // shape["n_heads"]) % 2:
        e.append(
            f"model.d_model = {shape['d_model']}: d_model / n_heads = {shape['d_model'] // shape['n_heads']} "
            "must be even (RoPE rotates pairs of dimensions)"
        )
    if cfg.data.seq_len > shape["context"]:
        e.append(f"data.seq_len = {cfg.data.seq_len}: must be <= model.context = {shape['context']}")


def _check_streaming(cfg: Config, e: list[str]) -> None:
    st = cfg.streaming
    _need(e, st.fragments >= 1, "streaming.fragments", st.fragments, "must be an integer >= 1 (1: plain DiLoCo)")
    _need(
        e,
        st.layers_per_fragment is None or st.layers_per_fragment >= 1,
        "streaming.layers_per_fragment",
        st.layers_per_fragment,
        "must be an integer >= 1 (or none)",
    )
    if st.layers_per_fragment is not None and st.fragments != 1:
        e.append(
            f"streaming.layers_per_fragment = {st.layers_per_fragment}: set either it or streaming.fragments "
            f"(= {st.fragments}), not both"
        )
    _one_of(e, "streaming.pattern", st.pattern, PATTERNS)
    _need(e, st.overlap_steps >= 0, "streaming.overlap_steps", st.overlap_steps, "must be an integer >= 0")
    _need(e, 0 <= st.alpha <= 1, "streaming.alpha", st.alpha, "must be in [0, 1]")
    _one_of(e, "streaming.quantization", st.quantization, QUANTIZATION_FORMATS)
    _one_of(e, "streaming.closing_round", st.closing_round, CLOSING_ROUNDS)
    if cfg.model.preset in PRESETS and not e:
        layers = resolve_model_shape(cfg.model, vocab_size=1)["n_layers"]
        P = cfg.block_fragments
        if P > layers:
            e.append(f"streaming.fragments = {P}: must be <= model.n_layers = {layers} (a fragment holds whole blocks)")
        else:
            check_overlap(cfg.diloco.H, num_fragments(P), st.overlap_steps, e)


def _check_network(cfg: Config, e: list[str]) -> None:
    n = cfg.network
    _need(
        e,
        n.bandwidth_gbps is None or (1e-6 <= n.bandwidth_gbps <= 1e6),
        "network.bandwidth_gbps",
        n.bandwidth_gbps,
        "must be in [1e-6, 1e6] Gbit/s (or none: no emulation)",
    )
    _need(e, 0 <= n.latency_ms <= 60_000, "network.latency_ms", n.latency_ms, "must be in [0, 60000] milliseconds")


def _check_run(cfg: Config, e: list[str]) -> None:
    r = cfg.run
    _need(e, 1 <= r.steps <= MAX_STEPS, "run.steps", r.steps, f"must be an integer in 1..{MAX_STEPS:,}")
    _need(
        e,
        r.tokens_per_parameter is None or (r.tokens_per_parameter > 0 and math.isfinite(r.tokens_per_parameter)),
        "run.tokens_per_parameter",
        r.tokens_per_parameter,
        "must be a finite number > 0 (or none: use run.steps)",
    )
    _need(e, 0 <= r.seed < 2**32, "run.seed", r.seed, "must be an integer in [0, 2**32)")
    _need(e, r.eval_every >= 0, "run.eval_every", r.eval_every, "must be >= 0 outer steps (0: only at the end)")
    _need(e, r.eval_batch >= 1, "run.eval_batch", r.eval_batch, "must be an integer >= 1")
    _need(
        e,
        r.eval_tokens is None or r.eval_tokens > cfg.data.seq_len,
        "run.eval_tokens",
        r.eval_tokens,
        f"must be an integer > data.seq_len = {cfg.data.seq_len} (or none: the validation split up to 1M tokens)",
    )
    _need(
        e,
        r.checkpoint_every >= 0,
        "run.checkpoint_every",
        r.checkpoint_every,
        "must be >= 0 outer steps (0: only at the end)",
    )
    _need(
        e,
        r.name is None or (r.name not in ("", ".", "..") and "/" not in r.name and "\\" not in r.name),
        "run.name",
        r.name,
        "must be a plain directory name (no path separators)",
    )
    _need(e, r.keep_checkpoints >= 1, "run.keep_checkpoints", r.keep_checkpoints, "must be an integer >= 1")
    _one_of(e, "run.precision", r.precision, PRECISIONS)
    _one_of(e, "run.compile", r.compile, COMPILE_MODES)
    if r.export_precision is not None:
        _one_of(e, "run.export_precision", r.export_precision, PRECISIONS)


def _check_tracking(cfg: Config, e: list[str]) -> None:
    t = cfg.tracking
    _one_of(e, "tracking.mode", t.mode, TRACKING_MODES)
    _need(
        e,
        t.init_timeout_s > 0 and math.isfinite(t.init_timeout_s),
        "tracking.init_timeout_s",
        t.init_timeout_s,
        "must be a finite number of seconds > 0",
    )


#: The section checks, in the order their lines are reported.
_CHECKS: tuple[Callable[[Config, list[str]], None], ...] = (
    _check_algorithm,
    _check_diloco,
    _check_inner,
    _check_outer,
    _check_model,
    _check_data,
    _check_model_shape,
    _check_streaming,
    _check_network,
    _check_run,
    _check_tracking,
)


def validate_config(cfg: Config) -> None:
    """Check every field; raise :class:`ConfigError` listing each problem on its own line.

    Cluster-dependent checks (CPUs available) happen in the trainer before any actor starts.
    """
    e: list[str] = []
    for check in _CHECKS:
        check(cfg, e)
    if e:
        raise ConfigError(e)
