"""What checkpoints save and tests compare: every sharded tensor described by its whole shape.

A rank holds slices: tensor parallel splits weights along `p.tp_dim` over tp, expert parallel
splits stacked experts along `p.ep_dim` over the ep group, ZeRO splits rows over dp_shard. Two
ways to hand them out:

- as DTensors (`model_state_dict`, `optim_state_dict`, `zero_shard_as_dtensor`): this rank's
  slice plus the whole shape and where the slice sits. torch.distributed.checkpoint writes each
  piece once under the parameter's name, and a later layout reads the pieces it owns, so a
  checkpoint reshards to any dp, tp, pp, ep or ZeRO stage with no conversion step;
- gathered whole (`gather_tp_shards`, `gather_expert_shards`): plain tensors on every rank, for
  tests against the single-process model and for export. Collective over the group.

Optimizer state has one format for DDP, ZeRO-1/2 and ZeRO-3: `state.<param>.exp_avg`,
`exp_avg_sq` and `step` (Muon's matrices: `momentum_buffer`), each moment a DTensor of the whole
parameter. Hyperparameters (`param_groups.*`) are not saved: they come from the config, which may
change on resume.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.mesh import Mesh

# Flattened: every entry keyed by parameter name ("state.layers.0...exp_avg"), so ranks that hold
# different parameters (pipeline stages) never write the same key with other values.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def tp_dims(model: nn.Module) -> dict[str, int]:
    """Parameter name -> the dim tensor parallel split it along; a tied matrix under each of its
    names (the state dict holds both, output.weight and tok_embeddings.weight)."""
    return {name: p.tp_dim for name, p in model.named_parameters(remove_duplicate=False) if hasattr(p, "tp_dim")}


def is_expert_parameter(p: torch.Tensor) -> bool:
    """Sharded by expert parallel (it records the dim it was split along, `ep_dim`)."""
    return hasattr(p, "ep_dim")


def _whole(local: torch.Tensor, device_mesh: DeviceMesh, placements: list, shape: list[int]) -> DTensor:
    return DTensor.from_local(local, device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def shards_as_dtensors(state: dict, dims: dict[str, int], device_mesh: DeviceMesh | None, prefix: str = "") -> dict:
    """Wrap each tensor of `state` whose key is prefix + a parameter name in `dims` [+ "." + suffix]
    as a DTensor Shard(dim) on the 1-D `device_mesh`, so a checkpoint records the whole shape."""
    if not dims or device_mesh is None:
        return state
    out = {}
    for key, value in state.items():
        name = key[len(prefix):]
        param = next((n for n in (name, name.rsplit(".", 1)[0]) if n in dims), None)
        if param is None or not torch.is_tensor(value) or value.ndim == 0:
            out[key] = value
            continue
        shape = list(value.shape)
        shape[dims[param]] *= device_mesh.size()
        out[key] = _whole(value, device_mesh, [Shard(dims[param])], shape)
    return out


def sharded(state: dict, model: nn.Module, mesh: Mesh, prefix: str = "") -> dict:
    """tp slices as DTensors on the tp axis, then expert slices as DTensors on the ep group."""
    state = shards_as_dtensors(state, tp_dims(model), mesh.device_mesh["tp"], prefix)
    experts = {name: p.ep_dim for name, p in model.named_parameters() if is_expert_parameter(p)}
    return shards_as_dtensors(state, experts, mesh.ep_device_mesh, prefix)


def dtensors_as_local(state: dict) -> dict:
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}


def zero_shard_as_dtensor(p: nn.Parameter, local: torch.Tensor, zero_dim: int, rows: int, mesh: Mesh) -> DTensor:
    """A ZeRO shard (rows [r c, (r+1) c) of p along `zero_dim`, split dim first, padded to c) as a
    DTensor of the whole matrix: Shard(zero_dim) over dp_shard, replicated over dp_replicate, and
    Shard(tp_dim) over tp for a tensor-parallel slice."""
    r = mesh.rank("dp_shard")
    valid = max(0, min(rows, p.shape[zero_dim] - r * rows))
    shape, placements = list(p.shape), [Replicate(), Shard(zero_dim), Replicate()]
    if hasattr(p, "tp_dim"):
        shape[p.tp_dim] *= mesh.size("tp")
        placements[2] = Shard(p.tp_dim)
    return _whole(local[:valid].movedim(0, zero_dim), mesh.device_mesh["dp_replicate", "dp_shard", "tp"], placements,
                  shape)


def expert_zero_shard_as_dtensor(p: nn.Parameter, local: torch.Tensor, zero_dim: int, rows: int, mesh: Mesh) -> DTensor:
    """A ZeRO shard of an expert parameter (this ep rank's experts (E/ep, ...), rows [r c, (r+1) c)
    of `zero_dim` on expert_dp rank r, split dim first, padded to c) as a DTensor of the whole
    (E, ...) tensor: Shard(zero_dim) over expert_dp, Shard(ep_dim) over ep."""
    r = mesh.rank("expert_dp")
    valid = max(0, min(rows, p.shape[zero_dim] - r * rows))
    shape = list(p.shape)
    shape[p.ep_dim] *= mesh.size("ep")
    return _whole(local[:valid].movedim(0, zero_dim), mesh.expert_device_mesh, [Shard(zero_dim), Shard(p.ep_dim)],
                  shape)


# ---- the replicated model's state (DDP), through torch's state-dict helpers ----------------------
def model_state_dict(model: nn.Module, mesh: Mesh) -> dict:
    return sharded(get_model_state_dict(model), model, mesh)


def load_model_state_dict(model: nn.Module, state: dict) -> None:
    set_model_state_dict(model, dtensors_as_local(state))


def optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh) -> dict:
    state = get_optimizer_state_dict(model, optimizer, options=FLAT)
    state = {k: v for k, v in state.items() if k.startswith("state.")}
    return sharded(state, model, mesh, prefix="state.")


def load_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    current = get_optimizer_state_dict(model, optimizer, options=FLAT)
    groups = {k: v for k, v in current.items() if k.startswith("param_groups.")}
    set_optimizer_state_dict(model, optimizer, {**groups, **dtensors_as_local(state)}, options=FLAT)


# ---- gathered whole ---------------------------------------------------------------------------------
def _gather_along(local: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    local = local.movedim(dim, 0).contiguous()  # the flat all-gather concatenates dim 0
    full = local.new_empty((group.size * local.shape[0], *local.shape[1:]))
    collectives.all_gather(full, local, group)
    return full.movedim(0, dim)


@torch.no_grad()
def gather_tp_shards(state: dict[str, torch.Tensor], model: nn.Module, mesh: Mesh) -> dict[str, torch.Tensor]:
    """Whole tensors from each rank's tp slices (concatenated along the dim they were split on)."""
    out = dict(state)
    for name, dim in tp_dims(model).items():
        out[name] = _gather_along(state[name], dim, mesh.group("tp"))
    return out


@torch.no_grad()
def gather_expert_shards(tensors: dict[str, torch.Tensor], model: nn.Module,
                         group: AxisGroup) -> dict[str, torch.Tensor]:
    """Whole (E, ...) tensors from each ep rank's expert slices, for the keys naming expert
    parameters (values: the parameters, their gradients, ...); other entries pass through."""
    sharded_names = {name for name, p in model.named_parameters() if is_expert_parameter(p)}
    out = dict(tensors)
    for name in sorted(sharded_names & tensors.keys()):  # the same order on every rank
        out[name] = _gather_along(tensors[name], 0, group)
    return out


@torch.no_grad()
def full_state_dict(model: nn.Module, mesh: Mesh) -> dict[str, torch.Tensor]:
    """Plain, unsharded copies of every parameter and buffer of a replicated (DDP) model."""
    local = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return gather_expert_shards(gather_tp_shards(local, model, mesh), model, mesh.group("ep"))
