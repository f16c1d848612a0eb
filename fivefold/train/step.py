"""One training step, the same code for 1 and N ranks:

    data (this rank's slice of the global batch)
      -> pipeline executor: forward and backward of every micro-batch (parallel/pipeline/executor.py),
         with tp/cp/ep collectives inside the layers and dp buckets reduced during the last backward
      -> optimizer step: unscale, clip, AdamW, ZeRO's gather (Parallelized.optimizer_step)
      -> MoE balancing (train/moe_balance.py), then the logged loss reduced over the ranks.

Loss weighting (Li et al. 2020 discuss why averaging per-rank means is wrong with uneven batches):
averaging each rank's mean loss gives a rank with padding or fewer tokens the same weight as a
full one. Here every rank divides its *sum* of token losses by the step's *global* token count
(all micro-batches, all ranks; known locally because batches are a pure function of the loader
position), and gradients are *summed* over the grad view. The result is the gradient of the mean
over every token of the global batch, identical to one process running the whole batch at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.data.batches import IGNORE, GlobalBatches, PackedDataset, rank_slice
from fivefold.model.masks import Documents
from fivefold.parallel.comm import collectives
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.parallelize import Parallelized
from fivefold.train.lr_schedule import lr_at
from fivefold.train.moe_balance import MoEBalancing
from fivefold.train.precision import LossScaler, autocast
from fivefold.train.utilization import document_keys, memory_peaks


@dataclass
class Run:
    """Everything the steps of a run share, built once by loop.setup()."""

    cfg: Config
    derived: Derived
    mesh: Mesh
    par: Parallelized
    train_set: PackedDataset
    val_set: PackedDataset | None
    loader: GlobalBatches
    scaler: LossScaler
    balancing: MoEBalancing
    device: torch.device

    def autocast(self):
        return autocast(self.cfg.train, self.mesh.device_type)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum a last-stage value over the pipeline, then over the grad view (charged to "log")."""
        collectives.all_reduce(loss, self.mesh.group("pp"), label="log")
        collectives.all_reduce(loss, self.mesh.group("grad"), label="log")
        return loss


@dataclass
class StepRecord:
    """What one step produced: the metrics line (keys: train/metrics.py) and this rank's own timing."""

    metrics: dict  # the same on every rank, except model_state_bytes (this rank's)
    wall_s: float  # this rank's step time
    parts: dict[str, float]  # this rank's step time by part (parallel/comm/timing.py)
    began: float  # perf_counter at the start
    events: list | None  # the timer's spans, when the step was traced
    timeline: list[tuple[float, float, str]]  # pp > 1: this rank's pipeline actions (start, end, name)
    samples: list[int] = field(default_factory=list)  # this rank's sample indices
    notes: list[str] = field(default_factory=list)  # lines to print (a skipped step)
    attention_keys: float | None = None  # logging steps under data.document_mask: utilization.document_keys


def train_step(run: Run, step: int, trace: bool = False) -> StepRecord:
    """Optimizer step `step` (0-based) of the run; collective over every rank."""
    mesh, par, t = run.mesh, run.par, run.cfg.train
    timer = mesh.timer
    began = timer.begin_step(trace=trace)
    mesh.stats.reset()
    if par.offload is not None:  # its copies are counted from here: "params" copies during forward and backward
        par.offload.reset_counts()
    lr = lr_at(step, run.cfg.optim, t.steps)
    with timer.span("data"):
        epoch, first = run.loader.state.epoch, run.loader.state.cursor
        indices = run.loader.next_indices()
        batch = rank_slice(run.train_set, indices, t.global_batch, run.derived.dp, mesh.rank("batch"), t.micro_batch)
        micro = par.local_micro_batches(batch.micro_batches, run.device)
        documents = Documents.from_config(run.cfg.data, run.train_set.eod)  # None: plain causal attention
        attention = par.attention_inputs(batch.micro_batches, documents, run.device)
        ahead = par.ahead_inputs(batch.micro_batches, run.cfg.model.mtp_layers, documents, run.device)
    run.balancing.before(run.scaler.scale)
    stats = par.pipeline.run(micro, batch.global_tokens, run.scaler.scale, autocast=run.autocast, attention=attention,
                             clock=timer.clock.mark if mesh.size("pp") > 1 else None, ahead=ahead)
    with timer.span("optimizer"):  # unscale, clip (its norm's reductions count to their axes), step
        outcome = par.optimizer_step(lr, run.scaler, run.cfg.optim.grad_clip)
        moe = run.balancing.after(outcome.applied)
    comm = mesh.stats.snapshot()  # training traffic only: the loss reduction below is "log"
    # the last stage's (else 0) loss, and the MTP depths' (model.mtp_layers), reduced at once
    losses = run.reduce_loss(torch.stack([stats.loss, *([] if stats.mtp_loss is None else [stats.mtp_loss])]))
    # The step's one read from the device: the logged loss and norm, and this rank's loss share (for an error).
    grad_norm, own_loss, loss_value, *mtp_value = torch.cat([torch.stack([outcome.grad_norm, stats.loss]),
                                                             losses]).tolist()
    applied = not outcome.overflow and math.isfinite(grad_norm)
    if not applied and not outcome.overflow and t.nonfinite == "stop":
        raise FloatingPointError(nonfinite_message(step + 1, own_loss, par.nonfinite_parameters(outcome)))
    wall, parts = timer.end_step()
    logging = logging_step(run.cfg, step + 1)
    # A logging step's allocator peaks, after the step's one read (host counters, outside its time).
    memory = memory_peaks(run.device) if logging else None
    # The actions' marks as times, once the step is over: a GPU's events are complete only then.
    ends = timer.host_times([m for start, end, _ in stats.timeline for m in (start, end)])
    timeline = [(ends[2 * i], ends[2 * i + 1], name) for i, (_, _, name) in enumerate(stats.timeline)]
    metrics = {"step": step + 1, "epoch": epoch, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
               "tokens": batch.global_tokens, "samples": [first, first + len(indices)], "step_time_s": wall,
               "tokens_per_s": batch.global_tokens / wall, "comm": comm,
               "model_state_bytes": par.memory.pop_peak()}
    if par.offload is not None:  # apart from "comm": the host link is no mesh axis
        metrics["offload"] = par.offload.stats(par.optimizer)
    if par.qk_clip is not None:  # the step's largest logit (rank 0's stage) and the heads it clipped
        metrics["qk_clip"] = {k: v.item() for k, v in par.qk_clip.last.items()}  # done: the step was read
    if hasattr(par.optimizer, "step_counts"):  # Muon: this rank's Newton-Schulz FLOPs and exchanged bytes
        metrics["muon"] = par.optimizer.step_counts()
    if mtp_value:  # the MTP depths' mean loss, per trained token as the main loss is (it trains times mtp_weight)
        metrics["mtp_loss"] = mtp_value[0]
    if run.scaler.enabled:
        metrics.update(loss_scale=run.scaler.scale, skipped=not applied)
    metrics.update(moe)
    if mesh.size("cp") > 1 and run.cfg.parallel.cp_method == "ring":
        metrics["attention_blocks"] = par.cp.take_blocks()
    if memory is not None:
        metrics["memory"] = memory
    if hasattr(run.train_set, "tokens_by_source"):  # a mixture: what each source gave this step
        metrics["source_tokens"] = run.train_set.tokens_by_source(indices)
    notes = [] if applied or outcome.overflow else [
        f"step {step + 1}: gradient norm {grad_norm}; step skipped (train.nonfinite = 'skip')"]
    # The document mask's kept keys of this rank's rows, for the logged FLOPs (host ids, after the step).
    keys = (document_keys(run.cfg, [x for x, _ in batch.micro_batches], run.train_set.eod)
            if logging and run.cfg.data.document_mask else None)
    return StepRecord(metrics, wall, parts, began, timer.events, timeline,
                      samples=[int(i) for i in batch.indices], notes=notes, attention_keys=keys)


def logging_step(cfg: Config, done: int) -> bool:
    """Does 1-based step `done` log its breakdown, utilization and memory (every train.log_every
    steps and the job's last)? The step measures for it; StepLog prints and records it."""
    return done % cfg.train.log_every == 0 or done == (cfg.train.stop_after or cfg.train.steps)


def nonfinite_message(step: int, loss: float, names: list[str]) -> str:
    return (f"step {step}: the gradient is not finite (first: {names[0] if names else '?'}; {len(names)} parameters "
            f"in all; this rank's loss share {loss}). Lower optim.lr, raise optim.warmup_steps or set "
            f"optim.grad_clip; train.nonfinite = 'skip' skips such steps instead; resume from the last checkpoint "
            f"with --resume")


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean token loss over the first eval_batches global batches of the validation set."""
    cfg, par, t = run.cfg, run.par, run.cfg.train
    batches = GlobalBatches(run.val_set, t.global_batch, t.seed, shuffle=False)
    documents = Documents.from_config(cfg.data, run.val_set.eod)
    total = torch.zeros(2, dtype=torch.float64, device=run.device)  # (loss sum, tokens)
    for _ in range(t.eval_batches):
        indices = batches.next_indices()
        batch = rank_slice(run.val_set, indices, t.global_batch, run.derived.dp, run.mesh.rank("batch"), t.micro_batch)
        micro = par.local_micro_batches(batch.micro_batches, run.device)
        total[0] += par.pipeline.forward_only(micro, autocast=run.autocast,
                                              attention=par.attention_inputs(batch.micro_batches, documents,
                                                                             run.device))
        if par.pipeline.has_last_stage:  # where the loss is; the sum over dp ranks is the global count
            total[1] += sum(int((y != IGNORE).sum()) for _, y in micro)
        if batches.state.epoch > 0:  # the validation set is smaller than eval_batches batches
            break
    run.reduce_loss(total)
    return float(total[0] / total[1])
