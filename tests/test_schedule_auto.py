"""pipeline.schedule=auto (issue 46): the planner picks the schedule that reaches a loss first, its predicted step
time x the steps the schedule takes under the optimizer (partitioner/time_to_loss.py, measured in
docs/convergence.md)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from partitioner import time_to_loss
from partitioner.__main__ import compose, main
from partitioner.auto import _steps_factor, apply_plan, plan_config, plan_optim, plan_rule
from partitioner.planner import load_plan, save_plan
from pipedream2bw.config import ConfigError, OptimConfig, default_plan_choices, validate

# a deep GPT on small devices: 8 stages; few microbatches a batch give flush a large bubble, many a small one
DEEP = [
    "model=gpt",
    "topology=dgx",
    "model.num_layers=24",
    "model.d_model=1024",
    "topology.memory_per_device_gib=4",
    "partition.costs=analytic",
    "pipeline.schedule=auto",
    # the batch rule, whose trades these are: under newest (Muon's default, 'auto') 2bw's step holds no error
    # feedback and wins at m = 8 here (newest's own: test_auto_under_newest_prices_2bw_at_its_depth_and_runs_...)
    "pipeline.weight_versions=batch",
]


def test_steps_factor_is_the_measured_ratio_and_unknown_for_adamw_under_2bw():
    muon = OptimConfig(name="muon", delay_correction="error_feedback")
    assert time_to_loss.steps_factor("flush", muon) == time_to_loss.steps_factor("gpipe", muon) == 1.0
    assert time_to_loss.steps_factor("2bw", muon) == pytest.approx(1020 / 900)
    assert time_to_loss.steps_factor("2bw", OptimConfig(name="muon", delay_correction="none")) == pytest.approx(
        210 / 123
    )
    assert time_to_loss.steps_factor("2bw", OptimConfig(name="adamw")) is None  # never reached flush's loss
    predict_ef = OptimConfig(name="muon", delay_correction="predict_error_feedback")  # its own, not plain Muon's
    assert time_to_loss.steps_factor("2bw", predict_ef) == pytest.approx(1000 / 900)


@pytest.mark.parametrize(
    ("batch", "candidates", "expected"),
    [(8, ("2bw", "flush"), "2bw"), (128, ("2bw", "flush"), "flush"), (8, time_to_loss.CANDIDATES, "zb1p")],
)
def test_auto_picks_the_schedule_with_the_least_time_to_a_loss(batch, candidates, expected, monkeypatch):
    # m = 8 on 8 stages: flush idles 7 of 15 ticks, 2bw's faster step outweighs its 1.11x steps (the default's
    # prediction with error feedback); m = 128: it does not;
    # zb1p fills most of flush's bubble and needs no extra steps: 2bw's step is still the faster, zb1p's time the less
    monkeypatch.setattr(time_to_loss, "CANDIDATES", candidates)
    cfg = compose([*DEEP, f"train.global_batch_size={batch}"])
    plans = plan_config(cfg)
    best = plans[0]
    assert set(best.schedule_choice) == set(time_to_loss.CANDIDATES) - {"zbv"}  # zbv: gloo only, not on a CUDA topology
    assert best.schedule == expected == min(best.schedule_choice, key=best.schedule_choice.get)
    assert best.predicted_batch_time_s * best.predicted_steps_factor == pytest.approx(
        best.schedule_choice[best.schedule]
    )
    # the choice is a real trade: 2bw's step is the fastest one every time
    per_step = {s: t / time_to_loss.steps_factor(s, cfg.optim) for s, t in best.schedule_choice.items()}
    assert min(per_step, key=per_step.get) == "2bw"


# a CPU machine of 4 ranks (gloo, where zbv runs), a GPT of 8 blocks (11 layers) on 4 stages, a sample a microbatch
CPU4 = [
    "model=gpt",
    "topology=cpu",
    "topology.devices_per_node=4",
    "topology.cores=4",
    "model.num_layers=8",
    "model.d_model=256",
    "partition.depths=[4]",
    "partition.microbatch_sizes=[1]",
    "partition.costs=analytic",
    "pipeline.schedule=auto",
    "optim.name=muon",
]


@pytest.mark.parametrize(("batch", "expected"), [(16, "zbv"), (2, "zb1p")])
def test_auto_picks_zbv_where_its_smaller_bubble_wins_and_not_where_it_loses(batch, expected):
    # m = 16 on 4 stages: zbv's V fills its bubble (cost.batch_multiplier: m ticks against zb1p's m + (d - 1)/3);
    # m = 2 < 2d - 1: the V's fill and drain are the longer (3.67 ticks against 3.0), zb1p's plan is the faster
    best = plan_config(compose([*CPU4, f"train.global_batch_size={batch}"]))[0]
    assert {"zbv", "zb1p"} <= set(best.schedule_choice)
    assert best.schedule == expected == min(best.schedule_choice, key=best.schedule_choice.get)
    if expected == "zbv":  # its plan: 2d chunks, rank r holding r and 2d-1-r, each with its own layers
        assert len(best.balance) == 2 * best.num_stages == 8 and sum(best.balance) == 11
        assert len(best.predicted_peak_memory_bytes) == best.num_stages


def test_auto_considers_zbv_for_what_an_llm_run_sets_and_skips_it_for_what_zbv_refuses():
    # issue 46: bf16, tied embeddings, validation and packed documents run under zbv now, so schedule=auto
    # plans zbv for such a run (it skipped it silently before); recomputation is still refused: no zbv plan then
    llm = ["train.precision=bf16", "model.tie_embeddings=true", "train.eval_every=10", "data.val_fraction=0.1"]
    llm += ["data.packing=documents", "train.global_batch_size=16"]
    best = plan_config(compose([*CPU4, *llm]))[0]
    assert best.schedule == "zbv" == min(best.schedule_choice, key=best.schedule_choice.get)
    refused = plan_config(compose([*CPU4, *llm, "pipeline.recompute=true"]))[0]
    assert "zbv" not in refused.schedule_choice and refused.schedule != "zbv"


def test_auto_never_picks_2bw_for_an_optimizer_it_is_not_known_to_converge_with(monkeypatch):
    monkeypatch.setattr(time_to_loss, "CANDIDATES", ("2bw", "flush"))
    best = plan_config(compose([*DEEP, "train.global_batch_size=8", "optim.name=adamw"]))[0]
    assert best.schedule == "flush" and math.isinf(best.schedule_choice["2bw"])


def test_a_plan_keeps_its_choice_through_its_file(tmp_path):
    best = plan_config(compose([*DEEP, "train.global_batch_size=8"]))[0]
    assert load_plan(save_plan(best, tmp_path / "plan.yaml")) == best


def test_the_planners_printout_names_the_choice_and_runs_the_chosen_schedule(capsys, tmp_path):
    assert main(["plan", "--out", str(tmp_path / "plan.yaml"), *DEEP, "train.global_batch_size=8"]) == 0
    out = capsys.readouterr().out
    assert "schedule=auto, time to a loss per synchronous step: 2bw " in out and "chosen: zb1p" in out, out
    run_line = out.strip().splitlines()[-1]
    assert "pipeline.schedule=zb1p" in run_line and "pipeline.schedule=auto" not in run_line, run_line


def test_auto_without_the_planner_is_refused_in_one_line():
    cfg = default_plan_choices(compose(["pipeline.schedule=auto"]))
    with pytest.raises(ConfigError, match=r"pipeline.schedule \(auto\) is the planner's choice.*use partition=auto"):
        validate(cfg, world_size=4)


def test_steps_factor_under_newest_is_the_measured_one_at_its_depth_and_else_the_fallback(monkeypatch):
    # pipeline.weight_versions=newest: the staleness of 2bw's early forwards depends on the depth; only d = 2 is
    # measured (docs/convergence.md: 310 / 310 / 310 steps against flush's 300); at any other depth its prediction
    # takes the batch rule's figure with its default correction (time_to_loss.NEWEST_FALLBACK), any other unmeasured
    # setting the optimizer's uncorrected batch-rule figure
    muon, predict = (
        OptimConfig(name="muon", delay_correction="none"),
        OptimConfig(name="muon", delay_correction="predict"),
    )
    newest = dict(weight_versions="newest")
    assert time_to_loss.steps_factor("2bw", muon, **newest, num_stages=2) == pytest.approx(930 / 900)
    assert time_to_loss.steps_factor("2bw", muon, **newest, num_stages=4) == pytest.approx(210 / 123)
    assert time_to_loss.steps_factor("2bw", muon, num_stages=2) == pytest.approx(210 / 123)  # the batch rule's
    assert time_to_loss.steps_factor("flush", muon, **newest, num_stages=2) == 1.0  # moot off 2bw
    assert time_to_loss.steps_factor("2bw", OptimConfig(name="adamw"), **newest, num_stages=2) is None
    assert time_to_loss.steps_factor("2bw", predict, **newest, num_stages=2) == pytest.approx(920 / 900)
    reach = dataclasses.replace(predict, predict_horizon=2.0)  # measured at the default horizon only: the fallback
    assert time_to_loss.steps_factor("2bw", reach, **newest, num_stages=2) == pytest.approx(1000 / 900)
    monkeypatch.setitem(time_to_loss.STEPS_FACTOR, ("muon", "predict", "newest", 2), None)
    assert time_to_loss.steps_factor("2bw", predict, **newest, num_stages=2) == pytest.approx(1000 / 900)
    monkeypatch.setitem(time_to_loss.STEPS_FACTOR, ("muon", "predict", "newest", 2), 0.99)
    assert time_to_loss.steps_factor("2bw", predict, **newest, num_stages=2) == 0.99
    assert time_to_loss.steps_factor("2bw", predict, **newest, num_stages=3) == pytest.approx(1000 / 900)
    monkeypatch.setitem(time_to_loss.STEPS_FACTOR, ("muon", time_to_loss.NEWEST_FALLBACK), None)
    assert time_to_loss.steps_factor("2bw", predict, **newest, num_stages=3) == pytest.approx(210 / 123)


# CPU4's machine and model on 2 ranks at d = 2: where 2bw's 1.02x under newest decides the choice
CPU2 = [*CPU4, "topology.devices_per_node=2", "topology.cores=2", "partition.depths=[2]"]


@pytest.mark.parametrize(
    ("batch", "rule", "expected"), [(2, "newest", "2bw"), (2, "batch", "zb1p"), (64, "newest", "flush")]
)
def test_auto_under_newest_prices_2bw_at_its_depth_and_runs_what_it_chose(batch, rule, expected):
    # m = 2 on 2 stages: 2bw's step is the fastest; at 1.02x steps (newest, d = 2) it wins, at 1.11x (the batch
    # rule's default correction) zb1p does. m = 64: flush's bubble is small, it wins; newest is moot there and the
    # planned run is the batch rule's (validated as such: flush with newest named is refused)
    cfg = compose([*CPU2, f"train.global_batch_size={batch}", f"pipeline.weight_versions={rule}"])
    best = plan_config(cfg)[0]
    assert best.schedule == expected == min(best.schedule_choice, key=best.schedule_choice.get)
    factor = 920 / 900 if rule == "newest" else 1000 / 900
    assert best.schedule_factors == pytest.approx({"2bw": factor, "flush": 1.0, "zb1p": 1.0, "zbv": 1.0})
    assert best.predicted_steps_factor == pytest.approx(best.schedule_factors[expected])
    why = dict(factors=best.schedule_factors, weight_versions=rule)
    line = time_to_loss.describe(best.schedule_choice, cfg.optim, best.schedule, **why)
    assert f"x {factor:.3g} steps ({'newest, ' if rule == 'newest' else ''}delay correction" in line, line
    pipeline, swap = apply_plan(cfg.pipeline, cfg.swap, best, world_size=2, num_layers=sum(best.balance))
    assert pipeline.weight_versions == (rule if expected == "2bw" else "batch")
    validate(default_plan_choices(dataclasses.replace(cfg, pipeline=pipeline, swap=swap)), world_size=2)


@pytest.mark.parametrize(("batch", "expected"), [(2, "2bw"), (64, "flush")])
def test_the_run_line_under_newest_names_the_rule_only_for_2bw(batch, expected, capsys, tmp_path):
    args = [*CPU2, f"train.global_batch_size={batch}", "pipeline.weight_versions=newest"]
    assert main(["plan", "--out", str(tmp_path / "plan.yaml"), *args]) == 0
    out = capsys.readouterr().out
    # Muon's auto correction under newest: its prediction (config/corrections.py), measured at d = 2
    assert "s x 1.02 steps (newest, delay correction predict) = " in out, out
    assert f"; {expected} (newest, delay correction predict); " in out or expected != "2bw", out
    run_line = out.strip().splitlines()[-1]
    assert f"pipeline.schedule={expected}" in run_line, run_line
    assert ("pipeline.weight_versions=newest" in run_line) == (expected == "2bw"), run_line


def test_newest_plans_2bw_at_any_depth_with_replicas_but_no_recompute_or_sharding(monkeypatch):
    # newest runs data_parallel > 1 (config/newest.py): priced at d = 2 (1.02x) against d = 4's fallback (1.71x),
    # 2bw's best plan on 4 ranks is 2 stages x 2 replicas; never recomputation or sharding, which it refuses
    any_depth = [a for a in CPU4 if not a.startswith("partition.depths")]
    monkeypatch.setattr(time_to_loss, "CANDIDATES", ("2bw",))
    newest = compose([*any_depth, "train.global_batch_size=8", "pipeline.weight_versions=newest"])
    plans = plan_config(newest, runners_up=8)
    assert (plans[0].num_stages, plans[0].data_parallel) == (2, 2)
    assert not any(p.recompute or p.sharded for p in plans)
    pipeline, swap = apply_plan(newest.pipeline, newest.swap, plans[0], world_size=4, num_layers=sum(plans[0].balance))
    assert (pipeline.data_parallel, pipeline.weight_versions) == (2, "newest")
    validate(default_plan_choices(dataclasses.replace(newest, pipeline=pipeline, swap=swap)), world_size=4)
    pinned = compose(
        [*any_depth, "partition.depths=[2]", "train.global_batch_size=8", "pipeline.weight_versions=newest"]
    )
    assert {(p.num_stages, p.data_parallel) for p in plan_config(pinned)} == {(2, 2)}


def test_newest_with_the_prediction_plans_every_microbatch_size_with_its_third_weight_copy(monkeypatch):
    # regression: optim.delay_correction=predict under newest needed m >= 2 x stage 0's early forwards, and the planner
    # kept only the (d, b) that met it; now a stage whose early forwards are more than half of m holds a second
    # prediction (config/newest.py's prediction_replicas), which its plan charges: at d = 4 and a batch of 8, b = 2
    # (m = 4) plans, stage 0 (3 early forwards) with three weight copies where the plan without the prediction has two
    monkeypatch.setattr(time_to_loss, "CANDIDATES", ("2bw", "flush"))
    predict = [*CPU4, "train.global_batch_size=8", "pipeline.weight_versions=newest", "partition.microbatch_sizes=[2]"]
    plans = {
        c: plan_config(compose([*predict, f"optim.delay_correction={c}", "pipeline.schedule=2bw"]))[0]
        for c in ("predict", "none")
    }
    assert {(p.num_stages, p.num_microbatches) for p in plans.values()} == {(4, 4)}
    assert plans["predict"].balance == plans["none"].balance
    weights = {c: [st["weights"] for st in p.predicted_memory_breakdown] for c, p in plans.items()}
    assert weights["predict"][0] * 2 == weights["none"][0] * 3 and weights["predict"][1:] == weights["none"][1:]


def test_auto_s_newest_plans_every_layout_and_runs_the_batch_rule_where_newest_does_not():
    # pipeline.weight_versions=auto (the default) chose newest for Muon: the 2bw candidate keeps recomputation,
    # swapping and the rest; a plan with one of them runs the batch rule (plan_rule), priced at its factor (Muon's
    # default correction there, 1.11x), and the Config made with the plan's keys resolves to it
    cfg = compose([*CPU2, "train.global_batch_size=2"])
    assert (cfg.pipeline.weight_versions, cfg.pipeline.auto_weight_versions) == ("newest", True)
    best = plan_config(cfg)[0]
    assert best.schedule == "2bw" and plan_rule(cfg, best) == "newest"
    assert _steps_factor(cfg, best) == pytest.approx(920 / 900)
    recomputed = dataclasses.replace(best, recompute=True)
    assert plan_rule(cfg, recomputed) == "batch" and _steps_factor(cfg, recomputed) == pytest.approx(1000 / 900)
    assert (plan_optim(cfg, best).delay_correction, plan_optim(cfg, recomputed).delay_correction) == (
        "predict",
        "predict_error_feedback",
    )
    pipeline, swap = apply_plan(cfg.pipeline, cfg.swap, recomputed, world_size=2, num_layers=sum(best.balance))
    ran = default_plan_choices(dataclasses.replace(cfg, pipeline=pipeline, swap=swap))
    assert (ran.pipeline.weight_versions, ran.optim.delay_correction) == ("batch", "predict_error_feedback")
    validate(ran, world_size=2)
