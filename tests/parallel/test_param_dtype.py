"""parallel.param_dtype = "bf16": ZeRO-3 gathers, and computes with, bf16 weights; the fp32 shards
stay the masters the optimizer steps.

The reference is one process under the same policy: fp32 weights cast to bf16 for each forward
(`torch.func.functional_call` with bf16 copies), so their gradients come back through the cast in
fp32, as FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) hands its bf16
gradients to an fp32 reduce-scatter. Casting commutes with gathering (each rank casts its own rows),
so the weights every forward sees are the same, bit for bit, and with the micro-batches the ranks
run, in their order, the sum of the gradients too.
"""

import pytest
import torch
from helpers import EQUIVALENCE, tiny_config, train_and_gather

from fivefold.model.transformer import count_parameters
from fivefold.parallel.forked_ranks import run_workers
from fivefold.train.loop import build_model
from fivefold.train.metrics import read_metrics

# No clipping: the norm is summed in another order over shards than over whole tensors (~1e-7
# relative), and a clipped update would carry that difference into every weight.
ARGS = (*EQUIVALENCE, "--optim.grad_clip=0", "--parallel.zero=3", "--train.micro_batch=4")


def _cast_reference(rank, world, cfg, ranks, per_rank_first=True):
    """One process: each step's micro-batches as `ranks` data-parallel ranks would hold them; the
    forward on bf16 copies of the fp32 weights, each micro-batch's gradient back through the cast in
    fp32, summed in fp32 in the order ZeRO-3 sums them: rank by rank over its micro-batches, then
    over ranks (`per_rank_first`: kept gathered, one reduce-scatter of each rank's accumulation), or
    over ranks, then micro-batch by micro-batch (resharding: each micro-batch reduce-scattered into
    the fp32 shards' gradients); AdamW on the fp32 weights."""
    from functools import reduce

    from torch.func import functional_call

    from fivefold.data.batches import rank_slice
    from fivefold.model.head import VocabSplit, token_losses
    from fivefold.parallel.optimizer import build_optimizer, set_lr
    from fivefold.train.loop import build_datasets
    from fivefold.train.lr_schedule import lr_at
    from fivefold.train.precision import autocast

    t = cfg.train
    model = build_model(cfg, 320)
    params = list(model.parameters())
    opt = build_optimizer(model, cfg.optim)
    train_set, _, loader = build_datasets(cfg, __import__("pathlib").Path(cfg.run.out_dir))

    def summed(grads):  # [[a tensor per parameter], ...] -> their sums, added left to right
        return reduce(lambda a, b: [x + y for x, y in zip(a, b, strict=True)], grads)

    losses = []
    for step in range(t.steps):
        set_lr(opt, lr_at(step, cfg.optim, t.steps))
        indices = loader.next_indices()
        total, grads = 0.0, []  # grads[r][m]: micro-batch m of rank r, fp32 per parameter
        for r in range(ranks):
            batch = rank_slice(train_set, indices, t.global_batch, ranks, r, t.micro_batch)
            grads.append([])
            for x, y in batch.micro_batches:
                weights = {name: p.to(torch.bfloat16) for name, p in model.named_parameters()}
                with autocast(t, "cpu"):  # the run's (none in fp32)
                    h = functional_call(model, weights, (x,), {"logits": False})  # (B, T, dim) after the final norm
                    # the run's loss: train.loss_chunk tokens' logits at a time; fivefold leaves the
                    # padding ids (257..319) out of the softmax, as the oracles do
                    split = VocabSplit(limit=257)
                    losses_ = token_losses(h, weights["output.weight"], y, t.loss_chunk, split)
                    loss = losses_.sum() / batch.global_tokens
                loss.backward()
                grads[-1].append([p.grad for p in params])
                opt.zero_grad(set_to_none=True)
                total += float(loss.detach())
        # per rank, then over ranks; or over ranks for each micro-batch m (zip(*grads)), then over m
        step_grads = summed([summed(g) for g in (grads if per_rank_first else zip(*grads, strict=True))])
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_bf16_weights_reproduce_one_process_casting_its_weights(tmp_path, dtype):
    """ZeRO-3 at dp 2 with bf16 weights equals the cast reference exactly: losses and final fp32
    weights bit for bit. (Checked to fail: against fp32 weights, parameters differ by ~5e-2.) Under
    bf16 autocast too (train.dtype = "bf16", as users run bf16 weights): autocast still moves its fp32
    ops (softmax, the loss) to fp32, in the run and in the reference alike."""
    out, args = tmp_path, (*ARGS, f"--train.dtype={dtype}")
    losses, _, state = run_workers(train_and_gather, 2, tiny_config(out / "ours", *args,
                                                                    "--parallel.param_dtype=bf16"))[0]
    ref_losses, ref_state = run_workers(_cast_reference, 1, tiny_config(out / "ref", *args), 2)[0]
    assert losses == ref_losses
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], ref), name


@pytest.mark.parametrize("keep", [True, False], ids=["kept_gathered", "resharding"])
def test_bf16_weights_sum_many_micro_batches_in_fp32(tmp_path, keep):
    """8 micro-batches of one sample per rank at dp 2: kept gathered, each rank's full gradients
    accumulate over them in fp32 until the one reduce-scatter; resharding, each micro-batch's reduced
    rows add up in the fp32 shards' gradients. Either way losses and final fp32 weights equal, bit for
    bit, the cast reference summing the same fp32 gradients in the same order. (Checked to fail: kept
    gathered bf16 weights accumulating their gradients in bf16 differed by 1.8e-2 in the weights and
    3.5e-4 in the step-2 loss after 2 steps; resharding was exact before and after.)"""
    args = (*EQUIVALENCE, "--optim.grad_clip=0", "--parallel.zero=3", "--train.micro_batch=1",
            "--train.global_batch=16", "--train.steps=2")
    keep_arg = f"--parallel.reshard_after_forward={str(not keep).lower()}"
    losses, _, state = run_workers(train_and_gather, 2, tiny_config(tmp_path / "ours", *args, keep_arg,
                                                                    "--parallel.param_dtype=bf16"))[0]
    ref_losses, ref_state = run_workers(_cast_reference, 1, tiny_config(tmp_path / "ref", *args), 2, keep)[0]
    assert losses == ref_losses
    for name, ref in ref_state.items():
        assert torch.equal(state[name], ref), (name, (state[name] - ref).abs().max().item())


def test_kept_gathered_full_gradients_are_priced_in_fp32_over_micro_batches(tmp_path):
    """The planner's buffers for ZeRO-3 kept gathered: the rank's weights and their unsharded
    gradients, at b.grad bytes with one micro-batch a step and 4 (fp32) when they accumulate."""
    from fivefold.model.counts import model_counts
    from fivefold.planner.layout import rank_shares
    from fivefold.planner.memory import BytesPerParam, buffer_bytes

    cfg = tiny_config(tmp_path, "--parallel.zero=3", "--parallel.reshard_after_forward=false")
    share = rank_shares(cfg, model_counts(cfg.model, 320))[0]
    b = BytesPerParam()  # 2, 2, 12

    def dp(grad_accum):
        return buffer_bytes(cfg, share, b, 32, 2, grad_ranks=2, grad_accum=grad_accum)["dp"]

    assert dp(1) == share.params * (2 + 2)
    assert dp(2) == share.params * (2 + 4)


def _train(rank, world, cfg):
    from fivefold.train.loop import train

    return train(cfg, progress=False).losses


def test_bf16_weights_halve_the_gathered_bytes(tmp_path):
    """Counted by the collective layer, per step on rank 0 (dp 2, 2 micro-batches, resharding): the
    gathers (twice a micro-batch, the head's unit once) move half the bytes; the reduce-scatters
    still carry fp32 gradients (parallel.reduce_dtype), so they move as many as before."""
    n, m = 2, 2
    steps = ("--train.steps=2", "--data.max_bytes=20000", "--data.val_fraction=0.0", "--parallel.zero=3",
             "--train.micro_batch=2")
    dp_bytes = {}
    for dtype in ("fp32", "bf16"):
        cfg = tiny_config(tmp_path / dtype, *steps, f"--parallel.param_dtype={dtype}")
        run_workers(_train, n, cfg)
        dp_bytes[dtype] = [r["comm"]["dp"]["bytes"] for r in read_metrics(tmp_path / dtype / "tiny" / "metrics.jsonl")]
    model = build_model(cfg, 320)
    P, H = count_parameters(model), count_parameters(model.norm) + count_parameters(model.output)
    gathered_fp32 = (2 * m * P - m * H) * 4  # bytes of the full tensors gathered in a step, fp32
    assert len(dp_bytes["bf16"]) == 2
    for fp32, bf16 in zip(dp_bytes["fp32"], dp_bytes["bf16"], strict=True):
        assert fp32 - bf16 == gathered_fp32 / 2


@pytest.mark.parametrize("layout,why", [
    (("--parallel.zero=0",), "parallel.zero = 0"), (("--parallel.zero=2",), "parallel.zero = 2"),
    (("--parallel.zero=3", "--parallel.pp=2"), "parallel.pp = 2"),
    (("--parallel.zero=3", "--train.dtype=fp16"), "train.dtype = 'fp16'")])
def test_bf16_weights_are_refused_where_a_layout_cannot_gather_them(tmp_path, layout, why):
    from fivefold.validate import validate

    errors = validate(tiny_config(tmp_path, "--parallel.param_dtype=bf16", *layout), 4)
    assert len(errors) == 1 and errors[0].startswith("parallel.param_dtype = 'bf16' with " + why), errors


def test_bf16_weights_validate_with_zero3(tmp_path):
    from fivefold.validate import validate

    assert validate(tiny_config(tmp_path, "--parallel.param_dtype=bf16", "--parallel.zero=3"), 4) == []
