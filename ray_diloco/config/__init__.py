"""Typed run configuration: dataclass sections, YAML presets, dotted overrides, validation.

A config is built in three layers, later ones winning:

1. the dataclass defaults below (the README's default run: DiLoCo, M=2, H=50, tiny model);
2. a YAML file (``--config FILE``) or a preset shipped in ``ray_diloco/configs/NAME.yaml``;
3. dotted overrides ``--set inner.lr=3e-4 --set diloco.replicas=4``.

Every problem found is reported as one line naming the field, the value and what is allowed
(:class:`ConfigError` carries the list).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ray_diloco.errors import ConfigError

PRESET_DIR = Path(__file__).parents[1] / "configs"



MAX_STEPS = 10**9  # inner steps of one run (more is a typo or an overflowing token budget)

@dataclass
class ModelConfig:
    """Decoder-only LM shape. ``preset`` fills every field left as ``None`` (see model.PRESETS)."""

    preset: str = "tiny"
    family: str | None = None  # "gpt2" (nanoGPT's GPT), "llama" or "qwen3" (QK-norm)
    n_layers: int | None = None
    n_heads: int | None = None
    d_model: int | None = None
    d_ff: int | None = None
    context: int | None = None  # maximum sequence length (tokens)
    vocab_size: int | None = None  # None: taken from the tokenizer
    z_loss: float | None = None  # z-loss coefficient; None: the preset's (1e-4 for paper sizes)
    init_std: float = 0.02
    tie_embeddings: bool = False


@dataclass
class DataConfig:
    """Where the text comes from and how it is tokenised and packed."""

    path: str | None = None  # local .txt/.md/.text, .jsonl/.json, .parquet or .csv; None: bundled Tiny Shakespeare
    dataset: str | None = None  # hub dataset name, e.g. "allenai/c4" (used when path is None)
    dataset_config: str | None = None  # e.g. "en"
    split: str = "train"
    text_field: str = "text"
    streaming: bool = True  # hub datasets only
    max_documents: int | None = None  # cap on documents read (hub streaming needs one)
    tokenizer: str = "char"  # "char", "bpe", or a Hugging Face tokenizer name or local path
    bpe_vocab_size: int = 4096
    seq_len: int = 64  # tokens per packed training sequence
    val_fraction: float = 0.1


@dataclass
class InnerConfig:
    """Inner optimiser (AdamW) and its lr schedule, per replica (DiLoCo Algorithm 1, inner loop)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    grad_clip: float = 1.0  # 0 disables clipping
    global_batch: int = 12  # sequences per inner step, summed over all replicas and workers


@dataclass
class OuterConfig:
    """Outer optimiser applied to the averaged pseudo-gradient (DiLoCo section 2)."""

    name: str = "nesterov"  # "nesterov", "sgd" (heavy-ball momentum, or plain with momentum 0), "adam"
    lr: float = 0.7
    momentum: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 0.1  # DiLoCo paper: outer Adam needs eps ~0.1 to be stable


@dataclass
class DiLoCoConfig:
    """Replicas (M), workers per replica and the sync interval H."""

    replicas: int = 2  # M
    workers_per_replica: int = 1
    H: int = 50  # inner steps between outer steps
    cpus_per_worker: float | None = None  # None: the cluster's CPUs shared evenly (at least 0.5 each)
    gpus_per_worker: float = 0
    placement_timeout_s: float = 120.0  # wait for replica placement groups
    pg_timeout_s: float = 300.0  # torch.distributed collective / rendezvous timeout
    # elasticity (fault tolerance): the quorum of an outer step, the replica count to grow to,
    # how long a sync round waits for a missing replica, and how many replica failures a run survives
    min_replicas: int = 1
    max_replicas: int | None = None  # None: diloco.replicas (no scale-up)
    sync_timeout_s: float = 60.0
    max_failures: int = 20
    join_inner_state: str = "peer"  # a joiner's inner optimiser: a live replica's state, or "fresh"
    spare_replicas: int = 0  # hot spares: started and set up in advance, admitted when a replica dies


@dataclass
class StreamingConfig:
    """Streaming DiLoCo (arXiv 2501.18512, section 2): fragments, overlap, quantised exchange.

    ``fragments: 1`` is plain DiLoCo (one fragment holding every parameter). With P >= 2 the
    transformer blocks are split into P fragments (``pattern``), and the embeddings and the
    final norm + LM head sync as two more small fragments, so a run has P + 2 fragments whose
    sync offsets are spread evenly over H.
    """

    fragments: int = 1  # P: fragments of transformer blocks (1: plain DiLoCo)
    layers_per_fragment: int | None = None  # instead of fragments: P = ceil(layers / this) (3 in the paper)
    pattern: str = "strided"  # "strided" (blocks p, p+P, ...) or "sequential" (consecutive blocks)
    overlap_steps: int = 0  # tau: inner steps between sending a fragment and merging its new global value
    alpha: float = 0.0  # merge: theta <- alpha * theta_local + (1 - alpha) * new_global
    quantization: str = "none"  # wire format of pseudo-gradients and outer updates: none, bf16, fp8_e4m3, int8, fp4_e3m0
    error_feedback: bool = False  # add each round's quantisation residual to the next round's value (both directions)
    closing_round: str = "average"  # at the last step, fragments off their phase: "average", "outer" step, or "none"


@dataclass
class NetworkConfig:
    """WAN emulation on every replica-to-driver link (and DP's all-reduce), for experiments."""

    bandwidth_gbps: float | None = None  # Gbit/s per link; None: no bandwidth delay
    latency_ms: float = 0.0  # one-way latency added to every message


@dataclass
class RunConfig:
    """Length, cadence and outputs of a run."""

    steps: int = 2000  # inner steps (per replica)
    # the scaling-law protocol's token budget D = tokens_per_parameter x N (20 in the paper): when set,
    # run.steps = ceil(D / (inner.global_batch x data.seq_len)), with N counted from the model
    tokens_per_parameter: float | None = None
    eval_every: int = 10  # outer steps between evaluations of the global parameters (0: end only)
    eval_batch: int = 64  # sequences per evaluation forward pass
    checkpoint_every: int = 10  # outer steps between checkpoints (0: only at the end)
    keep_checkpoints: int = 3
    output_dir: str = "runs"
    name: str | None = None  # run directory name; None: a timestamp
    seed: int = 0
    deterministic: bool = False  # torch deterministic algorithms: bitwise-reproducible resume
    precision: str = "fp32"  # "fp32" or "bf16" (autocast; outer state stays fp32)
    log_hashes: bool = False  # log sha256 of global parameters/outer state/data read per outer step
    trace_syncs: bool = False  # workers keep every sync's fp32 tensors for inspection (tests, debugging)
    address: str | None = None  # Ray address; None: start (or join, under `ray job submit`) a cluster
    # where run directories persist: a local path (used instead of output_dir), or a URI (s3://, gs://,
    # file://, any pyarrow/fsspec filesystem) the run, staged in output_dir, is mirrored to after each checkpoint
    storage_path: str | None = None


@dataclass
class TrackingConfig:
    """metrics.jsonl is always written; W&B and the progress bar are optional."""

    wandb: bool = True
    mode: str = "auto"  # "auto" (online only with an API key), "online", "offline", "disabled"
    project: str = "ray-diloco"
    entity: str | None = None
    name: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    log_model: bool = False  # upload the exported model (final/) as a W&B artifact of type "model"
    init_timeout_s: float = 60.0  # wait this long for the W&B server, then log offline
    progress: bool = True


@dataclass
class Config:
    """The whole run. ``algorithm`` is "diloco" or "dp" (the data-parallel baseline)."""

    algorithm: str = "diloco"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    run: RunConfig = field(default_factory=RunConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    # -- derived quantities -------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """Replica slots: ``max(diloco.replicas, diloco.max_replicas)``; each slot owns one data
        shard per rank, so a replacement or a joiner reads data no live replica reads."""
        return max(self.diloco.replicas, self.diloco.max_replicas or 0)

    @property
    def num_shards(self) -> int:
        """Data shards = every (slot, rank) pair of workers."""
        return self.num_slots * self.diloco.workers_per_replica

    @property
    def batch_per_worker(self) -> int:
        """Sequences per inner step on one worker (global batch split across M x workers)."""
        return self.inner.global_batch // (self.diloco.replicas * self.diloco.workers_per_replica)

    @property
    def block_fragments(self) -> int:
        """P, the number of fragments of transformer blocks (``layers_per_fragment`` wins when set)."""
        s = self.streaming
        if s.layers_per_fragment is not None and s.layers_per_fragment >= 1:
            from ray_diloco.models.transformer import PRESETS, resolve_model_shape

            if self.model.preset in PRESETS:
                return -(-resolve_model_shape(self.model, 1)["n_layers"] // s.layers_per_fragment)
        return s.fragments

    @property
    def sync_block_fragments(self) -> int:
        """P as exchanged: :attr:`block_fragments` for DiLoCo, 1 for the DP baseline (nothing is
        exchanged; its parameters form one fragment for checkpoints and export)."""
        return self.block_fragments if self.algorithm == "diloco" else 1

    @property
    def num_outer_steps(self) -> int:
        """Rounds of H inner steps (the last one may be shorter)."""
        return -(-self.run.steps // self.diloco.H)

    def to_dict(self) -> dict[str, Any]:
        """The config as nested plain dicts (YAML/JSON/W&B friendly)."""
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The config as YAML, sections in declaration order (written to ``RUN_DIR/config.yaml``)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---------------------------------------------------------------------------------------
# building


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, key: str, errors: list[str]) -> Any:
    """Convert ``value`` (from YAML or a ``--set`` string) to the annotated type ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key, errors)
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, list):
            errors.append(f"{key} = {value!r}: expected a list")
            return None
        return [_coerce(v, args[0], key, errors) for v in value]
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError
                return int(value)
            if isinstance(value, str):
                f = float(value)
                if not f.is_integer():
                    raise ValueError
                return int(f)
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        errors.append(f"{key} = {value!r}: expected {getattr(tp, '__name__', tp)}")
        return None
    return value


def _apply(section: Any, key_prefix: str, data: dict[str, Any], errors: list[str]) -> None:
    types_ = _field_types(type(section))
    for k, v in data.items():
        key = f"{key_prefix}{k}"
        if k not in types_:
            allowed = ", ".join(types_)
            errors.append(f"{key}: unknown config field (allowed: {allowed})")
            continue
        current = getattr(section, k)
        if dataclasses.is_dataclass(current):
            if not isinstance(v, dict):
                errors.append(f"{key} = {v!r}: expected a mapping of {type(current).__name__} fields")
                continue
            _apply(current, key + ".", v, errors)
        else:
            n_before = len(errors)
            coerced = _coerce(v, types_[k], key, errors)
            if len(errors) == n_before:
                setattr(section, k, coerced)


def _parse_set(item: str) -> tuple[list[str], str]:
    if "=" not in item:
        raise ConfigError([f"--set {item!r}: expected KEY=VALUE, for example inner.lr=3e-4"])
    key, value = item.split("=", 1)
    return key.strip().split("."), value.strip()


def resolve_config_path(name_or_path: str) -> Path:
    """A YAML path, or the name of a preset shipped in ``ray_diloco/configs``."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise ConfigError([f"--config {name_or_path}: file not found"])
        return p
    preset = PRESET_DIR / f"{name_or_path}.yaml"
    if preset.is_file():
        return preset
    names = ", ".join(sorted(q.stem for q in PRESET_DIR.glob("*.yaml")))
    raise ConfigError([f"--config {name_or_path}: no such file or preset (presets: {names})"])


def load_config(
    config: str | Path | dict[str, Any] | Config | None = None,
    overrides: list[str] | None = None,
    validate: bool = True,
) -> Config:
    """Build a :class:`Config` from defaults, a YAML file/preset/dict, and dotted overrides.

    Raises:
        ConfigError: with one line per unknown field, bad type or invalid value.
    """
    if isinstance(config, Config):
        cfg = _from_dict(config.to_dict(), [])  # a copy: the caller's object is not changed
    else:
        data: dict[str, Any] = {}
        if isinstance(config, dict):
            data = config
        elif config is not None:
            path = resolve_config_path(str(config))
            try:
                data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            except yaml.YAMLError as e:
                raise ConfigError([f"--config {path}: not valid YAML ({str(e).splitlines()[0]})"]) from None
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError([f"--config {path}: cannot read it as UTF-8 text ({type(e).__name__})"]) from None
            if not isinstance(data, dict):
                raise ConfigError([f"--config {path}: expected a mapping of config sections"])
        errors: list[str] = []
        cfg = _from_dict(data, errors)
        if errors:
            raise ConfigError(errors)
    errors = []
    for item in overrides or []:
        keys, value = _parse_set(item)
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        _apply(cfg, "", nested, errors)
    if errors:
        raise ConfigError(errors)
    if validate:
        validate_config(cfg)
    return cfg


def _from_dict(data: dict[str, Any], errors: list[str]) -> Config:
    cfg = Config()
    _apply(cfg, "", data, errors)
    return cfg


# ---------------------------------------------------------------------------------------
# validation

ALGORITHMS = ("diloco", "dp")
OUTER_OPTIMIZERS = ("nesterov", "sgd", "adam")
PRECISIONS = ("fp32", "bf16")
FAMILIES = ("gpt2", "llama", "qwen3")
TRACKING_MODES = ("auto", "online", "offline", "disabled")
PATTERNS = ("strided", "sequential")
CLOSING_ROUNDS = ("average", "outer", "none")


def num_fragments(block_fragments: int, extra: int = 2) -> int:
    """Fragments exchanged in a run: 1 for plain DiLoCo, else P block fragments + ``extra``
    (embeddings, final norm + LM head)."""
    return 1 if block_fragments == 1 else block_fragments + extra


def check_overlap(H: int, fragments: int, tau: int, errors: list[str]) -> None:
    """Streaming DiLoCo requires tau < H / F (F: all fragments), so a fragment's merge lands
    before the next fragment syncs; appends one line to ``errors`` when it does not hold."""
    if H >= 1 and tau >= 1 and tau * fragments >= H:
        what = "1 fragment" if fragments == 1 else \
            f"{fragments} fragments: {fragments - 2} of blocks + embeddings + head" if fragments > 2 else \
            f"{fragments} fragments"
        errors.append(f"streaming.overlap_steps = {tau}: must be < diloco.H / F = {H} / {fragments} "
                      f"= {H / fragments:g} (F = {what}; each fragment's merge must land before the next one syncs)")


def validate_config(cfg: Config) -> None:
    """Check every field; raise :class:`ConfigError` listing each problem on its own line.

    Cluster-dependent checks (CPUs available) happen in the trainer before any actor starts.
    """
    from ray_diloco.models.transformer import PRESETS, resolve_model_shape  # local import: model imports torch

    e: list[str] = []

    def need(ok: bool, key: str, value: Any, allowed: str) -> None:
        if not ok:
            e.append(f"{key} = {value!r}: {allowed}")

    need(cfg.algorithm in ALGORITHMS, "algorithm", cfg.algorithm, f"must be one of {', '.join(ALGORITHMS)}")
    d = cfg.diloco
    need(d.H >= 1, "diloco.H", d.H, "must be an integer >= 1")
    need(d.replicas >= 1, "diloco.replicas", d.replicas, "must be an integer >= 1")
    need(d.workers_per_replica >= 1, "diloco.workers_per_replica", d.workers_per_replica, "must be an integer >= 1")
    need(d.cpus_per_worker is None or d.cpus_per_worker > 0, "diloco.cpus_per_worker", d.cpus_per_worker,
         "must be > 0 (or none: share the cluster's CPUs evenly)")
    need(d.gpus_per_worker >= 0, "diloco.gpus_per_worker", d.gpus_per_worker, "must be >= 0")
    need(d.pg_timeout_s > 0, "diloco.pg_timeout_s", d.pg_timeout_s, "must be > 0 seconds")
    need(d.placement_timeout_s > 0, "diloco.placement_timeout_s", d.placement_timeout_s, "must be > 0 seconds")
    need(1 <= d.min_replicas <= max(d.replicas, 1), "diloco.min_replicas", d.min_replicas,
         f"must be an integer in [1, diloco.replicas = {d.replicas}]")
    need(d.max_replicas is None or d.max_replicas >= d.replicas, "diloco.max_replicas", d.max_replicas,
         f"must be >= diloco.replicas = {d.replicas} (or none: no scale-up)")
    need(d.sync_timeout_s > 0 and math.isfinite(d.sync_timeout_s), "diloco.sync_timeout_s", d.sync_timeout_s,
         "must be a finite number of seconds > 0")
    need(d.max_failures >= 0, "diloco.max_failures", d.max_failures, "must be an integer >= 0")
    need(0 <= d.spare_replicas <= cfg.num_slots, "diloco.spare_replicas", d.spare_replicas,
         f"must be an integer in [0, max(diloco.replicas, diloco.max_replicas) = {cfg.num_slots}]")
    if cfg.algorithm == "dp" and d.spare_replicas:
        e.append(f"diloco.spare_replicas = {d.spare_replicas}: spares need algorithm: diloco")
    need(d.join_inner_state in ("peer", "fresh"), "diloco.join_inner_state", d.join_inner_state,
         "must be one of peer, fresh")
    if cfg.algorithm == "dp" and (d.max_replicas or d.replicas) != d.replicas:
        e.append(f"diloco.max_replicas = {d.max_replicas!r}: elastic replicas need algorithm: diloco "
                 "(the DP baseline is one fixed DDP group)")

    i = cfg.inner
    need(i.lr > 0 and math.isfinite(i.lr), "inner.lr", i.lr, "must be a finite number > 0")
    need(0 <= i.beta1 < 1, "inner.beta1", i.beta1, "must be in [0, 1)")
    need(0 <= i.beta2 < 1, "inner.beta2", i.beta2, "must be in [0, 1)")
    need(i.eps > 0 and math.isfinite(i.eps), "inner.eps", i.eps, "must be a finite number > 0")
    need(i.weight_decay >= 0, "inner.weight_decay", i.weight_decay, "must be >= 0")
    need(i.warmup_steps >= 0, "inner.warmup_steps", i.warmup_steps, "must be >= 0")
    need(0 <= i.min_lr_ratio <= 1, "inner.min_lr_ratio", i.min_lr_ratio, "must be in [0, 1]")
    need(i.grad_clip >= 0, "inner.grad_clip", i.grad_clip, "must be >= 0 (0 disables clipping)")
    need(i.global_batch >= 1, "inner.global_batch", i.global_batch, "must be an integer >= 1")
    workers = d.replicas * d.workers_per_replica
    if i.global_batch >= 1 and d.replicas >= 1 and d.workers_per_replica >= 1 and i.global_batch % workers:
        e.append(
            f"inner.global_batch = {i.global_batch}: must be divisible by diloco.replicas x "
            f"diloco.workers_per_replica = {d.replicas} x {d.workers_per_replica} = {workers}"
        )

    o = cfg.outer
    need(o.name in OUTER_OPTIMIZERS, "outer.name", o.name, f"must be one of {', '.join(OUTER_OPTIMIZERS)}")
    need(o.lr > 0 and math.isfinite(o.lr), "outer.lr", o.lr, "must be a finite number > 0")
    need(0 <= o.momentum < 1, "outer.momentum", o.momentum, "must be in [0, 1)")
    need(0 <= o.adam_beta2 < 1, "outer.adam_beta2", o.adam_beta2, "must be in [0, 1)")
    need(o.adam_eps > 0, "outer.adam_eps", o.adam_eps, "must be > 0")

    m = cfg.model
    need(m.preset in PRESETS, "model.preset", m.preset, f"must be one of {', '.join(PRESETS)}")
    need(m.family is None or m.family in FAMILIES, "model.family", m.family, f"must be one of {', '.join(FAMILIES)}")
    for k in ("n_layers", "n_heads", "d_model", "d_ff", "context", "vocab_size"):
        v = getattr(m, k)
        need(v is None or v >= 1, f"model.{k}", v, "must be an integer >= 1")
    need(m.z_loss is None or m.z_loss >= 0, "model.z_loss", m.z_loss, "must be >= 0")
    need(m.init_std > 0, "model.init_std", m.init_std, "must be > 0")

    dc = cfg.data
    need(dc.seq_len >= 1, "data.seq_len", dc.seq_len, "must be an integer >= 1")
    need(0 < dc.val_fraction < 1, "data.val_fraction", dc.val_fraction, "must be in (0, 1)")
    need(dc.bpe_vocab_size >= 32, "data.bpe_vocab_size", dc.bpe_vocab_size, "must be >= 32")
    need(dc.max_documents is None or dc.max_documents >= 1, "data.max_documents", dc.max_documents, "must be >= 1")
    if dc.path is not None and not Path(dc.path).expanduser().exists():
        e.append(f"data.path = {dc.path!r}: file not found")
    elif dc.path is not None and not Path(dc.path).expanduser().is_file():
        e.append(f"data.path = {dc.path!r}: not a file")
    if m.preset in PRESETS and not e:
        shape = resolve_model_shape(m, vocab_size=1)
        if shape["d_model"] % shape["n_heads"]:
            e.append(f"model.d_model = {shape['d_model']}: must be divisible by model.n_heads = {shape['n_heads']}")
        elif shape["family"] != "gpt2" and (shape["d_model"] // shape["n_heads"]) % 2:
            e.append(f"model.d_model = {shape['d_model']}: d_model / n_heads = {shape['d_model'] // shape['n_heads']} "
                     "must be even (RoPE rotates pairs of dimensions)")
        if dc.seq_len > shape["context"]:
            e.append(f"data.seq_len = {dc.seq_len}: must be <= model.context = {shape['context']}")

    st = cfg.streaming
    from ray_diloco.core.quantize import FORMATS

    need(st.fragments >= 1, "streaming.fragments", st.fragments, "must be an integer >= 1 (1: plain DiLoCo)")
    need(st.layers_per_fragment is None or st.layers_per_fragment >= 1, "streaming.layers_per_fragment",
         st.layers_per_fragment, "must be an integer >= 1 (or none)")
    if st.layers_per_fragment is not None and st.fragments != 1:
        e.append(f"streaming.layers_per_fragment = {st.layers_per_fragment}: set either it or streaming.fragments "
                 f"(= {st.fragments}), not both")
    need(st.pattern in PATTERNS, "streaming.pattern", st.pattern, f"must be one of {', '.join(PATTERNS)}")
    need(st.overlap_steps >= 0, "streaming.overlap_steps", st.overlap_steps, "must be an integer >= 0")
    need(0 <= st.alpha <= 1, "streaming.alpha", st.alpha, "must be in [0, 1]")
    need(st.quantization in FORMATS, "streaming.quantization", st.quantization, f"must be one of {', '.join(FORMATS)}")
    need(st.closing_round in CLOSING_ROUNDS, "streaming.closing_round", st.closing_round,
         f"must be one of {', '.join(CLOSING_ROUNDS)}")
    if m.preset in PRESETS and not e:
        layers = resolve_model_shape(m, vocab_size=1)["n_layers"]
        P = cfg.block_fragments
        if P > layers:
            e.append(f"streaming.fragments = {P}: must be <= model.n_layers = {layers} (a fragment holds whole blocks)")
        else:
            check_overlap(cfg.diloco.H, num_fragments(P), st.overlap_steps, e)
    n = cfg.network
    need(n.bandwidth_gbps is None or (1e-6 <= n.bandwidth_gbps <= 1e6), "network.bandwidth_gbps",
         n.bandwidth_gbps, "must be in [1e-6, 1e6] Gbit/s (or none: no emulation)")
    need(0 <= n.latency_ms <= 60_000, "network.latency_ms", n.latency_ms, "must be in [0, 60000] milliseconds")

    r = cfg.run
    need(1 <= r.steps <= MAX_STEPS, "run.steps", r.steps, f"must be an integer in 1..{MAX_STEPS:,}")
    need(r.tokens_per_parameter is None or (r.tokens_per_parameter > 0 and math.isfinite(r.tokens_per_parameter)),
         "run.tokens_per_parameter", r.tokens_per_parameter, "must be a finite number > 0 (or none: use run.steps)")
    need(0 <= r.seed < 2**32, "run.seed", r.seed, "must be an integer in [0, 2**32)")
    need(r.eval_every >= 0, "run.eval_every", r.eval_every, "must be >= 0 outer steps (0: only at the end)")
    need(r.eval_batch >= 1, "run.eval_batch", r.eval_batch, "must be an integer >= 1")
    need(r.checkpoint_every >= 0, "run.checkpoint_every", r.checkpoint_every, "must be >= 0 outer steps (0: only at the end)")
    need(r.name is None or (r.name not in ("", ".", "..") and "/" not in r.name and "\\" not in r.name),
         "run.name", r.name, "must be a plain directory name (no path separators)")
    need(r.keep_checkpoints >= 1, "run.keep_checkpoints", r.keep_checkpoints, "must be an integer >= 1")
    need(r.precision in PRECISIONS, "run.precision", r.precision, f"must be one of {', '.join(PRECISIONS)}")
    t = cfg.tracking
    need(t.mode in TRACKING_MODES, "tracking.mode", t.mode, f"must be one of {', '.join(TRACKING_MODES)}")
    need(t.init_timeout_s > 0 and math.isfinite(t.init_timeout_s), "tracking.init_timeout_s", t.init_timeout_s,
         "must be a finite number of seconds > 0")
    if e:
        raise ConfigError(e)
