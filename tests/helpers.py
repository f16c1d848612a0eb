"""Small shared pieces of the tests."""

from __future__ import annotations

from pathlib import Path

from fivefold.config import Config, load_config

ROOT = Path(__file__).resolve().parent.parent


def tiny_config(out_dir: Path, *overrides: str) -> Config:
    """configs/tiny.toml writing into out_dir, with --section.key=value overrides."""
    return load_config(ROOT / "configs" / "tiny.toml", [f"--run.out_dir={out_dir}", *overrides])


# The data every equivalence test trains on: 1,100 bytes of the standard library make 35 samples of
# 32 tokens, so with batches of 8 the 5th step is an epoch's uneven last batch (3 samples, 5 slots
# of padding), where a per-rank mean loss would go wrong.
EQUIVALENCE = ("--data.max_bytes=1100", "--data.val_fraction=0.0", "--train.steps=5", "--checkpoint.keep=1")


def train_and_gather(rank: int, world: int, cfg: Config):
    """Worker: train, then return the losses, gradient norms and the gathered final model."""
    from fivefold.train.loop import train

    result = train(cfg, progress=False, return_state=True)
    return result.losses, result.grad_norms, result.state
