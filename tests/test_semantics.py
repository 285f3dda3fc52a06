"""The 2BW contract on real processes: pipeline weights against single-process oracles (gloo, CPU)."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from dist_helper import run_ok, train_counting_split_backwards
from reference import reference_train

from pipedream2bw.config import (
    Config,
    GPTConfig,
    LayerListConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
    WandbConfig,
)

OPTIMIZERS = {
    "sgd_momentum": OptimConfig(name="sgd", lr=0.2, kwargs={"momentum": 0.9}),
    "adam": OptimConfig(name="adam", lr=1e-2),
}


def tiny_config(
    *, schedule: str, num_stages: int, num_microbatches: int, optim: str = "adam", num_steps: int = 6
) -> Config:
    return Config(
        pipeline=PipelineConfig(
            schedule=schedule, num_stages=num_stages, num_microbatches=num_microbatches, microbatch_size=2
        ),
        model=GPTConfig(num_layers=3, d_model=32, num_heads=2, seq_len=16),
        # a test may change its copy (e.g. clipping) without leaking into later tests
        optim=copy.deepcopy(OPTIMIZERS[optim]),
        train=TrainConfig(num_steps=num_steps, log_every=100, warmup_steps=1),
        wandb=WandbConfig(mode="disabled"),
        seed=3,
    )


@functools.lru_cache(maxsize=None)
def _oracle(num_microbatches: int, optim: str, delayed: bool):
    cfg = tiny_config(schedule="2bw", num_stages=1, num_microbatches=num_microbatches, optim=optim)
    return reference_train(cfg, delayed=delayed)


def assert_losses_close(actual, expected) -> None:
    """Batch losses are float32 values: compare them at float32 round-off."""
    torch.testing.assert_close(torch.tensor(actual, dtype=torch.float32), torch.tensor(expected, dtype=torch.float32))


def max_abs_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("optim", sorted(OPTIMIZERS))
@pytest.mark.parametrize("d,m", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_2bw_equals_delayed_update_rule(tmp_path, d, m, optim):
    summary = run_ok(tiny_config(schedule="2bw", num_stages=d, num_microbatches=m, optim=optim), tmp_path)
    weights = torch.load(tmp_path / "final_model.pt")
    expected, expected_losses = _oracle(m, optim, True)
    assert weights.keys() == expected.keys()
    torch.testing.assert_close(weights, expected)
    assert_losses_close(summary["losses"], expected_losses)
    # ...and 2BW is not plain synchronous training: the difference is far above round-off.
    synchronous, _ = _oracle(m, optim, False)
    assert max_abs_diff(weights, synchronous) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["flush", "gpipe"])
@pytest.mark.parametrize("d,m", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_flushing_schedules_equal_minibatch_training(tmp_path, schedule, d, m):
    optim = "sgd_momentum" if m == d else "adam"
    summary = run_ok(tiny_config(schedule=schedule, num_stages=d, num_microbatches=m, optim=optim), tmp_path)
    expected, expected_losses = _oracle(m, optim, False)
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected)
    assert_losses_close(summary["losses"], expected_losses)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,d,m", [("zb1p", 2, 4), ("zb1p", 4, 8), ("zbv", 2, 4), ("zbv", 2, 8)])
def test_zero_bubble_equals_minibatch_training(tmp_path, schedule, d, m):
    """The split backward (B: input gradients, W: weight gradients, later) is flush's update, exactly: zb1p, and zbv's
    two chunks a rank (0 and 3 on rank 0, 1 and 2 on rank 1 at d=2; 1 -> 2 a hand-off in memory)."""
    cfg = tiny_config(schedule=schedule, num_stages=d, num_microbatches=m, optim="adam")
    summary = run_ok(cfg, tmp_path, fn=train_counting_split_backwards)
    expected, expected_losses = _oracle(m, "adam", False)
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected)
    assert_losses_close(summary["losses"], expected_losses)
    assert summary["schedule"] == schedule
    split = [{tuple(x) for x in json.loads((tmp_path / f"split_backwards_rank{r}.json").read_text())} for r in range(d)]
    steps = range(cfg.train.num_steps * m)
    if schedule == "zb1p":  # every B of every stage (the first stage's too: no input gradient, all of it left to W)
        assert split == [{(s, k) for k in steps} for s in range(d)]
    else:  # zbv: chunk 2's B runs the whole backward where its W follows at once, all but each batch's last (issue 46)
        rank1 = {(1, k) for k in steps} | {(2, k) for k in steps[m - 1 :: m]}
        assert split == [{(v, k) for v in (0, 3) for k in steps}, rank1]


@pytest.mark.slow
def test_zero_bubble_v_with_boundaries_of_two_widths(tmp_path):
    # Rank 0 sends chunk 0's (B, T, 8) to rank 1 and receives chunk 2's (B, T, 16) back, on the same tags: P2P agrees
    # a shape per direction (one agreement for both failed the second transfer's shape check). Against one process.
    runs = {}
    for schedule, d, balance in (("zbv", 2, [1, 1, 1, 3]), ("flush", 1, None)):
        cfg = tiny_config(schedule=schedule, num_stages=d, num_microbatches=4, optim="sgd_momentum", num_steps=3)
        cfg.model = LayerListConfig(target="custom_models.widening_layers", kwargs={"width": 8}, seq_len=8)
        cfg.pipeline.balance = balance
        summary = run_ok(cfg, tmp_path / schedule)
        runs[schedule] = (torch.load(tmp_path / schedule / "final_model.pt"), summary["losses"])
    torch.testing.assert_close(runs["zbv"][0], runs["flush"][0])
    assert_losses_close(runs["zbv"][1], runs["flush"][1])


@pytest.mark.slow
@pytest.mark.parametrize("w", [pytest.param(1, marks=pytest.mark.long), 2])
def test_zero_bubble_v_with_tied_embeddings_equals_minibatch_training(tmp_path, w):
    # zbv (issue 46): the embedding (chunk 0) and the head (chunk 3) are both on rank 0, one parameter there whose
    # gradient both chunks' W's accumulate, no exchange. At w=2 the reducer is armed at rank 0's last W of a batch
    # (chunk 0's), which reports chunk 3's parameters ready but not the tie: its own hook does, once, when whole.
    cfg = tiny_config(schedule="zbv", num_stages=2, num_microbatches=4 // w, optim="sgd_momentum", num_steps=4)
    cfg.pipeline.data_parallel = w
    cfg.model.tie_embeddings = True
    summary = run_ok(cfg, tmp_path)
    ref = tiny_config(schedule="2bw", num_stages=1, num_microbatches=4, optim="sgd_momentum", num_steps=4)
    ref.model.tie_embeddings = True
    expected, expected_losses = reference_train(ref, delayed=False)
    weights = torch.load(tmp_path / "final_model.pt")
    torch.testing.assert_close(weights, expected)
    assert_losses_close(summary["losses"], expected_losses)
    (tie,) = summary["ties"]
    assert tie["stages"] == [0] and summary["tie_allreduce_calls"] == [0] * (2 * w)
    embedding, head = tie["names"]
    assert torch.equal(weights[embedding], weights[head])


@pytest.mark.slow
def test_zero_bubble_v_with_a_host_optimizer_equals_minibatch_training(tmp_path):
    # zbv (issue 46) with swap.optimizer=host: the rank's masters and optimizer state in host memory, both chunks'
    # gradients copied out at the rank's last W of a batch and stepped there (the rank's one step).
    cfg = tiny_config(schedule="zbv", num_stages=2, num_microbatches=4, optim="sgd_momentum", num_steps=4)
    cfg.swap.optimizer = "host"
    summary = run_ok(cfg, tmp_path)
    expected, expected_losses = reference_train(
        tiny_config(schedule="flush", num_stages=1, num_microbatches=4, optim="sgd_momentum", num_steps=4),
        delayed=False,
    )
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected)
    assert_losses_close(summary["losses"], expected_losses)


@pytest.mark.slow
@pytest.mark.long
def test_zero_bubble_v_at_three_ranks_equals_minibatch_training(tmp_path):
    # d=3: a middle rank (chunks 1 and 4) that receives from and sends to both neighbours on the same tags. SGD with
    # momentum: Adam turns round-off on the attention key bias's ~zero gradient into lr-sized steps (1e-5 here).
    cfg = tiny_config(schedule="zbv", num_stages=3, num_microbatches=6, optim="sgd_momentum")
    cfg.model.num_layers = 4  # 6 layers: one a chunk
    summary = run_ok(cfg, tmp_path)
    ref = tiny_config(schedule="2bw", num_stages=1, num_microbatches=6, optim="sgd_momentum")
    ref.model.num_layers = 4
    expected, expected_losses = reference_train(ref, delayed=False)
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected)
    assert_losses_close(summary["losses"], expected_losses)


@pytest.mark.parametrize(
    "schedule,d,m", [("2bw", 2, 4), pytest.param("2bw", 4, 8, marks=pytest.mark.long), ("flush", 4, 8)]
)
def test_forward_lead_equals_the_same_update_rule(tmp_path, schedule, d, m):
    """pipeline.forward_lead=1 reorders each stage's forwards, not what they compute: 2bw's delayed rule and
    flush's synchronous one, exactly (under 2bw the extra forward is still batch t+1's, on W(t))."""
    cfg = tiny_config(schedule=schedule, num_stages=d, num_microbatches=m, optim="adam")
    cfg.pipeline.forward_lead = 1
    summary = run_ok(cfg, tmp_path)
    expected, expected_losses = _oracle(m, "adam", schedule == "2bw")
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected)
    assert_losses_close(summary["losses"], expected_losses)
    assert [r["peak_in_flight"] for r in summary["ranks"]] == [min(d - s + (s < d - 1), m) for s in range(d)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["2bw", "flush", "gpipe"])
def test_results_do_not_depend_on_depth(tmp_path, schedule):
    runs = {}
    for d in (1, 2, 4):
        summary = run_ok(tiny_config(schedule=schedule, num_stages=d, num_microbatches=4), tmp_path / f"d{d}")
        runs[d] = (torch.load(tmp_path / f"d{d}" / "final_model.pt"), summary["losses"])
    for d in (2, 4):
        torch.testing.assert_close(runs[d][0], runs[1][0])
        assert_losses_close(runs[d][1], runs[1][1])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["2bw", "flush", "zb1p", "gpipe"])
def test_sends_batched_with_the_next_receive_give_the_same_results(tmp_path, schedule):
    # The NCCL transfer mode (each send started with the next receive), exercised on gloo.
    cfg = tiny_config(schedule=schedule, num_stages=4, num_microbatches=4, optim="sgd_momentum")
    cfg.dist.batch_p2p = True
    summary = run_ok(cfg, tmp_path)
    expected, expected_losses = _oracle(4, "sgd_momentum", schedule == "2bw")
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected)
    assert_losses_close(summary["losses"], expected_losses)


@pytest.mark.slow
def test_same_global_batch_split_differently_gives_the_same_training(tmp_path):
    # The coalescing contract: (m=4, b=2) and (m=2, b=4) see the same 8 sequences per batch.
    runs = []
    for m, b in [(4, 2), (2, 4)]:
        cfg = tiny_config(schedule="2bw", num_stages=2, num_microbatches=m, optim="sgd_momentum")
        cfg.pipeline.microbatch_size = b
        summary = run_ok(cfg, tmp_path / f"m{m}")
        runs.append((torch.load(tmp_path / f"m{m}" / "final_model.pt"), summary["losses"]))
    torch.testing.assert_close(runs[0][0], runs[1][0])
    assert_losses_close(runs[0][1], runs[1][1])


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("schedule", ["2bw", "flush", "zb1p", "gpipe"])
def test_nccl_pipeline_matches_the_oracle(tmp_path, schedule):
    # NCCL p2p with each send batched with the next receive, one GPU per rank. GPU kernels
    # round differently from the CPU oracle, hence the looser tolerance.
    cfg = tiny_config(schedule=schedule, num_stages=2, num_microbatches=4, optim="sgd_momentum")
    cfg.dist.backend = "nccl"
    summary = run_ok(cfg, tmp_path)
    expected, expected_losses = _oracle(4, "sgd_momentum", schedule == "2bw")
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(expected_losses), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["2bw", "flush", "gpipe"])
def test_sent_tensors_are_freed_as_the_run_goes(tmp_path, schedule):
    """gloo reports a send complete only when waited on: without releases proven by the peers'
    later transfers, every activation and gradient sent would be held until the run ends."""
    cfg = tiny_config(schedule=schedule, num_stages=4, num_microbatches=4, optim="sgd_momentum", num_steps=12)
    summary = run_ok(cfg, tmp_path)
    for r in summary["ranks"]:
        # At most what is in flight each way (plus a batch under gpipe), whatever the number of steps
        # (12 steps x 4 microbatches x 2 directions = 96 sends per middle stage).
        assert 0 < r["peak_pending_sends"] <= 2 * 4 + 2, r
