"""A progress bar with an ETA for the commands that take a while (init, convert, calibrate, explain).

Training has its own display (train/metrics.py: loss and tokens/s beside the bar); this is the
plain case: one piece of work, advanced in any unit (bytes, tensors, phases, table entries). On a
terminal it redraws in place on stderr; elsewhere rich prints it once.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn


@contextlib.contextmanager
def progress_bar(description: str, total: float, enabled: bool = True) -> Iterator[Callable[..., None]]:
    """Show a bar for `total` units of work; yields advance(amount=1)."""
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                   TextColumn("eta"), TimeRemainingColumn(), console=Console(stderr=True), disable=not enabled)
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda amount=1: bar.advance(task, amount)
