"""Model size presets and the model shape they give (no torch: the config validates shapes with it).

``model.preset`` names a row of :data:`PRESETS`; every shape field of ``model`` left ``None`` takes
the row's value. ``tiny`` is nanoGPT's CPU "baby GPT" (its family and shape, so the default run
compares directly with nanoGPT and torchft on the same text), ``cpu-small``/``cpu-medium`` are small
CPU sizes, and ``35m`` ... ``10b`` are the sizes of Scaling Laws for DiLoCo (arXiv 2503.09799,
section 3: layers, heads, d_model, FFN).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, TypeVar


class ModelFields(Protocol):
    """What the presets read of a model config (``config.schema.ModelConfig``, which imports this
    module: typed by its fields, not by it). The shape fields (:data:`SHAPE_FIELDS`) are read and
    filled by name."""

    @property
    def preset(self) -> str: ...

    @property
    def vocab_size(self) -> int | None: ...

    @property
    def init_std(self) -> float: ...


_Model = TypeVar("_Model", bound=ModelFields)

#: The names of :data:`PRESETS`, in its order (the type of ``model.preset``).
PresetName = Literal[
    "tiny", "cpu-small", "cpu-medium", "35m", "90m", "180m", "335m", "550m", "1.3b", "2.4b", "4b", "10b"
]

Row = tuple[str, int, int, int, int, int, float, bool]

#: The paper's FFN width (a two-matrix MLP) of each scaling-law size (arXiv 2503.09799, section 3).
PAPER_FFN: dict[str, int] = {
    "35m": 2048,
    "90m": 3072,
    "180m": 4096,
    "335m": 5120,
    "550m": 6144,
    "1.3b": 8192,
    "2.4b": 10240,
    "4b": 12288,
    "10b": 16384,
}


def swiglu_width(ffn: int) -> int:
    """The SwiGLU width with the parameters of a two-matrix MLP of width ``ffn``: 2/3 of it,
    rounded to a multiple of 128."""
    return round(ffn * 2 / 3 / 128) * 128


# name: (family, layers, heads, d_model, d_ff, context, z_loss, tie_embeddings)
PRESETS: dict[str, Row] = {
    "tiny": ("gpt2", 4, 4, 128, 512, 64, 0.0, False),  # nanoGPT's CPU baby GPT (FFN 4 x 128)
    "cpu-small": ("llama", 6, 6, 192, 512, 128, 0.0, False),
    "cpu-medium": ("llama", 8, 8, 256, 704, 256, 0.0, False),
    # Scaling Laws for DiLoCo (arXiv 2503.09799), section 3: QK-norm, z-loss 1e-4, seq 2048, tied embeddings.
    **{
        name: ("qwen3", layers, heads, d, swiglu_width(PAPER_FFN[name]), 2048, 1e-4, True)
        for name, (layers, heads, d) in {
            "35m": (6, 8, 512),
            "90m": (9, 12, 768),
            "180m": (12, 16, 1024),
            "335m": (15, 20, 1280),
            "550m": (18, 24, 1536),
            "1.3b": (24, 32, 2048),
            "2.4b": (30, 40, 2560),
            "4b": (36, 48, 3072),
            "10b": (48, 64, 4096),
        }.items()
    },
}

#: What a preset meant before 2026-12-01, for runs recorded then: their config left the shape
#: fields None (the preset's): `tiny` was a llama-family model, and the scaling-law sizes had the
#: paper's FFN as a SwiGLU width with untied embeddings (1.3-1.7x their names' parameters; until
#: 2026-12-02, when runs already pinned every field but ``tie_embeddings``, False then by default).
#: See :func:`pin_model_fields`.
LEGACY_PRESETS: dict[str, Row] = {
    "tiny": ("llama", 4, 4, 128, 352, 64, 0.0, False),
    **{name: PRESETS[name][:4] + (ffn, 2048, 1e-4, False) for name, ffn in PAPER_FFN.items()},
}
SHAPE_FIELDS = ("family", "n_layers", "n_heads", "d_model", "d_ff", "context", "z_loss", "tie_embeddings")


def pin_model_fields(cfg: _Model, recorded_before_pinning: bool = False) -> _Model:
    """Fill each shape field of ``cfg`` left ``None`` (family, layers, heads, width, FFN, context,
    z-loss, tied embeddings) with its preset's value, in place, and return ``cfg``.

    A run pins its config before it starts, so its ``config.yaml`` and checkpoints record the
    model actually trained, whatever later versions make of the preset. A config recorded before
    runs did this (``recorded_before_pinning``) gets the preset's meaning at that time
    (:data:`LEGACY_PRESETS`). ``vocab_size`` stays as it is (None: the tokenizer's).
    """
    if all(getattr(cfg, field) is not None for field in SHAPE_FIELDS):
        return cfg  # pinned already (a run's config.yaml): model.init_from's files are not read
    table = {**PRESETS, **LEGACY_PRESETS} if recorded_before_pinning else PRESETS
    base = _base(cfg) or dict(zip(SHAPE_FIELDS, table[cfg.preset]))
    for field in SHAPE_FIELDS:
        if getattr(cfg, field) is None:
            setattr(cfg, field, base[field])
    return cfg


def _base(cfg: ModelFields) -> dict[str, Any] | None:
    """The shape of ``cfg.init_from``'s model (:func:`~ray_diloco.config.pretrained.pretrained_shape`),
    which replaces the preset's; None without one."""
    init_from = getattr(cfg, "init_from", None)
    if not init_from:
        return None
    from ray_diloco.config.pretrained import pretrained_shape

    return pretrained_shape(init_from)


def resolve_model_shape(cfg: ModelFields, vocab_size: int) -> dict[str, Any]:
    """Preset values (or ``model.init_from``'s model's) for every field of ``cfg`` left as ``None``;
    returns a plain dict, with ``init_from`` (None: a preset shape).

    ``vocab_size`` (from the tokenizer) is used unless ``cfg.vocab_size`` is set or the model of
    ``init_from`` has its own.
    """
    pretrained = _base(cfg)
    base = pretrained or dict(zip(SHAPE_FIELDS, PRESETS[cfg.preset]))
    shape = {k: base[k] if getattr(cfg, k) is None else getattr(cfg, k) for k in SHAPE_FIELDS}
    if cfg.vocab_size is not None:
        vocab_size = cfg.vocab_size
    elif pretrained is not None and pretrained["vocab_size"] is not None:
        vocab_size = pretrained["vocab_size"]
    init_from = getattr(cfg, "init_from", None) or None
    return {**shape, "vocab_size": vocab_size, "init_std": cfg.init_std, "init_from": init_from}
