"""A failing or hanging rank makes every rank exit non-zero, promptly, naming the rank that failed."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import torch
from dist_helper import spawn, train_failing_in_setup, train_with_fault
from test_semantics import tiny_config

from pipedream2bw.pipeline.schedule import FORWARD, Action, rank_actions
from pipedream2bw.run.runner import run


@pytest.mark.slow
@pytest.mark.parametrize("failing_layer,failing_rank", [(3, 2), (0, 0), (5, 3)])
def test_rank_that_raises_stops_every_rank(tmp_path, failing_layer, failing_rank):
    cfg = tiny_config(schedule="2bw", num_stages=4, num_microbatches=4, num_steps=20)
    assert cfg.pipeline.balance is None  # layers [0], [1, 2], [3, 4], [5]: layer -> rank below
    results = spawn(
        train_with_fault,
        world_size=4,
        args=(cfg, str(tmp_path), failing_layer, 7, "raise"),
        log_dir=tmp_path,
        timeout_s=240,
    )
    assert all(r.exitcode not in (0, -9) for r in results), [(r.rank, r.exitcode) for r in results]
    assert "injected fault on forward call 7" in results[failing_rank].log
    for r in results:
        assert f"rank {failing_rank} (stage {failing_rank}) failed: RuntimeError: injected fault" in r.log, r.log


@pytest.mark.slow
def test_hanging_rank_times_out_and_stops_every_rank(tmp_path):
    cfg = tiny_config(schedule="flush", num_stages=4, num_microbatches=4, num_steps=20)
    cfg.dist.timeout_s = 5.0
    results = spawn(
        train_with_fault, world_size=4, args=(cfg, str(tmp_path), 3, 5, "hang"), log_dir=tmp_path, timeout_s=240
    )
    assert all(r.exitcode not in (0, -9) for r in results), [(r.rank, r.exitcode) for r in results]
    # Some rank whose wait leads to the hung rank 2 (directly, or through a neighbour that waits
    # on it) times out first and names whom it waited for; every rank, the hung one included,
    # stops on that report.
    first = re.search(
        r"rank ([013]) \(stage [013]\) failed: RuntimeError: rank [013]: receiving from rank \d failed or timed out "
        r"after 0:00:05",
        results[0].log,
    )
    assert first, results[0].log
    for r in results:
        assert first[0] in r.log
    assert f"aborting because {first[0]}" in results[2].log, results[2].log


@pytest.mark.slow
def test_shape_change_is_a_clear_error_not_a_hang(tmp_path):
    # Regression guard for the classic pipeline hang: a stage whose output shape changes
    # mid-run. The sender names the mismatch; every rank stops.
    cfg = tiny_config(schedule="2bw", num_stages=4, num_microbatches=4, num_steps=20)
    results = spawn(
        train_with_fault, world_size=4, args=(cfg, str(tmp_path), 2, 6, "reshape"), log_dir=tmp_path, timeout_s=240
    )
    assert all(r.exitcode not in (0, -9) for r in results), [(r.rank, r.exitcode) for r in results]
    expected = (
        "rank 1 (stage 1) failed: PipelineShapeError: rank 1 sends (2, 15, 32) torch.float32 to rank 2 (tag 0), "
        "but the first microbatch agreed on (2, 16, 32) torch.float32"
    )
    for r in results:
        assert expected in r.log, r.log


@pytest.mark.slow
def test_failure_in_a_replicated_stage_stops_every_rank(tmp_path):
    from test_data_parallel import layout_config

    cfg = layout_config("2bw", 2, 2, 2)
    cfg.train.num_steps = 20
    # layers [0, 1, 2] on stage 0, [3, 4, 5] on stage 1; both replicas of stage 1 run layer 4,
    # and the fault fires on whichever reaches its 7th forward: ranks 2 and 3 may both fail.
    results = spawn(
        train_with_fault, world_size=4, args=(cfg, str(tmp_path), 4, 7, "raise"), log_dir=tmp_path, timeout_s=240
    )
    assert all(r.exitcode not in (0, -9) for r in results), [(r.rank, r.exitcode) for r in results]
    first = re.search(r"rank [23] \(stage 1\) failed: RuntimeError: injected fault on forward call 7", results[0].log)
    assert first, results[0].log
    assert all(first[0] in r.log for r in results)


@pytest.mark.slow
def test_failing_rank_logs_its_steps_with_the_failing_action_marked(tmp_path):
    # flush keeps one weight version, so the layer's 7th forward call is microbatch 6's: F6 on stage 1
    # (layers [0, 1, 2] on stage 0, [3, 4, 5] on stage 1). Its step, as lowered for gloo, is marked.
    cfg = tiny_config(schedule="flush", num_stages=2, num_microbatches=2, num_steps=5)
    results = spawn(
        train_with_fault, world_size=2, args=(cfg, str(tmp_path), 4, 7, "raise"), log_dir=tmp_path, timeout_s=240
    )
    assert all(r.exitcode not in (0, -9) for r in results), [(r.rank, r.exitcode) for r in results]
    actions = rank_actions(
        "flush", stage_index=1, num_stages=2, num_microbatches=2, first_batch=0, num_batches=5, batch_sends=False
    )
    at = actions.index(Action(1, FORWARD, 6))
    log = results[1].log
    assert f"[stage 1/rank 1] failed in action 1F6 (position {at} of {len(actions)})" in log, log
    marked = [line for line in log.splitlines() if ">F6<" in line]
    assert marked == ["step    15: RECV_F7 WAIT_F6 FREE_B5 >F6<"], log
    assert "step    16: B6 SEND_B6" in log  # the steps around it, as they were lowered
    expected = "rank 1 (stage 1) failed: RuntimeError: injected fault on forward call 7"  # re-raised as it was
    assert expected in results[0].log, results[0].log


@pytest.mark.slow
def test_failure_during_set_up_stops_every_rank_naming_it(tmp_path):
    # Issue 34: rank 0 failed while it set up its stage; rank 1, in a set-up collective (new_group) waiting on
    # the store, shared the failure monitor's store connection, so the monitor never saw the failure: rank 1
    # hung until the launcher killed it (or, here, died of a lost connection, naming no cause)
    cfg = tiny_config(schedule="2bw", num_stages=2, num_microbatches=2, num_steps=4)
    results = spawn(train_failing_in_setup, world_size=2, args=(cfg, str(tmp_path), 0), log_dir=tmp_path, timeout_s=240)
    assert all(r.exitcode not in (0, -9) for r in results), [(r.rank, r.exitcode) for r in results]
    expected = "aborting because rank 0 (stage 0) failed: RuntimeError: injected set-up fault"
    assert expected in results[1].log, results[1].log


def _streamed(cfg):
    """``cfg`` with every stage streaming its weights from host memory (swap.weights)."""
    cfg.swap.enabled, cfg.swap.weights, cfg.swap.optimizer, cfg.swap.resident = True, True, "host", 8
    return cfg


@pytest.mark.slow
@pytest.mark.long  # 2 launches, ~37 s on the loaded 2-core machine (the default tier has ~15 s to spare)
def test_a_rank_killed_mid_stream_stops_every_rank_and_its_checkpoints_resume(tmp_path):
    """swap.weights on both stages; rank 1 is SIGKILLed in the forward of batch 5 (between its layers' weight
    copies, one in flight): the other rank exits non-zero naming rank 1, and the checkpoint written before (step 4)
    still loads: the resumed run trains the last steps from it (test_stream's resume test shows a streamed resume
    bit for bit)."""
    cfg = _streamed(tiny_config(schedule="2bw", num_stages=2, num_microbatches=2, num_steps=6))
    cfg.train.checkpoint_every, cfg.dist.timeout_s = 2, 30.0
    # the LM head, on stage 1 (layers 3..5); each 2bw replica has its own copy of the wrapper: replica 0 runs batches
    # 0, 1, 3, 5, and its 7th forward is batch 5's first microbatch
    last = 5
    run_dir = tmp_path / "run"
    results = spawn(
        train_with_fault, world_size=2, args=(cfg, str(run_dir), last, 7, "kill"), log_dir=tmp_path / "killed"
    )
    assert results[1].exitcode == -signal.SIGKILL and results[0].exitcode not in (0, -9), [
        (r.rank, r.exitcode) for r in results
    ]
    # rank 0 waits on rank 1 in a receive (seen here) or for a send (were it sending when rank 1 died)
    died = r"rank 0 \(stage 0\) failed: RuntimeError: rank 0: (receiving from rank 1|a send to rank 1 .*) failed"
    assert re.search(died, results[0].log), results[0].log
    assert not (run_dir / "summary.json").exists()
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert "step_00000004" in saved, saved
    never = 10**9  # the same layers (names), no fault
    resumed = spawn(
        train_with_fault, world_size=2, args=(cfg, str(run_dir), last, never, "kill"), log_dir=tmp_path / "resumed"
    )
    assert all(r.exitcode == 0 for r in resumed), [r.log for r in resumed]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["first_step"] == 4 and len(summary["losses"]) == 6, summary["first_step"]
    assert all(r["stream"]["loads"] > 0 for r in summary["ranks"])


def _train_on_a_small_host(cfg, run_dir: str, available: int) -> None:
    """``run()`` on a host that reports ``available`` bytes of memory; the process groups must never start."""
    from pipedream2bw.pipeline import comm
    from pipedream2bw.run import start

    def no_groups(**kwargs):
        raise AssertionError("the process groups started")

    start.available_host_bytes, comm.init = (lambda: available), no_groups
    run(cfg, Path(run_dir))


@pytest.mark.slow
def test_a_host_that_cannot_hold_the_streamed_buffers_is_refused_before_any_group(tmp_path):
    cfg = _streamed(tiny_config(schedule="2bw", num_stages=2, num_microbatches=2, num_steps=2))
    small = 2**20  # 1 MiB: the tiny GPT's two streamed stages ask for more
    results = spawn(_train_on_a_small_host, world_size=2, args=(cfg, str(tmp_path), small), log_dir=tmp_path)
    assert all(r.exitcode not in (0, -9) for r in results), [(r.rank, r.exitcode) for r in results]
    for r in results:
        assert "the process groups started" not in r.log, r.log
        m = re.search(
            r"ConfigError: swap.weights \(true\): the streamed stages on this host \(stages \[0, 1\], 2 ranks\) "
            r"need (\d+) bytes .* but the host has 1048576 bytes .*stream fewer stages \(swap.stages\)",
            r.log,
        )
        assert m and int(m[1]) > small, r.log


def test_a_transfer_whose_peer_is_gone_before_it_is_posted_names_the_peer():
    """gloo may refuse to post a send or receive at once when the peer's connection is already reset (the long tier's
    killed-rank test met it under load): the error names the transfer and the peer, as a failed wait does."""
    from types import SimpleNamespace

    from pipedream2bw.pipeline.comm import P2P

    class GoneGroup:
        def send(self, tensors, rank, tag):
            raise RuntimeError("[pair.cc:537] Read error: Connection reset by peer")

        recv = send

    p2p = P2P(SimpleNamespace(rank=0), group=GoneGroup())
    p2p._in_group[1] = 1  # the peer's rank in the group, as the first post asks it
    for kind, what in (("send", r"a send to rank 1 \(posting it\)"), ("recv", "receiving from rank 1")):
        with pytest.raises(RuntimeError, match=rf"^rank 0: {what} failed: .*Connection reset by peer"):
            p2p._post(kind, torch.zeros(2), 1, 0)
