"""How the expert all-to-alls of a group that spans nodes use the two links: NVLink inside a node,
the per-GPU NIC between nodes.

comm.activation_traffic counts the bytes a rank sends in ep's all-to-alls: (ep - 1) / ep of its
tokens' top_k copies, every pass (dispatch and combine, forward and backward). Over a group of ep
ranks of which g share a node (layout.group_ranks_per_node), two dispatches are priced:

- "all_to_all" (parallel/expert.py, what fivefold runs): one NCCL all-to-all; of each rank's
  copies, those for its g - 1 node peers travel NVLink and the rest the NIC, at once, so
  t = steps x alpha + max(inter bytes / NIC, intra bytes / NVLink), inter = (ep - g) / (ep - 1)
  of the bytes.
- "node_limited" (DeepSeek-AI 2024, DeepSeek-V3 report sec. 3.2.2, node-limited routing; the
  DeepEP kernels that implement it): each token crosses the NIC once per target node, to the GPU
  of its own index there, and NVLink forwards it to the node's experts. A token reaches M nodes:
  the model's moe.topk_groups when its expert groups are the group's nodes (moe.n_groups = nodes,
  as DeepSeek-V3's 8 groups over EP64's 8 nodes), else the expected number of distinct nodes
  among top_k uniform picks, N (1 - (1 - 1/N)^k). Of those, (N - 1) / N are other nodes. NVLink
  then carries the copies a receiving node hands to its other g - 1 GPUs, (g - 1) / g of top_k.
  Under FP8 compute the all-to-alls towards the experts (forward dispatch, backward combine) carry
  e4m3 with one fp32 scale per 128 values (sec. 3.3.2-3.3.3: 1 + 4/128 bytes an element), those
  back (combine, the dispatch's backward) the compute dtype. fivefold does not run it: a published
  run's option (PlanOptions.ep_dispatch).
"""

from __future__ import annotations

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.planner.layout import group_ranks_per_node
from fivefold.planner.options import EpDispatch

FP8_WITH_SCALES = 1 + 4 / 128  # bytes per element: e4m3 and one fp32 scale per 1 x 128 tile


def target_nodes(cfg: Config, nodes: int) -> float:
    """M: the nodes one token's top_k copies reach under node-limited routing (module docstring)."""
    m = cfg.model
    if m.moe.n_groups == nodes and m.moe.topk_groups:
        return float(m.moe.topk_groups)
    return nodes * (1 - (1 - 1 / nodes) ** m.moe.top_k)


def expert_link_bytes(cfg: Config, d: Derived, gpus_per_node: int, sent: float, dispatch: EpDispatch,
                      fp8: bool, act_bytes: int) -> tuple[float, float]:
    """(NIC bytes, NVLink bytes) of the all-to-alls in which a rank sends `sent` bytes as
    comm.activation_traffic counts them, for a group spanning nodes (module docstring)."""
    ep, k = cfg.parallel.ep, cfg.model.moe.top_k
    g = group_ranks_per_node(cfg, d, gpus_per_node, "ep")
    if dispatch == "all_to_all":
        inter = sent * (ep - g) / (ep - 1)
        return inter, sent - inter
    nodes = ep // g
    copy = sent / (k * (ep - 1) / ep)  # one copy of each token, every pass, in the compute dtype
    if fp8:  # half the all-to-alls (towards the experts) in e4m3 with scales, half in the compute dtype
        copy *= (FP8_WITH_SCALES + act_bytes) / (2 * act_bytes)
    return copy * target_nodes(cfg, nodes) * (nodes - 1) / nodes, copy * k * (g - 1) / g
