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

from fivefold.config.schema import Config
from fivefold.planner.estimate import Estimate, estimate
from fivefold.planner.machine.datasheet import Hardware, get_hardware


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
    "buffer_bytes", "peak_bytes" (their sum), "comm_wire_bytes": {dp, tp, pp, cp, ep}, "step_time_s" and its parts
    "time_split" (both None without a `hardware` profile: a catalog GPU's time means nothing for a
    CPU run), "hardware"}.
    Memory and wire bytes are those of global rank 0 (pipeline rank 0), whose figures the metrics
    log samples, so each predicted figure stands beside its measured one; `fivefold plan` reports
    the fullest rank's memory and, per axis, the heaviest sender's bytes (with 1F1B at pp > 2 a
    middle stage's pp bytes, twice what the first stage sends).
    """
    est = _implementation_estimate(cfg, world_size, hardware or get_hardware("h100"), device_type)
    mem = est.memory_by_pp_rank[0]
    return {
        "model_state_bytes": {k: mem[k] for k in ("params", "grads", "optimizer")}
        | {"total": mem["params"] + mem["grads"] + mem["optimizer"]},
        "activation_bytes": mem["activations"],
        "buffer_bytes": mem["buffers"],
        "peak_bytes": mem["total"],  # all of the above: the planner's peak per rank, beside the measured peak
        "comm_wire_bytes": {axis: tr.bytes for axis, tr in est.comm_by_pp_rank[0].items()},
        "step_time_s": est.step_time_s if hardware is not None else None,
        "time_split": est.time_split if hardware is not None else None,  # the step time's parts (estimate.py)
        "hardware": hardware.name if hardware is not None else None,
    }


def memory_per_pipeline_rank(cfg: Config, world_size: int, device_type: str = "cpu") -> list[dict[str, float]]:
    """predict_for_config's memory for every pipeline rank, not only rank 0: one dict per pp rank of
    {params, grads, optimizer, activations, buffers, total} bytes, the terms terms.rank_memory adds
    with implementation=True (memory.fivefold_state_bytes, activation_bytes and buffer_bytes of
    layout.rank_shares; the activations in flight are simulate()'s, which depend on each rank's
    action order only, not on timing). Every tp, ep and dp rank of one pipeline rank holds the same,
    and the largest total is `fivefold plan`'s (the dry run, train/dry_run.py, prints these beside
    what it builds)."""
    return _implementation_estimate(cfg, world_size, get_hardware("h100"), device_type).memory_by_pp_rank


def _implementation_estimate(cfg: Config, world_size: int, hw: Hardware, device_type: str) -> Estimate:
    """The estimate in fivefold's own accounting (bytes do not depend on `hw`, times do)."""
    return estimate(cfg, world_size, hw, act_bytes=activation_element_bytes(cfg, device_type), implementation=True)
