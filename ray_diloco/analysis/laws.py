"""Scaling laws for DiLoCo (Charles et al., "Scaling Laws for DiLoCo", arXiv 2503.09799, sections
3-5): fits on a sweep's results, model selection, and predictions for a bigger model.

Every fit uses scipy; nothing here is a hand-written optimiser:

- independent power laws ``y = A * N^alpha`` per algorithm (DP, M = 1, 2, 4, 8 ...) for the eval
  loss, the optimal inner learning rate and the optimal global batch: least squares in log-log
  space (``scipy.stats.linregress``);
- the optimal batch per N: a quadratic in ``log2 B`` through the best loss at each batch
  (``scipy.optimize.curve_fit``), its minimum, then the power law through those minima;
- joint laws ``y = A * N^alpha * M^beta`` over the DiLoCo rows (``scipy.linalg.lstsq`` in log space);
- the parametric loss forms of :data:`FORMS`, fitted with a Huber loss on log L by L-BFGS
  (``scipy.optimize.minimize``) from many random starts, and compared by leave-one-size-out
  residuals;
- the best outer learning rate per (M, H).

A sweep table has one row per run with the columns of :data:`COLUMNS` (``ray-diloco tune``
writes them; other names are accepted through :data:`ALIASES`). ``M`` is 0 for data-parallel
rows (``dp`` is accepted).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ray_diloco.analysis.forms import FORMS, FormFit, fit_forms
from ray_diloco.errors import DataError
from ray_diloco.log import error_line

logger = logging.getLogger(__name__)

COLUMNS = ("N", "M", "H", "inner_lr", "outer_lr", "global_batch", "tokens", "eval_loss")
ALIASES = {
    "num_parameters": "N",
    "params": "N",
    "n": "N",
    "replicas": "M",
    "m": "M",
    "h": "H",
    "final_eval_loss": "eval_loss",
    "loss": "eval_loss",
    "batch": "global_batch",
    "lr": "inner_lr",
}


@dataclass(frozen=True)
class PowerLaw:
    """``y = A * N^alpha`` (N in parameters); ``r2`` of the log-log fit."""

    A: float
    alpha: float
    r2: float = float("nan")

    def __call__(self, n: Any) -> Any:
        return self.A * np.asarray(n, dtype=float) ** self.alpha

    def to_dict(self) -> dict[str, float]:
        return {"A": self.A, "alpha": self.alpha, "r2": self.r2}


@dataclass(frozen=True)
class JointLaw:
    """``y = A * N^alpha * M^beta`` over DiLoCo rows (M >= 1)."""

    A: float
    alpha: float
    beta: float

    def __call__(self, n: Any, m: Any) -> Any:
        return self.A * np.asarray(n, dtype=float) ** self.alpha * np.asarray(m, dtype=float) ** self.beta

    def to_dict(self) -> dict[str, float]:
        return {"A": self.A, "alpha": self.alpha, "beta": self.beta}


# -- input ------------------------------------------------------------------------------------
def load_table(path: str | Path) -> Any:
    """A sweep's results as a DataFrame with :data:`COLUMNS` (extra columns kept).

    ``path`` is a sweep directory (its ``results.parquet`` or ``results.csv``), a ``.csv`` or a
    ``.parquet`` file. Rows without a finite eval loss (failed or unfinished trials) are dropped.

    Raises:
        DataError: missing file, unreadable table, a missing column, no usable row.
    """
    import pandas as pd

    p = Path(path).expanduser()
    if p.is_dir():
        found = [p / n for n in ("results.parquet", "results.csv") if (p / n).is_file()]
        if not found:
            raise DataError(f"{path}: not a sweep directory (no results.parquet or results.csv)")
        p = found[0]
    if not p.is_file():
        raise DataError(f"{path}: file not found (give a sweep directory, a .csv or a .parquet)")
    try:
        df = pd.read_parquet(p) if p.suffix == ".parquet" else pd.read_csv(p)
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad input file
        raise DataError(f"{p}: cannot be read as a table ({error_line(e, limit=120)})") from None
    df = df.rename(
        columns={
            c: ALIASES[c.lower()] for c in df.columns if c.lower() in ALIASES and ALIASES[c.lower()] not in df.columns
        }
    )
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise DataError(f"{p}: missing column(s) {', '.join(missing)} (needed: {', '.join(COLUMNS)})")
    if "status" in df.columns:
        df = df[df["status"].isin(["TERMINATED"]) | df["status"].isna()]
    df = df.copy()
    raw = df.copy()
    df["M"] = df["M"].map(lambda v: 0 if str(v).strip().lower() in ("dp", "0", "0.0") else v)
    for c in COLUMNS:
        df[c] = pd.to_numeric(df[c], errors="coerce")
    df = df[df["eval_loss"].notna()]  # a run without a loss (failed, unfinished) is no data point
    if df.empty:
        raise DataError(f"{p}: no finished run with an eval loss")
    rules = {
        "N": ("a number of parameters > 0", lambda v: np.isfinite(v) & (v > 0)),
        "M": ("an integer >= 0 (0 or dp: data-parallel)", lambda v: np.isfinite(v) & (v >= 0) & (v == np.round(v))),
        "eval_loss": ("a finite loss > 0", lambda v: np.isfinite(v) & (v > 0)),
        "inner_lr": ("a finite lr > 0, or empty", lambda v: v.isna() | (np.isfinite(v) & (v > 0))),
        "global_batch": ("a finite batch > 0, or empty", lambda v: v.isna() | (np.isfinite(v) & (v > 0))),
        "H": (
            "an integer >= 1 (inner steps per outer step), or empty",
            lambda v: v.isna() | (np.isfinite(v) & (v >= 1) & (v == np.round(v))),
        ),
        "outer_lr": ("a finite lr > 0, or empty", lambda v: v.isna() | (np.isfinite(v) & (v > 0))),
        "tokens": ("a finite number of tokens >= 0, or empty", lambda v: v.isna() | (np.isfinite(v) & (v >= 0))),
    }
    for col, (allowed, ok) in rules.items():
        bad = df.index[~ok(df[col])]
        if len(bad):
            i = bad[0]
            v = raw.loc[i, col]
            shown = repr(v) if isinstance(v, str) else v
            raise DataError(
                f"{p}: row {i + 2}: {col} = {shown}: must be {allowed}"
                + (f" ({len(bad) - 1} more row(s) like it)" if len(bad) > 1 else "")
            )
    df["M"] = df["M"].astype(int)
    return df.reset_index(drop=True)


def algorithm_name(m: int) -> str:
    """``"DP"`` for M = 0, else ``"M=m"``."""
    return "DP" if int(m) == 0 else f"M={int(m)}"


# -- one-dimensional fits ------------------------------------------------------------------------
def fit_power_law(n: Any, y: Any, what: str = "y") -> PowerLaw:
    """Least squares in log-log space (``scipy.stats.linregress``); ``what`` names y in errors.

    Raises:
        DataError: fewer than two distinct N, or a value <= 0.
    """
    from scipy import stats

    n, y = np.asarray(n, dtype=float), np.asarray(y, dtype=float)
    if len(np.unique(n)) < 2 or np.any(n <= 0) or not np.all(np.isfinite(y) & (y > 0)):
        raise DataError(
            f"a power law of {what} needs finite values > 0 at two or more model sizes "
            f"(got {what} = {[round(float(v), 6) for v in y][:8]})"
        )
    r = stats.linregress(np.log(n), np.log(y))
    if not (math.isfinite(r.intercept) and r.intercept < math.log(np.finfo(float).max)):
        raise DataError(
            f"the power law of {what} through {[float(f'{v:.4g}') for v in y][:8]} has a coefficient A = "
            f"exp({r.intercept:.4g}) beyond a float: the values span too many orders of magnitude"
        )
    return PowerLaw(float(math.exp(r.intercept)), float(r.slope), float(r.rvalue**2))


def optimal_batch(rows: Any) -> float:
    """The optimal global batch of one (algorithm, N): the best loss at each batch, a quadratic
    in log2(B) through them (``scipy.optimize.curve_fit``), and its minimum. With fewer than three
    batches, or a fit without an interior minimum, the best batch tried.

    Args:
        rows: DataFrame rows of one algorithm and model size (columns global_batch, eval_loss).
    """
    import warnings

    from scipy.optimize import curve_fit

    rows = rows[rows["global_batch"].notna() & (rows["global_batch"] > 0)]
    if rows.empty:
        return float("nan")  # the table does not record batches
    best = rows.groupby("global_batch")["eval_loss"].min()
    b, loss = np.log2(best.index.to_numpy(dtype=float)), best.to_numpy(dtype=float)
    fallback = float(2 ** b[int(np.argmin(loss))])
    if len(b) < 3:
        return fallback
    try:
        with warnings.catch_warnings():  # three batches: no covariance estimate, which is not used
            warnings.simplefilter("ignore")
            (a, c, _), _ = curve_fit(
                lambda x, a, c, d: a * (x - c) ** 2 + d,
                b,
                loss,
                p0=(0.01, float(b[np.argmin(loss)]), float(loss.min())),
            )
    except (RuntimeError, ValueError):  # no convergence: the best batch tried
        return fallback
    if a <= 0 or not (b.min() - 1 <= c <= b.max() + 1):  # no minimum inside (or one step beyond) the grid
        return fallback
    return float(2**c)


def best_rows(df: Any) -> Any:
    """The best run (lowest eval loss) of each (M, N): its loss, inner lr and batch, and the
    optimal batch of :func:`optimal_batch`."""
    out = []
    for (m, n), g in df.groupby(["M", "N"]):
        r = g.loc[g["eval_loss"].idxmin()]
        out.append(
            {
                "M": int(m),
                "N": float(n),
                "eval_loss": float(r["eval_loss"]),
                "inner_lr": float(r["inner_lr"]),
                "global_batch": float(r["global_batch"]),
                "optimal_batch": optimal_batch(g),
                "outer_lr": float(r["outer_lr"]),
                "H": float(r["H"]),
            }
        )
    import pandas as pd

    return pd.DataFrame(out)


def fit_independent(best: Any) -> dict[str, dict[str, PowerLaw]]:
    """Per algorithm (DP, M=1, ...) power laws of the loss, inner lr and optimal batch in N.
    Algorithms with fewer than two model sizes are left out."""
    laws: dict[str, dict[str, PowerLaw]] = {}
    for m, g in best.groupby("M"):
        if g["N"].nunique() < 2:
            continue
        laws[algorithm_name(m)] = {"loss": fit_power_law(g["N"], g["eval_loss"], "eval_loss")}
        for q, col in (("inner_lr", "inner_lr"), ("batch", "optimal_batch")):  # when the table records them
            if g[col].notna().all():
                laws[algorithm_name(m)][q] = fit_power_law(g["N"], g[col], col)
    return laws


def fit_joint(n: Any, m: Any, y: Any) -> JointLaw:
    """``y = A * N^alpha * M^beta`` by least squares on ``log y`` (``scipy.linalg.lstsq``).

    Raises:
        DataError: fewer than two model sizes or two values of M >= 1.
    """
    from scipy.linalg import lstsq

    n, m, y = (np.asarray(v, dtype=float) for v in (n, m, y))
    if len(np.unique(n)) < 2 or len(np.unique(m)) < 2 or np.any(m < 1):
        raise DataError("a joint law needs DiLoCo rows (M >= 1) at two or more model sizes and two or more M")
    x = np.column_stack([np.ones_like(n), np.log(n), np.log(m)])
    c, *_ = lstsq(x, np.log(y))
    return JointLaw(float(math.exp(c[0])), float(c[1]), float(c[2]))


def optimal_outer_lr(df: Any) -> list[dict[str, Any]]:
    """For each (M, H) of the DiLoCo rows: the outer lr of the lowest loss at each N, and the
    one chosen (the most frequent over N; ties to the largest N's)."""
    out = []
    d = df[(df["M"] >= 1) & df["outer_lr"].notna() & df["H"].notna()]
    for (m, h), g in d.groupby(["M", "H"]):
        per_n = {float(n): float(gn.loc[gn["eval_loss"].idxmin(), "outer_lr"]) for n, gn in g.groupby("N")}
        values = list(per_n.values())
        counts = {v: values.count(v) for v in values}
        top = max(counts.values())
        chosen = next(per_n[n] for n in sorted(per_n, reverse=True) if counts[per_n[n]] == top)
        out.append({"M": int(m), "H": int(h), "outer_lr": chosen, "per_N": per_n})
    return out


# -- everything at once -------------------------------------------------------------------------
DEFAULT_STARTS = 32
"""Random starts of each parametric-form fit for ``fit`` and for ``predict --fits TABLE`` (one
default, so both choose the same form on the same table)."""


def fit_all(df: Any, starts: int = DEFAULT_STARTS) -> dict[str, Any]:
    """All fits of the module docstring on a sweep table (:func:`load_table`). Returns a
    JSON-ready dict: ``independent`` (per algorithm: loss / inner_lr / batch laws), ``joint``
    (loss / inner_lr / batch), ``forms`` (coefficients, objective, leave-one-size-out residual per
    N and mean), ``best_form``, ``outer_lr``, ``best_rows``, ``sizes`` and ``replicas``.

    Raises:
        DataError: fewer than two model sizes.
    """
    best = best_rows(df)
    if best["N"].nunique() < 2:
        raise DataError(f"the table has {best['N'].nunique()} model size(s); a scaling law needs at least two")
    out: dict[str, Any] = {
        "sizes": sorted(float(n) for n in best["N"].unique()),
        "replicas": sorted(int(m) for m in best["M"].unique()),
    }
    out["independent"] = {k: {q: law.to_dict() for q, law in v.items()} for k, v in fit_independent(best).items()}
    diloco = best[best["M"] >= 1]
    out["joint"], out["forms"], out["best_form"] = {}, {}, None
    if diloco["N"].nunique() >= 2 and diloco["M"].nunique() >= 2:
        out["joint"] = {
            q: fit_joint(diloco["N"], diloco["M"], diloco[col]).to_dict()
            for q, col in (("loss", "eval_loss"), ("inner_lr", "inner_lr"), ("batch", "optimal_batch"))
            if diloco[col].notna().all()
        }
        if diloco["N"].nunique() >= 3:
            logger.info(
                f"fitting {len(FORMS)} parametric forms, each on all sizes and with each of the "
                f"{diloco['N'].nunique()} sizes held out ({starts} starts per fit) ..."
            )
            out["forms"], out["best_form"] = fit_forms(diloco, starts)
    out["outer_lr"] = optimal_outer_lr(df)
    out["best_rows"] = best.to_dict(orient="records")
    seq = sorted(df["seq_len"].dropna().unique()) if "seq_len" in df.columns else []
    out["batch_unit"] = (
        f"sequences of {int(seq[0])} tokens"
        if len(seq) == 1
        else "sequences (the table's global_batch unit; it has no single seq_len)"
    )
    return out


LOSO_WARN_FRACTION = 0.03
"""predict warns when the chosen form, fitted without one of the sizes, missed that size's measured
loss by more than this fraction of it (the paper's forms miss by about 0.2%)."""


def _held_out_warning(fits: dict[str, Any], form: str) -> str | None:
    """The warning for a form that, fitted without one size, missed that size's mean DiLoCo loss
    (from ``best_rows``) by more than :data:`LOSO_WARN_FRACTION` of it; None when none did.
    Undefined misses (null, NaN) are skipped."""
    measured: dict[float, list[float]] = {}
    for row in fits.get("best_rows") or []:
        n, m, loss = row.get("N"), row.get("M"), row.get("eval_loss")
        if all(isinstance(v, (int, float)) for v in (n, m, loss)) and m >= 1 and math.isfinite(loss) and loss > 0:
            measured.setdefault(float(n), []).append(float(loss))
    worst = None
    for n, miss in fits["forms"][form]["residual_by_N"].items():
        if not isinstance(miss, (int, float)) or math.isnan(miss) or float(n) not in measured:
            continue
        loss = sum(measured[float(n)]) / len(measured[float(n)])
        if miss > LOSO_WARN_FRACTION * loss and (worst is None or miss / loss > worst[1] / worst[2]):
            worst = (float(n), float(miss), loss)
    if worst is None:
        return None
    n, miss, loss = worst
    return (
        f"fitted without N = {n:.3g}, this form missed its loss ({loss:.4g}) by {miss:.4g} "
        f"({100 * miss / loss:.1f}%): the loss is a rough estimate"
    )


def predict(fits: dict[str, Any], params: float, replicas: int, H: int | None = None) -> dict[str, Any]:
    """Predicted eval loss, inner lr, global batch and outer lr of a model of ``params``
    parameters trained with ``replicas`` replicas (0: data-parallel).

    The loss comes from the best parametric form by leave-one-size-out residual for DiLoCo (the
    independent law when the form was not fitted) and from the independent law for DP; inner lr
    and batch from the independent law of that M when fitted, else the joint law; the outer lr
    from the nearest fitted (M, H). ``loss_warning`` is set when the form's leave-one-size-out
    miss of a size is above :data:`LOSO_WARN_FRACTION` of that size's measured loss.

    Raises:
        DataError: nothing fitted for that algorithm.
    """
    missing = [
        k
        for k in ("sizes", "replicas", "independent", "joint", "forms", "best_form", "outer_lr")
        if not isinstance(fits, dict) or k not in fits
    ]
    if missing:
        raise DataError(f"--fits: not fits written by ray-diloco fit (missing {', '.join(missing)})")
    name = algorithm_name(replicas)
    ind = fits["independent"].get(name)
    out: dict[str, Any] = {"params": float(params), "replicas": int(replicas), "algorithm": name}
    if replicas >= 1 and fits.get("best_form"):
        form = fits["best_form"]
        out["eval_loss"] = float(FormFit(form, tuple(fits["forms"][form]["theta"]), 0.0)(params, replicas))
        out["loss_from"] = {"form": form, "residual": fits["forms"][form]["residual"]}
        warning = _held_out_warning(fits, form)
        if warning:
            out["loss_warning"] = warning
    elif ind is not None:
        out["eval_loss"] = float(PowerLaw(**ind["loss"])(params))
        out["loss_from"] = {"form": f"A*N^alpha ({name})", "r2": ind["loss"]["r2"]}
    else:
        raise DataError(
            f"--replicas {replicas}: the table has no {name} rows at two or more sizes to fit "
            f"(fitted: {', '.join(fits['independent']) or 'none'})"
        )
    for q in ("inner_lr", "batch"):
        if ind is not None and q in ind:
            out[q] = float(PowerLaw(**ind[q])(params))
            out[f"{q}_from"] = f"A*N^alpha ({name})"
        elif replicas >= 1 and q in fits["joint"]:
            out[q] = float(JointLaw(**fits["joint"][q])(params, replicas))
            out[f"{q}_from"] = "A*N^alpha*M^beta"
    out["global_batch"] = out.pop("batch", None)
    out["global_batch_from"] = out.pop("batch_from", None)
    out["global_batch_unit"] = fits.get("batch_unit", "sequences")
    out["outer_lr"], out["outer_lr_from"] = None, None
    largest, smallest = max(fits["sizes"]), min(fits["sizes"])
    notes = []
    if params > 2 * largest:
        notes.append(f"N is {params / largest:.3g}x the largest size fitted ({largest:.3g})")
    elif params < smallest / 2:
        notes.append(f"N is below the smallest size fitted ({smallest:.3g})")
    if replicas > max(fits["replicas"]):
        notes.append(f"M = {replicas} is beyond the largest M fitted ({max(fits['replicas'])})")
    if notes:
        out["extrapolation"] = "; ".join(notes)
    if replicas >= 1 and fits["outer_lr"]:
        near = min(
            fits["outer_lr"],
            key=lambda r: (abs(math.log2(r["M"]) - math.log2(replicas)), abs(r["H"] - H) if H is not None else -r["H"]),
        )
        out["outer_lr"], out["outer_lr_from"] = near["outer_lr"], {"M": near["M"], "H": near["H"]}
    return out


def _stat(value: float | None) -> str:
    """An r2 or residual for the tables: ``n/a`` when undefined (NaN in memory, null in a
    fits.json), ``inf`` when it overflowed."""
    return "n/a" if value is None or math.isnan(value) else f"{value:.4f}"


def format_fits(fits: dict[str, Any]) -> str:
    """The fits as readable tables (for ``ray-diloco fit``)."""
    lines = [
        f"model sizes: {', '.join(f'{n:.3g}' for n in fits['sizes'])}; "
        f"algorithms: {', '.join(algorithm_name(m) for m in fits['replicas'])}",
        "",
        "independent power laws y = A * N^alpha",
        f"{'algorithm':<10} {'loss A':>10} {'alpha':>9} {'r2':>7} {'inner lr A':>12} {'alpha':>9} {'batch A':>10} "
        f"{'alpha':>8}",
    ]
    for k, v in fits["independent"].items():
        lr, b = v.get("inner_lr"), v.get("batch")
        lines.append(
            f"{k:<10} {v['loss']['A']:>10.4g} {v['loss']['alpha']:>9.4f} {_stat(v['loss']['r2']):>7} "
            + (f"{lr['A']:>12.5g} {lr['alpha']:>9.4f} " if lr else f"{'-':>12} {'-':>9} ")
            + (f"{b['A']:>10.4g} {b['alpha']:>8.4f}" if b else f"{'-':>10} {'-':>8}")
        )
    if fits["joint"]:
        lines += ["", "joint laws y = A * N^alpha * M^beta (DiLoCo rows)"]
        for q, c in fits["joint"].items():
            lines.append(f"  {q:<9} A = {c['A']:.5g}, alpha = {c['alpha']:.4f}, beta = {c['beta']:.4f}")
    if fits["forms"]:
        sizes = list(next(iter(fits["forms"].values()))["residual_by_N"])
        lines += [
            "",
            "parametric forms L(N, M) (N in parameters), Huber on log L; leave-one-size-out |residual| per held-out N",
            f"{'form':<22} {'mean':>8} " + " ".join(f"{float(s):>8.3g}" for s in sizes),
        ]
        for name, f in fits["forms"].items():
            mark = "  <- best" if name == fits["best_form"] else ""
            lines.append(
                f"{name:<22} {f['residual']:>8.4f} " + " ".join(f"{f['residual_by_N'][s]:>8.4f}" for s in sizes) + mark
            )
    if fits["outer_lr"]:
        lines += ["", "best outer lr per (M, H) (per N in brackets)"]
        for r in fits["outer_lr"]:
            per = ", ".join(f"{n:.3g}: {v:g}" for n, v in r["per_N"].items())
            lines.append(f"  M={r['M']} H={r['H']}: {r['outer_lr']:g}  [{per}]")
    return "\n".join(lines)


def format_prediction(p: dict[str, Any]) -> str:
    """A prediction (:func:`predict`) as lines."""
    src = p["loss_from"]
    how = (
        f"form {src['form']}, leave-one-size-out residual {_stat(src['residual'])}"
        if "residual" in src
        else f"{src['form']}, r2 {_stat(src['r2'])}"
    )
    lines = [
        f"{p['algorithm']} at N = {p['params']:.4g} parameters"
        + (f" (an extrapolation: {p['extrapolation']})" if p.get("extrapolation") else ""),
        f"  eval loss     {p['eval_loss']:.4f}   ({how})",
    ]
    if p.get("loss_warning"):
        lines.append(f"  warning: {p['loss_warning']}")
    if p.get("inner_lr") is not None:
        lines.append(f"  inner lr      {p['inner_lr']:.4g}   ({p['inner_lr_from']})")
    if p.get("global_batch") is not None:
        lines.append(f"  global batch  {p['global_batch']:.4g} {p['global_batch_unit']}   ({p['global_batch_from']})")
    if p.get("outer_lr") is not None:
        lines.append(
            f"  outer lr      {p['outer_lr']:g}   (best at M={p['outer_lr_from']['M']}, H={p['outer_lr_from']['H']})"
        )
    elif p["replicas"] >= 1:
        lines.append(
            "  outer lr      -        (these fits hold no outer-lr sweep; the paper finds it independent of N, "
            "rising with M and H)"
        )
    return "\n".join(lines)
