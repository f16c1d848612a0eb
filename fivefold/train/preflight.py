"""The checks of a run made before any process starts (and without torch unless init_from is set).

`fivefold train` runs them on the launching node for every node's processes; `train()` called as
a library runs them itself. A typo fails in under a second: the config's checks (validate.py) and
the run directory's (checkpoint/run_dir.py) import no torch; only `checkpoint.init_from`, whose weights'
headers are read against the model (and `lora.init_from`'s PEFT adapter, checkpoint/peft.py), and a
resume, whose checkpoint's files are checked (checkpoint/files.py), do.
"""

from __future__ import annotations

from fivefold.checkpoint.run_dir import check_run_dir, latest_checkpoint, run_dir_of
from fivefold.config.schema import Config
from fivefold.train import sinks
from fivefold.validate import validate


def preflight(cfg: Config, world_size: int, joining: bool = False) -> list[str]:
    """Every problem of a run of `cfg` on `world_size` processes: the config, the run directory,
    the metric sinks' credentials, and the weights `checkpoint.init_from` names, each as one line naming
    the field and the fix. joining: a node joining an elastic job that node 0 runs; the run directory
    and its checkpoints are that job's, being written as this runs, so they are node 0's to check."""
    errors = validate(cfg, world_size) + ([] if joining else check_run_dir(cfg))
    if not errors:
        errors += sinks.preflight(cfg)  # online W&B without credentials (imports wandb only then)
    if cfg.checkpoint.init_from:
        from fivefold.checkpoint.weights import check_init_from

        errors += check_init_from(cfg)
    if cfg.lora.init_from and not errors:  # the PEFT adapter: its files and config against [lora], its tensors
        from fivefold.checkpoint.peft import peft_dir_errors  # against the model

        errors += peft_dir_errors(cfg)
    latest = latest_checkpoint(run_dir_of(cfg)) if cfg.checkpoint.resume and not errors and not joining else None
    if latest is not None:  # what the resume will read: each damaged file named now, not inside a rank
        from fivefold.checkpoint.files import checkpoint_errors

        errors += checkpoint_errors(latest)
    return errors
