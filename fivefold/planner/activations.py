"""Activation memory of one transformer block: the bytes autograd keeps for backward.

Derived for fivefold's own block (model/transformer.py: RMSNorm, grouped-query attention with RoPE and the
fused (flash) attention kernel, SwiGLU) by listing what each operation saves, following the method
of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), whose
paper counts Megatron's GPT block instead. Per token, in elements, with d = dim, dq = H x head_dim,
dk = K x head_dim, f = ffn width, t = tp:

  norms and residual stream (replicated over tp; split over tp with sp):
    attention norm: its input x, the rsqrt (1 per token), the normalised value before the weight;
    its output, kept by the q/k/v projections (with sp those keep the gathered input instead:
    d per token, not split); the same four for the MLP norm                     6d + 2
    Post norms (model.norm.position "post", OLMo 2) keep the same: the projections keep the
    block's input or h instead of a norm's output, and a norm on a sub-layer's output keeps that
    output, the rsqrt and the value before the weight (its own output only enters the residual
    add); sandwich norms (Gemma 3) keep both, the post norms' 2 (2d + 1) more. A norm scaling by
    (1 + weight) keeps the same; so do biases (none of their adds keeps a tensor) and GeGLU.
  attention (split over tp):
    the roped q and the k and v the kernel reads (GQA: K heads, SDPA's enable_gqa;
    model/attention.py repeats them to H heads only for SDPA on CUDA in fp32, whose kernel
    there takes no GQA: 2 (dq - dk) more, not counted)                            dq + 2 dk
    the kernel's output, which the out projection reads as its input (one storage), and the
    kernel's log-sum-exp (H per token)                                            dq + H
    Documents, sliding windows and sinks keep the same: their kernels (FlexAttention on CUDA,
    with GQA; model/blockwise.py elsewhere, which repeats one tile's K/V at a time and rebuilds
    each tile in backward from O and the log-sum-exp) save q, k, v, the output and the
    log-sum-exp, and no (T, T) mask exists. Not counted: FlexAttention's block mask, a few int32
    (B, 1, T/128, T/128) tables per layer (4 MB each at T = 128k, against gigabytes of the
    above), and the blockwise path's one additive bias tile of at most (B, 1, 512, 512) in the
    compute dtype, alive while its tile computes
    (RoPE keeps only its cos/sin table, shared by every block, and not counted here: products
    with a constant keep the constant, not the tensor)
    QK-norm adds, for q and k, the raw value and the value before the weight (2dq, 2dk) and
    the rsqrt per head (H, K), or per token over the whole projection (1 each, OLMo 2)
  SwiGLU (split over tp): gate output, its silu, up output, their product        4f
  or an MoE block (experts not split by tp: whole on every token without sp, on this tp rank's
  T/tp tokens with sp, whose MLP norm output then stays split: it is not gathered), with h the
  expert width and k = top_k: the router's scores and the top-k bookkeeping (~2E plus the
  indices), and per routed copy its gathered input row, the expert's four SwiGLU values and its
  output before and after the gate weight; shared experts are one SwiGLU of width n_shared h
                                                                 2E + 4 + k (4h + 3d) + 4 n_shared h
    (measured on tiny-moe, tp 1 and 2, with and without sp: within 1%)

Multi-head latent attention (model/attention.py LatentAttention; DeepSeek-V2 sec. 2.1), listed the same
way, with rq/rkv the query/key-value latents, R the shared RoPE width, n/v the per-head widths
without RoPE and of values:
  down-projections (replicated; T/tp tokens with sp, where they read the local norm output, so
  the attention norm's output is split too): the query latent's norm (input rq, rsqrt, value
  before the weight rq) and the key-value one (wkv_a's whole output rkv + R, which the norm's
  input is a view of, rsqrt, value before the weight rkv)                  2rq + 2rkv + R + 2
  what the up-projections read (replicated, never split: gathered with sp): the latents rq + rkv,
  at tp > 1 the one concatenation tensor parallel enters its region with, rq + rkv + R (with
  q_lora_rank = 0, x instead of the query latent: d, already counted at tp = 1)
  per head (split over tp): the kernel's q, k and v, H (n + R) each (new tensors: the nope and
  roped parts joined; v padded with zeros to the q/k width, so the fused kernel runs); the
  kernel's output H (n + R) and log-sum-exp H; the output cut to H v, copied by the out
  projection's reshape, H v
  (DeepSeek-V2's cache-free training keeps the same per-head tensors as multi-head attention with
  heads of n + R; only the projections differ)

Recompute: "full" keeps only each block's input (d, split with sp); "selective" recomputes the
attention kernel, which then keeps no log-sum-exp, and keeps its inputs; torchtitan's per-op
selective recompute keeps what per_op_block_elements lists. Weights are not
activations and are not counted.

Megatron-LM's layout (`layout = "megatron"`, PlanOptions.activations; dense grouped-query blocks):
what Korthikanti et al. 2022 count (sec. 4.1-4.2.2: 34 s b h / t per GPT layer with sequence
parallelism, less its dropout masks) and Megatron-Core keeps. A fused norm keeps its input and
rsqrt, not the normalised value; with sp the column-parallel layers keep their sequence-sharded
input and all-gather it again in backward (megatron/core/tensor_parallel/layers.py; comm.py prices
the gather); a fused SwiGLU keeps its input (gate and up), the down projection the product:
  norms and residual stream: input, rsqrt and output of each norm          4d + 2 (/ t with sp)
  SwiGLU                                                                    3f / t
The attention part is fivefold's (flash kernels keep the same tensors). MoE and latent-attention
blocks keep fivefold's counts under this layout.

FP8 compute (fp8_matmul_input_elements): Transformer Engine's linear modules cast each linear
layer's input to FP8 once in forward and keep that FP8 copy for the weight-gradient GEMM, and
DeepSeek-V3 (2024, sec. 3.3.3, "Low-Precision Storage") caches the Linear inputs in FP8 the same
way. What moves from the compute dtype to 1 byte: the attention projections' input (the attention
norm's output, or with sp the gathered input; MLA: that and the latents the up-projections read),
the gate/up input of a dense MLP (its norm's output or gathered input), every down projection's
input (the SwiGLU product: dense, each routed copy, the shared experts) and each routed copy's
gathered input row. What stays: the router's input, read in bf16 (DeepSeek-V3 keeps the gating
and the head in higher precision), so the shared experts add an FP8 copy of it, and GQA's out
projection input, which is also the attention kernel's output that the kernel's backward reads in
bf16: an FP8 copy is added for the out projection (with selective recompute the kernel's output is
rebuilt, and the kept tensor is the FP8 one alone). Norms, the residual stream, attention's q/k/v
and the SwiGLU's gate, silu and up values stay in the compute dtype.

DeepSeek-V3's layout (`layout = "deepseek"`; MLA + MoE models, their dense first blocks included):
what DeepSeek-AI 2024 (DeepSeek-V3 Technical Report, arXiv 2412.19437) keeps without recompute.
Sec. 3.2.3 rebuilds every RMSNorm and the MLA up-projections in backward and stores none of their
outputs; sec. 3.3.3 caches the linear layers' inputs for backward in FP8 (1 byte; the fp32 scale of
each 1 x 128 tile, 1/32 byte per element, is not counted, as above), the input of the linear after
attention in its own E5M6 format (12 bits: 1.5 bytes), and the SwiGLU's input in FP8, its output
rebuilt in backward (the paper says so of the MoE's; the dense first blocks are taken to do the
same). The MoE's up-projection input is dispatched in FP8 (sec. 3.3.3, low-precision
communication) and kept so. Per token, with a the compute dtype's bytes (2), t = tp and s = t with
sp, else 1; DeepSeek-V3 trains at tp = 1:
  residual stream: the two norms' inputs x and h, all backward needs to rebuild the norms (rsqrt
  included), in a bytes                                                          2d / s
  down-projections (replicated; T/tp tokens with sp): their outputs, the latent norms' inputs:
  the query latent rq (none with q_lora_rank = 0) and wkv_a's rkv + R, whose R is k's RoPE part,
  in a bytes                                                                     (rq + rkv + R) / s
  nothing of the norms' outputs (the inputs of wq_a, wkv_a, the router and the gate/up
  projections), of the up-projections' outputs and of the kernel's q, k and v: backward rebuilds
  them (without a query latent, wq is the query's up-projection and is rebuilt too)
  attention (split over tp): the kernel's output, which is wo's input and which the kernel's
  backward reads too, in E5M6, at v's own width (DeepSeek's kernel needs no padding), H v / t
  (1.5 bytes); the log-sum-exp, H / t, in a bytes as counted above
  a dense SwiGLU (split over tp): its input, the gate and up outputs, in FP8       2f / t (1 byte)
  or an MoE block (T/tp tokens with sp): the router's scores and top-k bookkeeping, 2E + 4 in a
  bytes as above; per routed copy the dispatched row, the up-projections' input, d in FP8, its
  SwiGLU input 2h in FP8, and the expert's output d in a bytes, which the gate weight's gradient
  reads (the paper does not list the combine; this is the least its weighted sum needs, where
  fivefold also keeps the weighted copy); the shared experts' SwiGLU input, 2 n_shared h in FP8
  MoE block, bytes:   a (2d + rq + rkv + R + H + 2E + 4) + 1.5 H v + k (d + 2h + a d) + 2 n_shared h
  dense block, bytes: a (2d + rq + rkv + R + H) + 1.5 H v + 2f           (at tp = 1, sp off)
deepseek_block_bytes lists these terms. block_activation_elements_per_token returns their bytes
over 2, a bf16 element's (an FP8 byte is half an element, an E5M6 value three quarters);
block_activation_bytes prices the bytes themselves at any compute dtype. The layout counts the FP8
storage already, whatever PlanOptions.fp8 says: fp8_matmul_input_elements returns (0, 0) for it,
so that memory.py's FP8 adjustment is not applied twice, and routed_expert_elements_per_token
returns its routed copies' share, k (d + 2h + a d) bytes, with nothing more to move. Under
train.recompute "selective" or "full" fivefold's own recompute replaces the paper's and the layout
changes nothing: fivefold's counts. Its time (roofline.chunk_price): the backward first runs the
rebuilt norms, up-projections and SwiGLUs again. Not priced: with sp at tp > 1 the rebuilt
up-projections would gather their latents again.
"""

from __future__ import annotations

from typing import Literal

from fivefold.model.config import ModelConfig

ActivationLayout = Literal["fivefold", "megatron", "deepseek"]

FP8_BYTES = 1.0  # an e4m3 element: FP8 activations, weights and DeepSeek-V3's cached linear inputs (sec. 3.3.3)
E5M6_BYTES = 1.5  # its attention output: 1 sign, 5 exponent and 6 mantissa bits
BF16_BYTES = 2  # the element block_activation_elements_per_token counts the deepseek layout's bytes in


def block_activation_elements_per_token(m: ModelConfig, tp: int = 1, sp: bool = False,
                                        recompute: str = "none", layout: ActivationLayout = "fivefold",
                                        layer: int | None = None) -> float:
    """Elements saved for backward per token of one block on one rank (see the module docstring):
    block `layer` (a dense first block of an MoE model when below first_dense_layers), or without
    one a block of the model's kind (MoE for an MoE model). Under the deepseek layout, its bytes
    over a bf16 element's."""
    d, hd = m.dim, m.head_dim or m.dim // m.n_heads
    H, K = m.n_heads, m.n_kv_heads
    dq, dk = H * hd, K * hd
    if recompute == "full":
        return d / tp if sp else d
    moe = bool(m.moe.n_experts) and (layer is None or layer >= m.moe.first_dense_layers)
    if layout == "deepseek" and recompute == "none" and layout_applies(m, layout):
        return sum(deepseek_block_bytes(m, tp, sp, BF16_BYTES, layer).values()) / BF16_BYTES
    if m.latent.kv_lora_rank:
        return _latent_block_elements(m, tp, sp, recompute, moe)
    replicated = 6 * d + 2
    if sp:  # norms and residuals hold T/tp tokens; the projections keep the gathered inputs
        replicated = (4 * d + 2) / tp + 2 * d
        if moe:  # the MoE keeps its own T/tp tokens' input, not a gathered one
            replicated = (5 * d + 2) / tp + d
    if m.norm.position == "sandwich":  # two more norms, on the sub-layers' outputs (T/tp tokens with sp)
        replicated += (4 * d + 2) / (tp if sp else 1)
    attention = dq + 2 * dk + dq + H
    if recompute == "selective":  # the recomputed kernel keeps its inputs only
        attention = dq + 2 * dk + dq
    if m.norm.qk:  # an rsqrt per head, or one per token for q and for k over the whole projection
        attention += 2 * dq + 2 * dk + (2 if m.norm.qk_span == "all" else H + K)
    if layout_applies(m, layout):
        return (4 * d + 2) / (tp if sp else 1) + attention / tp + 3 * m.ffn_dim / tp
    return replicated + attention / tp + _ffn_elements(m, tp, sp, moe)


def per_op_block_elements(m: ModelConfig, tp: int = 1, sp: bool = False) -> float | None:
    """Elements per token torchtitan's per-op selective recompute (PlanOptions.selective_ac =
    "per_op"; roofline.py prices what it reruns) keeps of one dense grouped-query block: the
    block's input (the checkpoint's; split with sp), the outputs of its first, third, ... matmuls
    in forward order (wq, wv, gate, down: dq, dk and f split over tp, the down projection's d
    before tp's reduction), the attention kernel's output and log-sum-exp (dq + H, split) and,
    with sp, the two reduce-scatters' outputs (d / tp each), all in the compute dtype (under FP8
    too: the policy keeps matmul outputs). None for the blocks it has no count for (MoE, latent
    attention, post or sandwich norms): fivefold's selective count stands for them."""
    if m.moe.n_experts or m.latent.kv_lora_rank or m.norm.position != "pre":
        return None
    d, hd = m.dim, m.head_dim or m.dim // m.n_heads
    H, K = m.n_heads, m.n_kv_heads
    split = (2 * H * hd + K * hd + H + m.ffn_dim) / tp
    return (d / tp if sp else d) + split + d + (2 * d / tp if sp and tp > 1 else 0.0)


def layout_applies(m: ModelConfig, layout: ActivationLayout) -> bool:
    """Whether `layout` keeps other tensors than fivefold's for this model ("megatron": dense pre-norm
    grouped-query blocks; "deepseek": latent attention with experts)."""
    if layout == "megatron":
        return not m.moe.n_experts and not m.latent.kv_lora_rank and m.norm.position == "pre"
    if layout == "deepseek":
        return bool(m.latent.kv_lora_rank and m.moe.n_experts)
    return False


def deepseek_block_bytes(m: ModelConfig, tp: int = 1, sp: bool = False, act_bytes: float = BF16_BYTES,
                         layer: int | None = None) -> dict[str, float]:
    """Bytes per token the deepseek layout keeps for one block on one rank without recompute, by
    tensor (the module docstring's list): block `layer`, or without one an MoE block."""
    d, H, R, v = m.dim, m.n_heads, m.latent.qk_rope_head_dim, m.latent.v_head_dim
    s = tp if sp else 1
    out = {"norm inputs": 2 * d / s * act_bytes,  # x and h: the norms are rebuilt from them
           "down-projection outputs": (m.latent.q_lora_rank + m.latent.kv_lora_rank + R) / s * act_bytes,
           "attention output (E5M6)": H * v / tp * E5M6_BYTES,  # wo's input, read by the kernel's backward too
           "log-sum-exp": H / tp * act_bytes}
    if layer is not None and layer < m.moe.first_dense_layers:
        return {**out, "swiglu input (FP8)": 2 * m.ffn_dim / tp * FP8_BYTES}  # gate and up outputs
    h, k = m.moe.ffn_dim or m.ffn_dim, m.moe.top_k
    return {**out, "router": (2 * m.moe.n_experts + 4) / s * act_bytes,
            "routed inputs (FP8)": k * d / s * FP8_BYTES,  # dispatched in FP8, the up-projections' input
            "routed swiglu inputs (FP8)": k * 2 * h / s * FP8_BYTES,
            "routed outputs": k * d / s * act_bytes,  # the gate weight's gradient reads them
            "shared swiglu input (FP8)": 2 * m.moe.n_shared_experts * h / s * FP8_BYTES}


def _ffn_elements(m: ModelConfig, tp: int, sp: bool, moe: bool) -> float:
    """The MLP's part (the module docstring's list): a dense SwiGLU split over tp, or an MoE block's
    router and experts, whole on every token without sp and on this tp rank's T/tp tokens with sp."""
    if not moe:
        return 4 * m.ffn_dim / tp
    h = m.moe.ffn_dim or m.ffn_dim
    experts = 2 * m.moe.n_experts + 4 + m.moe.top_k * (4 * h + 3 * m.dim) + 4 * m.moe.n_shared_experts * h
    return experts / (tp if sp else 1)


def _latent_block_elements(m: ModelConfig, tp: int, sp: bool, recompute: str, moe: bool) -> float:
    """block_activation_elements_per_token for a latent-attention block (the module docstring's list)."""
    d, H, R = m.dim, m.n_heads, m.latent.qk_rope_head_dim
    n, v, rq, rkv = m.latent.qk_nope_head_dim, m.latent.v_head_dim, m.latent.q_lora_rank, m.latent.kv_lora_rank
    down = (2 * rq + 1 if rq else 0) + 2 * rkv + R + 1
    latents = (rq or (d if tp > 1 else 0)) + rkv + (R if tp > 1 else 0)
    norms = 6 * d + 2  # both block norms and their outputs, as for grouped-query attention
    if sp:  # the MLP's projections keep their gathered input instead of the norm's output
        norms = (5 * d + 2) / tp + d
    replicated = norms + (down / tp if sp else down) + latents
    heads = 3 * H * (n + R) + H * v  # q, k, padded v; the cut output the out projection reads
    if recompute != "selective":  # the kernel's own output and log-sum-exp, which recompute rebuilds
        heads += H * (n + R) + H
    return replicated + heads / tp + _ffn_elements(m, tp, sp, moe)


def fp8_matmul_input_elements(m: ModelConfig, tp: int = 1, sp: bool = False, recompute: str = "none",
                              layout: ActivationLayout = "fivefold") -> tuple[float, float]:
    """(moved, added) elements per token of one block under FP8 compute (the module docstring):
    `moved` of block_activation_elements_per_token's elements are kept in 1 byte instead of the
    compute dtype, and `added` FP8 copies (1 byte each) are kept beside them. Routed experts'
    elements are per mean expert load (routed_expert_elements_per_token scales them). The deepseek
    layout counts its FP8 storage itself: (0, 0)."""
    if recompute == "full":
        return 0.0, 0.0  # only each block's input is kept, and no linear layer reads it
    if layout == "deepseek" and recompute == "none" and layout_applies(m, layout):
        return 0.0, 0.0  # block_activation_elements_per_token has these bytes already
    d, hd, moe = m.dim, m.head_dim or m.dim // m.n_heads, m.moe.n_experts > 0
    if m.latent.kv_lora_rank:
        mla, H = m.latent, m.n_heads
        rq, rkv, R, v = mla.q_lora_rank, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.v_head_dim
        latents = (rq or (d if tp > 1 else 0)) + rkv + (R if tp > 1 else 0)
        attention, added = (d / tp if sp else d) + latents + H * v / tp, 0.0  # the cut output is wo's own copy
    else:
        out_proj = m.n_heads * hd / tp
        attention = d + (out_proj if recompute == "selective" else 0.0)
        added = 0.0 if recompute == "selective" else out_proj
    if not moe:
        gathered = d / tp if sp and layout_applies(m, layout) else d  # kept sharded
        return attention - d + 2 * gathered + m.ffn_dim / tp, added  # gate/up input, the down projection's input
    h, split = m.moe.ffn_dim or m.ffn_dim, (tp if sp else 1)
    shared = m.moe.n_shared_experts * h / split
    added += d / split if m.moe.n_shared_experts else 0.0
    return attention + routed_expert_elements_per_token(m, tp, sp, recompute)[1] + shared, added


def routed_expert_elements_per_token(m: ModelConfig, tp: int = 1, sp: bool = False,
                                     recompute: str = "none", layout: ActivationLayout = "fivefold"
                                     ) -> tuple[float, float]:
    """(elements, fp8 moved): of one MoE block's elements per token, those of its routed copies at
    the mean expert load, k (4h + 3d) (split over tp with sp), and the k (d + h) of them an FP8
    recipe keeps in 1 byte; the busiest expert rank holds `expert_imbalance` times these. The
    deepseek layout's: its routed copies' bytes over a bf16 element's, none left to move."""
    if not m.moe.n_experts or recompute == "full":
        return 0.0, 0.0
    if layout == "deepseek" and recompute == "none" and layout_applies(m, layout):
        routed = ("routed inputs (FP8)", "routed swiglu inputs (FP8)", "routed outputs")
        kept = deepseek_block_bytes(m, tp, sp, BF16_BYTES)
        return sum(kept[k] for k in routed) / BF16_BYTES, 0.0
    h, split = m.moe.ffn_dim or m.ffn_dim, (tp if sp else 1)
    return m.moe.top_k * (4 * h + 3 * m.dim) / split, m.moe.top_k * (m.dim + h) / split


def block_activation_bytes(m: ModelConfig, micro_batch: int, seq_len: int, tp: int = 1, sp: bool = False,
                           recompute: str = "none", bytes_per_element: int = 4,
                           layout: ActivationLayout = "fivefold", layer: int | None = None) -> float:
    """Bytes one rank keeps for backward for one block and one micro-batch of (micro_batch, seq_len):
    block_activation_elements_per_token's elements at bytes_per_element, or the deepseek layout's
    own bytes (its FP8 and E5M6 tensors at 1 and 1.5 bytes whatever the compute dtype)."""
    tokens = micro_batch * seq_len
    if layout == "deepseek" and recompute == "none" and layout_applies(m, layout):
        return sum(deepseek_block_bytes(m, tp, sp, bytes_per_element, layer).values()) * tokens
    return block_activation_elements_per_token(m, tp, sp, recompute, layout, layer) * tokens * bytes_per_element
