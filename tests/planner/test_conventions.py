"""The estimate's figures in published conventions (planner/conventions.py) against hand arithmetic
from the formulas the module cites."""

from __future__ import annotations

import pytest

from fivefold.config.derive import derive
from fivefold.config.load import load_config
from fivefold.data.resolve import unpadded_vocab
from fivefold.planner.conventions import CONVENTION_KEYS
from fivefold.planner.estimate import estimate
from fivefold.planner.hardware import get_hardware
from fivefold.planner.options import PlanOptions

H100 = get_hardware("h100")
H, L, HEADS, S, V = 4096, 16, 32, 2048, 51200  # a GPT-shaped model (MHA, SwiGLU of 8h/3: 10880 = 85 x 128)


def _gpt(tp: int, pp: int, recompute: str = "selective", sp: bool = True, batch: int = 64):
    over = [f"--model.dim={H}", f"--model.n_layers={L}", f"--model.n_heads={HEADS}", f"--model.n_kv_heads={HEADS}",
            "--model.ffn_dim=10880", f"--model.vocab_size={V}", "--model.tie_embeddings=true", f"--train.seq_len={S}",
            f"--parallel.tp={tp}", f"--parallel.pp={pp}", f"--parallel.sp={str(sp).lower()}", "--parallel.zero=1",
            f"--train.global_batch={batch}", "--train.micro_batch=1", f"--train.recompute={recompute}"]
    cfg = load_config(None, over)
    world = 16
    return cfg, world, estimate(cfg, world, H100)


def test_json_carries_every_convention_by_name():
    cfg, world, est = _gpt(4, 4)
    assert tuple(est.to_json()["conventions"]) == CONVENTION_KEYS
    assert any(what == "conventions" for what, _, _ in est.explain)


def test_pipeline_bytes_per_micro_batch_and_direction_and_per_step():
    """Narayanan et al. 2021 sec. 4.1: one boundary sends b s h elements per micro-batch each way, / t
    under sequence parallelism: 1 x 2048 x 4096 x 2 bytes / 4. A middle stage of 1F1B sends its
    activation forward and its gradient back for each of the M = 64 / dp 1 micro-batches."""
    cfg, world, est = _gpt(4, 4)
    c = est.conventions
    assert c["pp_bytes_per_micro_batch_per_direction"] == 2048 * 4096 * 2 / 4
    micro = derive(cfg, world, unpadded_vocab(cfg)).grad_accum
    assert micro == 64 and c["pp_messages_per_step"] == 2 * micro
    assert c["pp_bytes_per_step_busiest_sender"] == 2 * micro * 2048 * 4096 * 2 / 4 == est.comm["pp"].bytes


def test_tensor_parallel_wire_tensors_and_shards():
    """Megatron's tp (Shoeybi et al. 2019; sp as Korthikanti et al. 2022, an all-gather and a
    reduce-scatter for each all-reduce): the heaviest sender (the last stage, with the head and
    loss) runs per micro-batch 2 all-reduce-equivalents per region (forward, backward) over 2 regions
    of each of its 4 blocks, 1 for the head, and the loss's one all-gather per chunk of 1,024 tokens
    (train.loss_chunk) of each rank's 2 fp32 numbers per token. Tensors: b s h x 2 bytes each, the
    gather's whole output; on the wire a ring sends 2 (t-1)/t of each all-reduce and (t-1)/t of each
    all-gather; a rank's shard is 1/t."""
    cfg, world, est = _gpt(4, 4)
    c, M = est.conventions, 64
    act = 2048 * 4096 * 2
    regions, loss = M * (2 * 2 * 4 + 1) * act, M * 2 * (4 * 2 * 1024 * 4)
    assert c["tp_message_bytes_per_step"] == pytest.approx(regions + loss)
    assert c["tp_wire_bytes_per_step"] == pytest.approx(2 * 3 / 4 * regions + 3 / 4 * loss) == est.comm["tp"].bytes
    assert c["tp_shard_bytes_per_step"] == pytest.approx((regions + loss) / 4)


def test_hfu_as_korthikanti_counts_selective_recompute():
    """Korthikanti et al. 2022: model FLOPs 72 B L s h^2 (1 + s/6h + V/12hL), hardware FLOPs with
    selective recompute 72 B L s h^2 (1 + s/3h + V/12hL): their ratio for this shape, to the SwiGLU
    stand-in's 0.1%. fivefold's own HFU adds the attention core's forward only, a third of that
    term (4 L h s per token of 12 L h s): (1 + s/6h (1 + 1/3) + ...) / (1 + s/6h + ...). Under full
    recomputation both count one more forward of the blocks (Narayanan et al. 2021: 96 / 72)."""
    _, _, est = _gpt(4, 4)
    c, tail = est.conventions, V / (12 * H * L)
    assert c["hfu_korthikanti"] / est.mfu == pytest.approx((1 + S / (3 * H) + tail) / (1 + S / (6 * H) + tail),
                                                            rel=1e-3)
    assert c["hfu"] / est.mfu == pytest.approx((1 + S / (6 * H) * 4 / 3 + tail) / (1 + S / (6 * H) + tail), rel=1e-3)
    assert c["hfu"] == est.hfu
    _, _, full = _gpt(4, 4, recompute="full")
    assert full.conventions["hfu_korthikanti"] == full.hfu
    assert full.hfu / full.mfu == pytest.approx((96 * (1 + S / (6 * H) + V / (16 * L * H)))
                                                / (72 * (1 + S / (6 * H) + tail)), rel=1e-3)


def test_activation_bytes_per_micro_batch_and_in_flight():
    """Per micro-batch: the per-block figure x the rank's blocks (+ the last stage's logits). In
    flight: without a pipeline one micro-batch at a time (its backward runs before the next
    forward); 1F1B's first stage holds p = 4 micro-batches (Narayanan et al. 2021), no logits."""
    _, _, flat = _gpt(4, 1, batch=16)
    c = flat.conventions
    per_block = c["activation_bytes_per_block_micro_batch"]
    # the loss's peak: a chunk of 1,024 tokens' fp32 logits and log-sum-exp's temporary over V / tp, beside
    # the micro-batch's saved hidden states (gathered over tp) and 2 fp32 numbers per token
    logits = 1024 * (V / 4) * 8 + 2048 * (H * 2 + 8)
    assert c["activation_bytes_per_micro_batch"] == pytest.approx(per_block * L + logits)
    assert c["activation_bytes_in_flight"] == pytest.approx(c["activation_bytes_per_micro_batch"])
    _, _, piped = _gpt(4, 4)
    p = piped.conventions
    assert p["activation_bytes_per_block_micro_batch"] == per_block
    assert p["activation_bytes_per_micro_batch"] == pytest.approx(per_block * L / 4)
    assert p["activation_bytes_in_flight"] == pytest.approx(4 * per_block * L / 4) == piped.memory["activations"]


def test_megatron_activation_layout_is_korthikantis_count():
    """activations = "megatron" (activations.py): a GPT block with sp keeps, per token, Korthikanti et
    al. 2022's 34 s b h / t bytes under selective recompute (sec. 4.2.2) less their two dropout masks
    (fivefold's model has none) plus the norms' rsqrt: 2 (4h + 2 + 4h + 3f) / t in bf16, where their
    GeLU MLP's 8h is this SwiGLU's 3f (f = 8h/3 rounded to 128: 10880).
    Its backward all-gathers each column-parallel region's input again: per micro-batch 2 regions
    of each of the heaviest tp sender's 4 blocks, (t-1)/t of b s h x 2 bytes on the wire each."""
    cfg, world, own = _gpt(4, 4)
    meg = estimate(cfg, world, H100, options=PlanOptions(activations="megatron"))
    per_token = meg.conventions["activation_bytes_per_block_micro_batch"] / 2048
    assert per_token == pytest.approx(2 * (4 * H + 2 + 4 * H + 3 * 10880) / 4)
    saved = own.conventions["activation_bytes_per_block_micro_batch"] / 2048 - per_token
    assert saved == pytest.approx(2 * (2 * H * (1 - 1 / 4) + 2 * H / 4 + 10880 / 4))  # gathered, normalised, silu
    extra = meg.conventions["tp_wire_bytes_per_step"] - own.conventions["tp_wire_bytes_per_step"]
    assert extra == pytest.approx(64 * 2 * 4 * 3 / 4 * 2048 * 4096 * 2)
    assert any(r.startswith("activations=megatron") for r in meg.not_runnable)
