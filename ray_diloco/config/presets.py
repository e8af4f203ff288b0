"""Model size presets and the model shape they give (no torch: the config validates shapes with it).

``model.preset`` names a row of :data:`PRESETS`; every shape field of ``model`` left ``None`` takes
the row's value. ``tiny`` is nanoGPT's CPU "baby GPT" (its family and shape, so the default run
compares directly with nanoGPT and torchft on the same text), ``cpu-small``/``cpu-medium`` are small
CPU sizes, and ``35m`` ... ``10b`` are the sizes of Scaling Laws for DiLoCo (arXiv 2503.09799,
section 3: layers, heads, d_model, FFN).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ray_diloco.config.schema import ModelConfig

#: The names of :data:`PRESETS`, in its order (the type of ``model.preset``).
PresetName = Literal["tiny", "cpu-small", "cpu-medium", "35m", "90m", "180m", "335m", "550m", "1.3b", "2.4b",
                     "4b", "10b"]

# name: (family, layers, heads, d_model, d_ff, context, z_loss)
PRESETS: dict[str, tuple[str, int, int, int, int, int, float]] = {
    "tiny": ("gpt2", 4, 4, 128, 512, 64, 0.0),  # nanoGPT's CPU baby GPT (FFN 4 x 128)
    "cpu-small": ("llama", 6, 6, 192, 512, 128, 0.0),
    "cpu-medium": ("llama", 8, 8, 256, 704, 256, 0.0),
    # Scaling Laws for DiLoCo (arXiv 2503.09799), section 3: QK-norm, z-loss 1e-4, seq 2048.
    "35m": ("qwen3", 6, 8, 512, 2048, 2048, 1e-4),
    "90m": ("qwen3", 9, 12, 768, 3072, 2048, 1e-4),
    "180m": ("qwen3", 12, 16, 1024, 4096, 2048, 1e-4),
    "335m": ("qwen3", 15, 20, 1280, 5120, 2048, 1e-4),
    "550m": ("qwen3", 18, 24, 1536, 6144, 2048, 1e-4),
    "1.3b": ("qwen3", 24, 32, 2048, 8192, 2048, 1e-4),
    "2.4b": ("qwen3", 30, 40, 2560, 10240, 2048, 1e-4),
    "4b": ("qwen3", 36, 48, 3072, 12288, 2048, 1e-4),
    "10b": ("qwen3", 48, 64, 4096, 16384, 2048, 1e-4),
}

#: What a preset meant before 2026-12-01, for runs recorded then: their config left the shape
#: fields None (the preset's), and `tiny` was a llama-family model. See :func:`pin_model_fields`.
LEGACY_PRESETS: dict[str, tuple[str, int, int, int, int, int, float]] = {"tiny": ("llama", 4, 4, 128, 352, 64, 0.0)}
SHAPE_FIELDS = ("family", "n_layers", "n_heads", "d_model", "d_ff", "context", "z_loss")


def pin_model_fields(cfg: ModelConfig, recorded_before_pinning: bool = False) -> ModelConfig:
    """Fill each shape field of ``cfg`` left ``None`` (family, layers, heads, width, FFN, context,
    z-loss) with its preset's value, in place, and return ``cfg``.

    A run pins its config before it starts, so its ``config.yaml`` and checkpoints record the
    model actually trained, whatever later versions make of the preset. A config recorded before
    runs did this (``recorded_before_pinning``) gets the preset's meaning at that time
    (:data:`LEGACY_PRESETS`). ``vocab_size`` stays as it is (None: the tokenizer's).
    """
    table = {**PRESETS, **LEGACY_PRESETS} if recorded_before_pinning else PRESETS
    for field, value in zip(SHAPE_FIELDS, table[cfg.preset]):
        if getattr(cfg, field) is None:
            setattr(cfg, field, value)
    return cfg


def resolve_model_shape(cfg: ModelConfig, vocab_size: int) -> dict[str, Any]:
    """Preset values for every field of ``cfg`` left as ``None``; returns a plain dict.

    ``vocab_size`` (from the tokenizer) is used unless ``cfg.vocab_size`` is set.
    """
    preset = dict(zip(SHAPE_FIELDS, PRESETS[cfg.preset]))
    shape = {k: preset[k] if getattr(cfg, k) is None else getattr(cfg, k) for k in SHAPE_FIELDS}
    return {**shape, "vocab_size": vocab_size if cfg.vocab_size is None else cfg.vocab_size,
            "init_std": cfg.init_std, "tie_embeddings": cfg.tie_embeddings}
