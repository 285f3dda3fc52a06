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
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from pipedream2bw.data import MicrobatchFeed
from pipedream2bw.memory.precision import autocast, compute_dtype
from pipedream2bw.pipeline.boundary import Channel, from_wire, to_device, to_wire
from pipedream2bw.pipeline.comm import EVAL_LOSS_TAG, P2P

log = logging.getLogger(__name__)

EVAL_TAG = 0  # activations, on the evaluation group (which carries nothing else)


def due(step: int, *, every: int, num_steps: int) -> bool:
    """Whether a validation pass follows the optimizer step that makes ``step`` steps."""
    return every > 0 and (step % every == 0 or step == num_steps)


class Evaluator:
    """One stage's share of the validation passes; on rank 0 also their losses.

    Args:
        prev, next: neighbouring ranks of this stage in its replica's chain (None at the ends).
        loss_sources: on rank 0, the last stage of every replica; empty elsewhere.
        p2p: transfers on the evaluation group (``comm.new_groups`` over all ranks).
        feed: the validation feed (first and last stages; None in between).
        num_microbatches: microbatches per pass on this replica (``eval_batches * m``).
        sends_loss: False on a last stage's tensor ranks > 0 (their tensor rank 0 sends the same loss).
    """

    def __init__(
        self,
        *,
        prev: Optional[int],
        next: Optional[int],
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
        self.prev, self.next, self.loss_sources, self.p2p, self.feed = prev, next, loss_sources, p2p, feed
        self.precision, self._wire_dtype = precision, compute_dtype(precision)
        # the same structured crossing as training's activations (a tensor, tuple or dict), on this group
        self._channel = Channel(p2p, tag=EVAL_TAG, what="a stage's validation output", device=device)
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
        losses = []
        try:
            for e in range(self.num_microbatches):
                if self.prev is None:
                    x = to_device(self.feed.inputs(e), self.device)
                else:  # as training's stages do: the compute dtype travels, float32 goes on (or it, upcast False)
                    x = self._channel.recv(self.prev)
                    x = from_wire(x, self._wire_dtype) if self.upcast else x
                with autocast(self.precision, self.device.type):
                    out = self.forward(module, x)
                if self.next is None:
                    losses.append(self.loss_fn(out.float(), to_device(self.feed.targets(e), self.device)))
                else:
                    self._channel.send(to_wire(out, self._wire_dtype), peer=self.next)
            if self.next is not None:
                self.p2p.flush()  # the next stage has all of this pass: nothing of it stays in flight
        finally:
            module.train(was_training)
        if self.next is None:
            loss = torch.stack(losses).mean()
            if self.loss_sources:  # rank 0 is a last stage itself
                self._own.append(float(loss))
            elif self.sends_loss:
                self.p2p.send_value(loss, peer=0, tag=EVAL_LOSS_TAG)
        if self.loss_sources:
            self._pending.append(step)
        self.time_s += time.perf_counter() - start

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
