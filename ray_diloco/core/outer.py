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
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_diloco.config import OuterConfig
from ray_diloco.core.formats import Packed
from ray_diloco.core.quantize import fused_codec
from ray_diloco.core.wire import as_tensor


class SGDState:
    """The state of torch's ``SGD`` (``torch.optim.SGD``: dampening 0, no weight decay) for one
    fragment's flat fp32 parameter, in torch's layout (``param_groups``, ``state[param]``,
    :meth:`state_dict` and :meth:`load_state_dict` as torch writes and reads them, so checkpoints
    are interchangeable), without ``torch.optim``: :meth:`OuterOptimizer.step_ordered` does the
    arithmetic itself, and constructing a ``torch.optim`` optimiser imports ``torch._dynamo``
    (about 1 s of CPU in every outer-optimiser process).

    Args:
        param: fp32 ``[numel_p]``, the fragment's global parameters.
        lr, momentum, nesterov: as ``torch.optim.SGD``'s.
    """

    def __init__(self, param: torch.Tensor, lr: float, momentum: float, nesterov: bool):
        self.param_groups: list[dict[str, Any]] = [
            {"lr": lr, "momentum": momentum, "dampening": 0, "weight_decay": 0, "nesterov": nesterov,
             "maximize": False, "foreach": None, "differentiable": False, "fused": None, "params": [param]}
        ]  # fmt: skip
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {0: {"momentum_buffer": fp32 [numel_p]}} (empty before the first step),
        "param_groups": [{hyperparameters, "params": [0]}]}``, torch's layout (live tensors)."""
        group = self.param_groups[0]
        state = self.state.get(group["params"][0])
        return {"state": {} if state is None else {0: dict(state)},
                "param_groups": [{**{k: v for k, v in group.items() if k != "params"}, "params": [0]}]}  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a state dict of :meth:`state_dict`'s (or torch ``SGD``'s) layout: the saved
        hyperparameters replace these, and a momentum buffer is taken as fp32 (as torch does).

        Raises:
            ValueError: not one parameter group of one parameter."""
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != 1:
            raise ValueError("an outer SGD state holds one parameter group of one parameter")
        param = self.param_groups[0]["params"][0]
        self.param_groups = [
            {**copy.deepcopy({k: v for k, v in groups[0].items() if k != "params"}), "params": [param]}
        ]
        saved = state_dict["state"].get(groups[0]["params"][0])
        self.state = {} if saved is None else {param: {k: v.to(dtype=torch.float32) for k, v in saved.items()}}


def make_outer_optimizer(param: torch.Tensor, cfg: OuterConfig) -> SGDState | torch.optim.Optimizer:
    """The optimiser state for one fragment's flat fp32 global parameters (SGD and Nesterov:
    :class:`SGDState`; Adam: torch's, which also steps)."""
    if cfg.name == "nesterov":
        return SGDState(param, cfg.lr, cfg.momentum, nesterov=cfg.momentum > 0)
    if cfg.name == "sgd":
        return SGDState(param, cfg.lr, cfg.momentum, nesterov=False)
    if cfg.name == "adam":
        return torch.optim.Adam([param], lr=cfg.lr, betas=(cfg.momentum, cfg.adam_beta2), eps=cfg.adam_eps)
    raise ValueError(f"outer.name = {cfg.name!r}: must be one of nesterov, sgd, adam")


#: Values per chunk of the streaming passes (fp32: 1 MiB): every pass over a fragment (the
#: checks, the mean, the outer step) runs chunk by chunk, so its operands stay in cache and no
#: temporary is as large as the fragment. A multiple of every SIMD width (same bits as one pass).
CHUNK = 1 << 18


def _chunks(n: int):
    for s in range(0, n, CHUNK):
        yield slice(s, min(n, s + CHUNK))


def finite_norm(values: np.ndarray) -> float | None:
    """The L2 norm of fp32 ``values`` ``[n]``, or None if any value is not finite; one read pass
    in chunks. Each chunk's sum of squares is an fp32 dot product (chunk sums added in fp64);
    a chunk whose fp32 sum is not finite is checked element-wise and, if its values are finite
    (squares beyond fp32's range), summed in fp64, where fp32 squares cannot overflow."""
    values = np.asarray(values, dtype=np.float32).reshape(-1)
    sq = 0.0
    for sl in _chunks(values.size):
        c = as_tensor(values[sl])
        part = float(torch.dot(c, c))
        if not math.isfinite(part):
            if not bool(torch.isfinite(c).all()):
                return None
            part = float(torch.linalg.vector_norm(c, dtype=torch.float64)) ** 2
        sq += part
    return math.sqrt(sq)


class OrderedMean:
    """The token-weighted mean of pseudo-gradients in a fixed order (the driver adds them in
    replica-id order), reproducible bit for bit and equal to the plain fp32 DiLoCo mean
    ``sum_i fl(d_i * w_i / W)`` summed in that order (DiLoCo, arXiv 2311.08105, Algorithm 1
    line 10). Terms are kept by reference (an object-store view of a ``none`` message is not
    copied) and summed chunk by chunk (:meth:`chunk`, :data:`CHUNK` values) when the round
    closes (the total weight ``W`` is known only then, so the terms cannot be scaled before):
    ``OuterOptimizer.step_ordered`` consumes the mean a chunk at a time in the same pass as the
    outer step, so no fragment-sized mean is ever allocated; :meth:`take` builds the whole mean.
    """

    def __init__(self, numel: int):
        self.numel = numel
        self.terms: list[tuple[np.ndarray | Packed, float]] = []
        self.total = 0.0
        self._decoded: torch.Tensor | None = None  # one chunk of a packed term, decoded

    @property
    def nbytes(self) -> int:
        """Bytes of the terms held (a packed term: its encoded bytes)."""
        return sum(d.nbytes for d, _ in self.terms)

    def add(self, delta: np.ndarray | Packed, weight: float) -> None:
        """Add fp32 ``delta`` ``[numel]`` (kept by reference, never written), or a pseudo-gradient
        still encoded in a scaled format (``core.formats.Packed``: decoded a chunk at a time
        when summed, the same values as decoding it whole), with ``weight`` > 0.

        Raises:
            ValueError: wrong size or non-positive weight.
        """
        d = delta if isinstance(delta, Packed) else np.asarray(delta, dtype=np.float32).reshape(-1)
        size = d.numel if isinstance(d, Packed) else d.size
        if size != self.numel:
            raise ValueError(f"pseudo-gradient has {size} values, expected {self.numel}")
        if not weight > 0:
            raise ValueError(f"weight {weight} must be > 0")
        self.terms.append((d, float(weight)))
        self.total += float(weight)

    def chunk(self, sl: slice, out: torch.Tensor) -> torch.Tensor:
        """The mean's values ``[sl]``, written into the start of ``out`` (fp32, at least that many
        values) and returned: ``0 + sum_i d_i[sl] * (w_i / W)`` in the order added (``sl`` starts
        at a multiple of ``core.codec.BLOCK`` when a term is packed, as :data:`CHUNK` chunks do)."""
        n = sl.stop - sl.start
        a = out[:n].zero_()
        for d, w in self.terms:
            if isinstance(d, Packed):
                if self._decoded is None or self._decoded.numel() < n:
                    self._decoded = torch.empty(min(CHUNK, self.numel) if n <= CHUNK else n, dtype=torch.float32)
                part = self._decoded[:n]
                fused_codec().decode_into(d.payload, d.scales, d.format, part.numpy(), start=sl.start)
                a.add_(part, alpha=w / self.total)
            else:
                a.add_(as_tensor(d[sl]), alpha=w / self.total)
        return a

    def take(self) -> torch.Tensor:
        """The mean (fp32 ``[numel]``, a new tensor); the terms are dropped.

        Raises:
            ValueError: nothing was added."""
        if not self.terms:
            raise ValueError("no pseudo-gradient to average")
        acc = torch.empty(self.numel, dtype=torch.float32)
        for sl in _chunks(self.numel):
            self.chunk(sl, acc[sl])
        self.terms = []
        return acc

    def clear(self) -> None:
        """Drop the terms (a failed round)."""
        self.terms = []


def outer_state_hash(globals_: list[np.ndarray], states: list[dict[str, Any]]) -> dict[str, str]:
    """sha256 of the global fragments (fp32, in fragment order) and of the tensors of each
    fragment's optimiser state (per-parameter state dict, in its order): what
    :meth:`OuterOptimizer.state_hash` reports, also from a ``state_dict`` (the sharded driver)."""
    hg, hm = hashlib.sha256(), hashlib.sha256()
    for g, st in zip(globals_, states):
        hg.update(np.ascontiguousarray(g, dtype=np.float32).tobytes())
        for v in st.values():
            if isinstance(v, torch.Tensor):
                hm.update(v.numpy().tobytes())
    return {"global": hg.hexdigest(), "outer_state": hm.hexdigest()}


def _sgd_pass(
    p: torch.Tensor,
    mean: OrderedMean,
    buf: torch.Tensor | None,
    first: bool,
    lr: float,
    mu: float,
    nesterov: bool,
    on_update: Callable[[slice, torch.Tensor], None] | None,
) -> float:
    """(``OuterOptimizer.step_ordered``) The mean and torch's SGD/Nesterov update of ``p`` (fp32
    ``[n]``) chunk by chunk in one pass; ``buf`` the momentum buffer (``first``: to be set to the
    first mean). With ``on_update`` each chunk of ``p`` is left as it was and its update handed to
    it. Returns the sum of the squared norms of the step directions (fp32 chunk norms in fp64)."""
    scratch = torch.empty(min(CHUNK, p.numel()), dtype=torch.float32)
    old = torch.empty_like(scratch) if on_update is not None else scratch
    part = torch.empty_like(scratch) if on_update is not None else scratch
    sq = 0.0
    with torch.no_grad():
        for sl in _chunks(p.numel()):
            eff = mean.chunk(sl, scratch)
            if buf is not None:
                b = buf[sl]
                if first:
                    b.copy_(eff)
                else:
                    b.mul_(mu).add_(eff)
                eff = eff.add_(b, alpha=mu) if nesterov else b
            pc = p[sl]
            o = old[: pc.numel()].copy_(pc) if on_update is not None else pc
            pc.add_(eff, alpha=-lr)
            sq += float(eff.norm()) ** 2
            if on_update is not None:  # the update (new - old: bitwise what the step adds); the chunk back to old
                u = torch.sub(pc, o, out=part[: pc.numel()])
                pc.copy_(o)
                on_update(sl, u)
    return sq


@dataclass
class OuterFragment:
    """One fragment as the outer side holds it (an outer shard: its slice of one), DiLoCo arXiv
    2311.08105 Algorithm 1 lines 8-12, kept per fragment as in Streaming DiLoCo arXiv
    2501.18512 section 2.

    ``param``: the global values (fp32 ``[n]``); ``opt``: their outer optimiser
    (:func:`make_outer_optimizer`: momentum or Adam moments); ``steps``: outer steps taken;
    ``version``: outer steps applied as the driver's round book counts them (an outer shard's
    replies carry it); ``residual``: the downlink's error-feedback residual (fp32 ``[n]``, None
    until the first quantised reply or without error feedback; ``core.wire.Downlink``)."""

    param: torch.Tensor
    opt: Any
    steps: int = 0
    version: int = 0
    residual: torch.Tensor | None = None


class OuterOptimizer:
    """Global fp32 parameters and an outer optimiser per fragment: the maths of the outer step.

    The downlink message (quantised update or full values) is the wire's business
    (``core.wire.Downlink``): the driver calls :meth:`step_ordered` with ``keep_update``, then
    ``Downlink.encode_update``, which applies the decoded update in place so the optimiser holds
    what every replica holds (with ``none`` the driver's reply is the new global fragment itself).

    Args:
        initial: one fp32 array ``[numel_p]`` per fragment (the replicas' common initialisation).
        cfg: outer optimiser settings.
    """

    def __init__(self, initial: list[np.ndarray], cfg: OuterConfig):
        self.cfg = cfg
        self.fragments = []
        for g in initial:
            p = torch.tensor(np.asarray(g, dtype=np.float32).reshape(-1))
            self.fragments.append(OuterFragment(p, make_outer_optimizer(p, cfg)))

    # -- the outer step --------------------------------------------------------------------
    def step_ordered(
        self,
        fragment: int,
        mean: OrderedMean,
        average_only: bool = False,
        keep_update: bool = False,
        on_update: Callable[[slice, torch.Tensor], None] | None = None,
    ) -> tuple[float, torch.Tensor | None]:
        """The outer step of ``fragment`` with the mean of ``mean``'s terms (dropped after).

        SGD/Nesterov run torch's ``SGD`` update (``torch.optim.sgd``: dampening 0, no weight
        decay; the first step copies the gradient into the momentum buffer) with the
        optimiser's own momentum buffer, chunk by chunk in ONE pass that also computes the mean
        (:meth:`OrderedMean.chunk`): the same arithmetic and state dict as torch, and no
        fragment-sized temporary. Adam calls torch's optimiser on the whole mean. With
        ``average_only`` the global fragment moves by ``-mean`` (lr 1, no momentum, state
        untouched).

        With ``keep_update`` the global fragment is left as it was and the update ``new - old``
        (fp32 ``[numel_p]``, bitwise what the step adds) is returned for the downlink to
        quantise (``core.wire.Downlink.encode_update`` then applies what receivers apply);
        otherwise the fragment is stepped in place and None is returned with the norm. With
        ``on_update`` the fragment is also left as it was and each chunk's update is handed to
        ``on_update(slice, update[slice])`` as soon as it is made (a scratch tensor, valid during
        the call; slices start at multiples of :data:`CHUNK`): the downlink encodes and applies it
        while it is in cache, and no fragment-sized update is ever allocated.

        Returns ``(update_norm, update or None)``: the norm of the step taken (``lr`` x the norm of
        the step direction; fp32 chunk norms combined in fp64).
        """
        frag = self.fragments[fragment]
        p, opt = frag.param, frag.opt
        if keep_update:  # the whole update, collected from the chunks
            update = torch.empty(p.numel(), dtype=torch.float32)

            def collect(sl: slice, u: torch.Tensor) -> None:
                update[sl].copy_(u)
                if on_update is not None:
                    on_update(sl, u)

            return self.step_ordered(fragment, mean, average_only, on_update=collect)[0], update
        frag.steps += 1
        g = opt.param_groups[0]
        if not average_only and isinstance(opt, torch.optim.Optimizer):  # Adam: torch steps
            full = mean.take()
            before = p.detach().clone()
            p.grad = full
            opt.step()
            p.grad = None
            change = p.detach() - before
            if on_update is not None:
                with torch.no_grad():
                    p.copy_(before)
                on_update(slice(0, change.numel()), change)
            return float(change.norm()), None
        lr, mu = (1.0, 0.0) if average_only else (g["lr"], g["momentum"])
        buf, first = None, False
        if mu != 0:
            state = opt.state.setdefault(p, {})
            buf = state.get("momentum_buffer")
            first = buf is None
            if first:
                state["momentum_buffer"] = buf = torch.empty_like(p.detach())
        sq = _sgd_pass(p.detach(), mean, buf, first, lr, mu, bool(g["nesterov"]), on_update)
        mean.clear()
        return lr * math.sqrt(sq), None

    def set_global(self, fragment: int, value: torch.Tensor) -> None:
        """Overwrite the global fragment (fp32 ``[numel_p]``) without touching the optimiser state
        (the driver adopts the decoded downlink, ``core.wire.Downlink``)."""
        p = self.fragments[fragment].param
        if value is not p:
            with torch.no_grad():
                p.copy_(value)

    def global_params(self) -> list[np.ndarray]:
        """Copies of every global fragment, fp32 ``[numel_p]``."""
        return [f.param.numpy().copy() for f in self.fragments]

    # -- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Per fragment (a snapshot, not live buffers): ``global`` values, ``optimizers`` state
        (momentum buffers), ``steps``, downlink ``residuals`` (fp32 arrays, None where there is
        none) and ``versions``."""
        return {
            "global": self.global_params(),
            "optimizers": [copy.deepcopy(f.opt.state_dict()) for f in self.fragments],
            "steps": [f.steps for f in self.fragments],
            "residuals": [None if f.residual is None else f.residual.numpy().copy() for f in self.fragments],
            "versions": [f.version for f in self.fragments],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a missing ``residuals`` or ``versions`` (or a None entry):
        no residual, version 0.

        Raises:
            ValueError: if the number of fragments differs.
        """
        n = len(self.fragments)
        if len(state["global"]) != n:
            raise ValueError(f"checkpoint has {len(state['global'])} fragments, expected {n}")
        residuals, versions = state.get("residuals") or [None] * n, state.get("versions", [0] * n)
        for f, g, o, k, r, v in zip(self.fragments, state["global"], state["optimizers"], state["steps"], residuals,
                                    versions, strict=True):  # fmt: skip
            with torch.no_grad():
                f.param.copy_(torch.from_numpy(np.array(g, dtype=np.float32, copy=True)))
            f.opt.load_state_dict(o)
            f.steps, f.version = int(k), int(v)
            f.residual = None if r is None else torch.from_numpy(np.array(r, dtype=np.float32, copy=True))

    def state_hash(self) -> dict[str, str]:
        """sha256 of the global parameters and of the optimiser buffers (parameter identity checks)."""
        return outer_state_hash([f.param.numpy() for f in self.fragments],
                                [f.opt.state.get(f.param, {}) for f in self.fragments])  # fmt: skip
