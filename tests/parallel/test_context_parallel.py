"""Context parallel: layouts by counting, then ring attention and Ulysses against one process.

Every multi-process case computes the unsharded `causal_attention` (or the whole model) on the
full sequence in the same worker and compares this rank's tokens of it, picked by the layout's true
positions, with what the cp ranks computed: outputs, and Q/K/V gradients from a random upstream
gradient. The cp=2 cases run as dp2 x cp2 on 4 ranks, so two rings run side by side on different
data and a group rank differs from the global rank a point-to-point send must address.

Tolerance 1e-5 (fp32): the ring sums the same products in another order (per chunk, merged by
log-sum-exp rescaling) than the fused local kernel, so results agree to rounding (at most 1.2e-6
measured), not bit for bit; Ulysses runs the same local kernel per head and measured bit-exact, but
keeps the tolerance since nothing promises that kernel's order is independent of the head count. A
wrong mask or merge is off by ~1e-1 or more (the wrong-layout case: 2.2).
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    BF16,
    EQUIVALENCE,
    LORA,
    LORA_ROW,
    MUON,
    MUON_ROW,
    Layout,
    assert_layout_reproduces,
    mesh_of,
    tiny_config,
)

from fivefold.config.derive import derive
from fivefold.config.load import replace
from fivefold.config.schema import Config
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.attention import attend, causal_attention
from fivefold.model.config import AttentionConfig, ModelConfig
from fivefold.model.masks import AttentionMask, Documents, dense_attention, document_ids
from fivefold.model.transformer import Transformer, cross_entropy_sum
from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup, CommStats
from fivefold.parallel.context import (
    ContextParallel,
    apply_context_parallel,
    attention_work,
    positions,
    ring_attention,
    shard_sequence,
    ulysses_attention,
)
from fivefold.parallel.forked_ranks import run_workers

TOL = dict(atol=1e-5, rtol=1e-5)  # fp32, reordered sums (module docstring)
B, T, D = 2, 32, 8


# ---- layouts: pure counting, no processes ----


def test_attention_work_balances_with_zigzag():
    assert attention_work(16, 4, "contiguous") == [10, 26, 42, 58]
    assert attention_work(16, 4, "zigzag") == [34, 34, 34, 34]
    assert sum(attention_work(16, 4, "zigzag")) == 16 * 17 // 2  # every causal pair once


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_positions_of_all_ranks_are_a_permutation(cp, layout):
    seq = 48
    every = torch.cat([positions(seq, cp, r, layout) for r in range(cp)])
    assert sorted(every.tolist()) == list(range(seq))
    x = torch.arange(seq).repeat(2, 1)  # (2, T): shard picks exactly the listed positions
    assert torch.equal(shard_sequence(x, cp, cp - 1, layout), x[:, positions(seq, cp, cp - 1, layout)])


def test_zigzag_pairs_an_early_chunk_with_a_late_one():
    assert positions(16, 4, 1, "zigzag").tolist() == [2, 3, 12, 13]
    with pytest.raises(ValueError, match="18 is not divisible by 8"):
        positions(18, 4, 0, "zigzag")
    with pytest.raises(ValueError, match="unknown cp_method"):
        ContextParallel(AxisGroup("cp", "cp", None, 1, 0, CommStats()), "stripes")


def _qkv(H, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, H, D, generator=g), torch.randn(B, T, K, D, generator=g),
            torch.randn(B, T, K, D, generator=g), torch.randn(B, T, H, D, generator=g))


def _grads(fn, q, k, v, dout):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_cp1_is_local_attention_without_communication(method):
    group = AxisGroup("cp", "cp", None, 1, 0, CommStats())  # size 1: no process group is touched
    cp = ContextParallel(group, method)
    q, k, v, dout = _qkv(4, 2)
    assert torch.equal(cp.positions(T), torch.arange(T)) and torch.equal(cp.shard(q), q)
    for ours, ref in zip(_grads(cp.core, q, k, v, dout), _grads(causal_attention, q, k, v, dout), strict=True):
        torch.testing.assert_close(ours, ref, **TOL)
    assert group.stats.snapshot() == {}


def test_ulysses_names_indivisible_heads():
    group = AxisGroup("cp", "cp", None, 4, 0, CommStats())  # the check runs before any communication
    q, k, v, _ = _qkv(4, 2)
    with pytest.raises(ValueError, match="4 query heads and 2 key/value heads.*divisible by 4"):
        ulysses_attention(q[:, :8], k[:, :8], v[:, :8], group)


# ---- ring attention and Ulysses on gloo ranks ----

# name -> (method, layout the data is sharded with, layout the ring is told, H, K)
CASES = {
    2: {"ring": ("ring", "zigzag", "zigzag", 4, 2),
        "ring-contiguous": ("ring", "contiguous", "contiguous", 4, 2),
        "ulysses": ("ulysses", "contiguous", None, 4, 2),
        "wrong-layout": ("ring", "zigzag", "contiguous", 4, 2)},  # chunk pairs judged by wrong positions
    4: {"ring": ("ring", "zigzag", "zigzag", 4, 2),
        "ulysses": ("ulysses", "contiguous", None, 8, 4)},
}


def _attention_worker(rank, world, cp):
    mesh = mesh_of(dp_shard=world // cp, cp=cp)
    group = mesh.group("cp")
    results = {}
    for name, (method, data_layout, ring_layout, H, K) in CASES[cp].items():
        q, k, v, dout = _qkv(H, K, seed=mesh.rank("dp"))  # each ring its own data
        ref = _grads(causal_attention, q, k, v, dout)
        full = torch.softmax(torch.einsum("bqhd,bthd->bhqt", q, k.repeat_interleave(H // K, 2)) * D ** -0.5, -1)
        non_causal = torch.einsum("bhqt,bthd->bqhd", full, v.repeat_interleave(H // K, 2))
        mine = positions(T, cp, group.rank, data_layout)
        if ring_layout is None:
            fn = ContextParallel(group, method).core
        else:
            fn = functools.partial(ring_attention, group=group, layout=ring_layout)
        q_l, k_l, v_l = (x[:, mine].clone().requires_grad_() for x in (q, k, v))
        mesh.stats.reset()
        out = fn(q_l, k_l, v_l)
        forward_stats = mesh.stats.snapshot()
        out.backward(dout[:, mine])
        results[name] = {
            "pairs": list(zip(["output", "dq", "dk", "dv"], [out.detach(), q_l.grad, k_l.grad, v_l.grad],
                              [x[:, mine] for x in ref], strict=True)),
            "non_causal": non_causal[:, mine],
            "forward": forward_stats.get("cp"), "total": mesh.stats.snapshot().get("cp"),
        }
    return results


@functools.cache
def _attention_results(cp):
    return run_workers(_attention_worker, 4, cp)


LAYOUTS = [(2, "ring"), (2, "ring-contiguous"), (2, "ulysses"), (4, "ring"), (4, "ulysses")]


@pytest.mark.parametrize("cp,name", LAYOUTS, ids=[f"cp{c}-{n}" for c, n in LAYOUTS])
def test_matches_unsharded_attention(cp, name):
    for rank, res in enumerate(_attention_results(cp)):
        for what, ours, ref in res[name]["pairs"]:
            torch.testing.assert_close(ours, ref, **TOL, msg=f"rank {rank}: {what}")
        # Non-trivial: causal differs visibly from attending to every key.
        assert (res[name]["pairs"][0][1] - res[name]["non_causal"]).abs().max() > 0.1


def test_a_wrong_mask_is_caught():
    """Zigzag data judged as contiguous: the ring masks and skips the wrong chunk pairs."""
    for res in _attention_results(2):
        _, ours, ref = res["wrong-layout"]["pairs"][0]
        assert (ours - ref).abs().max() > 0.1


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_moves_cp_minus_one_kv_blocks(cp):
    K = CASES[cp]["ring"][4]
    block = 2 * B * (T // cp) * K * D * 4  # K and V of T/cp tokens, fp32
    for res in _attention_results(cp):
        fwd, total = res["ring"]["forward"], res["ring"]["total"]
        assert fwd["calls"] == cp - 1 and fwd["bytes"] == (cp - 1) * block
        # Backward: the K/V blocks again (cp-1 hops) and the fp32 dK/dV buffers (cp hops, home).
        assert total["calls"] == 3 * cp - 2 and total["bytes"] == (3 * cp - 2) * block


@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_all_to_all_bytes(cp):
    _, _, _, H, K = CASES[cp]["ulysses"]
    payload = B * (T // cp) * (H + 2 * K) * D * 4 + B * (T // cp) * H * D * 4  # q,k,v in; out back
    for res in _attention_results(cp):
        fwd, total = res["ulysses"]["forward"], res["ulysses"]["total"]
        assert fwd["calls"] == 2 and fwd["bytes"] == payload
        assert fwd["wire_bytes"] == pytest.approx((cp - 1) / cp * payload)
        assert total["calls"] == 4 and total["bytes"] == 2 * payload  # backward: the inverse pair


# ---- documents, sliding windows and sinks under cp ----

WINDOW = 5


def _masked_worker(rank, world, cp):
    """Ring (zig-zag) and Ulysses with documents + a window + sinks, against the rule written out
    densely on the whole sequence (masks.dense_attention), in fp64: outputs, q/k/v gradients, and
    the sinks' gradient summed over cp (each rank's queries add their share). Also the chunk pairs
    ring attention skipped, with the mask and without."""
    mesh = mesh_of(dp_shard=world // cp, cp=cp)
    group = mesh.group("cp")
    H, K = CASES[cp]["ulysses"][3:]  # heads Ulysses can split over cp
    q, k, v, dout = (x.double() for x in _qkv(H, K, seed=mesh.rank("dp")))
    g = torch.Generator().manual_seed(mesh.rank("dp"))
    doc = document_ids(torch.randint(0, 6, (B, T), generator=g), 0)  # (B, T) of whole rows: every rank has them
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    results = {}
    for method in ("ring", "ulysses"):
        cp_core = ContextParallel(group, method)
        mine = positions(T, cp, group.rank, cp_core.layout)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
        ref = dense_attention(*leaves[:3], AttentionMask(doc, WINDOW, leaves[3]))
        ref.backward(dout)
        local = [x[:, mine].clone().requires_grad_() for x in (q, k, v)]
        own_sinks = sinks.clone().requires_grad_()
        mesh.stats.reset()
        out = cp_core.core(*local, AttentionMask(doc, WINDOW, own_sinks))
        out.backward(dout[:, mine])
        moved = mesh.stats.snapshot().get("cp")
        collectives.all_reduce(own_sinks.grad, group)
        plain = ContextParallel(group, method)
        plain.core(*(x[:, mine] for x in (q, k, v)))
        results[method] = {
            "pairs": list(zip(["output", "dq", "dk", "dv", "dsinks"],
                              [out.detach(), *(x.grad for x in local), own_sinks.grad],
                              [ref.detach()[:, mine], *(x.grad[:, mine] for x in leaves[:3]), leaves[3].grad],
                              strict=True)),
            "causal": dense_attention(q, k, v)[:, mine],
            "blocks": cp_core.take_blocks(), "plain_blocks": plain.take_blocks(),
            "moved": moved,
        }
    return results


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_documents_windows_and_sinks_under_cp(cp, method):
    for rank, res in enumerate(_masked_results(cp)):
        for what, ours, ref in res[method]["pairs"]:
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12, msg=f"rank {rank}: {what}")
        assert (res[method]["pairs"][0][1] - res[method]["causal"]).abs().max() > 0.05  # the mask matters


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_skips_what_the_mask_empties(cp):
    """Zig-zag causal attention skips the later chunks: query chunk a meets 2cp - 1 - a of them, so
    chunks r and 2cp - 1 - r skip 2cp - 1 pairs together. A window of 5 over chunks of 8 or 4
    tokens empties every pair more than one chunk apart, yet every K/V block still travels."""
    for res in _masked_results(cp):
        blocks, plain = res["ring"]["blocks"], res["ring"]["plain_blocks"]
        assert blocks["computed"] + blocks["skipped"] == plain["computed"] + plain["skipped"] == 2 * 2 * cp
        assert plain["skipped"] == 2 * cp - 1
        assert blocks["skipped"] > plain["skipped"]
        block = 2 * B * (T // cp) * CASES[cp]["ulysses"][4] * D * 8  # K and V of T/cp tokens, fp64
        assert res["ring"]["moved"]["bytes"] == (3 * cp - 2) * block  # as without a mask


@functools.cache
def _masked_results(cp):
    return run_workers(_masked_worker, 4, cp)


# ---- bf16 autocast: forward and backward agree ----

def _bf16_worker(rank, world, masked):
    """Ring attention at cp = 2 in bf16 autocast (q, k, v bf16, as a linear layer under autocast makes
    them), and one process's local attention in bf16 autocast, each measured against the fp64 truth:
    relative errors (Frobenius) of the output and of the q/k/v gradients (summed over cp)."""
    mesh = mesh_of(cp=world)
    group = mesh.group("cp")
    H, K, Tb, Db = 4, 2, 64, 16
    g = torch.Generator().manual_seed(0)
    q, dout = torch.randn(B, Tb, H, Db, generator=g), torch.randn(B, Tb, H, Db, generator=g)
    k, v = torch.randn(B, Tb, K, Db, generator=g), torch.randn(B, Tb, K, Db, generator=g)
    mask = AttentionMask(document_ids(torch.randint(0, 12, (B, Tb), generator=g), 0), 9) if masked else None
    mine = positions(Tb, world, group.rank, "zigzag")
    truth = [x.double().requires_grad_() for x in (q, k, v)]
    ref = dense_attention(*truth, mask)
    ref.backward(dout.double())
    truth = [ref.detach()[:, mine]] + [x.grad for x in truth]

    def errors(core, rows):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with torch.autocast("cpu", torch.bfloat16):
            out = core(*(x[:, rows].to(torch.bfloat16) for x in leaves), mask)
        out.float().backward(dout[:, rows])
        whole = len(rows) == Tb  # one process; else this rank's rows, its gradients a part of the sum
        for x in leaves if not whole else []:
            collectives.all_reduce(x.grad, group)
        ours = [out.detach().double()[:, mine if whole else slice(None)]] + [x.grad.double() for x in leaves]
        return [float((a - b).norm() / b.norm()) for a, b in zip(ours, truth, strict=True)]

    return {"ring": errors(ContextParallel(group, "ring").core, mine),
            "one": errors(attend, torch.arange(Tb))}


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "documents+window"])
def test_ring_in_bf16_is_as_accurate_as_one_process(masked):
    """Each tile's forward and backward run one kernel pair in bf16, merged in fp32: ring attention's
    error against the fp64 truth stays within 1.5x one process's (measured 0.93-1.06x: one more bf16
    rounding of each tile's output before the merge). The fp32 backward of bf16 forward scores that
    this replaced recomputed other probabilities than the forward summed: 2.0-3.2x (measured)."""
    for res in run_workers(_bf16_worker, 2, masked):
        for what, ring, one in zip(["output", "dq", "dk", "dv"], res["ring"], res["one"], strict=True):
            assert one < 0.02, what  # bf16's own rounding: ~2^-8 relative
            assert ring <= 1.5 * one, f"{what}: ring {ring:.2e} against one process's {one:.2e}"


# ---- the whole model ----


def _model_worker(rank, world, method):
    mesh = mesh_of(cp=world)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64)
    torch.manual_seed(0)
    ref = Transformer(cfg)
    ref.init_weights(0)
    ids = torch.randint(0, 64, (B, T + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = ids[:, :-1], ids[:, 1:]  # shifted on the full sequence, then sharded
    logits_ref = ref(inputs)
    (cross_entropy_sum(logits_ref, targets) / targets.numel()).backward()

    model = Transformer(cfg)
    model.load_state_dict(ref.state_dict())
    run_cfg = replace(Config(), parallel={"cp": world, "cp_method": method})
    cp = apply_context_parallel(model, mesh, run_cfg, derive(run_cfg, world, unpadded_vocab(run_cfg)))
    logits = model(cp.shard(inputs), positions=cp.positions(T))  # (B, T/cp, V)
    (cross_entropy_sum(logits, cp.shard(targets)) / targets.numel()).backward()  # global token count
    pairs = [("logits", logits.detach(), cp.shard(logits_ref.detach()))]
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        collectives.all_reduce(p.grad, mesh.group("cp"))  # cp ranks hold parts of the same samples: sum
        pairs.append((name, p.grad, p_ref.grad))
    return pairs


def _packed_worker(rank, world, method):
    """A packed row of three documents (eod 63) through the model on cp ranks, with documents,
    per-document positions, a window of 3 on the first block and sinks on both, against each
    document run alone on one process without any mask: per-token losses (this rank's tokens) and
    parameter gradients (summed over cp). Also the same row under cp without the document mask."""
    mesh = mesh_of(cp=world)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                      attention=AttentionConfig(window=3, window_pattern=("sliding", "full"), sinks=True))
    model = Transformer(cfg)
    model.init_weights(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 63, (1, T + 1), generator=torch.Generator().manual_seed(2))
    spans = [(0, 11), (11, 25), (25, 32)]
    for _, end in spans:
        ids[0, end - 1] = 63
    inputs, targets = ids[:, :-1], ids[:, 1:]

    def losses_and_grads(m, x, y, positions, doc):
        m.zero_grad()
        per_token = F.cross_entropy(m(x, positions, doc=doc).flatten(0, 1), y.flatten(), reduction="none")
        per_token.sum().backward()
        return per_token.detach(), [p.grad.clone() for p in m.parameters()]

    alone, alone_grads = [], None
    for start, end in spans:
        losses, grads = losses_and_grads(model, inputs[:, start:end], targets[:, start:end],
                                         torch.arange(end - start), None)
        alone.append(losses)
        alone_grads = grads if alone_grads is None else [a + g for a, g in zip(alone_grads, grads, strict=True)]
    run_cfg = replace(Config(), parallel={"cp": world, "cp_method": method})
    cp = apply_context_parallel(model, mesh, run_cfg, derive(run_cfg, world, unpadded_vocab(run_cfg)))
    positions, doc = Documents(63, mask=True, reset_positions=True).inputs(inputs, torch.arange(T))
    local = cp.shard(positions, dim=-1)  # (1, T/cp): the row's per-document positions, this rank's part
    packed, grads = losses_and_grads(model, cp.shard(inputs), cp.shard(targets), local, doc)
    for g in grads:
        collectives.all_reduce(g, mesh.group("cp"))
    unmasked, _ = losses_and_grads(model, cp.shard(inputs), cp.shard(targets), local, None)
    mine = cp.positions(T)
    return packed, torch.cat(alone)[mine], grads, alone_grads, unmasked


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_a_packed_row_under_cp_is_its_documents_alone(method):
    for packed, alone, grads, alone_grads, unmasked in run_workers(_packed_worker, 2, method):
        torch.testing.assert_close(packed, alone, rtol=0, atol=2e-6)  # fp32, other summation orders
        for ours, ref in zip(grads, alone_grads, strict=True):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        assert (unmasked - alone).abs().max() > 1e-3  # without the mask documents see each other


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_transformer_matches_one_process(method):
    for rank, pairs in enumerate(run_workers(_model_worker, 2, method)):
        for name, ours, ref in pairs:
            torch.testing.assert_close(ours, ref, **TOL, msg=f"rank {rank}: {name}")


# ---- whole training runs: the loop, the data sharding, RoPE positions and gradient sums ----

# Losses and norms as in test_data_parallel.py. Parameters: 5e-4 where DP needs 1e-4, because
# attention itself is computed differently (blocks merged by log-sum-exp, not one fused kernel:
# ~1e-6 relative, see TOL above), and step 4 of this data is a loss spike (gradient norm 45,
# clipped to 1) after which AdamW turns those differences into up to 1.5e-4 (ring, measured)
# in a few weights. The one-step test above bounds the model's logits and gradients at 1e-5.
TRAINING = {  # against `reference`, on EQUIVALENCE: the same data and reference as test_data_parallel.py
    "ring-cp4": Layout(4, ("--parallel.cp=4", "--train.micro_batch=4"), param_atol=5e-4),
    "ulysses-cp2": Layout(2, ("--parallel.cp=2", "--parallel.cp_method=ulysses"), param_atol=5e-4),
    "ring-dp2-cp2-zero3": Layout(4, ("--parallel.cp=2", "--parallel.zero=3"), param_atol=5e-4),
    # Muon (helpers.MUON): cp's ranks hold the same shards, each orthogonalises them (replicas)
    "ring-dp2-cp2-zero1-muon": Layout(4, ("--parallel.cp=2", "--parallel.zero=1", *MUON), **MUON_ROW),
    "ring-cp2-lora": Layout(2, ("--parallel.cp=2", *LORA), **LORA_ROW),  # LoRA (helpers.LORA)
    "ring-pp2-cp2": Layout(4, ("--parallel.cp=2", "--parallel.pp=2", "--parallel.dp=1", "--train.micro_batch=4"),
                           param_atol=5e-4),
    "ring-tp2-sp-cp2": Layout(4, ("--parallel.cp=2", "--parallel.tp=2", "--parallel.sp=true", "--parallel.dp=1",
                                  "--train.micro_batch=4"), param_atol=5e-4),
    # bf16 autocast (helpers.BF16): Ulysses' bf16 all-to-alls (the ring's bf16 tiles merged in fp32: the
    # masks table's bf16 row, every tile kind)
    "ulysses-cp2-bf16": Layout(2, ("--parallel.cp=2", "--parallel.cp_method=ulysses", *BF16)),
}


@pytest.mark.parametrize("name", TRAINING)
def test_training_reproduces_single_process(tmp_path, request, name):
    layout = TRAINING[name]
    assert_layout_reproduces(request, tiny_config(tmp_path, *EQUIVALENCE, *layout.overrides), layout)
