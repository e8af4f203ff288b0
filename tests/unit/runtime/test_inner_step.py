"""The replica worker's inner step, run in this process (no Ray actor): gradient accumulation over
micro-batches, activation checkpointing, and what a worker hands out being on the host."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from helpers import tiny_overrides, torch_lm

from ray_diloco.config import load_config
from ray_diloco.errors import ConfigError
from ray_diloco.models.transformer import build_model, lm_loss, logits_of
from ray_diloco.runtime.inner_loop import accumulate_gradients, to_host
from ray_diloco.runtime.replica import ReplicaWorker


def _batch(vocab: int, b: int = 8, t: int = 16):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, vocab, (b, t), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("z_loss", [0.0, 1e-4])
def test_accumulated_micro_batches_give_the_whole_batch_gradient(tmp_path, z_loss):
    cfg = load_config(tiny_overrides(tmp_path))
    model = build_model(cfg, 50)
    x, y = _batch(50)
    whole = accumulate_gradients(model, x, y, 8, z_loss, nullcontext, torch.device("cpu"))
    g_whole = _grads(model)
    model.zero_grad(set_to_none=True)
    parts = accumulate_gradients(model, x, y, 2, z_loss, nullcontext, torch.device("cpu"))
    g_parts = _grads(model)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)
    for n in g_whole:
        torch.testing.assert_close(g_parts[n], g_whole[n], rtol=1e-5, atol=1e-7)
    # and it is the mean of the per-micro-batch gradients, not their sum
    model.zero_grad(set_to_none=True)
    loss, _ = lm_loss(logits_of(model(x[:2])), y[:2], z_loss)
    loss.backward()
    first = _grads(model)
    assert not all(torch.allclose(first[n], g_whole[n], rtol=1e-3) for n in first)
    big = {n: 4 * g for n, g in g_whole.items()}
    assert not all(torch.allclose(g_parts[n], big[n], rtol=1e-2) for n in big)


def _worker(tmp_path, corpus, model_fn=None, **extra) -> ReplicaWorker:
    cfg = load_config(tiny_overrides(tmp_path, diloco__replicas=1, inner__global_batch=8, **extra))
    w = ReplicaWorker(cfg.to_dict(), 0, 0, 1, 0, 1, corpus.vocab_size, model_fn)
    w.setup(None, corpus.train, corpus.val)
    return w


def test_a_worker_with_micro_batches_trains_like_one_with_the_whole_batch(tmp_path, corpus):
    whole = _worker(tmp_path, corpus)
    parts = _worker(tmp_path, corpus, inner__micro_batch=2)
    a, b = whole.train(0, 3), parts.train(0, 3)
    assert a["data_digest"] == b["data_digest"] and a["tokens"] == b["tokens"]
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
    torch.testing.assert_close(torch.from_numpy(parts.local_fragment(0)), torch.from_numpy(whole.local_fragment(0)),
                               rtol=1e-4, atol=1e-5)


def test_activation_checkpointing_changes_no_number(tmp_path, corpus):
    """Recomputing the blocks' activations in the backward pass gives the same gradients, so the same
    parameters, bitwise (deterministic CPU kernels)."""
    plain = _worker(tmp_path, corpus, run__deterministic=True)
    ckpt = _worker(tmp_path, corpus, run__deterministic=True, run__activation_checkpointing=True)
    assert ckpt.parts.model.is_activation_checkpointing and not plain.parts.model.is_activation_checkpointing
    a, b = plain.train(0, 3), ckpt.train(0, 3)
    assert a["train_loss"] == b["train_loss"]
    assert plain.params_hash() == ckpt.params_hash()


def test_activation_checkpointing_of_a_model_without_it_is_one_config_line(tmp_path, corpus):
    cfg = load_config(tiny_overrides(tmp_path, run__activation_checkpointing=True))
    w = ReplicaWorker(cfg.to_dict(), 0, 0, 1, 0, 1, corpus.vocab_size, torch_lm)
    with pytest.raises(ConfigError, match=r"run.activation_checkpointing = true: the model \(TorchLM\)"):
        w.setup(None, corpus.train, corpus.val)


def test_states_leaving_a_worker_are_host_copies(tmp_path, corpus):
    w = _worker(tmp_path, corpus)
    w.train(0, 2)
    state = w.state_dict()
    opt = state["optimizer"]["state"]
    live = w.parts.optimizer.state_dict()["state"]
    for k, s in opt.items():
        for name, t in s.items():
            if isinstance(t, torch.Tensor):
                assert t.device.type == "cpu"
                assert t.data_ptr() != live[k][name].data_ptr()  # a copy: training on does not change it
    before = copy.deepcopy(opt)
    w.train(2, 3)
    assert all(torch.equal(before[k]["exp_avg"], opt[k]["exp_avg"]) for k in opt)
    nested = to_host({"a": [torch.ones(2), (torch.zeros(1), 3)], "b": "x"})
    assert nested["a"][1][1] == 3 and isinstance(nested["a"][1], tuple) and nested["b"] == "x"


@pytest.mark.slow
def test_a_compiled_worker_trains_like_the_eager_one_and_compiles_only_once(tmp_path, corpus):
    """``run.compile: true`` (on CPU; ``auto`` compiles on CUDA only): each decoder block compiled in
    place (inductor, C++ on CPU: about 30 s of compiling here) gives the loss and parameters of the
    eager model within fp32 rounding; the compiling first step is its own metric (``compile_s``, not
    in ``compute_s``). Then what outer steps do to a worker compiles nothing more (dynamo's
    counters): a merge's new local parameters written in place, a checkpoint's state loaded (a
    resume, a joiner taking a peer's state), evaluations, more inner steps."""
    import numpy as np
    from torch._dynamo.utils import counters

    from ray_diloco.models.transformer import decoder_blocks

    eager = _worker(tmp_path, corpus, run__deterministic=True)  # auto: off on CPU
    compiled = _worker(tmp_path, corpus, run__deterministic=True, run__compile=True)
    assert compiled.loop.compiling and not eager.loop.compiling
    blocks = decoder_blocks(compiled.parts.model)
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)  # in place: names unchanged
    assert [n for n, _ in compiled.parts.model.named_parameters()] == [n for n, _ in eager.parts.model.named_parameters()]
    a, b = eager.train(0, 3), compiled.train(0, 3)
    assert a["compile_s"] == 0 and b["compile_s"] > 1.0 and b["compute_s"] < b["compile_s"]
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
    torch.testing.assert_close(torch.from_numpy(compiled.local_fragment(0)), torch.from_numpy(eager.local_fragment(0)),
                               rtol=1e-4, atol=1e-5)
    windows = np.arange(3)
    compiled.evaluate(windows)  # the evaluation's graph (no grad), compiled once
    graphs = counters["stats"]["unique_graphs"]
    n_frag = compiled.num_fragments()
    for k in range(1, 4):
        compiled.load_local([eager.local_fragment(f) for f in range(n_frag)])  # a merge's new values, in place
        compiled.load_state_dict(compiled.state_dict())  # a checkpoint's state
        m = compiled.train(3 * k, 3 * k + 3)
        compiled.evaluate(windows)
        assert m["compile_s"] == 0
    assert counters["stats"]["unique_graphs"] == graphs
