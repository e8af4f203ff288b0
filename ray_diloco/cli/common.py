"""What the ``ray-diloco`` commands share: the config arguments, output paths checked before
any work, strict JSON written atomically."""

from __future__ import annotations

import argparse
import math
import os

from ray_diloco.errors import RayDilocoError


def add_config_args(p: argparse.ArgumentParser) -> None:
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


def check_output(flag: str, path: str | None) -> None:
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


def strict(obj: object) -> object:
    """``obj`` with every non-finite number (NaN, inf) as None, so JSON readers get null."""
    import numbers

    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    if isinstance(obj, numbers.Real) and not isinstance(obj, (bool, numbers.Integral)) and not math.isfinite(obj):
        return None
    return obj


def write_json(path: str, obj: object) -> None:
    """Write ``obj`` as strict JSON (non-finite numbers as null, numpy scalars as numbers)."""
    import json

    from ray_diloco.components.storage import write_text

    write_text(path, json.dumps(strict(obj), indent=2, default=float, allow_nan=False) + "\n")
