"""The training loop: set up, then for every step `train_step()` (train/step.py), evaluate when due,
log the step (train/step_log.py) and checkpoint when due. The same code for 1 and N ranks.

    train(cfg)                     joins the job's process group (torchrun's environment, or a group of one)
      setup()                      mesh, model -> parallelize(), data, resume or init_from
      for each step:
        train_step()               data -> pipeline (forward/backward) -> optimizer   (train/step.py)
        evaluate()                 on eval steps
        StepLog.log_step()         metrics, display, step-time table, traces          (train/step_log.py)
        CheckpointWriter.save()    every checkpoint.every steps and at the end        (checkpoint/run_state.py)
      out of memory: the rank's snapshot, then one line; no checkpoint of that step (train/oom.py)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fivefold.checkpoint.peft import PeftSource
from fivefold.checkpoint.run_dir import latest_checkpoint, run_dir_of
from fivefold.checkpoint.run_state import CheckpointWriter, load_checkpoint
from fivefold.checkpoint.weights import WithAdapters, fill_weights, load_weights
from fivefold.config.derive import Derived, derive
from fivefold.config.load import RUN_CONFIG, ConfigError, to_toml
from fivefold.config.schema import Config
from fivefold.data.batches import GlobalBatches
from fivefold.data.resolve import unpadded_vocab
from fivefold.launch.worker_report import note_missing
from fivefold.model.lora import NF4, apply_lora, quantise_base
from fivefold.model.seeded_init import SeededInit
from fivefold.model.transformer import Transformer
from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.arrivals import collective_deadlines
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.comm.compat import require_supported_torch
from fivefold.parallel.mesh import Mesh, device_for
from fivefold.parallel.muon import optimizer_split_note
from fivefold.parallel.parallelize import Parallelized, parallelize
from fivefold.parallel.pipeline.stage_split import split_note, stage_split
from fivefold.train.gc_policy import collect_between_steps
from fivefold.train.moe_balance import MoEBalancing
from fivefold.train.oom import out_of_memory, record_history
from fivefold.train.precision import LossScaler
from fivefold.train.preflight import preflight
from fivefold.train.step import Run, StepRecord, evaluate, train_step
from fivefold.train.step_log import StepLog
from fivefold.train.stop_request import StopRequest

if TYPE_CHECKING:
    from fivefold.launch.elastic import Decision


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
    stopped: bool = False  # an elastic job's SIGTERM stopped it early, with a checkpoint (stop_request.py)

    def add(self, record: StepRecord, val_loss: float | None) -> None:
        m = record.metrics
        self.losses.append(m["loss"])
        self.grad_norms.append(m["grad_norm"])
        self.tokens_per_s.append(m["tokens_per_s"])
        self.samples.append(record.samples)
        if val_loss is not None:
            self.val_losses[m["step"]] = val_loss


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
        # Joined under torch's default timeout, then given the collective timeout (as the mesh's groups
        # are, parallel/mesh.py): joining waits for the slowest rank to start, which a short collective
        # timeout must not cut. The mesh's arrivals watch is set against the same timeout
        # (parallel/comm/arrivals.py).
        dist.init_process_group(backend)
        timeout_s = collective_deadlines(timeout_s, device_type).process_group_s
        dist.group.WORLD.set_timeout(timedelta(seconds=timeout_s))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def meta_model(cfg: Config, vocab_size: int) -> Transformer:
    """The whole model on the meta device: names and shapes, no memory (what training builds); with
    lora.rank its adapters, everything else frozen (model/lora.py)."""
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(cfg.model, vocab_size=vocab_size))
    if cfg.lora.rank:
        apply_lora(model, cfg.lora)
    return model


def build_model(cfg: Config, vocab_size: int) -> Transformer:
    """The whole model in this process's memory with its seeded initial weights (the values every
    layout's ranks draw for their slices; model/seeded_init.py): for tests and benchmarks' peers."""
    model = Transformer(dataclasses.replace(cfg.model, vocab_size=vocab_size))
    if cfg.lora.rank:
        apply_lora(model, cfg.lora)
    model.init_weights(cfg.train.seed)
    if cfg.lora.rank and cfg.lora.base_dtype == "nf4":
        quantise_base(model)
    return model


def quantise_lora_base(par: Parallelized, cfg: Config) -> None:
    """lora.base_dtype = "nf4": the adapted layers' frozen weights become NF4 (model/lora.py), and the
    model-state meter counts them so (it held the dense weights)."""
    if cfg.lora.rank and cfg.lora.base_dtype == "nf4":
        quantise_base(par.model)
        nf4 = [b for name, b in par.model.named_buffers() if NF4 in name]
        par.memory.params = [*par.model.parameters(), *nf4]


def build_datasets(cfg: Config, run_dir: Path, world: AxisGroup | None = None):
    """The train and validation sets, memory-mapped, and the run's loader over them. Text inputs are
    prepared once into the cache (by `fivefold train` before the workers start; here by rank 0 when
    the job was started another way); the tokenizer's files are copied into the run directory
    (RUN_DIR/tokenizer: what `fivefold sample` decodes with).

    world: every rank of the job (the mesh's "world" view); None outside a run: the job's ranks,
    uncounted, when there is a job (a test's peer), else this process alone."""
    from fivefold.data.mixture import MixedBatches
    from fivefold.data.resolve import data_kind, ensure_prepared, open_datasets, order_folder
    from fivefold.data.tokenizer import load_tokenizer, save_tokenizer

    if world is None and dist.is_initialized():
        world = collectives.world_group()
    first = world is None or world.rank == 0
    if data_kind(cfg.data) == "text":
        if first:
            ensure_prepared(cfg)
        if world is not None:
            collectives.barrier(world, "barrier after preparing the data")
    train_set, val_set, tokenizer = open_datasets(cfg)
    if first and tokenizer is not None and not (run_dir / "tokenizer").is_dir():
        save_tokenizer(load_tokenizer(tokenizer), run_dir / "tokenizer")
    t, orders = cfg.train, order_folder(cfg)
    if cfg.data.mixture:
        loader = MixedBatches(train_set, [float(w) for _, w in cfg.data.mixture], t.global_batch, t.seed, orders)
    else:
        loader = GlobalBatches(train_set, t.global_batch, t.seed, order_dir=orders)
    return train_set, val_set, loader


def predicted(cfg: Config, world: int, device_type: str) -> dict:
    """The planner's prediction for this run's layout, logged beside what each step measures
    (the step time only with a calibrated hardware profile, `run.hardware`)."""
    from fivefold.planner.hardware import load_profile
    from fivefold.planner.selfcheck import predict_for_config

    hardware = load_profile(cfg.run.hardware) if cfg.run.hardware else None
    return predict_for_config(cfg, world, hardware, device_type)


def train(cfg: Config, derived: Derived | None = None, *, progress: bool = True,
          return_state: bool = False, elastic: Decision | None = None) -> TrainResult:
    """Train on this rank as part of the job (joins or creates the process group).

    derived: the config's derived numbers, from a caller that has already checked the config
    (`fivefold train` does, before any process starts); without it the config is checked here.
    return_state: put the final unsharded model state in the result (tests compare layouts with it).
    elastic: this round's layout decision in an elastic job (launch/elastic.py): logged as a `replan` event
    when it changed, and a SIGTERM then stops the job at the end of a step with a checkpoint.
    """
    require_supported_torch()  # an older torch is refused here, not at its first collective
    device_type = resolve_device_type(cfg)
    owns_group = init_distributed(device_type, cfg.parallel.collective_timeout_s)
    try:
        if derived is None:
            errors = preflight(cfg, dist.get_world_size())
            if errors:
                raise ConfigError(errors)
            derived = derive(cfg, dist.get_world_size(), unpadded_vocab(cfg))
        return _train(cfg, derived, device_type, progress, return_state, elastic)
    finally:
        if owns_group:
            dist.destroy_process_group()


def parallel_model(cfg: Config, derived: Derived, mesh: Mesh) -> tuple[Parallelized, SeededInit]:
    """This rank's part of the model, built on the meta device and parallelized there, its tensors
    allocated but without values; and the seeded initialisation that can give them their values."""
    model = meta_model(cfg, derived.vocab_size)
    seeded = SeededInit(model, model.cfg, cfg.train.seed)  # the whole model's names, before stages drop some
    return parallelize(model, mesh, cfg, derived), seeded


def setup(cfg: Config, derived: Derived, device_type: str) -> tuple[Run, int, Path | None]:
    """The run's mesh, parallelized model, data and loss scaler; returns (run, start step, the
    checkpoint resumed from).

    The model is built on the meta device and parallelized there, so a rank allocates only what it
    holds (parallel/materialize.py); its values then come from one source: the run's latest
    checkpoint (with checkpoint.resume), checkpoint.init_from, or the seeded initialisation.
    """
    run_dir = run_dir_of(cfg)
    mesh = Mesh.from_config(cfg, derived, device_type)
    if mesh.arrivals is not None:  # the launcher's summary names whom the watch found missing (NCCL)
        mesh.arrivals.on_found = note_missing
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RUN_CONFIG).write_text(to_toml(cfg))
    collectives.barrier(mesh.group("world"), "barrier after making the run directory")
    par, seeded = parallel_model(cfg, derived, mesh)
    train_set, val_set, loader = build_datasets(cfg, run_dir, mesh.group("world"))
    run = Run(cfg, derived, mesh, par, train_set, val_set, loader, LossScaler(cfg.train),
              MoEBalancing(par.model, mesh, cfg), mesh.device)
    latest = latest_checkpoint(run_dir) if cfg.checkpoint.resume else None
    if latest is not None:
        quantise_lora_base(par, cfg)  # the checkpoint holds the NF4 base itself: read into its buffers
        state = load_checkpoint(latest, par)
        run.loader.load_state_dict(state["loader"])
        run.scaler.load_state_dict(state["loss_scaler"])
        return run, state["step"], latest
    # LoRA's adapters: a PEFT adapter's (lora.init_from), else new ones from the seeded initialisation
    adapters = PeftSource(Path(cfg.lora.init_from), cfg) if cfg.lora.rank and cfg.lora.init_from else seeded
    if cfg.checkpoint.init_from:  # a fresh run from given weights: each rank reads only its slices
        load_weights(Path(cfg.checkpoint.init_from), par, adapters=adapters if cfg.lora.rank else None)
    elif adapters is not seeded:  # the seeded base with the PEFT adapter's
        fill_weights(WithAdapters(seeded, adapters), par, f"the seeded initialisation with {cfg.lora.init_from}")
    else:  # the seeded initialisation: each rank draws only the row blocks of its slices
        fill_weights(seeded, par, f"the seeded initialisation of {cfg.run.name or 'this run'}")
    quantise_lora_base(par, cfg)  # from the weights just loaded
    return run, 0, None


def _train(cfg: Config, derived: Derived, device_type: str, progress: bool, return_state: bool,
           elastic: Decision | None = None) -> TrainResult:
    prediction = predicted(cfg, dist.get_world_size(), device_type) if dist.get_rank() == 0 else None
    record_history(cfg, device_type)  # before the model is allocated: its allocations are in the history
    began = time.perf_counter()
    try:
        run, start, resumed_from = setup(cfg, derived, device_type)
    except torch.OutOfMemoryError as error:  # the weights, or a checkpoint's, do not fit (train/oom.py)
        raise out_of_memory(cfg, device_for(device_type), error) from error
    replan = ([("replan", {**elastic.event(), "setup_s": round(time.perf_counter() - began, 4)})]
              if elastic is not None and elastic.changed else [])
    try:
        return _steps(run, start, resumed_from, prediction, progress, return_state, elastic, replan)
    finally:
        run.mesh.close()  # its publishing thread stops before the process group goes


def _steps(run: Run, start: int, resumed_from: Path | None, prediction: dict | None, progress: bool,
           return_state: bool, elastic: Decision | None, replan: list) -> TrainResult:
    """Train from step `start` to the end (or train.stop_after, or an elastic job's agreed stop),
    checkpointing and logging."""
    cfg, world, t = run.cfg, dist.get_world_size(), run.cfg.train
    end = t.stop_after or t.steps
    log = StepLog(run, start, end, resumed_from, prediction, progress, replan)
    if resumed_from is not None:
        log.print(f"resumed from {resumed_from} at step {start}")
    if replan:
        log.print(elastic.message())
    note = split_note(cfg, stage_split(cfg, run.derived.vocab_size))
    if note:  # an automatic uneven split is said (and saved in the layout event, step_log.py)
        log.print(note)
    if cfg.optim.name == "muon":  # which parameters Muon takes and which AdamW keeps (the first stage's)
        log.print(optimizer_split_note(list(run.par.model.named_parameters())))
    checkpoints = CheckpointWriter(log.run_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save, log.world)
    result = TrainResult(run_dir=log.run_dir, start_step=start)
    stopped, stop_request = False, StopRequest() if elastic is not None else contextlib.nullcontext()
    step = start
    try:
        with collect_between_steps(t.gc_every) as collector, stop_request as stop:
            for step in range(start, end):
                # This process's first step compiles and makes NCCL's communicators: a longer timeout (mesh.py)
                first = max(cfg.parallel.first_step_timeout_s, cfg.parallel.collective_timeout_s)
                with run.mesh.timeout(first) if step == start else contextlib.nullcontext():
                    record = train_step(run, step, trace=log.traces(step + 1))
                done = step + 1
                collector.after_step(done)  # between steps: no collector pause inside one
                due = (t.eval_every and done % t.eval_every == 0) or done == t.steps
                evaluating = run.val_set is not None and due
                val_loss = evaluate(run) if evaluating else None
                log.log_step(record, val_loss)
                result.add(record, val_loss)
                stopped = stop is not None and stop.agreed(log.world)  # every rank stops at the same step
                if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == end or stopped:
                    state = {"loader": run.loader.state_dict(), "loss_scaler": run.scaler.state_dict(),
                             "world_size": world}
                    checkpoints.save(done, run.par, state)
                if stopped:  # SIGTERM: the launcher regroups (a node joins); the next world resumes here
                    log.event(done, "stop", reason="SIGTERM")
                    log.print(f"stopped at step {done} with a checkpoint (SIGTERM: the launcher is regrouping)")
                    break
        checkpoints.wait()  # an asynchronous write in flight completes (and is published) before the job ends
        collectives.barrier(log.world, "barrier at the end of training")
    except BaseException as error:
        # Out of memory: the snapshot first, while the failed step's tensors are still held (train/oom.py)
        oom = out_of_memory(cfg, run.device, error, step + 1) if isinstance(error, torch.OutOfMemoryError) else None
        # A write in flight leaves no partial folder; its own failure is said too (a full disk fails both).
        also = checkpoints.abandon()
        if also is not None:
            log.print(f"fivefold: also: {also}")
        log.close(failed=True)
        if oom is not None:
            raise oom from error
        raise
    log.close()
    result.stopped = stopped
    if return_state:
        result.state = run.par.full_state_dict()
    if dist.get_rank() == 0 and not stopped:
        write_summary(log.run_dir, cfg, log)
    return result


def write_summary(run_dir: Path, cfg: Config, log: StepLog) -> None:
    """summary.json: where the run's outputs are, printed too."""
    outputs = {"metrics" if name == "jsonl" else name: str(path) for name, path in log.sinks.outputs.items()}
    summary = {"run_dir": str(run_dir), **outputs,
               "config": str(run_dir / RUN_CONFIG), "checkpoint": str(latest_checkpoint(run_dir))}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    log.print("\n".join([f"outputs in {run_dir}/:", *(f"  {k:10s} {v}" for k, v in summary.items())]))
