"""How many bytes of model state this rank holds: parameters, gradients and optimizer state.

Counted from the storages themselves, each storage once (views and tied weights share one), on any
device, the meta device included (what the dry run builds has shapes and no memory), so a
freed storage (ZeRO-3 resizes a parameter's storage to zero between uses; a pipeline frees a stage
output once sent) counts nothing. The optimizer's share is its state (AdamW's moments) plus the
tensors it steps that are not the model's parameters (ZeRO's fp32 master shards), and their
gradients count as gradients. With ZeRO-Offload (data/offload.py) the optimizer steps host copies:
what is counted is the device's, the fp32 shards it keeps (none with offload = "params", whose
host masters are ZeRO-3's shards), not the host's (the metrics record's "offload" entry has
those). The metrics log reports the largest sample of a step; the planner's memory model
(planner/memory.py) predicts the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fivefold.parallel.data import DataParallel
    from fivefold.parallel.data.offload import HostOffload, ParamOffload


def model_state_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                      offload: HostOffload | ParamOffload | None = None) -> dict[str, int]:
    """{params, grads, optimizer, total} bytes held now for the model's `params` and `optimizer`
    on the device (`offload`: the optimizer's tensors are on the host; the device keeps the shards)."""
    seen: set[int] = set()

    def size(tensors: list[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage() if t is not None else None
            # A storage is told apart by its identity (_cdata: the one StorageImpl its views share),
            # not its address: meta storages (the dry run, train/dry_run.py) all have address 0.
            if storage is None or storage.nbytes() == 0 or storage._cdata in seen:
                continue
            seen.add(storage._cdata)
            total += storage.nbytes()
        return total

    model = {id(p) for p in params}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    masters = [p for p in stepped if id(p) not in model]  # ZeRO's shards: optimizer state, not weights
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    if offload is not None:  # the stepped tensors and their state are the host's
        masters, state = offload.device_masters, []
    out = {"params": size(list(params)),
           "grads": size([p.grad for p in params] + [p.grad for p in masters]),
           "optimizer": size(state + masters)}
    return {**out, "total": sum(out.values())}


def frozen_shards(dp: DataParallel, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 shards ZeRO-3 keeps of the frozen parameters (LoRA's base, parallel/data/fsdp.py): their only
    copy, which no optimizer steps, so model_state_bytes counts them only where they are given as weights
    (with the parameters, as the meter and the dry run give them)."""
    shards = getattr(dp, "shards", None)
    masters = shards.masters if shards is not None else {}
    return [masters[id(p)] for p in params if not p.requires_grad and id(p) in masters]


class ModelStateMeter:
    """The largest model_state_bytes() sampled (after a chunk's first and last backward) since the last pop."""

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                 offload: HostOffload | ParamOffload | None = None):
        self.params, self.optimizer, self.offload = params, optimizer, offload
        self._peak: dict[str, int] = {}

    def sample(self) -> None:
        now = model_state_bytes(self.params, self.optimizer, self.offload)
        if now["total"] > self._peak.get("total", -1):
            self._peak = now

    def pop_peak(self) -> dict[str, int]:
        peak, self._peak = self._peak, {}
        return peak
