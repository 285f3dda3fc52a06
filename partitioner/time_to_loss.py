"""``pipeline.schedule=auto``: the schedule that reaches a loss first, as steps x step time.

The planner predicts a plan's step time (``cost.py``); what a schedule does to the number of steps it takes is
measured, not modelled: a synchronous schedule (flush, zb1p, zbv, gpipe) steps on fresh gradients, the reference;
2bw's one step of delay costs extra steps that depend on the optimizer and its correction (docs/convergence.md: the
steps each setting took to flush's own final validation loss with the same optimizer, 3 seeds, where measured; else
to flush-AdamW's).
``STEPS_FACTOR`` holds those ratios; a setting not measured takes its optimizer's uncorrected figure, and an
optimizer with no measured figure under 2bw is not trusted to reach the loss (2bw is not chosen for it).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

from pipedream2bw.config import OptimConfig
from pipedream2bw.config.optimizers import correction_in_effect, is_muon

AUTO = "auto"
CANDIDATES: Tuple[str, ...] = ("2bw", "flush", "zb1p", "zbv")
"""What schedule=auto chooses between: gpipe does flush's work with all m microbatches in flight (never faster). zbv
(2d chunks, two a rank: partitioner/vplan.py) is tried where the run could run it (``config.v_schedule_refusal``: on
gloo, none of what it is not proven with) and skipped elsewhere."""

STEPS_FACTOR: Dict[Tuple[str, str], float] = {
    # docs/convergence.md, "Time to a loss" (GPT 4 x 64, m=4, b=8, lr 3e-3, 3 seeds), steps to 2.233: flush with
    # Muon 123 (90 / 160 / 120); 2bw with plain Muon 210 (1.71x)
    ("muon", "none"): 210 / 123,
    # docs/convergence.md, "Momentum, each schedule's learning rate, and the prediction with error feedback" (seeds
    # 0-2, 400-step runs), steps to flush-Muon's own final loss (300 steps; issue 46's "that loss", the longest
    # horizon measured): 2bw with Muon + error feedback at its default beta 1.5 340 / 340 / 340; with
    # predict_error_feedback (beta 0.5) 320 / 340 / 340. (To 2.233, flush-AdamW's final loss, earlier in the run:
    # 460 / 370 and 430 / 370; the delay costs most early.)
    ("muon", "error_feedback"): 1020 / 900,
    ("muon", "predict_error_feedback"): 1000 / 900,
}
"""2bw's steps over a synchronous schedule's with the same optimizer, per (optimizer, delay correction).
AdamW under 2bw did not reach flush's loss within the 300 steps measured (with or without a correction): absent."""


def steps_factor(schedule: str, optim: OptimConfig) -> Optional[float]:
    """Steps ``schedule`` takes to a loss over a synchronous schedule's, under ``optim``; None where 2bw is not
    known to reach it at all."""
    if schedule != "2bw":
        return 1.0
    kind = "muon" if is_muon(optim) else (optim.name or "").lower()
    correction = correction_in_effect(optim, schedule)
    return STEPS_FACTOR.get((kind, correction), STEPS_FACTOR.get((kind, "none")))


def time_per_step(batch_time_s: float, factor: Optional[float]) -> float:
    """A plan's predicted seconds per synchronous step's worth of progress: its batch time x its steps factor
    (infinite where the schedule is not known to reach the loss)."""
    return math.inf if factor is None else batch_time_s * factor


def describe(choice: Dict[str, float], optim: OptimConfig, chosen: str) -> str:
    """One line: each candidate's best predicted batch time x its steps factor (2bw's naming the delay correction it
    is for, optim.delay_correction resolved), and the choice."""
    parts = []
    for schedule, t in choice.items():
        f = steps_factor(schedule, optim)
        if f is None or not math.isfinite(t):
            parts.append(f"{schedule}: not measured to reach a synchronous schedule's loss under this optimizer")
        else:
            which = f" (delay correction {correction_in_effect(optim, schedule)})" if schedule == "2bw" else ""
            parts.append(f"{schedule} {t / f:.4g} s x {f:.3g} steps{which} = {t:.4g} s")
    return f"schedule=auto, time to a loss per synchronous step: {'; '.join(parts)}; chosen: {chosen}"
