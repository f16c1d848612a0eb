"""LoRA adapters in Hugging Face PEFT's format, both ways (`fivefold convert --to peft`, `lora.init_from`).

A PEFT LoRA adapter directory (peft's `save_pretrained`) holds two files:
- adapter_config.json: peft_type "LORA", r, lora_alpha, lora_dropout, use_rslora, target_modules (module
  names PEFT matches by suffix), task_type "CAUSAL_LM", ...
- adapter_model.safetensors: per adapted module of the transformers model, `lora_A.weight` (r, in) and
  `lora_B.weight` (out, r) under the module's name in the PeftModel, which wraps the transformers model as
  `base_model.model`: `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
fivefold's adapter of layer X is `X.lora.a` (= lora_A) and `X.lora.b` (= lora_B), the same matrices
(model/lora.py); the module's name is that of the HF weight behind `X.weight` in the family's mapping
(checkpoint/hf/), so an adapter is written for exactly the model `--to hf` writes. Where that family
reorders a weight's rows (DeepSeek-V3's RoPE rows), B's rows, the update's output rows, move with them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fivefold.checkpoint.hf import HF_BASE, Family, HFFormatError, family_to_write, hf_config
from fivefold.checkpoint.weights import WeightSource
from fivefold.config.schema import Config
from fivefold.data.resolve import resolved_model
from fivefold.model.config import PEFT_NAMES, LoRAConfig, ModelConfig
from fivefold.model.lora import LORA_A, LORA_B, apply_lora
from fivefold.model.transformer import Transformer

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel's name for the transformers model it wraps
FIELD = "lora.init_from"
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}  # safetensors' dtype names


def adapted_layers(names: frozenset[str] | set[str]) -> list[str]:
    """The layers that have an adapter among tensor names (`X.lora.a` -> `X`), sorted."""
    return sorted(n.removesuffix(LORA_A) for n in names if n.endswith(LORA_A))


def peft_module(layer: str, family: Family, m: ModelConfig) -> str:
    """The module PEFT adapts for fivefold layer `layer` (`layers.0.attn.wq` -> `model.layers.0.self_attn.q_proj`);
    HFFormatError when the family's transformers model has no module PEFT could address by that name."""
    why = None
    try:
        (hf,) = family.hf_names(f"{layer}.weight", m)
    except (KeyError, ValueError):
        hf, why = "", f"HF's {family.title} has no linear layer for it"
    module = hf.removesuffix(".weight")
    want = PEFT_NAMES.get(layer.rsplit(".", 1)[-1])
    if why is None and layer.startswith("mtp."):  # transformers builds no module for them (drops them on load)
        why = f"its weight is {hf}, an MTP layer: HF's {family.title} model has no module for it"
    elif why is None and module.rsplit(".", 1)[-1] != want:
        why = f"HF's {family.title} names its weight {hf}, not a '{want}' module PEFT could target"
    if why is not None:
        raise HFFormatError(f"{layer} has an adapter that PEFT cannot address: {why}")
    return module


def peft_keys(layer: str, family: Family, m: ModelConfig) -> tuple[str, str]:
    """PEFT's names of the adapter's A and B."""
    module = PREFIX + peft_module(layer, family, m)
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def peft_config(lora: LoRAConfig, targets: list[str], base_model: str | None = None) -> dict:
    """adapter_config.json for adapters of rank lora.rank on the modules named `targets`."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "use_rslora": lora.rslora,
            "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}


def scaling(lora: LoRAConfig) -> float:
    """What the update B A is multiplied by (PEFT's `scaling`): alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return lora.alpha / (lora.rank ** 0.5 if lora.rslora else lora.rank)


def write_peft(source: WeightSource, m: ModelConfig, lora: LoRAConfig, base: dict | None, out: Path,
               dtype: torch.dtype | None = None, base_model: str | None = None) -> Path:
    """The adapters in `source` (a run checkpoint's tensors) as a PEFT adapter directory `out`, for the model
    that `--to hf` writes of it (family and row order from `base`, the HF config it came from, if any)."""
    layers = adapted_layers(source.names())
    if not layers or not lora.rank:
        raise HFFormatError("the checkpoint has no LoRA adapters (its run had lora.rank = 0): export it with --to hf")
    family = family_to_write(m, base)
    problems = []
    for layer in layers:
        try:
            peft_module(layer, family, m)
        except HFFormatError as e:
            problems.append(str(e))
    if problems:
        raise HFFormatError(f"--to peft: {problems[0]}" + (f" (and {len(problems) - 1} more)" if problems[1:] else "")
                            + "; train without that target, or export the merged model with --to hf --merge")
    config = hf_config(m, torch.float32, base)
    tensors, targets = {}, set()
    for layer in layers:
        key_a, key_b = peft_keys(layer, family, m)
        a, b = source.read(layer + LORA_A), source.read(layer + LORA_B)  # (r, in), (out, r)
        rows = family.rows(f"{layer}.weight", m, config)
        if rows is not None:  # fivefold's rows are hf[rows]: B's rows are the update's
            b = b[torch.argsort(rows)]
        tensors[key_a] = a.to(dtype or a.dtype).contiguous()
        tensors[key_b] = b.to(dtype or b.dtype).contiguous()
        targets.add(key_a.removesuffix(".lora_A.weight").rsplit(".", 1)[-1])
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(peft_config(lora, sorted(targets), base_model), indent=2) + "\n")
    return out / ADAPTER_WEIGHTS


def lora_model(cfg: Config) -> Transformer:
    """The run's model with its adapters, on the meta device: names and shapes."""
    with torch.device("meta"):
        model = Transformer(resolved_model(cfg))
    apply_lora(model, cfg.lora)
    return model


def base_hf_config(cfg: Config) -> dict | None:
    """The HF config the run's base came from (checkpoint.init_from's config.json, or a converted seed's copy of
    it), which fixes the family and row order PEFT names are in; None when it came from none."""
    if not cfg.checkpoint.init_from:
        return None
    for name in ("config.json", HF_BASE):
        path = Path(cfg.checkpoint.init_from) / name
        if path.is_file():
            return json.loads(path.read_text())
    return None


class PeftSource:
    """A PEFT adapter directory read as fivefold's adapter tensors (`layers.0.attn.wq.lora.a`, ...) of the run
    `cfg` describes: a WeightSource for `load_weights(..., adapters=)` (checkpoint/weights.py)."""

    def __init__(self, path: Path, cfg: Config):
        self.path = path
        m = resolved_model(cfg)
        family = family_to_write(m, base_hf_config(cfg))
        config = hf_config(m, torch.float32, base_hf_config(cfg))
        self.keys: dict[str, str] = {}  # fivefold name -> PEFT key
        self.rows: dict[str, torch.Tensor] = {}  # B's of layers whose rows the family reorders: fivefold = hf[rows]
        for layer in adapted_layers({n for n, _ in lora_model(cfg).named_parameters()}):
            self.keys[layer + LORA_A], self.keys[layer + LORA_B] = peft_keys(layer, family, m)
            rows = family.rows(f"{layer}.weight", m, config)
            if rows is not None:
                self.rows[layer + LORA_B] = rows
        with safe_open(str(path / ADAPTER_WEIGHTS), framework="pt") as f:
            held = set(f.keys())
            self._shapes = {n: tuple(f.get_slice(k).get_shape()) for n, k in self.keys.items() if k in held}
            self._dtypes = {n: f.get_slice(k).get_dtype() for n, k in self.keys.items() if k in held}
        self.unused = sorted(held - set(self.keys.values()))  # PEFT tensors for modules this run does not adapt

    def names(self) -> frozenset[str]:
        return frozenset(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self._dtypes[name]]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        with safe_open(str(self.path / ADAPTER_WEIGHTS), framework="pt") as f:
            value = f.get_tensor(self.keys[name])
        if name in self.rows:
            value = value[self.rows[name]]
        return value if index is None else value[index]

    def read_into(self, name: str, index: tuple[slice, ...], out: torch.Tensor) -> None:
        out.copy_(self.read(name, index))


def peft_dir_errors(cfg: Config) -> list[str]:
    """Problems with lora.init_from, before any process starts: its files, adapter_config.json's r, lora_alpha,
    use_rslora and target_modules against [lora], and every adapter tensor's name and shape against the model."""
    path, lo = Path(cfg.lora.init_from), cfg.lora
    where = f"{FIELD} = '{path}'"
    missing = [n for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (path / n).is_file()]
    if missing:
        return [f"{where}: {', '.join(missing)} not found: give a PEFT LoRA adapter directory (peft's "
                f"save_pretrained, or `fivefold convert CKPT OUT --to peft`)"]
    try:
        theirs = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        return [f"{where}: {ADAPTER_CONFIG} is not JSON ({e})"]
    if theirs.get("peft_type") != "LORA":
        return [f"{where}: peft_type is {theirs.get('peft_type')!r}: fivefold reads LoRA adapters only"]
    errors = []
    targets = theirs.get("target_modules")
    for key, ours, field, same in (
            ("r", lo.rank, "rank", theirs.get("r") == lo.rank),
            ("lora_alpha", lo.alpha, "alpha", theirs.get("lora_alpha") == lo.alpha),
            ("use_rslora", lo.rslora, "rslora", bool(theirs.get("use_rslora")) == lo.rslora),
            ("target_modules", list(lo.targets), "targets",
             isinstance(targets, list) and set(targets) == set(lo.targets))):
        if not same:
            value = json.dumps(theirs.get(key)) if key != "target_modules" or isinstance(targets, list) else None
            fix = f"set lora.{field} = {value}" if value is not None else \
                "a regular expression: fivefold reads a list of module names"
            errors.append(f"{where}: {ADAPTER_CONFIG} has {key} = {theirs.get(key)!r}, this run lora.{field} = "
                          f"{ours!r}: {fix}")
    if errors:
        return errors
    try:
        source = PeftSource(path, cfg)
    except (ValueError, OSError) as e:  # a layer PEFT cannot name, a damaged file
        return [f"{where}: {e}"]
    shapes = {n: tuple(p.shape) for n, p in lora_model(cfg).named_parameters() if n in source.keys}
    problems = []
    for n, shape in shapes.items():
        if n not in source.names():
            problems.append(f"{source.keys[n]}: not in the adapter")
        elif source.shape(n) != shape:
            problems.append(f"{source.keys[n]}: {source.shape(n)}, this model's {n} {shape}")
    problems += [f"{k}: no layer of this model (targets and model.* as the adapter's base)" for k in source.unused]
    if problems:
        errors.append(f"{where} does not fit this run's model and [lora]:\n    " + "\n    ".join(problems[:10]))
    return errors
