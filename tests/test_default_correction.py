"""optim.delay_correction=auto (issue 46): Muon's prediction with error feedback wherever the prediction composes,
error feedback where a key of the run refuses it, no correction for other optimizers; decided once when the Config is
made, from the whole config, and every byte count follows the resolved value. Under the batch rule
(pipeline.weight_versions=batch, named here): Muon's default rule, newest, has its own (tests/test_newest.py)."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipedream2bw.config import Config, ConfigError, OptimConfig, PipelineConfig, register_configs
from pipedream2bw.config.corrections import prediction_refusal

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


def make(*overrides: str) -> Config:
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        batch = ["pipeline.weight_versions=batch"]  # the rule these corrections are for
        return OmegaConf.to_object(compose(config_name="config", overrides=[*batch, *overrides]))


BATCH = PipelineConfig(weight_versions="batch")


# each key that refuses the weight prediction (config/corrections.py's prediction_refusal), as overrides
REFUSING = {
    "swap.optimizer": ["swap.optimizer=host"],
    "optim.sharded": ["optim.sharded=true", "pipeline.data_parallel=2"],
    "train.weight_dtype": ["train.weight_dtype=compute", "train.precision=bf16"],
}


def test_auto_is_the_prediction_with_error_feedback_for_a_plain_muon_run():
    for cfg in (make(), Config(pipeline=BATCH), Config(pipeline=BATCH, optim=OptimConfig(name="muon"))):
        assert (cfg.optim.delay_correction, cfg.optim.error_feedback_beta) == ("predict_error_feedback", 0.5)
    assert make("optim.error_feedback_beta=1.0").optim.error_feedback_beta == 1.0  # a beta given stays


@pytest.mark.parametrize("key", sorted(REFUSING))
def test_auto_falls_back_to_error_feedback_naming_the_key_that_refuses_the_prediction(key, caplog):
    with caplog.at_level(logging.INFO, logger="pipedream2bw.config.corrections"):
        cfg = make(*REFUSING[key])
    assert (cfg.optim.delay_correction, cfg.optim.error_feedback_beta) == ("error_feedback", 1.5)
    lines = [r.getMessage() for r in caplog.records if "delay_correction=auto" in r.getMessage()]
    assert len(lines) == 1 and key in lines[0], lines
    # the explicit prediction is refused by the same rule, naming the same key
    explicit = make(*REFUSING[key], "optim.delay_correction=predict_error_feedback")
    assert explicit.optim.delay_correction == "predict_error_feedback"
    assert prediction_refusal(explicit).startswith(key)
    from pipedream2bw.config.validate import _validate_prediction

    with pytest.raises(ConfigError, match=re.escape(f"optim.delay_correction (predict_error_feedback) with {key}")):
        _validate_prediction(explicit)


@pytest.mark.parametrize(
    "overrides, correction, beta",
    [
        (["optim.delay_correction=error_feedback"], "error_feedback", 1.5),  # the old default, named: kept
        (["optim.delay_correction=error_feedback", "optim.error_feedback_beta=1.0"], "error_feedback", 1.0),
        (["optim.delay_correction=none"], "none", 1.5),
        (["optim.delay_correction=predict"], "predict", 1.5),
        (["optim.name=adamw"], "none", 1.5),  # every other optimizer: none (issue 43)
        (["optim.name=adamw", "swap.optimizer=host"], "none", 1.5),
    ],
)
def test_a_named_correction_and_other_optimizers_are_left_as_they_are(overrides, correction, beta):
    cfg = make(*overrides)
    assert (cfg.optim.delay_correction, cfg.optim.error_feedback_beta) == (correction, beta)


def test_a_bare_muon_optim_config_stays_auto_and_is_not_read_until_a_config_resolves_it():
    from pipedream2bw.memory.step_memory import StepModel

    bare = OptimConfig(name="muon")
    assert (bare.delay_correction, bare.error_feedback_beta) == ("auto", None)
    with pytest.raises(ValueError, match=r"optim.delay_correction \(auto\) is resolved from the whole config"):
        StepModel.of(bare, device_type="cpu")
    # once resolved, a replace of the Config keeps the value it resolved to (no second resolution, no second log)
    cfg = Config(pipeline=BATCH, optim=bare)
    assert dataclasses.replace(cfg, seed=1).optim.delay_correction == "predict_error_feedback"


def test_a_config_made_again_resolves_autos_choice_again_and_leaves_a_named_one():
    """partition=auto may choose pipeline.data_parallel > 1 for a sharded run whose 'auto' gave Muon the prediction:
    the Config the plan makes falls back to error feedback (beta 1.5), as 'auto' would have at that width, and back
    at w = 1; a named prediction stays (validate refuses it in one line), a beta given by hand stays."""

    def at(cfg, w):
        return dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, data_parallel=w))

    def resolved(cfg):
        return cfg.optim.delay_correction, cfg.optim.error_feedback_beta

    sharded = make("optim.sharded=true")
    assert resolved(sharded) == ("predict_error_feedback", 0.5)
    assert resolved(at(sharded, 2)) == ("error_feedback", 1.5)
    assert resolved(at(at(sharded, 2), 1)) == ("predict_error_feedback", 0.5)
    assert resolved(at(make("optim.sharded=true", "optim.error_feedback_beta=0.7"), 2)) == ("error_feedback", 0.7)
    named = make("optim.sharded=true", "optim.delay_correction=predict_error_feedback")
    assert resolved(at(named, 2)) == ("predict_error_feedback", 0.5)


def test_auto_keeps_the_prediction_at_tensor_parallel_and_the_planner_searches_t_for_it():
    """Issue 46: the prediction runs at pipeline.tensor_parallel > 1 (test_tensor_parallel checks it against its
    reference), so 'auto' gives Muon predict_error_feedback there, a named one is not refused, and the planner
    searches t > 1 for both; the synchronous warm-up is still refused at t > 1, so the planner keeps it at t = 1."""
    from partitioner.auto import _refused_at_t2, tensor_request
    from pipedream2bw.config.validate import _validate_prediction

    def resolved(cfg):
        return cfg.optim.delay_correction, cfg.optim.error_feedback_beta

    default, named = make(), make("optim.delay_correction=predict_error_feedback")
    for cfg in (make("pipeline.tensor_parallel=2"), make("pipeline.tensor_parallel=2", "pipeline.num_stages=2")):
        assert resolved(cfg) == ("predict_error_feedback", 0.5)
        assert prediction_refusal(cfg) is None
    _validate_prediction(make("pipeline.tensor_parallel=2", "optim.delay_correction=predict"))
    for cfg in (default, named, make("optim.delay_correction=predict"), make("optim.name=adamw")):
        assert not _refused_at_t2(cfg)
        assert tensor_request(cfg, "fp32", search=True)["tensor"] is not None  # t > 1 searched
    warm = make("pipeline.sync_warmup_steps=2")
    assert _refused_at_t2(warm) and tensor_request(warm, "fp32", search=True)["tensor"] is None


def test_the_bytes_and_the_steps_factor_follow_the_resolved_correction():
    """The planner's memory model (analytic_gpt's optimizer state, the step's float32 copies), summary.json's bytes
    per parameter and schedule=auto's steps factor: 8 B a parameter and the prediction's factor under the new
    default, 4 B and error feedback's where it falls back."""
    from partitioner import time_to_loss
    from partitioner.profile import analytic_gpt
    from pipedream2bw.config.optimizers import correction_in_effect
    from pipedream2bw.memory import precision as precisions
    from pipedream2bw.memory.step_memory import StepModel

    default, fallback = make(), make(*REFUSING["swap.optimizer"])

    def state(cfg):
        layers = analytic_gpt(cfg.model, cfg.optim, 8, cfg.topology)
        return sum(x.optimizer_bytes for x in layers), sum(x.param_bytes for x in layers)

    (pef, param_bytes), (ef, _) = state(default), state(fallback)
    assert pef - ef == param_bytes  # one more float32 copy of every parameter (fp32 params: 4 B each)
    assert StepModel.of(default.optim, device_type="cpu").correction_copies == 2
    assert StepModel.of(fallback.optim, device_type="cpu").correction_copies == 1

    def optimizer_bytes(cfg):
        correction = correction_in_effect(cfg.optim, "2bw")
        return precisions.param_memory("fp32", schedule="2bw", optimizer="adamw", delay_correction=correction).optimizer

    assert optimizer_bytes(default) - optimizer_bytes(fallback) == 4
    assert (
        time_to_loss.steps_factor("2bw", default.optim) == time_to_loss.STEPS_FACTOR[("muon", "predict_error_feedback")]
    )
    assert time_to_loss.steps_factor("2bw", fallback.optim) == time_to_loss.STEPS_FACTOR[("muon", "error_feedback")]
    # the plan's schedule=auto line names the correction 2bw's factor is for
    assert "(delay correction predict_error_feedback)" in time_to_loss.describe({"2bw": 1.0}, default.optim, "2bw")
    assert "(delay correction error_feedback)" in time_to_loss.describe({"2bw": 1.0}, fallback.optim, "2bw")


def test_a_checkpoint_of_the_old_default_is_refused_naming_the_correction_to_set():
    """A checkpoint written under the old default (error feedback, beta 1.5: one buffer u) against a run whose
    correction differs is refused, naming optim.delay_correction=error_feedback, with which it resumes as trained (a
    run that leaves it to 'auto' takes the checkpoint's before this check: tests/test_newest.py)."""
    from pipedream2bw.io.checkpoint import check_settings
    from pipedream2bw.run.model import training_settings

    old = {"training_settings": training_settings(make("optim.delay_correction=error_feedback"))}
    where = Path("checkpoints/step_100")
    pattern = re.escape(
        "optim.delay_correction: checkpoint 'error_feedback', this run 'predict_error_feedback' "
        "(set optim.delay_correction=error_feedback to resume as trained)"
    )
    with pytest.raises(ConfigError, match=pattern):
        check_settings(old, model={}, training=training_settings(make()), where=where, strict=True)
    named = training_settings(make("optim.delay_correction=error_feedback"))
    assert check_settings(old, model={}, training=named, where=where, strict=True) == []


@pytest.mark.parametrize("optim", [["optim.name=adamw"], []])
def test_a_correction_named_none_against_a_checkpoints_correction_is_refused_and_the_reverse(optim):
    """Regression: 'none' is not recorded (only a correction other than the default is), and a key one side does not
    record was not compared, so naming optim.delay_correction=none on resuming a checkpoint trained with error
    feedback passed unseen (its u(t-1) unread), and so did the reverse (error feedback from a step with no u). Under
    2bw an unrecorded correction is compared as 'none' (config/corrections.py's ``RECORDED_OFF_DEFAULT``); flush records
    none either way."""
    from pipedream2bw.io.checkpoint import check_settings
    from pipedream2bw.run.model import training_settings

    def resume(saved, run):  # check_settings of a checkpoint trained under ``saved`` resumed under ``run``
        where, recorded = Path("checkpoints/step_100"), {"training_settings": training_settings(saved)}
        return check_settings(recorded, model={}, training=training_settings(run), where=where, strict=True)

    feedback, none = (make(*optim, f"optim.delay_correction={c}") for c in ("error_feedback", "none"))
    for saved, run, fix in ((feedback, none, "error_feedback"), (none, feedback, "none")):
        with pytest.raises(ConfigError, match=re.escape(f"(set optim.delay_correction={fix} to resume as trained)")):
            resume(saved, run)
    flush = [*optim, "pipeline.schedule=flush"]
    assert resume(*(make(*flush, f"optim.delay_correction={c}") for c in ("error_feedback", "none"))) == []


def test_the_matrix_cell_of_muon_with_the_prediction_runs_it_as_the_default_auto(monkeypatch):
    """matrix.EXTRA's Muon cell of the prediction around error feedback leaves the correction to 'auto' (issue 46):
    its run, resumed at another layout against the reference, is the default's."""
    import matrix

    from pipedream2bw.config import corrections, schema

    asked = []

    def spy(cfg):
        asked.append(cfg.optim.delay_correction)
        return corrections.resolve_auto(cfg)

    monkeypatch.setattr(schema, "resolve_auto", spy)
    cell = next(c for c in matrix.EXTRA if c.muon and c.predict)
    for layout in cell.layouts():
        assert matrix.cell_config(cell, layout=layout).optim.delay_correction == "predict_error_feedback"
    assert asked == ["auto"] * len(cell.layouts())


@pytest.mark.parametrize(
    "extra, correction", [([], "predict_error_feedback"), (["swap.optimizer=host"], "error_feedback")]
)
def test_the_planners_header_names_the_resolved_correction(extra, correction, capsys, tmp_path):
    from partitioner.__main__ import main

    shape = ["model.num_layers=4", "model.d_model=64", "topology.memory_per_device_gib=4", "train.global_batch_size=8"]
    shape.append("pipeline.weight_versions=batch")
    assert main(["plan", "--out", str(tmp_path / "plan.yaml"), "model=gpt", "topology=dgx", *shape, *extra]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert f"; 2bw (delay correction {correction}); " in header, header


def _adamw(**optim):
    """A tiny AdamW run under 2bw (the batch rule, 'auto''s for it) with ``optim`` (its correction 'auto': none); a
    checkpoint every 2 of its 4 steps."""
    from test_semantics import tiny_config

    cfg = tiny_config(schedule="2bw", num_stages=1, num_microbatches=2, num_steps=4)
    cfg = dataclasses.replace(cfg, optim=OptimConfig(name="adamw", lr=1e-2, **optim))
    cfg.train.checkpoint_every = 2
    return cfg


def test_auto_marks_its_none_for_every_other_optimizer_and_a_resume_follows_the_checkpoints_correction(tmp_path):
    """Regression: 'auto' resolved AdamW's correction to none without optim.auto_correction, so a resume of an AdamW
    checkpoint trained with error feedback at the defaults did not follow it, and check_settings (none is not recorded)
    let the error-feedback buffer go unread. Now the mark is set for every optimizer (what a fresh run resolves to
    unchanged), and a correction named through dataclasses.replace drops it; the resume takes the checkpoint's
    correction and beta."""
    from test_newest import _manifest_of, _resumed

    fresh = _adamw()
    assert (fresh.optim.delay_correction, fresh.optim.error_feedback_beta, fresh.optim.auto_correction) == (
        "none",
        1.5,
        True,
    )
    named = dataclasses.replace(fresh, optim=dataclasses.replace(fresh.optim, delay_correction="error_feedback"))
    assert (named.optim.delay_correction, named.optim.auto_correction) == ("error_feedback", False)
    path, _ = _manifest_of(_adamw(delay_correction="error_feedback", error_feedback_beta=1.0), tmp_path)
    followed = _resumed(fresh, path)
    assert (followed.optim.delay_correction, followed.optim.error_feedback_beta) == ("error_feedback", 1.0)
    assert _resumed(_adamw(delay_correction="none"), path).optim.delay_correction == "none"  # named: kept


@pytest.mark.slow
def test_an_adamw_checkpoint_with_error_feedback_resumes_under_it_at_the_defaults(tmp_path):
    """Regression: an AdamW checkpoint trained with error feedback, resumed at the default optim.delay_correction=auto,
    ran without it (its u(t-1) in the checkpoint unread). 2 + 2 resumed steps now end on the bits of 4 straight steps
    with error feedback; resumed without it they do not."""
    from dist_helper import run_ok

    straight = run_ok(_adamw(delay_correction="error_feedback"), tmp_path / "ef")
    path = tmp_path / "ef" / "checkpoints" / "step_00000002"
    resumed = _adamw()
    resumed.train.resume = str(path)
    again = run_ok(resumed, tmp_path / "resumed")
    assert (again["delay_correction"], again["first_step"]) == ("error_feedback", 2)
    assert again["losses"] == straight["losses"]
    want, got = (torch.load(tmp_path / d / "final_model.pt") for d in ("ef", "resumed"))
    assert all(torch.equal(got[k], w) for k, w in want.items())
