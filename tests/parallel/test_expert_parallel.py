"""Expert parallel and MoE load balancing: each piece against one process, or against a hand count."""

import copy
import dataclasses
import math

import pytest
import torch
from helpers import (
    BF16,
    EQUIVALENCE,
    LORA,
    MOE_ARGS,
    MUON,
    Layout,
    assert_layout_reproduces,
    mesh_of,
    parallelized,
    tiny_config,
)

from fivefold.config.derive import derive
from fivefold.config.schema import Config
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.config import MoEConfig
from fivefold.model.moe import MoE, drop_over_capacity, local_dispatch, sequence_balance_loss
from fivefold.model.presets import PRESETS
from fivefold.model.transformer import Transformer, cross_entropy_sum
from fivefold.parallel.comm.collectives import AxisGroup, CommStats
from fivefold.parallel.expert import ExpertParallelDispatch, apply_expert_parallel, shard_experts
from fivefold.parallel.forked_ranks import run_workers
from fivefold.parallel.mesh import expert_partitions
from fivefold.parallel.state_dict import gather_expert_shards
from fivefold.train.moe_balance import expert_stats, reset_expert_counts, set_balance_loss_scale, update_expert_bias

DIM, HIDDEN = 16, 32


def moe_config(dim: int = DIM, **moe):
    """A small model whose MoE has 8 experts (top-2) of width HIDDEN; `moe`: other MoEConfig fields."""
    return dataclasses.replace(PRESETS["tiny"], dim=dim, n_heads=2, n_kv_heads=2, ffn_dim=HIDDEN, vocab_size=64,
                               moe=MoEConfig(**{"ffn_dim": HIDDEN, "n_experts": 8, "top_k": 2, **moe}))


def make_moe(seed=0, **changes) -> MoE:
    torch.manual_seed(seed)
    cfg = moe_config(**changes)
    moe = MoE(cfg.moe, cfg.dim, cfg.ffn_dim, cfg.activation)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def _apply_ep(moe, mesh):
    """apply_expert_parallel on one MoE block: everything it needs is the mesh's ep and cp groups."""
    cfg = Config()
    return apply_expert_parallel(moe, mesh, cfg, derive(cfg, mesh.world_size, unpadded_vocab(cfg)))


# ---- groups ---------------------------------------------------------------------------------------
def test_partitions_carve_ep_groups_out_of_each_grad_view():
    grid = torch.arange(16).view(2, 1, 2, 2, 2)  # pp 2, dp_shard 2, cp 2, tp 2: global ranks
    ep_parts, replica_parts = expert_partitions(grid, 2)
    # pp 0, tp 0 has grad view [0, 2, 4, 6] (tp innermost): ep groups are consecutive grad ranks.
    assert ep_parts[:2] == [[0, 2], [4, 6]] and replica_parts[:2] == [[0, 4], [2, 6]]
    assert ep_parts[2:4] == [[1, 3], [5, 7]]  # pp 0, tp 1
    assert ep_parts[-1] == [13, 15]  # pp 1, tp 1
    for parts, size in ((ep_parts, 2), (replica_parts, 2)):  # a partition of the world in equal parts
        assert sorted(r for p in parts for r in p) == list(range(16)) and {len(p) for p in parts} == {size}
    with pytest.raises(ValueError, match="divide"):
        expert_partitions(grid, 3)


def _groups(rank, world):
    out = []
    for degrees, ep in (({"dp_shard": 2, "cp": 2}, 2), ({"pp": 2, "dp_shard": 2}, 2), ({"dp_shard": 4}, 1),
                        ({"dp_shard": 4}, 4)):
        mesh = mesh_of(ep, **degrees)
        ep_group, replicas = mesh.group("ep"), mesh.group("expert_dp")
        members = []
        for group in (ep_group, replicas):  # who is really in each group: gather the global ranks
            t = torch.zeros(world, dtype=torch.long)
            t[rank] = 1
            if group.size > 1:
                torch.distributed.all_reduce(t, group=group.pg)
            members.append(t.nonzero().flatten().tolist())
        out.append((mesh.rank("grad"), ep_group.rank, ep_group.label, replicas.label, members,
                    ep_group.pg is mesh.group("grad").pg))
    return out


def test_groups_on_a_mesh_match_the_layout():
    results = run_workers(_groups, 4)
    for rank, (dpcp, pp_dp, dp_only, ep_only) in enumerate(results):
        grad, ep_rank, ep_label, rep_label, (ep_members, rep_members), _ = dpcp
        assert (ep_rank, ep_label, rep_label) == (grad % 2, "ep", "dp")
        assert ep_members == [rank - rank % 2, rank - rank % 2 + 1] and rep_members == [rank % 2, rank % 2 + 2]
        grad, ep_rank, _, _, (ep_members, rep_members), _ = pp_dp  # pp outermost: ranks {0,1} | {2,3}
        assert ep_members == [rank - rank % 2, rank - rank % 2 + 1] and rep_members == [rank]
        _, ep_rank, _, _, (ep_members, rep_members), _ = dp_only  # ep 1: experts replicated over all of dp
        assert ep_members == [rank] and rep_members == [0, 1, 2, 3]
        _, ep_rank, _, _, (ep_members, rep_members), shares_grad = ep_only  # all of dp: its own process group
        assert ep_members == [0, 1, 2, 3] and rep_members == [rank] and ep_rank == rank and not shares_grad


# ---- dispatch: against one process holding every rank's tokens ------------------------------------------
def _moe_equivalence(rank, world, with_empty_expert):
    B, T = 2, 5
    moe_ref = make_moe(aux_loss=0.1)
    if with_empty_expert:  # the bias (selection only) keeps expert 7 from every token of every rank
        moe_ref.expert_bias[7] = -100.0
    moe_ref.expert_bias[1] = 0.05  # and a bias that shifts selection without changing gate weights
    x_all, g_all = torch.randn(world, B, T, DIM), torch.randn(world, B, T, DIM)  # the same on every rank
    moe = copy.deepcopy(moe_ref)

    x_ref = x_all.view(world * B, T, DIM).clone().requires_grad_()
    set_balance_loss_scale(moe_ref, sequences=world * B)
    out_ref = moe_ref(x_ref)  # (world B, T, DIM)
    (out_ref * g_all.view_as(x_ref)).sum().backward()
    out_ref = out_ref.detach().view(world, B, T, DIM)
    idx_all = moe_ref.route(x_all.view(-1, DIM))[1].view(world, B * T, 2)  # every rank's routing

    mesh = mesh_of(ep=world, dp_shard=world)
    ep = _apply_ep(moe, mesh).group
    set_balance_loss_scale(moe, sequences=world * B)  # the reference's mean is over every rank's sequences
    assert moe.experts.gate.shape[0] == 8 // world and isinstance(moe.dispatch, ExpertParallelDispatch)
    x = x_all[rank].clone().requires_grad_()
    mesh.stats.reset()
    out = moe(x)
    forward_wire = mesh.stats.snapshot()["ep"]["wire_bytes"]
    (out * g_all[rank]).sum().backward()
    wire = mesh.stats.snapshot()["ep"]["wire_bytes"]

    # Rows that leave this rank: its copies for other ranks' experts, and the rows others send here.
    owner = idx_all // (8 // world)  # (world, N, k)
    sent = int((owner[rank] != rank).sum())
    received = int(sum((owner[s] == rank).sum() for s in range(world) if s != rank))
    counts_bytes = (world - 1) * (8 // world) * 8  # the int64 counts exchange, forward only
    router = moe.router.weight.grad.clone()
    torch.distributed.all_reduce(router, group=ep.pg)  # each rank's share of the router gradient
    grads = gather_expert_shards({n: p.grad for n, p in moe.named_parameters()}, moe, ep)
    stats, stats_ref = expert_stats(moe, ep), expert_stats(moe_ref)
    rows_bytes = (sent + received) * DIM * 4  # fp32 rows, each way once in forward and once in backward
    return dict(
        out=(out, out_ref[rank]), x_grad=(x.grad, x_ref.grad.view(world, B, T, DIM)[rank]),
        router=(router, moe_ref.router.weight.grad),
        **{n: (grads[n], p.grad) for n, p in moe_ref.named_parameters() if n.startswith("experts.")},
        wire=(forward_wire, wire, rows_bytes + counts_bytes, 2 * rows_bytes + counts_bytes),
        load=(stats.load, stats_ref.load), balance=(stats.balance_loss, stats_ref.balance_loss),
        grad_down_7=grads["experts.down"][7],
    )


@pytest.mark.parametrize("world,with_empty_expert", [(2, False), (4, True)], ids=["ep2", "ep4-empty-expert"])
def test_expert_parallel_moe_matches_one_process(world, with_empty_expert):
    for rank, r in enumerate(run_workers(_moe_equivalence, world, with_empty_expert)):
        forward_wire, wire, expected_forward, expected = r.pop("wire")
        assert forward_wire == expected_forward and wire == expected, (rank, forward_wire, wire, expected)
        load, load_ref = r.pop("load")
        assert load == load_ref and sum(load[""]) == world * 10 * 2
        balance, balance_ref = r.pop("balance")
        assert balance[""] == pytest.approx(balance_ref[""], rel=1e-6)  # summed over ranks, divided by global sequences
        down_7 = r.pop("grad_down_7")
        if with_empty_expert:  # no token anywhere: a zero gradient, present so reductions never wait on it
            assert load[""][7] == 0 and torch.count_nonzero(down_7) == 0
        for name, (ours, ref) in r.items():
            # The same rows reach each expert in the same order as in one process; only sums over
            # ranks (router gradient) and matmul blocking can differ, by float rounding.
            torch.testing.assert_close(ours, ref, atol=2e-6, rtol=1e-5, msg=f"rank {rank}: {name}")


def _context_parallel(rank, world):
    """ep = cp = 2: each rank holds half of every sequence; the balance loss needs the whole ones."""
    B, T = 3, 8
    moe_ref = make_moe(aux_loss=0.5)
    moe = copy.deepcopy(moe_ref)
    x_all, g_all = torch.randn(B, T, DIM), torch.randn(B, T, DIM)
    x_ref = x_all.clone().requires_grad_()
    (moe_ref(x_ref) * g_all).sum().backward()
    mesh = mesh_of(ep=2, cp=2)
    _apply_ep(moe, mesh)
    set_balance_loss_scale(moe, sequences=B)  # cp ranks share their sequences: B in all
    mine = slice(rank * T // 2, (rank + 1) * T // 2)
    x = x_all[:, mine].clone().requires_grad_()
    (moe(x) * g_all[:, mine]).sum().backward()
    router = moe.router.weight.grad.clone()
    torch.distributed.all_reduce(router, group=mesh.group("cp").pg)
    balance = expert_stats(moe, mesh.group("cp")).balance_loss[""]
    return [(router, moe_ref.router.weight.grad), (x.grad, x_ref.grad[:, mine]),
            (torch.tensor(balance), torch.tensor(expert_stats(moe_ref).balance_loss[""] / B))]


def test_balance_loss_over_context_parallel_ranks_matches_whole_sequences():
    for rank, pairs in enumerate(run_workers(_context_parallel, 2)):
        for name, (ours, ref) in zip(["router grad", "x grad", "balance loss"], pairs, strict=True):
            # Whole-sequence counts come from a cp all-reduce; partial sums differ only by rounding.
            torch.testing.assert_close(ours, ref.to(ours.dtype), atol=2e-6, rtol=1e-5, msg=f"rank {rank}: {name}")


def test_dispatch_on_one_rank_is_the_local_dispatch():
    moe = make_moe()
    x, g = torch.randn(10, DIM), torch.randn(10, DIM)
    weights, idx = moe.route(x)
    idx[0, 0] = -1  # a dropped copy
    one = AxisGroup(name="ep", label="ep", pg=None, size=1, rank=0, stats=CommStats())
    outs = []
    for dispatch in (local_dispatch, ExpertParallelDispatch(one, 8)):
        moe.zero_grad()
        out = dispatch(x, weights.detach(), idx, moe.experts)
        (out * g).sum().backward()
        outs.append((out.detach(), moe.experts.down.grad.clone()))
    for ours, ref in zip(*outs, strict=True):
        assert torch.equal(ours, ref)  # the same rows through the same matmuls
    assert one.stats.snapshot() == {}  # a group of one sends nothing


# Crafted routing on 2 ranks, 4 experts (rank 0 owns 0-1, rank 1 owns 2-3); -1 = a dropped copy.
CRAFTED = {
    "no-cross-traffic": [[[0, 1], [1, 0], [0, -1]], [[2, 3], [3, 2], [-1, 3]]],
    "one-way-and-empty-expert": [[[0, 1], [1, 0], [0, 1]], [[0, 3], [3, 1], [1, -1]]],  # expert 2: nothing
}


def _crafted(rank, world, routes):
    idx_all = torch.tensor(routes)  # (2, 3, 2)
    torch.manual_seed(0)
    full = make_moe(n_experts=4).experts
    x_all, w_all, g_all = torch.randn(2, 3, DIM), torch.rand(2, 3, 2), torch.randn(2, 3, DIM)
    x_ref, w_ref = x_all.clone().requires_grad_(), w_all.clone().requires_grad_()
    ref = torch.cat([local_dispatch(x_ref[s], w_ref[s], idx_all[s], full) for s in range(2)])  # (6, DIM)
    (ref * g_all.view(6, DIM)).sum().backward()
    mesh = mesh_of(ep=2, dp_shard=2)
    ep = mesh.group("ep")
    mine = copy.deepcopy(full)
    shard_experts(mine, ep)
    x, w = x_all[rank].clone().requires_grad_(), w_all[rank].clone().requires_grad_()
    out = ExpertParallelDispatch(ep, 4)(x, w, idx_all[rank], mine)
    (out * g_all[rank]).sum().backward()
    grads = [p.grad for p in (mine.gate, mine.up, mine.down)]
    refs = [p.grad.chunk(2)[rank] for p in (full.gate, full.up, full.down)]
    return [(out, ref.view(2, 3, DIM)[rank]), (x.grad, x_ref.grad[rank]), (w.grad, w_ref.grad[rank]),
            *zip(grads, refs, strict=True)]


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_dispatch_with_empty_splits_and_dropped_copies(case):
    for rank, pairs in enumerate(run_workers(_crafted, 2, CRAFTED[case])):
        for i, (ours, ref) in enumerate(pairs):
            assert ours is not None, f"rank {rank}: gradient {i} missing (a data-parallel reduction would wait on it)"
            torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5, msg=f"rank {rank}, tensor {i}")


# ---- capacity ---------------------------------------------------------------------------------------
def test_capacity_drops_the_late_copies_and_counts_them():
    # 6 tokens, top-2 of 4 experts, cf 1: capacity ceil(1 x 6 x 2 / 4) = 3 copies per expert.
    routes = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 3], [1, 0], [2, 3]])
    # Expert 0 is asked by tokens 0..4 in order: tokens 3 and 4 (its 4th and 5th copies) are dropped.
    expected = torch.tensor([[0, 1], [0, 1], [0, 2], [-1, 3], [1, -1], [2, 3]])
    assert torch.equal(drop_over_capacity(routes, 4, 3), expected)
    # Through the block: one-hot tokens and a router that scores exactly those routes.
    moe = make_moe(n_experts=4, dim=8, capacity_factor=1.0)
    with torch.no_grad():
        moe.router.weight.zero_()
        for t, (first, second) in enumerate(routes.tolist()):
            moe.router.weight[first, t], moe.router.weight[second, t] = 3.0, 2.0
    x = torch.eye(8)[:6].view(1, 6, 8).requires_grad_()
    out = moe(x)
    out.sum().backward()
    assert int(moe.step_dropped) == 2 and moe.step_load.tolist() == [5, 3, 2, 2]  # load: what was chosen
    weights, _ = moe.route(x.detach().view(6, 8))
    keep = expected >= 0
    manual = local_dispatch(x.detach().view(6, 8), weights * keep, expected.clamp(min=0), moe.experts)
    torch.testing.assert_close(out.detach().view(6, 8), manual)  # dropped copies contribute nothing
    with torch.no_grad():
        moe(x)
    assert int(moe.step_dropped) == 2  # evaluation counts nothing


# ---- aux-loss-free balancing ------------------------------------------------------------------------------
def test_bias_updates_even_out_a_skewed_router():
    moe = make_moe(bias_update=1e-3)
    with torch.no_grad():
        moe.router.weight[0] += 0.2  # every token leans to expert 0
    x = torch.randn(1, 512, DIM) + 0.5
    gate = []  # max / mean load per step
    for _ in range(40):
        moe(x).sum().backward()
        stats = expert_stats(moe)
        gate.append(stats.max_over_mean()[""])
        update_expert_bias(moe, stats, 0.01)  # a sign step: it ends up oscillating around balance
        reset_expert_counts(moe)
    assert gate[0] > 2.0 and max(gate[-10:]) < 1.3, gate  # measured: 2.54 -> 1.09-1.16
    # The bias chooses, the unbiased scores weigh.
    flat = x[0, :4]
    weights, idx = moe.route(flat)
    expected = moe.scores(flat).gather(-1, idx)
    torch.testing.assert_close(weights, expected / expected.sum(-1, keepdim=True))
    assert "expert_bias" in moe.state_dict() and "expert_bias" not in make_moe().state_dict()


# ---- sequence-wise balance loss ---------------------------------------------------------------------------
def test_balance_loss_value_matches_the_formula_by_hand():
    # One sequence of 2 tokens, 2 experts, top-1; sigmoid-like scores that do not sum to 1.
    scores = torch.tensor([[[0.9, 0.3], [0.2, 0.2]]])  # s' = [[.75, .25], [.5, .5]]
    idx = torch.tensor([[[0], [0]]])  # both tokens chose expert 0: f = 2/(1 x 2) x [2, 0] = [2, 0]
    # P = [(.75 + .5)/2, (.25 + .5)/2] = [.625, .375]: L = 2 x .625
    torch.testing.assert_close(sequence_balance_loss(scores, idx), torch.tensor([1.25]))
    # Two sequences are two losses; top-2 of 4 with a perfectly spread choice gives L = sum P = 1.
    scores = torch.tensor([[[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]], [[0.7, 0.1, 0.1, 0.1], [0.7, 0.1, 0.1, 0.1]]])
    idx = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [0, 1]]])  # seq 1: f = [2, 2, 0, 0], P = [.7, .1, .1, .1]
    torch.testing.assert_close(sequence_balance_loss(scores, idx), torch.tensor([1.0, 1.6]))


def test_balance_loss_split_over_context_parallel_halves_adds_up():
    torch.manual_seed(0)
    scores, idx = torch.rand(3, 8, 4), torch.randint(0, 4, (3, 8, 2))
    whole = sequence_balance_loss(scores, idx)  # (3,)

    def counts(s, i):
        return torch.zeros(3, 4).scatter_add_(1, i.reshape(3, -1), torch.ones(3, 8))

    both = counts(scores[:, :4], idx[:, :4]) + counts(scores[:, 4:], idx[:, 4:])  # what the cp all-reduce returns
    halves = [sequence_balance_loss(scores[:, h], idx[:, h], lambda c: both) for h in (slice(0, 4), slice(4, 8))]
    torch.testing.assert_close(halves[0] + halves[1], whole)


def test_balance_loss_gradient_reaches_the_router_with_the_step_scale():
    alpha, B, T = 0.3, 2, 6
    x, g = torch.randn(B, T, DIM), torch.randn(B, T, DIM)
    plain = make_moe()
    (plain(x) * g).sum().backward()
    moe = make_moe(aux_loss=alpha)
    set_balance_loss_scale(moe, sequences=8, loss_scale=4.0)  # e.g. 4 micro-batches of 2, fp16 scale 4
    out = moe(x)
    torch.testing.assert_close(out, plain(x))  # forward is unchanged
    (out * g).sum().backward()
    # Explicitly: the same main loss plus alpha x scale x (sum over these sequences) / 8.
    ref = make_moe()
    scores = ref.scores(x.view(-1, DIM))
    _, idx = ref.select(scores)
    aux = sequence_balance_loss(scores.view(B, T, -1), idx.view(B, T, -1))
    ((ref(x) * g).sum() + alpha * 4.0 * aux.sum() / 8).backward()
    extra = moe.router.weight.grad - plain.router.weight.grad
    assert extra.abs().max() > 1e-4  # the balance loss moved the router
    torch.testing.assert_close(moe.router.weight.grad, ref.router.weight.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(moe.experts.gate.grad, plain.experts.gate.grad)  # experts: main loss only
    assert float(moe.step_balance_loss) == pytest.approx(float(aux.detach().sum()))


# ---- counting: once per trained token ----------------------------------------------------------------------
def _count_each_token_once(rank, world):
    from fivefold.config.load import replace
    from fivefold.parallel.recompute import apply_recompute

    cfg = dataclasses.replace(PRESETS["tiny-moe"], vocab_size=64, n_layers=2,
                              moe=dataclasses.replace(PRESETS["tiny-moe"].moe, aux_loss=0.01))
    x = torch.randint(0, 64, (2, 16))
    per_block = 2 * 16 * cfg.moe.top_k
    grads = {}
    for mode in ("none", "full"):
        m = Transformer(cfg)
        m.init_weights(0)
        run_cfg = replace(Config(), train={"recompute": mode})
        apply_recompute(m, mesh_of(), run_cfg, derive(run_cfg, 1, unpadded_vocab(run_cfg)))
        cross_entropy_sum(m(x), x).backward()
        stats = expert_stats(m)
        assert all(sum(v) == per_block for v in stats.load.values()), (mode, stats.load)
        grads[mode] = m.layers["1"].ffn.router.weight.grad
        reset_expert_counts(m)
        with torch.no_grad():
            m(x)
        assert all(sum(v) == 0 for v in expert_stats(m).load.values()), "evaluation counted"
    torch.testing.assert_close(grads["full"], grads["none"], rtol=0, atol=0)  # aux gradient injected once
    # A zero-bubble pipeline's split backward: input gradients first, weights later, one graph.
    h = m.tok_embeddings(x).detach().requires_grad_()
    m.tok_embeddings = None
    out = cross_entropy_sum(m(h), x)
    torch.autograd.grad(out, h, retain_graph=True)
    torch.autograd.backward(out, inputs=[p for p in m.parameters()])
    assert all(sum(v) == per_block for v in expert_stats(m).load.values())
    assert math.isfinite(float(m.layers["0"].ffn.step_balance_loss))


def test_recompute_and_split_backward_count_each_token_once():
    run_workers(_count_each_token_once, 1)


# ---- whole training runs: the loop, expert gradients, norms, the bias update, checkpoints ----

# Losses and norms as in test_data_parallel.py. Weights 2e-4, not 1e-4: an expert sees only the
# few tokens routed to it, so many of its gradient elements are tiny and AdamW's normalisation
# turns summation-order differences into up to 1.1e-4 (measured for tp2 alone, without ep).
# The routing bias is compared exactly: it moves in +-0.01 steps from integer loads, so one
# token routed differently anywhere would show.
MOE_ROW = dict(reference="moe_reference", param_atol=2e-4, exact=("expert_bias",))
MOE_TRAINING = {  # on EQUIVALENCE and helpers.MOE_ARGS
    "ep2": Layout(2, ("--parallel.ep=2",), **MOE_ROW),
    "ep4": Layout(4, ("--parallel.ep=4", "--train.micro_batch=1"), **MOE_ROW),
    "tp2-ep2": Layout(4, ("--parallel.tp=2", "--parallel.ep=2"), **MOE_ROW),
    # sp: each tp rank routes its own half of every sequence (gradients, counts and balance loss summed over tp)
    "tp2-sp": Layout(2, ("--parallel.tp=2", "--parallel.sp=true"), **MOE_ROW),
    "tp2-sp-ep2": Layout(4, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.ep=2"), **MOE_ROW),
    # MoE under FSDP: the routing bias is a buffer it must keep
    "dp2-zero3": Layout(2, ("--parallel.zero=3",), **MOE_ROW),
    "pp2-ep2-zb_h1": Layout(4, ("--parallel.pp=2", "--parallel.ep=2", "--parallel.pp_schedule=zb_h1",
                                "--train.micro_batch=2"), **MOE_ROW),
    # ZeRO with experts: expert state sharded over expert_dp (2 ranks hold each half of the experts).
    "dp4-ep2-zero1": Layout(4, ("--parallel.ep=2", "--parallel.zero=1", "--train.micro_batch=1"), **MOE_ROW),
    "hsdp2x2-ep2-zero2": Layout(4, ("--parallel.ep=2", "--parallel.zero=2", "--parallel.dp_replicate=2",
                                    "--train.micro_batch=1"), **MOE_ROW),
    "dp4-ep2-zero3": Layout(4, ("--parallel.ep=2", "--parallel.zero=3", "--train.micro_batch=1"), **MOE_ROW),
    # Muon (helpers.MUON): each expert its own matrix, its rows gathered over expert_dp to its owner
    "dp4-ep2-zero1-muon": Layout(4, ("--parallel.ep=2", "--parallel.zero=1", "--train.micro_batch=1", *MUON),
                                 **{**MOE_ROW, "reference": "muon_moe_reference", "param_atol": 5e-4}),
    # DeepSeek-V3's recipe scaled down: ZeRO-1 + EP + PP (its DualPipe as DualPipeV).
    "pp2-ep2-zero1-dualpipe_v": Layout(4, ("--parallel.pp=2", "--parallel.ep=2", "--parallel.zero=1",
                                           "--parallel.pp_schedule=dualpipe_v", "--parallel.virtual_stages=2",
                                           "--train.micro_batch=1"), **MOE_ROW),
    # LoRA (helpers.LORA): the routed experts frozen (no adapter: stacked weights), sharded over expert_dp
    # under ZeRO-3 and never reduced; the attention's and shared experts' adapters train
    "tp2-ep2-zero3-lora": Layout(4, ("--parallel.tp=2", "--parallel.ep=2", "--parallel.zero=3", *LORA),
                                 reference="lora_moe_reference", param_atol=2e-4, exact=(".weight", ".experts.gate")),
    # bf16 autocast (helpers.BF16): tokens dispatched and combined in bf16, sp's routing on half rows
    "tp2-sp-ep2-bf16": Layout(4, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.ep=2", *BF16), **MOE_ROW),
}


@pytest.mark.parametrize("name", MOE_TRAINING)
def test_training_reproduces_single_process(tmp_path, request, name):
    layout = MOE_TRAINING[name]
    assert_layout_reproduces(request, tiny_config(tmp_path, *EQUIVALENCE, *MOE_ARGS, *layout.overrides), layout)


def _train_losses(rank, world, cfg):
    from fivefold.train.loop import train

    return train(cfg, progress=False).losses


@pytest.mark.parametrize("before,after", [
    ((2, "--parallel.ep=2", "--parallel.zero=0"), (2, "--parallel.ep=1", "--parallel.zero=0")),
    # ZeRO-3's expert shards (Shard(1) over expert_dp x Shard(0) over ep) into ZeRO-1 at ep 4.
    ((4, "--parallel.ep=2", "--parallel.zero=3"), (4, "--parallel.ep=4", "--parallel.zero=1")),
], ids=["ep2-to-ep1", "ep2-zero3-to-ep4-zero1"])
def test_checkpoint_resumes_under_another_expert_layout(tmp_path, before, after):
    """Each ep rank writes its experts as shards of one (E, ...) tensor (with ZeRO, shards of
    those), so a run saved at one ep and ZeRO stage resumes at another (the loader reads the
    experts it needs from the saved ranks' shards); the routing bias (a buffer, moved every step)
    is saved and restored with the weights."""
    import shutil

    from fivefold.checkpoint.run_state import complete_checkpoints

    args = (*EQUIVALENCE, *MOE_ARGS, "--train.steps=4", "--checkpoint.every=2", "--checkpoint.keep=2",
            "--train.micro_batch=1")
    losses = run_workers(_train_losses, before[0], tiny_config(tmp_path, *args, *before[1:]))[0]
    shutil.rmtree(complete_checkpoints(tmp_path / "tiny")[-1])
    resumed = run_workers(_train_losses, after[0],
                          tiny_config(tmp_path, *args, *after[1:], "--checkpoint.resume=true"))[0]
    # The same sums in another order (1e-5, as everywhere).
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[2:]), rtol=1e-5, atol=0)


def _save_and_load_routing_bias(rank, world, cfg, root):
    from fivefold.checkpoint.run_state import CheckpointWriter, latest_checkpoint, load_checkpoint

    def fresh():
        return parallelized(cfg, world)

    par = fresh()
    biases = [m.expert_bias for m in par.model.modules() if isinstance(m, MoE)]
    for i, b in enumerate(biases):
        b.copy_(torch.arange(len(b)) * 0.1 + i)  # what bias balancing would have moved it to
    CheckpointWriter(root, keep=1).save(1, par, {"loader": {}})
    again = fresh()
    load_checkpoint(latest_checkpoint(root), again)
    return [m.expert_bias.tolist() for m in again.model.modules() if isinstance(m, MoE)] == [b.tolist() for b in biases]


def test_zero3_saves_and_restores_the_routing_bias(tmp_path):
    """FSDP keeps persistent buffers beside its parameter shards; it once dropped them."""
    cfg = tiny_config(tmp_path, *MOE_ARGS, "--parallel.zero=3")
    assert run_workers(_save_and_load_routing_bias, 2, cfg, tmp_path / "run") == [True, True]


def _load_at_step_50(rank, world, cfg):
    from fivefold.train.loop import train
    from fivefold.train.metrics import read_metrics

    result = train(cfg, progress=False)
    last = read_metrics(result.run_dir / "metrics.jsonl")[-1]
    ratios = last["expert_max_over_mean"]
    return sum(ratios.values()) / len(ratios)


def test_bias_balancing_lowers_the_load_imbalance_at_step_50(tmp_path):
    """Same seed and data, 50 steps on the standard-library corpus (a 2-block tiny-moe, so the test
    stays quick): the routing bias (u = 0.01)
    leaves the busiest expert less over-loaded than no balancing (mean of max/mean over blocks)."""
    args = ("--model.preset=tiny-moe", "--model.n_layers=2", "--train.steps=50", "--optim.lr=3e-3",
            "--train.micro_batch=8", "--data.max_bytes=100000", "--train.log_every=50", "--data.val_fraction=0")
    plain = run_workers(_load_at_step_50, 1, tiny_config(tmp_path / "plain", *args))[0]
    biased = run_workers(_load_at_step_50, 1, tiny_config(tmp_path / "bias", *args, "--model.moe.bias_update=0.01"))[0]
    print(f"max/mean expert load at step 50: no balancing {plain:.3f}, bias {biased:.3f}")
    assert biased < plain
