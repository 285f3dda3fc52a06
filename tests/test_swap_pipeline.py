"""Swapping inside real pipelines (gloo, CPU): the same losses and weights bit for bit, bounded residency."""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from dist_helper import run_ok
from test_semantics import tiny_config

MIN_BYTES = 4096  # the tiny GPT's (2, 16, 32) float activations are 4 KiB: some storages move, some stay


def _config(schedule: str):
    cfg = tiny_config(schedule=schedule, num_stages=4, num_microbatches=4, num_steps=3)
    cfg.pipeline.balance = [2, 1, 1, 2]  # [embedding, block] [block] [block] [norm, head]: blocks save the most
    return cfg


@functools.lru_cache(maxsize=None)
def _baseline(schedule: str, optimizer: str = "device"):
    run_dir = Path(tempfile.mkdtemp(prefix=f"swap-baseline-{schedule}-"))
    try:
        cfg = _config(schedule)
        cfg.swap.optimizer = optimizer
        summary = run_ok(cfg, run_dir)
        return summary, torch.load(run_dir / "final_model.pt")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,enabled,stages,resident,swapping,recompute",
    [
        # stage 1 holds 3 in flight: swaps; 2 and 3 are not asked; optimizer on host
        (
            "2bw",
            False,
            [0, 1],
            1,
            [0, 1],
            False,
        ),
        # all asked; stages 2, 3 hold <= resident + 1 in flight: nothing to gain
        (
            "flush",
            True,
            None,
            1,
            [0, 1],
            False,
        ),
        ("gpipe", False, [0, 2, 3], 0, [0, 2, 3], False),  # gpipe holds all 4 on every stage; resident 0: no overlap
        # pipeline.recompute: the layers' inputs are what is saved, and what moves; the baseline
        # does not recompute, so this also shows recomputation itself changes no bit.
        ("gpipe", False, [3], 1, [3], True),
    ],
)
def test_swapping_gives_the_same_training_bit_for_bit(
    tmp_path, schedule, enabled, stages, resident, swapping, recompute
):
    cfg = _config(schedule)
    cfg.swap.enabled, cfg.swap.stages, cfg.swap.resident, cfg.swap.min_bytes = enabled, stages, resident, MIN_BYTES
    cfg.pipeline.recompute = recompute
    # the update on the host (2bw) against a baseline whose update is on the host too: the host step's fused Adam
    # (memory/host_optim.py::host_kernel) rounds some elements otherwise than torch's default loop on the device
    cfg.swap.optimizer = "host" if schedule == "2bw" else "device"
    summary = run_ok(cfg, tmp_path)
    base_summary, base_weights = _baseline(schedule, cfg.swap.optimizer)
    weights = torch.load(tmp_path / "final_model.pt")
    assert weights.keys() == base_weights.keys()
    assert all(torch.equal(weights[k], base_weights[k]) for k in weights)  # not to round-off: bit for bit
    assert summary["losses"] == base_summary["losses"]
    assert json.loads(json.dumps(summary)) == summary  # stats are plain JSON
    for r in summary["ranks"]:
        sw = r["swap"]
        if r["stage"] not in swapping:
            assert sw is None
            continue
        assert sw["resident"] == resident and sw["min_bytes"] == MIN_BYTES
        assert sw["swapped_out"] > 0 and sw["unswapped_bytes"] > 0  # both sides of min_bytes occur
        # Each storage sent out came back exactly once, and backward unpacked all of them.
        assert (sw["swapped_in"], sw["swapped_in_bytes"]) == (sw["swapped_out"], sw["swapped_out_bytes"])
        assert sw["unused"] == 0
        # Bytes: at most `resident` waiting microbatches on the device, and less than without swapping.
        assert sw["peak_waiting_bytes"] <= resident * sw["microbatch_bytes"]
        assert sw["peak_device_bytes"] <= (resident + 1) * sw["microbatch_bytes"] + sw["unswapped_bytes"]
        assert sw["peak_device_bytes"] < r["peak_stash_bytes"]
        assert sw["stall_s"] >= 0 and sw["copy_out_s"] > 0 and sw["copy_in_s"] > 0


def test_bug_recompute_kept_a_tuple_input_where_swapping_cannot_see_it(tmp_path):
    """Bug (found by tests/test_matrix.py): RecomputeSequential gave checkpoint a layer's (hidden, mask) input
    as one Python object, which checkpoint keeps outside saved-tensor hooks: with pipeline.recompute, swapping
    moved nothing on a model whose boundaries are tuples. Its tensors now go in as checkpoint's arguments."""
    from matrix import Cell, cell_config

    cell = Cell(
        schedule="flush",
        d=2,
        w=1,
        resume=False,
        swap=True,
        precision="fp32",
        tied=False,
        clip=False,
        skip=False,
        recompute=True,
        host_optim=False,
        validation=False,
        structured=True,
        sharded=False,
        weight_dtype="fp32",
    )
    summary = run_ok(cell_config(cell), tmp_path / "swap")
    cfg = cell_config(cell)
    cfg.swap.enabled = False
    plain = run_ok(cfg, tmp_path / "plain")
    (sw,) = [r["swap"] for r in summary["ranks"] if r["swap"] is not None]  # stage 0: 2 microbatches in flight
    assert sw["swapped_out"] > 0 and sw["swapped_in"] == sw["swapped_out"]
    assert summary["losses"] == plain["losses"]
    swapped, base = torch.load(tmp_path / "swap" / "final_model.pt"), torch.load(tmp_path / "plain" / "final_model.pt")
    assert all(torch.equal(swapped[k], base[k]) for k in base)
