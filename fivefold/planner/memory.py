"""Memory of one rank: model state (parameters, gradients, optimizer state), activations, buffers.

Model state follows the ZeRO paper's accounting (Rajbhandari et al. 2020, sec. 3.1: mixed-precision
Adam keeps 2 + 2 + 12 = 16 bytes per parameter, a bf16 weight and gradient and fp32 master weight,
momentum and variance): with N = dp_shard ranks and b_p, b_g, b_o bytes per parameter for the
weight, its gradient and its optimizer state (sec. 5),

    DDP     (b_p + b_g + b_o) P           ZeRO-2   (b_p + (b_g + b_o) / N) P
    ZeRO-1  (b_p + b_g + b_o / N) P       ZeRO-3   (b_p + b_g + b_o) P / N

where P is the parameters this rank holds after tp / ep / pp splitting (layout.rank_shares).
Activations use the shared per-block formula (activations.py) times the most blocks a rank holds
at once (terms.inflight_blocks: each forward of the schedule holds its chunk's blocks until that
chunk's backward completes), plus the logits of the last stage. Buffers are the communication
staging the parallel code allocates (below).

Options of other trainers (options.py; fivefold runs both offloads and FP8 weights' gathers):
- offload (offload_state): ZeRO-Offload (Ren et al. 2021) keeps the optimizer state, fp32 master
  included, on the host, with the fp32 gradient partition the CPU's Adam reads; ZeRO-Infinity
  (Rajbhandari et al. 2021) moves the ZeRO-3 parameter shards there too. Per parameter of the
  rank's shard the host holds b_o + 4 (+ b_p with parameters): 16 and 18 bytes at 2,2,12, the
  figures of DeepSpeed's memory estimator (estimate_zero3_model_states_mem_needs, without its 1.5
  buffer margin). On the device the optimizer state goes, and from ZeRO-2 on the gradient shard
  (it leaves for the host as it is reduced; its buckets stay in the buffers). fivefold's own
  (fivefold_state_bytes) keeps fp32 weights, so its host master is the parameter: 16 either way.
- fp8 = "weights": the blocks' weights at rest in 1 byte, the fp32 master in the optimizer state
  as before; the embedding and head stay in bf16 (torchtitan's float8 converts the linear layers
  but the output head; the embedding is no linear layer). fp8 compute keeps FP8 copies of the
  linear layers' inputs for backward (activations.fp8_matmul_input_elements).
- optim.name = "muon" (planner/muon.py): the hidden matrices keep one fp32 moment, not AdamW's two,
  so their optimizer state is 4 bytes less per element (b_o - 4: 8 at 2,2,12; fivefold's own 4
  under DDP, 8 per ZeRO shard element with its fp32 master), on the host under offload.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.config.derive import Derived, reshard_after_forward
from fivefold.config.schema import Config
from fivefold.planner.activations import (
    FP8_BYTES,
    block_activation_bytes,
    fp8_matmul_input_elements,
    per_op_block_elements,
    routed_expert_elements_per_token,
)
from fivefold.planner.layout import RankShare
from fivefold.planner.lora import TrainedShare, adapter_elements, nf4_base
from fivefold.planner.muon import MOMENT_BYTES, state_elements
from fivefold.planner.options import DEFAULT, PlanOptions

# The gradient partition on the host is fp32: DeepSpeed's CPU Adam steps fp32 gradients, and its
# estimator counts 16 bytes per offloaded parameter, 4 (gradient) + 12 (master and two moments)
HOST_GRAD_BYTES = 4.0


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes of one parameter's weight, gradient and optimizer state (`--bytes 2,2,12`)."""

    param: float = 2.0  # bf16 weight
    grad: float = 2.0  # bf16 gradient
    optimizer: float = 12.0  # fp32 master weight + two fp32 Adam moments (8 without the master copy)

    @classmethod
    def parse(cls, text: str) -> "BytesPerParam":
        parts = [float(x) for x in text.split(",")]
        if len(parts) != 3 or min(parts) < 0:
            raise ValueError(f"--bytes '{text}': give three numbers, weight,gradient,optimizer (e.g. 2,2,12)")
        return cls(*parts)

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optimizer


def model_state_bytes(params: float, b: BytesPerParam, zero: int, n: int) -> dict[str, float]:
    """Bytes per rank of `params` parameters under ZeRO stage `zero` sharded over n ranks."""
    out = {"params": params * b.param / (n if zero >= 3 else 1),
           "grads": params * b.grad / (n if zero >= 2 else 1),
           "optimizer": params * b.optimizer / (n if zero >= 1 else 1)}
    return {**out, "total": sum(out.values())}


def offload_state(state: dict[str, float], params: float, zero: int, n: int, offload: str) -> dict[str, float]:
    """A rank's model state (model_state_bytes of `params` over n) with `offload` applied: the
    device part under the same keys and what the host holds under "host" (module docstring)."""
    if offload == "none":
        return {**state, "host": 0.0}
    host = state["optimizer"] + HOST_GRAD_BYTES * params / n + (state["params"] if offload == "params" else 0.0)
    out = {"params": 0.0 if offload == "params" else state["params"],
           "grads": state["grads"] if zero < 2 else 0.0, "optimizer": 0.0}
    return {**out, "total": sum(out.values()), "host": host}


def with_fp8_weights(b: BytesPerParam, options: PlanOptions) -> BytesPerParam:
    """The bytes of a block's parameter under `options`: a 1-byte weight with fp8 = "weights"."""
    return dataclasses.replace(b, param=FP8_BYTES) if options.fp8 == "weights" else b


def largest_fitting_model(memory_bytes: float, b: BytesPerParam, zero: int, n: int) -> float:
    """Parameters whose model state alone fills `memory_bytes` per rank (the "does it fit" table)."""
    return memory_bytes / model_state_bytes(1.0, b, zero, n)["total"]


def fivefold_state_bytes(cfg: Config, params: float, n: int, grad_accum: int,
                         moments: int = 2) -> dict[str, float]:
    """What fivefold's own data-parallel code holds, as its metrics log samples it (after each
    micro-batch's backward): weights and gradients stay fp32 whatever train.dtype (autocast
    computes in bf16), AdamW keeps two fp32 moments (DDP), and ZeRO steps fp32 master shards
    (4 + 8 bytes per parameter over N). ZeRO-1 keeps the full gradient across micro-batches and
    frees it once reduced into the shard; ZeRO-2/3 never keep it; ZeRO-3 frees gathered weights.
    With parallel.offload = "optimizer" (parallel/data/offload.py) the moments go to the host, the
    fp32 shard stays on the device (ZeRO-1/2 gather from it; for ZeRO-3 it is the parameter), and
    the host holds master, both moments and the gradient shard's buffer: 16 bytes per shard element
    under "host" (0 without offload), what offload_state counts for ZeRO's accounting too. With
    "params" (ZeRO-3) the host master is the parameter shard: the same 16 bytes on the host (no
    parameter copy beside it, where ZeRO's accounting adds b_p), and the device keeps neither the
    fp32 shard nor its gradient (each gather's staging buffer lives only while the gather runs).
    `moments`: fp32 moments per element, AdamW's 2 or Muon's 1 (its momentum_buffer).
    """
    zero, offload = cfg.parallel.zero, cfg.parallel.offload if cfg.parallel.zero > 0 else "none"
    if zero == 0:
        out = {"params": 4.0 * params, "grads": 4.0 * params, "optimizer": MOMENT_BYTES * moments * params}
    else:
        # ZeRO-1 with accumulation: the largest sample is a non-last micro-batch's, full gradient
        # held and the shard's gradient not yet made (it is dropped after each optimizer step)
        grads = 4.0 * params if zero == 1 and grad_accum > 1 else 4.0 * params / n
        out = {"params": 0.0 if zero == 3 else 4.0 * params, "grads": 0.0 if offload == "params" else grads,
               "optimizer": {"none": 4.0 + MOMENT_BYTES * moments, "optimizer": 4.0, "params": 0.0}[offload]
               * params / n}
    host = ((4.0 + MOMENT_BYTES * moments + HOST_GRAD_BYTES) * params / n  # master, moments, gradient
            if offload != "none" else 0.0)
    return {**out, "total": sum(out.values()), "host": host}


def state_parts(cfg: Config, d: Derived, share: RankShare,
                options: PlanOptions = DEFAULT) -> list[tuple[int, int, bool]]:
    """(parameters, ranks they are sharded over, in bf16 under FP8 weights) of one pipeline rank:
    its dense parameters over dp_shard (the embedding and head apart) and, with ZeRO and ep > 1,
    its experts over the ranks holding the same experts (expert_dp = dp x cp / ep), as
    parallel/data/zero.py shards them; the routed experts stay bf16 unless options.fp8_experts."""
    p = cfg.parallel
    expert = share.expert_params if p.ep > 1 and p.zero else 0
    return [(share.params - expert - share.vocab_params, d.dp_shard, False), (share.vocab_params, d.dp_shard, True),
            (expert, d.dp * p.cp // p.ep, not options.fp8_experts)]


def rank_state_bytes(cfg: Config, d: Derived, share: RankShare, b: BytesPerParam, implementation: bool,
                     options: PlanOptions = DEFAULT) -> dict[str, float]:
    """A pipeline rank's model state, ZeRO's accounting (or fivefold's own with `implementation`,
    whose ZeRO-3 counts no gathered weights, FP8 or not, and whose parameter offload keeps no
    parameter copy beside the host master) over state_parts, under `options`' offload and FP8
    weights; "host" is what offload keeps on the host for this rank. Under Muon its matrices in
    each part keep one fp32 moment fewer (module docstring)."""
    p = cfg.parallel
    if implementation and options.offload != p.offload:
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(p, offload=options.offload))
    if cfg.lora.rank:
        return lora_state_bytes(cfg, d, share, b, implementation, options)
    dense_muon, expert_muon = state_elements(cfg, share)
    states = []
    # state_parts' order: dense, vocabulary (all AdamW's), experts
    for (n_params, n, vocab), muon in zip(state_parts(cfg, d, share, options), (dense_muon, 0, expert_muon),
                                          strict=True):
        for count, moments in ((n_params - muon, 2), (muon, 1)):
            if implementation:
                states.append(fivefold_state_bytes(cfg, count, n, d.grad_accum, moments))
                continue
            bp = b if vocab else with_fp8_weights(b, options)
            bp = bp if moments == 2 else dataclasses.replace(bp, optimizer=bp.optimizer - MOMENT_BYTES)
            state = model_state_bytes(count, bp, p.zero, n)
            states.append(offload_state(state, count, p.zero, n, options.offload))
    return {k: sum(st[k] for st in states) for k in states[0]}


def lora_state_bytes(cfg: Config, d: Derived, share: RankShare, b: BytesPerParam, implementation: bool,
                     options: PlanOptions = DEFAULT) -> dict[str, float]:
    """rank_state_bytes under LoRA (planner/lora.py): the frozen base (share.params) as weights only, under
    "params", and the adapters with every parameter's state (Muon's one moment: they are 2-D matrices).
    ZeRO-1/2 shard what trains, the base stays whole on every dp rank: fp32 in fivefold's own code, b_p or FP8
    weights' 1 byte in ZeRO's accounting; lora.base_dtype = "nf4" holds the adapted layers' weights in
    NF4 instead (lora.nf4_base). ZeRO-3 shards the base too (parallel/data/fsdp.py), by state_parts: its fp32
    rows, 4 / N bytes an element in fivefold's code, b_p / N in ZeRO's; the units it gathers to compute are
    buffer_bytes' (whole units, base and adapters, no gradient for the base)."""
    adapters, moments, p = adapter_elements(cfg, share), 1 if cfg.optim.name == "muon" else 2, cfg.parallel
    if p.zero == 3:
        fp8 = with_fp8_weights(b, options).param
        base = sum(count * (4.0 if implementation else b.param if bf16 else fp8) / n
                   for count, n, bf16 in state_parts(cfg, d, share, options))
    else:
        elements, nf4 = nf4_base(cfg, share, 4.0 if implementation else b.param)
        base = nf4 + (4.0 * (share.params - elements) if implementation else share.vocab_params * b.param
                      + (share.params - share.vocab_params - elements) * with_fp8_weights(b, options).param)
    if implementation:
        state = fivefold_state_bytes(cfg, adapters, d.dp_shard, d.grad_accum, moments)
    else:
        bp = b if moments == 2 else dataclasses.replace(b, optimizer=b.optimizer - MOMENT_BYTES)
        state = offload_state(model_state_bytes(adapters, bp, p.zero, d.dp_shard), adapters,
                              p.zero, d.dp_shard, options.offload)
    return {**state, "params": state["params"] + base, "total": state["total"] + base}


def expert_imbalance(cfg: Config, options: PlanOptions) -> float:
    """Tokens on the busiest expert rank over the mean: options.expert_imbalance with ep > 1, or
    what a run's measured loads give at this ep (routing.imbalance_by_ep); 1 without expert
    parallelism, where every rank runs all the experts for its own tokens."""
    if cfg.parallel.ep <= 1 or not cfg.model.moe.n_experts:
        return 1.0
    if options.measured_imbalance:  # ep divides the experts (validate), so the run's table has it
        return dict(options.measured_imbalance)[cfg.parallel.ep]
    return options.expert_imbalance


def activation_bytes(cfg: Config, share: RankShare, inflight_blocks: int, local_seq: int, vocab: int,
                     act_bytes: int, options: PlanOptions = DEFAULT) -> dict[str, float]:
    """Bytes kept for backward on one pipeline rank at its peak.

    blocks: block_activation_bytes (activations.py) for one micro-batch of (micro_batch, seq/cp)
    tokens, x the blocks in flight (the rank's blocks once without a pipeline: each micro-batch's
    backward runs before the next forward). logits: the last stage's loss holds one chunk of
    train.loss_chunk tokens' (c, V/tp) logits at a time (loss_bytes), one micro-batch at a time;
    mtp: the MTP depths' activations there (mtp_bytes).
    Under FP8 compute the linear layers' inputs are kept in 1 byte (fp8_matmul_input_elements);
    under torchtitan's per-op selective recompute a dense block keeps per_op_block_elements;
    on the busiest expert rank the routed copies' share is `expert_imbalance` x the mean's
    ("routed_extra": what the imbalance adds per block and micro-batch).
    """
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tokens = t.micro_batch * local_seq
    per_op = (per_op_block_elements(m, p.tp, p.sp) if t.recompute == "selective" and options.selective_ac == "per_op"
              else None)
    per_block = (per_op * tokens * act_bytes if per_op is not None else
                 block_activation_bytes(m, t.micro_batch, local_seq, p.tp, p.sp, t.recompute, act_bytes,
                                        options.activations))
    routed, routed_fp8 = routed_expert_elements_per_token(m, p.tp, p.sp, t.recompute, options.activations)
    routed_bytes = routed * act_bytes
    if options.fp8 != "none" and per_op is None:  # "weights" computes in FP8 too; per-op keeps matmul outputs
        moved, added = fp8_matmul_input_elements(m, p.tp, p.sp, t.recompute, options.activations)
        per_block -= tokens * (moved * (act_bytes - FP8_BYTES) - added * FP8_BYTES)
        routed_bytes -= routed_fp8 * (act_bytes - FP8_BYTES)
    routed_extra = (expert_imbalance(cfg, options) - 1.0) * routed_bytes * tokens
    per_block += routed_extra
    blocks = per_block * inflight_blocks
    logits = loss_bytes(cfg, local_seq, vocab, act_bytes) if share.last else 0.0
    mtp = mtp_bytes(cfg, local_seq, per_block, act_bytes) if share.last else 0.0
    main_blocks = len(share.blocks) - (m.mtp_layers if share.last else 0)  # share.blocks holds the depths' too
    return {"blocks": blocks, "logits": logits, "mtp": mtp, "per_block_microbatch": per_block,
            "routed_extra": routed_extra, "per_micro_batch": per_block * main_blocks + logits + mtp,
            "total": blocks + logits + mtp}


def head_tokens(cfg: Config, local_seq: int) -> int:
    """Tokens one micro-batch sends through the head and its loss on the last stage: the
    micro-batch's (cp-local; with sp the head gathers the sequence first), times 1 + model.mtp_layers,
    whose depths' hidden states go through the head in the same call (pipeline/stages.py StageChunk.losses)."""
    return cfg.train.micro_batch * local_seq * (1 + cfg.model.mtp_layers)


def loss_chunk_tokens(cfg: Config, local_seq: int) -> int:
    """Tokens whose logits exist at once: train.loss_chunk, or with 0 (or more than there are) all the
    tokens of one micro-batch's head call (head_tokens: its MTP depths' included)."""
    n, c = head_tokens(cfg, local_seq), cfg.train.loss_chunk
    return c if 0 < c < n else n


def loss_bytes(cfg: Config, local_seq: int, vocab: int, act_bytes: float) -> float:
    """The head and loss's peak on the last stage (model/head.py ChunkedCrossEntropy), for one chunk
    of c = loss_chunk_tokens tokens and V/tp vocabulary columns: in forward the chunk's fp32 logits
    and log-sum-exp's temporary beside them (ATen's logsumexp: (z - max).exp_()), 8 bytes per (c,
    V/tp) element, more than the compute-dtype product beside its fp32 copy (a + 4); in backward
    the recomputed fp32 softmax and its compute-dtype copy for the two matmuls (4 + a, 4 in fp32).
    Beside them the hidden states the loss saves, (1 + D) micro-batches of tokens x dim in the
    compute dtype (gathered over tp with sp), and two fp32 numbers per token (log-sum-exp, loss).
    Not counted: the head weight's working copies (a V/tp x dim weight gradient)."""
    m, p = cfg.model, cfg.parallel
    c = loss_chunk_tokens(cfg, local_seq)
    peak = c * (vocab / p.tp) * 8.0  # forward's two fp32 (c, V/tp) tensors: backward's 4 + a is no more
    return peak + head_tokens(cfg, local_seq) * (m.dim * act_bytes + 8.0)


def mtp_bytes(cfg: Config, local_seq: int, per_block: float, act_bytes: float) -> float:
    """The MTP depths' activations on the last stage, one micro-batch's (its forward is followed by
    its backward there, as the logits'): per depth its block's (per_block, the main blocks' kind and
    recompute) and per token enorm's and hnorm's inputs, rsqrt and normalised values (2d + 1 each),
    eh_proj's input (2d) and the output norm's (2d + 1): 8d + 3 elements, T/tp tokens with sp."""
    m, p = cfg.model, cfg.parallel
    tokens = cfg.train.micro_batch * local_seq / (p.tp if p.sp else 1)
    return m.mtp_layers * (per_block + tokens * (8 * m.dim + 3) * act_bytes)


def buffer_bytes(cfg: Config, share: RankShare, b: BytesPerParam, local_seq: int, act_bytes: int,
                 grad_ranks: int, grad_accum: int) -> dict[str, float]:
    """Communication staging (order of magnitude, not a byte count):

    dp: parallel.buckets_in_flight + 1 gradient buckets (parallel.bucket_mb each: K reducing while
    one more fills, parallel/data/buckets.py; no more than the gradients); ZeRO-3: the gathered
    weights of two units (current and prefetched, fsdp.py), or kept gathered (the default with
    pipelines) the rank's whole stages and their unsharded gradients during the step, those summed
    over grad_accum > 1 micro-batches in fp32 whatever b.grad (fsdp.py, as FSDP2 upcasts them);
    under LoRA (`share` a lora.TrainedShare) the units are whole, base and adapters, and the gradients
    the adapters' alone; pp: one activation sent and one received per micro-batch; tp with sp: one
    gathered input.
    """
    p, t, d = cfg.parallel, cfg.train, cfg.model.dim
    staged = (p.buckets_in_flight + 1) * p.bucket_mb * 1e6
    kept_grad = max(b.grad, 4.0) if grad_accum > 1 else b.grad
    weights = share.weights if isinstance(share, TrainedShare) else share.params  # LoRA's base with what trains
    dp = (0.0 if grad_ranks <= 1 else min(staged, share.params * b.grad) if p.zero < 3
          else 2 * share.largest_unit * b.param if reshard_after_forward(p)
          else weights * b.param + share.params * kept_grad)
    out = {"dp": dp,
           "pp": 2 * t.micro_batch * local_seq * d * act_bytes / (p.tp if p.sp else 1) if p.pp > 1 else 0.0,
           "tp": t.micro_batch * local_seq * d * act_bytes if p.tp > 1 and p.sp else 0.0}
    return {**out, "total": sum(out.values())}
