"""Published training runs that benchmarks/planner_vs_published.py sets the planner beside.

Every `Run` holds what its source states: the model, the GPUs, the layout, the batch, the
recomputation, the precision, the overlap settings, the FLOP convention and the measured figure,
with the source in a comment over it. What a source leaves out and the comparison has to choose
is written in `assumed`; where fivefold's model or layout cannot be the published one, `differs`
says how. Nothing here is fitted to a run: a figure is either read from the named source or
derived from such figures by the arithmetic shown beside it.

GPT-3-shaped models (Megatron-LM) have a GeLU MLP of width 4h; fivefold's MLP is SwiGLU, so
`gpt()` gives them ffn_dim = 8h/3 rounded to a multiple of 128, the same 8h^2 MLP parameters per
block (3 h f = 8 h^2), within 0.1%; the script prints each model's parameter count beside the
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


# Llama 3.1 8B: 8.03B parameters (presets.PUBLISHED_PARAMS), a 128256 x 4096 embedding.
_L8B = torchtitan_flops(8.03e9, 128256 * 4096, 32, 32, 128, 8192)

MEGATRON_2021 = "Narayanan et al. 2021 (SC21), Table 1; layouts: Megatron-LM examples/sc21/run_table_1.sh @6985e58"
MEGATRON_2021_OVERLAP = ("tp all-reduces block; DDP-impl local: gradients all-reduced after the backward (no overlap); "
                         "pipeline p2p with scatter/gather")
MEGATRON_2024 = "NVIDIA/Megatron-LM README @f2e5db402c (2024-07-15), images/model_table.png (H100 weak scaling)"
MEGATRON_2024_OVERLAP = ("--overlap-grad-reduce --overlap-param-gather (distributed optimizer: ZeRO-1) "
                         "--tp-comm-overlap; pipeline p2p overlapped by default")
TITAN_H100 = {"memory_bytes": 96e9, "hbm_bw": 2.4e12}  # Grand Teton H100: 96 GB HBM2e, 2.4 TB/s, 500 W (perf. docs)
TITAN_DIFF = "H100 here: 96 GB HBM2e at 2.4 TB/s and 500 W (peak unknown, 989 kept, as torchtitan's footnote does)"
H800 = {"intra_bw": 200e9}  # NVLink 400 GB/s bidirectional (philisun.com H800 vs H100 comparison): 200 per direction

RUNS: list[Run] = [
    # --- Megatron-LM, Narayanan et al. 2021: GPT on A100 80GB (Selene: 8 GPUs/node, 8x HDR IB per node), fp16,
    # seq 2048, vocab 51200 (tied embedding), full recomputation (--activations-checkpoint-method uniform).
    # Figures: the Megatron-LM README's table of April 2021 (images/cases_april2021.png @50a4b5f), the paper's Table 1.
    Run("megatron21-1T-3072xA100", MEGATRON_2021, "a100-80gb", 3072,
        (*gpt(25600, 128, 160, 51200, 2048, True), *layout(6, 8, 64, 3072, 1, recompute="full", dtype="fp16",
                                                            overlap_comm=False)),
        "tflops_hardware", 163.0, "hardware FLOPs (recompute counted), causal in full (96 B s l h^2 ...)",
        MEGATRON_2021_OVERLAP, {"causal_flops": "full", "tp_overlap": False},
        megatron_2021_flops(25600, 128, 2048, 51200), params_b=1008.0),
    Run("megatron21-530B-2520xA100", MEGATRON_2021, "a100-80gb", 2520,
        (*gpt(20480, 105, 128, 51200, 2048, True), *layout(9, 8, 35, 2520, 1, recompute="full", dtype="fp16",
                                                            overlap_comm=False, pp_schedule="interleaved_1f1b",
                                                            virtual_stages=3)),
        "tflops_hardware", 163.0, "hardware FLOPs (recompute counted), causal in full", MEGATRON_2021_OVERLAP,
        {"causal_flops": "full", "tp_overlap": False}, megatron_2021_flops(20480, 105, 2048, 51200), params_b=529.6),
    Run("megatron21-146B-1536xA100", MEGATRON_2021, "a100-80gb", 1536,
        (*gpt(12288, 80, 96, 51200, 2048, True), *layout(24, 8, 8, 2304, 2, recompute="full", dtype="fp16",
                                                          overlap_comm=False, pp_schedule="interleaved_1f1b",
                                                          virtual_stages=2)),
        "tflops_hardware", 148.0, "hardware FLOPs (recompute counted), causal in full", MEGATRON_2021_OVERLAP,
        {"causal_flops": "full", "tp_overlap": False}, megatron_2021_flops(12288, 80, 2048, 51200), params_b=145.6),
    Run("megatron21-18B-256xA100", MEGATRON_2021, "a100-80gb", 256,
        (*gpt(6144, 40, 48, 51200, 2048, True), *layout(32, 8, 1, 1024, 8, recompute="full", dtype="fp16")),
        "tflops_hardware", 135.0, "hardware FLOPs (recompute counted), causal in full",
        "tp all-reduces block; DDP-impl torch: bucketed gradient all-reduce overlapped with the backward",
        {"causal_flops": "full", "tp_overlap": False}, megatron_2021_flops(6144, 40, 2048, 51200), params_b=18.4),
    # --- Korthikanti et al. 2022, MFU and HFU "measured using a data parallel size of one" (NVIDIA/Megatron-LM
    # README @2e90a342f5, 2022-05-19; the paper's Table 5): 175B 51.4% / 52.8%, 530B 56.0% / 57.0%,
    # 1T 56.3% / 57.0%; sequence parallel + selective recomputation, seq 2048. Their ratio depends only on the
    # shape and the recomputation, not on the layout, which the sources read here do not give; the rows
    # compare the ratio. Shapes: 175B is GPT-3 (Brown et al. 2020, Table 2.1: 96 layers, 12288, 96 heads),
    # 530B and 1T as in Narayanan et al. 2021 above.
    Run("korthikanti22-175B-ratio", "Korthikanti et al. 2022, Table 5 (Megatron-LM README @2e90a342f5)", "a100-80gb",
        64, (*gpt(12288, 96, 96, 51200, 2048, True), *layout(1, 8, 8, 8, 1, recompute="selective", sp=True)),
        "hfu_over_mfu", 0.528 / 0.514, "both causal in full; HFU adds the recomputed attention core",
        "n/a (the ratio does not depend on overlap)", {"causal_flops": "full"}, params_b=175.0,
        assumed="layout tp8 x pp8, 8 micro-batches (any valid one: the ratio does not depend on it)",
        differs="the paper's HFU formula (1 + s/3h ...) counts 24 B L s^2 h where its selective recompute adds 16 "
                "(jaredcasper, Megatron-LM issue #523): its published HFU is high by that"),
    Run("korthikanti22-530B-ratio", "Korthikanti et al. 2022, Table 5 (Megatron-LM README @2e90a342f5)", "a100-80gb",
        280, (*gpt(20480, 105, 128, 51200, 2048, True), *layout(1, 8, 35, 35, 1, recompute="selective", sp=True)),
        "hfu_over_mfu", 0.570 / 0.560, "both causal in full; HFU adds the recomputed attention core",
        "n/a (the ratio does not depend on overlap)", {"causal_flops": "full"}, params_b=529.6,
        assumed="layout tp8 x pp35, 35 micro-batches (the ratio does not depend on it)",
        differs="the paper's HFU formula over-counts the recomputed attention (issue #523)"),
    Run("korthikanti22-1T-ratio", "Korthikanti et al. 2022, Table 5 (Megatron-LM README @2e90a342f5)", "a100-80gb",
        512, (*gpt(25600, 128, 160, 51200, 2048, True), *layout(1, 8, 64, 64, 1, recompute="selective", sp=True)),
        "hfu_over_mfu", 0.570 / 0.563, "both causal in full; HFU adds the recomputed attention core",
        "n/a (the ratio does not depend on overlap)", {"causal_flops": "full"}, params_b=1008.0,
        assumed="layout tp8 x pp64, 64 micro-batches (the ratio does not depend on it)",
        differs="the paper's HFU formula over-counts the recomputed attention (issue #523)"),
    # --- Megatron-Core r0.8.0 on H100 (README 2024): GPT, vocab 131072, seq 4096, dp 48 everywhere; per-GPU
    # TFLOP/s and MFU (of 989). Untied embeddings: the sizes in the table (7.1B, 177B, 462B) are the untied counts.
    Run("megatron24-7B-96xH100", MEGATRON_2024, "h100", 96,
        (*gpt(4096, 30, 32, 131072, 4096, False), *layout(48, 2, 1, 192, 1, zero=1, sp=True)),
        "tflops_model", 465.9, "model FLOPs, causal in full (training.py num_floating_point_operations)",
        MEGATRON_2024_OVERLAP, {"causal_flops": "full", "tp_overlap": True},
        megatron_model_flops(4096, 30, 4096, 131072), params_b=7.1,
        assumed="micro-batch 1; precision bf16; sequence parallel on (both not in the README)", recompute_fit=True),
    Run("megatron24-177B-2304xH100", MEGATRON_2024, "h100", 2304,
        (*gpt(12288, 96, 96, 131072, 4096, False), *layout(48, 8, 6, 1152, 1, zero=1, sp=True)),
        "tflops_model", 432.8, "model FLOPs, causal in full", MEGATRON_2024_OVERLAP,
        {"causal_flops": "full", "tp_overlap": True}, megatron_model_flops(12288, 96, 4096, 131072), params_b=177.0,
        assumed="micro-batch 1, plain 1F1B (Megatron's default without virtual stages), bf16, sp on",
        recompute_fit=True),
    Run("megatron24-462B-6144xH100", MEGATRON_2024, "h100", 6144,
        (*gpt(18432, 112, 144, 131072, 4096, False), *layout(48, 8, 16, 3072, 1, zero=1, sp=True)),
        "tflops_model", 459.9, "model FLOPs, causal in full", MEGATRON_2024_OVERLAP,
        {"causal_flops": "full", "tp_overlap": True}, megatron_model_flops(18432, 112, 4096, 131072), params_b=462.0,
        assumed="micro-batch 1, plain 1F1B, bf16, sp on", recompute_fit=True),
    # --- Llama 3 (Dubey et al. 2024), 405B on H100 80GB (700 W), seq 8192, 16M tokens per batch (2048 sequences),
    # BF16; TFLOP/s per GPU as shown on the SC'24 slide (P. Balaji, "Herding Llamas") transcribed at
    # glennklockwood.com/garden/llama-3.1 (the paper's Table 4; 430/989 = 43%, 400/989 = 40%, inside the paper's
    # stated 38-43% BF16 MFU). The paper's DP is FSDP; its FLOP convention is not stated in the sources read here.
    Run("llama3-405B-8192xH100", "Dubey et al. 2024, Table 4 (SC'24 slide via glennklockwood.com)", "h100", 8192,
        ("--model.preset=llama3-405b", "--train.seq_len=8192",
         *layout(64, 8, 16, 2048, 1, zero=1, sp=True, pp_schedule="interleaved_1f1b", virtual_stages=2)),
        "tflops_model", 430.0, "not stated (MFU of 989 TFLOP/s); compared as causal in full",
        "not stated in the sources read here", {"causal_flops": "full"}, params_b=405.85,
        assumed="micro-batch 1; interleaved 1F1B with 2 virtual stages; sequence parallel on",
        differs="DP: ZeRO-1 here (the paper's FSDP shards more state; no extra traffic with parameters kept "
                "gathered across micro-batches)", recompute_fit=True),
    Run("llama3-405B-16384xH100", "Dubey et al. 2024, Table 4 (SC'24 slide via glennklockwood.com)", "h100", 16384,
        ("--model.preset=llama3-405b", "--train.seq_len=8192",
         *layout(128, 8, 16, 2048, 1, zero=1, sp=True, pp_schedule="interleaved_1f1b", virtual_stages=2)),
        "tflops_model", 400.0, "not stated (MFU of 989 TFLOP/s); compared as causal in full",
        "not stated in the sources read here", {"causal_flops": "full"}, params_b=405.85,
        assumed="micro-batch 1; interleaved 1F1B with 2 virtual stages; sequence parallel on",
        differs="DP: ZeRO-1 here (the paper's FSDP)", recompute_fit=True),
    # --- DeepSeek-V3 (arXiv 2412.19437): 2048 H800; "180K H800 GPU hours" per trillion pre-training tokens
    # (introduction, INTRO text of deepseek-ai/DeepSeek-V3; 2664K for 14.8T = 180.0K/T); PP16 with DualPipe,
    # EP64 over 8 nodes, ZeRO-1 DP, no TP (sec. 3.2, as quoted in DeepOpt-com/WrinkleFree-Monorepo issue #6;
    # EP64, TP1, seq 4K also in deepseek-ai/profile-data's README); FP8 GEMMs; seq 4096 and a batch of 15360
    # sequences after the first 469B tokens (sec. 4.2); expert all-to-all overlapped with another chunk's compute.
    Run("deepseek-v3-2048xH800", "DeepSeek-AI 2024, DeepSeek-V3 report, sec. 1 (training costs), 3.2, 4.2", "h100",
        2048, ("--model.preset=deepseek-v3", "--train.seq_len=4096",
               *layout(128, 1, 16, 15360, 1, ep=64, zero=1, pp_schedule="dualpipe_v", virtual_stages=2)),
        "gpu_hours_per_trillion", 180e3, "time-based (GPU-hours): no FLOP convention",
        "DualPipe: expert all-to-all and pp p2p hidden under the other direction's compute",
        {"ep_overlap": True, "fp8": "compute"}, hardware=H800, params_b=671.0,
        assumed="micro-batch 1 (not in the sources read here)",
        differs="DualPipeV (one copy of the weights, V placement) for DualPipe (two copies); no multi-token "
                "prediction module (+1 block and head in the report); H800 priced as an H100 with NVLink 400 GB/s "
                "bidirectional; fivefold's recompute options are coarser than the report's (RMSNorm and MLA "
                "up-projections)", recompute_fit=True),
    # --- torchtitan, Llama 3.1 8B / 70B, seq 8192 (train_configs/llama3_*.toml), BF16 unless noted, FSDP2 prefetching
    # the next unit's all-gather (implicit forward and backward prefetch).
    # Dec 2024 runs: docs/performance.md @eaea6f6 (Grand Teton H100, table 1 and 3; torch 1963fc8, torchtitan 9dec370).
    Run("torchtitan-8B-8xH100", "torchtitan docs/performance.md @eaea6f6, Table 1 (FSDP row)", "h100", 8,
        ("--model.preset=llama3-8b", "--train.seq_len=8192", *layout(8, batch=16, micro=2, zero=3,
                                                                     recompute="selective")),
        "tokens_per_s_per_gpu", 5762.0, "tokens (MFU 33-39% stated, of 989: 6(N - emb) + 12 l h q t)",
        "FSDP2 all-gathers prefetched; no compile", {"causal_flops": "full", "zero3_prefetch": True},
        _L8B, hardware=TITAN_H100, params_b=8.03,
        differs="selective AC: torchtitan's per-op policy, fivefold's attention core (Korthikanti); " + TITAN_DIFF),
    Run("torchtitan-8B-128xH100", "torchtitan docs/performance.md @eaea6f6, Table 3 (FSDP row)", "h100", 128,
        ("--model.preset=llama3-8b", "--train.seq_len=8192", *layout(128, batch=256, micro=2, zero=3,
                                                                     recompute="selective")),
        "tokens_per_s_per_gpu", 5605.0, "tokens", "FSDP2 all-gathers prefetched; no compile",
        {"causal_flops": "full", "zero3_prefetch": True}, _L8B, hardware=TITAN_H100, params_b=8.03,
        differs="selective AC: per-op policy vs fivefold's attention core; " + TITAN_DIFF),
    # June 2025 (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @820504e): 70B on 256 H100, FSDP 32 x TP 8,
    # torch.compile, full AC, local batch 16 (512 sequences), bf16: vanilla TP 597.3, async TP 652.4 tokens/s/GPU.
    Run("torchtitan-70B-256xH100-tp", "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md", "h100", 256,
        ("--model.preset=llama3-70b", "--train.seq_len=8192",
         *layout(32, 8, 1, 512, 1, zero=3, sp=True, recompute="full")),
        "tokens_per_s_per_gpu", 597.3, "tokens", "TP collectives block (vanilla TP); FSDP2 prefetch",
        {"causal_flops": "full", "tp_overlap": False, "zero3_prefetch": True}, hardware=TITAN_H100, params_b=70.55,
        assumed="micro-batch 1 (torchtitan runs its local batch of 16 as one; fivefold's planner prices either)",
        differs="torch.compile not modelled; " + TITAN_DIFF),
    Run("torchtitan-70B-256xH100-asynctp", "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md", "h100",
        256, ("--model.preset=llama3-70b", "--train.seq_len=8192",
              *layout(32, 8, 1, 512, 1, zero=3, sp=True, recompute="full")),
        "tokens_per_s_per_gpu", 652.4, "tokens", "async TP: tp collectives overlapped with the matmuls; FSDP2 prefetch",
        {"causal_flops": "full", "tp_overlap": True, "zero3_prefetch": True}, hardware=TITAN_H100, params_b=70.55,
        assumed="micro-batch 1", differs="torch.compile not modelled; " + TITAN_DIFF),
    # April-Dec 2024 (docs/performance.md @4d88a8a, 2024-12-03): Llama 3 on 64 A100 80GB, FSDP, local batch 1,
    # 8B selective op AC 2973 WPS 58.2% MFU; 70B full AC 331 WPS 51.7% MFU. That MFU is 6N + 12 l h q t with N
    # counting the embedding (2973 x (6 x 8.03e9 + 12 x 32 x 32 x 128 x 8192) / 312e12 = 58.2%).
    Run("torchtitan-8B-64xA100", "torchtitan docs/performance.md @4d88a8a, Llama 3 table", "a100-80gb", 64,
        ("--model.preset=llama3-8b", "--train.seq_len=8192", *layout(64, batch=64, micro=1, zero=3,
                                                                     recompute="selective")),
        "mfu", 0.582, "MFU: 6N (embedding included) + 12 l h q t, causal in full", "FSDP2 prefetch",
        {"causal_flops": "full", "zero3_prefetch": True}, 6 * 8.03e9 + 12 * 32 * 32 * 128 * 8192, params_b=8.03,
        differs="selective AC: per-op policy vs fivefold's attention core; MFU counts the embedding as 6N"),
    Run("torchtitan-70B-64xA100", "torchtitan docs/performance.md @4d88a8a, Llama 3 table", "a100-80gb", 64,
        ("--model.preset=llama3-70b", "--train.seq_len=8192", *layout(64, batch=64, micro=1, zero=3,
                                                                      recompute="full")),
        "tokens_per_s_per_gpu", 331.0, "tokens (MFU 51.7% stated)", "FSDP2 prefetch",
        {"causal_flops": "full", "zero3_prefetch": True}, params_b=70.55),
]
