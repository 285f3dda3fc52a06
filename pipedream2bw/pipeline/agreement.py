"""What every stage must agree on before batch t's optimizer step: the global gradient norm and non-finite flags.

docs/design.md section 7. Each rank closes batch t (CLOSE(t), right after its last backward)
by putting its share into one small float64 vector, which is summed over all ranks while
training goes on; it applies the step (APPLY(t)) once the sum is in. Layout of the vector,
d stages:

    [0]            sum of squares of g(t) over the stage's parameters (replica 0 of each stage
                   only: the replicas of a stage hold the same averaged gradient, so each
                   stage counts once and the sum is the unpartitioned model's squared norm)
    [1 + s]        > 0 if stage s saw a non-finite batch loss (its last stage only)
    [1 + d + s]    > 0 if stage s saw a non-finite gradient (any replica)

``StepRule`` turns the agreed ``StepOutcome`` into a ``StepDecision``: skip the step, or the
factor to multiply the gradient by (the clip coefficient). An fp16 loss scaler is a
``StepRule`` too: it unscales through ``unscale`` and owns skipping through ``decide``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from pipedream2bw.pipeline.schedule import FORWARD, STEP, Action


class NonFiniteError(RuntimeError):
    """A batch's loss or gradient was not finite and ``train.on_nonfinite`` is 'stop'."""


@dataclass(frozen=True)
class StepOutcome:
    """What all ranks agreed on for batch ``step``."""

    step: int
    grad_norm: float  # global 2-norm of g(t) over the whole model (before clipping); inf or nan if not finite
    loss_stages: Tuple[int, ...] = ()  # stages whose batch loss was not finite (only the last stage computes one)
    grad_stages: Tuple[int, ...] = ()  # stages with a non-finite gradient

    @property
    def nonfinite(self) -> bool:
        """A non-finite loss or gradient anywhere in the batch (any stage, any replica)."""
        return bool(self.loss_stages or self.grad_stages) or not math.isfinite(self.grad_norm)

    def describe(self) -> str:
        """E.g. 'non-finite gradient at step 3 on stage 1'."""
        parts = [
            f"{what} on stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"
            for what, stages in (("loss", self.loss_stages), ("gradient", self.grad_stages))
            if stages
        ]
        return f"non-finite {' and '.join(parts) or 'gradient norm'} at step {self.step}"


@dataclass(frozen=True)
class StepDecision:
    skip: bool  # no optimizer step for this batch on any stage: W(t+1) = W(t)
    grad_multiplier: float = 1.0  # folded into the gradient scale (the clip coefficient)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` multiplies gradients by, computed as it does
    (float32): ``min(1, max_norm / (total_norm + 1e-6))``."""
    coef = max_norm / (torch.tensor(total_norm, dtype=torch.float32) + 1e-6)
    return float(torch.clamp(coef, max=1.0))


class StepRule:
    """Turns the agreed outcome of batch t into its step: clip, skip, or stop.

    Args:
        clip_grad_norm: clip g(t) to this global 2-norm (None: no clipping).
        on_nonfinite: 'stop' (raise ``NonFiniteError``) or 'skip' (skip the step everywhere).

    Subclasses (an fp16 loss scaler) may override ``needs_agreement`` (True), ``loss_scale(t)``
    (what batch t's loss is multiplied by; ``unscale(t)``, its inverse, turns batch t's
    accumulated gradients into true ones, for the norm at CLOSE(t) and at APPLY(t), so it must
    not change between the first backward of batch t and its APPLY) and ``decide`` (e.g. lower the scale and skip
    on ``outcome.nonfinite``). ``decide`` runs on every rank with the same outcome, so the ranks stay in agreement.
    """

    def __init__(self, *, clip_grad_norm: Optional[float] = None, on_nonfinite: str = "stop"):
        self.clip_grad_norm, self.on_nonfinite = clip_grad_norm, on_nonfinite

    @property
    def needs_agreement(self) -> bool:
        """Whether batch t's step needs every stage's share (else each rank decides alone)."""
        return self.clip_grad_norm is not None or self.on_nonfinite == "skip"

    def loss_scale(self, step: int) -> float:
        """What batch ``step``'s loss is multiplied by before its backward (fp16 loss scaling; else 1)."""
        return 1.0

    def unscale(self, step: int) -> float:
        return 1.0 / self.loss_scale(step)

    def decide(self, outcome: StepOutcome) -> StepDecision:
        """Raises:
        NonFiniteError: ``outcome.nonfinite`` under on_nonfinite='stop'."""
        if outcome.nonfinite:
            if self.on_nonfinite == "skip":
                return StepDecision(skip=True)
            raise NonFiniteError(stop_message(outcome.describe()))
        if self.clip_grad_norm is None:
            return StepDecision(skip=False)
        return StepDecision(skip=False, grad_multiplier=clip_coefficient(outcome.grad_norm, self.clip_grad_norm))


STOP_FIXES = "lower optim.lr, set optim.clip_grad_norm or optim.warmup_steps"
"""What the stop message proposes before train.on_nonfinite=skip (fp16's loss scaler proposes its own)."""


def stop_message(what: str, *, fixes: str = STOP_FIXES) -> str:
    return (
        f"{what}; train.on_nonfinite=stop ends the run (the last complete checkpoint is kept): {fixes}, "
        f"or set train.on_nonfinite=skip to skip such steps"
    )


def sq_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of ``grads`` as a float64 scalar on their device (no host sync): each
    tensor's 2-norm in its own dtype, as ``clip_grad_norm_`` takes them, squared and summed."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(torch._foreach_norm(list(grads), 2)).double().square().sum()


def encode(
    *, stage_index: int, num_stages: int, sq: torch.Tensor, counts_norm: bool, loss_nonfinite: bool
) -> torch.Tensor:
    """This rank's share of the vector summed over all ranks (layout in the module docstring)."""
    d, s = num_stages, stage_index
    share = torch.zeros(1 + 2 * d, dtype=torch.float64, device=sq.device)
    if counts_norm:
        share[0] = sq
    share[1 + s] = float(loss_nonfinite)
    share[1 + d + s] = (~torch.isfinite(sq)).double()
    return share


def decode(total: Sequence[float], *, step: int, num_stages: int) -> StepOutcome:
    """The outcome from the summed vector (a host list)."""
    d = num_stages
    return StepOutcome(
        step=step,
        grad_norm=math.sqrt(total[0]),  # a sum of squares: >= 0, inf or nan
        loss_stages=tuple(s for s in range(d) if total[1 + s] > 0),
        grad_stages=tuple(s for s in range(d) if total[1 + d + s] > 0),
    )


def apply_due(action: Action, pending: int, *, num_microbatches: int) -> bool:
    """Under 2bw, whether the deferred APPLY(``pending``) must run before ``action``.

    W(t+1) is first used by the first forward of batch t+2; and APPLY(t) runs before CLOSE(t+1)
    (the next STEP action), so at most one batch waits for its agreement and the gradient
    buffers hold one closed batch at a time. Batch t+1's last backward comes before APPLY(t) on
    the last stage: batch t's data-parallel all-reduce is the one CLOSE(t) took from the reducer
    (``comm.GradReducer.take``), not the reducer's current one. On stages s < d-1 the forward comes first
    (it precedes the backward of microbatch (t+2)m - (d-s-1)), on the last stage the STEP. In
    steady state 2(m-d+1+s) forwards and backwards run between CLOSE(t) and APPLY(t): at least
    one of each on stage 0, 2m on the last stage.
    No third version: batch t+1 runs on W(t) and accumulates into W(t)'s replica, while
    APPLY(t) writes W(t+1) into the replica of W(t-1), whose gradients it consumes. Except for
    the first batch, which shares W(0) with the second: the worker applies it at once.
    """
    return action.kind == STEP or (action.kind == FORWARD and action.index // num_microbatches >= pending + 2)
