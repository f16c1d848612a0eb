"""The training loop, the same code for 1 and N ranks.

Loss weighting (the pitfall the data-parallel course page describes): averaging each rank's mean
loss gives a rank with padding or fewer tokens the same weight as a full one. Here every rank
divides its *sum* of token losses by the step's *global* token count (all micro-batches, all
ranks; known locally because batches are a pure function of the loader position), and gradients
are *summed* over the grad view. The result is the gradient of the mean over every token of the
global batch, identical to one process running the whole batch at once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fivefold.config import Config, ConfigError, to_toml
from fivefold.mesh import Mesh, device_for
from fivefold.model import Transformer
from fivefold.parallel import comms
from fivefold.parallel.expert import (ExpertStats, expert_stats, reset_expert_counts, set_balance_loss_scale,
                                     update_expert_bias)
from fivefold.parallel.parallelize import Parallelized, full_state_dict, parallelize
from fivefold.parallel.timing import TIMER
from fivefold.train.breakdown import BreakdownWindow, gather_parts, log_entries, pipeline_timeline
from fivefold.train.checkpoint import CheckpointWriter, load_checkpoint
from fivefold.train.run_dir import check_run_dir, latest_checkpoint, run_dir_of
from fivefold.train.data import IGNORE, BPETokenizer, ByteTokenizer, GlobalBatches, PackedDataset, rank_slice, read_documents, split_documents
from fivefold.train.metrics import MetricsLog, ProgressDisplay
from fivefold.train.optim import clip_grad_norm, lr_at, set_lr
from fivefold.train.precision import LossScaler, autocast
from fivefold.train.weights import check_init_from, load_weights
from fivefold.validate import derive, validate
from fivefold.viz.trace import RankTrace


@dataclass
class TrainResult:
    run_dir: Path
    start_step: int  # 0, or the step of the checkpoint resumed from
    losses: list[float] = field(default_factory=list)  # one per step run here
    grad_norms: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss
    tokens_per_s: list[float] = field(default_factory=list)
    samples: list[list[int]] = field(default_factory=list)  # this rank's sample indices per step
    state: dict[str, torch.Tensor] | None = None  # full_state_dict() at the end, when asked for


def resolve_device_type(cfg: Config) -> str:
    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.train.device


def init_distributed(device_type: str, timeout_s: float | None = None) -> bool:
    """Join the job's process group (torchrun's environment), or make a group of one. True if new."""
    if dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    if "RANK" in os.environ:
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s) if timeout_s else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def build_model(cfg: Config, vocab_size: int) -> Transformer:
    """The full model with its initial weights, identical on every rank (seeded generator on CPU)."""
    model = Transformer(dataclasses.replace(cfg.model, vocab_size=vocab_size))
    model.init_weights(torch.Generator().manual_seed(cfg.train.seed))
    return model


def build_datasets(cfg: Config, run_dir: Path) -> tuple[PackedDataset, PackedDataset | None]:
    """Tokenized train and validation sets; a BPE tokenizer is trained once by rank 0 and shared."""
    docs = read_documents(cfg.data)
    train_docs, val_docs = split_documents(docs, cfg.data.val_fraction)
    if cfg.data.tokenizer == "byte":
        tokenizer = ByteTokenizer()
    else:
        path = run_dir / "tokenizer.json"
        if dist.get_rank() == 0 and not path.is_file():
            BPETokenizer.train(train_docs, cfg.data.bpe_vocab).save(path)
        dist.barrier()
        tokenizer = BPETokenizer.load(path)
    train_set = PackedDataset(train_docs, tokenizer, cfg.train.seq_len)
    val_set = PackedDataset(val_docs, tokenizer, cfg.train.seq_len) if val_docs else None
    return train_set, val_set


@torch.no_grad()
def evaluate(par: Parallelized, dataset: PackedDataset, cfg: Config, device: torch.device, dp: int) -> float:
    """Mean token loss over the first eval_batches global batches of the validation set."""
    batches = GlobalBatches(dataset, cfg.train.global_batch, cfg.train.seed, shuffle=False)
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, tokens)
    mesh = par.mesh
    for _ in range(cfg.train.eval_batches):
        indices = batches.next_indices()
        batch = rank_slice(dataset, indices, cfg.train.global_batch, dp, mesh.rank("batch"), cfg.train.micro_batch)
        micro = par.local_micro_batches(batch.micro_batches, device)
        total[0] += par.pipeline.forward_only(micro, cfg.model.dim, autocast=lambda: autocast(cfg.train, mesh.device_type),
                                              positions=par.positions(cfg.train.seq_len, device))
        if par.pipeline.has_last_stage:  # where the loss is; the sum over dp ranks is the global count
            total[1] += sum(int((y != IGNORE).sum()) for _, y in micro)
        if batches.state.epoch > 0:  # the validation set is smaller than eval_batches batches
            break
    comms.all_reduce(total, mesh.group("pp"), label="log")
    comms.all_reduce(total, mesh.group("grad"), label="log")
    return float(total[0] / total[1])


def nonfinite_message(step: int, loss: float, dp) -> str:
    """Which gradients are NaN/Inf at `step`, gathered from every rank (they hold different parts)."""
    local = [name for name, p in dp.model.named_parameters()
             if (g := dp.gradient_of(p)) is not None and not torch.isfinite(g).all()]
    found: list[list[str]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(found, local)
    names = [f"{n} (rank {r})" for r, part in enumerate(found) for n in part]
    return (f"step {step}: the gradient is not finite (first: {names[0] if names else '?'}; {len(names)} parameters in "
            f"all; this rank's loss share {loss}). Lower train.lr, raise train.warmup_steps or set train.grad_clip; "
            f"train.nonfinite = 'skip' skips such steps instead; resume from the last checkpoint with --resume")


def predicted(cfg: Config, world: int, device_type: str) -> dict:
    """The planner's prediction for this run's layout, logged beside what each step measures
    (the step time only with a calibrated hardware profile, `run.hardware`)."""
    from fivefold.planner.hardware import load_profile
    from fivefold.planner.selfcheck import predict_for_config

    hardware = load_profile(cfg.run.hardware) if cfg.run.hardware else None
    return predict_for_config(cfg, world, hardware, device_type)


def moe_metrics(routing: ExpertStats, mesh: Mesh) -> dict:
    """Copies routed to each expert per MoE block (all stages), and each block's max/mean load."""
    parts = [routing]
    if mesh.size("pp") > 1:  # each stage counted its own blocks
        parts = [None] * mesh.size("pp")
        dist.all_gather_object(parts, routing, group=mesh.group("pp").pg)
    every = ExpertStats(load={k: v for part in parts for k, v in part.load.items()},
                        dropped={k: v for part in parts for k, v in part.dropped.items()})
    return {"expert_load": every.load, "expert_dropped": every.dropped, "expert_max_over_mean": every.max_over_mean()}


def train(cfg: Config, *, progress: bool = True, return_state: bool = False) -> TrainResult:
    """Train on this rank as part of the job (joins or creates the process group).

    return_state: put the final unsharded model state in the result (tests compare layouts with it).
    """
    device_type = resolve_device_type(cfg)
    owns_group = init_distributed(device_type, cfg.parallel.collective_timeout_s)
    try:
        return _train(cfg, device_type, progress, return_state)
    finally:
        if owns_group:
            dist.destroy_process_group()


def _train(cfg: Config, device_type: str, progress: bool, return_state: bool) -> TrainResult:
    world, rank = dist.get_world_size(), dist.get_rank()
    errors = validate(cfg, world) + check_run_dir(cfg) + check_init_from(cfg)
    if errors:
        raise ConfigError(errors)
    d, t = derive(cfg, world), cfg.train
    run_dir = run_dir_of(cfg)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(cfg))
    dist.barrier()

    prediction = predicted(cfg, world, device_type) if rank == 0 else None
    mesh = Mesh.from_config(cfg, world, device_type)
    device = device_for(device_type)
    model = build_model(cfg, d.vocab_size).to(device)
    par = parallelize(model, mesh, cfg)
    dp = par.dp
    train_set, val_set = build_datasets(cfg, run_dir)
    loader = GlobalBatches(train_set, t.global_batch, t.seed)

    scaler = LossScaler(t)
    start = 0
    latest = latest_checkpoint(run_dir) if cfg.checkpoint.resume else None
    if latest is not None:
        state = load_checkpoint(latest, dp)
        loader.load_state_dict(state["loader"])
        scaler.load_state_dict(state["loss_scaler"])
        start = state["step"]
    elif cfg.checkpoint.init_from:  # a fresh run from given weights: each rank reads only its slices
        load_weights(Path(cfg.checkpoint.init_from), dp)
    result = TrainResult(run_dir=run_dir, start_step=start)
    log = MetricsLog(run_dir / cfg.run.metrics_file, start if latest else None) if rank == 0 else None
    display = ProgressDisplay(t.steps, start, enabled=rank == 0, bar=progress)
    if latest is not None:
        display.print(f"resumed from {latest} at step {start}")

    checkpoints = CheckpointWriter(run_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save)
    end = t.stop_after or t.steps
    world_group = comms.AxisGroup("world", "log", None, world, rank, mesh.stats, cfg.parallel.collective_timeout_s)
    breakdown = BreakdownWindow()  # rank 0: the steps since the last printed table
    trace = None
    if cfg.run.trace:  # from the job's second step (the first warms up), or its first if it is shorter
        first_traced = start + (2 if end - start > cfg.run.trace_steps else 1)
        trace = RankTrace(rank, first_traced, min(end, first_traced + cfg.run.trace_steps - 1))
    for step in range(start, end):
        began = TIMER.begin_step(trace=trace is not None and trace.covers(step + 1))
        mesh.stats.reset()
        lr = lr_at(step, t)
        set_lr(dp.optimizer, lr)
        with TIMER.span("data"):
            epoch, first = loader.state.epoch, loader.state.cursor
            indices = loader.next_indices()
            batch = rank_slice(train_set, indices, t.global_batch, d.dp, mesh.rank("batch"), t.micro_batch)
            micro = par.local_micro_batches(batch.micro_batches, device)
            positions = par.positions(t.seq_len, device)
        set_balance_loss_scale(par.model, t.global_batch, scaler.scale)
        stats = par.pipeline.run(micro, batch.global_tokens, cfg.model.dim, scaler.scale,
                                 autocast=lambda: autocast(t, device_type), positions=positions,
                                 clock=time.perf_counter if mesh.size("pp") > 1 else None)
        with TIMER.span("optimizer"):  # unscale, clip (its norm's reductions count to their axes), step
            split_over = par.gradient_split_groups()  # what a gradient norm must add up over
            finite = scaler.unscale(dp.gradients(), split_over)
            if finite:
                grad_norm = clip_grad_norm(dp.gradients(), t.grad_clip, split_over, par.gradients_counted_elsewhere(),
                                           par.expert_gradients())
                finite = math.isfinite(grad_norm)  # every rank sees the same global norm
                if finite:
                    dp.step()
                elif t.nonfinite == "stop":
                    raise FloatingPointError(nonfinite_message(step + 1, stats.loss, dp))
                else:  # train.nonfinite = "skip": nothing is applied
                    display.print(f"step {step + 1}: gradient norm {grad_norm}; step skipped "
                                  f"(train.nonfinite = 'skip')")
                    dp.skip_step()
            else:  # fp16 overflow: nothing is applied, the scale halves
                grad_norm = float("inf")
                dp.skip_step()
            scaler.update(finite)
            routing = expert_stats(par.model, mesh.group("grad"), label="log")  # summed over the grad view
            if finite and cfg.model.moe_bias_update:
                update_expert_bias(par.model, routing, cfg.model.moe_bias_update)
            reset_expert_counts(par.model)
        comm = mesh.stats.snapshot()  # training traffic only: the loss reduction below is "log"
        loss_sum = torch.tensor(stats.loss, dtype=torch.float64, device=device)  # last stage's, else 0
        comms.all_reduce(loss_sum, mesh.group("pp"), label="log")
        comms.all_reduce(loss_sum, mesh.group("grad"), label="log")
        elapsed, parts = TIMER.end_step()
        matrix = gather_parts(elapsed, parts, world_group, device)  # every rank's parts, outside the step's time
        if trace is not None and trace.covers(step + 1):
            trace.add(step + 1, began, elapsed, TIMER.events)
            if step + 1 == trace.last:
                trace.write(run_dir)
        loss_value = float(loss_sum)
        result.losses.append(loss_value)
        result.grad_norms.append(grad_norm)
        result.tokens_per_s.append(batch.global_tokens / elapsed)
        result.samples.append([int(i) for i in batch.indices])
        record = {"step": step + 1, "epoch": epoch, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                  "tokens": batch.global_tokens, "samples": [first, first + len(indices)], "step_time_s": elapsed,
                  "tokens_per_s": batch.global_tokens / elapsed, "comm": comm,
                  "model_state_bytes": dp.pop_peak_state_bytes()}
        if scaler.enabled:
            record.update(loss_scale=scaler.scale, skipped=not finite)
        if cfg.model.n_experts:
            record.update(moe_metrics(routing, mesh))
        record["predicted"] = prediction
        record.update(log_entries(matrix))

        done = step + 1
        printed = done % t.log_every == 0 or done == end
        if mesh.size("pp") > 1 and printed:  # every log_every steps: a few hundred actions per step
            timeline = pipeline_timeline(stats.timeline, mesh.group("pp"))
            if timeline is not None:
                record["pipeline_timeline"] = timeline
        if val_set is not None and ((t.eval_every and done % t.eval_every == 0) or done == t.steps):
            record["val_loss"] = result.val_losses[done] = evaluate(par, val_set, cfg, device, d.dp)
        if log is not None:
            log.write(record)
        display.update(done, loss_value, record["tokens_per_s"])
        if rank == 0:
            breakdown.add(done, matrix)
        if printed:
            val = f"  val {record['val_loss']:.4f}" if "val_loss" in record else ""
            display.print(f"step {done:>6}  loss {loss_value:.4f}{val}  lr {lr:.2e}  "
                          f"grad_norm {grad_norm:.3f}  {record['tokens_per_s']:,.0f} tok/s")
            if rank == 0:
                display.print(breakdown.table(done, prediction))
        if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == end:
            state = {"loader": loader.state_dict(), "loss_scaler": scaler.state_dict(), "world_size": world}
            checkpoints.save(done, dp, state)

    checkpoints.wait()  # an asynchronous write in flight completes before the job ends
    dist.barrier()
    display.close()
    if return_state:
        result.state = full_state_dict(par)
    if log is not None:
        log.close()
        summary = {"run_dir": str(run_dir), "metrics": str(log.path), "config": str(run_dir / "config.toml"),
                   "checkpoint": str(latest_checkpoint(run_dir))}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        display.print("\n".join([f"outputs in {run_dir}/:", *(f"  {k:10s} {v}" for k, v in summary.items())]))
    return result
