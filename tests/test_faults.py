"""A failing or hanging rank makes every rank exit non-zero, promptly, naming the rank that failed."""

from __future__ import annotations

import time

import pytest

from dist_helper import spawn, train_with_fault
from test_semantics import tiny_config


@pytest.mark.parametrize("failing_layer,failing_rank", [(3, 2), (0, 0), (5, 3)])
def test_rank_that_raises_stops_every_rank(tmp_path, failing_layer, failing_rank):
    cfg = tiny_config(schedule="2bw", num_stages=4, num_microbatches=4, num_steps=20)
    assert cfg.pipeline.balance is None  # layers [0], [1, 2], [3, 4], [5]: layer -> rank below
    start = time.monotonic()
    results = spawn(train_with_fault, world_size=4, args=(cfg, str(tmp_path), failing_layer, 7, "raise"), log_dir=tmp_path, timeout_s=60)
    elapsed = time.monotonic() - start
    assert all(r.exitcode not in (0, -9) for r in results), [(r.rank, r.exitcode) for r in results]
    assert elapsed < 30
    assert "injected fault on forward call 7" in results[failing_rank].log
    for r in results:
        assert f"rank {failing_rank} (stage {failing_rank}) failed: RuntimeError: injected fault" in r.log, r.log


def test_hanging_rank_times_out_and_stops_every_rank(tmp_path):
    cfg = tiny_config(schedule="flush", num_stages=4, num_microbatches=4, num_steps=20)
    cfg.dist.timeout_s = 3.0
    start = time.monotonic()
    results = spawn(train_with_fault, world_size=4, args=(cfg, str(tmp_path), 3, 5, "hang"), log_dir=tmp_path, timeout_s=60)
    elapsed = time.monotonic() - start
    assert all(r.exitcode not in (0, -9) for r in results), [(r.rank, r.exitcode) for r in results]
    assert elapsed < 30
    # A neighbour of the hung rank 2 times out first and names whom it waited for.
    first = [r for r in results if "timed out" in r.log]
    assert first and "rank 2" in first[0].log
    assert "aborting because rank " in results[2].log, results[2].log


def test_shape_change_is_a_clear_error_not_a_hang(tmp_path):
    # Regression guard for the classic pipeline hang: a stage whose output shape changes
    # mid-run. The sender names the mismatch; every rank stops.
    cfg = tiny_config(schedule="2bw", num_stages=4, num_microbatches=4, num_steps=20)
    results = spawn(train_with_fault, world_size=4, args=(cfg, str(tmp_path), 2, 6, "reshape"), log_dir=tmp_path, timeout_s=60)
    assert all(r.exitcode not in (0, -9) for r in results), [(r.rank, r.exitcode) for r in results]
    expected = "rank 1 (stage 1) failed: PipelineShapeError: rank 1 sends (2, 15, 32) torch.float32 to rank 2 (tag 0), " \
        "but the first microbatch agreed on (2, 16, 32) torch.float32"
    for r in results:
        assert expected in r.log, r.log
