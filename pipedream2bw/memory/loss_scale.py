"""Pure: fp16 dynamic loss scaling as a small checkpointable object, fed the globally agreed overflow flag,
and the step rule that applies it (``ScaledStepRule``)."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from pipedream2bw.pipeline.agreement import NonFiniteError, StepDecision, StepOutcome, StepRule, stop_message


class LossScaler:
    """The loss scale of an fp16 run: halved (``backoff``) on a step with a non-finite gradient,
    multiplied by ``growth_factor`` after ``growth_interval`` clean steps in a row.

    The same rule as ``torch.amp.GradScaler`` (``torch._amp_update_scale_``). It holds no tensors
    and talks to nobody: ``update`` takes the flag every stage and replica agreed on for the
    batch, so every rank's scaler takes the same values. Batch t's loss is multiplied by the
    scale before ``update(t)``; the step of batch t divides its gradient by that same scale.

    Args:
        init_scale: the first scale (``train.loss_scale``).
        growth_interval: clean steps in a row before the scale grows.
        growth_factor: what the scale is multiplied by when it grows.
        backoff: what the scale is multiplied by on a non-finite step.
        min_scale: the floor: ``below_floor`` says when the scale fell under it (a run that
            keeps overflowing at this scale is diverging, not unlucky).
    """

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff: float = 0.5,
        min_scale: float = 1.0,
    ):
        self.scale = float(init_scale)
        self.growth_interval, self.growth_factor, self.backoff, self.min_scale = (
            growth_interval,
            growth_factor,
            backoff,
            min_scale,
        )
        self.clean_steps = 0  # clean steps since the last change of the scale
        self.skipped_steps = 0  # non-finite steps so far (the runtime skipped their updates)

    def update(self, found_nonfinite: bool) -> None:
        """Closes a step: ``found_nonfinite`` is the agreed flag (any stage, any replica)."""
        if found_nonfinite:
            self.scale *= self.backoff
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            grown = self.scale * self.growth_factor
            if math.isfinite(grown):  # as GradScaler: never grow into inf
                self.scale = grown
            self.clean_steps = 0

    def below_floor(self) -> bool:
        """Whether the scale fell under ``min_scale``."""
        return self.scale < self.min_scale

    def state_dict(self) -> Dict[str, Any]:
        """Everything, JSON-serializable (it goes into a checkpoint's manifest)."""
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
            "growth_interval": self.growth_interval,
            "growth_factor": self.growth_factor,
            "backoff": self.backoff,
            "min_scale": self.min_scale,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continues from ``state``: the scale and the counters; the hyperparameters stay this run's."""
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


class ScaledStepRule(StepRule):
    """fp16's step rule: batch t's loss is scaled, its gradients unscaled, and a non-finite gradient
    or loss anywhere (agreed by every rank) skips batch t's step everywhere and lowers the scale.

    Batch t runs with the scale left by the updates of batches up to ``t - lag``. Under 2bw the
    step of batch t-1 is applied after batch t's backwards have started on the last stage (it waits
    for the agreement while batch t runs, docs/design.md section 7), so there ``lag`` is 2; under flush
    and gpipe, 1. Every rank then uses the same scale for batch t whenever it applies the steps.
    ``train.on_nonfinite=stop`` stops the run only when the scale falls below ``min_scale``.

    Args:
        scaler: the ``LossScaler`` (its state: the newest scale and counters).
        lag: 2 (2bw) or 1 (flush, gpipe).
        clip_grad_norm, on_nonfinite: as ``StepRule``.
    """

    def __init__(
        self, scaler: LossScaler, *, lag: int, clip_grad_norm: Optional[float] = None, on_nonfinite: str = "stop"
    ):
        super().__init__(clip_grad_norm=clip_grad_norm, on_nonfinite=on_nonfinite)
        self.scaler, self.lag = scaler, lag
        self._after: Dict[int, float] = {}  # step -> the scale its update left (the last `lag` steps)
        self._initial = scaler.scale  # the scale of batches before any update counts
        self._no_history = False  # resumed from a checkpoint that kept no recent scales

    @property
    def needs_agreement(self) -> bool:
        return True

    def loss_scale(self, step: int) -> float:
        source = step - self.lag  # the last update batch `step` sees
        if source < 0:
            return self._initial
        if source in self._after:
            return self._after[source]
        assert self._no_history, f"batch {step}'s loss scale needs step {source}'s update, which is not at hand"
        return self.scaler.scale  # resumed from a checkpoint without recent scales: the newest

    def decide(self, outcome: StepOutcome) -> StepDecision:
        """Raises:
        NonFiniteError: the scale fell below its floor under train.on_nonfinite=stop."""
        t = outcome.step
        self.scaler.update(outcome.nonfinite)
        self._after[t] = self.scaler.scale
        self._after = {u: v for u, v in self._after.items() if u >= t - self.lag}  # what APPLY(t) and later batches use
        if outcome.nonfinite:
            if self.on_nonfinite == "stop" and self.scaler.below_floor():
                raise NonFiniteError(
                    stop_message(
                        f"{outcome.describe()}: the fp16 loss scale fell to {self.scaler.scale:g}, below "
                        "train.loss_scale_min "
                        f"({self.scaler.min_scale:g}); the gradients keep overflowing",
                        fixes="set train.precision=bf16 (float32's range: no loss scale to overflow), lower "
                        f"train.loss_scale_min (now {self.scaler.min_scale:g}), lower optim.lr",
                    )
                )
            return StepDecision(skip=True)
        return super().decide(outcome)

    def state_dict(self) -> Dict[str, Any]:
        """The scaler's state and the scales the next batches run with (JSON-serializable)."""
        return {
            **self.scaler.state_dict(),
            "scale_after": {str(u): v for u, v in self._after.items()},
            "initial": self._initial,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continues from ``state`` (a checkpoint's): the scale, counters and recent scales."""
        self.scaler.load_state_dict(state)
        self._after = {int(u): float(v) for u, v in state.get("scale_after", {}).items()}
        self._no_history = "scale_after" not in state
        self._initial = float(state.get("initial", self.scaler.scale))
