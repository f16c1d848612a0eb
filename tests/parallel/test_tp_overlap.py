"""parallel.tp_overlap: sequence parallel's collectives cut into ring pieces under the matmuls
(comm/collective_matmul.py), against the blocking path and the single process."""

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    BF16,
    EQUIVALENCE,
    LORA,
    MLA_ARGS,
    TIED_ARGS,
    Layout,
    assert_layout_reproduces,
    assert_reproduces,
    mesh_of,
    tiny_config,
    train_and_gather,
)

from fivefold.parallel.comm import regions
from fivefold.parallel.comm.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from fivefold.parallel.forked_ranks import run_workers


def _region(rank, world, overlap, dtype="fp32"):
    """A region as a block has it: three column layers on one gathered input (one with a bias),
    combined, then a row layer; forward, the input's and every weight's gradient, and the tp traffic.
    dtype "bf16": forward under CPU autocast (fp32 weights and input), as train.dtype = "bf16" runs it."""
    mesh = mesh_of(tp=world)
    group = mesh.group("tp")
    torch.manual_seed(0)
    weights = [torch.randn(96 // world, 64, requires_grad=True) for _ in range(3)]  # (out/tp, d)
    bias = torch.randn(96 // world, requires_grad=True)
    row = torch.randn(64, 96 // world, requires_grad=True)  # (d, out/tp)
    x = torch.randn(2, 16, 64)[:, rank * 16 // world:(rank + 1) * 16 // world].clone().requires_grad_()  # (B, T/tp, d)
    cotangent = torch.randn(2, 16 // world, 64)
    biases = [bias, None, None]
    with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
        y = _region_forward(x, weights, biases, row, group, overlap)
    (y.float() * cotangent).sum().backward()
    return [y.detach(), x.grad, *(w.grad for w in weights), bias.grad, row.grad], mesh.stats.snapshot()["tp"]


def _region_forward(x, weights, biases, row, group, overlap):
    if overlap:
        q, k, v = all_gather_matmul(x, weights, biases, group)  # (B, T, out/tp) each
        y = matmul_reduce_scatter(q * k + v, row, group)  # (B, T/tp, d)
    else:
        gathered = regions.gather_from_sequence_parallel_region(x, group)  # (B, T, d)
        q, k, v = (F.linear(gathered, w, b) for w, b in zip(weights, biases, strict=True))
        y = regions.reduce_scatter_to_sequence_parallel_region(F.linear(q * k + v, row), group)
    return y  # (B, T/tp, d)


@pytest.mark.parametrize("world,dtype", [(2, "fp32"), (4, "fp32"), (2, "bf16")])
def test_overlapped_region_is_the_blocking_one_bit_for_bit(world, dtype):
    """Outputs and weight gradients are rows of, or the same, matmuls; dx sums the layers' branches in
    autograd's order and the ring's reduce-scatter adds what it receives to its own share, as gloo's
    does: every tensor bitwise the blocking path's (measured, tp 2 and 4). Under bf16 autocast too: the
    backward runs under the forward's autocast (it used to multiply bf16 gradients by fp32 weights and
    stop), and dx's branches are summed in x's fp32 as autograd sums the blocking path's casts. The wire
    bytes are equal: each rank sends n - 1 pieces of S/n, the ring collectives' (n-1)/n S; four
    collectives (two forward, their two conjugates backward) become 4 (n - 1) sends."""
    blocking, overlapped = run_workers(_region, world, False, dtype), run_workers(_region, world, True, dtype)
    for (ref, ref_tp), (ours, tp) in zip(blocking, overlapped, strict=True):
        assert ours[0].dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)
        for name, a, b in zip(["y", "dx", "dq", "dk", "dv", "db", "drow"], ours, ref, strict=True):
            assert torch.equal(a, b), name
        assert tp["wire_bytes"] == ref_tp["wire_bytes"]
        assert (ref_tp["calls"], tp["calls"]) == (4, 4 * (world - 1))


def _pair(tmp_path, args, world):
    blocking = run_workers(train_and_gather, world, tiny_config(tmp_path / "blocking", *args))[0]
    overlapped = run_workers(train_and_gather, world, tiny_config(tmp_path / "overlap", *args,
                                                                  "--parallel.tp_overlap=true"))[0]
    return blocking, overlapped


# Dense with tied embeddings and full recompute (the head's gather overlapped; the recomputed
# forward runs the rings again), DeepSeek-V3 in miniature (MoE blocks overlap attention only;
# latent attention's entry stays blocking, its wo overlapped), and the dense model in bf16 autocast.
@pytest.mark.parametrize("name,args", [
    ("dense-tied-recompute", (*TIED_ARGS, "--train.recompute=full")),
    ("mla-moe", (*EQUIVALENCE, *MLA_ARGS)),
    ("dense-bf16", (*EQUIVALENCE, "--train.dtype=bf16")),
    # LoRA's A beside each column layer's weight in the entry's matmuls, a row adapter's share in each piece
    ("dense-lora-bf16", (*EQUIVALENCE, *LORA, "--train.dtype=bf16")),
])
def test_tp2_overlap_trains_bit_for_bit_as_the_blocking_path(tmp_path, name, args):
    """Five steps of tp2 + sp: losses, gradient norms and every parameter the same numbers with and
    without the overlap (a sum of two partial sums is the same in either order)."""
    blocking, overlapped = _pair(tmp_path, (*args, "--parallel.tp=2", "--parallel.sp=true",
                                            "--train.micro_batch=4"), 2)
    assert overlapped[:2] == blocking[:2]
    assert overlapped[2].keys() == blocking[2].keys()
    for key, value in blocking[2].items():
        assert torch.equal(overlapped[2][key], value), key


def test_tp4_overlap_reproduces_single_process(tmp_path, reference):
    """At tp 4 the ring adds four partial sums in its own order: the tp4 table's bounds against the
    single process (test_tensor_parallel.py; measured against the blocking path: parameters 6.5e-5)."""
    cfg = tiny_config(tmp_path, *EQUIVALENCE, "--parallel.tp=4", "--parallel.sp=true", "--parallel.tp_overlap=true",
                      "--train.micro_batch=8")
    for result in run_workers(train_and_gather, 4, cfg):
        assert_reproduces(result, reference, param_atol=3e-4)


def test_overlap_moves_the_blocking_wire_bytes_as_sends(tmp_path):
    """One step's tp traffic at tp 2: the wire bytes of the blocking sp path exactly; the payload
    counted drops by half a (B, T, d) activation for each collective the overlap replaces (a send
    carries one piece, S/2, where the all-gather's and reduce-scatter's payload is S): per block its
    two regions' gathers and reduce-scatters and their conjugates. The embedding's reduce-scatter has
    no matmul to hide under and stays; so do the head's gather and its conjugate, since the loss
    multiplies the gathered hidden states a chunk of tokens at a time (model/head.py)."""
    from fivefold.train.metrics import read_metrics

    L, B, T, d = 8, 8, 32, 64
    args = ("--train.steps=1", "--data.max_bytes=20000", "--data.val_fraction=0.0", "--parallel.tp=2",
            "--parallel.sp=true", "--train.micro_batch=8")
    comm = {}
    for overlap in ("false", "true"):
        cfg = tiny_config(tmp_path / overlap, *args, f"--parallel.tp_overlap={overlap}")
        run_workers(train_and_gather, 2, cfg)
        comm[overlap] = read_metrics(tmp_path / overlap / "tiny" / "metrics.jsonl")[0]["comm"]["tp"]
    S = B * T * d * 4  # one (B, T, dim) fp32 activation
    assert comm["true"]["wire_bytes"] == comm["false"]["wire_bytes"]
    assert comm["true"]["calls"] == comm["false"]["calls"]  # at tp 2 each collective becomes one send
    assert comm["false"]["bytes"] - comm["true"]["bytes"] == 8 * L * S // 2


def test_tp2_overlap_in_bf16_trains_like_one_process_in_bf16(tmp_path, request):
    """tp2 + sp with the overlap under bf16 autocast, a bf16 row of the tensor-parallel table
    (helpers.BF16): within 3x one process's own bf16 noise. Measured: losses 0.78x, gradient norms
    1.07x, parameters 1.08x, as the blocking path (the two are bit for bit the same). Before the
    backward ran under the forward's autocast this run stopped at its first backward (bf16 gradients
    times fp32 weights)."""
    layout = Layout(2, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.tp_overlap=true", "--train.micro_batch=4",
                        *BF16))
    assert_layout_reproduces(request, tiny_config(tmp_path, *EQUIVALENCE, *layout.overrides), layout)
