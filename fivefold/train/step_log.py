"""What a run reports of each step: the metrics record to the sinks (train/sinks.py; its keys are in
train/metrics.py), the progress display, the step-time table beside the planner's prediction, and
Chrome traces of a few steps.

Every rank calls `StepLog.log_step()` for every step, because logging steps (`train.log_every`, and the last)
gather every rank's step-time parts (and with pp > 1 the pipeline's timeline); only rank 0 writes
and prints.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist
from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from fivefold.checkpoint.run_dir import run_dir_of
from fivefold.parallel.pipeline.stage_split import stage_split
from fivefold.train.breakdown import BreakdownWindow, breakdown_table, log_entries, pipeline_timeline
from fivefold.train.metrics import read_events
from fivefold.train.sinks import open_sinks
from fivefold.train.step import Run, StepRecord, logging_step
from fivefold.train.trace import RankTrace
from fivefold.train.utilization import formula_keys, peak_of, run_flops, utilization


class ProgressDisplay:
    """A rich progress bar with step, loss, tokens/s and ETA, plus a printed line every few steps."""

    def __init__(self, total: int, start: int, enabled: bool, bar: bool = True):
        self.enabled = enabled
        self.bar = enabled and bar
        self.console = Console(stderr=True)
        if not self.bar:
            return
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
            TimeRemainingColumn(), console=self.console,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, loss="-", tps="-")
        self.progress.start()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar:
            self.progress.update(self.task, completed=step, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}")

    def print(self, text: RenderableType) -> None:
        if self.enabled:
            self.console.print(text, highlight=False)

    def close(self) -> None:
        if self.bar:
            self.progress.stop()


class StepLog:
    """One run's reporting, from its first step (or the one it resumed at) to `end`."""

    def __init__(self, run: Run, start: int, end: int, resumed_from: Path | None, prediction: dict | None,
                 progress: bool, events: list[tuple[str, dict]] | None = None):
        cfg, mesh = run.cfg, run.mesh
        self.run, self.end, self.prediction = run, end, prediction
        self.rank = dist.get_rank()
        self.run_dir = run_dir_of(cfg)
        self.sinks = None
        if self.rank == 0:  # before the progress bar: W&B prints a few lines as it starts
            # the logged utilization's FLOPs and peak (train/utilization.py), once
            self.flops, self.keys = run_flops(cfg, run.derived.vocab_size), formula_keys(cfg)
            self.peak, self.retries = peak_of(cfg, run.device), 0
            self.sinks = open_sinks(cfg, self.run_dir, start if resumed_from is not None else None)
            self._events(start, resumed_from)
            for kind, fields in events or []:  # e.g. an elastic job's re-plan (launch/elastic.py)
                self.sinks.event(start, kind, **fields)
        self.display = ProgressDisplay(cfg.train.steps, start, enabled=self.rank == 0, bar=progress)
        self.window = BreakdownWindow()
        self.world = mesh.group("world")  # every rank of the job: the breakdown's gather, the stop's agreement
        self.trace = None
        if cfg.run.trace:  # from the job's second step (the first warms up), or its first if it is shorter
            first = start + (2 if end - start > cfg.run.trace_steps else 1)
            self.trace = RankTrace(self.rank, first, min(end, first + cfg.run.trace_steps - 1))

    def _events(self, start: int, resumed_from: Path | None) -> None:
        """The run's start as event records: a fresh start or a resume, a restart by the launcher
        after a failure, and the layout it runs under (which a resume may have changed)."""
        if resumed_from is None:
            self.sinks.event(start, "start")
        else:
            self.sinks.event(start, "resume", checkpoint=str(resumed_from))
        # torch's agent counts the restarts after a failure, not those for a node that joins (an
        # elastic grow, which its "replan" event records): a count already logged is no new restart.
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        metrics = self.run_dir / self.run.cfg.run.metrics_file
        logged = [e["restarts"] for e in read_events(metrics) if e["event"] == "restart"] if metrics.is_file() else []
        if restarts > max(logged, default=0):
            self.sinks.event(start, "restart", restarts=restarts)
        cfg = self.run.cfg
        self.sinks.event(start, "layout", world_size=dist.get_world_size(), ep=cfg.parallel.ep,
                         **self.run.mesh.degrees, stage_layers=list(stage_split(cfg, self.run.derived.vocab_size)),
                         attention=self.run.par.cp.kernels(cfg, self.run.device.type))

    def event(self, step: int, kind: str, **fields) -> None:
        """An event record at `step` (rank 0 writes it; the others have no sinks)."""
        if self.sinks is not None:
            self.sinks.event(step, kind, **fields)

    def traces(self, step: int) -> bool:
        """Is 1-based `step` traced?"""
        return self.trace is not None and self.trace.covers(step)

    def log_step(self, record: StepRecord, val_loss: float | None) -> dict:
        """Report one step; collective on logging steps. Returns the metrics line as written."""
        m = {**record.metrics, "predicted": self.prediction}
        done = m["step"]
        if self.traces(done):
            self.trace.add(done, record.began, record.wall_s, record.events)
            if done == self.trace.last:
                self.trace.write(self.run_dir)
        self.window.add(done, record.wall_s, record.parts)
        printed = logging_step(self.run.cfg, done)  # the step measured its memory for it (step.py)
        table = None
        if printed:  # every rank's parts, gathered outside the step's timed window
            step_parts, window_parts, first = self.window.gather(self.world, self.run.device)
            m.update(log_entries(step_parts))
            if self.rank == 0:
                table = breakdown_table(window_parts, first, done, self.prediction)
            if self.run.mesh.size("pp") > 1:  # a few hundred actions per step
                timeline = pipeline_timeline(record.timeline, self.run.mesh.group("pp"))
                if timeline is not None:
                    m["pipeline_timeline"] = timeline
        if printed and self.rank == 0:
            self._utilization(m, record)
        if val_loss is not None:
            m["val_loss"] = val_loss
        if self.sinks is not None:
            self.sinks.write(m)
        for note in record.notes:
            self.display.print(note)
        self.display.update(done, m["loss"], m["tokens_per_s"])
        if printed:
            val = f"  val {val_loss:.4f}" if val_loss is not None else ""
            val += f"  mtp {m['mtp_loss']:.4f}" if "mtp_loss" in m else ""
            u = m.get("utilization")  # MFU, or without a peak the achieved TFLOP/s per rank
            mfu = ("" if u is None else f"  MFU {u['mfu']:.1%}" if u["mfu"] is not None
                   else f"  {u['achieved_tflops']:.3g} TFLOP/s")
            self.display.print(f"step {done:>6}  loss {m['loss']:.4f}{val}  lr {m['lr']:.2e}  "
                               f"grad_norm {m['grad_norm']:.3f}  {m['tokens_per_s']:,.0f} tok/s{mfu}")
            if table is not None:
                self.display.print(table)
        return m

    def _utilization(self, m: dict, record: StepRecord) -> None:
        """A logging step's achieved TFLOP/s, MFU and HFU from rank 0's step time, and its memory
        with the allocator's retries of this window (the counter is the process's)."""
        m["utilization"] = utilization(self.flops, m["step_time_s"], dist.get_world_size(), self.peak,
                                       record.attention_keys, self.keys)
        if "alloc_retries" in m.get("memory", {}):
            total = m["memory"]["alloc_retries"]
            # (a count below the last one was reset by someone else: all of it is this window's)
            m["memory"] = {**m["memory"], "alloc_retries": total - self.retries if total >= self.retries else total}
            self.retries = total

    def print(self, text: str) -> None:
        self.display.print(text)

    def close(self, failed: bool = False) -> None:
        """failed: the run stops on an error (W&B marks the run crashed)."""
        self.display.close()
        if self.sinks is not None:
            self.sinks.close(failed)
