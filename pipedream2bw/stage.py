"""The stage worker: runs one rank's action list with p2p transfers, weight versions and the loss."""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from pipedream2bw.comm import P2P, GradReducer
from pipedream2bw.data import MicrobatchFeed
from pipedream2bw.schedule import BACKWARD, FORWARD, Action
from pipedream2bw.timeline import Recorder
from pipedream2bw.swap import SwapManager
from pipedream2bw.versions import WeightVersions

log = logging.getLogger(__name__)

ACTIVATION_TAG, GRADIENT_TAG = 0, 1


@dataclass(frozen=True)
class Peers:
    """Ranks a stage talks to: ``prev``/``next`` in its replica's chain (None at the ends), and
    on rank 0 only, ``loss_sources``: the last stage of every replica, whose losses it logs."""

    prev: Optional[int]
    next: Optional[int]
    loss_sources: Tuple[int, ...] = ()


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
    losses: List[float] = field(default_factory=list)  # batch mean loss; filled on rank 0
    peak_stash_bytes: int = 0  # activations autograd saves for one microbatch x most microbatches in flight
    weight_bytes: int = 0  # all weight versions held
    optimizer_state_bytes: int = 0
    peak_memory_bytes: int = 0  # CUDA: max allocated; CPU: process peak resident set
    p2p_wait_s: float = 0.0  # time spent waiting for activations and gradients from neighbours
    peak_pending_sends: int = 0  # most sends whose tensors were held at once (bounded by the in-flight count)
    checkpoint_s: float = 0.0  # time training waited for checkpoint copies (the writes run beside it)
    eval_s: float = 0.0  # time in validation passes (train.eval_every), compute and waits
    data_resident_bytes: Optional[int] = None  # token-file pages mapped in this rank at the end; None: no token file opened
    trace: Optional[dict] = None  # pipeline.trace: {"spans": [timeline.Span], "window": [start, end]}
    swap: Optional[Dict[str, Any]] = None  # SwapStats of a stage that swaps activations to host


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes autograd saves for backward, leaving out the stage's own parameters."""

    def __init__(self, param_ptrs: set):
        self.nbytes = 0
        seen = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in param_ptrs and ptr not in seen:
                seen.add(ptr)
                self.nbytes += t.untyped_storage().nbytes()
            return t

        super().__init__(pack, lambda t: t)


class StageWorker:
    """Runs the actions of stage ``stage_index`` of ``num_stages`` on this rank.

    F k: take microbatch k's input (from the feed on stage 0, else from stage s-1), run the
    stage with the weight version of k's batch, send the output on (or compute the loss on
    the last stage) and stash what backward needs. B k: backward with the gradient from
    stage s+1 (or of the loss) and send the input's gradient to stage s-1. S t: the optimizer
    step that closes batch t, on the mean gradient of its m microbatches on all w replicas.
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
        receipts: Tuple[Dict[int, int], Dict[int, int]] = ({}, {}),
    ):
        self.m = num_microbatches
        self.first, self.last = stage_index == 0, stage_index == num_stages - 1
        self.peers, self.versions, self.p2p, self.feed = peers, versions, p2p, feed
        self.loss_fn, self.device, self.reducer, self.grad_scale = loss_fn, device, reducer, grad_scale
        self.stats = StageStats(stage_index, p2p.ctx.rank)
        self.swap = swap
        self._stash: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # k -> (input, output or loss)
        self._saved_bytes: Optional[int] = None  # what autograd saves for one microbatch
        self._batch_losses: Dict[int, List[torch.Tensor]] = {}
        self._pending: Dict[Tuple[str, int], tuple] = {}  # posted receives, by (kind, k)
        self._param_ptrs = {p.untyped_storage().data_ptr() for r in versions.replicas for p in r.parameters()}
        # Early receives overlap transfers with compute where each transfer progresses on its own
        # (gloo). When sends are batched with the next receive (NCCL, where transfers between two
        # ranks run in order), receives are posted only when needed, paired with the held sends.
        self._prefetch = not p2p.batch_sends
        self.trace: Optional[Recorder] = None  # set for pipeline.trace; spans are recorded while trace.on
        # schedule.receipts of the previous stage (its forward j proves which of our gradients it
        # received) and of the next (its backward j, which of our activations): sends to free.
        self._receipts = {FORWARD: receipts[0], BACKWARD: receipts[1]}

    def _recv(self, kind: str, k: int, next_k: Optional[int]) -> torch.Tensor:
        peer, tag = (self.peers.prev, ACTIVATION_TAG) if kind == FORWARD else (self.peers.next, GRADIENT_TAG)
        start = time.perf_counter()
        pending = self._pending.pop((kind, k), None) or self.p2p.post_recv(peer=peer, tag=tag)
        if next_k is not None and self._prefetch:  # post the next receive now, so it overlaps our compute
            self._pending[(kind, next_k)] = self.p2p.post_recv(peer=peer, tag=tag)
        received = self.p2p.wait_recv(pending, peer=peer)
        self.p2p.release(peer, self._receipts[kind].get(k, -1))
        end = time.perf_counter()
        self.stats.p2p_wait_s += end - start
        if self.trace is not None and self.trace.on:
            self.trace.add("recv", k, start, end)
        return received

    def _send(self, tensor: torch.Tensor, k: int, *, peer: int, tag: int, defer: bool) -> None:
        start = time.perf_counter()
        self.p2p.send(tensor, peer=peer, tag=tag, defer=defer, token=k)
        self.stats.peak_pending_sends = max(self.stats.peak_pending_sends, self.p2p.pending_sends)
        if self.trace is not None and self.trace.on:
            self.trace.add("send", k, start, time.perf_counter())

    def forward(self, k: int, next_k: Optional[int], *, defer_send: bool = False) -> None:
        module = self.versions.module_for_batch(k // self.m)
        if self.first:
            start = time.perf_counter()
            x = self.feed.inputs(k).to(self.device, non_blocking=True)
        else:
            x = self._recv(FORWARD, k, next_k).requires_grad_()
            start = time.perf_counter()  # the F span starts once the input is here
        # Shapes are fixed (P2P checks them), so what autograd saves is measured on the first
        # microbatch only, keeping the hooks' per-tensor Python calls off the hot path.
        saved = SavedBytes(self._param_ptrs) if self._saved_bytes is None else contextlib.nullcontext()
        if self.swap is not None:  # one pair of hooks applies at a time: the swap hooks chain SavedBytes'
            hooks = self.swap.forward(k, inputs=(x,), outer=saved if self._saved_bytes is None else None)
        with hooks if self.swap is not None else saved:
            out = module(x)
            if self.last:
                out = self.loss_fn(out, self.feed.targets(k).to(self.device, non_blocking=True))
        if self._saved_bytes is None:
            self._saved_bytes = saved.nbytes
        if self.last:
            losses = self._batch_losses.setdefault(k // self.m, [])
            losses.append(out.detach())
            if len(losses) == self.m:  # the batch's losses are all known: report them now, not after the step
                self._report_loss(torch.stack(self._batch_losses.pop(k // self.m)).mean())
        else:
            self._send(out.detach(), k, peer=self.peers.next, tag=ACTIVATION_TAG, defer=defer_send)
        self._stash[k] = (x, out)
        self.stats.peak_stash_bytes = max(self.stats.peak_stash_bytes, len(self._stash) * self._saved_bytes)
        if self.trace is not None and self.trace.on:
            self.trace.add(FORWARD, k, start, time.perf_counter())

    def backward(self, k: int, next_k: Optional[int], *, defer_send: bool = False) -> None:
        x, out = self._stash.pop(k)
        if self.swap is not None:  # before the receive: the prefetch overlaps the wait for the gradient
            self.swap.begin_backward(k)
        if self.reducer is not None and (k + 1) % self.m == 0:  # the batch's last backward: reduce as it goes
            self.reducer.arm(self.versions.replicas.index(self.versions.module_for_batch(k // self.m)))
        grad = None if self.last else self._recv(BACKWARD, k, next_k)
        start = time.perf_counter()
        if self.last:
            out.backward()
        else:
            torch.autograd.backward(out, grad)
        if self.swap is not None:
            self.swap.end_backward(k)
        if not self.first:
            self._send(x.grad, k, peer=self.peers.prev, tag=GRADIENT_TAG, defer=defer_send)
        if self.trace is not None and self.trace.on:
            self.trace.add(BACKWARD, k, start, time.perf_counter())

    def _report_loss(self, loss: torch.Tensor) -> None:
        """A last stage: hand the batch's mean loss to rank 0 (here, if this is rank 0)."""
        if self.peers.loss_sources:
            self._own_loss = float(loss)
        else:
            self.p2p.send_loss(loss)

    def step(self, t: int) -> None:
        wait = self.reducer.wait if self.reducer is not None else (lambda i: None)
        trace = self.trace if self.trace is not None and self.trace.on else None
        if trace is not None and self.reducer is not None:
            wait = self._traced_wait(t)
        start = time.perf_counter()
        self.versions.step(t, grad_scale=self.grad_scale, before_bucket=wait)
        if trace is not None:
            trace.add("S", t, start, time.perf_counter())
        if self.peers.loss_sources:  # rank 0: the batch loss is the mean over the replicas' last stages
            start = time.perf_counter()
            losses = [self._own_loss if r == self.p2p.ctx.rank else self.p2p.recv_loss(peer=r) for r in self.peers.loss_sources]
            self.stats.losses.append(sum(losses) / len(losses))
            if trace is not None:
                trace.add("loss", t, start, time.perf_counter())
        self.stats.step_end_times.append(time.perf_counter())
        if self.trace is not None:
            self.trace.step_done(t, self.stats.step_end_times[-1])

    def _traced_wait(self, t: int) -> Callable[[int], None]:
        """The reducer's per-bucket wait, recorded as an ``allreduce`` span of batch ``t``."""
        def wait(b: int) -> None:
            start = time.perf_counter()
            self.reducer.wait(b)
            self.trace.add("allreduce", t, start, time.perf_counter())
        return wait

    def run(self, actions: Sequence[Action], *, on_step: Callable[[int], None] = lambda t: None) -> StageStats:
        """Runs ``actions`` in order; ``on_step(t)`` is called after each optimizer step."""
        # Forwards and backwards each run in microbatch order (schedule.check_stage), so the
        # receive to post after k's is k+1's.
        end = max((a.index for a in actions if a.kind == FORWARD), default=-1) + 1  # a resumed run starts past 0
        receives = [(a.kind == FORWARD and not self.first) or (a.kind == BACKWARD and not self.last) for a in actions]
        self.stats.start_time = time.perf_counter()
        for pos, a in enumerate(actions):
            next_k = a.index + 1 if a.index + 1 < end else None
            # A send may wait for the next action's receive (batched sends) only if there is one.
            defer_send = pos + 1 < len(actions) and receives[pos + 1]
            if a.kind == FORWARD:
                self.forward(a.index, next_k, defer_send=defer_send)
            elif a.kind == BACKWARD:
                self.backward(a.index, next_k, defer_send=defer_send)
            else:
                self.step(a.index)
                on_step(a.index)
        start = time.perf_counter()
        self.p2p.flush()
        self.stats.p2p_wait_s += time.perf_counter() - start
        if self.trace is not None:
            self.stats.trace = {"spans": self.trace.spans, "window": self.trace.window}
        if self.swap is not None:
            self.stats.swap = self.swap.close()
        self._measure_memory()
        return self.stats

    def _measure_memory(self) -> None:
        st = self.stats
        st.weight_bytes = sum(p.numel() * p.element_size() for r in self.versions.replicas for p in r.parameters())
        st.optimizer_state_bytes = sum(
            v.numel() * v.element_size()
            for optimizer in self.versions.optimizers
            for state in optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v)
        )
        if self.device.type == "cuda":
            st.peak_memory_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            st.peak_memory_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
