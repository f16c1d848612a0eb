"""What one Hugging Face model family is to fivefold (`Family`), and the parts families share.

A family module (llama.py, mixtral.py, deepseek_v3.py, ...) declares one `Family`: the architecture
and model_type it reads and writes, its tensor names, how its config.json becomes a ModelConfig and
back, and which ModelConfig values its HF model computes (everything else is refused on export).
registry.py lists the families; nothing else needs to know one from another.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import torch

from fivefold.checkpoint.dequant import QuantizationError, quantization
from fivefold.checkpoint.hf.rope import rope_fields_from_hf, rope_to_hf
from fivefold.model.config import ModelConfig

TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
# The Llama block (LlamaDecoderLayer), which most families keep or extend: fivefold name -> HF name.
LLAMA_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.wq.bias": "self_attn.q_proj.bias", "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias", "attn.wo.bias": "self_attn.o_proj.bias",
    "ffn.gate.weight": "mlp.gate_proj.weight", "ffn.up.weight": "mlp.up_proj.weight",
    "ffn.down.weight": "mlp.down_proj.weight",
}
QK_NORMS = {"attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}
# Every model is stored without these (transformers computes them): an old checkpoint may still hold them.
NOT_WEIGHTS = re.compile(r".*\.rotary_emb\.inv_freq$")
ANY = None  # in Family.computes: the family computes whatever the field says

# The features a family's HF model has or lacks, as the ModelConfig values of a plain Llama, each field by its
# path in ModelConfig ("norm.qk": model.norm.qk): a family lists in `computes` the values it takes where it
# differs (a tuple of values, or ANY).
PLAIN: dict[str, tuple | None] = {
    "attention.qkv_bias": (False,), "attention.out_bias": (False,), "attention.window": (0,),
    "attention.window_pattern": ((),), "attention.sinks": (False,), "attention.scale": (0.0,),
    "norm.qk": (False,), "norm.qk_span": ANY, "norm.position": ("pre",), "norm.offset": (0.0,),
    "norm.weight_fp32": (False,), "embed_scale": (False,), "activation": ("silu",), "head_dim": ANY,
    "rope.scaling": ANY, "rope.local_theta": (0.0,), "latent.kv_lora_rank": (0,), "moe.n_experts": (0,),
    "mtp_layers": (0,),
}
# ... and of a Mixtral MoE block, checked only for models with experts.
PLAIN_MOE: dict[str, tuple | None] = {
    "moe.n_shared_experts": (0,), "moe.first_dense_layers": (0,), "moe.router_score": ("softmax",),
    "moe.norm_topk": (True,), "moe.n_groups": (0, 1), "moe.routed_scale": (1.0,), "moe.linear_bias": (False,),
    "moe.swiglu_limit": (0.0,),
}


class HFFormatError(ValueError):
    """A Hugging Face config or checkpoint fivefold cannot represent; nothing was converted."""


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture, both ways."""

    title: str  # for messages: "Llama"
    architecture: str  # config.json "architectures": ["LlamaForCausalLM"]
    model_type: str  # config.json "model_type"
    block: dict[str, str]  # per block: fivefold name -> HF name under model.layers.{i}.
    # (config.json, problems) -> ModelConfig values by path ("dim", "rope.theta", "moe.n_experts": see
    # model_config); appends what it cannot represent to problems.
    read: Callable[[dict, list[str]], dict[str, Any]]
    # (model, config.json written so far: the base's keys and the common ones) -> this family's keys
    write: Callable[[ModelConfig, dict], dict[str, Any]]
    experts: dict[str, str] = field(default_factory=dict)  # stacked experts -> HF per-expert name with {e}
    required: tuple[str, ...] = ()  # integer keys config.json must have, beyond the common ones
    computes: dict[str, tuple | None] = field(default_factory=dict)  # overrides of PLAIN / PLAIN_MOE, by path
    export_checks: Callable[[ModelConfig], list[str]] = lambda m: []  # what `computes` cannot say
    # (fivefold name, model, config.json) -> the HF row behind each fivefold row where they differ, else None
    rows: Callable[[str, ModelConfig, dict], torch.Tensor | None] = lambda name, m, hf: None
    # Multi-token prediction (model.mtp_layers): depth k is HF's layer n_layers + k. Its own tensors: fivefold
    # name under mtp.{k}. -> HF name under model.layers.{n_layers + k}.; its block's are named as a main
    # block's. `mtp_copies`: tensors HF stores in each depth that are copies of the main model's (HF name under
    # the layer -> the fivefold tensor it copies): read once, checked equal on import, written back on export.
    mtp: dict[str, str] = field(default_factory=dict)
    mtp_copies: dict[str, str] = field(default_factory=dict)
    # Experts HF saves fused, one (E, ...) tensor for all: per block, fivefold name -> (HF name, start, step),
    # fivefold's tensor being HF's [..., start::step] (gpt-oss's gate_up_proj holds gate and up interleaved).
    fused: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    top: dict[str, str] = field(default_factory=lambda: dict(TOP))

    def hf_names(self, name: str, m: ModelConfig) -> list[str]:
        """The HF tensors behind one fivefold tensor: one, or for stacked experts one per expert."""
        if name in self.top:
            return [self.top[name]]
        depth = re.fullmatch(r"mtp\.(\d+)\.(.+)", name)
        if depth is not None:  # an MTP depth: HF's layer after the blocks (DeepSeek-V3's model.layers.61)
            layer, rest = m.n_layers + int(depth.group(1)), depth.group(2)
            if rest in self.mtp:
                return [f"model.layers.{layer}.{self.mtp[rest]}"]
            if rest.startswith("block."):
                return self.hf_names(f"layers.{layer}.{rest.removeprefix('block.')}", m)
            raise KeyError(f"'{name}' has no counterpart in HF's {self.title}")
        match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if match is None or all(match.group(2) not in names for names in (self.block, self.experts, self.fused)):
            raise KeyError(f"'{name}' has no counterpart in HF's {self.title}")
        layer, rest = match.groups()
        if rest in self.block or rest in self.fused:
            return [f"model.layers.{layer}.{self.block[rest] if rest in self.block else self.fused[rest][0]}"]
        return [f"model.layers.{layer}.{self.experts[rest].format(e=e)}" for e in range(m.moe.n_experts)]

    def fused_part(self, name: str) -> tuple[int, int] | None:
        """(start, step) of a fivefold tensor that is part of a fused HF tensor, else None."""
        block = re.fullmatch(r"(?:layers\.\d+|mtp\.\d+\.block)\.(.+)", name)
        part = None if block is None else self.fused.get(block.group(1))
        return None if part is None else part[1:]

    def copies(self, m: ModelConfig) -> list[tuple[str, str]]:
        """(HF name, fivefold name) of each copy of a main tensor that HF stores in the MTP depths of `m`."""
        return [(f"model.layers.{m.n_layers + k}.{hf}", ours) for k in range(m.mtp_layers)
                for hf, ours in self.mtp_copies.items()]

    def export_problems(self, m: ModelConfig) -> list[str]:
        """What model `m` computes that this family's HF model does not, one line each."""
        rules = {**PLAIN, **(PLAIN_MOE if m.moe.n_experts else {}), **self.computes}
        problems = []
        for path, fine in rules.items():
            value = attrgetter(path)(m)
            if fine is not ANY and value not in fine:
                problems.append(f"model.{path} = {value!r}: HF's {self.title} computes {path} = "
                                f"{' or '.join(repr(v) for v in fine)}")
        return problems + self.export_checks(m)


def is_stacked(name: str) -> bool:
    """Experts stacked into one (E, in, out) tensor: HF saves one matrix per expert."""
    return name.split(".")[-2] == "experts"


def refuse(hf: dict, problems: list[str], key: str, fine: Any, what: str) -> None:
    """Note config key `key` unless it is absent, null or `fine`."""
    if hf.get(key, fine) not in (fine, None):
        problems.append(f"{key} = {hf[key]!r}: {what}")


def refuse_common(hf: dict, problems: list[str]) -> None:
    """The options of a Llama-like config.json that no family here reads differently."""
    refuse(hf, problems, "attention_dropout", 0.0, "fivefold has no dropout")
    refuse(hf, problems, "mlp_bias", False, "fivefold's FFN has no bias")
    try:  # fp8 with block scales and MXFP4 are dequantized on import (checkpoint/dequant.py)
        quantization(hf)
    except QuantizationError as e:
        problems.append(str(e).removeprefix("config.json: "))


def part(name: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The fields of one part of ModelConfig (its RopeConfig, NormConfig, ...) by path: {"rope.theta": ...}."""
    return {f"{name}.{key}": value for key, value in fields.items()}


def model_config(fields: dict[str, Any]) -> ModelConfig:
    """The ModelConfig a family's `read` describes: values by path, "dim" for a field of ModelConfig itself,
    "rope.theta" for one of a part; each part built whole from its own, the rest left at their defaults."""
    top: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for path, value in fields.items():
        name, _, key = path.rpartition(".")
        if name:
            parts.setdefault(name, {})[key] = value
        else:
            top[key] = value
    plain = ModelConfig()
    return ModelConfig(**top, **{name: dataclasses.replace(getattr(plain, name), **values)
                                 for name, values in parts.items()})


def rope_fields(hf: dict, default_theta: float, problems: list[str]) -> dict[str, Any]:
    """RopeConfig's fields for config.json `hf` in either style (checkpoint/hf/rope.py); `default_theta`:
    the family's base when the file states none. A rope type fivefold does not read goes to problems."""
    return {"theta": default_theta, **rope_fields_from_hf(hf, problems)}


def common_fields(hf: dict, defaults: dict, problems: list[str]) -> dict[str, Any]:
    """The ModelConfig values (by path, as `read` returns them) every Llama-like config.json states the
    same way. `defaults`: what transformers assumes for rms_norm_eps, rope_theta (and num_key_value_heads,
    head_dim, tie_word_embeddings) when left out."""
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or defaults.get("head_dim") or 0
    return {
        "dim": hf["hidden_size"], "n_layers": hf["num_hidden_layers"], "n_heads": heads,
        "n_kv_heads": hf.get("num_key_value_heads") or defaults.get("num_key_value_heads", heads),
        "head_dim": 0 if head_dim == hf["hidden_size"] // heads else head_dim,  # 0: fivefold's "dim // n_heads"
        "ffn_dim": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
        "tie_embeddings": bool(hf.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))),
        "norm.eps": hf.get("rms_norm_eps", defaults["rms_norm_eps"]), "init_std": hf.get("initializer_range", 0.02),
        **part("rope", rope_fields(hf, defaults["rope_theta"], problems))}


def attention_keys(m: ModelConfig, base: dict) -> dict[str, Any]:
    """num_key_value_heads, head_dim and the RoPE keys of a grouped-query attention model."""
    out: dict[str, Any] = dict(num_key_value_heads=m.n_kv_heads, **rope_to_hf(m.rope, base))
    head_dim = m.head_dim or m.dim // m.n_heads
    if not (base.get("head_dim") is None and head_dim == m.dim // m.n_heads):  # keep a base's null default
        out["head_dim"] = head_dim
    return out


def pattern_of(layer_types: list[str]) -> tuple[str, ...]:
    """layer_types ("sliding_attention" / "full_attention" per layer) as fivefold's attention.window_pattern:
    its shortest period that divides the number of layers (the whole list for Gemma 3 1B's 26 layers
    of period 6), () when every layer slides."""
    kinds = ["sliding" if t == "sliding_attention" else "full" for t in layer_types]
    period = next(p for p in range(1, len(kinds) + 1)
                  if len(kinds) % p == 0 and all(k == kinds[i % p] for i, k in enumerate(kinds)))
    return () if set(kinds) == {"sliding"} else tuple(kinds[:period])


def layer_types(m: ModelConfig) -> list[str]:
    """fivefold's sliding windows as transformers' layer_types."""
    return ["sliding_attention" if m.attention.layer_window(i) else "full_attention" for i in range(m.n_layers)]
