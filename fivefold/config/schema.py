"""The whole configuration schema: one frozen dataclass per TOML table, a comment per field with its
unit and meaning.

    [model] (and [model.rope], [model.attention], [model.latent], [model.norm], [model.moe])
            the network's shape: fivefold/model/config.py, beside the model it describes
    [parallel]    the layout: the five degrees and how each dimension runs
    [train]       the step: batch, sequence, precision, recompute, evaluation
    [optim]       the optimizer and its learning-rate schedule (and [optim.muon])
    [lora]        low-rank adapters on a frozen model
    [data], [checkpoint], [run]   inputs, saved state, where outputs go

Loading (TOML, `--section.key=value`, the keys of earlier versions) is load.py's; the checks are
fivefold/validate/'s; the numbers a layout derives are derive.py's. A combination of settings
fivefold cannot run yet is refused by `validate()` by name ("not built yet"), never silently ignored.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Literal

from fivefold.model.config import LoRAConfig, ModelConfig


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 0  # data-parallel degree (parallel/data/); 0 = every process not used by pp x cp x tp
    dp_replicate: int = 1  # HSDP replica groups; dp_shard = dp / dp_replicate
    zero: int = 0  # 0 = DDP, 1/2 = ZeRO-1/2 optimizer/gradient sharding, 3 = FSDP
    bucket_mb: float = 25.0  # gradient bucket cap in MB (10^6 bytes) for DDP/ZeRO
    overlap_comm: bool = True  # start a bucket's collective during backward, as soon as it is complete
    # buckets whose collective may be in flight at once while the backward fills the next; the oldest
    # is waited for when one more would launch (1: each is finished before the next launches)
    buckets_in_flight: int = 2
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"  # dtype gradients travel in (bf16 halves the bytes)
    # zero=3: dtype the weights are gathered in and computed with (bf16 halves the gathers' bytes); the
    # fp32 shards stay the masters the optimizer steps (FSDP2's MixedPrecisionPolicy.param_dtype)
    param_dtype: Literal["fp32", "bf16"] = "fp32"
    # zero=3: true frees a unit's gathered parameters after its forward and again after its backward,
    # gathering them around every use; false keeps them gathered from their first forward to their
    # chunk's last backward of the step, reduce-scattering the gradients once; auto: true, but false
    # with pipelines (pp > 1), as torchtitan composes FSDP with pipelining
    reshard_after_forward: Literal["auto", True, False] = "auto"
    dp_collective: Literal["builtin", "ring"] = "builtin"  # gradient all-reduce: backend's or ours from send/recv
    tp: int = 1  # tensor-parallel degree (parallel/tensor.py)
    sp: bool = False  # sequence parallel inside tp regions
    pp: int = 1  # pipeline stages (parallel/pipeline/)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v"] = "1f1b"
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedules)
    # blocks of each pipeline stage, pp x virtual_stages entries; () = the same in each stage, or, when
    # pp x virtual_stages does not divide n_layers, balanced by the planner's costs (parallel/pipeline/stage_split.py)
    stage_layers: tuple[int, ...] = ()
    cp: int = 1  # context-parallel degree: one sample's sequence split over cp ranks (parallel/context.py)
    cp_method: Literal["ring", "ulysses"] = "ring"
    ep: int = 1  # expert-parallel degree; divides dp x cp (parallel/expert.py)
    # with sp: split each region's all-gather and reduce-scatter into tp chunks passed around the ring
    # while the matmul works on the chunk already there (the collective matmul of Wang et al. 2022)
    tp_overlap: bool = False
    # dualpipe_v: run a forward chunk of one micro-batch beside a backward chunk of another, each one's
    # expert all-to-alls in flight while the other computes (DeepSeek-V3 technical report, sec. 3.2.1)
    ep_overlap: bool = False
    # ZeRO-Offload (Ren et al. 2021): the fp32 master shards and AdamW moments live in host memory and
    # the optimizer steps there; "params" (ZeRO-3 only) keeps the parameter shards there too and
    # brings each unit to the device before its gather (ZeRO-Infinity, Rajbhandari et al. 2021)
    offload: Literal["none", "optimizer", "params"] = "none"
    # zero=3 with train.fp8 = "tensorwise": gather the blocks' linear weights as FP8 with their scales
    # (half the bytes of bf16), the masters staying fp32
    fp8_gather: bool = False
    # Seconds any collective (and the process group's start) waits for its peers before failing with
    # a message naming the rank, axis and operation: a rank died or took another code path. It covers
    # every wait but the first step's, e.g. while rank 0 trains the BPE tokenizer (torchtitan:
    # comm.train_timeout_seconds; Megatron: --distributed-timeout-minutes). 600: torch's NCCL default.
    collective_timeout_s: float = 600.0
    # The same for the collectives of this process's first step, which compiles (train.compile) and
    # makes NCCL's communicators (the longer of the two); collective_timeout_s after it (torchtitan:
    # comm.init_timeout_seconds)
    first_step_timeout_s: float = 1800.0


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100  # optimizer steps
    # End this job after this step, with a checkpoint, leaving the LR schedule of `steps` as it is;
    # the next job continues with --resume (for clusters' job time limits). 0 = run to `steps`.
    stop_after: int = 0
    global_batch: int = 8  # sequences per optimizer step, over all ranks
    micro_batch: int = 2  # sequences per forward/backward on one rank
    seq_len: int = 64  # tokens per sequence
    seed: int = 0  # model init and data order
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # compute dtype (autocast); auto: fp32 on CPU, bf16 on GPU
    loss_scale: float = 0.0  # fp16 only: fixed loss scale, or 0 for dynamic scaling
    initial_scale_power: int = 16  # fp16 dynamic scaling starts at 2**this
    loss_scale_window: int = 1000  # fp16: clean steps before the scale doubles
    min_loss_scale: float = 1.0  # fp16: the scale never drops below this
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compile: bool = False  # torch.compile each block's forward (not with zb_h1, zb_v, dualpipe_v past one stage)
    recompute: Literal["none", "selective", "full"] = "none"  # activation recomputation
    # tokens per chunk of the output head and its cross-entropy (model/head.py): no more than this many
    # tokens' logits exist at once, recomputed in backward; 0 = the whole micro-batch's at once
    loss_chunk: int = 1024
    # the weight lambda of the multi-token-prediction loss (model.mtp_layers > 0; DeepSeek-V3: 0.3 for the
    # first 10T tokens, then 0.1): the loss trained is main + lambda x the mean of the depths' losses
    mtp_weight: float = 0.3
    # the blocks' linear layers compute in FP8 with dynamic scales, one per tensor or one per row
    # (Micikevicius et al. 2022); embedding, output head and router stay in the compute dtype
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"
    nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/Inf gradient: stop naming the parameter, or skip the step
    # Python's garbage collector runs between steps, every this many steps, instead of whenever
    # allocations trigger it inside one (torchtitan's gc_freq, Megatron's --manual-gc-interval);
    # 0 = Python's automatic collection (train/gc_policy.py)
    gc_every: int = 50
    eval_every: int = 0  # steps between validation passes; 0 = only at the end
    eval_batches: int = 4  # global batches per validation pass
    log_every: int = 10  # steps between printed lines (the metrics file gets every step)
    # one device's peak TFLOP/s for the logged MFU / HFU (train/utilization.py); 0 = the calibrated
    # profile's (run.hardware), else the catalog entry of the CUDA device, else no MFU
    peak_tflops: float = 0.0
    # record the CUDA allocator's history (Python stacks only, the last memory_snapshot_entries
    # allocations and frees) for the snapshot an out-of-memory error writes (train/oom.py)
    memory_snapshot: bool = False
    memory_snapshot_entries: int = 100_000


@dataclass(frozen=True)
class MuonConfig:
    # Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training"), as torch.optim.Muon
    # runs it, on the 2-D hidden matrices (parallel/muon.py); AdamW keeps the rest at optim.lr
    lr: float = 0.0  # Muon's peak learning rate, scheduled as optim.lr is; 0 = optim.lr
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations, torch's quintic coefficients (3.4445, -4.7750, 2.0315)
    # "match_rms_adamw" (Moonlight): lr x 0.2 sqrt(max(out, in)), an update of AdamW's RMS, so AdamW's lr and
    # weight decay carry over; "original" (Keller Jordan's): lr x sqrt(max(1, out / in)), torch's default
    adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"


@dataclass(frozen=True)
class OptimConfig:
    # the optimizer (parallel/optimizer.py): AdamW everywhere, or Muon on the hidden matrices and AdamW on
    # the embedding, head, norms, biases, routers and sinks (the split is printed at start)
    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 3e-3  # peak learning rate
    lr_schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # after warmup (train/lr_schedule.py)
    warmup_steps: int = 10  # linear warmup from 0 to lr
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr
    decay_fraction: float = 0.2  # wsd: share of steps spent in the final linear decay
    weight_decay: float = 0.1  # decoupled decay (AdamW's and Muon's); never applied to norms and biases
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global gradient-norm cap; 0 disables clipping
    # QK-clip (MuonClip, Kimi K2): after each step, scale down W_q/W_k of each head whose largest
    # pre-softmax logit in the step passed this tau (K2: 100); 0 = off (parallel/qk_clip.py)
    qk_clip: float = 0.0
    muon: MuonConfig = field(default_factory=MuonConfig)


@dataclass(frozen=True)
class DataConfig:
    # What to train on (fivefold/data/): text files or folders, .jsonl / .jsonl.gz, .parquet (prepared once
    # into cache_dir, then reused), prepared datasets (`fivefold prepare`), nanoGPT .bin files of token ids
    # (bin_dtype, eod_id), Megatron-LM .bin/.idx pairs; empty = this Python's standard library sources
    paths: tuple[str, ...] = ()
    # "byte" (bytes 0..255 + end-of-document), "bpe" (a byte-level BPE trained here on the text), or a
    # Hugging Face tokenizer: a tokenizer.json, or a directory as transformers saves one (its end-of-document
    # token from tokenizer_config.json). "" = the data's own: a prepared dataset's, else "byte"; a tokenizer
    # given beside a prepared dataset must be the one it was prepared with (checked by hash).
    tokenizer: str = ""
    bpe_vocab: int = 4096  # BPE vocabulary size (special tokens included)
    vocab_multiple: int = 64  # pad the vocabulary to a multiple of this (tp degrees divide it)
    max_bytes: int = 8_000_000  # read at most this much text (files in sorted order); 0 = no cap
    val_fraction: float = 0.05  # share of documents held out for validation
    text_field: str = "text"  # the field holding the text in .jsonl and .parquet records
    bin_dtype: Literal["uint16", "uint32", "int32"] = "uint16"  # token ids in a nanoGPT .bin
    eod_id: int = -1  # end-of-document id in nanoGPT .bin / Megatron-LM files (-1: not given)
    # [[path, weight], ...]: prepared datasets drawn by weight (each global batch by the weights, in a fixed
    # order); replaces paths. The position is saved in checkpoints.
    mixture: tuple[tuple[str, float], ...] = ()
    document_mask: bool = False  # each token attends only to earlier tokens of its own document
    reset_positions: bool = False  # RoPE positions restart at 0 at each document (Megatron-LM's reset_position_ids)
    cache_dir: str = ""  # where text given to train is prepared (once, then reused); "" = <run.out_dir>/.prepared


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep: int = 2  # complete checkpoints kept; older ones are deleted
    async_save: bool = False  # write while training goes on (one staged CPU copy of this rank's state)
    resume: bool = False  # continue from the latest complete checkpoint in the run directory
    # Start from these weights instead of a random init, under any layout: a directory of safetensors
    # from `fivefold init` / `fivefold convert`, or a Hugging Face Llama/Mixtral directory. "" = random
    # init; ignored when resuming from the run's own checkpoint.
    init_from: str = ""


# run.sinks: sink name -> the distribution it needs (None: the standard library); its extra has the
# same name (train/sinks.py writes them).
SINK_PACKAGES = MappingProxyType({"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb"})


@dataclass(frozen=True)
class RunConfig:
    name: str = ""  # run directory name; "" = the config file's stem
    out_dir: str = "runs"  # parent of run directories
    metrics_file: str = "metrics.jsonl"  # one JSON object per step, inside the run directory
    hardware: str = ""  # a hardware profile (`fivefold calibrate --out`) for the predicted step time in the metrics log
    trace: bool = False  # write a Chrome trace per rank (RUN_DIR/trace/rank<R>.json); `fivefold train --trace`
    trace_steps: int = 3  # steps traced: from the job's second (the first warms up), or its first if it is shorter
    # Where rank 0's step records and events go (train/sinks.py): "jsonl" (metrics_file; required: resume and
    # `fivefold report` read it), "tensorboard" (RUN_DIR/tensorboard), "wandb" (RUN_DIR/wandb; online only with
    # wandb_mode = "online", which needs `wandb login`).
    sinks: tuple[str, ...] = ("jsonl",)
    wandb_mode: Literal["offline", "online"] = "offline"  # W&B offline: files only, `wandb sync` uploads them later
    wandb_project: str = "fivefold"  # W&B project the run belongs to


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)


def _is_table(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _tables(cls: type, path: str) -> Iterator[tuple[str, type]]:
    yield path, cls
    for name, hint in typing.get_type_hints(cls).items():
        if _is_table(hint):
            yield from _tables(hint, f"{path}.{name}")


# Every TOML table by its dotted path ("model", "model.rope", "train", ...) and the dataclass behind it.
TABLES: Mapping[str, type] = MappingProxyType(
    {path: cls for f in fields(Config) for path, cls in _tables(typing.get_type_hints(Config)[f.name], f.name)})
SECTIONS: tuple[str, ...] = tuple(f.name for f in fields(Config))  # the top-level tables, in file order
# The declared type of each plain key of each table (nested tables left out), resolved once: `from __future__
# import annotations` leaves them as text, and resolving takes a millisecond a table (the planner validates
# thousands of layouts).
FIELD_TYPES: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {path: MappingProxyType({k: h for k, h in typing.get_type_hints(cls).items() if not _is_table(h)})
     for path, cls in TABLES.items()})
SUBTABLES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {path: tuple(k for k, h in typing.get_type_hints(cls).items() if _is_table(h)) for path, cls in TABLES.items()})


def table_of(cfg: Config, path: str) -> Any:
    """The dataclass at a dotted table path: table_of(cfg, "model.rope") is cfg.model.rope."""
    value: Any = cfg
    for name in path.split("."):
        value = getattr(value, name)
    return value


def leaves(cfg: Config) -> Iterator[tuple[str, Any, Any]]:
    """(dotted key, value, declared type) of every plain key of every table."""
    for path, types in FIELD_TYPES.items():
        table = table_of(cfg, path)
        for key, hint in types.items():
            yield f"{path}.{key}", getattr(table, key), hint
