"""Matplotlib figures (PNG) of the scaling-law fits and of the compute-utilisation simulator.

Each function writes one file and returns its path; the Agg backend is used, so no display is
needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` atomically (via :func:`~ray_diloco.components.storage.write_bytes`).

    Raises:
        OSError: the path cannot be written (naming ``path``).
    """
    import io

    from ray_diloco.components.storage import write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    _pyplot().close(fig)
    write_bytes(str(path), buf.getvalue())  # a reader never sees half a PNG
    return path


def plot_fits(fits: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """``loss_vs_N.png`` (best loss per size and algorithm with the fitted power laws),
    ``residuals.png`` (leave-one-size-out residual per form and held-out size) and
    ``optimal_hparams.png`` (optimal inner lr and global batch vs N with their laws) in
    ``out_dir``. Returns the paths written."""
    from ray_diloco.analysis.forms import FORMS
    from ray_diloco.analysis.laws import PowerLaw, algorithm_name

    plt = _pyplot()
    out = Path(out_dir)
    best = fits["best_rows"]
    sizes = np.array(fits["sizes"])
    line = np.geomspace(sizes.min() / 1.3, sizes.max() * 1.3, 100)
    paths = []

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for m in fits["replicas"]:
        name = algorithm_name(m)
        pts = [(r["N"], r["eval_loss"]) for r in best if r["M"] == m]
        dots = ax.loglog(*zip(*pts), "o", label=name)[0]
        if name in fits["independent"]:
            law = PowerLaw(**fits["independent"][name]["loss"])
            ax.loglog(line, law(line), "-", color=dots.get_color(), lw=1, label=f"{law.A:.4g} N^{law.alpha:.4f}")
    from matplotlib.ticker import FormatStrFormatter

    ax.yaxis.set_major_formatter(FormatStrFormatter("%.2f"))  # losses span less than a decade
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.2f"))
    ax.set_xlabel("parameters N")
    ax.set_ylabel("eval loss (best per size)")
    ax.set_title("loss vs model size, per algorithm")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "loss_vs_N.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    if fits["forms"]:
        width = 0.8 / len(FORMS)
        held = [float(s) for s in next(iter(fits["forms"].values()))["residual_by_N"]]
        x = np.arange(len(held))
        for i, (name, f) in enumerate(fits["forms"].items()):
            ax.bar(
                x + i * width,
                [f["residual_by_N"][str(s)] for s in held],
                width,
                label=f"{name} (mean {f['residual']:.4f})",
            )
        ax.set_xticks(x + width * (len(FORMS) - 1) / 2, [f"{s:.3g}" for s in held])
        ax.set_xlabel("held-out model size N")
        ax.set_ylabel("|predicted - measured| loss")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "forms need DiLoCo rows at 3+ sizes and 2+ M", ha="center", transform=ax.transAxes)
    ax.set_title("leave-one-size-out residuals of the parametric forms")
    paths.append(_save(fig, out / "residuals.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, col, label in (
        (axes[0], "inner_lr", "inner_lr", "optimal inner lr"),
        (axes[1], "batch", "optimal_batch", "optimal global batch"),
    ):
        for m in fits["replicas"]:
            name = algorithm_name(m)
            pts = [(r["N"], r[col]) for r in best if r["M"] == m and r[col] == r[col]]  # not NaN
            if not pts:
                continue
            dots = ax.loglog(*zip(*pts), "o", label=name)[0]
            if key in fits["independent"].get(name, {}):
                law = PowerLaw(**fits["independent"][name][key])
                ax.loglog(line, law(line), "-", color=dots.get_color(), lw=1)
        ax.set_xlabel("parameters N")
        ax.set_ylabel(label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not in the table", ha="center", transform=ax.transAxes)
    fig.suptitle("optimal hyperparameters vs model size (lines: A N^alpha)")
    paths.append(_save(fig, out / "optimal_hparams.png"))
    return paths


def plot_utilisation(
    model: Any, methods: list[Any], path: str | Path, latency_s: float = 0.0, replicas: int = 2
) -> Path:
    """Compute utilisation vs bandwidth (log axis, 0.1-1000 Gbit/s) for each method."""
    from ray_diloco.analysis.simulate import BANDWIDTH_GRID_GBPS, METHOD_NAMES, Network, compute_utilisation

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for m in methods:
        cu = [compute_utilisation(model, m, Network(float(w), latency_s, replicas)) for w in BANDWIDTH_GRID_GBPS]
        label = METHOD_NAMES[m.kind] + ("" if m.kind == "dp" else f" (H={m.H})")
        ax.semilogx(BANDWIDTH_GRID_GBPS, cu, label=label)
    ax.set_xlabel("bandwidth between replicas (Gbit/s)")
    ax.set_ylabel("compute utilisation")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"{model.name} parameters: {model.layers} layers, {model.step_s:.3g} s/step")
    ax.legend(fontsize=7)
    return _save(fig, Path(path))
