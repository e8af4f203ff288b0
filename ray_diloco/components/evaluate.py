"""Offline use of a finished or running run: validation loss of a checkpoint, sampling.

Both run in this process (no Ray needed) on CPU, or on the first GPU when one is present; the
evaluation on a Ray cluster's devices is ``runtime/evaluation.py`` (it reads through
:func:`eval_input` too).
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ray_diloco.components.checkpoint import (
    checkpoint_config,
    global_params,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
)
from ray_diloco.components.data import Split, eval_split, load_corpus, val_batch, val_windows
from ray_diloco.components.export import model_with_params
from ray_diloco.components.token_store import load_saved_tokenizer
from ray_diloco.errors import CheckpointError, RayDilocoError
from ray_diloco.log import error_line
from ray_diloco.models.transformer import lm_loss, logits_of


def run_autocast(precision: str, device: torch.device):
    """The autocast of a run's ``run.precision`` on ``device``, as a context factory (bf16:
    ``torch.autocast`` to bfloat16, as the run's workers evaluate; fp32: none)."""
    if precision == "bf16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext


@torch.no_grad()
def evaluate_loss(
    model: torch.nn.Module,
    tokens: Split,
    seq_len: int,
    windows: np.ndarray,
    batch: int,
    autocast=nullcontext,
    min_batches: int = 0,
) -> tuple[float, int]:
    """Summed next-token cross-entropy (nats) and token count of ``model`` over validation
    ``windows`` (indices of non-overlapping ``seq_len`` windows of the ``tokens`` split). The sum
    stays on the model's device (fp64) and is read once at the end. ``min_batches``: forward
    passes made at least (the extra ones on window 0, not counted): the ranks of an FSDP replica
    must make as many as each other."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for s in range(0, len(windows), batch):
        x, y = val_batch(tokens, seq_len, windows[s : s + batch])
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast():
            logits = logits_of(model(x))
        _, ce = lm_loss(logits, y, 0.0)
        total += ce.double() * y.numel()
        count += y.numel()
    for _ in range(min_batches - -(-len(windows) // batch)):
        x, _ = val_batch(tokens, seq_len, np.zeros(1, dtype=np.int64))
        with autocast():
            model(x.to(device))
    model.train(was_training)
    return float(total), count


def _tokenizer(run_dir: Path):
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory {run_dir}: not found")
    tok_dir = run_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file() and not (tok_dir / "tokenizer_config.json").is_file():
        raise CheckpointError(f"run directory {run_dir}: no tokenizer in {tok_dir}")
    return load_saved_tokenizer(tok_dir)


def model_from_checkpoint(state: dict, vocab_size: int, model_fn=None, run_dir: Path | None = None) -> torch.nn.Module:
    """The model holding a checkpoint's global parameters (DP: rank 0's parameters), fp32 CPU.

    Raises:
        CheckpointError: the run used a custom ``model_fn`` and none is given, or shapes differ.
    """
    if state.get("custom_model") and model_fn is None:
        raise CheckpointError(
            f"run {run_dir or ''} was trained with a custom model_fn (Python API): evaluate or sample it from "
            "Python with ray_diloco.components.evaluate.evaluate_run(run_dir, model_fn=...) / generate(..., model_fn=...)"
        )
    cfg = checkpoint_config(state)
    return model_with_params(cfg, global_params(state), vocab_size, model_fn)


@dataclass
class EvalInput:
    """What an offline evaluation of one checkpoint reads: its lazily loaded ``state`` (``outer.pt``
    named, not read), the run's ``cfg``, the validation tokens ``val`` (int32, cut to
    ``run.eval_tokens``), the tokenizer's ``vocab_size``, the outer ``step`` and the checkpoint ``path``."""

    state: dict
    cfg: Any
    val: np.ndarray
    vocab_size: int
    step: int
    path: Path


def eval_input(run_dir: str | Path, step: int | None = None, corpus=None) -> EvalInput:
    """The checkpoint of outer step ``step`` (default: the newest) of ``run_dir`` and its validation
    tokens (``corpus``: the one a run trained from Python used; default: the run's config's).

    Raises:
        CheckpointError: missing run directory, checkpoint or tokenizer; corrupt checkpoint; a
            corpus that differs from the one the run was trained with.
    """
    run_dir = Path(run_dir)
    if step is None:
        step, path = latest_checkpoint(run_dir)
    else:
        found = dict(list_checkpoints(run_dir))
        if step not in found:
            raise CheckpointError(f"--step {step}: no such checkpoint in {run_dir} (have: {sorted(found) or 'none'})")
        path = found[step]
    state = load_checkpoint(path, lazy=True)  # global_params reads outer.pt only, not the workers' files
    cfg = checkpoint_config(state)
    if corpus is None:
        corpus = load_corpus(cfg.data, tokenizer=_tokenizer(run_dir))
    # the run recorded the fingerprint of its corpus with the validation split cut as here
    corpus = dataclasses.replace(corpus, val=eval_split(corpus.val, cfg.run.eval_tokens))
    if state.get("corpus_fingerprint") not in (None, corpus.fingerprint):
        raise CheckpointError(
            f"run {run_dir}: its corpus differs from {cfg.data.path or 'the bundled corpus'} "
            "(trained on a corpus passed from Python? pass corpus=...)"
        )
    return EvalInput(state, cfg, np.asarray(corpus.val), corpus.vocab_size, step, path)


def evaluate_run(run_dir: str | Path, step: int | None = None, model_fn=None, corpus=None) -> tuple[float, int, Path]:
    """Validation loss (nats/token) of a run's checkpoint over the validation tokens the run's
    evaluations read (``run.eval_tokens``), in the run's ``run.precision``, in this process on
    the first GPU or else the CPU (on a Ray cluster's devices:
    :func:`ray_diloco.runtime.evaluation.evaluate_run_on_cluster`).

    ``model_fn`` and ``corpus`` are needed for runs trained with them from Python.
    Returns ``(loss, outer_step, checkpoint_path)``.

    Raises:
        CheckpointError: missing run directory, checkpoint or tokenizer; corrupt checkpoint;
            a model or corpus that differs from the one the run was trained with.
    """
    e = eval_input(run_dir, step, corpus)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    total, count = evaluate_checkpoint(
        e.state, e.vocab_size, e.val, np.arange(val_windows(e.val, e.cfg.data.seq_len)), device, model_fn, Path(run_dir)
    )
    return total / count, e.step, e.path


def evaluate_checkpoint(
    state: dict,
    vocab_size: int,
    tokens: np.ndarray,
    windows: np.ndarray,
    device: torch.device,
    model_fn=None,
    run_dir: Path | None = None,
) -> tuple[float, int]:
    """Summed loss (nats) and token count of a checkpoint's global parameters over validation
    ``windows`` (int ``[k]`` of ``tokens``), the model built on ``device`` and evaluated as the run
    evaluates (its ``seq_len``, ``eval_batch``, ``run.precision``); the model is freed after.

    Raises:
        CheckpointError: as :func:`model_from_checkpoint`."""
    cfg = checkpoint_config(state)
    model = model_from_checkpoint(state, vocab_size, model_fn, run_dir).to(device)
    out = evaluate_loss(
        model, tokens, cfg.data.seq_len, windows, cfg.run.eval_batch, run_autocast(cfg.run.precision, device)
    )
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def generate(
    run_dir: str | Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
    model_fn=None,
) -> str:
    """Sample a continuation of ``prompt`` from the run's export (``final/``) or newest checkpoint.

    Raises:
        CheckpointError: as :func:`evaluate_run`.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    run_dir = Path(run_dir)
    tok = _tokenizer(run_dir)
    final = run_dir / "final"
    model: torch.nn.Module
    if (final / "config.json").is_file() and model_fn is None:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(str(final))
        except Exception as e:
            raise CheckpointError(f"exported model {final}: cannot be loaded ({error_line(e, limit=200)})") from None
    else:
        state = load_checkpoint(latest_checkpoint(run_dir)[1], lazy=True)
        model = model_from_checkpoint(state, len(tok), model_fn, run_dir)
    model.eval()
    try:
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    except Exception:
        known = set(tok.get_vocab())
        unknown = sorted({c for c in prompt if c not in known})
        raise RayDilocoError(
            f"--prompt {prompt[:40]!r}: the run's tokenizer cannot encode it "
            f"(unknown characters: {''.join(unknown)[:40]!r})"
        ) from None
    if ids.numel() == 0:
        ids = torch.zeros((1, 1), dtype=torch.long)
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if context is None:  # a custom model_fn: slide a window of the trained sequence length
        context = checkpoint_config(state).data.seq_len
    torch.manual_seed(seed)
    out = ids
    with torch.no_grad():  # a plain sampling loop: the context window slides, as in nanoGPT
        for _ in range(max_new_tokens):
            logits = logits_of(model(out[:, -context:]))[:, -1, :].double()
            logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature  # <= 0: no overflow
            if top_k > 0:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1)
            out = torch.cat([out, nxt], dim=1)
    return tok.decode(out[0].tolist())
