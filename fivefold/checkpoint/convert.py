"""Weights written and converted one tensor at a time (`fivefold init`, `fivefold convert`).

    fivefold init configs/tiny.toml --out seeds/tiny               # initial weights, one process
    fivefold convert HF_DIR seeds/llama --to fivefold               # Hugging Face -> seed directory
    fivefold convert runs/x/checkpoints/step_00000300 hf/x --to hf  # run checkpoint -> Hugging Face
    fivefold convert runs/x/checkpoints/step_00000300 peft/x --to peft  # a LoRA run's adapters -> PEFT

A seed directory (`init`, `convert --to fivefold`) holds safetensors in fivefold's names and
layouts plus `fivefold.toml`, the config that trains from it (`checkpoint.init_from`); converted
from HF, also the model's tokenizer files (`data.tokenizer` names the directory). `--to hf`
reads a run checkpoint (torch.distributed.checkpoint, through `checkpoint/safe_load.py`: data only) or a
seed directory and writes config.json + safetensors, sharded with an index past --max-shard-size,
and the tokenizer the weights were trained with beside them (checkpoint/tokenizer_files.py).
Every step holds one tensor (an MoE block's stacked experts: one expert of it when reading HF).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fivefold.checkpoint.files import first_failure
from fivefold.checkpoint.hf import (
    HF_BASE,
    HFFormatError,
    HFSource,
    family_to_write,
    hf_config,
    is_stacked,
    model_config_from_hf,
)
from fivefold.checkpoint.hf.deepseek_v3 import BIAS_UPDATE
from fivefold.checkpoint.peft import adapted_layers, scaling, write_peft
from fivefold.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner
from fivefold.checkpoint.safetensors_io import SafetensorsDir, WeightsFileError, write_sharded
from fivefold.checkpoint.seed import write_seed_config
from fivefold.checkpoint.tokenizer_files import copy_hf_tokenizer, trained_tokenizer
from fivefold.checkpoint.weights import WeightsMismatchError, WeightSource, fit_problems, source_name
from fivefold.config.load import RUN_CONFIG, SEED_CONFIG, ConfigError, load_config, replace
from fivefold.config.schema import Config
from fivefold.data.resolve import resolved_model
from fivefold.model.config import ModelConfig
from fivefold.model.lora import NF4, nf4_tensor
from fivefold.model.transformer import Transformer


class DCPSource:
    """The model tensors of a run checkpoint, one whole tensor at a time (however many ranks and
    shards wrote it), read in this process only (no process group needed)."""

    def __init__(self, path: Path):
        from fivefold.checkpoint.files import data_file_errors

        self.path = path
        # Every data file as long as its index says, before a tensor is read or a file written.
        damaged = data_file_errors(path, "the checkpoint is damaged: convert another one of the run")
        if damaged:
            raise WeightsFileError("\n".join(damaged))
        saved = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
        self.meta = {k[len("model."):]: v for k, v in saved.items()
                     if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
        # A QLoRA run's NF4 base (lora.base_dtype = "nf4", model/lora.py): read as its dequantised weight
        self.nf4 = {k[:-len(NF4 + "codes")] + ".weight": k[:-len("codes")] for k in self.meta
                    if k.endswith(NF4 + "codes")}
        self._names = frozenset(k for k in self.meta if NF4 not in k) | frozenset(self.nf4)
        self._last: tuple[str, torch.Tensor] | None = None  # stacked experts are read expert by expert

    def names(self) -> frozenset[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.nf4:
            rows, half = self.meta[self.nf4[name] + "codes"].size
            return rows, 2 * half
        return tuple(self.meta[name].size)

    def dtype(self, name: str) -> torch.dtype:
        return self.meta[self.nf4[name] + "scale_mean" if name in self.nf4 else name].properties.dtype

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        if name in self.nf4:
            parts = [self.read(self.nf4[name] + p) for p in ("codes", "scales", "scale_factor", "scale_mean")]
            value = nf4_tensor(*parts).get_original_weight()  # (out, in)
            self._last = (name, value)
        if self._last is None or self._last[0] != name:
            self._last = None  # free the previous tensor before reading the next
            value = torch.empty(self.shape(name), dtype=self.dtype(name))
            with warnings.catch_warnings():  # no_dist is what we ask for: no need to be told
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                try:
                    dcp.load({"model": {name: value}}, storage_reader=SafeFileSystemReader(str(self.path)),
                             planner=SafeLoadPlanner(self.path), no_dist=True)
                except CheckpointException as e:  # damaged within its size: garbage where a tensor was
                    raise WeightsFileError(f"{self.path}: reading {name} failed ({first_failure(e)}); the "
                                           f"checkpoint is damaged: convert another one of the run") from None
            self._last = (name, value)
        return self._last[1] if index is None else self._last[1][index]


def parse_size(text: str) -> int:
    """'5GB', '500MB', '20KB' (powers of 1000, as Hugging Face counts shards) or plain bytes."""
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    for unit, scale in units.items():
        if text.upper().endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * scale)
    if text.isdigit():
        return int(text)
    raise ValueError(f"--max-shard-size '{text}': write bytes or a size such as 5GB or 500MB")


def _tensors(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of what a checkpoint of model m holds: its parameters, a tied matrix once, then its
    saved buffers (MoE routing biases when model.moe.bias_update > 0)."""
    with torch.device("meta"):
        model = Transformer(m)
    saved = model.state_dict().keys()
    out = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return out | {name: tuple(b.shape) for name, b in model.named_buffers() if name in saved}


def check_fit(source: WeightSource, m: ModelConfig, what: str) -> None:
    """Every tensor of model m in `source` with its shape, else one error listing what is not."""
    with torch.device("meta"):
        model = Transformer(m)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = fit_problems(source, expected, {k for k, _ in model.named_buffers()}, m.tie_embeddings)
    if problems:
        raise WeightsMismatchError(f"{what} does not fit its model config:\n  " + "\n  ".join(problems[:10]))


def hf_to_fivefold(src: Path, out: Path, max_shard_bytes: int, dtype: torch.dtype | None = None) -> list[Path]:
    """A Hugging Face directory of a family read here -> a seed directory (weights in their own
    dtype, quantized ones dequantized to `dtype` (default: config.json's), and its tokenizer files
    beside them when it has a tokenizer: checkpoint/tokenizer_files.py). What the reading dequantized or
    skipped is printed."""
    source = HFSource(src, dtype=dtype)
    m = source.model_cfg
    check_fit(source, m, str(src))
    copies = source.copy_problems()  # the MTP layers' copies of the embedding and head: kept once, so equal
    if copies:
        raise HFFormatError(f"{src}: {copies[0]}")
    for note in source.notes:
        print(f"{src}: {note}")
    tensors = []
    for name, shape in _tensors(m).items():
        if name not in source.names():  # a buffer the checkpoint lacks (check_fit): the model's own zeros
            continue
        if is_stacked(name):  # one expert at a time (HF holds each apart, or dequantizes a box): (E, ...) pieces
            def produce(n=name, s=shape):
                return (source.read(n, (slice(e, e + 1), *(slice(0, k) for k in s[1:]))) for e in range(s[0]))
        else:
            def produce(n=name):
                return source.read(n)
        tensors.append((name, source.dtype(name), shape, produce))
    files = write_sharded(out, tensors, max_shard_bytes, {"format": "pt", "fivefold": "converted from " + str(src)})
    (out / HF_BASE).write_text(json.dumps(source.hf_config, indent=2) + "\n")
    # Training on the converted model must feed it the ids it was trained with, not bytes. The path is
    # written as `out` was given, as checkpoint.init_from is (write_seed_config): relative to the cwd.
    data = {"tokenizer": str(out)} if copy_hf_tokenizer(src, out) else {}
    # A sliding window must be shorter than the sequence (validate refuses a window that cuts nothing): the
    # first power of two above a window as long as the default seq_len (Gemma 3 1B's 512, Mistral v0.1's 4096).
    seq_len = Config().train.seq_len
    train = {"seq_len": 1 << m.attention.window.bit_length()} if m.attention.window >= seq_len else {}
    write_seed_config(replace(Config(model=m), run={"name": out.name}, data=data, train=train), out)
    return files


def run_config(src: Path, config: Path | None = None) -> Config:
    """The config a run checkpoint (its run's config.toml) or a seed directory (its fivefold.toml) was made with."""
    is_dcp = (src / ".metadata").is_file()
    config = config or (src.parent.parent / RUN_CONFIG if is_dcp else src / SEED_CONFIG)
    if not config.is_file():
        raise ConfigError([f"{config} not found: pass --config, the run's config.toml"])
    return load_config(config)


def open_fivefold(src: Path, config: Path | None) -> tuple[WeightSource, ModelConfig, dict | None, Path | None]:
    """A run checkpoint or a seed directory: its tensors, its model config (vocab resolved), the HF
    config it came from, when it did (its non-model keys are kept on the way back), and the directory
    of the tokenizer it trains with, when it has one of Hugging Face's."""
    if not src.is_dir():
        raise WeightsFileError(f"{src} is not a directory: give a run checkpoint (runs/NAME/checkpoints/step_X) "
                               f"or a seed directory")
    is_dcp = (src / ".metadata").is_file()
    source = DCPSource(src) if is_dcp else SafetensorsDir(src)
    cfg = run_config(src, config)
    base = None
    for candidate in [src / HF_BASE] + ([Path(cfg.checkpoint.init_from) / n for n in (HF_BASE, "config.json")]
                                        if cfg.checkpoint.init_from else []):
        if candidate.is_file():
            base = json.loads(candidate.read_text())
            break
    tokenizer = trained_tokenizer(src, is_dcp, cfg.data.tokenizer)
    return source, resolved_model(cfg), base, tokenizer


def fivefold_to_peft(src: Path, out: Path, config: Path | None = None, hf_base: Path | None = None,
                     dtype: torch.dtype | None = None) -> Path:
    """A LoRA run's checkpoint -> a PEFT adapter directory for the model `fivefold_to_hf` writes of it
    (checkpoint/peft.py)."""
    source, m, base, _ = open_fivefold(src, config)
    if hf_base is not None:
        base = json.loads(hf_base.read_text())
    cfg = run_config(src, config)
    return write_peft(source, m, cfg.lora, base, out, dtype, cfg.checkpoint.init_from or None)


def fivefold_to_hf(src: Path, out: Path, config: Path | None = None, hf_base: Path | None = None,
                   dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 10**9,
                   merge: bool = False) -> list[Path]:
    """A run checkpoint or seed directory -> a Hugging Face directory (config.json + safetensors, and
    the tokenizer files the run trained with, when it had a Hugging Face tokenizer). A LoRA run's
    checkpoint gives its base (its adapters: fivefold_to_peft), or with `merge` each adapted weight
    W + scaling B A (PEFT's merge_and_unload)."""
    source, m, base, tokenizer = open_fivefold(src, config)
    if hf_base is not None:
        base = json.loads(hf_base.read_text())
    adapted = set(adapted_layers(source.names()))
    if merge and not adapted:
        raise HFFormatError(f"{src}: --merge: the checkpoint has no LoRA adapters (its run had lora.rank = 0)")
    scale = scaling(run_config(src, config).lora) if merge else 0.0
    if adapted and not merge:
        print(f"{src}: writing the base model without its LoRA adapters: export them with --to peft, or the "
              f"merged model with --merge")
    if base is not None:
        model_config_from_hf(base, str(hf_base or "the HF config it came from"))  # refuses options we do not write
    family = family_to_write(m, base)
    problems = family.export_problems(m)
    keeps_bias = "ffn.expert_bias" in family.block  # DeepSeek-V3: the routing bias, in every MoE block
    for name in sorted(source.names()):
        if not keeps_bias and name.endswith(".expert_bias") and source.read(name).any():
            problems.append(f"{name} is not zero (model.moe.bias_update): {family.title}'s router has no bias")
    if problems:
        raise HFFormatError(f"{src}: the model has what HF's {family.title} cannot express:\n  "
                            + "\n  ".join(problems))
    check_fit(source, m, str(src))
    config = hf_config(m, dtype or source.dtype("tok_embeddings.weight"), base)
    # A family that keeps the routing bias always has it: written as zeros where the model keeps none.
    moe = dataclasses.replace(m.moe, bias_update=m.moe.bias_update or BIAS_UPDATE)
    biased = dataclasses.replace(m, moe=moe) if keeps_bias else m
    tensors = []
    fused: dict[str, list[tuple[str, int, int]]] = {}  # HF name -> its fivefold parts (name, start, step)
    for name, shape in _tensors(biased).items():
        found = source_name(name, source, m.tie_embeddings)
        if name.endswith(".expert_bias"):
            if keeps_bias:  # fp32 whatever `dtype`, as transformers keeps it
                def produce(n=found, s=shape):
                    return torch.zeros(s) if n is None else source.read(n).float()
                tensors.append((family.hf_names(name, m)[0], torch.float32, shape, produce))
            continue  # a router without a bias (a non-zero one is refused above)
        to = dtype or source.dtype(found)
        part = family.fused_part(name)
        if part is not None:  # written below, once all its parts are known
            hf = family.hf_names(name, m)[0]
            if hf not in fused:
                fused[hf] = []
                tensors.append((hf, to, shape, None))  # its place in the order; shape and producer below
            fused[hf].append((found, *part))
            continue
        for e, hf in enumerate(family.hf_names(name, m)):
            if is_stacked(name):  # expert e of (E, in, out) is HF's (out, in) weight, transposed
                box = (slice(e, e + 1), slice(0, shape[1]), slice(0, shape[2]))
                def produce(n=found, b=box, t=to):
                    return source.read(n, b)[0].T.contiguous().to(t)
                tensors.append((hf, to, (shape[2], shape[1]), produce))
            else:
                rows = family.rows(name, m, config)
                back = None if rows is None else torch.argsort(rows)  # hf = fivefold[back]
                layer = name.removesuffix(".weight") if merge else None
                def produce(n=found, t=to, back=back, layer=layer if layer in adapted else None):
                    value = source.read(n)
                    if layer is not None:  # W + scaling B A, in fp32: (out, r) @ (r, in)
                        a, b = source.read(layer + ".lora.a").float(), source.read(layer + ".lora.b").float()
                        value = value.float() + scale * (b @ a)
                    return (value if back is None else value[back]).to(t)
                tensors.append((hf, to, shape, produce))
    for hf, main in family.copies(m):  # the MTP depths' copies of the embedding and head, as DeepSeek-V3 stores them
        found = source_name(main, source, m.tie_embeddings)
        to = dtype or source.dtype(found)
        def produce(n=found, t=to):
            return source.read(n).to(t)
        tensors.append((hf, to, source.shape(found), produce))
    tensors = [item if item[3] is not None else _fused(source, *item[:3], fused[item[0]]) for item in tensors]
    files = write_sharded(out, tensors, max_shard_bytes, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        copy_hf_tokenizer(tokenizer, out)
    if base is not None and base.get("quantization_config"):
        print(f"{out}: written unquantized in {config.get('torch_dtype', config.get('dtype'))} (the checkpoint it "
              f"came from was {base['quantization_config'].get('quant_method')}, dequantized on import)")
    return files


def _fused(source: WeightSource, hf: str, dtype: torch.dtype, shape: tuple[int, ...],
           parts: list[tuple[str, int, int]]) -> tuple[str, torch.dtype, tuple[int, ...], Any]:
    """One HF tensor made of fivefold tensors, each its [..., start::step] (gpt-oss's gate_up_proj),
    written one expert (dim-0 row) at a time."""
    whole = (*shape[:-1], sum(source.shape(n)[-1] for n, _, _ in parts))

    def produce():
        for e in range(whole[0]):
            piece = torch.empty(1, *whole[1:], dtype=dtype)
            for name, start, step in parts:
                box = (slice(e, e + 1), *(slice(0, n) for n in source.shape(name)[1:]))
                piece[..., start::step] = source.read(name, box)
            yield piece
    return hf, dtype, whole, produce
