"""Where a run lives and which of its checkpoints are complete: paths only, no torch.

`fivefold train` checks a config before it starts any process; these checks must not pay for
importing torch (seconds), so they live here rather than beside the code that writes checkpoints.
"""

from __future__ import annotations

from pathlib import Path

from fivefold.config.schema import Config

PREFIX = "step_"


def run_dir_of(cfg: Config) -> Path:
    return Path(cfg.run.out_dir) / (cfg.run.name or "run")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Finished checkpoints, oldest first (temporary folders of interrupted writes are ignored)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").is_file()]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint folder holds, from its name (step_00000300 -> 300)."""
    return int(path.name[len(PREFIX):])


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def check_run_dir(cfg: Config) -> list[str]:
    """A fresh run must not overwrite the checkpoints of an earlier one."""
    run_dir = run_dir_of(cfg)
    if not cfg.checkpoint.resume and latest_checkpoint(run_dir) is not None:
        return [f"run directory '{run_dir}' already holds checkpoints; pass --resume to continue it, "
                f"or choose another --run.name"]
    return []

