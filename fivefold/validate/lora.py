"""[lora] (model/lora.py): its numbers, its targets, and the layouts it is not built for yet (the PEFT
adapter lora.init_from names is checked with the weights, train/preflight.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math

from fivefold.config.schema import Config
from fivefold.model.config import NF4_GROUP, PEFT_NAMES, ModelConfig


def lora_errors(cfg: Config) -> list[str]:
    lo, p = cfg.lora, cfg.parallel
    if lo.rank < 0:
        return [f"lora.rank = {lo.rank}: must be >= 0 (0 = off)"]
    if not lo.rank:
        return [f"lora.init_from = '{lo.init_from}' with lora.rank = 0: set lora.rank to the adapter's r "
                f"(its adapter_config.json)"] if lo.init_from else []
    errors = []
    if lo.alpha <= 0 or not 0 <= lo.dropout < 1:
        errors.append(f"lora: alpha = {lo.alpha} (> 0), dropout = {lo.dropout} (within [0, 1))")
    known = sorted(set(PEFT_NAMES.values()))
    unknown = [t for t in lo.targets if t not in known]
    if unknown or not lo.targets:
        errors.append(f"lora.targets = {list(lo.targets)}: {'unknown ' + ', '.join(unknown) if unknown else 'empty'}; "
                      f"choose among {', '.join(known)}")
    elif not set(lo.targets) & (present := model_targets(cfg.model)):
        errors.append(f"lora.targets = {list(lo.targets)} select no layer of this model (nothing would train): "
                      f"choose among its {', '.join(sorted(present))}")
    if p.offload == "params":
        errors.append("lora.rank > 0 is not built yet with parallel.offload = \"params\" (the frozen base's "
                      "shards would stay on the device): set offload = \"optimizer\" or \"none\"")
    if p.tp_overlap and lo.dropout:
        errors.append(f"lora.dropout = {lo.dropout} is not built yet with parallel.tp_overlap = true (the "
                      "overlapped entry never holds the gathered input to drop): set dropout = 0 or tp_overlap = false")
    if cfg.optim.qk_clip:
        errors.append("lora.rank > 0 is not built yet with optim.qk_clip (it scales W_q and W_k, which LoRA "
                      "freezes, and not the adapters beside them): set qk_clip = 0")
    if lo.base_dtype == "nf4":
        errors += nf4_errors(cfg)
    return errors


def model_targets(m: ModelConfig) -> set[str]:
    """The PEFT names of the linear layers a model of `m` has (model/lora.py adapts those of lora.targets)."""
    lat = m.latent
    if lat.kv_lora_rank:  # latent attention (model/attention.py LatentAttention)
        out = {"q_a_proj", "q_b_proj"} if lat.q_lora_rank else {"q_proj"}
        out |= {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    else:
        out = {"q_proj", "k_proj", "v_proj", "o_proj"}
    if not m.moe.n_experts or m.moe.first_dense_layers or m.moe.n_shared_experts:  # a dense or shared SwiGLU
        out |= {"gate_proj", "up_proj", "down_proj"}
    return out | ({"eh_proj"} if m.mtp_layers else set())


def nf4_errors(cfg: Config) -> list[str]:
    """lora.base_dtype = "nf4" (QLoRA, model/lora.py NF4Base): the layouts that cannot hold an NF4 base yet."""
    p, errors = cfg.parallel, []
    if importlib.util.find_spec("torchao") is None:
        errors.append("lora.base_dtype = \"nf4\" needs torchao (its NF4Tensor): pip install torchao==0.18.0, "
                      "or set base_dtype = \"\"")
    if p.zero == 3:
        errors.append("lora.base_dtype = \"nf4\" is not built yet with parallel.zero = 3 (its shards are rows of "
                      "dense weights, NF4's blocks and scales are not): set zero <= 2 or base_dtype = \"\"")
    if p.tp > 1:
        errors.append(f"lora.base_dtype = \"nf4\" is not built yet with parallel.tp = {p.tp} (NF4's scales are "
                      f"quantised around the whole weight's mean: a slice's differ): set tp = 1 or base_dtype = \"\"")
    if cfg.train.fp8 != "none":
        errors.append(f"lora.base_dtype = \"nf4\" with train.fp8 = \"{cfg.train.fp8}\": the adapted layers' "
                      "weights are NF4, not FP8-castable: set fp8 = \"none\" or base_dtype = \"\"")
    odd = [f"{name} {tuple(shape)}" for name, shape in adapted_shapes(cfg).items() if math.prod(shape) % NF4_GROUP]
    if odd:
        errors.append(f"lora.base_dtype = \"nf4\": {len(odd)} adapted weights are not whole groups of {NF4_GROUP} "
                      f"elements (64-element blocks, 256 scales a group), e.g. {odd[0]}: make model.dim and "
                      f"ffn_dim multiples of 128, or set base_dtype = \"\"")
    return errors


def adapted_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The weights' shapes of the layers lora.targets adapts, from the model built on the meta device
    (torch imported here: validating a config without NF4 needs none)."""
    import torch

    from fivefold.model.lora import lora_targets
    from fivefold.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(dataclasses.replace(cfg.model, vocab_size=max(cfg.model.vocab_size, 1)))
    return {name: tuple(model.get_submodule(name).weight.shape) for name in lora_targets(model, cfg.lora.targets)}
