"""Data parallel: the batch split over dp ranks, and with ZeRO the model state too.

Which implementation a layout gets, by `parallel.zero` (Rajbhandari et al. 2020, "ZeRO"):

| zero | module | sharded over dp_shard | traffic per rank per step (N ranks, M micro-batches) |
| --- | --- | --- | --- |
| 0 | ddp.py (DDP) | nothing | 2(N-1)/N x G, one all-reduce per bucket on the last micro-batch |
| 1 | zero.py | optimizer state | (N-1)/N x G + (N-1)/N x P |
| 2 | zero.py | + gradients | (M+1)(N-1)/N x G |
| 3 | fsdp.py | + parameters | 3M(N-1)/N x P (the head's 2M: no pipeline); kept gathered 2(N-1)/N x P |

G: gradient bytes, P: parameter bytes. With dp_replicate > 1 the shards are replicated across
dp_replicate (HSDP). Every one of them reduces gradients over the grad view (dp x cp), expert
gradients over expert_dp (where ZeRO also shards the experts' state), and is a no-op reduction
over one rank. With pipelines each of a rank's chunks reduces at its own last backward.
"""

from __future__ import annotations

from torch import nn

from fivefold.config import Config
from fivefold.parallel.data.ddp import DataParallel
from fivefold.parallel.data.fsdp import FullyShardedDataParallel
from fivefold.parallel.data.zero import ZeroDataParallel
from fivefold.parallel.derive import Derived
from fivefold.parallel.mesh import Mesh


def apply_data_parallel(model: nn.Module, mesh: Mesh, cfg: Config, derived: Derived, *,
                        chunks: list[list[nn.Module]] | None = None) -> DataParallel:
    """Wrap `model` (this rank's part of it, after every other dimension) for gradient reduction:
    DDP for zero = 0, ZeRO-1/2, or FSDP for zero = 3. `chunks`: this rank's pipeline chunks in the
    order of their last backward (`PipelineStages.reduction_chunks`), each reduced when it is done."""
    p = cfg.parallel
    if p.zero == 3:
        return FullyShardedDataParallel(model, mesh, p, chunks, derived.reshard_after_forward)
    if p.zero in (1, 2):
        return ZeroDataParallel(model, mesh, p, chunks)
    return DataParallel(model, mesh, p, chunks)
