"""A weight tied between layers on one rank is one parameter there (the runtime reties them: pipeline/ties.py); the
planner counts it once there and once on each stage where its holders are on different stages (partitioner/cost.py's
``Segments.total``, partitioner/vplan.py's ``held_contexts``)."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

from partitioner.__main__ import compose
from partitioner.auto import plan_config
from pipedream2bw.config import ConfigError
from pipedream2bw.models import build_gpt_layers
from pipedream2bw.pipeline.schedule import chunks

# a GPT whose tied (V, C) weight dwarfs its blocks: 2048 x 32 against two blocks of 12 x 32^2
SHAPE = ["model.num_layers=2", "model.d_model=32", "model.num_heads=2", "model.seq_len=16", "model.vocab_size=2048"]
TIED = [
    "model=gpt",
    "topology=cpu",
    "partition.costs=analytic",
    "model.tie_embeddings=true",
    "optim.name=adamw",
    "optim.delay_correction=none",
    "train.precision=fp32",
    "partition.microbatch_sizes=[2]",
    "train.global_batch_size=8",
    *SHAPE,
]


def _plan(schedule: str, d: int, *extra: str):
    cfg = compose([*TIED, f"pipeline.schedule={schedule}", f"partition.depths=[{d}]", *extra])
    return cfg, plan_config(cfg, runtime_bytes=0, devices=d)[0]


def _rank_params(cfg, plan, rank: int) -> int:
    """The parameters rank ``rank`` of ``plan`` holds, each once, as the runtime builds its layers (the GPT's tie one
    parameter where the rank builds both the embedding and the head)."""
    starts = [sum(plan.balance[:v]) for v in range(len(plan.balance) + 1)]
    stages = chunks(plan.schedule, rank, plan.num_stages) if plan.schedule == "zbv" else [rank]
    indices = [i for v in stages for i in range(starts[v], starts[v + 1])]
    layers = build_gpt_layers(cfg.model, seed=0, indices=indices)
    return sum(p.numel() for p in nn.ModuleList(layers).parameters())  # a shared parameter once


# regression: the embedding and the head on one rank (zbv's rank 0: chunks 0 and 2d-1; any schedule at d = 1) were
# each costed with the tied weight, and vplan summed rank 0's two chunks: a whole tied weight's bytes too many in its
# weights, gradient and optimizer state (and its step's largest tensor twice); on two stages each keeps its copy
@pytest.mark.parametrize(("schedule", "d"), [("zbv", 2), ("flush", 1), ("2bw", 1), ("flush", 2)])
def test_a_tied_weight_counts_once_on_a_rank_holding_both_holders_and_once_a_stage_otherwise(schedule, d):
    cfg, plan = _plan(schedule, d)
    versions = 2 if schedule == "2bw" else 1
    for rank, parts in enumerate(plan.predicted_memory_breakdown):
        n = _rank_params(cfg, plan, rank)  # float32, AdamW: 2 states a parameter
        assert (parts["weights"], parts["gradients"], parts["optimizer"]) == (versions * 4 * n, 4 * n, 8 * n), rank


def test_a_zbv_ranks_peak_is_its_two_chunks_together_with_one_step():
    # one optimizer steps a zbv rank's two chunks (run/chunks.py): its peak is the larger of the two chunks' steady
    # states together and their one step (the weight state, the step's transients, no microbatch in flight), not the
    # sum of each chunk's own larger one
    _, plan = _plan("zbv", 2)
    for peak, p in zip(plan.predicted_peak_memory_bytes, plan.predicted_memory_breakdown):
        state = p["weights"] + p["gradients"] + p["optimizer"] + p["buffers"]
        assert peak <= max(state + p["activations"] + p["workspace"], state + p["step"])
    # the step's transients (the CPU's single-tensor AdamW: its largest tensor's, the tied weight's) once on rank 0,
    # as on one stage holding the whole model, not once per chunk
    _, whole = _plan("flush", 1)
    assert plan.predicted_memory_breakdown[0]["step"] == whole.predicted_memory_breakdown[0]["step"] > 0


def test_a_zbv_plan_whose_rank_0_fits_its_one_tied_weight_is_found_where_an_untied_one_is_not():
    # before: rank 0 was costed as if its head had a weight of its own (the untied model's bytes), 4 x the tied
    # weight's (AdamW, float32) too many, and a device with room for one tied weight had no zbv plan
    cfg, untied = _plan("zbv", 2, "model.tie_embeddings=false")
    tie = 4 * cfg.model.vocab_size * cfg.model.d_model  # float32 bytes of one copy
    gib = (max(untied.predicted_peak_memory_bytes) - tie) / 2**30
    _, tied = _plan("zbv", 2, f"topology.memory_per_device_gib={gib}")
    assert max(tied.predicted_peak_memory_bytes) <= max(untied.predicted_peak_memory_bytes) - 4 * tie
    with pytest.raises(ConfigError, match="no zbv plan fits"):
        _plan("zbv", 2, f"topology.memory_per_device_gib={gib}", "model.tie_embeddings=false")


@pytest.mark.slow
@pytest.mark.long
def test_a_zbv_runs_weight_state_on_each_rank_is_its_plans(tmp_path):
    # the runtime's side of the count: each rank's weight version, a float32 gradient of it and its AdamW state (from
    # the run's tensors, summary.json) are the plan's weights + gradients + optimizer state (rank 0: the tie once)
    from dist_helper import run_ok

    from partitioner.planner import save_plan

    cfg, plan = _plan("zbv", 2, "train.num_steps=3", "train.warmup_steps=1", "wandb.mode=disabled")
    save_plan(plan, tmp_path / "plan.yaml")
    cfg.partition = dataclasses.replace(cfg.partition, mode="file", path=str(tmp_path / "plan.yaml"))
    cfg.pipeline = dataclasses.replace(cfg.pipeline, num_stages=2)
    summary = run_ok(cfg, tmp_path / "run")
    assert summary["balance"] == plan.balance
    for r in summary["ranks"]:
        parts = plan.predicted_memory_breakdown[r["stage"]]
        held = 2 * r["weight_bytes"] + r["optimizer_state_bytes"]  # one version under zbv, its float32 gradient
        # (Adam's step counts, 4 B a parameter tensor, are in the run's state and not the plan's)
        assert held == pytest.approx(parts["weights"] + parts["gradients"] + parts["optimizer"], rel=1e-3), r


def test_a_layer_lists_tie_on_one_stage_counts_once(tmp_path):
    # a layer list (run(layers=...), model=hf): its ties are found by identity as the runtime finds them
    # (pipeline.ties.find_ties) and named on the profiled costs; before, each holder counted the shared weight
    from pipedream2bw.models import lm_loss

    cfg = compose([*TIED, "pipeline.schedule=flush", "partition.depths=[1]", "partition.costs=profile"])
    cfg.partition.repeats, cfg.partition.cache_dir = 1, str(tmp_path)
    layers = build_gpt_layers(cfg.model, seed=0)  # the head's weight is the embedding's parameter
    plan = plan_config(cfg, runtime_bytes=0, devices=1, layers=layers, loss_fn=lm_loss)[0]
    n = sum(p.numel() for p in nn.ModuleList(layers).parameters())
    parts = plan.predicted_memory_breakdown[0]
    assert (parts["weights"], parts["gradients"]) == (4 * n, 4 * n)
    assert parts["optimizer"] == pytest.approx(8 * n, rel=1e-3)  # the profiled step's state: Adam's step counts too
