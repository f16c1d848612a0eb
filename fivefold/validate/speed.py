"""The runtime's speed options (FP8, tp and ep overlap, offload): each names what it needs."""

from __future__ import annotations

from fivefold.config.schema import Config


def speed_errors(cfg: Config) -> list[str]:
    """train.fp8, parallel.fp8_gather, tp_overlap, ep_overlap and offload against the layout they need."""
    p, t = cfg.parallel, cfg.train
    errors = []
    if p.tp_overlap and not p.sp:
        errors.append("parallel.tp_overlap = true needs sequence parallel (its all-gathers and reduce-scatters "
                      "are what it splits): set parallel.sp = true, or tp_overlap = false")
    elif p.tp_overlap and t.fp8 != "none":
        errors.append(f"parallel.tp_overlap = true is not built yet with train.fp8 = '{t.fp8}' (its pieces' "
                      "matmuls run in the compute dtype, and FP8's scales are taken over whole tensors): "
                      "set tp_overlap = false, or train.fp8 = 'none'")
    if p.ep_overlap and p.pp_schedule != "dualpipe_v":
        errors.append(f"parallel.ep_overlap = true pairs DualPipe's forward and backward chunks, but "
                      f"parallel.pp_schedule = '{p.pp_schedule}': set pp_schedule = 'dualpipe_v', "
                      "or ep_overlap = false")
    if p.ep_overlap and p.zero == 3 and p.reshard_after_forward is True:
        errors.append("parallel.ep_overlap = true is not built yet with ZeRO-3's reshard_after_forward = true (the "
                      "pair's two halves would gather, prefetch and free units side by side): set "
                      "reshard_after_forward = 'auto' (kept gathered under a pipeline), or ep_overlap = false")
    if p.offload == "params" and p.zero != 3:
        errors.append(f"parallel.offload = 'params' moves ZeRO-3's parameter shards to the host, but "
                      f"parallel.zero = {p.zero}: set zero = 3, or offload = 'optimizer'")
    if p.offload == "optimizer" and p.zero == 0:
        errors.append("parallel.offload = 'optimizer' moves the optimizer's shards to the host, but "
                      "parallel.zero = 0 has none: set zero = 1, 2 or 3")
    if p.fp8_gather and (p.zero != 3 or t.fp8 != "tensorwise"):
        errors.append(f"parallel.fp8_gather = true gathers ZeRO-3's weights in FP8 with one scale per tensor, "
                      f"but zero = {p.zero} and train.fp8 = '{t.fp8}': set zero = 3 and train.fp8 = 'tensorwise'")
    errors += _fp8_device_errors(cfg)
    return errors


def _fp8_device_errors(cfg: Config) -> list[str]:
    """FP8 matmuls on CUDA need FP8 tensor cores: compute capability 8.9 (Ada) or 9.0 (Hopper) and up."""
    t = cfg.train
    if t.fp8 == "none" or t.device == "cpu":
        return []
    import torch

    if not torch.cuda.is_available():
        return []  # on the CPU FP8 is emulated exactly (parallel/fp8.py's scaled_mm)
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) >= (8, 9):
        return []
    return [f"train.fp8 = '{t.fp8}' needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
            f"Blackwell), but {torch.cuda.get_device_name()} is {major}.{minor}: set train.fp8 = 'none'"]
