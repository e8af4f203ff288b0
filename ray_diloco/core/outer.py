"""The outer optimiser: global parameters, one optimiser state per fragment, the outer step.

DiLoCo (arXiv 2311.08105, Algorithm 1, lines 8-12): every H inner steps each replica m sends
its pseudo-gradient ``delta_m = theta_global - theta_m`` (fp32); the outer optimiser averages
what arrived (weighted by tokens trained) and steps the global parameters with it as the
gradient. Default: SGD with Nesterov momentum (lr 0.7, momentum 0.9), in torch semantics
``b <- mu*b + delta; theta <- theta - lr*(delta + mu*b)``. State is kept per fragment
(Streaming DiLoCo, arXiv 2501.18512, section 2: "one Nesterov buffer per fragment").

:class:`OuterOptimizer` is plain Python/torch (tested exactly, no Ray). The Ray actor around it,
which gathers each fragment's pseudo-gradients from the replicas through the object store and
handles the quorum, timeouts and membership, is ``driver.OuterDriver``.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import numpy as np
import torch

from ray_diloco.config import OuterConfig


def make_outer_optimizer(param: torch.Tensor, cfg: OuterConfig) -> torch.optim.Optimizer:
    """The torch optimiser for one fragment's flat fp32 global parameters."""
    if cfg.name == "nesterov":
        return torch.optim.SGD([param], lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)
    if cfg.name == "sgd":
        return torch.optim.SGD([param], lr=cfg.lr, momentum=cfg.momentum)
    if cfg.name == "adam":
        return torch.optim.Adam([param], lr=cfg.lr, betas=(cfg.momentum, cfg.adam_beta2), eps=cfg.adam_eps)
    raise ValueError(f"outer.name = {cfg.name!r}: must be one of nesterov, sgd, adam")


#: Values per chunk of the streaming sums (fp32: 4 MiB), so no temporary is as large as a fragment.
CHUNK = 1 << 20


def _chunks(n: int):
    for s in range(0, n, CHUNK):
        yield slice(s, min(n, s + CHUNK))


def finite_norm(values: np.ndarray) -> float | None:
    """The L2 norm (fp64 accumulation, chunked) of fp32 ``values`` ``[n]``, or None if any value
    is not finite."""
    sq = 0.0
    for sl in _chunks(values.size):
        c = values[sl]
        if not np.isfinite(c).all():
            return None
        sq += float(np.dot(c.astype(np.float64), c.astype(np.float64)))
    return float(np.sqrt(sq))


class OrderedMean:
    """The token-weighted mean of pseudo-gradients in a fixed order (the driver adds them in
    replica-id order), reproducible bit for bit and equal to the plain fp32 DiLoCo mean
    ``sum_i fl(d_i * w_i / W)`` summed in that order (DiLoCo, arXiv 2311.08105, Algorithm 1
    line 10). Terms are kept by reference (an object-store view of a ``none`` message is not
    copied) until :meth:`take`, which sums them in one pass over chunks of :data:`CHUNK`
    values: the only fp32 ``[numel]`` buffer it allocates is the result (the total weight
    ``W`` is known only when the round closes, so the terms cannot be scaled before).
    """

    def __init__(self, numel: int):
        self.numel = numel
        self.terms: list[tuple[np.ndarray, float]] = []
        self.total = 0.0

    @property
    def count(self) -> int:
        """Terms added."""
        return len(self.terms)

    @property
    def nbytes(self) -> int:
        """Bytes of the terms held."""
        return sum(d.nbytes for d, _ in self.terms)

    def add(self, delta: np.ndarray, weight: float) -> None:
        """Add fp32 ``delta`` ``[numel]`` (kept by reference, never written) with ``weight`` > 0.

        Raises:
            ValueError: wrong size or non-positive weight.
        """
        d = np.asarray(delta, dtype=np.float32).reshape(-1)
        if d.size != self.numel:
            raise ValueError(f"pseudo-gradient has {d.size} values, expected {self.numel}")
        if not weight > 0:
            raise ValueError(f"weight {weight} must be > 0")
        self.terms.append((d, float(weight)))
        self.total += float(weight)

    def take(self) -> torch.Tensor:
        """The mean (fp32 ``[numel]``, a new tensor); the terms are dropped.

        Raises:
            ValueError: nothing was added."""
        if not self.terms:
            raise ValueError("no pseudo-gradient to average")
        acc = torch.zeros(self.numel, dtype=torch.float32)
        for sl in _chunks(self.numel):
            a = acc[sl]
            for d, w in self.terms:
                a.add_(torch.from_numpy(d[sl].copy()), alpha=w / self.total)
        self.terms = []
        return acc

    def clear(self) -> None:
        """Drop the terms (a failed round)."""
        self.terms = []


def average_pseudo_gradients(deltas: list[np.ndarray], weights: list[float]) -> torch.Tensor:
    """Weighted mean in fp32 of pseudo-gradients ``[numel]`` (weights: tokens trained), as the
    driver computes it (:class:`OrderedMean`, terms in the order given): reproducible bit for
    bit, exactly the term for one replica.

    Raises:
        ValueError: on empty input, mismatched shapes or non-positive total weight.
    """
    if not deltas or len(deltas) != len(weights):
        raise ValueError(f"got {len(deltas)} pseudo-gradients and {len(weights)} weights")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"total weight {total} must be > 0")
    mean = OrderedMean(np.asarray(deltas[0]).size)
    for d, w in zip(deltas, weights):
        if w > 0:
            mean.add(d, w)
        elif np.asarray(d).size != mean.numel:
            raise ValueError(f"pseudo-gradient has {np.asarray(d).size} values, expected {mean.numel}")
    return mean.take()


class OuterOptimizer:
    """Global fp32 parameters and an outer optimiser per fragment: the maths of the outer step.

    The downlink message (quantised update or full values) is the wire's business
    (``core.wire.Downlink``): the driver calls :meth:`step`, then ``Downlink.encode``, which
    adopts the decoded value with :meth:`set_global` so the optimiser holds what every replica
    holds.

    Args:
        initial: one fp32 array ``[numel_p]`` per fragment (the replicas' common initialisation).
        cfg: outer optimiser settings.
    """

    def __init__(self, initial: list[np.ndarray], cfg: OuterConfig):
        self.cfg = cfg
        self.params = [torch.tensor(np.asarray(g, dtype=np.float32).reshape(-1)) for g in initial]
        self.opts = [make_outer_optimizer(p, cfg) for p in self.params]
        self.steps = [0] * len(self.params)

    # -- the outer step --------------------------------------------------------------------
    def step(self, fragment: int, weights: list[float], *deltas: np.ndarray, average_only: bool = False
             ) -> dict[str, Any]:
        """One outer step of ``fragment`` with the replicas' pseudo-gradients ``[numel_p]`` fp32.

        The weighted mean (fp32) is the gradient of the fragment's outer optimiser; with
        ``average_only`` (the closing round of a run, see ``SyncSchedule``) the global fragment
        becomes the weighted mean of the replicas' parameters instead (``global - mean``: outer
        lr 1, no momentum, optimiser state untouched), so a partial last round does not add a
        momentum extrapolation.

        Returns ``{"before": fp32 [numel_p] (the global fragment before the step),
        "update_norm": float, "step": int, "delta_norms": [float per replica]}``.
        """
        p = self.params[fragment]
        mean = average_pseudo_gradients(list(deltas), list(weights))
        before = p.clone()
        self.step_mean(fragment, mean, average_only)
        out: dict[str, Any] = {"before": before}
        out.update(update_norm=float((p - before).norm()), step=self.steps[fragment],
                   delta_norms=[float(np.linalg.norm(np.asarray(d, dtype=np.float32))) for d in deltas])
        return out

    def step_mean(self, fragment: int, mean: torch.Tensor, average_only: bool = False) -> float:
        """The outer step of ``fragment`` with the mean pseudo-gradient (fp32 ``[numel_p]``, owned by
        the caller and overwritten: no temporary as large as the fragment for SGD/Nesterov).

        SGD/Nesterov run torch's ``SGD`` update (``torch.optim.sgd``, dampening 0, no weight
        decay) in place on ``mean`` with the optimiser's own momentum buffer: the same
        arithmetic and state dict. Adam calls torch's optimiser. With ``average_only`` the
        global fragment moves by ``-mean`` (lr 1, no momentum, state untouched).

        Returns the norm of the update (``lr`` x the norm of the step direction).
        """
        p, opt = self.params[fragment], self.opts[fragment]
        self.steps[fragment] += 1
        g = opt.param_groups[0]
        if not average_only and self.cfg.name == "adam":
            before = p.detach().clone()
            p.grad = mean
            opt.step()
            p.grad = None
            return float((p.detach() - before).norm())
        lr, mu = (1.0, 0.0) if average_only else (g["lr"], g["momentum"])
        eff = mean
        if mu != 0:
            state = opt.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                state["momentum_buffer"] = buf = mean.detach().clone()
            else:
                buf.mul_(mu).add_(mean)
            eff = mean.add_(buf, alpha=mu) if g["nesterov"] else buf
        with torch.no_grad():
            p.add_(eff, alpha=-lr)
        return lr * float(eff.norm())

    def set_global(self, fragment: int, value: torch.Tensor) -> None:
        """Overwrite the global fragment (fp32 ``[numel_p]``) without touching the optimiser state
        (the driver adopts the decoded downlink, ``core.wire.Downlink``)."""
        p = self.params[fragment]
        if value is not p:
            with torch.no_grad():
                p.copy_(value)

    def global_params(self) -> list[np.ndarray]:
        """Copies of every global fragment, fp32 ``[numel_p]``."""
        return [p.numpy().copy() for p in self.params]

    # -- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Global parameters, optimiser state (momentum buffers) and step counts per fragment (a
        snapshot, not live buffers)."""
        return {
            "global": self.global_params(),
            "optimizers": [copy.deepcopy(o.state_dict()) for o in self.opts],
            "steps": list(self.steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (global parameters, optimiser buffers, step counts).

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

    def state_hash(self) -> dict[str, str]:
        """sha256 of the global parameters and of the optimiser buffers (parameter identity checks)."""
        hg, hm = hashlib.sha256(), hashlib.sha256()
        for p, o in zip(self.params, self.opts):
            hg.update(p.numpy().tobytes())
            for v in o.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    hm.update(v.numpy().tobytes())
        return {"global": hg.hexdigest(), "outer_state": hm.hexdigest()}
