"""The runtime runs plans: recomputation, partition=auto (rank 0 plans, every rank applies), partition=file."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from dist_helper import run_ok, spawn, train
from reference import reference_train

from partitioner.planner import load_plan, save_plan
from pipedream2bw.config import (
    Config,
    GPTConfig,
    OptimConfig,
    PartitionConfig,
    PipelineConfig,
    TrainConfig,
    WandbConfig,
)


def tiny(**pipeline) -> Config:
    return Config(
        pipeline=PipelineConfig(**{"num_stages": 2, "num_microbatches": 4, "microbatch_size": 2, **pipeline}),
        model=GPTConfig(num_layers=3, d_model=32, num_heads=2, seq_len=16),
        optim=OptimConfig(name="adam", lr=1e-2),
        train=TrainConfig(num_steps=5, log_every=100, warmup_steps=1),
        wandb=WandbConfig(mode="disabled"),
        seed=3,
    )


@pytest.mark.slow
def test_recompute_gives_the_same_training(tmp_path):
    cfg = tiny(recompute=True)
    summary = run_ok(cfg, tmp_path)
    expected, losses = reference_train(cfg, delayed=True)
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected)
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(losses))
    assert summary["recompute"] is True
    # Recomputation keeps less for backward than the plain run's stash.
    plain = run_ok(tiny(), tmp_path / "plain")
    assert max(r["peak_stash_bytes"] for r in summary["ranks"]) < max(r["peak_stash_bytes"] for r in plain["ranks"])


@pytest.mark.slow
def test_auto_plans_on_rank0_and_every_rank_runs_it(tmp_path):
    cfg = dataclasses.replace(
        tiny(schedule="auto"),  # the planner's choice too (issue 46)
        partition=PartitionConfig(mode="auto", cache_dir=str(tmp_path / "cache"), repeats=2, microbatch_sizes=[2, 4]),
    )
    cfg.train.global_batch_size = 16
    summary = run_ok(cfg, tmp_path / "run")
    plan = load_plan(tmp_path / "run" / "plan.yaml")
    assert summary["num_stages"] * summary["data_parallel"] == 2
    assert (summary["balance"], summary["microbatch_size"], summary["num_microbatches"]) == (
        plan.balance,
        plan.microbatch_size,
        plan.num_microbatches,
    )
    assert summary["rank_map"] == plan.rank_map and summary["global_batch_size"] == 16
    # Adam under 2bw is not known to reach a synchronous schedule's loss: the planner ran flush, and says why
    assert summary["schedule"] == plan.schedule == min(plan.schedule_choice, key=plan.schedule_choice.get) != "2bw"
    assert math.isinf(plan.schedule_choice["2bw"])
    assert summary["predicted_samples_per_s"] == plan.predicted_samples_per_s > 0
    assert summary["predicted_peak_memory_bytes"] == plan.predicted_peak_memory_bytes
    print(f"schedule=auto chose {plan.schedule}: {plan.schedule_choice}")
    # partition=file runs the saved plan (here edited by hand: another split, recomputation on, flush: the planner's
    # choice may be zbv, which runs without recomputation)
    edited = dataclasses.replace(
        plan,
        schedule="flush",
        num_stages=2,
        data_parallel=1,
        balance=[2, 4],
        rank_map=[[0], [1]],
        recompute=True,
        num_microbatches=16 // plan.microbatch_size,
    )
    save_plan(edited, tmp_path / "edited.yaml")
    cfg = dataclasses.replace(tiny(), partition=PartitionConfig(mode="file", path=str(tmp_path / "edited.yaml")))
    summary = run_ok(cfg, tmp_path / "file")
    assert summary["balance"] == [2, 4] and summary["recompute"] is True


@pytest.mark.slow
def test_infeasible_auto_plan_fails_on_every_rank_before_any_group(tmp_path):
    cfg = dataclasses.replace(
        tiny(), partition=PartitionConfig(mode="auto", cache_dir=str(tmp_path / "cache"), repeats=1)
    )
    cfg.topology.host_memory_gib = 0.01  # 5 MiB per rank: less than the torch runtime alone
    results = spawn(
        train, world_size=2, args=(cfg, str(tmp_path / "run")), log_dir=Path(tmp_path) / "logs", timeout_s=120
    )
    for r in results:
        assert r.exitcode != 0
        assert "ConfigError: no plan fits" in r.log and "GiB per device" in r.log, r.log
        assert "process group" not in r.log.lower() and "gloo" not in r.log.lower(), r.log


@pytest.mark.slow
def test_a_zbv_plan_runs_from_its_file_as_minibatch_training(tmp_path):
    # issue 46: the planner's zbv plan (balance: 2d chunks, rank r holding r and 2d-1-r) under partition=file, which
    # the runtime refused before; exact against minibatch training, as zbv under partition=manual is
    from partitioner.__main__ import compose
    from partitioner.auto import plan_config

    shape = ["model.num_layers=3", "model.d_model=32", "model.num_heads=2", "model.seq_len=16"]
    batch = ["pipeline.microbatch_size=2", "train.global_batch_size=8", "partition.depths=[2]"]
    overrides = ["model=gpt", "topology=cpu", "partition.costs=analytic", "pipeline.schedule=zbv", *shape, *batch]
    plan = plan_config(compose(overrides))[0]
    assert (plan.schedule, plan.num_stages, len(plan.balance), sum(plan.balance)) == ("zbv", 2, 4, 6)
    save_plan(plan, tmp_path / "plan.yaml")
    cfg = dataclasses.replace(tiny(), partition=PartitionConfig(mode="file", path=str(tmp_path / "plan.yaml")))
    summary = run_ok(cfg, tmp_path / "run")
    assert (summary["schedule"], summary["balance"]) == ("zbv", plan.balance)
    reference = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, num_stages=1, schedule="flush"))
    reference.pipeline.num_microbatches = plan.num_microbatches
    reference.pipeline.microbatch_size = plan.microbatch_size
    expected, losses = reference_train(reference, delayed=False)
    torch.testing.assert_close(torch.load(tmp_path / "run" / "final_model.pt"), expected)
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(losses))
