"""ZeRO-3's weight gathers in FP8 (`parallel.fp8_gather`, with train.fp8 = "tensorwise").

Without it ZeRO-3 gathers each FP8 layer's weight in parallel.param_dtype (4 or 2 bytes an
element) and the layer then quantizes it to e4m3 with one scale for the whole tensor
(parallel/fp8.py). Once the scale is known quantization is elementwise, and the scale depends only
on the tensor's amax, the MAX of its shards' amaxes. So each rank quantizes its own rows first and
the gather moves 1 byte an element, and every rank ends with exactly the e4m3 values it would have
computed from the full weight: the same numbers in a quarter of fp32's bytes (half of bf16's). The
weight's full-precision tensor is never filled; its layer reads the gathered values from its
`fp8_weight` (a Float8Weight). (torchtitan runs FSDP2 this way with `enable_fsdp_float8_all_gather`.)

Per gather of a unit's bucket: one MAX all-reduce of its FP8 weights' shard amaxes (an fp32 number
each) over the ranks sharding them, then over the tp splits of the weights tp splits (as fp8.py's
quantize reduces them), and two all-gathers: the FP8 weights' bytes, and the rest of the bucket
(norms, biases, the router, shared parameters) in param_dtype as before. Freeing the unit drops the
gathered FP8 values too.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.data.buckets import Bucket
from fivefold.parallel.data.shards import ZeroShards
from fivefold.parallel.fp8 import E4M3, Float8Scaling, Float8Weight

Finish = Callable[[], None]  # waits for one gather and puts what it brought in place


class Float8Gather:
    """The FP8 layers' weights of `buckets`, gathered in e4m3 with their scales."""

    def __init__(self, model: nn.Module, shards: ZeroShards, buckets: list[Bucket]):
        self.shards = shards
        # id(weight) -> (its layer's Float8Weight, the tp groups splitting it)
        self.weights: dict[int, tuple[Float8Weight, tuple[AxisGroup, ...]]] = {}
        for layer in model.modules():
            scaling = getattr(layer, "scaling", None)  # a LoRA adapter's `scaling` is its alpha / r
            if isinstance(scaling, Float8Scaling) and scaling.recipe == "tensorwise":
                layer.fp8_weight = Float8Weight()
                self.weights[id(layer.weight)] = (layer.fp8_weight, scaling.inputs + scaling.outputs)
        self.split = {id(b): (self._part(b, True), self._part(b, False)) for b in buckets}  # (FP8, the rest)

    def _part(self, b: Bucket, fp8: bool) -> Bucket | None:
        """The bucket's FP8 weights (or the rest) as a bucket of their own, for gathering only."""
        params = [p for p in b.params if (id(p) in self.weights) == fp8]
        shard_numel = [n for p, n in zip(b.params, b.shard_numel, strict=True) if (id(p) in self.weights) == fp8]
        return Bucket(params, b.group, b.chunk, shard_numel=shard_numel) if params else None

    def issue(self, b: Bucket, plain: Callable[[Bucket], Finish]) -> list[Finish]:
        """Start the bucket's gathers: its FP8 weights here, the rest as `plain` gathers a bucket."""
        fp8, rest = self.split[id(b)]
        return ([plain(rest)] if rest is not None else []) + ([self._issue_fp8(fp8)] if fp8 is not None else [])

    @torch.no_grad()
    def _issue_fp8(self, b: Bucket) -> Finish:
        group = self.shards.bucket_group(b)
        # as the plain gather would cast them (device_rows: staged up from the host with offload = "params")
        rows = [r.to(p.dtype) for p, r in zip(b.params, self.shards.device_rows(b), strict=True)]
        amax = torch.stack([r.abs().amax().float() for r in rows])  # (n,) of this rank's rows
        collectives.all_reduce(amax, group, op=dist.ReduceOp.MAX)
        self._reduce_over_tp(b, amax)
        fmax = torch.finfo(E4M3).max
        scale = fmax / amax.clamp(min=1e-12)  # (n,) fp8.quantize's, to the bit
        local = torch.cat([(r.float() * s).clamp(-fmax, fmax).to(E4M3).view(torch.uint8).reshape(-1)
                           for r, s in zip(rows, scale, strict=True)])  # (sum(shard numel),) 1 byte each
        full = local.new_empty(group.size * local.numel())  # (N sum(shard numel),) rank-major
        work = collectives.all_gather(full, local, group, async_op=True)
        inverse = scale.reciprocal()

        def finish() -> None:
            if work is not None:
                work.wait()
            for i, (p, gathered) in enumerate(self.shards.unpacked(b, full.view(E4M3))):
                zd = self.shards.zero_dims[id(p)]
                holder = self.weights[id(p)][0]
                holder.q = gathered[: p.shape[zd]].movedim(0, zd).contiguous()  # (N, K) e4m3
                holder.inv_scale = inverse[i]

        return finish

    def _reduce_over_tp(self, b: Bucket, amax: torch.Tensor) -> None:
        """MAX over the tp groups splitting each weight, one all-reduce per distinct set of groups."""
        by_groups: dict[tuple[str, ...], tuple[tuple[AxisGroup, ...], list[int]]] = {}
        for i, p in enumerate(b.params):
            groups = self.weights[id(p)][1]
            by_groups.setdefault(tuple(g.name for g in groups), (groups, []))[1].append(i)
        for groups, index in by_groups.values():
            if groups:
                part = amax[index]  # (k,) a copy
                for g in groups:
                    collectives.all_reduce(part, g, op=dist.ReduceOp.MAX)
                amax[index] = part

    def free(self, params: list[nn.Parameter]) -> None:
        """Drop the gathered FP8 values of `params`' FP8 weights."""
        for p in params:
            if id(p) in self.weights:
                holder = self.weights[id(p)][0]
                holder.q = holder.inv_scale = None
