"""The whole configuration schema: one frozen dataclass per section, TOML loading and CLI overrides.

Precedence, lowest first: field defaults < `model.preset` < the TOML file < `--section.key=value`.
`load_config()` parses, and reports unknown keys and values not of their field's declared type
(each skipped, so no code ever sees a wrongly typed value); `validate()` (in `fivefold.validate`)
checks ranges and the arithmetic between sections. Both collect every problem before anything
starts, so a user fixes a config in one round.

The model section lives in model/config.py (the presets build on it); the others are here. A
combination of settings fivefold cannot run yet is refused by `validate()` by name ("not built
yet"), never silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from fivefold.model.config import ModelConfig
from fivefold.model.presets import PRESETS


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 0  # data-parallel degree; 0 = every process not used by pp x cp x tp
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
    tp: int = 1  # tensor-parallel degree
    sp: bool = False  # sequence parallel inside tp regions
    pp: int = 1  # pipeline stages
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v"] = "1f1b"
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedules)
    # blocks of each pipeline stage, pp x virtual_stages entries; () = the same in each stage, or, when
    # pp x virtual_stages does not divide n_layers, balanced by the planner's costs (parallel/pipeline/stage_split.py)
    stage_layers: tuple[int, ...] = ()
    cp: int = 1  # context-parallel degree (sequence of one sample split over cp ranks)
    cp_method: Literal["ring", "ulysses"] = "ring"
    ep: int = 1  # expert-parallel degree; divides dp x cp
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
    # every wait, e.g. while rank 0 trains the BPE tokenizer (torchtitan: comm.train_timeout_seconds;
    # Megatron: --distributed-timeout-minutes).
    collective_timeout_s: float = 300.0


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100  # optimizer steps
    # End this job after this step, with a checkpoint, leaving the LR schedule of `steps` as it is;
    # the next job continues with --resume (for clusters' job time limits). 0 = run to `steps`.
    stop_after: int = 0
    global_batch: int = 8  # sequences per optimizer step, over all ranks
    micro_batch: int = 2  # sequences per forward/backward on one rank
    seq_len: int = 64  # tokens per sequence
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr
    lr_schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # after warmup
    warmup_steps: int = 10  # linear warmup from 0 to lr
    decay_fraction: float = 0.2  # wsd: share of steps spent in the final linear decay
    weight_decay: float = 0.1  # AdamW decoupled decay; never applied to norms and biases
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global gradient-norm cap; 0 disables clipping
    seed: int = 0  # model init and data order
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # compute dtype (autocast); auto: fp32 on CPU, bf16 on GPU
    loss_scale: float = 0.0  # fp16 only: fixed loss scale, or 0 for dynamic scaling
    initial_scale_power: int = 16  # fp16 dynamic scaling starts at 2**this
    loss_scale_window: int = 1000  # fp16: clean steps before the scale doubles
    min_loss_scale: float = 1.0  # fp16: the scale never drops below this
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compile: bool = False  # torch.compile each block's forward (not with zb_h1, zb_v, dualpipe_v past one stage)
    recompute: Literal["none", "selective", "full"] = "none"  # activation recomputation
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
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config)}  # type: ignore[misc]
# The declared type of each key of each section, resolved once (`from __future__ import annotations` leaves
# them as text, and resolving takes a millisecond a section: the planner validates thousands of layouts).
FIELD_TYPES: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {name: MappingProxyType(typing.get_type_hints(cls)) for name, cls in SECTIONS.items()})


class ConfigError(ValueError):
    """All problems found in a configuration, one per line (one problem: one line)."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        listed = errors[0] if len(errors) == 1 else "\n" + "\n".join(f"  - {e}" for e in errors)
        super().__init__(f"invalid configuration: {listed}")


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(options)}"


def _matches(value: Any, hint: Any) -> bool:
    """Whether a value (tuples for TOML arrays) is of a field's declared type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:  # (1 == True: an integer must not pass for a bool choice, nor a bool for an int one)
        return any(value == c and isinstance(value, bool) == isinstance(c, bool) for c in args)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args, strict=True))
    if hint is float:  # TOML's integers are numbers too; a bool is not
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint) and (hint is bool or not isinstance(value, bool))


def _describe(hint: Any) -> str:
    """What a field's declared type asks for, in TOML's words."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(str(c).lower() if isinstance(c, bool) else repr(c) for c in args)
    if origin is tuple and typing.get_origin(args[0]) is tuple:  # data.mixture's [path, weight] pairs
        return f"a list of [{', '.join(_noun(a) for a in typing.get_args(args[0]))}] pairs"
    if origin is tuple:
        return f"a list of {'ints' if args[0] is int else _noun(args[0]) + 's'}"
    return "true or false" if hint is bool else f"{'an' if hint is int else 'a'} {_noun(hint)}"


def _noun(hint: type) -> str:
    return {bool: "bool", int: "integer", float: "number", str: "string"}[hint]


def type_error(name: str, value: Any, hint: Any) -> str | None:
    """`section.key = value: must be ...` when value is not of the declared type, else None."""
    if _matches(value, hint):
        return None
    return f"{name} = {_thawed(value)!r}: must be {_describe(hint)}"


def type_errors(cfg: Config) -> list[str]:
    """Every field of cfg not of its declared type (load_config() lets none through; a Config
    built in code may hold one)."""
    errors = []
    for section, types in FIELD_TYPES.items():
        values = getattr(cfg, section)
        for key, hint in types.items():
            error = type_error(f"{section}.{key}", getattr(values, key), hint)
            if error:
                errors.append(error)
    return errors


def _frozen(value: Any) -> Any:
    """TOML arrays as tuples, at every depth (the dataclasses are frozen, their values hashable)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _thawed(value: Any) -> Any:
    """Tuples as the lists a user writes in TOML, for messages."""
    return [_thawed(v) for v in value] if isinstance(value, tuple) else value


def parse_value(text: str) -> Any:
    """A CLI value read as TOML (42, 1e-3, true, ["a", "b"]); anything else is a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _string_value(text: str) -> str:
    """A string field's CLI value: the text as written (`--run.name=2024` names the run "2024"), or the
    string a quoted TOML string stands for (`"x"`, as fivefold/deepspeed.py writes strings)."""
    value = parse_value(text)
    return value if isinstance(value, str) else text


def parse_overrides(args: list[str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """`--section.key=value` or `--section.key value` pairs -> nested dict, plus errors. A value is
    read as TOML, except for a string field's, which is taken as written."""
    out: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            errors.append(f"override '{arg}': expected --section.key=value (e.g. --train.steps=200)")
            continue
        key, sep, value = arg[2:].partition("=")
        if not sep:
            if i >= len(args):
                errors.append(f"override '{arg}' has no value: write --{key}=VALUE")
                continue
            value = args[i]
            i += 1
        section, _, name = key.partition(".")
        is_string = section in SECTIONS and FIELD_TYPES[section].get(name) is str
        out.setdefault(section, {})[name] = _string_value(value) if is_string else parse_value(value)
    return out, errors


def _merge_section(section: str, base: dict[str, Any], raw: Any, errors: list[str]) -> None:
    """raw's keys into base, each one unknown or not of its declared type reported and skipped."""
    types = FIELD_TYPES[section]
    if not isinstance(raw, dict):
        errors.append(f"[{section}] must be a table of keys, got {raw!r}")
        return
    for key, value in raw.items():
        if key not in types:
            errors.append(f"unknown key '{section}.{key}': {_suggest(key, list(types))}")
            continue
        value = _frozen(value)
        error = type_error(f"{section}.{key}", value, types[key])
        if error:
            errors.append(error)
        else:
            base[key] = value


def build_config(layers: list[dict[str, Any]]) -> tuple[Config, list[str]]:
    """Merge layers of {section: {key: value}} over the defaults (and a model preset)."""
    errors: list[str] = []
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for layer in layers:
        for section, raw in layer.items():
            if section not in SECTIONS:
                errors.append(f"unknown section '[{section}]': {_suggest(section, list(SECTIONS))}")
                continue
            _merge_section(section, values[section], raw, errors)
    preset = values["model"].get("preset", "")
    model_values = dict(values["model"])
    if preset:
        if preset not in PRESETS:
            errors.append(f"model.preset = '{preset}' is unknown: {_suggest(preset, sorted(PRESETS))}")
        else:
            model_values = {**dataclasses.asdict(PRESETS[preset]), **model_values}
    values["model"] = model_values
    sections = {name: SECTIONS[name](**vals) for name, vals in values.items()}
    return Config(**sections), errors


def read_config(path: str | Path | None = None, overrides: list[str] | None = None) -> tuple[Config, list[str]]:
    """Defaults < preset < TOML file < CLI overrides, plus every parse problem (unknown keys and
    values of the wrong type are skipped, so validate() can still report the rest of the mistakes
    in the same round)."""
    layers: list[dict[str, Any]] = []
    name = ""
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError([f"config file '{path}' does not exist (see configs/ for examples)"])
        try:
            layers.append(tomllib.loads(path.read_text(encoding="utf-8")))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError([f"{path}: not valid TOML: {e}"]) from None
        except UnicodeDecodeError:
            raise ConfigError([f"{path}: not a text file (not UTF-8); give a TOML config such as "
                               f"configs/tiny.toml"]) from None
        name = path.stem
    cli, errors = parse_overrides(overrides or [])
    layers.append(cli)
    cfg, merge_errors = build_config(layers)
    if not cfg.run.name and name:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=name))
    return cfg, errors + merge_errors


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """read_config() that raises ConfigError listing every parse problem."""
    cfg, errors = read_config(path, overrides)
    if errors:
        raise ConfigError(errors)
    return cfg


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML that load_config() reads back unchanged."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (tuple, list)):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)

    lines: list[str] = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for key, value in dataclasses.asdict(getattr(cfg, section)).items():
            lines.append(f"{key} = {fmt(value)}")
        lines.append("")
    return "\n".join(lines)


def replace(cfg: Config, **sections: dict[str, Any]) -> Config:
    """A copy of cfg with some keys changed: replace(cfg, train={"steps": 5})."""
    return dataclasses.replace(
        cfg, **{name: dataclasses.replace(getattr(cfg, name), **vals) for name, vals in sections.items()}
    )
