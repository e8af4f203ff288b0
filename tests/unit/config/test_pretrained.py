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


def _edited(path, src, replace=None, **fields):
    """A copy of the model at ``src`` whose config.json is ``replace`` or has ``fields`` set (None: removed)."""
    import shutil

    shutil.copytree(src, path)
    conf = json.loads((src / "config.json").read_text())
    conf.update(fields)
    conf = {k: v for k, v in conf.items() if v is not None} if replace is None else replace
    (path / "config.json").write_text(json.dumps(conf))
    return str(path)


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
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.init_from="])  # not the current directory
    assert e.value.problems == ["model.init_from = '': must name a model directory or a hub id (leave it unset for a preset)"]
    for init_from, why in [
        (str(tmp_path / "nope"), "no such directory"),
        (str(tmp_path / "empty"), "it has no config.json (a transformers model directory)"),
        (str(tmp_path / "mistral"), "model_type 'mistral'; the trainer builds gpt2, llama, qwen3"),
        ("nobody/no-such-model", "not a local model directory, and the Hugging Face hub cannot give it ("),
        (str(tmp_path / "no-tokenizer"), "it has no tokenizer (tokenizer.json); name one with data.tokenizer"),
        (_edited(tmp_path / "list", llama_dir, []), "config.json holds a list, not an object"),
        (_edited(tmp_path / "no-layers", llama_dir, num_hidden_layers=None), "its config.json has no num_hidden_layers"),
        (_edited(tmp_path / "str-layers", llama_dir, num_hidden_layers="2"),
         "its config.json has num_hidden_layers = '2'; expected a positive integer"),
        (_edited(tmp_path / "str-tie", llama_dir, tie_word_embeddings="no"),
         "its config.json has tie_word_embeddings = 'no'; expected true or false"),
        (_edited(tmp_path / "float-vocab", llama_dir, vocab_size=65.5),
         "its config.json has vocab_size = 65.5; expected a positive integer"),
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


def test_weights_that_are_not_the_configs_or_damaged_stop_the_job_before_any_worker(llama_dir, tmp_path, caplog):
    """from_pretrained initialised a layer its files lack at random (a log line aside) and a worker
    died on a damaged file; the job's check reads the headers and says what is wrong in one line."""
    import shutil

    from ray_diloco.models.pretrained import check_weights

    check_weights(str(llama_dir))
    tied = save_tiny_model(tmp_path / "tied", TEXT, family="qwen3", dtype=torch.bfloat16, tie=True)
    check_weights(str(tied))  # the head is the embedding: nothing missing
    cut = tmp_path / "cut"
    shutil.copytree(llama_dir, cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    bare = tmp_path / "bare"
    shutil.copytree(llama_dir, bare)
    (bare / "model.safetensors").unlink()
    for path, why in [
        (_edited(tmp_path / "deeper", llama_dir, num_hidden_layers=3),
         "its weights have no model.layers.2.self_attn.q_proj.weight (9 of the 30 parameters its config.json "
         "describes are missing)"),
        (_edited(tmp_path / "wider", llama_dir, intermediate_size=128),
         "model.layers.0.mlp.gate_proj.weight is (64, 32) in its weights, (128, 32) in its config.json "
         "(6 parameters differ)"),
        (str(cut), "model.safetensors cannot be read as safetensors (Error while deserializing header"),
        (str(bare), "it has no *.safetensors weights (save it with save_pretrained)"),
        (_edited(tmp_path / "kv0", llama_dir, num_key_value_heads=0), "its config.json does not build a model ("),
        (_edited(tmp_path / "act", llama_dir, hidden_act="nope"), "its config.json does not build a model (KeyError"),
    ]:
        with pytest.raises(ConfigError) as e:
            check_weights(path)
        assert e.value.problems[0].startswith(f"model.init_from = '{path}': {why}"), e.value.problems
    shallower = _edited(tmp_path / "shallower", llama_dir, num_hidden_layers=1)
    with caplog.at_level("WARNING", logger="ray_diloco"):
        check_weights(shallower)  # a model cut to its first layers is a choice: said, not refused
    assert "9 tensors of its weights are not in the model its config.json describes and are not loaded " \
           "(first: model.layers.1.input_layernorm.weight)" in caplog.text
