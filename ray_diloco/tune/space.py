"""Search spaces for Ray Tune sweeps: the YAML format (see :mod:`ray_diloco.tune.sweep` and docs/sweeps.md),
its checks, and each trial's config and placement-group bundles.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from ray_diloco.components.storage import join_uri, read_text
from ray_diloco.config import Config, load_config, resolve_config_path
from ray_diloco.errors import ConfigError
from ray_diloco.log import error_line
from ray_diloco.runtime.strategy import strategy_class

SPACE_KEYS = (
    "description",
    "config",
    "set",
    "params",
    "metric",
    "mode",
    "num_samples",
    "scheduler",
    "asha",
    "search",
    "resources",
    "max_concurrent_trials",
)
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
    staging_dir: str = ""  # with a URI storage_path: the local directory trials run in (set at each start)

    @property
    def sweep_dir(self) -> str:
        """``storage_path/name`` (a local path or a URI)."""
        return join_uri(self.storage_path, self.name)

    @property
    def local_dir(self) -> Path:
        """The local directory of the sweep: ``sweep_dir`` itself, or with a URI storage path
        ``staging_dir`` (the trials' run directories live under ``trials/`` and are mirrored)."""
        from ray_diloco.components.storage import is_uri

        return Path(self.staging_dir) if is_uri(self.storage_path) else Path(self.sweep_dir)

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
            return [
                int(round(v))
                if float(arg["start"]).is_integer() and float(arg["factor"]).is_integer()
                else float(f"{v:.6g}")
                for v in vals
            ]
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
            per_key[key] = (
                grid
                if grid is not None
                else list(arg)
                if kind in ("choice", "uniform", "loguniform", "randint")
                else []
            )
        n = max([len(v) for v in per_key.values()] + [1])
        return [{k: v[i % len(v)] for k, v in per_key.items()} for i in range(n)]

    def overrides(self, params: dict[str, Any]) -> list[str]:
        """``--set`` strings of the fixed overrides followed by one trial's parameters. A grouped
        value (a mapping, or its :func:`group_label` as the results table shows it) sets each of
        its fields."""
        out = [f"{k}={fmt_value(v)}" for k, v in self.set.items()]
        for k, v in params.items():
            group = self.group(k, v)
            out += [f"{f}={fmt_value(x)}" for f, x in group.items()] if group is not None else [f"{k}={fmt_value(v)}"]
        return out

    def group(self, key: str, value: Any) -> dict[str, Any] | None:
        """The fields a grouped grid value of ``key`` sets (``value`` a mapping or its label),
        None for a plain value."""
        if isinstance(value, dict):
            return value
        spec = self.params.get(key) or {}
        values = spec.get("grid") or spec.get("choice") or []
        return next((g for g in values if isinstance(g, dict) and group_label(g) == value), None)

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
        assert d.cpus_per_worker is not None  # trial_config fills it in
        worker = {"CPU": float(d.cpus_per_worker)}
        if d.gpus_per_worker:
            worker["GPU"] = float(d.gpus_per_worker)
        n = strategy_class(cfg).workers(cfg)
        return [{"CPU": float(self.resources.get("trial_cpus", 0.5))}] + [dict(worker) for _ in range(n)]


def group_label(group: dict[str, Any]) -> str:
    """A grouped grid value as one table cell: ``field=value`` pairs joined by spaces."""
    return " ".join(f"{k}={fmt_value(v)}" for k, v in group.items())


def fmt_value(v: Any) -> str:
    """A config value as a ``--set`` string (lists comma-separated, None as ``none``)."""
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return "none" if v is None else str(v)


MAX_GRID = 10_000  # values in one grid-like parameter (a geometric count above it is a typo)
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def _need(ok: bool, problems: list[str], line: str) -> None:
    if not ok:
        problems.append(line)


def _number(x: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_param(key: str, p: Any, problems: list[str]) -> None:
    where = f"params.{key}"
    if not isinstance(p, dict) or len(p) != 1 or next(iter(p)) not in KINDS:
        problems.append(f"{where} = {p!r}: expected one of {{{', '.join(k + ': ...' for k in KINDS)}}}")
        return
    kind, arg = next(iter(p.items()))
    if kind in ("grid", "choice"):
        _need(
            isinstance(arg, list) and len(arg) >= 1,
            problems,
            f"{where}.{kind} = {arg!r}: must be a non-empty list of values",
        )
        _need(
            not isinstance(arg, list) or not any(isinstance(x, float) and not math.isfinite(x) for x in arg),
            problems,
            f"{where}.{kind} = {arg!r}: numbers must be finite",
        )
        groups = [x for x in arg if isinstance(x, dict)] if isinstance(arg, list) else []
        _need(
            not groups
            or (
                len(groups) == len(arg)
                and all(g and all(isinstance(k, str) and not isinstance(v, dict) for k, v in g.items()) for g in groups)
            ),
            problems,
            f"{where}.{kind} = {arg!r}: grouped values must all be non-empty mappings of config fields to values",
        )
        _need(
            not isinstance(arg, list) or len(arg) <= MAX_GRID,
            problems,
            f"{where}.{kind}: {len(arg) if isinstance(arg, list) else 0} values, at most {MAX_GRID}",
        )
    elif kind in ("uniform", "loguniform", "randint"):
        ok = isinstance(arg, list) and len(arg) == 2 and all(map(_number, arg)) and arg[0] < arg[1]
        ok = (
            ok
            and (kind != "loguniform" or arg[0] > 0)
            and (kind != "randint" or all(float(x).is_integer() for x in arg))
        )
        _need(
            ok,
            problems,
            f"{where}.{kind} = {arg!r}: must be [low, high], finite numbers with low < high"
            + (", both > 0" if kind == "loguniform" else ", integers" if kind == "randint" else ""),
        )
    elif kind == "geometric":
        ok = isinstance(arg, dict) and set(arg) == {"start", "factor", "count"}
        ok = ok and all(_number(arg[k]) for k in arg)
        ok = (
            ok
            and arg["start"] > 0
            and arg["factor"] > 0
            and float(arg["count"]).is_integer()
            and 1 <= arg["count"] <= MAX_GRID
        )
        if ok:  # every value start * factor^i a finite non-zero float
            ends = (math.log(arg["start"]), math.log(arg["start"]) + (arg["count"] - 1) * math.log(arg["factor"]))
            ok = all(-700 < e < 700 for e in ends)
        _need(
            ok,
            problems,
            f"{where}.geometric = {arg!r}: must be {{start: > 0, factor: > 0, count: integer in "
            f"1..{MAX_GRID}}} with every value finite",
        )


def load_space(path: str | Path, overrides: list[str] | None = None, name: str | None = None,
               storage_path: str | None = None, scheduler: str | None = None, search: str | None = None,
               num_samples: int | None = None, max_concurrent: int | None = None) -> SweepSpec:  # fmt: skip
    """Read and check a search-space YAML; CLI options override its fields.

    Raises:
        ConfigError: one line per problem (unknown key, empty grid, bad range, a swept or fixed
            key that is not a config field, a value of the wrong type), before anything starts.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(
            [f"--space {path}: is a directory; expected a search-space YAML file such as tune_spaces/cpu_outer_lr.yaml"]
        )
    if not p.is_file():
        raise ConfigError([f"--space {path}: file not found"])
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError([f"--space {path}: not valid YAML ({error_line(e, typed=False)})"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"--space {path}: expected a mapping with params (and optionally {', '.join(SPACE_KEYS)})"])
    problems: list[str] = []
    for k in data:
        if k not in SPACE_KEYS:
            problems.append(f"{k}: unknown search-space key (allowed: {', '.join(SPACE_KEYS)})")
    params: Any = data.get("params")  # any YAML value: _check_options reports a wrong one
    fixed = data.get("set") or {}
    if not isinstance(fixed, dict):
        problems.append(f"set = {fixed!r}: must be a mapping of dotted config fields to values")
        fixed = {}
    base = data.get("config")
    if base is not None:  # a path relative to the space file, or a preset name
        rel = p.parent / str(base)
        base = str(rel.resolve()) if rel.is_file() else str(base)
    params = {str(k): v for k, v in params.items()} if isinstance(params, dict) else params  # else: reported below
    spec = SweepSpec(params=params, config=base,
                     set={str(k): v for k, v in fixed.items()}, description=str(data.get("description") or ""))  # fmt: skip
    for k in ("metric", "mode", "num_samples", "scheduler", "asha", "search", "resources", "max_concurrent_trials"):
        if data.get(k) is not None:
            setattr(spec, k, data[k])
    for k, v in (("scheduler", scheduler), ("search", search), ("num_samples", num_samples),
                 ("max_concurrent_trials", max_concurrent)):  # fmt: skip
        if v is not None:
            setattr(spec, k, v)
    for item in overrides or []:
        if "=" not in item:
            problems.append(f"--set {item!r}: expected KEY=VALUE, for example inner.lr=3e-4")
            continue
        k, v = item.split("=", 1)
        spec.set[k.strip()] = v.strip()
    _check_options(spec, problems)
    if name is not None:
        _need(bool(name) and set(name) <= NAME_CHARS and name not in (".", "..") and len(name) <= 100, problems,
              f"--name {name!r}: must be 1-100 letters, digits, '.', '_' or '-' (it names a directory)")  # fmt: skip
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
    from ray_diloco.components.storage import is_uri

    root = storage_path or str(Path(load_config(spec.config, [f"{k}={fmt_value(v)}" for k, v in spec.set.items()],
                                                validate=False).run.output_dir) / "sweeps")  # fmt: skip
    spec.storage_path = root if is_uri(root) else str(Path(root).expanduser().resolve())
    _absolute_paths(spec)
    return spec


def _check_options(spec: SweepSpec, problems: list[str]) -> None:
    """The sweep options' checks (not the parameters): one line each into ``problems``."""
    _need(spec.metric in METRICS, problems, f"metric = {spec.metric!r}: must be one of {', '.join(METRICS)}")
    _need(spec.mode in ("min", "max"), problems, f"mode = {spec.mode!r}: must be min or max")
    _need(
        _integer(spec.num_samples) and 1 <= spec.num_samples <= MAX_GRID,
        problems,
        f"num_samples = {spec.num_samples!r}: must be an integer in 1..{MAX_GRID}",
    )
    _need(
        spec.scheduler in SCHEDULERS,
        problems,
        f"scheduler = {spec.scheduler!r}: must be one of {', '.join(SCHEDULERS)}",
    )
    _need(spec.search in SEARCHES, problems, f"search = {spec.search!r}: must be one of {', '.join(SEARCHES)}")
    _need(
        spec.max_concurrent_trials is None
        or (_integer(spec.max_concurrent_trials) and spec.max_concurrent_trials >= 1),
        problems,
        f"max_concurrent_trials = {spec.max_concurrent_trials!r}: must be an integer >= 1 (or none: from the cluster)",
    )
    if not isinstance(spec.asha, dict) or set(spec.asha) - {"grace_period", "reduction_factor"}:
        problems.append(
            f"asha = {spec.asha!r}: allowed keys are grace_period (outer steps >= 1), reduction_factor (> 1)"
        )
    else:
        g, rf = spec.asha.get("grace_period", 1), spec.asha.get("reduction_factor", 2)
        _need(_integer(g) and g >= 1, problems, f"asha.grace_period = {g!r}: must be an integer >= 1 (outer steps)")
        _need(_number(rf) and rf > 1, problems, f"asha.reduction_factor = {rf!r}: must be a number > 1")
    res = spec.resources
    if not isinstance(res, dict) or set(res) - {"cpus_per_worker", "trial_cpus"}:
        problems.append(f"resources = {res!r}: allowed keys are cpus_per_worker (> 0), trial_cpus (> 0)")
    else:
        for k, v in res.items():
            _need(_number(v) and v > 0, problems, f"resources.{k} = {v!r}: must be a finite number > 0 (CPUs)")
    if not isinstance(spec.params, dict) or not spec.params:
        problems.append(
            f"params = {spec.params!r}: must be a non-empty mapping of config fields to "
            f"{{grid|choice|uniform|loguniform|randint|geometric: ...}}"
        )
    else:
        before = len(problems)
        for key, p in spec.params.items():
            _check_param(str(key), p, problems)
        if len(problems) == before and _integer(spec.num_samples):
            trials = spec.num_samples
            for key in spec.params:
                trials *= len(spec.grid_values(key) or [None])
            _need(
                trials <= MAX_GRID,
                problems,
                f"params: the grids make {trials:,} trials (x num_samples); at most {MAX_GRID:,} per sweep",
            )


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
    """The resolved space saved in a sweep directory (``--resume``), located where ``sweep_dir``
    is now: a sweep directory that was moved or copied resumes in its new place.

    Raises:
        ConfigError: ``sweep_dir`` holds no ``sweep.yaml``, or one that is not valid.
    """
    from ray_diloco.components.storage import is_uri, split_uri

    where = f"--resume {sweep_dir}"
    try:
        text = read_text(join_uri(sweep_dir, SPEC_FILE))
    except (UnicodeDecodeError, OSError) as e:
        raise ConfigError([f"{where}: {SPEC_FILE} cannot be read ({type(e).__name__})"]) from None
    if text is None:
        raise ConfigError([f"{where}: not a sweep directory (no {SPEC_FILE})"])
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError([f"{where}: {SPEC_FILE} is not valid YAML ({error_line(e, typed=False)})"]) from None
    fields = SweepSpec.__dataclass_fields__
    if not isinstance(data, dict) or "params" not in data or set(data) - set(fields):
        raise ConfigError([f"{where}: {SPEC_FILE} is not a saved sweep (expected the keys {', '.join(fields)})"])
    spec = SweepSpec(**data)
    problems: list[str] = []
    _check_options(spec, problems)
    if problems:
        raise ConfigError([f"{where}: {SPEC_FILE}: {line}" for line in problems])
    if is_uri(sweep_dir):
        spec.storage_path, spec.name = split_uri(sweep_dir)
    else:
        d = Path(sweep_dir).expanduser().resolve()
        spec.storage_path, spec.name = str(d.parent), d.name
    return spec
