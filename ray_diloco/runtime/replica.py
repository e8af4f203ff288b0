"""The replica worker: one Ray actor per (replica, rank), a thin shell around its inner loop.

A replica is ``workers_per_replica`` of these actors in one STRICT_PACK placement group. With
more than one worker they form their own ``torch.distributed`` group (gloo on CPU, NCCL on GPU)
through a ``TCPStore`` on rank 0 and train with DDP (or FSDP2, ``diloco.sharding: fsdp``); all
ranks of a replica hold identical parameters and inner-optimiser state. Rank 0 computes the
replica's pseudo-gradient.

The actor builds the model on its device and the worker's parts
(:class:`~ray_diloco.runtime.inner_loop.WorkerParts`), joins the replica's process group,
connects the fragments' syncs to the outer-optimiser driver through a
:class:`~ray_diloco.runtime.link.Link`, reads and writes its own checkpoint files, and fetches
what arrives as object refs. The inner loop and the evaluation are
:class:`~ray_diloco.runtime.inner_loop.InnerLoop`'s; how its state leaves and enters it is
:class:`~ray_diloco.runtime.inner_loop.WorkerState`'s (neither knows Ray).
"""

from __future__ import annotations

import os
import socket
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from ray_diloco.components.threads import worker_threads
from ray_diloco.config import load_config
from ray_diloco.core.fragments import Fragment, ParamSpec, fragment_plan, param_specs, plan_fragments
from ray_diloco.core.schedules import SyncSchedule
from ray_diloco.core.wire import link_delay_s
from ray_diloco.errors import ClusterError, ConfigError
from ray_diloco.models.transformer import (
    ModelFn,
    build_model,
    compile_blocks,
    compile_wanted,
    resolve_model_shape,
)
from ray_diloco.runtime.inner_loop import InnerLoop, WorkerParts, WorkerState
from ray_diloco.runtime.layout import ReplicaLayout
from ray_diloco.runtime.link import Link, fetch_global

#: The worker actor's concurrency group for calls that must be answered while ``train`` runs
#: (they touch no training state); every other call runs one at a time on the default group.
CONTROL_GROUP = "control"


def _dp_emulation_hook(loop: InnerLoop):
    """DDP comm hook for the DP baseline under WAN emulation (``ReplicaWorker(allreduce_emulation=True)``):
    the real all-reduce, plus the emulated time of a ring all-reduce of the bucket (each rank
    sends and receives ``2 (R-1)/R`` of the bucket's bytes over ``2 (R-1)`` hops), slept after
    the optimiser step."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    net = loop.p.cfg.network

    def hook(state, bucket):
        R = dist.get_world_size()
        nbytes = int(2 * bucket.buffer().numel() * bucket.buffer().element_size() * (R - 1) / R)
        loop.dp_bytes += nbytes
        loop.dp_delay_s += link_delay_s(nbytes, net.bandwidth_gbps, 0.0) + 2 * (R - 1) * net.latency_ms / 1e3
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
    cfg: Any, vocab_size: int, model_fn: ModelFn | None, meta: bool = False
) -> tuple[torch.nn.Module, torch.device, Exception | None]:
    """The worker's model built on its device (``torch.cuda.set_device`` first on a GPU; ``meta``:
    on the meta device, its values read once sharded, ``ReplicaLayout.loads_own_rows``), with
    ``run.activation_checkpointing`` (transformers' non-reentrant activation checkpointing of every
    decoder block), and the problem the worker's ``setup`` reports: ``ClusterError`` (GPUs asked
    for, no CUDA) or ``ConfigError`` (activation checkpointing of a model without it)."""
    device, device_problem = worker_device(cfg.diloco.gpus_per_worker)
    problem: Exception | None = ClusterError(device_problem) if device_problem else None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # built and initialised on its device: on a GPU no fp32 copy of the model passes through host
    # memory (40 GB per worker at 10B parameters); the seed fixes the values on each device type
    with torch.device("meta") if meta else torch.device(device) if device.type == "cuda" else nullcontext():
        model = build_model(cfg, vocab_size, model_fn)
    if not meta:
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


def _init_group(master: tuple[str, int], rank: int, world_size: int, device: torch.device, timeout_s: float) -> bool:
    """Join the replica's ``torch.distributed`` group (gloo on CPU, NCCL on a GPU) through the
    TCPStore of rank 0 at ``master`` (host, port). Returns True."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master[0], master[1], world_size, is_master=rank == 0, timeout=timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return True


def _free_port() -> int:
    """A TCP port free on this node now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class ReplicaWorker:
    """One rank of one replica (see the module docstring).

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
        cfg = self.cfg = load_config(config, validate=False)
        self.allreduce_emulation = allreduce_emulation
        self.threads = worker_threads(cfg)
        self.threads.apply()
        if cfg.run.deterministic:
            torch.use_deterministic_algorithms(True)
        # the model is built here; its parts, inner loop and state once setup has joined the
        # replica's process group (FSDP2 and DDP need it): nothing is built twice
        meta = ReplicaLayout.of(cfg, world_size, rank, torch.device("cpu")).loads_own_rows(cfg)
        self.model, self.device, self.problem = worker_model(cfg, vocab_size, model_fn, meta)
        self.specs = param_specs(self.model)
        try:
            self.fragments: list[Fragment] = fragment_plan(cfg, self.specs)
        except ValueError:  # reported by the trainer (ConfigError) before any training
            self.fragments = plan_fragments(self.specs, 1)
        self.ids = (replica, shard, num_shards)
        self.layout = ReplicaLayout.of(cfg, world_size, rank, self.device)
        self.z_loss = float(resolve_model_shape(cfg.model, vocab_size)["z_loss"])

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
        lay, device = self.layout, self.device
        group = False
        if lay.world_size > 1:
            assert master is not None  # rank 0's TCPStore address: the launcher passes it to every rank
            group = _init_group(master, lay.rank, lay.world_size, device, self.cfg.diloco.pg_timeout_s)
        compiling = compile_wanted(self.cfg.run.compile, device)
        if compiling:  # blocks in place, before DDP / FSDP2 wrap them
            compile_blocks(self.model)
        p = self.parts = WorkerParts.build(self.cfg, lay, self.ids, device, self.model, self.specs, self.fragments)
        self.loop = InnerLoop(p, self.z_loss, group=group, compiling=compiling)
        self.state = WorkerState(p)
        net = self.cfg.network
        if (
            isinstance(p.net, torch.nn.parallel.DistributedDataParallel)
            and self.allreduce_emulation
            and (net.bandwidth_gbps or net.latency_ms)
        ):
            p.net.register_comm_hook(None, _dp_emulation_hook(self.loop))
        p.open_reader(train_tokens)
        p.val_tokens = val_tokens
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), "device": str(p.device)}

    @ray.method(concurrency_group=CONTROL_GROUP)
    def thread_report(self) -> dict[str, Any]:
        """The threads this worker's process uses (``components.threads.ThreadPlan.report``)."""
        return self.threads.report()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def pid(self) -> int:
        """This worker's process id (operators, fault injection); answered on the ``control``
        concurrency group, also while :meth:`train` runs, so a kill lands in the running round."""
        return os.getpid()

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
        p, s, n, k = self.parts, self.cfg.streaming, self.cfg.network, self.cfg.diloco.outer_shards
        # a GPU worker keeps device globals (core.staging): its copies to and from the host leave
        # the training stream
        staging = self.layout.staging(p.device)
        lay = self.layout
        p.sync.attach(schedule, Link(driver, p.replica, lay.shard_rank, s.quantization, s.error_feedback,
                                     n.bandwidth_gbps, n.latency_ms, k, p.sync.buffers, units=lay.units,
                                     staging=staging, sends=lay.owns(lay.rank)), staging)  # fmt: skip

    def settle(self) -> int:
        """Wait until every sync this worker has started is answered (not merged: merges stay at
        their step); re-raises a failed exchange. Returns the number of syncs in flight."""
        return self.parts.sync.settle()

    def reset_to_global(self) -> None:
        """Local parameters of every fragment <- the global ones this worker holds; the inner
        optimiser state is cleared (used after a rejected, non-finite pseudo-gradient)."""
        self.parts.sync.reset_to_global()

    def load_global(self, fragment: int, global_p: list[Any], version: int = 0) -> None:
        """:meth:`WorkerState.load_global` of exchange unit ``fragment`` from the K outer shards'
        slices (object refs, as the driver's ``global_refs`` gives them)."""
        if self.layout.local_unit(fragment) is not None:
            self.state.load_global(fragment, fetch_global(global_p), version)

    def join(self, global_refs: list[Any], versions: list[int], step: int, reader_state: dict | None,
             peer_state: list[Any] | None = None, shard: int | None = None) -> tuple[str, str]:  # fmt: skip
        """Start as a joiner (:meth:`WorkerState.join`) from the driver's global fragments (object
        refs of fp32 ``[numel_p]`` per exchange unit, at ``versions``) and the inner-optimiser
        state of ``peer_state`` (a list holding the object ref of a live peer's
        ``inner_optimizer_state``, ``diloco.join_inner_state: peer``), or fresh, also when that
        peer died before handing it over. Returns the pseudo-gradient's sha256 (zero) and where
        the inner optimiser state came from (``peer`` or ``fresh``)."""
        inner = None
        if peer_state:
            try:
                inner = ray.get(peer_state[0], timeout=60)
            except (ray.exceptions.RayError, TimeoutError):  # the peer died meanwhile: not this replica's fault
                inner = None
        globals_ = [fetch_global(g) for g in self.state.units(global_refs)]
        digest = self.state.join(globals_, self.state.units(versions), step, inner, reader_state, shard)
        return digest, "peer" if inner is not None else "fresh"

    # -- state (runtime.inner_loop.WorkerState) ---------------------------------------------
    def local_fragment(self, fragment: int) -> np.ndarray:
        """:meth:`WorkerState.local_fragment`."""
        return self.state.local_fragment(fragment)

    def params_hash(self) -> str:
        """:meth:`WorkerState.params_hash`."""
        return self.state.params_hash()

    def nonfinite_params(self) -> list[str]:
        """:meth:`WorkerState.nonfinite_params`."""
        return self.state.nonfinite_params()

    def global_hash(self) -> str:
        """sha256 of the global parameters this worker holds (all fragments)."""
        return self.parts.sync.global_hash()

    def global_fragment(self, fragment: int) -> np.ndarray:
        """The global value of ``fragment`` this worker holds (fp32 ``[numel_p]``)."""
        return self.parts.sync.global_fragment(fragment)

    def inner_optimizer_state(self) -> dict[str, Any]:
        """:meth:`WorkerState.inner_optimizer_state`."""
        return self.state.inner_optimizer_state()

    def state_dict(self, full: bool = True) -> dict[str, Any]:
        """:meth:`WorkerState.state_dict`."""
        return self.state.state_dict(full)

    def load_local(self, local: list[np.ndarray]) -> None:
        """:meth:`WorkerState.load_local`."""
        self.state.load_local(local)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:meth:`WorkerState.load_state_dict`."""
        self.state.load_state_dict(state)

    def save_state(
        self, path: str, full: bool = True, token: str | None = None, upload: str | None = None
    ) -> dict[str, Any]:
        """Write :meth:`WorkerState.state_dict` (``full`` as there) to ``path``, a file of a
        checkpoint's temporary directory, from this process (the state never travels to the job's
        process): ``components.checkpoint.write_own_file`` (its returns; a file that cannot be
        written fails the checkpoint, not this replica)."""
        from ray_diloco.components.checkpoint import write_own_file

        node = ray.get_runtime_context().get_node_id()
        # written before this worker trains again: its tensors need no copy
        return write_own_file(Path(path), token, lambda: self.state.state_dict(full, copy_tensors=False), upload, node)

    def restore_state(
        self, own: dict[str, Any], full: dict[str, Any] | None = None, checkpoint_id: str | None = None
    ) -> bool:
        """:meth:`WorkerState.restore`."""
        return self.state.restore(own, full, checkpoint_id)

    # -- inner loop and evaluation (runtime.inner_loop.InnerLoop) ----------------------------
    def train(self, start: int, end: int) -> dict[str, Any]:
        """:meth:`InnerLoop.train`: inner steps ``start .. end-1`` and the syncs due in them."""
        return self.loop.train(start, end)

    def evaluate(self, windows: np.ndarray, global_refs: list[Any] | None = None) -> tuple[float, int]:
        """:meth:`InnerLoop.evaluate` of validation ``windows``: with ``global_refs`` (object refs
        of the driver's fp32 global fragments) the global parameters, else the model's (DP)."""
        globals_ = None if global_refs is None else [fetch_global(g) for g in self.state.units(global_refs)]
        return self.loop.evaluate(windows, globals_)

    def shutdown(self) -> None:
        """Stop the link thread and leave the replica's process group."""
        if not hasattr(self, "parts"):  # never set up: no link, no group
            return
        self.parts.sync.close()
        if self.loop.group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.loop.group = False


#: The worker as a Ray actor class (options such as CPUs and placement are set per actor).
# (Ray's typed overloads of ray.remote leave out concurrency_groups, a documented actor option)
ReplicaWorkerActor = ray.remote(concurrency_groups={CONTROL_GROUP: 1})(ReplicaWorker)  # type: ignore[call-overload]
