"""The model section of the configuration (`[model]`): the shape of the network, nothing about how it
is split. Its own module so that the presets (model/presets.py) and the whole schema (config.py) can
both use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ModelConfig:
    preset: str = ""  # name from fivefold.model.presets; its shape is the base that other model keys override
    dim: int = 64  # hidden size d_model
    n_layers: int = 8  # transformer blocks
    n_heads: int = 4  # query heads
    n_kv_heads: int = 4  # key/value heads (grouped-query attention when < n_heads)
    head_dim: int = 0  # per-head width; 0 = dim // n_heads
    ffn_dim: int = 128  # SwiGLU hidden width of dense blocks
    vocab_size: int = 0  # 0 = the tokenizer's vocabulary padded to data.vocab_multiple
    tie_embeddings: bool = False  # output head shares the token embedding matrix
    qk_norm: bool = False  # RMSNorm on queries and keys before RoPE (Qwen3, OLMo 2, Gemma 3)
    qk_norm_span: Literal["head", "all"] = "head"  # over each head (Qwen3, Gemma 3) or the whole projection (OLMo 2)
    # Where the block's norms sit: "pre" (Llama: x + f(norm(x))), "post" (OLMo 2: x + norm(f(x))),
    # "sandwich" (Gemma 2/3: x + norm(f(norm(x)))).
    norm_position: Literal["pre", "post", "sandwich"] = "pre"
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight); Gemma: 1, its weights stored as offsets
    # RMSNorm's weight applied in fp32 before the cast back to the input's dtype (OLMo 2; Gemma's norms,
    # with norm_offset, always are); false: cast, then weighted (Llama, Qwen, Mistral). Equal in fp32.
    norm_weight_fp32: bool = False
    embed_scale: bool = False  # token embeddings times sqrt(dim) (Gemma)
    activation: Literal["silu", "gelu_tanh"] = "silu"  # the gate's nonlinearity: SwiGLU, or GeGLU (Gemma)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base frequency
    # RoPE scaling, for contexts past the pre-training length (model/rope.py): "" = plain RoPE; "linear"
    # (positions divided by rope_factor; Gemma 3's global layers); "llama3" (Llama 3.1+: low frequencies
    # divided by rope_factor, a smooth ramp to the high ones); "yarn" (Peng et al. 2023, NTK-by-parts plus an
    # attention factor on cos/sin; DeepSeek-V3, gpt-oss, Qwen's long-context variants).
    rope_scaling: Literal["", "linear", "llama3", "yarn"] = ""
    rope_factor: float = 1.0  # how much longer the extended context is than rope_original_context
    rope_original_context: int = 0  # the pre-training context (HF original_max_position_embeddings); llama3, yarn
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths past original_context / this are fully scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths under original_context / this are kept
    rope_beta_fast: float = 32.0  # yarn: rotations below which a dimension is interpolated (ramp's start)
    rope_beta_slow: float = 1.0  # yarn: rotations above which a dimension is kept (ramp's end)
    rope_mscale: float = 0.0  # yarn: attention factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    rope_mscale_all_dim: float = 0.0  # (DeepSeek's form); both 0 = 0.1 ln(factor) + 1
    rope_attention_factor: float = 0.0  # yarn: cos/sin times this; 0 = derived as above
    rope_truncate: bool = True  # yarn: round the ramp's ends to whole dimensions (gpt-oss: false)
    local_rope_theta: float = 0.0  # RoPE base of sliding-window layers, unscaled (Gemma 3: 10000); 0 = rope_theta
    attention_scale: float = 0.0  # softmax scale; 0 = 1/sqrt(q/k head width) (Gemma 3: query_pre_attn_scalar**-0.5)
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2/2.5, gpt-oss)
    out_bias: bool = False  # a bias on attention's output projection (gpt-oss)
    # What a query may see beyond causality (model/masks.py). A sliding window of w tokens, the query
    # included (Mistral, Gemma 2/3, gpt-oss); 0 = the whole causal prefix.
    sliding_window: int = 0
    # Which layers slide: "sliding" / "full", repeated over the layers (Gemma 3: five "sliding" then one
    # "full"; gpt-oss: "sliding", "full"); empty = every layer slides when sliding_window > 0.
    window_pattern: tuple[str, ...] = ()
    attention_sinks: bool = False  # a learned logit per head joins every softmax's denominator (gpt-oss)
    # The attention kernel: "auto" = SDPA (is_causal) when only causality masks, else FlexAttention on
    # CUDA and the exact blockwise path elsewhere; "sdpa" = SDPA only (refuses documents, windows, sinks);
    # "flex" = FlexAttention for every layer (CUDA: it has no backward on CPU); "blockwise" = the exact
    # tiled path on any device (model/blockwise.py). Ring attention always runs the blockwise path.
    attention_backend: Literal["auto", "sdpa", "flex", "blockwise"] = "auto"
    # Multi-head latent attention (DeepSeek-V2 sec. 2.1, DeepSeek-V3 sec. 2.1.1); on when kv_lora_rank > 0,
    # then n_kv_heads and head_dim are unused. Widths are per token (latents) or per head.
    kv_lora_rank: int = 0  # width of the joint key/value latent (DeepSeek-V3: 512); 0 = grouped-query attention
    q_lora_rank: int = 0  # width of the query latent (DeepSeek-V3: 1536); 0 = queries projected from x directly
    qk_nope_head_dim: int = 0  # per-head query/key width without RoPE (DeepSeek-V3: 128)
    qk_rope_head_dim: int = 0  # per-head query/key width with RoPE, its key shared by all heads (DeepSeek-V3: 64)
    v_head_dim: int = 0  # per-head value width (DeepSeek-V3: 128)
    init_std: float = 0.02  # std of the normal init; residual output projections get std/sqrt(2 n_layers)
    # Mixture of experts (n_experts = 0 means a dense model).
    n_experts: int = 0  # routed experts per MoE block
    top_k: int = 2  # experts each token is routed to
    moe_ffn_dim: int = 0  # hidden width of one expert; 0 = ffn_dim
    n_shared_experts: int = 0  # always-on experts of width moe_ffn_dim each (DeepSeek, Qwen2-MoE)
    first_dense_layers: int = 0  # leading blocks that keep a dense FFN (DeepSeek-V3: 3)
    router_score: Literal["softmax", "sigmoid"] = "softmax"  # routing probabilities
    norm_topk: bool = True  # renormalise the top-k scores to sum to 1
    # Group-limited routing (DeepSeek-V3 sec. 2.1.2): experts in n_expert_groups equal groups, a group
    # scored by the sum of its top-2 scores; each token picks top_k experts within its topk_groups best groups.
    n_expert_groups: int = 0  # expert groups (DeepSeek-V3: 8); 0 or 1 = no group limit
    topk_groups: int = 0  # groups each token may use (DeepSeek-V3: 4); used when n_expert_groups > 1
    moe_bias: bool = False  # biases on the router and on every expert's projections (gpt-oss)
    # gpt-oss's clamped SwiGLU in the experts: gate <= limit, |up| <= limit, out = gate sigmoid(1.702 gate) (up + 1);
    # 0 = plain SwiGLU
    swiglu_limit: float = 0.0
    moe_routed_scale: float = 1.0  # factor on the routed experts' weights (DeepSeek-V3: 2.5); 1 = none
    # Load balancing (DeepSeek-V3 sec. 2.1.2): either or both.
    # aux-loss-free: per-expert routing bias step u after each step (DeepSeek-V3: 0.001); 0 = off
    moe_bias_update: float = 0.0
    moe_aux_loss: float = 0.0  # weight alpha of the sequence-wise balance loss (DeepSeek-V3: 0.0001); 0 = off
    # 0 = dropless; else an expert takes at most cf x (tokens x top_k / n_experts) copies per rank,
    # overflow dropped and counted
    moe_capacity_factor: float = 0.0

    def layer_window(self, layer: int) -> int:
        """The sliding window of block `layer` (0: the whole causal prefix)."""
        if not self.sliding_window or not self.window_pattern:
            return self.sliding_window
        return self.sliding_window if self.window_pattern[layer % len(self.window_pattern)] == "sliding" else 0
