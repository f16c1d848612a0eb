"""The planner's prediction for a training config, for the metrics log to print beside what it measured.

`predict_for_config(cfg, world_size)` estimates the layout `fivefold train` is about to run, in
the quantities the metrics log measures (train/metrics.py): model-state bytes per rank as fivefold's
own data-parallel code holds them (fp32 weights and gradients, AdamW moments, ZeRO's fp32 master
shards: memory.fivefold_state_bytes), activation bytes, wire bytes per axis per step (the same
comms.wire_bytes() accounting the counters use) and, given a hardware profile, the step time:
with one from `fivefold calibrate` on the machine that trains, the op-by-op price of the model's
own code (its pricer, calibration/pricer.py), which benchmarks/planner_selfcheck.py compares with
the measured median.
"""

from __future__ import annotations

from typing import Any

from fivefold.config import Config
from fivefold.planner.datasheet import Hardware, get_hardware
from fivefold.planner.estimate import estimate


def activation_element_bytes(cfg: Config, device_type: str = "cpu") -> int:
    """Bytes of one activation element: 4 in fp32 (train.dtype fp32, or auto on CPU), else 2."""
    dtype = cfg.train.dtype
    if dtype == "auto":
        dtype = "fp32" if device_type == "cpu" else "bf16"
    return 4 if dtype == "fp32" else 2


def predict_for_config(cfg: Config, world_size: int, hardware: Hardware | None = None,
                       device_type: str = "cpu") -> dict[str, Any]:
    """The prediction for one run of `cfg` on `world_size` ranks (cfg must pass validate()).

    Returns {"model_state_bytes": {params, grads, optimizer, total}, "activation_bytes",
    "buffer_bytes", "comm_wire_bytes": {dp, tp, pp, cp, ep}, "step_time_s" and its parts
    "time_split" (both None without a `hardware` profile: a catalog GPU's time means nothing for a
    CPU run), "hardware"}.
    Byte counts are for the fullest rank (rank 0 for dp-only layouts, which is what the
    metrics log samples).
    """
    hw = hardware or get_hardware("h100")  # only for bytes: they do not depend on the hardware
    est = estimate(cfg, world_size, hw, act_bytes=activation_element_bytes(cfg, device_type), implementation=True)
    mem = est.memory
    return {
        "model_state_bytes": {k: mem[k] for k in ("params", "grads", "optimizer")}
        | {"total": mem["params"] + mem["grads"] + mem["optimizer"]},
        "activation_bytes": mem["activations"],
        "buffer_bytes": mem["buffers"],
        "comm_wire_bytes": {axis: tr.bytes for axis, tr in est.comm.items()},
        "step_time_s": est.step_time_s if hardware is not None else None,
        "time_split": est.time_split if hardware is not None else None,  # the step time's parts (estimate.py)
        "hardware": hardware.name if hardware is not None else None,
    }
