"""The "does it fit" table of `fivefold plan --params P`: model state per GPU for each ZeRO stage.

With M = --mp (the model-parallel degree tp x pp, which divides every buffer: each model-parallel
rank holds P / M parameters) and N = GPUs / M data-parallel ranks, under the --bytes convention
b_p, b_g, b_o (memory.model_state_bytes; Rajbhandari et al. 2020, sec. 5):

    buffer       bytes   sharded over N by
    weights      b_p     ZeRO-3
    gradients    b_g     ZeRO-2, ZeRO-3
    optimizer    b_o     ZeRO-1, ZeRO-2, ZeRO-3  (fp32 master and the Adam moments)

ZeRO-3 also gathers its largest layer whole, L parameters: its weight for the forward and its
gradient before the reduce-scatter, (b_p + b_g) L more. DeepSpeed's memory estimator adds the same
term (estimate_zero3_model_states_mem_needs: 4 x largest_layer_params at 2 + 2 bytes), beside 18
bytes per parameter over the GPUs (--bytes 2,2,14 here gives its figure). Offload (memory.py:
offload_state) moves the optimizer state, and the parameter shards with offload=params, to the
host, which holds them for the node's GPUs (per node: its ranks x one rank's). FP8 weights put
every weight in 1 byte here: a bare count has no embedding or head to keep in bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fivefold.planner.memory import BytesPerParam, model_state_bytes, offload_state, with_fp8_weights
from fivefold.planner.options import PlanOptions

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
SHARDED_BY = {"params": ["ZeRO-3"], "grads": ["ZeRO-2", "ZeRO-3"], "optimizer": ["ZeRO-1", "ZeRO-2", "ZeRO-3"]}


@dataclass(frozen=True)
class StageFit:
    """One row of the table: bytes per GPU (and per node on the host) of one ZeRO stage."""

    stage: str
    device: dict[str, float]  # params, grads, optimizer, largest_layer, total
    host_node: float  # host memory per node that offload takes
    fits: bool
    largest_params: float  # the largest model whose state fits, under the same degrees and layer


def _state(params: float, b: BytesPerParam, zero: int, n: int, mp: int, largest: float,
           options: PlanOptions) -> dict[str, float]:
    blocks = with_fp8_weights(b, options)
    state = offload_state(model_state_bytes(params / mp, blocks, zero, n), params / mp, zero, n, options.offload)
    layer = (blocks.param + b.grad) * largest if zero == 3 else 0.0
    return {**state, "largest_layer": layer, "total": state["total"] + layer}


def stage_fit(params: float, b: BytesPerParam, zero: int, gpus: int, mp: int, largest: float, options: PlanOptions,
              memory_bytes: float, host_memory_bytes: float, ranks_per_node: int) -> StageFit | None:
    """One ZeRO stage's row; None where the stage cannot offload what `options` asks (offload.py)."""
    if (options.offload == "optimizer" and zero == 0) or (options.offload == "params" and zero != 3):
        return None
    n = gpus // mp
    s = _state(params, b, zero, n, mp, largest, options)
    host_node = s["host"] * ranks_per_node
    fits = s["total"] <= memory_bytes and (not host_memory_bytes or host_node <= host_memory_bytes)
    # Both sides grow linearly with the parameters past the largest layer's fixed term
    per_param = _state(1.0, b, zero, n, mp, 0.0, options)
    device_room = (memory_bytes - s["largest_layer"]) / per_param["total"] if per_param["total"] else math.inf
    host_room = (host_memory_bytes / (per_param["host"] * ranks_per_node)
                 if per_param["host"] and host_memory_bytes else math.inf)
    device = {k: s[k] for k in ("params", "grads", "optimizer", "largest_layer", "total")}
    return StageFit(STAGES[zero], device, host_node, fits, max(0.0, min(device_room, host_room)))


def check_params_mode(gpus: int, mp: int, largest: float | None) -> None:
    """ValueError naming the flag when --mp or --largest-layer cannot describe the job."""
    if mp < 1 or gpus % mp:
        raise ValueError(f"--mp {mp}: the model-parallel degree (tp x pp) must divide --gpus {gpus}")
    if largest is not None and largest < 0:
        raise ValueError(f"--largest-layer {largest:g}: give a parameter count (0 or more)")
