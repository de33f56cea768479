"""Which nodes a backward stage's recompute can leave unfilled (its linear end).

A backward stage recomputes its layers, then back-propagates from its outputs. Autograd
needs the *inputs* of most ops again, not their outputs: the last ``linear`` of a layer
and the residual ``add`` after it make values that only the stage's output is built from.
Computing them is wasted work (for a transformer block, the output projection: about a
tenth of the layer's recompute). ``torch.utils.checkpoint`` skips the same work by
stopping its recompute early.

This pass finds such nodes: ``linear`` / ``add`` / ``offload`` nodes whose values reach
nothing but the stage's output (or other unfilled nodes), and whose derivative formulas read
only their inputs. It returns the node names; ``Stage.unfilled`` holds them, the stage's code
says so in a comment above the first, and the interpreter, recomputing for backward,
runs those nodes under ``runtime.stages.unfilled.Unfilled``: autograd records them as usual (its own
formulas and kernels run in backward), the matmuls and adds themselves do not run. The
forward, and a fused stage, still run every node.

>>> import torch, torch.nn as nn, torch.fx as fx
>>> class Block(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)
...     def forward(self, x):
...         return x + self.down(torch.relu(self.up(x)))
>>> unfilled_nodes(fx.symbolic_trace(Block()).graph)  # module calls: nothing to skip
()
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxpipe import ops  # noqa: F401 — registers torch.ops.fxpipe.*

LINEAR = (torch._C._nn.linear, F.linear, torch.ops.aten.linear.default)
ADD = (operator.add, torch.add, torch.ops.aten.add.Tensor)
IDENTITY = (torch.ops.fxpipe.offload.default,)


def unfilled_nodes(graph: fx.Graph) -> tuple[str, ...]:
    """Names of the nodes a recompute for backward may defer, in graph order."""
    nodes = list(graph.nodes)
    unneeded: set[fx.Node] = set()  # values only the output (or other such values) reads
    for n in reversed(nodes):
        if _has_rule(n) and all(u.op == "output" or u in unneeded for u in n.users):
            unneeded.add(n)
    while True:
        deferred: set[fx.Node] = set()
        for n in nodes:  # a linear is deferred for its cost; the rest follow a deferred input
            if n not in unneeded:
                continue
            inputs = n.all_input_nodes
            if n.target in LINEAR and not any(a in deferred for a in inputs):
                deferred.add(n)
            elif n.target not in LINEAR and any(a in deferred for a in inputs):
                deferred.add(n)
        # a node that runs must not read a deferred value: then that value is needed
        needed = {a for n in nodes if n not in deferred and n.op != "output"
                  for a in n.all_input_nodes if a in deferred}
        if not needed:
            return tuple(n.name for n in nodes if n in deferred)
        unneeded -= needed


def _has_rule(n: fx.Node) -> bool:
    """Whether this node's backward reads only its inputs (``runtime.stages.unfilled.SKIPPED``)."""
    if n.op != "call_function" or n.kwargs:
        return False
    if n.target in LINEAR:
        return 2 <= len(n.args) <= 3 and all(isinstance(a, fx.Node) or a is None for a in n.args)
    if n.target in ADD:  # tensor + tensor (a number added is kept: it is free anyway)
        return len(n.args) == 2 and all(isinstance(a, fx.Node) for a in n.args)
    return n.target in IDENTITY and len(n.args) == 1
