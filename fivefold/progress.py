"""Progress bars with an ETA for the commands that take a while (prepare, init, convert, calibrate,
explain).

Training has its own display (train/metrics.py: loss and tokens/s beside the bar); these are the
plain cases: one piece of work, advanced in any unit (bytes, tensors, phases, table entries), and
`fivefold prepare`'s, which also shows the tokens/s. On a terminal they redraw in place on stderr;
elsewhere rich prints them once.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _bar(enabled: bool, *extra: TextColumn) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(), *extra,
                    TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=Console(stderr=True),
                    disable=not enabled)


@contextlib.contextmanager
def progress_bar(description: str, total: float, enabled: bool = True) -> Iterator[Callable[..., None]]:
    """Show a bar for `total` units of work; yields advance(amount=1)."""
    bar = _bar(enabled)
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda amount=1: bar.advance(task, amount)


class TokenProgress:
    """`fivefold prepare`'s bar over `total` input bytes; advance(bytes, tokens) after each unit."""

    def __init__(self, description: str, total: int, enabled: bool = True):
        self.bar = _bar(enabled, TextColumn("{task.fields[rate]}"))
        self.description, self.total = description, max(total, 1)
        self.tokens, self.began = 0, time.perf_counter()

    def __enter__(self) -> TokenProgress:
        self.bar.__enter__()
        self.task = self.bar.add_task(self.description, total=self.total, rate="")
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def advance(self, nbytes: int, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.began, 1e-9)
        self.bar.update(self.task, advance=nbytes, rate=f"{rate / 1e6:.2f}M tok/s")
