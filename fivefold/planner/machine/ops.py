"""The kernels of one block's forward at one rank's shapes: matmuls, the attention core, and the
bytes the elementwise kernels move. Pure arithmetic; roofline.py prices it.

What one rank runs, as fivefold's model code runs it (model/transformer.py, model/attention.py, parallel/tensor.py,
parallel/expert.py), with T = micro_batch x seq / cp tokens in the tensor-parallel regions and Ts =
T / tp with sequence parallel (the norms, residual adds and, for MoE, the whole MoE block), else T:

- matmuls (M, N, K) = (tokens, output width, input width), tp-split where parallel/tensor.py
  splits them: GQA's wq/wk/wv/wo by heads; MLA's per-head up-projections and wo by heads, its
  down-projections whole on Ts tokens; a dense SwiGLU's gate/up/down by hidden units; an MoE's
  router and shared experts whole on Ts tokens; each local routed expert (E / ep of them, one
  matmul each) on the rows the ep group sends it: Ts x ep x top_k / E, times the expert imbalance
  on the busiest expert rank (capped by a capacity factor, which drops the overflow). GroupedExperts
  loops over the experts, or in bf16 runs one torch._grouped_mm per weight on their rows padded
  per expert to whole groups of 8 (grouped_rows: 8 x E_local to 8 x E_local + 7 rows more), priced
  as those rows shared evenly; the head (V / tp) on the last stage;
- the attention core as the fused kernel runs it: T queries over the sequence's keys, causal
  (half the score matrix), H / tp heads, values padded to the query/key width for MLA (model/attention.py
  pads them so the flash kernel runs), at the sequence length one kernel call sees (seq / cp for
  ring attention, which calls it per chunk; the whole sequence for Ulysses). Under a sliding window
  or documents (model/mask_counts.py) its FLOPs are the pairs the mask keeps, and its work the
  128 x 128 tiles FlexAttention computes: the causal kernel's times the ratio of their tiles;
- elementwise kernels, each reading its inputs and writing its output once: RMSNorm (fp32 inside:
  upcast, square, mean, scale, downcast, weight), RoPE (fp32 inside: the rotated half, two
  products, a sum), GQA's repeated K/V (fp32 only: in bf16 SDPA takes the grouped heads itself,
  model/attention.py gqa_in_kernel), SwiGLU's silu and product, the residual adds, MLA's joins,
  pad and output copy, the MoE's gather (of the block's input, in the stream's dtype), the
  grouped experts' zero-padded buffer and the gather back out of it (the loop's concatenation
  instead), combine and scatter-add, the loss's log-softmax, and
  autocast's cast of each weight to the compute dtype (once per forward: autocast caches it; its
  backward once, the gradient cast back) where the weights are wider: fivefold's own fp32 weights
  (estimate's implementation = True, not ZeRO-3 gathering in bf16); the textbook's 2-byte weights
  (ZeRO's 2 + 2 + 12 accounting, what Megatron-LM and FSDP2's bf16 param_dtype hold) are the
  compute dtype already and cast nothing. fp32 weights also leave the residual stream fp32 (the
  embedding's output; autocast casts only a matmul's operands): the block's norms read it without
  a cast, the residual adds read and write it at 4 bytes, and each matmul reading the normed input
  (READS_INPUT) casts it again (RankShapes.residual_bytes; a CPU trace under autocast checks it).
  With fused kernels (`--kernels fused`, `train.compile`) each chain is fused: inputs read once,
  outputs written once.

FP8 matmuls (RankShapes.fp8, torchao's tensorwise recipe, as the roofline of
torchao/testing/training/roofline_utils.py counts its casts): each linear's input (M x K) and its
gradient's output gradient (M x N) are scaled by their absolute max and cast to FP8 in both
layouts the three matmuls read: an amax pass reading the bf16 tensor (none when fused with the
kernel that makes it), then one kernel reading it and writing two FP8 copies: 6 bytes an element
eager, 4 fused, the input's in forward, the output gradient's in backward. Each weight (K x N) is
cast once per forward and backward: an amax read, a cast in forward and another in backward (2 +
3 + 3 bytes an element); gathered in FP8 already (fp8 = "weights": cast on its shard before
ZeRO-3's gather, parallel/data/fp8_gather.py) only its transposed copy for the backward is made
(read 1 byte, write 1).

Backward elementwise traffic is twice the forward's (each op's backward reads its output's
gradient and what it saved, and writes its inputs' gradients), plus the zero-filled gradients of
RoPE's and MLA's slices, and, where the experts loop, their weight gradients: GroupedExperts unbinds
each stacked weight once, so its backward writes each local expert's gradient and stacks them (2 x
E_local x d x h elements per weight); the grouped matmul writes the stacked gradient itself.
A CPU trace of the tiny blocks (calibration/opcount.py) checks these counts (tests).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from fivefold.model.config import ModelConfig
from fivefold.model.counts import attention_head_dims, block_norms, head_dim
from fivefold.model.mask_counts import keys_per_query, tile_ratio
from fivefold.planner.options import AttentionKernel, Fp8

FP32 = 4  # bytes: norms and RoPE compute in fp32 (model/attention.py), the weights and their gradients are fp32
# model/moe.py's GROUP_ROWS (the planner imports no torch; a test holds them equal): each routed expert's rows
# are padded to a multiple of it for the grouped matmul's weight-gradient kernel, an expert without rows given
# one group of zero rows. Priced under fp8_experts too: a what-if of other trainers' FP8 grouped GEMMs, whose own
# alignment (16 rows and up) the planner does not model.
GROUP_ROWS = 8


# torchtitan's per-op selective recompute (PlanOptions.selective_ac = "per_op") reruns the second, fourth,
# ... of a block's matmuls in forward order: this slice of them (roofline.py prices it, flops.py counts it)
PER_OP_RERUN = slice(1, None, 2)
# Under FP8 the head and the router stay bf16 (fivefold's parallel/fp8.py converts the blocks' dense linears
# only; torchtitan filters the output layer, DeepSeek-V3 sec. 3.3.1 keeps the head and the gating in BF16), the
# routed experts too unless RankShapes.fp8_experts (DeepSeek-V3's and Transformer Engine's grouped GEMMs)
FP8_KEPT = frozenset({"head", "router"})
ROUTED_EXPERTS = frozenset({"expert gate", "expert up", "expert down"})


def kept_bf16(s: RankShapes) -> frozenset[str]:
    """The matmuls FP8 (RankShapes.fp8) leaves in bf16; none without FP8."""
    if s.fp8 == "none":
        return frozenset()
    return FP8_KEPT if s.fp8_experts else FP8_KEPT | ROUTED_EXPERTS


# the matmuls that read the block's (normed) input, which autocast casts from a wider residual stream
READS_INPUT = frozenset({"wq", "wk", "wv", "wq_a", "wkv_a", "gate", "up", "router", "shared gate", "shared up",
                         "expert gate", "expert up", "head"})


@dataclass(frozen=True)
class Matmul:
    """One forward matmul, X (M x K) times W (K x N), run `count` times alike (local experts)."""

    name: str
    m: int
    n: int
    k: int
    count: int = 1

    @property
    def flops(self) -> float:
        """Forward FLOPs of all its counts: 2 M N K each."""
        return 2.0 * self.m * self.n * self.k * self.count


@dataclass(frozen=True)
class Ops:
    """What one part's forward runs on one rank (module docstring)."""

    matmuls: tuple[Matmul, ...] = ()
    attention_flops: float = 0.0  # forward FLOPs of the attention kernel: the pairs the mask keeps, kernel widths
    attention_work: float = 0.0  # the same in causal FLOPs x the tiles the kernel computes over causality's
    attention_seq: int = 0  # sequence length one attention kernel call sees
    elementwise_bytes: float = 0.0  # forward: read + written
    backward_elementwise_bytes: float = 0.0
    parts: dict[str, float] = field(default_factory=dict, compare=False)  # forward elementwise bytes by op
    # a materialized attention (RankShapes.attention): its two batched matmuls, and the forward and
    # backward bytes of its softmax and dropout over the score matrix
    attention_matmuls: tuple[Matmul, ...] = ()
    softmax_bytes: tuple[float, float] = (0.0, 0.0)
    attention_flex: bool = False  # fivefold runs it through FlexAttention (runs_flex), not SDPA
    bf16_matmuls: frozenset[str] = frozenset()  # the matmuls FP8 leaves in bf16 (kept_bf16)


@dataclass(frozen=True)
class RankShapes:
    """The sizes one rank computes at (module docstring)."""

    tokens: int  # T: micro_batch x seq / cp
    sp_tokens: int  # Ts: T / tp with sequence parallel, else T
    seq_len: int  # keys each query sees (the whole sequence)
    kernel_seq: int  # sequence length of one attention kernel call
    tp: int = 1
    ep: int = 1
    act_bytes: int = 2  # activations in the compute dtype (bf16)
    # the residual stream's element: the embedding's dtype, fp32 where the weights are (autocast leaves
    # the stream as the embedding made it); 0: act_bytes
    residual_bytes: int = 0
    weight_bytes: float = 4  # a weight element as the matmuls find it: fp32 at rest is cast each forward
    fused: bool = False  # train.compile: elementwise chains fused
    imbalance: float = 1.0  # tokens on the busiest expert rank / the mean
    document_tokens: float = 0.0  # mean document length under a document mask (0: none, or not stated)
    document_mask: bool = False  # data.document_mask: fivefold's attention runs FlexAttention (runs_flex)
    attention: AttentionKernel = "sdpa"  # "materialized": a pre-FlashAttention trainer's (materialized_attention)
    fp8: Fp8 = "none"  # PlanOptions.fp8: "compute" casts every matmul's operands, "weights" has them gathered in FP8
    fp8_experts: bool = False  # PlanOptions.fp8_experts: the routed experts in FP8 too (else bf16, as fivefold's)


class _Elementwise:
    """Accumulates the forward (and extra backward) bytes of a part's elementwise kernels."""

    def __init__(self, s: RankShapes):
        self.s, self.parts, self.extra_backward, self.cast_forward = s, {}, 0.0, 0.0

    def add(self, what: str, nbytes: float) -> None:
        self.parts[what] = self.parts.get(what, 0.0) + nbytes

    def norm(self, what: str, elements: float, x_bytes: int = 0) -> None:
        """RMSNorm of a tensor of `x_bytes` elements (0: act_bytes): x.float(), pow, mean, x * rsqrt,
        type_as, * weight (model/attention.py); the casts are no kernels on an fp32 input."""
        a = x_bytes or self.s.act_bytes
        cast = (a + FP32) if a < FP32 else 0
        self.add(what, elements * (2 * a if self.s.fused else 2 * cast + 5 * FP32 + 2 * a))

    def residual_casts(self, matmuls: list[Matmul]) -> None:
        """autocast's cast of a wider residual stream (RankShapes.residual_bytes) to the compute dtype,
        once for each matmul that reads the normed block input (autocast caches weights' casts only)."""
        r, a = self.s.residual_bytes, self.s.act_bytes
        if r > a and not self.s.fused:
            self.add("input casts", sum(mm.m * mm.k * mm.count for mm in matmuls if mm.name in READS_INPUT) * (r + a))

    def rope(self, what: str, elements: float) -> None:
        """apply_rope: neg of half, cat, two upcasts, two products, a sum, a downcast; its two
        slices' backward writes zero-filled gradients of the input (extra backward)."""
        a = self.s.act_bytes
        cast = (a + FP32) if a < FP32 else 0
        self.add(what, elements * (2 * a if self.s.fused else a + 2 * a + 2 * cast + 4 * FP32 + 3 * FP32 + cast))
        self.extra_backward += 0.0 if self.s.fused else 3 * elements * a

    def copy(self, what: str, read: float, written: float) -> None:
        """A kernel reading `read` and writing `written` elements in the compute dtype."""
        self.add(what, (read + written) * self.s.act_bytes)

    def swiglu(self, what: str, elements: float) -> None:
        """silu(gate) (read one, write one) and its product with up (read two, write one)."""
        if self.s.fused:
            self.copy(what, 2 * elements, elements)
        else:
            self.copy(what, 3 * elements, 2 * elements)

    def weights(self, matmuls: list[Matmul]) -> None:
        """autocast's cast of each weight wider than the compute dtype: read weight_bytes, write act_bytes;
        its backward once, not twice (the gradient cast back: read act_bytes, write weight_bytes)."""
        a, w = self.s.act_bytes, self.s.weight_bytes
        if a < w:
            cast = sum(mm.n * mm.k * mm.count for mm in matmuls) * (w + a)
            self.add("weight casts", cast)
            self.cast_forward += cast
            self.extra_backward += cast

    def fp8_casts(self, matmuls: list[Matmul]) -> None:
        """The FP8 scaling and casts of each matmul's operands (module docstring): forward bytes
        under "fp8 casts", the backward's own (not twice the forward's) in extra_backward."""
        if self.s.fp8 == "none":
            return
        activation = 4 if self.s.fused else 6  # amax pass fused with the producer, or its own read
        weight_fwd, weight_bwd = (0, 2) if self.s.fp8 == "weights" else (2 + 3, 3)
        matmuls = [mm for mm in matmuls if mm.name not in kept_bf16(self.s)]
        inputs = sum(mm.m * mm.k * mm.count for mm in matmuls)
        outputs = sum(mm.m * mm.n * mm.count for mm in matmuls)
        weights = sum(mm.k * mm.n * mm.count for mm in matmuls)
        cast = activation * inputs + weight_fwd * weights
        self.cast_forward += cast
        if cast:
            self.add("fp8 casts", cast)
        self.extra_backward += activation * outputs + weight_bwd * weights

    def ops(self, matmuls: list[Matmul], attention: tuple[float, float] = (0.0, 0.0)) -> Ops:
        self.weights(matmuls)
        self.fp8_casts(matmuls)
        forward = sum(self.parts.values())
        return Ops(tuple(matmuls), attention[0], attention[1], self.s.kernel_seq if attention[0] else 0, forward,
                   2 * (forward - self.cast_forward) + self.extra_backward, dict(self.parts),
                   bf16_matmuls=kept_bf16(self.s))


def _masked(m: ModelConfig, layer: int, s: RankShapes, causal_flops: float) -> tuple[float, float]:
    """(FLOPs, work) of an attention kernel whose causal FLOPs are `causal_flops`, under the layer's
    window and the documents: the kept keys per query over the causal s / 2, and the kernel's
    tiles over the causal kernel's (Ops.attention_flops, attention_work)."""
    window = m.attention.layer_window(layer)
    keys = keys_per_query(s.seq_len, window, s.document_tokens)
    return causal_flops * keys / (s.seq_len / 2), causal_flops * tile_ratio(s.seq_len, window, s.document_tokens)


def _attention(m: ModelConfig, layer: int, s: RankShapes, ew: _Elementwise) -> tuple[list[Matmul], float]:
    """The attention of one block: its projections, the kernel's causal FLOPs, its elementwise kernels."""
    T, Ts, tp, d = s.tokens, s.sp_tokens, s.tp, m.dim
    H = max(1, m.n_heads // tp)
    if not m.latent.kv_lora_rank:
        hd, K = head_dim(m), max(1, m.n_kv_heads // tp)
        mms = [Matmul("wq", T, H * hd, d), Matmul("wk", T, K * hd, d), Matmul("wv", T, K * hd, d),
               Matmul("wo", T, d, H * hd)]
        if m.norm.qk:
            ew.norm("qk norm", T * (H + K) * hd)
        ew.rope("rope", T * (H + K) * hd)
        if K < H and s.act_bytes == FP32:  # fp32 on a GPU: k and v repeated to H heads (attention.gqa_in_kernel)
            ew.copy("repeat k/v", 2 * T * K * hd, 2 * T * H * hd)
        # QK^T and PV: 2 FLOPs per multiply-add over seq keys of width hd each, halved by the causal mask
        return mms, T * s.seq_len * H * (hd + hd)
    mla = m.latent
    n, r, v, rq, rkv = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.q_lora_rank, mla.kv_lora_rank
    qk = n + r
    mms = [Matmul("wkv_a", Ts, rkv + r, d), Matmul("wkv_b", T, H * (n + v), rkv), Matmul("wo", T, d, H * v)]
    mms += [Matmul("wq_a", Ts, rq, d), Matmul("wq_b", T, H * qk, rq)] if rq else [Matmul("wq", T, H * qk, d)]
    if rq:
        ew.norm("latent norms", Ts * rq)
    ew.norm("latent norms", Ts * rkv)
    ew.rope("rope", T * (H * r + r))
    ew.copy("mla joins", 2 * T * H * qk, 2 * T * H * qk)  # [q_nope, q_rope] and [k_nope, k_rope expanded]
    ew.copy("mla joins", T * H * v, T * H * qk)  # v padded to the query/key width
    ew.copy("mla joins", T * H * v, T * H * v)  # the output cut to v, copied by reshape
    if not s.fused:  # the per-head splits' backward: zero-filled gradients of q and kv, the pad's, the expand's
        ew.extra_backward += T * H * (2 * qk + 2 * (n + v) + qk + v + r) * s.act_bytes
    return mms, T * s.seq_len * H * (qk + qk)  # the kernel runs the padded value width


def _ffn(m: ModelConfig, layer: int, s: RankShapes, ew: _Elementwise) -> list[Matmul]:
    """A dense SwiGLU (split over tp) or an MoE block (router, shared and local routed experts)."""
    T, d = s.tokens, m.dim
    if not (m.moe.n_experts and layer >= m.moe.first_dense_layers):
        f = m.ffn_dim // s.tp
        ew.swiglu("swiglu", T * f)
        return [Matmul("gate", T, f, d), Matmul("up", T, f, d), Matmul("down", T, d, f)]
    Tm, E, k, h = s.sp_tokens, m.moe.n_experts, m.moe.top_k, m.moe.ffn_dim or m.ffn_dim
    local = max(1, E // s.ep)
    # rows per local expert on the busiest expert rank; a capacity factor drops what exceeds cf x the mean
    busiest = min(s.imbalance, m.moe.capacity_factor) if m.moe.capacity_factor > 0 else s.imbalance
    rows = max(1, math.ceil(Tm * s.ep * k / E * busiest))
    copies = Tm * k  # this rank's routed copies of its tokens
    x_bytes = s.residual_bytes or s.act_bytes  # the block's normed input, in the stream's dtype (autocast casts later)
    # model/moe.py grouped_dtype; 2-byte activations taken as bf16 (fp16 loops, but RankShapes can't tell)
    grouped = s.act_bytes == 2 and not (d % 8 or h % 8)
    run = grouped_rows(rows * local, local) if grouped else rows * local
    per_expert = -(-run // local)  # the rows each local expert's matmuls run, padding included
    mms = [Matmul("router", Tm, E, d), Matmul("expert gate", per_expert, h, d, local),
           Matmul("expert up", per_expert, h, d, local), Matmul("expert down", per_expert, d, h, local)]
    ew.add("router", Tm * E * (s.act_bytes + 3 * FP32))  # upcast, softmax / sigmoid, top-k
    ew.add("moe dispatch", 2 * copies * d * x_bytes)  # x[token_of_copy]
    ew.swiglu("expert swiglu", run * h)
    if grouped:  # a zeroed buffer of `run` rows (the input's dtype), the routed rows read and written into it
        ew.add("moe dispatch", (run + 2 * rows * local) * d * x_bytes)
    # the outputs gathered from the buffer (the loop: concatenated), then times the gate weights
    ew.copy("moe dispatch", rows * local * d + copies * d, rows * local * d + copies * d)
    ew.copy("moe dispatch", copies * d + Tm * d, 2 * Tm * d)  # new_zeros + index_add_
    if not (s.fused or grouped):  # the loop, per weight: each local expert's fp32 gradient written, then stacked
        ew.extra_backward += 3 * 2 * local * d * h * FP32  # (unbind's backward); grouped writes the stack itself
    if m.moe.n_shared_experts:
        hs = h * m.moe.n_shared_experts
        mms += [Matmul("shared gate", Tm, hs, d), Matmul("shared up", Tm, hs, d), Matmul("shared down", Tm, d, hs)]
        ew.swiglu("shared swiglu", Tm * hs)
        ew.copy("residual adds", 2 * Tm * d, Tm * d)  # routed + shared
    return mms


def grouped_rows(rows: int, local: int) -> int:
    """Rows the local experts' grouped matmuls run for `rows` routed rows (model/moe.py padded_groups):
    each expert's rows padded with zero rows to whole groups of GROUP_ROWS, an expert without rows
    given one group, in a buffer sized from shapes alone (no host read), round_up(rows, 8) + 8 x local:
    between 8 x local and 8 x local + 7 rows more than routed, whatever the routing."""
    return -(-rows // GROUP_ROWS) * GROUP_ROWS + GROUP_ROWS * local


def block_ops(m: ModelConfig, layer: int, s: RankShapes) -> Ops:
    """model.Block number `layer` forward on one rank: h = x + attn(norm(x)); out = h + ffn(norm(h)) (or
    its norms after the sub-layers, or both: model.norm.position, counts.block_norms)."""
    ew = _Elementwise(s)
    r = s.residual_bytes or s.act_bytes
    after = 2 if m.norm.position in ("post", "sandwich") else 0  # norms of a sub-layer's output, not the stream
    ew.norm("norms", (block_norms(m) - after) * s.sp_tokens * m.dim, r)
    ew.norm("norms", after * s.sp_tokens * m.dim)
    mms, causal_flops = _attention(m, layer, s, ew)
    mms += _ffn(m, layer, s, ew)
    ew.residual_casts(mms)
    # x + f(x), twice: the stream read and written at its dtype, the sub-layer's output at the compute dtype's
    ew.add("residual adds", 2 * s.sp_tokens * m.dim * (2 * r + s.act_bytes))
    if s.attention == "materialized":
        return materialized_attention(m, s, ew.ops(mms))
    return dataclasses.replace(ew.ops(mms, _masked(m, layer, s, causal_flops)), attention_flex=runs_flex(m, layer, s))


def runs_flex(m: ModelConfig, layer: int, s: RankShapes) -> bool:
    """Does fivefold's attention of block `layer` run FlexAttention on a GPU (model/attention.py
    backend_for): a window, documents or sinks under attention.backend "auto", or "flex" named."""
    masked = bool(m.attention.layer_window(layer) or s.document_mask or m.attention.sinks)
    return m.attention.backend == "flex" or (m.attention.backend == "auto" and masked)


def materialized_attention(m: ModelConfig, s: RankShapes, ops: Ops) -> Ops:
    """`ops` with the attention core as trainers before FlashAttention ran it (Megatron-LM 2021,
    Narayanan et al. 2021; Korthikanti et al. 2022 sec. 4): per sequence and head, S = Q K^T is a
    batched matmul of the whole S x S score matrix (the causal mask is applied to it, no FLOP is
    skipped), a fused scale-mask-softmax reads the scores and writes the probabilities, dropout
    (Megatron-LM's attention_dropout, 0.1 by default) reads them and writes the kept ones and a
    one-byte mask, and P V is a second batched matmul. Backward: dropout's reads the gradient and
    the mask and writes one, softmax's reads the probabilities and their gradient and writes one."""
    dqk, dv = attention_head_dims(m)
    S, heads = s.kernel_seq, max(1, m.n_heads // s.tp)
    n = s.tokens // S * heads  # (sequence, head) pairs of the micro-batch on this rank
    a = s.act_bytes
    matmuls = (Matmul("scores", S, S, dqk, n), Matmul("probs x v", S, dv, S, n))
    return dataclasses.replace(ops, attention_matmuls=matmuls, softmax_bytes=(n * S * S * (4 * a + 1),
                                                                             n * S * S * (5 * a + 1)))


def end_ops(m: ModelConfig, vocab: int, s: RankShapes, first: bool, last: bool, loss_chunk: int = 0) -> Ops:
    """The embedding lookup (first stage) and the final norm, head and loss (last stage).

    The loss (model/head.py, chunk by chunk of `loss_chunk` tokens at every tp) per logit: forward
    casts the compute-dtype product to fp32 (none in fp32) and log-sum-exp reads it for its max,
    subtracts, exps and sums (20 bytes); backward makes the logits again (loss_recompute_matmul,
    priced as recompute), casts, subtracts the log-sum-exp, exps, scales and casts the result back
    (2 casts + 24 bytes), and copies each chunk's input gradient into the whole. Per chunk its weight
    gradient (V/tp x dim) joins the fp32 sum (zeroed once): inside the matmul in fp32 (addmm_), else
    the compute-dtype product widened as it is added (a + 8 bytes per element): the chunks' one cost
    beyond one chunk's. With
    model.mtp_layers D the head runs on (1 + D) x the tokens, and the last stage also embeds each
    depth's tokens and runs its three norms and eh_proj (its block is one of the rank's blocks)."""
    ew, mms = _Elementwise(s), []
    v, depths = vocab // s.tp, m.mtp_layers if last else 0
    if first or depths:  # fp32 rows looked up, and backward's scatter into a zeroed fp32 gradient of the table
        looked_up = s.tokens * (int(first) + depths)
        ew.add("embedding", 2 * looked_up * m.dim * FP32)
        ew.extra_backward += (v * m.dim - 3 * looked_up * m.dim) * FP32
    if last:
        ew.norm("norms", s.sp_tokens * m.dim * (1 + 3 * depths), s.residual_bytes)
        if depths:
            mms.append(Matmul("eh_proj", s.sp_tokens, m.dim, 2 * m.dim, depths))
        head = loss_recompute_matmul(m, vocab, s)
        mms.append(head)
        ew.residual_casts(mms)
        cast = s.act_bytes + FP32 if s.act_bytes < FP32 else 0
        logits = head.m * v
        chunks = -(-head.m // loss_chunk) if 0 < loss_chunk < head.m else 1
        ew.add("loss", logits * (cast + 5 * FP32))
        ew.cast_forward += logits * (cast + 5 * FP32)  # its backward is its own, not twice the forward
        added = s.act_bytes + 2 * FP32 if s.act_bytes < FP32 else 0  # per chunk and weight-gradient element
        ew.extra_backward += logits * (2 * cast + 6 * FP32) + v * m.dim * (FP32 + chunks * added)
        ew.extra_backward += head.m * m.dim * 2 * s.act_bytes  # each chunk's input gradient copied into the whole
    return ew.ops(mms)


def loss_recompute_matmul(m: ModelConfig, vocab: int, s: RankShapes) -> Matmul:
    """The head's matmul over the micro-batch's tokens and each MTP depth's (model/head.py): its
    backward runs it once more to make the logits again (roofline.chunk_price adds it)."""
    return Matmul("head", s.tokens * (1 + m.mtp_layers), vocab // s.tp, m.dim)
