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
3. W starts autograd again at the frontier nodes (`GradientEdge`s) with the kept gradients and
   only their parameters as `inputs`, so the engine computes just the weight branches. Frontier
   nodes that share a parameter (each expert's slice of a stacked expert tensor) go in one call,
   so every parameter's gradient is accumulated once, as in a plain backward: data parallel's
   buckets count one accumulation per parameter.

A W call must not reach its parameters through its node's input-path children too: it would
then also compute (again) a contribution that another frontier node below owns. That happens only
when one weight is used in a chain (w applied twice in a row), and is refused; a weight used side
by side (each expert's slice of a stacked expert tensor) is fine: each node adds its own part.
On the first stage nobody waits for an input gradient (the "input" is the embedding output), so
I computes nothing and W runs the stage's whole backward, as one backward: splitting it there
would only add the split's own cost (the graph walk, and one autograd call per frontier group,
together ~+50% of a 4-block stage's backward, measured on CPU) to a rank whose I is on no one's
critical path. PyTorch's pipelining does the same (its first stage skips the input backward).
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _walk(root: Node, targets: set[Node],
          params: dict[int, torch.Tensor]) -> tuple[dict[Node, tuple[bool, frozenset]], dict[Node, list[Node]]]:
    """For every node below `root`: can it reach one of `targets`, and which parameters (ids) lie
    below it? One iterative post-order pass, each node visited once; also returns each node's
    children. (It runs on every I of every later stage: the sets are shared, not copied, wherever
    one child alone brings parameters, which is almost everywhere.)"""
    empty: frozenset = frozenset()
    info: dict[Node, tuple[bool, frozenset]] = {}
    children: dict[Node, list[Node]] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            kids = [info[c] for c in children[node]]
            parts = [p for _, p in kids if p]
            if not children[node]:  # a leaf: AccumulateGrad nodes hold their parameter
                var = getattr(node, "variable", None)
                if var is not None and id(var) in params:
                    parts.append(frozenset((id(var),)))
            below = empty if not parts else parts[0] if len(parts) == 1 else frozenset().union(*parts)
            info[node] = (node in targets or any(r for r, _ in kids), below)
        elif node not in info:
            info[node] = (False, empty)  # placeholder; acyclic, so final before it is read
            kids_of = children[node] = [c for c, _ in node.next_functions if c is not None]
            stack.append((node, True))
            stack += [(c, False) for c in kids_of if c not in info]
    return info, children


class SplitBackward:
    """One micro-batch's backward on one stage: `input_grad()` is I, `weight_grad()` is W."""

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, params: list[torch.Tensor]):
        """`inp`: the received activation (a leaf), or on the first stage the embedding output."""
        self.out, self.inp = out, inp
        self.params = {id(p): p for p in params}
        # the embedding made it (or, frozen under LoRA, made it needing no gradient): no earlier stage
        # waits for its gradient
        self.first = inp.grad_fn is not None or not inp.requires_grad
        self.groups: list[tuple[list[Node], list[torch.Tensor]]] = []  # frontier nodes sharing parameters
        self.kept: dict[Node, tuple] = {}  # frontier node -> the gradient that reached it in I
        self.out_grad: torch.Tensor | None = None  # first stage: the output's gradient, for W's whole backward

    def _frontier(self) -> list[tuple[list[Node], list[torch.Tensor]]]:
        """Frontier nodes, grouped by the parameters they share, with those parameters."""
        targets = {get_gradient_edge(self.inp).node}  # where I stops: the received activation's accumulator
        info, children = _walk(self.out.grad_fn, targets, self.params)
        groups: list[tuple[list[Node], set[int], set[int]]] = []  # (nodes, their params, params on their input paths)
        for node, (on_path, _) in info.items():
            if not on_path or node in targets:
                continue
            kids = [info[c] for c in children[node]]
            mine = set().union(*(p for r, p in kids if not r))  # reached off the input path
            if not mine:
                continue
            merged = ([node], mine, set().union(*(p for r, p in kids if r)))
            for g in [g for g in groups if g[1] & mine]:  # join every group sharing a parameter
                groups.remove(g)
                merged = (merged[0] + g[0], merged[1] | g[1], merged[2] | g[2])
            groups.append(merged)
        for _nodes, params, on_input_paths in groups:
            if params & on_input_paths:
                raise RuntimeError("split backward: a weight is applied twice in a chain in one stage; use a "
                                   "schedule without split backward (1f1b)")
        return [(nodes, [self.params[i] for i in params]) for nodes, params, _ in groups]

    def input_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """I: the gradient of the stage input, keeping what W needs (the first stage: None, and
        only `grad` is kept)."""
        if self.first:
            self.out_grad = grad
            return None
        self.groups = self._frontier()
        hooks = []
        for node in (n for nodes, _ in self.groups for n in nodes):
            def keep(grad_outputs: tuple, node: Node = node) -> None:
                self.kept[node] = grad_outputs
            hooks.append(node.register_prehook(keep))
        try:
            (inp_grad,) = torch.autograd.grad(self.out, self.inp, grad, retain_graph=True)
        finally:
            for h in hooks:
                h.remove()
        return inp_grad

    def weight_grad(self) -> None:
        """W: accumulate the weight gradients into .grad (gradient hooks fire as in any backward)."""
        if self.first:  # the whole backward, as a B action runs it
            torch.autograd.backward(self.out, self.out_grad)
        for nodes, params in self.groups:
            edges = [(GradientEdge(n, i), g) for n in nodes for i, g in enumerate(self.kept[n]) if g is not None]
            torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=params)
        self.groups, self.kept, self.out_grad = [], {}, None
