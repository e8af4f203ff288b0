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


def shard_model(model: torch.nn.Module, world_size: int, device: torch.device, bf16: bool) -> None:
    """``fully_shard`` every decoder block, then the root, over the default process group (which
    must hold exactly this replica's ``world_size`` ranks). In place: the parameters become DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
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


def load_own_rows(model: torch.nn.Module, init_from: str, world_size: int, rank: int, device: torch.device) -> None:
    """Materialise a model built on the meta device and sharded (:func:`shard_model`) with this
    rank's rows of ``model.init_from``'s weights, read from its safetensors files by slice: no rank
    reads or holds another's rows, so a model bigger than one worker's memory loads. Values in
    fp32 (bf16 files widened); the non-persistent buffers (RoPE frequencies) are computed again by
    transformers' own initialisation; tied parameters stay one.

    Raises:
        ConfigError: a parameter the files do not hold, or of another shape."""
    import json

    from safetensors import safe_open

    from ray_diloco.config.pretrained import model_dir
    from ray_diloco.core.shards import rank_rows
    from ray_diloco.errors import ConfigError

    root = model_dir(init_from)
    index = root / "model.safetensors.index.json"
    files = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    model.to_empty(device=device)
    with torch.no_grad():
        for name, _ in model.named_non_persistent_buffers():  # type: ignore[operator]  # a transformers model
            model._init_weights(model.get_submodule(name.rpartition(".")[0]))  # type: ignore[operator]
        handles: dict[str, Any] = {}
        prefix = getattr(model, "base_model_prefix", "") + "."
        for name, p in model.named_parameters():  # tied parameters once
            key = name if files is None or name in files else name.removeprefix(prefix)
            file = root / (files.get(key, "") if files is not None else "model.safetensors")
            if file.name not in handles and file.is_file():
                handles[file.name] = safe_open(str(file), framework="pt")
            f = handles.get(file.name)
            if f is None or key not in f.keys():
                raise ConfigError([f"model.init_from = {init_from!r}: its weights have no {name}"])
            part = f.get_slice(key)
            if tuple(part.get_shape()) != tuple(p.shape):
                raise ConfigError(
                    [f"model.init_from = {init_from!r}: {name} is {tuple(part.get_shape())} in its weights, "
                     f"{tuple(p.shape)} in its config"]
                )  # fmt: skip
            rows = rank_rows(p.shape[0], world_size, rank)
            local = cast("DTensor", p).to_local()
            local.copy_(part[rows.start : rows.stop].to(device=device, dtype=local.dtype))
