"""Ray Tune sweeps: each trial is a full DiLoCo (or DP) run with its own replicas.

A search space is a YAML file (``tune_spaces/*.yaml``, format in README)::

    description: outer lr x H on the tiny model
    config: tiny                    # base config: a preset name or a YAML path (default: built-in)
    set: {run.steps: 200}           # fixed overrides for every trial
    params:                         # swept config fields (dotted keys)
      outer.lr: {grid: [0.2, 0.4, 0.6, 0.8, 1.0]}
      diloco.H: {grid: [10, 30]}
      inner.lr: {geometric: {start: 1.0e-3, factor: 1.4142135623730951, count: 5}}   # a grid
      inner.warmup_steps: {choice: [50, 100]}
      inner.weight_decay: {loguniform: [1.0e-3, 0.3]}
    metric: eval_loss               # what is minimised (the global parameters' validation loss)
    mode: min
    num_samples: 1                  # samples of the random parameters per grid point
    scheduler: fifo                 # or asha (early stopping on the outer step)
    asha: {grace_period: 1, reduction_factor: 2}
    search: basic                   # or optuna
    resources: {cpus_per_worker: 1, trial_cpus: 0.5}
    max_concurrent_trials: null     # default: as many as the cluster holds at once

Each trial reserves one :class:`~ray.tune.PlacementGroupFactory`: a bundle for the trial
itself (its outer-optimiser driver takes no CPU) and one bundle per replica worker, so a trial
starts only when all its replicas fit and trials never deadlock on each other. Inside, the
replicas are placed in those bundles (``cluster.HOST_PLACEMENT_GROUP``).

Trials report, after every outer step, the global parameters' ``eval_loss`` (trials evaluate
every outer step unless the space sets ``run.eval_every``), ``best_eval_loss``, train loss,
tokens and bytes; ASHA stops trials on ``outer_step``. Each trial's run directory
(``SWEEP_DIR/trials/TRIAL``, with checkpoints, ``metrics.jsonl`` and its W&B run in the sweep's
W&B group) is resumed, not restarted, when an interrupted sweep is restored
(``ray-diloco tune --resume SWEEP_DIR``, ``Tuner.restore``).

The sweep directory gets ``results.csv`` / ``results.parquet`` (one row per trial: swept
values, the config fields the scaling-law fits use, final and best eval loss, tokens, bytes,
status, error) and ``best_config.yaml`` (a config ``ray-diloco train --config`` accepts).
"""

from __future__ import annotations

import copy
import math
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from ray.tune import Trainable

from .config import Config, load_config, resolve_config_path
from .errors import ConfigError, RayDilocoError

SPACE_KEYS = ("description", "config", "set", "params", "metric", "mode", "num_samples", "scheduler", "asha",
              "search", "resources", "max_concurrent_trials")
KINDS = ("grid", "choice", "uniform", "loguniform", "randint", "geometric")
SCHEDULERS = ("fifo", "asha")
SEARCHES = ("basic", "optuna")
METRICS = ("eval_loss", "best_eval_loss", "train_loss")
SPEC_FILE = "sweep.yaml"  # the resolved space, written into the sweep directory (for --resume)


@dataclass
class SweepSpec:
    """A resolved search space (see the module docstring); every path in it is absolute."""

    params: dict[str, dict[str, Any]]
    config: str | None = None
    set: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    metric: str = "eval_loss"
    mode: str = "min"
    num_samples: int = 1
    scheduler: str = "fifo"
    asha: dict[str, Any] = field(default_factory=dict)
    search: str = "basic"
    resources: dict[str, float] = field(default_factory=dict)
    max_concurrent_trials: int | None = None
    name: str = ""  # the sweep's name (its directory under the storage path)
    storage_path: str = ""  # where sweep directories go (local path or URI)

    @property
    def sweep_dir(self) -> str:
        """``storage_path/name`` (a local path or a URI)."""
        return self.storage_path.rstrip("/") + "/" + self.name

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (written as ``sweep.yaml``)."""
        return {k: copy.deepcopy(getattr(self, k)) for k in self.__dataclass_fields__}

    # -- search space ------------------------------------------------------------------------
    def grid_values(self, key: str) -> list[Any] | None:
        """The values of a grid-like parameter (grid, geometric), else None."""
        p = self.params[key]
        kind, arg = next(iter(p.items()))
        if kind == "grid":
            return list(arg)
        if kind == "geometric":
            vals = [arg["start"] * arg["factor"] ** i for i in range(int(arg["count"]))]
            return [int(round(v)) if float(arg["start"]).is_integer() and float(arg["factor"]).is_integer() else
                    float(f"{v:.6g}") for v in vals]
        return None

    def param_space(self, for_optuna: bool = False) -> dict[str, Any]:
        """Ray Tune's ``param_space`` (grids become ``tune.choice`` for Optuna, which samples)."""
        from ray import tune

        space: dict[str, Any] = {}
        for key, p in self.params.items():
            kind, arg = next(iter(p.items()))
            grid = self.grid_values(key)
            if grid is not None:
                space[key] = tune.choice(grid) if for_optuna else tune.grid_search(grid)
            elif kind == "choice":
                space[key] = tune.choice(list(arg))
            elif kind == "uniform":
                space[key] = tune.uniform(*arg)
            elif kind == "loguniform":
                space[key] = tune.loguniform(*arg)
            elif kind == "randint":
                space[key] = tune.randint(arg[0], arg[1] + 1)  # inclusive upper bound
        return space

    def examples(self) -> list[dict[str, Any]]:
        """A few parameter settings that together cover every grid/choice value and each
        range's ends (used to size trials and check values before the sweep starts)."""
        per_key: dict[str, list[Any]] = {}
        for key, p in self.params.items():
            kind, arg = next(iter(p.items()))
            grid = self.grid_values(key)
            per_key[key] = grid if grid is not None else list(arg) if kind in ("choice", "uniform", "loguniform",
                                                                               "randint") else []
        n = max([len(v) for v in per_key.values()] + [1])
        return [{k: v[i % len(v)] for k, v in per_key.items()} for i in range(n)]

    def overrides(self, params: dict[str, Any]) -> list[str]:
        """``--set`` strings of the fixed overrides followed by one trial's parameters."""
        return [f"{k}={_fmt(v)}" for k, v in {**self.set, **params}.items()]

    def trial_config(self, params: dict[str, Any], validate: bool = True) -> Config:
        """The config of a trial with ``params`` (the sweep's resource defaults filled in).

        Raises:
            ConfigError: an invalid value (one line per field).
        """
        cfg = load_config(self.config, self.overrides(params), validate=validate)
        if cfg.diloco.cpus_per_worker is None:
            cfg.diloco.cpus_per_worker = float(self.resources.get("cpus_per_worker", 1.0))
        return cfg

    def bundles(self, cfg: Config) -> list[dict[str, float]]:
        """The trial's placement group: its own bundle, then one per replica worker."""
        d = cfg.diloco
        worker = {"CPU": float(d.cpus_per_worker)}
        if d.gpus_per_worker:
            worker["GPU"] = float(d.gpus_per_worker)
        n = cfg.num_shards if cfg.algorithm == "diloco" else d.replicas * d.workers_per_replica
        return [{"CPU": float(self.resources.get("trial_cpus", 0.5))}] + [dict(worker) for _ in range(n)]


def _fmt(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return "none" if v is None else str(v)


def _need(ok: bool, problems: list[str], line: str) -> None:
    if not ok:
        problems.append(line)


def _check_param(key: str, p: Any, problems: list[str]) -> None:
    where = f"params.{key}"
    if not isinstance(p, dict) or len(p) != 1 or next(iter(p)) not in KINDS:
        problems.append(f"{where} = {p!r}: expected one of {{{', '.join(k + ': ...' for k in KINDS)}}}")
        return
    kind, arg = next(iter(p.items()))
    if kind in ("grid", "choice"):
        _need(isinstance(arg, list) and len(arg) >= 1, problems,
              f"{where}.{kind} = {arg!r}: must be a non-empty list of values")
    elif kind in ("uniform", "loguniform", "randint"):
        ok = isinstance(arg, list) and len(arg) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                             for x in arg) and arg[0] < arg[1]
        ok = ok and (kind != "loguniform" or arg[0] > 0) and (kind != "randint" or all(float(x).is_integer() for x in arg))
        _need(ok, problems, f"{where}.{kind} = {arg!r}: must be [low, high] with low < high"
              + (", both > 0" if kind == "loguniform" else ", integers" if kind == "randint" else ""))
    elif kind == "geometric":
        ok = isinstance(arg, dict) and set(arg) == {"start", "factor", "count"}
        ok = ok and all(isinstance(arg[k], (int, float)) and not isinstance(arg[k], bool) for k in arg)
        ok = ok and arg["start"] > 0 and arg["factor"] > 0 and float(arg["count"]).is_integer() and arg["count"] >= 1
        _need(ok, problems, f"{where}.geometric = {arg!r}: must be {{start: > 0, factor: > 0, count: integer >= 1}}")


def load_space(path: str | Path, overrides: list[str] | None = None, name: str | None = None,
               storage_path: str | None = None, scheduler: str | None = None, search: str | None = None,
               num_samples: int | None = None, max_concurrent: int | None = None) -> SweepSpec:
    """Read and check a search-space YAML; CLI options override its fields.

    Raises:
        ConfigError: one line per problem (unknown key, empty grid, bad range, a swept or fixed
            key that is not a config field, a value of the wrong type), before anything starts.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError([f"--space {path}: file not found"])
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError([f"--space {path}: not valid YAML ({str(e).splitlines()[0]})"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"--space {path}: expected a mapping with params (and optionally {', '.join(SPACE_KEYS)})"])
    problems: list[str] = []
    for k in data:
        if k not in SPACE_KEYS:
            problems.append(f"{k}: unknown search-space key (allowed: {', '.join(SPACE_KEYS)})")
    params = data.get("params")
    if not isinstance(params, dict) or not params:
        problems.append(f"params = {params!r}: must be a non-empty mapping of config fields to "
                        f"{{grid|choice|uniform|loguniform|randint|geometric: ...}}")
        params = {}
    for key, spec in params.items():
        _check_param(str(key), spec, problems)
    fixed = data.get("set") or {}
    if not isinstance(fixed, dict):
        problems.append(f"set = {fixed!r}: must be a mapping of dotted config fields to values")
        fixed = {}
    base = data.get("config")
    if base is not None:  # a path relative to the space file, or a preset name
        rel = (p.parent / str(base))
        base = str(rel.resolve()) if rel.is_file() else str(base)
    spec = SweepSpec(params={str(k): v for k, v in params.items()}, config=base,
                     set={str(k): v for k, v in fixed.items()}, description=str(data.get("description") or ""))
    for k in ("metric", "mode", "num_samples", "scheduler", "asha", "search", "resources", "max_concurrent_trials"):
        if data.get(k) is not None:
            setattr(spec, k, data[k])
    for k, v in (("scheduler", scheduler), ("search", search), ("num_samples", num_samples),
                 ("max_concurrent_trials", max_concurrent)):
        if v is not None:
            setattr(spec, k, v)
    for item in overrides or []:
        if "=" not in item:
            problems.append(f"--set {item!r}: expected KEY=VALUE, for example inner.lr=3e-4")
            continue
        k, v = item.split("=", 1)
        spec.set[k.strip()] = v.strip()
    _need(spec.metric in METRICS, problems, f"metric = {spec.metric!r}: must be one of {', '.join(METRICS)}")
    _need(spec.mode in ("min", "max"), problems, f"mode = {spec.mode!r}: must be min or max")
    _need(isinstance(spec.num_samples, int) and spec.num_samples >= 1, problems,
          f"num_samples = {spec.num_samples!r}: must be an integer >= 1")
    _need(spec.scheduler in SCHEDULERS, problems, f"scheduler = {spec.scheduler!r}: must be one of {', '.join(SCHEDULERS)}")
    _need(spec.search in SEARCHES, problems, f"search = {spec.search!r}: must be one of {', '.join(SEARCHES)}")
    _need(spec.max_concurrent_trials is None or (isinstance(spec.max_concurrent_trials, int)
                                                 and spec.max_concurrent_trials >= 1), problems,
          f"max_concurrent_trials = {spec.max_concurrent_trials!r}: must be an integer >= 1 (or none: from the cluster)")
    if not isinstance(spec.asha, dict) or set(spec.asha) - {"grace_period", "reduction_factor"}:
        problems.append(f"asha = {spec.asha!r}: allowed keys are grace_period (outer steps >= 1), reduction_factor (> 1)")
    else:
        _need(int(spec.asha.get("grace_period", 1)) >= 1, problems,
              f"asha.grace_period = {spec.asha.get('grace_period')!r}: must be >= 1 outer step")
        _need(float(spec.asha.get("reduction_factor", 2)) > 1, problems,
              f"asha.reduction_factor = {spec.asha.get('reduction_factor')!r}: must be > 1")
    res = spec.resources
    if not isinstance(res, dict) or set(res) - {"cpus_per_worker", "trial_cpus"}:
        problems.append(f"resources = {res!r}: allowed keys are cpus_per_worker (> 0), trial_cpus (> 0)")
    else:
        for k, v in res.items():
            _need(isinstance(v, (int, float)) and v > 0, problems, f"resources.{k} = {v!r}: must be > 0 CPUs")
    if problems:
        raise ConfigError(problems)
    # swept and fixed keys must be config fields with values of the right type (checked with
    # validation off: an out-of-range value fails its own trial, not the sweep)
    try:
        load_config(spec.config, [], validate=False)
    except ConfigError as e:
        raise ConfigError([f"config = {data.get('config')!r}: {line}" for line in e.problems]) from None
    for example in spec.examples():
        try:
            spec.trial_config(example, validate=False)
        except ConfigError as e:
            problems += [line if line.startswith("--set") else f"params/set: {line}" for line in e.problems]
    if problems:
        raise ConfigError(sorted(set(problems), key=problems.index))
    spec.name = name or f"{p.stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    from .storage import is_uri

    root = storage_path or str(Path(load_config(spec.config, [f"{k}={_fmt(v)}" for k, v in spec.set.items()],
                                                validate=False).run.output_dir) / "sweeps")
    spec.storage_path = root if is_uri(root) else str(Path(root).expanduser().resolve())
    _absolute_paths(spec)
    return spec


def _absolute_paths(spec: SweepSpec) -> None:
    """Trials run in Tune's trial directories: relative paths in the config become absolute."""
    for key in ("data.path", "run.output_dir"):
        v = spec.set.get(key)
        if v not in (None, "none", "null") and "://" not in str(v):
            spec.set[key] = str(Path(str(v)).expanduser().resolve())
    if spec.config is not None and not Path(spec.config).is_absolute():
        try:
            path = resolve_config_path(spec.config)
            spec.config = str(path.resolve())
        except ConfigError:
            pass
    if spec.config is not None:  # a base YAML's own relative data.path
        cfg = load_config(spec.config, validate=False)
        if cfg.data.path and "data.path" not in spec.set and not Path(cfg.data.path).is_absolute():
            spec.set["data.path"] = str(Path(cfg.data.path).expanduser().resolve())


def load_spec(sweep_dir: str) -> SweepSpec:
    """The resolved space saved in a sweep directory (``--resume``).

    Raises:
        ConfigError: ``sweep_dir`` holds no ``sweep.yaml``.
    """
    text = _read_text(sweep_dir.rstrip("/") + "/" + SPEC_FILE)
    if text is None:
        raise ConfigError([f"--resume {sweep_dir}: not a sweep directory (no {SPEC_FILE})"])
    return SweepSpec(**yaml.safe_load(text))


def _read_text(uri_or_path: str) -> str | None:
    from .storage import filesystem, is_uri

    if not is_uri(uri_or_path):
        p = Path(uri_or_path).expanduser()
        return p.read_text() if p.is_file() else None
    fs, path = filesystem(uri_or_path)
    try:
        with fs.open_input_stream(path) as f:
            return f.read().decode()
    except (OSError, FileNotFoundError):
        return None


def _write_text(uri_or_path: str, text: str) -> None:
    from .storage import filesystem, is_uri

    if not is_uri(uri_or_path):
        p = Path(uri_or_path).expanduser()
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, p)
        return
    fs, path = filesystem(uri_or_path)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(text.encode())


# ---------------------------------------------------------------------------------------
# the trial


class TrialError(RuntimeError):
    """A trial's run failed with a one-line reason (shown in the results table's ``error``)."""


def _trial_run(s: SweepSpec, trial: str, params: dict[str, Any]) -> tuple[Config | None, Path, Path | None, Path]:
    """A trial's config, run directory and what to resume (a run directory left by an interrupted
    sweep; with remote storage, fetched from there).

    Raises:
        TrialError: an invalid value in ``params``.
    """
    import shutil

    from .checkpoint import list_checkpoints
    from .storage import is_uri

    remote = is_uri(s.storage_path)
    local_root = Path(s.set.get("run.output_dir") or Path.cwd()) / "sweep-staging" / s.name / "trials" if remote \
        else Path(s.sweep_dir) / "trials"
    try:
        cfg = s.trial_config(params)
    except ConfigError as e:
        raise TrialError("; ".join(e.lines())) from None
    cfg.run.name, cfg.run.output_dir = trial, str(local_root)
    cfg.run.storage_path = s.sweep_dir + "/trials" if remote else None
    if "run.eval_every" not in s.set and "run.eval_every" not in params:
        cfg.run.eval_every = 1
    cfg.tracking.progress = False
    cfg.tracking.group = cfg.tracking.group or s.name
    cfg.tracking.name = cfg.tracking.name or f"{s.name}/{trial}"
    cfg.tracking.tags = list(cfg.tracking.tags) + ["sweep"]
    run_dir = local_root / trial
    resume = None
    if remote:
        from .storage import download_run, remote_run_dir

        try:
            resume = download_run(remote_run_dir(cfg.run.storage_path, trial), local_root)
        except RayDilocoError:
            resume = None
    if resume is None and run_dir.exists():  # restored sweep: continue this trial's run
        if list_checkpoints(run_dir):
            resume = run_dir
        else:  # stopped before its first checkpoint: start it again
            shutil.rmtree(run_dir)
    return cfg, run_dir, resume, local_root


class _StopTrial(Exception):
    """Raised in the training thread at an outer-step boundary when Tune stops the trial."""


class DilocoTrial(Trainable):
    """Ray Tune class trainable: one full run with the trial's parameters on its reserved bundles.

    The run (:func:`ray_diloco.trainer.train`) goes on in a thread; each :meth:`step` returns the
    next outer step's metrics (see the module docstring), the last one with ``done``. When Tune
    stops the trial (ASHA, Ctrl-C), :meth:`cleanup` ends the run at its next outer-step boundary
    the normal way, so its W&B run is finished and its replicas and placement bundles released.

    Raises (from :meth:`step`):
        TrialError: the run failed (invalid value, cluster error); Tune marks only this trial.
    """

    def setup(self, config: dict[str, Any], spec: dict[str, Any]) -> None:  # noqa: D401 - Tune hook
        import queue
        import threading

        import ray

        from . import cluster

        self._spec = SweepSpec(**spec)
        self._rows: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._last: dict[str, Any] = {}
        cfg, self._run_dir, resume, local_root = _trial_run(self._spec, self.trial_id, config)
        self._final = cfg.num_outer_steps
        self._best = _best_so_far(self._run_dir) if resume is not None else math.inf
        cluster.HOST_PLACEMENT_GROUP = ray.util.get_current_placement_group()
        self._thread = threading.Thread(target=self._train, args=(cfg, resume, local_root), daemon=True,
                                        name="diloco-trial")
        self._thread.start()

    def _train(self, cfg: Config, resume: Path | None, local_root: Path) -> None:
        from .trainer import train

        try:
            if resume is not None:
                train(None, [f"run.output_dir={local_root}", "tracking.progress=false"], resume=resume,
                      on_outer_step=self._on_outer_step)
            else:
                train(cfg, on_outer_step=self._on_outer_step)
        except _StopTrial:
            pass
        except RayDilocoError as e:
            self._error = TrialError("; ".join(e.lines()))
        except BaseException as e:  # noqa: BLE001 - handed to Tune through step()
            self._error = e
        finally:
            self._rows.put(None)

    def _metrics(self, row: dict[str, Any]) -> dict[str, Any]:
        loss = row.get("eval_loss")
        if loss is not None and math.isfinite(loss):
            self._best = min(self._best, loss)
        return {"outer_step": row["outer_step"], "inner_step": row["inner_step"],
                "eval_loss": loss if loss is not None else math.nan, "best_eval_loss": self._best,
                "train_loss": row["train_loss"], "tokens": row["tokens"],
                "bytes_sent": row["bytes_sent_total"], "bytes_received": row["bytes_received_total"],
                "run_dir": str(self._run_dir)}

    def _on_outer_step(self, row: dict[str, Any]) -> None:
        self._rows.put(self._metrics(row))
        if self._stop.is_set() and row["outer_step"] < self._final:  # the last one goes on to the export
            raise _StopTrial

    def step(self) -> dict[str, Any]:
        """The next outer step's metrics; ``done`` once the run has finished (export included)."""
        row = self._rows.get()
        if row is not None and row["outer_step"] >= self._final:
            self._thread.join()  # export and summary
            return {**row, "done": True}
        if row is None:
            if self._error is not None:
                raise self._error
            if not self._last:  # restored after its last outer step: report that step again
                import json

                lines = (self._run_dir / "metrics.jsonl").read_text().splitlines()
                self._last = self._metrics(json.loads(lines[-1]))
            return {**self._last, "done": True}
        self._last = row
        return row

    def save_checkpoint(self, checkpoint_dir: str) -> dict[str, Any]:
        """Tune's checkpoint holds only where the run is: the run's own atomic checkpoints (in its
        run directory, found again by trial id on restore) are what a resume loads."""
        return {"run_dir": str(self._run_dir)}

    def load_checkpoint(self, checkpoint: dict[str, Any] | None) -> None:
        """Nothing to load: :meth:`setup` already resumed the run from its run directory."""

    def cleanup(self) -> None:
        """Stop the run at its next outer-step boundary (30 s at most) and let it clean up."""
        self._stop.set()
        self._thread.join(timeout=30)


def _best_so_far(run_dir: Path) -> float:
    import json

    best = math.inf
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            v = json.loads(line).get("eval_loss")
            if isinstance(v, (int, float)) and math.isfinite(v):
                best = min(best, v)
    except (OSError, ValueError):
        pass
    return best


# ---------------------------------------------------------------------------------------
# the sweep


def _max_outer_steps(spec: SweepSpec) -> int:
    """ASHA's max_t: the most outer steps of any trial (with a token budget, counted with a
    vocabulary of 2^18 tokens, an upper bound: the scheduler must not cut a trial short)."""
    import itertools

    from .model import budget_steps

    base = spec.examples()[0]
    keys = [k for k in spec.params if k.startswith(("model.", "run.", "diloco.H", "inner.global_batch", "data.seq_len"))]
    values = [spec.grid_values(k) or [v for v in spec.examples() for v in [v[k]]] for k in keys]
    most = 1
    for combo in itertools.product(*values):
        cfg = spec.trial_config({**base, **dict(zip(keys, combo))}, validate=False)
        if cfg.run.tokens_per_parameter is not None:
            cfg.run.steps = budget_steps(cfg, cfg.model.vocab_size or 2**18)
        most = max(most, cfg.num_outer_steps)
    return most


def _trainable(spec: SweepSpec) -> Any:
    from ray import tune

    def resources(params: dict[str, Any]) -> Any:
        try:
            cfg = spec.trial_config(params, validate=False)
            bundles = spec.bundles(cfg)
        except Exception:  # an invalid trial: the smallest bundle, it fails at once with its own error
            bundles = [{"CPU": float(spec.resources.get("trial_cpus", 0.5))}]
        return tune.PlacementGroupFactory(bundles, strategy="PACK")

    return tune.with_resources(tune.with_parameters(DilocoTrial, spec=spec.to_dict()), resources)


def _concurrency(spec: SweepSpec) -> int:
    """Trials that fit the cluster at once (the largest trial's bundles against its CPUs/GPUs)."""
    import ray

    if spec.max_concurrent_trials:
        return int(spec.max_concurrent_trials)
    res = ray.cluster_resources()
    need_cpu = need_gpu = 0.0
    for p in spec.examples():
        try:
            b = spec.bundles(spec.trial_config(p, validate=False))
        except ConfigError:
            continue
        need_cpu = max(need_cpu, sum(x.get("CPU", 0) for x in b))
        need_gpu = max(need_gpu, sum(x.get("GPU", 0) for x in b))
    n = int(res.get("CPU", 0) // need_cpu) if need_cpu else 1
    if need_gpu:
        n = min(n, int(res.get("GPU", 0) // need_gpu))
    if n < 1:
        from .errors import ClusterError

        raise ClusterError(f"a trial needs {need_cpu:g} CPUs and {need_gpu:g} GPUs (its driver bundle + one bundle per "
                           f"replica worker) but the Ray cluster has {res.get('CPU', 0):g} CPUs and "
                           f"{res.get('GPU', 0):g} GPUs: lower resources.cpus_per_worker or diloco.replicas")
    return n


def _tune_config(spec: SweepSpec) -> Any:
    from ray import tune

    scheduler = search_alg = None
    if spec.scheduler == "asha":
        from ray.tune.schedulers import ASHAScheduler

        scheduler = ASHAScheduler(time_attr="outer_step", max_t=_max_outer_steps(spec),
                                  grace_period=int(spec.asha.get("grace_period", 1)),
                                  reduction_factor=float(spec.asha.get("reduction_factor", 2)))
    if spec.search == "optuna":
        try:
            from ray.tune.search.optuna import OptunaSearch

            search_alg = OptunaSearch(metric=spec.metric, mode=spec.mode, seed=0)
        except (ImportError, AssertionError):
            raise ConfigError(["search = 'optuna': needs the optuna package (pip install optuna, or "
                               "pip install 'ray-diloco[optuna]')"]) from None
    return tune.TuneConfig(metric=spec.metric, mode=spec.mode, scheduler=scheduler, search_alg=search_alg,
                           num_samples=spec.num_samples, max_concurrent_trials=_concurrency(spec),
                           trial_dirname_creator=lambda t: t.trial_id)


def _num_trials(spec: SweepSpec) -> int:
    n = spec.num_samples
    if spec.search == "basic":
        for key in spec.params:
            g = spec.grid_values(key)
            n *= len(g) if g is not None else 1
    return n


def tune(space: str | Path | None = None, overrides: list[str] | None = None, *, resume: str | None = None,
         name: str | None = None, storage_path: str | None = None, scheduler: str | None = None,
         search: str | None = None, num_samples: int | None = None, max_concurrent: int | None = None,
         address: str | None = None) -> dict[str, Any]:
    """Run (or, with ``resume``, continue) a sweep; write the results table and the best config.

    Returns ``{"sweep_dir", "rows", "best", "interrupted"}`` (``rows``: one dict per trial as
    in ``results.csv``; ``best``: the best row, None when no trial produced a finite loss;
    ``interrupted``: Ctrl-C/SIGTERM stopped it with trials unfinished: ``resume`` continues it).

    Raises:
        ConfigError: bad space or option. ClusterError: the cluster cannot host one trial.
    """
    import ray
    from ray import tune as rt

    from .cluster import init_ray

    if resume is not None:
        if space is not None:
            raise ConfigError([f"--space {space}: cannot be combined with --resume (the sweep's {SPEC_FILE} is used)"])
        spec = load_spec(resume)
    else:
        if space is None:
            raise ConfigError(["--space: required (a search-space YAML, for example tune_spaces/cpu_outer_lr.yaml)"])
        spec = load_space(space, overrides, name, storage_path, scheduler, search, num_samples, max_concurrent)
        if _read_text(spec.sweep_dir + "/" + SPEC_FILE) is not None:
            raise ConfigError([f"--name {spec.name}: sweep directory {spec.sweep_dir} already exists (continue it with "
                               f"--resume {spec.sweep_dir}, or choose another --name)"])
    cfg0 = load_config(spec.config, [f"{k}={_fmt(v)}" for k, v in spec.set.items()], validate=False)
    if address is not None:
        cfg0.run.address = address
    started = init_ray(cfg0)
    if threading.current_thread() is threading.main_thread():  # SIGTERM (ray job stop) stops like Ctrl-C:
        signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))  # Tune saves its state
    try:
        tune_cfg = _tune_config(spec)
        print(f"sweep {spec.name}: {_num_trials(spec)} trial(s), up to {tune_cfg.max_concurrent_trials} at once, "
              f"scheduler {spec.scheduler}, search {spec.search}, minimising {spec.metric}", file=sys.stderr)
        print(f"sweep directory: {spec.sweep_dir}", file=sys.stderr)
        run_cfg = rt.RunConfig(name=spec.name, storage_path=spec.storage_path, verbose=1,
                               failure_config=rt.FailureConfig(max_failures=0, fail_fast=False))
        if resume is not None:
            tuner = rt.Tuner.restore(spec.sweep_dir, trainable=_trainable(spec), resume_unfinished=True,
                                     resume_errored=False, restart_errored=False)
        else:
            _write_text(spec.sweep_dir + "/" + SPEC_FILE, yaml.safe_dump(spec.to_dict(), sort_keys=False))
            tuner = rt.Tuner(_trainable(spec), param_space=spec.param_space(for_optuna=spec.search == "optuna"),
                             tune_config=tune_cfg, run_config=run_cfg)
        grid = tuner.fit()
    finally:
        if started:
            ray.shutdown()
    rows = results_rows(spec, grid)
    best = write_results(spec, rows)
    interrupted = any(r["status"] not in ("TERMINATED", "STOPPED", "ERROR") for r in rows)
    return {"sweep_dir": spec.sweep_dir, "rows": rows, "best": best, "interrupted": interrupted}


def _error_line(err: BaseException | None) -> str | None:
    if err is None:
        return None
    text = str(err).strip().splitlines()
    for ln in reversed(text):  # Tune wraps the trial's exception: keep our one-line reason
        if "TrialError" in ln:
            return ln.split("TrialError:", 1)[-1].strip()
    return next((ln.strip() for ln in reversed(text) if ln.strip()), type(err).__name__)[:300]


def results_rows(spec: SweepSpec, grid: Any) -> list[dict[str, Any]]:
    """One dict per trial: ``trial``, ``status``, the swept values, ``algorithm``,
    ``num_parameters`` (N), ``replicas`` (M; 0 for DP), ``H``, ``inner_lr``, ``outer_lr``,
    ``global_batch``, ``tokens``, ``final_eval_loss``, ``best_eval_loss``, ``outer_steps``,
    ``bytes_sent``, ``bytes_received``, ``run_dir``, ``error``."""
    import json

    rows = []
    saved = _saved_statuses(spec.sweep_dir)
    for r, t in zip(grid, _trials(grid)):
        conf = r.config or getattr(t, "config", None) or {}  # a trial that never ran has no result config
        params = {k: conf.get(k) for k in spec.params}
        m = r.metrics or {}
        status = saved.get(getattr(t, "trial_id", None)) or getattr(t, "status", None) or \
            ("ERROR" if r.error else "TERMINATED")
        if status == "TERMINATED" and m.get("outer_step") is not None and _stopped_early(spec, params, m):
            status = "STOPPED"  # by the scheduler (ASHA) before its last outer step
        row: dict[str, Any] = {"trial": getattr(t, "trial_id", None) or (Path(r.path).name if r.path else None),
                               "status": status}
        row.update(params)
        try:
            cfg = spec.trial_config(params, validate=False)
        except ConfigError:
            cfg = None
        run_dir = m.get("run_dir")
        summary = {}
        if run_dir and (Path(run_dir) / "summary.json").is_file():
            summary = json.loads((Path(run_dir) / "summary.json").read_text())
        row.update({
            "algorithm": cfg.algorithm if cfg else None,
            "model": cfg.model.preset if cfg else None,
            "num_parameters": summary.get("num_parameters") or _num_parameters(run_dir),
            "replicas": (0 if cfg.algorithm == "dp" else cfg.diloco.replicas) if cfg else None,
            "H": cfg.diloco.H if cfg else None,
            "inner_lr": cfg.inner.lr if cfg else None,
            "outer_lr": cfg.outer.lr if cfg else None,
            "global_batch": cfg.inner.global_batch if cfg else None,
            "seq_len": cfg.data.seq_len if cfg else None,
            "tokens": m.get("tokens"),
            "final_eval_loss": m.get("eval_loss"),
            "best_eval_loss": m.get("best_eval_loss") if m.get("best_eval_loss") != math.inf else None,
            "outer_steps": m.get("outer_step"),
            "bytes_sent": m.get("bytes_sent"),
            "bytes_received": m.get("bytes_received"),
            "run_dir": run_dir,
            "error": _error_line(r.error),
        })
        rows.append(row)
    return rows


def _trials(grid: Any) -> list[Any]:
    """Tune's trial objects in the ResultGrid's order."""
    trials = list(getattr(getattr(grid, "_experiment_analysis", None), "trials", None) or [])
    return trials if len(trials) == len(grid) else [None] * len(grid)


def _saved_statuses(sweep_dir: str) -> dict[str, str]:
    """Each trial's status in the experiment state Tune saved when the sweep stopped:
    TERMINATED, ERROR, or PENDING/RUNNING/PAUSED when it was interrupted (the live trial objects
    are all stopped by then, so they cannot tell)."""
    import logging

    from ray.tune import ExperimentAnalysis

    log = logging.getLogger("ray.tune")
    level = log.level
    log.setLevel(logging.CRITICAL)  # it warns about trials that never reported
    try:
        return {t.trial_id: t.status for t in ExperimentAnalysis(sweep_dir).trials}
    except Exception:
        return {}
    finally:
        log.setLevel(level)


def _stopped_early(spec: SweepSpec, params: dict[str, Any], m: dict[str, Any]) -> bool:
    try:
        return m["outer_step"] < spec.trial_config(params, validate=False).num_outer_steps
    except ConfigError:
        return False


def _num_parameters(run_dir: str | None) -> int | None:
    """Parameter count from the run's exported or checkpointed model when there is no summary."""
    if not run_dir:
        return None
    from .checkpoint import global_params, latest_checkpoint, load_checkpoint

    try:
        _, path = latest_checkpoint(Path(run_dir))
        return int(sum(p.size for p in global_params(load_checkpoint(path))))
    except Exception:
        return None


def write_results(spec: SweepSpec, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``results.csv``, ``results.parquet`` and ``best_config.yaml`` in the sweep directory;
    prints the table's best trial. Returns the best row (None: no finite loss)."""
    import pandas as pd

    df = pd.DataFrame(rows)
    key = "best_eval_loss" if spec.metric == "best_eval_loss" else "final_eval_loss" \
        if spec.metric == "eval_loss" else "best_eval_loss"
    finite = [r for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
              and r["status"] != "ERROR"]
    best = (min if spec.mode == "min" else max)(finite, key=lambda r: r[key]) if finite else None
    _write_text(spec.sweep_dir + "/results.csv", df.to_csv(index=False))
    from .storage import filesystem, is_uri

    if is_uri(spec.sweep_dir):
        fs, path = filesystem(spec.sweep_dir + "/results.parquet")
        with fs.open_output_stream(path) as f:
            df.to_parquet(f, index=False)
    else:
        df.to_parquet(Path(spec.sweep_dir) / "results.parquet", index=False)
    counts = df["status"].value_counts().to_dict() if len(df) else {}
    print(f"{len(rows)} trial(s): " + ", ".join(f"{v} {k.lower()}" for k, v in sorted(counts.items())))
    for r in rows:
        if r["error"]:
            swept = " ".join(f"{k}={r[k]}" for k in spec.params)
            print(f"trial {r['trial']} ({swept}) failed: {r['error']}")
    print(f"results: {spec.sweep_dir}/results.csv")
    if best is None:
        print("no trial reached a finite eval loss")
        return None
    swept = {k: best[k] for k in spec.params}
    cfg = spec.trial_config(swept, validate=False)
    cfg.run.name = None
    _write_text(spec.sweep_dir + "/best_config.yaml", cfg.to_yaml())
    print(f"best trial {best['trial']}: {key} {best[key]:.4f} at outer step {best['outer_steps']} with "
          + " ".join(f"{k}={v}" for k, v in swept.items()))
    print(f"best config: {spec.sweep_dir}/best_config.yaml (ray-diloco train --config {spec.sweep_dir}/best_config.yaml)")
    return best
