"""d x w layouts: replicas of each stage average their coalesced gradients with one all-reduce per batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_helper import run_ok
from test_semantics import _oracle, assert_losses_close, tiny_config

from pipedream2bw.config import ConfigError, gpt_balance, validate
from pipedream2bw.pipeline.layout import default_layout, make_layout
from pipedream2bw.pipeline.versions import bucketize
from pipedream2bw.run.model import build_stage_module


def layout_config(schedule: str, d: int, w: int, m: int, **pipeline):
    # SGD with momentum: replicas sum gradients in another order than one pipeline does, and
    # Adam would blow that round-off up into lr-sized steps on parameters whose gradient is
    # exactly zero in theory (the attention key bias), hiding real differences in noise.
    cfg = tiny_config(schedule=schedule, num_stages=d, num_microbatches=m, optim="sgd_momentum")
    cfg.pipeline = dataclasses.replace(cfg.pipeline, data_parallel=w, **pipeline)
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["2bw", "flush", "gpipe"])
def test_layout_invariance(tmp_path, schedule):
    # The same global batches (8 sequences) on three layouts give the same weights and losses.
    runs = {}
    for d, w, m in [(2, 2, 2), (2, 1, 4), (4, 1, 4)]:
        run_dir = tmp_path / f"{d}x{w}"
        summary = run_ok(layout_config(schedule, d, w, m), run_dir)
        assert summary["global_batch_size"] == 8
        runs[(d, w)] = (torch.load(run_dir / "final_model.pt"), summary["losses"])
    for layout in [(2, 1), (4, 1)]:
        torch.testing.assert_close(runs[(2, 2)][0], runs[layout][0])
        assert_losses_close(runs[(2, 2)][1], runs[layout][1])
    if schedule == "2bw":  # and 2BW semantics hold with w > 1
        expected, expected_losses = _oracle(4, "sgd_momentum", True)
        torch.testing.assert_close(runs[(2, 2)][0], expected)
        assert_losses_close(runs[(2, 2)][1], expected_losses)


@pytest.mark.slow
def test_one_all_reduce_per_stage_per_batch(tmp_path):
    cfg = layout_config("2bw", 2, 2, 2)
    summary = run_ok(cfg, tmp_path / "one")
    assert [r["allreduce_calls"] for r in summary["ranks"]] == [cfg.train.num_steps] * 4
    # With small buckets each bucket is reduced once per batch, as soon as backward produced it.
    cfg = layout_config("2bw", 2, 2, 2, bucket_mb=0.01)
    summary = run_ok(cfg, tmp_path / "small")
    balance = gpt_balance(cfg.model, 2)
    for r in summary["ranks"]:
        module = build_stage_module(cfg, balance, r["stage"], None)
        num_buckets = len(bucketize(list(module.parameters()), bucket_bytes=0.01 * 2**20))
        assert num_buckets > 1
        assert r["allreduce_calls"] == cfg.train.num_steps * num_buckets
    torch.testing.assert_close(
        torch.load(tmp_path / "small" / "final_model.pt"), torch.load(tmp_path / "one" / "final_model.pt")
    )


@pytest.mark.slow
def test_explicit_rank_map_with_rank0_on_the_last_stage(tmp_path):
    # rank 0 runs stage 1 of replica 0; it still collects and logs the loss.
    mapped = run_ok(layout_config("flush", 2, 2, 2, rank_map=[[1, 3], [0, 2]]), tmp_path / "mapped")
    plain = run_ok(layout_config("flush", 2, 2, 2), tmp_path / "plain")
    assert mapped["rank_map"] == [[1, 3], [0, 2]]
    assert_losses_close(mapped["losses"], plain["losses"])
    torch.testing.assert_close(
        torch.load(tmp_path / "mapped" / "final_model.pt"), torch.load(tmp_path / "plain" / "final_model.pt")
    )


def test_default_layout_keeps_replicas_on_a_node_when_they_fit():
    assert default_layout(2, 2, ranks_per_node=4).ranks == ((0, 1), (2, 3))  # stage-major
    assert default_layout(4, 2, ranks_per_node=2).ranks == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert default_layout(2, 4, ranks_per_node=2).ranks == ((0, 2, 4, 6), (1, 3, 5, 7))  # replica-major
    assert default_layout(3, 1, ranks_per_node=3).position(2) == (2, 0)


def test_bad_rank_map_is_rejected():
    with pytest.raises(
        ConfigError, match=r"rank_map \(\[\[0, 1\], \[1, 2\]\]\) must have 2 rows .* using each of 0..3 once"
    ):
        make_layout(2, 2, ranks_per_node=4, rank_map=[[0, 1], [1, 2]])


def test_two_ranks_on_one_gpu_is_rejected_under_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = layout_config("2bw", 2, 2, 2)
    with pytest.raises(ConfigError, match=r"4 ranks on this node but 2 GPUs: NCCL needs one GPU per rank"):
        validate(cfg, world_size=4, local_world_size=4)
    cfg.dist.backend = "gloo"
    validate(cfg, world_size=4, local_world_size=4)


@pytest.mark.slow
def test_zbv_with_replicas_equals_minibatch_training(tmp_path):
    # zbv at w=2: each rank's reducer sums both chunks' gradients, armed at the rank's last W of the batch (armed at
    # its first chunk's last W, the other chunk's later W's would count as final); one all-reduce a batch.
    cfg = layout_config("zbv", 2, 2, 2)
    summary = run_ok(cfg, tmp_path)
    expected, expected_losses = _oracle(4, "sgd_momentum", False)
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected)
    assert_losses_close(summary["losses"], expected_losses)
    assert [r["allreduce_calls"] for r in summary["ranks"]] == [cfg.train.num_steps] * 4
