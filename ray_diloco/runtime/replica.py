"""The replica worker: one Ray actor per (replica, rank), running the inner loop.

A replica is ``workers_per_replica`` of these actors in one STRICT_PACK placement group. With
more than one worker they form their own ``torch.distributed`` group (gloo on CPU, NCCL on GPU)
through a ``TCPStore`` on rank 0 and train with DDP; all ranks of a replica hold identical
parameters and inner-optimiser state. Rank 0 computes the replica's pseudo-gradient.

The inner loop (DiLoCo, arXiv 2311.08105, Algorithm 1 lines 4-7): AdamW with the lr a pure
function of the global inner step (warmup + cosine), gradient clipping, bf16 autocast optional,
gradient accumulation over micro-batches, activation checkpointing and ``torch.compile`` optional;
the AdamW state is kept across outer steps, never reset or averaged. The loss stays on the
device and is read once per ``train`` call. Every state that leaves a worker (checkpoint, a
joiner's inner state, fragments) is on the host. The fragment syncs (send,
overlap, merge, checkpointed syncs in flight) are ``core.sync.FragmentSync``, driven here after
every inner step through a :class:`~ray_diloco.runtime.link.Link`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import socket
import time
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import ray
import torch

from ray_diloco.components.data import ShardReader
from ray_diloco.components.evaluate import evaluate_loss, run_autocast
from ray_diloco.config import load_config
from ray_diloco.core.fragments import (
    Fragment,
    ParamSpec,
    flatten,
    fragment_plan,
    param_specs,
    plan_fragments,
    tensor_hash,
    unflatten_into,
)
from ray_diloco.core.schedules import SyncSchedule, inner_lr
from ray_diloco.core.shards import rank_fragment
from ray_diloco.core.staging import DeviceStaging
from ray_diloco.core.sync import FragmentSync
from ray_diloco.core.wire import link_delay_s
from ray_diloco.errors import ClusterError, ConfigError
from ray_diloco.models.transformer import (
    ModelFn,
    build_model,
    lm_loss,
    logits_of,
    make_inner_optimizer,
    resolve_model_shape,
)
from ray_diloco.runtime.link import Link, fetch_global

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

#: The worker actor's concurrency group for calls that must be answered while ``train`` runs
#: (they touch no training state); every other call runs one at a time on the default group.
CONTROL_GROUP = "control"


def _dp_emulation_hook(worker: ReplicaWorker):
    """DDP comm hook for the DP baseline under WAN emulation (``ReplicaWorker(allreduce_emulation=True)``):
    the real all-reduce, plus the emulated time of a ring all-reduce of the bucket (each rank
    sends and receives ``2 (R-1)/R`` of the bucket's bytes over ``2 (R-1)`` hops), slept after
    the optimiser step."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    net = worker.cfg.network

    def hook(state, bucket):
        R = dist.get_world_size()
        nbytes = int(2 * bucket.buffer().numel() * bucket.buffer().element_size() * (R - 1) / R)
        worker.dp_bytes += nbytes
        worker.dp_delay_s += link_delay_s(nbytes, net.bandwidth_gbps, 0.0) + 2 * (R - 1) * net.latency_ms / 1e3
        return allreduce_hook(state, bucket)

    return hook


def worker_device(gpus_per_worker: float) -> tuple[torch.device, str | None]:
    """The device a worker trains on and, when GPUs were asked for but this process's torch has
    no CUDA, the one-line problem (reported by the worker's first call, not by training on CPU)."""
    if gpus_per_worker <= 0:
        return torch.device("cpu"), None
    if torch.cuda.is_available():
        return torch.device("cuda", 0), None
    return torch.device("cpu"), (
        f"diloco.gpus_per_worker = {gpus_per_worker:g}: torch {torch.__version__} on node "
        f"{socket.gethostname()} has no CUDA (torch.cuda.is_available() is False); install a CUDA build "
        "of torch on the GPU nodes, or set diloco.gpus_per_worker=0 to train on CPUs"
    )


def worker_model(
    cfg: Any, vocab_size: int, model_fn: ModelFn | None
) -> tuple[torch.nn.Module, torch.device, Exception | None]:
    """The worker's model built on its device (``torch.cuda.set_device`` first on a GPU), with
    ``run.activation_checkpointing`` (transformers' non-reentrant activation checkpointing of every
    decoder block), and the problem the worker's ``setup`` reports: ``ClusterError`` (GPUs asked
    for, no CUDA) or ``ConfigError`` (activation checkpointing of a model without it)."""
    device, device_problem = worker_device(cfg.diloco.gpus_per_worker)
    problem: Exception | None = ClusterError(device_problem) if device_problem else None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # built and initialised on its device: on a GPU no fp32 copy of the model passes through host
    # memory (40 GB per worker at 10B parameters); the seed fixes the values on each device type
    with torch.device(device) if device.type == "cuda" else nullcontext():
        model = build_model(cfg, vocab_size, model_fn)
    model = model.to(device)  # a model_fn that allocates on a fixed device
    if cfg.run.activation_checkpointing:
        new = getattr(model, "activation_checkpointing_enable", None)  # transformers 5; 4.x: gradient_...
        old = getattr(model, "gradient_checkpointing_enable", None)
        if (new is None and old is None) or not getattr(model, "supports_gradient_checkpointing", False):
            problem = problem or ConfigError(
                [
                    f"run.activation_checkpointing = true: the model ({type(model).__name__}) "
                    "has no transformers activation checkpointing; set it to false"
                ]
            )
        elif new is not None:
            new({"use_reentrant": False})
        else:
            assert old is not None  # the first branch takes a model with neither
            old(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, device, problem


def to_host(obj: Any, copy_tensors: bool = True) -> Any:
    """A copy of a (nested dict/list/tuple) state with every tensor detached and copied to host
    memory (what leaves a worker: the job's process may have no GPU), a DTensor (FSDP) as its
    local shard. Other values are deep-copied. ``copy_tensors=False``: not a copy for tensors
    already on the host, which are kept as they are (a state written to a file at once: no
    second copy of the optimiser state)."""
    from torch.distributed.tensor import DTensor  # here: importing it takes ~1 s, most workers never need it

    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=copy_tensors)
    if isinstance(obj, dict):
        return {k: to_host(v, copy_tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v, copy_tensors) for v in obj)
    return copy.deepcopy(obj)


def accumulate_gradients(
    net: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    micro: int,
    z_loss: float,
    autocast: Any,
    device: torch.device,
) -> torch.Tensor:
    """Forward and backward of the batch ``x``, ``y`` (int64 ``[B, T]``, host) in passes of
    ``micro`` sequences (``micro`` divides B); each pass's loss is scaled by ``micro / B`` so the
    accumulated gradient is the whole batch's. A DDP ``net`` reduces gradients on the last pass only.
    Returns the batch's mean cross-entropy (nats/token), a fp32 scalar on ``device``."""
    n = x.shape[0] // micro
    ce_sum: torch.Tensor | None = None
    for j in range(n):
        xm, ym = x[j * micro : (j + 1) * micro], y[j * micro : (j + 1) * micro]
        if hasattr(net, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter on the last pass only
            cast("FSDPModule", net).set_requires_gradient_sync(j == n - 1)
        quiet = (
            cast("DistributedDataParallel", net).no_sync()
            if n > 1 and j < n - 1 and hasattr(net, "no_sync")
            else nullcontext()
        )
        with quiet:
            with autocast():
                logits = logits_of(net(xm.to(device, non_blocking=True)))
            loss, ce = lm_loss(logits, ym.to(device, non_blocking=True), z_loss)
            (loss / n if n > 1 else loss).backward()
        ce_sum = ce.detach() if ce_sum is None else ce_sum + ce.detach()
    assert ce_sum is not None  # micro divides the batch: at least one pass
    return ce_sum / n if n > 1 else ce_sum


def _init_group(master: tuple[str, int], rank: int, world_size: int, device: torch.device, timeout_s: float) -> bool:
    """Join the replica's ``torch.distributed`` group (gloo on CPU, NCCL on a GPU) through the
    TCPStore of rank 0 at ``master`` (host, port). Returns True."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master[0], master[1], world_size, is_master=rank == 0, timeout=timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return True


def _max_over_ranks(value: int, device: torch.device) -> int:
    """The largest ``value`` over the ranks of the replica's process group."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _free_port() -> int:
    """A TCP port free on this node now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _mean_over_ranks(value: torch.Tensor, world_size: int) -> float:
    """The mean of a fp64 scalar over the ``world_size`` ranks of the replica's process group
    (1: no group, the value itself). ``value`` is on the group's device (gloo: CPU, NCCL: the GPU)."""
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(value)
        value /= world_size
    return float(value)


class WorkerState:
    """What a replica worker holds and how it leaves and enters it: its parameters (FSDP: its
    rows), inner-optimiser state, data position and RNG for checkpoints and joiners, and the
    driver's global fragments. The base of :class:`ReplicaWorker` (which sets every attribute
    used here: ``params``, ``sync_fragments``, ``sync``, ``optimizer``, ``reader``, ``fsdp``)."""

    # set by ReplicaWorker (declared here for the type checker; no values)
    replica: int
    rank: int
    world_size: int
    fsdp: bool
    device: torch.device
    specs: list[ParamSpec]
    params: dict[str, torch.Tensor]
    sync_fragments: list[Fragment]
    optimizer: torch.optim.Optimizer
    sync: FragmentSync
    reader: ShardReader | None
    settle: Callable[[], int]

    def _units(self, per_unit: list[Any]) -> list[Any]:
        """This worker's entries, one per fragment, of a list over the outer exchange's units
        (FSDP: unit ``f * W + rank`` is its part of fragment f; DDP: the fragments)."""
        return per_unit[self.rank :: self.world_size] if self.fsdp else per_unit

    def _load_optimizer(self, state: dict[str, Any]) -> None:
        if self.fsdp:
            from ray_diloco.runtime.fsdp import optimizer_state_in

            optimizer_state_in(self.optimizer, state)
        else:
            self.optimizer.load_state_dict(state)

    def local_fragment(self, fragment: int) -> np.ndarray:
        """This worker's current parameters of ``fragment`` as fp32 ``[numel_p]`` (FSDP: its rows)."""
        return flatten(self.params, self.sync_fragments[fragment]).numpy()

    def params_hash(self) -> str:
        """sha256 of this worker's local parameters (fp32 bytes, exchange order)."""
        return tensor_hash([self.params[s.name] for s in self.specs])

    def global_hash(self) -> str:
        """sha256 of the global parameters this worker holds (all fragments)."""
        return self.sync.global_hash()

    def inner_optimizer_state(self) -> dict[str, Any]:
        """A host copy of this worker's inner-optimiser ``state_dict`` (what a joiner may start from)."""
        return to_host(self.optimizer.state_dict())

    def global_fragment(self, fragment: int) -> np.ndarray:
        """The global value of ``fragment`` this worker holds (fp32 ``[numel_p]``)."""
        return self.sync.global_fragment(fragment)

    def load_global(self, fragment: int, global_p: list[Any], version: int = 0) -> None:
        """Adopt the global fragment (fp32 ``[numel_p]``, at ``version`` outer steps; the K outer
        shards' slices as the driver's ``global_refs`` gives them) and overwrite the local ones.
        FSDP: ``fragment`` is an exchange unit; another rank's unit is ignored."""
        if self.fsdp:
            if fragment % self.world_size != self.rank:
                return
            fragment //= self.world_size
        self.sync.load_global(fragment, fetch_global(global_p), version)

    def state_dict(self, full: bool = True, copy_tensors: bool = True) -> dict[str, Any]:
        """Data position and RNG of this worker and its sync state (``last_send``, ``pending``,
        ``comm``: ``core.sync.FragmentSync.state_dict``); with ``full`` also its inner-optimiser
        state, local parameters (identical on every rank of a replica, so only rank 0 sends them)
        and the link's error-feedback ``residuals``."""
        self.settle()  # syncs in flight are answered, so residuals and the driver are settled
        assert self.reader is not None  # opened by setup
        state = {
            "replica": self.replica,
            "rank": self.rank,
            "data": self.reader.state(),
            "torch_rng": torch.get_rng_state(),
            **self.sync.state_dict(residuals=full),
        }
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        if full:
            state["optimizer"] = to_host(self.optimizer.state_dict(), copy_tensors)
            state["local"] = [flatten(self.params, f).numpy() for f in self.sync_fragments]
        return state

    def load_local(self, local: list[np.ndarray]) -> None:
        """Overwrite the local parameters with fp32 ``[numel_p]`` arrays, one per fragment."""
        for f, arr in zip(self.sync_fragments, local):
            unflatten_into(self.params, f, torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a full state (``optimizer`` and ``local`` must be present). Call after
        ``load_global``: syncs that were in flight at the checkpoint merge the global values
        loaded from the driver, at their original merge step."""
        self.load_local(state["local"])
        self._load_optimizer(state["optimizer"])
        assert self.reader is not None  # opened by setup
        self.reader.load_state(state["data"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        self.sync.load_state_dict(state)

    def save_state(
        self, path: str, full: bool = True, token: str | None = None, upload: str | None = None
    ) -> dict[str, Any]:
        """Write :meth:`state_dict` (``full`` as there) with ``checkpoint_id`` ``token`` to ``path``,
        a file of a checkpoint's temporary directory, from this process: the state never travels to
        the job's process; with ``upload`` (the file's URI in ``run.storage_path``) also copy it
        there from here (``components.storage.upload_file``). Returns ``{"file", "bytes", "node"}``
        (+ ``"uploaded"``, or ``"upload_error"``: the job's mirror uploads it); ``{"unseen": True,
        "node"}`` when this node does not see that directory (no ``token`` marker there: the job
        then fetches :meth:`state_dict`); ``{"error": line}`` when the file cannot be written (disk
        full: the job fails the checkpoint, not this replica)."""
        from ray_diloco.components.checkpoint import sees_marker, write_state_file
        from ray_diloco.components.storage import upload_file
        from ray_diloco.errors import CheckpointError

        node = ray.get_runtime_context().get_node_id()
        if token is not None and not sees_marker(Path(path).parent, token):
            return {"unseen": True, "node": node}
        try:  # the state is written before this worker trains again: its tensors need no copy
            size = write_state_file(Path(path), {**self.state_dict(full, copy_tensors=False), "checkpoint_id": token})
        except CheckpointError as e:
            return {"error": str(e)}
        info = {"file": Path(path).name, "bytes": size, "node": node}
        if upload:
            problem = upload_file(Path(path), upload)
            info.update({"uploaded": True} if problem is None else {"upload_error": problem})
        return info

    def restore_state(
        self, own: dict[str, Any], full: dict[str, Any] | None = None, checkpoint_id: str | None = None
    ) -> bool:
        """:meth:`load_state_dict` from this worker's entry of a checkpoint: ``own`` is its file
        (``{"file", "bytes"}``: read here, not in the job's process) or the state itself; ``full``
        (the same kinds) holds the inner-optimiser state and local parameters when ``own`` has
        none (a DDP rank > 0 takes its replica's rank 0's). Returns False, loading nothing, when a
        file is not visible from this node with its recorded size and ``checkpoint_id`` (the job
        then reads it and sends the state).

        Raises:
            CheckpointError: a file is unreadable."""
        from ray_diloco.components.checkpoint import read_own_state

        def fetch(entry: dict[str, Any]) -> dict[str, Any] | None:
            return read_own_state(entry, checkpoint_id) if "file" in entry else dict(entry)

        state = fetch(own)
        base = fetch(full) if full is not None else None
        if state is None or (full is not None and base is None):
            return False
        if base is not None:
            state["optimizer"], state["local"] = base["optimizer"], base["local"]
        self.load_state_dict(state)
        return True


class ReplicaWorker(WorkerState):
    """One rank of one replica.

    Args:
        config: the run config as a dict (``Config.to_dict()``).
        replica: replica index m in ``[0, M)`` (DP: 0).
        rank: rank inside the replica in ``[0, world_size)``.
        world_size: workers in this replica (DP: all workers).
        shard: data shard index in ``[0, num_shards)``, unique per (replica, rank).
        num_shards: total shards (M x workers_per_replica).
        vocab_size: tokenizer vocabulary size.
        model_fn: optional builder ``(shape, vocab_size) -> nn.Module`` replacing the presets.
        allreduce_emulation: the DP baseline under WAN emulation: DDP's all-reduce also sleeps
            the emulated time of a ring all-reduce of each bucket (``network``; needs
            ``world_size > 1``).
    """

    def __init__(self, config: dict[str, Any], replica: int, rank: int, world_size: int, shard: int,
                 num_shards: int, vocab_size: int, model_fn: ModelFn | None = None, allreduce_emulation: bool = False):  # fmt: skip
        self.cfg = load_config(config, validate=False)
        self.replica, self.rank, self.world_size = replica, rank, world_size
        self.shard, self.num_shards = shard, num_shards
        self.allreduce_emulation = allreduce_emulation
        torch.set_num_threads(max(1, int(self.cfg.diloco.cpus_per_worker or 1)))
        if self.cfg.run.deterministic:
            torch.use_deterministic_algorithms(True)
        self.model, self.device, self.problem = worker_model(self.cfg, vocab_size, model_fn)
        self._autocast = run_autocast(self.cfg.run.precision, self.device)  # bf16: autocast on this device
        self.shape = resolve_model_shape(self.cfg.model, vocab_size)
        self.z_loss = float(self.shape["z_loss"])
        self.specs = param_specs(self.model)
        try:
            self.fragments: list[Fragment] = fragment_plan(self.cfg, self.specs)
        except ValueError:  # reported by the trainer (ConfigError) before any training
            self.fragments = plan_fragments(self.specs, 1)
        self.fsdp = self.cfg.exchange_units > 1 and world_size > 1
        self.params: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        self.sync_fragments = self.fragments  # what this worker exchanges of each fragment (FSDP: its rows)
        self.dp_bytes, self.dp_delay_s = 0, 0.0
        self.optimizer = make_inner_optimizer(self.model, self.cfg)
        self.sync = self._new_sync()
        self.net: torch.nn.Module = self.model
        self.reader: ShardReader | None = None
        self.val_tokens: np.ndarray | None = None
        self.group = False

    # -- set-up ----------------------------------------------------------------------------
    def node_address(self) -> tuple[str, int]:
        """``(ip, free TCP port)`` on this node, for the replica's TCPStore (rank 0)."""
        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, master: tuple[str, int] | None, train_tokens: np.ndarray, val_tokens: np.ndarray) -> dict:
        """Join the replica's process group (if world_size > 1), wrap in DDP, open the data shard.

        ``train_tokens``/``val_tokens`` (int32 ``[n]``) arrive from the object store (zero-copy).
        Raises ``RuntimeError`` (from torch) when the rendezvous times out (``pg_timeout_s``),
        ``ClusterError`` when GPUs were asked for and torch has no CUDA (``worker_device``),
        ``ConfigError`` when the model cannot checkpoint activations."""
        if self.problem is not None:
            raise self.problem
        if self.world_size > 1:
            assert master is not None  # rank 0's TCPStore address: the launcher passes it to every rank
            self.group = _init_group(master, self.rank, self.world_size, self.device, self.cfg.diloco.pg_timeout_s)
        if self.fsdp:
            self._shard()
        elif self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(self.model, device_ids=[0] if self.device.type == "cuda" else None)
            net = self.cfg.network
            if self.allreduce_emulation and (net.bandwidth_gbps or net.latency_ms):
                self.net.register_comm_hook(None, _dp_emulation_hook(self))
        if self.cfg.run.compile:
            self.net = cast(torch.nn.Module, torch.compile(self.net))
        self.reader = ShardReader(train_tokens, self.cfg.data.seq_len, self.shard, self.num_shards, self.cfg.run.seed)
        self.val_tokens = val_tokens
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), "device": str(self.device)}

    def _new_sync(self) -> FragmentSync:
        # on_reset a lambda: torch's load_state_dict replaces optimizer.state, so no bound method of it
        return FragmentSync(
            self.params,
            self.sync_fragments,
            alpha=self.cfg.streaming.alpha,
            batch=self.cfg.batch_per_worker,
            seq_len=self.cfg.data.seq_len,
            world_size=self.world_size,
            rank=0 if self.fsdp else self.rank,
            trace=self.cfg.run.trace_syncs,
            on_reset=lambda: self.optimizer.state.clear(),
        )

    def _shard(self) -> None:
        """``diloco.sharding: fsdp``: FSDP2 over the replica's group (``runtime.fsdp``); this
        worker's parameters, fragments, inner optimiser and sync become its rows' (each rank
        sends its own pseudo-gradient part as exchange unit ``f * W + rank``)."""
        from ray_diloco.runtime.fsdp import local_params, shard_model

        shard_model(self.model, self.world_size, self.device, self.cfg.run.precision == "bf16")
        self.params = local_params(self.model)
        self.sync_fragments = [rank_fragment(f, self.world_size, self.rank) for f in self.fragments]
        self.optimizer = make_inner_optimizer(self.model, self.cfg)
        self.sync = self._new_sync()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def pid(self) -> int:
        """This worker's process id (operators, fault injection); answered on the ``control``
        concurrency group, also while :meth:`train` runs, so a kill lands in the running round."""
        return os.getpid()

    def data_windows(self) -> np.ndarray:
        """Training windows (int64 ``[per_shard]``) this worker's shard reads in its current epoch."""
        r = self.reader  # either window order: a numpy permutation's or a Feistel permutation's
        assert r is not None  # opened by setup
        return np.asarray(r._windows(r.epoch, np.arange(r.per_shard, dtype=np.int64)), dtype=np.int64)

    def param_specs(self) -> list[ParamSpec]:
        """Names and shapes of the trainable parameters, in exchange order."""
        return self.specs

    def num_fragments(self) -> int:
        """Number of fragments the parameters are exchanged in (1: plain DiLoCo)."""
        return len(self.fragments)

    # -- outer-step exchange (core.sync.FragmentSync) ---------------------------------------
    def attach(self, driver: Any, schedule: SyncSchedule) -> None:
        """Connect to the outer-optimiser driver; from now on ``train`` syncs fragments on
        ``schedule`` through a background :class:`~ray_diloco.runtime.link.Link`."""
        s, n, k = self.cfg.streaming, self.cfg.network, self.cfg.diloco.outer_shards
        # a GPU worker keeps device globals (core.staging): its copies to and from the host leave
        # the training stream
        staging = DeviceStaging(self.device) if self.device.type == "cuda" and s.device_globals else None
        self.sync.attach(schedule, Link(driver, self.replica, self.rank, s.quantization, s.error_feedback,
                                        n.bandwidth_gbps, n.latency_ms, k, self.sync.buffers,
                                        units=self.world_size if self.fsdp else 1, staging=staging), staging)  # fmt: skip

    def settle(self) -> int:
        """Wait until every sync this worker has started is answered (not merged: merges stay at
        their step); re-raises a failed exchange. Returns the number of syncs in flight."""
        return self.sync.settle()

    def reset_to_global(self) -> None:
        """Local parameters of every fragment <- the global ones this worker holds; the inner
        optimiser state is cleared (used after a rejected, non-finite pseudo-gradient)."""
        self.sync.reset_to_global()

    def join(
        self,
        global_refs: list[Any],
        versions: list[int],
        step: int,
        reader_state: dict | None,
        peer_state: list[Any] | None = None,
        shard: int | None = None,
    ) -> tuple[str, str]:
        """Start as a joiner at inner step ``step``: local and global parameters <- the driver's
        global fragments (object refs of fp32 ``[numel_p]``) at ``versions``; the inner optimiser
        from ``peer_state`` (a list holding the object ref of a live peer's
        ``inner_optimizer_state``, ``diloco.join_inner_state: peer``) or fresh, also when that
        peer died before handing it over; no sync in flight; data shard ``shard`` (default: the
        one it was started with) at the slot's position (None: the shard's start).
        Returns the sha256 of the pseudo-gradient ``global - local`` of every fragment (zero) and
        where the inner optimiser state came from (``peer`` or ``fresh``)."""
        self.sync.join([fetch_global(g) for g in self._units(global_refs)], self._units(versions), step)
        assert self.reader is not None  # opened by setup
        state = None
        if peer_state:
            try:
                state = ray.get(peer_state[0], timeout=60)
            except (ray.exceptions.RayError, TimeoutError):  # the peer died meanwhile: not this replica's fault
                state = None
        if state is not None:
            self._load_optimizer(state)
        else:
            self.optimizer.state.clear()
        if shard is not None and shard != self.shard:
            self.shard = shard
            self.reader = ShardReader(
                self.reader.tokens, self.cfg.data.seq_len, shard, self.num_shards, self.cfg.run.seed
            )
        if reader_state is not None:
            self.reader.load_state(reader_state)
        return self.sync.pseudo_gradient_hash(), "peer" if state is not None else "fresh"

    def sync_trace(self) -> list[dict[str, Any]]:
        """Recorded sync events (``run.trace_syncs``): fp32 tensors at send and merge time."""
        return self.sync.trace

    # -- inner loop ------------------------------------------------------------------------
    def _inner_step(self, step: int, digest: Any) -> tuple[float, torch.Tensor]:
        """One AdamW step at global inner step ``step`` (gradients accumulated over micro-batches);
        returns its lr and the batch's mean cross-entropy (fp32 scalar on the device). The (epoch,
        window) pairs read go into ``digest``."""
        i = self.cfg.inner
        lr = inner_lr(step, i.lr, i.warmup_steps, self.cfg.run.steps, i.min_lr_ratio)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        assert self.reader is not None  # opened by setup
        x, y, idx = self.reader.next_batch(self.cfg.batch_per_worker)
        digest.update(idx.tobytes())
        ce = accumulate_gradients(self.net, x, y, self.cfg.micro_batch, self.z_loss, self._autocast, self.device)
        if i.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), i.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr, ce

    def train(self, start: int, end: int) -> dict[str, Any]:
        """Inner steps ``start .. end-1`` (global inner-step numbers) on this worker's shard.

        Returns the round's metrics: mean train loss (nats/token, averaged over ranks), last lr,
        tokens (this replica), inner-compute seconds and a sha256 of the (epoch, window) pairs read.
        """
        total_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        digest = hashlib.sha256()
        self.net.train()
        t_begin = time.perf_counter()
        compute_s = sync_s = wait_s = 0.0
        dp_seen, dp_bytes0 = self.dp_delay_s, self.dp_bytes
        comm0 = dataclasses.replace(self.sync.comm)
        lr = 0.0
        for step in range(start, end):
            t0 = time.perf_counter()
            lr, ce = self._inner_step(step, digest)
            total_loss += ce
            t1 = time.perf_counter()
            compute_s += t1 - t0
            if self.sync.attached:
                wait_s += self.sync.step(step + 1)
            elif self.dp_delay_s > dp_seen:  # emulated time of this step's DP all-reduce
                time.sleep(self.dp_delay_s - dp_seen)
                wait_s += self.dp_delay_s - dp_seen
                dp_seen = self.dp_delay_s
            sync_s += time.perf_counter() - t1
        wall_s = time.perf_counter() - t_begin
        train_loss = _mean_over_ranks(total_loss / max(1, end - start), self.world_size if self.group else 1)
        link = (
            self.sync.link_metrics(comm0)
            if self.sync.attached
            else {"bytes_up": self.dp_bytes - dp_bytes0, "bytes_down": self.dp_bytes - dp_bytes0}
        )
        assert self.reader is not None  # opened by setup
        return {
            "replica": self.replica,
            "rank": self.rank,
            "train_loss": train_loss,
            "inner_lr": lr,
            "steps": end - start,
            "tokens": (end - start) * self.cfg.batch_per_worker * self.cfg.data.seq_len * self.world_size,
            "compute_s": compute_s,
            "sync_s": sync_s,  # training-thread seconds in sends, merges and waits
            "sync_wait_s": wait_s,  # of which blocked on the link (exposed communication)
            "wall_s": wall_s,
            "link": link,
            "data_digest": digest.hexdigest(),
            "reader": self.reader.state(),
        }

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, windows: np.ndarray, global_refs: list[Any] | None = None) -> tuple[float, int]:
        """Summed cross-entropy (nats) and token count over validation ``windows`` (int ``[k]``).

        With ``global_refs`` (object refs of the driver's fp32 global fragments) the global
        parameters are evaluated: swapped into the model, then the local ones are put back.
        Without, the parameters currently in the model (DP).
        """
        saved = None
        if global_refs is not None:
            saved = [flatten(self.params, f) for f in self.sync_fragments]
            self.load_local([fetch_global(g) for g in self._units(global_refs)])
        try:
            # FSDP: every forward gathers parameters with the replica's other ranks: as many as theirs
            most = _max_over_ranks(-(-len(windows) // self.cfg.run.eval_batch), self.device) if self.fsdp else 0
            assert self.val_tokens is not None  # set by setup
            return evaluate_loss(
                self.model,
                self.val_tokens,
                self.cfg.data.seq_len,
                windows,
                self.cfg.run.eval_batch,
                self._autocast,
                min_batches=most,
            )
        finally:
            if saved is not None:
                for f, v in zip(self.sync_fragments, saved):
                    unflatten_into(self.params, f, v)
            if self.fsdp:  # no backward resharded the root group: drop its gathered (global) copy
                cast("FSDPModule", self.model).reshard()

    def shutdown(self) -> None:
        """Stop the link thread and leave the replica's process group."""
        self.sync.close()
        if self.group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.group = False


#: The worker as a Ray actor class (options such as CPUs and placement are set per actor).
# (Ray's typed overloads of ray.remote leave out concurrency_groups, a documented actor option)
ReplicaWorkerActor = ray.remote(concurrency_groups={CONTROL_GROUP: 1})(ReplicaWorker)  # type: ignore[call-overload]
