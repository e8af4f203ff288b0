"""``ray-diloco plan``: the fragments of a run, when each one syncs and how many bytes move.

Everything is computed from the config alone (the model is built on the ``meta`` device, so
no memory is allocated even for the 10B preset): the fragment partition
(``fragments.plan_fragments``), the sync schedule (``schedules.SyncSchedule``) and the wire
sizes of the chosen quantisation (``core.formats.WireFormat.message_nbytes``), next to the data-parallel
equivalent (``exchange.dp_equivalent_bytes``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ray_diloco.components.threads import outer_threads, worker_threads
from ray_diloco.config import Config
from ray_diloco.core.formats import RAW, wire_format
from ray_diloco.core.fragments import block_index, fragment_plan, param_specs
from ray_diloco.core.schedules import SyncSchedule
from ray_diloco.core.wire import DP_FORMULA, dp_equivalent_bytes
from ray_diloco.errors import ConfigError
from ray_diloco.models.transformer import build_transformers_model, resolve_model_shape
from ray_diloco.runtime.strategy import STRATEGIES, strategy_class


def plan_vocab_size(cfg: Config) -> int:
    """The vocabulary size a run would use: ``model.vocab_size``, the tokenizer's, or the
    character vocabulary of the local corpus.

    Raises:
        DataError: the tokenizer or corpus cannot be loaded.
    """
    if cfg.model.vocab_size is not None:
        return cfg.model.vocab_size
    if cfg.data.tokenizer == "bpe":
        return cfg.data.bpe_vocab_size
    if cfg.data.tokenizer != "char":
        from ray_diloco.components.text import build_tokenizer

        return len(build_tokenizer(cfg.data, []))
    from ray_diloco.components.data import load_corpus

    return load_corpus(cfg.data).vocab_size


def _describe(names: tuple[str, ...]) -> str:
    blocks = sorted({b for n in names if (b := block_index(n)) is not None})
    other = [n for n in names if block_index(n) is None]
    parts = []
    if blocks:
        parts.append("blocks " + ",".join(map(str, blocks)))
    if other:
        parts.append(", ".join(other) if len(other) <= 2 else f"{other[0]} ... ({len(other)} tensors)")
    return "; ".join(parts)


def codec_crossover(
    numel: int, fmt: str, replicas: int, outer_threads: int = 1, replica_threads: int = 1
) -> dict[str, Any] | None:
    """Whether a scaled format's exchange beats fp32's end to end, for one sync of ``numel``
    values with ``replicas`` replicas: the codec's CPU seconds on the critical path (a replica
    encodes with error feedback and decodes the reply on ``replica_threads``; the outer side checks
    and decodes ``replicas`` messages and encodes the reply on ``outer_threads``: the runs' thread
    plans, ``components.threads``) against the link
    seconds the smaller messages save; ``crossover_gbps``: the link bandwidth (Gbit/s, per
    replica, each way) below which the format is faster (the same for every model size: both
    sides scale with ``numel``). A model of the codec only: fp32's own copies into and out of the
    object store, which the measured exchange shows cost more than fp4's codec on one machine,
    are left out, so the figure is conservative. None for an unscaled format. The codec's
    seconds per value are each format's measured ``encode_s`` and ``decode_s``
    (``core.formats.WireFormat``; the outer side's check of a pseudo-gradient costs about a
    decode)."""
    f = wire_format(fmt)
    if not f.scaled:
        return None
    e, d = f.encode_s, f.decode_s
    replica_s = numel * (e + d) / max(1, replica_threads)
    outer_s = numel * (2 * replicas * d + e) / max(1, outer_threads)
    saved = 2 * (RAW.message_nbytes(numel) - f.message_nbytes(numel))  # up + down
    return {
        "format": fmt,
        "replica_codec_s": replica_s,
        "outer_codec_s": outer_s,
        "bytes_saved_per_sync": saved,
        "crossover_gbps": 8 * saved / (replica_s + outer_s) / 1e9,
    }


def sync_plan(cfg: Config, from_step: int = 0, upcoming: int = 3) -> dict[str, Any]:
    """The run's fragments, their next ``upcoming`` sync steps after ``from_step`` and the bytes
    one replica sends and receives per sync and over the run.

    Raises:
        ConfigError: the model cannot be cut into the configured fragments or tau does not fit.
        DataError: the vocabulary size cannot be determined.
    """
    vocab = plan_vocab_size(cfg)
    shape = resolve_model_shape(cfg.model, vocab)
    with torch.device("meta"):
        model = build_transformers_model(shape, shape["vocab_size"])
    specs = param_specs(model)
    try:
        frags = fragment_plan(cfg, specs)
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    n = sum(sp.numel for sp in specs)
    T = cfg.run.steps  # the token budget, when set, fixes them (as the run does: models.transformer.budget_steps)
    if cfg.run.tokens_per_parameter is not None:
        T = max(1, math.ceil(cfg.run.tokens_per_parameter * n / (cfg.inner.global_batch * cfg.data.seq_len)))
    F, H = len(frags), cfg.diloco.H
    sched = SyncSchedule(H, F, cfg.streaming.overlap_steps, T, cfg.streaming.closing_round)
    fmt = cfg.streaming.quantization
    sends = sched.sends_between(0, T)
    rows: list[dict[str, Any]] = []
    for f in frags:
        up = wire_format(fmt).message_nbytes(f.numel)
        steps = [t for t, g in sends if g == f.index]
        rows.append(
            {
                "fragment": f.index,
                "contents": _describe(f.names),
                "params": f.numel,
                "offset": sched.offset(f.index),
                "next_syncs": [t for t in steps if t > from_step][:upcoming],
                "syncs": len(steps),
                "bytes_up_per_sync": up,
                "bytes_down_per_sync": up,
            }
        )
    n = sum(f.numel for f in frags)
    M = cfg.diloco.replicas
    total_up = sum(r["bytes_up_per_sync"] * r["syncs"] for r in rows)
    total_down = sum(r["bytes_down_per_sync"] * r["syncs"] for r in rows)
    dp32 = 2 * dp_equivalent_bytes(n, T, M, 4)
    return {
        "algorithm": cfg.algorithm,
        "params": n,
        "fragments": F,
        "H": H,
        "overlap_steps": sched.overlap,
        "steps": T,
        "quantization": fmt,
        "replicas": M,
        "rows": rows,
        "bytes_up_per_replica": total_up,
        "bytes_down_per_replica": total_down,
        "peak_sync_bytes": max(r["bytes_up_per_sync"] + r["bytes_down_per_sync"] for r in rows),
        "dp_fp32_bytes_per_replica": dp32,
        "dp_bf16_bytes_per_replica": 2 * dp_equivalent_bytes(n, T, M, 2),
        "dp_formula": DP_FORMULA,
        "fewer_bytes_than_dp_fp32": dp32 / (total_up + total_down) if total_up and dp32 else None,
        "codec": codec_crossover(
            max(f.numel for f in frags), fmt, M, outer_threads(cfg).intra_op, worker_threads(cfg).intra_op
        ),
    }


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(b) < 1000 or unit == "TB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1000
    return str(b)


def format_plan(p: dict[str, Any]) -> str:
    """A readable table of :func:`sync_plan`."""
    lines = [
        f"{p['algorithm']}: {p['params']:,} parameters in {p['fragments']} fragment(s); H={p['H']}, "
        f"tau={p['overlap_steps']}, {p['steps']} steps, quantization {p['quantization']}, M={p['replicas']}",
        "",
        f"{'frag':>4}  {'params':>12}  {'offset':>6}  {'syncs':>5}  {'up/sync':>10}  {'down/sync':>10}  "
        f"{'next syncs':<18}  contents",
    ]
    for r in p["rows"]:
        nxt = ",".join(map(str, r["next_syncs"])) or "-"
        lines.append(
            f"{r['fragment']:>4}  {r['params']:>12,}  {r['offset']:>6}  {r['syncs']:>5}  "
            f"{_fmt_bytes(r['bytes_up_per_sync']):>10}  {_fmt_bytes(r['bytes_down_per_sync']):>10}  "
            f"{nxt:<18}  {r['contents']}"
        )
    ratio = p["fewer_bytes_than_dp_fp32"]
    lines += [
        "",
        f"per replica over the run: {_fmt_bytes(p['bytes_up_per_replica'])} up, "
        f"{_fmt_bytes(p['bytes_down_per_replica'])} down; peak per sync {_fmt_bytes(p['peak_sync_bytes'])}",
        f"data-parallel equivalent (up + down): {_fmt_bytes(p['dp_fp32_bytes_per_replica'])} fp32, "
        f"{_fmt_bytes(p['dp_bf16_bytes_per_replica'])} bf16"
        + (f"; {ratio:,.0f}x fewer bytes than fp32 DP" if ratio else ""),
        f"  ({p['dp_formula']})",
    ]
    c = p.get("codec")
    if c:
        lines.append(
            f"{c['format']} codec on the host, largest fragment: {c['replica_codec_s']:.3g} s per sync on a replica + "
            f"{c['outer_codec_s']:.3g} s on the outer side, to save {_fmt_bytes(c['bytes_saved_per_sync'])} per "
            f"replica: faster than fp32 on links below ~{c['crossover_gbps']:.0f} Gbit/s (benchmarks/codec.py)"
        )
    if STRATEGIES[p["algorithm"]].all_reduces_every_step:
        lines.insert(1, "note: algorithm dp all-reduces every step; the rows show what DiLoCo would exchange")
    return "\n".join(lines)


def wall_clock_plan(
    cfg: Config,
    p: dict[str, Any],
    chips: int,
    tflops: float,
    mfu: float,
    bandwidth_gbps: float | None = None,
    latency_ms: float | None = None,
) -> dict[str, Any]:
    """The run's predicted wall-clock from the compute-utilisation simulator
    (:mod:`ray_diloco.analysis.simulate`): step time from 6 x N x (global batch x seq len) FLOPs split
    over M replicas of ``chips`` chips at ``tflops`` x ``mfu``; the run's own method (DP, DiLoCo H, or
    its fragments, tau and wire format). With a bandwidth (the argument, else
    ``network.bandwidth_gbps``) it returns the time; without, the bandwidth per target.

    Returns a dict with ``step_s``, ``method``, ``bits_per_value`` and either ``bandwidth_gbps``,
    ``utilisation``, ``compute_s``, ``total_s`` or ``required_gbps`` (target -> Gbit/s)."""
    from ray_diloco.analysis.simulate import (
        TARGETS,
        Method,
        ModelSpec,
        Network,
        link_factor,
        required_bandwidth,
        step_time_s,
        wall_clock,
    )

    tokens = cfg.inner.global_batch * cfg.data.seq_len
    step = step_time_s(p["params"], tokens, chips * cfg.diloco.replicas, tflops, mfu)  # the batch is split over M
    model = ModelSpec(f"{p['params']:.3g}", p["params"], resolve_model_shape(cfg.model, 1)["n_layers"], step)
    largest = max(p["rows"], key=lambda r: r["params"])
    bits = 8 * largest["bytes_up_per_sync"] / largest["params"]
    if strategy_class(cfg).all_reduces_every_step:
        method = Method("dp", bits=16.0)  # DP reduces bf16 gradients
    elif p["fragments"] == 1 and p["overlap_steps"] == 0:
        method = Method("diloco", H=p["H"], bits=bits)
    else:
        method = Method(
            "streaming_overlap" if p["overlap_steps"] else "streaming",
            H=p["H"],
            tau=p["overlap_steps"],
            bits=bits,
            fragments=p["fragments"],
        )
    latency = (latency_ms if latency_ms is not None else cfg.network.latency_ms) / 1000
    replicas = max(2, cfg.diloco.replicas)
    out: dict[str, Any] = {
        "step_s": step,
        "tokens_per_step": tokens,
        "chips_per_replica": chips,
        "method": method.kind,
        "bits_per_value": method.wire_bits,
        "latency_s": latency,
        "steps": p["steps"],
    }
    bw = bandwidth_gbps if bandwidth_gbps is not None else cfg.network.bandwidth_gbps
    exchange = "ring" if method.kind == "dp" else "server"  # DDP all-reduces; DiLoCo goes through the driver
    shards = 1 if method.kind == "dp" else min(cfg.diloco.outer_shards, replicas)  # one per replica node at most
    out.update(
        exchange=exchange,
        outer_shards=shards,
        link_factor=link_factor(Network(1.0, 0.0, replicas, exchange, shards), method.kind == "dp"),
        ring_factor=link_factor(Network(1.0, 0.0, replicas)),
    )
    if bw is not None:
        net = Network(bw, latency, replicas, exchange, shards)
        out.update({"bandwidth_gbps": bw, **wall_clock(model, method, net, p["steps"])})
    else:
        out["required_gbps"] = {
            str(t): required_bandwidth(model, method, t, latency, replicas, exchange=exchange, shards=shards)
            for t in TARGETS
        }
    return out


def format_wall_clock(w: dict[str, Any]) -> str:
    """:func:`wall_clock_plan` as lines."""
    head = (
        f"simulated: {w['method']}, {w['bits_per_value']:.3g} bits per value on the wire, {w['step_s']:.4g} s of "
        f"compute per step ({w['tokens_per_step']:,} tokens over the replicas, {w['chips_per_replica']} chip(s) "
        "each)"
    )
    if w["exchange"] == "server":
        who = (
            "the outer-optimiser actor: its link"
            if w.get("outer_shards", 1) == 1
            else f"{w['outer_shards']} outer-optimiser shards (diloco.outer_shards) on replica nodes: a shard node's link"
        )
        head += (
            f"\nthe outer exchange goes through {who} moves {w['link_factor']:.3g} x "
            f"the synced values each way (a ring all-reduce: {w['ring_factor']:.3g} x)"
        )
    if "total_s" in w:
        return "\n".join(
            [
                head,
                f"at {w['bandwidth_gbps']:g} Gbit/s: compute utilisation {w['utilisation']:.1%}, "
                f"{w['total_s'] / 3600:.3g} h for {w['steps']:,} steps "
                f"({w['compute_s'] / 3600:.3g} h compute + {w['exposed_comm_s'] / 3600:.3g} h exposed "
                "communication)",
            ]
        )
    need = ", ".join(f"{float(t):.0%}: {'-' if v is None else f'{v:.1f}'}" for t, v in w["required_gbps"].items())
    return "\n".join(
        [head, f"Gbit/s needed per compute utilisation: {need} (give --bandwidth-gbps for the wall-clock)"]
    )


__all__ = ["format_plan", "format_wall_clock", "plan_vocab_size", "sync_plan", "wall_clock_plan"]
