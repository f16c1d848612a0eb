"""The overlap switches of a layout (planner/overlap.py): each against hand arithmetic from the
paper it comes from, each default against what fivefold's runtime does, and each changing only the
terms it governs."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import tiny_config

from fivefold.config.derive import derive
from fivefold.config.load import load_config
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.counts import block_forward_flops, model_counts
from fivefold.parallel.comm import collectives
from fivefold.parallel.forked_ranks import run_workers
from fivefold.planner.compute import busiest_chunk
from fivefold.planner.estimate import estimate
from fivefold.planner.hardware import get_hardware
from fivefold.planner.layout import rank_shares, split_layout
from fivefold.planner.machine.pricing import Memo
from fivefold.planner.options import DEFAULT, PlanOptions
from fivefold.planner.overlap import SWITCHES, decomposed_exposure, prefetch_pass
from fivefold.train.loop import train
from fivefold.validate import validate

H100 = get_hardware("h100")
# Compute-rich: matmuls slow against fast, latency-free links, so every overlap hides all it can.
SLOW_COMPUTE = dataclasses.replace(H100, peak_flops=1e12, intra_latency=0.0, inter_latency=0.0)


def _llama(world: int, *overrides: str):
    cfg = load_config(None, ["--model.preset=llama3-8b", "--train.seq_len=4096", "--train.micro_batch=1",
                             "--train.recompute=\"none\"", *overrides])
    assert validate(cfg, world) == []
    return cfg


def _chunk(cfg, world, hw):
    """The busiest rank's work and its price, as the estimate asks the pricer for them."""
    d = derive(cfg, world, unpadded_vocab(cfg))
    counts = model_counts(cfg.model, d.vocab_size)
    work = busiest_chunk(cfg, d, counts, rank_shares(cfg, counts), weight_bytes=2)  # as estimate: bf16 weights
    return d, work, hw.pricer.chunk(work, hw, Memo())


def _ring(op: str, nbytes: float, n: int, hw) -> float:
    """Alpha-beta time of one ring collective inside a node (Thakur et al. 2005 step counts)."""
    steps, wire = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n), "all_gather": (n - 1, (n - 1) / n),
                   "reduce_scatter": (n - 1, (n - 1) / n)}[op]
    return steps * hw.intra_latency + wire * nbytes / (hw.intra_bw * hw.bw_efficiency)


# ---- tp_overlap: Wang et al. 2022, "Overlap Communication with Dependent Computation via Decomposition" ----

def test_decomposed_collective_leaves_one_piece_or_what_the_matmul_cannot_cover():
    # Pipelined decomposition into n = 4 pieces (Wang et al. 2022, sec. 3): matmul pieces of 2, comm
    # pieces of 2.5. mm1 [0,2]; c1 [2,4.5] under mm2 [2,4]; c2 [4.5,7] under mm3 [4,6]; c3 [7,9.5]
    # under mm4 [6,8]; c4 [9.5,12]. 12 - 8 of matmul = 4 exposed = 10 - 3/4 x 8.
    assert decomposed_exposure(10.0, 8.0, 4) == pytest.approx(4.0)
    # Comm pieces of 1 under matmul pieces of 2: only the last piece, c4, is not under a matmul.
    assert decomposed_exposure(4.0, 8.0, 4) == pytest.approx(1.0)
    assert decomposed_exposure(4.0, 8.0, 1) == pytest.approx(4.0)  # one piece: nothing to overlap with
    assert decomposed_exposure(0.0, 8.0, 4) == 0.0


def test_tp_overlap_against_hand_arithmetic():
    # llama3-8b, tp=2 with sp, 2 micro-batches; links slow enough that the attention regions are
    # comm-bound (comm - matmul/2 exposed) and the MLP's backward hides all but one piece (comm/2).
    hw = dataclasses.replace(H100, intra_bw=20e9)
    cfg = _llama(2, "--parallel.tp=2", "--parallel.sp=true", "--train.global_batch=2")
    d, work, chunk = _chunk(cfg, 2, hw)
    est = estimate(cfg, 2, hw, options=PlanOptions(tp_overlap=True))
    n, M, tokens, L = 2, 2, 4096, 32
    dim, heads, kv, hd, ffn, vocab = 4096, 32, 8, 128, 14336, 128256
    act = tokens * dim * 2  # one (b, s, d) bf16 activation
    c1 = _ring("all_reduce", act, n, hw)  # one region's collective (sp's all-gather + reduce-scatter: the same)
    # the vocabulary-parallel loss: per chunk of 1,024 tokens (train.loss_chunk) one all-gather of (tp, 2, c) fp32
    loss = 4 * _ring("all_gather", n * 2 * 1024 * 4, n, hw)
    per_flop_f, per_flop_b = chunk.forward_s / work.forward_flops, chunk.backward_s / work.forward_flops
    attention = 2 * (dim * heads * hd + 2 * dim * kv * hd + heads * hd * dim) / n * tokens  # wq, wk, wv, wo
    mlp = 2 * 3 * dim * ffn / n * tokens  # gate, up, down
    head = 2 * vocab * dim / n * tokens

    def e(comm, matmul):  # one region's collective over tp pieces (Wang et al. 2022)
        return max(comm / n, comm - (n - 1) / n * matmul)

    blocks = L * (e(c1, attention * per_flop_f) + e(c1, attention * per_flop_b)
                  + e(c1, mlp * per_flop_f) + e(c1, mlp * per_flop_b))
    expected = M * (blocks + e(c1, head * per_flop_b) + c1 + loss)  # the embedding and the loss: exposed
    tp = est.overlaps["tp_overlap"]
    assert tp.traffic_s == pytest.approx(est.comm["tp"].time_s)
    assert tp.traffic_s == pytest.approx(M * ((4 * L + 2) * c1 + loss))
    assert tp.exposed_s == pytest.approx(expected)
    assert c1 - attention * per_flop_f / 2 > c1 / 2 and mlp * per_flop_b > c1  # both branches were taken
    off = estimate(cfg, 2, hw)
    assert off.overlaps["tp_overlap"].exposed_s == pytest.approx(off.comm["tp"].time_s)  # fivefold: all exposed
    # pp = 1: the step is shorter by what is hidden (to terms.simulate_scaled's 1e-4 rounding of b / f, a
    # 1e-4 share of the step), less the 20 of 132 SMs the hidden collectives take from the matmuls beside them
    # (overlap.contention)
    assert est.time_split["contention"] == pytest.approx(20 / 132 * tp.hidden_s)
    assert off.step_time_s - est.step_time_s == pytest.approx(tp.hidden_s * (1 - 20 / 132),
                                                              abs=1e-4 * est.step_time_s)


@pytest.mark.parametrize("recompute,per_region", [("none", 2), ("full", 3)])
def test_tp_overlap_hides_all_but_one_piece_when_compute_is_rich(recompute, per_region):
    # Full recompute runs each region's forward collective again, during the backward.
    cfg = _llama(2, "--parallel.tp=2", "--train.global_batch=2", f"--train.recompute=\"{recompute}\"")
    est = estimate(cfg, 2, SLOW_COMPUTE, options=PlanOptions(tp_overlap=True))
    c1 = _ring("all_reduce", 4096 * 4096 * 2, 2, SLOW_COMPUTE)
    loss = 4 * _ring("all_gather", 2 * 2 * 1024 * 4, 2, SLOW_COMPUTE)  # 4 chunks of 1,024 tokens: one gather each
    overlappable = 2 * (2 * per_region * 32 + 1) * c1  # 2 micro-batches: 2 regions per block, the head's
    assert est.overlaps["tp_overlap"].exposed_s == pytest.approx(overlappable / 2 + 2 * (c1 + loss))


# ---- zero3_prefetch: parallel/data/fsdp.py gathers one unit ahead ----

def test_prefetch_pass_by_hand():
    # Gathers only: the first is exposed, then what each exceeds the previous unit's compute.
    assert prefetch_pass([3, 1, 4, 1], [2, 2, 2, 2]) == pytest.approx(3 + 0 + 2 + 0)
    assert prefetch_pass([0, 0], [1, 1]) == 0.0
    # With reduce-scatters on the same stream (issued as each unit finishes), by hand: g1 [0,3];
    # u1 [3,5] under g2 [3,4]; r1 [5,6]; u2 [5,7], g3 issued at 5 runs [6,10]; r2 [10,11]; u3 waits:
    # [10,12], g4 [11,12], r3 [12,13]; u4 [12,14]; r4 [14,15]. 15 - 8 of compute = 7.
    assert prefetch_pass([3, 1, 4, 1], [2, 2, 2, 2], [1, 1, 1, 1]) == pytest.approx(7)


def _zero3_parts(cfg, hw, n):
    """(embedding, block, head) gather seconds and the same for their reduce-scatters (bf16)."""
    counts = model_counts(cfg.model, derive(cfg, n, unpadded_vocab(cfg)).vocab_size)
    sizes = (counts.embedding, counts.blocks[0].total, counts.head + counts.final_norm)
    return ([_ring("all_gather", 2 * s, n, hw) for s in sizes], [_ring("reduce_scatter", 2 * s, n, hw) for s in sizes])


def test_zero3_prefetch_resharding_against_hand_arithmetic():
    # ZeRO-3 over 4 ranks, 2 micro-batches, compute-rich. Per micro-batch, forward: the embedding's
    # gather, then block 0's under the embedding's compute (a lookup: none); backward: no gather
    # first (the head stays gathered from its forward), the last block's under the head's compute;
    # the reduce-scatters hide under the blocks' backwards except the last two (block 0's, then the
    # embedding's, after no compute). Every other gather hides under its predecessor.
    cfg = _llama(4, "--parallel.zero=3", "--train.global_batch=8")
    (g_emb, g_blk, g_head), (r_emb, r_blk, r_head) = _zero3_parts(cfg, SLOW_COMPUTE, 4)
    est = estimate(cfg, 4, SLOW_COMPUTE)
    z = est.overlaps["zero3_prefetch"]
    M = 2
    assert z.exposed_s == pytest.approx(M * (g_emb + g_blk + r_blk + r_emb))
    assert z.traffic_s == pytest.approx(M * (2 * (g_emb + 32 * g_blk) + g_head + r_emb + 32 * r_blk + r_head))
    assert est.exposed_dp_s == pytest.approx(z.exposed_s)  # no noise on a data sheet
    # parallel.overlap_comm = false: the buckets reduce after the backward (parallel/data/ddp.py), all exposed
    late = estimate(_llama(4, "--parallel.zero=3", "--train.global_batch=8", "--parallel.overlap_comm=false"), 4,
                    SLOW_COMPUTE).overlaps["zero3_prefetch"]
    assert late.exposed_s == pytest.approx(M * (g_emb + g_blk + r_emb + 32 * r_blk + r_head))
    off = estimate(cfg, 4, SLOW_COMPUTE, options=PlanOptions(zero3_prefetch=False))
    assert off.overlaps["zero3_prefetch"].exposed_s == pytest.approx(z.traffic_s)  # every gather and reduce-scatter
    assert off.exposed_dp_s == pytest.approx(z.traffic_s)


def test_zero3_kept_gathered_is_gathered_and_reduced_once_a_step():
    # reshard_after_forward = false (the default with pp > 1): gathered in the first micro-batch's
    # forward, reduce-scattered in the last one's backward, whatever the micro-batch count.
    cfg = _llama(4, "--parallel.zero=3", "--train.global_batch=16", "--parallel.reshard_after_forward=false")
    (g_emb, g_blk, g_head), (r_emb, r_blk, r_head) = _zero3_parts(cfg, SLOW_COMPUTE, 4)
    z = estimate(cfg, 4, SLOW_COMPUTE).overlaps["zero3_prefetch"]
    assert z.traffic_s == pytest.approx(g_emb + 32 * g_blk + g_head + r_emb + 32 * r_blk + r_head)
    assert z.exposed_s == pytest.approx(g_emb + g_blk + r_blk + r_emb)  # the backward needs no gather


def test_zero3_traffic_is_the_bytes_comm_py_counts():
    hw = dataclasses.replace(H100, intra_latency=0.0)  # per unit the runtime pays more latency terms: not compared
    for keep, hsdp in (("true", 1), ("false", 1), ("true", 2)):  # HSDP: sharded over dp_shard = 2 of dp = 4
        cfg = _llama(4, "--parallel.zero=3", "--train.global_batch=8", f"--parallel.reshard_after_forward={keep}",
                     f"--parallel.dp_replicate={hsdp}")
        est = estimate(cfg, 4, hw)
        dp = est.comm["dp"]  # HSDP's all-reduces over the replicas are a part of their own, priced apart
        assert bool(dp.merged) == (hsdp > 1)
        assert est.overlaps["zero3_prefetch"].traffic_s == pytest.approx(dp.time_s - dp.merged_s)


# ---- ep_overlap: DeepSeek-V3 Technical Report, sec. 3.2.1 (DualPipe) ----

def _moe(tmp_path, *overrides):
    return tiny_config(tmp_path, "--model.preset=tiny-moe", "--parallel.ep=2", "--train.recompute=\"none\"", *overrides)


def test_ep_overlap_leaves_the_unpaired_passes_when_compute_is_rich(tmp_path):
    hw = dataclasses.replace(SLOW_COMPUTE, peak_flops=1e6)
    cfg = _moe(tmp_path, "--train.micro_batch=1")  # 4 micro-batches on each of 2 ranks
    est = estimate(cfg, 2, hw, options=PlanOptions(ep_overlap=True))
    ep = est.overlaps["ep_overlap"]
    # The step's first forward and last backward have no other micro-batch to pair with: one
    # micro-batch's all-to-alls stay exposed, the other three's hide under their partners.
    assert ep.exposed_s == pytest.approx(est.comm["ep"].time_s / 4)
    one = _moe(tmp_path, "--train.micro_batch=4")  # one micro-batch: no partner at all
    assert estimate(one, 2, hw, options=PlanOptions(ep_overlap=True)).overlaps["ep_overlap"].hidden_s == 0.0


def test_ep_overlap_against_hand_arithmetic(tmp_path):
    # Full recompute: of a micro-batch's all-to-alls a, the forward runs a/3 (dispatch, combine) and
    # the backward 2a/3 (the recomputed forward's and the backward's); each hides under the other
    # micro-batch's opposite pass over the MoE blocks (DualPipe's pairs), the unpaired first
    # forward and last backward excepted.
    hw = dataclasses.replace(H100, peak_flops=5e11, intra_bw=2e9, sm_count=0)  # flat: time in proportion to FLOPs
    cfg = _moe(tmp_path, "--train.micro_batch=2", "--train.recompute=\"full\"")  # 2 micro-batches
    d, work, chunk = _chunk(cfg, 2, hw)
    counts = model_counts(cfg.model, d.vocab_size)
    est = estimate(cfg, 2, hw, options=PlanOptions(ep_overlap=True))
    moe = sum(block_forward_flops(cfg.model, counts.blocks[b], 32, 1) for b in range(8)) * 2 * 32
    f, b = chunk.forward_s * moe / work.forward_flops, chunk.backward_s * moe / work.forward_flops
    a = est.comm["ep"].time_s / 2
    assert b > 2 * a / 3 and a / 3 > f  # the backward hides the forward's all-to-alls; the forward does not
    expected = a + max(0, a / 3 - b) + max(0, 2 * a / 3 - f)
    assert est.overlaps["ep_overlap"].exposed_s == pytest.approx(expected)


# ---- dp_overlap: parallel.overlap_comm, bucket by bucket (Li et al. 2020, sec. 3.2.3) ----

def test_dp_overlap_is_the_config_switch(tmp_path):
    assert split_layout("dp=2,dp_overlap=false") == (["--parallel.dp=2", "--parallel.overlap_comm=false"], DEFAULT)
    cfg = _llama(8, "--parallel.dp=8", "--train.global_batch=8")
    on = estimate(cfg, 8, H100)
    off = estimate(_llama(8, "--parallel.dp=8", "--train.global_batch=8", "--parallel.overlap_comm=false"), 8, H100)
    o = on.dp_overlap
    assert on.overlaps["dp_overlap"].exposed_s == pytest.approx(max(o.reduce_s - o.window_s, o.bucket_s))
    assert on.overlaps["dp_overlap"].traffic_s == pytest.approx(o.reduce_s)
    assert off.overlaps["dp_overlap"].exposed_s == pytest.approx(o.reduce_s)  # without the backward to hide under
    assert on.overlaps["dp_overlap"].runtime and off.overlaps["dp_overlap"].runtime  # a config field: fivefold runs it


# ---- param_gather_overlap: Megatron-LM's --overlap-param-gather (ZeRO-1/2's gather under the next forward) ----

def test_param_gather_overlap_against_hand_arithmetic():
    # ZeRO-1 over 8 ranks of a node, one micro-batch: after the step every rank gathers the bf16
    # weights (params x 2 bytes, a ring all-gather); overlapped, what exceeds the forward is exposed,
    # never less than the first 25 MB bucket.
    cfg = _llama(8, "--parallel.dp=8", "--parallel.zero=1", "--train.global_batch=8")
    d, work, chunk = _chunk(cfg, 8, H100)
    params = work.share.params
    gather = _ring("all_gather", 2 * params, 8, H100)
    off, on = estimate(cfg, 8, H100), estimate(cfg, 8, H100, options=PlanOptions(param_gather_overlap=True))
    first_bucket = gather * 25e6 / (2 * params)
    assert gather < chunk.forward_s  # the forward hides all but the first bucket
    assert off.overlaps["param_gather_overlap"].exposed_s == pytest.approx(gather)
    assert on.overlaps["param_gather_overlap"].exposed_s == pytest.approx(first_bucket)
    assert off.exposed_dp_s - on.exposed_dp_s == pytest.approx(gather - first_bucket)
    assert on.not_runnable == ["param_gather_overlap=true: fivefold's ZeRO-1/2 gather the weights after the step "
                               "(parallel/data/zero.py)"]
    assert not off.not_runnable and off.overlaps["param_gather_overlap"].runtime
    zero3 = estimate(_llama(8, "--parallel.dp=8", "--parallel.zero=3", "--train.global_batch=8"), 8, H100,
                     options=PlanOptions(param_gather_overlap=True))
    assert zero3.overlaps["param_gather_overlap"].traffic_s == 0 and not zero3.not_runnable  # no gather to overlap


# ---- contention: the SMs hidden collectives take (DeepSeek-V3 report, sec. 3.2.2 and 3.5.1) ----

def test_hidden_collectives_take_their_sms_from_the_compute():
    cfg = _llama(8, "--parallel.dp=8", "--parallel.zero=1", "--train.global_batch=8")
    est = estimate(cfg, 8, H100, options=PlanOptions(param_gather_overlap=True))
    hidden = [h.hidden_s for h in est.overlaps.values() if h.hidden_s > 0]
    assert len(hidden) == 2  # the gradient reduce-scatter under the backward, the gather under the forward
    assert est.time_split["contention"] == pytest.approx(20 / 132 * sum(hidden))
    assert est.step_time_s == pytest.approx(sum(est.time_split.values()), rel=1e-3)  # a term of the step
    assert any(what == "contention" for what, _, _ in est.explain)
    flat = dataclasses.replace(H100, comm_sms=0)  # a GPU whose collectives take no SMs: nothing charged
    assert estimate(cfg, 8, flat, options=PlanOptions(param_gather_overlap=True)).time_split["contention"] == 0


# ---- defaults are fivefold's runtime; each switch moves only its own terms ----

def _collectives(rank, world, cfg):
    """Worker: one training step, each collective recorded as (axis, op, issued asynchronously)."""
    calls, issue = [], collectives._issue

    def recording(op, group, nbytes, label, async_op, *args, **kwargs):
        calls.append((label, op, async_op))
        return issue(op, group, nbytes, label, async_op, *args, **kwargs)

    collectives._issue = recording
    train(cfg, progress=False)
    return calls


def test_defaults_are_what_the_runtime_does(tmp_path):
    one_step = ("--train.steps=1", "--data.max_bytes=20000", "--data.val_fraction=0.0")
    tp = run_workers(_collectives, 2, tiny_config(tmp_path / "tp", *one_step, "--parallel.tp=2",
                                                   "--parallel.sp=true"))[0]
    moe = run_workers(_collectives, 2, tiny_config(tmp_path / "ep", *one_step, "--model.preset=tiny-moe",
                                                    "--parallel.ep=2", "--parallel.zero=3"))[0]
    tp_async = {a for axis, _, a in tp if axis == "tp"}
    ep_async = {a for axis, op, a in moe if axis == "ep" and op == "all_to_all"}
    gathers_async = {a for axis, op, a in moe if axis == "dp" and op == "all_gather"}
    assert tp_async == {False} and ep_async == {False} and gathers_async == {True}
    # tp's and ep's collectives block the compute that needs them; ZeRO-3's gathers are issued a
    # unit ahead (tests/parallel/test_dp_comm.py: at most the running unit and one prefetched are gathered).
    assert DEFAULT.tp_overlap is False and DEFAULT.ep_overlap is False and DEFAULT.zero3_prefetch is True
    assert DEFAULT.not_runnable() == []
    explicit = PlanOptions(tp_overlap=False, zero3_prefetch=True, ep_overlap=False)
    for cfg, world in ((_llama(8, "--parallel.tp=2", "--parallel.zero=3", "--train.global_batch=8"), 8),
                       (_moe(tmp_path), 2)):
        a, b = estimate(cfg, world, H100), estimate(cfg, world, H100, options=explicit)
        assert a.step_time_s == b.step_time_s and a.time_split == b.time_split
        assert all(h.runtime for h in a.overlaps.values())


def test_a_switch_the_layout_never_uses_is_no_reason_it_cannot_run(tmp_path):
    """zero3_prefetch=false prices nothing without ZeRO-3, tp_overlap nothing at tp = 1, ep_overlap
    nothing at ep = 1: such an estimate is what fivefold runs. With the axis in use, fivefold runs
    tp_overlap with sp and ep_overlap with dualpipe_v (validate/speed.py says so otherwise), and never
    zero3_prefetch = false."""
    off = PlanOptions(tp_overlap=True, zero3_prefetch=False, ep_overlap=True)
    plain = _llama(8, "--parallel.zero=1", "--train.global_batch=8")
    assert estimate(plain, 8, H100, options=off).not_runnable == []
    assert [w.split(":")[0] for w in off.not_runnable()] == ["zero3_prefetch=false"]  # in any layout
    used = estimate(_llama(8, "--parallel.tp=2", "--parallel.zero=3", "--train.global_batch=8"), 8, H100, options=off)
    assert [w.split(" needs")[0].split(":")[0] for w in used.not_runnable] == [
        "zero3_prefetch=false", "parallel.tp_overlap = true"]
    with_sp = _llama(8, "--parallel.tp=2", "--parallel.sp=true", "--parallel.zero=1", "--train.global_batch=8")
    assert estimate(with_sp, 8, H100, options=off).not_runnable == []
    moe = estimate(_moe(tmp_path), 2, H100, options=off).not_runnable
    assert len(moe) == 1 and moe[0].startswith("parallel.ep_overlap = true pairs DualPipe's")


def _changed(a, b) -> set[str]:
    """The step's terms (time_split keys) that differ between two estimates (without a pipeline the
    bubble is simulate_scaled's rounding of b / f, under 1e-4 of the step: not a change)."""
    no_bubble = max(a.time_split["bubble"], b.time_split["bubble"]) < 1e-4 * a.step_time_s
    return {k for k in a.time_split if a.time_split[k] != pytest.approx(b.time_split[k], rel=1e-9)
            and not (k == "bubble" and no_bubble)}


@pytest.mark.parametrize("switch,world,layout", [
    ("tp_overlap=on", 2, ("--parallel.tp=2", "--parallel.sp=true", "--train.global_batch=2")),
    ("zero3_prefetch=off", 4, ("--parallel.zero=3", "--train.global_batch=8")),
    ("dp_overlap=false", 8, ("--parallel.dp=8", "--train.global_batch=8")),
    ("param_gather_overlap=true", 8, ("--parallel.dp=8", "--parallel.zero=1", "--train.global_batch=8")),
])
def test_each_switch_moves_only_its_terms(switch, world, layout):
    key = switch.partition("=")[0]
    overrides, options = split_layout(switch)
    a = estimate(_llama(world, *layout), world, H100)
    b = estimate(_llama(world, *layout, *overrides), world, H100, options=options)
    term = "tp_cp_ep" if key == "tp_overlap" else "dp_exposed"
    # what a switch hides or exposes moves the SMs its collectives take beside the compute too
    assert _changed(a, b) == {term, "contention"}
    moved = b.overlaps[key].hidden_s - a.overlaps[key].hidden_s
    assert b.time_split["contention"] - a.time_split["contention"] == pytest.approx(20 / 132 * moved)
    assert a.memory == b.memory and {k: t.bytes for k, t in a.comm.items()} == {k: t.bytes for k, t in b.comm.items()}
    for other in SWITCHES:
        assert a.overlaps[other].traffic_s == pytest.approx(b.overlaps[other].traffic_s)
        if other != key:
            assert a.overlaps[other].exposed_s == pytest.approx(b.overlaps[other].exposed_s)
    assert a.overlaps[key].exposed_s != pytest.approx(b.overlaps[key].exposed_s)


def test_ep_overlap_moves_only_the_critical_path(tmp_path):
    hw = dataclasses.replace(H100, peak_flops=5e11, intra_bw=2e9, sm_count=0)  # flat: time in proportion to FLOPs
    cfg = _moe(tmp_path, "--train.micro_batch=1")  # dp's one bucket is exposed whole: no window moves it
    a, b = estimate(cfg, 2, hw), estimate(cfg, 2, hw, options=PlanOptions(ep_overlap=True))
    assert _changed(a, b) == {"tp_cp_ep"}
    assert b.overlaps["ep_overlap"].hidden_s > 0 and b.not_runnable  # fivefold overlaps them under dualpipe_v only


def test_explain_names_every_switch_and_whether_fivefold_runs_it():
    cfg = _llama(8, "--parallel.tp=2", "--parallel.zero=3", "--train.global_batch=8")
    rows = {what: text for what, text, _ in estimate(cfg, 8, H100, options=PlanOptions(tp_overlap=True)).explain}
    assert rows["tp overlap"].startswith("on (not runnable in this layout: see runnable): ")  # no sp
    assert "hidden" in rows["tp overlap"]
    assert rows["zero3 prefetch"].startswith("on (fivefold: prefetches the next unit): ")
    assert rows["ep overlap"].startswith("off (fivefold: runs parallel.ep_overlap as set): no expert all-to-alls")
    sp = _llama(8, "--parallel.tp=2", "--parallel.sp=true", "--parallel.tp_overlap=true", "--train.global_batch=8")
    rows = {what: text for what, text, _ in estimate(sp, 8, H100).explain}
    assert rows["tp overlap"].startswith("on (fivefold: runs parallel.tp_overlap as set): ")
    assert rows["dp overlap"].startswith("on (fivefold: runs parallel.overlap_comm as set): ")


def test_zero3_gathers_fp8_weights_as_the_dp_traffic_does():
    """fp8 = "weights": ZeRO-3 gathers the blocks' weights in 1 byte (parallel/data/fp8_gather.py), the
    embedding and head in their own dtype; the units the prefetch prices (overlap.zero3_units) save
    what the step's dp traffic saves, so the two agree on what FP8 gathering takes off."""
    cfg = _llama(8, "--parallel.zero=3", "--train.global_batch=8")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=4))
    plain, fp8 = (estimate(cfg, 8, H100, options=PlanOptions(fp8=f)) for f in ("compute", "weights"))
    saved_units = plain.overlaps["zero3_prefetch"].traffic_s - fp8.overlaps["zero3_prefetch"].traffic_s
    saved_traffic = plain.comm["dp"].time_s - fp8.comm["dp"].time_s
    assert saved_traffic > 0 and saved_units == pytest.approx(saved_traffic, rel=0.01)
