"""Published training runs that benchmarks/planner_vs_published.py sets the planner beside.

Every `Run` holds what its source states: the model, the GPUs, the layout, the batch, the
recomputation, the precision, the overlap settings, the FLOP convention and the measured figure,
with the source in a comment over it. What a source leaves out and the comparison has to choose
is written in `assumed`; where fivefold's model or layout cannot be the published one, `differs`
says how. Nothing here is fitted to a run: a figure is either read from the named source or
derived from such figures by the arithmetic shown beside it.

What a run is (`Run`), its layout helpers and the sources' FLOP formulas: published_common.py; each
source's name, shared settings and row builders: published_sources.py.
"""

from __future__ import annotations

from benchmarks.published_common import (
    FP32_GRADS,
    Run,
    gpt,
    layout,
    megatron_2021_flops,
    megatron_core_flops,
    megatron_model_flops,
)
from benchmarks.published_sources import (
    H800,
    HOPPER_FAST,
    L8B_FLOPS,
    LLAMA3,
    LLAMA3_ASSUMED,
    LLAMA3_DIFF,
    M21,
    M21_DIFF,
    M24,
    MBRIDGE_2511,
    MBRIDGE_CONVENTION,
    MBRIDGE_FP8,
    MBRIDGE_OVERLAP,
    MBRIDGE_RECIPE,
    MBRIDGE_TP_OPTIONS,
    MEGATRON_2021,
    MEGATRON_2021_OVERLAP,
    MEGATRON_2024,
    MEGATRON_2024_OVERLAP,
    MOE_ZOO,
    TITAN_DIFF,
    TITAN_FA2,
    TITAN_H100,
    TITAN_SAC,
    mpt_row,
    titan_h200_row,
    torchao_row,
)

RUNS: list[Run] = [
    # --- Megatron-LM, Narayanan et al. 2021: GPT on A100 80GB (Selene: 8 GPUs/node, 8x HDR IB per node), fp16,
    # seq 2048, vocab 51200 (tied embedding), full recomputation (--activations-checkpoint-method uniform).
    # Figures: the Megatron-LM README's table of April 2021 (images/cases_april2021.png @50a4b5f), the paper's Table 1.
    Run("megatron21-1T-3072xA100", MEGATRON_2021, "a100-80gb", 3072,
        (*gpt(25600, 128, 160, 51200, 2048, True), *layout(6, 8, 64, 3072, 1, recompute="full", dtype="fp16",
                                                            overlap_comm=False)),
        "tflops_hardware", 163.0, "hardware FLOPs (recompute counted), causal in full (96 B s l h^2 ...)",
        MEGATRON_2021_OVERLAP, M21,
        megatron_2021_flops(25600, 128, 2048, 51200), params_b=1008.0, differs=M21_DIFF),
    Run("megatron21-530B-2520xA100", MEGATRON_2021, "a100-80gb", 2520,
        (*gpt(20480, 105, 128, 51200, 2048, True), *layout(9, 8, 35, 2520, 1, recompute="full", dtype="fp16",
                                                            overlap_comm=False, pp_schedule="interleaved_1f1b",
                                                            virtual_stages=3)),
        "tflops_hardware", 163.0, "hardware FLOPs (recompute counted), causal in full", MEGATRON_2021_OVERLAP,
        M21, megatron_2021_flops(20480, 105, 2048, 51200), params_b=529.6, differs=M21_DIFF),
    Run("megatron21-146B-1536xA100", MEGATRON_2021, "a100-80gb", 1536,
        (*gpt(12288, 80, 96, 51200, 2048, True), *layout(24, 8, 8, 2304, 2, recompute="full", dtype="fp16",
                                                          overlap_comm=False, pp_schedule="interleaved_1f1b",
                                                          virtual_stages=2)),
        "tflops_hardware", 148.0, "hardware FLOPs (recompute counted), causal in full", MEGATRON_2021_OVERLAP,
        M21, megatron_2021_flops(12288, 80, 2048, 51200), params_b=145.6, differs=M21_DIFF),
    Run("megatron21-18B-256xA100", MEGATRON_2021, "a100-80gb", 256,
        (*gpt(6144, 40, 48, 51200, 2048, True), *layout(32, 8, 1, 1024, 8, recompute="full", dtype="fp16")),
        "tflops_hardware", 135.0, "hardware FLOPs (recompute counted), causal in full",
        "tp all-reduces block; DDP-impl torch: bucketed gradient all-reduce overlapped with the backward",
        M21, megatron_2021_flops(6144, 40, 2048, 51200), params_b=18.4, differs=M21_DIFF),
    # --- Korthikanti et al. 2022, MFU and HFU "measured using a data parallel size of one" (NVIDIA/Megatron-LM
    # README @2e90a342f5, 2022-05-19; the paper's Table 5): 175B 51.4% / 52.8%, 530B 56.0% / 57.0%,
    # 1T 56.3% / 57.0%; sequence parallel + selective recomputation, seq 2048. Their ratio depends only on the
    # shape and the recomputation, not on the layout, which the sources read here do not give; the rows
    # compare the ratio. Shapes: 175B is GPT-3 (Brown et al. 2020, Table 2.1: 96 layers, 12288, 96 heads),
    # 530B and 1T as in Narayanan et al. 2021 above.
    Run("korthikanti22-175B-ratio", "Korthikanti et al. 2022, Table 5 (Megatron-LM README @2e90a342f5)", "a100-80gb",
        64, (*gpt(12288, 96, 96, 51200, 2048, True), *layout(1, 8, 8, 8, 1, recompute="selective", sp=True)),
        "hfu_korthikanti_over_mfu", 0.528 / 0.514, "both causal in full; HFU as the paper counts recompute",
        "n/a (the ratio does not depend on overlap)", {"causal_flops": "full"}, params_b=175.0,
        assumed="layout tp8 x pp8, 8 micro-batches (any valid one: the ratio does not depend on it)",
        differs="the paper's HFU formula (1 + s/3h ...) counts the attention term again, three times the forward "
                "selective recompute reruns (Megatron-LM issue #523): compared in its count (hfu_korthikanti)"),
    Run("korthikanti22-530B-ratio", "Korthikanti et al. 2022, Table 5 (Megatron-LM README @2e90a342f5)", "a100-80gb",
        280, (*gpt(20480, 105, 128, 51200, 2048, True), *layout(1, 8, 35, 35, 1, recompute="selective", sp=True)),
        "hfu_korthikanti_over_mfu", 0.570 / 0.560, "both causal in full; HFU as the paper counts recompute",
        "n/a (the ratio does not depend on overlap)", {"causal_flops": "full"}, params_b=529.6,
        assumed="layout tp8 x pp35, 35 micro-batches (the ratio does not depend on it)",
        differs="compared in the paper's HFU count (hfu_korthikanti; Megatron-LM issue #523)"),
    Run("korthikanti22-1T-ratio", "Korthikanti et al. 2022, Table 5 (Megatron-LM README @2e90a342f5)", "a100-80gb",
        512, (*gpt(25600, 128, 160, 51200, 2048, True), *layout(1, 8, 64, 64, 1, recompute="selective", sp=True)),
        "hfu_korthikanti_over_mfu", 0.570 / 0.563, "both causal in full; HFU as the paper counts recompute",
        "n/a (the ratio does not depend on overlap)", {"causal_flops": "full"}, params_b=1008.0,
        assumed="layout tp8 x pp64, 64 micro-batches (the ratio does not depend on it)",
        differs="compared in the paper's HFU count (hfu_korthikanti; Megatron-LM issue #523)"),
    # --- Megatron-Core r0.8.0 on H100 (README 2024): GPT, vocab 131072, seq 4096, dp 48 everywhere; per-GPU
    # TFLOP/s and MFU (of 989). Untied embeddings: the sizes in the table (7.1B, 177B, 462B) are the untied counts.
    Run("megatron24-7B-96xH100", MEGATRON_2024, "h100", 96,
        (*gpt(4096, 30, 32, 131072, 4096, False), *layout(48, 2, 1, 192, 1, zero=1, sp=True)),
        "tflops_model", 465.9, "model FLOPs, causal in full (training.py num_floating_point_operations)",
        MEGATRON_2024_OVERLAP, M24,
        megatron_model_flops(4096, 30, 4096, 131072), params_b=7.1,
        assumed="micro-batch 1; precision bf16; sequence parallel on (both not in the README)", recompute_fit=True,
        differs="not explained: the planner is fast here by more than on the 177B and 462B rows of the same table, "
                "whose pipeline bubbles (17-19%) this layout has not",
        state_bytes=FP32_GRADS),
    Run("megatron24-177B-2304xH100", MEGATRON_2024, "h100", 2304,
        (*gpt(12288, 96, 96, 131072, 4096, False), *layout(48, 8, 6, 1152, 1, zero=1, sp=True)),
        "tflops_model", 432.8, "model FLOPs, causal in full", MEGATRON_2024_OVERLAP,
        M24, megatron_model_flops(12288, 96, 4096, 131072), params_b=177.0,
        assumed="micro-batch 1, plain 1F1B (Megatron's default without virtual stages), bf16, sp on",
        recompute_fit=True, state_bytes=FP32_GRADS),
    Run("megatron24-462B-6144xH100", MEGATRON_2024, "h100", 6144,
        (*gpt(18432, 112, 144, 131072, 4096, False), *layout(48, 8, 16, 3072, 1, zero=1, sp=True)),
        "tflops_model", 459.9, "model FLOPs, causal in full", MEGATRON_2024_OVERLAP,
        M24, megatron_model_flops(18432, 112, 4096, 131072), params_b=462.0,
        assumed="micro-batch 1, plain 1F1B, bf16, sp on", recompute_fit=True, state_bytes=FP32_GRADS),
    # --- Llama 3 (Dubey et al. 2024), 405B on H100 80GB (700 W), seq 8192, 16M tokens per batch (2048 sequences),
    # BF16; TFLOP/s per GPU as shown on the SC'24 slide (P. Balaji, "Herding Llamas") transcribed at
    # glennklockwood.com/garden/llama-3.1 (the paper's Table 4; 430/989 = 43%, 400/989 = 40%, inside the paper's
    # stated 38-43% BF16 MFU). The paper's DP is FSDP; its FLOP convention is not stated in the sources read here.
    Run("llama3-405B-8192xH100", "Dubey et al. 2024, Table 4 (SC'24 slide via glennklockwood.com)", "h100", 8192,
        ("--model.preset=llama3-405b", "--train.seq_len=8192",
         *layout(64, 8, 16, 2048, 1, zero=1, sp=True, pp_schedule="interleaved_1f1b", virtual_stages=7)),
        "tflops_model", 430.0, "not stated (MFU of 989 TFLOP/s); compared as causal in full",
        "not stated in the sources read here", LLAMA3, params_b=405.85,
        assumed=LLAMA3_ASSUMED,
        differs=LLAMA3_DIFF, recompute_fit=True, state_bytes=FP32_GRADS),
    Run("llama3-405B-16384xH100", "Dubey et al. 2024, Table 4 (SC'24 slide via glennklockwood.com)", "h100", 16384,
        ("--model.preset=llama3-405b", "--train.seq_len=8192",
         *layout(128, 8, 16, 2048, 1, zero=1, sp=True, pp_schedule="interleaved_1f1b", virtual_stages=7)),
        "tflops_model", 400.0, "not stated (MFU of 989 TFLOP/s); compared as causal in full",
        "not stated in the sources read here", LLAMA3, params_b=405.85,
        assumed=LLAMA3_ASSUMED,
        differs=LLAMA3_DIFF, recompute_fit=True, state_bytes=FP32_GRADS),
    # --- DeepSeek-V3 (arXiv 2412.19437): 2048 H800; "180K H800 GPU hours" per trillion pre-training tokens
    # (introduction, INTRO text of deepseek-ai/DeepSeek-V3; 2664K for 14.8T = 180.0K/T); PP16 with DualPipe,
    # EP64 over 8 nodes, ZeRO-1 DP, no TP (sec. 3.2, as quoted in DeepOpt-com/WrinkleFree-Monorepo issue #6;
    # EP64, TP1, seq 4K also in deepseek-ai/profile-data's README); FP8 GEMMs; seq 4096 and a batch of 15360
    # sequences after the first 469B tokens (sec. 4.2); expert all-to-all overlapped with another chunk's compute;
    # sec. 3.3.1: GEMMs in FP8, the routed experts' included, "the embedding module, the output head, MoE gating
    # modules, normalization operators, and attention operators" in their original precision.
    Run("deepseek-v3-2048xH800", "DeepSeek-AI 2024, DeepSeek-V3 report, sec. 1 (training costs), 3.2, 4.2", "h100",
        2048, ("--model.preset=deepseek-v3", "--train.seq_len=4096",
               *layout(128, 1, 16, 15360, 1, ep=64, zero=1, pp_schedule="dualpipe_v", virtual_stages=2)),
        "gpu_hours_per_trillion", 180e3, "time-based (GPU-hours): no FLOP convention",
        "DualPipe: expert all-to-all and pp p2p hidden under the other direction's compute",
        {"ep_overlap": True, "fp8": "compute", "ep_dispatch": "node_limited", "activations": "deepseek",
         "kernels": "fused", "attention_kernel": "fa2", "fp8_experts": True}, hardware=H800, params_b=671.0,
        assumed="micro-batch 1 (not in the sources read here); fused kernels and FlashAttention-2's rate (neither "
                "described)",
        differs="DualPipeV (one copy of the weights, V placement) for DualPipe (two copies); no multi-token "
                "prediction module (+1 block and head in the report); H800 priced as an H100 with NVLink 400 GB/s "
                "bidirectional and its 81559 MiB; the planner is fast here: its FP8 matmuls run at the tensorwise "
                "FP8 fraction (70.9% of 1979), where deepseek-ai/profile-data's H800 trace of one F&B pair spends "
                "75.6 ms in GEMMs that the planner prices at 42.5 (the 1 x 128 / 128 x 128 scaling's cost)",
        recompute_fit=True),
    # --- torchtitan, Llama 3.1 8B / 70B, seq 8192 (train_configs/llama3_*.toml), BF16 unless noted, FSDP2 prefetching
    # the next unit's all-gather (implicit forward and backward prefetch).
    # Dec 2024 runs: docs/performance.md @eaea6f6 (Grand Teton H100, table 1 and 3; torch 1963fc8, torchtitan 9dec370).
    Run("torchtitan-8B-8xH100", "torchtitan docs/performance.md @eaea6f6, Table 1 (FSDP row)", "h100", 8,
        ("--model.preset=llama3-8b", "--train.seq_len=8192", *layout(8, batch=16, micro=2, zero=3,
                                                                     recompute="selective")),
        "tokens_per_s_per_gpu", 5762.0, "tokens (MFU 33-39% stated, of 989: 6(N - emb) + 12 l h q t)",
        "FSDP2 all-gathers prefetched; no compile",
        {"causal_flops": "full", "zero3_prefetch": True, **TITAN_SAC, **TITAN_FA2},
        L8B_FLOPS, hardware=TITAN_H100, params_b=8.03,
        differs="selective AC as torchtitan's per-op policy (selective_ac); " + TITAN_DIFF,
        state_bytes=FP32_GRADS),
    Run("torchtitan-8B-128xH100", "torchtitan docs/performance.md @eaea6f6, Table 3 (FSDP row)", "h100", 128,
        ("--model.preset=llama3-8b", "--train.seq_len=8192", *layout(128, batch=256, micro=2, zero=3,
                                                                     recompute="selective")),
        "tokens_per_s_per_gpu", 5605.0, "tokens", "FSDP2 all-gathers prefetched; no compile",
        {"causal_flops": "full", "zero3_prefetch": True, **TITAN_SAC, **TITAN_FA2}, L8B_FLOPS, hardware=TITAN_H100,
        params_b=8.03,
        differs="selective AC as torchtitan's per-op policy (selective_ac); " + TITAN_DIFF, state_bytes=FP32_GRADS),
    # June 2025 (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @820504e): 70B on 256 H100, FSDP 32 x TP 8,
    # torch.compile, full AC, local batch 16 (512 sequences), bf16: vanilla TP 597.3, async TP 652.4 tokens/s/GPU.
    Run("torchtitan-70B-256xH100-tp", "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md", "h100", 256,
        ("--model.preset=llama3-70b", "--train.seq_len=8192",
         *layout(32, 8, 1, 512, 16, zero=3, sp=True, recompute="full")),
        "tokens_per_s_per_gpu", 597.3, "tokens", "TP collectives block (vanilla TP); FSDP2 prefetch",
        {"causal_flops": "full", "tp_overlap": False, "zero3_prefetch": True, "kernels": "fused", **TITAN_FA2},
        hardware=TITAN_H100,
        params_b=70.55,
        assumed="micro-batch 16: torchtitan runs its local batch as one, without gradient accumulation",
        differs="torch.compile priced as fused kernels (fivefold's compile); " + TITAN_DIFF, state_bytes=FP32_GRADS),
    Run("torchtitan-70B-256xH100-asynctp", "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md", "h100",
        256, ("--model.preset=llama3-70b", "--train.seq_len=8192",
              *layout(32, 8, 1, 512, 16, zero=3, sp=True, recompute="full")),
        "tokens_per_s_per_gpu", 652.4, "tokens", "async TP: tp collectives overlapped with the matmuls; FSDP2 prefetch",
        {"causal_flops": "full", "tp_overlap": True, "zero3_prefetch": True, "kernels": "fused", **TITAN_FA2},
        hardware=TITAN_H100,
        params_b=70.55,
        assumed="micro-batch 16 (the local batch, as above)",
        differs="torch.compile priced as fused kernels (fivefold's compile); " + TITAN_DIFF, state_bytes=FP32_GRADS),
    # April-Dec 2024 (docs/performance.md @4d88a8a, 2024-12-03): Llama 3 on 64 A100 80GB, FSDP, local batch 1,
    # 8B selective op AC 2973 WPS 58.2% MFU; 70B full AC 331 WPS 51.7% MFU. That MFU is 6N + 12 l h q t with N
    # counting the embedding (2973 x (6 x 8.03e9 + 12 x 32 x 32 x 128 x 8192) / 312e12 = 58.2%).
    Run("torchtitan-8B-64xA100", "torchtitan docs/performance.md @4d88a8a, Llama 3 table", "a100-80gb", 64,
        ("--model.preset=llama3-8b", "--train.seq_len=8192", *layout(64, batch=64, micro=1, zero=3,
                                                                     recompute="selective")),
        "mfu", 0.582, "MFU: 6N (embedding included) + 12 l h q t, causal in full", "FSDP2 prefetch",
        {"causal_flops": "full", "zero3_prefetch": True, **TITAN_SAC, **TITAN_FA2},
        6 * 8.03e9 + 12 * 32 * 32 * 128 * 8192, params_b=8.03,
        differs="selective AC as torchtitan's per-op policy (selective_ac); MFU counts the embedding as 6N",
        state_bytes=FP32_GRADS),
    Run("torchtitan-70B-64xA100", "torchtitan docs/performance.md @4d88a8a, Llama 3 table", "a100-80gb", 64,
        ("--model.preset=llama3-70b", "--train.seq_len=8192", *layout(64, batch=64, micro=1, zero=3,
                                                                      recompute="full")),
        "tokens_per_s_per_gpu", 331.0, "tokens (MFU 51.7% stated)", "FSDP2 prefetch",
        {"causal_flops": "full", "zero3_prefetch": True, **TITAN_FA2}, params_b=70.55, state_bytes=FP32_GRADS),
    # --- llm-foundry MPT benchmarks (mosaicml/llm-foundry, scripts/train/benchmarking/README.md): amp_bf16, FSDP
    # (FULL_SHARD), MP mode DEFAULT, vocab 50368, tied embedding (MPT's wte), shapes from scripts/train/yamls/
    # pretrain/mpt-*.yaml (1b: d 2048, 16 heads, 24 layers; 7b: 4096/32/32; 13b: 5120/40/40; 30b: 7168/56/48;
    # 70b: 8192/64/80; expansion_ratio 4). Each row: MFU, micro-batch, grad accumulation, global batch (sequences),
    # T/s/GPU, activation checkpointing; NumParams as params_b. The MFU's own formula (mpt_flops) turns it into the
    # table's T/s/GPU (tests/planner/test_published_runs.py).
    mpt_row("mpt-1b-8xH100", "H100 80GB BF16: 1b", (2048, 24, 16), 8, 112, 14, "none", 0.4182, 1315950592,
         "45455 T/s/GPU, grad accum 1, no AC"),
    mpt_row("mpt-7b-8xH100", "H100 80GB BF16: 7b", (4096, 32, 32), 8, 48, 6, "none", 0.4644, 6658859008,
         "10643 T/s/GPU, grad accum 1, no AC"),
    mpt_row("mpt-13b-8xH100", "H100 80GB BF16: 13b", (5120, 40, 40), 8, 16, 2, "none", 0.3979, 12853954560,
         "4792 T/s/GPU, grad accum 1, no AC",
         differs="not explained: the planner is fast here where the same table's 7b is close (a "
         "candidate: at micro-batch 2 FSDP1's gathers have less compute to hide under than the planner's prefetch "
         "assumes)"),
    mpt_row("mpt-30b-8xH100", "H100 80GB BF16: 30b", (7168, 48, 56), 8, 504, 3, "full", 0.3811, 29975214080,
         "2002 T/s/GPU, grad accum 21, AC on (each block: full here)"),
    mpt_row("mpt-70b-512xH100", "H100 80GB BF16 (Large Scale): 70b", (8192, 80, 64), 512, 4096, 8, "full", 0.4125,
         64862437376, "1007 T/s/GPU, grad accum 1, AC on (full here); 8 GPUs a node with one 400 Gb/s NIC each "
         "(not stated)"),
    mpt_row("mpt-7b-8xA100", "A100 80GB (1600 Gbps RoCE): 7b", (4096, 32, 32), 8, 96, 6, "none", 0.6423, 6658859008,
         "4641 T/s/GPU, grad accum 2, no AC", gpu="a100-80gb"),
    # --- Megatron-Bridge performance summary, 25.11 NeMo container, DGX-H100 (8 H100 a node): Llama 3 / 3.1 in FP8-CS,
    # seq 8192; GPUs, GBS, MBS, FSDP, TP, PP, CP, VP, EP, GA, tokens/s/GPU and model TFLOP/s/GPU as the table gives
    # them (the tests check tokens x megatron_core_flops = TFLOP/s). Recipes at v0.2.0: llama3 70B/405B without
    # recompute, sequence parallel with tp, distributed optimizer with overlapped grad reduce / param gather,
    # tp_comm_overlap userbuffers (h100 tp4 / tp8-cp2 configs); 8B FP8-CS: recompute_num_layers=5 (full, block).
    Run("mbridge-llama3-8B-8xH100-fp8", f"{MBRIDGE_2511}, LLAMA3_8B; {MBRIDGE_RECIPE}", "h100", 8,
        ("--model.preset=llama3-8b", "--train.seq_len=8192", *layout(8, batch=128, micro=1, zero=3, recompute="none")),
        "tokens_per_s_per_gpu", 14451.0, MBRIDGE_CONVENTION + " (744 TFLOP/s stated)",
        "Megatron-FSDP (the table's FSDP: 1 @5776a6d, 8 in the archive @067f987); TE fused kernels",
        {"causal_flops": "half", "fp8": "weights", "zero3_prefetch": True, "kernels": "fused",
         "activations": "megatron"},
        megatron_core_flops(4096, 32, 8192, 128256, 1, 32, groups=8, head_dim=128, ffn=14336), params_b=8.03,
        assumed="recompute none (the recipe recomputes 5 of the 32 blocks in full; fivefold has no per-block count)",
        differs=MBRIDGE_FP8 + "; the 5 recomputed blocks add about 5% compute not priced here; the recipe at "
                              "v0.2.0 sets no FSDP for this row, the table's FSDP column is followed"),
    Run("mbridge-llama3-70B-64xH100-fp8", f"{MBRIDGE_2511}, LLAMA3_70B; {MBRIDGE_RECIPE}", "h100", 64,
        ("--model.preset=llama3-70b", "--train.seq_len=8192",
         *layout(2, 4, 8, 128, 1, zero=1, sp=True, pp_schedule="interleaved_1f1b", virtual_stages=5,
                 recompute="none")),
        "tokens_per_s_per_gpu", 1602.0, MBRIDGE_CONVENTION + " (719 TFLOP/s stated)", MBRIDGE_OVERLAP,
        MBRIDGE_TP_OPTIONS,
        megatron_core_flops(8192, 80, 8192, 128256, 4, 64, groups=8, head_dim=128, ffn=28672), params_b=70.55,
        differs=MBRIDGE_FP8 + " (fp8 gathers of ZeRO-1 not modelled)"),
    Run("mbridge-llama31-405B-1024xH100-fp8", f"{MBRIDGE_2511}, LLAMA3.1_405B; {MBRIDGE_RECIPE}", "h100", 1024,
        ("--model.preset=llama3-405b", "--train.seq_len=8192",
         *layout(8, 8, 8, 512, 1, cp=2, zero=1, sp=True, pp_schedule="interleaved_1f1b", virtual_stages=8,
                 recompute="none")),
        "tokens_per_s_per_gpu", 292.0, MBRIDGE_CONVENTION + " (737 TFLOP/s stated)",
        MBRIDGE_OVERLAP + "; cp ring p2p overlapped with attention (TE)",
        MBRIDGE_TP_OPTIONS,
        megatron_core_flops(16384, 126, 8192, 128256, 8, 128, groups=8, head_dim=128, ffn=53248), params_b=405.85,
        differs=f"{MBRIDGE_FP8}; 126 blocks over 64 chunks: fivefold balances them by cost; {HOPPER_FAST}"),
    # Megatron-Bridge 25.11 DGX-H100, Qwen3-30B-A3B: FP8-CS, 16 GPUs, GBS 512, MBS 2, seq 4096, TP1 PP2 CP1 VP24 EP8,
    # GA 32: 5275 tokens/s/GPU, 121 TFLOP/s; force-balanced, dropless (the table's note).
    Run("mbridge-qwen3-30B-A3B-16xH100-fp8", f"{MBRIDGE_2511}, Qwen3_30B_a3B; {MBRIDGE_RECIPE}", "h100", 16,
        ("--model.preset=qwen3-30b-a3b", "--train.seq_len=4096",
         *layout(8, 1, 2, 512, 2, ep=8, zero=1, pp_schedule="interleaved_1f1b", virtual_stages=24,
                 recompute="none", reduce_dtype="bf16")),
        "tokens_per_s_per_gpu", 5275.0, MBRIDGE_CONVENTION + " (121 TFLOP/s stated)",
        "distributed optimizer, overlapped grad reduce / param gather; moe_a2a_overlap (overlap_moe_expert_parallel_"
        "comm: each micro-batch's all-to-alls under another's compute, as DualPipe pairs them); alltoall dispatcher "
        "(no DeepEP on H100), no CUDA graphs under FP8 (qwen3_workload_base_configs.py, overrides.py @5776a6d)",
        {"causal_flops": "half", "fp8": "weights", "kernels": "fused", "expert_imbalance": 1.0,
         "param_gather_overlap": True, "ep_overlap": True, "fp8_experts": True},
        megatron_core_flops(2048, 48, 4096, 151936, 1, 32, groups=4, head_dim=128, moe_ffn=768, top_k=8),
        params_b=30.5, assumed="recompute none (the recipe sets none)",
        differs=MBRIDGE_FP8 + "; the config at 5776a6d has VP 12 and MBS 1, the table's VP 24 and MBS 2 (the 25.09 "
                              "yaml's) are followed; not explained: 121 TFLOP/s is a sixth of the table's dense FP8 "
                              "rows (719-744), and 25.09's token-drop run of the same layout (capacity 1, padded: "
                              "static shapes) made 10494 tokens/s/GPU; the dropless run's per-layer routing counts, "
                              "token permutation, router kernels and per-expert launches are not priced"),
    # Megatron-Bridge 25.09 NeMo container, DGX-H100 table (docs/performance-summary.md @fa0315a, 2025-10-10):
    # DeepSeekV3 (dropless), 1024 GPUs, GBS 8192, MBS 1, seq 4096, TP2 PP8 CP1 VP4 EP64 GA128: 1297 tokens/s/GPU,
    # 338 (330) TFLOP/s; perf yaml (scripts/performance/configs/deepseek/deepseek_v3_llm_pretrain.yaml @fa0315a):
    # selective recompute, layout "Et|(tt|)*30mL" (the MTP layer on the last stage), bf16 gradient reduction.
    Run("mbridge-deepseek-v3-1024xH100", "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md @fa0315a (25.09), "
        "DGX-H100 table, DeepSeekV3 (dropless)", "h100", 1024,
        ("--model.preset=deepseek-v3", "--train.seq_len=4096",
         *layout(64, 2, 8, 8192, 1, ep=64, zero=1, sp=True, pp_schedule="interleaved_1f1b", virtual_stages=4,
                 recompute="selective", reduce_dtype="bf16", overlap_comm=False)),
        "tokens_per_s_per_gpu", 1297.0, MBRIDGE_CONVENTION + ", MLA and the MTP layer counted (338 TFLOP/s stated)",
        "run_script.py @fa0315a on H100: DeepEP (flex dispatcher), overlap_moe_expert_parallel_comm (1F1B all-to-all "
        "overlap) with delay_wgrad_compute, overlap_grad_reduce off; distributed optimizer's param gather "
        "overlapped; TE fused kernels",
        {"causal_flops": "half", "fp8": "compute", "kernels": "fused", "expert_imbalance": 1.0,
         "param_gather_overlap": True, "ep_overlap": True, "ep_dispatch": "node_limited", "fp8_experts": True},
        megatron_core_flops(7168, 61, 4096, 129280, 2, 128, ffn=18432, moe_ffn=2048, top_k=8, shared_ffn=2048,
                            dense_layers=3, mtp=1, mla=(1536, 512, 128, 64, 128)), params_b=671.0,
        assumed="FP8 (the table has no precision column; its note gives the parenthesised 330 as FP8 with "
                "DeepSeek-V3's 128x128 / 1x128 blocks, read here as the other FP8 granularity, per tensor); "
                "tp_comm_overlap off (not in the yaml)",
        differs="no MTP module in fivefold's model (+1 block and head: the source's FLOPs count it); the source's "
                "selective recompute of mla_up_proj and mlp as fivefold's selective (the attention core); 61 "
                "blocks over 32 chunks balanced by cost, not the yaml's layout; DeepEP's dispatch as node-limited "
                "(ep_dispatch), Megatron's 1F1B all-to-all overlap as DualPipe's pairing (ep_overlap, which "
                "fivefold runs under dualpipe_v only); over memory with fivefold's activations; " + HOPPER_FAST),
    # --- Megatron-Core MoE team's model zoo (the Megatron Core MoE report's companion repository), H100 table:
    # Qwen3-235B-A22B, DeepEP, BF16, 256 GPUs, seq 4096, the intra-node EP row: TP2 CP1 EP8 PP1 EDP32 ETP1 VPP1
    # DP128, FSDP on, MBS 4, GBS 2048, GA 4, full recompute: step 17.6 s, 276 TFLOP/s per GPU (main @1e057005).
    Run("mcore-qwen3-235B-256xH100", f"{MOE_ZOO}, intra-node EP row", "h100", 256,
        ("--model.preset=qwen3-235b-a22b", "--train.seq_len=4096",
         *layout(128, 2, 1, 2048, 4, ep=8, zero=3, sp=True, recompute="full")),
        "tflops_model", 276.0, "model FLOPs of Megatron-Core (megatron_core_flops), causal halved",
        "Megatron-FSDP; DeepEP dispatcher; TE fused kernels",
        {"causal_flops": "half", "zero3_prefetch": True, "kernels": "fused", "expert_imbalance": 1.0,
         "ep_dispatch": "node_limited"},
        megatron_core_flops(4096, 94, 4096, 151936, 2, 64, groups=4, head_dim=128, moe_ffn=1536, top_k=8),
        params_b=235.1, assumed="expert imbalance 1: balancing not stated for this row (the repo's "
                                "run_h100_235b.sh and the long-context commands add --moe-router-force-load-balancing)",
        differs="ETP 1 (experts not split by tp, EP8 x EDP32 over all 256 GPUs): fivefold's own expert layout "
                "under tp 2 strides ep by 2, so its EP8 spans two nodes where the source's stays in one; DeepEP's "
                "dispatch as node-limited (ep_dispatch)"),
    # --- torchtitan community benchmark (Trainy on WhiteFiber, June 2025): Llama 3.1 8B on 4 and 8 nodes of 8 H200
    # (NVLink; 400 Gb/s CX-7 per GPU), llama3_8b.toml (seq 8192, FSDP over all GPUs, selective per-op AC) with
    # local batch 2, torch.compile, Float8 (tensorwise) with FSDP float8 all-gather and precomputed scales; TPS/GPU.
    titan_h200_row(4, 10938.0),
    titan_h200_row(8, 10753.0),
    # --- torchao / torchtitan on B200: Llama3-8b, single node of 8 power-limited B200, batch size 1, seq 8192, 100
    # steps, torch.compile, FSDP2, per-op SAC; median tokens/s (torchtitan's tps, per GPU); torch 2.9.0.dev20250815,
    # torchao 0.13.0+gite4e681be6, torchtitan 6fc499f.
    torchao_row("bf16", "", 8307.5, "FSDP2 prefetch; torch.compile", "none"),
    torchao_row("mxfp8", ", mxfp8_cublas", 9969.0, "FSDP2 prefetch (bf16 gathers); torch.compile", "compute",
             "MXFP8 (1x32 blocks, cuBLAS) priced as fivefold's FP8 matmuls"),
    torchao_row("float8", ", float8 tensorwise (f8 all-gather)", 10417.0, "FSDP2 prefetch, float8 all-gather; "
             "torch.compile", "weights"),
    # --- torchtitan docs/performance.md @eaea6f6, Table 1 (as torchtitan-8B-8xH100 above): the torch.compile and
    # torch.compile + Float8 rows.
    Run("torchtitan-8B-8xH100-compile", "torchtitan docs/performance.md @eaea6f6, Table 1 (FSDP + torch.compile)",
        "h100", 8, ("--model.preset=llama3-8b", "--train.seq_len=8192", *layout(8, batch=16, micro=2, zero=3,
                                                                                recompute="selective")),
        "tokens_per_s_per_gpu", 6667.0, "tokens", "FSDP2 all-gathers prefetched; torch.compile",
        {"causal_flops": "full", "zero3_prefetch": True, "kernels": "fused", **TITAN_SAC, **TITAN_FA2},
        hardware=TITAN_H100, params_b=8.03,
        differs="selective AC as torchtitan's per-op policy (selective_ac); " + TITAN_DIFF, state_bytes=FP32_GRADS),
    Run("torchtitan-8B-8xH100-compile-fp8", "torchtitan docs/performance.md @eaea6f6, Table 1 "
        "(FSDP + torch.compile + Float8)", "h100", 8,
        ("--model.preset=llama3-8b", "--train.seq_len=8192", *layout(8, batch=16, micro=2, zero=3,
                                                                     recompute="selective")),
        "tokens_per_s_per_gpu", 8532.0, "tokens", "FSDP2 all-gathers prefetched; torch.compile",
        {"causal_flops": "full", "zero3_prefetch": True, "fp8": "compute", "kernels": "fused", **TITAN_SAC,
         **TITAN_FA2}, hardware=TITAN_H100,
        params_b=8.03, assumed="Float8 recipe and FSDP float8 all-gather not stated: tensorwise matmuls, bf16 gathers",
        differs="selective AC as torchtitan's per-op policy (selective_ac); " + TITAN_DIFF, state_bytes=FP32_GRADS),
]
