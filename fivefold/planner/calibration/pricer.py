"""The compute pricer of a measured profile: a CPU step priced from what `fivefold calibrate` measured.

It answers the core's four questions (datasheet.ComputePricer) with the profile's figures:

- chunk: the model's own ops, counted by tracing each part of the rank (opcount.py: its blocks,
  the embedding, the final norm + head + loss) and priced one by one (profile.tally_time); a part
  the profile timed whole (`--layers`, layers.py) at its measured time; full recompute adds the
  forward again. The FLOP price and its explain row stay beside it (MFU is FLOPs either way). With
  no per-op cost in the profile, or a part that cannot be traced, the data-sheet price stands.
- host: the Python around the ops, from counts of the layout (overheads.py);
- optimizer: fivefold's own step, timed per tensor and per element (else memory-bound);
- noise_wait: E[max of n standard normals] x the measured noise scale sigma(compute since the
  ranks last synchronised) (noise.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.planner.calibration.noise import expected_max_normal
from fivefold.planner.calibration.opcount import OpTally, Part, end_parts, part_tally
from fivefold.planner.calibration.overheads import host_costs
from fivefold.planner.calibration.profile import MeasuredProfile, tally_time
from fivefold.planner.machine.datasheet import DATASHEET, Hardware
from fivefold.planner.machine.pricing import ChunkPrice, ChunkWork, HostPrice, HostWork, Memo, Priced
from fivefold.planner.machine.roofline import interpolate
from fivefold.planner.memory import BytesPerParam


@dataclass(frozen=True)
class OpPriced:
    """One chunk's micro-batch priced op by op: seconds, and the counts host() and optimizer() reuse."""

    forward_s: float
    backward_s: float  # recompute included
    tensors: int  # parameter tensors of the whole rank (the optimizer's per-tensor work)
    parts: dict[str, float]  # per chunk: seconds by kind of work, ops, views, FLOPs, modules, functions


def op_priced(profile: MeasuredProfile, work: ChunkWork, hw: Hardware, memo: Memo) -> OpPriced | None:
    """The busiest rank's chunk, each part timed whole if the profile has it, else priced op by op;
    None when the profile has no per-op costs or a part cannot be traced (then FLOPs alone price it)."""
    if not profile.op_overhead_s:
        return None
    cfg, share, chunks = work.cfg, work.share, work.chunks
    m, p, t = cfg.model, cfg.parallel, cfg.train
    parts = [Part("block", m, blk, 0, p.tp, t.micro_batch, work.local_seq) for blk in share.blocks]
    parts += end_parts(m, work.vocab, p.tp, t.micro_batch, work.local_seq, share.first, share.last, t.loss_chunk)
    priced_f, priced_b, all_f, all_b = OpTally(), OpTally(), OpTally(), OpTally()
    timed_f = timed_b = 0.0
    timed = 0
    try:
        for part in parts:
            f, b = memo.get(("part_tally", part), lambda part=part: part_tally(part))
            all_f, all_b = all_f + f, all_b + b
            measured = profile.layer_time(part.key)
            if measured:
                timed_f, timed_b, timed = timed_f + measured[0], timed_b + measured[1], timed + 1
            else:
                priced_f, priced_b = priced_f + f, priced_b + b
    except ValueError:
        return None
    ft, bt = tally_time(priced_f, profile, hw), tally_time(priced_b, profile, hw)
    forward = ft["total"] + timed_f
    recompute = forward if t.recompute == "full" else 0.0
    both = all_f + all_b
    n_params = all_f.params - (1 if share.first and share.last and m.tie_embeddings else 0)
    out = {k: (ft[k] + bt[k]) / chunks for k in ft} | {
        "timed": (timed_f + timed_b) / chunks, "timed_parts": timed, "parts": len(parts),
        "ops": both.ops // chunks, "views": both.views // chunks, "flops": both.flops / chunks,
        # the Python around the ops of timed parts is in their times already (overheads.py adds the rest)
        "modules": priced_f.modules / chunks, "functions": priced_f.functions / chunks}
    return OpPriced(forward / chunks, (bt["total"] + timed_b + recompute) / chunks, n_params, out)


@dataclass(frozen=True)
class MeasuredPricer:
    """Prices with a MeasuredProfile, falling back to the data sheet where it measured nothing."""

    profile: MeasuredProfile

    def chunk(self, work: ChunkWork, hw: Hardware, memo: Memo) -> ChunkPrice:
        flops = DATASHEET.chunk(work, hw, memo)
        priced = op_priced(self.profile, work, hw, memo)
        if priced is None:
            return flops
        parts = priced.parts
        row = ("forward per chunk (ops)", f"{parts['ops']:,} ops + {parts['views']:,} views, "
               f"{parts['flops']:.3e} FLOP: {priced.forward_s * 1e3:.3f} ms forward, "
               f"{priced.backward_s * 1e3:.3f} ms backward ({parts['timed_parts']} of {parts['parts']} parts timed "
               f"whole: {parts['timed'] * 1e3:.3f} ms; the rest op by op: overhead {parts['overhead'] * 1e3:.3f}, "
               f"matmul {parts['matmul'] * 1e3:.3f}, attention {parts['attention'] * 1e3:.3f}, "
               f"elementwise {parts['elementwise'] * 1e3:.3f} ms)",
               "calibration/opcount.py: model.Block and the ends traced forward + backward (TorchDispatchMode), "
               "priced with the profile's op_overhead_s, view_overhead_s, matmul_curve, elementwise_curve; timed "
               "parts: the profile's layer_times (calibration/layers.py)")
        return ChunkPrice(priced.forward_s, priced.backward_s, [*flops.explain, row], priced)

    def host(self, work: HostWork, chunk: ChunkPrice, hw: Hardware) -> HostPrice:
        """Python's costs from the traced counts; none when the chunk was not traced (FLOP-priced)."""
        priced = chunk.detail
        if not isinstance(priced, OpPriced):
            return HostPrice()
        return host_costs(work.cfg, self.profile, hw, modules=priced.parts["modules"],
                          functions=priced.parts["functions"], tensors=priced.tensors / work.chunks,
                          rank_tensors=priced.tensors, rank_params=work.rank_params, micro=work.micro,
                          chunks=work.chunks, tp_calls=work.tp_calls, grad_bytes=work.grad_bytes,
                          dp_ranks=work.dp_ranks)

    def optimizer(self, shard_params: float, b: BytesPerParam, chunk: ChunkPrice, hw: Hardware) -> Priced:
        pr = self.profile
        if not (pr.optimizer_s_per_tensor or pr.optimizer_s_per_element):
            return DATASHEET.optimizer(shard_params, b, chunk, hw)
        tensors = chunk.detail.tensors if isinstance(chunk.detail, OpPriced) else 0
        seconds = tensors * pr.optimizer_s_per_tensor + shard_params * pr.optimizer_s_per_element
        return Priced(seconds, [("optimizer", f"{tensors} tensors x {pr.optimizer_s_per_tensor * 1e6:.1f} us + "
                                 f"{shard_params:,.0f} elements x {pr.optimizer_s_per_element * 1e9:.2f} ns = "
                                 f"{seconds * 1e3:.3f} ms", hw.sources.get("optimizer_s_per_tensor", "profile"))])

    def noise_wait(self, n: int, compute_s: float, memo: Memo) -> float:
        """0 for one rank, no compute, or no measured noise_curve."""
        if n <= 1 or compute_s <= 0 or not self.profile.noise_curve:
            return 0.0
        return memo.get(("expected_max_normal", n), lambda: expected_max_normal(n)) * interpolate(
            self.profile.noise_curve, compute_s)

    def for_search(self) -> MeasuredPricer:
        """Without layer times: they cover only the shapes they were taken at, and a CPU prices parts
        higher timed whole than op by op, which would rank the layouts they cover against the rest."""
        return MeasuredPricer(dataclasses.replace(self.profile, layer_times=()))
