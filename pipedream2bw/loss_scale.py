"""Pure: fp16 dynamic loss scaling as a small checkpointable object, fed the globally agreed overflow flag."""

from __future__ import annotations

import math
from typing import Any, Dict


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

    def __init__(self, *, init_scale: float = 2.0**16, growth_interval: int = 2000, growth_factor: float = 2.0,
                 backoff: float = 0.5, min_scale: float = 1.0):
        self.scale = float(init_scale)
        self.growth_interval, self.growth_factor, self.backoff, self.min_scale = growth_interval, growth_factor, backoff, min_scale
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
            "scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps,
            "growth_interval": self.growth_interval, "growth_factor": self.growth_factor,
            "backoff": self.backoff, "min_scale": self.min_scale,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continues from ``state``: the scale and the counters; the hyperparameters stay this run's."""
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
