"""Building a :class:`~ray_diloco.config.schema.Config`: defaults, a YAML file or preset, dotted overrides.

Values from YAML or ``--set KEY=VALUE`` strings are converted to each field's annotated type
(:func:`_coerce`); a ``Literal`` field is read as a string and its value checked by validation, so
a bad choice is reported as ``KEY = VALUE: must be one of ...``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from ray_diloco.config.schema import Config
from ray_diloco.config.validation import validate_config
from ray_diloco.errors import ConfigError
from ray_diloco.log import error_line

#: The presets ``--config NAME`` finds: ``ray_diloco/configs/NAME.yaml``.
PRESET_DIR = Path(__file__).parents[1] / "configs"


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce_scalar(value: Any, tp: Any) -> Any:
    """``value`` as ``tp`` (bool, int, float or str); raises ValueError or TypeError when it is not one."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError
    if tp is int:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError
            return int(value)
        if isinstance(value, str):
            f = float(value)
            if not f.is_integer():
                raise ValueError
            return int(f)
        return int(value)
    if tp is float:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ValueError
        return str(value)
    return value


def _coerce(value: Any, tp: Any, key: str, errors: list[str]) -> Any:
    """Convert ``value`` (from YAML or a ``--set`` string) to the annotated type ``tp``.

    ``Literal[...]`` is converted like ``str``: whether the value is one of its choices is
    validation's business (one message for YAML and ``--set`` alike).
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key, errors)
    if origin is typing.Literal:
        if "true" in args and (isinstance(value, bool) or str(value).lower() in ("true", "false")):
            return str(value).lower()  # YAML's true/false, --set's True, for a field with those choices
        return _coerce(value, str, key, errors)
    if origin is list:
        if isinstance(value, str):  # --set key=a,b; an empty value, none, null or [] is the empty list
            value = [] if value.strip().lower() in ("", "none", "null", "[]") else [v for v in value.split(",") if v]
        if not isinstance(value, list):
            errors.append(f"{key} = {value!r}: expected a list")
            return None
        return [_coerce(v, args[0], key, errors) for v in value]
    try:
        return _coerce_scalar(value, tp)
    except (TypeError, ValueError):
        errors.append(f"{key} = {value!r}: expected {getattr(tp, '__name__', tp)}")
        return None


def _apply(section: Any, key_prefix: str, data: dict[str, Any], errors: list[str]) -> None:
    types_ = _field_types(type(section))
    for k, v in data.items():
        key = f"{key_prefix}{k}"
        if k not in types_:
            allowed = ", ".join(types_)
            errors.append(f"{key}: unknown config field (allowed: {allowed})")
            continue
        current = getattr(section, k)
        if dataclasses.is_dataclass(current):
            if not isinstance(v, dict):
                errors.append(f"{key} = {v!r}: expected a mapping of {type(current).__name__} fields")
                continue
            _apply(current, key + ".", v, errors)
        else:
            n_before = len(errors)
            coerced = _coerce(v, types_[k], key, errors)
            if len(errors) == n_before:
                setattr(section, k, coerced)


def _parse_set(item: str) -> tuple[list[str], str]:
    if "=" not in item:
        raise ConfigError([f"--set {item!r}: expected KEY=VALUE, for example inner.lr=3e-4"])
    key, value = item.split("=", 1)
    return key.strip().split("."), value.strip()


def resolve_config_path(name_or_path: str) -> Path:
    """A YAML path, or the name of a preset shipped in ``ray_diloco/configs``."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise ConfigError([f"--config {name_or_path}: file not found"])
        return p
    preset = PRESET_DIR / f"{name_or_path}.yaml"
    if preset.is_file():
        return preset
    names = ", ".join(sorted(q.stem for q in PRESET_DIR.glob("*.yaml")))
    raise ConfigError([f"--config {name_or_path}: no such file or preset (presets: {names})"])


def _read_yaml(config: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file or preset (see :func:`resolve_config_path`)."""
    path = resolve_config_path(str(config))
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"--config {path}: not valid YAML ({error_line(e, typed=False)})"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"--config {path}: cannot read it as UTF-8 text ({type(e).__name__})"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: expected a mapping of config sections"])
    return data


def load_config(
    config: str | Path | dict[str, Any] | Config | None = None,
    overrides: list[str] | None = None,
    validate: bool = True,
) -> Config:
    """Build a :class:`Config` from defaults, a YAML file/preset/dict, and dotted overrides.

    Raises:
        ConfigError: with one line per unknown field, bad type or invalid value.
    """
    if isinstance(config, Config):
        cfg = _from_dict(config.to_dict(), [])  # a copy: the caller's object is not changed
    else:
        data: dict[str, Any] = {}
        if isinstance(config, dict):
            data = config
        elif config is not None:
            data = _read_yaml(config)
        errors: list[str] = []
        cfg = _from_dict(data, errors)
        if errors:
            raise ConfigError(errors)
    errors = []
    for item in overrides or []:
        keys, value = _parse_set(item)
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        _apply(cfg, "", nested, errors)
    if cfg.model.init_from:
        from ray_diloco.config.pretrained import settle_init_from

        settle_init_from(cfg)
    if validate:  # a --set that could not be read keeps its old value: the other fields still get checked
        try:
            validate_config(cfg)
        except ConfigError as e:
            errors += e.problems
    if errors:
        raise ConfigError(errors)
    return cfg


def _from_dict(data: dict[str, Any], errors: list[str]) -> Config:
    cfg = Config()
    _apply(cfg, "", data, errors)
    return cfg
