"""Each head's largest pre-softmax logit, taken tile by tile beside the blockwise path's kernels:
what MuonClip's QK-clip reads (optim.qk_clip; parallel/qk_clip.py).

The fused kernels give each query row's log-sum-exp, which bounds the largest logit from above
(by up to log T), not the logit itself. So where a layer records (AttentionMask.logit_max), each
tile the plan computes is multiplied once more, q k^T x scale in fp32 under the tile's mask, and
its maximum raises the running one: one more QK^T per computed tile in forward (half the forward's
attention FLOPs again), nothing in backward. Ring attention runs the same tiles over the blocks
that pass by, so a rank's maximum covers its queries against every key; ranks holding other
queries of the same heads are combined by qk_clip's all-reduce.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def raise_logit_max(logit_max: torch.Tensor, q: torch.Tensor, k: torch.Tensor, causal: bool,
                    bias: torch.Tensor | None, scale: float) -> None:
    """Fold one tile's largest logit per head into `logit_max` (H,), fp32, in place: q (B, H, tq, D),
    k (B, K, tk, D) in the kernels' dtype, kept below the diagonal when `causal` (a square tile on it),
    `bias` (B, 1, tq, tk) 0 / -inf for a masked tile."""
    heads = q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)  # (B, H, tk, D): query head h reads K/V head h // G
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, H, tq, tk)
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    if bias is not None:
        scores = scores + bias.float()
    torch.maximum(logit_max, scores.amax(dim=(0, 2, 3)), out=logit_max)
