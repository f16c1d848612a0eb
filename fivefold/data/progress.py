"""The prepare command's progress bar: input bytes done, tokens/s and the time left."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TokenProgress:
    """A bar over `total` input bytes; advance(bytes, tokens) after each unit."""

    def __init__(self, description: str, total: int, enabled: bool = True):
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("eta"),
                            TimeRemainingColumn(), console=Console(stderr=True), disable=not enabled)
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
