"""A rank that runs two chunks of the model (pipeline.schedule=zbv): each chunk's own state, the switch between them.

Under zbv rank r runs virtual stages r and 2d-1-r (``schedule.chunks``), its module the two chunks' layers in that
order (keyed by global layer index, as any stage's). The stage worker keeps one set of per-microbatch state per
chunk (its stash, its receives and sends, its neighbours) and, before each action, selects the chunk the action
names (``select``); the weights, their versions, the optimizer step and the data-parallel reduction stay the
rank's, one for both chunks. Between chunks d-1 and d, both on rank d-1, a send is a hand-off in memory (``LOCAL``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

from pipedream2bw.pipeline.boundary import Channel
from pipedream2bw.pipeline.schedule import BACKWARD, FORWARD, whole_backwards

LOCAL = -1
"""A neighbour on this rank (the chunk that follows or precedes in the V): no transfer, a hand-off."""

_PER_CHUNK = ("first", "last", "_stash", "_weight_work", "_posted", "_received", "_outbox", "_channel")
_PER_CHUNK += ("_recv_from", "_send_to", "_saved_bytes")


@dataclass
class Chunk:
    """One virtual stage of a rank: ``index`` v of 2d, its layers' positions in the rank's module (``layers``), its
    neighbours' ranks (``LOCAL`` on this rank, None at the ends) and its per-microbatch state, as the worker's."""

    index: int
    layers: slice
    first: bool
    last: bool
    _recv_from: Dict[str, Optional[int]]
    _send_to: Dict[str, Optional[int]]
    _channel: Dict[str, Any] = field(default_factory=dict)
    _stash: Dict[int, Any] = field(default_factory=dict)
    _weight_work: Dict[int, Any] = field(default_factory=dict)
    _posted: Dict[Tuple[str, int], Any] = field(default_factory=dict)
    _received: Dict[Tuple[str, int], Any] = field(default_factory=dict)
    _outbox: Dict[Tuple[str, int], Any] = field(default_factory=dict)
    _saved_bytes: Optional[int] = None
    param_indices: List[int] = field(default_factory=list)  # its parameters' positions in the rank's module


@dataclass(frozen=True)
class ChunkSpec:
    """What the builder knows of a chunk: its virtual stage, how many layers (the first ones of the rank's module
    are the first chunk's), and the ranks that send it activations (``prev``) and gradients (``next``)."""

    index: int
    num_layers: int
    prev: Optional[int]
    next: Optional[int]


def v_chunk_specs(*, stage: int, num_stages: int, balance: Sequence[int], rank_of: Sequence[int]) -> List[ChunkSpec]:
    """Rank ``stage``'s two chunks under zbv, r and 2d-1-r, with ``balance`` the 2d chunks' layer counts and
    ``rank_of[v]`` the rank that runs chunk v in this rank's replica (``LOCAL`` for this rank's own chunks)."""
    d = num_stages
    out = []
    for v in (stage, 2 * d - 1 - stage):
        prev = rank_of[v - 1] if v > 0 else None
        nxt = rank_of[v + 1] if v < 2 * d - 1 else None
        out.append(ChunkSpec(index=v, num_layers=balance[v], prev=prev, next=nxt))
    return out


def make_chunks(specs: Sequence[ChunkSpec], module: nn.Module, *, forward: str, backward: str, channel) -> List[Chunk]:
    """The worker's chunks from ``specs`` (``forward``/``backward``: the action kinds F and B; ``channel(kind)``
    makes one boundary channel; ``module``: the rank's module, whose parameters each chunk indexes)."""
    chunks, start = [], 0
    position = {id(p): i for i, p in enumerate(module.parameters())}
    names = list(module._modules)
    for spec in specs:
        layers = slice(start, start + spec.num_layers)
        chunk = Chunk(
            index=spec.index,
            layers=layers,
            first=spec.index == 0,
            last=spec.index == _num_chunks(specs) - 1,
            _recv_from={forward: spec.prev, backward: spec.next},
            _send_to={forward: spec.next, backward: spec.prev},
            _channel={forward: channel(forward), backward: channel(backward)},
        )
        part = [module._modules[n] for n in names[layers]]
        chunk.param_indices = sorted(position[id(p)] for layer in part for p in layer.parameters())
        chunks.append(chunk)
        start += spec.num_layers
    return chunks


def _num_chunks(specs: Sequence[ChunkSpec]) -> int:
    """2d: a rank's chunks are r and 2d-1-r, so their indices sum to 2d - 1."""
    return specs[0].index + specs[-1].index + 1


def select(worker: Any, chunk: Chunk) -> None:
    """Makes ``chunk``'s state the worker's (its dicts by reference: what the worker adds stays the chunk's)."""
    current = getattr(worker, "_chunk", None)
    if current is chunk:
        return
    if current is not None:  # the values the worker reassigns (the first microbatch's saved bytes) go back
        current._saved_bytes = worker._saved_bytes
    for name in _PER_CHUNK:
        setattr(worker, name, getattr(chunk, name))
    worker._chunk = chunk


def part(module: nn.Module, chunk: Chunk, cache: Dict[Tuple[int, int], nn.Module]) -> nn.Module:
    """``chunk``'s layers of ``module`` (a weight version of the rank's module) as a module of their own, made once."""
    key = (id(module), chunk.index)
    if key not in cache:
        cache[key] = module[chunk.layers]
    return cache[key]


def attach(worker: Any, specs: Sequence[ChunkSpec], *, module: nn.Module, tags: Tuple[int, int]) -> None:
    """Gives ``worker`` its chunks (zbv; none: a rank of one stage), selected before each action, the cache of their
    modules and the box of hand-offs between them.

    Args:
        worker: the stage worker (its ``p2p`` and ``device`` set).
        specs: the rank's chunks, in the order of their layers in ``module``.
        module: one weight version of the rank's module (the chunks index its parameters).
        tags: the activations' and the gradients' channel tags.
    """
    channels = {FORWARD: (tags[0], "a stage's output"), BACKWARD: (tags[1], "an input gradient")}
    made = make_chunks(
        specs,
        module,
        forward=FORWARD,
        backward=BACKWARD,
        channel=lambda x: Channel(worker.p2p, tag=channels[x][0], what=channels[x][1], device=worker.device),
    )
    worker._chunks = {c.index: c for c in made}
    worker._chunk = None
    worker._parts = {}  # (id of a version's module, chunk) -> the chunk's layers of it
    worker._local = {}  # (X, k) -> what a chunk handed the other on this rank
    worker._final_weights = {}  # batch -> this rank's chunks through the W of its last microbatch
    worker._whole = frozenset()  # (chunk, k) whose B k runs the whole backward (``plan_whole``)


def plan_whole(worker: Any, actions: Sequence[Any]) -> None:
    """Before ``actions`` run: the (chunk, k) of them whose B k runs the whole backward and W k nothing
    (``schedule.whole_backwards``: chunk d's, on rank d-1, where W k follows B k at once)."""
    if worker._chunks:
        worker._whole = whole_backwards(
            actions, schedule=worker.versions.schedule, rank=worker.stage_index, num_stages=worker.num_stages
        )


def whole(worker: Any, k: int) -> bool:
    """Whether the chunk selected runs microbatch k's whole backward at B k (``plan_whole``)."""
    return bool(worker._chunks) and (worker._chunk.index, k) in worker._whole


def arm_at_w(worker: Any, k: int) -> None:
    """What W k does first (zb1p, zbv; before B k's whole backward where that stands for W k): at the batch's last
    microbatch, arms the data-parallel reducer (a rank of chunks: at its last such W, ``arm_at_last_weight``)."""
    if worker.reducer is None or (k + 1) % worker.m != 0:
        return
    if worker._chunks:
        arm_at_last_weight(worker, k)
    else:
        worker._arm_reducer(k)


def arm_at_last_weight(worker: Any, k: int) -> None:
    """W k of a batch's last microbatch on one chunk: at the rank's second such W (its last W of the batch) arms the
    data-parallel reducer and reports the other chunk's gradients ready (final since its own last W); this W's
    hooks report the rest. Armed earlier, the other chunk's W's of the batch would have counted as final. A parameter
    both chunks use (a tie on this rank: zbv's GPT embedding and head) is this W's to report: its hook fires once
    here, where its last contribution arrives (reported for the other chunk too, its bucket would count it twice and
    could start before its gradient was whole)."""
    t = k // worker.m
    worker._final_weights[t] = worker._final_weights.get(t, 0) + 1
    if worker._final_weights[t] < len(worker._chunks):
        return
    del worker._final_weights[t]
    worker._arm_reducer(k)
    replica = worker.versions.replicas.index(worker.versions.module_for_batch(t))
    own = set(worker._chunk.param_indices)
    for chunk in worker._chunks.values():
        if chunk is not worker._chunk:
            for i in chunk.param_indices:
                if i not in own:
                    worker.reducer.gradient_ready(replica, i)


def held_bytes(worker: Any) -> int:
    """Bytes autograd holds for the microbatches in flight on both chunks (stashed or awaiting W), each chunk's
    count times what it saves for one microbatch (measured on its first forward)."""
    total = 0
    for c in worker._chunks.values():
        saved = worker._saved_bytes if c is worker._chunk else c._saved_bytes
        total += (len(c._stash) + len(c._weight_work)) * (saved or 0)
    return total
