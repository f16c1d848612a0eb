"""Offload's seconds: the copies over the host link and the optimizer step on the host's CPU.

ZeRO-Offload (Ren et al. 2021) keeps the optimizer state on the host and steps it there; ZeRO-
Infinity (Rajbhandari et al. 2021) moves the ZeRO-3 parameter shards there too (memory.py holds
their bytes). What a step adds, on one rank, with its shard of S parameters (memory.state_parts):

- gradients down: each reduction's shard (S x b_g) crosses the host link while the backward that
  makes it runs (ZeRO-Offload swaps gradients to the host bucket by bucket during the backward):
  per reduction, only what exceeds one micro-batch's backward is exposed. Reductions per step:
  ZeRO-1 one (in the last backward), ZeRO-2 one per micro-batch, ZeRO-3 one per micro-batch when
  it reshards and one when it keeps the units gathered (comm.dp_traffic's counts);
- parameters up (offload = "params"): every ZeRO-3 gather first brings this rank's shard up
  (S x b_p), prefetched while the micro-batch computes: per micro-batch two gathers (forward and
  backward; one per step kept gathered), exposed what exceeds the micro-batch's compute;
- the host's Adam: it reads the fp32 gradient, reads and writes master and moments and writes
  the working weight, (4 + 2 b_o + b_p) bytes per parameter, memory-bound at this GPU's share of
  the node's DRAM bandwidth (Hardware.host_bw), not overlapped: the paper's one-step delayed
  parameter update changes the optimizer's semantics and is not assumed;
- weights up (offload = "optimizer"): the updated shard (S x b_p) before ZeRO's weight all-gather,
  not overlapped either.

Both directions of the host link (Hardware.pcie_bw, per direction) run at once; the link and the
DRAM run at the catalog's link efficiency (bw_efficiency).

Pinned (page-locked) host memory, `pinned_host_bytes`: what crosses the host link is pinned where
it rests, with no staging copy beside it (DeepSpeed pins the offloaded partitions themselves;
fivefold one flat buffer per rank, parallel/data/offload.py): the fp32 gradient shard and the fp32
master, 4 + 4 bytes per shard element, and in ZeRO's accounting with offload = "params" the
parameter shard beside them (b_p; fivefold's master is its parameter shard). It is part of the host
bytes (memory.py), not added to them: the share of them the OS can never swap or reclaim. The
moments stay pageable: only the host's Adam reads them.
"""

from __future__ import annotations

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.planner.layout import RankShare
from fivefold.planner.machine.datasheet import GB, Hardware
from fivefold.planner.machine.pricing import Priced
from fivefold.planner.memory import FP8_BYTES, HOST_GRAD_BYTES, BytesPerParam, state_parts
from fivefold.planner.options import PlanOptions

SOURCE = "ZeRO-Offload (Ren et al. 2021); ZeRO-Infinity (Rajbhandari et al. 2021); offload.py"


def check_offload(cfg: Config, options: PlanOptions) -> None:
    """ValueError naming --layout offload where the ZeRO stage cannot hold what it offloads."""
    zero = cfg.parallel.zero
    if options.offload == "params" and zero != 3:
        raise ValueError(f"--layout offload=params: parameter offload (ZeRO-Infinity) moves ZeRO-3's parameter "
                         f"shards, and this layout has zero={zero}; add zero=3, or use offload=optimizer")
    if options.offload == "optimizer" and zero == 0:
        raise ValueError("--layout offload=optimizer: ZeRO-Offload moves a ZeRO shard of the optimizer "
                         "(DeepSpeed offloads with stage 1, 2 or 3); add zero=1 or more")


def pinned_host_bytes(cfg: Config, d: Derived, share: RankShare, b: BytesPerParam, options: PlanOptions,
                      implementation: bool) -> float:
    """The page-locked host bytes of this rank under options.offload (module docstring): 0 without
    offload; in fivefold's own accounting (`implementation`) the run's flat buffer, 8 per shard element."""
    if options.offload == "none":
        return 0.0
    pinned = 0.0
    for n_params, n, vocab in state_parts(cfg, d, share, options):
        pinned += (4.0 + HOST_GRAD_BYTES) * n_params / n  # fp32 master + fp32 gradient shard
        if options.offload == "params" and not implementation:  # ZeRO's parameter shard beside the master
            pinned += n_params / n * (b.param if vocab or options.fp8 != "weights" else FP8_BYTES)
    return pinned


def offload_step(cfg: Config, d: Derived, share: RankShare, b: BytesPerParam, hw: Hardware, options: PlanOptions,
                 grad_b: float, param_b: float, forward_s: float, backward_s: float) -> Priced:
    """The seconds offload adds to a step of this rank (module docstring), in place of the device's
    optimizer step. forward_s, backward_s: one micro-batch's forward and backward on this rank."""
    if hw.host_bw <= 0 or hw.pcie_bw <= 0:
        raise ValueError(f"--layout offload={options.offload}: hardware '{hw.name}' has no host_bw (or pcie_bw); "
                         "add them to its profile, or start it from a catalog entry (base = 'h100')")
    p, M = cfg.parallel, d.grad_accum
    fp8 = options.fp8 == "weights"
    shard = weights = 0.0
    for n_params, n, vocab in state_parts(cfg, d, share, options):
        shard += n_params / n
        weights += n_params / n * (param_b if vocab or not fp8 else FP8_BYTES)
    link_bw, dram_bw = hw.pcie_bw * hw.bw_efficiency, hw.host_bw * hw.bw_efficiency
    reductions = 1 if p.zero == 1 or (p.zero == 3 and not d.reshard_after_forward) else M
    down_s = shard * grad_b / link_bw
    down = reductions * max(0.0, down_s - backward_s)
    up = 0.0
    if options.offload == "params":
        per_micro = (2 if d.reshard_after_forward else 1) * weights / link_bw
        up = (M if d.reshard_after_forward else 1) * max(0.0, per_micro - forward_s - backward_s)
    step_bytes = shard * (HOST_GRAD_BYTES + 2 * b.optimizer) + weights
    cpu = step_bytes / dram_bw
    weights_up = weights / link_bw if options.offload == "optimizer" else 0.0
    total = down + up + cpu + weights_up
    row = ("offload", f"{options.offload}: shard {shard / 1e9:.3f}B params; gradients down {reductions} x "
           f"{down_s * 1e3:.2f} ms over {link_bw / GB:.1f} GB/s, {down * 1e3:.2f} ms past the backward"
           + (f"; parameters up {up * 1e3:.2f} ms past the compute" if options.offload == "params" else "")
           + f"; host Adam {step_bytes / GB:.2f} GB at {dram_bw / GB:.1f} GB/s = {cpu * 1e3:.2f} ms"
           + (f"; weights up {weights_up * 1e3:.2f} ms" if weights_up else "") + f": {total * 1e3:.2f} ms",
           f"{SOURCE}; pcie_bw: {hw.sources.get('pcie_bw', 'profile')}; "
           f"host_bw: {hw.sources.get('host_bw', 'profile')}")
    return Priced(total, [row])
