"""Pure: what splitting a backward into B and W costs the schedules that split it (zb1p, zbv; issue 46).

The split runs two autograd passes where the whole backward runs one: B, the input's gradient, keeping the graph,
then W, the weights' from what B caught (``pipeline/split_backward.py``). Per layer and microbatch it takes
``LayerCost.split_s`` more than the whole backward (profiled by ``profile.split_backward``: 0.7-1.2 ms on a block
backward of 1.3-2.2 ms at GPT 4 x 64, b=4, on a 2-core CPU, docs/planner.md; analytic costs:
``profile.SPLIT_ANALYTIC`` of the backward). Per layer: a stage of several layers runs one B and one W, so their
fixed per-call part is counted once a layer (an upper bound there). A
stage pays it on the backwards that run split: none on the first stage or chunk (its input, token ids, needs no
gradient: B does nothing and W runs the whole backward), and under zbv none on chunk d's B k where W k follows at
once (``schedule.whole_backwards``: B runs the whole backward, W nothing). ``cost.simulate`` charges it to W k (the
second pass); ``cost.segment_costs`` adds its share to the stage's backward. How the rest divides: B takes
``LayerCost.input_s`` (profiled: at GPT 4 x 64 a block's B alone is 0.75-0.85 of its whole backward at b=4 and
b=16 by the runtime's split, the attention's and the elementwise backward being all on the input's path), W the
remainder.
"""

from __future__ import annotations

import functools

import numpy as np

from pipedream2bw.pipeline.schedule import SPLIT_SCHEDULES, V_SCHEDULES, chunk_rank, pipeline_actions, whole_backwards


@functools.lru_cache(maxsize=256)
def split_share(schedule: str, stage_index: int, num_stages: int, num_microbatches: int) -> float:
    """The share of stage (under zbv: chunk) ``stage_index``'s backwards that run split (the module docstring),
    counted over the middle batch of three."""
    if schedule not in SPLIT_SCHEDULES or stage_index == 0:
        return 0.0
    if schedule not in V_SCHEDULES:
        return 1.0
    d, m = num_stages, num_microbatches
    lists = pipeline_actions(schedule, num_stages=d, num_microbatches=m, num_batches=3)
    rank = chunk_rank(stage_index, d)
    whole = whole_backwards(lists[rank], schedule=schedule, rank=rank, num_stages=d)
    return 1.0 - sum(1 for v, k in whole if v == stage_index and m <= k < 2 * m) / m


def split_backward_s(seg, i, j, ctx, *, recomputed):
    """(backward_s, keys) of the stage holding layers ``[i, j)`` of ``seg`` (``cost.Segments``) at ``ctx``
    (``cost.StageContext``): its mean backward per microbatch (+ ``recomputed``, the forward again with
    recomputation) with ``split_share`` of its backwards paying ``split_s``, the split's cost of one; and
    ``input_s``, a split backward's B (the recomputation, then the input's gradient: ``LayerCost.input_s``), whose W
    takes the rest. ``keys``: those three, for ``cost.segment_costs``."""
    share = split_share(ctx.schedule, ctx.stage_index, ctx.num_stages, ctx.num_microbatches)
    split = (seg.X[j] - seg.X[i]) if share else np.zeros(np.broadcast(np.asarray(i), np.asarray(j)).shape)
    keys = dict(split_s=split, split_share=share + 0 * split, input_s=seg.I[j] - seg.I[i] + recomputed)
    return seg.B[j] - seg.B[i] + recomputed + share * split, keys


def whole_set(schedule: str, lists) -> set:
    """The (chunk, k) whose B k runs the whole backward over every rank's action list ``lists`` (under zbv)."""
    return set().union(
        *(whole_backwards(actions, schedule=schedule, rank=r, num_stages=len(lists)) for r, actions in enumerate(lists))
    )
