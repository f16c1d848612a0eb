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
from fivefold.parallel.schedules import build_schedule
from fivefold.parallel.simulate import simulate
from fivefold.planner.counts import model_counts
from fivefold.planner.datasheet import Hardware, get_hardware
from fivefold.planner.estimate import estimate
from fivefold.planner.layout import rank_shares
from fivefold.planner.memory import BytesPerParam, activation_bytes, buffer_bytes, rank_state_bytes
from fivefold.validate import derive


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
    Memory and wire bytes are those of global rank 0 (pipeline rank 0), whose figures the metrics
    log samples, so each predicted figure stands beside its measured one; `fivefold plan` reports
    the fullest rank's memory and, per axis, the heaviest sender's bytes (with 1F1B at pp > 2 a
    middle stage's pp bytes, twice what the first stage sends).
    """
    hw = hardware or get_hardware("h100")  # only for bytes: they do not depend on the hardware
    est = estimate(cfg, world_size, hw, act_bytes=activation_element_bytes(cfg, device_type), implementation=True)
    mem = memory_per_pipeline_rank(cfg, world_size, device_type)[0]
    return {
        "model_state_bytes": {k: mem[k] for k in ("params", "grads", "optimizer")}
        | {"total": mem["params"] + mem["grads"] + mem["optimizer"]},
        "activation_bytes": mem["activations"],
        "buffer_bytes": mem["buffers"],
        "comm_wire_bytes": {axis: tr.bytes for axis, tr in est.comm_by_pp_rank[0].items()},
        "step_time_s": est.step_time_s if hardware is not None else None,
        "time_split": est.time_split if hardware is not None else None,  # the step time's parts (estimate.py)
        "hardware": hardware.name if hardware is not None else None,
    }


def memory_per_pipeline_rank(cfg: Config, world_size: int, device_type: str = "cpu") -> list[dict[str, float]]:
    """predict_for_config's memory for every pipeline rank, not only the fullest: one dict per pp
    rank of {params, grads, optimizer, activations, buffers, total} bytes, from the terms
    terms.rank_memory adds with implementation=True (memory.fivefold_state_bytes, activation_bytes
    and buffer_bytes of layout.rank_shares; the activations in flight are simulate()'s, which depend
    on each rank's action order only, not on timing). Every tp, ep and dp rank of one pipeline rank
    holds the same, and the largest total is predict_for_config's (the dry run, train/dry_run.py,
    prints these beside what it builds)."""
    p, d = cfg.parallel, derive(cfg, world_size)
    act_bytes = activation_element_bytes(cfg, device_type)
    inflight = simulate(build_schedule(p.pp_schedule, p.pp, d.grad_accum, p.virtual_stages)).peak_inflight
    out = []
    for r, share in enumerate(rank_shares(cfg, model_counts(cfg.model, d.vocab_size))):
        state = rank_state_bytes(cfg, d, share, BytesPerParam(), implementation=True)
        mem = {k: state[k] for k in ("params", "grads", "optimizer")}
        acts = activation_bytes(cfg, share, inflight[r], d.local_seq_len, d.vocab_size, act_bytes)
        mem["activations"] = acts["total"]
        mem["buffers"] = buffer_bytes(cfg, share, BytesPerParam(), d.local_seq_len, act_bytes, d.dp * p.cp)["total"]
        mem["total"] = sum(mem.values())
        out.append(mem)
    return out
