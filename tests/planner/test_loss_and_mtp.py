"""The planner's price of the chunked loss (train.loss_chunk) and of MTP depths (model.mtp_layers):
parameters against the model built on the meta device, the logits term against model/head.py's
chunks, the FLOPs and the stage split of the last stage."""

import dataclasses

import pytest
from helpers import tiny_config

from fivefold.config.derive import derive
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.counts import block_params, count_on_meta, flops_per_token, model_counts
from fivefold.model.presets import PRESETS
from fivefold.parallel.pipeline.stage_split import part_costs, stage_split
from fivefold.planner.comm import loss_chunks
from fivefold.planner.estimate import estimate
from fivefold.planner.layout import rank_shares
from fivefold.planner.machine.datasheet import GB, get_hardware
from fivefold.planner.memory import head_tokens, loss_bytes, loss_chunk_tokens
from fivefold.validate import validate


@pytest.mark.parametrize("name,depths", [("tiny", 1), ("tiny", 2), ("tiny-moe", 1), ("deepseek-v3", 1)])
def test_mtp_parameters_match_the_meta_device_model(name, depths):
    """Each depth: a block numbered after the main ones (an MoE block past first_dense_layers),
    eh_proj (2d x d) and three norms: DeepSeek-V3's one depth is 14B parameters (its report: 671B
    main model + 14B MTP module, the embedding and head shared)."""
    m = dataclasses.replace(PRESETS[name], mtp_layers=depths)
    vocab = m.vocab_size or 320
    counts = model_counts(m, vocab)
    assert counts.total == count_on_meta(m, vocab)
    assert len(counts.mtp) == depths and counts.mtp[0] == block_params(m, m.n_layers)
    if name == "deepseek-v3":  # the report's 14B counts the depth's own copies of the embedding and head
        extra = counts.total - model_counts(PRESETS[name], vocab).total
        assert extra + 2 * counts.embedding == pytest.approx(14e9, rel=0.04)  # 11.6B + 2 x 0.93B = 13.5B


def test_mtp_flops_are_a_block_an_eh_proj_and_the_head_again_per_depth():
    m0 = PRESETS["tiny"]
    m1 = dataclasses.replace(m0, mtp_layers=1)
    f0, f1 = flops_per_token(m0, 32, 320), flops_per_token(m1, 32, 320)
    block = model_counts(m0, 320).blocks[-1]
    assert f1["matmul"] - f0["matmul"] == 6 * (block.active_matmul + 2 * m0.dim ** 2 + 320 * m0.dim)
    assert f1["attention"] - f0["attention"] == pytest.approx(f0["attention"] / m0.n_layers)  # one block more


@pytest.mark.parametrize("chunk,mtp,expected", [(0, 0, 64), (16, 0, 16), (1024, 0, 64), (0, 1, 128), (48, 1, 48)])
def test_the_logits_term_is_one_chunk_of_the_head_call(tmp_path, chunk, mtp, expected):
    """model/head.py holds the logits of `loss_chunk` tokens at a time, of the micro-batch's 2 x 32 tokens
    and each MTP depth's as many (one head call): 8 bytes per (c, V/tp) logit at the peak (fp32 logits
    and log-sum-exp's temporary), beside the saved hidden states and two fp32 numbers per token."""
    cfg = tiny_config(tmp_path, f"--train.loss_chunk={chunk}", f"--model.mtp_layers={mtp}", "--parallel.tp=2")
    assert head_tokens(cfg, 32) == 64 * (1 + mtp)
    assert loss_chunk_tokens(cfg, 32) == expected
    assert sum(c * n for c, n in loss_chunks(cfg, 32)) == 64 * (1 + mtp)
    vocab = 320
    tokens = 64 * (1 + mtp)
    assert loss_bytes(cfg, 32, vocab, 2) == 8 * expected * vocab / 2 + tokens * (cfg.model.dim * 2 + 8)


def _llama8b(tmp_path, *overrides):
    cfg = tiny_config(tmp_path, "--model.preset=llama3-8b", "--train.seq_len=8192", "--train.micro_batch=1",
                      "--train.global_batch=8", *overrides)
    assert validate(cfg, 8) == []
    return cfg


def test_chunking_the_loss_frees_the_logits_of_an_8k_sequence(tmp_path):
    """Llama 3 8B, 8k tokens a micro-batch, dp 8: the whole micro-batch's logits at the peak are
    8 x 8192 x 128,256 bytes = 8.4 GB; chunks of 1,024 tokens hold 1.05 GB. The step's peak drops by
    the difference and nothing else moves. The matmuls are the same, FLOP for FLOP; what the 7 more
    chunks cost is the head's weight gradient, its bf16 product widened as it is added into the fp32
    sum once per chunk (10 bytes per V x d element, at 90% of the H100's 3.35 TB/s): 12 ms of a 0.93 s
    step."""
    h100 = get_hardware("h100")
    whole, chunked = (estimate(_llama8b(tmp_path, f"--train.loss_chunk={c}"), 8, h100) for c in (0, 1024))
    logits = 8 * 128256 * (8192 - 1024)
    assert whole.memory["activations"] - chunked.memory["activations"] == pytest.approx(logits)
    assert whole.memory["total"] / GB == pytest.approx(chunked.memory["total"] / GB + logits / GB)
    sums = 7 * 128256 * 4096 * 10 / (0.9 * 3.35e12)
    assert chunked.step_time_s - whole.step_time_s == pytest.approx(sums, rel=0.01)


def test_the_loss_recompute_is_priced_in_backward_not_in_hfu(tmp_path):
    """The loss's backward runs the head's matmul again (model/head.py): the step is slower than the
    model FLOPs alone say, and HFU, like FlashAttention's recompute, does not count it."""
    cfg = _llama8b(tmp_path)
    est = estimate(cfg, 8, get_hardware("h100"))
    assert est.hfu == est.mfu  # train.recompute none: HFU counts activation recomputation only
    rows = dict((what, text) for what, text, _ in est.explain)
    assert "loss_chunk 1024: 8 chunk(s) of 1024 tokens x 128256 vocabulary columns" in rows["loss (logits)"]
    assert "backward makes each chunk's logits again" in rows["loss (logits)"]


def test_mtp_sits_on_the_last_stage_with_a_copy_of_the_embedding(tmp_path):
    """pp 2: the last rank holds the depth's block, eh_proj, its three norms and (untied) a copy of the
    embedding, which the first rank holds too (pipeline/stages.py split_stages); its blocks list the
    depth's block as n_layers (what the tp, cp and ep traffic count)."""
    base = tiny_config(tmp_path, "--parallel.pp=2")
    cfg = tiny_config(tmp_path, "--parallel.pp=2", "--model.mtp_layers=1")
    vocab = derive(cfg, 2, unpadded_vocab(cfg)).vocab_size
    counts = model_counts(cfg.model, vocab)
    before, after = rank_shares(base, model_counts(base.model, vocab)), rank_shares(cfg, counts)
    assert after[0] == before[0]
    assert after[1].blocks == [*before[1].blocks, cfg.model.n_layers]
    depth = counts.total - model_counts(base.model, vocab).total
    assert after[1].params - before[1].params == depth + counts.embedding
    assert after[1].vocab_params - before[1].vocab_params == counts.embedding


def test_the_stage_split_weighs_the_depths_on_the_last_stage(tmp_path):
    """Unchanged without MTP; with depths the last stage's costs grow by their blocks, eh_proj and the
    head again, so an uneven split moves blocks off it."""
    cfg = tiny_config(tmp_path, "--parallel.pp=3", "--model.n_layers=8")
    with_mtp = tiny_config(tmp_path, "--parallel.pp=3", "--model.n_layers=8", "--model.mtp_layers=2")
    vocab = 320
    costs, mtp_costs = part_costs(cfg, model_counts(cfg.model, vocab)), part_costs(with_mtp, model_counts(
        with_mtp.model, vocab))
    assert mtp_costs.flops == costs.flops and mtp_costs.first == costs.first
    assert mtp_costs.last[0] == 3 * costs.last[0] + 2 * costs.flops[-1] + 2 * 2 * 2 * with_mtp.model.dim ** 2
    split, mtp_split = stage_split(cfg, vocab), stage_split(with_mtp, vocab)
    assert sum(mtp_split) == 8 and mtp_split[-1] < split[-1]
