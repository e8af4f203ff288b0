"""The outer optimiser: global parameters, one optimiser state per fragment, the outer step.

DiLoCo (arXiv 2311.08105, Algorithm 1, lines 8-12): every H inner steps each replica m sends
its pseudo-gradient ``delta_m = theta_global - theta_m`` (fp32); the outer optimiser averages
what arrived (weighted by tokens trained) and steps the global parameters with it as the
gradient. Default: SGD with Nesterov momentum (lr 0.7, momentum 0.9), in torch semantics
``b <- mu*b + delta; theta <- theta - lr*(delta + mu*b)``. State is kept per fragment
(Streaming DiLoCo, arXiv 2501.18512, section 2: "one Nesterov buffer per fragment").

:class:`OuterOptimizer` is plain Python/torch (tested exactly, no Ray). :class:`OuterDriver` is
the Ray actor around it: it gathers each fragment's pseudo-gradients from the replicas through
the object store, runs the outer step once per round and replies to every replica.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from .config import OuterConfig
from .exchange import apply_downlink
from .quantize import decode, encode, from_message, quantize_with_feedback, to_message


def make_outer_optimizer(param: torch.Tensor, cfg: OuterConfig) -> torch.optim.Optimizer:
    """The torch optimiser for one fragment's flat fp32 global parameters."""
    if cfg.name == "nesterov":
        return torch.optim.SGD([param], lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)
    if cfg.name == "sgd":
        return torch.optim.SGD([param], lr=cfg.lr, momentum=cfg.momentum)
    if cfg.name == "adam":
        return torch.optim.Adam([param], lr=cfg.lr, betas=(cfg.momentum, cfg.adam_beta2), eps=cfg.adam_eps)
    raise ValueError(f"outer.name = {cfg.name!r}: must be one of nesterov, sgd, adam")


def average_pseudo_gradients(deltas: list[np.ndarray], weights: list[float]) -> torch.Tensor:
    """Weighted mean in fp32 of pseudo-gradients ``[numel]`` (weights: tokens trained).

    Each term is scaled by ``w_i / sum(w)`` (exactly 1 for one replica, 1/2 for two equal ones),
    then summed in the order given, so the result is reproducible bit for bit.

    Raises:
        ValueError: on empty input, mismatched shapes or non-positive total weight.
    """
    if not deltas or len(deltas) != len(weights):
        raise ValueError(f"got {len(deltas)} pseudo-gradients and {len(weights)} weights")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"total weight {total} must be > 0")
    acc = torch.zeros(np.asarray(deltas[0]).size, dtype=torch.float32)
    for d, w in zip(deltas, weights):
        t = torch.as_tensor(np.array(d, dtype=np.float32, copy=True).reshape(-1))  # object-store arrays are read-only
        if t.numel() != acc.numel():
            raise ValueError(f"pseudo-gradient has {t.numel()} values, expected {acc.numel()}")
        acc.add_(t, alpha=w / total)
    return acc


class OuterOptimizer:
    """Global fp32 parameters, an outer optimiser per fragment, and the downlink encoding.

    Args:
        initial: one fp32 array ``[numel_p]`` per fragment (the replicas' common initialisation).
        cfg: outer optimiser settings.
        quantization: wire format of the outer update sent back (``streaming.quantization``).
        error_feedback: carry the downlink quantisation residual into the next update.
    """

    def __init__(self, initial: list[np.ndarray], cfg: OuterConfig, quantization: str = "none",
                 error_feedback: bool = False):
        self.cfg, self.quantization, self.error_feedback = cfg, quantization, error_feedback
        self.params = [torch.tensor(np.asarray(g, dtype=np.float32).reshape(-1)) for g in initial]
        self.opts = [make_outer_optimizer(p, cfg) for p in self.params]
        self.steps = [0] * len(self.params)
        self.residuals: list[torch.Tensor | None] = [None] * len(self.params)

    # -- the outer step --------------------------------------------------------------------
    def step(self, fragment: int, weights: list[float], *deltas: np.ndarray, average_only: bool = False
             ) -> dict[str, Any]:
        """One outer step of ``fragment`` with the replicas' pseudo-gradients ``[numel_p]`` fp32.

        The weighted mean (fp32) is the gradient of the fragment's outer optimiser; with
        ``average_only`` (the closing round of a run, see ``SyncSchedule``) the global fragment
        becomes the weighted mean of the replicas' parameters instead (``global - mean``: outer
        lr 1, no momentum, optimiser state untouched), so a partial last round does not add a
        momentum extrapolation. The reply
        for the replicas is then encoded: with ``quantization: none`` the new global values in
        fp32; otherwise the update ``u = new - old`` (plus the downlink residual with error
        feedback) is quantised, and this optimiser's own global fragment is set to
        ``exchange.apply_downlink(old, message)``, exactly what every replica computes.

        Returns ``{"message": bytes, "update_norm": float, "step": int,
        "delta_norms": [float per replica]}``.
        """
        p = self.params[fragment]
        mean = average_pseudo_gradients(list(deltas), list(weights))
        before = p.clone()
        if average_only:
            with torch.no_grad():
                p.sub_(mean)
        else:
            p.grad = mean
            self.opts[fragment].step()
            p.grad = None
        self.steps[fragment] += 1
        if self.quantization == "none":
            message = to_message(encode(p, "none"))
        else:
            message, residual = quantize_with_feedback(p - before, self.quantization, self.residuals[fragment])
            if self.error_feedback:
                self.residuals[fragment] = residual
            with torch.no_grad():
                p.copy_(apply_downlink(before, message))
        return {
            "message": message,
            "update_norm": float((p - before).norm()),
            "step": self.steps[fragment],
            "delta_norms": [float(np.linalg.norm(np.asarray(d, dtype=np.float32))) for d in deltas],
        }

    def global_params(self) -> list[np.ndarray]:
        """Copies of every global fragment, fp32 ``[numel_p]``."""
        return [p.numpy().copy() for p in self.params]

    # -- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Global parameters, optimiser state (momentum buffers), step counts and downlink
        residuals per fragment (a snapshot, not live buffers)."""
        return {
            "global": self.global_params(),
            "optimizers": [copy.deepcopy(o.state_dict()) for o in self.opts],
            "steps": list(self.steps),
            "residuals": [None if r is None else r.numpy().copy() for r in self.residuals],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (global parameters, optimiser buffers, step counts, residuals).

        Raises:
            ValueError: if the number of fragments differs.
        """
        if len(state["global"]) != len(self.params):
            raise ValueError(f"checkpoint has {len(state['global'])} fragments, expected {len(self.params)}")
        for i, g in enumerate(state["global"]):
            with torch.no_grad():
                self.params[i].copy_(torch.from_numpy(np.array(g, dtype=np.float32, copy=True)))
            self.opts[i].load_state_dict(state["optimizers"][i])
        self.steps = list(state["steps"])
        res = state.get("residuals") or [None] * len(self.params)
        self.residuals = [None if r is None else torch.from_numpy(np.array(r, dtype=np.float32, copy=True))
                          for r in res]

    def state_hash(self) -> dict[str, str]:
        """sha256 of the global parameters and of the optimiser buffers (parameter identity checks)."""
        hg, hm = hashlib.sha256(), hashlib.sha256()
        for p, o in zip(self.params, self.opts):
            hg.update(p.numpy().tobytes())
            for v in o.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    hm.update(v.numpy().tobytes())
        return {"global": hg.hexdigest(), "outer_state": hm.hexdigest()}


@dataclass
class _Round:
    """One fragment sync in progress on the driver: pseudo-gradients in, one reply out."""

    deltas: dict[int, tuple[float, np.ndarray]] = field(default_factory=dict)  # replica -> (weight, delta)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    reply: bytes | None = None
    fetched: int = 0
    bytes_up: int = 0


class OuterDriver:
    """The outer-optimiser driver as an async Ray actor: it holds the global parameters and
    the outer state, and completes a fragment's sync round once every replica has sent.

    Each replica's rank 0 calls :meth:`exchange` from its link thread (see ``exchange.Link``);
    the call returns when the round is complete, with the reply bytes. Other ranks of the
    replica call :meth:`result`. A round is keyed ``(fragment, send step)`` from the pure
    schedule, so every process agrees on it after any restart; replicas' pseudo-gradients are
    averaged in replica order, so the result does not depend on arrival order.

    Args:
        initial: fp32 ``[numel_p]`` per fragment. cfg: the run config (dict).
    """

    def __init__(self, initial: list[np.ndarray], cfg: dict[str, Any]):
        from .config import load_config

        c = load_config(cfg, validate=False)
        self.opt = OuterOptimizer(initial, c.outer, c.streaming.quantization, c.streaming.error_feedback)
        self.num_replicas = c.diloco.replicas
        self.receivers = c.diloco.replicas * c.diloco.workers_per_replica
        self.rounds: dict[tuple[int, int], _Round] = {}
        self.completed = [0] * len(self.opt.params)  # send step of the last completed round per fragment
        self.stats: list[dict[str, Any]] = []

    def _round(self, fragment: int, step: int) -> _Round:
        if not 0 <= fragment < len(self.opt.params):
            raise ValueError(f"fragment {fragment}: not in [0, {len(self.opt.params)})")
        if step <= self.completed[fragment] and (fragment, step) not in self.rounds:
            raise ValueError(f"fragment {fragment}: the round sent at step {step} is already completed and collected")
        return self.rounds.setdefault((fragment, step), _Round())

    async def exchange(self, fragment: int, step: int, replica: int, weight: float, message: bytes,
                       average_only: bool = False) -> bytes:
        """Submit replica ``replica``'s quantised pseudo-gradient (wire message) of ``fragment``
        sent at inner step ``step``, weighted by ``weight`` (tokens); returns the reply once every
        replica has sent. ``average_only``: a closing round (the weighted mean, no outer step).

        Raises:
            ValueError: bad fragment/round/replica, a duplicate submission, a malformed message.
        """
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica {replica}: not in [0, {self.num_replicas})")
        if not 0 <= fragment < len(self.opt.params):
            raise ValueError(f"fragment {fragment}: not in [0, {len(self.opt.params)})")
        delta = decode(from_message(message))  # malformed input is refused before any state changes
        if delta.size != self.opt.params[fragment].numel():
            raise ValueError(f"replica {replica}: fragment {fragment} has {self.opt.params[fragment].numel()} "
                             f"values, got {delta.size}")
        r = self._round(fragment, step)
        if replica in r.deltas:
            raise ValueError(f"replica {replica}: sent fragment {fragment} at step {step} twice")
        r.deltas[replica] = (float(weight), delta)
        r.bytes_up += len(message)
        if len(r.deltas) == self.num_replicas:
            order = sorted(r.deltas)
            out = self.opt.step(fragment, [r.deltas[m][0] for m in order], *[r.deltas[m][1] for m in order],
                                average_only=average_only)
            r.reply, r.deltas = out["message"], {}
            self.stats.append({"fragment": fragment, "step": step, "update_norm": out["update_norm"],
                               "delta_norms": out["delta_norms"], "bytes_up": r.bytes_up,
                               "bytes_down": len(out["message"]) * self.num_replicas})
            self.completed[fragment] = step
            r.done.set()
        return await self._collect(fragment, step, r)

    async def result(self, fragment: int, step: int) -> bytes:
        """The reply of a round for a rank > 0 of some replica (waits for the round)."""
        return await self._collect(fragment, step, self._round(fragment, step))

    async def _collect(self, fragment: int, step: int, r: _Round) -> bytes:
        await r.done.wait()
        r.fetched += 1
        if r.fetched >= self.receivers:
            self.rounds.pop((fragment, step), None)
        return r.reply

    def take_stats(self, max_send_step: int | None = None) -> list[dict[str, Any]]:
        """Per-round figures (fragment, send step, update norm, bytes) of the completed rounds sent
        at or before ``max_send_step`` (all if None); later ones are kept for a later call (and in
        :meth:`state_dict`), so each round is reported in the outer step its replicas merge it."""
        out = [r for r in self.stats if max_send_step is None or r["step"] <= max_send_step]
        self.stats = [r for r in self.stats if not (max_send_step is None or r["step"] <= max_send_step)]
        return out

    def global_refs(self) -> list[Any]:
        """Every global fragment (fp32 ``[numel_p]``) put once into the object store."""
        import ray

        return [ray.put(g) for g in self.opt.global_params()]

    def global_params(self) -> list[np.ndarray]:
        """Copies of every global fragment, fp32 ``[numel_p]``."""
        return self.opt.global_params()

    def state_dict(self) -> dict[str, Any]:
        """The outer optimiser's state, the last completed send step per fragment and the figures
        of completed rounds not yet reported."""
        return {**self.opt.state_dict(), "completed": list(self.completed), "stats": copy.deepcopy(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.opt.load_state_dict(state)
        self.completed = list(state.get("completed", [0] * len(self.opt.params)))
        self.stats = copy.deepcopy(list(state.get("stats", [])))

    def state_hash(self) -> dict[str, str]:
        """sha256 of the global parameters and of the outer optimiser buffers."""
        return self.opt.state_hash()

    def pending_rounds(self) -> int:
        """Rounds held in memory (incomplete or not yet collected by every receiver)."""
        return len(self.rounds)


#: The driver as a Ray actor. It needs no CPU reservation: its work is a few vector operations
#: per sync, and it must not take a core a replica worker needs.
OuterDriverActor = ray.remote(num_cpus=0)(OuterDriver)
