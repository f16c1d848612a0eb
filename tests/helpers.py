"""Small shared pieces of the tests."""

from __future__ import annotations

from pathlib import Path

from fivefold.config import Config, load_config

ROOT = Path(__file__).resolve().parent.parent


def tiny_config(out_dir: Path, *overrides: str) -> Config:
    """configs/tiny.toml writing into out_dir, with --section.key=value overrides."""
    return load_config(ROOT / "configs" / "tiny.toml", [f"--run.out_dir={out_dir}", *overrides])
