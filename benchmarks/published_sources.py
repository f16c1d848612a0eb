"""Where the published runs of published_runs.py come from: each source's name and commit, the settings
its rows share (overlap, kernels, the options a row is priced under), what its rows assume or differ
in, and the builders of a source's family of rows (llm-foundry's table, torchtitan's H200 runs,
torchao's B200 rows). Every figure is the source's, as in published_runs.py.
"""

from __future__ import annotations

from benchmarks.published_common import (
    FP32_GRADS,
    Run,
    gpt,
    layout,
    mpt_flops,
    torchtitan_flops,
)

# Llama 3.1 8B: 8.03B parameters (presets.PUBLISHED_PARAMS), a 128256 x 4096 embedding.
L8B_FLOPS = torchtitan_flops(8.03e9, 128256 * 4096, 32, 32, 128, 8192)

MEGATRON_2021 = "Narayanan et al. 2021 (SC21), Table 1; layouts: Megatron-LM examples/sc21/run_table_1.sh @6985e58"
MEGATRON_2021_OVERLAP = ("tp all-reduces block; DDP-impl local: gradients all-reduced after the backward (no overlap); "
                         "pipeline p2p with scatter/gather")
MEGATRON_2024 = "NVIDIA/Megatron-LM README @f2e5db402c (2024-07-15), images/model_table.png (H100 weak scaling)"
MEGATRON_2024_OVERLAP = ("--overlap-grad-reduce --overlap-param-gather (distributed optimizer: ZeRO-1) "
                         "--tp-comm-overlap; pipeline p2p overlapped by default")
# Grand Teton H100: 96 GB HBM2e, 2.4 TB/s, 500 W (perf. docs); "the actual peak TFLOPs number is between SXM and
# NVL" (benchmarks/llama3_h100_202412_torchtitan.md, footnote 2): between the NVL's 835 (1,671 with sparsity, its
# data sheet) and the SXM's 989, priced at the middle, 912 (FP8 twice that)
TITAN_H100 = {"memory_bytes": 96e9, "hbm_bw": 2.4e12, "peak_flops": 912e12, "fp8_peak_flops": 1824e12}
# torchtitan's selective AC is its per-op policy (activation_checkpoint.py, "op"): every other matmul of a block
# and all its elementwise kernels rerun in backward, the attention kernel's output saved
TITAN_SAC = {"selective_ac": "per_op"}
# torchtitan's SDPA on H100 and H200 through mid-2025 ran its flash backend, FlashAttention-2: torch before 2.9
# put flash first (pytorch/pytorch#142132, Dec 2024: "sdpa 329 | cudnn 631" TFLOP/s on H100), and torchtitan
# @e7c0cae pins [FLASH, EFFICIENT, MATH], cuDNN first only on sm100 (models/attention.py, PR #1196)
TITAN_FA2 = {"attention_kernel": "fa2"}
TITAN_DIFF = ("H100 here: 96 GB HBM2e at 2.4 TB/s and 500 W, its peak between the NVL's and the SXM's (the source's "
              "footnote), priced at 912 TFLOP/s, the middle; what 500 W leaves of the clocks no source states; "
              "torchtitan's repeat_kv copies of K and V before SDPA are not priced (fivefold's SDPA takes the "
              "grouped heads; about 1% of the step)")
# Megatron-LM 2021 (and Korthikanti et al. 2022) fused its elementwise kernels (apex's LayerNorm, bias + GeLU,
# scale-mask-softmax) and, before FlashAttention, wrote the whole score matrix out: Q K^T, softmax, P V.
M21 = {"causal_flops": "full", "tp_overlap": False, "kernels": "fused", "attention_kernel": "materialized"}
M21_DIFF = ("biases, hidden dropout, LayerNorm and GeLU (the source's) priced as fivefold's RMSNorm and SwiGLU; "
            "p2p_communication.py's batch_isend_irecv is waited for and followed by a torch.cuda.synchronize() on "
            "every exchange (stages in lock-step; priced as messages the next stage waits for, about 1-4% of these "
            "steps by their sizes); not explained: the planner is 8-20% fast here; the catalog's A100 matmul "
            "fraction (86.9%) is a 2024 measurement, what 2021's cuBLAS reached at these shapes is not in the "
            "sources read")
# Megatron-Core 2024: Transformer Engine's fused kernels (norms, bias + activation, rotary) and fused attention,
# cuDNN's on Hopper (TE's get_attention_backend prefers FusedAttention on sm90+: the catalog's SDPA curve, the
# default attention_kernel), its kernels keeping for backward what Korthikanti et al. 2022 count (activations =
# "megatron"); the same for Megatron-Bridge and the MoE model zoo below
M24 = {"causal_flops": "full", "tp_overlap": True, "kernels": "fused", "activations": "megatron",
       "param_gather_overlap": True}
# NVLink 400 GB/s bidirectional (philisun.com H800 vs H100 comparison): 200 per direction; nvidia-smi reports an
# H800's memory as 81559 MiB (as it does the H100 80GB HBM3's; the catalog keeps the data sheet's 80 GB)
H800 = {"intra_bw": 200e9, "memory_bytes": 81559 * 2**20}
FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md @8c8dd48 (tables as of 5e85bd6, #838)"
FOUNDRY_CONVENTION = "MFU: 6 N + 12 l d s (N with embeddings), causal in full, of 989 (H100) / 312 (A100)"
FOUNDRY_OVERLAP = ("Composer FSDP1: limit_all_gathers (the yamls); forward/backward prefetch not set by the sweep "
                   "(Composer's defaults)")
FOUNDRY_DIFF = ("MPT: GeLU MLP of 4d (SwiGLU 8d/3 here, module docstring), LayerNorm with biases and biases on every "
                "linear, a learned position embedding of seq x d (in NumParams); no compile, each LayerNorm "
                "(low_precision_layernorm) and GeLU one kernel, priced as fivefold's eager RMSNorm, SwiGLU and "
                "RoPE, which move several times their bytes: priced fused instead, the planner is 21-55% fast on "
                "these rows, so the eager pricing hides an optimism it does not explain; attn_impl triton "
                "(llm-foundry v0.3.0's Triton flash attention, not FlashAttention-2; submit_benchmarks.py) priced "
                "at FlashAttention-2's rate")
FOUNDRY_ASSUMED = "MP mode DEFAULT read as Composer's: bf16 compute and gathers, fp32 gradient reduction"
def mpt_row(name: str, row: str, shape: tuple[int, int, int], gpus: int, batch: int, micro: int, recompute: str,
         mfu: float, params: int, table: str, differs: str = "", gpu: str = "h100") -> Run:
    """One row of llm-foundry's table: `shape` (d, layers, heads) as in its yamls, seq 2048, FSDP FULL_SHARD in
    bf16, MFU by its own formula (mpt_flops) of NumParams `params`; `table` the row's other columns."""
    d, layers, heads = shape
    return Run(name, f"{FOUNDRY}, {row}, seq 2048, {gpus} GPUs", gpu, gpus,
               (*gpt(d, layers, heads, 50368, 2048, True), *layout(gpus, batch=batch, micro=micro, zero=3,
                                                                   param_dtype="bf16", dtype="bf16",
                                                                   recompute=recompute)),
               "mfu", mfu, FOUNDRY_CONVENTION, FOUNDRY_OVERLAP,
               {"causal_flops": "full", "zero3_prefetch": True, "kernels": "eager", "attention_kernel": "fa2"},
               mpt_flops(params, layers, d, 2048), params_b=params / 1e9,
               assumed=f"{FOUNDRY_ASSUMED}; the table: {table}",
               differs="; ".join(x for x in (FOUNDRY_DIFF, differs) if x), state_bytes=FP32_GRADS)



def titan_h200_row(nodes: int, published: float) -> Run:
    """torchtitan's Trainy/WhiteFiber row of `nodes` nodes of 8 H200: local batch 2, Float8 with its all-gather."""
    gpus = 8 * nodes
    return Run(f"torchtitan-8B-{gpus}xH200-float8", f"{TITAN_H200}, {nodes} nodes", "h200", gpus,
               ("--model.preset=llama3.1-8b", "--train.seq_len=8192",
                *layout(gpus, batch=2 * gpus, micro=2, zero=3, recompute="selective")),
               "tokens_per_s_per_gpu", published, "tokens", "FSDP2 prefetch; float8 all-gather; torch.compile",
               {"causal_flops": "full", "zero3_prefetch": True, "fp8": "weights", "kernels": "fused", **TITAN_SAC,
                **TITAN_FA2},
               params_b=8.03,
               differs="selective AC as torchtitan's per-op policy (selective_ac); force_recompute_fp8_weight_in_bwd "
                       "(the weight re-cast in the backward) does nothing in that torchao; not explained: the planner "
                       "is fast here by about a quarter", state_bytes=FP32_GRADS)


MBRIDGE_2511 = ("NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md @5776a6d (25.11 NeMo container, DGX-H100 "
                "table; the same rows in docs/performance-summary-archive.md @067f987)")
MBRIDGE_RECIPE = "recipes: scripts/performance/configs/ and src/megatron/bridge/recipes/ @v0.2.0 (7af9601)"
MBRIDGE_CONVENTION = "model FLOPs, causal halved (flop_utils.py num_floating_point_operations)"
MBRIDGE_OVERLAP = ("distributed optimizer with overlap_grad_reduce and overlap_param_gather (recipe); "
                   "tp_comm_overlap userbuffers where tp > 1; TE fused kernels")
# where the planner is fast on a Hopper row priced as its source ran, and no cause is known
HOPPER_FAST = ("not explained: the planner is fast here, as on the other Hopper rows priced with the kernels their "
               "sources ran (a candidate, the clocks a GPU holds under sustained load, is what `fivefold calibrate` "
               "times on a GPU)")
# Megatron-Bridge's tensor-parallel FP8 rows: TE's fused kernels and Megatron's activations, tp overlapped
MBRIDGE_TP_OPTIONS = {"causal_flops": "half", "fp8": "weights", "tp_overlap": True, "kernels": "fused",
                      "activations": "megatron", "param_gather_overlap": True}
MBRIDGE_FP8 = ("FP8-CS: TE per-tensor current scaling (bf16_with_fp8_current_scaling_mixed, first/last layers bf16 "
               "off in the perf scripts) with fp8_param_gather; TE's linears and grouped experts in FP8, the output "
               "layer (Megatron's ColumnParallelLinear, not a TE module) and the router in bf16")
MOE_ZOO = "yanring/Megatron-MoE-ModelZoo @e865051, best_practice/qwen3/readme.md, H100 table (256 H100, IB 8x50 GB/s)"
TITAN_H200 = "pytorch/torchtitan @b5bcd76, benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
TORCHAO_B200 = ("pytorch/ao @36027d8 docs/source/workflows/training.md, 'Training e2e benchmarks on NVIDIA B200' (the "
                "same table in torchtitan @b5bcd76 torchtitan/components/quantization/mxfp8.md)")
TORCHAO_DIFF = ("'8x power limited B200': 750 W of the rated 1000 W (the table's first wording, pytorch/ao PR #2777 "
                "@d8bb51f6, 'limited to 750W'), priced at the data sheet's clocks, which no source gives at 750 W; "
                "the B200's attention curves are the H100's cuDNN fractions (no published B200 curve); not "
                "explained: the bf16 row is 21% MFU, where the planner's B200 gives about 60%, and 750 W is not "
                "known to cost that much")


def torchao_row(recipe: str, table: str, published: float, overlap: str, fp8: str, differs: str = "") -> Run:
    """torchao's B200 row of `recipe` (`table`: its name there, after TORCHAO_B200): Llama 3 8B on one node of 8,
    local batch 1, torch.compile, FSDP2, torchtitan's per-op SAC; `fp8` the planner's FP8 option for it."""
    return Run(f"torchao-8B-8xB200-{recipe}", TORCHAO_B200 + table, "b200", 8,
               ("--model.preset=llama3-8b", "--train.seq_len=8192",
                *layout(8, batch=8, micro=1, zero=3, recompute="selective")),
               "tokens_per_s_per_gpu", published, "tokens", overlap,
               {"causal_flops": "full", "zero3_prefetch": True, "fp8": fp8, "kernels": "fused", **TITAN_SAC},
               params_b=8.03, differs="; ".join(x for x in (differs, TORCHAO_DIFF) if x), state_bytes=FP32_GRADS)


LLAMA3 = {"causal_flops": "full", "kernels": "fused", "activations": "megatron", "attention_kernel": "fa2"}
LLAMA3_ASSUMED = ("micro-batch 1; sequence parallel on; interleaved 1F1B with 7 virtual stages: sec. 3.3.2 takes "
                  "one block each from the first and last stages, whose first and last chunks then hold only the "
                  "embedding and the head, so 126 = 16 x 8 - 2 reads as one block a chunk at V = 8, which fivefold "
                  "(a block in every chunk) cannot lay out: 7 is the nearest; fused kernels keeping Megatron-LM's "
                  "activations (not described; a 2024 trainer at 38-43% MFU fuses its norms and activations); "
                  "attention at FlashAttention-2's rate (the kernel is not described)")
LLAMA3_DIFF = ("sec. 3.3.2 trains 8K sequences without activation checkpointing; here only full recompute fits 80 GB "
               "(104 and 88 GB without: V = 7 puts two blocks in 14 of the 112 chunks, 157 blocks in flight where "
               "one block a chunk holds about 126; the unsharded ZeRO-1 gradients 13 GB): priced with full "
               "recompute; without it the planner is 17-21% fast; DP: ZeRO-1 for the paper's FSDP (which shards "
               "gradients too, reduced in fp32)")
