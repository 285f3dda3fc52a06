"""The 2bw delay corrections' names, what refuses the weight prediction, and what optim.delay_correction=auto
resolves to: torch-free, as ``Config`` resolves 'auto' when it is made (config/schema.py) and config/validate.py
refuses an explicit prediction by the same rule (``prediction_refusal``)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

log = logging.getLogger(__name__)

AUTO = "auto"

DELAY_CORRECTIONS = ("none", "error_feedback", "lookahead", "predict", "predict_error_feedback")
"""The optim.delay_correction values a run may hold once 'auto' (``AUTO``) is resolved (``resolve_auto``)."""

FEEDBACK = ("error_feedback", "predict_error_feedback")
"""The optim.delay_correction values that run error feedback (``ErrorFeedback``)."""

PREDICTING = ("predict", "predict_error_feedback")
"""The optim.delay_correction values that run the weight prediction (``WeightPrediction``): predict_error_feedback
wraps it around error feedback."""

AUTO_MUON = "predict_error_feedback"
"""What 'auto' gives Muon where nothing of the run refuses the prediction (``prediction_refusal``): the best 2bw
setting measured, on every seed at both GPT shapes (docs/convergence.md); error feedback (``AUTO_MUON_FALLBACK``)
elsewhere. Every other optimizer gets no correction."""

AUTO_MUON_FALLBACK = "error_feedback"
"""What 'auto' gives Muon where a key of the run refuses the prediction: error feedback composes with all of them."""


RECORDED_OFF_DEFAULT = {"optim.delay_correction": "none"}
"""Training settings a checkpoint records only where they are not their default (config/optimizers.py's
``extra_optim_settings``): a manifest without one ran the default. 'auto' follows it as that (config/newest.py), and
under 2bw a resume compares it as that (io/checkpoint.py's ``settings_differences``: a correction named 'none' on
resuming one trained with a correction, or the reverse, would otherwise pass unseen, its buffer unread or absent)."""


def auto_gives(optim: Any) -> bool:
    """Whether ``optim.delay_correction`` (of an ``OptimConfig``) is one 'auto' gives its optimizer under some
    config (``resolve_auto``): Muon's ``AUTO_MUON``, ``AUTO_MUON_FALLBACK`` or newest's 'predict'; 'none' for every
    other optimizer ('auto' itself too, still to resolve). optim.auto_correction beside any other is not 'auto''s
    choice: a ``dataclasses.replace`` naming the correction (or the optimizer) kept the marker."""
    if optim.delay_correction == AUTO:
        return True
    return optim.delay_correction in ((AUTO_MUON, AUTO_MUON_FALLBACK, "predict") if is_muon(optim) else ("none",))


def state_copies(correction: str) -> int:
    """Float32 copies of every parameter that ``correction`` (a resolved optim.delay_correction) keeps between steps,
    and clones during one: error feedback's u(t-1), the prediction's d(t-1), both under predict_error_feedback."""
    return (correction in FEEDBACK) + (correction in PREDICTING)


def is_muon(cfg: Any) -> bool:
    """Whether ``cfg`` (an ``OptimConfig``) names Muon (``optim.name=muon``, no ``optim._target_``)."""
    return not cfg.target and str(cfg.name).lower() == "muon"


def default_beta(correction: str) -> float:
    """optim.error_feedback_beta when null, by the correction it serves (docs/convergence.md): 0.5 under the
    prediction with error feedback (1.5 over-corrects there), 1.5 under error feedback alone."""
    return 0.5 if correction == "predict_error_feedback" else 1.5


def prediction_refusal(cfg: Any) -> Optional[str]:
    """Why the weight prediction (optim.delay_correction=predict|predict_error_feedback) cannot run under ``cfg``
    (a ``Config``), as 'key (value): why; fix', or None. The one statement of the rule: config/validate.py refuses an
    explicit prediction with it, and 'auto' falls back to error feedback with it (``resolve_auto``)."""
    if cfg.swap.optimizer == "host":
        return "swap.optimizer (host): the host's masters are not the versions batches read; set swap.optimizer=device"
    if cfg.optim.sharded and cfg.pipeline.data_parallel > 1:
        return (
            "optim.sharded (true) at pipeline.data_parallel > 1: sharded masters are not written for it; set it false"
        )
    if cfg.train.weight_dtype == "compute" and cfg.train.precision != "fp32":
        return (
            "train.weight_dtype (compute): the versions are rounded copies of the masters; set train.weight_dtype=fp32"
        )
    return None


def resolve_auto(cfg: Any) -> Any:
    """``cfg.optim`` with optim.delay_correction=auto resolved from the whole config ``cfg``: Muon's
    ``AUTO_MUON`` unless ``prediction_refusal`` names a key (then ``AUTO_MUON_FALLBACK``, logged with that key),
    'none' for every other optimizer; under pipeline.weight_versions=newest, Muon's 'predict' (newest's own
    prediction, at any m: config/newest.py's ``prediction_replicas``); a null optim.error_feedback_beta by the
    correction resolved (``default_beta``);
    ``auto_correction`` set. A correction 'auto' resolved before (``auto_correction``) is resolved again, so that a
    config made again with other keys (a plan's pipeline.data_parallel under optim.sharded) never holds what 'auto'
    would not give it, its beta with it unless it differs from its correction's default (one given by hand). Any other
    value of optim.delay_correction is returned as it is."""
    optim = cfg.optim
    if optim.delay_correction == AUTO:
        beta_given = optim.error_feedback_beta is not None
    elif optim.auto_correction:
        beta_given = optim.error_feedback_beta != default_beta(optim.delay_correction)
    else:
        return optim
    correction = "none"
    if is_muon(optim) and cfg.pipeline.weight_versions == "newest":  # newest: its own prediction
        correction = "predict"
    elif is_muon(optim):
        correction = AUTO_MUON
        why = prediction_refusal(cfg)
        if why is not None:
            correction = AUTO_MUON_FALLBACK
            if optim.delay_correction != correction:  # once, where it changes
                log.info("optim.delay_correction=auto resolves to %s, not %s, with %s", correction, AUTO_MUON, why)
    beta = optim.error_feedback_beta if beta_given else default_beta(correction)
    if (optim.delay_correction, optim.error_feedback_beta, optim.auto_correction) == (correction, beta, True):
        return optim
    return dataclasses.replace(optim, delay_correction=correction, error_feedback_beta=beta, auto_correction=True)


def concrete(optim: Any) -> str:
    """``optim.delay_correction``, which must be resolved: a bare ``OptimConfig(name="muon")`` keeps 'auto' until a
    ``Config`` holding it resolves it from the whole config.

    Raises:
        ValueError: the correction is still 'auto'.
    """
    if optim.delay_correction == AUTO:
        raise ValueError(
            "optim.delay_correction (auto) is resolved from the whole config when a Config is made (Muon's depends on "
            "swap, sharding and precision): pass Config(optim=...).optim, or name the correction"
        )
    return optim.delay_correction
