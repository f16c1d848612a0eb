"""Checkpoint save and load: fivefold's writer beside plain torch.distributed.checkpoint.

Run: `.venv/bin/python benchmarks/checkpoint.py [--rounds R] [--models tiny,debug]`

For each model (fp32, 2 forked gloo ranks, data parallel with `zero` 0 and 3):
- `fivefold`: `CheckpointWriter.save()` (DCP into a temporary folder, RNG files, state.json, the
  rename that makes it visible, pruning) and `load_checkpoint()` (shape check, restricted
  metadata reader, resharding load, moments and masters back in place);
- `fivefold_async`: the time `save()` blocks training (staging copy and planning), and the time
  until the write is published;
- `torch`: the same model under torch `DistributedDataParallel` (zero 0) or FSDP2 `fully_shard`
  (zero 3) with AdamW, saved with
  `dcp.save({"model", "optim"})` of `get_model_state_dict` / `get_optimizer_state_dict` and
  loaded with `dcp.load` + `set_*_state_dict`: the native way, with none of the above.
Times are the slowest rank's, median over rounds; bytes are what each rank wrote (its `.distcp`
files; rank 0 also writes the metadata). Absolute times on this shared machine are noise: read
the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import log  # noqa: E402
from fivefold.config.load import load_config  # noqa: E402
from fivefold.data.resolve import unpadded_vocab
from fivefold.parallel.forked_ranks import run_workers  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _slowest(seconds: float) -> float:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn) -> float:
    dist.barrier()
    began = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - began)


def _rank_bytes(folder: Path, rank: int) -> int:
    return sum(f.stat().st_size for f in folder.glob(f"__{rank}_*.distcp"))


def _worker(rank: int, world: int, cfg, root: Path, rounds: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.nn.parallel import DistributedDataParallel

    from fivefold.checkpoint.run_state import CheckpointWriter, latest_checkpoint, load_checkpoint
    from fivefold.config.derive import derive
    from fivefold.parallel.mesh import Mesh
    from fivefold.parallel.parallelize import parallelize
    from fivefold.train.loop import build_model

    peer = build_model(cfg, 320)
    params = sum(p.numel() for p in peer.parameters())  # before any sharding
    derived = derive(cfg, world, unpadded_vocab(cfg))
    par = parallelize(build_model(cfg, 320), Mesh.from_config(cfg, derived), cfg, derived)
    if cfg.parallel.zero == 3:  # the native peer of ZeRO-3: FSDP2 on every block, then the root
        from torch.distributed.fsdp import fully_shard

        ddp = peer
        for block in ddp.layers.values():
            fully_shard(block)
        fully_shard(ddp)
    else:
        ddp = DistributedDataParallel(peer)
    opt = torch.optim.AdamW(ddp.parameters())
    for p in ddp.parameters():  # Adam's moments exist after a first step
        p.grad = torch.zeros_like(p)
    opt.step()
    times: dict[str, list[float]] = {
        k: [] for k in ("save", "load", "async_blocking", "async_total", "torch_save", "torch_load")}

    def one_round(i: int) -> None:
        run, theirs = root / f"ff{i}", root / f"torch{i}"
        writer = CheckpointWriter(run, keep=1)
        times["save"].append(_timed(lambda: writer.save(1, par, {"loader": {}})))
        times["load"].append(_timed(lambda: load_checkpoint(latest_checkpoint(run), par)))
        overlapped = CheckpointWriter(root / f"async{i}", keep=1, async_save=True)
        dist.barrier()
        began = time.perf_counter()
        overlapped.save(1, par, {"loader": {}})
        times["async_blocking"].append(_slowest(time.perf_counter() - began))
        overlapped.wait()
        dist.barrier()
        times["async_total"].append(_slowest(time.perf_counter() - began))
        state = lambda: {"model": get_model_state_dict(ddp), "optim": get_optimizer_state_dict(ddp, opt)}  # noqa: E731
        times["torch_save"].append(_timed(lambda: dcp.save(state(), checkpoint_id=str(theirs))))

        def torch_load():
            target = state()
            dcp.load(target, checkpoint_id=str(theirs))
            set_model_state_dict(ddp, target["model"])
            set_optimizer_state_dict(ddp, opt, target["optim"])

        times["torch_load"].append(_timed(torch_load))

    for i in range(rounds):
        one_round(i)
    written = latest_checkpoint(root / "ff0")
    return {"times": {k: statistics.median(v) for k, v in times.items()},
            "bytes": _rank_bytes(written, rank), "torch_bytes": _rank_bytes(root / "torch0", rank),
            "params": params}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models", default="tiny,debug")
    args = ap.parse_args(argv)
    for preset in args.models.split(","):
        for zero in (0, 3):
            cfg = load_config(ROOT / "configs" / "tiny.toml", [f"--model.preset={preset}", f"--parallel.zero={zero}"])
            root = Path(tempfile.mkdtemp(prefix="ff-ckpt-"))
            try:
                out = run_workers(_worker, 2, cfg, root, args.rounds, timeout=900)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            t = out[0]["times"]
            record = {"model": preset, "params": out[0]["params"], "zero": zero, "ranks": 2,
                      "seconds": {k: round(v, 4) for k, v in t.items()},
                      "bytes_per_rank": [r["bytes"] for r in out],
                      "torch_bytes_per_rank": [r["torch_bytes"] for r in out],
                      "save_ratio_fivefold_over_torch": round(t["save"] / t["torch_save"], 2),
                      "load_ratio_fivefold_over_torch": round(t["load"] / t["torch_load"], 2),
                      "async_blocking_over_blocking_save": round(t["async_blocking"] / t["save"], 2)}
            print(json.dumps(record), flush=True)
            log(f"{preset} zero={zero}: save {t['save'] * 1e3:.1f} ms (torch {t['torch_save'] * 1e3:.1f}), "
                f"load {t['load'] * 1e3:.1f} ms (torch {t['torch_load'] * 1e3:.1f}), async blocks "
                f"{t['async_blocking'] * 1e3:.1f} ms of {t['async_total'] * 1e3:.1f}")


if __name__ == "__main__":
    main()
