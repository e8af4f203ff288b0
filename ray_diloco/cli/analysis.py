"""``ray-diloco plan``, ``fit``, ``predict`` and ``simulate``: a run's fragment plan, scaling-law
fits and predictions (``analysis.laws``), the bandwidth simulator (``analysis.simulate``)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from ray_diloco.cli.common import add_config_args, check_output, write_json
from ray_diloco.errors import RayDilocoError
from ray_diloco.log import error_line


def add_plan_command(sub: Any) -> None:
    pl = sub.add_parser("plan", help="fragments, sync steps and bytes per replica of a run, from its config")
    pl.add_argument(
        "config_file",
        nargs="?",
        default=None,
        metavar="CONFIG",
        help="YAML file or preset name (default: the built-in defaults)",
    )
    add_config_args(pl)
    pl.add_argument("--from-step", type=int, default=0, help="list the syncs after this inner step (default 0)")
    pl.add_argument("--next", type=int, default=3, dest="upcoming", help="sync steps listed per fragment (default 3)")
    pl.add_argument("--json", default=None, metavar="PATH", help="also write the plan as JSON")
    pl.add_argument(
        "--chips",
        type=int,
        default=None,
        help="accelerators per replica: adds the predicted wall-clock (simulator of ray-diloco simulate)",
    )
    pl.add_argument("--tflops", type=float, default=None, help="peak TFLOP/s per chip (default 300)")
    pl.add_argument("--mfu", type=float, default=None, help="model FLOPs utilisation (default 0.6)")
    pl.add_argument(
        "--bandwidth-gbps",
        type=float,
        default=None,
        help="link between replicas (default: network.bandwidth_gbps, else the bandwidth per target)",
    )
    pl.add_argument("--latency-ms", type=float, default=None, help="latency per message (default: network.latency_ms)")


def add_law_commands(sub: Any) -> None:
    """fit, predict."""
    fi = sub.add_parser(
        "fit", help="scaling laws from a sweep: power laws, joint forms, optimal lr/batch/outer lr, plots"
    )
    fi.add_argument(
        "table",
        nargs="+",
        metavar="SWEEP_DIR|TABLE",
        help="sweep directories (results.parquet/csv) or .csv/.parquet tables; several are fitted as one "
        "(a study's main grid and its outer-lr sweep)",
    )
    fi.add_argument(
        "--out", default=None, metavar="DIR", help="where fits.json and the plots go (default: next to the first table)"
    )
    fi.add_argument("--json", default=None, metavar="PATH", help="also write the fits as JSON here")
    fi.add_argument(
        "--starts",
        type=int,
        default=None,
        help="random starts of each parametric-form fit (default 32, as predict uses when it fits a table)",
    )
    fi.add_argument("--no-plots", action="store_true", help="skip the PNG plots")

    pr = sub.add_parser("predict", help="predicted loss, inner lr, global batch and outer lr of a bigger model")
    pr.add_argument("--params", type=float, required=True, help="parameters N of the model, e.g. 4e9")
    pr.add_argument("--replicas", type=int, required=True, help="M (0: data-parallel)")
    pr.add_argument("--H", type=int, default=None, help="sync interval, for the outer lr (default: the largest fitted)")
    pr.add_argument(
        "--fits",
        default="paper",
        metavar="FITS|SWEEP_DIR|TABLE",
        help="fits.json from ray-diloco fit, a sweep directory or a table (fitted now), or 'paper' "
        "(the published Scaling Laws for DiLoCo fits; default)",
    )
    pr.add_argument("--json", default=None, metavar="PATH", help="also write the prediction as JSON")


def add_simulate_command(sub: Any) -> None:
    si = sub.add_parser("simulate", help="compute utilisation vs bandwidth of DP, DiLoCo and Streaming DiLoCo")
    si.add_argument(
        "--paper-table",
        action="store_true",
        help="the papers' configurations (1B/10B/100B, five methods) beside the published bandwidths",
    )
    si.add_argument("--params", type=float, default=1e9, help="parameters N (default 1e9)")
    si.add_argument("--layers", type=int, default=24, help="transformer blocks (default 24)")
    si.add_argument(
        "--step-s",
        type=float,
        default=None,
        help="seconds of compute per step (default: from 6 N x tokens FLOPs, --chips, --tflops, --mfu)",
    )
    si.add_argument("--tokens-per-step", type=float, default=2**20, help="global batch in tokens (default 2^20)")
    si.add_argument("--chips", type=int, default=64, help="accelerators per replica (default 64)")
    si.add_argument("--tflops", type=float, default=300.0, help="peak TFLOP/s per chip (default 300)")
    si.add_argument("--mfu", type=float, default=0.6, help="model FLOPs utilisation (default 0.6)")
    si.add_argument("--H", type=int, default=100, help="inner steps between syncs of a fragment (default 100)")
    si.add_argument("--tau", type=int, default=1, help="overlap in inner steps for the +overlap methods (default 1)")
    si.add_argument("--layers-per-fragment", type=int, default=3, help="blocks per fragment (default 3)")
    si.add_argument("--latency-ms", type=float, default=0.0, help="latency per message (default 0)")
    si.add_argument(
        "--bits",
        type=float,
        default=None,
        help="bits per value on the wire (default 16, bf16 as in the papers; FP4 methods: 4)",
    )
    si.add_argument(
        "--target",
        type=float,
        action="append",
        default=None,
        help="compute utilisation to reach, repeatable (default 0.5 0.8 0.9 0.95 0.99)",
    )
    si.add_argument("--plot", default=None, metavar="PNG", help="also plot utilisation vs bandwidth")
    si.add_argument("--json", default=None, metavar="PATH", help="also write the table as JSON")


def cmd_plan(a: argparse.Namespace) -> int:
    from ray_diloco.analysis.plan import format_plan, sync_plan
    from ray_diloco.config import load_config

    if a.config_file is not None and a.config is not None:
        raise RayDilocoError(f"plan: give the config once (CONFIG {a.config_file!r} or --config {a.config!r})")
    from ray_diloco.errors import UsageError

    bad = [f"{flag} = {v}: must be >= 0" for flag, v in (("--from-step", a.from_step), ("--next", a.upcoming)) if v < 0]
    sim = {"--tflops": a.tflops, "--mfu": a.mfu, "--bandwidth-gbps": a.bandwidth_gbps, "--latency-ms": a.latency_ms}
    if a.chips is None:
        bad += [
            f"{flag}: only used with --chips (the simulated wall-clock)" for flag, v in sim.items() if v is not None
        ]
    else:
        if a.chips < 1:
            bad.append(f"--chips = {a.chips}: must be an integer >= 1 (accelerators per replica)")
        bad += _chip_problems(a.tflops, a.mfu)
        if a.bandwidth_gbps is not None and not (math.isfinite(a.bandwidth_gbps) and 1e-6 <= a.bandwidth_gbps <= 1e6):
            bad.append(f"--bandwidth-gbps = {a.bandwidth_gbps}: must be in [1e-6, 1e6] Gbit/s")
        if a.latency_ms is not None and not (math.isfinite(a.latency_ms) and 0 <= a.latency_ms <= 60_000):
            bad.append(f"--latency-ms = {a.latency_ms}: must be in [0, 60000] milliseconds")
    if bad:
        raise UsageError(bad)
    check_output("--json", a.json)
    cfg = load_config(a.config_file or a.config, a.overrides)
    p = sync_plan(cfg, a.from_step, a.upcoming)
    print(format_plan(p))
    if a.chips is not None:
        from ray_diloco.analysis.plan import format_wall_clock, wall_clock_plan

        p["wall_clock"] = wall_clock_plan(
            cfg, p, a.chips, a.tflops or 300.0, a.mfu or 0.6, a.bandwidth_gbps, a.latency_ms
        )
        print()
        print(format_wall_clock(p["wall_clock"]))
    if a.json:
        write_json(a.json, p)
    return 0


def cmd_fit(a: argparse.Namespace) -> int:
    from pathlib import Path

    from ray_diloco.analysis.laws import DEFAULT_STARTS, fit_all, format_fits, load_table

    if a.starts is None:
        a.starts = DEFAULT_STARTS
    if a.starts < 1:
        raise RayDilocoError(f"--starts = {a.starts}: must be >= 1")
    check_output("--json", a.json)
    if a.out is not None and Path(a.out).expanduser().exists() and not Path(a.out).expanduser().is_dir():
        raise RayDilocoError(f"--out {a.out}: not a directory (fits.json and the plots go into it)")
    import pandas as pd

    tables = [load_table(t) for t in a.table]
    df = tables[0] if len(tables) == 1 else pd.concat(tables, ignore_index=True)
    fits = fit_all(df, starts=a.starts)
    print(format_fits(fits))
    src = Path(a.table[0]).expanduser()
    out = Path(a.out).expanduser() if a.out else (src if src.is_dir() else src.parent)
    write_json(str(out / "fits.json"), fits)
    print(f"\nfits: {out / 'fits.json'} (ray-diloco predict --fits {out / 'fits.json'} --params N --replicas M)")
    if a.json:
        write_json(a.json, fits)
    if not a.no_plots:
        from ray_diloco.analysis.plots import plot_fits

        for p in plot_fits(fits, out):
            print(f"plot: {p}")
    return 0


def cmd_predict(a: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from ray_diloco.analysis.laws import fit_all, format_prediction, load_table, predict
    from ray_diloco.analysis.paper import paper_fits

    if not (math.isfinite(a.params) and a.params > 0):
        raise RayDilocoError(f"--params = {a.params}: must be a finite number of parameters > 0")
    if a.replicas < 0:
        raise RayDilocoError(f"--replicas = {a.replicas}: must be >= 0 (0: data-parallel)")
    if a.H is not None and a.H < 1:
        raise RayDilocoError(f"--H = {a.H}: must be >= 1")
    check_output("--json", a.json)
    src = Path(a.fits).expanduser()
    if src.is_dir() and (src / "fits.json").is_file():  # a sweep (or --out) directory that fit wrote into
        src = src / "fits.json"
    if a.fits == "paper":
        fits, origin = paper_fits(), "the published Scaling Laws for DiLoCo fits"
    elif src.is_file() and src.suffix == ".json":
        try:
            fits = json.loads(src.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise RayDilocoError(f"--fits {a.fits}: not valid JSON ({error_line(e, typed=False, limit=100)})") from None
        origin = str(src)
    elif src.exists():
        fits, origin = fit_all(load_table(a.fits)), f"fits of {a.fits}"
    else:
        raise RayDilocoError(
            f"--fits {a.fits}: not found (give a fits.json from ray-diloco fit, a sweep directory, "
            "a .csv/.parquet table, or paper)"
        )
    try:
        p = predict(fits, a.params, a.replicas, a.H)
        p["fits"] = origin
        text = format_prediction(p)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        if a.fits == "paper" or src.suffix != ".json":
            raise
        raise RayDilocoError(
            f"--fits {a.fits}: not fits written by ray-diloco fit (a value of the wrong type or "
            f"shape: {error_line(e, limit=100)})"
        ) from None
    print(text)
    print(f"  (from {origin})")
    if a.json:
        write_json(a.json, p)
    return 0


def _chip_problems(tflops: float | None, mfu: float | None) -> list[str]:
    """One line per invalid ``--tflops`` / ``--mfu`` (None: not given), for plan and simulate."""
    bad = []
    if tflops is not None and not (math.isfinite(tflops) and 1e-3 <= tflops <= 1e6):
        bad.append(f"--tflops = {tflops}: must be in [0.001, 1e6] TFLOP/s per chip")
    if mfu is not None and not 0 < mfu <= 1:
        bad.append(f"--mfu = {mfu}: must be in (0, 1]")
    return bad


#: Largest ``--layers`` the simulator takes: its run time grows with the layers.
MAX_LAYERS = 10_000


def _simulate_problems(a: argparse.Namespace) -> list[str]:
    """One line per invalid ``simulate`` option."""
    bad = []
    for t in a.target or []:
        if not 0 < t < 1:
            bad.append(f"--target = {t}: must be a utilisation in (0, 1), for example 0.95")
    for name, v in (("--params", a.params), ("--tokens-per-step", a.tokens_per_step)):
        if not (math.isfinite(v) and v > 0):
            bad.append(f"{name} = {v}: must be a finite number > 0")
    if a.step_s is not None and not (math.isfinite(a.step_s) and a.step_s > 0):
        bad.append(f"--step-s = {a.step_s}: must be a finite number of seconds > 0")
    bad += _chip_problems(a.tflops, a.mfu)
    for name, v, low in (
        ("--layers", a.layers, 1),
        ("--chips", a.chips, 1),
        ("--H", a.H, 1),
        ("--tau", a.tau, 0),
        ("--layers-per-fragment", a.layers_per_fragment, 1),
    ):
        if v < low:
            bad.append(f"{name} = {v}: must be an integer >= {low}")
    if a.layers > MAX_LAYERS:
        bad.append(
            f"--layers = {a.layers}: must be at most {MAX_LAYERS:,} (the simulator walks every layer's "
            "backward; the largest published models have about 100-200)"
        )
    if not (math.isfinite(a.latency_ms) and a.latency_ms >= 0):
        bad.append(f"--latency-ms = {a.latency_ms}: must be a finite number >= 0")
    if a.bits is not None and not (math.isfinite(a.bits) and 0 < a.bits <= 64):
        bad.append(f"--bits = {a.bits}: must be in (0, 64]")
    return bad


def cmd_simulate(a: argparse.Namespace) -> int:
    from ray_diloco.analysis.simulate import (
        METHODS,
        TARGETS,
        Method,
        ModelSpec,
        bandwidth_table,
        format_bandwidth_table,
        paper_rows,
        step_time_s,
    )
    from ray_diloco.errors import UsageError

    problems = _simulate_problems(a)
    if a.paper_table and a.plot:
        problems.append("--plot: not drawn with --paper-table (it plots one model's utilisation; drop --paper-table)")
    if problems:
        raise UsageError(problems)
    check_output("--json", a.json)
    check_output("--plot", a.plot)
    targets = tuple(a.target or TARGETS)
    if a.paper_table:
        rows = paper_rows()
        print("Gbit/s needed per compute-utilisation target: ours (the paper's)")
        for table, title in (
            ("streaming-4", "Streaming DiLoCo Table 4 (H=100)"),
            ("scaling-6", "Scaling Laws for DiLoCo Table 6 (10B, 0.8 s/step)"),
        ):
            part = [r for r in rows if r["table"] == table]
            off = [abs(r["steps_off"]) for r in part if r["steps_off"] is not None]
            print(
                f"\n{title}: {sum(o == 0 for o in off)}/{len(part)} cells exact, "
                f"{sum(o <= 1 for o in off)}/{len(part)} within one grid step, worst {max(off)} steps"
            )
            print(format_bandwidth_table(part, with_paper=True))
        if a.json:
            write_json(a.json, [{"model": r["model"], "method": r["method"], "H": r["H"], "target": r["target"],
                                  "gbps": r["gbps"], "paper_gbps": r["paper_gbps"], "table": r["table"]} for r in rows])  # fmt: skip
        return 0
    step = a.step_s if a.step_s is not None else step_time_s(a.params, a.tokens_per_step, a.chips, a.tflops, a.mfu)
    model = ModelSpec(f"{a.params:.3g}", a.params, a.layers, step)
    methods = [
        Method(
            k,
            H=a.H,
            tau=a.tau,
            layers_per_fragment=a.layers_per_fragment,
            bits=None if a.bits is None or k.endswith("_fp4") else a.bits,
        )
        for k in METHODS
    ]
    rows = bandwidth_table(model, methods, targets, a.latency_ms / 1000)
    src = (
        "(--step-s)"
        if a.step_s is not None
        else f"(6 N x {a.tokens_per_step:.4g} tokens on {a.chips} chips at {a.tflops:g} TFLOP/s x {a.mfu:g} MFU)"
    )
    print(
        f"N = {a.params:.4g} parameters, {a.layers} layers, {step:.4g} s of compute per step {src}; H = {a.H}, "
        f"tau = {a.tau}, {a.layers_per_fragment} layers per fragment, {a.bits or 16:g} bits per value "
        f"(FP4: 4), latency {a.latency_ms:g} ms"
    )
    print("Gbit/s needed per compute-utilisation target ('-': not reached at 1000 Gbit/s)")
    print(format_bandwidth_table(rows))
    if a.json:
        write_json(
            a.json,
            [
                {**r, "params": a.params, "layers": a.layers, "step_s": step, "latency_s": a.latency_ms / 1000}
                for r in rows
            ],
        )
    if a.plot:
        from ray_diloco.analysis.plots import plot_utilisation

        print(f"plot: {plot_utilisation(model, methods, a.plot, a.latency_ms / 1000)}")
    return 0
