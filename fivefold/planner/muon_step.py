"""The Muon step's price (optim.name = "muon"; planner/muon.py counts what moves and what runs).

Per step and rank: the gather's and the return's all_to_alls of bf16 pieces, on the links of the
groups they cross (dp_shard's for the dp stages, tp's), timed alpha-beta as comm.py times every
collective (an all_to_all keeps one NIC across nodes); and NS5 on the matrices this rank owns, at
the matmul rate the compute is priced at (peak x matmul_efficiency on a catalog GPU, else peak x
compute_efficiency). All of it exposed: the all_to_alls block, between the backward and the
weights' update, and NS5 runs between them. Added to the optimizer term, never to the model FLOPs.
The bytes are also reported on their axes (comm.heaviest_senders), as the runtime counts them there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.planner.comm import AxisTraffic, time_of, traffic_row
from fivefold.planner.layout import RankShare, axis_spans_nodes
from fivefold.planner.machine.datasheet import GB, Hardware
from fivefold.planner.machine.pricing import Priced
from fivefold.planner.muon import (
    MOMENT_BYTES,
    expert_dp,
    muon_share,
    ns_working_bytes,
    rank_ns_flops,
    stage_pieces,
    state_elements,
)

SOURCE = ("parallel/muon.py and matrix_owners.py (NS5: Jordan et al. 2024, torch.optim.Muon); planner/muon.py; "
          "comm.py alpha-beta")


@dataclass(frozen=True)
class MuonStep:
    by_rank: list[dict[str, AxisTraffic]] = field(default_factory=list)  # per pipeline rank: its all_to_alls, timed
    priced: Priced = field(default_factory=lambda: Priced(0.0))  # the busiest rank's NS5 and all_to_alls, all exposed
    ns_flops: float = 0.0  # the busiest rank's NS5 FLOPs a step


def muon_traffic(cfg: Config, d: Derived, share: RankShare, hw: Hardware) -> dict[str, AxisTraffic]:
    """One rank's all_to_alls of a step by axis: per stage the gather and the return, each (N-1)/N of
    the bf16 pieces it holds there (muon.stage_pieces), timed on the stage's link."""
    out: dict[str, AxisTraffic] = {}
    for axis, n, nbytes in stage_pieces(cfg, d, share):
        group = "dp_shard" if axis == "dp" else axis  # ZeRO's groups (expert_dp's taken as dp_shard's, as comm.py)
        t = out.setdefault(axis, AxisTraffic(inter_node=axis_spans_nodes(cfg, d, hw.gpus_per_node, group)))
        t.add("all_to_all", nbytes, n, 2)
    for t in out.values():
        t.time_s = time_of(t, hw)
    return out


def ns_rate(hw: Hardware) -> tuple[float, str]:
    """FLOP/s of NS5's bf16 matmuls, and the figure it comes from."""
    if hw.sm_count and hw.matmul_efficiency:
        return hw.peak_flops * hw.matmul_efficiency, "matmul_efficiency"
    return hw.peak_flops * hw.compute_efficiency, "compute_efficiency"


def muon_step(cfg: Config, d: Derived, shares: list[RankShare], busiest: RankShare, hw: Hardware) -> MuonStep:
    """Every pipeline rank's Muon traffic and the busiest rank's priced step; empty without Muon."""
    if cfg.optim.name != "muon":
        return MuonStep([{} for _ in shares])
    p = cfg.parallel
    by_rank = [muon_traffic(cfg, d, s, hw) for s in shares]
    mine = by_rank[shares.index(busiest)]
    flops = rank_ns_flops(cfg, d, busiest)
    rate, figure = ns_rate(hw)
    ns_s, comm_s = flops / rate, sum(t.time_s for t in mine.values())
    dense, experts = state_elements(cfg, busiest)
    saved = MOMENT_BYTES * (dense / (d.dp_shard if p.zero else 1) + experts / (expert_dp(cfg, d) if p.zero else 1))
    s, (shape, working) = muon_share(cfg, busiest), ns_working_bytes(cfg, busiest)
    rows = [traffic_row(f"{axis} traffic, muon", t, hw) for axis, t in mine.items()]
    rows.append(("optimizer, muon", f"Muon steps {s.total:,} of the rank's {busiest.params:,} parameters "
                 f"(tp slices {s.tp:,}, whole {s.whole:,}, experts {s.experts:,}), AdamW the rest: one fp32 momentum "
                 f"per element where AdamW keeps two, {saved / GB:.3f} GB less optimizer state"
                 + (" (on the host)" if p.offload != "none" and p.zero else "")
                 + f"; NS5 x {cfg.optim.muon.ns_steps} on the owned matrices {flops:.3e} FLOP / "
                 f"{rate / 1e12:.0f} TFLOP/s (peak x {figure}) = {ns_s * 1e3:.2f} ms; all_to_alls "
                 f"{comm_s * 1e3:.2f} ms; both exposed: {(ns_s + comm_s) * 1e3:.2f} ms. NS5's working set on "
                 f"the largest matrix {shape[0]} x {shape[1]}: {working / GB:.3f} GB (3 bf16 copies + 2 m x m; "
                 "not in the peak: it runs after the backward freed the activations)", SOURCE))
    return MuonStep(by_rank, Priced(ns_s + comm_s, rows), flops)
