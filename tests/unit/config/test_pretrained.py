"""model.init_from without Ray: the shape and tokenizer a saved model gives a run, its errors, its
weights as the model the workers build."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import save_tiny_model

from ray_diloco.config import load_config, resolve_model_shape
from ray_diloco.errors import ConfigError
from ray_diloco.models.transformer import build_model, count_parameters

TEXT = "To be, or not to be, that is the question.\n" * 20


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("m") / "tiny-llama", TEXT)


def test_the_saved_models_shape_and_tokenizer_are_the_runs(llama_dir, monkeypatch):
    monkeypatch.chdir(llama_dir.parent)
    cfg = load_config({"model": {"init_from": "./tiny-llama"}})  # relative: made absolute for the workers
    assert cfg.model.init_from == str(llama_dir) and cfg.data.tokenizer == str(llama_dir)
    shape = resolve_model_shape(cfg.model, vocab_size=1)
    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    assert {k: shape[k] for k in ("family", "n_layers", "n_heads", "d_model", "d_ff", "context", "vocab_size",
                                  "tie_embeddings", "z_loss")} == {
        "family": "llama", "n_layers": 2, "n_heads": 4, "d_model": 32, "d_ff": 64, "context": 64,
        "vocab_size": vocab, "tie_embeddings": False, "z_loss": 0.0}  # fmt: skip
    # a tokenizer named is kept; a shape field set to the file's value is no conflict
    cfg = load_config({"model": {"init_from": str(llama_dir), "n_layers": 2}, "data": {"tokenizer": "bpe"}})
    assert cfg.data.tokenizer == "bpe"


def test_a_conflicting_shape_field_and_a_model_that_is_not_there_are_one_line(llama_dir, tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config({"model": {"init_from": str(llama_dir)}}, ["model.n_layers=3", "model.family=gpt2"])
    assert e.value.problems == [
        f"model.family = 'gpt2': model.init_from = '{llama_dir}' has family 'llama' (leave model.family unset)",
        f"model.n_layers = 3: model.init_from = '{llama_dir}' has n_layers 2 (leave model.n_layers unset)",
    ]
    (tmp_path / "empty").mkdir()
    (tmp_path / "mistral").mkdir()
    (tmp_path / "mistral" / "config.json").write_text('{"model_type": "mistral"}')
    (tmp_path / "no-tokenizer").mkdir()
    (tmp_path / "no-tokenizer" / "config.json").write_text((llama_dir / "config.json").read_text())
    for init_from, why in [
        (str(tmp_path / "nope"), "no such directory"),
        (str(tmp_path / "empty"), "it has no config.json (a transformers model directory)"),
        (str(tmp_path / "mistral"), "model_type 'mistral'; the trainer builds gpt2, llama, qwen3"),
        ("nobody/no-such-model", "not a local model directory, and the Hugging Face hub cannot give it ("),
        (str(tmp_path / "no-tokenizer"), "it has no tokenizer (tokenizer.json); name one with data.tokenizer"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"model.init_from={init_from}"])
        assert len(e.value.problems) == 1 and e.value.problems[0].startswith(f"model.init_from = '{init_from}': {why}")


def test_the_built_model_holds_the_files_weights_in_fp32(tmp_path):
    """bf16 weights, tied embeddings (qwen3): the model every worker builds holds them widened to
    fp32, head and embedding still one tensor; counting parameters on the meta device reads nothing."""
    from safetensors.torch import load_file

    src = save_tiny_model(tmp_path / "tiny-qwen3", TEXT, family="qwen3", dtype=torch.bfloat16, tie=True)
    cfg = load_config({"model": {"init_from": str(src)}})
    model = build_model(cfg, vocab_size=1)
    saved = load_file(str(src / "model.safetensors"))
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values())
    assert saved and all(torch.equal(params[k], v.float()) for k, v in saved.items() if k in params)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.config.num_key_value_heads == 2 and not model.config.use_cache
    with torch.device("meta"):
        meta = build_model(cfg, vocab_size=1)
    assert count_parameters(meta) == count_parameters(model)
