"""ZeRO-Offload: the optimizer state of this rank's ZeRO shard lives in host memory and steps there.

ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training") keeps
what the optimizer needs only once a step, the fp32 master weights and the AdamW moments, in the
host's memory, and runs the AdamW step on the host's CPU; the device keeps what forward and
backward need every micro-batch. `parallel.offload = "optimizer"` (with zero = 1, 2 or 3) does so
for this rank's ZeRO shard (shards.py) of S elements:

| where | what | bytes |
| --- | --- | --- |
| host | fp32 master shard, AdamW's exp_avg and exp_avg_sq, the fp32 gradient shard's buffer | 16 S |
| device | the fp32 shard the updated values come back to, and its reduced gradient | 4 S + 4 S |

(the device's fp32 shard is ZeRO-1/2's all-gather source and ZeRO-3's parameter shard: it stays)

Each optimizer step, once the gradients are reduced (and unscaled and clipped on the device, so
the values are the ones the device's optimizer would have stepped):
1. device -> host: every reduced fp32 gradient shard into its host buffer, 4 S bytes;
2. wait for those copies (on CUDA an event: the copies are asynchronous, into pinned buffers);
3. torch's CPU AdamW (foreach) steps the host masters with the host moments;
4. host -> device: every updated fp32 master shard into the device's shard, 4 S bytes; then data
   parallel follows up as without offload (ZeRO-1/2 all-gather the updated rows; ZeRO-3's next
   forward gathers them).
So the device saves AdamW's 8 S bytes of moments (the fp32 shard stays: the gathers read it) and
the link carries 8 S bytes a step. (The paper's device keeps fp16 weights and gets a 2 S fp16 copy
back; fivefold's weights are fp32 whatever train.dtype, autocast computing in bf16, so the fp32
shard comes back.) The paper's one-step delayed update (overlapping the host step
with the next step's compute) changes the optimizer's semantics and is not done: the results are
the device optimizer's, bit for bit on a CPU (the same foreach AdamW on the same fp32 values).
ZeRO-Infinity's parameter offload (`offload = "params"`) is not built (validate/speed.py).

On a CPU device host and device are the same memory; the host copies are separate tensors all the
same and every copy is made, so the mechanism runs and its bytes are counted as on a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.config import Config
from fivefold.parallel.data.shards import ShardedOptimizer, ZeroShards
from fivefold.parallel.materialize import carry_marks


class HostOffload:
    """This rank's ZeRO shards' optimizer state on the host (module docstring): the host masters the
    optimizer steps, their gradient buffers, and the copies each way with their bytes."""

    def __init__(self, shards: ZeroShards, params: list[nn.Parameter]):
        self.shards = shards
        self.device_masters = [shards.masters[id(p)] for p in params]  # the device's fp32 shards, parameter order
        device = self.device_masters[0].device if self.device_masters else torch.device("cpu")
        self.device = device
        # A meta device (the dry run) keeps the host copies on meta too: shapes, no memory.
        host = torch.device("meta") if device.type == "meta" else torch.device("cpu")
        pin = device.type == "cuda"  # pinned: the copies each way can be asynchronous DMA
        self.host_masters: list[nn.Parameter] = []
        self.host_grads: list[torch.Tensor] = []  # persistent: pinned once, reused every step
        for m in self.device_masters:
            master = torch.empty(m.shape, dtype=torch.float32, device=host, pin_memory=pin)  # (c, ...) as m
            # AdamW's decay rule reads no_decay off the tensors it steps (optimizer.build_optimizer)
            self.host_masters.append(carry_marks(m, nn.Parameter(master, requires_grad=False), ("no_decay",)))
            self.host_grads.append(torch.empty(m.shape, dtype=torch.float32, device=host, pin_memory=pin))
        # What the optimizer steps (dp.optimizer_params()) and the key of the state the shards' state
        # dicts read and load: the host's, so checkpoints carry the host moments under DDP's keys.
        shards.stepped = {id(p): h for p, h in zip(params, self.host_masters, strict=True)}
        self.d2h_bytes = self.h2d_bytes = 0  # this step's (reset_counts at each optimizer step)
        self.pull_masters()

    def host_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of the host tensors held for this rank: masters, gradient buffers and `optimizer`'s
        state of them (the moments, and once AdamW has made them its 0-dim fp32 step counters)."""
        state = [t for m in self.host_masters for t in optimizer.state.get(m, {}).values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in [*self.host_masters, *self.host_grads, *state])

    def reset_counts(self) -> None:
        """A new step: nothing moved yet (a skipped step moves nothing)."""
        self.d2h_bytes = self.h2d_bytes = 0

    @torch.no_grad()
    def pull_masters(self) -> None:
        """The device's fp32 shards into the host masters: after the device's were (re)filled, by the
        seeded initialisation, init_from or a checkpoint's model state. Not counted as a step's bytes."""
        for h, m in zip(self.host_masters, self.device_masters, strict=True):
            h.copy_(m, non_blocking=True)
        self._wait()

    @torch.no_grad()
    def to_host(self) -> None:
        """The reduced (unscaled, clipped) gradient shards into the host buffers, the host masters'
        gradients; waits for them, so the host optimizer reads complete values. A shard without a
        gradient (its parameter got none on any rank) gets none, and AdamW skips it, as on the device."""
        for h, buf, m in zip(self.host_masters, self.host_grads, self.device_masters, strict=True):
            if m.grad is None:
                h.grad = None
                continue
            buf.copy_(m.grad, non_blocking=True)  # (c, ...) fp32
            h.grad = buf
            self.d2h_bytes += buf.numel() * buf.element_size()
        self._wait()

    @torch.no_grad()
    def to_device(self) -> None:
        """The updated host masters into the device's shards (those the optimizer stepped). On CUDA
        asynchronous: the next to_host waits on the same stream, so a host master is not written by
        the next step before its copy here has read it."""
        for h, m in zip(self.host_masters, self.device_masters, strict=True):
            if h.grad is None:
                continue
            m.copy_(h, non_blocking=True)  # (c, ...) fp32
            self.h2d_bytes += h.numel() * h.element_size()

    def zero_grad(self) -> None:
        """Let the device's gradient shards go (the optimizer lets go of the host masters' own)."""
        for m in self.device_masters:
            m.grad = None

    def stats(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """This step's bytes each way and the host's bytes, for the metrics record's "offload"."""
        return {"d2h_bytes": self.d2h_bytes, "h2d_bytes": self.h2d_bytes, "host_bytes": self.host_bytes(optimizer)}

    def _wait(self) -> None:
        """Block the host until the copies issued so far on the device's stream are done (CUDA: an
        event on the current stream; elsewhere the copies were synchronous)."""
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()


def apply_offload(dp: ShardedOptimizer, cfg: Config) -> HostOffload | None:
    """The host copies of a ZeRO strategy's shards with parallel.offload = "optimizer" (`dp`: ZeRO-1/2
    or 3; validate/speed.py refuses offload without ZeRO, and "params"); None otherwise."""
    if cfg.parallel.offload != "optimizer":
        return None
    return HostOffload(dp.shards, dp.params)
