"""Muon on the hidden matrices and AdamW on the rest, over any layout, equal to one process.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers"; Liu et al. 2025, "Muon is
Scalable for LLM Training", the Moonlight report) keeps a momentum per weight matrix and steps
along its orthogonalisation: Newton-Schulz iterations push the (Nesterov) momentum's singular
values towards 1. The update here is torch.optim.Muon's, operation for operation (a test holds a
one-process run bit for bit to torch.optim.Muon and torch.optim.AdamW on the same split):

    B <- lerp(B, G, 1 - mu)               momentum (an EMA, as torch keeps it)
    U <- lerp(G, B, mu)                   Nesterov (else U = B)
    O <- NS5(bf16(U))                     5 quintic Newton-Schulz steps in bf16, on the whole matrix
    W <- W (1 - lr wd) - adjusted_lr(lr, shape) O

What takes Muon (`is_muon_matrix`): every 2-D hidden matrix, attention's and latent attention's
projections, the MLPs', MTP's eh_proj, and each expert's matrices, each one its own matrix (the
stacked (E, in, out) tensors are cut per expert, and an expert's matrix is orthogonalised as its
(out, in) Linear weight, so its learning-rate adjustment reads the Linear's shape). AdamW keeps the
embedding, the head, the routers, norms, biases and sinks, as Moonlight and Kimi K2 split them.

Only NS5 needs a whole matrix; everything else is elementwise and runs on whatever piece of a
matrix a rank steps (DDP: its tp slice; ZeRO: its fp32 master rows of that slice). The pieces of
each matrix's U go, in bf16 (the cast NS5 starts with, so exact), to one owner among the ranks
holding them (matrix_owners.py: ZeRO's rows, then tp's slices), which orthogonalises it and sends
each piece of O back. The momentum therefore lives where AdamW's moments do, sharded as the
layout shards them, and is saved as a DTensor of the whole parameter like them: a checkpoint
resumes at any layout.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fivefold.config.schema import OptimConfig
from fivefold.parallel.matrix_owners import Matrix, Split, assign_owners, gather_to_owners, scatter_from_owners

# AdamW's matrices: the embedding and head (a lookup and a classifier, not hidden maps) and the routers.
ADAMW_MATRICES = ("tok_embeddings.weight", "output.weight", "router.weight")
# Keller Jordan's quintic coefficients and step count, torch.optim.Muon's defaults (torch/optim/_muon.py)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
STAGES = ("dp_shard", "expert_dp", "tp")  # the gathers' order, innermost cut first; the return reverses it


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    """Whether Muon steps this parameter: a hidden weight matrix (an expert stack is E of them)."""
    return p.ndim >= 2 and not getattr(p, "no_decay", False) and not name.endswith(ADAMW_MATRICES)


def newton_schulz(update: torch.Tensor, steps: int) -> torch.Tensor:
    """NS5: the (out, in) matrix's orthogonalisation, bf16 (torch.optim.Muon's, step for step): scaled
    to spectral norm <= 1, then `steps` iterations of X <- a X + (b A + c A^2) X with A = X X^T on the
    wide orientation (the smaller Gram matrix)."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(torch.bfloat16, memory_format=torch.contiguous_format, copy=True)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=NS_EPS))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def ns_flops(shape: tuple[int, int], steps: int) -> int:
    """NS5's matmul FLOPs on an (out, in) matrix: per step X X^T, the Gram's square and its product
    with X, with m = the smaller side and n = the larger: 2 m^2 n + 2 m^3 + 2 m^2 n."""
    m, n = min(shape), max(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


def adjusted_lr(lr: float, shape: tuple[int, int], rule: str) -> float:
    """torch.optim.Muon's learning-rate adjustment for an (out, in) matrix: Moonlight's
    "match_rms_adamw", 0.2 sqrt(max(out, in)) (an update with AdamW's RMS of about 0.2), or
    Keller Jordan's "original", sqrt(max(1, out / in))."""
    out, inp = shape
    return lr * (0.2 * math.sqrt(max(out, inp)) if rule == "match_rms_adamw" else math.sqrt(max(1.0, out / inp)))


@dataclass
class Piece:
    """One matrix as one stepped tensor holds it: `view` gives this rank's 2-D piece of it (in the
    matrix's stored orientation) from any tensor shaped like the stepped one (its gradient, momentum,
    the update); `linear`: the matrix is stored (in, out), an expert's, and orthogonalised as (out, in)."""

    matrix: Matrix
    view: Callable[[torch.Tensor], torch.Tensor]
    linear: bool = False


class Muon(torch.optim.Optimizer):
    """Muon over `pieces` (the stepped tensors it owns, each with the matrices it holds pieces of) and
    an AdamW, `adamw`, over the rest; one optimizer to the step, the checkpoints and the schedule:
    its param_groups are Muon's then AdamW's, and both keep their state in one `state`."""

    def __init__(self, pieces: dict[torch.Tensor, list[Piece]], adamw: torch.optim.AdamW, cfg: OptimConfig):
        m = cfg.muon
        lr = m.lr or cfg.lr
        super().__init__([{"params": list(pieces), "kind": "muon", "lr_scale": lr / cfg.lr}],
                         {"lr": lr, "weight_decay": cfg.weight_decay, "momentum": m.momentum, "nesterov": m.nesterov,
                          "ns_steps": m.ns_steps, "adjust_lr": m.adjust_lr})
        self.pieces = pieces
        self.adamw = adamw
        self.adamw.state = self.state  # one state: what init_optimizer_state fills and checkpoints read
        # an empty group (LoRA: every adapter is a matrix, AdamW keeps nothing) would fail torch's
        # state-dict load, which names each group by its first parameter
        adamw.param_groups = [g for g in adamw.param_groups if g["params"]]
        self.param_groups += adamw.param_groups
        assign_owners([pc.matrix for ps in pieces.values() for pc in ps])
        self.flops = 0  # the last step's Newton-Schulz FLOPs on this rank
        self.exchanged_bytes = 0.0  # and the bytes its owners' exchange sent to other ranks

    def __setstate__(self, state: dict) -> None:
        # Optimizer.load_state_dict (DDP's checkpoints load through it) replaces `state` and the
        # groups with new objects: AdamW must step the new ones.
        super().__setstate__(state)
        if "adamw" in self.__dict__:
            self.adamw.state = self.state
            self.adamw.param_groups = self.param_groups[1:]

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        # Fused AdamW (CUDA) skips a non-finite step on the device; Muon's owners exchange pieces
        # first, so the verdict is read here (every rank reads the same global norm).
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            if bool(found_inf):
                return
            self.adamw.found_inf = found_inf
        self.adamw.step()
        group = self.param_groups[0]
        mu, steps = group["momentum"], group["ns_steps"]
        self.flops = 0
        travel: dict[str, torch.Tensor] = {}  # the pieces of the matrices the layout cuts, bf16
        waiting = []  # their tensors: stepped once the results are back
        # Tensor by tensor, so that one fp32 update is alive at a time: a matrix this rank holds whole
        # is orthogonalised and applied at once; a cut one's piece is cast (NS5's first step,
        # elementwise) and waits for the exchange.
        for t in [t for t in self.pieces if t.grad is not None]:
            state = self.state[t]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(t)
            buf = state["momentum_buffer"]
            buf.lerp_(t.grad, 1 - mu)
            update = t.grad.lerp(buf, mu) if group["nesterov"] else buf
            whole = {pc.matrix.name: self._orthogonal(pc, pc.view(update), steps)
                     for pc in self.pieces[t] if not pc.matrix.splits}
            for pc in self.pieces[t]:
                if pc.matrix.splits:
                    travel[pc.matrix.name] = pc.view(update).to(torch.bfloat16)
            if len(whole) == len(self.pieces[t]):
                self._apply(t, whole, group)
            else:
                waiting.append((t, whole))
        results = self._exchange(travel, [pc for t, _ in waiting for pc in self.pieces[t] if pc.matrix.splits],
                                 steps)
        for t, whole in waiting:
            self._apply(t, {**whole, **results}, group)

    def _orthogonal(self, pc: Piece, whole: torch.Tensor, steps: int) -> torch.Tensor:
        """NS5 of one whole matrix, as its Linear (out, in) (an expert's stored (in, out) transposed)."""
        self.flops += ns_flops(pc.matrix.shape, steps)
        return newton_schulz(whole.T, steps).T if pc.linear else newton_schulz(whole, steps)

    def _apply(self, t: torch.Tensor, orthogonal: dict[str, torch.Tensor], group: dict) -> None:
        """Decoupled weight decay, then each matrix's orthogonalised update at its adjusted rate."""
        lr = group["lr"]
        t.mul_(1 - lr * group["weight_decay"])
        for pc in self.pieces[t]:
            shape = pc.matrix.shape[::-1] if pc.linear else pc.matrix.shape
            pc.view(t).add_(orthogonal[pc.matrix.name], alpha=-adjusted_lr(lr, shape, group["adjust_lr"]))

    def _exchange(self, pieces: dict[str, torch.Tensor], cut: list[Piece], steps: int) -> dict[str, torch.Tensor]:
        """The cut matrices' NS5 results, this rank's piece of each: the pieces (bf16) gathered to each
        matrix's owner stage by stage, orthogonalised there, and sent back the way they came."""
        matrices = [pc.matrix for pc in cut]
        stats = next((m.splits[0].group.stats for m in matrices), None)  # the mesh's counters
        sent_before = _wire_bytes(stats)
        shapes: list[dict[str, torch.Size]] = []
        stages = []
        for name in STAGES:
            cuts = [(m, k) for m in matrices for k in _cut_index(m, name) if m.held_after(k)]
            shapes.append({m.name: pieces[m.name].shape for m, _ in cuts})
            stages.append(cuts)
            pieces.update(gather_to_owners(pieces, cuts))
        results = {pc.matrix.name: self._orthogonal(pc, pieces[pc.matrix.name], steps) for pc in cut
                   if pc.matrix.owned()}
        like = next(iter(pieces.values()), None)  # bf16, on the device (a rank may own none of them)
        for cuts, piece_shapes in zip(reversed(stages), reversed(shapes), strict=True):
            results.update(scatter_from_owners(results, cuts, piece_shapes, like))
        self.exchanged_bytes = _wire_bytes(stats) - sent_before
        return results

    def step_counts(self) -> dict[str, float]:
        """The last step's Newton-Schulz FLOPs and exchanged bytes on this rank (the metrics log's "muon")."""
        return {"ns_flops": self.flops, "exchange_bytes": self.exchanged_bytes}


def _wire_bytes(stats: object) -> float:
    """Bytes this rank has sent over every axis so far (CommStats; none without a cut)."""
    return 0.0 if stats is None else sum(c["wire_bytes"] for c in stats.snapshot().values())


def _cut_index(m: Matrix, group_name: str) -> list[int]:
    """The index of m's cut over `group_name` ([] when the layout does not cut it there)."""
    return [k for k, s in enumerate(m.splits) if s.group.name == group_name]


def muon_pieces(dp: object, mesh: object, names: dict[int, str]) -> dict[torch.Tensor, list[Piece]]:
    """For each tensor the optimizer steps whose parameter is a Muon matrix, the matrices it holds
    pieces of and how its piece of each is cut (`Piece`): tp's slice of the whole matrix, then ZeRO's
    rows of that slice (`dp.shards`: the split dim, the rows each rank owns, the group). An expert
    stack (E, in, out) is E matrices; ZeRO splits it along E unless ep has (zero_dims), and then each
    rank holds whole experts, with nothing to gather."""
    shards = getattr(dp, "shards", None)
    tp = mesh.group("tp")
    out: dict[torch.Tensor, list[Piece]] = {}
    for p, stepped in zip(dp.params, dp.optimizer_params(), strict=True):
        name = names[id(p)]
        if not is_muon_matrix(name, p):
            continue
        stack = p.ndim == 3
        local = tuple(p.shape[1:]) if stack else tuple(p.shape)  # (rows, cols) of one matrix on this rank
        zd = None if shards is None else shards.zero_dims[id(p)]  # of p; its master keeps it first
        if stack and zd == 0:  # whole experts [r c, r c + own) on this rank
            first = shards.group_of(p).rank * shards.rows[id(p)]
            out[stepped] = [Piece(Matrix(f"{name}[{first + i}]", local, ()), _viewer(True, i, None), linear=True)
                            for i in range(shards.own_rows(p))]
            continue
        whole = list(local)
        cuts: list[Split] = []
        if hasattr(p, "tp_dim"):
            whole[p.tp_dim] *= tp.size
            cuts.append(Split(tp, p.tp_dim, local[p.tp_dim], whole[p.tp_dim]))
        zero_dim = None
        if zd is not None:
            zero_dim = zd - 1 if stack else zd  # of one matrix
            cuts.append(Split(shards.group_of(p), zero_dim, shards.rows[id(p)], local[zero_dim]))
        out[stepped] = [Piece(Matrix(f"{name}[{e}]" if stack else name, tuple(whole), tuple(cuts)),
                              _viewer(stack, e, zero_dim), linear=stack) for e in range(p.shape[0] if stack else 1)]
    return out


def _viewer(stack: bool, e: int, zero_dim: int | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """How a stepped tensor holds one matrix's piece: DDP steps the parameter, (rows, cols) or an
    expert stack (E, rows, cols); ZeRO its master rows, the split dim moved first (an expert stack's
    rows of its matrices' dim 0, (c, E, cols), or whole experts, (c, rows, cols))."""
    if zero_dim is None:
        return (lambda t: t[e]) if stack else (lambda t: t)
    if stack:
        return lambda t: t[:, e].movedim(0, zero_dim)
    return lambda t: t.movedim(0, zero_dim)


def optimizer_split_note(named: list[tuple[str, torch.Tensor]]) -> str:
    """The split, said at start: which parameters each optimizer takes, by name with the layer
    numbers folded ("layers.*.attn.wq.weight"), and their counts of elements (this rank's stage)."""
    kinds: dict[bool, dict[str, int]] = {True: {}, False: {}}
    for name, p in named:
        key = re.sub(r"\.\d+\.", ".*.", name)
        side = kinds[is_muon_matrix(name, p)]
        side[key] = side.get(key, 0) + p.numel()
    said = [f"{label} on {sum(kinds[m].values()):,} parameters: {', '.join(kinds[m])}"
            for m, label in ((True, "Muon"), (False, "AdamW"))]
    return "optim: " + "; ".join(said)


def build_muon(dp: object, mesh: object, cfg: OptimConfig, adamw_builder: Callable) -> Muon:
    """Muon over dp's stepped tensors whose parameters are hidden matrices, AdamW (`adamw_builder`,
    optimizer.py's rule for decay) over the others."""
    names = {id(p): n for n, p in dp.model.named_parameters()}
    pieces = muon_pieces(dp, mesh, names)
    rest = [t for t in dp.optimizer_params() if t not in pieces]
    return Muon(pieces, adamw_builder(rest, cfg), cfg)
