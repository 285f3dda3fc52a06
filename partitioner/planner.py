"""Pure: search over (d, w, t), b, recomputation and per-stage swapping, with exact stage boundaries.

For one candidate (d, w, b, recompute) the boundaries come from a dynamic program over the
layer list (docs/design.md section 4)::

    dp[s][j] = min over i of max(dp[s-1][i], T_s(i..j-1))   subject to M_s(i..j-1) <= device memory

where ``T_s`` is the stage's time per batch (objective ``throughput``) or its peak memory
(objective ``memory``), both from ``cost.segment_costs`` evaluated for every segment at once.
Stage index matters (stage s holds min(d - s, m) microbatches in flight, links differ), so
the program runs over absolute stage positions. A stage that does not fit swaps its
activations to host memory if allowed (``swap``), paying the stall. The best candidates are
then run through the schedule simulator, whose time and peak memory the plan reports.

A tensor width t > 1 (``partitioner.tensor``) splits each stage's layers over t ranks of one node: the search runs
on one rank's costs (``tensor.split_layers``) over a d x w mesh of tensor groups, group g being ranks g*t .. g*t+t-1.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from partitioner.cost import (
    MEMORY_PARTS,
    RESOURCES,
    LayerCost,
    Segments,
    StageContext,
    StageCost,
    segment_costs,
    simulate,
)

# the plan and its file: re-exported, the planner's callers import them from here
from partitioner.plans import (  # noqa: F401
    Plan,
    bound_line,
    load_plan,
    plan_from_text,
    plan_to_text,
    save_plan,
    stage_table,
    table,
)
from partitioner.tensor import TENSOR_EFFICIENCY, TensorShape, check_width, split_layers, widths
from partitioner.topology import (
    GIB,
    LOCAL,
    host_device_bandwidth,
    intra_link,
    make_rank_map,
    p2p_links,
    replica_links,
)
from pipedream2bw.config import TopologyConfig
from pipedream2bw.errors import ConfigError
from pipedream2bw.memory.host_optim import free_cores
from pipedream2bw.memory.precision import param_memory, step_waits
from pipedream2bw.pipeline.schedule import SPLIT_SCHEDULES

OBJECTIVES = ("throughput", "memory")


# ---------------------------------------------------------------- the dynamic program


@dataclass(frozen=True)
class HostFigures:
    """The host as the cost model takes it (``partitioner.host.HostProfile``; the defaults: no figure, its work is
    charged nothing): bytes per second its optimizer step reads and writes and one copy moves, swap.host_step, and
    the figures in words for the plan."""

    step_bw: float = math.inf
    copy_bw: float = math.inf
    reduce_bw: float = math.inf  # gloo all-reduce bus bandwidth between ranks of a host (streamed replicas' sums)
    step: str = "auto"
    text: str = ""
    cores: int = 0  # the host's cores: a node's ranks beyond them take turns (0: as many as ranks)
    # a rank's intra-op threads where OMP_NUM_THREADS sets them (0: 1 with several ranks on a node, as torchrun
    # sets, else torch's default, the host's cores): what the ranks' compute leaves free (``host_free_cores``)
    omp_threads: int = 0

    def free_cores(self, ranks: int) -> float:
        """Cores per rank that ``ranks`` ranks of a node leave free of their compute (inf: no figure)."""
        if not self.cores:
            return math.inf
        threads = self.omp_threads or (1 if ranks > 1 else self.cores)
        return float(free_cores(cores=self.cores, ranks=ranks, rank_threads=threads))


def stage_contexts(
    topo: TopologyConfig,
    rank_map,
    *,
    schedule: str,
    num_microbatches: int,
    recompute: bool,
    swap: bool,
    swap_resident: int,
    runtime_bytes,
    sharded: bool = False,
    weight_copy_bytes: int = 4,
    bucket_bytes: float = 25 * 2**20,
    waits: Optional[Sequence[bool]] = None,
    stream_window: int = 1,
    forward_lead: int = 0,
    host: HostFigures = HostFigures(),
    newest_predict: bool = False,
) -> List[StageContext]:
    """Per-stage contexts; ``runtime_bytes`` is one figure for all stages or a list, one per stage; ``waits``:
    per stage, whether it holds a closed batch's gradient (``precision.step_waits``; default none); ``host``: the host's
    figures, shared by the ranks of a node (a stage's ``host_share``: the plan's ranks on its first rank's node per
    core of the host, at least 1); ``newest_predict``: 2bw under pipeline.weight_versions=newest with its prediction
    (``StageContext``'s)."""
    d, w = len(rank_map), len(rank_map[0])
    if isinstance(runtime_bytes, (int, float)):
        runtime_bytes = [runtime_bytes] * d
    elif len(runtime_bytes) != d:
        raise ConfigError(
            f"runtime bytes per stage ({len(runtime_bytes)} figures) must be one figure or one per stage ({d})"
        )
    nxt, rep = p2p_links(topo, rank_map), replica_links(topo, rank_map)
    node = [r // topo.devices_per_node for row in rank_map for r in row]
    return [
        StageContext(
            stage_index=s,
            num_stages=d,
            num_microbatches=num_microbatches,
            data_parallel=w,
            schedule=schedule,
            forward_lead=forward_lead,
            newest_predict=newest_predict,
            recompute=recompute,
            swap=swap,
            swap_resident=swap_resident,
            link_next=nxt[s] if s < d - 1 else LOCAL,
            link_prev=nxt[s - 1] if s > 0 else LOCAL,
            replica_link=rep[s],
            host_device_bw=host_device_bandwidth(topo),
            runtime_bytes=float(runtime_bytes[s]),
            sharded=sharded,
            weight_copy_bytes=weight_copy_bytes,
            bucket_bytes=bucket_bytes,
            waits=bool(waits[s]) if waits is not None else False,
            stream_window=stream_window,
            host_step_bw=host.step_bw,
            host_copy_bw=host.copy_bw,
            host_reduce_bw=host.reduce_bw,
            host_share=max(1.0, node.count(rank_map[s][0] // topo.devices_per_node) / (host.cores or math.inf)),
            host_free_cores=host.free_cores(node.count(rank_map[s][0] // topo.devices_per_node)),
            host_step=host.step,
            host_is_device=topo.device == "cpu",
        )
        for s in range(d)
    ]


def partition(
    seg: Segments,
    contexts: Sequence[StageContext],
    *,
    capacity: float,
    objective: str = "throughput",
    allow_swap: bool = True,
    time_limit: float = math.inf,
    swap_only_if_needed: Optional[bool] = None,
    stream: bool = False,
) -> Optional[Tuple[float, List[int], List[bool]]]:
    """Exact min-max stage boundaries for the stages described by ``contexts``.

    Args:
        objective: 'throughput' minimizes the slowest stage's time per batch, 'memory' the largest
            stage's peak memory.
        time_limit: with 'memory', every stage must also take at most this long per batch (the
            planner's second pass: the least memory among splits as fast as the fastest).
        swap_only_if_needed: a stage swaps only when it does not fit otherwise (default: for
            'throughput'); else whenever swapping lowers its memory.
        stream: the alternative to a plain stage is a streamed one (weights from host memory, activations
            swapped: the runtime's swap.weights streams every stage that swaps), not one swapping activations only.

    Returns:
        (bottleneck value, first layer of each stage, swap flag of each stage), or None when
        no split fits in ``capacity`` bytes per device (and ``time_limit``).
    """
    n, d = seg.n, len(contexts)
    if d > n:
        return None
    if swap_only_if_needed is None:
        swap_only_if_needed = objective == "throughput"
    idx = np.arange(n + 1)
    # (n+1, n+1): entry [i, j] stands for the segment of layers i..j-1
    seg_i, seg_j = np.meshgrid(idx, idx, indexing="ij")
    invalid = seg_i >= seg_j
    key = "batch_s" if objective == "throughput" else "memory"
    limit = time_limit * (1 + 1e-9) if objective == "memory" else math.inf
    dp = None
    choices, swaps = [], []
    for s, ctx in enumerate(contexts):
        ctx = dataclasses.replace(ctx, host_optimizer=ctx.host_optimizer or stream)  # streaming sets it on all
        plain = segment_costs(seg, seg_i, seg_j, ctx)
        ok = (plain["memory"] <= capacity) & (plain["batch_s"] <= limit)
        value = np.where(ok, plain[key], np.inf)
        swapped = np.zeros_like(ok)
        if stream or (allow_swap and ctx.num_microbatches > 1):
            sw = segment_costs(seg, seg_i, seg_j, dataclasses.replace(ctx, swap=True, stream=stream))
            sw_ok = (sw["memory"] <= capacity) & (sw["batch_s"] <= limit)
            better = sw_ok & (~ok if swap_only_if_needed else sw[key] < value)
            value = np.where(better, sw[key], value)
            swapped = better
        value = np.where(invalid, np.inf, value)
        if s == 0:
            value = np.where(seg_i == 0, value, np.inf)
            best_i = np.zeros(n + 1, dtype=int)
            dp = value[0]
        else:
            total = np.maximum(dp[:, None], value)
            best_i = total.argmin(axis=0)
            dp = total[best_i, idx]
        choices.append(best_i)
        swaps.append(swapped)
    if not np.isfinite(dp[n]):
        return None
    starts, flags, j = [0] * d, [False] * d, n
    for s in reversed(range(d)):
        i = int(choices[s][j])
        starts[s], flags[s] = i, bool(swaps[s][i, j])
        j = i
    return float(dp[n]), starts, flags


# ---------------------------------------------------------------- the search


def divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True)
class Request:
    """What to plan: the batch, the machine and the search's limits."""

    global_batch_size: int
    topology: TopologyConfig
    devices: int
    memory_per_device_bytes: float
    runtime_bytes: object  # float: eps for every stage; or a list, one per stage (measured per stage)
    schedule: str = "2bw"
    forward_lead: int = 0  # pipeline.forward_lead: forwards ahead of 1F1B's d - s (one more microbatch's activations)
    objective: str = "throughput"
    depths: Optional[Sequence[int]] = None
    microbatch_sizes: Optional[Sequence[int]] = None
    recompute: Optional[bool] = None
    swap: bool = True
    swap_resident: int = 1
    max_microbatch_size: int = 64
    costs: str = "profile"
    model: Dict[str, object] = field(default_factory=dict)
    tolerance: float = 0.01  # plans within this fraction of the best objective tie; the other objective decides
    precision: str = "fp32"  # resolved train.precision, recorded in the plan (the costs already follow it)
    sharded: Optional[bool] = False  # optim.sharded; None: the search tries both
    shardable: bool = True  # False: the optimizer cannot step flat pieces (optim.name=muon), so never suggest it
    weight_dtype: str = "fp32"  # train.weight_dtype: what one weight version costs per parameter
    bucket_bytes: float = 25 * 2**20  # pipeline.bucket_mb in bytes: the reduction's flattening, a bucket at a time
    # precision.step_waits' inputs: a step agreement (clipping, skip, fp16), weights tied across the layers (held
    # across stages at d > 1), validation or the tie check (a sharded step then waits as well)
    step_agreement: bool = False
    tied: bool = False
    early_apply: bool = True
    stream: bool = True  # partition.stream: may stages stream their weights from host memory (see _streams)
    weight_prefetch: int = 1  # swap.weight_prefetch: the streamed stages' window
    host: HostFigures = HostFigures()  # the host's step and copies (a streaming plan steps every stage there)
    # tensor parallelism (partitioner.tensor): the model's split (None: its layers cannot be split, t = 1), the widths
    # to try (None: every t that divides the heads, the MLP width and a node's devices), sequence parallelism, and
    # the split compute's efficiency
    tensor: Optional[TensorShape] = None
    tensor_widths: Optional[Sequence[int]] = None
    sequence_parallel: bool = False
    tensor_efficiency: float = TENSOR_EFFICIENCY
    # 2bw under pipeline.weight_versions=newest with optim.delay_correction=predict: a stage whose early forwards are
    # more than half of m holds a third weight copy (config/newest.py's ``prediction_replicas``; StageContext's)
    newest_predict: bool = False


CostFn = Callable[[int], Sequence[LayerCost]]  # microbatch size -> per-layer costs


def _candidates(req: Request, num_layers: int):
    if req.objective not in OBJECTIVES:
        raise ConfigError(f"partition.objective ({req.objective!r}) is unknown; use one of {list(OBJECTIVES)}")
    if not 0 <= req.tolerance < 1:
        raise ConfigError(
            f"partition.tolerance ({req.tolerance}) must be in [0, 1): "
            f"the fraction of the best objective within which plans tie"
        )
    for t in widths_to_try(req):
        for d, w in _meshes(req, num_layers, req.devices // t):
            yield from _batch_candidates(req, d, w, t)


def widths_to_try(req: Request) -> List[int]:
    """The tensor widths the search takes: ``req.tensor_widths`` (each checked: ``tensor.check_width``), else every
    width the model and the machine allow (1 where the model cannot be split)."""
    dpn = req.topology.devices_per_node
    if req.tensor_widths is not None:
        for t in req.tensor_widths:
            check_width(req.tensor, t, devices=req.devices, devices_per_node=dpn)
        return list(req.tensor_widths)
    return [1] if req.tensor is None else widths(req.tensor, devices=req.devices, devices_per_node=dpn)


def _meshes(req: Request, num_layers: int, groups: int):
    """(d, w) with d * w = ``groups`` (tensor groups), d within the layers and ``req.depths``."""
    for d in req.depths or [d for d in divisors(groups) if d <= num_layers]:
        if not (groups % d or d > num_layers):
            yield d, groups // d


def _batch_candidates(req: Request, d: int, w: int, t: int):
    """(d, w, t, b, m, recompute, sharded) of one mesh: each b dividing the replica's batch (2bw: m >= d)."""
    if req.global_batch_size % w:
        return
    per_replica = req.global_batch_size // w
    bs = req.microbatch_sizes or [b for b in divisors(per_replica) if b <= req.max_microbatch_size]
    for b in bs:
        m = per_replica // b
        if per_replica % b or (req.schedule == "2bw" and m < d):
            continue
        for rc in [req.recompute] if req.recompute is not None else [False, True]:
            for sh in [req.sharded] if req.sharded is not None else [False, True]:
                if not (sh and w == 1):  # nothing to shard over: the unsharded candidate
                    yield d, w, t, b, m, rc, sh


@dataclass(frozen=True)
class _Split:
    """One searched configuration with its stage boundaries: what ``_make_plan`` turns into a Plan."""

    seg: Segments  # the layers' costs at this microbatch size
    data_parallel: int
    microbatch_size: int
    num_microbatches: int
    recompute: bool
    starts: List[int]  # first layer of each stage
    swap_flags: List[bool]  # whether each stage swaps its activations
    rank_map: List[List[int]]
    contexts: Sequence[StageContext]  # one per stage, built with swap=False; swap_flags decide
    stream: bool = False  # the stages that swap_flags name stream their weights too (swap.weights)
    tensor_parallel: int = 1  # t: each stage's layers split over t ranks (seg holds one rank's costs)

    @property
    def num_stages(self) -> int:
        return len(self.contexts)

    def stage_costs(self) -> List[StageCost]:
        """Each stage's time and memory, swapping where ``swap_flags`` says."""
        bounds = [*self.starts, self.seg.n]
        return [
            StageCost.of(
                self.seg,
                bounds[s],
                bounds[s + 1],
                dataclasses.replace(
                    ctx,
                    swap=self.swap_flags[s],
                    stream=self.stream and self.swap_flags[s],
                    host_optimizer=self.stream,
                ),
            )
            for s, ctx in enumerate(self.contexts)
        ]


def _make_plan(req: Request, split: _Split, *, simulate_it: bool) -> Plan:
    """The Plan for ``split``: its figures from the schedule simulator (``simulate_it``), else the
    cheaper bound the search ranks by (the slowest stage, or the CPU cores' total work if slower)."""
    d, w, m, t = split.num_stages, split.data_parallel, split.num_microbatches, split.tensor_parallel
    bounds = [*split.starts, split.seg.n]
    stages = split.stage_costs()
    cores = req.topology.cores if req.topology.device == "cpu" else None
    if simulate_it:  # the cores' share: the w x t ranks of each stage
        sim = simulate(
            stages,
            schedule=req.schedule,
            num_microbatches=m,
            data_parallel=w * t,
            cores=cores,
            forward_lead=req.forward_lead,
        )
        batch_time, peaks = sim.batch_time_s, sim.peak_memory_bytes
    else:
        batch_time = max(st["batch_s"] for st in stages)
        if cores:
            busy = w * t * sum(m * (st["forward_s"] + st["backward_s"]) + st["step_s"] for st in stages)
            batch_time = max(batch_time, busy / cores)
        peaks = [st["memory"] for st in stages]
    return Plan(
        schedule=req.schedule,
        num_stages=d,
        data_parallel=w,
        tensor_parallel=t,
        sequence_parallel=req.sequence_parallel and t > 1,
        microbatch_size=split.microbatch_size,
        num_microbatches=m,
        global_batch_size=req.global_batch_size,
        balance=[bounds[s + 1] - bounds[s] for s in range(d)],
        rank_map=[list(r) for r in split.rank_map],
        recompute=split.recompute,
        sharded=split.contexts[0].sharded,
        weight_dtype=req.weight_dtype,
        swap_stages=[s for s in range(d) if split.swap_flags[s]],
        stream_stages=[s for s in range(d) if split.stream and split.swap_flags[s]],
        weight_prefetch=req.weight_prefetch,
        predicted_stall_s=[float(st["stall_s"]) for st in stages],
        predicted_host_step_s=[float(st["host_step_s"]) for st in stages],
        predicted_host_sum_s=[float(st["host_sum_s"]) for st in stages],
        predicted_stage_bound=[RESOURCES[int(st["bound"])] for st in stages],
        predicted_allreduce_s=[float(st["allreduce_s"]) for st in stages],
        predicted_exposed_s=[float(st["exposed_s"]) for st in stages],
        predicted_host_bytes=[int(st["host_bytes"]) for st in stages],
        predicted_bound=RESOURCES[int(max(stages, key=lambda st: st["batch_s"])["bound"])],
        host=req.host.text if split.stream else "",
        host_optimizer=split.stream,
        **plan_request_fields(req, batch_time),
        predicted_stage_time_s=[float(st["microbatch_s"]) for st in stages],
        predicted_peak_memory_bytes=[int(p) for p in peaks],
        predicted_memory_breakdown=[{k: int(st[k]) for k in MEMORY_PARTS} for st in stages],
        model=dict(req.model),
        swap_resident=req.swap_resident,
        precision=req.precision,
    )


def plan_request_fields(req: Request, batch_time: float) -> Dict[str, Any]:
    """A Plan's fields that come from the request, and its predicted batch time and samples/s."""
    return dict(
        objective=req.objective,
        topology=req.topology.name,
        devices=req.devices,
        memory_per_device_bytes=int(req.memory_per_device_bytes),
        costs=req.costs,
        predicted_batch_time_s=float(batch_time),
        predicted_samples_per_s=float(req.global_batch_size / batch_time),
    )


def group_topology(topo: TopologyConfig, t: int) -> TopologyConfig:
    """The machine as a mesh of tensor groups of ``t`` ranks: a node holds ``devices_per_node / t`` of them (the
    planner's rank maps and links count groups; group g is ranks g*t .. g*t+t-1, on one node)."""
    return dataclasses.replace(topo, devices_per_node=topo.devices_per_node // t) if t > 1 else topo


def _contexts(req: Request, rank_map, *, m: int, recompute: bool, sharded: bool, t: int = 1) -> List[StageContext]:
    """``stage_contexts`` of one candidate of ``req`` (``rank_map`` in tensor groups of ``t`` ranks)."""
    d, w = len(rank_map), len(rank_map[0])
    return stage_contexts(
        group_topology(req.topology, t),
        rank_map,
        schedule=req.schedule,
        num_microbatches=m,
        recompute=recompute,
        swap=False,
        swap_resident=req.swap_resident,
        runtime_bytes=req.runtime_bytes,
        sharded=sharded,
        weight_copy_bytes=_weight_copy(req),
        bucket_bytes=req.bucket_bytes,
        waits=_waits(req, d, w, sharded=sharded),
        stream_window=req.weight_prefetch,
        host=req.host,
        forward_lead=req.forward_lead,
        newest_predict=req.newest_predict,
    )


def plan(cost_fn: CostFn, req: Request, *, runners_up: int = 4, explain: bool = True) -> List[Plan]:
    """The best plan for ``req`` first, then up to ``runners_up`` others, best first.

    Throughput: highest predicted samples/s; memory: lowest peak memory per device. Plans within
    ``req.tolerance`` of the best count as tied, and the other objective decides among them
    (``_order``). The finalists' figures come from the simulator.

    Raises:
        ConfigError: nothing fits; says the smallest per-device memory, or the fewest devices, that would, and
            (``explain``) which of the search's options left out would find a plan.
    """
    whole: Dict[int, List[LayerCost]] = {}
    cache: Dict[Tuple[int, int], Segments] = {}

    def segments(b: int, t: int = 1) -> Segments:
        """One rank's costs at microbatch size ``b`` and tensor width ``t``."""
        if b not in whole:
            whole[b] = list(cost_fn(b))
        if (b, t) not in cache:
            cache[b, t] = Segments(_split_layers(req, whole[b], b, t))
        return cache[b, t]

    num_layers = segments(1 if req.microbatch_sizes is None else req.microbatch_sizes[0]).n
    found: List[Tuple[tuple, Plan, _Split]] = []
    tried = 0
    for d, w, t, b, m, rc, sh in _candidates(req, num_layers):
        tried += 1
        seg = segments(b, t)
        rank_map = make_rank_map(group_topology(req.topology, t), d, w)
        ctxs = _contexts(req, rank_map, m=m, recompute=rc, sharded=sh, t=t)
        resident = False
        for stream in [False, True] if _streams(req, w, t) else [False]:
            res = partition(
                seg,
                ctxs,
                capacity=req.memory_per_device_bytes,
                objective=req.objective,
                allow_swap=req.swap,
                stream=stream,
            )
            # the second pass costs swap.optimizer=host on every stage: where the first found a plan, only one that
            # streams is new; where it did not, one that keeps its optimizer state on the host without streaming is
            resident = resident or (res is not None and not stream)
            if res is None or (stream and resident and not any(res[2])):
                continue
            split = _Split(seg, w, b, m, rc, starts=res[1], swap_flags=res[2], rank_map=rank_map, contexts=ctxs)
            split = dataclasses.replace(split, stream=stream, tensor_parallel=t)
            if stream and not _host_fits(req, split):
                continue
            p = _make_plan(req, split, simulate_it=False)
            found.append((_rank_key(req.objective, p), p, split))
    if not found:
        raise ConfigError(_infeasible_message(segments, req, tried, num_layers) if explain else "no plan fits")
    order = _order([p for _, p, _ in found], req.objective, req.tolerance)
    found = [found[i] for i in order]
    finalists = []
    for _, _, split in found[: runners_up + 3]:
        if req.objective == "throughput":  # as fast, with the least memory: a min-max split leaves slack elsewhere
            fastest = max(st["batch_s"] for st in split.stage_costs())
            lean = partition(
                split.seg,
                split.contexts,
                capacity=req.memory_per_device_bytes,
                objective="memory",
                allow_swap=req.swap,
                time_limit=fastest,
                swap_only_if_needed=True,
                stream=split.stream,
            )
            if lean is not None and _streaming_ok(req, split, lean):
                split = dataclasses.replace(split, starts=lean[1], swap_flags=lean[2])
        finalists.append(_make_plan(req, split, simulate_it=True))
    finalists = [finalists[i] for i in _order(finalists, req.objective, req.tolerance)]
    return finalists[: runners_up + 1]


def _rank_key(objective: str, p: Plan) -> tuple:
    peak = max(p.predicted_peak_memory_bytes)
    if objective == "memory":
        return (peak, -p.predicted_samples_per_s)
    return (-p.predicted_samples_per_s, peak)


def _order(plans: Sequence[Plan], objective: str, tolerance: float) -> List[int]:
    """Indices of ``plans``, best first: those within ``tolerance`` (a fraction) of the best objective
    count as equal and come first, ordered by the other objective (throughput: the least peak
    memory among plans as fast as the fastest; memory: the fastest among the leanest); then the
    rest by ``_rank_key``. A model's 0.4% less memory is no reason to run 3x slower."""
    if not plans:
        return []
    peak = [max(p.predicted_peak_memory_bytes) for p in plans]
    speed = [p.predicted_samples_per_s for p in plans]
    if objective == "memory":
        near = [i for i in range(len(plans)) if peak[i] <= min(peak) * (1 + tolerance)]
        near.sort(key=lambda i: (-speed[i], peak[i]))
    else:
        near = [i for i in range(len(plans)) if speed[i] >= max(speed) * (1 - tolerance)]
        near.sort(key=lambda i: (peak[i], -speed[i]))
    rest = sorted((i for i in range(len(plans)) if i not in set(near)), key=lambda i: _rank_key(objective, plans[i]))
    return near + rest


def _split_layers(req: Request, layers: Sequence[LayerCost], b: int, t: int) -> List[LayerCost]:
    """One rank's costs of ``layers`` split ``t`` ways (``tensor.split_layers``, collectives on the intra-node link)."""
    if t == 1:
        return list(layers)
    link = intra_link(req.topology)
    sp, eff = req.sequence_parallel, req.tensor_efficiency
    return split_layers(layers, req.tensor, t, b=b, link=link, sequence_parallel=sp, efficiency=eff)


def _streams(req: Request, w: int, t: int = 1) -> bool:
    """Whether a candidate with ``w`` replicas of ``t`` ranks may stream weights: what the runtime's swap.weights
    accepts (config/validate.py, run/start.py: no tensor split, no ties on a streamed stage; data parallelism,
    clipping, skip, fp16, validation and compute-dtype versions compose) and where it saves device memory (a GPU's,
    not the host's own). With w > 1 the cost model charges the replicas' gloo all-reduce of the host gradients
    (``cost._stream_reduce_s``) and each node's host holds its replicas' shares (``_host_fits``)."""
    return req.stream and t == 1 and req.topology.device == "cuda" and not req.tied


def _streaming_ok(req: Request, split: "_Split", lean) -> bool:
    """Whether the second pass's split ``lean`` of a streaming ``split`` still streams (its costs count
    swap.optimizer=host, which only a plan that streams sets) and fits the host."""
    lean_split = dataclasses.replace(split, starts=lean[1], swap_flags=lean[2])
    return not split.stream or _host_fits(req, lean_split)


def _host_fits(req: Request, split: "_Split") -> bool:
    """Whether each node's host memory holds what its stages keep there (streamed weights and state, swapped
    activations)."""
    used: Dict[int, float] = {}
    for row, st in zip(split.rank_map, split.stage_costs()):
        for r in row:
            used[r // req.topology.devices_per_node] = (
                used.get(r // req.topology.devices_per_node, 0.0) + st["host_bytes"]
            )
    return max(used.values()) <= req.topology.host_memory_gib * GIB


def _weight_copy(req: Request) -> int:
    """Bytes of one weight version per parameter (param_memory's: 4, or 2 with train.weight_dtype=compute)."""
    return param_memory(
        req.precision, schedule=req.schedule, optimizer="adam", weight_dtype_name=req.weight_dtype
    ).weight_copy


def _waits(req: Request, d: int, w: int, *, sharded: bool) -> List[bool]:
    """``precision.step_waits`` per stage of a candidate: whether it holds a closed batch's gradient."""
    return [
        step_waits(
            req.schedule,
            agreement=req.step_agreement,
            tied_across_stages=req.tied and d > 1,
            sharded=sharded and w > 1,
            early_apply=req.early_apply,
            stage_index=s,
        )
        for s in range(d)
    ]


def _min_memory(
    seg: Segments,
    req: Request,
    d: int,
    w: int,
    b: int,
    m: int,
    *,
    devices_topo: TopologyConfig,
    sharded: bool = False,
    t: int = 1,
) -> float:
    """Lowest possible peak memory per device at (d, w, t, b), recomputing and swapping (``seg``: one rank's costs)."""
    devices_topo = group_topology(devices_topo, t)
    rank_map = make_rank_map(devices_topo, d, w)
    eps = req.runtime_bytes if isinstance(req.runtime_bytes, (int, float)) else max(req.runtime_bytes)
    ctxs = stage_contexts(
        devices_topo,
        rank_map,
        schedule=req.schedule,
        num_microbatches=m,
        recompute=True,
        swap=False,
        swap_resident=req.swap_resident,
        runtime_bytes=eps,
        sharded=sharded,
        weight_copy_bytes=_weight_copy(req),
        bucket_bytes=req.bucket_bytes,
        waits=_waits(req, d, w, sharded=sharded),
        stream_window=req.weight_prefetch,
        newest_predict=req.newest_predict,
    )
    best = math.inf
    for stream in [False, True] if _streams(req, w, t) else [False]:
        res = partition(seg, ctxs, capacity=math.inf, objective="memory", allow_swap=req.swap, stream=stream)
        best = min(best, math.inf if res is None else res[0])
    return best


def _infeasible_message(segments: Callable[..., Segments], req: Request, tried: int, num_layers: int) -> str:
    cap = req.memory_per_device_bytes / GIB
    what = (
        f"no plan fits: {num_layers} layers, global batch {req.global_batch_size}, {req.schedule}, "
        f"on {req.devices} devices of {cap:.3g} GiB ({tried} configurations tried)"
    )
    if tried == 0:
        return (
            f"{what}: no (d, w, t, b) divides the global batch with d*w*t = {req.devices} devices "
            f"(2bw also needs m >= d){_what_would_fit(segments, req)}; change train.global_batch_size, the device "
            f"count or partition.depths/microbatch_sizes"
        )
    # The smallest per-device memory on these devices: the memory objective without a cap.
    best = math.inf
    relaxed = dataclasses.replace(req, microbatch_sizes=None, depths=None, recompute=None)
    for d, w, t, b, m, rc, sh in _candidates(relaxed, num_layers):
        if rc:
            seg = segments(b, t)
            best = min(best, _min_memory(seg, req, d, w, b, m, devices_topo=req.topology, sharded=sh, t=t))
    fewest = _fewest_devices(segments, req, num_layers)
    fix = f"needs at least {best / GIB:.3g} GiB per device on {req.devices} devices"
    if fewest:
        d, t = fewest
        mesh = f"{d} stages of {cap:.3g} GiB" if t == 1 else f"{d} stages x {t} tensor ranks of {cap:.3g} GiB"
        fix += f", or a pipeline of at least {mesh} (at least {d * t} devices, a multiple of the depth)"
    else:
        fix += f"; even a {num_layers}-stage pipeline does not fit in {cap:.3g} GiB"
    return (
        f"{what}: it {fix}{_what_would_fit(segments, req)}; raise topology.memory_per_device_gib "
        f"(topology.host_memory_gib for ranks sharing a CPU host) or the device count, or lower the batch"
    )


def _fewest_devices(segments: Callable[..., Segments], req: Request, num_layers: int) -> Optional[Tuple[int, int]]:
    """(d, t) of the fewest devices d*t that hold the model at this memory: for each tensor width the search may take
    (within a node), the shallowest pipeline (w = 1, b = 1) that fits; ``None`` when none does."""
    dpn = req.topology.devices_per_node
    ts = [1] if req.tensor is None else widths(req.tensor, devices=dpn, devices_per_node=dpn)
    fewest = None
    for t in ts:
        big = dataclasses.replace(req.topology, nodes=1, devices_per_node=num_layers * t)
        for d in range(1, num_layers + 1):
            if (req.schedule == "2bw" and req.global_batch_size < d) or (fewest and d * t >= fewest[0] * fewest[1]):
                break
            m = req.global_batch_size
            if _min_memory(segments(1, t), req, d, 1, 1, m, devices_topo=big, t=t) <= req.memory_per_device_bytes:
                fewest = (d, t)
                break
    return fewest


def _split(req: Request) -> bool:
    """Whether the request's schedule splits its backwards (zb1p): swapping, streaming and recomputation refuse it."""
    return req.schedule in SPLIT_SCHEDULES


# What the search left out, each as (what it is, the setting that lets the planner use it, the Request it changes),
# offered when the request leaves it out: the "no plan" message says which of them finds a plan.
_LEFT_OUT = (
    ("sharding", "partition.sharded=null", lambda r: r.sharded is False and r.shardable, {"sharded": None}),
    ("activation swapping", "partition.swap=true", lambda r: not r.swap and not _split(r), {"swap": True}),
    ("weight streaming", "partition.stream=true", lambda r: not r.stream and not _split(r), {"stream": True}),
    (
        "recomputation",
        "partition.recompute=null",
        lambda r: r.recompute is False and not _split(r),
        {"recompute": None},
    ),
    (  # zb1p refuses all three (config/validate.py): flush's update with them
        "flush's swapping, streaming and recomputation",
        "pipeline.schedule=flush partition.swap=true partition.stream=true partition.recompute=null",
        _split,
        {"schedule": "flush", "swap": True, "stream": True, "recompute": None},
    ),
    (
        "any microbatch size",
        "partition.microbatch_sizes=null",
        lambda r: r.microbatch_sizes is not None,
        {"microbatch_sizes": None},
    ),
    ("any depth", "partition.depths=null", lambda r: r.depths is not None, {"depths": None}),
    (
        "any tensor width",
        "pipeline.tensor_parallel=1: the planner searches t",
        lambda r: r.tensor is not None and r.tensor_widths is not None,
        {"tensor_widths": None},
    ),
)


def _what_would_fit(segments: Callable[..., Segments], req: Request) -> str:
    """``'; with sharding (partition.sharded=null) it fits: 2 x 4 x 1, b 1, peak 3.1 GiB'``: the search run again with
    each option ``req`` leaves out (``_LEFT_OUT``), then with all of them together; ``''`` when it leaves none out."""
    left_out = [(name, key, change) for name, key, applies, change in _LEFT_OUT if applies(req)]
    if not left_out:
        return ""

    def best(changes: Dict[str, object]) -> Optional[Plan]:
        try:
            costs = lambda b: segments(b).layers  # noqa: E731 (the costs already taken, kept by the caller's cache)
            return plan(costs, dataclasses.replace(req, **changes), runners_up=0, explain=False)[0]
        except ConfigError:
            return None

    def fits(p: Plan) -> str:
        peak = max(p.predicted_peak_memory_bytes) / GIB
        return f"{p.num_stages} x {p.data_parallel} x {p.tensor_parallel}, b {p.microbatch_size}, peak {peak:.3g} GiB"

    found = [(name, key, p) for name, key, change in left_out if (p := best(change)) is not None]
    if found:
        return "; " + "; ".join(f"with {name} ({key}) it fits: {fits(p)}" for name, key, p in found)
    keys = " ".join(key for _, key, _ in left_out)
    together = best({k: v for _, _, change in left_out for k, v in change.items()}) if len(left_out) > 1 else None
    if together is not None:
        return f"; with {', '.join(name for name, _, _ in left_out)} together ({keys}) it fits: {fits(together)}"
    names = " or ".join(name for name, _, _ in left_out)
    return f"; {names} ({keys}) would not find a plan either{', alone or together' if len(left_out) > 1 else ''}"
