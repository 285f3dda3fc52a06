"""pipeline.weight_versions: its values, and what 'newest' is not proven with (refused in one line naming the key).

Under 'newest' a microbatch's forward runs on the newest version its stage holds at that point of its schedule, its
backward on the same (docs/concepts.md): proven against tests/reference.py's rule where APPLY(t) follows CLOSE(t) at
once (no agreement, no exchange, no sharded step), on one or more replicas per stage (pipeline.data_parallel), with
float32 versions (fp32, bf16).
With optim.delay_correction=predict the forwards of a batch that run before the stage's previous step run on a
prediction of the version they miss (pipeline/versions.py's ``PredictedNewestVersions``)."""

from __future__ import annotations

from typing import Any, Optional

WEIGHT_VERSIONS = ("batch", "newest")
"""pipeline.weight_versions' values: 'batch' (2bw's rule, W(t-1) for all of batch t) and 'newest'."""


def early_forwards(num_stages: int, num_microbatches: int, forward_lead: int) -> int:
    """How many forwards of each batch stage 0 runs before its previous batch's step under 2bw's 1F1B: d - 1 plus
    its forward lead (pipeline/schedule.py's ``lead``, which tests/test_newest.py holds this to), the most of any
    stage."""
    d, m = num_stages, num_microbatches
    return d - 1 + (0 if d == 1 else max(0, min(forward_lead, m - d)))


def newest_refusal(cfg: Any) -> Optional[str]:
    """Why ``cfg`` (a ``Config``) cannot run pipeline.weight_versions=newest, as one line naming the key, why and
    what to set, or None (also None under weight_versions=batch). Under pipeline.schedule=auto it is its 2bw
    candidate's rule: the rest is refused whatever the schedule, and again once a plan has set the run's layout."""
    p, o, t, mdl = cfg.pipeline, cfg.optim, cfg.train, cfg.model
    if p.weight_versions not in WEIGHT_VERSIONS:
        return f"pipeline.weight_versions ({p.weight_versions!r}) is unknown; use one of {list(WEIGHT_VERSIONS)}"
    if p.weight_versions == "batch":
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
    for bad, why, fix in refused:
        if bad:
            return f"pipeline.weight_versions=newest with {why}; set {fix}, or pipeline.weight_versions=batch"
    if o.delay_correction == "predict":
        early = early_forwards(p.num_stages, p.num_microbatches, p.forward_lead)
        if 2 * early > p.num_microbatches:
            return (
                f"pipeline.weight_versions=newest with optim.delay_correction=predict at pipeline.num_microbatches "
                f"({p.num_microbatches}): stage 0 runs {early} forwards of each batch on the prediction, whose buffer "
                f"the next batch's overwrites before their backwards unless num_microbatches >= {2 * early}; raise "
                "it, lower pipeline.forward_lead, or set optim.delay_correction=none"
            )
    return None
