"""The planner's memory beyond fivefold's trainer, against hand arithmetic from published formulas:
CPU offload (ZeRO-Offload, ZeRO-Infinity, DeepSpeed's memory estimator), FP8 weights and compute,
the --params table's model-parallel degree and largest layer, the worst pipeline and expert rank,
the traffic of the rank that sends the most, and a search that shows what the trainer cannot run
without ever choosing it. Pure Python: no process group, no tensor."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fivefold.cli import main
from fivefold.config.derive import derive
from fivefold.config.load import load_config
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.counts import model_counts
from fivefold.parallel.comm.collectives import wire_bytes
from fivefold.planner.estimate import estimate
from fivefold.planner.fits import stage_fit
from fivefold.planner.hardware import GB, get_hardware
from fivefold.planner.layout import rank_shares, stage_sizes
from fivefold.planner.machine.pricing import Memo
from fivefold.planner.memory import BytesPerParam, activation_bytes
from fivefold.planner.options import PlanOptions
from fivefold.planner.search import search
from fivefold.planner.terms import inflight_blocks
from fivefold.validate import validate

H100 = get_hardware("h100")
P70, L70 = 70e9, 128256 * 8192  # a 70B model and Llama 3 70B's embedding, V x d (its largest layer)


def _cfg(preset: str, *overrides: str):
    return load_config(None, [f"--model.preset={preset}", *overrides])


def _8b(*overrides: str):
    cfg = _cfg("llama3-8b", "--train.seq_len=4096", "--train.global_batch=64", "--train.micro_batch=1", *overrides)
    assert validate(cfg, 8) == []
    return cfg


@pytest.mark.parametrize("offload,bytes_,gpu_mem,cpu_mem", [
    # DeepSpeed's estimate_zero3_model_states_mem_needs (deepspeed/runtime/zero/stage3.py), without its
    # additional_buffer_factor of 1.5, on 8 nodes of 8 GPUs: largest_layer_memory = 4 L, and
    ("none", "2,2,14", 4 * L70 + 18 * P70 / 64, 0.0),  # gpu 4 L + 18 P / GPUs
    ("optimizer", "2,2,12", 4 * L70 + 2 * P70 / 64, 16 * P70 / 8),  # gpu 4 L + 2 P / GPUs, cpu 16 P / nodes
    ("params", "2,2,12", 4 * L70, 18 * P70 / 8),  # gpu 4 L, cpu 18 P / nodes
])
def test_zero3_offload_matches_deepspeeds_memory_estimator(offload, bytes_, gpu_mem, cpu_mem):
    row = stage_fit(P70, BytesPerParam.parse(bytes_), 3, 64, 1, L70, PlanOptions(offload=offload), H100.memory_bytes,
                    H100.host_memory_bytes, 8)
    assert row.device["total"] == pytest.approx(gpu_mem)
    assert row.host_node == pytest.approx(cpu_mem)


def test_params_table_takes_a_model_parallel_degree_and_the_models_largest_layer(capsys):
    assert main(["plan", "--params", "70e9", "--gpus", "64", "--mp", "8", "--model", "llama3-70b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # --mp 8 leaves 8 data-parallel ranks, each holding P / 8: ZeRO-3 keeps 16 P / 64 and the largest
    # unit's weight and gradient whole, (2 + 2) x V d (the embedding outweighs a 70B block, 856M)
    assert out["ZeRO-3"]["largest_layer"] == pytest.approx(4 * L70 / GB)
    assert out["ZeRO-3"]["total"] == pytest.approx((16 * P70 / 64 + 4 * L70) / GB)
    assert out["DDP"]["total"] == pytest.approx(16 * P70 / 8 / GB) and out["DDP"]["largest_layer"] == 0
    assert out["ZeRO-1"]["largest_params"] == pytest.approx(H100.memory_bytes / ((2 + 2 + 12 / 8) / 8))
    assert out["sharded_by"] == {"params": ["ZeRO-3"], "grads": ["ZeRO-2", "ZeRO-3"],
                                 "optimizer": ["ZeRO-1", "ZeRO-2", "ZeRO-3"]}


def test_optimizer_offload_moves_the_optimizer_and_prices_the_host_step():
    """ZeRO-Offload (Ren et al. 2021) at ZeRO-1 on 8 x H100: the device keeps bf16 weights and gradients,
    the host per node 8 ranks x (12 + 4) x P / 8; the step adds the host's Adam, (4 + 2 x 12 + 2) bytes per
    shard parameter at 76.8 GB/s x 0.8, and the weights' shard up at 64 GB/s x 0.8 (the gradients' copy
    hides under the backward)."""
    cfg = _8b("--parallel.dp=8", "--parallel.zero=1")
    P = model_counts(cfg.model).total
    est = estimate(cfg, 8, H100, options=PlanOptions(offload="optimizer"))
    assert est.memory["optimizer"] == 0 and est.memory["params"] == est.memory["grads"] == 2 * P
    assert est.host_memory_bytes == pytest.approx(8 * 16 * P / 8)
    shard = P / 8
    host_adam = shard * (4 + 2 * 12 + 2) / (76.8e9 * 0.8)
    weights_up = shard * 2 / (64e9 * 0.8)
    assert est.time_split["optimizer"] == pytest.approx(host_adam + weights_up)
    assert est.not_runnable == []  # parallel.offload runs it; the config switch prices the same
    switched = estimate(_8b("--parallel.dp=8", "--parallel.zero=1", "--parallel.offload=optimizer"), 8, H100)
    assert switched.step_time_s == est.step_time_s and switched.options == est.options
    base = estimate(cfg, 8, H100)
    assert base.memory["optimizer"] == pytest.approx(12 * P / 8) and base.host_memory_bytes == 0


@pytest.mark.parametrize("offload", ["optimizer", "params"])
def test_host_link_copies_past_the_compute_are_exposed(offload):
    """On a 1 GB/s host link, ZeRO-3 (resharding) with M = 8 micro-batches: each backward's gradient
    shard goes down (S x 2 bytes) while that backward runs, and with parameter offload each micro-batch's
    two gathers first bring the shard up (2 x S x 2 bytes) while it computes; what exceeds is exposed.
    The data sheet's pricer makes a backward 2 x forward, plus the loss's head matmul once more
    (model/head.py makes the logits again in backward)."""
    cfg = _8b("--parallel.dp=8", "--parallel.zero=3")
    slow = dataclasses.replace(H100, pcie_bw=1e9, sm_count=0)  # priced flat: backward = 2 x forward + the rerun
    est = estimate(cfg, 8, slow, options=PlanOptions(offload=offload))
    P, M, link = model_counts(cfg.model).total, 8, 1e9 * 0.8
    shard = P / 8
    compute = est.time_split["compute"] / M  # forward + backward of one micro-batch
    rerun = 2 * model_counts(cfg.model).embedding * 4096 / (slow.peak_flops * slow.compute_efficiency)
    down = M * max(0.0, shard * 2 / link - (compute - (compute - rerun) / 3))
    up = M * max(0.0, 2 * shard * 2 / link - compute) if offload == "params" else 0.0
    host_adam = shard * (4 + 2 * 12 + 2) / (76.8e9 * 0.8)
    weights_up = shard * 2 / link if offload == "optimizer" else 0.0
    assert down > 0 and (up > 0 or offload == "optimizer")
    assert est.time_split["optimizer"] == pytest.approx(down + up + host_adam + weights_up)


def test_parameter_offload_empties_the_device_state():
    """ZeRO-Infinity (Rajbhandari et al. 2021): with ZeRO-3 the parameter shards go to the host too,
    18 bytes per parameter of the shard at 2,2,12 (DeepSpeed's estimator's figure)."""
    cfg = _8b("--parallel.dp=8", "--parallel.zero=3")
    P = model_counts(cfg.model).total
    est = estimate(cfg, 8, H100, options=PlanOptions(offload="params"))
    assert est.memory["params"] == est.memory["grads"] == est.memory["optimizer"] == 0
    assert est.host_memory_bytes == pytest.approx(18 * P)
    assert est.not_runnable == []  # parallel/data/offload.py runs it
    # fivefold's own state: the fp32 host master is the parameter shard, so 16 bytes per element, 8 x 16 P / 8
    own = estimate(cfg, 8, H100, implementation=True, options=PlanOptions(offload="params"))
    assert own.memory["params"] == own.memory["grads"] == own.memory["optimizer"] == 0
    assert own.host_memory_bytes == pytest.approx(16 * P)


def test_offload_refusals_are_one_line(capsys):
    args = ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "64"]
    assert main([*args, "--layout", "dp=8,zero=1,offload=params"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--layout offload=params" in err and "zero=3" in err
    assert main([*args, "--layout", "dp=8,zero=0,offload=optimizer"]) == 2
    assert "--layout offload=optimizer" in capsys.readouterr().err
    assert main([*args, "--layout", "dp=8,zero=1", "--expert-imbalance", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--expert-imbalance 0.5" in err
    assert main(["plan", "--params", "7e9", "--gpus", "8", "--mp", "3"]) == 2
    assert "--mp 3" in capsys.readouterr().err


def test_fp8_weights_gather_one_byte_per_block_weight():
    """fp8 = "weights": the blocks' weights in 1 byte at rest and on ZeRO-3's gathers (torchtitan's float8
    all-gather casts each linear weight's shard before FSDP's all-gather, docs/float8.md); the embedding and
    head stay in bf16, the gradients too. Per step, M = 8 micro-batches: 2M gathers (M of the head's
    unit, kept gathered for its backward) and M reduce-scatters."""
    cfg = _8b("--parallel.dp=8", "--parallel.zero=3")
    c = model_counts(cfg.model)
    vocab = c.embedding + c.head
    weights = (c.total - vocab) * 1 + vocab * 2
    head = c.head * 2 + c.final_norm * 1
    est = estimate(cfg, 8, H100, options=PlanOptions(fp8="weights"))
    M = 64 // 8
    expected = (M * wire_bytes("all_gather", 2 * weights - head, 8)
                + M * wire_bytes("reduce_scatter", 2 * c.total, 8))
    assert est.comm["dp"].bytes == pytest.approx(expected)
    assert est.memory["params"] == pytest.approx(weights / 8)
    assert est.not_runnable == []  # parallel.fp8_gather runs it (parallel/data/fp8_gather.py)
    assert estimate(_8b("--parallel.dp=8", "--parallel.zero=1"), 8, H100,
                    options=PlanOptions(fp8="weights")).not_runnable[0].startswith("parallel.fp8_gather = true")


@pytest.mark.parametrize("recompute,per_token", [
    # llama3-8b, tp 1: d = 4096, ffn 14336, dq = 32 x 128 = 4096. Transformer Engine's FP8 linear layers
    # keep their inputs for the weight gradient in FP8 (DeepSeek-V3 sec. 3.3.3 caches them so too): the
    # attention and gate/up inputs (2d) and the down projection's (ffn) lose a byte each; the out
    # projection's input is also the attention kernel's bf16 output: one FP8 copy added (dq)
    ("none", (2 * 4096 + 14336) - 4096),
    ("selective", 2 * 4096 + 14336 + 4096),  # the kernel's output is rebuilt: only wo's FP8 copy is kept
    ("full", 0),  # only each block's input is kept, which no linear layer reads
])
def test_fp8_compute_keeps_the_linear_inputs_in_one_byte(recompute, per_token):
    cfg = _8b(f"--train.recompute={recompute}")
    share = rank_shares(cfg, model_counts(cfg.model))[0]
    bf16, fp8 = (activation_bytes(cfg, share, share.chunk_blocks, 4096, 128256, 2, PlanOptions(fp8=f))
                 for f in ("none", "compute"))
    assert bf16["per_block_microbatch"] - fp8["per_block_microbatch"] == per_token * 4096


def test_the_busiest_expert_rank_holds_and_moves_imbalance_times_the_mean():
    """tiny-moe (d 64, 4 experts of width h 64, top 2) with ep 2 on 4 ranks: at imbalance 1.5 the busiest
    expert rank keeps 0.5 x k (4h + 3d) more elements per token and block (the routed copies' share of
    activations.py's MoE formula) and its 4 all-to-alls per MoE block and micro-batch (GShard, Lepikhin
    et al. 2020) carry 1.5 x the balanced bytes."""
    cfg = _cfg("tiny-moe", "--parallel.dp=4", "--parallel.ep=2", "--train.seq_len=64", "--train.global_batch=8",
               "--train.micro_batch=1")
    assert validate(cfg, 4) == []
    flat, skewed = (estimate(cfg, 4, H100, act_bytes=2, options=PlanOptions(expert_imbalance=x)) for x in (1.0, 1.5))
    assert skewed.comm["ep"].bytes == pytest.approx(1.5 * flat.comm["ep"].bytes)
    tokens, blocks = 64, 8
    assert skewed.memory["activations"] - flat.memory["activations"] == pytest.approx(
        0.5 * 2 * (4 * 64 + 3 * 64) * 2 * tokens * blocks)
    assert any(what == "busiest expert rank" for what, _, _ in skewed.explain)
    one_rank = load_config(None, ["--model.preset=tiny-moe", "--parallel.dp=4", "--train.seq_len=64",
                                  "--train.global_batch=8", "--train.micro_batch=1"])
    # without expert parallelism every rank runs all experts for its own tokens: no busiest expert rank
    assert estimate(one_rank, 4, H100, options=PlanOptions(expert_imbalance=1.5)).memory == \
        estimate(one_rank, 4, H100).memory


def test_pipeline_traffic_is_reported_for_the_rank_that_sends_the_most():
    """1F1B over 4 stages, M = 8: a middle stage sends its activation forward and its input's gradient
    back, 2M messages of (b, s, d) bf16; the last stage, the busiest (head and loss), only M. The fullest
    rank is the first, with p - r = 4 micro-batches of its 8 blocks in flight (Narayanan et al. 2021)."""
    cfg = _8b("--parallel.pp=4", "--parallel.dp=2")
    est = estimate(cfg, 8, H100)
    message = 1 * 4096 * 4096 * 2
    M = 64 // 2
    assert est.comm["pp"].bytes == 2 * M * message
    rows = {what: text for what, text, _ in est.explain}
    assert "pipeline rank 1 of 4 sends the most" in rows["pp traffic, heaviest sender"]
    assert f"{M * message / GB:.3f} GB" in rows["pp traffic"]  # the busiest rank's, timed
    assert rows["fullest rank"].startswith("pipeline rank 0 of 4: 32 blocks in flight (per rank [32, 24, 16, 8])")


def test_pp2_traffic_is_the_same_on_both_ranks_as_the_runtime_counts():
    """Two stages each send M messages: the report is the counted figure whichever rank logs it."""
    cfg = _8b("--parallel.pp=2", "--parallel.dp=4")
    est = estimate(cfg, 8, H100)
    assert est.comm["pp"].bytes == (64 // 4) * 4096 * 4096 * 2
    assert not any(what == "pp traffic, heaviest sender" for what, _, _ in est.explain)


def test_search_writes_offload_when_only_offload_fits(tmp_path, capsys):
    """Llama 3 8B on 2 x A100-40GB: nothing fits on the device (ZeRO-3 alone needs 16 x 8B / 2 = 64 GB);
    offload makes some fit, and the best is written with its switch, which `fivefold train` runs."""
    out = tmp_path / "plan.toml"
    args = ["plan", "--model", "llama3-8b", "--gpus", "2", "--gpu", "a100-40gb", "--seq", "2048", "--global-batch",
            "8", "--out", str(out)]
    assert main(args) == 1 and not out.exists()
    assert main([*args, "--consider", "offload,fp8"]) == 0
    written = load_config(out)
    assert written.parallel.offload != "none" and not validate(written, 2)
    assert main([*args, "--consider", "nvme"]) == 2
    assert "--consider nvme" in capsys.readouterr().err


def test_search_ranks_every_switch_as_a_layout_choice_and_covers_zero_with_pipelines_and_experts():
    cfg = _cfg("tiny-moe", "--train.seq_len=64", "--train.global_batch=16")
    res = search(cfg, 4, H100, keep=100_000, consider=("offload", "fp8"))
    assert res.ranked and all(not e.not_runnable for _, e in res.ranked)
    # what it set aside is what fivefold does not build yet (validate/speed.py), nothing else
    assert {r.split(" is not built yet")[0] for _, e in res.not_runnable for r in e.not_runnable} <= {
        "parallel.ep_overlap = true"}
    layouts = [c.parallel for c, _ in res.ranked]
    # parameter offload is priced with ZeRO-3 only, and ranked: parallel/data/offload.py runs it
    assert any(p.offload == "params" for p in layouts)
    assert all(p.zero == 3 for p in layouts if p.offload == "params")
    assert any(p.pp > 1 and p.zero == 2 for p in layouts) and any(p.pp > 1 and p.zero == 3 for p in layouts)
    assert any(p.ep > 1 and p.zero >= 1 for p in layouts)
    # the switches are set in the configs the search would write, each one `fivefold train` accepts
    firsts = {}
    for c, e in res.ranked:
        p = c.parallel
        for name, on in (("tp_overlap", p.tp_overlap), ("ep_overlap", p.ep_overlap), ("offload", p.offload),
                         ("fp8", c.train.fp8), ("fp8_gather", p.fp8_gather)):
            if on and on != "none":
                firsts.setdefault((name, on), (c, e))
    assert set(firsts) == {("tp_overlap", True), ("ep_overlap", True), ("offload", "optimizer"), ("offload", "params"),
                           ("fp8", "tensorwise"), ("fp8_gather", True)}
    for c, e in firsts.values():
        assert not validate(c, 4) and e.options == e.options.with_config(c)
    assert all(not p.ep_overlap or p.pp_schedule == "dualpipe_v" for p in layouts)
    # an option fivefold does not run puts every candidate it changes apart: never the best
    off = search(cfg, 4, H100, keep=5, options=PlanOptions(zero3_prefetch=False))
    assert off.not_runnable and {c.parallel.zero for c, _ in off.not_runnable} == {3}
    assert off.ranked and all(c.parallel.zero != 3 for c, _ in off.ranked)


def test_the_catalogs_host_figures_come_from_the_memory_channels():
    # DGX H100: 2 x Xeon Platinum 8480C, 8 channels of DDR5-4800 (8 bytes a transfer) each, for 8 GPUs
    assert H100.host_bw == pytest.approx(2 * 8 * 4800e6 * 8 / 8) and H100.host_memory_bytes == 2000 * GB
    assert "8480C" in H100.sources["host_bw"]


def test_offload_reaches_the_json(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "64", "--seq", "4096",
                 "--layout", "dp=8,zero=3,offload=optimizer,micro_batch=1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runnable"] is True and out["not_runnable"] == [] and out["host_memory_gb"] > 0
    assert out["host_memory_gb"] == pytest.approx(16 * model_counts(_8b().model).total / GB)  # 8 x 16 P / 8


def test_uneven_chunks_hold_their_own_blocks():
    """Interleaved 1F1B, p = 2, v = 2, M = 4, 7 blocks split [1, 3, 2, 1] over the 4 chunks: rank 0
    runs F0s0 F1s0 F0s2 F1s2 F2s0 B0s2 F3s0 B1s2 F2s2 B0s0 F3s2 ..., holding 1, 2, 4, 6, 7, 5, 6, 4,
    6, 5, 7 blocks: at most 7, where 5 chunks of the largest (2 blocks) would count 10. Rank 1's
    chunks of 3 and 1 peak at 9 (three of the 3-block chunk's forwards live at once)."""
    cfg = _8b("--model.n_layers=7", "--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b",
              "--parallel.virtual_stages=2", "--parallel.dp=4", "--train.global_batch=16")
    d = derive(cfg, 8, unpadded_vocab(cfg))
    sizes = stage_sizes(cfg, model_counts(cfg.model))
    assert sizes == [1, 3, 2, 1] and d.grad_accum == 4
    assert inflight_blocks(cfg, d, sizes, Memo()) == [7, 9]


def test_per_op_selective_recompute_keeps_every_other_matmuls_output():
    """torchtitan's op-level SAC on a Llama 3 8B block (d 4096, 32 heads of 128, 8 kv heads, f 14336):
    the block's input d, the outputs of wq, wv, gate and down (4096 + 1024 + 14336 + 4096), the
    attention kernel's output and log-sum-exp (4096 + 32): 31776 elements a token at tp 1; at tp 2
    with sp the input, the split outputs and the two reduce-scatters' outputs are halved, down's d is
    whole: 2048 + (8192 + 1024 + 32 + 14336) / 2 + 4096 + 4096 = 22032."""
    from fivefold.planner.activations import per_op_block_elements

    m = _8b().model
    assert per_op_block_elements(m) == 31776
    assert per_op_block_elements(m, tp=2, sp=True) == 22032
    assert per_op_block_elements(_cfg("mixtral-8x7b").model) is None  # no count: fivefold's selective stands
    cfg = _8b("--train.recompute=selective", "--train.micro_batch=1", "--train.seq_len=8192")
    d = derive(cfg, 1, unpadded_vocab(cfg))
    share = rank_shares(cfg, model_counts(cfg.model, d.vocab_size))[0]
    per_op = activation_bytes(cfg, share, 32, 8192, d.vocab_size, 2, PlanOptions(selective_ac="per_op"))
    assert per_op["per_block_microbatch"] == 31776 * 8192 * 2
    fp8 = activation_bytes(cfg, share, 32, 8192, d.vocab_size, 2, PlanOptions(selective_ac="per_op", fp8="compute"))
    assert fp8["per_block_microbatch"] == per_op["per_block_microbatch"]  # matmul outputs, kept in bf16
    own = activation_bytes(cfg, share, 32, 8192, d.vocab_size, 2)
    assert own["per_block_microbatch"] > 2 * per_op["per_block_microbatch"]
