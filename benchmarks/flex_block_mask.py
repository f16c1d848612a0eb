"""FlexAttention's block mask: fivefold's build at block granularity (model/flex.py) beside torch's
`create_block_mask`, which evaluates the rule on every (query, key) pair, on a CPU.

Run: `.venv/bin/python benchmarks/flex_block_mask.py [--seq-len 4096] [--window 1000] [--rounds 3]`

One row of packed documents (ids from random ends, ~300 tokens apart) and a sliding window: the two
builds' median seconds over `--rounds`, their ratio (torch / fivefold), and whether they found the
same full and kept blocks. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask

from fivefold.model import flex
from fivefold.model.masks import AttentionMask, document_ids


def _seconds(build, rounds: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(rounds):
        began = time.perf_counter()
        out = build()
        times.append(time.perf_counter() - began)
    return statistics.median(times), out


def _blocks(m) -> tuple[list, list]:
    """The kept and full blocks of a BlockMask, as sorted index lists per query block."""
    def rows(num, idx):
        return [sorted(idx[0, 0, i, : int(num[0, 0, i])].tolist()) for i in range(num.shape[-1])]
    return rows(m.kv_num_blocks, m.kv_indices), rows(m.full_kv_num_blocks, m.full_kv_indices)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    T = args.seq_len
    tokens = torch.randint(0, 300, (1, T), generator=torch.Generator().manual_seed(0))
    doc = document_ids(tokens, 0)  # (1, T): a new document after each 0
    mask = AttentionMask(doc, args.window)
    ours_s, ours = _seconds(lambda: flex.block_mask(mask, T, torch.device("cpu")), args.rounds)
    torch_s, ref = _seconds(lambda: create_block_mask(flex._mask_mod(doc, args.window), 1, None, T, T,
                                                      device="cpu"), args.rounds)
    print(json.dumps({"seq_len": T, "window": args.window, "fivefold_s": round(ours_s, 5),
                      "create_block_mask_s": round(torch_s, 5), "ratio_torch_over_fivefold": round(torch_s / ours_s, 1),
                      "same_blocks": _blocks(ours) == _blocks(ref)}))


if __name__ == "__main__":
    main()
