"""One estimate's figures in the conventions published runs quote them, beside fivefold's own.

Papers and trainers count the same traffic, FLOPs and memory differently, so a published figure
compares only to the planner's figure in the same convention. `--json` carries each under its own
name (`conventions`), and `--explain` shows them in one row:

- pipeline bytes: papers quote one message, the activation (or its gradient) one stage boundary
  sends per micro-batch in one direction, b s h elements (Narayanan et al. 2021, sec. 4.1; / t
  with sequence parallelism or Megatron's scatter/gather); fivefold's `comm_bytes_per_step` is the
  busiest sender's whole step, both directions: `pp_messages_per_step` of them.
- tensor-parallel bytes: on the wire (what a rank sends: a ring all-reduce 2 (t-1)/t of the tensor,
  an all-gather or reduce-scatter (t-1)/t; fivefold's figure), the tensors themselves (the
  message, as Korthikanti et al. 2022 count "b s h per all-reduce") and each rank's shard of them
  (message / t, what sequence parallelism's all-gather contributes and its reduce-scatter keeps).
- HFU: fivefold counts what recomputation runs again: full, one more forward of the blocks;
  selective, the attention core's forward. Korthikanti et al. 2022 count full recomputation the
  same (96 B s l h^2 (1 + s/6h + V/16lh) of Narayanan et al. 2021 is 4/3 of the blocks' model
  FLOPs), but selective as the model's attention term once more (1 + s/6h -> 1 + s/3h in 72 B s l
  h^2 (...)): three times the forward it reruns, which Megatron-LM issue #523 notes.
- activations: Korthikanti's per block and micro-batch (s b h (34 + 5 a s / h) for a GPT), per
  micro-batch through the fullest rank's blocks, and in flight at the schedule's peak (memory).
"""

from __future__ import annotations

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.planner.comm import AxisTraffic
from fivefold.planner.flops import StepFlops
from fivefold.planner.machine.datasheet import GB
from fivefold.planner.machine.pricing import Row

CONVENTION_KEYS = (
    "pp_bytes_per_micro_batch_per_direction", "pp_messages_per_step", "pp_bytes_per_step_busiest_sender",
    "tp_wire_bytes_per_step", "tp_message_bytes_per_step", "tp_shard_bytes_per_step",
    "hfu", "hfu_korthikanti", "hardware_flops_per_token_korthikanti",
    "activation_bytes_per_block_micro_batch", "activation_bytes_per_micro_batch", "activation_bytes_in_flight",
)


def korthikanti_hardware_per_token(f: StepFlops) -> float:
    """Hardware FLOPs per token as Korthikanti et al. 2022 count them (module docstring): selective
    recomputation adds the model's attention term again, full the forward of the blocks as fivefold does."""
    if f.recompute == "selective":
        return f.model_per_token + f.attention_per_token
    return f.hardware_per_token


def conventions(cfg: Config, d: Derived, sent: dict[str, AxisTraffic], f: StepFlops, step_s: float,
                peak_flops: float, activations: dict[str, float], act_bytes: int) -> tuple[dict[str, float], Row]:
    """The figures of the module docstring, and the explain row that lists them. `sent`: the
    heaviest senders' traffic (comm.heaviest_senders); `activations`: the fullest rank's
    (terms.RankMemory.activations)."""
    p, t = cfg.parallel, cfg.train
    message = t.micro_batch * d.local_seq_len * cfg.model.dim * act_bytes / (p.tp if p.sp else 1) if p.pp > 1 else 0.0
    pp, tp = sent["pp"], sent["tp"]
    capacity = step_s * d.world_size * peak_flops
    hfu_k = korthikanti_hardware_per_token(f)
    out = {
        "pp_bytes_per_micro_batch_per_direction": message,
        "pp_messages_per_step": float(pp.calls),
        "pp_bytes_per_step_busiest_sender": pp.bytes,
        "tp_wire_bytes_per_step": tp.bytes,
        "tp_message_bytes_per_step": tp.message_bytes,
        "tp_shard_bytes_per_step": tp.message_bytes / p.tp if p.tp > 1 else 0.0,
        "hfu": f.hardware_per_step / capacity,
        "hfu_korthikanti": hfu_k * f.tokens_per_step / capacity,
        "hardware_flops_per_token_korthikanti": hfu_k,
        "activation_bytes_per_block_micro_batch": activations["per_block_microbatch"],
        "activation_bytes_per_micro_batch": activations["per_micro_batch"],
        "activation_bytes_in_flight": activations["total"],
    }
    text = (f"pp {message / GB:.4f} GB per micro-batch and direction, {pp.calls} sends a step from the busiest "
            f"sender ({pp.bytes / GB:.3f} GB); tp {tp.bytes / GB:.3f} GB on the wire, {tp.message_bytes / GB:.3f} GB "
            f"of tensors, {out['tp_shard_bytes_per_step'] / GB:.3f} GB of per-rank shards; HFU {out['hfu']:.1%} "
            f"(fivefold's recompute count), {out['hfu_korthikanti']:.1%} (Korthikanti's); activations "
            f"{out['activation_bytes_per_block_micro_batch'] / GB:.3f} GB per block and micro-batch, "
            f"{out['activation_bytes_per_micro_batch'] / GB:.3f} GB per micro-batch, "
            f"{out['activation_bytes_in_flight'] / GB:.3f} GB in flight")
    return out, ("conventions", text, "planner/conventions.py: Narayanan et al. 2021 sec. 4.1 (pp), Korthikanti "
                 "et al. 2022 (tp tensors, HFU, activations); fivefold's own: wire bytes, recompute as run")
