"""One training case at world 1: `fivefold`, the runtime's own path (train/loop.py `setup()`: mesh,
model built on the meta device and parallelized, the default corpus with the byte tokenizer, the
seeded initialisation; then train/step.py `train_step()` per step; no metrics log, no final
checkpoint), or `plain`: the same `Transformer` trained by a bare loop (random token ids, autocast,
`cross_entropy_sum` / tokens, backward, `clip_grad_norm_`, the optimizer `build_optimizer` makes,
the loss read each step; with compile each block `.compile()`d as fivefold does)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
MODELS = {
    "llama-1b": {"config": None, "overrides": [  # Llama 3.2 1B: 1.236B parameters, tied
        "--model.dim=2048", "--model.n_layers=16", "--model.n_heads=32", "--model.n_kv_heads=8",
        "--model.ffn_dim=8192", "--model.vocab_size=128256", "--model.rope.theta=500000.0",
        "--model.norm.eps=1e-5", "--model.tie_embeddings=true"], "seq_len": 2048, "micro_batch": 4},
    "debug": {"config": "configs/debug.toml", "overrides": [], "seq_len": 128, "micro_batch": 8},
    "tiny": {"config": "configs/tiny.toml", "overrides": [], "seq_len": 32, "micro_batch": 2},
}


def make_config(model: str, device: str, dtype: str, steps: int, out_dir: Path, extra: tuple[str, ...] = (),
                micro_batch: int = 0, seq_len: int = 0):
    """A world-1 config of `model` for `steps` steps, `extra` overrides last; validated."""
    from fivefold.config.load import ConfigError, load_config
    from fivefold.validate import validate

    spec = MODELS[model]
    mb, seq = micro_batch or spec["micro_batch"], seq_len or spec["seq_len"]
    # an epoch covers all steps (val_fraction 0.05); the floor leaves the split documents to split
    max_bytes = max(20_000, int(steps * mb * (seq + 1) * 1.5 / 0.95))
    cfg = load_config(ROOT / spec["config"] if spec["config"] else None, [
        *spec["overrides"], f"--train.seq_len={seq}", f"--train.micro_batch={mb}", f"--train.global_batch={mb}",
        f"--train.dtype={dtype}", f"--train.device={device}", "--train.compile=false", "--parallel.dp=1",
        f"--train.steps={steps}", "--optim.warmup_steps=1", "--train.eval_every=0", "--data.tokenizer=byte",
        f"--data.max_bytes={max_bytes}", f"--run.out_dir={out_dir}", f"--run.name={model}", *extra])
    if errors := validate(cfg, 1):
        raise ConfigError(errors)
    return cfg


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_device(device: str) -> None:
    gc.collect()
    if "torch._dynamo" in sys.modules:  # compiled graphs hold the blocks they were traced from
        sys.modules["torch._dynamo"].reset()
        gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def fivefold_case(cfg, device: str, steps: int, compile_options: dict | None = None) -> dict:
    """`steps` of train_step; `compile_options`: compile the blocks with these torch.compile options
    after setup (what train.compile does, with a backend of the caller's choosing)."""
    from fivefold.config.derive import derive
    from fivefold.data.resolve import unpadded_vocab
    from fivefold.parallel.parallelize import compile_blocks
    from fivefold.train.loop import init_distributed, setup
    from fivefold.train.step import train_step

    init_distributed(device)  # a process group of one, kept for the part's later cases
    began = time.perf_counter()
    run, _, _ = setup(cfg, derive(cfg, 1, unpadded_vocab(cfg)), device)
    if compile_options is not None:
        compile_blocks(run.par.model, **compile_options)
    sync(device)
    out = {"setup_s": time.perf_counter() - began, "times": [], "tokens": [], "losses": [], "metrics": []}
    for step in range(steps):
        sync(device)
        t0 = time.perf_counter()
        m = train_step(run, step).metrics  # reads the loss and the gradient norm
        sync(device)
        out["times"].append(time.perf_counter() - t0)
        out["tokens"].append(m["tokens"])
        out["losses"].append(m["loss"])
        out["metrics"].append(m)
    return out


def plain_case(cfg, vocab: int, device: str, steps: int, compile_: bool = False) -> dict:
    from fivefold.model.transformer import Transformer, cross_entropy_sum
    from fivefold.parallel.optimizer import build_optimizer

    t = cfg.train
    began = time.perf_counter()
    torch.manual_seed(t.seed)
    with torch.device(device):
        model = Transformer(dataclasses.replace(cfg.model, vocab_size=vocab))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, cfg.model.init_std)
            else:
                p.fill_(1.0)
    if compile_:
        for block in model.layers.values():
            block.compile()  # as fivefold compiles: each block, its parameter names kept
    opt = build_optimizer(model, cfg.optim)
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.dtype)
    autocast = (lambda: torch.autocast(device_type=device, dtype=dtype)) if dtype else contextlib.nullcontext
    g = torch.Generator().manual_seed(t.seed)
    B, T = t.micro_batch, t.seq_len
    sync(device)
    out = {"setup_s": time.perf_counter() - began, "times": [], "tokens": [], "losses": [], "metrics": []}
    for _ in range(steps):
        tokens = torch.randint(0, min(vocab, 257), (B, T + 1), generator=g)  # ids the byte tokenizer makes
        sync(device)
        t0 = time.perf_counter()
        x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # (B, T) each
        with autocast():
            logits = model(x)  # (B, T, vocab)
        loss = cross_entropy_sum(logits, y) / y.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
        sync(device)
        out["times"].append(time.perf_counter() - t0)
        out["tokens"].append(B * T)
    return out


def losses(cfg, device: str, steps: int, compile_options: dict | None = None) -> tuple[list[float], dict]:
    """fivefold's losses over `steps` steps from a fresh setup, and the last step's metrics record."""
    free_device(device)
    res = fivefold_case(cfg, device, steps, compile_options)
    return res["losses"], res["metrics"][-1]


def relative_gap(a: list[float], b: list[float]) -> float:
    """The largest |a - b| / |b| over the steps: how far one loss curve is from its reference."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
