"""Plans for pipeline.schedule=zbv: the model cut into 2d chunks, rank r holding chunks r and 2d-1-r (the V).

Each chunk is a contiguous layer range of its own (a plan's ``balance`` lists 2d counts, as the runtime's
``pipeline.balance`` does under zbv). The boundaries come from the planner's dynamic program over the 2d chunks (each
chunk's time as a stage of its own, the min-max over chunks); the plan's figures from the simulator over zbv's action
lists (``cost.simulate`` with the 2d chunks' costs), its memory per rank as its two chunks' together, what the two
share counted once (``held_contexts``: a tie whose holders are both on the rank, the GPT's embedding and head on rank 0,
is one parameter there; one optimizer steps both chunks). What zbv runs
without (config/validate.py: recomputation, swapping, streaming, sharding, tensor parallelism, NCCL) the search does
not try; a CUDA topology (NCCL) is refused.

Limits: the dynamic program balances chunks, not ranks (a rank's time is its two chunks' sum, which the simulator
then reports); a chunk must fit a device alone, and a plan whose ranks do not fit their two chunks is dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

from partitioner.cost import MEMORY_PARTS, RESOURCES, Segments, StageContext, simulate
from partitioner.planner import (
    CostFn,
    Plan,
    Request,
    _candidates,
    _contexts,
    _order,
    _Split,
    partition,
    plan_request_fields,
)
from partitioner.topology import LOCAL, make_rank_map
from pipedream2bw.errors import ConfigError
from pipedream2bw.pipeline.schedule import chunk_rank
from pipedream2bw.pipeline.schedule import chunks as rank_chunks

SCHEDULE = "zbv"


def v_rows(rank_map: Sequence[Sequence[int]]) -> List[List[int]]:
    """The 2d chunks' placements: chunk v runs where stage v of ``rank_map`` does, and chunk 2d-1-r where stage r."""
    d = len(rank_map)
    return [list(rank_map[chunk_rank(v, d)]) for v in range(2 * d)]


def v_contexts(req: Request, rank_map: Sequence[Sequence[int]], *, m: int) -> list:
    """One ``StageContext`` per chunk: index v of 2d, ``num_stages`` d (``schedule.in_flight``'s zbv rule), the
    hand-off between chunks d-1 and d (both on rank d-1) a local one, the runtime bytes each rank's."""
    d = len(rank_map)
    runtime = req.runtime_bytes
    if not isinstance(runtime, (int, float)):  # one figure per rank -> one per chunk
        runtime = [runtime[chunk_rank(v, d)] for v in range(2 * d)]
    req = dataclasses.replace(req, runtime_bytes=runtime)
    ctxs = _contexts(req, v_rows(rank_map), m=m, recompute=False, sharded=False)
    ctxs = [dataclasses.replace(c, num_stages=d) for c in ctxs]
    ctxs[d - 1] = dataclasses.replace(ctxs[d - 1], link_next=LOCAL)
    ctxs[d] = dataclasses.replace(ctxs[d], link_prev=LOCAL)
    return ctxs


def held_contexts(ctxs: Sequence[StageContext], starts: Sequence[int], num_layers: int) -> List[StageContext]:
    """The 2d chunks' contexts, a rank's second chunk (v >= d) holding its first one's layers besides its own
    (``StageContext.held``): a parameter both chunks use (the GPT's tie, chunks 0 and 2d-1) is one on the rank, and
    one optimizer steps both, as the runtime keeps them (run/chunks.py)."""
    d, bounds = len(ctxs) // 2, [*starts, num_layers]
    return [
        dataclasses.replace(c, held=((bounds[2 * d - 1 - v], bounds[2 * d - v]),)) if v >= d else c
        for v, c in enumerate(ctxs)
    ]


def _per_rank(values: Sequence[float], d: int) -> List[float]:
    """Chunk figures -> rank figures: rank r's two chunks, r and 2d-1-r, summed."""
    return [sum(values[v] for v in rank_chunks(SCHEDULE, r, d)) for r in range(d)]


def v_plan(req: Request, split: _Split, *, simulate_it: bool) -> Plan:
    """The Plan of a zbv ``split`` (its contexts, starts and costs per chunk): from the simulator (``simulate_it``),
    else from the bound the search ranks by (the slowest rank's two chunks, or the cores' total work if slower)."""
    d, w, m = len(split.rank_map), split.data_parallel, split.num_microbatches
    chunks = dataclasses.replace(split, contexts=held_contexts(split.contexts, split.starts, split.seg.n)).stage_costs()
    cores = req.topology.cores if req.topology.device == "cpu" else None
    rank_batch = _per_rank([st["batch_s"] for st in chunks], d)  # a rank's two chunks, the search's bound
    if simulate_it:
        sim = simulate(chunks, schedule=SCHEDULE, num_microbatches=m, data_parallel=w, cores=cores)
        batch_time = sim.batch_time_s
        steady = [st.steady_with(p) for st, p in zip(chunks, sim.peak_in_flight)]
    else:
        batch_time = max(rank_batch)
        if cores:
            busy = w * sum(m * (st["forward_s"] + st["backward_s"]) + st["step_s"] for st in chunks)
            batch_time = max(batch_time, busy / cores)
        steady = [st["steady_memory"] for st in chunks]
    runtime = [float(split.contexts[r].runtime_bytes) for r in range(d)]  # counted once a rank, not once a chunk
    # a rank's peak: its two chunks' steady states together, or their one step (both chunks' weight state and the
    # step's transients at once; none of their microbatches in flight then: live_at_step), whichever is larger
    at_step = _per_rank([st["step_memory"] for st in chunks], d)
    peaks = [max(a, b) - rt for a, b, rt in zip(_per_rank(steady, d), at_step, runtime)]
    per_part = {k: _per_rank([st[k] for st in chunks], d) for k in MEMORY_PARTS}
    breakdown: List[Dict[str, int]] = []
    for r in range(d):
        parts = {k: int(per_part[k][r]) for k in MEMORY_PARTS}
        parts["runtime"] = int(runtime[r])
        breakdown.append(parts)
    bounds = [*split.starts, split.seg.n]
    slower = [max((chunks[v] for v in rank_chunks(SCHEDULE, r, d)), key=lambda st: st["batch_s"]) for r in range(d)]
    bound = [RESOURCES[int(st["bound"])] for st in slower]
    return Plan(
        schedule=SCHEDULE,
        num_stages=d,
        data_parallel=w,
        microbatch_size=split.microbatch_size,
        num_microbatches=m,
        global_batch_size=req.global_batch_size,
        balance=[bounds[v + 1] - bounds[v] for v in range(2 * d)],
        rank_map=[list(r) for r in split.rank_map],
        recompute=False,
        swap_stages=[],
        **plan_request_fields(req, batch_time),
        predicted_stage_time_s=[float(t) for t in _per_rank([st["microbatch_s"] for st in chunks], d)],
        predicted_peak_memory_bytes=[int(p) for p in peaks],
        predicted_memory_breakdown=breakdown,
        predicted_stall_s=[0.0] * d,
        predicted_host_step_s=[0.0] * d,
        predicted_host_sum_s=[0.0] * d,
        predicted_stage_bound=bound,
        predicted_bound=bound[rank_batch.index(max(rank_batch))],
        model=dict(req.model),
        precision=req.precision,
        weight_dtype=req.weight_dtype,
    )


def plan_v(cost_fn: CostFn, req: Request, *, runners_up: int = 4) -> List[Plan]:
    """The best zbv plans for ``req``, best first (``planner.plan``'s ranking: the search's bound, then the
    simulator's figures for the finalists).

    Raises:
        ConfigError: a CUDA topology (zbv runs on gloo only), or no plan fits.
    """
    if req.topology.device == "cuda":
        raise ConfigError(
            f"pipeline.schedule=zbv runs on gloo only and topology {req.topology.name!r} is a CUDA one (NCCL); "
            "plan zb1p, or a CPU topology"
        )
    req = dataclasses.replace(req, recompute=False, sharded=False, swap=False, stream=False, tensor=None)
    cache: Dict[int, Segments] = {}

    def segments(b: int) -> Segments:
        if b not in cache:
            cache[b] = Segments(list(cost_fn(b)))
        return cache[b]

    num_layers = segments(1 if req.microbatch_sizes is None else req.microbatch_sizes[0]).n
    found: List[tuple] = []
    for d, w, _, b, m, _, _ in _candidates(req, num_layers):
        if 2 * d > num_layers:
            continue
        rank_map = make_rank_map(req.topology, d, w)
        ctxs = v_contexts(req, rank_map, m=m)
        res = partition(segments(b), ctxs, capacity=req.memory_per_device_bytes, allow_swap=False)
        if res is None:
            continue
        split = _Split(segments(b), w, b, m, False, starts=res[1], swap_flags=res[2], rank_map=rank_map, contexts=ctxs)
        p = v_plan(req, split, simulate_it=False)
        if max(p.predicted_peak_memory_bytes) <= req.memory_per_device_bytes:
            found.append((p, split))
    order = _order([p for p, _ in found], req.objective, req.tolerance)
    finalists = [v_plan(req, found[i][1], simulate_it=True) for i in order[: runners_up + 3]]
    finalists = [p for p in finalists if max(p.predicted_peak_memory_bytes) <= req.memory_per_device_bytes]
    if not finalists:
        raise ConfigError(
            f"no zbv plan fits: {num_layers} layers in 2d chunks (two a rank), global batch {req.global_batch_size}, "
            f"{req.devices} devices of {req.memory_per_device_bytes / 2**30:.3g} GiB; plan zb1p, or more memory"
        )
    return [finalists[i] for i in _order(finalists, req.objective, req.tolerance)][: runners_up + 1]
