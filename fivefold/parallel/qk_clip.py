"""QK-clip (MuonClip, Kimi K2 report, Kimi Team 2025, sec. 2.1): after each optimizer step, every
attention head whose largest pre-softmax logit in the step exceeded tau has its query and key
projections scaled down so that the logit would have been tau.

For head h with largest logit S_h > tau, gamma_h = tau / S_h, and the logit q_h . k_h is bilinear in
the two projections, so:
- multi-head attention: W_q's rows of head h and W_k's rows of head h each x sqrt(gamma_h);
- grouped-query attention: a key head serves several query heads, each with its own gamma: the
  query takes all of it, W_q's rows of head h x gamma_h (as K2's MLA does for its shared rotary key);
- latent attention: the per-head no-RoPE parts, W_qb's (or W_q's) Dn rows of head h and W_kvb's Dn
  key rows of head h, x sqrt(gamma_h); the query's RoPE part x gamma_h; the shared rotary key
  (in W_kva) is left alone, as K2 leaves it.
Biases of those rows (Qwen2's) scale with them. A QK-norm would undo the scaling; validate refuses it.

Where: the rows the optimizer steps (dp.optimizer_params(): the parameters under DDP, ZeRO's fp32
masters), before data parallel regathers the parameters from them, so every layout clips the same
weights. The largest logits come from the blockwise path's tiles (model/logit_max.py), this rank's
heads (tp splits heads) over its queries; the ranks holding the same heads of the same layer are the
grad view (dp x cp: other samples, other tokens), where one all-reduce of every layer's maxima takes
the max.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from fivefold.model.attention import Attention, LatentAttention
from fivefold.parallel.comm import collectives
from fivefold.parallel.mesh import Mesh


class QKClip:
    """QK-clip at `tau` over this rank's attention layers: each layer records its heads' largest logits
    during the step (`logit_max`), and `clip` rescales after the optimizer has stepped."""

    def __init__(self, model: nn.Module, dp: object, mesh: Mesh, tau: float):
        self.tau, self.group = tau, mesh.group("grad")
        self.layers = [m for m in model.modules() if isinstance(m, (Attention, LatentAttention))]
        device = next(model.parameters()).device
        for layer in self.layers:
            layer.logit_max = torch.full((_heads(layer),), -math.inf, device=device)  # (H this rank holds,)
        self.stepped = dict(zip((id(p) for p in dp.params), dp.optimizer_params(), strict=True))
        self.shards = getattr(dp, "shards", None)
        self.last: dict[str, torch.Tensor] = {}  # the last clip's largest logit and heads clipped, 0-dim

    @torch.no_grad()
    def clip(self) -> None:
        """Rescale the heads whose largest logit passed tau, on the tensors the optimizer steps; then
        start the next step's maxima. Collective over the grad view."""
        if not self.layers:
            return
        maxima = torch.stack([layer.logit_max for layer in self.layers])  # (L, H)
        collectives.all_reduce(maxima, self.group, op=dist.ReduceOp.MAX)
        gamma = (self.tau / maxima).clamp(max=1.0).where(maxima > self.tau, 1.0)  # (L, H)
        for layer, g in zip(self.layers, gamma, strict=True):
            self._scale(layer, g)  # by 1 where no head passed tau
        self.reset()
        # on the device: the step record reads them after the step's one read (train/step.py)
        self.last = {"max_logit": maxima.max(), "clipped_heads": (gamma < 1).sum()}

    def reset(self) -> None:
        """Start the next step's maxima (after a clip, or a skipped step)."""
        for layer in self.layers:
            layer.logit_max.fill_(-math.inf)

    def _scale(self, layer: nn.Module, gamma: torch.Tensor) -> None:
        root = gamma.sqrt()
        if isinstance(layer, LatentAttention):
            q_rows = torch.cat([root[:, None].expand(-1, layer.nope), gamma[:, None].expand(-1, layer.rope)], 1)
            self._scale_rows(layer.wq if layer.wq_a is None else layer.wq_b, q_rows.reshape(-1))  # (H (Dn + Dr),)
            k_rows = torch.cat([root[:, None].expand(-1, layer.nope), torch.ones_like(root)[:, None].expand(
                -1, layer.v_dim)], 1)
            self._scale_rows(layer.wkv_b, k_rows.reshape(-1))  # (H (Dn + Dv),): the values' rows stay
            return
        heads, kv_heads = gamma.numel(), layer.wk.weight.shape[0] // layer.head_dim
        if kv_heads == heads:  # multi-head: the two projections share the scaling
            self._scale_rows(layer.wq, root.repeat_interleave(layer.head_dim))
            self._scale_rows(layer.wk, root.repeat_interleave(layer.head_dim))
        else:  # grouped: the query takes it all
            self._scale_rows(layer.wq, gamma.repeat_interleave(layer.head_dim))

    def _scale_rows(self, linear: nn.Module, factor: torch.Tensor) -> None:
        """Multiply the output rows of `linear` (this rank's tp slice) by `factor` (rows,), weight and bias,
        on the tensors the optimizer steps: the parameters, or ZeRO's master rows of them."""
        for p in (linear.weight, linear.bias):
            if p is None:
                continue
            t = self.stepped[id(p)]
            if self.shards is None:
                t.mul_(factor.view(-1, *[1] * (t.ndim - 1)).to(t.dtype))
                continue
            c, zd = self.shards.rows[id(p)], self.shards.zero_dims[id(p)]
            if zd == 1:  # the master is (in rows, out): the output rows are its columns
                t.mul_(factor[None, :].to(t.dtype))
                continue
            r = self.shards.group_of(p).rank
            mine = torch.nn.functional.pad(factor, (0, c * self.shards.group_of(p).size - factor.numel()), value=1.0)
            t.mul_(mine[r * c:(r + 1) * c].view(-1, *[1] * (t.ndim - 1)).to(t.dtype))


def _heads(layer: nn.Module) -> int:
    """The query heads a layer holds on this rank (tp splits them)."""
    if isinstance(layer, LatentAttention):
        return (layer.wq if layer.wq_a is None else layer.wq_b).weight.shape[0] // (layer.nope + layer.rope)
    return layer.wq.weight.shape[0] // layer.head_dim
