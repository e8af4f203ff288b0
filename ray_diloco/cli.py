"""The ``ray-diloco`` command: train, tune, eval, generate, config, plan, scale, fit, predict, simulate.

Errors in input, data, checkpoints or cluster size print one line each (``error: ...``) and
exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from ray_diloco.errors import RayDilocoError
from ray_diloco.log import error_line


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        "-c",
        default=None,
        help="YAML file or preset name (ray_diloco/configs/NAME.yaml); default: the built-in defaults",
    )
    p.add_argument(
        "--set",
        "-s",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, repeatable: --set inner.lr=3e-4 --set diloco.replicas=4",
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ray-diloco", description="DiLoCo training of language models on Ray.")
    sub = ap.add_subparsers(dest="command", required=True)
    for add in (
        _add_run_commands,
        _add_prepare_command,
        _add_plan_command,
        _add_law_commands,
        _add_simulate_command,
        _add_tune_commands,
    ):
        add(sub)
    for command in sub.choices.values():  # every command: how much it says
        says = command.add_mutually_exclusive_group()
        says.add_argument("-v", "--verbose", action="store_true", help="also print debug messages")
        says.add_argument("-q", "--quiet", action="store_true", help="print only warnings, errors and results")
    return ap


def _add_run_commands(sub: Any) -> None:
    """train, eval, generate, config."""
    t = sub.add_parser("train", help="train with DiLoCo (or the DP baseline) and export the global model")
    _add_config_args(t)
    t.add_argument("--resume", metavar="RUN_DIR", default=None, help="continue a run from its newest checkpoint")
    t.add_argument(
        "--address",
        default=None,
        help="Ray cluster address ('auto' joins a running cluster); default: start a local one",
    )

    e = sub.add_parser("eval", help="validation loss of a run's newest checkpoint (global parameters)")
    e.add_argument("run_dir", help="a run directory (with checkpoints/)")
    e.add_argument("--step", type=int, default=None, help="outer step of the checkpoint (default: newest)")
    e.add_argument(
        "--address",
        default=None,
        help="evaluate on this Ray cluster ('auto', HOST:PORT), in tasks with the run's worker "
        "resources (its GPUs); default: in this process (first GPU, else CPU)",
    )
    e.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tasks on the cluster (default: the run's replicas x workers per replica); "
        "without --address: on RAY_ADDRESS's cluster or a local one",
    )

    g = sub.add_parser("generate", help="sample text from a run's exported model")
    g.add_argument("run_dir")
    g.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample (default 200)")
    g.add_argument("--temperature", type=float, default=0.8, help="softmax temperature > 0 (default 0.8)")
    g.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0: all (default 50)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")

    c = sub.add_parser("config", help="print the resolved config as YAML (after --config and --set)")
    _add_config_args(c)


def _add_prepare_command(sub: Any) -> None:
    p = sub.add_parser("prepare", help="tokenise a corpus once, on Ray Data, into a token store (data.prepared)")
    p.add_argument(
        "sources",
        nargs="*",
        metavar="SOURCE",
        help="files, directories or globs, local or s3:// / gs://: .txt/.md/.text, .jsonl/.json, .parquet or .csv",
    )
    p.add_argument("--out", required=True, metavar="DIR_OR_URI", help="the store's directory or URI")
    p.add_argument(
        "--dataset",
        default=None,
        metavar="NAME",
        help="instead of SOURCE: a Hugging Face dataset (hub name or local dataset directory), streamed",
    )
    p.add_argument("--dataset-config", default=None, metavar="C", help="configuration of --dataset")
    p.add_argument("--split", default="train", metavar="S", help="split of --dataset (default train)")
    p.add_argument(
        "--tokenizer",
        default="bpe",
        metavar="char|bpe|NAME_OR_PATH",
        help="char, bpe (byte-level BPE trained on a 32 MB sample), or a Hugging Face tokenizer name, "
        "directory or tokenizer.json (default bpe)",
    )
    p.add_argument("--bpe-vocab-size", type=int, default=4096, help="vocabulary of the trained BPE (default 4096)")
    p.add_argument("--text-field", default="text", help="column holding the text (JSONL, Parquet, --dataset)")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        help="share held out for validation (default 0.01): of the documents, by hash of their text, or "
        "of the tokens, with --val-split tail",
    )
    p.add_argument(
        "--val-split",
        choices=("hash", "tail"),
        default="hash",
        help="hash: a document goes to validation by the crc32 of its text (default); tail: the last "
        "--val-fraction of the token stream, data.path's rule",
    )
    p.add_argument("--shard-tokens", type=int, default=1 << 25, help="tokens per shard (default 33554432)")
    p.add_argument("--actors", type=int, default=None, help="tokenizer actors (default: one per CPU)")
    p.add_argument("--address", default=None, help="Ray cluster address; default: start a local one")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _cmd_prepare(a: argparse.Namespace) -> int:
    from ray_diloco.components.prepare import PrepareOptions, prepare_store

    prepare_store(
        PrepareOptions(
            sources=a.sources,
            out=a.out,
            dataset=a.dataset,
            dataset_config=a.dataset_config,
            split=a.split,
            tokenizer=a.tokenizer,
            bpe_vocab_size=a.bpe_vocab_size,
            text_field=a.text_field,
            val_fraction=a.val_fraction,
            val_split=a.val_split,
            shard_tokens=a.shard_tokens,
            actors=a.actors,
            progress=not a.no_progress,
        ),
        address=a.address,
    )
    print(f"store: {a.out} (train with --set data.prepared={a.out})")
    return 0


def _add_plan_command(sub: Any) -> None:
    pl = sub.add_parser("plan", help="fragments, sync steps and bytes per replica of a run, from its config")
    pl.add_argument(
        "config_file",
        nargs="?",
        default=None,
        metavar="CONFIG",
        help="YAML file or preset name (default: the built-in defaults)",
    )
    _add_config_args(pl)
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


def _add_law_commands(sub: Any) -> None:
    """fit, predict."""
    fi = sub.add_parser(
        "fit", help="scaling laws from a sweep: power laws, joint forms, optimal lr/batch/outer lr, plots"
    )
    fi.add_argument(
        "table", metavar="SWEEP_DIR|TABLE", help="a sweep directory (results.parquet/csv) or a .csv/.parquet"
    )
    fi.add_argument(
        "--out", default=None, metavar="DIR", help="where fits.json and the plots go (default: next to the table)"
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


def _add_simulate_command(sub: Any) -> None:
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


def _add_tune_commands(sub: Any) -> None:
    """tune, scale."""
    tu = sub.add_parser("tune", help="a Ray Tune sweep: every trial is a full run with its own replicas")
    tu.add_argument(
        "--space", default=None, metavar="FILE", help="search-space YAML (tune_spaces/*.yaml; format in docs/sweeps.md)"
    )
    tu.add_argument(
        "--set",
        "-s",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fixed config override for every trial, repeatable",
    )
    tu.add_argument(
        "--resume",
        metavar="SWEEP_DIR",
        default=None,
        help="continue an interrupted sweep (Tuner.restore); its trials resume from their checkpoints",
    )
    tu.add_argument("--name", default=None, help="sweep name (its directory); default: SPACE-TIMESTAMP")
    tu.add_argument(
        "--storage-path",
        default=None,
        help="where sweep directories go: a local path or s3://, gs://, file:// (default: run.output_dir/sweeps)",
    )
    tu.add_argument(
        "--scheduler", choices=("fifo", "asha"), default=None, help="early stopping (default: the space's, else fifo)"
    )
    tu.add_argument(
        "--search",
        choices=("basic", "optuna"),
        default=None,
        help="grid/random (basic) or Optuna (needs optuna installed)",
    )
    tu.add_argument("--num-samples", type=int, default=None, help="samples per grid point (Optuna: trials)")
    tu.add_argument("--max-concurrent", type=int, default=None, help="trials at once (default: what the cluster holds)")
    tu.add_argument("--address", default=None, help="Ray cluster address ('auto' joins a running cluster)")

    sc = sub.add_parser("scale", help="change the number of replicas of a running DiLoCo run")
    sc.add_argument("run_dir", metavar="RUN_DIR")
    sc.add_argument(
        "--replicas",
        type=int,
        required=True,
        help="replicas from the next outer step on: more start when the cluster has room, extra ones leave",
    )


def _cmd_train(a: argparse.Namespace) -> int:
    from ray_diloco.runtime.launcher import train

    train(a.config, a.overrides, resume=a.resume, address=a.address)
    return 0


def _cmd_eval(a: argparse.Namespace) -> int:
    if a.workers is not None and a.workers < 1:
        raise RayDilocoError(f"--workers = {a.workers}: must be >= 1")
    if a.address is not None or a.workers is not None:  # on a Ray cluster, the run's worker resources
        from ray_diloco.runtime.evaluation import evaluate_run_on_cluster

        loss, step, path = evaluate_run_on_cluster(a.run_dir, a.step, address=a.address, workers=a.workers)
    else:
        from ray_diloco.components.evaluate import evaluate_run

        loss, step, path = evaluate_run(a.run_dir, a.step)
    print(f"checkpoint: {path}")
    print(f"outer step {step}: validation loss {loss:.4f}")
    return 0


def _cmd_generate(a: argparse.Namespace) -> int:
    from ray_diloco.components.evaluate import generate

    if a.max_new_tokens < 1:
        raise RayDilocoError(f"--max-new-tokens = {a.max_new_tokens}: must be >= 1")
    if not (a.temperature > 0 and math.isfinite(a.temperature)):
        raise RayDilocoError(f"--temperature = {a.temperature}: must be a finite number > 0")
    if a.top_k < 0:
        raise RayDilocoError(f"--top-k = {a.top_k}: must be >= 0 (0: no top-k filter)")
    if not 0 <= a.seed < 2**63:
        raise RayDilocoError(f"--seed = {a.seed}: must be an integer in [0, 2^63)")
    print(generate(a.run_dir, a.prompt, a.max_new_tokens, a.temperature, a.top_k, a.seed))
    return 0


def _cmd_config(a: argparse.Namespace) -> int:
    from ray_diloco.config import load_config

    print(load_config(a.config, a.overrides).to_yaml(), end="")
    return 0


def _cmd_plan(a: argparse.Namespace) -> int:
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
    _check_output("--json", a.json)
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
        _write_json(a.json, p)
    return 0


def _check_output(flag: str, path: str | None) -> None:
    """Refuse an output path that cannot be written, before any work is done."""
    if path is None:
        return
    from pathlib import Path

    p = Path(path).expanduser()
    parent = next((q for q in [p.parent, *p.parent.parents] if q.exists()), None)
    if p.is_dir():
        raise RayDilocoError(f"{flag} {path}: is a directory (give a file path)")
    if parent is not None and (not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK)):
        raise RayDilocoError(f"{flag} {path}: {parent} is not a writable directory")


def _strict(obj: object) -> object:
    """``obj`` with every non-finite number (NaN, inf) as None, so JSON readers get null."""
    import numbers

    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    if isinstance(obj, numbers.Real) and not isinstance(obj, (bool, numbers.Integral)) and not math.isfinite(obj):
        return None
    return obj


def _write_json(path: str, obj: object) -> None:
    """Write ``obj`` as strict JSON (non-finite numbers as null, numpy scalars as numbers)."""
    import json

    from ray_diloco.components.storage import write_text

    write_text(path, json.dumps(_strict(obj), indent=2, default=float, allow_nan=False) + "\n")


def _cmd_fit(a: argparse.Namespace) -> int:
    from pathlib import Path

    from ray_diloco.analysis.laws import DEFAULT_STARTS, fit_all, format_fits, load_table

    if a.starts is None:
        a.starts = DEFAULT_STARTS
    if a.starts < 1:
        raise RayDilocoError(f"--starts = {a.starts}: must be >= 1")
    _check_output("--json", a.json)
    if a.out is not None and Path(a.out).expanduser().exists() and not Path(a.out).expanduser().is_dir():
        raise RayDilocoError(f"--out {a.out}: not a directory (fits.json and the plots go into it)")
    df = load_table(a.table)
    fits = fit_all(df, starts=a.starts)
    print(format_fits(fits))
    src = Path(a.table).expanduser()
    out = Path(a.out).expanduser() if a.out else (src if src.is_dir() else src.parent)
    _write_json(str(out / "fits.json"), fits)
    print(f"\nfits: {out / 'fits.json'} (ray-diloco predict --fits {out / 'fits.json'} --params N --replicas M)")
    if a.json:
        _write_json(a.json, fits)
    if not a.no_plots:
        from ray_diloco.analysis.plots import plot_fits

        for p in plot_fits(fits, out):
            print(f"plot: {p}")
    return 0


def _cmd_predict(a: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from ray_diloco.analysis.laws import fit_all, format_prediction, load_table, paper_fits, predict

    if not (math.isfinite(a.params) and a.params > 0):
        raise RayDilocoError(f"--params = {a.params}: must be a finite number of parameters > 0")
    if a.replicas < 0:
        raise RayDilocoError(f"--replicas = {a.replicas}: must be >= 0 (0: data-parallel)")
    if a.H is not None and a.H < 1:
        raise RayDilocoError(f"--H = {a.H}: must be >= 1")
    _check_output("--json", a.json)
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
        _write_json(a.json, p)
    return 0


def _chip_problems(tflops: float | None, mfu: float | None) -> list[str]:
    """One line per invalid ``--tflops`` / ``--mfu`` (None: not given), for plan and simulate."""
    bad = []
    if tflops is not None and not (math.isfinite(tflops) and 1e-3 <= tflops <= 1e6):
        bad.append(f"--tflops = {tflops}: must be in [0.001, 1e6] TFLOP/s per chip")
    if mfu is not None and not 0 < mfu <= 1:
        bad.append(f"--mfu = {mfu}: must be in (0, 1]")
    return bad


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
    if not (math.isfinite(a.latency_ms) and a.latency_ms >= 0):
        bad.append(f"--latency-ms = {a.latency_ms}: must be a finite number >= 0")
    if a.bits is not None and not (math.isfinite(a.bits) and 0 < a.bits <= 64):
        bad.append(f"--bits = {a.bits}: must be in (0, 64]")
    return bad


def _cmd_simulate(a: argparse.Namespace) -> int:
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
    _check_output("--json", a.json)
    _check_output("--plot", a.plot)
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
            _write_json(a.json, [{"model": r["model"], "method": r["method"], "H": r["H"], "target": r["target"],
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
        _write_json(
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


def _cmd_tune(a: argparse.Namespace) -> int:
    from ray_diloco.tune.sweep import tune

    if a.resume is not None and a.overrides:
        raise RayDilocoError(
            f"--set {a.overrides[0]}: cannot be combined with --resume (the sweep's saved space is used)"
        )
    for flag, v in (("--num-samples", a.num_samples), ("--max-concurrent", a.max_concurrent)):
        if v is not None and v < 1:
            raise RayDilocoError(f"{flag} = {v}: must be >= 1")
    out = tune(
        a.space,
        a.overrides,
        resume=a.resume,
        name=a.name,
        storage_path=a.storage_path,
        scheduler=a.scheduler,
        search=a.search,
        num_samples=a.num_samples,
        max_concurrent=a.max_concurrent,
        address=a.address,
    )
    if out["interrupted"]:
        print(f"sweep interrupted: continue it with ray-diloco tune --resume {out['sweep_dir']}", file=sys.stderr)
        return 130
    return 0 if out["best"] is not None else 1  # 1: no trial produced a finite loss


def _cmd_scale(a: argparse.Namespace) -> int:
    from ray_diloco.runtime.membership import request_scale

    path = request_scale(a.run_dir, a.replicas)
    print(f"asked for {a.replicas} replica(s) from the next outer step ({path})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ray-diloco`` console script; returns the exit status."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    a = _parser().parse_args(argv)
    import signal

    from ray_diloco.log import setup

    setup(1 if a.verbose else -1 if a.quiet else 0)

    from ray_diloco.components import address

    address.GRACEFUL_SIGTERM = True  # SIGTERM (ray job stop, kill) cleans up like Ctrl-C
    signal.signal(signal.SIGTERM, address.raise_keyboard_interrupt)
    handlers = {
        "train": _cmd_train,
        "eval": _cmd_eval,
        "generate": _cmd_generate,
        "config": _cmd_config,
        "prepare": _cmd_prepare,
        "plan": _cmd_plan,
        "scale": _cmd_scale,
        "tune": _cmd_tune,
        "fit": _cmd_fit,
        "predict": _cmd_predict,
        "simulate": _cmd_simulate,
    }
    try:
        return handlers[a.command](a)
    except RayDilocoError as e:
        for line in e.lines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ray-diloco plan | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except OSError as e:  # disk full, permissions, a path that is not what it should be
        print(f"error: {e.filename or ''}: {e.strerror or e}".replace("error: : ", "error: "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
