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

What it costs beyond the two passes (issue 46): B finds the intermediates by one walk of the graph, whose
structure (``_walk``) keys the analysis a stage keeps (``GraphPlans``: every microbatch of a stage builds a graph
of one structure, so the weights are grouped once, and again only for a graph of another); B catches the
gradients as ``torch.autograd.grad``'s inputs (``GradientEdge``s beside the stage's inputs), with no Python hook;
W calls autograd's engine once a group, without ``torch.autograd.backward``'s Python checks (``_accumulate``).

A stage whose input needs no gradient (the first: token ids) has no B to speak of: B does nothing
and W the whole backward, as torch's does.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge, Node

try:  # what torch.autograd.backward calls once its Python checks are done
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # a torch without it: W calls torch.autograd.backward
    _engine_run_backward = None


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


# A graph's analysis as positions in ``_walk``'s order: per group, the weights' indices in the ``weights`` given and
# the edges (position, output number) of its intermediates where B catches a gradient; then the weights W takes from
# the outputs (indices).
_Plan = Tuple[Tuple[Tuple[Tuple[int, ...], Tuple[Tuple[int, int], ...]], ...], Tuple[int, ...]]


def _walk(roots: Sequence[Node], labels: Dict[Node, int], weight_ids: Dict[int, int]) -> Tuple[List[Node], tuple]:
    """Every node below ``roots`` in one deterministic breadth-first order, and the graph's structure: per node its
    type, its children as (position, input number) (None: no gradient there) and its label (``labels``' for the
    inputs, a weight's index in ``weight_ids`` for its AccumulateGrad node, else None). Two graphs of one structure
    have one analysis at the same positions: the structure is what ``GraphPlans`` keys it by."""
    order = list(dict.fromkeys(roots))
    index = {node: i for i, node in enumerate(order)}
    structure = []
    for node in order:  # grows as it goes: breadth first
        kids = []
        for child, nr in node.next_functions:
            if child is None:
                kids.append(None)
                continue
            i = index.get(child)
            if i is None:
                i = index[child] = len(order)
                order.append(child)
            kids.append((i, nr))
        label = labels.get(node)
        if label is None and not kids:  # a leaf's AccumulateGrad node: which weight, if one
            label = weight_ids.get(id(getattr(node, "variable", None)))
        structure.append((type(node), tuple(kids), label))
    return order, tuple(structure)


def _analyse(
    order: List[Node],
    structure: tuple,
    roots: Sequence[Tuple[int, int]],
    inputs: List[Node],
    weights: List[torch.Tensor],
) -> _Plan:
    """``_groups`` of the graph ``_walk`` gave (``order``, ``structure``; ``roots``: its outputs' edges), by place."""
    position = {node: i for i, node in enumerate(order)}
    consumers = _consumers([order[p] for p, _ in roots])
    weight_nodes = {_node(w): j for j, w in enumerate(weights)}
    groups = _groups(inputs, list(weight_nodes), consumers)
    edges_into = collections.defaultdict(set)  # position -> the output numbers a gradient can reach it at
    for _, kids, _ in structure:
        for kid in kids:
            if kid is not None:
                edges_into[kid[0]].add(kid[1])
    for p, nr in roots:
        edges_into[p].add(nr)
    plan = []
    for group in groups:
        where = sorted(position[n] for n in group["intermediates"])
        plan.append(
            (
                tuple(sorted(weight_nodes[w] for w in group["weights"])),
                tuple((p, nr) for p in where for nr in sorted(edges_into[p])),
            )
        )
    covered = {j for g in plan for j in g[0]}
    reached = {label for _, kids, label in structure if label is not None and label >= 0}  # weights' labels: >= 0
    return tuple(plan), tuple(sorted(reached - covered))


class GraphPlans:
    """A stage's backward graphs' analyses, by the graph's structure (``_walk``): every microbatch of a stage builds
    a graph of one structure (the same module, the same branches taken; tensor sizes do not enter it), so B walks it
    and looks the analysis up instead of running ``_groups`` again; a graph of another structure (another branch,
    other weights, another output) is analysed anew. Keeps the ``size`` most recent (zbv: a rank's two chunks)."""

    def __init__(self, size: int = 8):
        self.size = size
        self._plans: Dict[tuple, _Plan] = {}
        self.misses = 0  # analyses run: one a structure while it stays kept

    def get(self, structure: tuple, analyse) -> _Plan:
        plan = self._plans.get(structure)
        if plan is None:
            self.misses += 1
            plan = self._plans[structure] = analyse()
            if len(self._plans) > self.size:
                del self._plans[next(iter(self._plans))]
        return plan


@dataclass
class WeightWork:
    """What B leaves for W: per weight group, its weights, its intermediates' edges and the gradients caught there
    (``(weights, edges, grads)``); for the weights B could not reach (``rest``), the outputs and their gradients;
    ``full``: W is the whole backward."""

    groups: List[Tuple[List[torch.Tensor], List[GradientEdge], List[Optional[torch.Tensor]]]] = field(
        default_factory=list
    )
    rest: List[torch.Tensor] = field(default_factory=list)
    outputs: Sequence[torch.Tensor] = ()
    grads: Sequence[Optional[torch.Tensor]] = ()
    full: bool = False


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[Optional[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    *,
    plans: Optional[GraphPlans] = None,
) -> Tuple[List[Optional[torch.Tensor]], WeightWork]:
    """B: the gradients of ``inputs`` (None where unused) from ``outputs`` with ``grads`` (None: ones, a loss).

    Args:
        outputs: the stage's outputs that need gradients (the loss on the last stage).
        grads: their gradients, as received (None for a scalar loss).
        inputs: the stage's floating-point inputs (empty on the first stage); those that need no gradient get None.
        weights: the stage's parameters.
        plans: the stage's analyses kept across microbatches (None: the graph is analysed each time).

    Returns:
        the input gradients, and the ``WeightWork`` that ``backward_weight`` completes.
    """
    weights = [w for w in weights if w.requires_grad]
    given, inputs = inputs, [x for x in inputs if x.requires_grad]
    if not inputs or not outputs:
        return [None] * len(given), WeightWork(outputs=outputs, grads=grads, full=bool(outputs))
    roots = [_node(o) for o in outputs]
    input_nodes = [_node(x) for x in inputs]
    order, structure = _walk(
        [n for n in roots if n is not None],
        {n: -1 - i for i, n in enumerate(input_nodes)},
        {id(w): j for j, w in enumerate(weights)},
    )
    position = {n: i for i, n in enumerate(order[: len(roots)])}
    root_edges = tuple((position[n], o.output_nr) for n, o in zip(roots, outputs) if n is not None)
    key = (structure, root_edges)

    def analyse() -> _Plan:
        return _analyse(order, structure, root_edges, input_nodes, weights)

    groups, rest = plans.get(key, analyse) if plans is not None else analyse()
    # B catches the gradient each intermediate receives: autograd.grad's inputs, beside the stage's inputs
    edges = [GradientEdge(order[p], nr) for _, where in groups for p, nr in where]
    found = torch.autograd.grad(outputs, inputs + edges, grads, retain_graph=True, allow_unused=True)
    dinputs, caught = found[: len(inputs)], found[len(inputs) :]
    work = WeightWork(rest=[weights[j] for j in rest])
    start = 0
    for indices, where in groups:
        end = start + len(where)
        work.groups.append(([weights[j] for j in indices], edges[start:end], list(caught[start:end])))
        start = end
    if work.rest:
        work.outputs, work.grads = outputs, grads
    by_input = {id(x): g for x, g in zip(inputs, dinputs)}
    return [by_input.get(id(x)) for x in given], work


def _accumulate(edges: List[GradientEdge], grads: List[torch.Tensor], params: List[torch.Tensor]) -> None:
    """``torch.autograd.backward(edges, grads, inputs=params)`` less its Python checks (~40 us a call, W one call a
    weight group: 14 for a GPT chunk of 2 blocks and the head), which B's own call makes moot: the gradients are
    what autograd caught at those very edges. Parameters of a tensor subclass go through the public call (their
    ``__torch_function__``)."""
    if _engine_run_backward is None or any(type(p) not in (torch.Tensor, torch.nn.Parameter) for p in params):
        torch.autograd.backward(edges, grads, inputs=params)
        return
    _engine_run_backward(
        tuple(edges), tuple(grads), False, False, tuple(params), allow_unreachable=True, accumulate_grad=True
    )


def _group_weights(params: List[torch.Tensor], edges: List[GradientEdge], caught: List[Optional[torch.Tensor]]) -> None:
    """A group's W: autograd from its intermediates' ``edges``, with what B ``caught`` there, to ``params``."""
    given = [i for i, g in enumerate(caught) if g is not None]
    if not given:
        return
    handles = []
    if len({e.node for e in edges}) > 1:  # an intermediate below another gets its caught gradient, not twice
        got: Dict[Node, Dict[int, torch.Tensor]] = collections.defaultdict(dict)
        for e, g in zip(edges, caught):
            got[e.node][e.output_nr] = g
        for node, theirs in got.items():
            handles.append(node.register_prehook(lambda out, at=theirs: tuple(at.get(i) for i in range(len(out)))))
    try:
        _accumulate([edges[i] for i in given], [caught[i] for i in given], params)
    finally:
        for h in handles:
            h.remove()


def backward_weight(work: WeightWork) -> None:
    """W: accumulates the weights' gradients (into ``.grad``, through autograd, hooks firing) from what B left."""
    if work.full and work.outputs:
        torch.autograd.backward(list(work.outputs), list(work.grads) if work.grads else None)
        return
    if work.rest:  # first: the groups' pass below frees the graph's buffers it goes through
        torch.autograd.backward(list(work.outputs), list(work.grads), inputs=work.rest, retain_graph=True)
    groups, work.groups = work.groups[::-1], []
    while groups:  # in B's order; a group's caught gradients are freed once its weights have theirs
        _group_weights(*groups.pop())
