"""Where things live in a layout: which blocks each pipeline rank holds, how many parameters a
rank keeps after tp/ep/pp splitting, and whether an axis's groups stay inside one node.

A layout *is* a `Config` here: the planner estimates exactly what `fivefold train` would run,
and the search filters candidates with the same `validate()`. `--layout dp=8,tp=8,...` is only a
short way to write `parallel.*`, `train.recompute` and `train.micro_batch` overrides.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.model.counts import ModelCounts, block_rank_params
from fivefold.parallel.pipeline.stage_split import split_of_counts
from fivefold.planner.options import DEFAULT, OPTION_KEYS, PlanOptions, parse_option

# --layout keys -> config keys (everything else is refused with the list of valid keys)
LAYOUT_KEYS = {
    "dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp", "ep": "parallel.ep",
    "zero": "parallel.zero", "sp": "parallel.sp", "pp_schedule": "parallel.pp_schedule",
    "virtual_stages": "parallel.virtual_stages", "v": "parallel.virtual_stages", "cp_method": "parallel.cp_method",
    "dp_replicate": "parallel.dp_replicate", "recompute": "train.recompute", "micro_batch": "train.micro_batch",
    "mb": "train.micro_batch", "dp_overlap": "parallel.overlap_comm",
}


def split_layout(text: str, options: PlanOptions = DEFAULT) -> tuple[list[str], PlanOptions]:
    """"dp=8,tp=8,sp=true,tp_overlap=on" -> (["--parallel.dp=8", "--parallel.tp=8", "--parallel.sp=true"],
    options with tp_overlap): the config's keys become overrides, the planner's own (options.py) options."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if sep and key in OPTION_KEYS:
            options = parse_option(options, key, value)
            continue
        if not sep or key not in LAYOUT_KEYS:
            valid = ", ".join([*LAYOUT_KEYS, *OPTION_KEYS])
            raise ValueError(f"--layout item '{item}': expected KEY=VALUE with KEY in {valid}")
        value = value.strip()
        if key in ("pp_schedule", "recompute", "cp_method"):
            value = f'"{value}"'
        out.append(f"--{LAYOUT_KEYS[key]}={value}")
    return out, options


def layout_overrides(text: str) -> list[str]:
    """"dp=8,tp=8,sp=true" -> ["--parallel.dp=8", "--parallel.tp=8", "--parallel.sp=true"]."""
    return split_layout(text)[0]


def stage_sizes(cfg: Config, counts: ModelCounts) -> list[int]:
    """Blocks in each (virtual) stage, in model order: the runtime's split (parallel/pipeline/stage_split.py)."""
    return list(split_of_counts(cfg, counts))


def stage_to_rank(cfg: Config, stage: int) -> int:
    """Same placement as schedules.Schedule.stage_to_rank: loop, or V for zb_v / dualpipe_v."""
    p = cfg.parallel
    if p.pp_schedule in ("zb_v", "dualpipe_v"):
        return stage if stage < p.pp else 2 * p.pp - 1 - stage
    return stage % p.pp


@dataclass(frozen=True)
class RankShare:
    """What one pipeline rank holds (per tp/ep rank), in parameters."""

    pp_rank: int
    blocks: list[int]  # global block indices; on the last rank the MTP depths' too (n_layers + k)
    chunk_blocks: int  # the largest (virtual) stage on this rank, in blocks
    params: int  # parameters on this rank after tp and ep splitting
    expert_params: int  # the routed-expert part of `params`
    first: bool  # holds the embedding
    last: bool  # holds the final norm, head and loss
    largest_unit: int  # ZeRO-3 gathers a unit (one block, the embedding or the head) at a time
    vocab_params: int = 0  # the embedding's and head's part of `params` (FP8 recipes keep them in bf16)
    # Sides of stage boundaries between this rank's stages and another rank's; a V schedule's turn
    # (its last rank's two stages) is handed over in memory (parallel/pipeline/p2p.py).
    wire_boundaries: int = 0
    # ZeRO-3 resharding keeps the head's unit gathered from its forward to its backward when no
    # pipeline runs anything between them (parallel/data/fsdp.py): its parameters (a tied embedding on
    # this rank shares the unit) and their vocabulary part; 0 on other ranks and with pp > 1.
    kept_unit: int = 0
    kept_vocab: int = 0


def rank_shares(cfg: Config, counts: ModelCounts, sizes: list[int] | None = None) -> list[RankShare]:
    """One entry per pipeline rank; `sizes`: stage_sizes(cfg, counts), if the caller has them."""
    p = cfg.parallel
    tp, ep = p.tp, p.ep
    sizes = sizes or stage_sizes(cfg, counts)
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    shares = []
    for r in range(p.pp):
        stages = [s for s in range(len(sizes)) if stage_to_rank(cfg, s) == r]
        blocks = [b for s in stages for b in range(starts[s], starts[s] + sizes[s])]
        first, last = 0 in stages, len(sizes) - 1 in stages
        wire = sum(1 for s in stages for n in (s - 1, s + 1) if 0 <= n < len(sizes) and stage_to_rank(cfg, n) != r)
        n_layers = len(counts.blocks)
        blocks += [n_layers + k for k in range(len(counts.mtp))] if last else []  # the MTP depths' blocks
        units = []
        expert, vocab = 0, 0
        for b in blocks:
            if b < n_layers:  # an MTP depth's block joins the head's unit (parallel/data/fsdp.py)
                units.append(block_rank_params(counts.blocks[b], tp, ep))
            expert += counts.block(b).experts // ep
        if first:
            units.append(counts.embedding // tp)
            vocab += units[-1]
        kept = kept_vocab = 0
        if last:
            # a tied head on another rank than the embedding keeps its own copy of the matrix, and so
            # do the MTP depths, which embed the tokens ahead (pipeline/stages.py split_stages)
            tied_copy = counts.embedding if counts.head == 0 and not first else 0
            if counts.mtp and counts.head and not first:
                units.append(counts.embedding // tp)  # its own unit, as the first stage's is
                vocab += units[-1]
            mtp = sum(block_rank_params(bp, tp, ep) + counts.mtp_extra for bp in counts.mtp)
            units.append((counts.head + tied_copy) // tp + counts.final_norm + mtp)
            vocab += (counts.head + tied_copy) // tp
            if p.pp == 1:
                tied_unit = counts.embedding // tp if counts.head == 0 and first else 0
                kept, kept_vocab = units[-1] + tied_unit, (counts.head + tied_copy) // tp + tied_unit
        shares.append(RankShare(pp_rank=r, blocks=blocks, chunk_blocks=max(sizes[s] for s in stages),
                                params=sum(units), expert_params=expert, first=first, last=last,
                                largest_unit=max(units) if units else 0, vocab_params=vocab,
                                wire_boundaries=wire, kept_unit=kept, kept_vocab=kept_vocab))
    return shares


def axis_spans_nodes(cfg: Config, d: Derived, gpus_per_node: int, axis: str) -> bool:
    """Whether a group of `axis` crosses a node boundary.

    Ranks are laid out as the mesh lays them (fivefold/parallel/mesh.py), outermost first
    (pp, dp_replicate, dp_shard, cp, tp): a group of axis X is `size` ranks `stride` apart, where
    stride is the product of the degrees inside X. It stays in a node when size x stride ranks fit
    in one (and nodes hold a multiple of that). The "dp" axis means the gradient view dp x cp,
    "dp_shard" and "dp_replicate" ZeRO's shard groups and their replicas (HSDP); ep groups are
    taken inside dp x cp, next to tp. `d` is the Derived of the layout, as the estimate has it.
    """
    inner, size = _stride_and_size(cfg, d, axis)
    span = inner * size
    if size <= 1:
        return False
    return span > gpus_per_node or gpus_per_node % span != 0


def group_ranks_per_node(cfg: Config, d: Derived, gpus_per_node: int, axis: str) -> int:
    """How many ranks of one `axis` group share a node (axis_spans_nodes' layout): all of them when
    the group fits in one, else the node's gpus_per_node / stride of them (1 when the stride does
    not divide a node)."""
    inner, size = _stride_and_size(cfg, d, axis)
    if not axis_spans_nodes(cfg, d, gpus_per_node, axis):
        return size
    return max(1, gpus_per_node // inner) if inner <= gpus_per_node and gpus_per_node % inner == 0 else 1


def _stride_and_size(cfg: Config, d: Derived, axis: str) -> tuple[int, int]:
    """(ranks between two members, members) of a group of `axis` (axis_spans_nodes' docstring)."""
    p = cfg.parallel
    inner = {"tp": 1, "cp": p.tp, "ep": p.tp, "dp": p.tp, "dp_shard": p.tp * p.cp,
             "dp_replicate": p.tp * p.cp * d.dp_shard, "pp": p.tp * p.cp * d.dp}[axis]
    size = {"tp": p.tp, "cp": p.cp, "ep": p.ep, "dp": d.dp * p.cp, "dp_shard": d.dp_shard,
            "dp_replicate": p.dp_replicate, "pp": p.pp}[axis]
    return inner, size
