"""Metric sinks: where rank 0's step records and events go (the schema is in train/metrics.py).

One record schema, three destinations chosen by `run.sinks`:

- `jsonl`: RUN_DIR/metrics.jsonl (`run.metrics_file`), one JSON object a line, flushed per line; the
  record of truth that resume, `fivefold report` and the tests read, so it is always written.
- `tensorboard`: event files in RUN_DIR/tensorboard; every numeric leaf of a step record is a scalar
  whose tag is its path (`loss`, `comm/dp/wire_bytes`, `expert_max_over_mean/layers.1.ffn`), lists and
  nulls are skipped; an event is a text summary of its JSON under the tag `events/text_summary`
  (torch's add_text adds the suffix).
- `wandb`: a Weights & Biases run in RUN_DIR/wandb, offline unless `run.wandb_mode = "online"`, with
  the resolved config as the run's config and the same flattened scalars at `step=step`.

Every sink drops what a crashed job wrote past the checkpoint it resumes from: JSONL rewrites its file,
TensorBoard writes a purge marker (`purge_step`), W&B keeps one run id per run directory and
continues it (the server ignores steps it already has; see WandbSink).

This module imports neither torch nor tensorboard nor wandb at import time: a sink's package is
imported only when that sink is chosen (`validate()` checks it is installed: config.SINK_PACKAGES).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from fivefold.config.schema import SINK_PACKAGES

if TYPE_CHECKING:
    from fivefold.config.schema import Config

# Kinds of event records (train/metrics.py documents their fields); anything else is a typo.
EVENT_KINDS = ("start", "resume", "restart", "layout", "replan", "stop")


class Sink(Protocol):
    path: Path  # the file or folder it writes

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self, failed: bool) -> None: ...


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, int | float]:
    """The numeric leaves of a record by path ("comm/dp/wire_bytes"); step, lists, strings and
    nulls are left out (a sample range or a timeline is no scalar). Booleans count as 0/1."""
    out: dict[str, int | float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, (int, float)) and name != "step":  # the step is the x axis, not a series
            out[name] = int(value) if isinstance(value, bool) else value
    return out


class JsonlSink:
    """Appends one JSON line per record; on resume, drops lines past the checkpoint's step first."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is not None and path.is_file():
            keep = [line for line in complete_lines(path) if json.loads(line)["step"] <= resume_step]
            path.write_text("".join(line + "\n" for line in keep))
        elif resume_step is None:
            path.write_text("")
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        """One whole line or none: written unbuffered (a crash loses no step already done), and a
        write that fails part-way (a full disk) is cut back to the last complete line."""
        data = (json.dumps(record) + "\n").encode()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            reason = "no space left" if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else e.strerror
            raise MetricsWriteError(f"{self.path}: {reason} writing the step record ({e.strerror}); free space "
                                    f"there or set --run.out_dir to a disk with room, then --resume") from None

    def close(self, failed: bool = False) -> None:
        os.close(self._fd)


class MetricsWriteError(OSError):
    """The metrics log could not take a record; the message names the file and the fix."""


def complete_lines(path: Path) -> list[str]:
    """The non-empty lines of a JSONL file, without a last line that has no newline yet (a crash cut
    it mid-write, or the writer is still writing it)."""
    text = path.read_text()
    lines = text.splitlines()[: None if text.endswith("\n") else -1]
    return [line for line in lines if line]


class TensorBoardSink:
    """Scalars and event texts through torch's SummaryWriter, flushed per record."""

    def __init__(self, log_dir: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # only when chosen: it imports tensorboard

        log_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:  # a fresh run: event files left in the folder belong to an earlier attempt
            for old in log_dir.glob("events.out.tfevents.*"):
                old.unlink()
        # purge_step: readers hide every event of the earlier files at or after this step, i.e. what
        # the crashed job logged past the checkpoint (the next records rewrite those steps).
        purge = None if resume_step is None else resume_step + 1
        self.path = log_dir
        self._writer = SummaryWriter(str(log_dir), purge_step=purge)

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if "event" in record:
            self._writer.add_text("events", json.dumps(record), step)
        else:
            for tag, value in flatten(record).items():
                self._writer.add_scalar(tag, float(value), step)
        self._writer.flush()  # like the JSONL lines: a crash loses no finished step

    def close(self, failed: bool = False) -> None:
        self._writer.close()


class WandbSink:
    """A W&B run in RUN_DIR/wandb: offline unless `run.wandb_mode = "online"`, never prompting.

    One run id per run directory (kept in RUN_DIR/wandb/fivefold-run-id): a resumed job continues the
    same run. Offline, each job is its own folder (offline-run-*) that `wandb sync` uploads in order;
    online, the job resumes the run. Either way W&B keeps the first values of steps logged twice (its
    steps only increase), so steps between the checkpoint and a crash show the crashed job's values.
    W&B's `resume_from` rewind would replace them, but it is a preview feature not every account has.
    """

    def __init__(self, cfg: Config, run_dir: Path, resume_step: int | None):
        import wandb  # only when chosen: about 0.8 s

        r = cfg.run
        if r.wandb_mode == "online" and not wandb.login(prompt=False, verify=False):
            raise RuntimeError(wandb_login_problem())
        # Process-wide settings too: wandb 0.31 decides whether its own telemetry contacts the W&B
        # servers from these, not from the run's mode, so an offline run would otherwise reach out.
        wandb.setup(settings=wandb.Settings(mode=r.wandb_mode))
        id_file = run_dir / "wandb" / "fivefold-run-id"
        resuming = resume_step is not None and id_file.is_file()
        run_id = id_file.read_text().strip() if resuming else secrets.token_hex(4)  # W&B ids: [a-z0-9]
        try:
            self._run = wandb.init(
                project=r.wandb_project, name=r.name or run_dir.name, id=run_id, dir=run_dir, mode=r.wandb_mode,
                config=dataclasses.asdict(cfg), resume="allow" if resuming else None, reinit="create_new",
                # console="off": W&B would wrap stdout/stderr, under rich's live progress bar and the launcher;
                # quiet: where the run is saved (or its URL) at start, not a page of sparklines at the end.
                settings=wandb.Settings(console="off", quiet=True),
            )
        except BaseException:
            wandb.teardown()  # setup() started the service process; a failed init must not leave it running
            raise
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
        self._teardown = wandb.teardown
        self.path = Path(self._run.dir).parent  # RUN_DIR/wandb/offline-run-<time>-<id> (or run-...)
        self._events: tuple[int, list[str]] = (-1, [])  # the texts of this step's events

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if "event" in record:
            # One `events` text per step: a second event at the same step must not overwrite the first.
            at, texts = self._events
            texts = [*texts, json.dumps(record)] if at == step else [json.dumps(record)]
            self._events = (step, texts)
            self._run.log({"events": "\n".join(texts)}, step=step)
        else:
            self._run.log(flatten(record), step=step)

    def close(self, failed: bool = False) -> None:
        try:
            self._run.finish(exit_code=1 if failed else 0)
        finally:
            # The run started W&B's service process (wandb-core); it would otherwise outlive the run
            # until the interpreter exits (a test session, a notebook).
            self._teardown()


def wandb_login_problem() -> str:
    return ("run.wandb_mode = 'online' but no W&B API key is configured: run `wandb login` or set "
            "WANDB_API_KEY, or set run.wandb_mode = 'offline' (then `wandb sync` uploads the run later)")


def preflight(cfg: Config) -> list[str]:
    """Problems a sink would hit at open, found before any process starts: only an online W&B run
    without credentials (it imports wandb, so it runs only when that is chosen)."""
    if "wandb" not in cfg.run.sinks or cfg.run.wandb_mode != "online":
        return []
    import wandb

    return [] if wandb.login(prompt=False, verify=False) else [wandb_login_problem()]


class MetricSinks:
    """Every chosen sink behind one write: rank 0 opens it, the other ranks have none."""

    def __init__(self, sinks: list[Sink], outputs: dict[str, Path]):
        self._sinks = sinks
        self.outputs = outputs  # sink name -> the file or folder it writes, for the run's summary

    def write(self, record: dict[str, Any]) -> None:
        """One step record: {"step": N, ...the keys of train/metrics.py}."""
        if "step" not in record or "event" in record:
            raise ValueError(f"a step record needs 'step' and no 'event' (use event()): {sorted(record)}")
        for sink in self._sinks:
            sink.write(record)

    def event(self, step: int, kind: str, **fields: Any) -> None:
        """An event record {"step": step, "event": kind, **fields}, in the same streams as the steps."""
        if kind not in EVENT_KINDS or "event" in fields:
            raise ValueError(f"event kind {kind!r} with fields {sorted(fields)}: kinds are {', '.join(EVENT_KINDS)}; "
                             f"add a new kind to EVENT_KINDS and the table in train/metrics.py")
        record = {"step": step, "event": kind, **fields}
        for sink in self._sinks:
            sink.write(record)

    def close(self, failed: bool = False) -> None:
        """Closes every sink, also when one of them fails; `failed` marks the W&B run as crashed."""
        with contextlib.ExitStack() as stack:
            for sink in self._sinks:
                stack.callback(sink.close, failed)

    def __enter__(self) -> MetricSinks:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(failed=kind is not None)


def open_sinks(cfg: Config, run_dir: Path, resume_step: int | None) -> MetricSinks:
    """The sinks of `run.sinks` for this job. `resume_step`: the step of the checkpoint this job
    resumes from (what was logged after it is dropped), or None for a fresh run (the JSONL file starts
    empty, earlier TensorBoard event files are deleted, W&B starts a new run). Call on rank 0 only,
    after validate() accepted the config."""
    names = list(dict.fromkeys(("jsonl", *cfg.run.sinks)))  # jsonl first: it is the record of truth
    run_dir.mkdir(parents=True, exist_ok=True)
    sinks: list[Sink] = []
    outputs: dict[str, Path] = {}
    with _close_on_error(sinks):
        for name in names:
            if name == "jsonl":
                sink: Sink = JsonlSink(run_dir / cfg.run.metrics_file, resume_step)
            elif name == "tensorboard":
                sink = TensorBoardSink(run_dir / "tensorboard", resume_step)
            elif name == "wandb":
                sink = WandbSink(cfg, run_dir, resume_step)
            else:
                raise ValueError(f"run.sinks: unknown sink {name!r}; choose among {', '.join(SINK_PACKAGES)}")
            sinks.append(sink)
            outputs[name] = sink.path
    return MetricSinks(sinks, outputs)


@contextlib.contextmanager
def _close_on_error(sinks: list[Sink]) -> Iterator[None]:
    """If opening a later sink fails, the ones already open are closed (W&B's service stopped)."""
    try:
        yield
    except BaseException:
        MetricSinks(sinks, {}).close(failed=True)
        raise
