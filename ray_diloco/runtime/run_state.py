"""A run's counters, carried across outer steps and into checkpoints (no Ray, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


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
    compile_s: float = 0.0  # seconds of the workers' compiling first steps (run.compile), in no other figure
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

    def round_fields(
        self, metrics: list[dict[str, Any]], wall: float, n_tokens: int, sent: int, received: int
    ) -> dict[str, Any]:
        """Loss, lr, throughput, time split and bytes of one outer step (its workers' ``metrics``,
        ``wall`` seconds, ``n_tokens`` trained, bytes ``sent`` and ``received``), and the running
        totals, which it advances."""
        st = self
        by_replica: dict[int, dict[str, Any]] = {}
        for mtr in metrics:
            by_replica.setdefault(mtr["replica"], mtr)
        loss_ids = sorted(by_replica)
        losses = [by_replica[m]["train_loss"] for m in loss_ids]
        compute_s = float(np.mean([mtr["compute_s"] for mtr in metrics]))
        # a round that compiled (run.compile: each worker's first step): that step is left out of the rate
        compile_s = max((mtr.get("compile_s", 0.0) for mtr in metrics), default=0.0)
        if compile_s > 0:
            n_tokens = round(n_tokens * (1 - 1 / max(1, max(mtr.get("steps", 1) for mtr in metrics))))
        st.compile_s += compile_s
        wall_run = max(1e-9, wall - compile_s)
        st.inner_compute_s += compute_s
        st.train_wall_s += wall_run
        sync_wait = float(np.mean([mtr["sync_wait_s"] for mtr in metrics]))  # part of outer_wait_s
        st.sync_wait_s += sync_wait
        return {
            "train_loss": float(np.mean(losses)),
            "train_loss_replica": {f"replica_{m}": v for m, v in zip(loss_ids, losses)},
            "inner_lr": metrics[0]["inner_lr"],
            "tokens": st.tokens,
            "tokens_per_s": n_tokens / wall_run if wall > 0 else None,
            "inner_compute_s": compute_s,
            "sync_wait_s": sync_wait,
            "outer_wait_s": max(0.0, wall_run - compute_s),
            "compute_utilisation": compute_s / wall_run if wall > 0 else None,
            "round_s": wall,
            "compile_s": compile_s,
            "bytes_sent": sent,
            "bytes_received": received,
            "bytes_sent_total": st.bytes_sent,
            "bytes_received_total": st.bytes_received,
            "peak_sync_bytes": st.peak_sync_bytes,
        }
