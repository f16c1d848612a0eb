"""Bytes each rank sends per optimizer step on each axis, and how long that takes.

Bytes use the same `comms.wire_bytes()` the running code counts with (bandwidth-optimal ring:
all-reduce 2(N-1)/N x S, all-gather / reduce-scatter / all-to-all (N-1)/N x S, send S), so a
prediction and a measurement are the same quantity. Per step, with M micro-batches per rank:

- dp (gradient reduction over dp x cp; Rajbhandari et al. 2020, "ZeRO", sec. 7):
  DDP: all-reduce of the gradients once (on the last micro-batch); ZeRO-1: reduce-scatter of the
  gradients + all-gather of the weights (same bytes as DDP); ZeRO-2: a reduce-scatter on every
  micro-batch + the all-gather; ZeRO-3: two all-gathers of the weights and one reduce-scatter of
  the gradients per micro-batch (3 x params: 1.5x DDP's 2 x params at M = 1), the head's unit
  gathered once without a pipeline (kept for its backward: parallel/data/fsdp.py). A ZeRO shard is
  held by every rank of its dp_replicate group (HSDP) and of its cp group: once a step the
  reduced shard (G / dp_shard, the micro-batches' sum) is all-reduced over each of those groups in
  turn, on their own links, bucket by bucket behind the backward (parallel/data/zero.py; replica_traffic).
- tp (Megatron-LM, Shoeybi et al. 2019; Korthikanti et al. 2022 for sp): per block and micro-batch,
  two all-reduces in forward (attention, MLP; an MoE block's experts are not tp-split: attention
  only) and two in backward, each of the (b, s/cp, d) activation: 8 b s d (t-1)/t element-bytes
  per dense block; with sp an all-gather plus a reduce-scatter replace each all-reduce at the same
  bytes, and the MoE blocks' gradients (each tp rank routed its own tokens) are all-reduced once a
  step. Full recompute runs forward again (+1 per region). The vocabulary-parallel embedding and
  head add one each (with MTP the head's is (1 + D) tokens wide, and the last stage embeds each
  depth's tokens: D more), and the loss one all-gather per chunk of train.loss_chunk tokens of each
  token's fp32 log-sum-exp and target logit (loss_gathers). The MTP depths' blocks count as blocks.
  A q/k norm over the whole projection (OLMo 2) adds, per block,
  two all-reduces of (b, s/cp) fp32 sums of squares in each forward pass and two in backward.
- pp: one activation forward and one gradient backward per micro-batch and stage boundary
  (b s d elements, / t with sp), 2 M per chunk not at the model's ends, less the boundaries
  between two stages of one rank (a V schedule's turn), handed over in memory; with tied
  embeddings or MTP depths, the first and last stage's copies of the embedding sum their
  gradients once a step (an all-reduce of two ranks, each its ZeRO shard).
- cp (ring attention, Liu et al. 2023): K and V of every block go round the ring, C-1 hops in
  forward and again in backward, where a dK/dV buffer (fp32) follows each block and makes one hop
  more, back to its owner (parallel/context.py): 2 (C-1) K/V blocks and C fp32 dK/dV blocks; Ulysses
  (Jacobs et al. 2023): four all-to-alls forward (q, k, v, out) and four backward.
- ep (GShard, Lepikhin et al. 2020): per MoE block and micro-batch, dispatch and combine in
  forward and again in backward: 4 all-to-alls of the token copies (b s/cp top_k d, / t with sp),
  x the expert imbalance on the busiest expert rank (activation_traffic); a group spanning nodes
  sends its node peers' share over NVLink and the rest over the NIC at once, or dispatches as
  DeepSeek-V3's node-limited routing does (expert_comm.py).

LoRA (lora.rank, planner/lora.py): dp reduces the adapters only (ZeRO-3 gathers whole units: lora.dp_gathers);
tp all-reduces their whole factors' gradients (ZeRO: this rank's rows) once a step; frozen embeddings sum nothing.

Reported per axis for the pipeline rank that sends the most (heaviest_senders), Muon's all_to_alls
merged in (planner/muon_step.py times them in the optimizer step); the step's time terms keep the
busiest rank's (the most FLOPs: compute.busiest_chunk), which sets the pace.

Time by an alpha-beta model (Hockney 1994; Thakur et al. 2005 for the collective step counts):
t = steps x alpha + wire bytes / (bandwidth x efficiency), the link being the node's interconnect
or the per-GPU NIC depending on whether the axis's groups cross nodes (layout.axis_spans_nodes).
A collective whose group has k ranks in each node it spans runs as k rings at once, each leaving
the node through another rank's NIC (NCCL's channels): each ring carries 1/k of the bytes, so a
rank's NIC sends 1/k of its wire bytes and NVLink the other (k - 1)/k, at once (`link`'s
ranks_per_node). The data of a dp group over whole nodes enters each node once, not once per GPU.
Point-to-point traffic (pp, cp's ring hops) and the all-to-alls (expert_comm.py) keep one NIC.
A profile from `fivefold calibrate` holds alpha per collective (on gloo their fixed costs per ring
step differ by a factor of two or more); the catalog's one alpha per link serves every op.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.model.counts import ModelCounts, block_params, mtp_extra_params
from fivefold.parallel.comm.wire import wire_bytes
from fivefold.planner.activations import FP8_BYTES, layout_applies
from fivefold.planner.expert_comm import expert_link_bytes
from fivefold.planner.layout import RankShare, axis_spans_nodes, group_ranks_per_node
from fivefold.planner.lora import adapter_elements, dp_gathers, partial_elements
from fivefold.planner.machine.datasheet import GB, Hardware
from fivefold.planner.machine.pricing import ChunkWork, Row
from fivefold.planner.memory import expert_imbalance, head_tokens, loss_chunk_tokens
from fivefold.planner.options import PlanOptions

AXES = ("dp", "tp", "pp", "cp", "ep")


def loss_chunks(cfg: Config, local_seq: int) -> list[tuple[int, int]]:
    """(tokens of a chunk, how many such chunks) of one micro-batch's loss (model/head.py: chunks of
    train.loss_chunk tokens, the last one shorter; 0 or a chunk of them all: one chunk)."""
    n, c = head_tokens(cfg, local_seq), loss_chunk_tokens(cfg, local_seq)
    return [(c, n // c)] + ([(n % c, 1)] if n % c else [])


def loss_gathers(cfg: Config, local_seq: int) -> list[tuple[float, int]]:
    """The vocabulary-parallel loss's tp collectives of one micro-batch as (bytes of one, how many),
    as comm/collectives.py counts them: per chunk of c tokens ONE all-gather of each rank's (2, c)
    fp32 log-sum-exps and target logits (parallel/tensor.py _gather_over), counted by its output,
    (tp x 2 x c) fp32 values; nothing in backward (model/head.py). None at tp = 1."""
    tp = cfg.parallel.tp
    return [] if tp <= 1 else [(tp * 2 * c * 4.0, count) for c, count in loss_chunks(cfg, local_seq)]


@dataclass
class AxisTraffic:
    """One axis on one rank for one step."""

    bytes: float = 0.0  # wire bytes this rank sends
    message_bytes: float = 0.0  # the collectives' tensors, whole (conventions.py: what papers count)
    calls: int = 0  # collectives (alpha is paid per step of each)
    steps: int = 0  # ring steps summed over the calls (latency terms)
    inter_node: bool = False
    ranks_per_node: int = 1  # of a group across nodes, the members in one node: rings at once (link)
    time_s: float = 0.0
    op_steps: dict[str, int] = field(default_factory=dict)  # the steps by collective
    # Collectives on groups of their own, each on its own link, merged in (bytes, calls, time_s):
    # ZeRO's all-reduces over a shard's replicas.
    merged: dict[str, AxisTraffic] = field(default_factory=dict)

    def add(self, op: str, nbytes: float, n: int, count: float = 1) -> None:
        if n <= 1 or count <= 0 or nbytes <= 0:  # no peer, or nothing to send: no collective runs
            return
        self.bytes += count * wire_bytes(op, nbytes, n)  # the formula the running code counts with
        self.message_bytes += count * nbytes
        self.calls += int(count)
        steps = int(count * ring_steps(op, n))
        self.steps += steps
        self.op_steps[op] = self.op_steps.get(op, 0) + steps

    def absorb(self, name: str, other: AxisTraffic) -> None:
        """Merge `other` (its time_s set) in as part `name`."""
        self.bytes += other.bytes
        self.message_bytes += other.message_bytes
        self.calls += other.calls
        self.time_s += other.time_s
        self.merged[name] = other

    @property
    def merged_s(self) -> float:
        return sum(t.time_s for t in self.merged.values())


def ring_steps(op: str, n: int) -> int:
    """Latency terms of one collective over n ranks (Thakur et al. 2005): 2(n-1) for a ring
    all-reduce, 1 for a send or broadcast, n-1 for the others."""
    return {"all_reduce": 2 * (n - 1), "send": 1, "broadcast": 1}.get(op, n - 1)


def link(hw: Hardware, inter_node: bool, op: str | None = None, ranks_per_node: int = 1) -> tuple[float, float]:
    """(bandwidth in bytes/s after efficiency, latency per step in s) of the link an axis uses;
    with `op`, that collective's own latency where the profile measured one per collective. Across
    nodes with k = ranks_per_node members of the group in each node (module docstring), the k
    rings' wire bytes leave through k NICs while (k - 1)/k of them cross NVLink:
    bytes / min(k x NIC, NVLink x k / (k - 1))."""
    bw, alpha = ((hw.inter_bw, hw.inter_latency) if inter_node else (hw.intra_bw, hw.intra_latency))
    if inter_node and ranks_per_node > 1:
        bw = min(ranks_per_node * hw.inter_bw, hw.intra_bw * ranks_per_node / (ranks_per_node - 1))
    return bw * hw.bw_efficiency, dict(hw.collective_alpha).get(op, alpha)


def latency_of(t: AxisTraffic, hw: Hardware) -> float:
    """The latency terms of `t`'s collectives: each op's steps x its link's alpha."""
    return sum(steps * link(hw, t.inter_node, op)[1] for op, steps in t.op_steps.items())


def time_of(t: AxisTraffic, hw: Hardware) -> float:
    return latency_of(t, hw) + t.bytes / link(hw, t.inter_node, None, t.ranks_per_node)[0]


def dp_traffic(zero: int, n: int, grad_bytes: float, param_bytes: float, micro: int,
               reshard_after_forward: bool = True, into: AxisTraffic | None = None,
               kept_bytes: float = 0.0) -> AxisTraffic:
    """Gradient reduction of one rank's `grad_bytes` (and weight gathers of `param_bytes`) over n,
    added to `into` if given. ZeRO-2 reduce-scatters on every backward of each chunk (B or W);
    ZeRO-3 resharding gathers for every forward and backward, but `kept_bytes` of the weights (the
    head's unit without a pipeline: RankShare.kept_unit) only for the forward; kept gathered once
    per step (parallel/data/fsdp.py)."""
    t = into if into is not None else AxisTraffic()
    if zero == 0:
        t.add("all_reduce", grad_bytes, n)
    elif zero in (1, 2):
        t.add("reduce_scatter", grad_bytes, n, micro if zero == 2 else 1)
        t.add("all_gather", param_bytes, n)
    elif reshard_after_forward:
        t.add("all_gather", param_bytes, n, micro)  # for the forwards
        t.add("all_gather", param_bytes - kept_bytes, n, micro)  # for the backwards
        t.add("reduce_scatter", grad_bytes, n, micro)
    else:
        t.add("all_gather", param_bytes, n)
        t.add("reduce_scatter", grad_bytes, n)
    return t


def replica_traffic(cfg: Config, d: Derived, hw: Hardware, shard_grad_bytes: float) -> dict[str, AxisTraffic]:
    """The all-reduces of one rank's reduced dense gradient shard (`shard_grad_bytes`) over the ranks
    that hold the same ZeRO shard, by group: dp_replicate (HSDP) and cp, one after the other, once a
    step at every ZeRO stage (parallel/data/zero.py: the last micro-batch's rows join the earlier ones'
    first). Each timed on its group's link."""
    p = cfg.parallel
    if p.zero == 0:  # DDP all-reduces over the whole grad view (dp x cp) already
        return {}
    out = {}
    for axis, n in (("dp_replicate", p.dp_replicate), ("cp", p.cp)):
        if n > 1:
            t = AxisTraffic(inter_node=axis_spans_nodes(cfg, d, hw.gpus_per_node, axis),
                            ranks_per_node=group_ranks_per_node(cfg, d, hw.gpus_per_node, axis))
            t.add("all_reduce", shard_grad_bytes, n)
            t.time_s = time_of(t, hw)
            out[axis] = t
    return out


def activation_traffic(cfg: Config, blocks: int, moe_blocks: int, first: bool, last: bool,
                       local_seq: int, micro: int, act_bytes: int, wire_boundaries: int,
                       imbalance: float = 1.0, regather: bool = False) -> dict[str, AxisTraffic]:
    """tp, pp, cp and ep traffic of one pipeline rank holding `blocks` blocks.

    wire_boundaries: the sides of stage boundaries this rank's stages have with another rank's
    (RankShare.wire_boundaries): each sends one message a micro-batch, the activation forward or
    its gradient back. imbalance: tokens on the busiest expert rank over the mean;
    that rank receives imbalance x the mean's token copies in each dispatch (and in the combine's
    backward) and sends as many back in each combine (and in the dispatch's backward), so each of
    its all-to-alls carries imbalance x the balanced bytes through its link. regather: with sp,
    the backward all-gathers each column-parallel region's input again (Megatron-LM's layout,
    activations.py), one all-gather more per region and micro-batch.
    """
    m, p, t = cfg.model, cfg.parallel, cfg.train
    b = t.micro_batch
    act = b * local_seq * m.dim * act_bytes  # one (b, s/cp, d) activation
    out = {axis: AxisTraffic() for axis in ("tp", "pp", "cp", "ep")}
    # tp: 2 per tp region (1 fwd + 1 bwd), +1 with full recompute; attention is a region in every
    # block, the MLP only in dense blocks (an MoE block's experts are not split by tp: without sp
    # every tp rank routes the same tokens, with sp its own, neither talks over tp); embedding fwd, head bwd.
    # With MTP (D depths, their blocks among `blocks`) the last stage embeds each depth's tokens (D
    # embedding calls) and its head's input is (1 + D) micro-batches of tokens wide.
    per_region = 2 + (1 if t.recompute == "full" else 0)
    regions = 2 * blocks - moe_blocks
    depths = m.mtp_layers if last else 0
    out["tp"].add("all_reduce", act, p.tp, micro * (per_region * regions + int(first) + int(last) + 2 * depths))
    if p.sp and depths:  # each depth's eh_proj and norms see T/tp tokens: their fp32 gradients summed over tp
        out["tp"].add("all_reduce", mtp_extra_params(m) * 4.0, p.tp, micro * depths)
    if regather and p.sp:
        out["tp"].add("all_gather", act, p.tp, micro * regions)
    if last:  # the vocabulary-parallel loss: per chunk one all-gather of each token's log-sum-exp and target logit
        for nbytes, count in loss_gathers(cfg, local_seq):
            out["tp"].add("all_gather", nbytes, p.tp, micro * count)
    fwd_passes = 2 if t.recompute == "full" else 1
    if m.norm.qk and m.norm.qk_span == "all" and not m.latent.kv_lora_rank:
        # OLMo 2's q/k norm over the whole projection, split with the heads: each token's fp32 sum of
        # squares of q and of k summed over tp in every forward pass, and their gradients in backward
        out["tp"].add("all_reduce", b * local_seq * 4, p.tp, micro * blocks * 2 * (fwd_passes + 1))
    # pp: the activation out of a stage boundary's lower side, its gradient back from the upper.
    out["pp"].add("send", act / (p.tp if p.sp else 1), p.pp, micro * wire_boundaries)
    # cp: ring K/V (per tp rank's kv heads), or Ulysses' all-to-alls of q, k, v, out.
    hd = m.head_dim or m.dim // m.n_heads
    kv = 2 * b * local_seq * (m.n_kv_heads // p.tp) * hd * act_bytes  # K and V of one block
    if p.cp > 1 and p.cp_method == "ring":
        # each hop sends this rank's current block: (C-1) K/V sends per pass, forward and backward;
        # in backward also C sends of the fp32 dK/dV buffer (the last one home to the block's owner)
        out["cp"].add("send", kv, p.cp, micro * blocks * (p.cp - 1) * (fwd_passes + 1))
        out["cp"].add("send", kv * 4 / act_bytes, p.cp, micro * blocks * p.cp)
    elif p.cp > 1:
        qkvo = 2 * b * local_seq * (m.n_heads // p.tp) * hd * act_bytes + kv  # q, out, k, v
        out["cp"].add("all_to_all", qkvo / 4, p.cp, micro * blocks * 4 * (fwd_passes + 1))
    # ep: dispatch + combine, forward and backward, of the top_k copies of each token (with sp, of
    # this tp rank's T/tp tokens: each routes its own).
    copies = imbalance * b * local_seq * m.moe.top_k * m.dim * act_bytes / (p.tp if p.sp else 1)
    out["ep"].add("all_to_all", copies, p.ep, micro * moe_blocks * 2 * (fwd_passes + 1))
    return out


def moe_partial_params(cfg: Config, share: RankShare) -> int:
    """Parameters of the rank's MoE blocks that sp leaves whole but fed T/tp tokens (router, shared
    and its routed experts; parallel/expert.py's tp_partial), the norms with them (a few x dim)."""
    m, ep = cfg.model, cfg.parallel.ep
    return sum(bp.replicated + bp.experts // ep for bp in (block_params(m, b) for b in share.blocks) if bp.experts)


def rank_traffic(cfg: Config, share: RankShare, moe_blocks: int, options: PlanOptions, d: Derived,
                 hw: Hardware, grad_b: float, param_b: float, act_bytes: int) -> dict[str, AxisTraffic]:
    """Every axis's traffic of one pipeline rank (holding `share`, `moe_blocks` of its blocks with
    routed experts) for one step, timed on the links its groups use. grad_b,
    param_b: bytes of one gradient and one weight element on the wire; FP8 weights gather the
    blocks' weights in 1 byte (torchtitan's float8 all-gather casts each linear layer's weight
    shard to float8 before the FSDP all-gather: docs/float8.md), the embedding and head in param_b."""
    p = cfg.parallel
    micro, n_shard, grad_ranks = d.grad_accum, d.dp_shard, d.dp * p.cp
    block_b = FP8_BYTES if options.fp8 == "weights" else param_b
    # Dense gradients over the grad view (ZeRO: shards over dp_shard); routed experts (ep > 1) over
    # the ranks holding the same experts, expert_dp, where ZeRO shards them too (parallel/data/zero.py).
    lora = cfg.lora.rank > 0  # only the adapters train (planner/lora.py): frozen experts and vocabulary
    expert = share.expert_params if p.ep > 1 and (p.zero == 3 or not lora) else 0  # LoRA: ZeRO-3 gathers them
    dense = adapter_elements(cfg, share) if lora else share.params - expert
    dense_weights, kept_weights = (dp_gathers(cfg, share, d.vocab_size, param_b, block_b) if lora else (
        (dense - share.vocab_params) * block_b + share.vocab_params * param_b,
        (share.kept_unit - share.kept_vocab) * block_b + share.kept_vocab * param_b))
    dp = dp_traffic(p.zero, grad_ranks if p.zero == 0 else n_shard, dense * grad_b, dense_weights, micro,
                    d.reshard_after_forward, kept_bytes=kept_weights)
    dp_traffic(p.zero, grad_ranks // p.ep, expert * grad_b * (not lora),  # fivefold's FP8 leaves experts bf16
               expert * (block_b if options.fp8_experts else param_b), micro, d.reshard_after_forward, dp)
    traffic = {"dp": dp}
    traffic.update(activation_traffic(cfg, len(share.blocks), moe_blocks, share.first, share.last, d.local_seq_len,
                                      micro, act_bytes, share.wire_boundaries, expert_imbalance(cfg, options),
                                      options.activations == "megatron" and layout_applies(cfg.model, "megatron")))
    if lora and partial_elements(cfg, share):  # the adapters' whole factors: one all-reduce a step (lora.py)
        traffic["tp"].add("all_reduce", partial_elements(cfg, share) * grad_b / (n_shard if p.zero else 1), p.tp)
    if p.sp and moe_blocks and not lora:  # each tp rank's MoE gradients cover its own tokens: summed once a step
        traffic["tp"].add("all_reduce", moe_partial_params(cfg, share) * grad_b, p.tp)
    if (cfg.model.tie_embeddings or cfg.model.mtp_layers) and share.first != share.last and not lora:
        # the embedding's two copies (a tied head's, the MTP depths'), on the first and the last stage's
        # ranks: once a step the sum of their gradients (this rank's rows; its ZeRO shard), pipeline/executor.py
        rows = d.vocab_size * cfg.model.dim // p.tp
        traffic["pp"].add("all_reduce", (-(-rows // n_shard) if p.zero else rows) * grad_b, 2)
    for axis, tr in traffic.items():
        # ZeRO's own collectives run over dp_shard (HSDP keeps them inside a node); DDP's over dp x cp.
        groups = "dp_shard" if axis == "dp" and p.zero else axis
        tr.inter_node = axis_spans_nodes(cfg, d, hw.gpus_per_node, groups)
        if tr.inter_node and axis in ("dp", "tp"):  # collectives: one ring per member in a node (link)
            tr.ranks_per_node = group_ranks_per_node(cfg, d, hw.gpus_per_node, groups)
        tr.time_s = time_of(tr, hw)
    ep = traffic["ep"]
    if ep.bytes and ep.inter_node:  # node peers over NVLink, the rest over the NIC, at once (expert_comm.py)
        inter, intra = expert_link_bytes(cfg, d, hw.gpus_per_node, ep.bytes, options.ep_dispatch,
                                         options.fp8 != "none", act_bytes)
        ep.bytes = inter + intra
        ep.time_s = latency_of(ep, hw) + max(inter / link(hw, True)[0], intra / link(hw, False)[0])
    for group, replicas in replica_traffic(cfg, d, hw, dense * grad_b / n_shard).items():
        dp.absorb(f"replicas over {group}", replicas)
    return traffic


def step_traffic(work: ChunkWork, d: Derived, hw: Hardware, grad_b: float, param_b: float,
                 act_bytes: int) -> tuple[dict[str, AxisTraffic], list[Row]]:
    """rank_traffic of the busiest rank (its times are the step's), and one explain row per axis
    that sends anything."""
    traffic = rank_traffic(work.cfg, work.share, work.moe_blocks, work.options, d, hw, grad_b, param_b,
                           act_bytes)
    rows = []
    for axis, tr in traffic.items():
        parts = [(f"{axis} traffic", own_part(tr)),
                 *((f"{axis} traffic, {name}", t) for name, t in tr.merged.items())]
        rows += [traffic_row(name, t, hw) for name, t in parts if t.bytes]
    return traffic, rows


def own_part(tr: AxisTraffic) -> AxisTraffic:
    """`tr` without its merged parts: the collectives priced by its own op_steps and link."""
    merged = tr.merged.values()
    return AxisTraffic(tr.bytes - sum(t.bytes for t in merged), tr.message_bytes - sum(t.message_bytes for t in merged),
                       tr.calls - sum(t.calls for t in merged), tr.steps, tr.inter_node, tr.ranks_per_node,
                       tr.time_s - tr.merged_s, tr.op_steps)


def traffic_row(name: str, tr: AxisTraffic, hw: Hardware) -> Row:
    rings = f" ({tr.ranks_per_node} rings at once, each through another rank's NIC)" if tr.ranks_per_node > 1 else ""
    where = f"across nodes{rings}" if tr.inter_node else "inside a node"
    steps = " + ".join(f"{k} {op} steps x {link(hw, tr.inter_node, op)[1] * 1e6:.0f} us"
                       for op, k in tr.op_steps.items())
    alpha_source = "collective_alpha" if hw.collective_alpha else "inter_latency" if tr.inter_node else "intra_latency"
    return (name, f"{tr.bytes / GB:.3f} GB in {tr.calls} collectives, {where}: {steps} + "
            f"bytes / {link(hw, tr.inter_node, None, tr.ranks_per_node)[0] / GB:.2f} GB/s = {tr.time_s * 1e3:.2f} ms",
            "comm.py (wire_bytes ring accounting; alpha-beta, Hockney 1994); alpha: "
            + hw.sources.get(alpha_source, "profile"))


def with_parts(traffic: dict[str, AxisTraffic], parts: dict[str, AxisTraffic], name: str) -> dict[str, AxisTraffic]:
    """`traffic` with `parts` (by axis, timed) merged in as part `name`, in copies: `traffic` stays as it was."""
    out = dict(traffic)
    for axis, part in parts.items():
        out[axis] = dataclasses.replace(out[axis], op_steps=dict(out[axis].op_steps), merged=dict(out[axis].merged))
        out[axis].absorb(name, part)
    return out


def heaviest_senders(work: ChunkWork, shares: list[RankShare], counts: ModelCounts, timed: dict[str, AxisTraffic],
                     d: Derived, hw: Hardware, grad_b: float, param_b: float, act_bytes: int,
                     optimizer: list[dict[str, AxisTraffic]] | None = None,
                     ) -> tuple[dict[str, AxisTraffic], list[Row], list[dict[str, AxisTraffic]]]:
    """Per axis, the traffic of the pipeline rank that sends the most (the first of equals, the
    busiest rank `work.share` if it is one of them), a row naming it where it is not the busiest
    rank, whose `timed` traffic the step's time terms keep (its collectives are on the critical
    path), and every pipeline rank's traffic, by pp rank. The first and last stages send one
    pipeline message per micro-batch and chunk fewer than the middle ones; the last holds the
    head's and the loss's tp collectives. `optimizer`: per pipeline rank (shares' order), the optimizer
    step's collectives (Muon's), merged in as part "muon"."""
    cfg, busiest = work.cfg, work.share.pp_rank
    per_rank = {s.pp_rank: (timed if s.pp_rank == busiest else rank_traffic(
        cfg, s, sum(1 for b in s.blocks if counts.block(b).experts), work.options, d, hw, grad_b,
        param_b, act_bytes)) for s in shares}
    for s, parts in zip(shares, optimizer or [], strict=False):
        per_rank[s.pp_rank] = with_parts(per_rank[s.pp_rank], parts, "muon")
    out, rows = {}, []
    for axis in AXES:
        top = max(per_rank, key=lambda r: (per_rank[r][axis].bytes, r == busiest, -r))
        out[axis] = per_rank[top][axis]
        if top != busiest and out[axis].bytes > timed[axis].bytes:
            rows.append((f"{axis} traffic, heaviest sender",
                         f"pipeline rank {top} of {cfg.parallel.pp} sends the most: {out[axis].bytes / GB:.3f} GB "
                         f"(reported); the busiest rank {busiest} sends {timed[axis].bytes / GB:.3f} GB, whose "
                         f"{timed[axis].time_s * 1e3:.2f} ms are on the step's critical path",
                         "comm.rank_traffic of every pipeline rank (layout.rank_shares)"))
    if len(shares) > 1 and not rows:
        rows.append(("traffic, heaviest sender", f"the busiest pipeline rank {busiest} of {cfg.parallel.pp} sends "
                     "the most on every axis (reported and timed)", "comm.rank_traffic of every pipeline rank"))
    return out, rows, [per_rank[s.pp_rank] for s in shares]
