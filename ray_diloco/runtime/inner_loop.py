"""What a replica worker trains and holds, without Ray: the inner loop and the worker's state.

A replica worker (the Ray actor :class:`~ray_diloco.runtime.replica.ReplicaWorker`) is made of
three things built here or there:

- :class:`WorkerParts`: the model, its parameters and fragments, the inner optimiser, the data
  shard's reader and the fragments' :class:`~ray_diloco.core.sync.FragmentSync`; the actor
  replaces some of them when FSDP shards the model or a joiner takes another data shard.
- :class:`InnerLoop`: the inner steps (DiLoCo, arXiv 2311.08105, Algorithm 1 lines 4-7):
  AdamW with the lr a pure function of the global inner step (warmup + cosine), gradient
  clipping, bf16 autocast optional, gradient accumulation over micro-batches; the AdamW state is
  kept across outer steps, never reset or averaged. The loss stays on the device and is read once
  per ``train`` call. After every inner step the fragment syncs due run (send, overlap, merge).
  Also the evaluation of local or global parameters.
- :class:`WorkerState`: how the worker's state leaves and enters it (checkpoints, joiners, the
  driver's global fragments). Every state that leaves a worker is on the host.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from ray_diloco.components.data import ShardReader, Split
from ray_diloco.components.evaluate import evaluate_loss, run_autocast
from ray_diloco.config import Config
from ray_diloco.core.fragments import Fragment, ParamSpec, flatten, tensor_hash, unflatten_into
from ray_diloco.core.schedules import inner_lr
from ray_diloco.core.sync import FragmentSync
from ray_diloco.models.transformer import lm_loss, logits_of, make_inner_optimizer
from ray_diloco.runtime.layout import ReplicaLayout

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel


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
    """Forward and backward of the batch ``x``, ``y`` (int64 ``[B, T]``, host or ``device``) in passes of
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


def _mean_over_ranks(value: torch.Tensor, world_size: int) -> float:
    """The mean of a fp64 scalar over the ``world_size`` ranks of the replica's process group
    (1: no group, the value itself). ``value`` is on the group's device (gloo: CPU, NCCL: the GPU)."""
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(value)
        value /= world_size
    return float(value)


@dataclasses.dataclass(eq=False)
class WorkerParts:
    """What one rank of one replica trains and exchanges, shared by its :class:`InnerLoop` and
    :class:`WorkerState`.

    Attributes:
        cfg: the run config. replica: replica index m in ``[0, M)``. rank, world_size: this
            worker's rank in its replica and the replica's workers. shard, num_shards: its data
            shard (unique per (replica, rank)) and the total.
        device: where it trains. model: the model. net: what the inner loop calls (the model,
            its DDP wrapper or its ``torch.compile`` module).
        specs: the trainable parameters in exchange order. fragments: the fragments they are
            exchanged in. layout: the replica's layout (``runtime.layout``).
        params: name -> parameter (FSDP: this rank's rows). sync_fragments: what this worker
            exchanges of each fragment (FSDP: its rows). optimizer: the inner optimiser.
        sync: the fragments' syncs (:meth:`new_sync`). reader: its data shard (set by the
            actor's ``setup``). val_tokens: the validation split (int32 ``[n]``).
    """

    cfg: Config
    replica: int
    rank: int
    world_size: int
    shard: int
    num_shards: int
    device: torch.device
    model: torch.nn.Module
    specs: list[ParamSpec]
    fragments: list[Fragment]
    layout: ReplicaLayout
    params: dict[str, torch.Tensor]
    sync_fragments: list[Fragment]
    optimizer: torch.optim.Optimizer
    net: torch.nn.Module
    sync: FragmentSync = dataclasses.field(init=False)
    reader: ShardReader | None = None
    val_tokens: Split | None = None

    @classmethod
    def build(cls, cfg: Config, layout: ReplicaLayout, ids: tuple[int, int, int], device: torch.device,
              model: torch.nn.Module, specs: list[ParamSpec], fragments: list[Fragment]) -> WorkerParts:  # fmt: skip
        """A worker's parts on ``layout``, once the replica's process group exists (the worker's
        ``setup``): the model wrapped for it (:meth:`ReplicaLayout.wrap`), the inner optimiser
        and the syncs of what it exchanges. ``ids``: (replica, data shard, number of shards)."""
        replica, shard, num_shards = ids
        net, params, mine = layout.wrap(cfg, model, device, fragments)
        parts = cls(
            cfg, replica, layout.rank, layout.world_size, shard, num_shards, device, model, specs, fragments,
            layout=layout, params=params, sync_fragments=mine, optimizer=make_inner_optimizer(model, cfg), net=net,
        )  # fmt: skip
        parts.new_sync()
        return parts

    def new_sync(self) -> None:
        """A fresh :class:`FragmentSync` of :attr:`params` and :attr:`sync_fragments` (after they
        changed: FSDP); a rejected pseudo-gradient's reset clears the inner-optimiser state."""
        # on_reset reads self.optimizer when called: torch's load_state_dict replaces optimizer.state
        self.sync = FragmentSync(
            self.params,
            self.sync_fragments,
            alpha=self.cfg.streaming.alpha,
            batch=self.cfg.batch_per_worker,
            seq_len=self.cfg.data.seq_len,
            world_size=self.world_size,
            rank=self.layout.sync_rank,
            on_reset=lambda: self.optimizer.state.clear(),
        )

    def open_reader(self, tokens: Split, shard: int | None = None) -> None:
        """Read data shard ``shard`` (default: :attr:`shard`) of ``tokens`` (the training split) from its start."""
        self.shard = self.shard if shard is None else shard
        self.reader = ShardReader(tokens, self.cfg.data.seq_len, self.shard, self.num_shards, self.cfg.run.seed)


class InnerLoop:
    """The inner steps and the evaluation of one worker (see the module docstring).

    Args:
        parts: the worker's parts (read at every call). group: the replica's process group is
            joined. compiling: the model's blocks are compiled and no step has run yet.
        z_loss: the weight of the z-loss term (the model shape's ``z_loss``; 0: none).
    """

    def __init__(self, parts: WorkerParts, z_loss: float, group: bool = False, compiling: bool = False):
        self.p, self.z_loss = parts, z_loss
        self.autocast = run_autocast(parts.cfg.run.precision, parts.device)  # bf16: autocast on this device
        self.group = group  # the replica's process group is joined (False once the actor left it)
        self.compiling = compiling  # the model's blocks are compiled and its first step has not run
        # the DP baseline under WAN emulation: bytes and emulated seconds of its all-reduces so far
        self.dp_bytes, self.dp_delay_s = 0, 0.0

    def inner_step(self, step: int, digest: Any) -> tuple[float, torch.Tensor]:
        """One AdamW step at global inner step ``step`` (gradients accumulated over micro-batches);
        returns its lr and the batch's mean cross-entropy (fp32 scalar on the device). The (epoch,
        window) pairs read go into ``digest``."""
        p, i = self.p, self.p.cfg.inner
        lr = inner_lr(step, i.lr, i.warmup_steps, p.cfg.run.steps, i.min_lr_ratio)
        for g in p.optimizer.param_groups:
            g["lr"] = lr
        assert p.reader is not None  # opened by setup
        x, y, idx = p.reader.next_batch(p.cfg.batch_per_worker)
        digest.update(idx.tobytes())
        if p.device.type == "cuda":  # one asynchronous copy from pinned memory: a pageable one waits for the GPU
            x, y = (t.contiguous().pin_memory().to(p.device, non_blocking=True) for t in (x, y))
        ce = accumulate_gradients(p.net, x, y, p.cfg.micro_batch, self.z_loss, self.autocast, p.device)
        if i.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(p.model.parameters(), i.grad_clip)
        p.optimizer.step()
        p.optimizer.zero_grad(set_to_none=True)
        return lr, ce

    def train(self, start: int, end: int) -> dict[str, Any]:
        """Inner steps ``start .. end-1`` (global inner-step numbers) on this worker's shard, the
        fragment syncs due in them run after each step.

        Returns the round's metrics: mean train loss (nats/token, averaged over ranks), last lr,
        tokens (this replica), inner-compute seconds and a sha256 of the (epoch, window) pairs read.
        """
        p = self.p
        total_loss = torch.zeros((), dtype=torch.float64, device=p.device)
        digest = hashlib.sha256()
        p.net.train()
        t_begin = time.perf_counter()
        compute_s = sync_s = wait_s = compile_s = 0.0
        dp_seen, dp_bytes0 = self.dp_delay_s, self.dp_bytes
        comm0 = dataclasses.replace(p.sync.comm)
        lr = 0.0
        for step in range(start, end):
            t0 = time.perf_counter()
            lr, ce = self.inner_step(step, digest)
            total_loss += ce
            t1 = time.perf_counter()
            if self.compiling:  # this process's first step: torch.compile's graphs (its own metric)
                if p.device.type == "cuda":
                    torch.cuda.synchronize(p.device)
                    t1 = time.perf_counter()
                compile_s, self.compiling = t1 - t0, False
            else:
                compute_s += t1 - t0
            if p.sync.attached:
                wait_s += p.sync.step(step + 1)
            elif self.dp_delay_s > dp_seen:  # emulated time of this step's DP all-reduce
                time.sleep(self.dp_delay_s - dp_seen)
                wait_s += self.dp_delay_s - dp_seen
                dp_seen = self.dp_delay_s
            sync_s += time.perf_counter() - t1
        wall_s = time.perf_counter() - t_begin
        train_loss = _mean_over_ranks(total_loss / max(1, end - start), p.world_size if self.group else 1)
        link = (
            p.sync.link_metrics(comm0)
            if p.sync.attached
            else {"bytes_up": self.dp_bytes - dp_bytes0, "bytes_down": self.dp_bytes - dp_bytes0}
        )
        assert p.reader is not None  # opened by setup
        return {
            "replica": p.replica,
            "rank": p.rank,
            "train_loss": train_loss,
            "inner_lr": lr,
            "steps": end - start,
            "tokens": (end - start) * p.cfg.batch_per_worker * p.cfg.data.seq_len * p.world_size,
            "compute_s": compute_s,
            "compile_s": compile_s,  # the compiling first step (in no other figure)
            "sync_s": sync_s,  # training-thread seconds in sends, merges and waits
            "sync_wait_s": wait_s,  # of which blocked on the link (exposed communication)
            "wall_s": wall_s,
            "link": link,
            "data_digest": digest.hexdigest(),
            "reader": p.reader.state(),
        }

    def evaluate(self, windows: np.ndarray, globals_: list[np.ndarray] | None = None) -> tuple[float, int]:
        """Summed cross-entropy (nats) and token count over validation ``windows`` (int ``[k]``).

        With ``globals_`` (fp32 ``[numel_p]`` per fragment, this worker's part) those global
        parameters are evaluated: swapped into the model, then the local ones are put back.
        Without, the parameters currently in the model.
        """
        p = self.p
        saved = None
        if globals_ is not None:
            saved = [flatten(p.params, f) for f in p.sync_fragments]
            for f, arr in zip(p.sync_fragments, globals_):
                unflatten_into(p.params, f, torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)))
        try:
            most = p.layout.eval_min_batches(-(-len(windows) // p.cfg.run.eval_batch), p.device)
            assert p.val_tokens is not None  # set by setup
            return evaluate_loss(
                p.model,
                p.val_tokens,
                p.cfg.data.seq_len,
                windows,
                p.cfg.run.eval_batch,
                self.autocast,
                min_batches=most,
            )
        finally:
            if saved is not None:
                for f, v in zip(p.sync_fragments, saved):
                    unflatten_into(p.params, f, v)
            p.layout.after_eval(p.model)


class WorkerState:
    """How a worker's state leaves and enters it: its parameters (FSDP: its rows), inner-optimiser
    state, data position and RNG for checkpoints and joiners, and the driver's global fragments.

    Args:
        parts: the worker's parts (read at every call).
    """

    def __init__(self, parts: WorkerParts):
        self.p = parts

    def units(self, per_unit: list[Any]) -> list[Any]:
        """This worker's entries, one per fragment, of a list over the outer exchange's units
        (FSDP: unit ``f * W + rank`` is its part of fragment f; DDP: the fragments)."""
        return self.p.layout.own_units(per_unit)

    def load_optimizer(self, state: dict[str, Any]) -> None:
        """The inner optimiser's state from ``state`` (a ``state_dict``; FSDP: this rank's rows)."""
        self.p.layout.load_inner_optimizer(self.p.optimizer, state)

    def local_fragment(self, fragment: int) -> np.ndarray:
        """This worker's current parameters of ``fragment`` as fp32 ``[numel_p]`` (FSDP: its rows)."""
        return flatten(self.p.params, self.p.sync_fragments[fragment]).numpy()

    def params_hash(self) -> str:
        """sha256 of this worker's local parameters (fp32 bytes, exchange order)."""
        return tensor_hash([self.p.params[s.name] for s in self.p.specs])

    def nonfinite_params(self) -> list[str]:
        """The names of this worker's local parameters (FSDP: its rows) holding a NaN or infinity."""
        return [s.name for s in self.p.specs if not bool(torch.isfinite(self.p.params[s.name]).all())]

    def inner_optimizer_state(self) -> dict[str, Any]:
        """A host copy of this worker's inner-optimiser ``state_dict`` (what a joiner may start from)."""
        return to_host(self.p.optimizer.state_dict())

    def load_global(self, fragment: int, values: np.ndarray, version: int = 0) -> None:
        """Adopt the global exchange unit ``fragment`` (fp32 ``[numel_p]``, at ``version`` outer
        steps) and overwrite the local one. FSDP: another rank's unit is ignored."""
        local = self.p.layout.local_unit(fragment)
        if local is not None:
            self.p.sync.load_global(local, values, version)

    def state_dict(self, full: bool = True, copy_tensors: bool = True) -> dict[str, Any]:
        """Data position and RNG of this worker and its sync state (``last_send``, ``pending``,
        ``comm``: ``core.sync.FragmentSync.state_dict``); with ``full`` also its inner-optimiser
        state, local parameters (identical on every rank of a replica, so only rank 0 sends them)
        and the link's error-feedback ``residuals``. Waits for the syncs in flight first."""
        p = self.p
        p.sync.settle()  # syncs in flight are answered, so residuals and the driver are settled
        assert p.reader is not None  # opened by setup
        state = {
            "replica": p.replica,
            "rank": p.rank,
            "data": p.reader.state(),
            "torch_rng": torch.get_rng_state(),
            **p.sync.state_dict(residuals=full),
        }
        if p.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(p.device)
        if full:
            state["optimizer"] = to_host(p.optimizer.state_dict(), copy_tensors)
            state["local"] = [flatten(p.params, f).numpy() for f in p.sync_fragments]
        return state

    def load_local(self, local: list[np.ndarray]) -> None:
        """Overwrite the local parameters with fp32 ``[numel_p]`` arrays, one per fragment."""
        for f, arr in zip(self.p.sync_fragments, local):
            unflatten_into(self.p.params, f, torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a full state (``optimizer`` and ``local`` must be present). Call after
        ``load_global``: syncs that were in flight at the checkpoint merge the global values
        loaded from the driver, at their original merge step."""
        p = self.p
        self.load_local(state["local"])
        self.load_optimizer(state["optimizer"])
        assert p.reader is not None  # opened by setup
        p.reader.load_state(state["data"])
        torch.set_rng_state(state["torch_rng"])
        if p.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], p.device)
        p.sync.load_state_dict(state)

    def restore(
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

    def join(self, globals_: list[np.ndarray], versions: list[int], step: int, inner: dict[str, Any] | None,
             reader_state: dict | None, shard: int | None = None) -> str:  # fmt: skip
        """Start as a joiner at inner step ``step``: local and global parameters <- ``globals_``
        (fp32 ``[numel_p]``, this worker's part of each fragment: :meth:`units`) at ``versions``
        (the same); the inner optimiser from ``inner``
        (a peer's :meth:`inner_optimizer_state`) or fresh; no sync in flight; data shard ``shard``
        (default: its own) at ``reader_state`` (None: the shard's start). Returns the sha256 of
        the pseudo-gradient ``global - local`` of every fragment (zero)."""
        p = self.p
        p.sync.join(globals_, versions, step)
        if inner is not None:
            self.load_optimizer(inner)
        else:
            p.optimizer.state.clear()
        assert p.reader is not None  # opened by setup
        if shard is not None and shard != p.shard:
            p.open_reader(p.reader.tokens, shard)
        if reader_state is not None:
            p.reader.load_state(reader_state)
        return p.sync.pseudo_gradient_hash()
