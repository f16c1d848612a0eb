"""LoRA's price in the step (lora.rank > 0; planner/lora.py counts the adapters).

Compute, per micro-batch and chunk, beside what the hardware's pricer gave the full model:
- the frozen base computes no weight gradients (autograd skips a matmul whose weight does not
  require grad): a third of every base matmul's FLOPs. On a catalog GPU each matmul's weight
  gradient X^T dY at its own shape (roofline.py) is taken out of the backward; with other pricers
  (FLOPs at peak x compute_efficiency, a calibrated profile) the base matmuls' share of the forward,
  the same FLOPs as their weight gradients. The input gradients stay: the adapters below need them.
- the adapters' matmuls: forward x A^T, (.) B^T, backward their input and weight gradients (2x the
  forward), each at its roofline (skinny: r = 16 is far below a tile, so mostly bandwidth), and
  their elementwise kernels at HBM speed: forward the scaling's product and the sum with the base's
  output (5 (T, out) reads and writes), backward the scaling's gradient and the sum of the adapter's
  input gradient into the base's (2 (T, out) + 3 (T, in)). Full recompute runs their forward again.
Memory (memory.rank_state_bytes), traffic (comm.rank_traffic; data parallel's gathers: lora.dp_gathers)
and MFU's model FLOPs (flops.py: the work LoRA needs, 4 per base weight and token rather than 6, plus 6
per adapter parameter) are priced where their terms are.
"""

from __future__ import annotations

from fivefold.config.schema import Config
from fivefold.model.counts import flops_per_token
from fivefold.planner.layout import RankShare
from fivefold.planner.lora import (
    activation_bytes_per_block,
    adapter_elements,
    adapter_params,
    model_adapters,
    partial_elements,
    rank_adapters,
    trained_share,
)
from fivefold.planner.machine.datasheet import GB, Hardware
from fivefold.planner.machine.ops import Ops, block_ops, end_ops
from fivefold.planner.machine.pricing import ChunkPrice, ChunkWork, Memo, Row
from fivefold.planner.machine.roofline import _check_fp8, matmul_seconds, rank_shapes

SOURCE = "model/lora.py (Hu et al. 2021); planner/lora.py, lora_step.py"


def trainable_share(cfg: Config, share: RankShare) -> RankShare:
    """`share` as data parallel and the optimizer see it: with LoRA only its adapters train (no experts, no
    vocabulary), and ZeRO-3 gathers whole units, base and adapters (lora.trained_share); unchanged without."""
    return trained_share(cfg, share) if cfg.lora.rank else share


def with_adapter_activations(cfg: Config, share: RankShare, acts: dict[str, float], held: int, tokens: int,
                             act_bytes: int) -> dict[str, float]:
    """memory.activation_bytes' `acts` with the adapters' saved tensors (lora.activation_bytes_per_block) in
    every block in flight, under "lora"; unchanged without LoRA."""
    per_block = activation_bytes_per_block(cfg, share, tokens, act_bytes)
    if not per_block:
        return acts
    return {**acts, "lora": per_block * held, "per_block_microbatch": acts["per_block_microbatch"] + per_block,
            "per_micro_batch": acts["per_micro_batch"] + per_block * len(share.blocks),
            "total": acts["total"] + per_block * held}


def _weight_grad_seconds(work: ChunkWork, hw: Hardware, memo: Memo) -> float:
    """The base matmuls' weight gradients of one micro-batch over the rank's chunks, each at its
    roofline as roofline.price_ops prices it (the blocks', the embedding's and the head's)."""
    m, share, shapes, fp8 = work.cfg.model, work.share, rank_shapes(work), _check_fp8(work, hw)

    def of(ops: Ops) -> float:
        return sum(matmul_seconds(mm.k, mm.n, mm.m, hw, shapes.act_bytes, fp8 and mm.name not in ops.bf16_matmuls)
                   * mm.count for mm in ops.matmuls)
    blocks = sum(memo.get(("lora weight grads", m, b, shapes, hw, fp8), lambda b=b: of(block_ops(m, b, shapes)))
                 for b in share.blocks if b < m.n_layers)
    ends = of(end_ops(m, work.vocab, shapes, share.first, share.last, work.cfg.train.loss_chunk)) \
        if share.first or share.last else 0.0
    return blocks + ends


def _adapter_seconds(work: ChunkWork, hw: Hardware) -> tuple[float, float, float]:
    """(forward, backward, FLOPs forward) of the rank's adapters over one micro-batch and its chunks."""
    cfg = work.cfg
    r, tp, a = cfg.lora.rank, cfg.parallel.tp, work.act_bytes
    tokens = cfg.train.micro_batch * work.local_seq
    adapters = rank_adapters(cfg, work.share)
    flops = float(tokens * sum(x.forward_flops(r, tp) for x in adapters))
    if not hw.sm_count:  # no roofline: FLOPs at the rate the rest is priced at (datasheet.DatasheetPricer)
        rate = hw.peak_flops * hw.compute_efficiency
        return flops / rate, 2 * flops / rate, flops
    bw, fwd, bwd = hw.hbm_bw * hw.hbm_efficiency, 0.0, 0.0
    for x in adapters:
        i, o = x.widths(tp)
        for mm, k, n in ((tokens, i, r), (tokens, r, o)):  # x A^T: (T, in) (in, r); then (T, r) (r, out)
            fwd += matmul_seconds(mm, n, k, hw, a, False)
            bwd += matmul_seconds(mm, k, n, hw, a, False) + matmul_seconds(k, n, mm, hw, a, False)
        fwd += 5 * tokens * o * a / bw
        bwd += (2 * tokens * o + 3 * tokens * i) * a / bw
    return fwd, bwd, flops


def lora_chunk(work: ChunkWork, chunk: ChunkPrice, hw: Hardware, memo: Memo) -> ChunkPrice:
    """`chunk` (the pricer's, for the full model) with LoRA's changes (module docstring); unchanged without."""
    cfg = work.cfg
    if not cfg.lora.rank:
        return chunk
    c = work.chunks
    if hw.sm_count:
        saved = _weight_grad_seconds(work, hw, memo) / c
        how = "each base matmul's X^T dY at its roofline"
    else:
        share = (work.forward_flops - work.attention_forward_flops) / work.forward_flops if work.forward_flops else 0.0
        saved, how = chunk.forward_s * share, f"the base matmuls' {share:.1%} of the forward"
    fwd, bwd, flops = (s / c for s in _adapter_seconds(work, hw))
    rerun = fwd if cfg.train.recompute == "full" else 0.0
    forward, backward = chunk.forward_s + fwd, chunk.backward_s - saved + bwd + rerun
    row = ("compute: LoRA", f"frozen base: no weight gradients, -{saved * 1e3:.2f} ms of the backward ({how}); "
           f"adapters: {len(rank_adapters(cfg, work.share))} layers on the rank, {flops:.3e} FLOP forward per chunk, "
           f"+{fwd * 1e3:.2f} ms forward, +{(bwd + rerun) * 1e3:.2f} ms backward (matmuls at their roofline, "
           f"the scaling and sums at HBM speed); per chunk now {forward * 1e3:.3f} + {backward * 1e3:.3f} ms", SOURCE)
    return ChunkPrice(forward, backward, [*chunk.explain, row], chunk.detail)


def lora_row(cfg: Config, share: RankShare, grad_b: float, n_shard: int) -> list[Row]:
    """The summary row `--explain` shows: what trains, its state and its traffic."""
    if not cfg.lora.rank:
        return []
    lo, p = cfg.lora, cfg.parallel
    total, mine, partial = adapter_params(cfg), adapter_elements(cfg, share), partial_elements(cfg, share)
    moments = 1 if cfg.optim.name == "muon" else 2
    zero3 = "; ZeRO-3 shards the base too, gathers it with the adapters unit by unit, never reduces it"
    return [("LoRA", f"rank {lo.rank} on {', '.join(lo.targets)}: {len(model_adapters(cfg))} adapted layers, "
             f"{total:,} adapter parameters ({total / 1e6:.2f}M) train, the base is frozen (its weights only: no "
             f"gradient, no optimizer state, no reduction); this rank's adapters {mine:,} "
             f"({moments} fp32 moment{'s' if moments == 2 else ''} each"
             + (f", ZeRO-{p.zero} over {n_shard}" if p.zero else "") + f"); dp reduces {mine * grad_b / GB:.4f} GB "
             "of adapter gradients" + (zero3 if p.zero == 3 else "")
             + (f"; tp all-reduces the whole factors' {partial * grad_b / GB:.4f} GB of gradients once a step"
                if partial else ""), SOURCE)]


def lora_flops_per_token(cfg: Config, vocab_size: int) -> tuple[float, float]:
    """(model FLOPs per token LoRA's step removes, adds): the base's weight gradients, 2 per active
    matmul weight (a third of its 6), and the adapters' 6 per parameter (every token goes through
    every adapter); (0, 0) without LoRA. The attention core keeps its forward and backward."""
    if not cfg.lora.rank:
        return 0.0, 0.0
    f = flops_per_token(cfg.model, cfg.train.seq_len, vocab_size)
    return f["matmul"] / 3, 6.0 * adapter_params(cfg)
