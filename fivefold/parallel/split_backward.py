"""Backward split in two for zero-bubble schedules: I (input gradient) now, W (weight gradients) later.

A stage's backward computes two things: the gradient of its input, which the previous stage is
waiting for, and the gradients of its weights, which nobody waits for. Zero-bubble schedules
(Qi et al. 2023, "Zero Bubble Pipeline Parallelism") run the first as action I and move the
second, W, into time the rank would otherwise spend idle. For W to be worth moving it must not
repeat I's work: a linear layer y = x Wᵀ costs one matmul for dx = dy W and one for dW = dyᵀ x,
and I should do only the first, W only the second.

How this is done with autograd alone, on the graph the forward recorded:
1. Walk the graph from the output. Nodes from which the stage input is reachable are on the
   *input path*; I runs exactly those (`torch.autograd.grad(out, inp)` prunes the rest, so
   `MmBackward` computes dx and skips dW).
2. A *frontier* node is on the input path and has a child off it that leads to parameters (for
   a linear layer: the matmul node, whose other child leads to the weight). While I runs, a
   pre-hook on each frontier node keeps the gradient arriving at it (dy).
3. W starts autograd again at each frontier node (a `GradientEdge`) with the kept gradient and
   only that node's parameters as `inputs`, so the engine computes just the weight branch.

The parameters of two frontier nodes must be disjoint (each weight used once in the stage);
otherwise one W would reach the other's weights through the input path and count them twice,
so that case is refused. On the first stage the "input" is the embedding output: I propagates
through the blocks down to it, and W also runs the embedding's backward from the kept gradient.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, Node


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _reaches(root: Node, targets: set[Node]) -> dict[Node, bool]:
    """For every node below `root`: is one of `targets` reachable from it? (iterative post-order)"""
    reach: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            reach[node] = node in targets or any(reach[c] for c in _children(node))
        elif node not in reach:
            reach[node] = False  # placeholder; the graph is acyclic, so it is final before it is read
            stack.append((node, True))
            stack += [(c, False) for c in _children(node) if c not in reach]
    return reach


def _leaf_params(start: Node, params: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """The parameters whose gradient accumulators lie below `start`."""
    found, seen, stack = {}, {start}, [start]
    while stack:
        node = stack.pop()
        var = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if var is not None and id(var) in params:
            found[id(var)] = var
        for c in _children(node):
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return list(found.values())


class SplitBackward:
    """One micro-batch's backward on one stage: `input_grad()` is I, `weight_grad()` is W."""

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, params: list[torch.Tensor]):
        """`inp`: the received activation (a leaf), or on the first stage the embedding output."""
        self.out, self.inp = out, inp
        self.params = {id(p): p for p in params}
        self.kept: list[tuple[Node, tuple, list[torch.Tensor]]] = []  # (frontier, its dy, its params)
        self.inp_grad: torch.Tensor | None = None  # kept for the embedding's backward (first stage)

    def _frontier(self) -> list[tuple[Node, list[torch.Tensor]]]:
        root = self.out.grad_fn
        if self.inp.grad_fn is not None:  # the embedding output: I stops at the node that made it
            targets = {self.inp.grad_fn}
        else:  # a received activation: I ends at its gradient accumulator
            targets = {n for n in _reaches(root, set()) if getattr(n, "variable", None) is self.inp}
        on_path = _reaches(root, targets)
        frontier, owner = [], {}
        for node, reaches_input in on_path.items():
            if not reaches_input or node in targets:
                continue
            params = [p for c in _children(node) if not on_path[c] for p in _leaf_params(c, self.params)]
            for p in params:
                if id(p) in owner:
                    raise RuntimeError("split backward: a parameter is used twice in one stage; "
                                       "use a schedule without split backward (1f1b, interleaved_1f1b)")
                owner[id(p)] = node
            if params:
                frontier.append((node, params))
        return frontier

    def input_grad(self, grad: torch.Tensor | None) -> torch.Tensor:
        """I: the gradient of the stage input, keeping what W needs."""
        hooks = []
        for node, params in self._frontier():
            def keep(grad_outputs: tuple, node: Node = node, params: list = params) -> None:
                self.kept.append((node, grad_outputs, params))
            hooks.append(node.register_prehook(keep))
        try:
            (inp_grad,) = torch.autograd.grad(self.out, self.inp, grad, retain_graph=True)
        finally:
            for h in hooks:
                h.remove()
        if self.inp.grad_fn is not None:
            self.inp_grad = inp_grad
        return inp_grad

    def weight_grad(self) -> None:
        """W: accumulate the weight gradients into .grad (gradient hooks fire as in any backward)."""
        for node, grad_outputs, params in self.kept:
            edges = [(GradientEdge(node, i), g) for i, g in enumerate(grad_outputs) if g is not None]
            torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=params)
        if self.inp_grad is not None:  # first stage: the embedding below the input
            below = _leaf_params(self.inp.grad_fn, self.params)
            if below:
                torch.autograd.backward(self.inp, self.inp_grad, inputs=below)
        self.kept, self.inp_grad = [], None
