"""What a published run is and the FLOP formulas its source states (benchmarks/published_runs.py lists
the runs).

GPT-3-shaped models (Megatron-LM's GPT, llm-foundry's MPT) have a GeLU MLP of width 4h; fivefold's
MLP is SwiGLU, so `gpt()` gives them ffn_dim = 8h/3 rounded to a multiple of 128, the same 8h^2 MLP
parameters per block (3 h f = 8 h^2), within 0.1%; the script prints each model's parameter count beside the
source's. They also have learned position embeddings, LayerNorm and biases (fivefold: RoPE,
RMSNorm, no biases), a few parameters per block that change no FLOP count by 0.1%.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# What a published figure is; planner_vs_published.predicted() gives the planner's in the same unit.
METRICS = {
    "tokens_per_s_per_gpu": "tokens/s/GPU",
    "tflops_model": "model TFLOP/s/GPU",  # MFU numerator, recomputation not counted
    "tflops_hardware": "hardware TFLOP/s/GPU",  # HFU numerator, recomputation counted
    "mfu": "MFU",
    "hfu_over_mfu": "HFU / MFU",
    "hfu_korthikanti_over_mfu": "HFU / MFU (Korthikanti's count)",  # planner/conventions.py
    "gpu_hours_per_trillion": "GPU-hours / 1T tokens",
}


@dataclass(frozen=True)
class Run:
    name: str
    source: str  # paper and table, or the file and commit it was read from
    gpu: str  # the catalog entry the GPU is priced as (hardware replaces fields where it differs)
    world: int
    overrides: tuple[str, ...]  # --section.key=value, as `fivefold train` takes them
    metric: str  # a METRICS key
    published: float
    convention: str  # the source's FLOP convention, in words
    overlap: str  # the source's overlap settings, in words
    options: dict[str, object] = field(default_factory=dict)  # PlanOptions fields that match them
    flops_per_token: float = 0.0  # the source's own training FLOPs per token, by its formula (0: not stated)
    hardware: dict[str, float] = field(default_factory=dict)  # Hardware fields replaced, cited in `differs`
    params_b: float = 0.0  # the source's parameter count (billions): the shape check
    assumed: str = ""  # what the source does not state and this row chose
    differs: str = ""  # how fivefold's run differs from the published one
    recompute_fit: bool = False  # recomputation not stated: the least the planner finds fitting is used
    # bytes per parameter of weight, gradient and optimizer state as the source keeps them (the planner's
    # --bytes): the gradient's is also what its data-parallel reduction sends (FP32_GRADS: reduced in fp32)
    state_bytes: tuple[float, float, float] = (2.0, 2.0, 12.0)


# bf16 weights, gradients accumulated and reduced in fp32, fp32 master + Adam: Megatron-LM with bf16
# (arguments.py turns accumulate_allreduce_grads_in_fp32 on), FSDP2's default reduce_dtype (torchtitan),
# Composer's mixed precision DEFAULT (llm-foundry)
FP32_GRADS = (2.0, 4.0, 12.0)


def gpt(h: int, layers: int, heads: int, vocab: int, seq: int, tied: bool) -> tuple[str, ...]:
    """A GPT-3-shaped model (Megatron-LM) as fivefold overrides: SwiGLU of 8h/3 (module docstring)."""
    ffn = round(8 * h / 3 / 128) * 128
    return (f"--model.dim={h}", f"--model.n_layers={layers}", f"--model.n_heads={heads}", f"--model.n_kv_heads={heads}",
            f"--model.ffn_dim={ffn}", f"--model.vocab_size={vocab}", f"--model.tie_embeddings={str(tied).lower()}",
            f"--train.seq_len={seq}")


def layout(dp: int, tp: int = 1, pp: int = 1, batch: int = 1, micro: int = 1, **more: object) -> tuple[str, ...]:
    """Degrees, global batch (sequences) and micro-batch as overrides; `more` as parallel.* or train.* keys."""
    keys = {"parallel.dp": dp, "parallel.tp": tp, "parallel.pp": pp, "train.global_batch": batch,
            "train.micro_batch": micro}
    for k, v in more.items():
        keys[k if "." in k else ("train." if k in ("recompute", "dtype") else "parallel.") + k] = v
    return tuple(f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in keys.items())


def megatron_2021_flops(h: int, layers: int, seq: int, vocab: int) -> float:
    """Narayanan et al. 2021, sec. 5.1: F = 96 B s l h^2 (1 + s/6h + V/16lh) per iteration, with
    activation recomputation (a second forward) counted and the causal attention counted in full;
    per token, divide by B s (the formula as reimplemented, e.g. in pytorch/PiPPy's GPT-2 example,
    which cites the paper's page 8)."""
    return 96 * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))


def megatron_model_flops(h: int, layers: int, seq: int, vocab: int) -> float:
    """Model FLOPs per token of a GPT (MHA, 4h GeLU MLP, no recompute), causal attention in full:
    72 l h^2 (1 + s/6h + V/12lh), Korthikanti et al. 2022 (as quoted in NVIDIA/Megatron-LM issue
    #523), and what megatron/training/training.py num_floating_point_operations (commit f2e5db402c,
    2024-07) computes for such a model: 12 s l h^2 ((2 + s/h) + 4 + V/2lh) per sequence."""
    return 72 * layers * h * h * (1 + seq / (6 * h) + vocab / (12 * layers * h))


def torchtitan_flops(params: float, embedding: float, layers: int, heads: int, head_dim: int, seq: int) -> float:
    """torchtitan's MFU numerator (torchtitan/utils.py get_num_flop_per_token, commit 9dec370, 2024-12):
    6 (N - embedding) + 12 l h q t, the causal mask not halving the attention term."""
    return 6 * (params - embedding) + 12 * layers * heads * head_dim * seq


def mpt_flops(params: float, layers: int, d_model: int, seq: int) -> float:
    """llm-foundry's MFU numerator per token (scripts/train/benchmarking/collect_results.py @8c8dd48, and its
    README's formula): 3 (2 N s + 4 l d s^2) per sequence, i.e. 6 N + 12 l d s per token, N the run's
    NumParams (embeddings included), the causal mask not halving the attention term."""
    return 6 * params + 12 * layers * d_model * seq


def megatron_core_flops(h: int, layers: int, seq: int, vocab: int, tp: int, heads: int, *, groups: int = 0,
                        head_dim: int = 0, ffn: int = 0, moe_ffn: int = 0, top_k: int = 0, shared_ffn: int = 0,
                        dense_layers: int = 0, mtp: int = 0, mla: tuple[int, int, int, int, int] = ()) -> float:
    """Megatron-Core's model FLOPs per token as Megatron-Bridge computes them for its performance tables
    (src/megatron/bridge/training/utils/flop_utils.py num_floating_point_operations, transformer_flops,
    @97ad8cc6f, the 25.11 release; the same terms as Megatron-LM training.py): 12 l h (3/2 f) for SwiGLU MLPs
    (dense blocks, top-k routed experts, shared experts; router not counted), GQA attention
    12 l h^2 (1 + g/n + s/2h) (q n / h), the causal mask halving the core attention, or MLA's
    6 l (q_lora (h + n (qk + rope) + 1) + kv_lora (h + n (qk + v) + 1) + h rope + n v h + s n (qk + rope)/2
    + s n v / 2), the MTP layers counted as blocks plus 6 (3 h + 2 h^2) each, and the logits 6 h V' (mtp + 1),
    V' the vocabulary padded to a multiple of 128 tp. mla = (q_lora, kv_lora, qk_head, rope_head, v_head)."""
    n_moe = layers - dense_layers if moe_ffn else 0
    n_dense = layers - n_moe
    n_moe, n_dense = (n_moe + mtp, n_dense) if moe_ffn else (n_moe, n_dense + mtp)
    total = layers + mtp
    mlp = 12 * h * 1.5 * (ffn * n_dense + (moe_ffn * top_k + shared_ffn) * n_moe)
    if mla:
        q_lora, kv_lora, qk, rope, v = mla
        attn = 6 * total * (q_lora * (h + heads * (qk + rope) + 1) + kv_lora * (h + heads * (qk + v) + 1)
                            + h * rope + heads * v * h + seq * heads * (qk + rope) / 2 + seq * heads * v / 2)
    else:
        attn = 12 * total * h * h * (1 + groups / heads + seq / h / 2) * (heads * head_dim / h)
    padded = -(-vocab // (128 * tp)) * 128 * tp
    return mlp + attn + 6 * mtp * (3 * h + 2 * h * h) + 6 * h * padded * (mtp + 1)
