"""The config package: typed and documented fields, torch-free import, the generated reference."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from ray_diloco import config
from ray_diloco.config import Config, load_config, reference
from ray_diloco.config.loading import _coerce
from ray_diloco.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
REGENERATE = "python -m ray_diloco.config.reference > docs/configuration.md"


def _sections():
    """(key prefix, dataclass) of the top level and of each section."""
    hints = typing.get_type_hints(Config)
    yield "", Config
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(hints[f.name]):
            yield f"{f.name}.", hints[f.name]


def _problems(*overrides: str, data: dict | None = None) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(data, list(overrides))
    return e.value.problems


def test_importing_the_config_and_the_package_pulls_neither_torch_nor_ray():
    code = ("import sys; import ray_diloco; from ray_diloco.config import load_config; from ray_diloco.config "
            "import reference; load_config(); reference.markdown(); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray')); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_docs_configuration_md_is_current():
    page = ROOT / "docs" / "configuration.md"
    assert page.is_file(), f"docs/configuration.md is missing: run `{REGENERATE}`"
    stale = f"docs/configuration.md is stale: run `{REGENERATE}`"
    assert page.read_text(encoding="utf-8") == reference.markdown(), stale


def test_every_field_has_a_docstring_and_every_key_is_in_the_reference():
    page = reference.markdown()
    for prefix, cls in _sections():
        docs = reference.field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not dataclasses.is_dataclass(hints[f.name]):
                assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
                assert f"| `{prefix}{f.name}` |" in page


def test_allowed_values_are_the_literals_arguments():
    s = config.schema
    assert config.ALGORITHMS == ("diloco", "dp") == typing.get_args(s.Algorithm)
    assert config.OUTER_OPTIMIZERS == ("nesterov", "sgd", "adam")
    assert config.PRECISIONS == ("fp32", "bf16")
    assert config.FAMILIES == ("gpt2", "llama", "qwen3")
    assert config.TRACKING_MODES == ("auto", "online", "offline", "disabled")
    assert config.PATTERNS == ("strided", "sequential")
    assert config.CLOSING_ROUNDS == ("average", "outer", "none")
    assert config.JOIN_INNER_STATES == ("peer", "fresh")
    hints = typing.get_type_hints(config.StreamingConfig)
    assert typing.get_args(hints["quantization"]) == config.QUANTIZATION_FORMATS
    assert typing.get_type_hints(config.ModelConfig)["family"] == s.Family | None


def test_preset_literal_lists_every_preset_in_order():
    assert config.PRESET_NAMES == tuple(config.PRESETS)
    assert set(config.LEGACY_PRESETS) <= set(config.PRESETS)


def test_wire_formats_are_the_config_literal_in_wire_order():
    """A format's wire id is its index in FORMATS: the order is part of the message format."""
    from ray_diloco.core.formats import FORMATS

    names = tuple(f.name for f in FORMATS)
    assert names == config.QUANTIZATION_FORMATS == ("none", "bf16", "fp8_e4m3", "int8", "fp4_e3m0")
    assert [f.id for f in FORMATS] == list(range(len(FORMATS)))


def test_the_model_module_re_exports_the_presets():
    from ray_diloco.models import transformer

    for name in ("PRESETS", "LEGACY_PRESETS", "SHAPE_FIELDS", "pin_model_fields", "resolve_model_shape"):
        assert getattr(transformer, name) is getattr(config.presets, name) is getattr(config, name)


@pytest.mark.parametrize("override, line", [
    ("algorithm=foo", "algorithm = 'foo': must be one of diloco, dp"),
    ("outer.name=lamb", "outer.name = 'lamb': must be one of nesterov, sgd, adam"),
    ("model.family=bert", "model.family = 'bert': must be one of gpt2, llama, qwen3"),
    ("model.preset=huge", ("model.preset = 'huge': must be one of tiny, cpu-small, cpu-medium, 35m, 90m, 180m, 335m, "
                           "550m, 1.3b, 2.4b, 4b, 10b")),
    ("streaming.pattern=zig", "streaming.pattern = 'zig': must be one of strided, sequential"),
    ("streaming.quantization=fp16",
     "streaming.quantization = 'fp16': must be one of none, bf16, fp8_e4m3, int8, fp4_e3m0"),
    ("streaming.closing_round=x", "streaming.closing_round = 'x': must be one of average, outer, none"),
    ("run.precision=fp8", "run.precision = 'fp8': must be one of fp32, bf16"),
    ("tracking.mode=off", "tracking.mode = 'off': must be one of auto, online, offline, disabled"),
    ("diloco.join_inner_state=x", "diloco.join_inner_state = 'x': must be one of peer, fresh"),
])
def test_a_bad_choice_is_reported_by_validation_word_for_word(override, line):
    assert _problems(override) == [line]


def test_literal_fields_are_read_like_strings():
    assert _problems(data={"algorithm": 3}) == ["algorithm = '3': must be one of diloco, dp"]
    assert _problems(data={"streaming": {"quantization": {"a": 1}}}) == [
        "streaming.quantization = {'a': 1}: expected str"]
    assert _problems(data={"model": {"family": ["x"]}}) == ["model.family = ['x']: expected str"]
    cfg = load_config({"streaming": {"quantization": "int8"}}, ["model.family=none", "tracking.mode=offline"])
    assert (cfg.streaming.quantization, cfg.model.family, cfg.tracking.mode) == ("int8", None, "offline")
    assert load_config(None, ["model.family=qwen3"]).model.family == "qwen3"
    errors: list[str] = []
    assert _coerce("null", config.Family | None, "k", errors) is None and not errors
    assert _coerce(7, config.Precision, "k", errors) == "7" and not errors


def test_problems_come_in_section_order_and_the_shape_check_waits_for_sane_fields():
    assert _problems("run.seed=-1", "tracking.mode=x", "algorithm=x", "diloco.H=0", "inner.lr=0") == [
        "algorithm = 'x': must be one of diloco, dp",
        "diloco.H = 0: must be an integer >= 1",
        "inner.lr = 0.0: must be a finite number > 0",
        "run.seed = -1: must be an integer in [0, 2**32)",
        "tracking.mode = 'x': must be one of auto, online, offline, disabled",
    ]
    assert _problems("data.seq_len=65") == ["data.seq_len = 65: must be <= model.context = 64"]
    assert _problems("data.seq_len=65", "inner.lr=0") == ["inner.lr = 0.0: must be a finite number > 0"]
    assert _problems("streaming.fragments=3", "streaming.overlap_steps=10") == [(
        "streaming.overlap_steps = 10: must be < diloco.H / F = 50 / 5 = 10 (F = 5 fragments: 3 of blocks + "
        "embeddings + head; each fragment's merge must land before the next one syncs)")]


def test_reference_renders_types_and_defaults():
    assert reference.type_text(config.Family | None) == "one of `gpt2`, `llama`, `qwen3` or none"
    assert reference.type_text(list[str]) == "list of str"
    assert reference.type_text(int | None) == "int or none"
    assert [reference.value_text(v) for v in (None, True, 1e-3, "tiny", [])] == [
        "`none`", "`true`", "`0.001`", "`tiny`", "empty"]
    page = reference.markdown()
    assert "| `streaming.quantization` | one of `none`, `bf16`, `fp8_e4m3`, `int8`, `fp4_e3m0` | `none` |" in page
    assert "| `diloco.H` | int | `50` | H, inner steps between outer steps. |" in page
