"""The config's dataclass sections, their typed fields and the quantities derived from them.

Each field has a type (``Literal[...]`` where the values are an enumeration), a default and the
docstring directly under it; ``docs/configuration.md`` is generated from them
(:mod:`ray_diloco.config.reference`). The allowed-values tuples (:data:`ALGORITHMS`, ...) are the
Literals' arguments, so validation, the wire format and the reference share one list.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from ray_diloco.config.presets import PRESETS, PresetName, resolve_model_shape

Algorithm = Literal["diloco", "dp"]
OuterOptimizer = Literal["nesterov", "sgd", "adam"]
Precision = Literal["fp32", "bf16"]
Family = Literal["gpt2", "llama", "qwen3"]
TrackingMode = Literal["auto", "online", "offline", "disabled"]
Pattern = Literal["strided", "sequential"]
ClosingRound = Literal["average", "outer", "none"]
JoinInnerState = Literal["peer", "fresh"]
ReplicaNodes = Literal["one", "several"]
Sharding = Literal["ddp", "fsdp", "hsdp"]
CompileMode = Literal["auto", "true", "false"]
#: Wire formats; a format's id in the wire message is its index here (:mod:`ray_diloco.core.quantize`).
QuantFormat = Literal["none", "bf16", "fp8_e4m3", "int8", "fp4_e3m0"]

ALGORITHMS: tuple[str, ...] = typing.get_args(Algorithm)
OUTER_OPTIMIZERS: tuple[str, ...] = typing.get_args(OuterOptimizer)
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)
FAMILIES: tuple[str, ...] = typing.get_args(Family)
TRACKING_MODES: tuple[str, ...] = typing.get_args(TrackingMode)
PATTERNS: tuple[str, ...] = typing.get_args(Pattern)
CLOSING_ROUNDS: tuple[str, ...] = typing.get_args(ClosingRound)
JOIN_INNER_STATES: tuple[str, ...] = typing.get_args(JoinInnerState)
REPLICA_NODES: tuple[str, ...] = typing.get_args(ReplicaNodes)
SHARDINGS: tuple[str, ...] = typing.get_args(Sharding)
COMPILE_MODES: tuple[str, ...] = typing.get_args(CompileMode)
QUANTIZATION_FORMATS: tuple[str, ...] = typing.get_args(QuantFormat)
PRESET_NAMES: tuple[str, ...] = typing.get_args(PresetName)

#: Most inner steps one run may have (more is a typo or an overflowing token budget).
MAX_STEPS = 10**9
#: Smallest byte-level BPE vocabulary: the 256 bytes and a few merges (both data paths refuse less).
MIN_BPE_VOCAB = 260
BPE_VOCAB_RULE = f"must be at least {MIN_BPE_VOCAB} (256 bytes and merges)"


@dataclass
class ModelConfig:
    """Decoder-only LM shape. ``preset`` fills every field left as ``None`` (see ``PRESETS`` in
    :mod:`ray_diloco.config.presets`)."""

    preset: PresetName = "tiny"
    """Size preset: ``tiny`` (nanoGPT's CPU baby GPT: gpt2 family, 4 layers, 4 heads, 128 wide, FFN 512,
    context 64), ``cpu-small``, ``cpu-medium`` (llama), and the sizes of Scaling Laws for DiLoCo
    (arXiv 2503.09799, section 3) ``35m`` ... ``10b`` (qwen3, context 2048, z-loss 1e-4, tied embeddings,
    SwiGLU width 2/3 of the paper's FFN: the names' parameter counts at a 32768 vocabulary)."""
    family: Family | None = None
    """``gpt2`` (nanoGPT's GPT: learned positions, LayerNorm, GELU MLP), ``llama`` (RoPE, RMSNorm, SwiGLU)
    or ``qwen3`` (llama plus QK-norm); None: the preset's."""
    n_layers: int | None = None
    """Decoder blocks; None: the preset's."""
    n_heads: int | None = None
    """Attention heads; None: the preset's."""
    d_model: int | None = None
    """Width (hidden size); None: the preset's."""
    d_ff: int | None = None
    """FFN width (the GELU MLP of gpt2, the SwiGLU of llama and qwen3); None: the preset's."""
    context: int | None = None
    """Maximum sequence length, in tokens; None: the preset's."""
    vocab_size: int | None = None
    """Vocabulary size; None: taken from the tokenizer."""
    z_loss: float | None = None
    """z-loss coefficient (arXiv 2503.09799, section 3); None: the preset's (1e-4 for the paper's sizes)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of the weights."""
    tie_embeddings: bool | None = None
    """Share the input embedding matrix with the LM head; None: the preset's (True for the scaling-law
    sizes, as in the paper, False for ``tiny``, ``cpu-small``, ``cpu-medium``)."""
    init_from: str | None = None
    """Start from a Hugging Face model's weights (continued pre-training): a local model directory
    (``config.json`` and safetensors, as ``save_pretrained`` writes) or a hub id such as
    ``meta-llama/Llama-3.2-1B`` (fetched once into the Hugging Face cache by the job). Its family
    (gpt2, llama or qwen3) and shape replace ``preset``'s (a shape field set to another value is an
    error); its tokenizer is the data's unless ``data.tokenizer`` names another than ``char``; every
    replica starts from its weights (fp32). None: random initialisation of the preset's shape."""


@dataclass
class DataConfig:
    """Where the text comes from and how it is tokenised and packed."""

    prepared: str | None = None
    """A token store made by ``ray-diloco prepare`` (a directory, or a URI such as ``s3://bucket/store``):
    workers read their own windows from its shards, memory-mapped or fetched on demand; ``path``,
    ``dataset``, ``tokenizer``, ``val_fraction`` do not apply (the store fixes them). None: ``path``."""
    path: str | None = None
    """Local text file: .txt/.md/.text, .jsonl/.json, .parquet or .csv; None: ``dataset`` when set, else
    the bundled Tiny Shakespeare."""
    dataset: str | None = None
    """Hugging Face hub dataset name, e.g. ``allenai/c4`` (used when ``path`` is None)."""
    dataset_config: str | None = None
    """Hub dataset configuration, e.g. ``en``."""
    split: str = "train"
    """Hub dataset split."""
    text_field: str = "text"
    """Column holding the text (JSON, Parquet, CSV and hub datasets)."""
    streaming: bool = True
    """Stream the hub dataset instead of downloading it whole (hub datasets only)."""
    max_documents: int | None = None
    """Cap on the documents read (hub streaming needs one); None: all of them."""
    tokenizer: str = "char"
    """``char``, ``bpe`` (trained on the text), or a Hugging Face tokenizer name or local path. With
    ``model.init_from``, ``char`` (the default) means that model's tokenizer."""
    bpe_vocab_size: int = 4096
    """Vocabulary of the BPE tokenizer trained when ``tokenizer`` is ``bpe``."""
    seq_len: int = 64
    """Tokens per packed training sequence (at most ``model.context``)."""
    val_fraction: float = 0.1
    """Fraction of the token stream (its tail) held out for validation."""
    cache_dir: str | None = None
    """Where a local file (``path`` or the bundled corpus) is kept once tokenised, as a token store keyed
    by the file's sha256, the tokenizer and the settings above, so a restart or resume does not tokenise
    it again. None: ``$RAY_DILOCO_CACHE``, else ``~/.cache/ray-diloco``."""
    in_process_bytes: int = 64 << 20
    """A ``path`` file up to this many bytes (and any with ``max_documents``) is read and tokenised in
    the job's process; a bigger one by ``prepare``'s Ray Data pipeline (tokenizer actors, flat memory)
    into the same cache, with the same tail split and window order recorded in its manifest; its text
    file is read a line at a time (no EOS inside it) and a ``char``/``bpe`` tokenizer is built from a
    32 MB sample (``char`` then has ``<unk>`` and an EOS). Default 64 MiB."""


@dataclass
class InnerConfig:
    """Inner optimiser (AdamW) and its lr schedule, per replica (DiLoCo, arXiv 2311.08105,
    Algorithm 1 lines 4-7: the inner loop)."""

    lr: float = 1e-3
    """Peak AdamW learning rate (linear warmup, then cosine decay)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not to norm gains and biases)."""
    warmup_steps: int = 100
    """Inner steps of linear lr warmup."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays the lr to ``lr * min_lr_ratio``."""
    grad_clip: float = 1.0
    """Gradient-norm clipping threshold; 0 disables clipping."""
    global_batch: int = 12
    """Sequences per inner step, summed over all replicas and workers (divisible by
    ``diloco.replicas x diloco.workers_per_replica``)."""
    micro_batch: int | None = None
    """Sequences per forward/backward pass on one worker: the worker's share of the global batch is
    accumulated over ``batch_per_worker / micro_batch`` passes (gradient accumulation; DDP reduces once,
    on the last); must divide it. None: one pass of the whole share."""


@dataclass
class OuterConfig:
    """Outer optimiser applied to the averaged pseudo-gradient (DiLoCo, arXiv 2311.08105,
    Algorithm 1 lines 8-12)."""

    name: OuterOptimizer = "nesterov"
    """``nesterov`` (the DiLoCo paper's), ``sgd`` (heavy-ball momentum, or plain SGD with momentum 0) or
    ``adam``."""
    lr: float = 0.7
    """Outer learning rate (eta)."""
    momentum: float = 0.9
    """Nesterov / heavy-ball momentum (Adam: beta1), in [0, 1)."""
    adam_beta2: float = 0.95
    """Outer Adam beta2."""
    adam_eps: float = 0.1
    """Outer Adam epsilon: the DiLoCo paper (arXiv 2311.08105) finds outer Adam needs ~0.1 to be stable."""


@dataclass
class DiLoCoConfig:
    """Replicas (M), workers per replica, the sync interval H, and elasticity (fault tolerance): the
    quorum of an outer step, the replica count to grow to, how long a sync round waits for a missing
    replica, and how many replica failures a run survives."""

    replicas: int = 2
    """M, independent model replicas."""
    workers_per_replica: int = 1
    """Ray actors per replica (DDP or FSDP inside the replica: ``sharding``)."""
    sharding: Sharding = "ddp"
    """Inside a replica: ``ddp`` (every worker holds the whole model and inner-optimiser state) or ``fsdp``
    (FSDP2 ``fully_shard`` per decoder block: each worker holds 1/W of them; bf16 precision gathers
    parameters in bf16 over fp32 masters). With ``fsdp`` each worker exchanges its own part of every
    fragment with the outer optimiser (nothing is gathered on one rank). Needs ``workers_per_replica >= 2``.
    ``hsdp``: FSDP2 on a 2-D mesh, the replica's W workers as W / S replicate groups of
    ``shard_group_size`` S consecutive ranks, each group sharding the model over its S ranks (1/S
    each) and the groups all-reducing gradients (a shard group within a node, the groups across
    nodes); the first group's ranks exchange their rows with the outer optimiser."""
    shard_group_size: int | None = None
    """S, ranks per shard group under ``sharding: hsdp``: divides ``workers_per_replica``, 2 <= S < W;
    None: the largest divisor of W up to 8 and W / 2 (8: one node of GPUs). Only with ``hsdp``."""
    H: int = 50
    """H, inner steps between outer steps."""
    cpus_per_worker: float | None = None
    """CPUs reserved per worker; None: the cluster's CPUs shared evenly (at least 0.5 each). A worker's
    torch, numba and OpenMP threads are ``floor`` of it, at least 1 (``components.threads``)."""
    outer_cpus: float = 0
    """CPUs reserved for each process of the outer side (the driver, and each of the K shards when
    ``outer_shards`` > 1); their threads are ``floor`` of it, at least 1. 0: nothing reserved, one
    thread (the outer step of a large model wants more: e.g. 4 on a head node with cores to spare)."""
    gpus_per_worker: float = 0
    """GPUs per worker (CUDA and NCCL when > 0)."""
    placement_timeout_s: float = 120.0
    """Seconds to wait for the replicas' placement groups (and, with ``wait_for_nodes``, for the nodes)."""
    wait_for_nodes: bool = False
    """The cluster autoscales (``ray up`` with ``min_workers: 0`` GPU node types, KubeRay): when it has too
    few CPUs/GPUs at start, ask the autoscaler for the workers' bundles (``request_resources``) and wait up
    to ``placement_timeout_s`` for them instead of stopping at once. Set ``cpus_per_worker`` with it."""
    replica_nodes: ReplicaNodes = "one"
    """Where a replica's workers run: ``one`` node (a STRICT_PACK placement group: DDP traffic stays inside
    the node) or ``several`` (PACK: as few nodes as possible, for a replica larger than a node; NCCL then
    crosses the network between them)."""
    pg_timeout_s: float = 300.0
    """torch.distributed collective / rendezvous timeout, in seconds."""
    min_replicas: int = 1
    """Quorum: a sync round takes an outer step only with at least this many valid pseudo-gradients;
    with fewer it fails (global parameters and outer state unchanged, replicas keep their local
    progress). In [1, ``diloco.replicas``]."""
    max_replicas: int | None = None
    """Grow to this many replicas when the cluster has room (scale-up); None: ``diloco.replicas`` (no
    scale-up). Each of the ``max(replicas, max_replicas)`` slots owns a data shard."""
    sync_timeout_s: float = 60.0
    """Seconds after a sync round opened at which it completes without the replicas that have not sent
    (dropped from that average); a replica still training this long after the others finished an
    outer step is removed as unresponsive."""
    max_failures: int = 20
    """Replica failures (deaths, failed starts) a run survives before it stops with an error."""
    join_inner_state: JoinInnerState = "peer"
    """A joining replica's inner optimiser: ``peer`` (a live replica's AdamW state) or ``fresh``."""
    spare_replicas: int = 0
    """Hot spares: replicas started and set up in advance, outside the quorum, admitted at the next
    outer step when a replica dies (they need room: set ``diloco.cpus_per_worker``)."""
    driver_resource: str = ""
    """Where the outer-optimiser driver runs. Empty: on the node of the job's process (the head under
    ``ray job submit``), pinned there (node affinity), never on a replica's node by the scheduler's
    choice, so a replica node's loss does not take the outer state with it. A name: on a node that
    offers this custom Ray resource (``ray start --resources='{"NAME": 1}'``), e.g. a small CPU node
    of its own; the driver takes 0.001 of it."""
    outer_shards: int = 1
    """K, outer-optimiser shards: every fragment's flat parameters split into K contiguous slices
    (``core.shards.shard_bounds``), each owned by one shard actor with its own outer-optimiser state,
    placed round-robin on the replicas' nodes, so the exchange's bytes spread over K nodes' links (K = replica
    nodes: each node sends and receives about a ring all-reduce's bytes). 1: the driver itself holds
    the global parameters. Results are bitwise the same for every K (SGD/Nesterov)."""
    outer_shard_backup: bool = True
    """With K > 1: after every outer step each shard's new state (global values, outer-optimiser
    momentum, residual) is copied to the next shard, so a shard lost with its node is rebuilt on a live
    node with the same bits and the run goes on (docs/elasticity.md). Costs each shard a second copy of
    its neighbour's slice (2 U/K with SGD/Nesterov, U = 4 bytes x parameters) and as many bytes per
    outer step. false: a shard's loss stops the run (resume from the last checkpoint)."""


@dataclass
class StreamingConfig:
    """Streaming DiLoCo (arXiv 2501.18512, section 2): fragments, overlap, quantised exchange.

    ``fragments: 1`` is plain DiLoCo (one fragment holding every parameter). With P >= 2 the
    transformer blocks are split into P fragments (``pattern``), and the embeddings and the
    final norm + LM head sync as two more small fragments, so a run has P + 2 fragments whose
    sync offsets are spread evenly over H.
    """

    fragments: int = 1
    """P, fragments of transformer blocks; 1: plain DiLoCo (one fragment of every parameter)."""
    layers_per_fragment: int | None = None
    """Instead of ``fragments``: P = ceil(layers / this) (3 in arXiv 2501.18512); None: use ``fragments``."""
    pattern: Pattern = "strided"
    """Blocks of a fragment: ``strided`` (fragment j holds blocks j, j+P, ...) or ``sequential``
    (consecutive blocks)."""
    overlap_steps: int = 0
    """tau: inner steps between sending a fragment and merging its new global value; must be < H / F,
    F = all fragments (P + 2 when P >= 2; ``ray-diloco plan`` shows F)."""
    alpha: float = 0.0
    """Merge of a fragment's new global value: theta <- alpha * theta_local + (1 - alpha) * new_global."""
    quantization: QuantFormat = "none"
    """Wire format of pseudo-gradients and outer updates, both ways: ``none`` (fp32), ``bf16``, ``fp8_e4m3``,
    ``int8`` or ``fp4_e3m0`` (per-block absmax scales)."""
    error_feedback: bool = False
    """Add each round's quantisation residual to the next round's value (replicas and driver)."""
    device_globals: bool = True
    """On a GPU: keep a device copy of the global parameters (+4 bytes per parameter of GPU memory, 1/W of
    it per rank with FSDP) so pseudo-gradients are computed, quantised (error-feedback residuals kept there)
    and merged on the GPU, on a side stream off the training stream, only message bytes crossing to the
    host; false: read through host copies on the training thread and quantise on the host (saves the
    memory, stalls training for each copy). No effect on CPU."""
    closing_round: ClosingRound = "average"
    """At the last step, fragments off their phase sync once more: ``average`` (global = the replicas'
    weighted mean), ``outer`` (an ordinary outer step) or ``none`` (no closing round)."""


@dataclass
class NetworkConfig:
    """WAN emulation on every replica-to-driver link (and DP's all-reduce), for experiments."""

    bandwidth_gbps: float | None = None
    """Bandwidth of every link, in Gbit/s; None: no bandwidth delay (no emulation)."""
    latency_ms: float = 0.0
    """One-way latency added to every message, in milliseconds."""


@dataclass
class RunConfig:
    """Length, cadence and outputs of a run."""

    steps: int = 2000
    """Inner steps in the run (every replica takes all of them)."""
    tokens_per_parameter: float | None = None
    """The scaling-law token budget D = this x N (20 in arXiv 2503.09799, section 3): sets
    ``run.steps = ceil(D / (inner.global_batch x data.seq_len))``, N counted from the model; None: use
    ``run.steps``."""
    eval_every: int = 10
    """Outer steps between evaluations of the global parameters (0: only at the end)."""
    eval_batch: int = 64
    """Sequences per evaluation forward pass."""
    eval_tokens: int | None = None
    """Validation tokens an evaluation reads (the first ones of the validation split, spread over the
    workers); None: the whole validation split up to 1,048,576 tokens."""
    checkpoint_every: int = 10
    """Outer steps between checkpoints (0: only at the end)."""
    keep_checkpoints: int = 3
    """Newest checkpoints kept (older ones are deleted)."""
    output_dir: str = "runs"
    """Parent directory of run directories."""
    name: str | None = None
    """Run directory name; None: a timestamp."""
    seed: int = 0
    """Seed of the model initialisation and the data order."""
    deterministic: bool = False
    """torch deterministic algorithms: a bitwise-reproducible resume."""
    precision: Precision = "fp32"
    """``fp32`` or ``bf16`` (autocast; the outer state stays fp32). bf16 is for GPUs: on CPU, autocast runs
    about 10x slower than fp32."""
    export_precision: Precision | None = None
    """dtype of the exported model's safetensors (``final/``): ``fp32`` or ``bf16``; None: ``precision``'s.
    The outer-optimiser driver writes them fragment by fragment: the job's process never holds the model."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward pass instead of keeping them
    (transformers' activation checkpointing, non-reentrant): less memory, about a third more compute."""
    compile: CompileMode = "auto"
    """``torch.compile`` each decoder block of the model in place (torchtitan's way; with FSDP2 the
    compiled blocks are then sharded): ``auto`` on workers with CUDA, off on CPU; ``true``/``false``
    force it (on CPU inductor needs a C++ compiler). The first inner step of each worker process
    compiles (``compile_s`` in the metrics, left out of ``tokens_per_s``); merges, resyncs and
    checkpoint loads do not recompile."""
    log_hashes: bool = False
    """Log the sha256 of the global parameters, the outer state, each worker's global and local parameters
    and the data read, per outer step."""
    address: str | None = None
    """Ray address: ``auto`` (the cluster running on this machine), HOST:PORT or ``ray://``; None
    (or ``local``): a local cluster of the run's own, even when another runs on the machine
    (under ``ray job submit``: the job's cluster, from ``RAY_ADDRESS``)."""
    storage_path: str | None = None
    """Where run directories persist: a local path (used instead of ``run.output_dir``), or a URI
    (``s3://``, ``gs://``, ``file://``, any pyarrow or fsspec filesystem): the run is staged in
    ``run.output_dir`` and mirrored to ``storage_path/NAME`` after every checkpoint and at the end (``--resume URI``
    continues it anywhere); None: ``run.output_dir``."""


@dataclass
class TrackingConfig:
    """metrics.jsonl is always written; W&B and the progress bar are optional."""

    wandb: bool = True
    """Log to Weights & Biases."""
    mode: TrackingMode = "auto"
    """W&B mode: ``auto`` (online only with an API key), ``online``, ``offline`` or ``disabled``."""
    project: str = "ray-diloco"
    """W&B project."""
    entity: str | None = None
    """W&B entity (user or team); None: W&B's default entity."""
    name: str | None = None
    """W&B run name; None: the run directory name."""
    group: str | None = None
    """W&B group."""
    tags: list[str] = field(default_factory=list)
    """W&B tags (comma-separated with ``--set``)."""
    log_model: bool = False
    """Upload the exported model (``final/``) as a W&B artifact of type ``model``."""
    init_timeout_s: float = 60.0
    """Seconds to wait for the W&B server; after that (or any W&B error) the run logs offline in
    ``RUN_DIR/wandb`` (``wandb sync`` uploads it later) and trains on."""
    progress: bool = True
    """Show the progress bar."""


@dataclass
class Config:
    """The whole run: the algorithm and one section per concern."""

    algorithm: Algorithm = "diloco"
    """``diloco`` or ``dp`` (the data-parallel baseline: one DDP group, no outer optimiser)."""
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
    def exchange_units(self) -> int:
        """Outer-exchange units per fragment: ``diloco.workers_per_replica`` with ``diloco.sharding:
        fsdp``, S under ``hsdp`` (each rank of a shard group exchanges its own rows,
        ``core.shards.exchange_index``), else 1."""
        return self.shard_group_size

    @property
    def shard_group_size(self) -> int:
        """S, the ranks one copy of the model is sharded over inside a replica: W under ``fsdp``,
        ``diloco.shard_group_size`` (default: the largest divisor of W up to min(8, W / 2)) under
        ``hsdp``, 1 under ``ddp``."""
        d = self.diloco
        if d.sharding == "hsdp":
            w = d.workers_per_replica
            return (
                d.shard_group_size
                if d.shard_group_size is not None
                else max([g for g in range(2, min(8, w // 2) + 1) if w % g == 0] or [1])
            )
        return d.workers_per_replica if d.sharding == "fsdp" else 1

    @property
    def micro_batch(self) -> int:
        """Sequences per forward/backward pass on one worker: ``inner.micro_batch``, or the whole
        :attr:`batch_per_worker` when it is None."""
        return self.inner.micro_batch or self.batch_per_worker

    @property
    def block_fragments(self) -> int:
        """P, the number of fragments of transformer blocks (``layers_per_fragment`` wins when set)."""
        s = self.streaming
        if s.layers_per_fragment is not None and s.layers_per_fragment >= 1 and self.model.preset in PRESETS:
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
