"""The compute of one micro-batch on one pipeline chunk, in FLOPs, on the busiest rank.

Forward FLOPs of a block (counts.block_forward_flops, which the pipeline's stage split balances
too) are 2 per multiply-add of each matmul weight a token goes through
(counts.BlockParams.active_matmul: attention projections, a dense SwiGLU or the router, shared and
top_k routed experts) plus the attention core, 2 k H (Dqk + Dv) per token for k keys per query
(QK^T and PV, 2 FLOPs per multiply-add): k = s / 2 for causality alone (the mask halves the
scores; 2 s H hd when both widths are head_dim, MLA's differ), the pairs kept / s under the
block's sliding window or documents of the stated mean length (model/mask_counts.py). Tensor
parallel cuts attention's per-head part and dense MLPs by tp; MLA's down-projections, routed and
shared experts and the router run whole on every tp rank. The last stage adds the head's V x d
matmul (cut by tp over the vocabulary). (The pipeline's stage split, parallel/pipeline/stage_split.py,
still weighs every block's attention as causal.) The hardware's pricer then turns this work
into seconds (datasheet.ComputePricer).
"""

from __future__ import annotations

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.model.counts import (
    ModelCounts,
    attention_head_dims,
    attention_keys,
    block_forward_flops,
    head_forward_flops,
    mtp_attention_keys,
)
from fivefold.planner.layout import RankShare
from fivefold.planner.machine.pricing import ChunkWork
from fivefold.planner.options import DEFAULT, PlanOptions


def chunks_per_rank(cfg: Config) -> int:
    """Model chunks one pipeline rank runs: its virtual stages, two for the V-shaped schedules."""
    p = cfg.parallel
    return p.virtual_stages if p.pp_schedule not in ("zb_v", "dualpipe_v") else 2


def block_keys(cfg: Config, options: PlanOptions = DEFAULT) -> list[float]:
    """Each block's mean keys per query as the step runs it (counts.attention_keys): its window, and
    documents of options.document_tokens when data.document_mask is on."""
    docs = options.document_tokens if cfg.data.document_mask else 0
    m, seq = cfg.model, cfg.train.seq_len
    return attention_keys(m, seq, docs) + mtp_attention_keys(m, seq, docs)  # the MTP depths' blocks: n_layers + k


def busiest_chunk(cfg: Config, d: Derived, counts: ModelCounts, shares: list[RankShare],
                  options: PlanOptions = DEFAULT, act_bytes: int = 2, weight_bytes: float = 4) -> ChunkWork:
    """The work of the pipeline rank with the most forward FLOPs (the first of equals): it sets the pace.
    weight_bytes: a weight element's bytes at rest (or as gathered), which autocast casts from when wider."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tokens = t.micro_batch * d.local_seq_len  # tokens of one micro-batch on one rank
    keys = block_keys(cfg, options)
    attn_fwd = [2 * k * m.n_heads * sum(attention_head_dims(m)) / p.tp for k in keys]  # per token: 2 k H (Dqk + Dv)
    fwd_flops, moe_blocks = [], []
    for s in shares:
        flops = sum(block_forward_flops(m, counts.block(blk), t.seq_len, p.tp, p.sp, keys[blk]) for blk in s.blocks)
        if s.last:  # the head, once for the main tokens and once per MTP depth's, and the depths' eh_proj
            flops += head_forward_flops(counts, p.tp) * (1 + m.mtp_layers)
            flops += m.mtp_layers * 2 * counts.mtp_extra_matmul // (p.tp if p.sp else 1)
        fwd_flops.append(float(flops * tokens))
        moe_blocks.append(sum(1 for blk in s.blocks if counts.block(blk).experts))
    worst = max(range(len(shares)), key=lambda r: fwd_flops[r])
    share = shares[worst]
    return ChunkWork(cfg=cfg, share=share, chunks=chunks_per_rank(cfg), vocab=d.vocab_size, local_seq=d.local_seq_len,
                     moe_blocks=moe_blocks[worst], forward_flops=fwd_flops[worst],
                     attention_forward_flops=sum(attn_fwd[blk] for blk in share.blocks) * tokens, options=options,
                     act_bytes=act_bytes, weight_bytes=weight_bytes,
                     loss_recompute_flops=head_forward_flops(counts, p.tp) * (1 + m.mtp_layers) * tokens
                     if share.last else 0.0)
