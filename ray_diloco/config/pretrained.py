"""``model.init_from``: a Hugging Face model (a local directory or a hub id) as the run's shape.

Torch-free: the config validates and pins a run's shape from the model's ``config.json`` alone.
A hub id is fetched with ``huggingface_hub`` into its cache (``HF_HOME``; on a cluster, a cache on
shared storage is fetched once for every node), ``config.json`` first (to validate), the weights
and tokenizer when the job starts (:func:`model_dir`); a local directory is used in place.

The families are those the trainer builds (``gpt2``, ``llama``, ``qwen3``: the config's
``model_type``); the model itself is built from the file's whole config, so fields our shape does
not name (grouped-query attention's ``num_key_value_heads``, ``rope_theta``, ``rms_norm_eps``,
the activation) are the file's, and the export writes that config back.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from ray_diloco.errors import ConfigError

#: What the model directory must hold (a hub download fetches these and nothing else).
FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
         "special_tokens_map.json", "vocab.json", "merges.txt", "*.model"]  # fmt: skip
#: Our shape fields in a transformers config of each family: (field, its key, default when absent).
_KEYS: dict[str, list[tuple[str, str, Any]]] = {
    "gpt2": [("n_layers", "n_layer", 12), ("n_heads", "n_head", 12), ("d_model", "n_embd", 768),
             ("d_ff", "n_inner", None), ("context", "n_positions", 1024), ("tie_embeddings", "tie_word_embeddings", True)],
    "llama": [("n_layers", "num_hidden_layers", None), ("n_heads", "num_attention_heads", None),
              ("d_model", "hidden_size", None), ("d_ff", "intermediate_size", None),
              ("context", "max_position_embeddings", 2048), ("tie_embeddings", "tie_word_embeddings", False)],
}  # fmt: skip
_KEYS["qwen3"] = _KEYS["llama"]


def _is_local(init_from: str) -> bool:
    return Path(init_from).expanduser().is_dir() or init_from.startswith((".", "/", "~"))


def _fetch(init_from: str, patterns: list[str]) -> Path:
    """The hub snapshot of ``init_from`` holding ``patterns`` (from the cache when there)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(init_from, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 - the hub raises many types (connection, not found, gated, ...)
        from ray_diloco.log import error_line

        raise ConfigError(
            [
                f"model.init_from = {init_from!r}: not a local model directory, and the Hugging Face hub "
                f"cannot give it ({error_line(e, limit=160)})"
            ]
        ) from None


@functools.lru_cache(maxsize=8)
def _hub_config_dir(init_from: str) -> Path:
    """The hub snapshot holding ``init_from``'s ``config.json`` (asked of the hub once a process)."""
    return _fetch(init_from, ["config.json"])


def pretrained_config(init_from: str) -> dict[str, Any]:
    """The model's ``config.json`` as a dict (a hub id: that file alone is fetched; a local
    directory's is read each time, so a model moved or edited is seen).

    Raises:
        ConfigError: no such directory or hub model, no or unreadable ``config.json``, or a
            ``model_type`` the trainer does not build."""
    root = Path(init_from).expanduser() if _is_local(init_from) else _hub_config_dir(init_from)
    path = root / "config.json"
    if not path.is_file():
        what = "no such directory" if not root.is_dir() else "it has no config.json (a transformers model directory)"
        raise ConfigError([f"model.init_from = {init_from!r}: {what}"])
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError([f"model.init_from = {init_from!r}: config.json cannot be read ({e})"]) from None
    if not isinstance(cfg, dict):
        raise ConfigError([f"model.init_from = {init_from!r}: config.json holds a {type(cfg).__name__}, not an object"])
    kind = cfg.get("model_type")
    if kind not in _KEYS:
        raise ConfigError(
            [f"model.init_from = {init_from!r}: model_type {kind!r}; the trainer builds {', '.join(_KEYS)}"]
        )
    return cfg


@functools.lru_cache(maxsize=8)
def _hub_model_dir(init_from: str) -> Path:
    """The hub snapshot holding ``init_from``'s weights and tokenizer (asked of the hub once a process)."""
    return _fetch(init_from, FILES)


def config_dir(init_from: str) -> Path:
    """The local directory holding the model's ``config.json`` (``init_from`` itself, or the hub
    snapshot of that file alone): for building its architecture without reading its weights.

    Raises:
        ConfigError: as :func:`pretrained_config`."""
    pretrained_config(init_from)
    return Path(init_from).expanduser().resolve() if _is_local(init_from) else _hub_config_dir(init_from)


def model_dir(init_from: str) -> Path:
    """The local directory of the model's files: ``init_from`` itself, or its hub snapshot with
    weights and tokenizer (:data:`FILES`), fetched once into the cache.

    Raises:
        ConfigError: as :func:`pretrained_config`."""
    pretrained_config(init_from)
    return Path(init_from).expanduser().resolve() if _is_local(init_from) else _hub_model_dir(init_from)


def pretrained_shape(init_from: str) -> dict[str, Any]:
    """The model's shape in our fields (:data:`~ray_diloco.config.presets.SHAPE_FIELDS` and
    ``vocab_size``): family, layers, heads, width, FFN (gpt2's default 4 x width), context, tied
    embeddings; z-loss 0 (a released model was not trained with ours).

    Raises:
        ConfigError: as :func:`pretrained_config`, or a shape field missing from ``config.json``
            (where transformers has no default) or not a positive integer (``tie_word_embeddings``:
            not a bool)."""
    cfg = pretrained_config(init_from)
    family = cfg["model_type"]
    shape: dict[str, Any] = {"family": family, "z_loss": 0.0}
    optional = {"vocab_size", "d_ff"} if family == "gpt2" else {"vocab_size"}  # None: the tokenizer's, 4 x width
    for ours, key, default in [*_KEYS[family], ("vocab_size", "vocab_size", None)]:
        shape[ours] = value = cfg.get(key, default)
        kind = bool if ours == "tie_embeddings" else int
        if value is None and ours not in optional:
            raise ConfigError([f"model.init_from = {init_from!r}: its config.json has no {key}"])
        if value is not None and (type(value) is not kind or (kind is int and value < 1)):
            what = "true or false" if kind is bool else "a positive integer"
            raise ConfigError(
                [f"model.init_from = {init_from!r}: its config.json has {key} = {value!r}; expected {what}"]
            )
    if shape["d_ff"] is None:  # gpt2's default
        shape["d_ff"] = 4 * shape["d_model"]
    return shape


def init_from_problems(cfg: Any) -> list[str]:
    """One line per shape field the model config sets to another value than its ``init_from``
    model has (``z_loss`` and ``init_std`` are training choices, not the file's), and one when the
    data takes the model's tokenizer from a local directory that has none (``cfg``: a ``Config``).

    Raises:
        ConfigError: as :func:`pretrained_config`."""
    model = cfg.model
    shape = pretrained_shape(model.init_from)
    root = Path(model.init_from)
    if (
        cfg.data.tokenizer == model.init_from
        and root.is_dir()
        and not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    ):
        return [
            f"model.init_from = {model.init_from!r}: it has no tokenizer (tokenizer.json); name one with data.tokenizer"
        ]
    return [
        f"model.{k} = {getattr(model, k)!r}: model.init_from = {model.init_from!r} has {k} {shape[k]!r} "
        f"(leave model.{k} unset)"
        for k in ("family", "n_layers", "n_heads", "d_model", "d_ff", "context", "tie_embeddings", "vocab_size")
        if getattr(model, k) is not None and getattr(model, k) != shape[k]
    ]


def settle_init_from(cfg: Any) -> None:
    """A run's config with ``model.init_from`` (a ``Config``, in place): a local directory becomes an
    absolute path (the workers' working directories differ from the job's), and the model's
    tokenizer becomes the data's where ``data.tokenizer`` is left ``char``."""
    init_from = cfg.model.init_from
    if _is_local(init_from):
        init_from = cfg.model.init_from = str(Path(init_from).expanduser().resolve())
    if cfg.data.tokenizer == "char":
        cfg.data.tokenizer = init_from
