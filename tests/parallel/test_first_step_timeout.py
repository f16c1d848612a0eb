"""The collective timeouts of a run: torch's NCCL default for every step but the first, which compiles
and makes NCCL's communicators under parallel.first_step_timeout_s (parallel/mesh.py's `timeout`),
set on every process group of the job and lowered after it."""

from datetime import timedelta

import torch
import torch.distributed as dist
from helpers import tiny_config

from fivefold.config.schema import ParallelConfig
from fivefold.parallel.comm import arrivals
from fivefold.parallel.forked_ranks import run_workers
from fivefold.validate import validate

TIMEOUTS = ("--parallel.collective_timeout_s=45", "--parallel.first_step_timeout_s=90")


def _group_timeouts(run) -> dict[str, float]:
    """The seconds every process group of this process waits (its gloo backend's own setting), by
    group name, and the mesh's views' (their errors say them), under "view:<name>"."""
    out = {}
    for pg, name in dist.distributed_c10d._world.pg_names.items():
        timeout: timedelta = pg._get_backend(torch.device("cpu")).options._timeout
        out[name] = timeout.total_seconds()
    for name in ("dp", "grad", "world"):
        out[f"view:{name}"] = run.mesh.group(name).timeout_s
    return out


def _train_recording_timeouts(rank, world, cfg):
    """Train, noting every group's timeout as each step begins (inside the step's timeout block)."""
    import fivefold.train.loop as loop

    seen, step_of = [], loop.train_step

    def recorded(run, step, **kwargs):
        seen.append(_group_timeouts(run))
        return step_of(run, step, **kwargs)

    loop.train_step = recorded  # a forked worker's own module: gone with the process
    loop.train(cfg, progress=False)
    return seen


def test_the_first_step_waits_longer_and_every_group_is_set_back_after_it(tmp_path):
    """dp2 over 3 steps: while step 1 runs every group of the job (the mesh's axes and views, and
    the default group "world") waits first_step_timeout_s; from step 2 on collective_timeout_s.
    Fails where the first step ran under the steady timeout (the setting did not exist)."""
    cfg = tiny_config(tmp_path, "--parallel.dp=2", "--train.steps=3", "--data.val_fraction=0.0", *TIMEOUTS)
    for seen in run_workers(_train_recording_timeouts, 2, cfg):
        assert len(seen) == 3
        assert len(seen[0]) > 4 and seen[0].keys() == seen[1].keys() == seen[2].keys()
        assert set(seen[0].values()) == {90.0}, seen[0]
        assert set(seen[1].values()) == set(seen[2].values()) == {45.0}, seen[1]


def test_the_default_timeout_is_torchs_nccl_default_and_the_first_steps_is_longer():
    """600 s, what torch's NCCL process groups wait without one (half that aborted a cold start);
    the first step's default is longer, and a CUDA run's arrivals watch looks before either ends."""
    p = ParallelConfig()
    assert p.collective_timeout_s == arrivals.collective_deadlines(None, "cuda").process_group_s == 600
    assert p.first_step_timeout_s > p.collective_timeout_s
    for seconds in (p.collective_timeout_s, p.first_step_timeout_s):
        d = arrivals.collective_deadlines(seconds, "cuda")
        assert d.watch_s == seconds / 2 and d.watch_s + d.look_s < d.process_group_s


def test_a_first_step_timeout_of_no_seconds_is_one_line(tmp_path):
    """One shorter than the collective timeout is no error: the first step waits the longer of the two."""
    cfg = tiny_config(tmp_path, "--parallel.first_step_timeout_s=0")
    assert validate(cfg, 1) == ["parallel.first_step_timeout_s = 0: must be > 0 seconds (1800 is the default)"]
    assert validate(tiny_config(tmp_path, "--parallel.collective_timeout_s=3600"), 1) == []
