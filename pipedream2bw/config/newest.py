"""pipeline.weight_versions: its values, and what 'newest' is not proven with (refused in one line naming the key).

Under 'newest' a microbatch's forward runs on the newest version its stage holds at that point of its schedule, its
backward on the same (docs/concepts.md): proven against tests/reference.py's rule where APPLY(t) follows CLOSE(t) at
once (no agreement, no exchange, no sharded step), on one or more replicas per stage (pipeline.data_parallel), with
float32 versions (fp32, bf16).
With optim.delay_correction=predict the forwards of a batch that run before the stage's previous step run on a
prediction of the version they miss (pipeline/versions.py's ``PredictedNewestVersions``), held in one replica, or two
alternating by batch where a stage's early forwards are more than half of m (``prediction_replicas``)."""

from __future__ import annotations

import dataclasses
import logging
import re
import types
from typing import Any, Mapping, Optional, Tuple

from pipedream2bw.config.corrections import (
    AUTO,
    DELAY_CORRECTIONS,
    FEEDBACK,
    PREDICTING,
    RECORDED_OFF_DEFAULT,
    default_beta,
    is_muon,
    prediction_refusal,
)
from pipedream2bw.errors import ConfigError

log = logging.getLogger(__name__)

WEIGHT_VERSIONS = (AUTO, "batch", "newest")
"""pipeline.weight_versions' values: 'auto' (the default: ``resolve_weight_versions``), 'batch' (2bw's rule, W(t-1)
for all of batch t) and 'newest'."""


def early_forwards(num_stages: int, num_microbatches: int, forward_lead: int, *, stage_index: int = 0) -> int:
    """How many forwards of each batch stage s runs before its previous batch's step under 2bw's 1F1B: d - s - 1 plus
    its forward lead (pipeline/schedule.py's ``lead``, which tests/test_newest.py holds this to); stage 0's, the most
    of any stage, by default. At most m - 1."""
    s, d, m = stage_index, num_stages, num_microbatches
    return d - s - 1 + (0 if s == d - 1 else max(0, min(forward_lead, m - (d - s))))


PREDICT_HORIZON = 1.5
"""optim.predict_horizon's default: how many steps ahead newest's prediction reaches (``PredictedNewestVersions``).
Measured (docs/convergence.md, "How far the prediction reaches"): with Muon at d = 2, 1.5 took 2bw to fewer or as
many steps to flush's final loss as 1 at every GPT shape and m measured (3 seeds each), and as 2 or fewer at the
wider one; at the README's run (d = 4, 150 steps) 1 ended lower (by 0.005 and 0.023 over 2 seeds)."""


def prediction_replicas(early: int, num_microbatches: int) -> int:
    """The replicas a stage running ``early`` forwards of each batch before its previous step (``early_forwards``)
    holds for newest's prediction besides its exact W (``PredictedNewestVersions``): one, or two alternating by batch
    where they are more than half of m (2E > m): batch t-1's early microbatches are then not all through their
    backwards before batch t's first forward, but batch t-2's always are (E <= m - 1; both walked over the schedule in
    tests/test_newest.py). The last stage runs none early: its one is never written."""
    return 2 if 2 * early > num_microbatches else 1


def prediction_weight_copies(num_stages: int, num_microbatches: int, forward_lead: int, *, stage_index: int) -> int:
    """The weight copies stage s holds under newest with its prediction: its exact W and its prediction replicas
    (``prediction_replicas`` of its ``early_forwards``), as ``PredictedNewestVersions`` holds them."""
    early = early_forwards(num_stages, num_microbatches, forward_lead, stage_index=stage_index)
    return 1 + prediction_replicas(early, num_microbatches)


def resolve_weight_versions(cfg: Any) -> Any:
    """``cfg.pipeline`` (of a ``Config``) with pipeline.weight_versions=auto resolved from the whole config: 'newest'
    for Muon under schedule 2bw (or auto: its 2bw candidate's rule) wherever newest runs (``newest_refusal`` names
    nothing, with the correction 'auto' resolves to under it, predict), 'batch' elsewhere (logged once with the key
    that decides it); ``auto_weight_versions`` set. Measured (docs/convergence.md, "With its prediction"): with Muon,
    newest with its prediction takes 2bw to 1.03x / 1.09x a flushing pipeline's steps at two GPT shapes, against the
    batch rule's 1.11x / 1.17x with its default correction; no other optimizer is measured under it. A rule 'auto'
    resolved before is resolved again whenever the config is made again (a plan's recomputation refuses newest), as
    ``optim.auto_correction``. Any other value is returned as it is."""
    p, o = cfg.pipeline, cfg.optim
    if p.weight_versions != AUTO and not p.auto_weight_versions:
        return p
    rule, why = "batch", None
    if is_muon(o) and p.schedule in ("2bw", AUTO):
        # a correction 'auto' chose (predict under newest) is chosen again under the rule resolved here
        chosen = o.delay_correction == AUTO or o.auto_correction
        trial = types.SimpleNamespace(
            pipeline=dataclasses.replace(p, weight_versions="newest", auto_weight_versions=False),
            optim=dataclasses.replace(o, delay_correction="predict") if chosen else o,
            train=cfg.train,
            model=cfg.model,
            swap=cfg.swap,
            data=cfg.data,
        )
        why = newest_refusal(trial)
        rule = "batch" if why else "newest"
    if why and p.weight_versions != rule:  # once, where it changes
        log.info("pipeline.weight_versions=auto resolves to batch, not newest: %s", why.split("; set ")[0])
    if (p.weight_versions, p.auto_weight_versions) == (rule, True):
        return p
    return dataclasses.replace(p, weight_versions=rule, auto_weight_versions=True)


LAYOUT_RECORD = "newest ("
"""How checkpoints written on 2026-11-27 record pipeline.weight_versions=newest: with the layout that decided its early
forwards, 'newest (num_stages 2, balance [3, 2], num_microbatches 4, forward_lead 0)' (balance 'even' for null)."""


def recorded_rule(value: Any) -> Any:
    """A checkpoint's pipeline.weight_versions as the rule it names: 'newest' for 2026-11-27's ``LAYOUT_RECORD``."""
    return "newest" if isinstance(value, str) and value.startswith(LAYOUT_RECORD) else value


def layout_record(pipeline: Any) -> str:
    """``pipeline``'s layout in the words of ``LAYOUT_RECORD``, as 2026-11-27's checkpoints wrote it under newest."""
    p, balance = pipeline, "even" if pipeline.balance is None else list(pipeline.balance)
    return (
        f"newest (num_stages {p.num_stages}, balance {balance}, num_microbatches {p.num_microbatches}, forward_lead "
        f"{p.forward_lead})"
    )


def read_layout_record(recorded: Mapping[str, Any], pipeline: Any) -> Mapping[str, Any]:
    """``recorded`` (a manifest's training settings) with 2026-11-27's ``LAYOUT_RECORD`` read as 'newest' where a
    resume under ``pipeline`` (the run's layout, planned) goes on as trained: at the layout it names, or without
    newest's prediction. Under the prediction its last stage kept no P(n) (it runs no early forward), which the early
    forwards of a stage holding those layers at another layout would read: left as it is, so check_settings refuses
    it, naming the layout to set (``layout_hint``)."""
    value = recorded.get("pipeline.weight_versions")
    if recorded_rule(value) == value:
        return recorded
    if recorded.get("optim.delay_correction") == "predict" and value != layout_record(pipeline):
        return recorded
    return {**recorded, "pipeline.weight_versions": "newest"}


def layout_hint(value: str) -> str:
    """What to set to resume a checkpoint whose pipeline.weight_versions is ``value``, a ``LAYOUT_RECORD`` (read as
    'newest' at its layout, ``read_layout_record``): the rule and its layout as overrides."""
    fields = dict(re.findall(r"(\w+) (\[[^\]]*\]|[^,)]+)", value[len(LAYOUT_RECORD) :]))  # a balance list has ", "
    fields["balance"] = "null" if fields["balance"] == "even" else fields["balance"].replace(" ", "")
    return "pipeline.weight_versions=newest " + " ".join(f"pipeline.{k}={v}" for k, v in fields.items())


def follow_checkpoint(cfg: Any, recorded: Optional[Mapping[str, Any]], *, where: Any, strict: bool) -> Any:
    """``cfg`` (a ``Config``) resuming checkpoint ``where``, whose manifest records the training settings
    ``recorded`` (run/model.py's ``training_settings``; None where it records none): where 'auto' chose
    pipeline.weight_versions or optim.delay_correction, the checkpoint's rule and correction (and, unless given, its
    optim.error_feedback_beta) instead, named as if set by hand, so that a plan and a Config made again keep them
    (auto's own choice is for fresh runs). A value set by hand is never replaced. Logged once where it differs from
    auto's choice.

    Raises:
        ConfigError: ``strict`` and the checkpoint's rule or correction does not run with this run's keys (and none
            set by hand differs from it): one line naming the key that refuses it and the ways on.
    """
    followed = _recorded(cfg, recorded)
    if not followed:
        return cfg
    full = _pinned(cfg, followed)
    blocker = _blocker(full)
    if blocker is None:
        changed = {k: v for k, v in followed.items() if _current(cfg, k) != v}
        if changed:
            log.info(
                "resuming %s under its own %s ('auto' follows a checkpoint; name them to change them)",
                where,
                _described(changed),
            )
        return full
    # what runs: the checkpoint's rule with auto's correction under it, else auto's choice of both
    rule = {k: v for k, v in followed.items() if k.startswith("pipeline.")}
    fallback = _pinned(cfg, rule) if rule and _blocker(_pinned(cfg, rule)) is None else cfg
    if not strict or _explicit_differences(cfg, recorded):  # check_settings names (strict) or logs the differences
        return fallback
    ran = {k: _current(fallback, k) for k in followed}
    why, fix = blocker
    fix = "pipeline.num_stages=1, where the tie is one parameter" if why.startswith("model.") else fix
    raise ConfigError(
        f"checkpoint {where} was trained under {_described(followed)}, which 'auto' resumes it under, but this run "
        f"refuses it: {why}; set {fix} to resume as trained, train.resume_strict=false to go on under "
        f"{_described(ran)} (the differences logged), or train.resume=never to start afresh"
    )


def _recorded(cfg: Any, recorded: Optional[Mapping[str, Any]]) -> dict:
    """What ``follow_checkpoint`` takes from ``recorded`` for the keys 'auto' chose: a 2bw checkpoint's rule ('batch'
    where it records none: written before newest; 'newest' for 2026-11-27's ``LAYOUT_RECORD``, whose layout
    check_settings holds where it matters), its correction ('none' where it records none: only others are)."""
    p, o = cfg.pipeline, cfg.optim
    out: dict = {}
    if recorded is None:
        return out
    rule = recorded_rule(recorded.get("pipeline.weight_versions", "batch"))  # 2026-11-27's layout record: newest
    if p.auto_weight_versions and p.schedule in ("2bw", AUTO) and recorded.get("pipeline.schedule") == "2bw":
        if rule in ("batch", "newest"):
            out["pipeline.weight_versions"] = rule
    correction = recorded.get("optim.delay_correction", RECORDED_OFF_DEFAULT["optim.delay_correction"])
    # a correction is followed under the rule it ran with (newest's predict is not the batch rule's)
    same_rule = (
        out.get("pipeline.weight_versions", p.weight_versions) == rule or recorded.get("pipeline.schedule") != "2bw"
    )
    if o.auto_correction and correction in DELAY_CORRECTIONS and same_rule:
        out["optim.delay_correction"] = correction
        beta_given = o.error_feedback_beta != default_beta(o.delay_correction)  # as resolve_auto tells
        beta = recorded.get("optim.error_feedback_beta") if correction in FEEDBACK and not beta_given else None
        if beta is None:
            beta = o.error_feedback_beta if beta_given else default_beta(correction)
        out["optim.error_feedback_beta"] = beta
    return out


def _pinned(cfg: Any, values: Mapping[str, Any]) -> Any:
    """``cfg`` with ``values`` (``_recorded``'s) set as by hand: a Config made again does not resolve them again."""
    pipeline, optim = cfg.pipeline, cfg.optim
    if "pipeline.weight_versions" in values:
        rule = values["pipeline.weight_versions"]
        pipeline = dataclasses.replace(pipeline, weight_versions=rule, auto_weight_versions=False)
    if "optim.delay_correction" in values:
        correction, beta = values["optim.delay_correction"], values["optim.error_feedback_beta"]
        optim = dataclasses.replace(optim, delay_correction=correction, error_feedback_beta=beta, auto_correction=False)
    return dataclasses.replace(cfg, pipeline=pipeline, optim=optim)


def _blocker(cfg: Any) -> Optional[Tuple[str, str]]:
    """(the key that refuses ``cfg``'s rule or correction with its other keys, and why; what to set it to), or None."""
    if cfg.pipeline.weight_versions == "newest":
        return _newest_blocker(cfg)
    why = prediction_refusal(cfg) if cfg.optim.delay_correction in PREDICTING else None
    return None if why is None else tuple(why.rsplit("; set ", 1))


def _current(cfg: Any, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _described(values: Mapping[str, Any]) -> str:
    """``values`` (``_recorded``'s) as 'key=value, ...', a beta only where its correction runs error feedback."""
    feedback = values.get("optim.delay_correction") in FEEDBACK
    return ", ".join(f"{k}={v}" for k, v in values.items() if feedback or k != "optim.error_feedback_beta")


def _explicit_differences(cfg: Any, recorded: Mapping[str, Any]) -> bool:
    """Whether a rule or correction set by hand differs from the checkpoint's: the run changes it (check_settings)."""
    p, o = cfg.pipeline, cfg.optim
    rule = recorded.get("pipeline.weight_versions", "batch") if recorded.get("pipeline.schedule") == "2bw" else None
    rule = recorded_rule(rule)  # 2026-11-27's layout record: newest
    other_rule = not p.auto_weight_versions and rule is not None and p.weight_versions != rule
    recorded_correction = recorded.get("optim.delay_correction", RECORDED_OFF_DEFAULT["optim.delay_correction"])
    other_correction = not o.auto_correction and o.delay_correction != recorded_correction
    return other_rule or other_correction


def newest_refusal(cfg: Any) -> Optional[str]:
    """Why ``cfg`` (a ``Config``) cannot run pipeline.weight_versions=newest, as one line naming the key, why and
    what to set, or None (also None under weight_versions=batch). Under pipeline.schedule=auto it is its 2bw
    candidate's rule: the rest is refused whatever the schedule, and again once a plan has set the run's layout."""
    p = cfg.pipeline
    if p.weight_versions not in WEIGHT_VERSIONS:
        return f"pipeline.weight_versions ({p.weight_versions!r}) is unknown; use one of {list(WEIGHT_VERSIONS)}"
    blocker = _newest_blocker(cfg)
    if blocker is None:
        return None
    why, fix = blocker
    return f"pipeline.weight_versions=newest with {why}; set {fix}, or pipeline.weight_versions=batch"


def _newest_blocker(cfg: Any) -> Optional[Tuple[str, str]]:
    """(the key that refuses newest with why, what to set it to) for ``newest_refusal``, or None (also under
    weight_versions=batch)."""
    p, o, t, mdl = cfg.pipeline, cfg.optim, cfg.train, cfg.model
    if p.weight_versions != "newest":  # batch; auto is resolved when the Config is made
        return None
    deferred = "its step would wait for an agreement, so the newest version is not the one proven"
    refused = [
        # schedule=auto: a rule of its 2bw candidate (moot under the others, partitioner/auto.py's apply_plan)
        (
            p.schedule not in ("2bw", "auto"),
            f"pipeline.schedule ({p.schedule}): newest is a 2bw rule",
            "pipeline.schedule=2bw",
        ),
        (p.tensor_parallel > 1, f"pipeline.tensor_parallel ({p.tensor_parallel}): not proven", "it 1"),
        (p.sync_warmup_steps > 0, "pipeline.sync_warmup_steps: the versions keep one rule", "it 0"),
        (p.recompute, "pipeline.recompute: not proven", "it false"),
        (bool(o.sharded), "optim.sharded: " + deferred, "it false"),
        (
            o.delay_correction not in ("none", "predict"),
            f"optim.delay_correction ({o.delay_correction}): not proven",
            "none, predict or auto",
        ),
        (o.clip_grad_norm is not None, "optim.clip_grad_norm: " + deferred, "it null"),
        (t.on_nonfinite == "skip", "train.on_nonfinite (skip): " + deferred, "train.on_nonfinite=stop"),
        (t.precision == "fp16", "train.precision (fp16): " + deferred + " (its loss scaler's)", "bf16 or fp32"),
        (t.weight_dtype == "compute" and t.precision != "fp32", "train.weight_dtype (compute): not proven", "fp32"),
        (getattr(mdl, "tie_embeddings", False) and p.num_stages > 1, "model.tie_embeddings: " + deferred, "it false"),
        (bool(cfg.swap.enabled or cfg.swap.stages), "swap.enabled/swap.stages: not proven", "neither"),
        (cfg.swap.weights, "swap.weights: not proven", "it false"),
        (cfg.swap.optimizer == "host", "swap.optimizer (host): not proven", "swap.optimizer=device"),
        (cfg.data.packing != "windows", f"data.packing ({cfg.data.packing}): not proven", "data.packing=windows"),
    ]
    return next(((why, fix) for bad, why, fix in refused if bad), None)
