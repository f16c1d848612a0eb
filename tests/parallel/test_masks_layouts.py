"""Documents, sliding windows and sinks (helpers.MASKS_ON) under every dimension, against one process.

Training runs of every dimension against one process, with everything a query may be kept from
switched on at once: packed documents with per-document positions, a window of 6 tokens on every
other layer and a learned sink per head. Context parallel now takes them too (ring, zig-zag, and
Ulysses; at cp 4 too in test_context_parallel.py, attention with every mask and its skipped pairs), and
the sinks are split over tp with the heads. A resharding chain then carries
such a run across layouts through its checkpoints.
"""

import pytest
from helpers import (
    BF16,
    MASKS_ON,
    MOE_ARGS,
    Layout,
    assert_layout_reproduces,
    assert_reproduces,
    document_args,
    tiny_config,
)

from fivefold.checkpoint.run_dir import run_dir_of
from fivefold.checkpoint.run_state import complete_checkpoints
from fivefold.parallel.forked_ranks import run_workers
from fivefold.train.metrics import read_events, read_metrics

# Bounds as in test_document_mask.py (dp, pp: 1e-4; tp: 3e-4; ep: 2e-4) and test_context_parallel.py
# (cp: 5e-4: blocks merged by log-sum-exp), with their reasons. The routing bias exactly.
LAYOUTS = {
    "cp2-ring": Layout(2, ("--parallel.cp=2",), "masks_reference", param_atol=5e-4),
    "cp2-ulysses": Layout(2, ("--parallel.cp=2", "--parallel.cp_method=ulysses"), "masks_reference",
                          param_atol=5e-4),
    # Recomputation re-runs blocks (full) or the attention core (selective) with the same mask.
    "tp2-sp-recompute-selective": Layout(2, ("--parallel.tp=2", "--parallel.sp=true", "--train.recompute=selective"),
                                         "masks_reference", param_atol=3e-4),
    "pp2-1f1b-recompute-full": Layout(2, ("--parallel.pp=2", "--train.recompute=full", "--train.micro_batch=2"),
                                      "masks_reference"),
    "pp2-zb_v": Layout(2, ("--parallel.pp=2", "--parallel.pp_schedule=zb_v", "--parallel.virtual_stages=2",
                           "--train.micro_batch=2"), "masks_reference"),
    "dp2-zero3": Layout(2, ("--parallel.zero=3", "--train.micro_batch=2"), "masks_reference"),
    "ep2-moe": Layout(2, (*MOE_ARGS, "--parallel.ep=2", "--train.micro_batch=4"), "masks_moe_reference",
                      param_atol=2e-4, exact=("expert_bias",)),
    "pp2-cp2-tp2-sp": Layout(8, ("--parallel.pp=2", "--parallel.cp=2", "--parallel.tp=2", "--parallel.sp=true",
                                 "--train.micro_batch=4"), "masks_reference", param_atol=5e-4),
    "dp2-cp2-ep2-moe": Layout(8, (*MOE_ARGS, "--parallel.cp=2", "--parallel.ep=2", "--parallel.zero=3",
                                  "--train.micro_batch=2"), "masks_moe_reference", param_atol=5e-4,
                              exact=("expert_bias",)),
    # bf16 autocast (helpers.BF16): the masked tiles' bias in bf16, merged across the ring in fp32
    "cp2-ring-bf16": Layout(2, ("--parallel.cp=2", *BF16), "masks_reference"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_with_every_mask_reproduce_single_process(tmp_path, request, short_docs, name):
    layout = LAYOUTS[name]
    cfg = tiny_config(tmp_path, *document_args(short_docs, *MASKS_ON, *layout.overrides))
    assert_layout_reproduces(request, cfg, layout)
    # The run says which kernel attended; ring attention counts the chunk pairs the mask emptied.
    metrics = run_dir_of(cfg) / cfg.run.metrics_file
    ring = cfg.parallel.cp > 1 and cfg.parallel.cp_method == "ring"
    kernel = "ring/blockwise" if ring else "ulysses/blockwise" if cfg.parallel.cp > 1 else "blockwise"
    assert next(e for e in read_events(metrics) if e["event"] == "layout")["attention"] == {"masked": kernel}
    blocks = [r.get("attention_blocks") for r in read_metrics(metrics)]
    if ring:  # zig-zag alone skips 2cp - 1 of rank 0's 4cp pairs per layer and micro-batch; the masks more
        p = cfg.parallel
        micro_batches = 8 // (layout.ranks // (p.cp * p.tp * p.pp)) // cfg.train.micro_batch  # 8 rows over dp
        pairs = 4 * p.cp * cfg.model.n_layers // p.pp * micro_batches
        assert all(b["computed"] + b["skipped"] == pairs for b in blocks[:4])  # 4 full steps of 8 rows
        assert all(b["skipped"] > pairs * (2 * p.cp - 1) // (4 * p.cp) for b in blocks)
    else:
        assert blocks == [None] * len(blocks)


def test_the_masks_change_the_run(masks_reference, documents_reference):
    """Windows and sinks reach the model through the loop: the losses differ from documents alone."""
    assert max(abs(a - b) for a, b in zip(masks_reference[0], documents_reference[0], strict=True)) > 1e-3


def _train(rank, world, cfg):
    from fivefold.train.loop import train

    r = train(cfg, progress=False, return_state=True)
    return r.losses, r.grad_norms, r.state


# The second job resumes the first's checkpoint under another layout: the sinks go from split over tp
# (with the heads) to whole, in ZeRO-3 shards, under cp.
CHAIN = [(2, ("--parallel.tp=2", "--parallel.sp=true"), 3), (4, ("--parallel.cp=2", "--parallel.zero=3"), 5)]


def test_checkpoints_of_masked_runs_reshard(tmp_path, short_docs, masks_reference):
    losses, norms = [], []
    for job, (world, layout, stop) in enumerate(CHAIN):
        resume = ("--checkpoint.resume=true",) if job else ()
        cfg = tiny_config(tmp_path, *document_args(short_docs, *MASKS_ON, "--train.micro_batch=2", *layout,
                                                   f"--train.stop_after={stop}", *resume))
        job_losses, job_norms, state = run_workers(_train, world, cfg)[0]
        assert [p.name for p in complete_checkpoints(tmp_path / "tiny")] == [f"step_{stop:08d}"]
        losses += job_losses
        norms += job_norms
    assert_reproduces((losses, norms, state), masks_reference, param_atol=5e-4)
