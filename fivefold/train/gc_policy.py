"""Python's garbage collector on the training loop's schedule instead of in the middle of a step.

CPython collects reference cycles whenever enough objects have been allocated since the last
collection, and a collection walks every tracked object. A training step allocates many small
objects (autograd nodes, a zero-bubble schedule's graph walk, messages), so automatic collections
land inside steps at random: about 5% of a ZB-V step (wall time with collection on and off, under
cProfile, on benchmarks/pipeline_parallel.py's model), and on many ranks the slowest rank's pause
is everyone's.
As torchtitan (`training.gc_freq`) and Megatron-LM (`--manual-gc`) do: collect once after set-up,
move what set-up built (the model, the data) to the permanent generation so that later
collections do not walk it (`gc.freeze`), switch automatic collection off, and collect between
steps every `train.gc_every` steps. Garbage without cycles is freed at once by reference counting
either way; only cycles wait for the next collection.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


class StepCollector:
    """Collects every `every` steps (`after_step`); 0: Python's automatic collection, untouched."""

    def __init__(self, every: int):
        self.every = every

    def after_step(self, done: int) -> None:
        if self.every and done % self.every == 0:
            gc.collect()


@contextlib.contextmanager
def collect_between_steps(every: int) -> Iterator[StepCollector]:
    """Automatic collection off (and set-up's objects frozen) for the block; restored after it."""
    collector = StepCollector(every)
    if not every:
        yield collector
        return
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield collector
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
