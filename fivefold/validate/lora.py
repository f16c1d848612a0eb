"""[lora] (model/lora.py): its numbers, its targets, and the layouts it is not built for yet (the PEFT
adapter lora.init_from names is checked with the weights, train/preflight.py)."""

from __future__ import annotations

from fivefold.config.schema import Config
from fivefold.model.config import PEFT_NAMES, ModelConfig


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
    if p.zero == 3:
        errors.append("lora.rank > 0 is not built yet with parallel.zero = 3 (its frozen base would not be "
                      "sharded): set zero = 0, 1 or 2")
    if p.tp_overlap:
        errors.append("lora.rank > 0 is not built yet with parallel.tp_overlap = true (the overlapped region "
                      "entry runs its layers' matmuls without their adapters): set tp_overlap = false")
    if cfg.optim.qk_clip:
        errors.append("lora.rank > 0 is not built yet with optim.qk_clip (it scales W_q and W_k, which LoRA "
                      "freezes, and not the adapters beside them): set qk_clip = 0")
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

