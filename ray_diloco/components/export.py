"""The global model as a model: built from flat fp32 fragments, exported for transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from ray_diloco.components.storage import remove_path, replace_dir
from ray_diloco.config import Config
from ray_diloco.core.fragments import Fragment, param_specs, unflatten_into
from ray_diloco.core.wire import as_tensor
from ray_diloco.errors import CheckpointError
from ray_diloco.models.transformer import ModelFn, resolve_model_shape

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def check_sizes(fragments: list, params: list[np.ndarray] | list[int]) -> None:
    """Raise :class:`CheckpointError` when saved fragments (arrays, or their sizes) do not fit the
    model's fragments."""
    have = [p if isinstance(p, int) else int(np.asarray(p).size) for p in params]
    want = [f.numel for f in fragments]
    if have != want:
        raise CheckpointError(
            f"checkpoint holds {sum(have):,} parameters in {len(have)} fragment(s) but the model has "
            f"{sum(want):,} in {len(want)}: the model config (or model_fn) differs from the one it was trained with"
        )


def model_with_params(
    cfg: Config, params: list[np.ndarray], vocab_size: int, model_fn: ModelFn | None = None
) -> torch.nn.Module:
    """A fresh model (fp32, CPU) holding ``params``: one fp32 array ``[numel_p]`` per fragment.

    Raises:
        CheckpointError: if the sizes do not match the model built from ``cfg`` / ``model_fn``.
    """
    from ray_diloco.core.fragments import fragment_plan
    from ray_diloco.models.transformer import build_model

    model = build_model(cfg, vocab_size, model_fn, weights=False)  # every parameter is overwritten below
    try:
        frags = fragment_plan(cfg, param_specs(model))
    except ValueError as e:
        raise CheckpointError(f"the model built from the run's config cannot hold these parameters: {e}") from None
    check_sizes(frags, params)
    named: dict[str, torch.Tensor] = dict(model.named_parameters())
    for f, arr in zip(frags, params):
        unflatten_into(named, f, torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)))
    return model


ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def for_inference(config: Any, tokenizer: Any) -> None:
    """Set an exported model config's special-token ids from the run's tokenizer (None where it has
    none: the char-level tokenizer has no BOS/EOS, and the config defaults 1 and 2 would make
    ``generate`` stop at whichever characters have those ids) and turn the KV cache back on."""
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, key, getattr(tokenizer, key, None) if tokenizer is not None else None)
    config.use_cache = True


def write_hf_config(
    cfg: Config, vocab_size: int, out_dir: Path, tokenizer: Any = None, dtype: torch.dtype = torch.float32
) -> None:
    """``config.json`` and ``generation_config.json`` of the run's model (a preset's transformers
    class and shape, or the ``model.init_from`` model's config; special tokens from ``tokenizer``,
    ``dtype`` the weights' dtype) into ``out_dir``, without building the model."""
    from transformers import GenerationConfig

    from ray_diloco.models.transformer import hf_config, resolve_model_shape

    shape = resolve_model_shape(cfg.model, vocab_size)
    if shape["init_from"]:  # the source model's own config: every field, ours or not, as it was
        from transformers import AutoConfig

        from ray_diloco.config.pretrained import model_dir

        config = AutoConfig.from_pretrained(model_dir(shape["init_from"]))
    else:
        config = hf_config(shape)
    config.architectures = [ARCHITECTURES[shape["family"]]]
    config.dtype = dtype
    for_inference(config, tokenizer)
    config.save_pretrained(str(out_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))


def write_hf_weights(
    fragments: list[Fragment],
    params: list[np.ndarray] | Callable[[int, int, int], np.ndarray],
    out_dir: Path,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 << 30,
) -> list[str]:
    """The parameters as safetensors named as in the model, in ``dtype``, in shards of at most
    ``max_shard_bytes`` (whole parameters in exchange order; ``model-00001-of-0000N.safetensors``
    and ``model.safetensors.index.json``, as ``save_pretrained`` writes them; one shard:
    ``model.safetensors``): at most one shard's tensors exist at a time besides ``params``.
    Returns the files written.

    Args:
        fragments: the run's fragment plan (names and shapes).
        params: one fp32 array ``[numel_p]`` per fragment, or a reader ``(fragment, start, stop)
            -> fp32 array`` of that fragment's values ``[start, stop)``, called once per parameter
            (the driver's outer shards: no copy of the whole model is made).

    Raises:
        CheckpointError: arrays (or values read) of the wrong size.
    """
    import json

    from safetensors.torch import save_file

    itemsize = torch.empty(0, dtype=dtype).element_size()
    groups: list[list[tuple[int, int, Any]]] = [[]]  # (fragment, offset in it, param), shard by shard
    size = 0
    for i, f in enumerate(fragments):
        off = 0
        for p in f.params:  # in exchange order; a shard ends before the parameter that would pass the limit
            b = p.numel * itemsize
            if groups[-1] and size + b > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append((i, off, p))
            size += b
            off += p.numel
    n = len(groups)
    names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    if callable(params):
        read = params
    else:
        check_sizes(fragments, params)
        read = lambda i, start, stop: np.asarray(params[i], dtype=np.float32).reshape(-1)[start:stop]  # noqa: E731
    weight_map, total = {}, 0
    for name, group in zip(names, groups):
        tensors: dict[str, torch.Tensor] = {}
        for i, off, p in group:
            values = np.asarray(read(i, off, off + p.numel), dtype=np.float32)
            if values.size != p.numel:
                raise CheckpointError(f"parameter {p.name}: {values.size:,} values read, expected {p.numel:,}")
            # a copy each: safetensors stores whole storages, not views of a fragment
            tensors[p.name] = as_tensor(values).to(dtype, copy=True).view(p.shape)
            weight_map[p.name] = name
            total += p.numel * itemsize
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        del tensors
    if n > 1:
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
        names.append("model.safetensors.index.json")
    return names


def _save_tokenizer(tokenizer: Any, out_dir: Path, context: int) -> None:
    """``save_pretrained`` with ``model_max_length`` = the model's context (tokens), so that
    ``tok(text, truncation=True)`` keeps inputs within the positions the model has."""
    before = tokenizer.model_max_length
    tokenizer.model_max_length = context
    try:
        tokenizer.save_pretrained(str(out_dir))
    finally:
        tokenizer.model_max_length = before


def export_dtype(cfg: Config) -> torch.dtype:
    """The exported weights' dtype: ``run.export_precision``, else ``run.precision``."""
    return torch.bfloat16 if (cfg.run.export_precision or cfg.run.precision) == "bf16" else torch.float32


def export_model(
    cfg: Config,
    params: list[np.ndarray] | Callable[[], list[np.ndarray]],
    vocab_size: int,
    tokenizer: Any,
    out_dir: Path,
    model_fn: ModelFn | None = None,
    fragments: list[Fragment] | None = None,
    write_weights: Callable[[Path, torch.dtype], bool] | None = None,
) -> Path:
    """Write the global model atomically (a ``.tmp`` directory renamed): a transformers checkpoint
    (+ tokenizer) for the presets, so ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it
    (when the run's ``fragments`` are given: :func:`write_hf_config` here and the weights in
    :func:`export_dtype` by ``write_weights(dir, dtype)``, the process holding them, or when it
    returns False by :func:`write_hf_weights` here; else the model's own ``save_pretrained``, fp32);
    ``model.pt`` (the state dict) for a ``model_fn`` model. ``params``: one fp32 array per
    fragment, or a callable fetching them (called only when this process writes the weights)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    remove_path(tmp)
    tmp.mkdir(parents=True)
    # the tokenizer's model_max_length: the preset's context, or the sequence length a model_fn model trained on
    context = cfg.data.seq_len if model_fn is not None else resolve_model_shape(cfg.model, vocab_size)["context"]
    if model_fn is None and fragments is not None:
        dtype = export_dtype(cfg)
        write_hf_config(cfg, vocab_size, tmp, tokenizer, dtype)
        if write_weights is None or not write_weights(tmp, dtype):
            write_hf_weights(fragments, params() if callable(params) else params, tmp, dtype)
        if tokenizer is not None:
            _save_tokenizer(tokenizer, tmp, context)
    else:
        model = model_with_params(cfg, params() if callable(params) else params, vocab_size, model_fn)
        if hasattr(model, "save_pretrained"):
            hf = cast("PreTrainedModel", model)  # a transformers model
            if getattr(hf, "config", None) is not None and tokenizer is not None:
                for_inference(hf.config, tokenizer)
                if getattr(hf, "generation_config", None) is not None:
                    from transformers import GenerationConfig

                    hf.generation_config = GenerationConfig.from_model_config(hf.config)
            hf.save_pretrained(str(tmp))
            if tokenizer is not None:
                _save_tokenizer(tokenizer, tmp, context)
        else:
            torch.save(model.state_dict(), tmp / "model.pt")
    replace_dir(tmp, out_dir, out_dir.with_name(out_dir.name + ".old"))  # a kill leaves the old export or the new one
    return out_dir
