"""The global model as a model: built from flat fp32 fragments, exported for transformers."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import Config
from .errors import CheckpointError
from .fragments import param_specs, unflatten_into
from .model import ModelFn


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
    from .replica import build_model, fragment_plan

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


def export_model(cfg: Config, params: list[np.ndarray], vocab_size: int, tokenizer: Any, out_dir: Path,
                 model_fn: ModelFn | None = None) -> Path:
    """Write the global model: ``save_pretrained`` (+ tokenizer) for transformers models, so
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it; ``model.pt`` (state dict) otherwise."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = model_with_params(cfg, params, vocab_size, model_fn)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    else:
        torch.save(model.state_dict(), tmp / "model.pt")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    return out_dir
