"""Pure: the cost model (docs/design.md sections 3-4) and a simulator of the schedules' action lists.

A model is an ordered list of ``LayerCost`` (one microbatch size ``b``); a stage is a contiguous
segment ``[start, stop)`` of it. ``segment_costs`` evaluates the memory and time formulas for
one stage; its arguments may be numpy index arrays, so the planner's dynamic program evaluates
every segment at once with the very same formulas that the final plan reports.

Memory of stage s (bytes), ``n`` microbatches in flight (``in_flight``); ``W`` is one copy of the
stage's weights, float32 under every precision (``pipedream2bw.memory.precision.param_memory``, whose bytes
per parameter these terms are)::

    versions*W*c + W (gradient) + O/w' (optimizer state) + M (float32 masters, with the optimizer)
                       c: weight_copy_bytes / 4 (train.weight_dtype); w' = w with optim.sharded, else 1;
                       M = W/w' where the versions are not the masters (sharded or compute dtype), else 0
    + W/w' (held)      where the step waits (``waits``: 2bw with a step agreement or ties): the closed
                       batch's gradient (sharded: its shard) while the next batch's accumulates
    + activations      n*A                      A: what autograd saves for one microbatch
                                                   (+ the stashed output the runtime keeps)
                       n*I' + A  (recompute)    I': stage input + stashed output
                       r*P + (n - r)*U          (swapping: r = min(n, K + 1), K = swap.resident)
                                                P: per microbatch (A, or I' with recompute);
                                                U = min(P, I'): never swapped (the stage's input
                                                and stashed output, held by the stage itself)
    + buffers          p2p receive/send buffers and their gradients; w>1: one gradient bucket
                       (``bucket_bytes``) flattened beside its gradients as its reduction starts
    + workspace        the largest layer's saved bytes + output: gradients alive in its backward
    + runtime          eps: memory the process has before any model (measured, not fitted)

A parameter several layers share (a tied embedding: ``LayerCost.ties``) is one parameter on a stage that holds
several of them (the runtime reties them: ``pipeline/ties.py``): its weights, versions, gradient, optimizer state,
step and the step's copies count once there (``Segments.total``), and once a rank under zbv, whose second chunk
(``StageContext.held``: the rank's other chunk's layers) counts none of what its first one holds, nor the step's
largest tensor again (one optimizer steps the rank's two chunks). Holders on different stages keep a copy each.

the steady state's peak; the step's (``step_memory``): the weight state, buffers and runtime + the microbatches still
in flight when the stage steps (``live_at_step``: under 2bw n - 1 of the next batch's, none under flush and gpipe) +
``step``, the step's transients (``pipedream2bw.memory.step_memory``: the largest one tensor's, and the multi-tensor
temporary and, under 2bw, the delay correction's float32 copy over the parameters one optimizer steps at once, a
bucket's where w > 1, a shard's sharded; none on the device where the optimizer steps on the host). ``memory`` is
the larger of the two.

Time per microbatch: ``c*(F+B) + p2p + stall`` (``c*(F+B)`` is F + B + F with recomputation);
per batch, ``K*T_s + step_s + exposed all-reduce`` with K = m (2bw), m + d - 1 (flush/gpipe) or m + (d - 1)/3
(zb1p: ZB-H1's bubble is (d - 1)(F + B_input - W), with the backward split into two equal halves and B = 2F, the
ratio analytic costs give the simulator too: (d - 1)F = (d - 1)T/3; profiled, B is ``LayerCost.input_s``, 0.7-0.9
of a small GPT block's backward). Under zb1p and zbv the backward that runs split costs
``LayerCost.split_s`` more (``partitioner/split.py``: B then W are two autograd passes; profiled), added to B at the
share of backwards that run split and, in the simulator, to each W after a split B.
zb1p's memory: n = min(d, m) microbatches on every stage
(``in_flight``: a microbatch's tensors stay until its W), an upper bound, as after its B a microbatch holds only
what W needs (the weights' inputs).

Swap stall (``swap.py``'s mechanism): a microbatch moves ``t = (P - U) / host_device_bw`` each
way, on one copy stream per direction (a full-duplex link). Offloads start as tensors are saved
and may lag up to the next forward (the budget wait); a prefetch starts when the backward
before it does. Under 1F1B an F and a B lie between two offloads and between two fetches:
``stall = max(0, t - (F + B))``, or ``t`` with K = 0 (each fetch starts at its own backward).
GPipe runs its forwards back to back, then its backwards: ``max(0, t - F)`` plus
``max(0, t - B)`` (``t`` with K = 0). A stage with ``n <= K + 1`` in flight does not swap.

Streamed stage (``swap.weights``; ``pipedream2bw/memory/stream.py``): its weight versions, gradient accumulators and
optimizer state are in host memory; the device holds what ``stream.device_bytes_model`` says (the ``window + 1``
largest layers' weights and one layer's gradients: weights and gradients below, optimizer 0), and the stage also
swaps its activations (the runtime's ``swap.stages`` name both). Its versions may be in the compute dtype
(``train.weight_dtype=compute`` under bf16: ``weight_copy_bytes`` 2): the device's copies and gradients, the link's
bytes and ``t_k`` are then half, while the host keeps float32 masters and gradient sums. Time, per microbatch, with
``t_k`` layer k's weights (in the versions' dtype) over the host-device bandwidth and one copy stream: the forward
takes layer k's copy while layer k+1's is coming (window >= 1), so it stalls ``t_first + sum max(0, t_(k+1) - F_k)``;
the backward takes them in reverse, each layer's gradients leaving synchronously on the compute stream (``t_k`` more,
exposed), so it stalls ``t_last + sum max(0, t_(k-1) - (B_k + t_k)) + sum t_k`` (B_k + F_k with recomputation).
Window 0: every copy is exposed. Exact for window 1 with the first copy of each pass exposed; for larger windows an
upper bound (they smooth uneven layers, the copy stream's total is the same). Host bytes (``host_bytes``,
``stream.host_bytes_model``'s terms): per version its weights and a float32 gradient accumulator, the optimizer state
and float32 masters where the versions are in the compute dtype (2bw with AdamW: 24 B a parameter either way).
``swap.optimizer=host``, which streaming needs and sets on every stage, leaves a stage that does not stream its
versions and gradients, with its optimizer state and float32 masters on the host and the step's float32 gradients
out and new weights in (``(1 + c) W / host_device_bw``) charged to the step; with compute-dtype versions its step
stays on the training thread (``sharding.ShardedVersions``).

A streamed stage's replicas (w > 1, ``_stream_reduce_s``) all-reduce its float32 host gradient sums over gloo, a
bucket per layer started once the batch's last backward has also left the layer below it (a layer late), the buckets
in order on the group, all waited for at the step (right after that backward): per layer ``2 (w-1)/w`` of its bytes
at the slower of the replicas' link and the host's measured gloo figure (``host_reduce_bw``) plus ``2 (w-1)``
latencies; exposed, what outlasts the backward (on a CPU, all of it). Each layer's sums are flattened first: one host
copy more (the sums) and the stage's float32 gradient bytes more in host memory; no bucket on the device.

An unstreamed stage's replicas (``_data_parallel_s``) all-reduce ``2 (w-1)/w`` of its float32 gradient bytes over the
slowest link among them, hidden behind the batch's last backward where the link is faster. On a CPU (``host_is_device``)
the replicas' gloo runs on this host: at most its measured figure (``host_reduce_bw``, as a streamed stage's); and where
the ranks' compute leaves no core free (``host_free_cores`` < 1) none of it is hidden: gloo's threads take turns with
compute on the ranks' cores, and the runtime's bucket (``pipeline.bucket_mb``, 25 MiB: a small stage's every gradient)
starts only once its last gradient is final, at the backward's end. A CPU stage's training thread also copies its
weights' bytes beside the optimizer's step (``_cpu_copies_s``, at the host's copy bandwidth, charged to ``step_s``): the
gradients scaled by 1/(m w), under 2bw W(t) copied into the replica the step writes W(t+1) in, at w > 1 each bucket
flattened for the all-reduce (on a GPU at the device's memory bandwidth: not charged).

The host (``_host_work``, ``_batch_s``; figures from ``partitioner.host``, measured once and cached): a stage whose
optimizer steps there runs no step on the device; the host's step reads the gradient and reads and writes the weights
and the optimizer state (AdamW: 28 B a parameter) at the host's measured step bandwidth, and a streamed stage's host
also sums its gradients over the m microbatches (the first copied, the rest added: 1.5 copies each; from bf16
gradients into float32 sums 0.75 and 1.25) at the measured copy bandwidth; compute-dtype versions' step also rounds
the masters into the new version, and float32 streamed versions' step first copies W(t) into the replica it writes
W(t+1) in (one copy of W: the runtime's thread spent 10-14 ms of CPU a step on 6.3 M parameters, the AdamW kernel
alone 7.6-10.4); a node's ranks beyond its cores take turns. Three resources per batch: the device (K microbatches
with their stalls), the link (each direction's copies) and the host. A synchronous step (``host_step_overlaps``: not
background) adds: ``max(device, link, sums) + step``; in the background the step of batch t overlaps batch t+1
(``max(device, link, sums, step)``); a CPU "device" is the host, where everything adds but the link's copies, which
worker threads run. Where the node's ranks leave no core free of their compute (``host_free_cores`` < 1,
``host_optim.free_cores``: two ranks of one thread on 2 cores; one rank on torch's default threads, every core) the
host's work takes turns with compute on the ranks' cores: the step adds even in the background (the runtime's thread
waited 46-59 ms a step for a core it ran 10-14 ms on, bench_stream --data-parallel 2), and on a CPU so do the copies,
less the stalls, in which they run. The step's figure is one thread's (``partitioner.host``), the runtime's step's
threads where no core is free (``host_optim.host_threads``); with free cores it takes them, which the model does not
credit (not measured on such a host: there the time is an upper bound). ``bound`` names the busiest.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from partitioner.segments import LayerCost, Segments
from partitioner.split import split_backward_s, whole_set
from partitioner.topology import LOCAL, Link
from pipedream2bw.config.newest import prediction_weight_copies
from pipedream2bw.memory.precision import optimizer_state_factor, versions_held

# in_flight: the runtime's own bound, re-exported for the memory model's callers
from pipedream2bw.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    SPLIT_SCHEDULES,
    STEP,
    V_SCHEDULES,
    WEIGHT,
    chunks,
    in_flight,
    max_in_flight,
    pipeline_actions,
    stage_actions,
    timings,
)

# re-exported: optimizer_state_factor's home is pipedream2bw.memory.precision, with the bytes per parameter; the
# layers' costs and their prefix sums partitioner.segments
__all__ = ["optimizer_state_factor", "LayerCost", "Segments"]


def num_versions(schedule: str) -> int:
    return versions_held(schedule)


def weight_copies(ctx: "StageContext") -> int:
    """The weight copies a stage holds: its versions (``num_versions``), or under newest's prediction its W and its
    one or two prediction replicas (config/newest.py's ``prediction_weight_copies``)."""
    if not (ctx.newest_predict and ctx.schedule == "2bw"):
        return num_versions(ctx.schedule)
    return prediction_weight_copies(ctx.num_stages, ctx.num_microbatches, ctx.forward_lead, stage_index=ctx.stage_index)


def batch_multiplier(schedule: str, num_stages: int, num_microbatches: int) -> float:
    """Per-microbatch times per batch on the bottleneck: m without flushes, m + d - 1 with them, m + (d - 1)/3
    under zb1p (its W's fill all of the bubble but the forward's share of the fill and drain), and under zbv its
    schedule's own steady-state ticks (``_v_ticks``) over 6: m once m >= 2d - 1 (zero bubble: rank 0, first and
    last in the V, starts batch t+1 while the others finish batch t), more below."""
    if schedule == "zb1p":
        return num_microbatches + (num_stages - 1) / 3
    if schedule in V_SCHEDULES:
        return _v_ticks(schedule, num_stages, num_microbatches) / 6
    return num_microbatches if schedule == "2bw" else num_microbatches + num_stages - 1


@functools.lru_cache(maxsize=64)
def _v_ticks(schedule: str, num_stages: int, num_microbatches: int) -> float:
    """A V schedule's (two chunks a rank) steady-state batch, the spacing of rank 0's steps over 5 batches (as
    ``simulate``), in ticks of a chunk's F, B or W, each a sixth of a stage's F + B under the simulator's ratio (B =
    2F, split into two equal halves; a chunk is half a stage); steps take no time."""
    lists = pipeline_actions(schedule, num_stages=num_stages, num_microbatches=num_microbatches, num_batches=5)
    times = timings(lists, lambda a: 0.0 if a.kind == STEP else 1.0)
    ends = [end for a, (_, end) in zip(lists[0], times[0]) if a.kind == STEP]
    return (ends[-1] - ends[1]) / (len(ends) - 2)


def _xfer(link: Link, nbytes):
    nbytes = np.asarray(nbytes, dtype=np.float64)
    if link.bandwidth == math.inf:
        return np.zeros_like(nbytes)
    return np.where(nbytes > 0, link.latency + nbytes / link.bandwidth, 0.0)


@dataclass(frozen=True)
class StageContext:
    """Everything about a stage's position that the formulas need besides its layers."""

    stage_index: int
    num_stages: int
    num_microbatches: int
    data_parallel: int
    schedule: str = "2bw"
    forward_lead: int = 0  # pipeline.forward_lead
    # pipeline.weight_versions=newest with optim.delay_correction=predict (under 2bw): ``weight_copies``
    newest_predict: bool = False
    recompute: bool = False
    swap: bool = False
    swap_resident: int = 1
    link_next: Link = LOCAL  # to stage s+1
    link_prev: Link = LOCAL  # to stage s-1
    replica_link: Link = LOCAL  # among the stage's replicas
    host_device_bw: float = 10e9
    runtime_bytes: float = 0.0
    # layer ranges [start, stop) the stage's rank holds besides its own (zbv: its other chunk), stepped with it by one
    # optimizer: the parameters it shares with them and the step's largest tensor count there (``Segments.total``)
    held: Tuple[Tuple[int, int], ...] = ()
    sharded: bool = False  # optim.sharded: masters and optimizer state 1/w per replica, reduce-scatter + all-gather
    weight_copy_bytes: int = 4  # bytes per parameter of one weight version (train.weight_dtype: 4, or 2 in bf16/fp16)
    bucket_bytes: float = 25 * 2**20  # pipeline.bucket_mb: the data-parallel reduction flattens a bucket at a time
    waits: bool = False  # precision.step_waits: a closed batch's gradient is held while the next one's accumulates
    stream: bool = False  # swap.weights on this stage (with swap: the runtime swaps a streamed stage's activations)
    stream_window: int = 1  # swap.weight_prefetch
    host_optimizer: bool = False  # swap.optimizer=host (every stage of a plan that streams): state and masters on host
    # the host (``partitioner.host``; the defaults, no figure, charge it nothing): bytes per second its optimizer step
    # reads and writes, and one host copy moves (one thread); the node's ranks stepping there per core of its host, at
    # least 1 (beyond its cores they take turns); where the step runs (swap.host_step: ``host_step_overlaps``);
    # whether the host is the device (a CPU: its work and the stage's compute take turns on the same cores)
    host_step_bw: float = math.inf
    host_copy_bw: float = math.inf
    # a streamed stage's replicas all-reduce its host gradients over gloo (run/build.py): the host's measured gloo
    # all-reduce bus bandwidth (bytes/s), capped by the replicas' link (``_stream_reduce_s``)
    host_reduce_bw: float = math.inf
    host_share: float = 1.0
    host_step: str = "auto"
    host_is_device: bool = False
    # cores of the node per rank that its ranks' compute threads leave free (``host_optim.free_cores``; inf: no
    # figure): with none, the host's work takes turns with compute on the ranks' cores (``_batch_s``)
    host_free_cores: float = math.inf


def host_step_overlaps(ctx: StageContext) -> bool:
    """Whether a stage's host optimizer step runs on a thread of its own while the next batch computes, as the runtime
    decides (run/build.py, swap.host_step): under 2bw with swap.host_step=background or auto, streamed stages too;
    else on the training thread, as an unstreamed stage with compute-dtype versions (sharding.ShardedVersions) does."""
    unstreamed_compute = ctx.weight_copy_bytes != 4 and not ctx.stream
    return ctx.schedule == "2bw" and ctx.host_step in ("background", "auto") and not unstreamed_compute


def _swap_stall(t, fwd, bwd, *, schedule: str, resident: int):
    """Compute's wait per microbatch for copies of ``t`` seconds each way (see the module docstring)."""
    fetch = t if resident == 0 else None
    if schedule == "gpipe":
        return np.maximum(0.0, t - fwd) + (fetch if fetch is not None else np.maximum(0.0, t - bwd))
    return fetch if fetch is not None else np.maximum(0.0, t - (fwd + bwd))


def _stream_stalls(seg: Segments, i, j, ctx: StageContext):
    """A streamed stage's (forward, backward) stall per microbatch: the module docstring's formulas."""
    # on a CPU "device" the gradients are added to the host accumulators as they are made: the host's sums
    grads_out = not ctx.host_is_device
    t, pf, pb, tc = seg.stream_stalls(
        ctx.host_device_bw, recompute=ctx.recompute, grads_out=grads_out, weight_copy_bytes=ctx.weight_copy_bytes
    )
    total = tc[j] - tc[i]
    if ctx.stream_window == 0:
        return total, total + grads_out * total
    return t[i] + pf[j - 1] - pf[i], t[j - 1] + pb[j] - pb[np.minimum(i + 1, seg.n)] + grads_out * total


def _stream_reduce_s(seg: Segments, i, j, ctx: StageContext):
    """A streamed stage's data-parallel traffic per batch (s): (allreduce_s, exposed_s).

    As the runtime does it (run/build.py, comm.GradReducer fed by ``WeightStream.on_grad``): each layer is a bucket of
    its float32 host gradient sums (whatever the versions' dtype), all-reduced over a gloo group of the stage's
    replicas, started once the batch's last microbatch has added that layer's gradients (reported when the stream
    hands over the next layer's: a layer late; the first layer's at the backward's end), the buckets in order on the
    group; the training thread waits for all of them at the step (CLOSE or APPLY(t), right after that backward, before
    the host step is handed over), so they overlap only the last microbatch's backward and are not hidden behind the
    host step or the next batch. Ring all-reduce: ``2 (w-1)/w`` of a bucket's bytes each way and ``2 (w-1)`` latencies,
    at the slower of the replicas' link and the host's gloo figure. On a CPU the host is the device: it all adds.
    """
    w = ctx.data_parallel
    # the host's part (gloo's copies and sums) slower where a node's ranks outnumber its cores, as its other work
    bw, lat = min(ctx.replica_link.bandwidth, ctx.host_reduce_bw / ctx.host_share), ctx.replica_link.latency
    if bw == math.inf:
        z = np.zeros(np.broadcast(np.asarray(i), np.asarray(j)).shape)
        return z, z
    pa, exp = seg.reduce_exposed(2 * (w - 1) / w / bw, 2 * (w - 1) * lat, recompute=ctx.recompute)
    total = pa[j] - pa[i]
    return total, total if ctx.host_is_device else exp[i, j]


def _replicas_s(seg: Segments, i, j, ctx: StageContext, *, W, bwd, microbatch, ws: int, wc: float, K: int):
    """(allreduce_s, exposed_s) of a stage's replicas: a streamed stage's host all-reduce, else the devices'."""
    if ctx.stream and ctx.data_parallel > 1:
        return _stream_reduce_s(seg, i, j, ctx)
    return _data_parallel_s(ctx, W, bwd, microbatch, ws=ws, wc=wc, K=K)


def _data_parallel_s(ctx: StageContext, W, bwd, microbatch, *, ws: int, wc: float, K: int):
    """A stage's data-parallel traffic per batch (s): the all-reduce (or reduce-scatter and all-gather) of
    its ``W`` bytes of float32 gradients, and what of it the batch does not hide.

    Returns:
        (allreduce_s, exposed_s).
    """
    # optim.sharded: a reduce-scatter of the float32 gradient and an all-gather of the new weights (their
    # stored dtype) move what an all-reduce would; under 2bw both travel while the next batch runs
    # (APPLY(t) is deferred), under flush/gpipe the reduce-scatter overlaps the last backward, the
    # all-gather is exposed. The shards' step is 1/w of the whole.
    w = ctx.data_parallel
    # on a CPU the replicas all-reduce over gloo on this host: at most its measured figure (as a streamed stage's)
    bw = min(ctx.replica_link.bandwidth, ctx.host_reduce_bw / ctx.host_share if ctx.host_is_device else math.inf)
    if w > 1 and bw != math.inf:
        one_way, latency = (w - 1) / w / bw, 2 * (w - 1) * ctx.replica_link.latency
    else:
        one_way, latency = 0.0, 0.0
    allreduce = (1 + (wc if ws > 1 else 1)) * one_way * W + latency
    if ctx.host_is_device and ctx.host_free_cores < 1:
        # a CPU whose ranks' compute leaves no core free: gloo's threads take turns with compute on the ranks' cores,
        # and a bucket (pipeline.bucket_mb) starts only once its last gradient is final (a stage of one bucket: at
        # the backward's end), so nothing of it is hidden (issue 42: bench_stream --data-parallel 2)
        exposed = allreduce
    elif ws > 1 and ctx.schedule == "2bw":
        exposed = np.maximum(0.0, allreduce - K * microbatch)
    elif ws > 1:
        exposed = np.maximum(0.0, one_way * W - bwd) + wc * one_way * W + latency / 2
    else:
        exposed = np.maximum(0.0, allreduce - bwd)  # it overlaps the batch's last backward
    return allreduce, exposed


def _weight_state(seg: Segments, i, j, ctx: StageContext, *, ws: int, wc: float):
    """A stage's device bytes of weights, gradients and optimizer state, its host bytes of them and its step (s).

    Returns:
        (weights, gradients, optimizer, host, step_s).
    """
    W = seg.total("W", i, j, ctx.held)
    step = seg.total("S", i, j, ctx.held) / ws
    # float32 masters of their own where the versions are not them (sharded, or in the compute dtype): counted
    # with the optimizer state, which owns them
    master = W / ws if (ws > 1 or ctx.weight_copy_bytes != 4) else 0.0 * W
    weights, gradients = weight_copies(ctx) * W * wc, W + (W / ws if ctx.waits else 0.0)
    optimizer = seg.total("O", i, j, ctx.held) / ws + master
    # a stage whose optimizer is on the host runs no step on the device: its step (s) here is the link's part
    if ctx.stream:  # on the host (``stream.host_bytes_model``): per version its weights and a float32 gradient
        # accumulator, the optimizer state and, for compute-dtype versions, the float32 masters (in ``optimizer``)
        dev, maxw = seg.stream_device(ctx.stream_window, ctx.weight_copy_bytes)
        host = weights + num_versions(ctx.schedule) * W + optimizer
        # w > 1: each layer's float32 sums flattened for the replicas' all-reduce (comm.BatchReduction), pageable
        # host memory beside the accumulators until the step
        host = host + (W if ctx.data_parallel > 1 else 0.0)
        return dev[i, j] - maxw[i, j], maxw[i, j], np.zeros_like(W), host, np.zeros_like(W)
    if ctx.host_optimizer:  # host_optim.py: the masters and state on the host; at the step the float32 gradients go
        # out and the new weights (in the versions' dtype) come in
        return weights, gradients, np.zeros_like(W), optimizer + W, (1 + wc) * W / ctx.host_device_bw
    return weights, gradients, optimizer, np.zeros_like(W), step + _cpu_copies_s(ctx, W, ws=ws, wc=wc)


def _cpu_copies_s(ctx: StageContext, W, *, ws: int, wc: float):
    """A CPU stage's copies of its weights' bytes on the training thread beside the optimizer's step (s per batch),
    as ``WeightVersions.step`` and ``comm.BatchReduction`` make them: the gradients scaled by 1/(m w) (a pass that
    reads and writes them, as a copy), under 2bw W(t) copied into the replica the step writes W(t+1) in, and w > 1
    each bucket's gradients flattened for the all-reduce. On a GPU they run at the device's memory bandwidth (not
    charged); sharded or compute-dtype versions (``sharding.ShardedVersions``) copy otherwise: not charged either."""
    if not ctx.host_is_device or ws > 1 or wc != 1:
        return 0.0 * W
    copies = 1 + (ctx.schedule == "2bw") + (ctx.data_parallel > 1)
    return copies * W * ctx.host_share / ctx.host_copy_bw


RESOURCES = ("compute", "copy", "host")  # what bounds a stage's batch: segment_costs' ``bound`` indexes it


def _host_work(seg: Segments, i, j, ctx: StageContext):
    """The host's seconds per batch for a stage whose optimizer steps there: (its optimizer step, its sums of a
    streamed stage's gradients over the microbatches), slower by ``host_share`` where ranks outnumber cores.

    The step reads the gradient and reads and writes the weights and the optimizer state (AdamW: 28 B a parameter)
    at the host's measured step bandwidth; the sums copy the first microbatch's gradients and add the others'
    (reading two buffers, writing one: 1.5 copies) at its copy bandwidth.
    """
    W, wc = seg.total("W", i, j, ctx.held), ctx.weight_copy_bytes / 4
    if not (ctx.stream or ctx.host_optimizer):
        return np.zeros_like(W), np.zeros_like(W)
    # compute-dtype versions: the step also rounds the new float32 masters into W(t+1)'s replica (reads W, writes wc W)
    rounding = (1 + wc) * W if wc != 1 else 0 * W
    step = (3 * W + 2 * seg.total("O", i, j, ctx.held) + rounding) * ctx.host_share / ctx.host_step_bw
    if ctx.stream and wc == 1:  # float32 versions: W(t) is first copied into the replica the step writes W(t+1) in
        step = step + W * ctx.host_share / ctx.host_copy_bw
    # sums into float32 accumulators of gradients in the versions' dtype: the first cast (reads wc W, writes W), the
    # others added (read W and wc W, write W), in copies of W (a copy reads and writes it: 2 W): 1 and 1.5 in float32
    first, add = (1 + wc) / 2, (2 + wc) / 2
    # w > 1: the all-reduce's flattening of each layer's sums (one copy, on the training thread: comm.BatchReduction)
    flat = 1 if ctx.data_parallel > 1 else 0
    sums = (first + add * (ctx.num_microbatches - 1) + flat) * W * ctx.host_share / ctx.host_copy_bw
    return step, sums if ctx.stream else 0 * W


def _batch_s(ctx: StageContext, *, device, copy, host_step, host_sum, link_step, stalled=0.0):
    """A stage's seconds per batch from its three resources (the module docstring), and the step's part on the
    training thread (what the simulator's STEP action takes).

    Args:
        device: the device's time: K microbatches with their stalls, and the exposed data-parallel traffic.
        copy: the link's busy time (each direction apart, the busier one).
        host_step, host_sum: ``_host_work``'s.
        link_step: the host optimizer's copies at the step (gradients out, new weights in).
        stalled: the part of ``device`` that compute waits for copies (a CPU with no core free: the copies run then).

    Returns:
        (batch_s, step_s, bound): ``bound`` indexes ``RESOURCES``.
    """
    shared = ctx.host_free_cores < 1  # no core free of the ranks' compute: the host's work takes turns with it
    if ctx.host_is_device:  # one set of cores: the sums run inline in the backward, the step after the batch
        step = link_step + host_step
        # no core free: the copies (worker threads' memcpys) take turns with compute too, running while it stalls
        cpu = np.maximum(device, device - stalled + copy) if shared else device
        batch = cpu + host_sum + step
    elif host_step_overlaps(ctx) and not shared:  # the training thread hands the step of batch t over to a core of
        # its own; it has batch t+1 to run
        step = link_step / 2
        batch = np.maximum(np.maximum(device, host_sum) + step, host_step + link_step / 2)
    else:
        step = link_step + host_step
        batch = np.maximum(device, host_sum) + step
    batch = np.maximum(batch, copy)
    busy = np.stack(np.broadcast_arrays(device, copy, host_step + host_sum))
    return batch, step, busy.argmax(axis=0).astype(np.float64)


def _batch_times(seg: Segments, i, j, ctx: StageContext, moved, *, device, link_step, stalled) -> Dict[str, np.ndarray]:
    """A stage's per-batch times from ``device`` (its K microbatches and exposed traffic) and the step: ``_batch_s``'s
    three resources where its optimizer steps on the host, else the device's batch and its step (``link_step``)."""
    host_step, host_sum = _host_work(seg, i, j, ctx)
    copy = _copy_s(seg, i, j, ctx, moved)
    if ctx.stream or ctx.host_optimizer:
        batch, step, bound = _batch_s(
            ctx, device=device, copy=copy, host_step=host_step, host_sum=host_sum, link_step=link_step, stalled=stalled
        )
        floor = batch  # the host's work and the link beside the simulator's events
    else:
        batch, step = device + link_step, link_step
        bound, floor = np.where(copy > batch, 1.0, 0.0), 0 * batch
    return dict(step_s=step, host_step_s=host_step, host_sum_s=host_sum, bound=bound, batch_s=batch, floor_s=floor)


def _copy_s(seg: Segments, i, j, ctx: StageContext, moved):
    """The link's busy seconds per batch in its busier direction: per microbatch the swapped activations (each way)
    and a streamed stage's weights (in: the forward's and the backward's copies) and gradients (out); at the step,
    the host optimizer's gradients out and new weights in."""
    W, m, bw, wc = seg.total("W", i, j, ctx.held), ctx.num_microbatches, ctx.host_device_bw, ctx.weight_copy_bytes / 4
    if ctx.stream:  # the weights and their gradients in the versions' dtype
        weights_in, grads_out = 2 * m * wc * W / bw, m * wc * W / bw
    elif ctx.host_optimizer:  # the float32 gradients out, the new weights in
        weights_in, grads_out = wc * W / bw, W / bw
    else:
        weights_in = grads_out = 0 * W
    return m * moved / bw + np.maximum(weights_in, grads_out)


@functools.lru_cache(maxsize=256)
def live_at_step(schedule: str, stage_index: int, num_stages: int, num_microbatches: int, forward_lead: int = 0) -> int:
    """Microbatches stage s holds forwarded and not yet through their backward when it steps, in the steady state
    (its second step of three batches): under 2bw ``in_flight`` - 1 of the next batch's (no flush: their activations
    lie under the step's transients), none under the flushing schedules. A V schedule's chunks step at the end of
    their batch: none."""
    if schedule in V_SCHEDULES:
        return 0
    actions = stage_actions(
        schedule,
        stage_index=stage_index,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        num_batches=3,
        forward_lead=forward_lead,
    )
    release = WEIGHT if any(a.kind == WEIGHT for a in actions) else BACKWARD
    live, at_steps = 0, []
    for a in actions:
        live += 1 if a.kind == FORWARD else -1 if a.kind == release else 0
        if a.kind == STEP:
            at_steps.append(live)
    return at_steps[1]


def _step_transient(seg: Segments, i, j, ctx: StageContext, *, ws: int):
    """The step's transient bytes on the device (``pipedream2bw.memory.step_memory``): the largest one tensor's
    temporaries + the multi-tensor temporary and, under 2bw, the delay correction's copy over the parameters one
    optimizer steps at once (a gradient bucket's where w > 1: an optimizer per bucket; a shard's, sharded). A stage
    whose optimizer is on the host (streamed, or swap.optimizer=host) steps there: none on the device."""
    group = seg.total("SG", i, j, ctx.held) + (seg.total("SC", i, j, ctx.held) if ctx.schedule == "2bw" else 0.0)
    if ctx.data_parallel > 1:
        group = np.minimum(group, ctx.bucket_bytes)
    # the rank's other chunk (held) steps with this one: its largest tensor's temporaries are counted there
    largest = seg.SMAX[i, j] - max((seg.SMAX[a, b] for a, b in ctx.held), default=0.0)
    out = np.maximum(largest, 0.0) + group / ws
    return 0.0 * out if (ctx.stream or ctx.host_optimizer) else out


def segment_costs(seg: Segments, i, j, ctx: StageContext) -> Dict[str, np.ndarray]:
    """Memory (bytes) and time (s) of the stage holding layers ``[i, j)``; ``i``/``j`` may be arrays.

    Keys: weights, gradients, optimizer, activations, buffers, workspace, runtime, memory (their
    sum); forward_s, backward_s, send_s, send_grad_s, stall_s (per microbatch: swapping's and streaming's),
    stream_s and stream_fwd_s (streaming's part, and its forward's), microbatch_s (their sum), host_bytes (what
    the stage keeps in host memory: swapped activations, a streamed stage's weights and state); step_s (the step's
    part on the training thread), host_step_s and host_sum_s (the host's optimizer step and sums of gradients),
    allreduce_s, exposed_s (per batch: data-parallel traffic, what is not hidden), batch_s (the stage's time
    per batch), bound (its busiest resource, an index into ``RESOURCES``), floor_s (what ``simulate`` adds); split_s
    and split_share (zb1p, zbv: the split backward's cost of one, in backward_s at the share that runs split) and
    input_s (a split backward's B); and
    act_per_microbatch, act_moved (its bytes that go to host when swapping), act_extra (for the
    simulator's own in-flight count).
    """
    i, j = np.asarray(i), np.asarray(j)
    s, d, m, w = ctx.stage_index, ctx.num_stages, ctx.num_microbatches, ctx.data_parallel
    out_b = np.where(j == seg.n, 0.0, seg.OUT[j])  # the last stage sends nothing on
    in_b = seg.IN[i]
    W, F = seg.total("W", i, j, ctx.held), seg.F[j] - seg.F[i]
    A = seg.A[j] - seg.A[i] + out_b  # the runtime's stash keeps the output until its backward
    n = in_flight(ctx.schedule, s, d, m, forward_lead=ctx.forward_lead)
    if ctx.recompute:
        per_mb, extra = in_b + out_b, A  # keep inputs; one microbatch's activations while it is recomputed
    else:
        per_mb, extra = A, np.zeros_like(A)
    fwd, (bwd, split) = F, split_backward_s(seg, i, j, ctx, recomputed=F if ctx.recompute else 0.0)
    swapped = ctx.swap and n > ctx.swap_resident + 1  # as the runtime decides (run/build.py: swap_manager)
    kept = np.minimum(per_mb, in_b + out_b)  # the stash holds each microbatch's input and output: never swapped
    moved = per_mb - kept if swapped else np.zeros_like(per_mb)
    resident = min(n, ctx.swap_resident + 1) if swapped else n  # the microbatch computing + K waiting
    stall = (
        _swap_stall(moved / ctx.host_device_bw, fwd, bwd, schedule=ctx.schedule, resident=ctx.swap_resident)
        if swapped
        else np.zeros_like(F)
    )
    stream_fwd, stream_bwd = _stream_stalls(seg, i, j, ctx) if ctx.stream else (np.zeros_like(F),) * 2
    stall = stall + stream_fwd + stream_bwd
    send = _xfer(ctx.link_next, out_b)
    send_grad = _xfer(ctx.link_prev, np.where(s == 0, 0.0, in_b))
    microbatch = fwd + bwd + send + send_grad + stall
    ws = w if ctx.sharded and w > 1 and not ctx.stream else 1  # a streamed stage ignores optim.sharded (validate.py)
    wc, K = ctx.weight_copy_bytes / 4, batch_multiplier(ctx.schedule, d, m)
    allreduce, exposed = _replicas_s(seg, i, j, ctx, W=W, bwd=bwd, microbatch=microbatch, ws=ws, wc=wc, K=K)
    weights, gradients, optimizer, host, step = _weight_state(seg, i, j, ctx, ws=ws, wc=wc)
    host = host + (n - resident) * moved
    times = _batch_times(seg, i, j, ctx, moved, device=K * microbatch + exposed, link_step=step, stalled=K * stall)
    out = dict(
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=resident * per_mb + (n - resident) * (per_mb - moved) + extra,
        # w > 1: a bucket flattened beside its gradients (a streamed stage's on the host: ``host_bytes``)
        buffers=2 * (in_b + out_b) + (np.minimum(W, ctx.bucket_bytes) if w > 1 and not ctx.stream else 0.0),
        workspace=seg.RMAX[i, j],
        runtime=np.full(W.shape, float(ctx.runtime_bytes)),
        forward_s=fwd,
        backward_s=bwd,
        **split,  # split_s (per backward that runs split; ``split_share`` of them do) and a split B's input_s
        send_s=send,
        send_grad_s=send_grad,
        stall_s=stall,
        stream_fwd_s=stream_fwd,
        stream_s=stream_fwd + stream_bwd,
        host_bytes=host,
        microbatch_s=microbatch,
        allreduce_s=allreduce,
        exposed_s=exposed,
        **times,
        act_per_microbatch=per_mb,
        act_moved=moved,
        act_extra=extra,
        step=_step_transient(seg, i, j, ctx, ws=ws),
    )
    # at the step: the microbatches still in flight (2bw: the next batch's) under the step's transients
    live = live_at_step(ctx.schedule, s, d, m, ctx.forward_lead)
    kept_at_step = min(live, ctx.swap_resident + 1) if swapped else live
    out["step_activations"] = kept_at_step * per_mb + (live - kept_at_step) * (per_mb - moved)
    return _with_peak(out)


STEADY_PARTS = ("weights", "gradients", "optimizer", "activations", "buffers", "workspace", "runtime")
MEMORY_PARTS = STEADY_PARTS + ("step",)  # step: the optimizer step's transients, the last part of the step's peak


def _with_peak(out: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """``out`` with its peak: ``memory``, the larger of the steady state's (``STEADY_PARTS``: the backward's
    workspace over the microbatches in flight) and the step's (``step_memory``: the weight state, buffers and
    runtime, the microbatches still in flight at the step and the step's transients)."""
    out["steady_memory"] = sum(out[k] for k in STEADY_PARTS)
    at_step = ("weights", "gradients", "optimizer", "buffers", "runtime", "step_activations", "step")
    out["step_memory"] = sum(out[k] for k in at_step)
    out["memory"] = np.maximum(out["steady_memory"], out["step_memory"])
    return out


@dataclass(frozen=True)
class StageCost:
    """One stage of a plan: its layers, time and memory (scalars from ``segment_costs``)."""

    start: int
    stop: int
    ctx: StageContext
    values: Dict[str, float] = field(default_factory=dict)

    @staticmethod
    def of(seg: Segments, start: int, stop: int, ctx: StageContext) -> "StageCost":
        return StageCost(start, stop, ctx, {k: float(v) for k, v in segment_costs(seg, start, stop, ctx).items()})

    def __getitem__(self, key: str) -> float:
        return self.values[key]

    def memory_with(self, live: int) -> float:
        """Peak memory with ``live`` microbatches in flight (the simulator's count)."""
        return max(self.steady_with(live), self["step_memory"])

    def steady_with(self, live: int) -> float:
        """The steady state's memory with ``live`` microbatches in flight (``memory_with`` without the step's)."""
        resident = min(live, self.ctx.swap_resident + 1) if self["act_moved"] else live
        static = self["steady_memory"] - self["activations"]
        return static + live * self["act_per_microbatch"] - (live - resident) * self["act_moved"] + self["act_extra"]


@dataclass(frozen=True)
class SimResult:
    batch_time_s: float  # steady-state time per batch (what rank 0's samples/s measures)
    peak_memory_bytes: List[float]
    peak_in_flight: List[int]
    busy_s: float  # compute seconds per batch over all ranks (cores share them on a CPU)


def simulate(
    stages: Sequence[StageCost],
    *,
    schedule: str,
    num_microbatches: int,
    data_parallel: int = 1,
    num_batches: int = 5,
    cores: Optional[int] = None,
    forward_lead: int = 0,
) -> SimResult:
    """Runs every stage's ``stage_actions`` list against its costs, event by event, with the
    runtime schedule's own dependency rule (``schedule.timings``).

    F k on stage s starts when s is free and F k on s-1 has finished (its send included);
    B k likewise waits for B k on s+1; S t takes the step plus the exposed all-reduce. Under zb1p B k
    (the input's gradient, sent on) takes ``input_s`` (profiled; half the backward with analytic costs; nothing on
    the first stage, whose W k runs the whole backward) and W k the rest with the split's cost. Under zbv ``stages``
    are the 2d chunks (rank r runs r and 2d-1-r; its S steps both), and the memory and in-flight lists are per
    chunk. The
    batch time is the steady-state spacing of stage 0's steps (rank 0 measures there). With
    ``cores`` (ranks sharing CPU cores), the batch takes at least the ranks' total compute
    divided by the cores.
    """
    m = num_microbatches
    d = len(stages) // 2 if schedule in V_SCHEDULES else len(stages)
    lists = pipeline_actions(
        schedule, num_stages=d, num_microbatches=m, num_batches=num_batches, forward_lead=forward_lead
    )

    # zbv: chunk d's B's that run the whole backward (W k follows at once): no W of their own, no split's cost
    whole = whole_set(schedule, lists)

    def duration(a) -> float:
        st = stages[a.stage_index]
        if a.kind == FORWARD:
            return st["forward_s"] + st["send_s"] + st["stream_fwd_s"]
        if a.kind == STEP:
            return sum(stages[v]["step_s"] + stages[v]["exposed_s"] for v in chunks(schedule, a.stage_index, d))
        # the backward without the split's cost (``segment_costs`` charges its share), which W k pays where B k runs
        # split: its second autograd pass
        base = st["backward_s"] - st.values.get("split_share", 0.0) * st.values.get("split_s", 0.0)
        runs_whole = schedule not in SPLIT_SCHEDULES or (a.stage_index, a.index) in whole
        # a split B: the input's gradient (profiled), none on the first stage or chunk (token ids need none: W runs
        # the whole backward)
        first = a.stage_index == 0
        b = base if runs_whole else 0.0 if first else min(base, st.values.get("input_s", base / 2))
        if a.kind == WEIGHT:
            return 0.0 if runs_whole else base - b + st.values.get("split_s", 0.0)  # none charged on the first
        return b + st["send_grad_s"] + st["stall_s"] - st["stream_fwd_s"]

    times = timings(lists, duration)
    step_end = [end for a, (_, end) in zip(lists[0], times[0]) if a.kind == STEP]
    peak = [max_in_flight(stage) for stage in lists]
    if schedule in V_SCHEDULES:  # per chunk
        peak = [max_in_flight([a for rank in lists for a in rank if a.stage_index == v]) for v in range(2 * d)]
    if len(step_end) >= 3:
        batch = (step_end[-1] - step_end[1]) / (len(step_end) - 2)
    else:
        batch = step_end[-1] / len(step_end)
    # the host's work and the link beside the training thread's actions (a host stage's resources, ``_batch_s``)
    batch = max(batch, *(st["floor_s"] for st in stages))
    busy = data_parallel * sum(m * (st["forward_s"] + st["backward_s"]) + st["step_s"] for st in stages)
    if cores:
        batch = max(batch, busy / cores)
    return SimResult(batch, [st.memory_with(p) for st, p in zip(stages, peak)], peak, busy)
