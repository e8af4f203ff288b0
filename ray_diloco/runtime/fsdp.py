"""FSDP2 inside a replica (``diloco.sharding: fsdp``): sharding the model over the replica's ranks,
and the inner-optimiser state in and out of a worker as plain host tensors.

Each decoder block and then the root module are wrapped with ``fully_shard`` on a 1-D device mesh
of the replica's process group (gloo on CPU, NCCL on GPUs): every parameter becomes a DTensor
``Shard(0)``, rank r keeping the rows ``core.shards.rank_rows`` of its first dimension. With bf16
precision the parameters are gathered in bf16 and gradients reduced in fp32 over fp32 masters
(``MixedPrecisionPolicy``). The outer exchange works on each rank's local rows
(``core.shards.rank_fragment``), so nothing is gathered on one rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from ray_diloco.models.transformer import decoder_blocks

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor  # fully_shard's parameters


def shard_model(model: torch.nn.Module, world_size: int, shard_size: int, device: torch.device, bf16: bool) -> None:
    """``fully_shard`` every decoder block, then the root, over the default process group (which
    must hold exactly this replica's ``world_size`` ranks): on a 1-D mesh when ``shard_size`` is
    the world size (FSDP), else on a 2-D ``(replicate, shard)`` mesh of ``world_size /
    shard_size`` groups of ``shard_size`` consecutive ranks (HSDP: each group shards the model,
    the groups all-reduce gradients). In place: the parameters become DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if shard_size == world_size:
        mesh = init_device_mesh(device.type, (world_size,))
    else:
        mesh = init_device_mesh(
            device.type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
        )
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def local_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> this rank's rows of each trainable parameter: detached views sharing the DTensor's
    local storage (writing them writes the parameter), in ``named_parameters`` order."""
    with torch.no_grad():
        return {n: cast("DTensor", p).to_local().detach() for n, p in model.named_parameters() if p.requires_grad}


def _params_by_index(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def optimizer_state_in(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load this rank's own inner-optimiser state as it left the worker (``replica.to_host``: each
    DTensor as a host copy of its local shard): those tensors become DTensors like their
    parameters again."""
    from torch.distributed.tensor import DTensor

    params = _params_by_index(optimizer)
    wrapped = {}
    for k, s in state["state"].items():
        p = params[int(k)]
        wrapped[k] = {
            n: DTensor.from_local(
                v.to(p.device), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0
            else v
            for n, v in s.items()
        }
    optimizer.load_state_dict({"state": wrapped, "param_groups": state["param_groups"]})


def load_own_rows(model: torch.nn.Module, init_from: str, shards: int, shard: int, device: torch.device) -> None:
    """Materialise a model built on the meta device and sharded (:func:`shard_model`) with this
    rank's rows (shard ``shard`` of ``shards``) of ``model.init_from``'s weights, read from its safetensors files by slice: no rank
    reads or holds another's rows, so a model bigger than one worker's memory loads. Values in
    fp32 (bf16 files widened); the non-persistent buffers (RoPE frequencies) are computed again by
    transformers' own initialisation; tied parameters stay one.

    Raises:
        ConfigError: a parameter the files do not hold, or of another shape."""
    from safetensors import safe_open

    from ray_diloco.core.shards import rank_rows
    from ray_diloco.errors import ConfigError
    from ray_diloco.models.pretrained import locate, weight_table

    table = weight_table(init_from)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, _ in model.named_non_persistent_buffers():  # type: ignore[operator]  # a transformers model
            model._init_weights(model.get_submodule(name.rpartition(".")[0]))  # type: ignore[operator]
        handles: dict[str, Any] = {}
        for name, p in model.named_parameters():  # tied parameters once
            w = locate(model, name, table)
            if w is None or w.shape != tuple(p.shape):  # check_weights refused it in the job already
                raise ConfigError(
                    [f"model.init_from = {init_from!r}: {name} is not in its weights as {tuple(p.shape)}"]
                )
            if str(w.file) not in handles:
                handles[str(w.file)] = safe_open(str(w.file), framework="pt")
            part = handles[str(w.file)].get_slice(w.key)
            rows = rank_rows(p.shape[0], shards, shard)
            local = cast("DTensor", p).to_local()
            local.copy_(part[rows.start : rows.stop].to(device=device, dtype=local.dtype))
