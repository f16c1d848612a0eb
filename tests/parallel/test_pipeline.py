"""Pipeline parallel reproduces the single-process run, for every schedule.

Same data as test_data_parallel.py: the 5th step is an epoch's uneven last batch, so some
micro-batches are pure padding, which the pipeline must carry without changing the result.

Every pipeline message here carries tag 0: gloo then matches the messages between two ranks by
the order they are posted, as NCCL does (it ignores tags), so these runs check that each rank
sends in the order its neighbour receives (fivefold/parallel/pipeline/messages.py), not only that tags match.
"""

import pytest
import torch
from helpers import (
    BF16,
    EQUIVALENCE,
    LORA,
    LORA_ROW,
    MUON,
    MUON_ROW,
    TIED_ARGS,
    Layout,
    assert_reproduces,
    assert_row,
    tiny_config,
    train_and_gather,
)

from fivefold.checkpoint.run_dir import run_dir_of
from fivefold.config.derive import derive
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.counts import model_counts
from fivefold.parallel.forked_ranks import run_workers
from fivefold.parallel.pipeline.executor import PipelineExecutor
from fivefold.planner.layout import stage_sizes
from fivefold.train.loop import train
from fivefold.train.metrics import read_events, read_metrics


@pytest.fixture(autouse=True)
def tags_as_nccl(monkeypatch):
    """Tag 0 on every pipeline message (the workers are forked after this, so they inherit it)."""
    monkeypatch.setattr(PipelineExecutor, "_tag", lambda self, message: 0)

LAYOUTS = {  # against `reference`, on EQUIVALENCE
    "gpipe-pp2": Layout(2, ("--parallel.pp=2", "--parallel.pp_schedule=gpipe", "--train.micro_batch=2")),
    "1f1b-pp2": Layout(2, ("--parallel.pp=2", "--train.micro_batch=2")),
    "1f1b-pp4": Layout(4, ("--parallel.pp=4", "--train.micro_batch=1")),
    "interleaved-pp2-v2": Layout(2, ("--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b",
                                     "--parallel.virtual_stages=2", "--train.micro_batch=2")),
    "interleaved-pp4-v2": Layout(4, ("--parallel.pp=4", "--parallel.pp_schedule=interleaved_1f1b",
                                     "--parallel.virtual_stages=2", "--train.micro_batch=1")),
    "zb_h1-pp2": Layout(2, ("--parallel.pp=2", "--parallel.pp_schedule=zb_h1", "--train.micro_batch=2")),
    "zb_h1-pp4": Layout(4, ("--parallel.pp=4", "--parallel.pp_schedule=zb_h1", "--train.micro_batch=1")),
    "dualpipe_v-pp2": Layout(2, ("--parallel.pp=2", "--parallel.pp_schedule=dualpipe_v",
                                 "--parallel.virtual_stages=2", "--train.micro_batch=2")),
    "zb_v-pp2": Layout(2, ("--parallel.pp=2", "--parallel.pp_schedule=zb_v", "--parallel.virtual_stages=2",
                           "--train.micro_batch=2")),
    "dualpipe_v-pp4": Layout(4, ("--parallel.pp=4", "--parallel.pp_schedule=dualpipe_v",
                                 "--parallel.virtual_stages=2", "--train.micro_batch=1")),
    "zb_v-pp4": Layout(4, ("--parallel.pp=4", "--parallel.pp_schedule=zb_v", "--parallel.virtual_stages=2",
                           "--train.micro_batch=1")),
    "1f1b-pp2-dp2": Layout(4, ("--parallel.pp=2", "--train.micro_batch=2")),
    "1f1b-pp2-dp2-zero1": Layout(4, ("--parallel.pp=2", "--parallel.zero=1", "--train.micro_batch=1")),
    # Muon (helpers.MUON): each stage orthogonalises its own matrices, their owners over its ZeRO shards
    "zb_h1-pp2-dp2-zero3-muon": Layout(4, ("--parallel.pp=2", "--parallel.pp_schedule=zb_h1", "--parallel.zero=3",
                                           "--train.micro_batch=1", *MUON), **MUON_ROW),
    "1f1b-pp2-layers-5-3": Layout(2, ("--parallel.pp=2", "--parallel.stage_layers=[5, 3]", "--train.micro_batch=2")),
    # ZeRO-2 reduce-scatters each chunk's gradients on every backward (B or W) of that chunk.
    "1f1b-pp2-dp2-zero2": Layout(4, ("--parallel.pp=2", "--parallel.zero=2", "--train.micro_batch=1")),
    "interleaved-pp2-v2-dp2-zero2": Layout(4, ("--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b",
                                               "--parallel.virtual_stages=2", "--parallel.zero=2",
                                               "--train.micro_batch=1")),
    # ZeRO-3 with pipelines keeps a chunk gathered through the step and reduce-scatters at its last
    # backward (the default); resharding gathers around every F, B, I and W instead.
    "zb_h1-pp2-dp2-zero3": Layout(4, ("--parallel.pp=2", "--parallel.pp_schedule=zb_h1", "--parallel.zero=3",
                                      "--train.micro_batch=1")),
    "interleaved-pp2-v2-dp2-zero3": Layout(4, ("--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b",
                                               "--parallel.virtual_stages=2", "--parallel.zero=3",
                                               "--train.micro_batch=1")),
    # The source texts' 3D recipe scaled down (TP x PP x DP with ZeRO-2), and ZeRO-3 beside TP and PP.
    "3d-tp2-sp-pp2-dp2-zero2": Layout(8, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.pp=2",
                                          "--parallel.zero=2", "--train.micro_batch=1")),
    "tp2-pp2-dp2-zero3-zb_h1": Layout(8, ("--parallel.tp=2", "--parallel.pp=2", "--parallel.zero=3",
                                          "--parallel.pp_schedule=zb_h1", "--train.micro_batch=1")),
    # Replicated ZeRO shards (dp_shard 1, dp_replicate 2) under a zero-bubble V schedule: each
    # chunk's replicas sum at its last W, once a step, the 4 micro-batches' rows joined.
    "zb_v-pp2-replicas2-zero2": Layout(4, ("--parallel.pp=2", "--parallel.pp_schedule=zb_v",
                                           "--parallel.virtual_stages=2", "--parallel.zero=2",
                                           "--parallel.dp_replicate=2", "--train.micro_batch=1")),
    "dualpipe_v-pp2-dp2-zero3-reshard": Layout(4, ("--parallel.pp=2", "--parallel.pp_schedule=dualpipe_v",
                                                   "--parallel.virtual_stages=2", "--parallel.zero=3",
                                                   "--parallel.reshard_after_forward=true", "--train.micro_batch=1")),
    # 8 layers in 6 stages, no stage_layers: the split balanced by cost (test_stage_split.py has the arithmetic)
    "interleaved-pp2-v3-uneven": Layout(2, ("--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b",
                                            "--parallel.virtual_stages=3", "--train.micro_batch=2")),
    # bf16 autocast (helpers.BF16): bf16 activations and gradients between stages, a V schedule's split backward
    "dualpipe_v-pp2-bf16": Layout(2, ("--parallel.pp=2", "--parallel.pp_schedule=dualpipe_v",
                                      "--parallel.virtual_stages=2", "--train.micro_batch=2", *BF16)),
    # LoRA (helpers.LORA) with tied embeddings, under ZeRO-3 kept gathered (pipelines' default): each unit's
    # weights, the frozen ones too, from its first forward to its chunk's last backward; the split backward's
    # W passes only the adapters'; the frozen tied matrix's two copies have no gradient to sum
    "tied-zb_h1-pp2-dp2-zero3-lora": Layout(4, (*TIED_ARGS[len(EQUIVALENCE):], "--parallel.pp=2",
                                                "--parallel.pp_schedule=zb_h1", "--parallel.zero=3",
                                                "--train.micro_batch=2", *LORA),
                                            **{**LORA_ROW, "reference": "lora_tied_reference"}),
}
UNEVEN = {"interleaved-pp2-v3-uneven": [1, 2, 2, 1, 1, 1]}  # layout: the automatic split
TIED = {  # against `tied_reference`, on TIED_ARGS
    "tied-1f1b-pp2": Layout(2, ("--parallel.pp=2", "--train.micro_batch=2"), "tied_reference"),
    "tied-1f1b-pp2-dp2-zero1": Layout(4, ("--parallel.pp=2", "--parallel.zero=1", "--train.micro_batch=2"),
                                      "tied_reference"),
    "tied-dualpipe_v-pp2": Layout(2, ("--parallel.pp=2", "--parallel.pp_schedule=dualpipe_v",
                                      "--parallel.virtual_stages=2", "--train.micro_batch=2"), "tied_reference"),
    # One FSDP unit holds the shared matrix (embedding and head); on the V layout it spans two chunks.
    "tied-zero3-dp2": Layout(2, ("--parallel.zero=3", "--train.micro_batch=2"), "tied_reference"),
    "tied-dualpipe_v-pp2-dp2-zero3": Layout(4, ("--parallel.pp=2", "--parallel.pp_schedule=dualpipe_v",
                                                "--parallel.virtual_stages=2", "--parallel.zero=3",
                                                "--train.micro_batch=1"), "tied_reference"),
}


def train_gather_and_split(rank: int, world: int, cfg):
    """Worker: train_and_gather, and the blocks of each stage this rank's runtime kept."""
    import fivefold.parallel.pipeline.stages as stages

    kept, split_stages = {}, stages.split_stages

    def recording(*args, **kwargs):  # in this forked worker only
        chunks = split_stages(*args, **kwargs)
        kept.update({s: len(c.layers) for s, c in chunks.items()})
        return chunks

    stages.split_stages = recording
    return (*train_and_gather(rank, world, cfg), kept)


@pytest.mark.parametrize("name", LAYOUTS)
def test_pipeline_reproduces_single_process(tmp_path, request, name):
    layout = LAYOUTS[name]
    cfg = tiny_config(tmp_path, *EQUIVALENCE, *layout.overrides)
    results = run_workers(train_gather_and_split, layout.ranks, cfg)
    # Same tolerances and reasons as test_data_parallel.py: fp32 summation order, amplified by AdamW.
    for *result, _ in results:  # every rank reports the same loss and gathered model
        assert_row(request, result, layout)
    # The runtime's stages are the planner's, and for an uneven model the ones chosen by hand
    runtime = {s: n for *_, kept in results for s, n in kept.items()}
    planned = stage_sizes(cfg, model_counts(cfg.model, derive(cfg, layout.ranks, unpadded_vocab(cfg)).vocab_size))
    assert [runtime[s] for s in sorted(runtime)] == planned
    if name in UNEVEN:
        assert planned == UNEVEN[name]
        layout_event = next(e for e in read_events(run_dir_of(cfg) / cfg.run.metrics_file) if e["event"] == "layout")
        assert layout_event["stage_layers"] == UNEVEN[name]  # saved with the run


@pytest.mark.parametrize("name", ["1f1b-pp2", "zb_v-pp2"])
def test_pipeline_with_polled_sends_reproduces_single_process(tmp_path, reference, monkeypatch, name):
    """The executor's send path as on CUDA (polled, parallel/pipeline/p2p.py) trains the same."""
    from fivefold.parallel.pipeline import executor, p2p

    monkeypatch.setattr(executor, "sends_for", lambda device: p2p.Sends(poll=True))
    layout = LAYOUTS[name]
    for result in run_workers(train_and_gather, layout.ranks, tiny_config(tmp_path, *EQUIVALENCE, *layout.overrides)):
        assert_reproduces(result, reference, param_atol=layout.param_atol)


@pytest.mark.parametrize("name", TIED)
def test_tied_embeddings_stay_in_sync_across_stages(tmp_path, tied_reference, name):
    ref_losses, _, ref_state = tied_reference
    layout = TIED[name]
    results = run_workers(train_and_gather, layout.ranks, tiny_config(tmp_path, *TIED_ARGS, *layout.overrides))
    for losses, _, state in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        # The first stage's copy (tok_embeddings) and the last stage's (output) are one matrix again.
        torch.testing.assert_close(state["tok_embeddings.weight"], ref_state["tok_embeddings.weight"],
                                   rtol=0, atol=layout.param_atol)
        assert torch.equal(state["tok_embeddings.weight"], state["output.weight"])


def _train(rank, world, cfg):
    return train(cfg, progress=False).losses


@pytest.mark.parametrize("schedule", ["zb_h1"])  # pp2 -> pp1 (1F1B) is in test_reshard.py
def test_pipeline_resume_is_exact(tmp_path, schedule):
    import shutil

    from fivefold.checkpoint.run_state import complete_checkpoints

    args = (*EQUIVALENCE, "--train.steps=4", "--checkpoint.every=2", "--parallel.pp=2",
            f"--parallel.pp_schedule={schedule}", "--train.micro_batch=2", "--train.eval_every=2",
            "--data.val_fraction=0.3", "--data.max_bytes=20000", "--checkpoint.keep=2")
    losses = run_workers(_train, 2, tiny_config(tmp_path, *args))[0]
    shutil.rmtree(complete_checkpoints(tmp_path / "tiny")[-1])  # each stage wrote only its own layers
    resumed = run_workers(_train, 2, tiny_config(tmp_path, *args, "--checkpoint.resume=true"))[0]
    assert resumed == losses[2:]


def test_activations_travel_in_the_compute_dtype(tmp_path):
    """Under bf16 autocast the activations and gradients between stages travel in bf16: half the
    pipeline bytes of fp32, as the planner prices them (act_bytes); the loss stays close."""
    from fivefold.planner.selfcheck import predict_for_config

    runs = {}
    for dtype in ("fp32", "bf16"):
        args = ("--train.steps=2", "--data.max_bytes=20000", "--data.val_fraction=0.0", "--parallel.pp=2",
                "--train.micro_batch=2", f"--train.dtype={dtype}")
        cfg = tiny_config(tmp_path / dtype, *args)
        losses = run_workers(_train, 2, cfg)[0]
        records = read_metrics(tmp_path / dtype / "tiny" / "metrics.jsonl")
        runs[dtype] = losses, [r["comm"]["pp"]["bytes"] for r in records], predict_for_config(cfg, 2)
    (fp32_losses, fp32_bytes, fp32_plan), (bf16_losses, bf16_bytes, bf16_plan) = runs["fp32"], runs["bf16"]
    # Per step, each rank sends one (2, 32, 64) message per micro-batch (4 of them), and adds the
    # 8 bytes of the gradient norm's fp64 sum of squares (all-reduced over the stages).
    messages = 4 * 2 * 32 * 64 * 4
    assert fp32_bytes == [messages + 8] * 2
    assert bf16_bytes == [messages // 2 + 8] * 2
    assert fp32_plan["comm_wire_bytes"]["pp"] == messages  # the planner prices the messages
    assert bf16_plan["comm_wire_bytes"]["pp"] == messages // 2
    # bf16 rounding of the matmuls and of the one boundary: a few parts in a thousand.
    torch.testing.assert_close(torch.tensor(bf16_losses), torch.tensor(fp32_losses), rtol=2e-2, atol=0)
