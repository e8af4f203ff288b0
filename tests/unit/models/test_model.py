"""Model presets, families and the loss (z-loss) numerics."""

from __future__ import annotations

import math

import pytest
import torch

from ray_diloco.config import ModelConfig
from ray_diloco.models.transformer import (
    PRESETS,
    build_transformers_model,
    count_parameters,
    lm_loss,
    resolve_model_shape,
)


def test_tiny_preset_is_the_baby_gpt_shape():
    """nanoGPT's CPU baby GPT: GPT-2 blocks (LayerNorm, GELU MLP of 4 x width, learned positions),
    4 layers, 4 heads, width 128, context 64, no dropout; the head is untied here (nanoGPT ties it)."""
    shape = resolve_model_shape(ModelConfig(preset="tiny"), vocab_size=65)
    assert (shape["family"], shape["n_layers"], shape["n_heads"], shape["d_model"], shape["d_ff"],
            shape["context"]) == ("gpt2", 4, 4, 128, 512, 64)
    model = build_transformers_model(shape)
    assert type(model).__name__ == "GPT2LMHeadModel"
    cfg = model.config
    assert cfg.resid_pdrop == cfg.embd_pdrop == cfg.attn_pdrop == 0.0 and cfg.activation_function == "gelu"
    d, ff, v, ctx = 128, 512, 65, 64
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d)  # 2 LayerNorms, attn, MLP
    assert count_parameters(model) == 4 * block + v * d + ctx * d + 2 * d + v * d  # + wte, wpe, ln_f, head


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_every_family_exports_and_loads_in_transformers_with_the_same_logits(family, tmp_path):
    """The export path of a run (parameters by fragment, no model built) gives a checkpoint that
    ``AutoModelForCausalLM`` loads with every parameter and the same logits, for each family;
    streaming fragments find each family's blocks."""
    from transformers import AutoModelForCausalLM

    from ray_diloco.components.export import write_hf_config, write_hf_weights
    from ray_diloco.config import load_config
    from ray_diloco.core.fragments import block_index, flatten, param_specs, plan_fragments

    cfg = load_config({"model": {"family": family, "n_layers": 3, "n_heads": 2, "d_model": 32, "d_ff": 64,
                                 "context": 16}, "data": {"seq_len": 16}})
    torch.manual_seed(0)
    model = build_transformers_model(resolve_model_shape(cfg.model, 50)).eval()
    specs = param_specs(model)
    assert sorted({block_index(s.name) for s in specs} - {None}) == [0, 1, 2]
    frags = plan_fragments(specs, 3)
    named = dict(model.named_parameters())
    write_hf_config(cfg, 50, tmp_path)  # without building the model: its config, then its weights
    write_hf_weights(frags, [flatten(named, f).detach().numpy() for f in frags], tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(loaded) is type(model)
    x = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_bf16_export_in_several_shards_loads_in_transformers(tmp_path):
    """``write_hf_weights`` of one fragment in bf16 with a small shard limit: several ``model-0000k-of-0000n``
    files and the index, as ``save_pretrained`` writes them; ``from_pretrained`` loads every
    parameter as the bf16 rounding of the fp32 one, and the logits follow the fp32 model's."""
    import json

    from transformers import AutoModelForCausalLM

    from ray_diloco.components.export import write_hf_config, write_hf_weights
    from ray_diloco.config import load_config
    from ray_diloco.core.fragments import flatten, param_specs, plan_fragments

    cfg = load_config({"model": {"family": "qwen3", "n_layers": 3, "n_heads": 2, "d_model": 32, "d_ff": 64,
                                 "context": 16}, "data": {"seq_len": 16}, "run": {"precision": "bf16"}})
    torch.manual_seed(0)
    model = build_transformers_model(resolve_model_shape(cfg.model, 50)).eval()
    frags = plan_fragments(param_specs(model), 1)  # one fragment (plain DiLoCo) still splits by parameter
    named = dict(model.named_parameters())
    write_hf_config(cfg, 50, tmp_path, None, torch.bfloat16)
    names = write_hf_weights(frags, [flatten(named, f).detach().numpy() for f in frags], tmp_path, torch.bfloat16,
                             max_shard_bytes=20_000)
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(named) and set(index["weight_map"].values()) == set(shards)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert loaded.dtype == torch.bfloat16
    for k, v in loaded.named_parameters():
        assert torch.equal(v, named[k].detach().to(torch.bfloat16)), k
    x = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits.float(), model(x).logits, atol=0.05)


def test_scaling_law_presets_match_the_paper_table_and_their_names_parameters():
    """Layers, heads and width are the paper's (arXiv 2503.09799, section 3); the SwiGLU width is 2/3
    of its FFN (rounded to 128), embeddings tied: at its 32768 vocabulary each size has its name's
    parameters within 5% (before 2026-12-02 they were 1.3-1.7x: ``1.3b`` had 1.75B)."""
    table = {"35m": (6, 8, 512, 2048), "90m": (9, 12, 768, 3072), "180m": (12, 16, 1024, 4096),
             "335m": (15, 20, 1280, 5120), "550m": (18, 24, 1536, 6144), "1.3b": (24, 32, 2048, 8192),
             "2.4b": (30, 40, 2560, 10240), "4b": (36, 48, 3072, 12288), "10b": (48, 64, 4096, 16384)}
    for name, (layers_, heads_, d_, ffn) in table.items():
        fam, layers, heads, d, ff, ctx, z, tied = PRESETS[name]
        assert (layers, heads, d) == (layers_, heads_, d_) and fam == "qwen3" and z == 1e-4 and ctx == 2048 and tied
        assert ff % 128 == 0 and abs(ff - 2 * ffn / 3) <= 64
        shape = resolve_model_shape(ModelConfig(preset=name), vocab_size=32768)
        with torch.device("meta"):
            n = count_parameters(build_transformers_model(shape))
        named = float(name[:-1]) * (1e9 if name.endswith("b") else 1e6)
        assert abs(n / named - 1) < 0.05, (name, n)


def test_a_run_recorded_before_the_presets_were_honest_keeps_its_model():
    from ray_diloco.config.presets import pin_model_fields

    old = pin_model_fields(ModelConfig(preset="1.3b"), recorded_before_pinning=True)
    assert (old.d_ff, old.tie_embeddings) == (8192, False)
    new = pin_model_fields(ModelConfig(preset="1.3b"))
    assert (new.d_ff, new.tie_embeddings) == (5504, True)
    assert pin_model_fields(ModelConfig(preset="35m", tie_embeddings=False)).tie_embeddings is False


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
