"""RankPlan: what each rank runs, built from the config without any process group."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipedream2bw.config import Config, GPTConfig, PipelineConfig, TrainConfig, validate
from pipedream2bw.pipeline.layout import make_layout
from pipedream2bw.run.runtime import RankPlan


def test_every_rank_of_a_rank_map_gets_its_stage_replica_neighbours_and_layers():
    # d=2 stages x w=2 replicas placed by hand: replica 0 is ranks 3 -> 1, replica 1 is ranks 0 -> 2.
    cfg = Config(
        pipeline=PipelineConfig(
            num_stages=2, data_parallel=2, num_microbatches=3, microbatch_size=4, rank_map=[[3, 0], [1, 2]]
        ),
        model=GPTConfig(num_layers=2, seq_len=16),
        train=TrainConfig(num_steps=7, precision="auto"),
    )
    balance = validate(cfg, world_size=4)  # GPT, 2 blocks: [1 + 1, 1 + 2]
    layout = make_layout(2, 2, ranks_per_node=4, rank_map=cfg.pipeline.rank_map)
    plans = [
        RankPlan.from_config(
            cfg,
            layout=layout,
            balance=balance,
            ctx=SimpleNamespace(rank=r, world_size=4, device=torch.device("cpu"), backend="gloo"),
            resume=(Path("ckpt"), {"step": 5}) if r == 1 else None,
        )
        for r in range(4)
    ]
    got = [(p.stage, p.replica, p.prev_rank, p.next_rank, p.layer_indices) for p in plans]
    assert got == [
        (0, 1, None, 2, [0, 1]),
        (1, 0, 3, None, [2, 3, 4]),
        (1, 1, 0, None, [2, 3, 4]),
        (0, 0, None, 1, [0, 1]),
    ]
    assert [p.first_step for p in plans] == [0, 5, 0, 0]
    p = plans[0]
    assert (p.num_stages, p.data_parallel, p.global_batch, p.num_steps, p.seq_len) == (2, 2, 24, 7, 16)
    assert p.precision == "fp32"  # train.precision=auto on a CPU
    assert p.positions() == [(0, 1), (1, 0), (1, 1), (0, 0)]
    assert p.layout_record == {"num_stages": 2, "data_parallel": 2, "balance": [2, 3], "rank_map": [[3, 0], [1, 2]]}
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.stage = 1


@pytest.mark.parametrize("w,optimizer,one", [(1, "device", True), (2, "device", False), (1, "host", False)])
def test_one_optimizer_steps_a_stage_no_reducer_waits_on(w, optimizer, one):
    """At data_parallel 1 no reduction waits on gradient buckets: a stage's untied parameters step in one optimizer
    (a bucket each cost an H200 3 ms a batch of a 12-block GPT, 36 multi-tensor steps instead of one). Replicas
    keep their buckets (each all-reduce starts as its bucket fills), and so does the host optimizer (a copy each)."""
    from pipedream2bw.config import SwapConfig
    from pipedream2bw.models import build_gpt_layers
    from pipedream2bw.run.build import build_versions

    cfg = Config(
        pipeline=PipelineConfig(num_stages=1, data_parallel=w, num_microbatches=2, microbatch_size=1, bucket_mb=0.01),
        model=GPTConfig(num_layers=1, d_model=32, num_heads=2, seq_len=8),
    )
    balance = validate(cfg, world_size=w)
    rt = RankPlan.from_config(
        cfg,
        layout=make_layout(1, w, ranks_per_node=w),
        balance=balance,
        ctx=SimpleNamespace(rank=0, world_size=w, device=torch.device("cpu"), backend="gloo"),
        resume=None,
    )
    module = torch.nn.Sequential(*build_gpt_layers(cfg.model, seed=0))
    swap = SwapConfig(optimizer=optimizer)
    versions, got, _ = build_versions(rt, module, [], bucket_mb=0.01, swap=swap, optim=cfg.optim)
    assert len(got) == len(versions.optimizers) and (len(got) == 1) == one  # 0.01 MB buckets: several otherwise
    assert sorted(i for b in got for i in b) == list(range(len(list(module.parameters()))))
