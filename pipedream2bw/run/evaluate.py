"""Validation: forward-only microbatches of held-out data through the pipeline with the newest weights.

Every stage runs the pass right after its optimizer step ``t`` when ``t + 1`` is a multiple of
``train.eval_every`` (and after the last step), on its newest version ``W(t+1)``: the same
weights on every stage, whichever schedule. Under 2bw a step is deferred on every stage or on
none (``StageWorker``'s ``deferred``), so the pass comes at the same point of each stage's schedule:
with a tie deferring only its holders, a stage that stepped at once waited in the pass for a
holder that first needed that stage's next activation. The pass changes nothing that training uses: no
weight version, gradient, optimizer state or RNG stream (the module runs in eval mode under
``no_grad``, so dropout draws nothing and autograd saves nothing), and its transfers go over a
process group of their own (``EvalChannel``), so they never interleave with training's p2p.

Why it cannot deadlock without draining the pipeline, under 2bw too: a stage reaches its step
``t`` using only what its neighbours send before their own step ``t`` (the activations of
microbatches up to ``(t+1)m + d - s - 2`` and gradients up to ``(t+1)m - 1``), so every stage gets
there whatever its neighbours do after it; training sends still in flight then are asynchronous
and on another group. The pass itself flows one way, stage 0 to the last, and a stage waits only
for its own validation sends to be received, by a neighbour already in (or on its way to) the
same pass. The last stages send their mean loss to rank 0 over the control group; rank 0
collects it after its next step, by when the loss has been sent (the last stages sent it before
the next batch's loss, which rank 0 received in that step), so rank 0 never stalls training
waiting for it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from pipedream2bw.data import MicrobatchFeed
from pipedream2bw.memory.precision import autocast, compute_dtype
from pipedream2bw.pipeline.boundary import Channel, from_wire, to_device, to_wire
from pipedream2bw.pipeline.comm import EVAL_LOSS_TAG, P2P
from pipedream2bw.run.chunks import LOCAL  # a leg's neighbour on this rank (zbv: chunks d-1 and d): a hand-off

log = logging.getLogger(__name__)

EVAL_TAG = 0  # activations, on the evaluation group (which carries nothing else)


@dataclass(frozen=True)
class Leg:
    """One run of a pass's microbatches through part of the stage: ``layers`` (positions in the stage's module; None:
    all of it), from ``prev`` (a rank, ``LOCAL``, or None: the feed) to ``next`` (a rank, ``LOCAL``, or None: the
    loss). A stage is one leg; a rank of two chunks (zbv) two, in its chunks' order."""

    layers: Optional[slice]
    prev: Optional[int]
    next: Optional[int]


def due(step: int, *, every: int, num_steps: int) -> bool:
    """Whether a validation pass follows the optimizer step that makes ``step`` steps."""
    return every > 0 and (step % every == 0 or step == num_steps)


class Evaluator:
    """One stage's share of the validation passes; on rank 0 also their losses.

    Args:
        legs: this rank's part of a pass (``Leg``): one for a stage, its two chunks' under zbv.
        loss_sources: on rank 0, the last stage of every replica; empty elsewhere.
        p2p: transfers on the evaluation group (``comm.new_groups`` over all ranks).
        feed: the validation feed (first and last stages; None in between).
        num_microbatches: microbatches per pass on this replica (``eval_batches * m``).
        sends_loss: False on a last stage's tensor ranks > 0 (their tensor rank 0 sends the same loss).
    """

    def __init__(
        self,
        *,
        legs: Sequence[Leg],
        loss_sources: Tuple[int, ...],
        p2p: P2P,
        feed: Optional[MicrobatchFeed],
        num_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        precision: str = "fp32",
        upcast: bool = True,
        sends_loss: bool = True,
    ):
        self.upcast = upcast  # False: a received activation stays in the compute dtype (weights stored in it)
        self.sends_loss = sends_loss
        self.legs, self.loss_sources, self.p2p, self.feed = list(legs), loss_sources, p2p, feed
        self.last = self.legs[-1].next is None  # this rank computes the loss (zbv: rank 0, its second chunk)
        self.precision, self._wire_dtype = precision, compute_dtype(precision)
        # the same structured crossing as training's activations (a tensor, tuple or dict), on this group: one a leg
        # (each leg's structures its own: zbv's two chunks cross different boundaries)
        self._channels = [
            Channel(p2p, tag=EVAL_TAG, what="a stage's validation output", device=device) for _ in self.legs
        ]
        self._local: Dict[int, Any] = {}  # microbatch -> what a leg handed the next leg on this rank
        self.num_microbatches, self.loss_fn, self.device = num_microbatches, loss_fn, device
        self.rank = p2p.ctx.rank
        self.time_s = 0.0  # this rank's time in validation passes (compute and waits)
        self.losses: List[Tuple[int, float]] = []  # rank 0: (steps trained, validation loss)
        self._own: List[float] = []  # rank 0 as a last stage: its own losses not yet collected
        self._pending: List[int] = []  # rank 0: steps whose losses are on their way
        # ``forward(module, x)``: the stage's forward; a streamed stage's (swap.weights) brings each layer's weights
        # from host memory (``WeightStream.evaluate``)
        self.forward: Callable[[nn.Module, Any], Any] = lambda module, x: module(x)

    @torch.no_grad()
    def run(self, module: nn.Module, *, step: int) -> None:
        """The pass after ``step`` steps, with ``module`` (this stage's newest weights)."""
        start = time.perf_counter()
        was_training = module.training
        module.eval()
        losses: List[torch.Tensor] = []
        try:
            for leg, channel in zip(self.legs, self._channels):
                part = module if leg.layers is None else module[leg.layers]
                for e in range(self.num_microbatches):
                    with autocast(self.precision, self.device.type):
                        out = self.forward(part, self._input(leg, channel, e))
                    self._output(leg, channel, e, out, losses)
            if any(leg.next not in (None, LOCAL) for leg in self.legs):
                self.p2p.flush()  # the next stage has all of this pass: nothing of it stays in flight
        finally:
            module.train(was_training)
        if self.last:
            loss = torch.stack(losses).mean()
            if self.loss_sources:  # rank 0 is a last stage itself
                self._own.append(float(loss))
            elif self.sends_loss:
                self.p2p.send_value(loss, peer=0, tag=EVAL_LOSS_TAG)
        if self.loss_sources:
            self._pending.append(step)
        self.time_s += time.perf_counter() - start

    def _input(self, leg: Leg, channel: Channel, e: int) -> Any:
        """Microbatch ``e``'s input to ``leg``: the feed's, handed over on this rank, or received; as training's
        stages take it (the compute dtype travels, float32 goes on, or it with ``upcast`` False)."""
        if leg.prev is None:
            return to_device(self.feed.inputs(e), self.device)
        x = self._local.pop(e) if leg.prev == LOCAL else channel.recv(leg.prev)
        return from_wire(x, self._wire_dtype) if self.upcast else x

    def _output(self, leg: Leg, channel: Channel, e: int, out: Any, losses: List[torch.Tensor]) -> None:
        """``leg``'s output of microbatch ``e``: its loss at the end, else in the compute dtype to the next leg."""
        if leg.next is None:
            losses.append(self.loss_fn(out.float(), to_device(self.feed.targets(e), self.device)))
        elif leg.next == LOCAL:  # rounded as a send would (training's hand-off does the same)
            self._local[e] = to_wire(out, self._wire_dtype)
        else:
            channel.send(to_wire(out, self._wire_dtype), peer=leg.next)

    def collect(self) -> List[Tuple[int, float]]:
        """Rank 0: the (step, loss) of every pass run so far, not collected before (mean over the
        replicas' last stages); [] elsewhere. Call it after a later step or once training is done."""
        out = []
        for step in self._pending:
            values = [
                self._own.pop(0) if r == self.rank else self.p2p.recv_loss(peer=r, tag=EVAL_LOSS_TAG)
                for r in self.loss_sources
            ]
            out.append((step, sum(values) / len(values)))
        self._pending.clear()
        self.losses.extend(out)
        for step, loss in out:
            log.info("step %d validation loss %.4f perplexity %.2f", step, loss, perplexity(loss))
        return out

    def close(self) -> None:
        """Waits for this rank's validation sends (the last stages' losses to rank 0)."""
        self.p2p.flush()


def perplexity(loss: float) -> float:
    """exp(loss), capped where float64 overflows (an untrained model on a large vocabulary)."""
    return math.exp(min(loss, 700.0))
