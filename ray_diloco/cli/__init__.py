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

from ray_diloco.cli.analysis import (
    add_law_commands,
    add_plan_command,
    add_simulate_command,
    cmd_fit,
    cmd_plan,
    cmd_predict,
    cmd_simulate,
)
from ray_diloco.cli.common import add_config_args
from ray_diloco.errors import RayDilocoError


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ray-diloco", description="DiLoCo training of language models on Ray.")
    sub = ap.add_subparsers(dest="command", required=True)
    for add in (
        _add_run_commands,
        _add_prepare_command,
        add_plan_command,
        add_law_commands,
        add_simulate_command,
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
    add_config_args(t)
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
    add_config_args(c)


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
        "plan": cmd_plan,
        "scale": _cmd_scale,
        "tune": _cmd_tune,
        "fit": cmd_fit,
        "predict": cmd_predict,
        "simulate": cmd_simulate,
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
