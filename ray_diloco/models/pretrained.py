"""The weights of a ``model.init_from`` model: where each parameter lies in its safetensors files,
checked against the model its ``config.json`` describes before any worker reads them.

``from_pretrained`` initialises a parameter the files lack at random and says so only in a log
line, and a file it cannot read kills the worker that loads it; :func:`check_weights` reads the
files' headers (no tensor data) in the job's process, so a model whose weights and config
disagree, or whose files are damaged, stops the run with one line before anything starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch

from ray_diloco.errors import ConfigError

#: Tensors a released checkpoint may hold that no parameter of ours reads (buffers saved by older
#: transformers versions: RoPE frequencies, GPT-2's causal mask).
_STALE = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")


class Weight(NamedTuple):
    """One tensor of the files: its file, its key there and its shape."""

    file: Path
    key: str
    shape: tuple[int, ...]


def weight_table(init_from: str) -> dict[str, Weight]:
    """Every tensor of ``init_from``'s safetensors files (its model directory's index's, or every
    ``*.safetensors``), key -> :class:`Weight`, read from the headers alone.

    Raises:
        ConfigError: no safetensors file, a file the index names missing, or a file whose header
            is damaged or that is shorter than its header says (each naming ``model.init_from``
            and the file)."""
    from safetensors import safe_open

    from ray_diloco.config.pretrained import model_dir

    root = model_dir(init_from)
    index = root / "model.safetensors.index.json"
    where = f"model.init_from = {init_from!r}"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError([f"{where}: {index.name} cannot be read ({e})"]) from None
    paths = [root / f for f in files] if files is not None else sorted(root.glob("*.safetensors"))
    if not paths:
        raise ConfigError([f"{where}: it has no *.safetensors weights (save it with save_pretrained)"])
    table: dict[str, Weight] = {}
    for path in paths:
        if not path.is_file():
            raise ConfigError([f"{where}: {path.name} is missing (its index names it)"])
        try:
            with safe_open(str(path), framework="pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types (a header cut short, ...)
            raise ConfigError(
                [f"{where}: {path.name} cannot be read as safetensors ({str(e).splitlines()[0]})"]
            ) from None
        table.update({k: Weight(path, k, s) for k, s in shapes.items()})
    return table


def locate(model: torch.nn.Module, name: str, table: dict[str, Weight]) -> Weight | None:
    """The tensor of ``table`` holding ``model``'s parameter ``name`` (saved with or without the
    model's ``base_model_prefix``, as transformers reads it), None when the files lack it."""
    if name in table:
        return table[name]
    prefix = getattr(model, "base_model_prefix", "") + "."
    return table.get(name.removeprefix(prefix)) or table.get(prefix + name)


def check_weights(init_from: str) -> None:
    """Check ``model.init_from``'s files against the model its config describes, in the job's
    process, before any worker loads them: every parameter (tied ones once) is in the files with
    its shape. Tensors the model does not read are logged (a checkpoint of another shape would
    also miss some of ours, which stops the run).

    Raises:
        ConfigError: one line naming ``model.init_from`` and the first problem (and how many)."""
    import logging

    from ray_diloco.models.transformer import pretrained_model

    table = weight_table(init_from)
    where = f"model.init_from = {init_from!r}"
    try:
        with torch.device("meta"):
            model = pretrained_model(init_from)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers fails on a bad field in many ways (0 heads, an unknown activation)
        raise ConfigError(
            [
                f"{where}: its config.json does not build a model ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r})"
            ]
        ) from None
    missing, wrong = [], []
    for name, p in model.named_parameters():
        w = locate(model, name, table)
        if w is None:
            missing.append(name)
        elif w.shape != tuple(p.shape):
            wrong.append(f"{name} is {w.shape} in its weights, {tuple(p.shape)} in its config.json")
    if missing:
        raise ConfigError([f"{where}: its weights have no {missing[0]} ({len(missing)} of the "
                           f"{sum(1 for _ in model.parameters())} parameters its config.json describes are missing)"])  # fmt: skip
    if wrong:
        raise ConfigError([f"{where}: {wrong[0]}" + (f" ({len(wrong)} parameters differ)" if len(wrong) > 1 else "")])
    read = {w.key for n in model.state_dict() if (w := locate(model, n, table)) is not None}  # tied: both names
    extra = sorted(k for k in table if k not in read and not k.endswith(_STALE))
    if extra:
        logging.getLogger("ray_diloco").warning(
            f"{where}: {len(extra)} tensors of its weights are not in the model its config.json "
            f"describes and are not loaded (first: {extra[0]})"
        )
