"""Peak memory of writing a seed checkpoint (`fivefold init`): the largest tensor, not the model.

    .venv/bin/python benchmarks/seed_memory.py                     # tiny, debug, llama3-8b dims with 2 layers
    .venv/bin/python benchmarks/seed_memory.py --quick             # tiny and debug only

Each case runs in a fresh process (so one case's peak cannot hide another's): it imports
everything, notes its peak RSS (getrusage's ru_maxrss, KiB on Linux), writes the seed into a
temporary directory, and reports the growth of the peak beside the bytes of the largest
tensor and of the whole model. Writing holds one tensor at a time, so the growth should be about
the largest tensor (the embedding or head matrix for Llama shapes), far below the model's bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASES = {
    "tiny": ["configs/tiny.toml"],
    "debug": ["configs/debug.toml"],
    "llama3-8b-2layers": ["configs/tiny.toml", "--model.preset=llama3-8b", "--model.n_layers=2"],
}

CHILD = r"""
import json, resource, sys, tempfile
from pathlib import Path
import torch
from fivefold.config.load import load_config
from fivefold.data.resolve import resolved_model
from fivefold.model.transformer import Transformer
from fivefold.checkpoint.seed import write_seed_checkpoint

cfg = load_config(sys.argv[1], sys.argv[2:])
with torch.device("meta"):
    model = Transformer(resolved_model(cfg))
sizes = [p.numel() * 4 for p in model.parameters()]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
with tempfile.TemporaryDirectory() as out:
    path = write_seed_checkpoint(cfg, Path(out))
    written = path.stat().st_size
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"model_bytes": sum(sizes), "largest_tensor_bytes": max(sizes), "file_bytes": written,
                  "peak_rss_before": before, "peak_rss_after": after, "peak_rss_growth": after - before}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny and debug only")
    args = parser.parse_args()
    for name, argv in CASES.items():
        if args.quick and name.startswith("llama"):
            continue
        out = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, check=True)
        result = {"case": name, **json.loads(out.stdout.strip().splitlines()[-1])}
        result["growth_over_largest"] = round(result["peak_rss_growth"] / result["largest_tensor_bytes"], 3)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
