"""Save a tiny llama in the layout of a released model (save_pretrained), to try continued pre-training (``model.init_from``)
without a download: ``python examples/tiny_llama.py DIR``.

``DIR`` gets what ``save_pretrained`` writes (``config.json``, ``model.safetensors``, the
tokenizer files): 2 layers, width 32, FFN 64, context 64, 4 attention heads over 2 key/value heads
(grouped-query attention), RoPE base 5000, random weights of seed 1, and a char-level tokenizer of
the bundled Tiny Shakespeare. The tests build their models with :func:`save_tiny_model`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

SHAKESPEARE = Path(__file__).resolve().parents[1] / "ray_diloco" / "data" / "tinyshakespeare.txt"


def save_tiny_model(path: Path, text: str, family: str = "llama", dtype: torch.dtype = torch.float32,
                    tie: bool = False) -> Path:
    """The model described above, of ``family`` (``llama`` or ``qwen3``) with weights in ``dtype``
    and, with ``tie``, tied embeddings; its tokenizer has the characters of ``text``. Returns ``path``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from ray_diloco.components.text import char_tokenizer

    tok = char_tokenizer([text])
    conf = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family](
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, tie_word_embeddings=tie,
        bos_token_id=None, eos_token_id=None)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(conf).to(dtype).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="where to save the model")
    print(save_tiny_model(parser.parse_args().dir, SHAKESPEARE.read_text()))
