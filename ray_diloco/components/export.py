"""The global model as a model: built from flat fp32 fragments, exported for transformers."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ray_diloco.config import Config
from ray_diloco.errors import CheckpointError
from ray_diloco.core.fragments import Fragment, param_specs, unflatten_into
from ray_diloco.models.transformer import ModelFn, resolve_model_shape


def check_sizes(fragments: list, params: list[np.ndarray]) -> None:
    """Raise :class:`CheckpointError` when saved fragments do not fit the model's fragments."""
    have = [int(np.asarray(p).size) for p in params]
    want = [f.numel for f in fragments]
    if have != want:
        raise CheckpointError(
            f"checkpoint holds {sum(have):,} parameters in {len(have)} fragment(s) but the model has "
            f"{sum(want):,} in {len(want)}: the model config (or model_fn) differs from the one it was trained with"
        )


def model_with_params(cfg: Config, params: list[np.ndarray], vocab_size: int,
                      model_fn: ModelFn | None = None) -> torch.nn.Module:
    """A fresh model (fp32, CPU) holding ``params``: one fp32 array ``[numel_p]`` per fragment.

    Raises:
        CheckpointError: if the sizes do not match the model built from ``cfg`` / ``model_fn``.
    """
    from ray_diloco.core.fragments import fragment_plan
    from ray_diloco.models.transformer import build_model

    model = build_model(cfg, vocab_size, model_fn)
    try:
        frags = fragment_plan(cfg, param_specs(model))
    except ValueError as e:
        raise CheckpointError(f"the model built from the run's config cannot hold these parameters: {e}") from None
    check_sizes(frags, params)
    named = dict(model.named_parameters())
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


def write_pretrained(cfg: Config, fragments: list[Fragment], params: list[np.ndarray], vocab_size: int,
                     out_dir: Path, tokenizer: Any = None) -> None:
    """A transformers checkpoint of a preset model without building the model: ``config.json``,
    ``generation_config.json`` and the parameters as safetensors (``huggingface_hub``'s
    ``save_torch_state_dict``, sharded at 5 GB like ``save_pretrained``), named as in the
    model. No model is built (nor its modelling code imported, nor its weights initialised) in
    the process that exports, which can be the run's driver on a CPU-only head node.

    Args:
        fragments: the run's fragment plan (names and shapes, exchange order); ``params`` one fp32
            array ``[numel_p]`` per fragment.
    """
    from huggingface_hub import save_torch_state_dict
    from transformers import GenerationConfig

    from ray_diloco.models.transformer import hf_config, resolve_model_shape

    check_sizes(fragments, params)
    shape = resolve_model_shape(cfg.model, vocab_size)
    config = hf_config(shape)
    config.architectures = [ARCHITECTURES[shape["family"]]]
    config.dtype = torch.float32
    for_inference(config, tokenizer)
    config.save_pretrained(str(out_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))
    tensors: dict[str, torch.Tensor] = {}
    for f, arr in zip(fragments, params):
        flat = np.asarray(arr, dtype=np.float32)
        off = 0
        for p in f.params:  # a copy each: safetensors stores whole storages, not views of a fragment
            tensors[p.name] = torch.tensor(flat[off : off + p.numel]).view(p.shape)
            off += p.numel
    save_torch_state_dict(tensors, str(out_dir))


def _save_tokenizer(tokenizer: Any, out_dir: Path, context: int) -> None:
    """``save_pretrained`` with ``model_max_length`` = the model's context (tokens), so that
    ``tok(text, truncation=True)`` keeps inputs within the positions the model has."""
    before = tokenizer.model_max_length
    tokenizer.model_max_length = context
    try:
        tokenizer.save_pretrained(str(out_dir))
    finally:
        tokenizer.model_max_length = before


def export_model(cfg: Config, params: list[np.ndarray], vocab_size: int, tokenizer: Any, out_dir: Path,
                 model_fn: ModelFn | None = None, fragments: list[Fragment] | None = None) -> Path:
    """Write the global model atomically (a ``.tmp`` directory renamed): a transformers checkpoint
    (+ tokenizer) for the presets, so ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it
    (:func:`write_pretrained` when the run's ``fragments`` are given, else the model's own
    ``save_pretrained``); ``model.pt`` (the state dict) for a ``model_fn`` model."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    _remove(tmp)
    tmp.mkdir(parents=True)
    # the tokenizer's model_max_length: the preset's context, or the sequence length a model_fn model trained on
    context = cfg.data.seq_len if model_fn is not None else resolve_model_shape(cfg.model, vocab_size)["context"]
    if model_fn is None and fragments is not None:
        write_pretrained(cfg, fragments, params, vocab_size, tmp, tokenizer)
        if tokenizer is not None:
            _save_tokenizer(tokenizer, tmp, context)
    else:
        model = model_with_params(cfg, params, vocab_size, model_fn)
        if hasattr(model, "save_pretrained"):
            if getattr(model, "config", None) is not None and tokenizer is not None:
                for_inference(model.config, tokenizer)
                if getattr(model, "generation_config", None) is not None:
                    from transformers import GenerationConfig

                    model.generation_config = GenerationConfig.from_model_config(model.config)
            model.save_pretrained(str(tmp))
            if tokenizer is not None:
                _save_tokenizer(tokenizer, tmp, context)
        else:
            torch.save(model.state_dict(), tmp / "model.pt")
    old = out_dir.with_name(out_dir.name + ".old")  # swap: a kill leaves the old export or the new one
    _remove(old)
    if out_dir.exists() or out_dir.is_symlink():
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    _remove(old)
    return out_dir


def _remove(path: Path) -> None:
    """Delete a directory tree, a file or a link (not what a link points to); nothing if absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
