"""The stage worker: runs one rank's action list with p2p transfers, weight versions and the loss."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from pipedream2bw.data import MicrobatchFeed
from pipedream2bw.io.timeline import Recorder
from pipedream2bw.memory.memprobe import SavedBytes, process_peak_bytes
from pipedream2bw.memory.precision import autocast, compute_dtype
from pipedream2bw.memory.sharding import ShardedVersions
from pipedream2bw.memory.stream import WeightStream
from pipedream2bw.memory.swap import SwapManager
from pipedream2bw.pipeline import agreement, split_backward, stateful
from pipedream2bw.pipeline.agreement import NonFiniteError, StepDecision, StepOutcome, StepRule
from pipedream2bw.pipeline.boundary import Channel, from_wire, to_device, to_wire
from pipedream2bw.pipeline.comm import P2P, AsyncSum, BatchReduction, GradReducer, ShardedReduction
from pipedream2bw.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    FREE,
    HOLD,
    RECV,
    SEND,
    SPLIT_SCHEDULES,
    STEP,
    WAIT,
    WEIGHT,
    Action,
    comm_op,
    render_steps,
    steps,
)
from pipedream2bw.pipeline.versions import WeightVersions
from pipedream2bw.run import chunks as v_chunks

log = logging.getLogger(__name__)

ACTIVATION_TAG, GRADIENT_TAG = 0, 1  # the two boundary.Channels of training's p2p
_LOG_CONTEXT_STEPS = 8  # a failure logs this many of the rank's steps either side of the failing one


def _leaves(tree: Any) -> List[torch.Tensor]:
    """``pytree.tree_leaves(tree)``, without its 8 Python calls for the usual stage boundary, one tensor (issue 47)."""
    return [tree] if isinstance(tree, torch.Tensor) else pytree.tree_leaves(tree)


@dataclass(frozen=True)
class Peers:
    """Ranks a stage talks to: ``prev``/``next`` in its replica's chain (None at the ends), and
    on rank 0 only, ``loss_sources``: the last stage of every replica, whose losses it logs."""

    prev: Optional[int]
    next: Optional[int]
    loss_sources: Tuple[int, ...] = ()
    sends_loss: bool = True
    """False on a last stage's tensor ranks > 0: their tensor rank 0 reports the same loss."""


@dataclass
class StageStats:
    """What one stage measured; rank 0 gathers these into summary.json."""

    stage_index: int
    rank: int
    replica: int = 0
    allreduce_calls: int = 0  # gradient all-reduce collectives started (one per bucket per batch)
    allreduce_exposed_s: float = 0.0  # time the optimizer step waited on them: not hidden behind backward
    start_time: float = 0.0
    step_end_times: List[float] = field(default_factory=list)
    start_cpu: float = 0.0  # process CPU seconds (all threads) at start_time and at each step end: work, not waits
    step_end_cpu: List[float] = field(default_factory=list)
    losses: List[float] = field(default_factory=list)  # batch mean loss; filled on rank 0
    lrs: List[float] = field(default_factory=list)  # learning rate of each step; filled on rank 0
    # agreed global gradient norm (None: not agreed); rank 0
    grad_norms: List[Optional[float]] = field(default_factory=list)
    skipped_steps: List[int] = field(default_factory=list)  # steps skipped everywhere for a non-finite loss or gradient
    agreement_exposed_s: float = 0.0  # time APPLY waited for the step agreement: not hidden behind other work
    allgather_exposed_s: float = 0.0  # optim.sharded: time forwards and steps waited for the weights' all-gather
    host_step_s: float = 0.0  # seconds the host optimizer steps ran (on their thread, or synchronously on this one)
    host_step_wait_s: float = 0.0  # ... and seconds training waited for them (the part not hidden)
    host_step_cpu_s: float = 0.0  # ... and seconds they ran on a core (the thread's CPU time; the rest it waited)
    peak_stash_bytes: int = 0  # activations autograd saves for one microbatch x most microbatches in flight
    peak_in_flight: int = 0  # most microbatches forwarded and not yet through their backward (zb1p: their W)
    weight_bytes: int = 0  # all weight versions held
    optimizer_state_bytes: int = 0
    peak_memory_bytes: int = 0  # CUDA: max allocated; CPU: process peak resident set
    p2p_wait_s: float = 0.0  # time spent waiting for activations and gradients from neighbours
    peak_pending_sends: int = 0  # most sends whose tensors were held at once (bounded by the in-flight count)
    checkpoint_s: float = 0.0  # time training waited for checkpoint copies (the writes run beside it)
    eval_s: float = 0.0  # time in validation passes (train.eval_every), compute and waits
    # token-file pages mapped in this rank at the end; None: no token file opened
    data_resident_bytes: Optional[int] = None
    trace: Optional[dict] = None  # pipeline.trace: {"spans": [timeline.Span], "window": [start, end]}
    swap: Optional[Dict[str, Any]] = None  # SwapStats of a stage that swaps activations to host
    stream: Optional[Dict[str, Any]] = None  # stream.StreamStats of a stage that streams its weights (swap.weights)
    loss_scales: List[float] = field(default_factory=list)  # fp16: the loss scale each batch ran with


class StageWorker:
    """Runs the actions of stage ``stage_index`` of ``num_stages`` on this rank.

    F k: take microbatch k's input (from the feed on stage 0, else from stage s-1), run the
    stage with the weight version of k's batch, send the output on (or compute the loss on
    the last stage) and stash what backward needs. B k: backward with the gradient from
    stage s+1 (or of the loss) and send the input's gradient to stage s-1. S t: the optimizer
    step that closes batch t, on the mean gradient of its m microbatches on all w replicas.
    The transfers are actions of their own in the list (``schedule.lower``: RECV, WAIT, FREE,
    SEND, HOLD), which the worker runs as they come, deciding nothing about communication.

    A step is two halves (docs/design.md section 7). CLOSE(t), at the S action: start what batch t's
    step needs from the other stages (``exchanges``' ``start(t)``, then, when ``step_rule``
    needs an agreement, this rank's share of the global gradient norm and non-finite flags,
    summed over all ranks by ``agreement`` in the background). APPLY(t): ``exchanges``'
    ``finish(t)``, wait for the agreement, let ``step_rule`` decide (clip, skip or stop), set
    the learning rate ``lr_at(t)`` and step the weights. Under flush and gpipe, and under 2bw
    with nothing to agree on, APPLY follows CLOSE at once. Under 2bw with an agreement or an
    exchange on any stage (``steps_wait_on_others``), APPLY(t) waits until W(t+1) is needed
    (``agreement.apply_due``: before the first forward of batch t+2 or the next S, whichever
    comes first), so the agreement travels while
    batch t+1 runs and costs no flush (except after the first batch, which shares W(0) and its
    gradient buffers with the second). ``on_step(t)`` (checkpoints, logging) runs after APPLY(t).

    ``exchanges``: objects with ``start(t)`` and ``finish(t)``, for other transfers that must be
    done before batch t's step on this stage (e.g. the gradient sum of a weight tied across
    stages). ``start(t)`` runs at CLOSE(t) after the data-parallel all-reduce, before this
    rank's share of the norm is computed; ``finish(t)`` at APPLY(t) before the step. With
    clipping, ``finish(t)`` runs at CLOSE(t) instead, as the norm needs the exchanged gradients
    (a wait there, not deferred); an exchange's ``norm_excluded`` parameter indices (e.g. tied
    copies whose norm another stage counts) stay out of this rank's share.
    """

    def __init__(
        self,
        *,
        stage_index: int,
        num_stages: int,
        num_microbatches: int,
        peers: Peers,
        versions: WeightVersions,
        p2p: P2P,
        feed: MicrobatchFeed,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        reducer: Optional[GradReducer] = None,
        grad_scale: float,
        swap: Optional[SwapManager] = None,
        replica: int = 0,
        step_rule: Optional[StepRule] = None,
        agreement: Optional[AsyncSum] = None,
        exchanges: Sequence[Any] = (),
        lr_at: Optional[Callable[[int], float]] = None,
        precision: str = "fp32",
        steps_wait_on_others: bool = False,
        early_apply: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        stream: Optional[WeightStream] = None,
        norm_excluded: Sequence[int] = (),
        chunks: Sequence[v_chunks.ChunkSpec] = (),
    ):
        self.m = num_microbatches
        self.norm_excluded = set(norm_excluded)  # parameter indices another rank counts in the norm (tensor_parallel)
        # Each layer draws from its own stream per microbatch (pipeline/stateful.py), whatever the schedule.
        self.seed, self.num_replicas = seed, num_replicas
        self._buffers = stateful.BufferWatch()  # the stage's buffers that training changes (BatchNorm statistics)
        self._batch_start_buffers: Dict[int, Dict[str, torch.Tensor]] = {}  # batch -> them before its first forward
        self.stage_index, self.num_stages, self.replica = stage_index, num_stages, replica
        self.rule = step_rule if step_rule is not None else StepRule()
        assert agreement is not None or not self.rule.needs_agreement, "this step rule needs an agreement channel"
        self.agreement, self.exchanges, self.lr_at = agreement, list(exchanges), lr_at
        self._plan_apply(versions, reducer, steps_wait_on_others=steps_wait_on_others, early_apply=early_apply)
        self._init_batch_state()
        self.first, self.last = stage_index == 0, stage_index == num_stages - 1
        self.peers, self.versions, self.p2p, self.feed = peers, versions, p2p, feed
        self.loss_fn, self.device, self.reducer, self.grad_scale = loss_fn, device, reducer, grad_scale
        self.stats = StageStats(stage_index, p2p.ctx.rank)
        self.swap, self.stream = swap, stream  # stream (swap.weights): the weights come from host memory layer by layer
        if stream is not None and reducer is not None:  # its gradients reach the host accumulators, not autograd's
            stream.on_grad = self._host_grad_ready
        # Reduced precision: forwards under autocast; activations and their gradients cross stages
        # in the compute dtype. fp16: the last stage's loss is multiplied by the step rule's loss
        # scale of its batch, and the rule (a ScaledStepRule) unscales and skips through the agreement.
        self.precision = precision
        self._wire_dtype = compute_dtype(precision)
        self._autocast = precision != "fp32"  # forwards under torch.autocast
        # Weights stored in the compute dtype (train.weight_dtype=compute) run the whole stage in it: a
        # received activation stays in the compute dtype (a float32 one would meet bf16 norm weights).
        self._upcast = precision != "fp32" and getattr(versions, "weight_dtype", torch.float32) == torch.float32
        # a streamed stage's compute-dtype versions: gradients summed in float32 (``main_grad``), float32 masters
        self._float32_sums = getattr(versions, "float32_masters", False)
        # X's tensors (F: activations, B: input gradients) come from one neighbour and go to the other.
        self._channel = {
            FORWARD: Channel(p2p, tag=ACTIVATION_TAG, what="a stage's output", device=device),
            BACKWARD: Channel(p2p, tag=GRADIENT_TAG, what="an input gradient", device=device),
        }
        self._stash: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # k -> (input, output or loss)
        # pipeline.schedule=zb1p: B k computes the input's gradient, W k the weights' from what B left here (k -> it)
        self.split = versions.schedule in SPLIT_SCHEDULES
        self._weight_work: Dict[int, split_backward.WeightWork] = {}
        self._graph_plans = split_backward.GraphPlans()  # B's graph analyses, by the graph's shape
        self._saved_bytes: Optional[int] = None  # what autograd saves for one microbatch
        self._batch_losses: Dict[int, List[torch.Tensor]] = {}
        self._posted: Dict[Tuple[str, int], List[tuple]] = {}  # RECV_X k's posted receives, by (X, k)
        self._received: Dict[Tuple[str, int], Any] = {}  # what WAIT_X k received, for F k or B k
        self._outbox: Dict[Tuple[str, int], Any] = {}  # what F k or B k produced, for SEND_X k or HOLD_X k
        self._param_ptrs = {p.untyped_storage().data_ptr() for r in versions.replicas for p in r.parameters()}
        self.trace: Optional[Recorder] = None  # set for pipeline.trace; spans are recorded while trace.on
        self._recv_from = {FORWARD: peers.prev, BACKWARD: peers.next}
        self._send_to = {FORWARD: peers.next, BACKWARD: peers.prev}
        v_chunks.attach(self, chunks, module=versions.replicas[0], tags=(ACTIVATION_TAG, GRADIENT_TAG))

    def _plan_apply(
        self, versions: WeightVersions, reducer: Optional[GradReducer], *, steps_wait_on_others: bool, early_apply: bool
    ) -> None:
        """Whether APPLY(t) is deferred (``self.deferred``) and, sharded, how many compute steps after CLOSE(t)."""
        # Under 2bw, APPLY(t) may wait for W(t+1)'s first use; elsewhere the flush comes first anyway. Every stage
        # defers when any rank's step waits on other stages (``steps_wait_on_others``: a weight tied across stages
        # that this stage may not hold), so on_step(t), and a validation pass in it, comes at the same point of
        # every stage's schedule; a stage that stepped at once while a holder deferred deadlocked in the pass.
        # optim.sharded: the reduce-scatter, the shard's step and the all-gather travel while batch t+1 runs.
        sharded = reducer is not None and reducer.num_shards > 1
        self.deferred = versions.schedule == "2bw" and (
            self.agreement is not None or bool(self.exchanges) or steps_wait_on_others or sharded
        )
        # Sharded, APPLY(t) need not wait for W(t+1)'s first use: it runs after this many compute steps past
        # CLOSE(t) (at the same step on every replica: the stage's collectives keep one order), so that the
        # all-gather of W(t+1) travels until batch t+2's first forward (ShardedVersions.module_for_batch).
        # One step lets the last bucket's reduce-scatter arrive; with an agreement or a tie exchange, which
        # complete when stage 0 closes t, 2 more per stage this one is past stage 0 (a 1F1B pair per hop).
        # Not with ``early_apply`` false: on_step(t) then holds a pass through the stages (validation, the tie
        # check), which must come at the same point of every stage's schedule (apply_due's).
        self._apply_after = None
        if sharded and self.deferred and early_apply:
            self._apply_after = 1 + (2 * self.stage_index if self.agreement is not None or self.exchanges else 0)

    def _init_batch_state(self) -> None:
        """The per-batch bookkeeping between a batch's CLOSE and its APPLY, empty."""
        self._loss_nonfinite: Dict[int, bool] = {}  # last stage: batch -> its loss was not finite
        self._losses_due: List[Tuple[torch.Tensor, int]] = []  # last stage: (batch t's mean loss, t), not reported yet
        # rank 0 as a last stage: batch -> its own loss, until APPLY(t) logs it (a deferred APPLY(t) runs after
        # batch t+1's forwards, which report that batch's loss)
        self._own_losses: Dict[int, float] = {}
        # Rank 0: batch -> its posted loss receives (P2P.post_loss). Batch t+1's are posted at APPLY(t), before
        # the last stages can have sent that loss: on gloo, posting a receive whose message has arrived waited
        # for the rendezvous (2-10 ms a step, which the tightly coupled 1F1B passed on to the last stage). A run
        # stopped after step t (preemption) leaves batch t+1's receive posted; shutting the group down drops it.
        self._loss_posts: Dict[int, List[tuple]] = {}
        self._last_batch = -1  # the last batch of the actions run
        # closed batch -> its data-parallel all-reduce, held until its APPLY: under 2bw batch t+1's last
        # backward arms the reducer again before a deferred APPLY(t) (one rule for every deferring feature)
        self._reductions: Dict[int, BatchReduction] = {}
        self._exchanged: Optional[int] = None  # batch whose exchanges have finished

    def _communicate(self, op: str, x: str, k: int) -> None:
        """Runs one lowered communication action ``OP_X k`` (schedule's module docstring); between two chunks
        of this rank (zbv), a hand-off: SEND leaves the tensors in ``_local``, WAIT takes them, RECV, FREE nothing."""
        if (self._recv_from if op in (RECV, WAIT) else self._send_to)[x] == v_chunks.LOCAL:
            if op == WAIT:
                self._received[(x, k)] = self._local.pop((x, k))
            elif op in (SEND, HOLD):
                self._local[(x, k)] = self._outbox.pop((x, k))
            return
        token = (self._chunk.index, k) if self._chunks else k  # zbv: two chunks send to one peer, two flows
        if op == RECV:
            self._posted[(x, k)] = self._channel[x].post_recv(self._recv_from[x])
        elif op == WAIT:
            self._received[(x, k)] = self._channel[x].wait_recv(self._posted.pop((x, k)), peer=self._recv_from[x])
        elif op == FREE:
            self.p2p.release(self._send_to[x], token[:1] + (k,) if self._chunks else k)
        else:
            start = time.perf_counter()
            self._channel[x].send(self._outbox.pop((x, k)), peer=self._send_to[x], defer=op == HOLD, token=token)
            self.stats.peak_pending_sends = max(self.stats.peak_pending_sends, self.p2p.pending_sends)
            if self.trace is not None and self.trace.on:
                self.trace.add("send", k, start, time.perf_counter())

    def forward(self, k: int) -> None:
        """F k: the stage on microbatch k's input (the feed's on stage 0, else what WAIT_F k received)
        with its batch's weight version; keeps the output for SEND_F k (the loss on the last stage)."""
        whole = self.versions.module_for_forward(k, self.m)  # its batch's version (weight_versions=newest: newest)
        module = v_chunks.part(whole, self._chunk, self._parts) if self._chunks else whole
        if self.stream is not None:
            replica = self.versions.replica_for_batch(k // self.m)
            self.stream.begin_forward(k, replica)
        if self.first:
            x = self._data(self.feed.inputs, k)
        else:
            x = self._received.pop((FORWARD, k))
            for leaf in _leaves(x):
                if leaf.is_floating_point():  # integer elements (masks, ids) carry no gradient
                    leaf.requires_grad_()
        # Shapes are fixed (P2P checks them), so what autograd saves is measured on the first
        # microbatch only, keeping the hooks' per-tensor Python calls off the hot path.
        saved = SavedBytes(self._param_ptrs) if self._saved_bytes is None else contextlib.nullcontext()
        if self.swap is not None:  # one pair of hooks applies at a time: the swap hooks chain SavedBytes'
            hooks = self.swap.forward(k, inputs=_leaves(x), outer=saved if self._saved_bytes is None else None)
        self._watch_buffers(whole, k)
        g = stateful.sample_microbatch(k, num_microbatches=self.m, num_replicas=self.num_replicas, replica=self.replica)
        with hooks if self.swap is not None else saved, stateful.microbatch_streams(self.seed, g, self.device):
            # A reduced-precision activation goes on in float32, as it would have in one process: only
            # the transfer is rounded, not the rest of the stage's residual stream.
            inp = from_wire(x, self._wire_dtype) if self._upcast else x
            # fp32: no context at all (torch.autocast(enabled=False) costs 28 Python calls a forward; the worker
            # never runs inside an autocast region it would have to turn off)
            with autocast(self.precision, self.device.type) if self._autocast else contextlib.nullcontext():
                out = module(inp) if self.stream is None else self.stream.forward(module, k, replica, inp)
            if self.last:  # the loss in float32, outside autocast
                out = self.loss_fn(out.float(), self._data(self.feed.targets, k))
            elif self.precision != "fp32":
                out = to_wire(out, self._wire_dtype)  # sent in the compute dtype; backward casts its gradient back
        if self._buffers.names is None:
            self._found_buffers(whole)
        if self._saved_bytes is None:
            self._saved_bytes = saved.nbytes
        if self.last:
            losses = self._batch_losses.setdefault(k // self.m, [])
            losses.append(out.detach())
            if len(losses) == self.m:  # the batch's losses are all known: reported after B's sends, not the step
                self._losses_due.append((torch.stack(self._batch_losses.pop(k // self.m)).mean(), k // self.m))
        else:
            self._outbox[(FORWARD, k)] = (
                out.detach() if isinstance(out, torch.Tensor) else pytree.tree_map(torch.Tensor.detach, out)
            )
        self._stash[k] = (x, out)
        self._note_held()

    def _note_held(self) -> None:
        """After a forward: the most microbatches held (zb1p: a microbatch's tensors stay until its W) and bytes."""
        held = len(self._stash) + len(self._weight_work)
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, held)
        held = held * self._saved_bytes if not self._chunks else v_chunks.held_bytes(self)  # zbv: both chunks'
        self.stats.peak_stash_bytes = max(self.stats.peak_stash_bytes, held)

    def _watch_buffers(self, module: torch.nn.Module, k: int) -> None:
        """Before F k: the first forward finds the buffers training changes; the first of each batch keeps them
        as they are, which a checkpoint of the batch's start saves (under 2bw, stage 0 runs batch t+1's
        first forwards before step t's checkpoint)."""
        self._buffers.before(module)
        if k % self.m == 0 and self._buffers.names:
            t = k // self.m  # on_step(t-1), which may come after batch t's first forwards, takes batch t's
            self._batch_start_buffers = {u: b for u, b in self._batch_start_buffers.items() if u >= t - 1}
            self._batch_start_buffers[t] = self._buffers.snapshot(module)

    def _found_buffers(self, module: torch.nn.Module) -> None:
        """After the first forward: which buffers it changed; under 2bw, says they are not versioned."""
        self._buffers.after(module)
        if self._buffers.names and self.versions.schedule == "2bw":
            log.warning(
                "buffers %s change in training and are not versioned under 2bw: both weight versions share "
                "them, updated by every forward in microbatch order (batch t+1's with W(t), not W(t+1))",
                ", ".join(self._buffers.names),
            )

    def buffers_at_start(self, t: int) -> Dict[str, torch.Tensor]:
        """The buffers training changes as they were before batch ``t``'s first forward on this stage; empty when
        that forward has not run yet (the buffers are those now) or when the stage has none."""
        return self._batch_start_buffers.get(t, {})

    def _host_grad_ready(self, k: int, replica: int, i: int) -> None:
        """A streamed stage (swap.weights): microbatch k's gradient of parameter i is in the host accumulator; the
        batch's last microbatch's makes it final, and the reducer starts a bucket once all of its are."""
        if (k + 1) % self.m == 0:
            self.reducer.gradient_ready(replica, i)

    def _before_backward(self, k: int) -> None:
        """Starts B k's step, before its receives: the swap prefetch overlaps the gradient's wait; ``_arm_reducer``."""
        if self.swap is not None:
            self.swap.begin_backward(k)
        if self.stream is not None:
            self.stream.begin_backward(k)
        for reduction in self._reductions.values():  # sharded: reduce-scatter inputs done with, freed here
            if isinstance(reduction, ShardedReduction):
                reduction.release_done()
        if (k + 1) % self.m == 0 and not self.split:  # zb1p: before the last W
            self._arm_reducer(k)

    def _arm_reducer(self, k: int) -> None:
        """Before the batch's last backward (B k): its gradients gathered (newest: two replicas') where it accumulates
        them, the replica the reducer (if any) all-reduces as that backward goes."""
        replica = self.versions.gather_gradients(k // self.m)
        if self.reducer is not None:
            self.reducer.arm(replica)

    def weight(self, k: int) -> None:
        """W k (zb1p): microbatch k's weight gradients from what B left (``split_backward``), or none (``whole``)."""
        if v_chunks.whole(self, k):
            return
        v_chunks.arm_at_w(self, k)
        split_backward.backward_weight(self._weight_work.pop(k))

    def backward(self, k: int) -> None:
        """B k: backward from the gradient WAIT_B k received (the loss's on the last stage); keeps the
        input's gradient for SEND_B k."""
        x, out = self._stash.pop(k)
        grad = None if self.last else self._received.pop((BACKWARD, k))
        if self.split:  # under zbv chunk d's B k runs the whole backward (its gradient stays on the rank), W k nothing
            if not v_chunks.whole(self, k):
                return self._backward_input(k, x, out, grad)
            v_chunks.arm_at_w(self, k)
        if self.last:
            scale = self.rule.loss_scale(k // self.m)
            (out * scale if scale != 1.0 else out).backward()
        else:
            # grad: one gradient per floating-point element of out, in order (see below)
            pairs = [
                (o, g) for o, g in zip((o for o in _leaves(out) if o.is_floating_point()), grad) if o.requires_grad
            ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if self.swap is not None:
            self.swap.end_backward(k)
        if self.stream is not None:
            self.stream.end_backward(k)
        if not self.first:
            inputs = [t for t in _leaves(x) if t.is_floating_point()]
            self._outbox[(BACKWARD, k)] = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]

    def _backward_input(self, k: int, x: Any, out: Any, grad: Optional[List[torch.Tensor]]) -> None:
        """B k under zb1p: only the input's gradient, for SEND_B k; what W k needs is kept (``split_backward``)."""
        if self.last:
            scale = self.rule.loss_scale(k // self.m)
            outputs, grads = [out * scale if scale != 1.0 else out], [None]
        else:  # as ``backward``: one gradient per floating-point element of out, those that need one
            pairs = [
                (o, g) for o, g in zip((o for o in _leaves(out) if o.is_floating_point()), grad) if o.requires_grad
            ]
            outputs, grads = [o for o, _ in pairs], [g for _, g in pairs]
        inputs = [t for t in _leaves(x) if t.is_floating_point()] if not self.first else []
        module = self.versions.module_for_batch(k // self.m)
        params = list((v_chunks.part(module, self._chunk, self._parts) if self._chunks else module).parameters())
        work = split_backward.backward_input(outputs, grads, inputs, params, plans=self._graph_plans)
        dinputs, self._weight_work[k] = work
        if not self.first:
            self._outbox[(BACKWARD, k)] = [g if g is not None else torch.zeros_like(t) for t, g in zip(inputs, dinputs)]

    def _data(self, read: Callable[[int], torch.Tensor], k: int) -> torch.Tensor:
        """Microbatch k's inputs or targets from the feed (a tensor, or a tuple of them for packed documents), on the
        device (a ``data`` span when tracing)."""
        if self.trace is None or not self.trace.on:
            return to_device(read(k), self.device)
        start = time.perf_counter()
        out = to_device(read(k), self.device)
        self.trace.add("data", k, start, time.perf_counter())
        return out

    def _report_losses(self) -> None:
        """A last stage: hand each batch t's mean loss its forwards completed to rank 0 (here, if this is rank 0) after
        the next backward's sends, before CLOSE(t) (the loss's isend, 0.2 ms on gloo, held back B's gradient).

        Raises:
            NonFiniteError: the loss is not finite and no agreement runs (train.on_nonfinite=stop
                without clipping); with one, the flag goes into batch t's agreement instead.
        """
        due, self._losses_due = self._losses_due, []
        for loss, t in due:
            finite = bool(torch.isfinite(loss))
            if not finite and self.agreement is None:
                raise NonFiniteError(
                    agreement.stop_message(f"non-finite loss ({float(loss)}) at step {t} on stage {self.stage_index}")
                )
            self._loss_nonfinite[t] = not finite
            if self.peers.loss_sources:
                self._own_losses[t] = float(loss)
            elif self.peers.sends_loss:
                self.p2p.send_loss(loss)

    def _post_losses(self, t: int) -> None:
        """Rank 0: posts the receives of batch t's losses from the other replicas' last stages, once."""
        if t not in self._loss_posts and t <= self._last_batch:
            self._loss_posts[t] = [
                self.p2p.post_loss(peer=r) for r in self.peers.loss_sources if r != self.p2p.ctx.rank
            ]

    def close(self, t: int) -> float:
        """CLOSE(t): batch t's backwards are done; start what its step needs from the other ranks.

        Returns:
            the time it started (the S span of an APPLY that follows at once starts there).
        """
        start = time.perf_counter()
        if self.stream is not None:  # a streamed stage's gradients may still be on their way to the host (GPU)
            self.stream.grads_landed()  # ... and the reducer hears of each as it lands, before it is taken
        if self.reducer is not None:
            self._reductions[t] = self.reducer.take()
        for exchange in self.exchanges:
            exchange.start(t)
        if self.agreement is not None:
            self._wait_reducer(t)  # the norm needs the gradients averaged across replicas
            # The norm (clipped by, or logged as the global norm) needs the summed gradients of weights
            # tied across stages, each counted once (on its first holder): the exchange is waited here.
            self._finish_exchanges(t)
            excluded = {i for exchange in self.exchanges for i in getattr(exchange, "norm_excluded", ())}
            excluded |= self.norm_excluded
            scale = self.grad_scale * self.rule.unscale(t)
            # each replica counts its shards, whole buckets on replica 0 (a streamed stage's float32 masters: alike)
            if isinstance(self.versions, ShardedVersions) or self._float32_sums:
                reduction = self._reductions.get(t)
                sq = self.versions.grad_sq_norm(
                    (lambda b: reduction.wait(b)) if reduction is not None else (lambda b: None),
                    t,
                    excluded=excluded,
                    count_whole=self.replica == 0,
                )
            else:
                params = [p for i, p in enumerate(self.versions.module_for_batch(t).parameters()) if i not in excluded]
                sq = agreement.sq_norm([p.grad for p in params if p.grad is not None])
            share = agreement.encode(
                stage_index=self.stage_index,
                num_stages=self.num_stages,
                sq=sq * scale**2,
                counts_norm=self.replica == 0 or isinstance(self.versions, ShardedVersions) or self._float32_sums,
                loss_nonfinite=self._loss_nonfinite.pop(t, False),
            )
            self.agreement.start(share, what=f"the step agreement of batch {t}")
        if self.deferred and self.trace is not None and self.trace.on:
            self.trace.add("S", t, start, time.perf_counter())
        return start

    def apply(self, t: int, *, since: Optional[float] = None) -> None:
        """APPLY(t): batch t's step, W(t+1) = W(t) - optimizer_step(g(t)), clipped, skipped or stopped
        as the step rule decides from the agreed outcome (``since``: when its CLOSE started, if just now).

        Raises:
            NonFiniteError: a non-finite loss or gradient under train.on_nonfinite=stop.
        """
        trace = self.trace if self.trace is not None and self.trace.on else None
        start = time.perf_counter() if since is None else since
        self._finish_exchanges(t)
        lr = self.lr_at(t) if self.lr_at is not None else None
        if lr is not None:
            self.versions.set_lr(lr)
        if self.precision == "fp16":
            self.stats.loss_scales.append(self.rule.loss_scale(t))
        outcome = self._agreed(t) if self.agreement is not None else None
        decision = self.rule.decide(outcome) if outcome is not None else StepDecision(skip=False)
        bucket_wait = self._bucket_wait(t)
        if self.stream is not None:  # the host gradients complete, no weight copy in flight: a step or skip may go
            self.stream.quiesce()
        if decision.skip:
            self.versions.skip(t)
            self.stats.skipped_steps.append(t)
            if self.p2p.ctx.rank == 0:
                # fp16's scaler skips on an overflow whatever train.on_nonfinite (which said "stop": the run went on)
                why = "fp16 loss scaling lowers its scale" if self.precision == "fp16" else None
                log.warning(
                    "%s: step skipped on every stage (%s)",
                    outcome.describe(),
                    why or f"train.on_nonfinite={self.rule.on_nonfinite}",
                )
        else:
            scale = self.grad_scale * self.rule.unscale(t) * decision.grad_multiplier
            self._step(t, scale, bucket_wait, check=outcome is None and self.rule.on_nonfinite == "stop")
        if trace is not None:
            trace.add("S", t, start, time.perf_counter())
        if self.peers.loss_sources:  # rank 0: the batch loss is the mean over the replicas' last stages
            start = time.perf_counter()
            posted = iter(self._loss_posts.pop(t))  # posted by run() (the first batch) or APPLY(t-1)
            self._post_losses(t + 1)
            losses = [
                self._own_losses.pop(t) if r == self.p2p.ctx.rank else self.p2p.take_loss(next(posted))
                for r in self.peers.loss_sources
            ]
            self.stats.losses.append(sum(losses) / len(losses))
            self.stats.lrs.append(lr if lr is not None else self.versions.optimizers[0].param_groups[0]["lr"])
            self.stats.grad_norms.append(None if outcome is None else outcome.grad_norm)
            if trace is not None:
                trace.add("loss", t, start, time.perf_counter())
        self.stats.step_end_times.append(time.perf_counter())
        self.stats.step_end_cpu.append(time.process_time())
        if self.trace is not None:
            self.trace.step_done(t, self.stats.step_end_times[-1])

    def _step(self, t: int, scale: float, bucket_wait: Callable[[int], Any], *, check: bool) -> None:
        """The versions' step of batch t, then (``check``) this stage's finite check of W(t+1). A background host
        step (swap.host_step) runs the check on its thread; its error surfaces where W(t+1) is next needed."""
        if not getattr(self.versions, "background", False):
            self.versions.step(t, grad_scale=scale, before_bucket=bucket_wait)
            if check:
                self._check_finite(t)
            return
        trace = self.trace if self.trace is not None and self.trace.on else None
        self.versions.step(
            t,
            grad_scale=scale,
            before_bucket=bucket_wait,
            after=(lambda weights: self._check_finite(t, weights)) if check else None,
            span=(lambda b, start, end: trace.add("hoststep", b, start, end)) if trace is not None else None,
        )

    def _finish_exchanges(self, t: int) -> None:
        """``finish(t)`` of every exchange, once per batch (CLOSE(t) may have done it for the norm)."""
        if self._exchanged != t:
            for exchange in self.exchanges:
                exchange.finish(t)
            self._exchanged = t

    def _defers(self, t: int) -> bool:
        """Whether APPLY(t) may wait (``agreement.apply_due``): under 2bw with an agreement, unless batch
        t+1 runs on the same weights (the first batch: W(-1) = W(0)) and would add its gradients to t's."""
        return self.deferred and self.versions.apply_may_wait(t)

    def _agreed(self, t: int) -> StepOutcome:
        start = time.perf_counter()
        total = self.agreement.wait().tolist()
        end = time.perf_counter()
        self.stats.agreement_exposed_s += end - start
        if self.trace is not None and self.trace.on:
            self.trace.add("allreduce", t, start, end)
        return agreement.decode(total, step=t, num_stages=self.num_stages)

    def _wait_reducer(self, t: int) -> None:
        """Waits for every bucket of batch t's gradient reduction; APPLY(t) takes the reduction (its
        buckets, once waited, return at once; a sharded one keeps its summed shards until then)."""
        reduction = self._reductions.get(t)
        for b in range(len(self.versions.buckets) if reduction is not None else 0):
            reduction.wait(b)

    def _bucket_wait(self, t: int) -> Callable[[int], Any]:
        """What the optimizer step calls before bucket b: wait for batch t's reduction of it (at once if
        CLOSE(t) waited already: the norm needs the averaged gradients); a sharded reduction returns the
        replica's summed shard of the bucket's gradient."""
        reduction = self._reductions.pop(t, None)
        if reduction is None:
            return lambda b: None
        if self.trace is not None and self.trace.on:
            return self._traced_wait(t, reduction)
        return reduction.wait

    def _check_finite(self, t: int, weights: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Under on_nonfinite=stop without an agreement each rank checks its own stage, on the new
        weights W(t+1) (``weights``: given by a background host step, its host copies): a non-finite gradient
        makes them non-finite (SGD, Adam), and the check runs after the gradients are freed, adding nothing to
        the step's peak memory. One host sync.

        Raises:
            NonFiniteError: naming the step and this stage.
        """
        # sharded: each replica checks its float32 shards (the newest version may still be gathering)
        sharded = isinstance(self.versions, ShardedVersions)
        if weights is not None:
            params = list(weights)
        elif self._float32_sums:  # a streamed stage's float32 masters (the versions are rounded from them)
            params = list(self.versions.master)
        else:
            params = self.versions.shards if sharded else self.versions.newest_parameters()
        with torch.no_grad():  # a check, not a computation to differentiate: no graph over every parameter
            sq = agreement.sq_norm(params)
        if not math.isfinite(float(sq)):
            raise NonFiniteError(agreement.stop_message(f"non-finite gradient at step {t} on stage {self.stage_index}"))

    def _traced_wait(self, t: int, reduction: BatchReduction) -> Callable[[int], None]:
        """The reduction's per-bucket wait, recorded as an ``allreduce`` span of batch ``t``."""

        def wait(b: int) -> Any:
            start = time.perf_counter()
            out = reduction.wait(b)
            self.trace.add("allreduce", t, start, time.perf_counter())
            return out

        return wait

    def run(
        self,
        actions: Sequence[Action],
        *,
        on_step: Callable[[int], None] = lambda t: None,
        on_close: Callable[[int], None] = lambda t: None,
    ) -> StageStats:
        """Dispatches ``actions`` (``schedule.rank_actions``: the compute with its communication
        lowered around it) in order, step by step (``schedule.steps``); ``on_close(t)`` is called at
        CLOSE(t) (where the S action stands) and ``on_step(t)`` after APPLY(t) (the weights W(t+1)).

        Raises:
            Exception: whatever an action raised, unchanged, after logging this rank's steps with
                the failing action marked ``>like this<`` (``schedule.render_steps``).
        """
        self.stats.start_time, self.stats.start_cpu = time.perf_counter(), time.process_time()
        batches = [a.index for a in actions if a.kind == STEP]
        self._last_batch = max(batches, default=-1)
        v_chunks.plan_whole(self, actions)
        if self.peers.loss_sources and batches:
            self._post_losses(batches[0])
        # the action running (its position), or what else runs there: for the log of a failure
        self._at, self._what = 0, None
        try:
            self._dispatch(actions, on_step=on_step, on_close=on_close)
        except NonFiniteError:  # the run's verdict on its numbers, not a fault of the schedule: its message says it
            raise
        except Exception:
            at, what = self._at, self._what
            log.error(  # the log's prefix names the stage and rank
                "failed in %s (position %d of %d); this rank's steps, the failing one >marked<:\n%s",
                what or f"action {actions[at]}",
                at,
                len(actions),
                render_steps(actions, mark=at if what is None else None, context=_LOG_CONTEXT_STEPS),
            )
            raise
        self.versions.settle()  # a background host step still running (swap.host_step); raises what it raised
        self.stats.host_step_s = getattr(self.versions, "host_step_s", 0.0)
        self.stats.host_step_wait_s = getattr(self.versions, "host_step_wait_s", 0.0)
        self.stats.host_step_cpu_s = getattr(self.versions, "host_step_cpu_s", 0.0)
        self.stats.allgather_exposed_s = getattr(self.versions, "gather_wait_s", 0.0)
        if self.trace is not None:
            self.stats.trace = {"spans": self.trace.spans, "window": self.trace.window}
        if self.swap is not None:
            self.stats.swap = self.swap.close()
        if self.stream is not None:
            self.stats.stream = self.stream.close()
        self._measure_memory()
        return self.stats

    def _dispatch(
        self, actions: Sequence[Action], *, on_step: Callable[[int], None], on_close: Callable[[int], None]
    ) -> None:
        """``run``'s loop: each step's compute with its communication, CLOSE and APPLY (deferred or not)."""
        pending = None  # a closed batch whose APPLY is deferred (2bw with an agreement)
        early = None  # optim.sharded: the position of the step before which the pending APPLY runs, if not due sooner
        for k, step in enumerate(steps(actions)):
            a = step.compute
            due = pending is not None and (early is not None and k >= early)
            if pending is not None and (due or agreement.apply_due(a, pending, num_microbatches=self.m)):
                self._at, self._what = step.start, f"the deferred APPLY({pending}) due before the step of {a}"
                self.apply(pending)
                self._hook(on_step, pending)
                pending, self._what = None, None
            if a.kind == STEP:
                self._at = step.at
                since = self.close(a.index)
                self._hook(on_close, a.index)
                if self._defers(a.index):
                    pending = a.index
                    early = k + 1 + self._apply_after if self._apply_after is not None else None
                else:
                    self.apply(a.index, since=since)
                    self._hook(on_step, a.index)
                continue
            if a.kind == BACKWARD:
                self._at = step.start
                self._before_backward(a.index)
            self._compute_step(actions, step)
        self._at, self._what = len(actions), "the last deferred APPLY or the final flush of sends"
        if pending is not None:
            self.apply(pending)
            self._hook(on_step, pending)
        start = time.perf_counter()
        self.p2p.flush()
        self.stats.p2p_wait_s += time.perf_counter() - start

    def _compute_step(self, actions: Sequence[Action], step: Any) -> None:
        """One step's F or B with the communication lowered around it, in order."""
        a = step.compute
        if self._chunks:  # zbv: the chunk the action names
            v_chunks.select(self, self._chunks[a.stage_index])
        received = compute = None  # when the step's receives and its compute started
        for at in range(step.start, step.stop):
            self._at = at
            if at == step.at:
                compute = time.perf_counter()
                if received is not None:
                    self._waited(a.index, received, compute)
                {FORWARD: self.forward, BACKWARD: self.backward, WEIGHT: self.weight}[a.kind](a.index)
            else:
                received = time.perf_counter() if received is None and at < step.at else received
                self._communicate(*comm_op(actions[at].kind), actions[at].index)
        if self.trace is not None and self.trace.on:  # F and B spans end once their sends are posted
            self.trace.add(a.kind, a.index, compute, time.perf_counter())
        if self._losses_due and a.kind != FORWARD:
            self._report_losses()

    def _hook(self, fn: Callable[[int], None], t: int) -> None:
        """The caller's ``on_close``/``on_step`` for batch t (a ``hooks`` span when tracing)."""
        if self.trace is None or not self.trace.on:
            return fn(t)
        start = time.perf_counter()
        fn(t)
        if self.trace.on:  # on_step of the last traced step runs after the window closed
            self.trace.add("hooks", t, start, time.perf_counter())

    def _waited(self, k: int, start: float, end: float) -> None:
        """Counts the time a step's receives took before its compute (posting, waiting, freeing)."""
        self.stats.p2p_wait_s += end - start
        if self.trace is not None and self.trace.on:
            self.trace.add("recv", k, start, end)

    def _measure_memory(self) -> None:
        st = self.stats
        st.weight_bytes = sum(p.numel() * p.element_size() for r in self.versions.replicas for p in r.parameters())
        st.optimizer_state_bytes = self.versions.optimizer_state_bytes()
        st.peak_memory_bytes = process_peak_bytes(self.device)
