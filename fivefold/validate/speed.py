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
    errors += _fp8_device_errors(cfg) + _fp8_shape_errors(cfg)
    return errors


# torch._scaled_mm, FP8's matmul on CUDA, takes an (M, K) by (K, N) product only where K and N are
# multiples of 16 (its 16-byte alignment of e4m3 rows; torchao's Float8Linear states the same rule).
FP8_MULTIPLE = 16


def _fp8_shape_errors(cfg: Config) -> list[str]:
    """Every linear layer train.fp8 makes FP8 (parallel/fp8.py's apply_fp8: the blocks' but the
    router's) has, on each rank, input and output widths that are multiples of 16: a column-parallel
    layer's outputs and a row-parallel layer's inputs are split over tp (parallel/tensor.py's
    TP_PLAN). Where the run computes on CUDA (train.device "cuda", or "auto" with a GPU); the CPU's
    emulated FP8 matmul (parallel/fp8.py) takes any width."""
    t = cfg.train
    if t.fp8 == "none" or t.device == "cpu":
        return []  # before torch is imported: a config without FP8 is checked in no time
    import torch
    from torch import nn

    if t.device == "auto" and not torch.cuda.is_available():
        return []
    from fivefold.model.moe import MoE
    from fivefold.model.transformer import Block
    from fivefold.parallel.tensor import TP_PLAN, ColumnParallelLinear, RowParallelLinear

    m, tp = cfg.model, cfg.parallel.tp
    dense_layers = range(m.n_layers) if not m.moe.n_experts else range(min(m.moe.first_dense_layers, m.n_layers))
    kinds = sorted({0 if i in dense_layers else m.n_layers - 1 for i in range(m.n_layers)})  # a dense, an MoE block
    widths: dict[str, tuple[int, int]] = {}  # layer name -> (in, out) on one rank
    with torch.device("meta"):
        for layer in kinds:
            block = Block(m, layer, m.head_dim or m.dim // m.n_heads)
            for parent_name, parent in block.named_modules():
                if isinstance(parent, MoE):
                    continue  # the router stays in the compute dtype (its shared experts are reached below)
                for name, child in parent.named_children():
                    if type(child) is not nn.Linear:
                        continue
                    split = TP_PLAN.get(f"{parent_name}.{name}") if isinstance(parent, type(block.attn)) or \
                        parent is block.ffn else None
                    k, n = child.in_features, child.out_features
                    widths[f"{parent_name}.{name}"] = (k // tp if split is RowParallelLinear else k,
                                                       n // tp if split is ColumnParallelLinear else n)
    bad = [f"{name} {k} x {n}" for name, (k, n) in widths.items() if k % FP8_MULTIPLE or n % FP8_MULTIPLE]
    if not bad:
        return []
    return [f"train.fp8 = '{cfg.train.fp8}' multiplies with torch._scaled_mm, whose widths must be multiples of "
            f"{FP8_MULTIPLE}, but these layers' (inputs x outputs on one rank, tp = {tp}) are not: {', '.join(bad)}; "
            f"choose model widths that make them multiples of {FP8_MULTIPLE} (of {FP8_MULTIPLE} x tp where tp "
            f"splits them), or train.fp8 = 'none'"]


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
