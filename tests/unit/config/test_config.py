"""Config: defaults, YAML presets, dotted overrides, one clear line per invalid field."""

from __future__ import annotations

import pytest

from ray_diloco.config import PRESET_DIR, load_config
from ray_diloco.errors import ConfigError


def test_defaults_are_the_readme_run():
    cfg = load_config()
    assert (cfg.algorithm, cfg.diloco.replicas, cfg.diloco.workers_per_replica, cfg.diloco.H) == ("diloco", 2, 1, 50)
    assert (cfg.outer.name, cfg.outer.lr, cfg.outer.momentum) == ("nesterov", 0.7, 0.9)
    assert (cfg.inner.global_batch, cfg.data.seq_len, cfg.run.steps) == (12, 64, 2000)
    assert (cfg.inner.beta1, cfg.inner.beta2) == (0.9, 0.99)
    assert cfg.batch_per_worker == 6 and cfg.num_outer_steps == 40


def test_dotted_overrides_are_typed():
    cfg = load_config(None, ["inner.lr=3e-4", "diloco.replicas=4", "run.deterministic=true",
                             "tracking.tags=a,b", "model.family=qwen3", "data.max_documents=none"])
    assert cfg.inner.lr == 3e-4 and isinstance(cfg.diloco.replicas, int) and cfg.diloco.replicas == 4
    assert cfg.run.deterministic is True and cfg.tracking.tags == ["a", "b"] and cfg.model.family == "qwen3"


def test_every_shipped_preset_loads():
    names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    assert "default" in names and "dp" in names
    for name in names:
        load_config(name)


def test_yaml_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("diloco:\n  H: 7\ninner:\n  lr: 0.01\n")
    cfg = load_config(str(f), ["diloco.H=9"])
    assert cfg.diloco.H == 9 and cfg.inner.lr == 0.01


@pytest.mark.parametrize("override, field", [
    ("diloco.H=0", "diloco.H"),
    ("diloco.replicas=0", "diloco.replicas"),
    ("diloco.workers_per_replica=0", "diloco.workers_per_replica"),
    ("inner.lr=0", "inner.lr"),
    ("inner.lr=-0.001", "inner.lr"),
    ("outer.lr=0", "outer.lr"),
    ("outer.momentum=1.0", "outer.momentum"),
    ("outer.momentum=-0.1", "outer.momentum"),
    ("inner.global_batch=13", "inner.global_batch"),
    ("data.seq_len=65", "data.seq_len"),
    ("algorithm=fedavg", "algorithm"),
    ("outer.name=lamb", "outer.name"),
    ("run.precision=fp8", "run.precision"),
    ("model.preset=huge", "model.preset"),
    ("data.path=/nonexistent/corpus.txt", "data.path"),
    ("diloco.H=abc", "diloco.H"),
    ("diloco.H=2.5", "diloco.H"),
    ("diloco.bogus=1", "diloco.bogus"),
    ("run.seed=-1", "run.seed"),
    ("inner.lr=inf", "inner.lr"),
    ("run.name=../escape", "run.name"),
    ("data.path=/tmp", "data.path"),
    ("diloco.spare_replicas=1000000000", "diloco.spare_replicas"),
    ("diloco.min_replicas=3", "diloco.min_replicas"),
    ("diloco.driver_resource=CPU", "diloco.driver_resource"),  # Ray's own: an actor cannot ask for it by name
    ("diloco.driver_resource=object_store_memory", "diloco.driver_resource"),
])
def test_invalid_field_gives_one_line_naming_it(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert len(e.value.problems) == 1, e.value.problems
    line = e.value.lines()[0]
    assert field in line and "\n" not in line
    value = override.split("=", 1)[1]
    assert value in line or field.endswith("bogus")


def test_several_problems_one_line_each():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["diloco.H=0", "inner.lr=0", "outer.momentum=2"])
    assert len(e.value.problems) == 3


def test_a_set_value_of_the_wrong_type_does_not_hide_the_other_problems():
    """A --set that cannot be read and a --set that reads but is out of range: both lines."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["inner.lr=abc", "diloco.H=0"])
    assert e.value.problems == ["inner.lr = 'abc': expected float", "diloco.H = 0: must be an integer >= 1"]


def test_a_bpe_vocabulary_below_the_bytes_is_refused_for_every_data_path():
    """The in-process tokeniser used to train a 257-token vocabulary for 100 where prepare's refused it."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.tokenizer=bpe", "data.bpe_vocab_size=100"])
    assert e.value.problems == ["data.bpe_vocab_size = 100: must be at least 260 (256 bytes and merges)"]
    assert load_config(None, ["data.bpe_vocab_size=260"]).data.bpe_vocab_size == 260


@pytest.mark.parametrize("value", ["none", "None", "null", "[]", ""])
def test_an_empty_list_from_the_command_line(value):
    assert load_config(None, [f"tracking.tags={value}"]).tracking.tags == []


def test_divisibility_message_names_the_product():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["diloco.replicas=4", "diloco.workers_per_replica=2", "inner.global_batch=12"])
    assert "4 x 2 = 8" in e.value.lines()[0]


def test_bad_set_syntax_and_missing_file():
    with pytest.raises(ConfigError):
        load_config(None, ["inner.lr"])
    with pytest.raises(ConfigError) as e:
        load_config("/nope/missing.yaml")
    assert "not found" in e.value.lines()[0]


def test_head_dim_must_be_even_for_rope():
    """llama and qwen3 rotate pairs of dimensions (RoPE); gpt2 has learned positions, any head size."""
    for family in ("llama", "qwen3"):
        with pytest.raises(ConfigError) as e:
            load_config(None, ["model.d_model=60", "model.n_heads=4", f"model.family={family}"])
        assert "d_model / n_heads = 15" in e.value.lines()[0]
    assert load_config(None, ["model.d_model=60", "model.n_heads=4", "model.family=gpt2"]).model.d_model == 60


def test_resume_cannot_change_the_data_slots():
    """max_replicas sets the number of data slots (shards); a resume that changes it is refused
    before config.yaml is rewritten."""
    from ray_diloco.runtime.launcher import _check_resumable

    saved = load_config(None, ["diloco.max_replicas=2"])
    with pytest.raises(ConfigError) as e:
        _check_resumable(load_config(None, ["diloco.max_replicas=3"]), saved)
    assert e.value.problems == ["diloco.max_replicas = 3: the checkpoint was trained with 2; it cannot change on resume"]
    _check_resumable(load_config(None, ["diloco.max_replicas=2", "diloco.sync_timeout_s=5"]), saved)


def test_outer_shards_of_the_dp_baseline_are_refused():
    """The DP baseline has no outer optimiser: K outer shards there were accepted and did nothing
    (a fresh user's finding); one line now, as for its spares and elastic replicas."""
    with pytest.raises(ConfigError, match=r"^diloco.outer_shards = 2: outer shards need algorithm: diloco"):
        load_config(None, ["algorithm=dp", "diloco.outer_shards=2"])
    assert load_config(None, ["algorithm=dp"]).diloco.outer_shards == 1


def test_hsdp_shard_groups_default_and_bounds():
    """S defaults to the largest divisor of W up to min(8, W / 2); a bad S, too few workers, the DP
    baseline or S without hsdp are one line each naming the field."""
    from ray_diloco.runtime.layout import ReplicaLayout

    def s(w, *more):
        return load_config(None, ["diloco.sharding=hsdp", f"diloco.workers_per_replica={w}", "inner.global_batch=192", *more])

    assert [s(w).shard_group_size for w in (4, 6, 8, 12, 16, 32)] == [2, 3, 4, 6, 8, 8]
    cfg = s(8, "diloco.shard_group_size=2")
    assert (cfg.shard_group_size, cfg.exchange_units) == (2, 2)
    lay = [ReplicaLayout.of(cfg, 8, r, __import__("torch").device("cpu")) for r in range(8)]
    assert [la.shard_rank for la in lay] == [0, 1] * 4 and [la.sync_rank for la in lay] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [lay[0].owns(r) for r in range(8)] == [True, True] + [False] * 6 and lay[0].owner(5) == 1
    assert lay[0].summary("hsdp") == "inside a replica: hsdp, the model sharded over 2 ranks, 4 shard groups all-reducing gradients"
    fsdp = load_config(None, ["diloco.sharding=fsdp", "diloco.workers_per_replica=4", "inner.global_batch=16"])
    assert ReplicaLayout.of_run(fsdp).summary("fsdp") == "inside a replica: fsdp, the model sharded over 4 ranks"
    assert ReplicaLayout.of_run(load_config(None, [])).summary("ddp") is None
    for more, line in [
        (["diloco.shard_group_size=3"], "diloco.shard_group_size = 3: must divide diloco.workers_per_replica = 8"),
        (["diloco.shard_group_size=8"], "diloco.shard_group_size = 8: must divide diloco.workers_per_replica = 8"),
        (["diloco.shard_group_size=1"], "diloco.shard_group_size = 1: must divide"),
        (["diloco.shard_group_size=0"], "diloco.shard_group_size = 0: must divide"),  # not "the default"
    ]:
        with pytest.raises(ConfigError) as e:
            s(8, *more)
        assert len(e.value.problems) == 1 and e.value.problems[0].startswith(line), e.value.problems
    with pytest.raises(ConfigError) as e:
        s(5)  # no S with 2 <= S < 5 divides 5: the field to change is W (S was never given)
    assert any(p.startswith("diloco.workers_per_replica = 5: hsdp needs shard groups") for p in e.value.problems)
    with pytest.raises(ConfigError) as e:
        s(2)
    assert e.value.problems == ["diloco.sharding = 'hsdp': hsdp shards a replica over its workers: "
                                "needs diloco.workers_per_replica >= 4 (it is 2)"]
    with pytest.raises(ConfigError) as e:
        s(4, "algorithm=dp")
    assert any("hsdp is for DiLoCo replicas" in p for p in e.value.problems)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["diloco.sharding=fsdp", "diloco.workers_per_replica=4", "inner.global_batch=16", "diloco.shard_group_size=2"])
    assert e.value.problems == ["diloco.shard_group_size = 2: is read only with diloco.sharding = hsdp (it is fsdp)"]


def test_a_config_error_rebuilt_from_its_message_keeps_it_whole():
    """Ray re-raises a worker's error by calling its class with the message: a str, which was
    split into one "problem" per character ("m; o; d; e; l; ...")."""
    assert ConfigError("model.init_from = 'x': bad").problems == ["model.init_from = 'x': bad"]
    assert ConfigError(["a = 1: bad", "b = 2: bad"]).lines() == ["config error: a = 1: bad", "config error: b = 2: bad"]
