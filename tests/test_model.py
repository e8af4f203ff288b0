"""Model presets, families and the loss (z-loss) numerics."""

from __future__ import annotations

import math

import pytest
import torch

from ray_diloco.config import ModelConfig
from ray_diloco.model import PRESETS, build_transformers_model, count_parameters, lm_loss, resolve_model_shape


def test_tiny_preset_is_the_baby_gpt_shape():
    shape = resolve_model_shape(ModelConfig(preset="tiny"), vocab_size=65)
    assert (shape["n_layers"], shape["n_heads"], shape["d_model"], shape["context"]) == (4, 4, 128, 64)
    n = count_parameters(build_transformers_model(shape))
    assert 0.7e6 < n < 1.1e6


def test_scaling_law_presets_match_the_paper_table():
    table = {"35m": (6, 8, 512, 2048), "90m": (9, 12, 768, 3072), "180m": (12, 16, 1024, 4096),
             "335m": (15, 20, 1280, 5120), "550m": (18, 24, 1536, 6144), "1.3b": (24, 32, 2048, 8192),
             "2.4b": (30, 40, 2560, 10240), "4b": (36, 48, 3072, 12288), "10b": (48, 64, 4096, 16384)}
    for name, dims in table.items():
        fam, layers, heads, d, ff, ctx, z = PRESETS[name]
        assert (layers, heads, d, ff) == dims and fam == "qwen3" and z == 1e-4 and ctx == 2048


def test_qwen3_has_qk_norm_and_overrides_win():
    shape = resolve_model_shape(ModelConfig(preset="tiny", family="qwen3", n_layers=2, d_model=32, n_heads=2, d_ff=64),
                                vocab_size=50)
    model = build_transformers_model(shape)
    names = [n for n, _ in model.named_parameters()]
    assert any("q_norm" in n for n in names) and any("k_norm" in n for n in names)
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 50


def test_z_loss_adds_mean_squared_logsumexp():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g) * 3
    targets = torch.randint(0, 7, (2, 3), generator=g)
    loss0, ce = lm_loss(logits, targets, 0.0)
    loss1, ce1 = lm_loss(logits, targets, 1e-4)
    lse = torch.logsumexp(logits.reshape(-1, 7), -1)
    assert torch.equal(loss0, ce) and torch.equal(ce, ce1)
    assert loss1.item() == pytest.approx(ce.item() + 1e-4 * (lse**2).mean().item(), rel=1e-6)
    uniform, _ = lm_loss(torch.zeros(1, 4, 7), torch.zeros(1, 4, dtype=torch.long))
    assert uniform.item() == pytest.approx(math.log(7), rel=1e-6)
