"""Loss-masked fine-tuning (prompt/completion records, data/records.py) under every dimension, against one process.

Only completion tokens are trained: their targets alone count in the loss and in the step's global
token count, the denominator, so each layout must reproduce one process's run. The records are
short (documents kept apart by data.document_mask), so every row of 32 holds several prompts and
completions and every rank's slice holds some of each; the step's token count is the trained ones.
"""

import json

import pytest
from helpers import (
    BF16,
    DOCUMENTS_ON,
    Layout,
    assert_layout_reproduces,
    assert_reproduces,
    document_args,
    one_process_bf16,
    tiny_config,
    train_and_gather,
)

from fivefold.checkpoint.run_dir import run_dir_of
from fivefold.parallel.forked_ranks import run_workers
from fivefold.train.metrics import read_metrics

# Bounds as in test_masks_layouts.py (dp, pp: 1e-4; tp: 3e-4; cp: 5e-4), with their reasons there.
LAYOUTS = {
    "dp2": Layout(2, ("--train.micro_batch=2",), "completion_reference"),
    "tp2-sp": Layout(2, ("--parallel.tp=2", "--parallel.sp=true"), "completion_reference", param_atol=3e-4),
    "pp2-1f1b": Layout(2, ("--parallel.pp=2", "--train.micro_batch=2"), "completion_reference"),
    "cp2-ring": Layout(2, ("--parallel.cp=2",), "completion_reference", param_atol=5e-4),
    # bf16 autocast (helpers.BF16): the split vocabulary's masked loss on bf16 logits
    "tp2-sp-bf16": Layout(2, ("--parallel.tp=2", "--parallel.sp=true", *BF16), "completion_reference"),
}


def completion_records(n: int = 120) -> list[dict]:
    """Prompts of 6..11 bytes and completions of 3..7: with the end-of-document byte under 20 tokens."""
    return [{"prompt": f"q{i:03d}: " + "xyz"[: i % 4], "completion": " " + "abcdef"[: 2 + i % 5]} for i in range(n)]


@pytest.fixture(scope="module")
def completions(tmp_path_factory):
    folder = tmp_path_factory.mktemp("completions")
    (folder / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in completion_records()))
    return folder / "pc.jsonl"


def completion_args(path, *extra: str) -> tuple[str, ...]:
    return document_args(path, *DOCUMENTS_ON, *extra)


@pytest.fixture(scope="module")
def completion_run(tmp_path_factory, completions):
    """One process, each global batch in one micro-batch: its (losses, norms, state) and step records."""
    cfg = tiny_config(tmp_path_factory.mktemp("completion-ref"), *completion_args(completions),
                      "--train.micro_batch=8")
    return run_workers(train_and_gather, 1, cfg)[0], read_metrics(run_dir_of(cfg) / cfg.run.metrics_file)


@pytest.fixture(scope="module")
def completion_reference(completion_run):
    return completion_run[0]


@pytest.fixture(scope="module")
def bf16_completion_reference(tmp_path_factory, completions):
    """One process under bf16 autocast, and in fp32 at its learning rate (helpers.BF16)."""
    return one_process_bf16(tmp_path_factory, "completion-ref", *completion_args(completions))


@pytest.mark.parametrize("name", LAYOUTS)
def test_loss_masked_layouts_reproduce_single_process(tmp_path, request, completions, completion_run, name):
    layout = LAYOUTS[name]
    cfg = tiny_config(tmp_path, *completion_args(completions, *layout.overrides))
    assert_layout_reproduces(request, cfg, layout)
    # The step's count (the denominator) is the trained targets: the completions and their ends, a
    # minority of each full batch of 8 x 32 targets, and the same as one process's.
    tokens = [r["tokens"] for r in read_metrics(run_dir_of(cfg) / cfg.run.metrics_file)]
    assert tokens == [r["tokens"] for r in completion_run[1]]
    assert all(0 < t < 8 * 32 // 2 for t in tokens)


def test_resume_with_the_mask_is_exact_and_reshards(tmp_path, completions, completion_run):
    """Three steps on one process, then the rest resumed under tp2 + sp: the loader's position comes back,
    so the samples (and so the trained counts) are the uninterrupted run's."""
    losses, norms = [], []
    for job, (world, layout, stop) in enumerate([(1, ("--train.micro_batch=8",), 3),
                                                 (2, ("--parallel.tp=2", "--parallel.sp=true"), 5)]):
        resume = ("--checkpoint.resume=true",) if job else ()
        cfg = tiny_config(tmp_path, *completion_args(completions, *layout, f"--train.stop_after={stop}", *resume))
        job_losses, job_norms, state = run_workers(train_and_gather, world, cfg)[0]
        losses += job_losses
        norms += job_norms
    reference, ref_records = completion_run
    assert losses[:3] == reference[0][:3]  # the same process, data and order: bit-identical
    records = read_metrics(run_dir_of(cfg) / cfg.run.metrics_file)
    assert [(r["samples"], r["tokens"]) for r in records] == [(r["samples"], r["tokens"]) for r in ref_records]
    assert_reproduces((losses, norms, state), reference, param_atol=3e-4)
