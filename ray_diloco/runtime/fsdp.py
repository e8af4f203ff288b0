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
