"""The metrics log (one JSON object per step) and the progress display, both on rank 0 only.

Keys of a step's object in `metrics.jsonl` (later features add keys; none is ever renamed):

| key | meaning |
| --- | --- |
| step | optimizer steps done, 1-based |
| epoch | training epochs completed before this step's batch was taken |
| loss | mean token loss of the step's global batch (every token of every rank weighs the same) |
| lr | learning rate used for the step |
| grad_norm | global L2 norm of the summed gradient, before clipping |
| tokens | target tokens in the global batch (padding excluded) |
| samples | [start, end): the positions in epoch `epoch`'s seeded sample order (train/data.py) that made the global batch; consecutive steps continue where the last ended (a new epoch starts at 0), so a gap or an overlap is a lost or repeated sample |
| step_time_s | wall-clock seconds of the step on rank 0, data to optimizer |
| tokens_per_s | tokens / step_time_s, for the whole job |
| comm | {axis: {calls, bytes, wire_bytes}} counted through parallel/comms.py during the step |
| model_state_bytes | {params, grads, optimizer, total}: bytes rank 0 held, largest sample after each micro-batch's backward (storages counted once) |
| val_loss | mean validation token loss (only on steps that evaluate) |
| loss_scale, skipped | fp16 only: the loss scale after the step, and whether an overflow skipped it |
| predicted | the planner's prediction for this layout (planner/selfcheck.py): model_state_bytes, activation_bytes, buffer_bytes, comm_wire_bytes per axis, step_time_s and its parts time_split (with `run.hardware`, else null) |
| step_breakdown | {part: seconds} of the step, the mean over ranks of each rank's own measurement (parallel/timing.py); the parts add up to the ranks' mean step time: compute (F/B/I/W actions, timed directly), recompute (the forward run again in backward), bubble (a pipeline stage waiting to receive), exposed_dp/tp/pp/cp/ep (the thread blocked in that axis's collectives; asynchronous ones hidden behind compute are not counted), exposed_log (the metrics' own reductions: loss, expert loads), optimizer (unscale, clip, step), data (batch slicing and tensors), unattributed (the rest). A part no rank spent time in is left out; compute and unattributed are always there |
| step_breakdown_max | the same parts, each the max over ranks (the slowest rank for that part; they do not add up) |
| pipeline_timeline | pp > 1, every `train.log_every` steps: per pipeline rank (of rank 0's pipeline), its actions as [start_s, end_s, "F3s1"], seconds from the step's first action |
| expert_load | MoE only: {block: copies the router sent to each expert during the step, all ranks} |
| expert_max_over_mean | MoE only: {block: busiest expert's load / mean load} (1.0 = balanced) |
| expert_dropped | MoE only: {block: copies dropped over capacity (moe_capacity_factor)} |
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class MetricsLog:
    """Appends one JSON line per step; on resume, drops lines past the checkpoint's step first."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is not None and path.is_file():
            text = path.read_text()
            lines = text.splitlines()[: None if text.endswith("\n") else -1]  # a crash mid-write cut the last one
            keep = [line for line in lines if line and json.loads(line)["step"] <= resume_step]
            path.write_text("".join(line + "\n" for line in keep))
        elif resume_step is None:
            path.write_text("")
        self._file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a crash must not lose the steps already done

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


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
