"""zbv's two chunks a rank (run/chunks.py), without processes: which layers, neighbours and state each chunk has."""

from __future__ import annotations

import types

from torch import nn

from pipedream2bw.pipeline.schedule import BACKWARD, FORWARD
from pipedream2bw.run import chunks


def _rank(stage: int, d: int = 2):
    """Rank ``stage``'s module (its two chunks' layers, global keys) and a worker-like object with its chunks."""
    balance = [2, 1, 1, 2]  # chunks 0..3 of a 6-layer list
    specs = chunks.v_chunk_specs(stage=stage, num_stages=d, balance=balance, rank_of=[0, 1, 1, 0])
    starts = [sum(balance[:v]) for v in range(2 * d)]
    indices = [i for s in specs for i in range(starts[s.index], starts[s.index] + s.num_layers)]
    module = nn.Sequential(*[nn.Linear(3, 3) for _ in indices])
    worker = types.SimpleNamespace(p2p=None, device="cpu", _saved_bytes=None)
    chunks.attach(worker, specs, module=module, tags=(0, 1))
    return module, worker


def test_each_chunk_has_its_layers_neighbours_and_ends():
    module, worker = _rank(0)
    first, last = worker._chunks[0], worker._chunks[3]
    assert (first.first, first.last, last.first, last.last) == (True, False, False, True)
    assert first._send_to == {FORWARD: 1, BACKWARD: None} and last._recv_from == {FORWARD: 1, BACKWARD: None}
    assert first.param_indices == [0, 1, 2, 3] and last.param_indices == [4, 5, 6, 7]  # two Linears each
    cache = {}
    assert list(chunks.part(module, last, cache)) == list(module)[2:4]
    assert chunks.part(module, last, cache) is chunks.part(module, last, cache)  # made once
    _, middle = _rank(1)
    # rank 1: chunk 1 takes its input from rank 0, chunk 2 sends its output to rank 0 (the V turns on rank 1)
    assert middle._chunks[1]._recv_from[FORWARD] == 0 and middle._chunks[2]._send_to[FORWARD] == 0


def test_select_swaps_the_state_and_held_bytes_counts_both_chunks():
    _, worker = _rank(0)
    chunks.select(worker, worker._chunks[0])
    worker._stash[0] = "x"  # the worker's dicts are the chunk's
    worker._saved_bytes = 100  # measured on chunk 0's first forward
    chunks.select(worker, worker._chunks[3])
    assert worker._stash == {} and worker._chunks[0]._stash == {0: "x"} and worker._chunks[0]._saved_bytes == 100
    worker._saved_bytes = 10
    worker._stash[0], worker._weight_work[1] = "y", "w"
    assert chunks.held_bytes(worker) == 1 * 100 + 2 * 10


def test_a_ties_holders_under_zbv_are_the_ranks_running_its_chunks():
    # balance lists 2d = 6 chunks of one layer: rank r runs chunks r and 5-r. The GPT's tie (first and last layers,
    # chunks 0 and 5) is held by rank 0 alone: one parameter there, no exchange (build._tie_groups makes no group).
    from pipedream2bw.pipeline.ties import Tie, holders

    def tie(*layers):
        return Tie(tuple(f"{i}.w" for i in layers), (3,))

    balance = [1] * 6
    assert holders(tie(0, 5), balance, v_schedule=True) == [0]
    assert holders(tie(1, 4), balance, v_schedule=True) == [1]
    assert holders(tie(0, 1), balance, v_schedule=True) == [0, 1]
    assert holders(tie(0, 5), balance) == [0, 5]  # as stages of a 6-stage pipeline
