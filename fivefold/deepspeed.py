"""Read a DeepSpeed JSON config as fivefold `--section.key=value` overrides.

`fivefold train --deepspeed ds_config.json` lays these overrides between the TOML file and the
command line, so a DeepSpeed user keeps their file and fivefold's own keys still win. Every key of
the JSON ends in one of three places, so nothing is dropped silently: `mapping` (what it became),
`ignored` (no fivefold meaning, named so the user knows) or `errors` (a refusal with a fix).

The batch triple follows DeepSpeed's rule train_batch_size = micro x grad_accum x dp with
dp = world_size / (tp x pp), derives missing members as DeepSpeed does, and refuses what DeepSpeed
refuses. `tensor_parallel.tp_size` and `pipeline_parallel.pp_size` are fivefold extensions found
in published configs, not DeepSpeed training keys (DeepSpeed's training TP key is
`tensor_parallel.autotp_size`; its pipeline degree is set in code). validate() is not run here:
the CLI runs it on the merged config, where the TOML's keys are known too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fivefold.config import ConfigError

BYTES_PER_ELEMENT = 4  # DeepSpeed sizes buckets in elements; fivefold in MB of fp32 gradients
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
PRECISION = ("fp16", "bf16", "bfloat16")  # "bfloat16" is DeepSpeed's older spelling of "bf16"
FP16_KEYS = {"loss_scale": ("train.loss_scale", False), "initial_scale_power": ("train.initial_scale_power", True),
             "loss_scale_window": ("train.loss_scale_window", True), "min_loss_scale": ("train.min_loss_scale", False)}
OPTIMIZERS = ("Adam", "AdamW")
# Scheduler params and DeepSpeed's defaults for them (None: DeepSpeed requires the key).
SCHEDULERS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
}


@dataclass
class DeepSpeedMapping:
    overrides: list[str] = field(default_factory=list)  # --section.key=value, for read_config()
    mapping: list[tuple[str, str]] = field(default_factory=list)  # DeepSpeed key path -> what it became
    ignored: list[str] = field(default_factory=list)  # DeepSpeed key paths without a fivefold meaning
    errors: list[str] = field(default_factory=list)  # refusals, each naming key, values and fix


def _toml(value: Any) -> str:
    """A value as parse_value() reads it back: TOML literals, strings quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string of plain text is a TOML basic string
    return repr(value)


class _Mapper:
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}  # fivefold key -> value; a later set wins, as on the CLI
        self.m = DeepSpeedMapping()

    def set(self, path: str, key: str, value: Any, note: str = "") -> None:
        self.values[key] = value
        self.m.mapping.append((path, f"{key} = {_toml(value)}" + (f"  ({note})" if note else "")))

    def note(self, path: str, text: str) -> None:
        self.m.mapping.append((path, text))

    def keep(self, path: str, key: str) -> None:
        # HF-style "auto": the trainer fills it in; for fivefold that trainer is the TOML file.
        self.note(path, f"{key} kept from the fivefold config (DeepSpeed value 'auto')")

    def ignore(self, path: str) -> None:
        self.m.ignored.append(path)

    def error(self, text: str) -> None:
        self.m.errors.append(text)

    def section(self, path: str, value: Any) -> dict[str, Any] | None:
        if isinstance(value, dict):
            return value
        self.error(f"{path} = {value!r}: must be a JSON object {{...}}")
        return None

    def number(self, path: str, value: Any, integer: bool = False, low: float | None = None) -> Any:
        """value as int/float, or None after an error naming the key (bools are not numbers)."""
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and integer:  # JSON writes 5e8 as a float; DeepSpeed accepts it as an integer
            ok = float(value).is_integer()
        if ok and low is not None:
            ok = value >= low
        if not ok:
            what = "an integer" if integer else "a number"
            self.error(f"{path} = {value!r}: must be {what}" + (f" >= {low:g}" if low is not None else ""))
            return None
        return int(value) if integer else float(value)

    def flag(self, path: str, value: Any) -> bool | None:
        if isinstance(value, bool):
            return value
        self.error(f"{path} = {value!r}: must be true or false")
        return None

    def take(self, path: str, value: Any, key: str, integer: bool = False, low: float | None = 0,
             note: str = "") -> None:
        """One DeepSpeed number -> one fivefold key ("auto" keeps fivefold's value)."""
        if value == "auto":
            self.keep(path, key)
        elif (n := self.number(path, value, integer, low)) is not None:
            self.set(path, key, n, note)


def _model_parallel(ds: dict[str, Any], mp: _Mapper) -> tuple[int, int]:
    """tp and pp degrees (1 when absent): they decide dp for DeepSpeed's batch rule."""
    tp = pp = 1
    sec = mp.section("tensor_parallel", ds["tensor_parallel"]) if "tensor_parallel" in ds else {}
    for key, value in (sec or {}).items():
        path = f"tensor_parallel.{key}"
        if key not in ("autotp_size", "tp_size"):
            mp.ignore(path)
        elif (n := mp.number(path, value, integer=True, low=1)) is not None:
            if tp != 1 and n != tp:
                mp.error(f"tensor_parallel.autotp_size and tensor_parallel.tp_size disagree ({tp} vs {n}); keep one")
                continue
            tp = n
            why = ("fivefold extension: DeepSpeed trains with autotp_size; tp_size is its inference key"
                   if key == "tp_size" else "DeepSpeed AutoTP degree")
            mp.set(path, "parallel.tp", n, why)
    sec = mp.section("pipeline_parallel", ds["pipeline_parallel"]) if "pipeline_parallel" in ds else {}
    for key, value in (sec or {}).items():
        path = f"pipeline_parallel.{key}"
        if key != "pp_size":
            mp.ignore(path)
        elif (n := mp.number(path, value, integer=True, low=1)) is not None:
            pp = n
            mp.set(path, "parallel.pp", n, "fivefold extension: DeepSpeed has no pipeline_parallel "
                   "section; it sets pipeline stages in code")
    return tp, pp


def _batch(ds: dict[str, Any], mp: _Mapper, world: int, tp: int, pp: int) -> None:
    """DeepSpeed's batch triple: derive the missing members, refuse what does not multiply out."""
    present = [k for k in BATCH_KEYS if k in ds]
    if not present:
        return  # the TOML's train.global_batch and micro_batch stay
    given: dict[str, int] = {}
    for key in present:
        if ds[key] != "auto" and (n := mp.number(key, ds[key], integer=True, low=1)) is not None:
            given[key] = n
    if len(given) < sum(ds[k] != "auto" for k in present):
        return  # a value was already refused
    if world % (tp * pp):
        mp.error(f"tp x pp = {tp} x {pp} = {tp * pp} does not divide the world size {world}, so the batch "
                 f"keys cannot be checked; launch a multiple of {tp * pp} processes or lower the degrees")
        return
    dp = world // (tp * pp)
    tb, mb, ga = (given.get(k) for k in BATCH_KEYS)
    # The same floor divisions DeepSpeed makes; a remainder then fails the product check below.
    if tb and mb and ga:
        pass
    elif tb and mb:
        ga = tb // mb // dp
    elif tb and ga:
        mb = tb // dp // ga
    elif mb and ga:
        tb = mb * ga * dp
    elif tb:
        ga, mb = 1, tb // dp
    elif mb:
        ga, tb = 1, mb * dp
    else:
        autos = [k for k in present if ds[k] == "auto"]
        what = ", ".join(f"{k} = 'auto'" for k in autos) or f"gradient_accumulation_steps = {ga} alone"
        mp.error(f"{what}: nothing to derive the batch from; give train_batch_size or "
                 f"train_micro_batch_size_per_gpu as a number (DeepSpeed needs one of them too)")
        return
    assert tb is not None and mb is not None and ga is not None
    dp_text = f"dp = world size {world} / (tp {tp} x pp {pp}) = {dp}"
    if mb < 1 or ga < 1 or tb != mb * ga * dp:
        mark = {k: "" if k in given else " (derived)" for k in BATCH_KEYS}
        fixes = [f"train_batch_size = {mb * ga * dp}"] if mb >= 1 and ga >= 1 else []
        if mb >= 1 and tb % (mb * dp) == 0:
            fixes.append(f"gradient_accumulation_steps = {tb // (mb * dp)}")
        if ga >= 1 and tb % (ga * dp) == 0:
            fixes.append(f"train_micro_batch_size_per_gpu = {tb // (ga * dp)}")
        fixes.append(f"a train_batch_size that is a multiple of dp = {dp}")
        mp.error(f"batch sizes do not multiply out: train_batch_size = {tb}{mark[BATCH_KEYS[0]]} but "
                 f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp = {mb}{mark[BATCH_KEYS[1]]}"
                 f" x {ga}{mark[BATCH_KEYS[2]]} x {dp} = {mb * ga * dp} ({dp_text}); DeepSpeed refuses "
                 f"this too; fix: {' or '.join(dict.fromkeys(fixes))}")
        return
    derived = f"derived as DeepSpeed does, {dp_text}"
    mp.set(BATCH_KEYS[0], "train.global_batch", tb, "sequences per step" if tb == given.get(BATCH_KEYS[0]) else derived)
    mp.set(BATCH_KEYS[1], "train.micro_batch", mb, "" if mb == given.get(BATCH_KEYS[1]) else derived)
    mp.note(BATCH_KEYS[2], f"no own key: fivefold derives global_batch / (micro_batch x dp) = {ga}"
            + ("" if ga == given.get(BATCH_KEYS[2]) else f" ({derived})"))


def _precision(ds: dict[str, Any], mp: _Mapper) -> None:
    enabled: dict[str, bool | str | None] = {}
    for name in (n for n in PRECISION if n in ds):
        sec = mp.section(name, ds[name]) or {}
        value = sec.get("enabled", False)  # DeepSpeed's default: off
        enabled[name] = "auto" if value == "auto" else mp.flag(f"{name}.enabled", value)
        on = enabled[name] is True or (name == "fp16" and value == "auto")
        for key, sub in sec.items():
            path = f"{name}.{key}"
            if key in FP16_KEYS and name == "fp16" and on:
                target, integer = FP16_KEYS[key]
                mp.take(path, sub, target, integer)
            elif key != "enabled":
                mp.ignore(path)  # hysteresis, auto_cast, ..., or a disabled section's knobs
    on = [n for n, e in enabled.items() if e is True]
    if "fp16" in on and len(on) > 1:
        mp.error(f"fp16.enabled and {on[-1]}.enabled are both true: DeepSpeed refuses this too; enable one")
    elif on:
        mp.set(f"{on[0]}.enabled", "train.dtype", "fp16" if on[0] == "fp16" else "bf16")
    elif "auto" in enabled.values():
        mp.keep(f"{next(n for n, e in enabled.items() if e == 'auto')}.enabled", "train.dtype")
    elif enabled and all(e is False for e in enabled.values()):
        mp.set(f"{next(iter(enabled))}.enabled", "train.dtype", "fp32", "fp16/bf16 off: DeepSpeed trains in fp32")


def _zero(mp: _Mapper, sec: dict[str, Any]) -> None:
    for key, value in sec.items():
        path = f"zero_optimization.{key}"
        if key == "stage":
            mp.take(path, value, "parallel.zero", integer=True, note="fivefold's zero 3 is FSDP" if value == 3 else "")
        elif key == "overlap_comm":
            if value == "auto":
                mp.keep(path, "parallel.overlap_comm")
            elif (b := mp.flag(path, value)) is not None:
                mp.set(path, "parallel.overlap_comm", b)
        elif key == "reduce_bucket_size":
            if value == "auto":
                mp.keep(path, "parallel.bucket_mb")
            elif (n := mp.number(path, value, integer=True, low=1)) is not None:
                mp.set(path, "parallel.bucket_mb", n * BYTES_PER_ELEMENT / 1e6,
                       f"{n:g} elements x {BYTES_PER_ELEMENT} bytes per fp32 element / 10^6")
        else:
            mp.ignore(path)  # offload_*, contiguous_gradients, allgather_*, stage3_*, ...


def _optimizer(mp: _Mapper, sec: dict[str, Any]) -> None:
    kind = sec.get("type")
    if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw"):
        mp.error(f"optimizer.type = {kind!r}: fivefold trains with AdamW only; supported DeepSpeed types: "
                 f"{', '.join(OPTIMIZERS)} (any case); change the type or remove the optimizer section")
        return
    params = mp.section("optimizer.params", sec.get("params", {})) or {}
    for key in sec:
        if key not in ("type", "params"):
            mp.ignore(f"optimizer.{key}")
    # DeepSpeed's "Adam" is AdamW unless params.adam_w_mode is false; fivefold is always AdamW.
    w_mode = kind.lower() == "adamw" or params.get("adam_w_mode", True) is not False
    for key, value in params.items():
        path = f"optimizer.params.{key}"
        if key in ("lr", "eps"):
            mp.take(path, value, f"train.{key}")
        elif key == "weight_decay":
            why = ("decoupled (AdamW), as DeepSpeed here" if w_mode else "DeepSpeed would add it to the gradient "
                   "as L2 (adam_w_mode = false); fivefold always applies decoupled AdamW decay")
            mp.take(path, value, "train.weight_decay", note=why + "; fivefold never decays norms and biases")
        elif key == "betas" and value == "auto":
            mp.keep(path, "train.beta1, train.beta2")
        elif key == "betas":
            if not isinstance(value, list) or len(value) != 2:
                mp.error(f"{path} = {value!r}: must be a list of two numbers [beta1, beta2]")
                continue
            for i, beta in enumerate(value):
                mp.take(f"{path}[{i}]", beta, f"train.beta{i + 1}")
        elif key == "adam_w_mode":
            mp.note(path, "fivefold always uses decoupled weight decay (AdamW)" + ("" if w_mode else ", see weight_decay"))
        else:
            mp.ignore(path)  # torch_adam, bias_correction, amsgrad, ...


def _scheduler(mp: _Mapper, sec: dict[str, Any]) -> None:
    kind = next((k for k in SCHEDULERS if isinstance(sec.get("type"), str) and k.lower() == sec["type"].lower()), None)
    if kind is None:
        mp.error(f"scheduler.type = {sec.get('type')!r}: not supported; supported DeepSpeed schedulers: "
                 f"{', '.join(SCHEDULERS)}; change it, or remove the section and set train.lr_schedule")
        return
    params = mp.section("scheduler.params", sec.get("params", {})) or {}
    for key in [*(k for k in sec if k not in ("type", "params")), *(f"params.{k}" for k in params if k not in SCHEDULERS[kind])]:
        mp.ignore(f"scheduler.{key}")  # last_batch_iteration, ...
    p = {k: params.get(k, d) for k, d in SCHEDULERS[kind].items()}

    def path(key: str) -> str:
        return f"scheduler.params.{key}" + ("" if key in params else " (DeepSpeed default)")

    for key, default in SCHEDULERS[kind].items():
        if default is None and key not in params:
            mp.error(f"scheduler.params.{key} is missing: {kind} needs it (DeepSpeed too); add it")
            return
    shape = f"fivefold warms up linearly from 0 (DeepSpeed: {p['warmup_type']} warmup)"
    if kind == "WarmupDecayLR":
        total, warm = p["total_num_steps"], p["warmup_num_steps"]
        if "auto" in (total, warm):
            mp.error(f"scheduler.params total_num_steps = {total!r}, warmup_num_steps = {warm!r}: WarmupDecayLR "
                     f"needs both as numbers to place its linear decay; write them")
            return
        total = mp.number(path("total_num_steps"), total, integer=True, low=1)
        warm = mp.number(path("warmup_num_steps"), warm, integer=True, low=0)
        if total is None or warm is None:
            return
        if warm >= total:
            mp.error(f"scheduler.params.warmup_num_steps = {warm} >= total_num_steps = {total}: WarmupDecayLR "
                     f"would never decay; lower warmup_num_steps or use WarmupLR")
            return
        mp.set(f"scheduler.type = {kind}", "train.lr_schedule", "wsd",
               "DeepSpeed decays linearly after warmup: that is wsd with no stable phase, its decay the linear tail")
        mp.set(path("total_num_steps"), "train.steps", total)
        mp.set(path("warmup_num_steps"), "train.warmup_steps", warm, shape)
        mp.set(f"scheduler.params.total_num_steps - warmup_num_steps", "train.decay_fraction",
               (total - warm) / total, f"({total} - {warm}) / {total}")
    elif kind == "WarmupCosineLR":
        mp.set(f"scheduler.type = {kind}", "train.lr_schedule", "cosine", "peak lr is optimizer.params.lr")
        mp.take(path("total_num_steps"), p["total_num_steps"], "train.steps", integer=True, low=1)
        mp.take(path("warmup_num_steps"), p["warmup_num_steps"], "train.warmup_steps", integer=True, note=shape)
        mp.take(path("cos_min_ratio"), p["cos_min_ratio"], "train.min_lr_ratio")
        if p["warmup_min_ratio"] not in (0, "auto"):
            mp.note(path("warmup_min_ratio"), f"not reproduced: {shape}")
    else:
        mp.set(f"scheduler.type = {kind}", "train.lr_schedule", "constant", "WarmupLR holds warmup_max_lr after warmup")
        mp.take(path("warmup_num_steps"), p["warmup_num_steps"], "train.warmup_steps", integer=True, note=shape)
    if kind != "WarmupCosineLR":
        max_lr, min_lr = p["warmup_max_lr"], p["warmup_min_lr"]
        mp.take(path("warmup_max_lr"), max_lr, "train.lr", note="the scheduler sets the lr, over optimizer.params.lr")
        if kind == "WarmupDecayLR" and isinstance(max_lr, (int, float)) and max_lr > 0 and "auto" != min_lr:
            mp.take(path("warmup_min_lr"), min_lr / max_lr if isinstance(min_lr, (int, float)) else min_lr,
                    "train.min_lr_ratio", note=f"warmup_min_lr / warmup_max_lr: the decay ends at warmup_min_lr")
        elif kind == "WarmupLR" and min_lr not in (0, "auto"):
            mp.note(path("warmup_min_lr"), f"not reproduced: {shape}")


def map_deepspeed(ds: dict[str, Any], world_size: int) -> DeepSpeedMapping:
    """A DeepSpeed config (parsed JSON) for `world_size` processes -> fivefold overrides and notes."""
    if world_size < 1:
        raise ValueError(f"world_size = {world_size}: must be at least 1")
    mp = _Mapper()
    tp, pp = _model_parallel(ds, mp)
    _batch(ds, mp, world_size, tp, pp)
    _precision(ds, mp)
    # Fixed order, whatever the file's: a scheduler that sets the lr must come after the optimizer.
    handlers = {"zero_optimization": _zero, "optimizer": _optimizer, "scheduler": _scheduler}
    if "gradient_clipping" in ds:
        mp.take("gradient_clipping", ds["gradient_clipping"], "train.grad_clip", note="0 disables clipping")
    for name, handler in handlers.items():
        if name in ds and (sec := mp.section(name, ds[name])) is not None:
            handler(mp, sec)
    known = {*BATCH_KEYS, *PRECISION, *handlers, "gradient_clipping", "tensor_parallel", "pipeline_parallel"}
    mp.m.ignored.extend(k for k in ds if k not in known)
    mp.m.overrides = [f"--{key}={_toml(value)}" for key, value in mp.values.items()]
    return mp.m


def load_deepspeed(path: str | Path, world_size: int) -> DeepSpeedMapping:
    """map_deepspeed() of a JSON file; a missing file or bad JSON raises ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"DeepSpeed config '{path}' does not exist"])
    try:
        ds = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError([f"{path}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno} "
                           f"(JSON allows no comments and no trailing commas)"]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"{path}: not UTF-8 text ({e.reason})"]) from None
    if not isinstance(ds, dict):
        raise ConfigError([f"{path}: a DeepSpeed config is a JSON object {{...}}, got a {type(ds).__name__}"])
    return map_deepspeed(ds, world_size)


def format_mapping(m: DeepSpeedMapping) -> str:
    """Lines 'deepspeed key -> fivefold key = value', then the ignored keys (errors are the caller's)."""
    width = max((len(k) for k, _ in m.mapping), default=0)
    lines = ["DeepSpeed config -> fivefold:"] + [f"  {k:<{width}} -> {v}" for k, v in m.mapping]
    if not m.mapping:
        lines.append("  (nothing mapped)")
    if m.ignored:
        lines.append(f"ignored (no fivefold meaning): {', '.join(m.ignored)}")
    return "\n".join(lines)
