"""A stage's backward in two parts (pipeline.schedule=zb1p): B, the input's gradient, then W, the weights'.

B runs autograd from the stage's outputs to its inputs only, keeping the graph (``retain_graph``) and
catching, on the way, the gradient that reaches each node where a weight's branch joins the input's
path (an "intermediate": e.g. the matmul node that takes both the activation and the weight). W later
runs autograd from those intermediates, with the gradients caught, to the weights alone, so nothing
of B is computed twice. Learnt from torch.distributed.pipelining's ``_backward.py``
(``stage_backward_input`` / ``stage_backward_weight``), written here with two differences: W
accumulates through autograd (``torch.autograd.backward(..., inputs=weights)``), so the gradient
hooks that the data-parallel reducer and the float32 accumulators use fire as under a plain
backward; and a weight reachable from the outputs but not through the input's path (a branch of its
own into an output) is not lost: W takes it from the outputs (the graph kept for it).

A stage whose input needs no gradient (the first: token ids) has no B to speak of: B does nothing
and W the whole backward, as torch's does.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge, Node


def _node(t: torch.Tensor) -> Optional[Node]:
    """``t``'s grad_fn, or for a leaf its AccumulateGrad node (created lazily: a view makes it)."""
    if t.grad_fn is not None or not t.requires_grad:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _consumers(roots: Sequence[Node]) -> Dict[Node, List[Node]]:
    """The graph below ``roots`` reversed: node -> the nodes that take its output (towards the roots)."""
    consumers: Dict[Node, List[Node]] = collections.defaultdict(list)
    seen, queue = set(roots), collections.deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is not None:
                consumers[child].append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)
    return consumers


def _downstream(starts: Sequence[Node], consumers: Dict[Node, List[Node]], stop: Set[Node]) -> Tuple[set, set]:
    """Nodes reached from ``starts`` towards the outputs, and which of ``stop`` were met (not walked past)."""
    closure, met = set(starts), set()
    queue = collections.deque(starts)
    while queue:
        for node in consumers.get(queue.popleft(), ()):
            if node in closure:
                continue
            if node in stop:
                met.add(node)
                continue
            closure.add(node)
            queue.append(node)
    return closure, met


def _groups(inputs: List[Node], weights: List[Node], consumers: Dict[Node, List[Node]]) -> List[dict]:
    """Weights grouped by the intermediates (nodes on the input's path) where their branches join it: a group
    is ``{"weights": set of AccumulateGrad nodes, "intermediates": set of nodes}``, merged where they share one."""
    on_input_path, _ = _downstream(inputs, consumers, set())
    by_node: Dict[Node, dict] = {}
    for w in weights:
        _, met = _downstream([w], consumers, on_input_path)
        group = {"weights": {w}, "intermediates": met}
        for node in met:
            other = by_node.get(node)
            if other is not None and other is not group:
                other["weights"] |= group["weights"]
                other["intermediates"] |= group["intermediates"]
                group = other
            by_node[node] = group
        for node in group["intermediates"]:
            by_node[node] = group
    unique = {id(g): g for g in by_node.values()}
    return list(unique.values())


@dataclass
class WeightWork:
    """What B leaves for W: the weight groups with the gradients caught at their intermediates; for the
    weights B could not reach (``rest``), the outputs and their gradients; ``full``: W is the whole backward."""

    groups: List[dict] = field(default_factory=list)
    rest: List[torch.Tensor] = field(default_factory=list)
    outputs: Sequence[torch.Tensor] = ()
    grads: Sequence[Optional[torch.Tensor]] = ()
    full: bool = False


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[Optional[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
) -> Tuple[List[Optional[torch.Tensor]], WeightWork]:
    """B: the gradients of ``inputs`` (None where unused) from ``outputs`` with ``grads`` (None: ones, a loss).

    Args:
        outputs: the stage's outputs that need gradients (the loss on the last stage).
        grads: their gradients, as received (None for a scalar loss).
        inputs: the stage's floating-point inputs (empty on the first stage); those that need no gradient get None.
        weights: the stage's parameters.

    Returns:
        the input gradients, and the ``WeightWork`` that ``backward_weight`` completes.
    """
    weights = [w for w in weights if w.requires_grad]
    given, inputs = inputs, [x for x in inputs if x.requires_grad]
    if not inputs or not outputs:
        return [None] * len(given), WeightWork(outputs=outputs, grads=grads, full=bool(outputs))
    out_nodes = [n for n in map(_node, outputs) if n is not None]
    consumers = _consumers(out_nodes)
    weight_nodes = {_node(w): w for w in weights}
    groups = _groups([_node(x) for x in inputs], list(weight_nodes), consumers)
    handles = []
    for group in groups:
        group["intermediates"] = list(group["intermediates"])
        group["grads"] = [None] * len(group["intermediates"])
        for i, node in enumerate(group["intermediates"]):

            def catch(grad_outputs: Tuple[Any, ...], group: dict = group, i: int = i) -> None:
                group["grads"][i] = grad_outputs

            handles.append(node.register_prehook(catch))
    try:
        dinputs = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    covered = {n for g in groups for n in g["weights"]}
    # reached from the outputs (in the graph) but joining no input path: W takes them from the outputs
    rest = [w for n, w in weight_nodes.items() if n not in covered and (n in consumers or n in out_nodes)]
    work = WeightWork(groups=groups, rest=rest, outputs=outputs if rest else (), grads=grads if rest else ())
    by_input = {id(x): g for x, g in zip(inputs, dinputs)}
    return [by_input.get(id(x)) for x in given], work


def backward_weight(work: WeightWork) -> None:
    """W: accumulates the weights' gradients (into ``.grad``, through autograd, hooks firing) from what B left."""
    if work.full and work.outputs:
        torch.autograd.backward(list(work.outputs), list(work.grads) if work.grads else None)
        return
    if work.rest:  # first: the groups' pass below frees the graph's buffers it goes through
        torch.autograd.backward(list(work.outputs), list(work.grads), inputs=work.rest, retain_graph=True)
    for group in work.groups:
        edges, grads, handles = [], [], []
        for node, caught in zip(group["intermediates"], group["grads"]):
            for i, g in enumerate(caught or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
            if len(group["intermediates"]) > 1:  # an intermediate below another gets its caught gradient, not twice
                handles.append(node.register_prehook(lambda _, caught=caught: caught))
        try:
            if edges:
                params = [n.variable for n in group["weights"]]
                torch.autograd.backward(edges, grads, inputs=params)
        finally:
            for h in handles:
                h.remove()
        group.clear()
