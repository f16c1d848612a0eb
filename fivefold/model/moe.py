"""Mixture-of-experts feed-forward blocks, free of any parallelism: routing, the experts, the local dispatch.

`MoE` routes each token to top-k of E gated experts (`GroupedExperts`, stacked so expert parallel
shards them along dim 0), plus optional always-on shared experts. Its dispatch is a callable
attribute: `local_dispatch` runs every expert in this process; expert parallel swaps in an
all-to-all (parallel/expert.py). Balance losses, capacity dropping and the step's routing counts
are here too.

Shapes: N tokens (B T flattened), E experts, k experts per token.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.model.config import MoEConfig
from fivefold.model.ffn import FeedForward, gated

# Rows of each group a grouped matmul runs: every expert's rows are padded with zero rows to a multiple
# of this, and an expert with none gets one whole group of zero rows. CUDA's grouped GEMM computes the
# weight gradient dW_e = x_e^T dy_e contracting over a group's rows, which its kernel needs in whole
# 16-byte multiples (8 bf16 rows), and an empty group can hang the backward (pytorch/pytorch#152668);
# torchtitan pads the same way, to 8 rows in bf16. FP8 grouped GEMMs would need 16, but fivefold's FP8
# never reaches the routed experts (parallel/fp8.py): they run bf16, so 8. The planner prices the same
# padding (planner/machine/ops.py GROUP_ROWS, tests/planner/test_planner_roofline.py checks they agree).
GROUP_ROWS = 8


def grouped_dtype(x: torch.Tensor, dim: int, hidden: int) -> torch.dtype | None:
    """bf16 when the experts' matmuls run as one grouped matmul (`torch._grouped_mm`), None for the
    loop: it needs a torch that has it, bf16 compute (autocast's dtype, or bf16 inputs: on CUDA it
    takes bf16 only) and rows of whole 16-byte multiples (dim and hidden multiples of 8). It runs on
    the CPU too (torch 2.13), equal to the loop there (tests/model/test_model.py)."""
    if not hasattr(torch, "_grouped_mm") or dim % 8 or hidden % 8:
        return None
    kind = x.device.type
    autocasting = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
    dtype = torch.get_autocast_dtype(kind) if autocasting else x.dtype
    return dtype if dtype == torch.bfloat16 else None


def _padded_rows(rows: int, n_experts: int) -> int:
    """Rows of the padded buffer for `rows` rows over `n_experts` groups, from shapes alone (no host
    read): each group pads by at most GROUP_ROWS - 1 rows, an empty one by GROUP_ROWS, so
    round_up(rows, GROUP_ROWS) + GROUP_ROWS x n_experts always holds them; the last group absorbs
    what is left, so the groups cover every row the matmul writes."""
    return -(-rows // GROUP_ROWS) * GROUP_ROWS + GROUP_ROWS * n_experts


def padded_groups(counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where `rows` rows sorted by expert go in a zero-padded buffer of _padded_rows(rows, E) rows
    whose groups are all whole multiples of GROUP_ROWS, none empty; computed on the device.

    counts (E,) summing to `rows` -> dest (rows,) each row's row in the buffer, and ends (E,) int32
    one past each group's last buffer row (torch._grouped_mm's offs), the last the buffer's end."""
    groups = ((counts + GROUP_ROWS - 1) // GROUP_ROWS).clamp(min=1) * GROUP_ROWS  # (E,) padded, never empty
    ends = torch.cumsum(groups, 0)  # (E,)
    ends[-1] = _padded_rows(rows, len(counts))  # the last group takes the buffer's tail (zero rows)
    shift = (ends - groups) - (torch.cumsum(counts, 0) - counts)  # (E,) buffer start - start in x, per expert
    dest = torch.arange(rows, device=counts.device) + shift.repeat_interleave(counts, output_size=rows)  # (rows,)
    return dest, ends.to(torch.int32)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """One grouped matmul, x cast to the weights' dtype here: each matmul its own cast, as autocast
    casts the loop's, so the gate's and up's input gradients are summed in x's dtype as the loop's are."""
    return torch._grouped_mm(x.to(w.dtype), w, offs=offs)


class GroupedExperts(nn.Module):
    """E gated experts (SwiGLU, GeGLU or gpt-oss's clamped SwiGLU: ffn.gated) stored as stacked weights,
    so expert parallel shards them along dim 0. With `bias` (gpt-oss) each projection has a bias per
    expert, stacked the same way: gate_bias, up_bias (E, hidden) and down_bias (E, dim)."""

    def __init__(self, n_experts: int, dim: int, hidden: int, bias: bool = False, activation: str = "silu",
                 limit: float = 0.0):
        super().__init__()
        self.activation, self.limit = activation, limit
        self.gate = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.up = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.down = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.gate_bias = nn.Parameter(torch.empty(n_experts, hidden)) if bias else None
        self.up_bias = nn.Parameter(torch.empty(n_experts, hidden)) if bias else None
        self.down_bias = nn.Parameter(torch.empty(n_experts, dim)) if bias else None
        for b in (self.gate_bias, self.up_bias, self.down_bias):
            if b is not None:  # biases, though 2-D (stacked): no weight decay (parallel/optimizer.py)
                b.no_decay = True

    def grouped(self, x: torch.Tensor) -> bool:
        """Whether forward runs one grouped matmul per weight (no host numbers needed) on x."""
        return grouped_dtype(x, *self.gate.shape[1:]) is not None

    def forward(self, x: torch.Tensor, counts: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """x (N, dim) sorted by expert, counts (E,) rows for each local expert on x's device -> (N, dim).
        `sizes`: the same counts read to the host already (the loop needs them; read here if not given).

        Both paths run the same unit (`_unit`) on the same rows: one grouped matmul per weight on the
        rows padded per expert (`padded_groups`), with each row's bias looked up, or expert by expert
        with that expert's bias; the same numbers either way."""
        dtype = grouped_dtype(x, *self.gate.shape[1:])
        biases = (self.gate_bias, self.up_bias, self.down_bias)
        if dtype is not None:
            dest, ends = padded_groups(counts, x.shape[0])  # (N,), (E,)
            # zero rows between the groups, filled in place (no copy of the zeros); index_copy_'s backward
            # gathers dx back from the padded rows
            padded = x.new_zeros(_padded_rows(x.shape[0], len(counts)), x.shape[1]).index_copy_(0, dest, x)  # (P, dim)
            weights = [w.to(dtype) for w in (self.gate, self.up, self.down)]
            row_biases = (None,) * 3
            if self.gate_bias is not None:
                # torch._grouped_mm takes no bias: each padded row's expert, from the group ends on the
                # device (no host read), looks its bias up; an embedding, whose backward sums each
                # expert's rows (deterministically on CUDA, unlike index_add); zero rows add zero gradients
                sizes_padded = torch.diff(ends, prepend=ends.new_zeros(1))  # (E,)
                expert_of_row = torch.arange(len(counts), device=x.device).repeat_interleave(
                    sizes_padded, output_size=padded.shape[0])  # (P,)
                row_biases = tuple(F.embedding(expert_of_row, b) for b in biases)  # (P, hidden), (P, hidden), (P, dim)
            y = self._unit(padded, *weights, *row_biases, matmul=partial(_grouped_mm, offs=ends))  # (P, dim)
            # (N, dim): the zero rows' outputs dropped; the backward adds each row's gradient once into
            # zeros (distinct rows: exact in any order, on CUDA too)
            return y.index_select(0, dest)
        sizes = counts.tolist() if sizes is None else sizes
        # unbind once: its backward stacks the experts' gradients in one pass, where indexing
        # self.gate[e] per expert would write a zero-filled gradient of the whole stack for each
        stacks = [t.unbind(0) if t is not None else (None,) * len(sizes)
                  for t in (self.gate, self.up, self.down, *biases)]
        outs = [self._unit(chunk, *per_expert, matmul=torch.matmul)
                for chunk, *per_expert in zip(torch.split(x, sizes), *stacks, strict=True)]
        return torch.cat(outs) if outs else x[:0]

    def _unit(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
              gate_bias: torch.Tensor | None, up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
              matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The gated unit on rows x (n, dim) -> (n, dim); biases (w,) or one per row (n, w), added in the
        product's dtype (as nn.Linear's bias under autocast). A (w,) bias is expanded to the rows before
        its cast, so its gradient is summed over the rows in the bias's own dtype (fp32), as the grouped
        path's per-row lookup sums it, not in the product's (bf16)."""
        def biased(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return y if bias is None else y + bias.expand_as(y).to(y.dtype)

        h = gated(biased(matmul(x, gate), gate_bias), biased(matmul(x, up), up_bias), self.activation,
                  self.limit)  # (n, hidden)
        return biased(matmul(h, down), down_bias)  # (n, dim)


def histogram(values: torch.Tensor, bins: int) -> torch.Tensor:
    """Occurrences of 0..bins-1 in `values` (int64, (bins,)). Not torch.bincount: on CUDA that reads
    the largest value to the host (its output size depends on it)."""
    return torch.zeros(bins, dtype=torch.long, device=values.device).index_add_(0, values, torch.ones_like(values))


def sort_by_expert(experts_idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of the token copies grouped by expert, and the copies each expert gets.

    experts_idx (N, k) with -1 for a copy dropped over capacity -> order (N k,) indices into the
    flattened (N k) copies, the dropped ones first, and counts (1 + E,): slot 0 counts the dropped
    (so order[counts[0]:] are the kept copies), slot 1 + e expert e's. Stable, so inside one expert
    the copies keep token order: the all-to-all of expert parallel relies on that to reproduce one
    process's rows exactly. Nothing is read to the host.
    """
    flat_idx = experts_idx.reshape(-1)  # (N k,)
    order = torch.argsort(flat_idx, stable=True)  # dropped copies (-1) sort first
    return order, histogram(flat_idx + 1, n_experts + 1)


def local_dispatch(x: torch.Tensor, weights: torch.Tensor, experts_idx: torch.Tensor,
                   experts: GroupedExperts, drops: bool = True) -> torch.Tensor:
    """Send each token's copies to its experts and sum the weighted results, all in this process.

    x (N, dim), weights and experts_idx (N, k) -> (N, dim); an index of -1 is a dropped copy, which
    only `drops` (capacity dropping on) allows. Expert parallel replaces this with an all-to-all that
    sends the same sorted rows to the ranks owning the experts. Host reads: none when nothing can
    be dropped and the experts run grouped; else one, of every count at once.
    """
    order, counts = sort_by_expert(experts_idx, experts.gate.shape[0])  # (N k,), (1 + E,)
    sizes = None
    if drops or not experts.grouped(x):
        dropped, *sizes = counts.tolist()  # the layer's one read
        order = order[dropped:]  # (M,) the kept copies
    token_of_copy = order // experts_idx.shape[1]  # (M,) source token of each sorted copy
    y = experts(x[token_of_copy], counts[1:], sizes)  # (M, dim)
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return y.new_zeros(x.shape).index_add_(0, token_of_copy, y)  # (N, dim)


def sequence_balance_loss(scores: torch.Tensor, idx: torch.Tensor,
                          reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (technical report, eqs. 17-20) per sequence, without alpha.

    scores (S, T, E) router affinities, idx (S, T, k) the selected experts -> (S,):
      L = sum_i f_i P_i,  f_i = E / (k T) x #{t : token t selected expert i},
      P_i = 1/T sum_t s'_it,  s'_it = s_it / sum_j s_jt.
    f counts the experts actually selected (with the balancing bias, when there is one: the load
    that must be balanced; equal to the paper's TopK(s) when the bias is zero) and carries no
    gradient; P does. `reduce` sums per-sequence counts (S, E) over ranks that hold other tokens of
    the same sequences (context parallel; sequence parallel's tp ranks); each rank then returns its
    tokens' share of L, and the shares add up to the whole sequence's loss. T is the whole
    sequence's length, read from the counts.
    """
    n_seq, _, n_experts = scores.shape
    k = idx.shape[-1]
    counts = scores.new_zeros(n_seq, n_experts).scatter_add_(
        1, idx.reshape(n_seq, -1), scores.new_ones(idx.reshape(n_seq, -1).shape))  # (S, E)
    if reduce is not None:
        counts = reduce(counts)
    tokens = counts.sum(-1, keepdim=True) / k  # (S, 1): T of the whole sequence
    f = counts * (n_experts / k) / tokens  # (S, E)
    p = (scores / scores.sum(-1, keepdim=True)).sum(1) / tokens  # (S, E), this rank's part of P
    return (f.detach() * p).sum(-1)  # (S,)


def drop_over_capacity(idx: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """idx (N, k) -> the same with -1 for every copy past an expert's first `capacity` copies.

    Copies queue in token order (token t's k copies before token t+1's), so which ones are dropped
    depends on positions only: deterministic, and the same however often forward is recomputed.
    """
    order, counts = sort_by_expert(idx, n_experts)  # (N k,), (1 + E,): nothing dropped yet, slot 0 is 0
    counts = counts[1:]  # (E,)
    first = torch.cumsum(counts, 0) - counts  # (E,) where each expert's run starts in `order`
    flat = idx.reshape(-1)
    place = torch.empty_like(flat)
    place[order] = torch.arange(order.numel(), device=idx.device) - first[flat[order]]  # (N k,) place in its queue
    return flat.masked_fill(place >= capacity, -1).view_as(idx)


class _StepTally(torch.autograd.Function):
    """Identity on the MoE output, whose backward does what must happen once per trained token.

    - Adds this forward's routing statistics to the step's totals. Counting here rather than in
      forward makes evaluation (no backward) count nothing, and activation recomputation (a
      second forward, whose graph is never run backward) count once; a split backward (zero-
      bubble pipelines run it twice over a kept graph) is caught by the flag on ctx.
    - Injects the balance loss: its gradient is `aux_grad` whatever the main loss is, so the loss
      needs no extra term (with pipeline parallel only the last stage holds the loss).
    """

    @staticmethod
    def forward(ctx, out, aux, moe, load, dropped, aux_grad):
        ctx.moe, ctx.load, ctx.dropped, ctx.counted = moe, load, dropped, False
        ctx.aux = None if aux is None else aux.detach()
        ctx.aux_grad = aux_grad
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.counted:
            ctx.counted = True
            ctx.moe.step_load += ctx.load
            ctx.moe.step_dropped += ctx.dropped
            if ctx.aux is not None:
                ctx.moe.step_balance_loss += ctx.aux
        aux_grad = None if ctx.aux is None else torch.full_like(ctx.aux, ctx.aux_grad)
        return grad, aux_grad, None, None, None, None


class MoE(nn.Module):
    """Top-k routed experts plus optional always-on shared experts (Shazeer 2017; DeepSeekMoE 2024).

    Routing (model/config.py's MoEConfig): softmax or sigmoid scores, optionally group-limited (`select`),
    the top-k weights renormalised (norm_topk) and multiplied by routed_scale (DeepSeek-V3: 2.5, the
    routed experts' output only; the shared experts' is not scaled). With linear_bias the router's
    logits have a bias (gpt-oss: softmax over the top-k logits, which is softmax, top-k and
    renormalise: router_score "softmax" with norm_topk).
    Load balancing (all off by default, then the math is the plain top-k MoE):
    - `expert_bias` (E,): added to the scores to choose the top-k, never to the gate weights
      (DeepSeek-V3 sec. 2.1.2, auxiliary-loss-free); the training loop moves it after each step
      (fivefold.parallel.expert.update_expert_bias). A state-dict entry only when the update is on.
    - `aux_weight` (alpha): the sequence-wise balance loss enters backward through _StepTally,
      scaled by alpha x loss_scale / step_sequences, so summed over every micro-batch and rank it
      is alpha x the mean over the step's sequences. step_sequences = 0 means this forward's own
      sequences (a single call); the loop sets both per step (expert.set_balance_loss_scale).
    - `capacity_factor` (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): an expert takes
      at most ceil(cf x N k / E) of the N k copies of a call's N tokens; the rest are dropped
      (their tokens keep the residual only) and counted.
    Per-step totals (buffers, not saved): step_load (E,) copies selected per expert, step_dropped,
    step_balance_loss (sum over sequences of L without alpha).
    """

    def __init__(self, moe: MoEConfig, dim: int, ffn_dim: int, activation: str = "silu"):
        """The [model.moe] table `moe` over a residual stream of width `dim`; the experts' hidden width is
        moe.ffn_dim, or the model's dense `ffn_dim` when that is 0; `activation` as the dense FFN's."""
        super().__init__()
        hidden = moe.ffn_dim or ffn_dim
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        self.score, self.norm_topk = moe.router_score, moe.norm_topk
        self.n_groups, self.topk_groups, self.routed_scale = moe.n_groups, moe.topk_groups, moe.routed_scale
        self.router = nn.Linear(dim, moe.n_experts, bias=moe.linear_bias)
        self.experts = GroupedExperts(moe.n_experts, dim, hidden, moe.linear_bias, activation, moe.swiglu_limit)
        self.shared = FeedForward(dim, hidden * moe.n_shared_experts, activation) if moe.n_shared_experts else None
        self.dispatch: Callable[..., torch.Tensor] = local_dispatch
        self.register_buffer("expert_bias", torch.zeros(moe.n_experts), persistent=moe.bias_update > 0)
        self.aux_weight, self.capacity_factor = moe.aux_loss, moe.capacity_factor
        self.step_sequences, self.loss_scale = 0, 1.0
        # Sums per-sequence expert counts over the ranks sharing those sequences (context parallel,
        # and tensor parallel's ranks under sequence parallel).
        self.sequence_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.register_buffer("step_load", torch.zeros(moe.n_experts, dtype=torch.long), persistent=False)
        self.register_buffer("step_dropped", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("step_balance_loss", torch.zeros((), dtype=torch.float64), persistent=False)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, dim) -> router affinities (N, E)."""
        logits = self.router(x).float()  # (N, E)
        return logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()

    def select(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """scores (N, E) -> top-k gate weights (N, k) and expert indices (N, k).

        Group-limited (DeepSeek-V3 sec. 2.1.2, "node-limited routing"; DeepSeek-V2 sec. 2.2.2): the
        E experts form G groups of E/G; a group's score is the sum of its two highest (biased)
        scores, each token keeps its topk_groups best groups and picks its top-k experts in them.
        """
        biased = scores + self.expert_bias  # (N, E): the bias only chooses
        if self.n_groups > 1:
            grouped = biased.view(biased.shape[0], self.n_groups, -1)  # (N, G, E/G)
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_groups, dim=-1).indices  # (N, topk_groups)
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)  # (N, G)
            biased = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)  # (N, E)
        idx = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, idx)  # (N, k) unbiased
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.routed_scale, idx

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, dim) -> top-k weights (N, k) and expert indices (N, k)."""
        return self.select(self.scores(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, dim = x.shape
        flat = x.reshape(-1, dim)  # (B T, dim)
        scores = self.scores(flat)  # (B T, E)
        weights, idx = self.select(scores)
        training = torch.is_grad_enabled()  # evaluation neither counts nor adds the balance loss
        if training:
            load = histogram(idx.reshape(-1), self.n_experts)  # (E,) what the router chose
            aux = None
            if self.aux_weight > 0:
                aux = sequence_balance_loss(scores.view(B, T, -1), idx.view(B, T, -1), self.sequence_reduce).sum()
        if self.capacity_factor > 0:
            idx = drop_over_capacity(idx, self.n_experts,
                                     math.ceil(self.capacity_factor * idx.numel() / self.n_experts))
        out = self.dispatch(flat, weights, idx, self.experts, drops=self.capacity_factor > 0)
        if self.shared is not None:
            out = out + self.shared(flat)
        if training and out.requires_grad:
            aux_grad = self.aux_weight * self.loss_scale / (self.step_sequences or B)
            out = _StepTally.apply(out, aux, self, load, (idx < 0).sum(), aux_grad)
        return out.view(B, T, dim)
