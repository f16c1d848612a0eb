"""The output head and its loss: hidden states -> each token's cross-entropy, never holding the
logits of more than `chunk` tokens (train.loss_chunk).

The logits of a micro-batch are (tokens, V): for one 8k-token sequence of Llama 3 (V = 128k) 4.2 GB
in fp32, and backward's gradient of them as much again. `token_losses` cuts the tokens into chunks
(Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models", recompute the logits in
backward; Liger's FLCE computes the gradients in forward instead, and holds the head's whole weight
gradient from forward to backward, once per micro-batch in flight on a pipeline's last stage):

- forward, chunk by chunk: logits (c, V) in the compute dtype, upcast to fp32, reduced to each
  token's log-sum-exp and target logit; the chunk's logits are dropped. Kept: the (N,) log-sum-exps.
- backward, chunk by chunk: the logits once more, softmax = exp(z - lse) minus the one-hot target,
  times the tokens' incoming gradients; then the hidden states' gradient (c, dim) and the weight's,
  summed over chunks in fp32. Only those the running backward asks for: a zero-bubble schedule's I
  wants the hidden states' alone and its W the weight's alone (pipeline/split_backward.py; the
  engine says which of the node's edges it will run, as torch.utils.checkpoint asks it).

One extra head matmul (the recomputed logits: 2 N dim V FLOPs, a third of the head's) for memory of
(c, V) instead of (N, V). Every matmul runs in the compute dtype (autocast's, else the weight's): a
chunked loss whose backward fell back to fp32 matmuls is the known way to lose 13x.

Under tensor parallel the head holds V/tp rows of the vocabulary (`VocabSplit`): each rank's chunk
reduces its own columns to a log-sum-exp and (where the target lies there) a target logit, and one
all-gather of those two numbers per token combines them, so backward needs no communication at all.
The same code serves one rank (a split of one, whose gather is a copy).

Per-token losses do not depend on the chunk size: each is its row's own reductions (fp32 runs of the
suite compare them bit for bit). The weight's gradient is a sum over chunks where one matmul summed
over all tokens at once: equal up to the order of an fp32 sum.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100  # targets that count nothing (padding, untrained turns)


def _alone(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(0)


@dataclass(frozen=True)
class VocabSplit:
    """Which vocabulary ids this rank's head rows are, and how per-token values meet the other ranks'.

    start: this rank's first id; limit: ids from here on are padding (a vocabulary padded to divide
    by tp), masked out of the softmax; gather: (2, c) -> (ranks, 2, c), every rank's values in rank
    order (tensor parallel's all-gather; one rank: itself)."""

    start: int = 0
    limit: int | None = None
    gather: Callable[[torch.Tensor], torch.Tensor] = _alone


def compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """What the head's matmuls compute in: autocast's dtype where it is on, else the weight's."""
    kind = h.device.type
    on = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)  # (meta has no autocast)
    return torch.get_autocast_dtype(kind) if on else weight.dtype


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """The head's matmuls take their inputs' dtype as it is (already the compute dtype)."""
    available = torch.amp.is_autocast_available(device.type)
    return torch.autocast(device.type, enabled=False) if available else contextlib.nullcontext()


def _logits(h: torch.Tensor, weight: torch.Tensor, split: VocabSplit) -> torch.Tensor:
    """(c, dim) x (V_local, dim), both in the compute dtype -> fp32 logits (c, V_local), padding -inf."""
    with _no_autocast(h.device):
        z = (h @ weight.T).float()  # (c, V_local)
    v = z.shape[-1]
    if split.limit is not None and split.limit < split.start + v:
        z.masked_fill_(torch.arange(split.start, split.start + v, device=z.device) >= split.limit, float("-inf"))
    return z


def _targets_here(targets: torch.Tensor, split: VocabSplit, v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's column on this rank (0 where it lies elsewhere) and whether it lies here."""
    local = targets - split.start
    here = (targets != IGNORE) & (local >= 0) & (local < v_local)
    return local.masked_fill(~here, 0), here


class ChunkedCrossEntropy(torch.autograd.Function):
    """Hidden (N, dim), head weight (V_local, dim), targets (N,) -> each token's loss (N,), fp32."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, split, dtype):
        n, v_local = h.shape[0], weight.shape[0]
        step = chunk if 0 < chunk < n else max(n, 1)
        w = weight.to(dtype)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)  # (N,)
        losses = torch.zeros(n, dtype=torch.float32, device=h.device)  # (N,)
        for s in range(0, n, step):
            z = _logits(h[s:s + step].to(dtype), w, split)  # (c, V_local): the only logits alive
            idx, here = _targets_here(targets[s:s + step], split, v_local)
            target = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)  # (c,)
            parts = split.gather(torch.stack([torch.logsumexp(z, dim=-1), target]))  # (ranks, 2, c)
            lse[s:s + step] = torch.logsumexp(parts[:, 0], dim=0)
            valid = targets[s:s + step] != IGNORE
            losses[s:s + step] = (lse[s:s + step] - parts[:, 1].sum(dim=0)).masked_fill(~valid, 0.0)
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk, ctx.split, ctx.dtype = step, split, dtype
        return losses

    @staticmethod
    def backward(ctx, grad):
        h, weight, targets, lse = ctx.saved_tensors
        step, split, dtype = ctx.chunk, ctx.split, ctx.dtype
        want_h, want_w = (node is not None and torch._C._will_engine_execute_node(node)
                          for node, _ in ctx.next_functions[:2])
        w = weight.to(dtype)
        grad_h = torch.empty_like(h) if want_h else None  # (N, dim)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for s in range(0, h.shape[0], step):
            hc = h[s:s + step].to(dtype)  # (c, dim)
            z = _logits(hc, w, split)  # (c, V_local), recomputed
            p = z.sub_(lse[s:s + step].unsqueeze(-1)).exp_()  # softmax over the whole vocabulary's sum
            idx, here = _targets_here(targets[s:s + step], split, w.shape[0])
            p.scatter_add_(-1, idx.unsqueeze(-1), -here.unsqueeze(-1).to(p.dtype))  # minus the one-hot
            scale = grad[s:s + step] * (targets[s:s + step] != IGNORE)  # (c,)
            g = p.mul_(scale.unsqueeze(-1)).to(dtype)  # (c, V_local): d loss / d logits
            with _no_autocast(h.device):
                if want_h:
                    grad_h[s:s + step] = g @ w  # (c, dim)
                if want_w:  # (V_local, dim), summed over chunks in fp32 with no weight-sized temporary
                    if dtype == grad_w.dtype:  # in fp32 the product is added inside the matmul
                        grad_w.addmm_(g.T, hc)
                    else:  # the bf16 product, widened as it is added (no fp32 copy of it first)
                        grad_w.add_(g.T @ hc)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def token_losses(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 0,
                 split: VocabSplit = VocabSplit()) -> torch.Tensor:
    """Each token's cross-entropy (..., ) fp32 from hidden states (..., dim) and the head's weight
    (V_local, dim): 0 where the target is IGNORE; `chunk` tokens' logits at a time (0: all at once)."""
    dtype = compute_dtype(h, weight)
    h, weight = _not_leaf(h.reshape(-1, h.shape[-1])), _not_leaf(weight)  # (N, dim), (V_local, dim)
    return ChunkedCrossEntropy.apply(h, weight, targets.reshape(-1), chunk, split, dtype).view(targets.shape)


def _not_leaf(t: torch.Tensor) -> torch.Tensor:
    """A leaf that needs a gradient (a parameter) as a view of itself: the backward asks the engine
    whether it will run each input's node, which it cannot be asked of a leaf's under autograd.grad."""
    return t.view_as(t) if t.requires_grad and t.grad_fn is None else t


class OutputHead(nn.Module):
    """The output projection, hidden (..., dim) -> logits (..., V); given targets, each token's loss
    instead (`token_losses`), which never holds more than `chunk` tokens' logits.

    Its losses come out of the module's forward, not a function beside it: ZeRO-3 gathers the
    head's weight in the hooks of this forward (parallel/data/fsdp.py). Tensor parallel replaces it
    with a VocabParallelHead (parallel/tensor.py), which enters the tp region first and splits the
    vocabulary."""

    split = VocabSplit()

    def __init__(self, dim: int, vocab_size: int):
        super().__init__()
        self.weight = nn.Linear(dim, vocab_size, bias=False).weight  # (V, dim), nn.Linear's init

    def enter(self, h: torch.Tensor) -> torch.Tensor:
        """The hidden states every vocabulary row multiplies (tensor parallel gathers them)."""
        return h

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
        h = self.enter(h)  # (B, T, dim)
        if targets is None:
            return F.linear(h, self.weight)  # (B, T, V)
        return token_losses(h, self.weight, targets, chunk, self.split)  # (B, T)
