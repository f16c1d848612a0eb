"""The metrics schema, its readers and the progress display, all on rank 0 only.

Rank 0 writes one record per step, and one per event, through the sinks of `run.sinks`
(train/sinks.py): metrics.jsonl always (one JSON object a line), TensorBoard and W&B when chosen.
Every record carries `step`; an event record also carries `event`, a step record never does, so
`read_metrics()` returns the steps and `read_events()` the events of the same file.

Keys of a step record (later features add keys; none is ever renamed):

| key | meaning |
| --- | --- |
| step | optimizer steps done, 1-based |
| epoch | training epochs completed before this step's batch was taken |
| loss | mean token loss of the step's global batch (every token of every rank weighs the same) |
| mtp_loss | model.mtp_layers > 0 only: the MTP depths' mean loss, each depth's token losses summed and divided by the step's trained tokens as `loss` is (the step trains loss + train.mtp_weight x mtp_loss) |
| lr | learning rate used for the step |
| grad_norm | global L2 norm of the summed gradient, before clipping |
| tokens | target tokens in the global batch (padding excluded) |
| samples | [start, end): the positions in epoch `epoch`'s seeded sample order (data/batches.py) that made the global batch; consecutive steps continue where the last ended (a new epoch starts at 0), so a gap or an overlap is a lost or repeated sample |
| source_tokens | data.mixture only: {source: target tokens of the global batch it gave} (the folder names; they add up to `tokens`); `samples` then counts the mixed stream's samples (epoch stays 0) |
| step_time_s | wall-clock seconds of the step on rank 0, data to optimizer |
| tokens_per_s | tokens / step_time_s, for the whole job |
| comm | {axis: {calls, bytes, wire_bytes}} counted through parallel/comm/collectives.py during the step |
| model_state_bytes | {params, grads, optimizer, total}: bytes rank 0 held, largest sample after each micro-batch's backward (storages counted once) |
| muon | optim.name = "muon" only: {ns_flops, exchange_bytes}: rank 0's Newton-Schulz FLOPs in the step (the matrices it owns, parallel/muon.py) and the bytes its owners' exchange sent to other ranks (gathers and returns, bf16; also inside `comm`, under dp and tp) |
| qk_clip | optim.qk_clip > 0 only: {max_logit, clipped_heads}: the largest pre-softmax logit of the step over rank 0's pipeline stage's heads (all ranks holding them), and how many of those heads QK-clip scaled down after it (parallel/qk_clip.py) |
| offload | parallel.offload != "none" only: {d2h_bytes, h2d_bytes, host_bytes, pinned_bytes}: rank 0's gradient shard bytes copied to the host and fp32 shard bytes copied to the device during the step (parallel/data/offload.py: "optimizer" the updated shards after the step, "params" every gather's shards), the bytes of its host tensors (fp32 masters, gradient buffers, AdamW's state), and of those the one flat buffer of masters and gradient buffers, page-locked on CUDA (on a CPU device what a GPU would pin) |
| val_loss | mean validation token loss (only on steps that evaluate) |
| loss_scale, skipped | fp16 only: the loss scale after the step, and whether an overflow skipped it |
| predicted | the planner's prediction for this layout, for rank 0 as the other keys are (planner/selfcheck.py): model_state_bytes, activation_bytes, buffer_bytes, peak_bytes (their sum: the planner's peak per rank, beside `memory`), comm_wire_bytes per axis, step_time_s and its parts time_split (with `run.hardware`, else null) |
| utilization | logging steps only: {achieved_tflops, hardware_tflops, mfu, hfu, peak_tflops, peak_from} (train/utilization.py): TFLOP/s per rank (the whole job's FLOPs of the step / step_time_s / ranks) in model FLOPs (planner/flops.py's convention: 6 x active matmul parameters, so an MoE's top_k experts and GQA's narrow K/V; causal attention counted in full, as PaLM; sliding windows and documents as the pairs the mask keeps, documents measured on rank 0's own rows) and in hardware FLOPs (train.recompute's rerun added); mfu, hfu = those / peak_tflops, one device's peak from peak_from: "setting" (train.peak_tflops), "profile" (run.hardware's calibrated profile) or "catalog:<entry>" (the planner's datasheet entry of the CUDA device torch reports); with none of them, mfu, hfu, peak_tflops and peak_from are null |
| memory | logging steps only, rank 0's, read at the step's existing read from the device: on CUDA {peak_allocated_bytes, peak_reserved_bytes, alloc_retries}, the caching allocator's peaks and retries (a failed cudaMalloc that freed the cache and tried again) since the last logging step (peaks reset there); on a CPU {peak_rss_bytes}, the process's peak resident set (getrusage), a peak over the process's lifetime, never reset |
| step_breakdown | logging steps only (every `train.log_every` steps and the last): {part: seconds} of the step, the mean over ranks of each rank's own measurement (parallel/comm/timing.py); the parts add up to the ranks' mean step time: compute (F/B/I/W actions, timed directly), recompute (the forward run again in backward), bubble (a pipeline stage waiting to receive), exposed_dp/tp/pp/cp/ep (the thread blocked in that axis's collectives; asynchronous ones hidden behind compute are not counted), exposed_log (the metrics' own reductions: loss, expert loads), optimizer (unscale, clip, step), data (batch slicing and tensors), unattributed (the rest). A part no rank spent time in is left out; compute and unattributed are always there |
| step_breakdown_max | logging steps only: the same parts, each the max over ranks (the slowest rank for that part; they do not add up) |
| pipeline_timeline | pp > 1, every `train.log_every` steps: per pipeline rank (of rank 0's pipeline), its actions as [start_s, end_s, "F3s1"], seconds from the step's first action (on a GPU: when the stream ran it, CUDA events) |
| attention_blocks | ring attention (cp > 1) only: {computed, skipped}: (query chunk, key chunk) pairs rank 0's attention forwards computed and skipped because the mask keeps none of their pairs (their K/V still travel), over layers and micro-batches, recomputed forwards included |
| expert_load | MoE only: {block: copies the router sent to each expert during the step, all ranks} |
| expert_max_over_mean | MoE only: {block: busiest expert's load / mean load} (1.0 = balanced) |
| expert_dropped | MoE only: {block: copies dropped over capacity (model.moe.capacity_factor)} |

Keys of an event record (kinds in sinks.EVENT_KINDS; a new kind or field gets its row here):

| key | meaning |
| --- | --- |
| step | steps done when it happened (0 before the first step) |
| event | the kind: "start" (a fresh run begins), "resume" (this job continues from the checkpoint of step `step`), "restart" (the launcher restarted the workers after a failure), "layout" (the mesh this job trains on, at every start and resume), "replan" (an elastic job's new layout for a new world, fivefold/launch/elastic.py), "stop" (an elastic job saved a checkpoint at `step` and stopped on SIGTERM, for its launcher to regroup) |
| checkpoint | resume: the checkpoint's path |
| restarts | restart: restarts so far (TORCHELASTIC_RESTART_COUNT) |
| world_size, dp, tp, pp, cp, ep | layout: processes and parallel degrees (a job resuming on fewer processes shows the change) |
| attention | layout: the attention kernel of each kind of layer the model has, {"causal": .., "masked": ..} ("masked": documents, a sliding window or sinks): "sdpa", "flex" or "blockwise" (model/attention.py), "ulysses/<kernel>" behind Ulysses' all-to-all, "ring/blockwise" for ring attention |
| stage_layers | layout: blocks of each pipeline (virtual) stage in model order, as parallel/pipeline/stage_split.py chose them (parallel.stage_layers when given) |
| world_size, from_world_size | replan: ranks of the new world, and of the checkpoint resumed (or of the launch, before the first checkpoint) |
| from, to | replan: the layouts before and after, as planner/search.py's layout_name ("dp2 tp2 z0 mb2 -"); from is null when the checkpoint's world has no layout under the policy |
| policy, kept | replan: how the layout was chosen ("keeping tp, pp, cp, ep", "the planner's best (keeping tp)") and the axes kept |
| micro_batch, grad_accum | replan: [before, after] micro-batch size and micro-batches per rank per step; the global batch (global_batch) is unchanged |
| predicted_step_time_s | replan: {from, to}: the planner's step time of each layout on `hardware` (run.hardware's profile, or --gpu's catalog GPU); null without either |
| decide_s, setup_s | replan: seconds rank 0 spent choosing the layout, and building the mesh and model and loading (resharding) the checkpoint |
| reason | stop: what asked for it ("SIGTERM") |
"""  # noqa: E501 - a markdown table row is one line, however long

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fivefold.train.sinks import complete_lines


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSONL metrics file, steps and events in the order written (a last line cut
    by a crash, or still being written, is left out)."""
    return [json.loads(line) for line in complete_lines(path)]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records of a JSONL metrics file (events left out)."""
    return [r for r in read_records(path) if "event" not in r]


def read_events(path: Path) -> list[dict[str, Any]]:
    """The event records of a JSONL metrics file: {"step": N, "event": kind, ...fields}."""
    return [r for r in read_records(path) if "event" in r]
