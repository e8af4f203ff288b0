"""Scaling-law fits (ray_diloco.analysis.laws) against the published tables of "Scaling Laws for DiLoCo"
(arXiv 2503.09799, section 3), a synthetic sweep with known optima, and the fit/predict CLI."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from helpers import ROOT, one_error_line, run_main

from ray_diloco.analysis.forms import FORMS, FormFit, fit_form
from ray_diloco.analysis.laws import (
    fit_all,
    fit_joint,
    fit_power_law,
    format_prediction,
    load_table,
    optimal_batch,
    predict,
)
from ray_diloco.analysis.paper import (
    PAPER_FORM_RESIDUALS,
    PAPER_INDEPENDENT,
    PAPER_JOINT,
    PAPER_SIZES,
    paper_fits,
    paper_table,
)
from ray_diloco.errors import DataError

FIXTURE = ROOT / "tests" / "fixtures" / "cpu_scaling_study.csv"  # stages 1 and 2 of our CPU study


@pytest.mark.parametrize("algorithm", list(PAPER_INDEPENDENT))
def test_independent_loss_laws_reproduce_the_published_coefficients(algorithm):
    """Done-when 1: A within 2%, alpha within 0.002 of the paper's per-algorithm fits."""
    df = paper_table()
    m = 0 if algorithm == "DP" else int(algorithm[2:])
    rows = df[df["M"] == m]
    law = fit_power_law(rows["N"], rows["eval_loss"])
    A, alpha = PAPER_INDEPENDENT[algorithm]["loss"]
    assert law.A == pytest.approx(A, rel=0.02) and law.alpha == pytest.approx(alpha, abs=0.002), (law, A, alpha)
    assert law.r2 > 0.99


def test_joint_law_reproduces_the_published_coefficients():
    """Done-when 1: L = A N^alpha M^beta over the DiLoCo rows (M = 1, 2, 4, 8)."""
    df = paper_table()
    d = df[df["M"] >= 1]
    law = fit_joint(d["N"], d["M"], d["eval_loss"])
    A, alpha, beta = PAPER_JOINT["loss"]
    assert law.A == pytest.approx(A, rel=0.02)
    assert law.alpha == pytest.approx(alpha, abs=0.002) and law.beta == pytest.approx(beta, abs=0.002)


def test_parametric_forms_with_2_4b_held_out():
    """Done-when 2, measured: each form fitted on 35M..1.3B (Huber on log L, L-BFGS, random
    starts) and scored on the 2.4B losses. The published residuals (0.0044 / 0.0035 / 0.0025 /
    0.0043) were fitted on the paper's full sweep; on its published best-loss table alone the
    +C forms beat the plain power law, and A*N^(alpha+beta*M)+C does not come out best (see
    docs/scaling-laws.md). The fits are deterministic (seeded starts), so the ranking is pinned."""
    df = paper_table()
    d = df[df["M"] >= 1]
    train, held = d[d["N"] < 2e9], d[d["N"] > 2e9]
    res = {}
    for name in FORMS:
        fit = fit_form(name, train["N"], train["M"], train["eval_loss"], starts=24)
        pred = fit(held["N"], held["M"])
        res[name] = float(np.mean(np.abs(pred - held["eval_loss"])))
    print({k: (round(v, 4), PAPER_FORM_RESIDUALS[k]) for k, v in res.items()})
    assert all(v < 0.03 for v in res.values()), res
    plain = res["A*N^alpha*M^beta"]
    assert all(res[k] < plain for k in FORMS if k.endswith("+C")), res  # the irreducible term helps out of sample
    assert min(res, key=res.get) == "A*N^alpha*M^beta+C"


def test_form_coefficients_are_for_n_in_parameters_as_the_formulas_read():
    """Each fitted form, evaluated from its reported coefficients with N in parameters (the
    paper's unit), gives the fit's own predictions. For A*N^(alpha+beta*M)+C this pins the family:
    its M-dependence N^(beta*M) changes with the unit of N, and the paper's N is in parameters."""
    df = paper_table()
    d = df[df["M"] >= 1]
    n, m = d["N"].to_numpy(), d["M"].to_numpy(dtype=float)
    formulas = {
        "A*N^alpha*M^beta": lambda c: c["A"] * n ** c["alpha"] * m ** c["beta"],
        "A*N^alpha*M^beta+C": lambda c: c["A"] * n ** c["alpha"] * m ** c["beta"] + c["C"],
        "A*N^(alpha+beta*M)+C": lambda c: c["A"] * n ** (c["alpha"] + c["beta"] * m) + c["C"],
        "A*N^alpha+B*M^beta+C": lambda c: c["A"] * n ** c["alpha"] + c["B"] * m ** c["beta"] + c["C"],
    }
    for name, formula in formulas.items():
        fit = fit_form(name, n, m, d["eval_loss"], starts=8)
        np.testing.assert_allclose(formula(fit.coefficients()), fit(n, m), rtol=1e-9, err_msg=name)
        assert np.abs(fit(n, m) - d["eval_loss"]).max() < 0.1, name  # a fit, not a failed optimisation


def _synthetic_sweep() -> tuple[pd.DataFrame, dict]:
    """A grid sweep whose losses follow known laws: L*(N, M) = A N^alpha M^beta (DP: M^0 x 1.002),
    plus quadratic penalties in log2(inner lr / lr*(N)) and log2(B / B*(N)) and in the outer lr
    away from 0.2 + 0.2 log2(M)."""
    # lr*(N) = 2^-7 at 1M parameters, falling 2^-1.5 per 4x: on the sqrt(2) grid at every size swept
    truth = {"A": 20.0, "alpha": -0.1, "beta": 0.01, "lr_A": 2**-7 * 1e6**0.75, "lr_alpha": -0.75, "b_A": 0.02,
             "b_alpha": 0.45}
    rows = []
    for n in (1e6, 4e6, 16e6, 64e6):
        lr_star, b_star = truth["lr_A"] * n ** truth["lr_alpha"], truth["b_A"] * n ** truth["b_alpha"]
        for m in (0, 1, 2, 4):
            base = truth["A"] * n ** truth["alpha"] * (1.002 if m == 0 else m ** truth["beta"])
            outer_star = 0.2 + 0.2 * math.log2(max(m, 1))
            for k in range(-3, 4):  # inner lr over powers of sqrt 2 around the optimum's grid point
                lr = 2 ** (round(2 * math.log2(lr_star)) / 2 + k / 2)
                for j in range(-2, 3):  # batch over powers of 2
                    b = 2 ** (round(math.log2(b_star)) + j)
                    for outer in ((0.2, 0.4, 0.6, 0.8, 1.0) if m >= 1 else (1.0,)):
                        loss = base + 0.01 * math.log2(lr / lr_star) ** 2 + 0.004 * math.log2(b / b_star) ** 2 \
                            + (0.05 * (outer - outer_star) ** 2 if m >= 1 else 0.0)
                        rows.append({"num_parameters": n, "replicas": m, "H": 30, "inner_lr": lr, "outer_lr": outer,
                                     "global_batch": b, "tokens": 20 * n, "final_eval_loss": loss,
                                     "status": "TERMINATED"})
    rows.append({**rows[0], "final_eval_loss": float("nan"), "status": "ERROR"})  # failed trials are ignored
    return pd.DataFrame(rows), truth


def test_fits_recover_the_laws_a_synthetic_sweep_was_made_from(tmp_path):
    df, truth = _synthetic_sweep()
    df.to_csv(tmp_path / "results.csv", index=False)
    table = load_table(tmp_path)  # a sweep directory: its results.csv, result columns renamed
    assert len(table) == len(df) - 1 and set(table["M"]) == {0, 1, 2, 4}
    fits = fit_all(table, starts=8)
    for name in ("M=1", "M=2", "M=4"):
        m = int(name[2:])
        loss = fits["independent"][name]["loss"]
        # the best run of a size sits on the lr / batch grid points nearest the optimum: up to
        # 1.6e-3 of penalty on a loss near 3
        assert loss["A"] == pytest.approx(truth["A"] * m ** truth["beta"], rel=3e-3)
        assert loss["alpha"] == pytest.approx(truth["alpha"], abs=1e-3)
        batch = fits["independent"][name]["batch"]  # the quadratic through the best loss per batch finds B* exactly
        assert batch["A"] == pytest.approx(truth["b_A"], rel=1e-4) and batch["alpha"] == pytest.approx(truth["b_alpha"], abs=1e-5)
        lr = fits["independent"][name]["inner_lr"]
        assert lr["A"] == pytest.approx(truth["lr_A"], rel=1e-6) and lr["alpha"] == pytest.approx(truth["lr_alpha"], abs=1e-9)
    joint = fits["joint"]["loss"]
    assert joint["A"] == pytest.approx(truth["A"], rel=3e-3) and joint["beta"] == pytest.approx(truth["beta"], abs=1e-3)
    assert {(r["M"], r["outer_lr"]) for r in fits["outer_lr"]} == {(1, 0.2), (2, 0.4), (4, 0.6)}
    assert fits["forms"]["A*N^alpha*M^beta"]["residual"] < 3e-3  # the generating form predicts held-out sizes
    p = predict(fits, 256e6, 2, H=30)
    assert p["eval_loss"] == pytest.approx(truth["A"] * 256e6 ** truth["alpha"] * 2 ** truth["beta"], rel=3e-3)
    assert p["global_batch"] == pytest.approx(truth["b_A"] * 256e6 ** truth["b_alpha"], rel=1e-3)
    assert p["outer_lr"] == 0.4
    with pytest.raises(DataError, match="--replicas 8: the table has no M=8 rows"):
        predict({**fits, "best_form": None}, 1e9, 8)


def test_optimal_batch_is_the_vertex_of_the_quadratic_in_log2_b():
    rows = pd.DataFrame({"global_batch": [32, 64, 128, 256, 256], "eval_loss": [3.0 + 0.1 * (x - 6.3) ** 2 for x in
                                                                            (5, 6, 7, 8)] + [9.0]})
    assert optimal_batch(rows) == pytest.approx(2 ** 6.3, rel=1e-6)
    two = pd.DataFrame({"global_batch": [32, 64], "eval_loss": [3.1, 3.0]})
    assert optimal_batch(two) == 64  # fewer than three batches: the best one tried


PAPER_FITS_GRID_N = sorted(PAPER_SIZES.values()) + [4e9, 10e9]  # the fitted sizes and the paper's 4B and 10B runs


def test_form_jacobians_match_finite_differences():
    """The exact gradient fit_form gives L-BFGS-B: d log L / d theta of each form against central
    differences, at random parameters and at the paper's (N, M)."""
    df = paper_table()
    d = df[df["M"] >= 1]
    n, m = d["N"].to_numpy(), d["M"].to_numpy(dtype=float)
    rng = np.random.default_rng(3)
    for name, form in FORMS.items():
        theta = rng.uniform(-1.0, 1.0, len(form.params))
        log_l, jac = form.log_loss_and_jacobian(theta, n, m)
        np.testing.assert_array_equal(log_l, form.log_loss(theta, n, m))
        h = 1e-6
        fd = np.stack([(form.log_loss(theta + h * e, n, m) - form.log_loss(theta - h * e, n, m)) / (2 * h)
                       for e in np.eye(len(theta))])
        np.testing.assert_allclose(jac, fd, rtol=1e-6, atol=1e-8, err_msg=name)


def test_predictions_from_the_papers_fits_match_its_4b_and_10b_runs():
    """The paper trained 4B and 10B models with predicted hyperparameters (arXiv 2503.09799, section 3).
    Our loss predictions from its own table (35M-2.4B) land within 1% of what it measured at 4B;
    at 10B, 4x past the largest size fitted, within 3.5% (DP's pure power law, with no
    irreducible term, is the most optimistic: 2.021 against 2.090)."""
    fits = paper_fits(cached=False)
    shipped = paper_fits()  # the copy `predict --fits paper` reads: the same fits
    assert shipped["best_form"] == fits["best_form"]
    # fit_form converges (objective in units of delta^2, exact gradient; see its docstring): refits
    # with the losses moved by 1e-15 (the last bits of log/exp differ between CPUs and numpy
    # builds) or from other random starts agree to 5e-6 in every coefficient and 4e-8 in every
    # prediction below, so these tolerances leave a 20x margin. (Before, L-BFGS-B stopped early on
    # an absolute test and A of A*N^alpha*M^beta+C moved by 2.4e-4 between two installs.)
    n, m = np.meshgrid(PAPER_FITS_GRID_N, [1, 2, 4, 8])
    for name, f in fits["forms"].items():
        for k, v in f["coefficients"].items():
            assert shipped["forms"][name]["coefficients"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), (name, k)
        np.testing.assert_allclose(FormFit(name, tuple(shipped["forms"][name]["theta"]), 0.0)(n, m),
                                   FormFit(name, tuple(f["theta"]), 0.0)(n, m), rtol=1e-6, err_msg=name)
    measured = {(4e9, 0): 2.224, (10e9, 0): 2.090, (4e9, 1): 2.219, (10e9, 1): 2.086, (4e9, 2): 2.220,
                (10e9, 2): 2.086, (4e9, 4): 2.230, (10e9, 4): 2.096}
    for (n, m), loss in measured.items():
        p = predict(fits, n, m)
        assert p["eval_loss"] == pytest.approx(loss, rel=0.01 if n == 4e9 else 0.035), (n, m, p["eval_loss"], loss)
        # inner lr and batch come from the published laws
        lr_a, lr_alpha = PAPER_INDEPENDENT[p["algorithm"]]["inner_lr"]
        assert p["inner_lr"] == pytest.approx(lr_a * n ** lr_alpha, rel=1e-9)


def test_fit_and_predict_cli_write_json_and_plots(tmp_path):
    df, _ = _synthetic_sweep()
    df.to_parquet(tmp_path / "sweep.parquet", index=False)
    out = run_main(["fit", str(tmp_path / "sweep.parquet"), "--starts", "4", "--json", str(tmp_path / "f.json")])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "independent power laws" in out.stdout and "<- best" in out.stdout
    fits = json.loads((tmp_path / "fits.json").read_text())
    assert fits == json.loads((tmp_path / "f.json").read_text())
    for png in ("loss_vs_N.png", "residuals.png", "optimal_hparams.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pred = run_main(["predict", "--fits", str(tmp_path / "fits.json"), "--params", "2.56e8", "--replicas", "2",
                    "--json", str(tmp_path / "p.json")])
    assert pred.returncode == 0, pred.stderr
    p = json.loads((tmp_path / "p.json").read_text())
    assert f"{p['eval_loss']:.4f}" in pred.stdout and p["outer_lr"] == 0.4
    paper = run_main(["predict", "--params", "4e9", "--replicas", "2"])
    assert paper.returncode == 0 and "published Scaling Laws for DiLoCo fits" in paper.stdout, paper.stderr


@pytest.mark.parametrize("args, expected", [
    (["fit", "/nonexistent/results.csv"], "error: /nonexistent/results.csv: file not found"),
    (["predict", "--params", "-1", "--replicas", "2"], "error: --params = -1.0: must be a finite number of parameters > 0"),
    (["predict", "--params", "1e9", "--replicas", "-2"], "error: --replicas = -2: must be >= 0"),
    (["fit", "MISSING_COLUMN"], "missing column(s) H"),
    (["fit", "NEGATIVE_N"], "row 3: N = -5.0: must be a number of parameters > 0 (1 more row(s) like it)"),
    (["predict", "--params", "1e9", "--replicas", "1", "--fits", "FOREIGN_JSON"],
     "not fits written by ray-diloco fit (missing sizes, replicas, independent, joint, forms, best_form, outer_lr)"),
    (["predict", "--params", "1e9", "--replicas", "1", "--fits", "nothere.json"],
     "error: --fits nothere.json: not found (give a fits.json from ray-diloco fit, a sweep directory"),
    (["simulate", "--json", "DIR"], "is a directory (give a file path)"),
    (["plan", "--mfu", "0.5"], "error: --mfu: only used with --chips"),
    (["plan", "--chips", "1", "--tflops", "1e300"], "error: --tflops = 1e+300: must be in [0.001, 1e6] TFLOP/s per chip"),
    (["fit", "TABLE", "--out", "FILE"], "/f.json: not a directory (fits.json and the plots go into it)"),
])
def test_fit_and_predict_bad_input_is_one_line(tmp_path, args, expected):
    df, _ = _synthetic_sweep()
    if args[-1] == "MISSING_COLUMN":
        df.drop(columns=["H"]).to_csv(tmp_path / "t.csv", index=False)
        args = ["fit", str(tmp_path / "t.csv")]
    elif args[-1] == "NEGATIVE_N":
        df.loc[[1, 5], "num_parameters"] = -5.0
        df.to_csv(tmp_path / "t.csv", index=False)
        args = ["fit", str(tmp_path / "t.csv")]
    _synthetic_sweep()[0].to_csv(tmp_path / "table.csv", index=False)
    args = [str(tmp_path / "f.json") if x in ("FOREIGN_JSON", "FILE") else str(tmp_path) if x == "DIR"
            else str(tmp_path / "table.csv") if x == "TABLE" else x for x in args]
    (tmp_path / "f.json").write_text('{"model": "gpt", "loss": 1.0}')
    out = run_main(args)
    one_error_line(out, expected)
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("col, value, expected", [
    ("H", float("inf"), "row 5: H = inf: must be an integer >= 1"),
    ("H", 0, "row 5: H = 0: must be an integer >= 1"),
    ("H", 2.5, "row 5: H = 2.5: must be an integer >= 1"),
    ("outer_lr", -0.5, "row 5: outer_lr = -0.5: must be a finite lr > 0"),
    ("tokens", float("inf"), "row 5: tokens = inf: must be a finite number of tokens >= 0"),
])
def test_bad_h_outer_lr_or_tokens_in_a_table_are_refused(tmp_path, col, value, expected):
    """Found by a break-it pass: an infinite H crashed the outer-lr table with a traceback, and a
    negative or infinite outer lr could come out as the best one."""
    df, _ = _synthetic_sweep()
    df[col] = df[col].astype(object)
    df.loc[3, col] = value
    df.to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(DataError, match=re.escape(expected)):
        load_table(tmp_path / "t.csv")


def test_predict_flags_a_size_below_the_fitted_range():
    p = predict(paper_fits(), 1e6, 2)
    assert "below the smallest size fitted" in p["extrapolation"]
    assert "extrapolation" not in predict(paper_fits(), 1e9, 2)


def test_a_real_cpu_sweep_goes_through_fit_predict_and_plots(tmp_path):
    """The study's table (tests/fixtures/cpu_scaling_study.csv: the results.csv of
    `tune_spaces/cpu_scaling_study.yaml` and `..._stage2.yaml`, 3 sizes x {DP, M=1, 2, 4}) through
    fit (the command, its defaults) and predict; the laws and the forms' leave-one-size-out
    residuals are the ones docs/scaling-laws.md reports."""
    table = load_table(FIXTURE)
    assert table["N"].nunique() == 3 and set(table["M"]) == {0, 1, 2, 4}
    out = run_main(["fit", str(FIXTURE), "--out", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-2000:]
    fits = json.loads((tmp_path / "fits.json").read_text())
    doc = (ROOT / "docs" / "scaling-laws.md").read_text()
    study = doc[doc.index("## Our own study") :]
    for name, laws in fits["independent"].items():
        row = f"| {name} | {laws['loss']['A']:.4g} | {laws['loss']['alpha']:.4f} | {laws['loss']['r2']:.3f} | "
        row += f"{laws['inner_lr']['A']:.4g} | {laws['inner_lr']['alpha']:.4f} | {laws['inner_lr']['r2']:.3f} |"
        assert row in study, row
    for form, f in fits["forms"].items():
        row = f"| `{form}` | {f['residual']:.4f} | " + " | ".join(f"{v:.4f}" for v in f["residual_by_N"].values())
        assert row in study, row
    assert f"best by that residual: `{fits['best_form']}`" in study
    for name in ("DP", "M=1", "M=2", "M=4"):
        law = fits["independent"][name]["loss"]
        assert law["alpha"] < 0 and law["r2"] > 0.8, (name, law)  # bigger models reach lower loss
    assert all((tmp_path / p).is_file() for p in ("loss_vs_N.png", "residuals.png", "optimal_hparams.png"))
    n_big = 4 * max(table["N"])
    pred = run_main(["predict", "--fits", str(tmp_path / "fits.json"), "--params", str(n_big), "--replicas", "2"])
    assert pred.returncode == 0, pred.stderr
    best_seen = table[table["M"] == 2]["eval_loss"].min()
    assert "eval loss" in pred.stdout
    p = predict(fits, n_big, 2)
    assert 0 < p["eval_loss"] < best_seen  # a 4x bigger model is predicted to do better than anything swept


def test_fit_of_a_studys_stages_is_the_fit_of_their_rows_together(tmp_path):
    """`ray-diloco fit STAGE1 STAGE2` (the study's two sweeps) fits their rows as one table."""
    import pandas as pd

    df = pd.read_csv(FIXTURE)
    parts = []
    for stage, rows in df.groupby("stage"):
        parts.append(str(tmp_path / f"{stage}.csv"))
        rows.to_csv(parts[-1], index=False)
    assert len(parts) == 2
    fits = []
    for args in (parts, [str(FIXTURE)]):
        out = tmp_path / str(len(fits))
        assert run_main(["fit", *args, "--out", str(out), "--starts", "2", "--no-plots"]).returncode == 0
        fits.append(json.loads((out / "fits.json").read_text()))
    assert fits[0] == fits[1] and len(fits[0]["best_rows"]) == 12



def test_json_outputs_are_strict_and_predict_reads_them_back(tmp_path):
    """fit/predict/simulate --json and fits.json hold no bare NaN or Infinity (not JSON): an
    undefined number is null, and predict reads such a fits.json back to the same prediction."""
    from ray_diloco.cli.common import write_json as _write_json

    fits = paper_fits()
    fits["independent"]["DP"]["loss"]["r2"] = float("nan")  # an r2 that is undefined
    assert any(math.isnan(v) for v in (fits["independent"]["DP"]["inner_lr"]["r2"], fits["best_rows"][0]["inner_lr"]))
    _write_json(str(tmp_path / "fits.json"), fits)

    def no_constants(name):
        raise AssertionError(f"{name} in strict JSON")

    back = json.loads((tmp_path / "fits.json").read_text(), parse_constant=no_constants)
    assert back["independent"]["DP"]["loss"]["r2"] is None and back["best_rows"][0]["inner_lr"] is None
    for m in (0, 2):
        assert predict(back, 4e9, m)["eval_loss"] == predict(fits, 4e9, m)["eval_loss"]
    assert "r2 n/a" in format_prediction(predict(back, 4e9, 0))


def test_predict_warns_when_the_chosen_form_missed_a_held_out_size():
    """No warning with the paper's fits (worst held-out miss under 1% of the loss); a form that
    missed a held-out size by more than LOSO_WARN_FRACTION of that size's measured loss gets a
    warning line naming that size and the miss, at any queried N (relative to the prediction, it
    vanished when the form extrapolated worst); an undefined miss (NaN, null) hides no other."""
    from ray_diloco.analysis.laws import LOSO_WARN_FRACTION

    fits = paper_fits()
    assert "loss_warning" not in predict(fits, 4e9, 2)
    at_1_3b = [r["eval_loss"] for r in fits["best_rows"] if r["N"] == 1.3e9 and r["M"] >= 1]
    measured = sum(at_1_3b) / len(at_1_3b)
    miss = measured * LOSO_WARN_FRACTION * 1.5
    by_n = fits["forms"][fits["best_form"]]["residual_by_N"]
    by_n["1300000000.0"], by_n["35000000.0"] = miss, float("nan")
    for n in (4e9, 1e12):
        p = predict(fits, n, 2)
        assert p["loss_warning"] == (f"fitted without N = 1.3e+09, this form missed its loss ({measured:.4g}) by "
                                     f"{miss:.4g} (4.5%): the loss is a rough estimate")
        assert f"  warning: {p['loss_warning']}" in format_prediction(p).splitlines()
    by_n["1300000000.0"] = miss / 2
    assert "loss_warning" not in predict(fits, 4e9, 2)


def test_predict_reads_null_misses_and_refuses_hand_edited_fits_in_one_line(tmp_path):
    """A fits.json that fit wrote with an overflowed (null) residual is read, shown as n/a; a
    hand-edited one with a value of the wrong type or shape is one error line, exit 2."""
    from ray_diloco.cli.common import write_json as _write_json

    def run(fits):
        _write_json(str(tmp_path / "fits.json"), fits)
        out = run_main(["predict", "--fits", str(tmp_path / "fits.json"), "--params", "4e9", "--replicas", "2"])
        return out.returncode, SimpleNamespace(out=out.stdout, err=out.stderr)

    fits = paper_fits()
    fits["forms"][fits["best_form"]]["residual"] = float("inf")
    rc, out = run(fits)
    assert rc == 0 and "leave-one-size-out residual n/a" in out.out  # inf is written as null
    for edit in ({"theta": None}, {"theta": [1.0]}, {"residual_by_N": ["x"]}):
        bad = paper_fits()
        bad["forms"][bad["best_form"]].update(edit)
        rc, out = run(bad)
        assert rc == 2 and len(out.err.strip().splitlines()) == 1 and "Traceback" not in out.err, (edit, out.err)
        assert out.err.startswith(f"error: --fits {tmp_path / 'fits.json'}: not fits written by ray-diloco fit")


def test_a_power_law_beyond_floats_is_one_error():
    """Losses spanning hundreds of orders of magnitude: the fitted A overflows a float."""
    with pytest.raises(DataError, match=r"beyond a float: the values span too many orders of magnitude"):
        fit_power_law([1e6, 2e6], [1e100, 1.0], "eval_loss")


def test_fit_and_predict_of_a_table_use_the_same_number_of_starts(tmp_path, monkeypatch):
    """`ray-diloco fit TABLE` and `predict --fits TABLE` fit with the same default number of random
    starts (they chose different forms on the same table when they differed: 32 against 64): both
    commands run on one table, each says how many starts it used, and they pick the same form. The
    default is made 3 for the run (32 starts take half a minute here): a command that does not take
    its starts from the one default shows another count."""
    import inspect

    from ray_diloco.analysis import laws
    from ray_diloco.cli import _parser

    DEFAULT_STARTS = laws.DEFAULT_STARTS

    assert _parser().parse_args(["fit", "t.csv"]).starts is None  # None: DEFAULT_STARTS in _cmd_fit
    assert inspect.signature(fit_all).parameters["starts"].default == DEFAULT_STARTS == 32
    fit_help = next(a for a in _parser()._subparsers._group_actions[0].choices["fit"]._actions if a.dest == "starts").help
    assert f"default {DEFAULT_STARTS}" in fit_help
    monkeypatch.setattr(laws, "DEFAULT_STARTS", 3)
    monkeypatch.setattr(laws.fit_all, "__defaults__", (3,))
    DEFAULT_STARTS = 3
    df, _ = _synthetic_sweep()
    table = tmp_path / "table.csv"
    df[df["num_parameters"] < 20e6].to_csv(table, index=False)  # 3 sizes: the forms are fitted
    fit = run_main(["fit", str(table), "--out", str(tmp_path / "fit")])
    pred = run_main(["predict", "--fits", str(table), "--params", "1e9", "--replicas", "2"])
    assert fit.returncode == 0 and pred.returncode == 0, fit.stderr + pred.stderr
    said = f"({DEFAULT_STARTS} starts per fit)"
    assert said in fit.stderr and said in pred.stderr, (fit.stderr, pred.stderr)
    best = json.loads((tmp_path / "fit" / "fits.json").read_text())["best_form"]
    assert best and f"form {best}" in pred.stdout, (best, pred.stdout)


def test_paper_fits_are_a_new_copy_each_call():
    """A caller that edits the published fits (as the hand-edited-fits test does) does not change
    what the next `predict --fits paper` reads (the cached dict was shared, found when the CLI
    tests moved in process)."""
    fits = paper_fits()
    fits["forms"][fits["best_form"]]["theta"] = [1.0]
    again = paper_fits()
    assert len(again["forms"][again["best_form"]]["theta"]) == 4
    assert predict(again, 4e9, 2)["eval_loss"] > 0
