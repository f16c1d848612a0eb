"""ZeRO-Offload and ZeRO-Infinity's parameter offload: this rank's ZeRO shard state in host memory.

ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training") keeps
what the optimizer needs only once a step, the fp32 master weights and the AdamW moments, in the
host's memory, and runs the AdamW step on the host's CPU; the device keeps what forward and
backward need every micro-batch. `parallel.offload = "optimizer"` (with zero = 1, 2 or 3) does so
for this rank's ZeRO shard (shards.py) of S elements (`HostOffload`):

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

`parallel.offload = "params"` (ZeRO-3 only, `ParamOffload`) is ZeRO-Infinity's parameter offload
(Rajbhandari et al. 2021, "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme Scale Deep
Learning", sec. 5, to CPU memory; no NVMe) on top of that: the host master IS ZeRO-3's parameter
shard, and the device keeps neither an fp32 shard nor a gradient shard between uses.

| where | what | bytes |
| --- | --- | --- |
| host | fp32 parameter shard (the master), AdamW's two moments, the fp32 gradient shard | 16 S |
| device | a staging buffer per gather in flight: its unit's shard, fp32 | none kept |

- up, per gather of a unit (fsdp.py; prefetched one unit ahead, as the gathers are): the unit's
  shards are copied into a device staging buffer (ZeroShards.packed), cast to param_dtype unless
  that is fp32, and all-gathered from it; the buffer goes with the gather. 4 bytes per element;
- down, per reduce-scatter: the rank's reduced rows go into the host gradient buffer, or (a later
  micro-batch's, resharding) are added to it there, the fp32 add the device would make: 4 bytes;
- the step: gradients are unscaled and clipped where they are, on the host (the norm's float64
  partial sums of squares go to the device for the mesh's all-reduces: the same numbers), the
  host's AdamW steps the masters, and nothing comes back: the next forward's gathers bring them.
Bytes per step, this rank's shard of S elements (S_head of them the head's unit: final norm and
output), M micro-batches:
    h2d = 4 M (2 S - S_head)   resharding without a pipeline (each unit gathered for its forward
                               and its backward, the head's unit once: kept for its backward)
    h2d = 4 M 2 S              resharding with a pipeline, one chunk a rank (no unit kept across)
    h2d = 4 S                  kept gathered (parallel.reshard_after_forward = false, the default
                               with pipelines): each unit gathered once a step
    d2h = 4 S M resharding, 4 S kept gathered (one reduce-scatter a step)
(`step_bytes`), and with HSDP or cp replicas at M > 1 resharding the accumulated rows go up once
more, 4 S, for the replicas' all-reduce. On CPU the run is ZeRO-3 on the device bit for bit (the
same fp32 adds, norm and foreach AdamW on the same values). On CUDA the copies are asynchronous
from pinned memory but ordered with the compute on the current stream (no side copy stream), so a
prefetch's copy up waits behind the kernels issued before it.

Host memory: the masters and the gradient buffers, what crosses the link, are views into one flat
fp32 buffer per rank, masters first, 8 S bytes (`HostCopies.flat`); on CUDA that buffer is
page-locked as it is, in one cudaHostRegister call (CUDA Runtime API, "cudaHostRegister"), so the
copies can be asynchronous DMA. Not through torch's pinned allocator (`pin_memory=True`): its caching
host allocator rounds every allocation up to a power of two (ATen's CachingHostAllocator), which for
a buffer of a few GB pins up to twice its bytes, memory the OS can then never swap or reclaim. The
moments are the optimizer's own tensors, pageable: the host's AdamW reads them where they are.
The step record's `pinned_bytes` is the flat buffer's 8 S, the planner's pinned host bytes
(planner/offload.py).

On a CPU device host and device are the same memory; the host copies are separate tensors all the
same and every copy is made, so the mechanism runs and its bytes are counted as on a GPU, the flat
buffer's too (nothing is pinned there: `pinned_bytes` is what a GPU would pin).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from fivefold.config.schema import Config
from fivefold.parallel.data.buckets import Bucket
from fivefold.parallel.data.shards import ShardedOptimizer, ZeroShards
from fivefold.parallel.materialize import carry_marks


class HostCopies:
    """What both offloads share: this rank's host masters and their gradient buffers, views into one
    flat buffer (page-locked on CUDA), the bytes copied each way this step, and the wait for the
    copies in flight."""

    def __init__(self, shards: ZeroShards, params: list[nn.Parameter]):
        self.shards = shards
        masters = [shards.masters[id(p)] for p in params]  # the device's fp32 shards, parameter order
        self.device = masters[0].device if masters else torch.device("cpu")
        # A meta device (the dry run) keeps the host copies on meta too: shapes, no memory.
        host = torch.device("meta") if self.device.type == "meta" else torch.device("cpu")
        sizes = [m.numel() for m in masters]
        shard = sum(sizes)  # S
        # Persistent, made once and reused every step: masters then gradient buffers, parameter order
        self.flat = torch.empty(2 * shard, dtype=torch.float32, device=host)  # (2 S,)
        if self.device.type == "cuda":
            _page_lock(self, self.flat)
        self.pinned_bytes = self.flat.numel() * self.flat.element_size()
        self.host_masters: list[nn.Parameter] = []
        self.host_grads: list[torch.Tensor] = []
        parts = zip(masters, self.flat[:shard].split(sizes), self.flat[shard:].split(sizes), strict=True)
        for m, master, grad in parts:
            # AdamW's decay rule reads no_decay off the tensors it steps (optimizer.build_optimizer)
            self.host_masters.append(carry_marks(m, nn.Parameter(master.view(m.shape), requires_grad=False),
                                                 ("no_decay",)))  # (c, ...) as m
            self.host_grads.append(grad.view(m.shape))  # (c, ...) as m
        self.d2h_bytes = self.h2d_bytes = 0  # this step's: the training step resets them as it begins

    def host_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of the host tensors held for this rank: masters, gradient buffers and `optimizer`'s
        state of them (the moments, and once AdamW has made them its 0-dim fp32 step counters)."""
        state = [t for m in self.host_masters for t in optimizer.state.get(m, {}).values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in [*self.host_masters, *self.host_grads, *state])

    def reset_counts(self) -> None:
        """A new step: nothing moved yet (a skipped step's optimizer moves nothing)."""
        self.d2h_bytes = self.h2d_bytes = 0

    def stats(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """This step's bytes each way, the host's bytes and those of them pinned (module docstring),
        for the metrics record's "offload"."""
        return {"d2h_bytes": self.d2h_bytes, "h2d_bytes": self.h2d_bytes, "host_bytes": self.host_bytes(optimizer),
                "pinned_bytes": self.pinned_bytes}

    def _wait(self) -> None:
        """Block the host until the copies issued so far on the device's stream are done (CUDA: an
        event on the current stream; elsewhere the copies were synchronous)."""
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()


def _page_lock(owner: HostCopies, flat: torch.Tensor) -> None:
    """Page-lock `flat`'s bytes exactly (module docstring), until `owner` is collected: then the
    device's copies are waited for and the range is unlocked before the buffer can be freed (the
    finalizer holds it). Views that outlive `owner` keep their memory, pageable."""
    if flat.numel() == 0:
        return
    nbytes = flat.numel() * flat.element_size()
    error = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), nbytes, 1))  # 1: cudaHostRegisterPortable
    if error:
        raise RuntimeError(f"parallel.offload: page-locking the {nbytes / 2**30:.2f} GiB host buffer of this "
                           f"rank's masters and gradients failed (cudaError {error}): raise the locked-memory limit "
                           "(ulimit -l) or free host memory")
    # Not at exit: the CUDA context may be gone by then, and the process's end unlocks everything
    weakref.finalize(owner, _unlock, flat).atexit = False


def _unlock(flat: torch.Tensor) -> None:
    torch.cuda.synchronize()  # no copy in flight reads or writes the range
    torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())


class HostOffload(HostCopies):
    """offload = "optimizer" (module docstring): host copies of the device's fp32 shards, which the
    optimizer steps, their gradient buffers, and the copies each way at each step."""

    def __init__(self, shards: ZeroShards, params: list[nn.Parameter]):
        super().__init__(shards, params)
        self.device_masters = [shards.masters[id(p)] for p in params]  # kept: ZeRO's gathers read them
        # What the optimizer steps (dp.optimizer_params()) and the key of the state the shards' state
        # dicts read and load: the host's, so checkpoints carry the host moments under DDP's keys.
        shards.stepped = {id(p): h for p, h in zip(params, self.host_masters, strict=True)}
        self.pull_masters()

    def grads_ready(self) -> None:
        """The step unscales and clips the device's gradient shards: nothing to wait for."""

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


class ParamOffload(HostCopies):
    """offload = "params" (module docstring): ZeRO-3's fp32 parameter shards are the host masters;
    the shards (shards.HostMasters) call `stage` before each gather and `add_grad` at each reduction."""

    def __init__(self, shards: ZeroShards, params: list[nn.Parameter]):
        super().__init__(shards, params)
        self.grad_buffer: dict[int, torch.Tensor] = {}  # id(host master) -> its gradient buffer
        for p, h, buf in zip(params, self.host_masters, self.host_grads, strict=True):
            h.copy_(shards.masters[id(p)])  # the padding rows' zeros (the rest is filled on load)
            shards.masters[id(p)] = h  # the device's shard goes: the host master is the parameter shard
            self.grad_buffer[id(h)] = buf
        shards.host = self  # shards.stepped is shards.masters: the optimizer steps the host masters
        self.device_masters: list[torch.Tensor] = []  # no fp32 shard stays on the device

    @torch.no_grad()
    def stage(self, b: Bucket) -> torch.Tensor:
        """The bucket's host shards copied up into a new device buffer, (sum(shard numel),) fp32."""
        staged = torch.empty(sum(b.shard_numel), dtype=torch.float32, device=self.device)
        for p, part in zip(b.params, staged.split(b.shard_numel), strict=True):
            part.copy_(self.shards.masters[id(p)].reshape(-1), non_blocking=True)  # (shard numel,)
        self.h2d_bytes += staged.numel() * staged.element_size()
        return staged

    @torch.no_grad()
    def add_grad(self, p: nn.Parameter, rows: torch.Tensor) -> None:
        """Reduced rows of p (device, in reduce_dtype) down into its host gradient: a step's first
        become it, a later micro-batch's are added to it there in fp32 (the add the device would make)."""
        h = self.shards.masters[id(p)]
        rows = rows.view_as(h).float()  # (c, ...) fp32
        if h.grad is None:
            buf = self.grad_buffer[id(h)]
            buf.copy_(rows, non_blocking=True)  # waited for by grads_ready, or by a later add's copy
            h.grad = buf
        else:  # on CUDA a blocking copy down (after every copy before it on the stream), then the add
            h.grad.add_(rows.to(h.grad.device))
        self.d2h_bytes += rows.numel() * rows.element_size()

    @torch.no_grad()
    def take_accumulated(self, b: Bucket) -> torch.Tensor | None:
        """The bucket's accumulated host gradients up, flat (sum(shard numel),) fp32, for the replicas'
        all-reduce (HSDP, cp) to sum with the last micro-batch's rows; the host's cleared."""
        grads = [self.shards.masters[id(p)].grad for p in b.params]
        if grads[0] is None:
            return None
        self._wait()  # a copy down into them may still be in flight
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self.device)
        for p in b.params:
            self.shards.masters[id(p)].grad = None
        self.h2d_bytes += flat.numel() * flat.element_size()
        return flat

    def grads_ready(self) -> None:
        """Before the step reads the host gradients (unscale, clip, AdamW): the copies down are done."""
        self._wait()

    def pull_masters(self) -> None:
        """Nothing: loads write the host masters themselves (they are the shards)."""

    def to_host(self) -> None:
        """Nothing: the gradient shards came down as they were reduced."""

    def to_device(self) -> None:
        """Nothing: the next forward's gathers bring the updated shards up."""

    def zero_grad(self) -> None:
        """Nothing: the device holds no gradient shard (the optimizer lets go of the host masters')."""


def step_bytes(shard: int, head: int, micro_batches: int, reshard_after_forward: bool, pipeline: bool
               ) -> dict[str, int]:
    """offload = "params": the bytes each way of one step (module docstring) for a shard of `shard`
    fp32 elements, `head` of them the head's unit's, without replicas."""
    if not reshard_after_forward:
        return {"h2d_bytes": 4 * shard, "d2h_bytes": 4 * shard}
    gathered = 2 * shard - (0 if pipeline else head)  # per micro-batch
    return {"h2d_bytes": 4 * micro_batches * gathered, "d2h_bytes": 4 * micro_batches * shard}


def apply_offload(dp: ShardedOptimizer, cfg: Config) -> HostOffload | ParamOffload | None:
    """The host side of a ZeRO strategy's shards: parallel.offload = "optimizer" (`dp`: ZeRO-1/2 or
    3) or "params" (`dp`: ZeRO-3; validate/speed.py refuses offload without ZeRO, and "params"
    without ZeRO-3); None without offload."""
    if cfg.parallel.offload == "optimizer":
        return HostOffload(dp.shards, dp.params)
    if cfg.parallel.offload == "params":
        return ParamOffload(dp.shards, dp.params)
    return None
