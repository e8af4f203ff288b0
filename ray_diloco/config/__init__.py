"""Typed run configuration: dataclass sections, YAML presets, dotted overrides, validation.

A config is built in three layers, later ones winning:

1. the dataclass defaults (the README's default run: DiLoCo, M=2, H=50, tiny model);
2. a YAML file (``--config FILE``) or a preset shipped in ``ray_diloco/configs/NAME.yaml``;
3. dotted overrides ``--set inner.lr=3e-4 --set diloco.replicas=4``.

Every problem found is reported as one line naming the field, the value and what is allowed
(:class:`ConfigError` carries the list).

Modules (none imports torch or ray):

- :mod:`~ray_diloco.config.schema`: the sections, their typed and documented fields, derived quantities;
- :mod:`~ray_diloco.config.presets`: model size presets and the shape they resolve to;
- :mod:`~ray_diloco.config.loading`: YAML files, presets and ``--set`` overrides into a :class:`Config`;
- :mod:`~ray_diloco.config.validation`: one check per section, one line per problem;
- :mod:`~ray_diloco.config.reference`: ``docs/configuration.md``, generated from the schema.
"""

from __future__ import annotations

from ray_diloco.config.loading import PRESET_DIR, load_config, resolve_config_path
from ray_diloco.config.presets import (
    LEGACY_PRESETS,
    PRESETS,
    SHAPE_FIELDS,
    PresetName,
    pin_model_fields,
    resolve_model_shape,
)
from ray_diloco.config.schema import (
    ALGORITHMS,
    BPE_VOCAB_RULE,
    CLOSING_ROUNDS,
    FAMILIES,
    JOIN_INNER_STATES,
    MAX_STEPS,
    MIN_BPE_VOCAB,
    OUTER_OPTIMIZERS,
    PATTERNS,
    PRECISIONS,
    PRESET_NAMES,
    QUANTIZATION_FORMATS,
    REPLICA_NODES,
    SHARDINGS,
    TRACKING_MODES,
    Algorithm,
    ClosingRound,
    Config,
    DataConfig,
    DiLoCoConfig,
    Family,
    InnerConfig,
    JoinInnerState,
    ModelConfig,
    NetworkConfig,
    OuterConfig,
    OuterOptimizer,
    Pattern,
    Precision,
    QuantFormat,
    RunConfig,
    StreamingConfig,
    TrackingConfig,
    TrackingMode,
)
from ray_diloco.config.validation import check_overlap, num_fragments, validate_config
from ray_diloco.errors import ConfigError

__all__ = [
    "ALGORITHMS",
    "CLOSING_ROUNDS",
    "FAMILIES",
    "JOIN_INNER_STATES",
    "REPLICA_NODES",
    "SHARDINGS",
    "LEGACY_PRESETS",
    "MAX_STEPS",
    "MIN_BPE_VOCAB",
    "BPE_VOCAB_RULE",
    "OUTER_OPTIMIZERS",
    "PATTERNS",
    "PRECISIONS",
    "PRESETS",
    "PRESET_DIR",
    "PRESET_NAMES",
    "QUANTIZATION_FORMATS",
    "SHAPE_FIELDS",
    "TRACKING_MODES",
    "Algorithm",
    "ClosingRound",
    "Config",
    "ConfigError",
    "DataConfig",
    "DiLoCoConfig",
    "Family",
    "InnerConfig",
    "JoinInnerState",
    "ModelConfig",
    "NetworkConfig",
    "OuterConfig",
    "OuterOptimizer",
    "Pattern",
    "Precision",
    "PresetName",
    "QuantFormat",
    "RunConfig",
    "StreamingConfig",
    "TrackingConfig",
    "TrackingMode",
    "check_overlap",
    "load_config",
    "num_fragments",
    "pin_model_fields",
    "resolve_config_path",
    "resolve_model_shape",
    "validate_config",
]
