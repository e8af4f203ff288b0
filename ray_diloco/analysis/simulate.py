"""Compute-utilisation simulator: how much bandwidth DP, DiLoCo and Streaming DiLoCo need
(Streaming DiLoCo, arXiv 2501.18512, section 3.5 and Table 4; Scaling Laws for DiLoCo, arXiv
2503.09799, Appendix A and Table 6).

The model, one training step of a model with ``layers`` blocks and ``step_s`` seconds of compute
(forward 1/3 of it, backward 2/3, from 6 x N x tokens FLOPs at the chip speed and MFU):

- a reduction moves ``2 x n x (1 - 1/R) x bits`` over the slow link for ``n`` parameters between
  ``R`` replicas (a ring all-reduce: the papers' model and the DP baseline), at ``W`` Gbit/s,
  plus the latency once per message. ``Network.exchange = "server"`` models this project's
  outer exchange instead (:func:`link_factor`): the outer-optimiser actor receives every
  replica's pseudo-gradient and sends each replica node one reply, so its link moves
  ``R x n x bits`` each way (``shards`` owners spread over the replica nodes cut it to
  ``(R + K - 2) / K x n x bits``, the ring's figure at K = R);
- every reduction overlaps the backward pass: each layer's share is sent when that layer's
  backward ends, one message after the other on the link; what is still on the link when the
  backward pass ends is exposed, and the next forward waits for it;
- DP reduces all gradients every step. DiLoCo reduces the outer gradients (all parameters) once
  every H steps. Streaming DiLoCo reduces one fragment (``layers_per_fragment`` blocks, the
  paper's 3) every H / P steps, P fragments. With overlap, a fragment's reduction also hides
  behind ``tau`` more steps of compute (it is merged tau steps later). FP4 sends 4 bits per
  value instead of the bf16 default's 16;
- compute utilisation = compute time / (compute time + exposed communication time).

``required_bandwidth`` searches the papers' geometric grid (:data:`BANDWIDTH_GRID_GBPS`,
0.1 ... 1000 Gbit/s, 50 points, each about 1.207x the last) for the smallest bandwidth that
reaches a target utilisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_diloco.errors import ConfigError

BANDWIDTH_GRID_GBPS = np.geomspace(0.1, 1000.0, 50)
METHODS = ("dp", "diloco", "streaming", "streaming_overlap", "streaming_overlap_fp4")
METHOD_NAMES = {
    "dp": "DP",
    "diloco": "DiLoCo",
    "streaming": "Streaming",
    "streaming_overlap": "Streaming+overlap",
    "streaming_overlap_fp4": "Streaming+overlap+FP4",
}
TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
FORWARD_FRACTION = 1.0 / 3.0  # of a step's compute; the backward pass is the other 2/3


@dataclass(frozen=True)
class ModelSpec:
    """A model for the simulator: ``params`` (parameters), ``layers`` (transformer blocks) and
    ``step_s`` (seconds of compute per inner step)."""

    name: str
    params: float
    layers: int
    step_s: float


# Streaming DiLoCo Table 4 (60% MFU): 1B 24 layers 0.1 s/step, 10B 48 layers 0.8 s, 100B 108 layers 4.9 s
PAPER_MODELS = {
    "1B": ModelSpec("1B", 1e9, 24, 0.1),
    "10B": ModelSpec("10B", 1e10, 48, 0.8),
    "100B": ModelSpec("100B", 1e11, 108, 4.9),
}


EXCHANGES = ("ring", "server")


@dataclass(frozen=True)
class Network:
    """The slow link between replicas: ``bandwidth_gbps`` (Gbit/s), ``latency_s`` (seconds per
    message), ``replicas`` (R, the number of parties), and how DiLoCo's outer gradients travel
    (``exchange``): ``ring`` (a ring all-reduce, the papers' model) or ``server`` (this
    project's outer-optimiser actor, ``shards`` K of them; see :func:`link_factor`). DP always
    all-reduces in a ring."""

    bandwidth_gbps: float
    latency_s: float = 0.0
    replicas: int = 2
    exchange: str = "ring"
    shards: int = 1


def link_factor(net: Network, all_reduce: bool = False) -> float:
    """Values of one reduction of ``n`` parameters on the busiest link, per direction, in units of
    ``n`` (full-duplex links).

    - ring all-reduce (``all_reduce``, or ``exchange == "ring"``): ``2 (R - 1) / R`` per node;
    - ``server``, K = 1: the outer-optimiser actor on its own node receives R pseudo-gradients
      and sends R replies (one object per replica node): ``R``;
    - ``server``, K > 1 shards, one on each of K replica nodes (K <= R): a shard node sends the
      other R - 1 replicas their reply slice (``(R - 1) / K``) and its own replica's other
      slices to the other shards (``(K - 1) / K``): ``(R + K - 2) / K``, the ring's figure at
      K = R.

    Raises:
        ConfigError: an unknown exchange, or shards outside [1, R].
    """
    R = net.replicas
    if all_reduce or net.exchange == "ring":
        return 2.0 * (1.0 - 1.0 / R)
    if net.exchange != "server":
        raise ConfigError([f"exchange = {net.exchange!r}: must be one of {', '.join(EXCHANGES)}"])
    if not 1 <= net.shards <= max(1, R):
        raise ConfigError([f"shards = {net.shards}: must be in [1, {R}] (one per replica node at most)"])
    return float(R) if net.shards == 1 else (R + net.shards - 2) / net.shards


@dataclass(frozen=True)
class Method:
    """How the replicas communicate: ``kind`` (one of :data:`METHODS`), ``H`` (inner steps
    between syncs of a fragment), ``layers_per_fragment`` (or ``fragments``, P, directly),
    ``tau`` (overlap in inner steps) and ``bits`` per value on the wire (default: bf16's 16, and
    4 for the ``_fp4`` kind).

    Raises:
        ConfigError: an unknown kind or a value out of range.
    """

    kind: str
    H: int = 100
    layers_per_fragment: int = 3
    tau: int = 1
    bits: float | None = None
    fragments: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in METHODS:
            raise ConfigError([f"method = {self.kind!r}: must be one of {', '.join(METHODS)}"])
        if self.H < 1 or self.layers_per_fragment < 1 or self.tau < 0 or (self.bits is not None and self.bits <= 0):
            raise ConfigError(
                [
                    f"method {self.kind}: H = {self.H}, layers per fragment = {self.layers_per_fragment}, "
                    f"tau = {self.tau}, bits = {self.bits}: need H >= 1, layers >= 1, tau >= 0, bits > 0"
                ]
            )

    @property
    def wire_bits(self) -> float:
        return self.bits if self.bits is not None else 4 if self.kind.endswith("_fp4") else 16

    def num_fragments(self, layers: int) -> int:
        """P: ``fragments`` when given, else ``layers // layers_per_fragment`` (at least 1)."""
        return self.fragments if self.fragments is not None else max(1, layers // self.layers_per_fragment)


def _exposed_after_backward(bits: float, layers: int, backward_s: float, net: Network) -> float:
    """Seconds of a reduction still on the link when the backward pass ends: each layer's share
    (``bits / layers``, one message each) is sent as that layer's backward finishes."""
    per_layer_bwd = backward_s / layers
    msg_s = bits / layers / (net.bandwidth_gbps * 1e9) + net.latency_s
    end = 0.0
    for k in range(1, layers + 1):
        end = max(k * per_layer_bwd, end) + msg_s
    return max(0.0, end - backward_s)


def compute_utilisation(model: ModelSpec, method: Method, net: Network) -> float:
    """Compute time / (compute time + exposed communication time), in [0, 1] (model of the module
    docstring)."""
    backward = model.step_s * (1.0 - FORWARD_FRACTION)
    ring = link_factor(net, all_reduce=method.kind == "dp")
    if method.kind in ("dp", "diloco"):
        bits = ring * model.params * method.wire_bits
        exposed = _exposed_after_backward(bits, model.layers, backward, net)
        period_s = model.step_s * (1 if method.kind == "dp" else method.H)
    else:
        fragments = method.num_fragments(model.layers)
        bits = ring * model.params / fragments * method.wire_bits
        exposed = _exposed_after_backward(bits, model.layers, backward, net)
        if method.kind != "streaming":
            exposed = max(0.0, exposed - method.tau * model.step_s)
        period_s = model.step_s * method.H / fragments
    return period_s / (period_s + exposed)


def required_bandwidth(
    model: ModelSpec,
    method: Method,
    target: float,
    latency_s: float = 0.0,
    replicas: int = 2,
    grid: Any = BANDWIDTH_GRID_GBPS,
    exchange: str = "ring",
    shards: int = 1,
) -> float | None:
    """The smallest bandwidth of ``grid`` (Gbit/s) at which the utilisation reaches ``target``;
    None when even the largest does not."""
    for w in grid:
        if compute_utilisation(model, method, Network(float(w), latency_s, replicas, exchange, shards)) >= target:
            return float(w)
    return None


def wall_clock(model: ModelSpec, method: Method, net: Network, steps: int) -> dict[str, float]:
    """A planned run's time: ``compute_s`` (steps x step time), ``utilisation`` and ``total_s``
    (compute / utilisation), all in seconds."""
    cu = compute_utilisation(model, method, net)
    compute = steps * model.step_s
    return {"compute_s": compute, "utilisation": cu, "total_s": compute / cu, "exposed_comm_s": compute / cu - compute}


def step_time_s(params: float, tokens_per_step: float, chips: int, tflops_per_chip: float, mfu: float) -> float:
    """Seconds of compute per inner step: 6 x N x tokens FLOPs over ``chips`` chips of
    ``tflops_per_chip`` TFLOP/s at ``mfu`` (Scaling Laws for DiLoCo, Appendix A)."""
    return 6.0 * params * tokens_per_step / (chips * tflops_per_chip * 1e12 * mfu)


# -- the papers' tables --------------------------------------------------------------------------
PAPER_TABLE4 = {  # Streaming DiLoCo Table 4: Gbit/s for utilisation 50/80/90/95/99 %
    ("1B", "dp"): (86.8, 152.6, 184.2, 222.3, 569.0),
    ("1B", "diloco"): (1.4, 6.2, 13.3, 23.3, 86.8),
    ("1B", "streaming"): (1.4, 5.2, 9.1, 16.0, 28.1),
    ("1B", "streaming_overlap"): (1.4, 4.3, 6.2, 9.1, 11.0),
    ("1B", "streaming_overlap_fp4"): (0.4, 0.9, 1.7, 2.0, 3.0),
    ("10B", "dp"): (104.8, 222.3, 222.3, 268.3, 471.5),
    ("10B", "diloco"): (1.7, 7.5, 16.0, 33.9, 104.8),
    ("10B", "streaming_overlap_fp4"): (0.4, 0.9, 1.4, 1.4, 1.7),
    ("100B", "dp"): (184.2, 323.8, 390.7, 390.7, 471.5),
    ("100B", "streaming_overlap_fp4"): (0.5, 0.9, 1.1, 1.1, 1.4),
}
PAPER_TABLE6_10B = {  # Scaling Laws for DiLoCo Table 6, 10B: DP and DiLoCo at H = 10, 50, 100, 300
    1: (104.8, 184.2, 222.3, 222.3, 390.7),  # H = 1: DP
    10: (16.0, 49.4, 86.8, 152.6, 222.3),
    50: (3.0, 11.0, 23.3, 41.0, 126.5),
    100: (1.4, 6.2, 13.3, 23.3, 86.8),
    300: (0.5, 2.0, 4.3, 9.1, 41.0),
}


def grid_steps(ours: float | None, published: float, grid: Any = BANDWIDTH_GRID_GBPS) -> int | None:
    """Signed distance in grid steps from the published bandwidth to ours (None: ours not reached)."""
    if ours is None:
        return None
    idx = lambda v: int(np.argmin(np.abs(np.log(grid) - math.log(v))))  # noqa: E731
    return idx(ours) - idx(published)


def paper_rows(include_table6: bool = True) -> list[dict[str, Any]]:
    """Every published cell next to ours: ``{"table", "model", "method", "H", "target", "gbps",
    "paper_gbps", "steps_off"}`` (bandwidths in Gbit/s; ``steps_off`` in grid steps)."""
    rows = []
    for (model, kind), values in PAPER_TABLE4.items():
        for target, pub in zip(TARGETS, values):
            ours = required_bandwidth(PAPER_MODELS[model], Method(kind, H=100), target)
            rows.append(
                {
                    "table": "streaming-4",
                    "model": model,
                    "method": kind,
                    "H": 1 if kind == "dp" else 100,
                    "target": target,
                    "gbps": ours,
                    "paper_gbps": pub,
                    "steps_off": grid_steps(ours, pub),
                }
            )
    if include_table6:
        for H, values in PAPER_TABLE6_10B.items():
            kind = "dp" if H == 1 else "diloco"
            for target, pub in zip(TARGETS, values):
                ours = required_bandwidth(PAPER_MODELS["10B"], Method(kind, H=max(H, 1)), target)
                rows.append(
                    {
                        "table": "scaling-6",
                        "model": "10B",
                        "method": kind,
                        "H": H,
                        "target": target,
                        "gbps": ours,
                        "paper_gbps": pub,
                        "steps_off": grid_steps(ours, pub),
                    }
                )
    return rows


def bandwidth_table(
    model: ModelSpec,
    methods: list[Method],
    targets: tuple[float, ...] = TARGETS,
    latency_s: float = 0.0,
    replicas: int = 2,
) -> list[dict[str, Any]]:
    """``{"model", "method", "H", "target", "gbps"}`` for every method and target."""
    return [
        {
            "model": model.name,
            "method": m.kind,
            "H": 1 if m.kind == "dp" else m.H,
            "target": t,
            "gbps": required_bandwidth(model, m, t, latency_s, replicas),
        }
        for m in methods
        for t in targets
    ]


def format_bandwidth_table(rows: list[dict[str, Any]], with_paper: bool = False) -> str:
    """Rows of :func:`bandwidth_table` or :func:`paper_rows` as a table, one line per (model,
    method, H), a column per target (ours, and the paper's in brackets with ``with_paper``)."""
    targets = sorted({r["target"] for r in rows})
    keys: list[tuple[Any, ...]] = []
    for r in rows:
        k = (r.get("table", ""), r["model"], r["method"], r["H"])
        if k not in keys:
            keys.append(k)
    head = f"{'model':<6} {'method':<22} {'H':>4} " + " ".join(
        f"{f'{100 * t:g}%':>{16 if with_paper else 7}}" for t in targets
    )
    lines = [head]
    for k in keys:
        cells = []
        for t in targets:
            r = next(r for r in rows if (r.get("table", ""), r["model"], r["method"], r["H"]) == k and r["target"] == t)
            ours = "-" if r["gbps"] is None else f"{r['gbps']:.1f}"
            cells.append(f"{ours:>7} ({r['paper_gbps']:>6.1f})" if with_paper else f"{ours:>7}")
        lines.append(
            f"{k[1]:<6} {METHOD_NAMES[k[2]]:<22} {k[3]:>4} " + " ".join(f"{c:>16}" if with_paper else c for c in cells)
        )
    return "\n".join(lines)
