"""Decoder-only language models built from a transformers config (no downloaded weights).

Families: ``gpt2`` (nanoGPT's GPT: learned positions, LayerNorm, GELU MLP), ``llama`` (RMSNorm,
RoPE, SwiGLU) and ``qwen3`` (llama plus QK-norm, as in the Scaling Laws for DiLoCo paper,
section 3). Presets: ``tiny`` (char-level, nanoGPT's CPU "baby GPT": its family and shape, so
the default run compares directly with nanoGPT and torchft on the same text), small CPU sizes,
and the scaling-law paper's sizes 35M ... 10B (Scaling Laws for DiLoCo, arXiv 2503.09799,
section 3: layers, heads, d_model, FFN).

A Python user may pass any ``model_fn(shape: dict, vocab_size: int) -> torch.nn.Module`` whose
``forward(input_ids)`` returns logits ``[batch, seq, vocab]`` (or an object with ``.logits``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ray_diloco.config import MAX_STEPS, Config
from ray_diloco.config.presets import (  # noqa: F401 (the presets moved to the config, torch-free; re-exported)
    LEGACY_PRESETS,
    PRESETS,
    SHAPE_FIELDS,
    pin_model_fields,
    resolve_model_shape,
)
from ray_diloco.errors import ConfigError

ModelFn = Callable[[dict[str, Any], int], torch.nn.Module]


def hf_config(shape: dict[str, Any]):
    """The transformers ``GPT2Config`` / ``LlamaConfig`` / ``Qwen3Config`` for a resolved shape."""
    from transformers import GPT2Config, LlamaConfig, Qwen3Config

    if shape["family"] == "gpt2":  # nanoGPT's GPT: learned positions, LayerNorm, GELU MLP, no dropout
        return GPT2Config(
            vocab_size=shape["vocab_size"],
            n_embd=shape["d_model"],
            n_inner=shape["d_ff"],
            n_layer=shape["n_layers"],
            n_head=shape["n_heads"],
            n_positions=shape["context"],
            activation_function="gelu",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            initializer_range=shape["init_std"],
            tie_word_embeddings=shape["tie_embeddings"],
            bos_token_id=None,
            eos_token_id=None,
            use_cache=False,
        )
    common = dict(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["d_model"],
        intermediate_size=shape["d_ff"],
        num_hidden_layers=shape["n_layers"],
        num_attention_heads=shape["n_heads"],
        num_key_value_heads=shape["n_heads"],
        max_position_embeddings=shape["context"],
        initializer_range=shape["init_std"],
        tie_word_embeddings=shape["tie_embeddings"],
        use_cache=False,
    )
    if shape["family"] == "qwen3":
        return Qwen3Config(head_dim=shape["d_model"] // shape["n_heads"], **common)
    return LlamaConfig(**common)


def build_transformers_model(
    shape: dict[str, Any], vocab_size: int | None = None, weights: bool = True
) -> torch.nn.Module:
    """Randomly initialised ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` (fp32,
    on CPU), or, when ``shape["init_from"]`` names a model, that model with its weights in fp32
    (:func:`pretrained_model`; ``weights`` False: its architecture only, for parameters that are
    about to be overwritten)."""
    from transformers import AutoModelForCausalLM

    if shape.get("init_from"):
        return pretrained_model(shape["init_from"], weights)
    if vocab_size is not None and shape.get("vocab_size") is None:
        shape = {**shape, "vocab_size": vocab_size}
    return AutoModelForCausalLM.from_config(hf_config(shape), attn_implementation="sdpa")


def pretrained_model(init_from: str, weights: bool = True) -> torch.nn.Module:
    """The model of ``model.init_from`` (a local directory or a hub id:
    :func:`~ray_diloco.config.pretrained.model_dir`), built from its own ``config.json`` (fields our
    shape does not name, such as ``num_key_value_heads`` or ``rope_theta``, included) with its
    weights in fp32 (bf16 files are widened; tied embeddings stay tied); the KV cache off, as
    for training. Under ``torch.device("meta")`` (counting parameters), or with ``weights``
    False (randomly initialised: a checkpoint's parameters go in next), no weights are read.

    Raises:
        ConfigError: the model cannot be found or read."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from ray_diloco.config.pretrained import config_dir, model_dir

    hf_logging.disable_progress_bar()  # no "Loading weights" bar from every worker
    if not weights or torch.empty(0).device.type == "meta":
        conf = AutoConfig.from_pretrained(config_dir(init_from))
        conf.use_cache = False
        return AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa")
    path = model_dir(init_from)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError([f"model.init_from = {init_from!r}: cannot load its weights ({e})".splitlines()[0]]) from None
    model.config.use_cache = False
    return model


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard one by one: a transformers model's decoder layers (its
    ``_no_split_modules`` classes), else the entries of every ``nn.ModuleList`` (a ``model_fn``'s
    blocks). Empty: only the root is sharded."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        blocks = [m for m in model.modules() if type(m).__name__ in names]
        if blocks:
            return blocks
    return [m for ml in model.modules() if isinstance(ml, torch.nn.ModuleList) for m in ml]


def compile_wanted(mode: str | bool, device: torch.device) -> bool:
    """``run.compile``: ``auto`` compiles on a CUDA device only; ``true``/``false`` (or a bool) force it."""
    if mode in ("auto", None):
        return device.type == "cuda"
    return mode in (True, "true")


def compile_blocks(model: torch.nn.Module) -> int:
    """``torch.compile`` each decoder block (:func:`decoder_blocks`) in place (``nn.Module.compile``:
    the module, its parameters and their names stay as they are), as torchtitan does: identical
    blocks share one compiled graph (one compile for all of them), and FSDP2 can shard the compiled
    blocks. A model without blocks is compiled whole, in place. Returns the modules compiled."""
    blocks = decoder_blocks(model) or [model]
    for block in blocks:
        block.compile()
    return len(blocks)


def count_parameters(model: torch.nn.Module) -> int:
    """Total elements of ``model.parameters()``."""
    return sum(p.numel() for p in model.parameters())


def logits_of(output: Any) -> torch.Tensor:
    """Logits ``[batch, seq, vocab]`` from a tensor or a transformers ``ModelOutput``."""
    return output if isinstance(output, torch.Tensor) else output.logits


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss. ``logits`` [B, T, V] (any float dtype), ``targets`` [B, T] int64.

    Returns ``(loss, ce)``: ``ce`` is the mean cross-entropy in nats/token (fp32) and
    ``loss = ce + z_loss * mean(logsumexp(logits)^2)`` (the z-loss of the scaling-law paper).
    """
    logits = logits.float()
    flat = logits.reshape(-1, logits.size(-1))
    ce = F.cross_entropy(flat, targets.reshape(-1))
    if z_loss > 0:
        return ce + z_loss * torch.logsumexp(flat, dim=-1).pow(2).mean(), ce
    return ce, ce


def budget_steps(cfg: Any, vocab_size: int, model_fn: ModelFn | None = None) -> int:
    """Inner steps of the token budget ``run.tokens_per_parameter x N`` (Scaling Laws for DiLoCo,
    section 3: D = 20N): ``ceil(D / (inner.global_batch x data.seq_len))``. N (parameters) is
    counted on the meta device, so nothing is allocated, even for a 10B model.

    Raises:
        ConfigError: the budget needs more than ``MAX_STEPS`` inner steps.
    """
    shape = resolve_model_shape(cfg.model, vocab_size)
    with torch.device("meta"):
        model = model_fn(shape, vocab_size) if model_fn is not None else build_transformers_model(shape)
    n = count_parameters(model)
    steps = max(1, math.ceil(cfg.run.tokens_per_parameter * n / (cfg.inner.global_batch * cfg.data.seq_len)))
    if steps > MAX_STEPS:
        raise ConfigError(
            [
                f"run.tokens_per_parameter = {cfg.run.tokens_per_parameter:g}: gives {steps:,} inner steps "
                f"for {n:,} parameters, more than the {MAX_STEPS:,} a run may have"
            ]
        )
    return steps


def build_model(cfg: Config, vocab_size: int, model_fn: ModelFn | None = None, weights: bool = True) -> torch.nn.Module:
    """The model with the run seed's initialisation, identical in every process (fp32);
    ``model.init_from``'s weights unless ``weights`` is False (parameters about to be overwritten)."""
    torch.manual_seed(cfg.run.seed)
    shape = resolve_model_shape(cfg.model, vocab_size)
    if model_fn is not None:
        return model_fn(shape, shape["vocab_size"])
    return build_transformers_model(shape, shape["vocab_size"], weights)


def make_inner_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and biases are not decayed); the fused
    CUDA kernel when the parameters are on a GPU (torch's default, for-each, on CPU)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    i = cfg.inner
    groups = [{"params": decay, "weight_decay": i.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = True if next(model.parameters()).is_cuda else None
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=i.lr, betas=(i.beta1, i.beta2), eps=i.eps, fused=fused
    )
