"""Hugging Face checkpoints in and out: config, names and layouts, one module per model family.

What differs between a Hugging Face (HF) directory and fivefold, and what is done about it:
- config.json <-> ModelConfig (`model_config_from_hf`, `hf_config`). An option fivefold does not
  implement is refused by name rather than dropped, since the converted model would compute
  something else; so is a model option the HF family written does not compute (`export_problems`).
- Names: `model.layers.{i}.self_attn.q_proj.weight` <-> `layers.{i}.attn.wq.weight`, ... (each family's
  `block`); stacked experts (E, in, out) <-> one (out, in) matrix per expert; rows reordered where a
  family's RoPE layout differs (DeepSeek-V3); experts HF saves fused (gpt-oss) <-> slices of them (`Family.fused`).
- Quantized releases (DeepSeek-V3 / Kimi K2 fp8, gpt-oss MXFP4) are read dequantized (`checkpoint/dequant.py`).
- Tied embeddings: HF saves no `lm_head.weight`; fivefold saves `tok_embeddings.weight` once.
Weights are read only from safetensors (`checkpoint/safetensors_io.py`).

family.py   `Family`: what one architecture is to fivefold, and the parts families share
llama.py, mistral.py, mixtral.py, qwen2.py, qwen3.py, olmo2.py, gemma3.py, deepseek_v3.py, qwen3_moe.py,
gpt_oss.py: one family each
rope.py     RoPE keys of config.json (either transformers style) <-> the model's RopeConfig (model.rope)
registry.py `FAMILIES`; config.json <-> ModelConfig through the family it names or the model needs
source.py   `HFSource`: an HF directory read as fivefold's tensors
"""

from fivefold.checkpoint.hf.family import Family, HFFormatError, is_stacked
from fivefold.checkpoint.hf.registry import (
    FAMILIES,
    export_problems,
    family_of,
    family_to_write,
    hf_config,
    model_config_from_hf,
)
from fivefold.checkpoint.hf.source import HFSource

HF_BASE = "hf_config.json"  # in a seed converted from HF: the original config.json, for the way back

__all__ = ["FAMILIES", "HF_BASE", "Family", "HFFormatError", "HFSource", "export_problems", "family_of",
           "family_to_write", "hf_config", "is_stacked", "model_config_from_hf"]
