"""What a compute pricer is given and what it answers (the interface itself: datasheet.ComputePricer).

The estimate counts the work of a step from the layout (counts, layout, comm) and asks the
hardware's pricer four questions, each answered in seconds (the first three with the explain rows
behind them; the core explains the waits, which it sums over collectives):

- chunk: one micro-batch through one pipeline chunk on the busiest rank, forward and backward;
- host: the Python around the kernels (per forward, per backward, per step);
- optimizer: one optimizer step over this rank's shard;
- noise_wait: how long one collective of n ranks waits for its slowest rank;

and for_search() gives the pricer a search uses for every candidate alike.

A catalog GPU answers from its data sheet (datasheet.DatasheetPricer); a profile measured by
`fivefold calibrate` carries its own pricer (calibration/pricer.py). The types here are plain data
so that both sides can use them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, TypeVar

from fivefold.config.schema import Config
from fivefold.planner.layout import RankShare
from fivefold.planner.options import DEFAULT, PlanOptions

Row = tuple[str, str, str]  # one line of an estimate's explanation: (what, arithmetic, source)
T = TypeVar("T")


class Memo:
    """Results that many estimates share, owned by whoever runs them: search() keeps one for all its
    candidates (each pipeline shape simulated once, each part traced once); a single estimate makes
    its own. An object passed down rather than a module-level cache, so no state outlives its owner."""

    def __init__(self) -> None:
        self._results: dict[Hashable, Any] = {}

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        """The result stored under `key`, computed (and stored) on first use; an exception stores nothing."""
        if key not in self._results:
            self._results[key] = compute()
        return self._results[key]


@dataclass(frozen=True)
class ChunkWork:
    """One micro-batch through one chunk (virtual stage) of the busiest pipeline rank."""

    cfg: Config
    share: RankShare  # the busiest pipeline rank: the most forward FLOPs
    chunks: int  # chunks per rank (virtual stages; 2 for the V schedules)
    vocab: int  # padded vocabulary (config/derive.py)
    local_seq: int  # tokens of one sample on one rank (seq_len / cp)
    moe_blocks: int  # the rank's blocks with routed experts (each runs ep's all-to-alls)
    forward_flops: float  # forward FLOPs of one micro-batch over all the rank's chunks (tp-split)
    attention_forward_flops: float  # their attention core's share (what selective recompute runs again)
    options: PlanOptions = DEFAULT  # the estimate's switches (options.py): FP8, expert imbalance, overlap
    act_bytes: int = 2  # bytes per activation element (the compute dtype's)
    weight_bytes: float = 4  # bytes per weight element as the matmuls find it (estimate's param_b)
    # on the last stage, the head matmul the loss's backward runs again (model/head.py), per micro-batch
    loss_recompute_flops: float = 0.0


@dataclass(frozen=True)
class ChunkPrice:
    """Seconds of one chunk's forward and backward (recompute included), and how they were found."""

    forward_s: float
    backward_s: float
    explain: list[Row] = field(default_factory=list)
    detail: Any = None  # what the pricer that made it reads again in host() and optimizer(); opaque to the core


@dataclass(frozen=True)
class HostWork:
    """The counts of a step that Python's costs scale with, as the layout gives them."""

    cfg: Config
    rank_params: int  # parameter elements on this rank
    micro: int  # micro-batches per step
    chunks: int  # chunks per rank
    tp_calls: int  # tensor-parallel collectives per step that are autograd Functions (comm.py)
    grad_bytes: float  # gradient bytes this rank reduces
    dp_ranks: int  # ranks it reduces them over (dp x cp)


@dataclass
class HostPrice:
    """Seconds of Python around the kernels; built up term by term, hence not frozen."""

    forward_s: float = 0.0  # per micro-batch and chunk, added to its forward
    backward_s: float = 0.0  # per micro-batch and chunk, added to its backward
    step_s: float = 0.0  # once per step
    explain: list[Row] = field(default_factory=list)


@dataclass(frozen=True)
class Priced:
    """One term of a step: its seconds and the rows that explain them."""

    seconds: float
    explain: list[Row] = field(default_factory=list)
