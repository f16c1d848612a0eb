"""The command line end to end: real launcher processes, real files."""

import os
import subprocess
import sys

import torch.distributed as dist
from helpers import ROOT

from fivefold.cli import main
from fivefold.train.metrics import read_metrics

FAST = ["--data.max_bytes=20000", "--train.steps=3", "--no-progress"]


def fivefold(*args: str, launcher: tuple[str, ...] = ("-m", "fivefold")) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *launcher, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)


# The local launcher (`--nproc`) runs in tests/launch/test_launch.py, killed worker and all.
def test_train_under_torchrun(tmp_path):
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fivefold")
    out = fivefold("train", "configs/tiny.toml", f"--run.out_dir={tmp_path}", *FAST, launcher=torchrun)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(read_metrics(tmp_path / "tiny" / "metrics.jsonl")) == 3


def test_bad_config_fails_before_any_process_starts(tmp_path, capsys):
    # Before torch is even imported (seconds saved on every typo): the process reports whether it was
    check = ("import sys; from fivefold.cli import main; code = main(sys.argv[1:]); "
             "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(code)")
    out = fivefold("train", "configs/tiny.toml", "--nproc", "3", "--parallel.dp=2", "--train.stpes=1",
                   "--optim.lr=-1", f"--run.out_dir={tmp_path}", launcher=("-c", check))
    assert out.returncode == 2 and out.stdout.strip() == "no torch", out.stdout
    assert "unknown key 'train.stpes': did you mean 'steps'?" in out.stderr  # parse and value errors together
    assert "parallel.dp x pp x cp x tp = 2 x 1 x 1 x 1 = 2 but 3 processes" in out.stderr
    assert "optim.lr = -1: must be > 0" in out.stderr
    # In this process too: the check runs before any process group exists.
    code = main(["train", "configs/tiny.toml", "--nproc", "64",
                 "--deepspeed", str(ROOT / "tests/fixtures/ds_seed_004.json"), f"--run.out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and not dist.is_initialized()
    assert "zero_optimization.stage   -> parallel.zero = 2" in err  # the mapping is printed
    assert "train_batch_size = 1024 but" in err and "= 4 x 8 x 8 = 256" in err
    assert not (tmp_path / "tiny").exists()  # nothing started, nothing written
