"""Expert all-to-alls across nodes (planner/expert_comm.py) against hand arithmetic."""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.config.load import load_config
from fivefold.planner.comm import link
from fivefold.planner.estimate import estimate
from fivefold.planner.hardware import get_hardware
from fivefold.planner.options import PlanOptions

H100 = get_hardware("h100")


def _ep16(*over: str):
    """Qwen3-30B-A3B (128 experts, top 8, no expert groups) at ep 16: two nodes of 8 ranks each."""
    return load_config(None, ["--model.preset=qwen3-30b-a3b", "--train.seq_len=4096", "--parallel.ep=16",
                              "--parallel.zero=1", "--train.global_batch=32", "--train.micro_batch=1", *over])


def _latency(ep) -> float:
    return sum(steps * link(H100, True, op)[1] for op, steps in ep.op_steps.items())


def test_all_to_all_sends_node_peers_over_nvlink():
    """One NCCL all-to-all over 16 ranks, 8 a node: of a rank's copies 7 / 15 go to its node peers
    over NVLink, 8 / 15 over the NIC, at once; bytes as comm.activation_traffic counts them."""
    est = estimate(_ep16(), 16, H100)
    ep = est.comm["ep"]
    inter, intra = ep.bytes * 8 / 15, ep.bytes * 7 / 15
    assert ep.inter_node
    assert ep.time_s == pytest.approx(_latency(ep) + max(inter / link(H100, True)[0], intra / link(H100, False)[0]))


def test_node_limited_dispatch_crosses_each_node_once():
    """DeepSeek-V3 sec. 3.2.2: a token crosses the NIC once per target node and NVLink forwards it.
    Without expert groups, 8 uniform picks over N = 2 nodes reach 2 (1 - (1/2)^8) nodes, 1/2 of
    them the other; NVLink hands 7/8 of the 8 copies to the node's other GPUs. One copy of every
    token is the all-to-all's bytes over 8 x 15/16. Under FP8 the dispatches carry 1 + 4/128
    bytes an element, the combines 2."""
    a2a = estimate(_ep16(), 16, H100).comm["ep"]
    copy = a2a.bytes / (8 * 15 / 16)
    nic, nvlink = copy * 2 * (1 - 0.5 ** 8) / 2, copy * 8 * 7 / 8
    limited = estimate(_ep16(), 16, H100, options=PlanOptions(ep_dispatch="node_limited"))
    ep = limited.comm["ep"]
    assert ep.bytes == pytest.approx(nic + nvlink)
    assert ep.time_s == pytest.approx(_latency(ep) + max(nic / link(H100, True)[0], nvlink / link(H100, False)[0]))
    assert any(r.startswith("ep_dispatch=node_limited") for r in limited.not_runnable)
    fp8 = estimate(_ep16(), 16, H100, options=PlanOptions(ep_dispatch="node_limited", fp8="compute")).comm["ep"]
    assert fp8.bytes == pytest.approx((nic + nvlink) * (1 + 4 / 128 + 2) / 4)


def test_node_limited_with_expert_groups_on_nodes_reaches_topk_groups():
    """Expert groups that are the ep group's nodes (2 groups of 64 experts, one a node) limit a token
    to topk_groups of them: 1, its own node or the other, the other half the time: NIC bytes = one
    copy x 1 x 1/2; NVLink's are the ungrouped case's."""
    grouped = _ep16("--model.moe.n_groups=2", "--model.moe.topk_groups=1")
    copy = estimate(grouped, 16, H100).comm["ep"].bytes / (8 * 15 / 16)
    ep = estimate(grouped, 16, H100, options=PlanOptions(ep_dispatch="node_limited")).comm["ep"]
    assert ep.bytes == pytest.approx(copy * 1 * 1 / 2 + copy * 8 * 7 / 8)


def test_a_group_inside_a_node_is_unchanged():
    hw = dataclasses.replace(H100, gpus_per_node=16)
    plain, limited = (estimate(_ep16(), 16, hw, options=PlanOptions(ep_dispatch=x)).comm["ep"]
                      for x in ("all_to_all", "node_limited"))
    assert not plain.inter_node and plain.bytes == limited.bytes and plain.time_s == limited.time_s
