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

import copy
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
HUBER_DELTA = 1e-3  # on log L (Hoffmann et al.'s choice, kept by the DiLoCo scaling-law paper)


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


# -- the paper's published numbers (arXiv 2503.09799, section 3) -----------------------------------
PAPER_SIZES = {"35M": 35e6, "90M": 90e6, "180M": 180e6, "335M": 335e6, "550M": 550e6, "1.3B": 1.3e9, "2.4B": 2.4e9}
PAPER_LOSSES = {  # Scaling Laws for DiLoCo Table 4: C4 eval loss per model size; 0 = DP
    0: (3.485, 3.167, 2.950, 2.784, 2.653, 2.460, 2.326),
    1: (3.482, 3.162, 2.943, 2.777, 2.645, 2.451, 2.317),
    2: (3.508, 3.182, 2.957, 2.788, 2.657, 2.464, 2.323),
    4: (3.554, 3.213, 2.981, 2.808, 2.673, 2.472, 2.332),
    8: (3.621, 3.265, 3.019, 2.841, 2.698, 2.493, 2.351),
}
PAPER_INDEPENDENT = {  # published independent laws (A, alpha): loss, inner lr, batch (in 2048-token sequences)
    "DP": {"loss": (18.129, -0.0953), "inner_lr": (16319.2, -0.819), "batch": (0.22592, 0.281)},
    "M=1": {"loss": (18.363, -0.0961), "inner_lr": (74620.6, -0.945), "batch": (0.01361, 0.435)},
    "M=2": {"loss": (18.768, -0.0969), "inner_lr": (3978.82, -0.780), "batch": (0.00769, 0.479)},
    "M=4": {"loss": (19.762, -0.0992), "inner_lr": (4512.99, -0.789), "batch": (0.00535, 0.510)},
    "M=8": {"loss": (21.051, -0.1018), "inner_lr": (618986, -1.102), "batch": (0.01859, 0.455)},
}
PAPER_JOINT = {
    "loss": (19.226, -0.0985, 0.0116),
    "inner_lr": (22256, -0.8827, 0.2929),
    "batch": (0.00709, 0.4695, 0.3399),
}
PAPER_FORM_RESIDUALS = {
    "A*N^alpha*M^beta": 0.0044,
    "A*N^alpha*M^beta+C": 0.0035,
    "A*N^(alpha+beta*M)+C": 0.0025,
    "A*N^alpha+B*M^beta+C": 0.0043,
}  # 2.4B held out


def paper_table() -> Any:
    """The published eval losses (:data:`PAPER_LOSSES`) as a sweep table: one row per (M, N)
    (inner lr, batch, H and outer lr are not published per run: NaN, H = 30)."""
    import pandas as pd

    return pd.DataFrame(
        [
            {
                "N": n,
                "M": m,
                "H": 30,
                "inner_lr": np.nan,
                "outer_lr": np.nan,
                "global_batch": np.nan,
                "tokens": 20 * n,
                "eval_loss": loss,
            }
            for m, losses in PAPER_LOSSES.items()
            for n, loss in zip(PAPER_SIZES.values(), losses)
        ]
    )


PAPER_FITS_FILE = Path(__file__).parents[1] / "data" / "paper_fits.json"  # paper_fits(cached=False), saved


def paper_fits(starts: int = 8, cached: bool = True) -> dict[str, Any]:
    """Fits in the format of :func:`fit_all` for ``ray-diloco predict --fits paper``: the loss laws
    and parametric forms fitted here on the published losses, the inner-lr and batch laws as
    published (batch in 2048-token sequences). No outer lr (the paper gives no per-(M, H) table).

    ``cached`` reads them from :data:`PAPER_FITS_FILE` (shipped; a test checks it equals a fresh
    fit), which saves the seconds of the 4 x 8 form fits. Each call returns its own copy: a caller
    may change it without changing what the next call returns."""
    return copy.deepcopy(_paper_fits(starts, cached))


@functools.lru_cache(maxsize=4)
def _paper_fits(starts: int, cached: bool) -> dict[str, Any]:
    if cached and PAPER_FITS_FILE.is_file():
        import json

        return json.loads(PAPER_FITS_FILE.read_text())
    df = paper_table()
    best = df.assign(optimal_batch=np.nan)
    out: dict[str, Any] = {
        "sizes": sorted(PAPER_SIZES.values()),
        "replicas": sorted(PAPER_LOSSES),
        "independent": {},
        "outer_lr": [],
        "best_rows": best.to_dict(orient="records"),
        "source": "Scaling Laws for DiLoCo (published losses; published inner lr and batch laws)",
        "batch_unit": "sequences of 2048 tokens",
    }
    for m, g in df.groupby("M"):
        name = algorithm_name(m)
        loss = fit_power_law(g["N"], g["eval_loss"]).to_dict()
        out["independent"][name] = {
            "loss": loss,
            **{
                q: {"A": a, "alpha": al, "r2": float("nan")}
                for q, (a, al) in PAPER_INDEPENDENT[name].items()
                if q != "loss"
            },
        }
    diloco = df[df["M"] >= 1]
    out["joint"] = {
        "loss": fit_joint(diloco["N"], diloco["M"], diloco["eval_loss"]).to_dict(),
        **{q: dict(zip(("A", "alpha", "beta"), v)) for q, v in PAPER_JOINT.items() if q != "loss"},
    }
    out["forms"], out["best_form"] = fit_forms(diloco, starts)
    return out


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


# -- parametric loss forms L(N, M) ---------------------------------------------------------------
@dataclass(frozen=True)
class Form:
    """A parametric loss form. ``log_loss(theta, n, m)`` returns log L for N in parameters and M
    in replicas. ``theta`` holds log A' (and log B, log C) so that the scales stay positive, where
    A' = A * N0^alpha is the scale at N = :data:`N0`: the fit works with log(N / N0) (well
    conditioned) while the family is exactly the paper's, N in parameters. That matters for
    ``A*N^(alpha+beta*M)+C``: its M-dependence N^(beta*M) changes with the unit of N, so it is
    written as A' (N/N0)^alpha (N/N0)^(beta*M) N0^(beta*M), which is A N^(alpha+beta*M).

    Every form is a sum of terms (A N^alpha M^beta, C, ...) whose logs are linear in ``theta``:
    ``terms(n, m)`` returns ``X`` ``[terms, params, points]`` with log term_k = theta . X_k, so
    log L = logsumexp_k(theta . X_k) and its gradient (the fit's exact Jacobian) is
    sum_k share_k X_k, share_k = term_k / L."""

    name: str
    params: tuple[str, ...]
    terms: Callable[[np.ndarray, np.ndarray], np.ndarray]
    scale: tuple[tuple[str, float], ...] = ()  # (coefficient, s): theta holds s x the coefficient

    def log_loss(self, theta: np.ndarray, n: np.ndarray, m: np.ndarray) -> np.ndarray:
        """log L at each (n, m)."""
        return self.log_loss_and_jacobian(theta, n, m)[0]

    def log_loss_and_jacobian(self, theta: np.ndarray, n: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """log L (the shape of ``n`` and ``m`` broadcast) and d log L / d theta ``[params, points]``.

        Raises:
            ValueError: ``theta`` does not hold one value per parameter.
        """
        theta = np.asarray(theta, dtype=float)
        if theta.shape != (len(self.params),):
            raise ValueError(f"{self.name}: theta has shape {theta.shape}, expected ({len(self.params)},)")
        n, m = np.broadcast_arrays(np.asarray(n, dtype=float), np.asarray(m, dtype=float))
        log_l, jac = _log_sum_of_terms(theta, self.terms(n.reshape(-1), m.reshape(-1)))
        return log_l.reshape(n.shape), jac

    def coefficients(self, theta: np.ndarray) -> dict[str, float]:
        """The coefficients for N in parameters (the paper's convention: A = A' / N0^alpha)."""
        c = {k: float(v) for k, v in zip(self.params, theta)}
        for k, s in self.scale:
            c[k] /= s
        for k in ("A", "B", "C"):
            if k in c:
                c[k] = math.exp(c[k] - (c["alpha"] * math.log(N0) if k == "A" else 0.0))
        return c


N0 = 1e9  # the fits work with log(N / N0), N0 = 1B parameters: better conditioned than raw N
LOG_N0 = math.log(N0)


def _log_sum_of_terms(theta: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log sum_k exp(theta . X_k) ``[points]`` and its gradient ``[params, points]`` for ``X``
    ``[terms, params, points]``."""
    z = np.einsum("p,kpi->ki", theta, x)
    top = z.max(axis=0)
    e = np.exp(z - top)
    total = e.sum(axis=0)
    return top + np.log(total), np.einsum("ki,kpi->pi", e / total, x)


def _terms(
    *rows: Callable[[np.ndarray, np.ndarray, np.ndarray], list[Any]],
) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """``terms`` of a :class:`Form` from one function per term: ``(one, x, m) -> [d log term /
    d theta_j for each j]`` with x = log(N / N0) and ``one`` a vector of ones."""

    def build(n: np.ndarray, m: np.ndarray) -> np.ndarray:
        x, one = np.log(n / N0), np.ones_like(n)
        return np.stack([np.stack([np.broadcast_to(v, n.shape) for v in row(one, x, m)]) for row in rows])

    return build


FORMS = {
    "A*N^alpha*M^beta": Form("A*N^alpha*M^beta", ("A", "alpha", "beta"), _terms(lambda one, x, m: [one, x, np.log(m)])),
    "A*N^alpha*M^beta+C": Form(
        "A*N^alpha*M^beta+C",
        ("A", "alpha", "beta", "C"),
        _terms(lambda one, x, m: [one, x, np.log(m), 0.0], lambda one, x, m: [0.0, 0.0, 0.0, one]),
    ),
    # beta M log N = (beta log N0) M (1 + log(N/N0) / log N0): theta holds beta log N0 (conditioning)
    "A*N^(alpha+beta*M)+C": Form(
        "A*N^(alpha+beta*M)+C",
        ("A", "alpha", "beta", "C"),
        _terms(lambda one, x, m: [one, x, m * (1.0 + x / LOG_N0), 0.0], lambda one, x, m: [0.0, 0.0, 0.0, one]),
        scale=(("beta", LOG_N0),),
    ),
    "A*N^alpha+B*M^beta+C": Form(
        "A*N^alpha+B*M^beta+C",
        ("A", "alpha", "B", "beta", "C"),
        _terms(
            lambda one, x, m: [one, x, 0.0, 0.0, 0.0],
            lambda one, x, m: [0.0, 0.0, one, np.log(m), 0.0],
            lambda one, x, m: [0.0, 0.0, 0.0, 0.0, one],
        ),
    ),
}


@dataclass(frozen=True)
class FormFit:
    """A fitted :class:`Form`: ``theta`` (internal), the coefficients (for N in
    parameters), and the Huber objective at the optimum."""

    form: str
    theta: tuple[float, ...]
    objective: float

    def __call__(self, n: Any, m: Any) -> Any:
        return np.exp(
            FORMS[self.form].log_loss(np.asarray(self.theta), np.asarray(n, dtype=float), np.asarray(m, dtype=float))
        )

    def coefficients(self) -> dict[str, float]:
        return FORMS[self.form].coefficients(np.asarray(self.theta))


def fit_form(form: str, n: Any, m: Any, loss: Any, starts: int = 64, seed: int = 0) -> FormFit:
    """Fit one of :data:`FORMS` with a Huber loss (delta :data:`HUBER_DELTA`) on log L, by L-BFGS-B
    (``scipy.optimize.minimize``) from ``starts`` random starting points; the best optimum wins.

    The fit is converged, not just stopped: refits of the paper's table agree to 1e-4 in every
    coefficient whatever the CPU's last bits of log/exp or the scipy release. L-BFGS-B stops when
    an iteration lowers ``f`` by less than ``ftol * max(|f|, 1)`` (ftol 2.2e-9), and the plain
    Huber sum of those 28 losses is about 6e-5: the test was absolute, the fit stopped some 4e-5
    of ``f`` short, somewhere along the shallow A-C valley of the +C forms, and where it stopped
    moved with the last bit of numpy's log/exp (its SIMD code differs by CPU) and with scipy:
    A of ``A*N^alpha*M^beta+C`` by 2.4e-4 between two installs, and as much here when the losses
    were perturbed by 1e-15. So the optimiser minimises the sum in units of ``HUBER_DELTA**2``
    (about 1 per point; :attr:`FormFit.objective` stays in the plain unit), with the exact
    gradient (:meth:`Form.log_loss_and_jacobian`) rather than finite differences.

    Args:
        n, m, loss: 1-D arrays of the same length (parameters, replicas >= 1, eval loss > 0).
    """
    from scipy.optimize import minimize

    f = FORMS[form]
    n, m, log_l = (np.asarray(v, dtype=float) for v in (n, m, np.log(np.asarray(loss, dtype=float))))
    unit = HUBER_DELTA**2
    x = f.terms(n, m)

    def objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
        pred, jac = _log_sum_of_terms(theta, x)
        r = pred - log_l
        small = np.abs(r) <= HUBER_DELTA  # Huber: r^2 / 2 inside delta, delta (|r| - delta / 2) outside
        value = np.where(small, 0.5 * r * r, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA)).sum()
        return float(value) / unit, jac @ np.clip(r, -HUBER_DELTA, HUBER_DELTA) / unit

    rng = np.random.default_rng(seed)
    best = None
    for _ in range(starts):
        theta0 = rng.uniform(-1.0, 1.0, len(f.params))
        r = minimize(objective, theta0, jac=True, method="L-BFGS-B")
        if np.isfinite(r.fun) and (best is None or r.fun < best.fun):
            best = r
    assert best is not None
    return FormFit(form, tuple(float(v) for v in best.x), float(best.fun) * unit)


def leave_one_size_out(diloco: Any, form: str, starts: int = 64) -> dict[float, float]:
    """Per model size N: the mean |predicted - measured| loss at N (over its M values) of ``form``
    fitted on the other sizes (paper section 5: forms compared on held-out sizes)."""
    out = {}
    for n in sorted(diloco["N"].unique()):
        train, held = diloco[diloco["N"] != n], diloco[diloco["N"] == n]
        fit = fit_form(form, train["N"], train["M"], train["eval_loss"], starts=starts)
        out[float(n)] = float(np.mean(np.abs(fit(held["N"], held["M"]) - held["eval_loss"])))
    return out


def fit_forms(diloco: Any, starts: int) -> tuple[dict[str, Any], str]:
    """Every form of :data:`FORMS` fitted on the DiLoCo rows (columns N, M, eval_loss) and scored
    by :func:`leave_one_size_out`. Returns ``({form: {"coefficients", "theta", "objective",
    "residual_by_N", "residual"}}, best form by mean residual)``."""
    forms: dict[str, dict[str, Any]] = {}
    for name in FORMS:
        fit = fit_form(name, diloco["N"], diloco["M"], diloco["eval_loss"], starts=starts)
        loo = leave_one_size_out(diloco, name, starts=starts)
        forms[name] = {
            "coefficients": fit.coefficients(),
            "theta": list(fit.theta),
            "objective": fit.objective,
            "residual_by_N": {str(k): v for k, v in loo.items()},
            "residual": float(np.mean(list(loo.values()))),
        }
    return forms, min(forms, key=lambda k: forms[k]["residual"])


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
