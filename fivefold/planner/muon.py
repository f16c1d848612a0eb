"""Muon's share of a layout (optim.name = "muon", parallel/muon.py), by formula from the model's shape:
which matrices it steps, on which ranks, the bytes its owners exchange and the Newton-Schulz FLOPs
they run. Pure arithmetic: the planner imports no torch (parallel/muon.py is the runtime this mirrors).

What Muon steps (parallel/muon.py is_muon_matrix): every 2-D hidden matrix, each routed expert's
three its own matrices; AdamW keeps the embedding, the head, the routers, norms, biases and sinks
(Moonlight's split: Liu et al. 2025, "Muon is Scalable for LLM Training"). Listed here by shape and
by how the layout cuts it (`Cut`): "tp", split over tp (attention's per-head projections, a dense
SwiGLU: parallel/tensor.py); "whole", whole on every tp rank (MLA's down-projections, the shared
experts, the MTP depths' eh_proj); "expert", a routed expert's, E / ep of them on a rank.

State: one fp32 momentum per element (MOMENT_BYTES) where AdamW keeps two moments; ZeRO's fp32
master is the same. Sharded as AdamW's state is: the dense part over dp_shard, the routed experts
with ep > 1 and ZeRO over expert_dp = dp x cp / ep (memory.state_parts).

The step (parallel/matrix_owners.py): each matrix is gathered whole, in bf16, to one owner among the
ranks holding its pieces, stage by stage, and its result goes back the same way, each stage one
all_to_all per direction in which a rank sends (N-1)/N of the pieces it holds (owners are balanced
by size over the grid: assign_owners):
- dp (ZeRO only): over dp_shard, this rank's rows of the tp and whole matrices; over expert_dp,
  its rows of its experts when ep splits them (with ep = 1 ZeRO keeps whole experts: nothing moves);
- tp: over tp, the tp slices of the matrices this rank holds after the dp stage, 1/dp_shard of its
  slices under ZeRO, all of them under DDP (each dp replica orthogonalises all its matrices).
The owner runs NS5 on each matrix it owns: ns_flops, over the grid of the matrix's owners (tp x
dp_shard for a tp matrix under ZeRO, dp_shard for a whole one, expert_dp or dp_shard for an expert;
tp, 1, 1 under DDP), in bf16 at the matmul rate the compute is priced at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.model.config import ModelConfig
from fivefold.model.counts import head_dim
from fivefold.planner.layout import RankShare
from fivefold.planner.lora import rank_adapters

Cut = Literal["tp", "whole", "expert"]
MOMENT_BYTES = 4.0  # one fp32 moment: Muon keeps one per element, AdamW two
WIRE_BYTES = 2.0  # the pieces travel in bf16, NS5's input dtype (parallel/muon.py: the cast is its first step)


@dataclass(frozen=True)
class MuonMatrix:
    """`count` matrices of one (out, in) shape in a block, cut as `cut` says (module docstring)."""

    shape: tuple[int, int]
    count: int
    cut: Cut

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1] * self.count


def ns_flops(shape: tuple[int, int], steps: int) -> int:
    """NS5's matmul FLOPs on one (out, in) matrix, as parallel/muon.py ns_flops counts them: per step
    X X^T, the Gram's square and its product with X, m = the smaller side, n = the larger."""
    m, n = min(shape), max(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


def block_matrices(m: ModelConfig, layer: int) -> list[MuonMatrix]:
    """The Muon matrices of block `layer` (an MTP depth's: n_layers + k), model/attention.py, ffn.py
    and moe.py's shapes as (out, in) (an expert's stored (in, out) stack is orthogonalised as its Linear)."""
    d, H = m.dim, m.n_heads
    out = []
    lat = m.latent
    if lat.kv_lora_rank:  # MLA: wq_a, wq_b (or wq), wkv_a, wkv_b, wo
        qk, rope = lat.qk_nope_head_dim + lat.qk_rope_head_dim, lat.qk_rope_head_dim
        if lat.q_lora_rank:
            out += [MuonMatrix((lat.q_lora_rank, d), 1, "whole"), MuonMatrix((H * qk, lat.q_lora_rank), 1, "tp")]
        else:
            out.append(MuonMatrix((H * qk, d), 1, "tp"))
        out += [MuonMatrix((lat.kv_lora_rank + rope, d), 1, "whole"),
                MuonMatrix((H * (lat.qk_nope_head_dim + lat.v_head_dim), lat.kv_lora_rank), 1, "tp"),
                MuonMatrix((d, H * lat.v_head_dim), 1, "tp")]
    else:  # wq, wk, wv, wo
        hd, K = head_dim(m), m.n_kv_heads
        out += [MuonMatrix((H * hd, d), 1, "tp"), MuonMatrix((K * hd, d), 2, "tp"), MuonMatrix((d, H * hd), 1, "tp")]
    if m.moe.n_experts and layer >= m.moe.first_dense_layers:
        h, E, shared = m.moe.ffn_dim or m.ffn_dim, m.moe.n_experts, m.moe.n_shared_experts
        if shared:  # one SwiGLU of width h x n_shared, whole on every tp rank
            out += [MuonMatrix((h * shared, d), 2, "whole"), MuonMatrix((d, h * shared), 1, "whole")]
        return [*out, MuonMatrix((h, d), 2 * E, "expert"), MuonMatrix((d, h), E, "expert")]  # gate, up; down
    return [*out, MuonMatrix((m.ffn_dim, d), 2, "tp"), MuonMatrix((d, m.ffn_dim), 1, "tp")]  # gate, up; down


def rank_matrices(cfg: Config, share: RankShare) -> list[MuonMatrix]:
    """The Muon matrices of one pipeline rank's blocks, whole (before any cut), with each MTP depth's
    eh_proj (2d -> d); under LoRA its adapters' instead (the frozen base has none); [] unless optim.name
    is "muon"."""
    m = cfg.model
    if cfg.optim.name != "muon":
        return []
    if cfg.lora.rank:
        return adapter_matrices(cfg, share)
    out = [mm for b in share.blocks for mm in block_matrices(m, b)]
    depths = sum(1 for b in share.blocks if b >= m.n_layers)
    return out + ([MuonMatrix((m.dim, 2 * m.dim), depths, "whole")] if depths else [])


def adapter_matrices(cfg: Config, share: RankShare) -> list[MuonMatrix]:
    """LoRA's A (r, in) and B (out, r) of the rank's adapted layers (planner/lora.py), cut as
    parallel/tensor.py cuts them: a column layer's B split over tp and its A whole, a row layer's A
    split and its B whole (the whole factor on every tp rank, a replica there)."""
    r, out = cfg.lora.rank, []
    for a in rank_adapters(cfg, share):
        i, o = a.shape
        a_cut, b_cut = {"column": ("whole", "tp"), "row": ("tp", "whole"), "whole": ("whole", "whole")}[a.cut]
        out += [MuonMatrix((r, i), 1, a_cut), MuonMatrix((o, r), 1, b_cut)]
    return out


@dataclass(frozen=True)
class MuonShare:
    """Muon's elements on one rank of a pipeline rank, by cut: its slices of the tp matrices, the whole
    matrices, and its E / ep experts' (before ZeRO shards any of them)."""

    tp: int
    whole: int
    experts: int

    @property
    def total(self) -> int:
        return self.tp + self.whole + self.experts


def muon_share(cfg: Config, share: RankShare) -> MuonShare:
    p = cfg.parallel
    by_cut = {"tp": 0, "whole": 0, "expert": 0}
    for mm in rank_matrices(cfg, share):
        by_cut[mm.cut] += mm.numel
    return MuonShare(by_cut["tp"] // p.tp, by_cut["whole"], by_cut["expert"] // p.ep)


def experts_apart(cfg: Config) -> bool:
    """Whether ZeRO shards the routed experts over expert_dp apart from the rest (memory.state_parts)."""
    return cfg.parallel.ep > 1 and cfg.parallel.zero > 0


def state_elements(cfg: Config, share: RankShare) -> tuple[int, int]:
    """Muon's elements in memory.state_parts' dense part and in its expert part (sharded over expert_dp)."""
    s = muon_share(cfg, share)
    return (s.tp + s.whole, s.experts) if experts_apart(cfg) else (s.total, 0)


def expert_dp(cfg: Config, d: Derived) -> int:
    """Ranks holding the same experts, where ZeRO shards them with ep > 1 (dp x cp / ep)."""
    return d.dp * cfg.parallel.cp // cfg.parallel.ep


def stage_pieces(cfg: Config, d: Derived, share: RankShare) -> list[tuple[str, int, float]]:
    """The gather's stages on one rank as (axis, ranks, bf16 bytes of the pieces it holds there); the
    return moves the same bytes back (module docstring)."""
    p, s = cfg.parallel, muon_share(cfg, share)
    if not s.total:
        return []
    zero = p.zero > 0
    out = []
    if zero:
        out.append(("dp", d.dp_shard, WIRE_BYTES * (s.tp + s.whole) / d.dp_shard))
        if p.ep > 1:
            out.append(("dp", expert_dp(cfg, d), WIRE_BYTES * s.experts / expert_dp(cfg, d)))
    out.append(("tp", p.tp, WIRE_BYTES * s.tp / (d.dp_shard if zero else 1)))
    return [(axis, n, nbytes) for axis, n, nbytes in out if n > 1 and nbytes > 0]


def owners(cfg: Config, d: Derived, cut: Cut) -> int:
    """Ranks that share a matrix's NS work (module docstring): its owner grid."""
    p = cfg.parallel
    if not p.zero:
        return p.tp if cut == "tp" else 1
    return {"tp": p.tp * d.dp_shard, "whole": d.dp_shard,
            "expert": expert_dp(cfg, d) if p.ep > 1 else d.dp_shard}[cut]


def rank_ns_flops(cfg: Config, d: Derived, share: RankShare) -> float:
    """NS5 FLOPs one rank runs a step: its pipeline rank's matrices (its E / ep experts) over their owners."""
    steps, ep = cfg.optim.muon.ns_steps, cfg.parallel.ep
    return sum(ns_flops(mm.shape, steps) * (mm.count / ep if mm.cut == "expert" else mm.count) / owners(cfg, d, mm.cut)
               for mm in rank_matrices(cfg, share))


def ns_working_bytes(cfg: Config, share: RankShare) -> tuple[tuple[int, int], float]:
    """The largest matrix and NS5's working set on it at its peak (parallel/muon.py newton_schulz): the
    gathered bf16 matrix, its bf16 copy and the next iterate (3 m n), the Gram A and b A + c A^2 (2 m^2)."""
    shapes = [mm.shape for mm in rank_matrices(cfg, share)]
    if not shapes:
        return (0, 0), 0.0
    shape = max(shapes, key=lambda s: s[0] * s[1])
    m, n = min(shape), max(shape)
    return shape, WIRE_BYTES * (3 * m * n + 2 * m * m)
