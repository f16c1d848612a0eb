"""Config checks, before any process group starts.

`validate(cfg, world_size)` is a pure function returning every problem as one line that names the
field, the values and a fix; the planner uses it as its filter. Types come first (config/types.py's
type_errors: read_config() refuses a wrongly typed value, a Config built in code may still hold
one), then sizes, then each section's ranges, then the arithmetic between sections, which
assumes positive sizes. What follows from a valid config (degrees, micro-batches per step, tokens
per step, ...) is `derive()`'s (config/derive.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

from fivefold.config.derive import data_parallel_degree, padded_vocab
from fivefold.config.schema import SINK_PACKAGES, Config, leaves
from fivefold.config.types import type_errors
from fivefold.data.resolve import data_errors, tokenizer_vocab, unpadded_vocab
from fivefold.data.sources import path_kind
from fivefold.parallel.pipeline.schedules import build_schedule
from fivefold.validate.attention import attention_errors
from fivefold.validate.hints import divisors_near, multiples_near
from fivefold.validate.lora import lora_errors
from fivefold.validate.rope import rope_errors
from fivefold.validate.shape import expert_group_errors, head_errors
from fivefold.validate.speed import speed_errors


def _non_finite_errors(cfg: Config) -> list[str]:
    """Number fields that are nan or infinite: nan compares false with every bound checked later."""
    return [f"{key} = {value!r}: must be a finite number" for key, value, hint in leaves(cfg)
            if hint is float and isinstance(value, float) and not math.isfinite(value)]  # (a str: a type error)


def _sink_errors(cfg: Config) -> list[str]:
    """run.sinks: known names, jsonl kept, and each sink's optional package installed; found with
    find_spec, which locates a package without importing it (wandb alone takes most of a second)."""
    r = cfg.run
    errors = []
    for name in dict.fromkeys(r.sinks):
        package = SINK_PACKAGES.get(name, "")
        if package == "":
            errors.append(f"run.sinks: unknown sink '{name}'; choose among {', '.join(map(repr, SINK_PACKAGES))}")
        elif package and importlib.util.find_spec(package) is None:
            errors.append(f"run.sinks includes '{name}' but the {package} package is not installed: "
                          f"pip install 'fivefold[{name}]' (make install does), or remove it from run.sinks")
    if len(set(r.sinks)) != len(r.sinks):
        errors.append(f"run.sinks = {list(r.sinks)} names a sink twice; list each once")
    if "jsonl" not in r.sinks:
        errors.append(f"run.sinks = {list(r.sinks)} leaves out 'jsonl': resume and `fivefold report` read "
                      f"{r.metrics_file}; add 'jsonl' (the other sinks come beside it)")
    if "wandb" in r.sinks and (not r.wandb_project or len(r.wandb_project) > 128
                               or any(c in r.wandb_project for c in "/\\#?%:")):
        errors.append(f"run.wandb_project = {r.wandb_project!r}: W&B project names are 1 to 128 characters "
                      f"without / \\ # ? % :")
    return errors


def validate(cfg: Config, world_size: int) -> list[str]:
    """Every problem of `cfg` for `world_size` processes, one message each (empty = valid)."""
    errors = type_errors(cfg) + _non_finite_errors(cfg)
    if errors:  # arithmetic on wrongly typed (or nan) values would only add noise
        return errors
    errors = _size_errors(cfg)
    bad_sizes = bool(errors)
    errors += _optimizer_errors(cfg) + _data_section_errors(cfg) + _run_errors(cfg)
    if bad_sizes:  # the arithmetic below assumes positive sizes
        return errors
    dp = data_parallel_degree(cfg, world_size)
    return (errors + _mesh_errors(cfg, world_size, dp) + head_errors(cfg) + _tp_split_errors(cfg)
            + _stage_errors(cfg) + _vocab_errors(cfg) + _expert_errors(cfg, dp) + _batch_errors(cfg, dp)
            + _sequence_errors(cfg) + attention_errors(cfg) + rope_errors(cfg) + _schedule_errors(cfg, dp)
            + speed_errors(cfg) + lora_errors(cfg))


def _size_errors(cfg: Config) -> list[str]:
    """Counts and sizes: at least 1, or 0 or more where 0 means off or "derive it"."""
    m, p, t, o, d, c = cfg.model, cfg.parallel, cfg.train, cfg.optim, cfg.data, cfg.checkpoint
    positive = {
        "model.dim": m.dim, "model.n_layers": m.n_layers, "model.n_heads": m.n_heads,
        "model.n_kv_heads": m.n_kv_heads, "model.ffn_dim": m.ffn_dim, "parallel.tp": p.tp,
        "parallel.pp": p.pp, "parallel.cp": p.cp, "parallel.ep": p.ep,
        "parallel.dp_replicate": p.dp_replicate, "parallel.virtual_stages": p.virtual_stages,
        "train.steps": t.steps, "train.global_batch": t.global_batch, "train.micro_batch": t.micro_batch,
        "train.seq_len": t.seq_len, "train.eval_batches": t.eval_batches, "train.log_every": t.log_every,
        "data.vocab_multiple": d.vocab_multiple, "checkpoint.keep": c.keep, "run.trace_steps": cfg.run.trace_steps,
        "train.memory_snapshot_entries": t.memory_snapshot_entries,
    }
    non_negative = {
        "parallel.dp": p.dp, "model.head_dim": m.head_dim, "model.vocab_size": m.vocab_size,
        "model.moe.n_experts": m.moe.n_experts, "model.moe.ffn_dim": m.moe.ffn_dim,
        "model.moe.n_shared_experts": m.moe.n_shared_experts, "model.moe.first_dense_layers": m.moe.first_dense_layers,
        **{f"model.latent.{key}": value for key, value in dataclasses.asdict(m.latent).items()},
        "model.moe.n_groups": m.moe.n_groups, "model.moe.topk_groups": m.moe.topk_groups,
        "optim.warmup_steps": o.warmup_steps, "train.eval_every": t.eval_every, "train.stop_after": t.stop_after,
        "train.gc_every": t.gc_every, "optim.grad_clip": o.grad_clip, "optim.weight_decay": o.weight_decay,
        "data.max_bytes": d.max_bytes, "checkpoint.every": c.every, "train.peak_tflops": t.peak_tflops,
        "train.loss_chunk": t.loss_chunk, "model.mtp_layers": m.mtp_layers, "train.mtp_weight": t.mtp_weight,
    }
    return ([f"{key} = {value}: must be at least 1" for key, value in positive.items() if value < 1]
            + [f"{key} = {value}: must be 0 or more" for key, value in non_negative.items() if value < 0])


def _optimizer_errors(cfg: Config) -> list[str]:
    """The learning-rate schedule, AdamW, Muon, fp16 loss scaling and the device."""
    t, o = cfg.train, cfg.optim
    errors = []
    err = errors.append
    if o.lr <= 0:
        err(f"optim.lr = {o.lr}: must be > 0")
    if not 0 <= o.min_lr_ratio <= 1:
        err(f"optim.min_lr_ratio = {o.min_lr_ratio}: must be within [0, 1]")
    if t.stop_after > t.steps >= 1:  # (a train.steps < 1 is reported with the sizes, once)
        err(f"train.stop_after = {t.stop_after} exceeds train.steps = {t.steps}; lower it (0 = run to the end)")
    if o.warmup_steps > t.steps >= 1:
        err(f"optim.warmup_steps = {o.warmup_steps} exceeds train.steps = {t.steps}; lower warmup_steps")
    if not 0 < o.decay_fraction <= 1:
        err(f"optim.decay_fraction = {o.decay_fraction}: must be within (0, 1]")
    for key, value in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        if not 0 <= value < 1:
            err(f"{key} = {value}: must be within [0, 1)")
    if o.eps <= 0:
        err(f"optim.eps = {o.eps}: must be > 0")
    m = o.muon
    if m.lr < 0 or not 0 <= m.momentum < 1 or m.ns_steps < 1:
        err(f"optim.muon: lr = {m.lr} (>= 0, 0 = optim.lr), momentum = {m.momentum} (within [0, 1)), ns_steps = "
            f"{m.ns_steps} (>= 1)")
    if o.qk_clip < 0:
        err(f"optim.qk_clip = {o.qk_clip}: must be >= 0 (0 = off)")
    elif o.qk_clip and cfg.model.attention.backend in ("sdpa", "flex"):
        err(f"optim.qk_clip reads each head's largest logit from the blockwise path's tiles, but "
            f"model.attention.backend = '{cfg.model.attention.backend}' gives none: set backend = 'auto'")
    elif o.qk_clip and cfg.model.norm.qk:
        err("optim.qk_clip scales W_q and W_k, which model.norm.qk normalises away: set qk_clip = 0, "
            "or norm.qk = false")
    if o.name == "muon" and cfg.parallel.offload != "none":
        err(f"optim.name = 'muon' is not built yet with parallel.offload = '{cfg.parallel.offload}' (its owners "
            "gather the matrices' pieces on the device): set offload = 'none', or optim.name = 'adamw'")
    if t.loss_scale < 0 or t.min_loss_scale <= 0 or t.loss_scale_window < 1 or not 0 <= t.initial_scale_power <= 64:
        err(f"fp16 loss scaling: train.loss_scale = {t.loss_scale} (>= 0, 0 = dynamic), min_loss_scale = "
            f"{t.min_loss_scale} (> 0), loss_scale_window = {t.loss_scale_window} (>= 1), initial_scale_power = "
            f"{t.initial_scale_power} (0..64)")
    if t.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            err("train.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return errors


def _data_section_errors(cfg: Config) -> list[str]:
    """[data]: fractions, the BPE size, that the inputs exist, and what their headers say."""
    d = cfg.data
    errors = []
    if not 0 <= d.val_fraction < 1:
        errors.append(f"data.val_fraction = {d.val_fraction}: must be within [0, 1)")
    if d.tokenizer == "bpe" and d.bpe_vocab < 260:
        errors.append(f"data.bpe_vocab = {d.bpe_vocab}: a byte-level BPE needs at least 260 tokens (256 bytes + "
                      f"specials)")
    missing = [path for path in d.paths if not Path(path).exists() and path_kind(path) != "megatron"]
    for path in missing:
        errors.append(f"data.paths: '{path}' does not exist; give existing text files or folders, prepared "
                      "datasets or token files, or [] for the standard library")
    if not missing:
        errors += data_errors(cfg)
    return errors


def _run_errors(cfg: Config) -> list[str]:
    """[run]: the hardware profile exists, and the metric sinks."""
    hardware = cfg.run.hardware
    errors = []
    if hardware and not Path(hardware).is_file():
        errors.append(f"run.hardware = '{hardware}' does not exist; write one with `fivefold calibrate --out "
                      f"{hardware}` or leave it empty")
    return errors + _sink_errors(cfg)


def _mesh_errors(cfg: Config, world_size: int, dp: int) -> list[str]:
    """The degrees multiply to the number of processes; the data-parallel options fit together."""
    p = cfg.parallel
    errors = []
    err = errors.append
    rest = p.pp * p.cp * p.tp
    if p.dp == 0 and dp == 0:
        err(f"parallel.pp x cp x tp = {rest} does not divide the {world_size} processes; "
            f"launch a multiple of {rest} processes or lower those degrees")
    elif dp * rest != world_size:
        err(f"parallel.dp x pp x cp x tp = {dp} x {p.pp} x {p.cp} x {p.tp} = {dp * rest} but {world_size} "
            f"processes were launched; set parallel.dp = 0 (fill the rest) or launch {dp * rest} processes")
    if dp and dp % p.dp_replicate:
        err(f"parallel.dp_replicate = {p.dp_replicate} does not divide dp = {dp}; use one of {divisors_near(dp, dp)}")
    if p.zero not in (0, 1, 2, 3):
        err(f"parallel.zero = {p.zero}: must be 0 (DDP), 1, 2 or 3 (FSDP)")
    elif p.dp_replicate > 1 and p.zero == 0:
        err(f"parallel.dp_replicate = {p.dp_replicate} with parallel.zero = 0: DDP already replicates the whole "
            f"model over every dp rank, so replica groups change nothing; set zero = 1, 2 or 3 (HSDP: ZeRO shards "
            f"over dp / dp_replicate ranks, replicated dp_replicate times) or dp_replicate = 1")
    if p.sp and p.tp == 1:
        err("parallel.sp = true needs parallel.tp > 1 (it splits the sequence over the tp ranks)")
    if p.dp_collective == "ring" and p.zero:
        err(f"parallel.dp_collective = 'ring' is DDP's all-reduce; with parallel.zero = {p.zero} set "
            "dp_collective = 'builtin'")
    if p.bucket_mb <= 0:
        err(f"parallel.bucket_mb = {p.bucket_mb}: must be > 0 (25 is the usual choice)")
    errors += _param_dtype_errors(cfg)
    if p.buckets_in_flight < 1:
        err(f"parallel.buckets_in_flight = {p.buckets_in_flight}: must be >= 1 (2 is the default)")
    if p.collective_timeout_s <= 0:
        err(f"parallel.collective_timeout_s = {p.collective_timeout_s}: must be > 0 seconds (600 is the default)")
    if p.first_step_timeout_s <= 0:
        err(f"parallel.first_step_timeout_s = {p.first_step_timeout_s}: must be > 0 seconds (1800 is the default)")
    return errors


def _param_dtype_errors(cfg: Config) -> list[str]:
    """parallel.param_dtype = "bf16" needs gathered weights (ZeRO-3), no pipeline and no fp16 compute."""
    p = cfg.parallel
    why = ("" if p.param_dtype == "fp32" else
           f"parallel.zero = {p.zero} keeps fp32 weights on every rank; set zero = 3" if p.zero != 3 else
           f"parallel.pp = {p.pp}: stages exchange activations in fp32; set pp = 1" if p.pp > 1 else
           "train.dtype = 'fp16' would compute bf16 weights in fp16; set train.dtype = 'bf16'"
           if cfg.train.dtype == "fp16" else "")
    return [f"parallel.param_dtype = 'bf16' with {why} or param_dtype = 'fp32'"] if why else []


def _tp_split_errors(cfg: Config) -> list[str]:
    """The widths tensor parallelism splits are divisible by tp."""
    m, tp = cfg.model, cfg.parallel.tp
    split_by_tp = [("model.n_heads", m.n_heads), ("model.ffn_dim", m.ffn_dim)]
    if not m.latent.kv_lora_rank:
        split_by_tp.insert(1, ("model.n_kv_heads", m.n_kv_heads))
    return [f"{key} = {value} is not divisible by parallel.tp = {tp}; use tp in "
            f"{{{divisors_near(value, 64)}}} or {key} = {multiples_near(value, tp)}"
            for key, value in split_by_tp if value % tp]


def _stage_errors(cfg: Config) -> list[str]:
    """The blocks split into pp x virtual_stages pipeline stages of at least one block each."""
    m, p = cfg.model, cfg.parallel
    stages = p.pp * p.virtual_stages
    if p.stage_layers:
        if len(p.stage_layers) != stages or sum(p.stage_layers) != m.n_layers or min(p.stage_layers) < 1:
            return [f"parallel.stage_layers = {list(p.stage_layers)}: needs pp x virtual_stages = {stages} entries, "
                    f"each at least 1, adding up to model.n_layers = {m.n_layers} (or [] for a balanced split)"]
    elif m.n_layers < stages:  # any other count splits: unevenly, balanced by parallel/pipeline/stage_split.py
        return [f"model.n_layers = {m.n_layers} is fewer than parallel.pp x virtual_stages = {stages} stages of at "
                f"least one block each; lower pp or virtual_stages to at most {m.n_layers} stages, or raise n_layers"]
    return []


def _vocab_errors(cfg: Config) -> list[str]:
    """The vocabulary holds the tokenizer's tokens and splits over tp."""
    m, tp = cfg.model, cfg.parallel.tp
    errors = []
    vocab = padded_vocab(cfg, unpadded_vocab(cfg))
    if m.vocab_size and m.vocab_size < tokenizer_vocab(cfg):
        errors.append(f"model.vocab_size = {m.vocab_size} is smaller than the {cfg.data.tokenizer or 'data'}'s "
                      f"tokenizer's {tokenizer_vocab(cfg)} tokens; set model.vocab_size = 0 to take the tokenizer's "
                      f"(padded)")
    if vocab % tp:
        errors.append(f"vocabulary {vocab} is not divisible by parallel.tp = {tp}; set data.vocab_multiple to a "
                      f"multiple of {tp}")
    return errors


def _expert_errors(cfg: Config, dp: int) -> list[str]:
    """Mixture of experts: routing, balancing and capacity settings; ep for the experts and the ranks."""
    m, p = cfg.model, cfg.parallel
    errors = []
    err = errors.append
    if m.moe.n_experts:
        if not 1 <= m.moe.top_k <= m.moe.n_experts:
            err(f"model.moe.top_k = {m.moe.top_k}: must be between 1 and model.moe.n_experts = {m.moe.n_experts}")
        if m.moe.n_experts % p.ep:
            err(f"model.moe.n_experts = {m.moe.n_experts} is not divisible by parallel.ep = {p.ep}; "
                f"use ep in {{{divisors_near(m.moe.n_experts, 64)}}}")
        for key, value in (("model.moe.bias_update", m.moe.bias_update), ("model.moe.aux_loss", m.moe.aux_loss)):
            if value < 0:
                err(f"{key} = {value}: must be 0 (off) or more")
        if m.moe.capacity_factor and m.moe.capacity_factor < 1:
            err(f"model.moe.capacity_factor = {m.moe.capacity_factor}: must be 0 (dropless) or at least 1 "
                f"(1.25 is common); below 1 even a perfectly balanced router drops tokens")
        if m.moe.routed_scale <= 0:
            err(f"model.moe.routed_scale = {m.moe.routed_scale}: must be > 0 (1 = unscaled; DeepSeek-V3: 2.5)")
        if m.moe.n_groups > 1:
            errors += expert_group_errors(cfg)
        if m.moe.first_dense_layers >= m.n_layers:
            err(f"model.moe.first_dense_layers = {m.moe.first_dense_layers} leaves no MoE block of {m.n_layers}; "
                f"lower it")
        if m.moe.swiglu_limit < 0:
            err(f"model.moe.swiglu_limit = {m.moe.swiglu_limit}: must be 0 (plain SwiGLU) or more (gpt-oss: 7.0)")
        elif m.moe.swiglu_limit and m.activation != "silu":
            err(f"model.moe.swiglu_limit = {m.moe.swiglu_limit} is gpt-oss's clamped SwiGLU, but model.activation = "
                f"'{m.activation}'; set model.activation = 'silu' or model.moe.swiglu_limit = 0")
    elif p.ep > 1:
        err(f"parallel.ep = {p.ep} needs an MoE model; set model.moe.n_experts > 0 or parallel.ep = 1")
    for key, on in (("model.moe.linear_bias", m.moe.linear_bias), ("model.moe.swiglu_limit", m.moe.swiglu_limit)):
        if on and not m.moe.n_experts:
            err(f"{key} applies to the experts only and this model has none; set it off or model.moe.n_experts > 0")
    if dp and (dp * p.cp) % p.ep:
        err(f"parallel.ep = {p.ep} does not divide dp x cp = {dp * p.cp}; experts are sharded inside the "
            "data-parallel ranks")
    return errors


def _batch_errors(cfg: Config, dp: int) -> list[str]:
    """The global batch splits into dp x micro_batch sequences."""
    t = cfg.train
    k = dp * t.micro_batch
    if not dp or t.global_batch % k == 0:
        return []
    # Only hints that can fix it: a micro_batch can only help when dp divides the global batch.
    other = (f"a micro_batch in {{{divisors_near(t.global_batch // dp, t.global_batch // dp)}}}"
             if t.global_batch % dp == 0 else
             f"a dp (processes / (pp x cp x tp)) in {{{divisors_near(t.global_batch, t.global_batch)}}}")
    return [f"train.global_batch = {t.global_batch} is not divisible by dp x train.micro_batch = {dp} x "
            f"{t.micro_batch} = {k}; use global_batch = {multiples_near(t.global_batch, k)} or {other}"]


def _sequence_errors(cfg: Config) -> list[str]:
    """The sequence splits over cp (and tp with sp), and Ulysses' heads over cp."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    errors = []
    err = errors.append
    ring = p.cp > 1 and p.cp_method == "ring"
    seq_multiple = (2 * p.cp if ring else p.cp) * (p.tp if p.sp else 1)
    if t.seq_len % seq_multiple:
        why = "2 x cp zig-zag chunks" if ring else "cp shards"
        err(f"train.seq_len = {t.seq_len} is not divisible by {seq_multiple} ({why}"
            f"{', x tp with sp' if p.sp else ''}); use seq_len = {multiples_near(t.seq_len, seq_multiple)}")
    kv_heads = m.n_heads if m.latent.kv_lora_rank else m.n_kv_heads  # latent attention: every head has its k, v
    if p.cp > 1 and p.cp_method == "ulysses" and m.n_heads % p.tp == 0 and kv_heads % p.tp == 0:
        heads, kv = m.n_heads // p.tp, kv_heads // p.tp
        if heads % p.cp or kv % p.cp:
            err(f"parallel.cp_method = 'ulysses' splits each tp rank's heads over cp: {heads} query and {kv} "
                f"key/value heads are not both divisible by cp = {p.cp}; use cp_method = 'ring' or a cp in "
                f"{{{divisors_near(math.gcd(heads, kv), 64)}}}")
    return errors


def _schedule_errors(cfg: Config, dp: int) -> list[str]:
    """The pipeline schedule runs with this step's micro-batches and virtual stages."""
    p, t = cfg.parallel, cfg.train
    errors = []
    if dp and t.global_batch % (dp * t.micro_batch) == 0:
        micro = t.global_batch // (dp * t.micro_batch)
        if p.pp > 1 and micro < p.pp:
            errors.append(f"{micro} micro-batches per step is fewer than parallel.pp = {p.pp} stages; the "
                          f"{p.pp_schedule} schedule needs at least pp: raise train.global_batch or lower "
                          f"train.micro_batch")
        else:
            try:
                schedule = build_schedule(p.pp_schedule, p.pp, micro, p.virtual_stages)
            except ValueError as e:
                errors.append(f"parallel.pp_schedule = '{p.pp_schedule}' with pp = {p.pp}, virtual_stages = "
                              f"{p.virtual_stages} and {micro} micro-batches per step: {e}")
            else:
                if t.compile and schedule.splits_backward:
                    # A compiled block's backward is one autograd node computing every gradient at
                    # once: I and W would each run all of it, the backward twice.
                    errors.append(f"train.compile = true with parallel.pp_schedule = '{p.pp_schedule}': its "
                                  f"split backward (I, W) cannot split a compiled block's backward; use "
                                  f"parallel.pp_schedule = '1f1b' or 'interleaved_1f1b', or train.compile = false")
                if p.tp_overlap and p.sp and p.tp > 1 and schedule.splits_backward:
                    # Each overlapped matmul is one autograd node computing dx and dW together, its ring
                    # inside: W would run the ring again (comm/collective_matmul.py).
                    errors.append(f"parallel.tp_overlap = true is not built yet with parallel.pp_schedule = "
                                  f"'{p.pp_schedule}': its split backward (I, W) cannot split an overlapped "
                                  f"matmul's; use pp_schedule = '1f1b' or 'interleaved_1f1b', or tp_overlap = false")
    if p.pp_schedule in ("dualpipe_v", "zb_v") and p.virtual_stages != 2:
        errors.append(f"parallel.pp_schedule = '{p.pp_schedule}' runs 2 stages per rank; set "
                      f"parallel.virtual_stages = 2")
    return errors
