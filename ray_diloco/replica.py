"""The replica worker: one Ray actor per (replica, rank), running the inner loop.

A replica is ``workers_per_replica`` of these actors in one STRICT_PACK placement group. With
more than one worker they form their own ``torch.distributed`` group (gloo on CPU, NCCL on GPU)
through a ``TCPStore`` on rank 0 and train with DDP; all ranks of a replica hold identical
parameters and inner-optimiser state. Rank 0 computes the replica's pseudo-gradient.

The inner loop (DiLoCo, arXiv 2311.08105, Algorithm 1 lines 4-7): AdamW with the lr a pure
function of the global inner step (warmup + cosine), gradient clipping, bf16 autocast optional;
the AdamW state is kept across outer steps, never reset or averaged.
"""

from __future__ import annotations

import copy
import hashlib
import os
import socket
import time
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import numpy as np
import ray
import torch

from .config import Config, load_config
from .data import ShardReader, val_batch
from .fragments import Fragment, ParamSpec, flatten, param_specs, plan_fragments, unflatten_into
from .model import ModelFn, build_transformers_model, lm_loss, logits_of, resolve_model_shape
from .schedules import inner_lr


def build_model(cfg: Config, vocab_size: int, model_fn: ModelFn | None = None) -> torch.nn.Module:
    """The model with the run seed's initialisation, identical in every process (fp32)."""
    torch.manual_seed(cfg.run.seed)
    shape = resolve_model_shape(cfg.model, vocab_size)
    return (model_fn or build_transformers_model)(shape, shape["vocab_size"])


def make_inner_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and biases are not decayed)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    i = cfg.inner
    groups = [{"params": decay, "weight_decay": i.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=i.lr, betas=(i.beta1, i.beta2), eps=i.eps)


def tensor_hash(tensors: list[torch.Tensor]) -> str:
    """sha256 of the tensors' fp32 bytes, in order (parameter identity across processes)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, tokens: np.ndarray, seq_len: int, windows: np.ndarray,
                  batch: int, autocast=nullcontext) -> tuple[float, int]:
    """Summed next-token cross-entropy (nats) and token count of ``model`` over validation
    ``windows`` (indices of non-overlapping ``seq_len`` windows of the int32 ``tokens``)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for s in range(0, len(windows), batch):
        x, y = val_batch(tokens, seq_len, windows[s : s + batch])
        x, y = x.to(device), y.to(device)
        with autocast():
            logits = logits_of(model(x))
        _, ce = lm_loss(logits, y, 0.0)
        total += float(ce) * y.numel()
        count += y.numel()
    model.train(was_training)
    return total, count


class ReplicaWorker:
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
    """

    def __init__(self, config: dict[str, Any], replica: int, rank: int, world_size: int, shard: int,
                 num_shards: int, vocab_size: int, model_fn: ModelFn | None = None):
        self.cfg = load_config(config, validate=False)
        self.replica, self.rank, self.world_size = replica, rank, world_size
        self.shard, self.num_shards = shard, num_shards
        threads = max(1, int(self.cfg.diloco.cpus_per_worker or 1))
        torch.set_num_threads(threads)
        if self.cfg.run.deterministic:
            torch.use_deterministic_algorithms(True)
        use_cuda = self.cfg.diloco.gpus_per_worker > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        self.model = build_model(self.cfg, vocab_size, model_fn).to(self.device)
        self.shape = resolve_model_shape(self.cfg.model, vocab_size)
        self.z_loss = float(self.shape["z_loss"])
        self.specs = param_specs(self.model)
        self.fragments: list[Fragment] = plan_fragments(self.specs, 1)
        self.params = dict(self.model.named_parameters())
        self.global_flat: list[torch.Tensor | None] = [None] * len(self.fragments)
        self.optimizer = make_inner_optimizer(self.model, self.cfg)
        self.net: torch.nn.Module = self.model
        self.reader: ShardReader | None = None
        self.val_tokens: np.ndarray | None = None
        self.group = False

    # -- set-up ----------------------------------------------------------------------------
    def node_address(self) -> tuple[str, int]:
        """``(ip, free TCP port)`` on this node, for the replica's TCPStore (rank 0)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def setup(self, master: tuple[str, int] | None, train_tokens: np.ndarray, val_tokens: np.ndarray) -> dict:
        """Join the replica's process group (if world_size > 1), wrap in DDP, open the data shard.

        ``train_tokens``/``val_tokens`` (int32 ``[n]``) arrive from the object store (zero-copy).
        Raises ``RuntimeError`` (from torch) when the rendezvous times out (``pg_timeout_s``).
        """
        if self.world_size > 1:
            import torch.distributed as dist

            timeout = timedelta(seconds=self.cfg.diloco.pg_timeout_s)
            host, port = master
            store = dist.TCPStore(host, port, self.world_size, is_master=self.rank == 0, timeout=timeout)
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
            self.group = True
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(self.model, device_ids=[0] if self.device.type == "cuda" else None)
        self.reader = ShardReader(train_tokens, self.cfg.data.seq_len, self.shard, self.num_shards, self.cfg.run.seed)
        self.val_tokens = val_tokens
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), "device": str(self.device)}

    def param_specs(self) -> list[ParamSpec]:
        """Names and shapes of the trainable parameters, in exchange order."""
        return self.specs

    def num_fragments(self) -> int:
        """Number of fragments the parameters are exchanged in (1: plain DiLoCo)."""
        return len(self.fragments)

    def local_fragment(self, fragment: int) -> np.ndarray:
        """This worker's current parameters of ``fragment`` as fp32 ``[numel_p]``."""
        return flatten(self.params, self.fragments[fragment]).numpy()

    def params_hash(self) -> str:
        """sha256 of this worker's local parameters (fp32 bytes, exchange order)."""
        return tensor_hash([self.params[s.name] for s in self.specs])

    def global_hash(self) -> str:
        """sha256 of the global parameters this worker holds (all fragments)."""
        return tensor_hash([g for g in self.global_flat if g is not None])

    # -- outer-step exchange ---------------------------------------------------------------
    def load_global(self, fragment: int, global_p: np.ndarray) -> None:
        """Adopt the new global fragment (fp32 ``[numel_p]``): keep a copy, overwrite local params."""
        g = torch.from_numpy(np.array(global_p, dtype=np.float32, copy=True))
        self.global_flat[fragment] = g
        unflatten_into(self.params, self.fragments[fragment], g)

    def pseudo_gradient(self, fragment: int) -> np.ndarray:
        """``global_p - local_p`` in fp32, shape ``[numel_p]`` (DiLoCo Algorithm 1, line 8)."""
        g = self.global_flat[fragment]
        if g is None:
            raise RuntimeError(f"replica {self.replica}: no global parameters for fragment {fragment}")
        return (g - flatten(self.params, self.fragments[fragment])).numpy()

    # -- inner loop ------------------------------------------------------------------------
    def _autocast(self):
        if self.cfg.run.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def train(self, start: int, end: int) -> dict[str, Any]:
        """Inner steps ``start .. end-1`` (global inner-step numbers) on this worker's shard.

        Returns the round's metrics: mean train loss (nats/token, averaged over ranks), last lr,
        tokens (this replica), inner-compute seconds and a sha256 of the (epoch, window) pairs read.
        """
        cfg, i = self.cfg, self.cfg.inner
        b = cfg.batch_per_worker
        total_loss = torch.zeros((), dtype=torch.float64)
        digest = hashlib.sha256()
        self.net.train()
        t0 = time.perf_counter()
        lr = 0.0
        for step in range(start, end):
            lr = inner_lr(step, i.lr, i.warmup_steps, cfg.run.steps, i.min_lr_ratio)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            x, y, idx = self.reader.next_batch(b)
            digest.update(idx.tobytes())
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self._autocast():
                logits = logits_of(self.net(x))
            loss, ce = lm_loss(logits, y, self.z_loss)
            loss.backward()
            if i.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), i.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            total_loss += ce.detach().to("cpu", torch.float64)
        compute_s = time.perf_counter() - t0
        n = max(1, end - start)
        mean_loss = total_loss / n
        if self.group:
            import torch.distributed as dist

            dist.all_reduce(mean_loss)  # gloo/nccl; float64 on CPU only for gloo
            mean_loss /= self.world_size
        return {
            "replica": self.replica,
            "rank": self.rank,
            "train_loss": float(mean_loss),
            "inner_lr": lr,
            "steps": end - start,
            "tokens": (end - start) * b * cfg.data.seq_len * self.world_size,
            "compute_s": compute_s,
            "data_digest": digest.hexdigest(),
        }

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, windows: np.ndarray) -> tuple[float, int]:
        """Summed cross-entropy (nats) and token count over validation ``windows`` (int ``[k]``).

        Evaluates the parameters currently in the model; the trainer calls it right after
        ``load_global``, so these are the global parameters.
        """
        return evaluate_loss(self.model, self.val_tokens, self.cfg.data.seq_len, windows,
                             self.cfg.run.eval_batch, self._autocast)

    # -- checkpoint ------------------------------------------------------------------------
    def state_dict(self, full: bool = True) -> dict[str, Any]:
        """Data position and RNG of this worker; with ``full`` also its inner-optimiser state and
        local parameters (identical on every rank of a replica, so only rank 0 sends them)."""
        state = {"replica": self.replica, "rank": self.rank, "data": self.reader.state(),
                 "torch_rng": torch.get_rng_state()}
        if full:
            state["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
            state["local"] = [flatten(self.params, f).numpy() for f in self.fragments]
        return state

    def load_local(self, local: list[np.ndarray]) -> None:
        """Overwrite the local parameters with fp32 ``[numel_p]`` arrays, one per fragment."""
        for f, arr in zip(self.fragments, local):
            unflatten_into(self.params, f, torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a full state (``optimizer`` and ``local`` must be present)."""
        self.load_local(state["local"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.reader.load_state(state["data"])
        torch.set_rng_state(state["torch_rng"])

    def shutdown(self) -> None:
        """Leave the replica's process group."""
        if self.group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.group = False
