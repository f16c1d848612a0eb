"""Read a DeepSpeed JSON config as fivefold `--section.key=value` overrides.

`fivefold train --deepspeed ds_config.json` lays these overrides between the TOML file and the
command line, so a DeepSpeed user keeps their file and fivefold's own flags still win. Every key of
the JSON ends in one of three places, so nothing is dropped silently: `mapping` (what it became),
`ignored` (no fivefold meaning, named so the user knows) or `errors` (a refusal with a fix).

The batch triple follows DeepSpeed's rule train_batch_size = micro x grad_accum x dp with
dp = world_size / (tp x pp): missing members are derived as DeepSpeed derives them, and what
DeepSpeed refuses is refused. `tensor_parallel.tp_size` and `pipeline_parallel.pp_size` are fivefold
extensions seen in published configs, not DeepSpeed training keys (DeepSpeed's training TP key is
`tensor_parallel.autotp_size`; it sets pipeline stages in code). validate() is not run here: the CLI
runs it on the merged config, where the TOML's keys are known too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fivefold.config.load import ConfigError

BYTES_PER_ELEMENT = 4  # DeepSpeed sizes buckets in elements, fivefold in MB: count fp32 gradients
BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
PRECISION = ("fp16", "bf16", "bfloat16")  # "bfloat16" is DeepSpeed's older spelling of "bf16"
EXT = "fivefold extension, not a DeepSpeed training key: "
# DeepSpeed key path -> (fivefold key, kind, note); kind: int/float (>= 0), pos (integer >= 1), bool.
SIMPLE: dict[str, tuple[str, str, str]] = {
    "gradient_clipping": ("optim.grad_clip", "float", "0 disables clipping"),
    "zero_optimization.stage": ("parallel.zero", "int", "0 = DDP; fivefold's 3 is FSDP"),
    "zero_optimization.overlap_comm": ("parallel.overlap_comm", "bool", ""),
    "zero_optimization.reduce_bucket_size": ("parallel.bucket_mb", "pos", ""),  # elements -> MB in take()
    "fp16.loss_scale": ("train.loss_scale", "float", "0 = dynamic scaling"),
    "fp16.initial_scale_power": ("train.initial_scale_power", "int", ""),
    "fp16.loss_scale_window": ("train.loss_scale_window", "int", ""),
    "fp16.min_loss_scale": ("train.min_loss_scale", "float", ""),
    "optimizer.params.lr": ("optim.lr", "float", ""),
    "optimizer.params.eps": ("optim.eps", "float", ""),
    "tensor_parallel.autotp_size": ("parallel.tp", "pos", "DeepSpeed AutoTP degree"),
    "tensor_parallel.tp_size": ("parallel.tp", "pos", EXT + "DeepSpeed trains with autotp_size"),
    "pipeline_parallel.pp_size": ("parallel.pp", "pos", EXT + "DeepSpeed has no pipeline_parallel section"),
}
OPTIMIZERS = ("Adam", "AdamW")
# Scheduler params with DeepSpeed's defaults (None: DeepSpeed requires the key).
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
    """A value as config.parse_value() reads it back: TOML literals, strings quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else repr(value)  # JSON strings are TOML strings


class _Mapper:
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}  # fivefold key -> value; a later set wins, as on the CLI
        self.m = DeepSpeedMapping()

    def set(self, path: str, key: str, value: Any, note: str = "") -> None:
        self.values[key] = value
        self.m.mapping.append((path, f"{key} = {_toml(value)}" + (f"  ({note})" if note else "")))

    def error(self, text: str) -> None:
        self.m.errors.append(text)

    def section(self, path: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.error(f"{path} = {value!r}: must be a JSON object {{...}}")
            return {}
        return value

    def check(self, path: str, value: Any, kind: str) -> Any:
        """value as the kind asks, or None after an error naming the key (JSON bools are not numbers)."""
        if kind == "bool":
            ok = isinstance(value, bool)
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= (kind == "pos")  # 1 or 0
            ok = ok and (kind == "float" or float(value).is_integer())  # JSON may write 5e8: an integer
        if ok:
            return value if kind == "bool" else float(value) if kind == "float" else int(value)
        want = {"bool": "true or false", "float": "a number >= 0", "int": "an integer >= 0", "pos": "an integer >= 1"}
        self.error(f"{path} = {value!r}: must be {want[kind]}")
        return None

    def take(self, path: str, value: Any, key: str, kind: str, note: str = "") -> Any:
        """One DeepSpeed value -> one fivefold key; returns it, or None (refused, or "auto")."""
        if value == "auto":  # HF-style: the trainer fills it in; for fivefold that is the TOML file
            self.m.mapping.append((path, f"{key} kept from the fivefold config (DeepSpeed value 'auto')"))
            return None
        if (v := self.check(path, value, kind)) is not None:
            if key == "parallel.bucket_mb":
                v, note = v * BYTES_PER_ELEMENT / 1e6, f"{v:g} elements x {BYTES_PER_ELEMENT} bytes (fp32) / 10^6"
            self.set(path, key, v, note)
        return v

    def walk(self, prefix: str, sec: dict[str, Any], own: tuple[str, ...] = ()) -> None:
        """Map a section's SIMPLE keys and ignore the rest, except keys in `own` (the caller's)."""
        for key, value in sec.items():
            path = f"{prefix}.{key}"
            if path in SIMPLE:
                self.take(path, value, *SIMPLE[path])
            elif key not in own:
                self.m.ignored.append(path)


def _batch(ds: dict[str, Any], mp: _Mapper, world: int, tp: int, pp: int) -> None:
    """DeepSpeed's batch triple: derive the missing members, refuse what does not multiply out."""
    present = [k for k in BATCH if k in ds]
    given = {k: mp.check(k, ds[k], "pos") for k in present if ds[k] != "auto"}
    if not present or None in given.values():
        return  # nothing to do (the TOML's batch stays), or a value was already refused
    if world % (tp * pp):
        mp.error(f"tp x pp = {tp} x {pp} = {tp * pp} does not divide the world size {world}, so the batch "
                 f"cannot be checked; launch a multiple of {tp * pp} processes or lower the degrees")
        return
    dp = world // (tp * pp)
    tb, mb, ga = (given.get(k) for k in BATCH)
    # The same floor divisions DeepSpeed makes; a remainder then fails the product check below.
    if tb and mb and not ga:
        ga = tb // mb // dp
    elif tb and ga and not mb:
        mb = tb // dp // ga
    elif mb and ga and not tb:
        tb = mb * ga * dp
    elif tb and not mb:
        ga, mb = 1, tb // dp
    elif mb and not tb:
        ga, tb = 1, mb * dp
    if not tb or mb is None or ga is None:
        what = ", ".join(f"{k} = 'auto'" for k in present if ds[k] == "auto") or f"{BATCH[2]} = {ga} alone"
        mp.error(f"{what}: nothing to derive the batch from; give {BATCH[0]} or {BATCH[1]} as a number "
                 f"(DeepSpeed needs one of them too)")
        return
    dp_text = f"dp = world size {world} / (tp {tp} x pp {pp}) = {dp}"
    mark = {k: "" if k in given else " (derived)" for k in BATCH}
    if mb < 1 or ga < 1 or tb != mb * ga * dp:
        fixes = [f"{BATCH[0]} = {mb * ga * dp}"] if mb and ga else []
        fixes += [f"{BATCH[2]} = {tb // (mb * dp)}"] if mb and tb % (mb * dp) == 0 else []
        fixes += [f"{BATCH[1]} = {tb // (ga * dp)}"] if ga and tb % (ga * dp) == 0 else []
        fixes = fixes or [f"a {BATCH[0]} that is a multiple of {BATCH[2]} x dp = {max(ga, 1) * dp}"]
        mp.error(f"batch sizes do not multiply out: {BATCH[0]} = {tb}{mark[BATCH[0]]} but {BATCH[1]} x {BATCH[2]} "
                 f"x dp = {mb}{mark[BATCH[1]]} x {ga}{mark[BATCH[2]]} x {dp} = {mb * ga * dp} ({dp_text}); "
                 f"DeepSpeed refuses this too; fix: {' or '.join(fixes)}")
        return
    how = f"derived as DeepSpeed does, {dp_text}"
    mp.set(BATCH[0], "train.global_batch", tb, ("sequences per step" if BATCH[0] in given else how))
    mp.set(BATCH[1], "train.micro_batch", mb, "" if BATCH[1] in given else how)
    mp.m.mapping.append((BATCH[2], f"no own key: fivefold derives global_batch / (micro_batch x dp) = {ga}"
                         + ("" if BATCH[2] in given else f"  ({how})")))


def _precision(ds: dict[str, Any], mp: _Mapper) -> None:
    enabled: dict[str, Any] = {}
    for name in (n for n in PRECISION if n in ds):
        if not isinstance(sec := ds[name], dict):
            mp.section(name, sec)  # reports it
            continue
        value = sec.get("enabled", False)  # DeepSpeed's default: off
        enabled[name] = value if value == "auto" else mp.check(f"{name}.enabled", value, "bool")
        scaled = name == "fp16" and enabled[name] in (True, "auto")  # loss-scale keys only matter then
        mp.walk(name, {k: v for k, v in sec.items() if scaled or f"{name}.{k}" not in SIMPLE}, own=("enabled",))
        mp.m.ignored.extend(f"{name}.{k}" for k in sec if not scaled and f"{name}.{k}" in SIMPLE)
    on = [n for n, e in enabled.items() if e is True]
    auto = [n for n, e in enabled.items() if e == "auto"]
    if "fp16" in on and len(on) > 1:
        mp.error(f"fp16.enabled and {on[-1]}.enabled are both true: DeepSpeed refuses this too; enable one")
    elif on:
        mp.set(f"{on[0]}.enabled", "train.dtype", "fp16" if on[0] == "fp16" else "bf16")
    elif auto:
        mp.take(f"{auto[0]}.enabled", "auto", "train.dtype", "bool")
    elif enabled and all(e is False for e in enabled.values()):
        mp.set(f"{next(iter(enabled))}.enabled", "train.dtype", "fp32", "fp16/bf16 off: DeepSpeed trains in fp32")


def _optimizer(mp: _Mapper, sec: dict[str, Any]) -> None:
    kind = sec.get("type")
    if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw"):
        mp.error(f"optimizer.type = {kind!r}: this mapping reads AdamW's only; supported DeepSpeed types: "
                 f"{', '.join(OPTIMIZERS)} (any case); change the type or remove the optimizer section (Muon: "
                 "[optim] name = 'muon' in the fivefold config)")
        return
    mp.m.ignored.extend(f"optimizer.{k}" for k in sec if k not in ("type", "params"))
    params = mp.section("optimizer.params", sec.get("params", {}))
    mp.walk("optimizer.params", params, own=("betas", "weight_decay", "adam_w_mode"))
    # DeepSpeed's "Adam" is AdamW unless params.adam_w_mode is false; fivefold is always AdamW.
    w_mode = kind.lower() == "adamw" or params.get("adam_w_mode", True) is not False
    if "weight_decay" in params:
        why = ("decoupled, as DeepSpeed here" if w_mode else "DeepSpeed would add it to the gradient as L2 "
               "(adam_w_mode = false); fivefold always decays decoupled (AdamW)")
        mp.take("optimizer.params.weight_decay", params["weight_decay"], "optim.weight_decay", "float",
                why + "; fivefold never decays norms and biases")
    if "adam_w_mode" in params:
        mp.m.mapping.append(("optimizer.params.adam_w_mode", "fivefold always uses decoupled weight decay (AdamW)"))
    betas = params.get("betas", [])
    if betas == "auto" or (isinstance(betas, list) and len(betas) == 2):
        for i, beta in enumerate(betas if betas != "auto" else ["auto", "auto"]):
            mp.take(f"optimizer.params.betas[{i}]", beta, f"optim.beta{i + 1}", "float")
    elif "betas" in params:
        mp.error(f"optimizer.params.betas = {betas!r}: must be a list of two numbers [beta1, beta2]")


def _scheduler(mp: _Mapper, sec: dict[str, Any]) -> None:
    name = sec.get("type")
    kind = next((k for k in SCHEDULERS if isinstance(name, str) and k.lower() == name.lower()), None)
    if kind is None:
        mp.error(f"scheduler.type = {name!r}: not supported; supported DeepSpeed schedulers: "
                 f"{', '.join(SCHEDULERS)}; change it, or remove the section and set optim.lr_schedule")
        return
    params = mp.section("scheduler.params", sec.get("params", {}))
    mp.m.ignored.extend(f"scheduler.{k}" for k in sec if k not in ("type", "params"))
    mp.m.ignored.extend(f"scheduler.params.{k}" for k in params if k not in SCHEDULERS[kind])  # last_batch_iteration
    if missing := [k for k, d in SCHEDULERS[kind].items() if d is None and k not in params]:
        mp.error(f"scheduler.params.{missing[0]} is missing: {kind} needs it (DeepSpeed too); add it")
        return
    p = {k: params.get(k, d) for k, d in SCHEDULERS[kind].items()}

    def at(key: str) -> str:
        return f"scheduler.params.{key}" + ("" if key in params else " (DeepSpeed default)")

    schedule, why = {"WarmupLR": ("constant", "WarmupLR holds warmup_max_lr after warmup"),
                     "WarmupDecayLR": ("wsd", "WarmupDecayLR decays linearly after warmup: wsd with no stable "
                                       "phase, its decay the linear tail"),
                     "WarmupCosineLR": ("cosine", "WarmupCosineLR; its peak is optimizer.params.lr")}[kind]
    mp.set("scheduler.type", "optim.lr_schedule", schedule, why)
    total = mp.take(at("total_num_steps"), p["total_num_steps"], "train.steps", "pos") if "total_num_steps" in p else 0
    shape = f"fivefold warms up linearly from 0; DeepSpeed: {p['warmup_type']} warmup"
    warm = mp.take(at("warmup_num_steps"), p["warmup_num_steps"], "optim.warmup_steps", "int", shape)
    start = p.get("warmup_min_ratio", p.get("warmup_min_lr"))
    if kind != "WarmupDecayLR" and start not in (0, "auto"):
        mp.m.mapping.append((at("warmup_min_ratio" if kind == "WarmupCosineLR" else "warmup_min_lr"),
                             f"not reproduced: {shape}"))
    if kind == "WarmupCosineLR":
        mp.take(at("cos_min_ratio"), p["cos_min_ratio"], "optim.min_lr_ratio", "float", "final lr / peak lr")
        return
    peak = mp.take(at("warmup_max_lr"), p["warmup_max_lr"], "optim.lr", "float",
                   "the scheduler sets the lr, over optimizer.params.lr")
    if kind == "WarmupDecayLR":
        if "auto" in (p["total_num_steps"], p["warmup_num_steps"]):
            mp.error(f"scheduler.params total_num_steps = {p['total_num_steps']!r}, warmup_num_steps = "
                     f"{p['warmup_num_steps']!r}: WarmupDecayLR needs both as numbers to place its decay; write them")
        elif total and warm is not None and warm >= total:
            mp.error(f"scheduler.params.warmup_num_steps = {warm} >= total_num_steps = {total}: WarmupDecayLR "
                     f"would never decay; lower warmup_num_steps or use WarmupLR")
        elif total and warm is not None:
            mp.set(at("total_num_steps"), "optim.decay_fraction", (total - warm) / total,
                   f"({total} - {warm}) / {total}")
        low = p["warmup_min_lr"]
        low = low if low == "auto" else mp.check(at("warmup_min_lr"), low, "float")
        if peak and low is not None:  # the linear decay ends at warmup_min_lr
            mp.take(at("warmup_min_lr"), low if low == "auto" else low / peak, "optim.min_lr_ratio", "float",
                    "warmup_min_lr / warmup_max_lr")


def map_deepspeed(ds: dict[str, Any], world_size: int) -> DeepSpeedMapping:
    """A DeepSpeed config (parsed JSON) for `world_size` processes -> fivefold overrides and notes."""
    if world_size < 1:
        raise ValueError(f"world_size = {world_size}: must be at least 1")
    mp = _Mapper()
    tp_sec = mp.section("tensor_parallel", ds.get("tensor_parallel", {}))
    mp.walk("tensor_parallel", tp_sec)
    mp.walk("pipeline_parallel", mp.section("pipeline_parallel", ds.get("pipeline_parallel", {})))
    if "tp_size" in tp_sec and "autotp_size" in tp_sec and tp_sec["tp_size"] != tp_sec["autotp_size"]:
        mp.error(f"tensor_parallel.tp_size = {tp_sec['tp_size']!r} and autotp_size = {tp_sec['autotp_size']!r} "
                 f"disagree; keep one (autotp_size is DeepSpeed's)")
    _batch(ds, mp, world_size, mp.values.get("parallel.tp", 1), mp.values.get("parallel.pp", 1))
    _precision(ds, mp)
    if "gradient_clipping" in ds:
        mp.take("gradient_clipping", ds["gradient_clipping"], *SIMPLE["gradient_clipping"])
    mp.walk("zero_optimization", mp.section("zero_optimization", ds.get("zero_optimization", {})))
    # Optimizer before scheduler, whatever the file's order: a scheduler's lr must win.
    for name, handler in (("optimizer", _optimizer), ("scheduler", _scheduler)):
        if name in ds and mp.section(name, ds[name]) is ds[name]:  # not a dict: reported, skipped
            handler(mp, ds[name])
    known = {*BATCH, *PRECISION, "gradient_clipping", "tensor_parallel", "pipeline_parallel",
             "zero_optimization", "optimizer", "scheduler"}
    mp.m.ignored.extend(k for k in ds if k not in known)  # steps_per_print, activation_checkpointing, ...
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
        raise ConfigError([f"{path}: a DeepSpeed config is a JSON object {{...}}, got {type(ds).__name__}"])
    return map_deepspeed(ds, world_size)


def format_mapping(m: DeepSpeedMapping) -> str:
    """Lines 'deepspeed key -> fivefold key = value', then the ignored keys (errors are the caller's)."""
    width = max((len(k) for k, _ in m.mapping), default=0)
    lines = ["DeepSpeed config -> fivefold:"] + [f"  {k:<{width}} -> {v}" for k, v in m.mapping]
    lines += [] if m.mapping else ["  (nothing mapped)"]
    lines += [f"ignored (no fivefold meaning): {', '.join(m.ignored)}"] if m.ignored else []
    return "\n".join(lines)
