"""Parameter and FLOP counts of fivefold's model, by formula, for any shape.

The formula mirrors `model/transformer.py` layer by layer (a test builds every preset on the meta device and
compares), and splits the total the way the parallel code splits the model: what tensor parallel
cuts, what it replicates, what expert parallel cuts, and what lives in the first and last pipeline
stage only (the MTP depths, model.mtp_layers, among the last). Nothing here allocates a tensor,
so a 405B model costs microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fivefold.model.config import ModelConfig
from fivefold.model.mask_counts import keys_per_query

# Attention FLOPs of a causal sequence: "full" counts the whole T x T score matrix (PaLM's and
# Megatron-LM's MFU convention), "half" only the part the mask keeps. Under documents and sliding
# windows both count what the mask keeps, "full" twice over (the causal triangle as its square).
CausalFlops = Literal["half", "full"]


@dataclass(frozen=True)
class BlockParams:
    """Parameters of one transformer block, by how the parallel code treats them."""

    tp_split: int  # attention projections and a dense SwiGLU: cut by tp (parallel/tensor.py TP_PLAN)
    replicated: int  # norms, QK-norm, MLA's down-projections, router and shared experts: whole on every tp rank
    experts: int  # routed experts: cut by ep, replicated over tp (README, expert parallel)
    active_matmul: int  # matmul weights one token goes through (top_k of the routed experts)
    routed_active: int = 0  # of `experts`, the top_k ones one token goes through
    # no matmul's, cut by tp with the heads: q/k/v biases, sinks, q/k norms over the whole projection
    tp_split_other: int = 0

    @property
    def total(self) -> int:
        return self.tp_split + self.tp_split_other + self.replicated + self.experts


@dataclass(frozen=True)
class ModelCounts:
    blocks: list[BlockParams]
    embedding: int  # V x d (first stage); cut by tp over the vocabulary
    head: int  # V x d, 0 when tied (last stage); cut by tp
    final_norm: int  # d (last stage)
    # model.mtp_layers depths of multi-token prediction (last stage): each a block, numbered after the
    # main ones (block_params(m, n_layers + k)), and `mtp_extra` besides it (mtp_extra_params)
    mtp: tuple[BlockParams, ...] = ()
    mtp_extra: int = 0

    @property
    def total(self) -> int:
        return (sum(b.total for b in self.blocks) + self.embedding + self.head + self.final_norm
                + sum(b.total for b in self.mtp) + len(self.mtp) * self.mtp_extra)

    def block(self, i: int) -> BlockParams:
        """Block i in the runtime's numbering: the main blocks, then the MTP depths' (n_layers + k)."""
        n = len(self.blocks)
        return self.blocks[i] if i < n else self.mtp[i - n]

    @property
    def expert_total(self) -> int:
        return sum(b.experts for b in self.blocks)

    @property
    def active(self) -> int:
        """Parameters one token activates: all but the routed experts it is not sent to (the
        published "activated parameters" of an MoE model)."""
        return self.total - sum(b.experts - b.routed_active for b in (*self.blocks, *self.mtp))

    @property
    def active_matmul(self) -> int:
        """Matmul parameters one token uses: blocks (top-k experts only) and the output head; with MTP,
        per depth its block, eh_proj and the head once more (each depth's tokens go through it too)."""
        mtp = sum(b.active_matmul for b in self.mtp) + len(self.mtp) * (self.mtp_extra_matmul + self.embedding)
        return sum(b.active_matmul for b in self.blocks) + self.embedding + mtp  # the head is V x d either way

    @property
    def mtp_extra_matmul(self) -> int:
        """Of mtp_extra, the matmul's: eh_proj (2d -> d, d = final_norm's width); 0 without MTP."""
        return 2 * self.final_norm ** 2 if self.mtp else 0


def head_dim(m: ModelConfig) -> int:
    return m.head_dim or m.dim // m.n_heads


def attention_head_dims(m: ModelConfig) -> tuple[int, int]:
    """Per-head widths of (query/key, value): head_dim twice, or MLA's (Dn + Dr, Dv)."""
    if m.latent.kv_lora_rank:
        return m.latent.qk_nope_head_dim + m.latent.qk_rope_head_dim, m.latent.v_head_dim
    return head_dim(m), head_dim(m)


def attention_params(m: ModelConfig) -> tuple[int, int, int, int]:
    """One block's attention (model/attention.py): (tp-split matmul, replicated matmul, tp-split other,
    replicated other) parameters, `other` being biases, norms and sinks, no matmul's.

    Grouped-query: wq, wk, wv, wo split by heads, with their q/k/v biases (Qwen2, gpt-oss); wo's
    bias (gpt-oss) replicated, added once after the sum over tp; QK-norm weights replicated per head
    (D each), split with the heads over the whole projection (H D and K D: OLMo 2). Latent (MLA): the
    per-head up-projections wq_b (or wq) and wkv_b and the output wo split; the down-projections wq_a
    and wkv_a replicated, as are their norms (parallel/tensor.py). Attention sinks: one logit per
    query head (gpt-oss), split with the heads.
    """
    d, H = m.dim, m.n_heads
    sinks = H if m.attention.sinks else 0
    out_bias = d if m.attention.out_bias else 0
    if not m.latent.kv_lora_rank:
        hd, K = head_dim(m), m.n_kv_heads
        matmul = d * H * hd + 2 * d * K * hd + H * hd * d
        biases = (H + 2 * K) * hd if m.attention.qkv_bias else 0
        split_norms = (H + K) * hd if m.norm.qk and m.norm.qk_span == "all" else 0
        head_norms = 2 * hd if m.norm.qk and m.norm.qk_span == "head" else 0
        return matmul, 0, biases + split_norms + sinks, head_norms + out_bias
    nope, rope, v = m.latent.qk_nope_head_dim, m.latent.qk_rope_head_dim, m.latent.v_head_dim
    rq, rkv = m.latent.q_lora_rank, m.latent.kv_lora_rank
    split = (rq or d) * H * (nope + rope) + rkv * H * (nope + v) + H * v * d  # wq_b (or wq), wkv_b, wo
    down = d * rq + d * (rkv + rope)  # wq_a, wkv_a
    return split, down, sinks, rq + rkv + out_bias  # q_a_norm, kv_a_norm


def block_norms(m: ModelConfig) -> int:
    """How many dim-wide norms a block holds (model.norm.position): two before its sub-layers ("pre"),
    two after them ("post", OLMo 2), or both ("sandwich", Gemma 3)."""
    return 4 if m.norm.position == "sandwich" else 2


def block_params(m: ModelConfig, layer: int) -> BlockParams:
    """model.Block: its norms, attention (attention_params), FeedForward or MoE."""
    d = m.dim
    attn, down, attn_split_other, attn_other = attention_params(m)
    replicated = block_norms(m) * d + attn_other + down  # block norms, attention's norms and down-projections
    attn_matmul = attn + down
    if m.moe.n_experts and layer >= m.moe.first_dense_layers:
        h = m.moe.ffn_dim or m.ffn_dim
        router, expert = d * m.moe.n_experts, 3 * d * h  # gate, up, down per expert
        shared = 3 * d * h * m.moe.n_shared_experts  # one SwiGLU of width h x n_shared
        active = attn_matmul + router + shared + expert * m.moe.top_k
        # moe.linear_bias (gpt-oss): the router's bias (E, replicated) and each expert's gate, up and down biases
        router_bias, expert_bias = (m.moe.n_experts, 2 * h + d) if m.moe.linear_bias else (0, 0)
        return BlockParams(tp_split=attn, replicated=replicated + router + router_bias + shared,
                           experts=m.moe.n_experts * (expert + expert_bias), active_matmul=active,
                           routed_active=(expert + expert_bias) * m.moe.top_k,
                           tp_split_other=attn_split_other)
    ffn = 3 * d * m.ffn_dim  # gate, up, down
    return BlockParams(tp_split=attn + ffn, replicated=replicated, experts=0, active_matmul=attn_matmul + ffn,
                       tp_split_other=attn_split_other)


def block_rank_params(bp: BlockParams, tp: int, ep: int) -> int:
    """Parameters of one block on one rank: the tp-split parts / tp, the replicated part whole, the
    routed experts / ep."""
    return (bp.tp_split + bp.tp_split_other) // tp + bp.replicated + bp.experts // ep


def block_forward_flops(m: ModelConfig, bp: BlockParams, seq_len: int, tp: int, sp: bool = False,
                        keys: float | None = None) -> int:
    """Forward FLOPs of one block per token on one tp rank: 2 per multiply-add of the matmul weights
    a token goes through (tp cuts attention and dense MLPs; the router, shared and routed experts run
    whole, on every token without sp, on this tp rank's T/tp tokens with sp: parallel/expert.py) plus
    the attention core, 2 k H (Dqk + Dv) for k keys per query (QK^T and PV, 2 per multiply-add):
    `keys` from mask_counts.keys_per_query for the block's window and documents, by default s / 2,
    the causal half (s H (Dqk + Dv); 2 s H hd when both widths are head_dim, MLA's differ).
    Integers: validate() makes heads, key/value heads and ffn_dim divisible by tp."""
    widths = m.n_heads * sum(attention_head_dims(m))
    attention_core = seq_len * widths if keys is None else round(2 * keys * widths)
    whole = 2 * (bp.active_matmul - bp.tp_split)
    return (2 * bp.tp_split + attention_core) // tp + (whole // tp if sp else whole)


def head_forward_flops(counts: ModelCounts, tp: int) -> int:
    """Forward FLOPs per token of the head's V x d matmul on one tp rank (tied or not: the same
    matrix size; the vocabulary is divisible by tp). The embedding is a lookup: no FLOPs."""
    return 2 * counts.embedding // tp


def mtp_extra_params(m: ModelConfig) -> int:
    """One MTP depth's parameters besides its block (model/transformer.py MTPLayer; DeepSeek-V3 sec.
    2.2): eh_proj, 2d -> d without bias, and three d-wide norms, enorm, hnorm and the output's norm
    (the released checkpoints' shared_head.norm)."""
    return 2 * m.dim * m.dim + 3 * m.dim


def model_counts(m: ModelConfig, vocab_size: int | None = None) -> ModelCounts:
    """Counts for a model whose vocabulary is `vocab_size` (default: m.vocab_size)."""
    v = vocab_size or m.vocab_size
    if v <= 0:
        raise ValueError("the vocabulary size must be known (model.vocab_size, or pass vocab_size)")
    mtp = tuple(block_params(m, m.n_layers + k) for k in range(m.mtp_layers))
    return ModelCounts(blocks=[block_params(m, i) for i in range(m.n_layers)], embedding=v * m.dim,
                       head=0 if m.tie_embeddings else v * m.dim, final_norm=m.dim, mtp=mtp,
                       mtp_extra=mtp_extra_params(m) if mtp else 0)


def count_on_meta(m: ModelConfig, vocab_size: int | None = None) -> int:
    """The same count from the real model built on the meta device (no memory): the test oracle."""
    import dataclasses

    import torch

    from fivefold.model.transformer import Transformer, count_parameters

    with torch.device("meta"):
        model = Transformer(dataclasses.replace(m, vocab_size=vocab_size or m.vocab_size))
    return count_parameters(model)


def attention_keys(m: ModelConfig, seq_len: int, document_tokens: float = 0) -> list[float]:
    """Mean keys per query of each block (mask_counts.keys_per_query): seq_len / 2 for causality
    alone, fewer under the block's sliding window (AttentionConfig.layer_window) and documents of mean
    length `document_tokens` (0: no document mask)."""
    per_window = {w: keys_per_query(seq_len, w, document_tokens)
                  for w in {m.attention.layer_window(layer) for layer in range(m.n_layers)}}
    return [per_window[m.attention.layer_window(layer)] for layer in range(m.n_layers)]


def mtp_attention_keys(m: ModelConfig, seq_len: int, document_tokens: float = 0) -> list[float]:
    """attention_keys of the MTP depths' blocks (layers n_layers + k: their windows as a block's of
    that index), which see the same rows and documents as the main blocks."""
    return [keys_per_query(seq_len, m.attention.layer_window(m.n_layers + k), document_tokens)
            for k in range(m.mtp_layers)]


def flops_per_token(m: ModelConfig, seq_len: int, vocab_size: int | None = None,
                    causal: CausalFlops = "full", document_tokens: float = 0) -> dict[str, float]:
    """Training FLOPs per token (forward + backward), model FLOPs only (no recompute).

    - matmuls: 6 x active matmul parameters (2 per multiply-add forward, twice that backward;
      Kaplan et al. 2020, "Scaling Laws for Neural Language Models", C = 6N), head included;
    - attention scores and the weighted sum: per head a matmul of s x Dqk (QK^T) and one of s x Dv
      (PV), 2 FLOPs per multiply-add, x3 for backward: 6 x L x s x H x (Dqk + Dv), which is
      12 L s H hd when Dqk = Dv = hd, PaLM's 12 L H Q T (Chowdhery et al. 2022, App. B) and the
      4 s h per layer forward of Megatron-LM (Narayanan et al. 2021, its FLOP count): both count it in
      full. causal="half" halves it for the masked half a fused kernel skips, which is what the
      step time prices (compute.py). MLA: Dqk = Dn + Dr, Dv; its down- and up-projections are
      matmul parameters like any other.
    - masks beyond causality (sliding windows, documents of mean length `document_tokens`) count
      the pairs they keep (mask_counts.py): per block 6 H (Dqk + Dv) x its mean kept keys per query
      (attention_keys), times 2 under causal="full", which counts each kept causal triangle as its
      square, as it counts the T x T square for the causal T (T + 1) / 2.
    Returns {"matmul", "attention", "total", "attention_forward"} (the last, the attention's forward
    under the same convention, is what selective recompute runs again).
    """
    if causal not in ("full", "half"):
        raise ValueError(f"causal = {causal!r}: expected 'full' or 'half'")
    c = model_counts(m, vocab_size)
    matmul = 6.0 * c.active_matmul
    keys = sum(attention_keys(m, seq_len, document_tokens)) + sum(mtp_attention_keys(m, seq_len, document_tokens))
    attention = 6.0 * m.n_heads * sum(attention_head_dims(m)) * keys * (2 if causal == "full" else 1)
    return {"matmul": matmul, "attention": attention, "total": matmul + attention, "attention_forward": attention / 3}


def recompute_flops_per_token(m: ModelConfig, seq_len: int, recompute: str, vocab_size: int | None = None,
                              causal: CausalFlops = "full", document_tokens: float = 0) -> float:
    """FLOPs per token that activation recomputation runs again (parallel/recompute.py), under the
    same causal convention: "full" one more forward of every block (its matmuls and attention core;
    the head is not recomputed), "selective" the attention core's forward (Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models"), "none" nothing. Model FLOPs +
    these are the hardware FLOPs of HFU, which that paper reports beside MFU."""
    f = flops_per_token(m, seq_len, vocab_size, causal, document_tokens)
    if recompute == "full":
        c = model_counts(m, vocab_size)
        blocks = sum(b.active_matmul for b in (*c.blocks, *c.mtp))  # the MTP depths' blocks are checkpointed too
        return 2.0 * blocks + f["attention_forward"]
    if recompute == "selective":
        return f["attention_forward"]
    if recompute == "none":
        return 0.0
    raise ValueError(f"train.recompute = {recompute!r}: expected none, selective or full")
