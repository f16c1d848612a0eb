"""Tensor and sequence parallel: each layer, then the whole model, against the unsharded one."""

import pytest
import torch
from helpers import (
    BF16,
    EQUIVALENCE,
    LORA,
    LORA_MLA_TARGETS,
    LORA_ROW,
    MLA_ARGS,
    MUON,
    MUON_ROW,
    TIED_ARGS,
    Layout,
    assert_layout_reproduces,
    assert_row,
    loss_traffic,
    mesh_of,
    parallelized,
    tiny_config,
    train_and_gather,
)

from fivefold.data.resolve import unpadded_vocab
from fivefold.model.head import OutputHead, VocabSplit
from fivefold.model.transformer import cross_entropy_sum
from fivefold.parallel.forked_ranks import run_workers
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    enter_tensor_parallel_region,
)


def _linear_pair(rank, world, sp):
    """enter region -> column parallel -> x2 -> row parallel, against the unsharded pair."""
    group = mesh_of(tp=world).group("tp")
    torch.manual_seed(0)
    col, row = torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 8, bias=False)
    x, r = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    x_ref = x.clone().requires_grad_()
    y_ref = row(col(x_ref) * 2.0)  # (2, 4, 8)
    (y_ref * r).sum().backward()
    mine = slice(rank * 4 // world, (rank + 1) * 4 // world) if sp else slice(None)  # sp: this rank's tokens
    pcol, prow = ColumnParallelLinear(col, group, sp), RowParallelLinear(row, group, sp)
    x_in = x[:, mine].clone().requires_grad_()
    y = prow(pcol(enter_tensor_parallel_region(x_in, group, sp)) * 2.0)  # (2, T/tp with sp else T, 8)
    (y * r[:, mine]).sum().backward()  # with sp the ranks' losses add up to the reference loss
    return [(y, y_ref[:, mine]), (x_in.grad, x_ref.grad[:, mine]),
            (pcol.weight.grad, col.weight.grad.chunk(world, 0)[rank]),
            (prow.weight.grad, row.weight.grad.chunk(world, 1)[rank])]


@pytest.mark.parametrize("world,sp", [(2, False), (4, False), (2, True), (4, True)])
def test_column_and_row_parallel_match_the_unsharded_layers(world, sp):
    for pairs in run_workers(_linear_pair, world, sp):
        for name, (ours, ref) in zip(["output", "input grad", "column grad", "row grad"], pairs, strict=True):
            torch.testing.assert_close(ours.detach(), ref.detach(), atol=1e-5, rtol=1e-5, msg=name)


def _vocab(rank, world, sp):
    """Vocabulary-parallel embedding and head with the vocab-parallel loss in chunks of 3 tokens (8 in
    all: an uneven last chunk), against torch's cross-entropy over the unsharded logits."""
    group = mesh_of(tp=world).group("tp")
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(12, 8), OutputHead(8, 12)
    tokens, targets = torch.randint(0, 12, (2, 4)), torch.randint(0, 12, (2, 4))
    targets[0, 0] = -100  # padding counts nothing
    loss_ref = cross_entropy_sum(head(emb(tokens)), targets)
    loss_ref.backward()
    pemb, phead = VocabParallelEmbedding(emb, group, sp), VocabParallelHead(head, group, sp, 12)
    logits = phead(pemb(tokens))  # (2, 4, 12/tp)
    loss = phead(pemb(tokens), targets, chunk=3).sum()  # with sp it gathers the sequence: targets are whole rows
    loss.backward()
    return (logits.shape[-1], float(loss), float(loss_ref), (pemb.weight.grad, emb.weight.grad.chunk(world, 0)[rank]),
            (phead.weight.grad, head.weight.grad.chunk(world, 0)[rank]))


@pytest.mark.parametrize("world,sp", [(2, False), (4, False), (2, True)])
def test_vocab_parallel_embedding_head_and_loss(world, sp):
    for width, loss, loss_ref, emb_grads, head_grads in run_workers(_vocab, world, sp):
        assert width == 12 // world  # no rank holds logits over the whole vocabulary
        assert loss == pytest.approx(loss_ref, rel=1e-6)
        torch.testing.assert_close(*emb_grads, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(*head_grads, atol=1e-5, rtol=1e-5)


def _latent_attention_model(rank, world, cfg, sp):
    """A dense 2-block latent-attention model under tp (and sp) against the same model whole: logits,
    and every gradient (replicated ones whole on each rank, split ones as this rank's slice)."""
    from fivefold.config.derive import derive
    from fivefold.config.load import replace
    from fivefold.parallel.tensor import apply_tensor_parallel
    from fivefold.train.loop import build_model

    cfg = replace(cfg, parallel={"tp": world, "sp": sp, "dp": 1})
    derived = derive(cfg, world, unpadded_vocab(cfg))
    ref, model = build_model(cfg, 320), build_model(cfg, 320)
    torch.manual_seed(0)
    x, r = torch.randint(0, 320, (2, 16)), torch.randn(2, 16, 320)
    (ref(x) * r).sum().backward()
    apply_tensor_parallel(model, Mesh.from_config(cfg, derived), cfg, derived)
    logits = model(x, torch.arange(16))  # (2, 16, 320/tp); explicit positions: with sp blocks hold T/tp
    mine = r.chunk(world, -1)[rank]
    (logits * mine).sum().backward()  # the ranks' sums add up to the reference's
    grads = dict(ref.named_parameters())
    pairs = [("logits", logits, ref(x).chunk(world, -1)[rank])]
    for name, p in model.named_parameters():
        whole = grads[name].grad
        pairs.append((name, p.grad, whole.chunk(world, p.tp_dim)[rank] if hasattr(p, "tp_dim") else whole))
    return pairs


@pytest.mark.parametrize("sp,q_lora", [(False, 48), (True, 48), (True, 0)], ids=["tp2", "tp2-sp", "tp2-sp-q-direct"])
def test_latent_attention_splits_heads_and_keeps_down_projections_whole(tmp_path, sp, q_lora):
    cfg = tiny_config(tmp_path, "--model.preset=tiny-mla", "--model.moe.n_experts=0", "--model.n_layers=2",
                      f"--model.latent.q_lora_rank={q_lora}")
    for rank, pairs in enumerate(run_workers(_latent_attention_model, 2, cfg, sp)):
        assert any("wkv_a" in name for name, _, _ in pairs)
        for name, ours, ref in pairs:
            # fp32 sums over tp in another order: measured <= 6.1e-7 of the tensor's largest entry (the
            # gradients reach ~70: 2 x 16 x 320 random cotangents). A missing sum over tp is off by
            # a whole rank's share.
            torch.testing.assert_close(ours.detach(), ref.detach(), atol=5e-6 * float(ref.abs().max()), rtol=0,
                                       msg=f"rank {rank}: {name}")


# fp32 summation order differs (row-parallel partial sums, split vocabulary sums), and AdamW
# amplifies it on near-zero gradients (see test_data_parallel.py). Measured: losses <= 5.6e-7
# relative, grad norms <= 5.4e-5, parameters <= 1.03e-4 (one element of a down projection,
# dp2-tp2; tp2 alone 9.0e-5): the parameter bound is 3x that. A wrong shard, a missing
# reduction or a per-rank loss moves losses by percents.
# Tied, against `tied_reference` at lr 1e-3 (helpers.TIED_ARGS): measured parameters <= 7.1e-7
# (tp2-sp, pp2-tp2), so 1e-5.
TIED = dict(reference="tied_reference", param_atol=1e-5)
LAYOUTS = {  # on EQUIVALENCE, or TIED_ARGS for the tied ones
    "tp2": Layout(2, ("--parallel.tp=2", "--train.micro_batch=4"), param_atol=3e-4),
    "tp2-sp-tied": Layout(2, ("--parallel.tp=2", "--parallel.sp=true", "--train.micro_batch=4"), **TIED),
    "pp2-tp2-tied": Layout(4, ("--parallel.tp=2", "--parallel.pp=2", "--train.micro_batch=2"), **TIED),
    "tp4": Layout(4, ("--parallel.tp=4", "--train.micro_batch=8"), param_atol=3e-4),
    "tp2-sp": Layout(2, ("--parallel.tp=2", "--parallel.sp=true", "--train.micro_batch=4"), param_atol=3e-4),
    "pp2-tp2": Layout(4, ("--parallel.tp=2", "--parallel.pp=2", "--train.micro_batch=2"), param_atol=3e-4),
    "dp2-tp2-zero1": Layout(4, ("--parallel.tp=2", "--parallel.zero=1", "--train.micro_batch=2"), param_atol=3e-4),
    "dp2-tp2-sp-zero3": Layout(4, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.zero=3",
                                   "--train.micro_batch=2"), param_atol=3e-4),
    "pp2-tp2-sp-zb": Layout(4, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.pp=2",
                                "--parallel.pp_schedule=zb_h1", "--train.micro_batch=2"), param_atol=3e-4),
    # Muon (helpers.MUON): each matrix's tp slices, and ZeRO's rows of them, gathered to one owner
    "dp2-tp2-sp-zero1-muon": Layout(4, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.zero=1",
                                        "--train.micro_batch=2", *MUON), **MUON_ROW),
    # LoRA (helpers.LORA): each adapter split as its layer (column: B's rows; row: A's columns), the whole
    # factor's gradient summed over tp; under ZeRO-3 beside the frozen base's shards (with Muon the adapters
    # are matrices like any, B's slices gathered to their owner: test_muon.py's one-step row, bit for bit)
    "tp2-lora": Layout(2, ("--parallel.tp=2", "--train.micro_batch=8", *LORA), **LORA_ROW),
    "dp2-tp2-sp-zero1-lora": Layout(4, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.zero=1",
                                        "--train.micro_batch=2", *LORA), **LORA_ROW),
    "dp2-tp2-sp-zero3-lora-bf16": Layout(4, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.zero=3",
                                             "--train.micro_batch=2", *LORA, *BF16), reference="lora_reference"),
    # bf16 autocast (helpers.BF16): the split vocabulary's loss on bf16 logits, tp's partial sums rounded to
    # bf16, sp, and a split backward, composed (tp2 + sp alone: test_tp_overlap.py's bf16 row, the blocking
    # path's numbers bit for bit)
    "pp2-tp2-sp-zb-bf16": Layout(4, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.pp=2",
                                     "--parallel.pp_schedule=zb_h1", "--train.micro_batch=2", *BF16)),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_tensor_parallel_reproduces_single_process(tmp_path, request, name):
    layout = LAYOUTS[name]
    tied = layout.reference == "tied_reference"
    args = (*(TIED_ARGS if tied else EQUIVALENCE), *layout.overrides)
    for result in run_workers(train_and_gather, layout.ranks, tiny_config(tmp_path, *args)):
        assert_row(request, result, layout)
        if tied:  # one matrix in every slice, and on both pipeline ends
            assert torch.equal(result[2]["tok_embeddings.weight"], result[2]["output.weight"])


# DeepSeek-V3's architecture in miniature (helpers.MLA_ARGS) against its own one process.
# Measured: losses <= 3.0e-7 relative, grad norms <= 3.4e-6, parameters <= 2.4e-5 (cp2-ring;
# tp2-ep2 2.3e-5, tp2 1.9e-5, cp2-ulysses 7.2e-6): the bound is 4x that. The routing bias
# exactly: one token routed differently anywhere (a group or an expert) moves it by 0.01.
MLA = dict(reference="mla_reference", param_atol=1e-4, exact=("expert_bias",))
MLA_LAYOUTS = {  # on EQUIVALENCE and MLA_ARGS
    "tp2": Layout(2, ("--parallel.tp=2", "--train.micro_batch=4"), **MLA),
    "tp2-ep2": Layout(4, ("--parallel.tp=2", "--parallel.ep=2", "--train.micro_batch=2"), **MLA),
    # values padded to the query/key width, so ring attention takes them
    "cp2-ring": Layout(2, ("--parallel.cp=2",), **MLA),
    "cp2-ulysses": Layout(2, ("--parallel.cp=2", "--parallel.cp_method=ulysses"), **MLA),
    "tp2-bf16": Layout(2, ("--parallel.tp=2", "--train.micro_batch=4", *BF16), **MLA),  # latent heads split in bf16
    # LoRA on every latent projection: the down-projections and shared experts run on each rank's own
    # tokens under sp, so their adapters' gradients are summed over tp as their weights' are
    "tp2-sp-lora": Layout(2, ("--parallel.tp=2", "--parallel.sp=true", "--train.micro_batch=4", *LORA,
                              LORA_MLA_TARGETS), reference="lora_mla_reference", param_atol=2e-4,
                          exact=(".weight", ".experts.gate")),
}


@pytest.mark.parametrize("name", MLA_LAYOUTS)
def test_latent_attention_and_group_routing_reproduce_single_process(tmp_path, request, name):
    layout = MLA_LAYOUTS[name]
    assert_layout_reproduces(request, tiny_config(tmp_path, *EQUIVALENCE, *MLA_ARGS, *layout.overrides), layout)


# tp alone and ZeRO-1 with tp are saved and loaded across layouts in test_reshard.py.
@pytest.mark.parametrize("world,zero", [(4, 3)])
def test_tensor_parallel_resume_is_exact(tmp_path, world, zero):
    import shutil

    from fivefold.checkpoint.run_state import complete_checkpoints

    args = (*EQUIVALENCE, "--train.steps=4", "--checkpoint.every=2", "--checkpoint.keep=2", "--parallel.tp=2",
            f"--parallel.zero={zero}", "--train.micro_batch=2")
    first = run_workers(train_and_gather, world, tiny_config(tmp_path, *args))[0][0]
    shutil.rmtree(complete_checkpoints(tmp_path / "tiny")[-1])
    resumed = run_workers(train_and_gather, world, tiny_config(tmp_path, *args, "--checkpoint.resume=true"))[0][0]
    assert resumed == first[2:]  # DTensor shards on (dp, tp) came back bit for bit


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_traffic_matches_the_theory(tmp_path, sp):
    from fivefold.parallel.comm.collectives import wire_bytes
    from fivefold.train.metrics import read_metrics

    n, L, B, T, d = 2, 8, 8, 32, 64
    cfg = tiny_config(tmp_path, "--train.steps=1", "--data.max_bytes=20000", "--data.val_fraction=0.0",
                      "--parallel.tp=2", f"--parallel.sp={str(sp).lower()}", "--train.micro_batch=8",
                      "--train.loss_chunk=24")
    run_workers(train_and_gather, n, cfg)
    tp = read_metrics(tmp_path / "tiny" / "metrics.jsonl")[0]["comm"]["tp"]
    S = B * T * d * 4  # one (B, T, dim) fp32 activation
    AR = lambda nbytes: wire_bytes("all_reduce", nbytes, n)  # noqa: E731
    # The loss: per chunk of train.loss_chunk tokens (B T = 256 in chunks of 24: 10 of 24, one of 16),
    # one all-gather of each token's log-sum-exp and target logit (fp32) from every rank.
    chunks, loss = loss_traffic(B * T, 24, n)
    # Per block, one all-reduce in forward for attention and one for the MLP, and their conjugates in
    # backward; the embedding's forward sum and the head's backward sum; the gradient norm's fp64 sum
    # of squares.
    expected = 4 * L * AR(S) + AR(S) + AR(S) + loss + AR(8)
    if not sp:
        assert tp["calls"] == 4 * L + 2 + chunks + 1
    else:
        # Each all-reduce becomes an all-gather plus a reduce-scatter of the same bytes; norm weights
        # (2 per block and the final one) then saw T/tp tokens each and sum their gradients.
        expected += (2 * L + 1) * AR(4 * d)
        assert tp["calls"] == 8 * L + 2 + 2 + chunks + 1 + (2 * L + 1)
    assert tp["wire_bytes"] == expected


def _logit_tensors(rank, world, cfg):
    """Every tensor an op creates during a training step of 64 tokens whose last dim spans a rank's
    vocabulary or more (logits, their softmax and gradient): (widest, most tokens) of them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in [] if func.is_view else out if isinstance(out, (tuple, list)) else [out]:  # (not W^T)
                if isinstance(t, torch.Tensor) and t.ndim > 1 and t.shape[-1] >= 320 // world:
                    seen.append((t.shape[-1], t.numel() // t.shape[-1]))
            return out

    par = parallelized(cfg, world)
    x = torch.randint(0, 320, (2, 32))
    with Watch():
        par.pipeline.run([(x, x)], global_tokens=64)
    return max(w for w, _ in seen), max(n for _, n in seen)


@pytest.mark.parametrize("tp,chunk", [(1, 24), (2, 0), (2, 24)])
def test_no_rank_forms_logits_over_the_whole_vocabulary_or_micro_batch(tmp_path, tp, chunk):
    """Under tp a rank's logits are V / tp wide, never V = 320; with train.loss_chunk, the logits of
    no more than `chunk` of the micro-batch's 64 tokens exist at once (0: all of them)."""
    cfg = tiny_config(tmp_path, f"--parallel.tp={tp}", "--train.global_batch=2", "--train.micro_batch=2",
                      f"--train.loss_chunk={chunk}")
    assert run_workers(_logit_tensors, tp, cfg) == [(320 // tp, chunk or 64)] * tp


def _padding_masked(rank, world):
    group = mesh_of(tp=world).group("tp")
    torch.manual_seed(0)
    head, h = OutputHead(8, 12), torch.randn(2, 4, 8)  # 10 real ids, 2 padding ids (padded to divide by tp)
    targets = torch.randint(0, 10, (2, 4))
    if world > 1:
        head = VocabParallelHead(head, group, False, vocab_limit=10)
    else:
        head.split = VocabSplit(limit=10)
    loss = head(h, targets, chunk=3).sum()
    loss.backward()
    return float(loss), head.weight.grad


@pytest.mark.parametrize("world", [1, 2])
def test_padding_ids_are_masked_out_of_the_loss(world):
    torch.manual_seed(0)
    head, h = OutputHead(8, 12), torch.randn(2, 4, 8)
    targets = torch.randint(0, 10, (2, 4))
    expected = cross_entropy_sum(head(h)[..., :10], targets)  # the loss over the real vocabulary only
    results = run_workers(_padding_masked, world)
    assert results[0][0] == pytest.approx(float(expected), rel=1e-6)
    assert torch.equal(results[-1][1][-2:], torch.zeros(2, 8))  # padding rows of the head learn nothing
