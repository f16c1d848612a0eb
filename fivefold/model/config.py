"""The model section of the configuration (`[model]`): the shape of the network, nothing about how it
is split. The shape's plain numbers sit at the top; each part of the block that a model family
varies is a table of its own, taken whole by the code that computes it:

    [model]            dim, n_layers, heads, ffn_dim, vocab, tied embeddings, activation, init
    [model.rope]       RopeConfig: RoPE's base and its long-context scaling       (model/rope.py)
    [model.attention]  AttentionConfig: windows, sinks, softmax scale, biases, kernel (attention.py)
    [model.latent]     LatentConfig: multi-head latent attention's ranks and widths  (attention.py)
    [model.norm]       NormConfig: where the norms sit, their eps and weight, q/k norms
    [model.moe]        MoEConfig: experts, routing, balancing                          (model/moe.py)

As Hugging Face nests `rope_scaling` in a config.json and torchtitan an `MoEArgs` in its model
args. It lives in model/ because the model stands on nothing else of fivefold (the presets,
model/presets.py, are ModelConfigs too); fivefold/config/schema.py composes it into the whole schema.
So does `[lora]` (LoRAConfig, below): a section of its own, since the adapters leave the model's
shape alone, and here for the same reason (model/lora.py reads it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0  # RoPE base frequency
    # Scaling, for contexts past the pre-training length (model/rope.py): "" = plain RoPE; "linear"
    # (positions divided by factor; Gemma 3's global layers); "llama3" (Llama 3.1+: low frequencies
    # divided by factor, a smooth ramp to the high ones); "yarn" (Peng et al. 2023, NTK-by-parts plus an
    # attention factor on cos/sin; DeepSeek-V3, gpt-oss, Qwen's long-context variants).
    scaling: Literal["", "linear", "llama3", "yarn"] = ""
    factor: float = 1.0  # how much longer the extended context is than original_context
    original_context: int = 0  # the pre-training context (HF original_max_position_embeddings); llama3, yarn
    low_freq_factor: float = 1.0  # llama3: wavelengths past original_context / this are fully scaled
    high_freq_factor: float = 4.0  # llama3: wavelengths under original_context / this are kept
    beta_fast: float = 32.0  # yarn: rotations below which a dimension is interpolated (ramp's start)
    beta_slow: float = 1.0  # yarn: rotations above which a dimension is kept (ramp's end)
    mscale: float = 0.0  # yarn: attention factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    mscale_all_dim: float = 0.0  # (DeepSeek's form); both 0 = 0.1 ln(factor) + 1
    attention_factor: float = 0.0  # yarn: cos/sin times this; 0 = derived as above
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions (gpt-oss: false)
    local_theta: float = 0.0  # RoPE base of sliding-window layers, unscaled (Gemma 3: 10000); 0 = theta


@dataclass(frozen=True)
class AttentionConfig:
    # What a query may see beyond causality (model/masks.py). A sliding window of `window` tokens, the
    # query included (Mistral, Gemma 2/3, gpt-oss); 0 = the whole causal prefix.
    window: int = 0
    # Which layers slide: "sliding" / "full", repeated over the layers (Gemma 3: five "sliding" then one
    # "full"; gpt-oss: "sliding", "full"); empty = every layer slides when window > 0.
    window_pattern: tuple[str, ...] = ()
    sinks: bool = False  # a learned logit per head joins every softmax's denominator (gpt-oss)
    scale: float = 0.0  # softmax scale; 0 = 1/sqrt(q/k head width) (Gemma 3: query_pre_attn_scalar**-0.5)
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2/2.5, gpt-oss)
    out_bias: bool = False  # a bias on attention's output projection (gpt-oss)
    # The kernel: "auto" = SDPA (is_causal) when only causality masks, else FlexAttention on CUDA and the
    # exact blockwise path elsewhere; "sdpa" = SDPA only (refuses documents, windows, sinks); "flex" =
    # FlexAttention for every layer (CUDA: it has no backward on CPU); "blockwise" = the exact tiled path
    # on any device (model/blockwise.py). Ring attention always runs the blockwise path.
    backend: Literal["auto", "sdpa", "flex", "blockwise"] = "auto"

    def layer_window(self, layer: int) -> int:
        """The sliding window of block `layer` (0: the whole causal prefix)."""
        if not self.window or not self.window_pattern:
            return self.window
        return self.window if self.window_pattern[layer % len(self.window_pattern)] == "sliding" else 0


@dataclass(frozen=True)
class LatentConfig:
    # Multi-head latent attention (DeepSeek-V2 sec. 2.1, DeepSeek-V3 sec. 2.1.1); on when kv_lora_rank > 0,
    # then model.n_kv_heads and model.head_dim are unused. Widths are per token (latents) or per head.
    kv_lora_rank: int = 0  # width of the joint key/value latent (DeepSeek-V3: 512); 0 = grouped-query attention
    q_lora_rank: int = 0  # width of the query latent (DeepSeek-V3: 1536); 0 = queries projected from x directly
    qk_nope_head_dim: int = 0  # per-head query/key width without RoPE (DeepSeek-V3: 128)
    qk_rope_head_dim: int = 0  # per-head query/key width with RoPE, its key shared by all heads (DeepSeek-V3: 64)
    v_head_dim: int = 0  # per-head value width (DeepSeek-V3: 128)


@dataclass(frozen=True)
class NormConfig:
    # Where the block's norms sit: "pre" (Llama: x + f(norm(x))), "post" (OLMo 2: x + norm(f(x))),
    # "sandwich" (Gemma 2/3: x + norm(f(norm(x)))).
    position: Literal["pre", "post", "sandwich"] = "pre"
    offset: float = 0.0  # RMSNorm scales by (offset + weight); Gemma: 1, its weights stored as offsets
    eps: float = 1e-5  # RMSNorm epsilon
    # RMSNorm's weight applied in fp32 before the cast back to the input's dtype (OLMo 2; Gemma's norms,
    # with offset, always are); false: cast, then weighted (Llama, Qwen, Mistral). Equal in fp32.
    weight_fp32: bool = False
    qk: bool = False  # RMSNorm on queries and keys before RoPE (Qwen3, OLMo 2, Gemma 3)
    qk_span: Literal["head", "all"] = "head"  # over each head (Qwen3, Gemma 3) or the whole projection (OLMo 2)


@dataclass(frozen=True)
class MoEConfig:
    n_experts: int = 0  # routed experts per MoE block; 0 = a dense model
    top_k: int = 2  # experts each token is routed to
    ffn_dim: int = 0  # hidden width of one expert; 0 = model.ffn_dim
    n_shared_experts: int = 0  # always-on experts of width ffn_dim each (DeepSeek, Qwen2-MoE)
    first_dense_layers: int = 0  # leading blocks that keep a dense FFN (DeepSeek-V3: 3)
    router_score: Literal["softmax", "sigmoid"] = "softmax"  # routing probabilities
    norm_topk: bool = True  # renormalise the top-k scores to sum to 1
    # Group-limited routing (DeepSeek-V3 sec. 2.1.2): experts in n_groups equal groups, a group scored by
    # the sum of its top-2 scores; each token picks top_k experts within its topk_groups best groups.
    n_groups: int = 0  # expert groups (DeepSeek-V3: 8); 0 or 1 = no group limit
    topk_groups: int = 0  # groups each token may use (DeepSeek-V3: 4); used when n_groups > 1
    linear_bias: bool = False  # biases on the router and on every expert's projections (gpt-oss)
    # gpt-oss's clamped SwiGLU in the experts: gate <= limit, |up| <= limit, out = gate sigmoid(1.702 gate) (up + 1);
    # 0 = plain SwiGLU
    swiglu_limit: float = 0.0
    routed_scale: float = 1.0  # factor on the routed experts' weights (DeepSeek-V3: 2.5); 1 = none
    # Load balancing (DeepSeek-V3 sec. 2.1.2): either or both.
    # aux-loss-free: per-expert routing bias step u after each step (DeepSeek-V3: 0.001); 0 = off
    bias_update: float = 0.0
    aux_loss: float = 0.0  # weight alpha of the sequence-wise balance loss (DeepSeek-V3: 0.0001); 0 = off
    # 0 = dropless; else an expert takes at most cf x (tokens x top_k / n_experts) copies per rank,
    # overflow dropped and counted
    capacity_factor: float = 0.0


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
    embed_scale: bool = False  # token embeddings times sqrt(dim) (Gemma)
    activation: Literal["silu", "gelu_tanh"] = "silu"  # the gate's nonlinearity: SwiGLU, or GeGLU (Gemma)
    init_std: float = 0.02  # std of the normal init; residual output projections get std/sqrt(2 n_layers)
    # depths of multi-token prediction (DeepSeek-V3 sec. 2.2; HF num_nextn_predict_layers): depth k also
    # predicts the token k + 1 after the next, through a block of its own and the shared embedding and
    # head; trained with weight train.mtp_weight, unused when sampling (model/transformer.py MTPLayer)
    mtp_layers: int = 0
    rope: RopeConfig = field(default_factory=RopeConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    latent: LatentConfig = field(default_factory=LatentConfig)
    norm: NormConfig = field(default_factory=NormConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)


# QLoRA's NF4 blocks (Dettmers et al. 2023; torchao's to_nf4 defaults): one absmax scale per 64 elements,
# those scales quantised to int8 in groups of 256 (model/lora.py NF4Base; the planner prices them)
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
NF4_GROUP = NF4_BLOCK * NF4_SCALER_BLOCK  # elements per group of scales: an NF4 weight's numel divides by it

# fivefold's linear layers by their attribute name -> the module name PEFT's target_modules matches
# (Hugging Face's names for the same layers: LlamaAttention, LlamaMLP, DeepseekV3Attention, ...)
PEFT_NAMES = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
              "wq_a": "q_a_proj", "wq_b": "q_b_proj", "wkv_a": "kv_a_proj_with_mqa", "wkv_b": "kv_b_proj",
              "gate": "gate_proj", "up": "up_proj", "down": "down_proj", "eh_proj": "eh_proj"}


@dataclass(frozen=True)
class LoRAConfig:
    # LoRA (Hu et al. 2021; model/lora.py): the model's weights frozen, a low-rank update trained beside the
    # chosen linear layers, y = x W^T + scaling (dropout(x) A^T) B^T; named and initialised as PEFT does
    rank: int = 0  # r, the update's rank; 0 = off (every weight trains)
    alpha: float = 8.0  # scaling = alpha / r (PEFT's lora_alpha; its default with r = 8)
    dropout: float = 0.0  # on the adapter's input (PEFT's lora_dropout)
    rslora: bool = False  # scaling = alpha / sqrt(r) (Kalajdzievski 2023; PEFT's use_rslora)
    # the layers that get an adapter, in the names PEFT users write (target_modules): q_proj, k_proj, v_proj,
    # o_proj, gate_proj, up_proj, down_proj; latent attention's q_a_proj, q_b_proj, kv_a_proj_with_mqa,
    # kv_b_proj; MTP's eh_proj. Routed experts (stacked weights, no linear layers) get none.
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) whose adapters training
    # continues from; "" = new adapters (A drawn, B zero). The base comes from checkpoint.init_from.
    init_from: str = ""
    # the frozen base of each adapted layer: "" = kept in the run's parameter dtype; "nf4" = QLoRA's 4-bit
    # NormalFloat (Dettmers et al. 2023) through torchao's NF4Tensor, 64-element blocks with double-quantised
    # scales, dequantised into the compute dtype at each use (model/lora.py NF4Base)
    base_dtype: Literal["", "nf4"] = ""
