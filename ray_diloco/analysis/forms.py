"""Parametric loss forms L(N, M) for DiLoCo (Charles et al., "Scaling Laws for DiLoCo", arXiv
2503.09799, section 5): each form of :data:`FORMS` fitted with a Huber loss on log L by L-BFGS
(``scipy.optimize.minimize``) from many random starts, and the forms compared by
leave-one-size-out residuals. ``analysis.laws`` fits them on a sweep table, ``analysis.paper``
on the published losses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

HUBER_DELTA = 1e-3  # on log L (Hoffmann et al.'s choice, kept by the DiLoCo scaling-law paper)


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
