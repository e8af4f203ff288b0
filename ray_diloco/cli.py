"""The ``ray-diloco`` command: train, tune, eval, generate, config, plan, scale.

Errors in input, data, checkpoints or cluster size print one line each (``error: ...``) and
exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from .errors import RayDilocoError


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=None,
                   help="YAML file or preset name (ray_diloco/configs/NAME.yaml); default: the built-in defaults")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, repeatable: --set inner.lr=3e-4 --set diloco.replicas=4")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ray-diloco", description="DiLoCo training of language models on Ray.")
    sub = ap.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train with DiLoCo (or the DP baseline) and export the global model")
    _add_config_args(t)
    t.add_argument("--resume", metavar="RUN_DIR", default=None, help="continue a run from its newest checkpoint")
    t.add_argument("--address", default=None,
                   help="Ray cluster address ('auto' joins a running cluster); default: start a local one")

    e = sub.add_parser("eval", help="validation loss of a run's newest checkpoint (global parameters)")
    e.add_argument("run_dir", help="a run directory (with checkpoints/)")
    e.add_argument("--step", type=int, default=None, help="outer step of the checkpoint (default: newest)")

    g = sub.add_parser("generate", help="sample text from a run's exported model")
    g.add_argument("run_dir")
    g.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample (default 200)")
    g.add_argument("--temperature", type=float, default=0.8, help="softmax temperature > 0 (default 0.8)")
    g.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0: all (default 50)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")

    c = sub.add_parser("config", help="print the resolved config as YAML (after --config and --set)")
    _add_config_args(c)

    pl = sub.add_parser("plan", help="fragments, sync steps and bytes per replica of a run, from its config")
    pl.add_argument("config_file", nargs="?", default=None, metavar="CONFIG",
                    help="YAML file or preset name (default: the built-in defaults)")
    _add_config_args(pl)
    pl.add_argument("--from-step", type=int, default=0, help="list the syncs after this inner step (default 0)")
    pl.add_argument("--next", type=int, default=3, dest="upcoming", help="sync steps listed per fragment (default 3)")
    pl.add_argument("--json", default=None, metavar="PATH", help="also write the plan as JSON")

    tu = sub.add_parser("tune", help="a Ray Tune sweep: every trial is a full run with its own replicas")
    tu.add_argument("--space", default=None, metavar="FILE", help="search-space YAML (tune_spaces/*.yaml; format in README)")
    tu.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="fixed config override for every trial, repeatable")
    tu.add_argument("--resume", metavar="SWEEP_DIR", default=None,
                    help="continue an interrupted sweep (Tuner.restore); its trials resume from their checkpoints")
    tu.add_argument("--name", default=None, help="sweep name (its directory); default: SPACE-TIMESTAMP")
    tu.add_argument("--storage-path", default=None,
                    help="where sweep directories go: a local path or s3://, gs://, file:// (default: run.output_dir/sweeps)")
    tu.add_argument("--scheduler", choices=("fifo", "asha"), default=None,
                    help="early stopping (default: the space's, else fifo)")
    tu.add_argument("--search", choices=("basic", "optuna"), default=None,
                    help="grid/random (basic) or Optuna (needs optuna installed)")
    tu.add_argument("--num-samples", type=int, default=None, help="samples per grid point (Optuna: trials)")
    tu.add_argument("--max-concurrent", type=int, default=None, help="trials at once (default: what the cluster holds)")
    tu.add_argument("--address", default=None, help="Ray cluster address ('auto' joins a running cluster)")

    sc = sub.add_parser("scale", help="change the number of replicas of a running DiLoCo run")
    sc.add_argument("run_dir", metavar="RUN_DIR")
    sc.add_argument("--replicas", type=int, required=True,
                    help="replicas from the next outer step on: more start when the cluster has room, extra ones leave")
    return ap


def _cmd_train(a: argparse.Namespace) -> int:
    from .trainer import train

    train(a.config, a.overrides, resume=a.resume, address=a.address)
    return 0


def _cmd_eval(a: argparse.Namespace) -> int:
    from .evaluate import evaluate_run

    loss, step, path = evaluate_run(a.run_dir, a.step)
    print(f"checkpoint: {path}")
    print(f"outer step {step}: validation loss {loss:.4f}")
    return 0


def _cmd_generate(a: argparse.Namespace) -> int:
    from .evaluate import generate

    if a.max_new_tokens < 1:
        raise RayDilocoError(f"--max-new-tokens = {a.max_new_tokens}: must be >= 1")
    if not (a.temperature > 0 and math.isfinite(a.temperature)):
        raise RayDilocoError(f"--temperature = {a.temperature}: must be a finite number > 0")
    if a.top_k < 0:
        raise RayDilocoError(f"--top-k = {a.top_k}: must be >= 0 (0: no top-k filter)")
    print(generate(a.run_dir, a.prompt, a.max_new_tokens, a.temperature, a.top_k, a.seed))
    return 0


def _cmd_config(a: argparse.Namespace) -> int:
    from .config import load_config

    print(load_config(a.config, a.overrides).to_yaml(), end="")
    return 0


def _cmd_plan(a: argparse.Namespace) -> int:
    import json

    from .config import load_config
    from .plan import format_plan, sync_plan

    if a.config_file is not None and a.config is not None:
        raise RayDilocoError(f"plan: give the config once (CONFIG {a.config_file!r} or --config {a.config!r})")
    if a.from_step < 0 or a.upcoming < 0:
        raise RayDilocoError(f"--from-step = {a.from_step}, --next = {a.upcoming}: must be >= 0")
    p = sync_plan(load_config(a.config_file or a.config, a.overrides), a.from_step, a.upcoming)
    print(format_plan(p))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(p, f, indent=2)
    return 0


def _cmd_tune(a: argparse.Namespace) -> int:
    from .sweep import tune

    if a.resume is not None and a.overrides:
        raise RayDilocoError(f"--set {a.overrides[0]}: cannot be combined with --resume (the sweep's saved space is used)")
    for flag, v in (("--num-samples", a.num_samples), ("--max-concurrent", a.max_concurrent)):
        if v is not None and v < 1:
            raise RayDilocoError(f"{flag} = {v}: must be >= 1")
    out = tune(a.space, a.overrides, resume=a.resume, name=a.name, storage_path=a.storage_path, scheduler=a.scheduler,
               search=a.search, num_samples=a.num_samples, max_concurrent=a.max_concurrent, address=a.address)
    if out["interrupted"]:
        print(f"sweep interrupted: continue it with ray-diloco tune --resume {out['sweep_dir']}", file=sys.stderr)
        return 130
    return 0 if out["best"] is not None else 1  # 1: no trial produced a finite loss


def _cmd_scale(a: argparse.Namespace) -> int:
    from .elastic import request_scale

    path = request_scale(a.run_dir, a.replicas)
    print(f"asked for {a.replicas} replica(s) from the next outer step ({path})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ray-diloco`` console script; returns the exit status."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    a = _parser().parse_args(argv)
    import signal

    from . import cluster

    cluster.GRACEFUL_SIGTERM = True  # SIGTERM (ray job stop, kill) cleans up like Ctrl-C
    signal.signal(signal.SIGTERM, cluster.raise_keyboard_interrupt)
    handlers = {"train": _cmd_train, "eval": _cmd_eval, "generate": _cmd_generate, "config": _cmd_config,
                "plan": _cmd_plan, "scale": _cmd_scale, "tune": _cmd_tune}
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
