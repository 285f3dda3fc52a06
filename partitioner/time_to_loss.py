"""``pipeline.schedule=auto``: the schedule that reaches a loss first, as steps x step time.

The planner predicts a plan's step time (``cost.py``); what a schedule does to the number of steps it takes is
measured, not modelled: a synchronous schedule (flush, zb1p, zbv, gpipe) steps on fresh gradients, the reference;
2bw's one step of delay costs extra steps that depend on the optimizer and its correction (docs/convergence.md: the
steps each setting took to flush's own final validation loss with the same optimizer, 3 seeds, where measured; else
to flush-AdamW's).
``STEPS_FACTOR`` holds those ratios, under pipeline.weight_versions=newest per depth too (its forwards' staleness
depends on d: only d = 2 is measured). A setting not measured (any other correction, rule, depth or optimizer) takes
its optimizer's uncorrected figure under the batch rule, and an optimizer with no measured figure under 2bw is not
trusted to reach the loss (2bw is not chosen for it). The weight-version rule is 2bw's only: a synchronous schedule's
forwards run on the newest version whatever it says.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple, Union

from pipedream2bw.config import OptimConfig
from pipedream2bw.config.newest import PREDICT_HORIZON
from pipedream2bw.config.optimizers import correction_in_effect, is_muon

AUTO = "auto"
CANDIDATES: Tuple[str, ...] = ("2bw", "flush", "zb1p", "zbv")
"""What schedule=auto chooses between: gpipe does flush's work with all m microbatches in flight (never faster). zbv
(2d chunks, two a rank: partitioner/vplan.py) is tried where the run could run it (``config.v_schedule_refusal``: on
gloo, none of what it is not proven with) and skipped elsewhere."""

STEPS_FACTOR: Dict[Tuple[Union[str, int], ...], Optional[float]] = {
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
    # docs/convergence.md, "The newest version at each forward" (4 x 64, seeds 0-2, 400-step runs, flush at one
    # stage), steps to flush's own final loss (300 / 300 / 300): 2bw under newest, no correction, d = 2: 310 / 310 / 310
    ("muon", "none", "newest", 2): 930 / 900,
    # with its prediction (optim.delay_correction=predict, what 'auto' resolves to under newest) at its default
    # horizon 1.5, the same runs: 310 / 310 / 300 (docs/convergence.md, "How far the prediction reaches"; at 2 and 8
    # microbatches a batch 310 / 320 / 320 and 300 / 300 / 300, at 6 x 128 310 / 310 / 330; counted every 2 steps,
    # 308 / 312 / 312 and 300 / 298 / 300, at 6 x 128 306 / 310 / 322 against flush's first 300 / 296 / 286)
    ("muon", "predict", "newest", 2): 920 / 900,
}
"""2bw's steps over a synchronous schedule's with the same optimizer, per (optimizer, delay correction) under the
batch rule and per (optimizer, delay correction, 'newest', num_stages) under pipeline.weight_versions=newest; None:
not measured. AdamW under 2bw did not reach flush's loss within the 300 steps measured (with or without a
correction): absent."""
NEWEST_FALLBACK = "predict_error_feedback"
"""The batch rule's correction whose figure prices newest with its prediction at a depth not measured under it."""


def steps_factor(
    schedule: str, optim: OptimConfig, *, weight_versions: str = "batch", num_stages: int = 0
) -> Optional[float]:
    """Steps ``schedule`` takes to a loss over a synchronous schedule's, under ``optim`` and, for 2bw, the
    pipeline.weight_versions rule ``weight_versions`` at ``num_stages`` stages (newest's figures are per depth); newest
    with its prediction at an unmeasured depth or optim.predict_horizon (its figures are the default horizon's) takes
    ``NEWEST_FALLBACK``'s figure, any other unmeasured setting its optimizer's uncorrected batch-rule figure. None
    where 2bw is not known to reach the loss at all."""
    if schedule != "2bw":
        return 1.0
    kind = "muon" if is_muon(optim) else (optim.name or "").lower()
    correction = correction_in_effect(optim, schedule)
    key = (kind, correction, "newest", num_stages) if weight_versions == "newest" else (kind, correction)
    measured = STEPS_FACTOR.get(key)
    if correction == "predict" and optim.predict_horizon != PREDICT_HORIZON:  # measured at the default horizon only
        measured = None
    if measured is None and weight_versions == "newest" and correction == "predict":
        # newest with its prediction ended below the batch rule with its default correction at every depth measured
        # (d = 2: two shapes, 3 seeds; d = 4: the README's run): an unmeasured depth is priced as the latter
        measured = STEPS_FACTOR.get((kind, NEWEST_FALLBACK))
    return measured if measured is not None else STEPS_FACTOR.get((kind, "none"))


def describe(
    choice: Dict[str, float],
    optim: OptimConfig,
    chosen: str,
    *,
    factors: Optional[Dict[str, float]] = None,
    weight_versions: str = "batch",
) -> str:
    """One line: each candidate's best predicted batch time x its steps factor (``factors``: a plan's
    ``schedule_factors``, each candidate's best plan's; where absent, ``steps_factor``'s at no depth), 2bw's naming
    the rule ``weight_versions`` under newest and the delay correction it is for (optim.delay_correction resolved),
    and the choice."""
    parts = []
    for schedule, t in choice.items():
        f = (factors or {}).get(schedule, steps_factor(schedule, optim, weight_versions=weight_versions))
        if f is None or not math.isfinite(f) or not math.isfinite(t):
            parts.append(f"{schedule}: not measured to reach a synchronous schedule's loss under this optimizer")
        else:
            rule = "newest, " if weight_versions == "newest" else ""
            which = f" ({rule}delay correction {correction_in_effect(optim, schedule)})" if schedule == "2bw" else ""
            parts.append(f"{schedule} {t / f:.4g} s x {f:.3g} steps{which} = {t:.4g} s")
    return f"schedule=auto, time to a loss per synchronous step: {'; '.join(parts)}; chosen: {chosen}"
