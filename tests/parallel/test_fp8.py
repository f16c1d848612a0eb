"""FP8 training (parallel/fp8.py) against one process: the column- and row-parallel matmuls with their
amax reductions, a whole layout's run, the bound to bf16, and which layers compute in FP8."""

import pytest
import torch
from helpers import BF16, EQUIVALENCE, LORA, MOE_ARGS, assert_within_noise, mesh_of, tiny_config, train_and_gather
from torch import nn

from fivefold.parallel.forked_ranks import run_workers


def _chain(rank, world, recipe, sp, reduce):
    """tp's column -> silu -> row pair on (2, 16, 64) tokens, forward and backward, in FP8."""
    from fivefold.parallel.fp8 import Float8Scaling
    from fivefold.parallel.tensor import ColumnParallelLinear, RowParallelLinear, enter_tensor_parallel_region

    tp = mesh_of(tp=world).group("tp")
    torch.manual_seed(0)
    first, second = nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=False)
    with torch.no_grad():  # one rank's slice 10x larger: an amax left unreduced shows at any scale rounding
        first.weight[48:] *= 10
        second.weight[:, 48:] *= 10
    x, dy = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    col, row = ColumnParallelLinear(first, tp, sp), RowParallelLinear(second, tp, sp)
    split = (tp,) if reduce and world > 1 else ()
    col.scaling, row.scaling = Float8Scaling(recipe, outputs=split), Float8Scaling(recipe, inputs=split)
    mine = (x.chunk(world, 1)[rank] if sp else x).clone().requires_grad_()  # (2, 16/tp | 16, 64)
    y = row(torch.nn.functional.silu(col(enter_tensor_parallel_region(mine, tp, sp))))
    y.backward(dy.chunk(world, 1)[rank] if sp else dy)
    return y.detach(), mine.grad, col.weight.grad, row.weight.grad


def _gathered(results, sp):
    seq = lambda i: torch.cat([r[i] for r in results], 1) if sp else results[0][i]  # noqa: E731
    return seq(0), seq(1), torch.cat([r[2] for r in results], 0), torch.cat([r[3] for r in results], 1)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_fp8_matmuls_equal_one_process(recipe, sp):
    """Every amax reduced over the axis splitting what it is taken over: the weight gradients are
    bit-identical to one process's (their sums run over the same tokens in the same order), the
    output and the input gradient within 1e-6 of their largest value (the sum over tp's partial
    products is the only other order). Without the reductions a tensorwise slice is scaled by its
    own amax: far off. (Rowwise scales are powers of two, and multiplying by 2^k moves only a
    float's exponent, so there an unreduced amax changes values only at the format's range ends.)"""
    ref = run_workers(_chain, 1, recipe, False, True)[0]
    y, dx, dw_col, dw_row = _gathered(run_workers(_chain, 2, recipe, sp, True), sp)
    for got, want in ((y, ref[0]), (dx, ref[1])):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * want.abs().max().item())
    assert torch.equal(dw_col, ref[2]) and torch.equal(dw_row, ref[3])
    if recipe == "rowwise":
        return
    unreduced = _gathered(run_workers(_chain, 2, recipe, sp, False), sp)
    assert max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(unreduced, ref, strict=True)) > 1e-3


def test_fp8_layout_reproduces_one_process_running_the_same_micro_batches(tmp_path):
    """tp2 + sp + cp2 in FP8 against one process in FP8 with the same micro-batches of 4 (the
    activations' amax is per micro-batch, never reduced over dp: see fp8.py).

    The first forward is one process's to fp32 order (loss within 1e-6). Its gradients are not
    bit-for-bit: a value that fp32 summation order moves by 1e-7 across a rounding boundary of
    FP8 (e5m2 steps 25% apart for the output gradient) moves by a whole step, so the first
    gradient norm agrees to 5e-4 (1.1e-4 to 1.8e-4 measured for tp2, cp2 and this layout) and
    AdamW's sign-like first update takes it from there; hence one step only, and a bound."""
    args = (*EQUIVALENCE, "--train.steps=1", "--train.fp8=tensorwise", "--train.micro_batch=4")
    (ref_loss, ref_norm, _), = run_workers(train_and_gather, 1, tiny_config(tmp_path / "one", *args))
    layout = tiny_config(tmp_path / "four", *args, "--parallel.tp=2", "--parallel.sp=true", "--parallel.cp=2")
    for loss, norm, _ in run_workers(train_and_gather, 4, layout):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(norm, ref_norm, rtol=5e-4, atol=0)


# ---- FP8 rows: layouts in FP8 against one process in FP8 -------------------------------------------
# Each trains 5 steps as FP8 runs train, on bf16 autocast (helpers.BF16), with 4-row micro-batches,
# and is held to one process with the same recipe and the same micro-batches (the activations' amax
# is a micro-batch's, never reduced over dp: fp8.py): each gap within BF16_NOISE times that process's
# own FP8 gap from its bf16 run, the noise FP8 brings by itself (helpers.assert_within_noise). A
# layout's only other difference is summation order, which moves a value across an FP8 rounding
# boundary now and then (e5m2's steps are 25% apart), as FP8's own rounding does everywhere; an amax
# left unreduced over a split moves a whole slice by its scale's ratio. lr 1e-3: at 3e-3 rowwise
# FP8's step-3 gradient norm spikes by chance (one process 3.2 where bf16 has 2.1, tp2 + sp 8.3);
# at 1e-3 no run does. Measured ratios (losses, gradient norms, parameters): tp2 + sp 0.71, 1.14,
# 0.93 (tensorwise) and 0.56, 0.57, 0.63 (rowwise); pp2 0.63, 0.21, 0.72; ep2 0.08, 0.06, 1.00 (a
# routing bias step); ZeRO-3's FP8 gathers 0: bit for bit one process (amaxes over shards are MAX).
FP8_ROWS = {  # name: (ranks, recipe, model, layout)
    "tp2-sp-tensorwise": (2, "tensorwise", (), ("--parallel.tp=2", "--parallel.sp=true")),
    "tp2-sp-rowwise": (2, "rowwise", (), ("--parallel.tp=2", "--parallel.sp=true")),
    "dp2-zero3-fp8-gather": (2, "tensorwise", (), ("--parallel.zero=3", "--parallel.fp8_gather=true")),
    "pp2-1f1b-rowwise": (2, "rowwise", (), ("--parallel.pp=2",)),
    "ep2-moe-tensorwise": (2, "tensorwise", MOE_ARGS, ("--parallel.ep=2",)),
    # LoRA: each adapted layer's frozen base in FP8, gathered in e4m3 from its ZeRO-3 shards, its adapter in
    # bf16 beside it (measured: the losses one process's bit for bit)
    "dp2-zero3-fp8-gather-lora": (2, "tensorwise", LORA, ("--parallel.zero=3", "--parallel.fp8_gather=true")),
}
FP8_BASE = (*EQUIVALENCE, *BF16, "--optim.lr=1e-3", "--train.micro_batch=4")


@pytest.fixture(scope="module")
def fp8_reference(tmp_path_factory):
    """(recipe, model) -> one process in FP8 with that recipe, and in bf16: each run once per module."""
    runs = {}

    def one_process(fp8: str, model: tuple[str, ...]):
        if (fp8, model) not in runs:
            cfg = tiny_config(tmp_path_factory.mktemp(f"one-{fp8}"), *FP8_BASE, *model, f"--train.fp8={fp8}")
            runs[fp8, model] = run_workers(train_and_gather, 1, cfg)[0]
        return runs[fp8, model]

    return lambda recipe, model: (one_process(recipe, model), one_process("none", model))


@pytest.mark.parametrize("name", FP8_ROWS)
def test_fp8_layouts_train_like_one_process_in_fp8(tmp_path, fp8_reference, name):
    ranks, recipe, model, layout = FP8_ROWS[name]
    cfg = tiny_config(tmp_path, *FP8_BASE, *model, f"--train.fp8={recipe}", *layout)
    for result in run_workers(train_and_gather, ranks, cfg):
        assert_within_noise(result, *fp8_reference(recipe, model))


def test_fp8_losses_stay_within_two_percent_of_bf16_over_50_steps(tmp_path):
    """The tiny model (2 blocks) in bf16 and in FP8 (both recipes), 50 steps at lr 3e-3.

    Bound: every step's loss within 2% of bf16's, the mean of the last 10 within 1%. Why: e4m3
    rounds each operand to 1/16 of its magnitude at worst, so a 64-long product's error is about
    2^-5 / sqrt(64) relative, 0.4%, per matmul; the loss follows the weights and sees it averaged
    over steps (published FP8 runs stay within 1% of bf16, Micikevicius et al. 2022, Fig. 3).
    The FP8 run must also differ from bf16's (it ran in FP8 at all): by more than 1e-4 somewhere."""
    base = ("--data.max_bytes=20000", "--data.val_fraction=0.0", "--train.steps=50", "--optim.lr=3e-3",
            "--train.dtype=bf16", "--model.n_layers=2", "--train.micro_batch=8", "--checkpoint.keep=1",
            "--optim.warmup_steps=5")
    bf16 = torch.tensor(run_workers(train_and_gather, 1, tiny_config(tmp_path / "bf16", *base))[0][0])
    for recipe in ("tensorwise", "rowwise"):
        cfg = tiny_config(tmp_path / recipe, *base, f"--train.fp8={recipe}")
        fp8 = torch.tensor(run_workers(train_and_gather, 1, cfg)[0][0])
        relative = (fp8 - bf16).abs() / bf16
        assert relative.max() < 0.02, (recipe, relative.max())
        assert abs(fp8[-10:].mean() - bf16[-10:].mean()) / bf16[-10:].mean() < 0.01, recipe
        assert relative.max() > 1e-4, recipe


def _layers(rank, world, cfg):
    from helpers import parallelized

    from fivefold.parallel.fp8 import Float8Linear

    par = parallelized(cfg, world)
    fp8 = sorted(n for n, m in par.model.named_modules() if getattr(m, "scaling", None) is not None)
    return fp8, [n for n, m in par.model.named_modules() if isinstance(m, Float8Linear)]


def test_the_blocks_linear_layers_compute_in_fp8_and_nothing_else(tmp_path):
    """DeepSeek-V3 in miniature at tp2 + sp: attention's split projections and latent attention's
    replicated down-projections, the dense block's MLP and the shared expert are FP8; the router,
    the routed experts, the embedding and the head are not."""
    cfg = tiny_config(tmp_path, "--model.preset=tiny-mla", "--train.fp8=rowwise", "--parallel.tp=2",
                      "--parallel.sp=true", "--train.global_batch=2", "--train.micro_batch=2")
    fp8, plain_swapped = run_workers(_layers, 2, cfg)[0]
    per_block = lambda i, *names: [f"layers.{i}.{n}" for n in names]  # noqa: E731
    attn = ("attn.wkv_a", "attn.wkv_b", "attn.wo", "attn.wq_a", "attn.wq_b")
    expected = per_block(0, *attn, "ffn.down", "ffn.gate", "ffn.up")
    for i in range(1, 4):
        expected += per_block(i, *attn, "ffn.shared.down", "ffn.shared.gate", "ffn.shared.up")
    assert fp8 == sorted(expected)
    # The layers tp leaves whole became Float8Linear: latent attention's down-projections, shared experts
    assert sorted(plain_swapped) == sorted(n for n in expected if n.endswith(("wq_a", "wkv_a")) or ".shared." in n)


def _fp8_gather_run(tmp_path, name, world, *args):
    from fivefold.train.metrics import read_metrics

    cfg = tiny_config(tmp_path / name, *EQUIVALENCE, "--parallel.dp=2", "--parallel.zero=3", "--train.fp8=tensorwise",
                      "--train.micro_batch=4", *args)
    result = run_workers(train_and_gather, world, cfg)[0]
    return result, read_metrics(tmp_path / name / "tiny" / "metrics.jsonl")[0]["comm"]["dp"]


@pytest.mark.parametrize("world,micro,args", [(2, 1, ()), (4, 2, ("--parallel.tp=2", "--train.micro_batch=2")),
                                              (2, 1, ("--train.dtype=bf16",))],
                         ids=["dp2-zero3", "dp2-tp2-zero3", "dp2-zero3-bf16"])
def test_zero3_gathers_fp8_weights_in_a_quarter_of_the_bytes_and_the_same_numbers(tmp_path, world, micro, args):
    """parallel.fp8_gather (data/fp8_gather.py): each weight's amax is the MAX over its shards (and
    tp splits) and quantization is elementwise, so every rank gets the e4m3 values it would have
    made from the whole weight: losses, gradient norms and parameters bit for bit those of ZeRO-3
    gathering fp32. The dp traffic of one step: per gather of a block's bucket (forward and
    backward, per micro-batch) the FP8 weights move 1 byte an element instead of 4,
    and their amaxes (4 bytes each) are all-reduced: one all-gather and one all-reduce more."""
    from fivefold.parallel.comm.collectives import wire_bytes

    plain, plain_dp = _fp8_gather_run(tmp_path, "plain", world, *args)
    fp8, fp8_dp = _fp8_gather_run(tmp_path, "fp8", world, *args, "--parallel.fp8_gather=true")
    assert fp8[:2] == plain[:2]
    for key, value in plain[2].items():
        assert torch.equal(fp8[2][key], value), key
    n, blocks, tp = 2, 8, world // 2
    weights = [k for k in plain[2] if k.startswith("layers.0.") and k.endswith(
        tuple(f"{m}.weight" for m in ("wq", "wk", "wv", "wo", "gate", "up", "down")))]
    assert len(weights) == 7
    elements = sum(plain[2][k].numel() for k in weights) // tp  # one tp rank's slices: divisible by n here
    gathers = 2 * blocks * micro
    saved = gathers * (wire_bytes("all_gather", 4 * elements, n) - wire_bytes("all_gather", elements, n))
    amax = gathers * wire_bytes("all_reduce", 4 * len(weights), n)
    assert plain_dp["wire_bytes"] - fp8_dp["wire_bytes"] == saved - amax
    assert fp8_dp["calls"] - plain_dp["calls"] == 2 * gathers


@pytest.mark.parametrize("args,named", [
    (("--model.dim=40",), "attn.wq 40 x 40"),  # every layer's input width
    (("--model.preset=tiny-mla", "--parallel.tp=2"), "attn.wkv_b 32 x 56, attn.wo 24 x 64"),  # split over tp
], ids=["dense", "latent-tp2"])
def test_widths_scaled_mm_cannot_take_are_refused_where_it_runs(tmp_path, args, named):
    """On CUDA, every FP8 layer's widths on one rank must be multiples of 16 (torch._scaled_mm);
    the CPU's emulated matmul takes any width, so a CPU run is not refused."""
    from fivefold.validate import validate

    world = 2 if "--parallel.tp=2" in args else 1
    errors = validate(tiny_config(tmp_path, "--train.fp8=tensorwise", "--train.device=cuda", *args), world)
    fp8 = [e for e in errors if e.startswith("train.fp8 = 'tensorwise' multiplies with torch._scaled_mm")]
    assert len(fp8) == 1 and named in fp8[0], errors
    assert validate(tiny_config(tmp_path, "--train.fp8=tensorwise", "--train.device=cpu", *args), world) == []
    plain = validate(tiny_config(tmp_path, "--train.fp8=tensorwise", "--train.device=cuda"), 1)
    assert not [e for e in plain if "_scaled_mm" in e]  # tiny.toml's widths pass
