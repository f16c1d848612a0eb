"""`fivefold calibrate`, Python's share of a step: the fixed costs that are no aten op.

A CPU rank runs every line of a step itself, and a tiny model's step is mostly fixed costs: besides
the ops (measure.op_costs), each nn.Module call, each custom autograd.Function (tensor parallel's
collectives, the vocabulary-parallel loss), each Python hook on a gradient (data parallel's bucket
hook), the loop's model-state sampling after each micro-batch and the pipeline's send thread cost
time that no op count sees. Each is measured as the difference between two chains that run the
same ops, one with the thing and one without, taken in turns so that both see the same load
(sampling.sample_turns):

- module_call_s: 100 multiplies, each inside an nn.Module's forward, against the bare multiplies;
- function_s: the same multiplies as an autograd.Function (forward and backward in Python);
- hook_s: a sum of 100 leaf tensors, each with a post-accumulate-grad hook, against none;
- tensor_query_s: state_memory.model_state_bytes on 100 parameters (each with a gradient and
  AdamW's three state tensors), per parameter;
- thread_s: a helper thread draining a queue, started and joined, as the pipeline's sends do.
"""

from __future__ import annotations

import queue
import threading

import torch
from torch import nn

from fivefold.planner.calibration.sampling import SAMPLE_S, sample_turns

LINKS = 100


class _Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0001


class _ScaleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0001

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.0001


def host_costs(repeats: int = 9, min_s: float = SAMPLE_S) -> dict[str, float]:
    """Seconds per module call, Function, gradient hook, parameter sampled and helper thread."""
    w = torch.randn(64, requires_grad=True)
    modules = [_Scale() for _ in range(LINKS)]

    def chain(link):
        def run():
            x = w
            for i in range(LINKS):
                x = link(i, x)
            x.sum().backward()
        return run

    leaves = [torch.randn(64, requires_grad=True) for _ in range(LINKS)]
    hooked = [torch.randn(64, requires_grad=True) for _ in range(LINKS)]
    for p in hooked:
        p.register_post_accumulate_grad_hook(lambda p: None)

    def leaf_sum(params):
        def run():
            x = params[0]
            for p in params[1:]:
                x = x + p
            x.sum().backward()
            for p in params:
                p.grad = None
        return run

    def thread():
        q: queue.SimpleQueue = queue.SimpleQueue()
        t = threading.Thread(target=lambda: [None for _ in iter(q.get, None)], daemon=True)
        t.start()
        q.put(None)
        t.join()

    t = sample_turns({"plain": chain(lambda i, x: x * 1.0001), "module": chain(lambda i, x: modules[i](x)),
                      "function": chain(lambda i, x: _ScaleFunction.apply(x)), "leaves": leaf_sum(leaves),
                      "hooked": leaf_sum(hooked), "state": _state_sampler(LINKS), "thread": thread}, repeats, min_s)
    return {"module_call_s": max(t["module"] - t["plain"], 0.0) / LINKS,
            "function_s": max(t["function"] - t["plain"], 0.0) / LINKS,
            "hook_s": max(t["hooked"] - t["leaves"], 0.0) / LINKS,
            "tensor_query_s": t["state"] / LINKS, "thread_s": t["thread"]}


def _state_sampler(count: int):
    """state_memory.model_state_bytes (what the pipeline samples after each micro-batch's backward)
    on `count` parameters, each with a gradient and AdamW's step, exp_avg and exp_avg_sq."""
    from fivefold.parallel.optimizer import init_optimizer_state
    from fivefold.parallel.state_memory import model_state_bytes

    params = [nn.Parameter(torch.randn(64)) for _ in range(count)]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(params)
    init_optimizer_state(optimizer)
    return lambda: model_state_bytes(params, optimizer)
