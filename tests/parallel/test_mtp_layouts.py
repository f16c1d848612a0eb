"""Multi-token prediction (model.mtp_layers, DeepSeek-V3 sec. 2.2) under every dimension, against one
process: DeepSeek-V3's architecture in miniature (latent attention, group-limited routing, a shared
expert, the bias update and balance loss) with one MTP depth, whose block is an MoE block too, on
packed documents under the document mask (the depth's targets shift within a document)."""

import pytest
from helpers import (
    BF16,
    EQUIVALENCE,
    MLA_ARGS,
    Layout,
    assert_layout_reproduces,
    assert_reproduces,
    one_process,
    one_process_bf16,
    tiny_config,
    train_and_gather,
)

from fivefold.parallel.forked_ranks import run_workers
from fivefold.train.metrics import read_metrics

MTP_ARGS = (*EQUIVALENCE, *MLA_ARGS, "--model.mtp_layers=1", "--data.document_mask=true", "--train.steps=3")
# Measured on the dense tiny model with one depth and documents, 5 steps (losses / grad norms relative /
# parameters): tp2-sp 1.6e-6 / 4.1e-6 / 5.8e-6, cp2 5.9e-6 / 1.5e-5 / 2.2e-5, pp2 and ZeRO-3 under 1e-6;
# pp2 under zb_h1 and dualpipe_v 8.2e-6 and 7.8e-6 in the parameters. The bounds are the MoE tables'
# (test_expert_parallel.py): routing turns rounding into larger steps.
ROW = dict(reference="mtp_reference", param_atol=2e-4, exact=("expert_bias",))
LAYOUTS = {
    "dp2": Layout(2, (), **ROW),
    "dp2-zero3": Layout(2, ("--parallel.zero=3",), **ROW),
    # without sp every tp rank projects the whole sequence alike; with sp the depth's eh_proj and
    # norms see each rank's own tokens and their gradients are summed over tp
    "tp2": Layout(2, ("--parallel.tp=2",), **ROW),
    "tp2-sp": Layout(2, ("--parallel.tp=2", "--parallel.sp=true"), **ROW),
    # the depth on the last stage with a copy of the embedding, summed with the first stage's
    "pp2": Layout(2, ("--parallel.pp=2",), **ROW),
    # the shifted targets are cut from whole rows: a token keeps its k-ahead target across the shards
    "cp2": Layout(2, ("--parallel.cp=2",), **ROW),
    "pp2-ep2": Layout(4, ("--parallel.pp=2", "--parallel.ep=2", "--train.micro_batch=2"), **ROW),
    # the last stage's units: its embedding copy alone, the depth with the final norm and the head
    "pp2-dp2-zero3": Layout(4, ("--parallel.pp=2", "--parallel.zero=3", "--train.micro_batch=2"), **ROW),
    "tp2-sp-bf16": Layout(2, ("--parallel.tp=2", "--parallel.sp=true", *BF16), **ROW),
}


@pytest.fixture(scope="module")
def mtp_run(tmp_path_factory):
    """The one-process reference and its logged MTP losses."""
    out = tmp_path_factory.mktemp("mtp")
    return one_process(out, *MTP_ARGS), [r["mtp_loss"] for r in read_metrics(out / "tiny" / "metrics.jsonl")]


@pytest.fixture(scope="module")
def mtp_reference(mtp_run):
    return mtp_run[0]


@pytest.fixture(scope="module")
def bf16_mtp_reference(tmp_path_factory):
    return one_process_bf16(tmp_path_factory, "mtp", *MTP_ARGS)


def test_the_depth_trains_and_reports_its_loss(mtp_run, tmp_path):
    """The depth is there, its weights move, its loss is logged beside the main loss, and it changes
    the main model's training: a layout that dropped it could not match the rows below."""
    (losses, norms, state), mtp_losses = mtp_run
    depth = {k: v for k, v in state.items() if k.startswith("mtp.0.")}
    assert {"mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.eh_proj.weight", "mtp.0.norm.weight",
            "mtp.0.block.ffn.experts.gate"} <= set(depth)
    cfg = tiny_config(tmp_path, *MTP_ARGS, "--model.mtp_layers=0", "--train.micro_batch=8")
    plain_losses, plain_norms, plain = run_workers(train_and_gather, 1, cfg)[0]
    assert depth["mtp.0.eh_proj.weight"].abs().max() > 0 and len(mtp_losses) == 3
    assert all(4 < m < 6 for m in mtp_losses[:1])  # about ln(V) at the start, as the main loss
    assert plain_losses[0] == losses[0] and plain_norms[0] != norms[0]  # the same forward; its gradient adds
    assert not any(k.startswith("mtp.") for k in plain)


@pytest.mark.parametrize("name", LAYOUTS)
def test_mtp_reproduces_single_process(tmp_path, request, name):
    layout = LAYOUTS[name]
    assert_layout_reproduces(request, tiny_config(tmp_path, *MTP_ARGS, *layout.overrides), layout)


def test_mtp_resumes_under_another_layout(tmp_path, mtp_reference):
    """Each step a job of its own, resumed under another layout from the last one's checkpoint: pp2
    (the last stage saves its copy of the embedding beside the first stage's) -> ZeRO-3 dp2 -> tp2
    with sp; together the uninterrupted one-process run."""
    from fivefold.checkpoint.run_state import complete_checkpoints

    losses, norms = [], []
    for step, layout in enumerate([("--parallel.pp=2",), ("--parallel.zero=3",),
                                   ("--parallel.tp=2", "--parallel.sp=true")], start=1):
        resume = ("--checkpoint.resume=true",) if step > 1 else ()
        cfg = tiny_config(tmp_path, *MTP_ARGS, "--train.micro_batch=2", f"--train.stop_after={step}", *layout, *resume)
        job_losses, job_norms, state = run_workers(train_and_gather, 2, cfg)[0]
        assert [p.name for p in complete_checkpoints(tmp_path / "tiny")] == [f"step_{step:08d}"]
        losses += job_losses
        norms += job_norms
    assert_reproduces((losses, norms, state), mtp_reference, param_atol=3e-4)  # test_reshard.py's bound
