"""The families read and written (FAMILIES), and choosing one: by config.json, or for a model."""

from __future__ import annotations

from typing import Any

import torch

from fivefold.checkpoint.hf.deepseek_v3 import FAMILY as DEEPSEEK_V3
from fivefold.checkpoint.hf.family import Family, HFFormatError, model_config
from fivefold.checkpoint.hf.gemma3 import FAMILY as GEMMA3
from fivefold.checkpoint.hf.gpt_oss import FAMILY as GPT_OSS
from fivefold.checkpoint.hf.llama import FAMILY as LLAMA
from fivefold.checkpoint.hf.mistral import FAMILY as MISTRAL
from fivefold.checkpoint.hf.mixtral import FAMILY as MIXTRAL
from fivefold.checkpoint.hf.olmo2 import FAMILY as OLMO2
from fivefold.checkpoint.hf.qwen2 import FAMILY as QWEN2
from fivefold.checkpoint.hf.qwen3 import FAMILY as QWEN3
from fivefold.checkpoint.hf.qwen3_moe import FAMILY as QWEN3_MOE
from fivefold.model.config import ModelConfig

# Read by architecture; written, when no HF config says which, as the first that computes the model.
FAMILIES: tuple[Family, ...] = (LLAMA, MIXTRAL, MISTRAL, QWEN2, QWEN3, OLMO2, GEMMA3, DEEPSEEK_V3, QWEN3_MOE, GPT_OSS)
ARCHITECTURES = {f.architecture: f for f in FAMILIES}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
COMMON_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def family_of(hf: dict, where: str = "config.json") -> Family:
    """The family that reads config.json `hf`; HFFormatError naming its architecture and listing those read."""
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        names = list(ARCHITECTURES)
        raise HFFormatError(f"{where}: architectures {archs}: fivefold reads {', '.join(names[:-1])} and "
                            f"{names[-1]} only")
    return ARCHITECTURES[archs[0]]


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """fivefold's ModelConfig for a config.json of a family read here; HFFormatError listing every
    option fivefold lacks."""
    family = family_of(hf, where)
    missing = [k for k in COMMON_REQUIRED + family.required if not isinstance(hf.get(k), int)]
    if missing:
        raise HFFormatError(f"{where}: {', '.join(missing)} missing or not an integer")
    problems: list[str] = []
    fields = family.read(hf, problems)
    if problems:
        raise HFFormatError(f"{where} ({family.architecture}) uses what fivefold does not implement:\n  "
                            + "\n  ".join(problems))
    return model_config(fields)


def family_to_write(m: ModelConfig, base: dict | None = None) -> Family:
    """The family model `m` is written as: that of the HF config it came from (`base`), else the first
    that computes it, else the one that lacks the fewest of its options (export_problems says which)."""
    if base is not None and (base.get("architectures") or [None])[0] in ARCHITECTURES:
        return family_of(base)
    fits = [f for f in FAMILIES if not f.export_problems(m)]
    return fits[0] if fits else min(FAMILIES, key=lambda f: len(f.export_problems(m)))


def export_problems(m: ModelConfig, base: dict | None = None) -> list[str]:
    """What model `m` has that the HF family it is written as (family_to_write) cannot express."""
    return family_to_write(m, base).export_problems(m)


def hf_config(m: ModelConfig, dtype: torch.dtype, base: dict | None = None) -> dict[str, Any]:
    """config.json for the model `m` (vocab_size resolved) saved in `dtype`. `base`: an HF config
    whose other keys (token ids, context length, ...) are kept; its model keys are replaced."""
    family = family_to_write(m, base)
    out = {k: v for k, v in (base or {}).items() if k != "quantization_config"}  # dequantized on import
    out.update(architectures=[family.architecture], model_type=family.model_type, hidden_size=m.dim,
               num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, vocab_size=m.vocab_size,
               rms_norm_eps=m.norm.eps, tie_word_embeddings=m.tie_embeddings, initializer_range=m.init_std)
    out.update(family.write(m, out))
    out["torch_dtype" if "torch_dtype" in out else "dtype"] = DTYPE_NAMES[dtype]
    return out

