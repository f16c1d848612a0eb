"""Hugging Face Llama, Mixtral and DeepSeek-V3 checkpoints in and out: config, names and layouts.

What differs between a Hugging Face (HF) directory and fivefold, and what is done about it:
- config.json <-> ModelConfig (`model_config_from_hf`, `hf_config`). An option fivefold does not
  implement (a RoPE scaling type, biases, sliding-window attention, ...) is refused by name rather
  than dropped, since the converted model would compute something else.
- Names: `model.layers.{i}.self_attn.q_proj.weight` <-> `layers.{i}.attn.wq.weight`, ... (DENSE).
- RoPE: nothing to do. HF's Llama rotates the pairs (x_i, x_{i+D/2}) ("rotate_half"), and so does
  `model.apply_rope`. (Meta's original checkpoints rotate adjacent pairs (x_2i, x_2i+1); HF's
  conversion script, transformers/models/llama/convert_llama_weights_to_hf.py, permutes the
  rows of wq and wk once, per head: view(H, D/2, 2, dim).transpose(1, 2). HF weights are already
  in the layout fivefold uses; tests/checkpoint/test_hf.py shows that permutation applied again is caught.)
- Mixtral's experts are saved one nn.Linear per expert, weight (out, in):
  `block_sparse_moe.experts.{e}.w1` (gate, (hidden, dim)), `w3` (up, (hidden, dim)), `w2` (down,
  (dim, hidden)); fivefold stacks them as x @ W: `experts.gate/up` (E, dim, hidden), `experts.down`
  (E, hidden, dim), so expert e of a stacked tensor is HF's weight transposed. (transformers 5
  fuses gate and up in memory, `experts.gate_up_proj`, but still saves this per-expert layout.)
  The router `block_sparse_moe.gate` is `ffn.router`: softmax, top-k, renormalised, as fivefold's
  MoE with router_score = "softmax" and norm_topk = true.
- Tied embeddings: HF saves no `lm_head.weight`; fivefold saves `tok_embeddings.weight` once.
- DeepSeek-V3 (latent attention, group-limited sigmoid routing, shared experts): its names, its
  interleaved RoPE rows and what else differs are in checkpoint/hf_deepseek.py; a model with
  model.kv_lora_rank > 0 is written as DeepSeek-V3.
Weights are read only from safetensors (`checkpoint/safetensors_io.py`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from fivefold.checkpoint import hf_deepseek
from fivefold.checkpoint.safetensors_io import SafetensorsDir
from fivefold.config import ModelConfig
from fivefold.model.transformer import Transformer

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "mixtral",
                 hf_deepseek.ARCHITECTURE: "deepseek_v3"}
DENSE = {  # per block: fivefold name -> HF name
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn.gate.weight": "mlp.gate_proj.weight", "ffn.up.weight": "mlp.up_proj.weight",
    "ffn.down.weight": "mlp.down_proj.weight", "ffn.router.weight": "block_sparse_moe.gate.weight",
}
TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
EXPERTS = {"ffn.experts.gate": "block_sparse_moe.experts.{e}.w1.weight",
           "ffn.experts.up": "block_sparse_moe.experts.{e}.w3.weight",
           "ffn.experts.down": "block_sparse_moe.experts.{e}.w2.weight"}
BLOCKS = {"llama": (DENSE, EXPERTS), "mixtral": (DENSE, EXPERTS),  # per architecture: block and expert names
          "deepseek_v3": (hf_deepseek.BLOCK, hf_deepseek.EXPERTS)}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# What transformers assumes for keys a config.json leaves out (LlamaConfig / MixtralConfig defaults).
DEFAULTS = {"llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
            "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_key_value_heads": 8},
            "deepseek_v3": hf_deepseek.DEFAULTS}


class HFFormatError(ValueError):
    """A Hugging Face config or checkpoint fivefold cannot represent; nothing was converted."""


# ---- names -------------------------------------------------------------------------------------
def kind_of(m: ModelConfig) -> str:
    """The HF architecture a fivefold model is written as: DeepSeek-V3 with latent attention, else
    Mixtral with experts, else Llama."""
    return "deepseek_v3" if m.kv_lora_rank else "mixtral" if m.n_experts else "llama"


def hf_names(name: str, m: ModelConfig) -> list[str]:
    """The HF tensors behind one fivefold tensor: one, or for stacked experts one per expert."""
    if name in TOP:
        return [TOP[name]]
    block, experts = BLOCKS[kind_of(m)]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match is None or (match.group(2) not in block and match.group(2) not in experts):
        raise KeyError(f"'{name}' has no Hugging Face counterpart")
    layer, rest = match.groups()
    if rest in block:
        return [f"model.layers.{layer}.{block[rest]}"]
    return [f"model.layers.{layer}.{experts[rest].format(e=e)}" for e in range(m.n_experts)]


def is_stacked(name: str) -> bool:
    """Experts stacked into one (E, in, out) tensor: HF saves one matrix per expert."""
    return name.split(".")[-2] == "experts"


def hf_rows(name: str, m: ModelConfig, hf: dict) -> torch.Tensor | None:
    """The HF row behind each row of fivefold's tensor `name` (fivefold = hf[rows]) where the two
    orders differ (DeepSeek-V3's interleaved RoPE rows), else None. `hf`: the model's config.json."""
    if kind_of(m) != "deepseek_v3" or not hf.get("rope_interleave", hf_deepseek.DEFAULTS["rope_interleave"]):
        return None
    return hf_deepseek.rope_rows(name, m)


# ---- config ------------------------------------------------------------------------------------
def _rope_theta(hf: dict, default: float, problems: list[str]) -> float:
    """RoPE base from either config style: v5's rope_parameters or the older rope_theta/rope_scaling."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        problems.append(f"rope type '{kind}': fivefold implements plain RoPE only (no scaled or extended RoPE)")
    return float(params.get("rope_theta", hf.get("rope_theta", default)))


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """fivefold's ModelConfig for a Llama, Mixtral or DeepSeek-V3 config.json; HFFormatError listing
    every option fivefold lacks."""
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        names = list(ARCHITECTURES)
        raise HFFormatError(f"{where}: architectures {archs}: fivefold reads {', '.join(names[:-1])} and "
                            f"{names[-1]} only")
    kind = ARCHITECTURES[archs[0]]
    required = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"]
    required += ["num_local_experts", "num_experts_per_tok"] if kind == "mixtral" else []
    required += list(hf_deepseek.REQUIRED) if kind == "deepseek_v3" else []
    missing = [k for k in required if not isinstance(hf.get(k), int)]
    if missing:
        raise HFFormatError(f"{where}: {', '.join(missing)} missing or not an integer")
    problems: list[str] = []

    def refuse(key: str, fine: Any, what: str) -> None:
        if hf.get(key, fine) not in (fine, None):
            problems.append(f"{key} = {hf[key]!r}: {what}")

    refuse("hidden_act", "silu", "fivefold's FFN is SwiGLU (silu)")
    refuse("attention_bias", False, "fivefold's attention projections have no bias")
    refuse("mlp_bias", False, "fivefold's FFN has no bias")
    refuse("attention_dropout", 0.0, "fivefold has no dropout")
    refuse("sliding_window", None, "fivefold's attention is full causal attention, no sliding window")
    refuse("router_jitter_noise", 0.0, "fivefold's router adds no noise")
    refuse("quantization_config", None, "quantized weights are not read; use the unquantized checkpoint")
    if kind == "deepseek_v3":
        problems += hf_deepseek.config_problems(hf)
    defaults = DEFAULTS[kind]
    theta = _rope_theta(hf, defaults["rope_theta"], problems)
    if problems:
        raise HFFormatError(f"{where} ({archs[0]}) uses what fivefold does not implement:\n  " + "\n  ".join(problems))
    if kind == "deepseek_v3":
        return hf_deepseek.model_config(hf, theta)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or 0
    moe = dict(n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"]) if kind == "mixtral" else {}
    return ModelConfig(
        dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or defaults.get("num_key_value_heads", heads),
        head_dim=0 if head_dim == hf["hidden_size"] // heads else head_dim,  # 0: fivefold's "dim // n_heads"
        ffn_dim=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=hf.get("rms_norm_eps", defaults["rms_norm_eps"]),
        rope_theta=theta, init_std=hf.get("initializer_range", 0.02), **moe)


def export_problems(m: ModelConfig) -> list[str]:
    """What a fivefold model has that the HF architecture it is written as (kind_of) cannot express."""
    # None of the architectures written here has sliding windows or sinks (Mistral, Gemma and gpt-oss do).
    masks = [what for bad, what in ((m.sliding_window > 0, "model.sliding_window > 0 (no sliding window)"),
                                    (m.attention_sinks, "model.attention_sinks = true (no attention sinks)")) if bad]
    if kind_of(m) == "deepseek_v3":
        return masks + hf_deepseek.export_problems(m)
    moe = m.n_experts > 0
    checks = [(m.qk_norm, "model.qk_norm = true (Llama and Mixtral have no q/k norms)"),
              (m.n_shared_experts > 0, "model.n_shared_experts > 0 (Mixtral has no shared experts)"),
              (moe and m.first_dense_layers > 0, "model.first_dense_layers > 0 (every Mixtral block is MoE)"),
              (moe and m.router_score != "softmax", "model.router_score = 'sigmoid' (Mixtral's router is a softmax)"),
              (moe and not m.norm_topk, "model.norm_topk = false (Mixtral renormalises its top-k weights)"),
              (moe and m.n_expert_groups > 1, "model.n_expert_groups > 1 (Mixtral routes without groups)"),
              (moe and m.moe_routed_scale != 1, "model.moe_routed_scale != 1 (Mixtral does not scale its experts)")]
    problems = masks + [what for bad, what in checks if bad]
    deepseek_only = (m.n_shared_experts, m.first_dense_layers, m.router_score != "softmax", m.n_expert_groups > 1,
                     m.moe_routed_scale != 1)
    if moe and any(deepseek_only):
        problems.append("(DeepSeek-V3 has these MoE options, but fivefold writes it for latent attention only: "
                        "model.kv_lora_rank > 0)")
    return problems


def hf_config(m: ModelConfig, dtype: torch.dtype, base: dict | None = None) -> dict:
    """config.json for the model `m` (vocab_size resolved) saved in `dtype`. `base`: an HF config
    whose other keys (token ids, context length, ...) are kept; its model keys are replaced."""
    kind = kind_of(m)
    out = dict(base or {})
    out.update(architectures=[next(a for a, k in ARCHITECTURES.items() if k == kind)], model_type=kind,
               hidden_size=m.dim, num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
               vocab_size=m.vocab_size, rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
               hidden_act="silu", initializer_range=m.init_std)
    if kind == "deepseek_v3":
        out.update(hf_deepseek.hf_keys(m, out))
    else:
        out.update(intermediate_size=(m.moe_ffn_dim or m.ffn_dim) if m.n_experts else m.ffn_dim,
                   num_key_value_heads=m.n_kv_heads)
        head_dim = m.head_dim or m.dim // m.n_heads
        if not (out.get("head_dim") is None and head_dim == m.dim // m.n_heads):  # keep a base's null default
            out["head_dim"] = head_dim
    if kind == "mixtral":
        out.update(num_local_experts=m.n_experts, num_experts_per_tok=m.top_k)
    if "rope_parameters" in out:  # transformers 5 style
        out["rope_parameters"] = {**out["rope_parameters"], "rope_theta": m.rope_theta}
    else:  # the older style, which transformers 4 and 5 both read
        out["rope_theta"] = m.rope_theta
    out["torch_dtype" if "torch_dtype" in out else "dtype"] = DTYPE_NAMES[dtype]
    return out


# ---- reading HF weights as fivefold tensors ------------------------------------------------------
class HFSource:
    """A Hugging Face directory seen as fivefold's tensors (names, shapes, slices): the
    WeightSource `checkpoint/weights.py` loads from, and what `fivefold convert --to fivefold` writes."""

    def __init__(self, path: Path, field: str = ""):
        config = path / "config.json"
        if not path.is_dir():
            raise HFFormatError(f"{path} is not a directory: give a Hugging Face model directory (config.json and "
                                f"*.safetensors)")
        try:
            self.hf_config = json.loads(config.read_text())
        except (OSError, ValueError) as e:
            raise HFFormatError(f"{config}: not readable JSON ({e})") from None
        self.model_cfg = model_config_from_hf(self.hf_config, str(config))
        self.files = SafetensorsDir(path, field)
        with torch.device("meta"):
            model = Transformer(self.model_cfg)
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        have = self.files.names()
        self._names = frozenset(k for k in self.shapes if all(n in have for n in hf_names(k, self.model_cfg)))

    def names(self) -> frozenset[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        parts = hf_names(name, self.model_cfg)
        if not is_stacked(name):
            return self.files.shape(parts[0])
        out_features, in_features = self.files.shape(parts[0])
        return (len(parts), in_features, out_features)

    def dtype(self, name: str) -> torch.dtype:
        return self.files.dtype(hf_names(name, self.model_cfg)[0])

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """A box of fivefold's tensor `name`; for stacked experts (E, in, out), each expert's box
        is read from HF's (out, in) weight and transposed; for reordered rows (hf_rows), the HF rows
        spanning the box's are read and picked from."""
        parts = hf_names(name, self.model_cfg)
        if not is_stacked(name):
            order = hf_rows(name, self.model_cfg, self.hf_config)
            if order is None:
                return self.files.read(parts[0], index)
            rows, *cols = index or tuple(slice(0, n) for n in self.shape(name))
            wanted = order[rows]  # (R,) HF rows of the box: the reordering stays inside each head
            if wanted.numel() == 0:
                return torch.empty(0, *[s.stop - s.start for s in cols], dtype=self.dtype(name))
            low = int(wanted.min())
            return self.files.read(parts[0], (slice(low, int(wanted.max()) + 1), *cols))[wanted - low]  # (R, ...)
        experts, rows, cols = index or tuple(slice(0, n) for n in self.shape(name))
        if min(s.stop - s.start for s in (experts, rows, cols)) <= 0:  # an empty shard (ZeRO-3 with E < dp)
            return torch.empty([max(0, s.stop - s.start) for s in (experts, rows, cols)], dtype=self.dtype(name))
        boxes = [self.files.read(parts[e], (cols, rows))  # (cols, rows) each
                 for e in range(experts.start, experts.stop)]
        return torch.stack([box.T for box in boxes])  # (E', rows, cols)

    def read_into(self, name: str, index: tuple[slice, ...], out: torch.Tensor) -> None:
        out.copy_(self.read(name, index))

