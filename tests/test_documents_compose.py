"""Packed documents (data.packing=documents, issue 45) with bf16, zb1p, activation swapping and optim.sharded: each
against the single-process reference (fp32 rel 1e-5; bf16 as an autocast process that rounds where the pipeline
sends), swapping also bit for bit against the same run without it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from reference import reference_run
from test_documents import doc_config
from test_precision import run_jobs
from test_semantics import assert_losses_close, max_abs_diff

from pipedream2bw.config import gpt_balance, validate

MASK_BYTES = 2 * 16 * 16 * 4  # one block's document mask as attention saves it: (b, 1, T, T) float32, b = 2


def reference(cfg, *, delayed):
    """One process on the pipeline's global batch (its w * m microbatches, each replica's gradients summed first),
    rounding to the compute dtype where a pipeline of ``cfg``'s stages sends."""
    p = cfg.pipeline
    one = dataclasses.replace(
        cfg, pipeline=dataclasses.replace(p, num_microbatches=p.data_parallel * p.num_microbatches)
    )
    balance = gpt_balance(cfg.model, p.num_stages)
    return reference_run(one, delayed=delayed, replicas=(p.data_parallel,) * 2, balance=balance)


def _config(tmp_path, **kw):
    cfg = doc_config(tmp_path, eval_every=0, num_steps=4, **kw)
    validate(cfg, world_size=cfg.pipeline.num_stages * cfg.pipeline.data_parallel)  # accepted: not refused
    return cfg


@pytest.mark.slow
def test_bf16_zb1p_and_swapping_with_documents_train_as_one_process(tmp_path):
    plain = _config(tmp_path)
    bf16 = _config(tmp_path)
    bf16.train.precision = "bf16"
    zb1p = _config(tmp_path, schedule="zb1p")
    swapped = _config(tmp_path)
    # stage 0 holds 2 microbatches in flight under 2bw: with resident 0 the waiting one's saved tensors move,
    # the blocks' document masks among them (attention saves the mask it was given, as float32); the positions are
    # the stage's input, which it holds anyway (never swapped)
    swapped.swap.stages, swapped.swap.resident, swapped.swap.min_bytes = [0], 0, MASK_BYTES
    runs = run_jobs(tmp_path, [plain, bf16, zb1p, swapped], world_size=2)
    for cfg, (summary, weights) in zip([plain, bf16, zb1p], runs):
        ref = reference(cfg, delayed=cfg.pipeline.schedule == "2bw")
        torch.testing.assert_close(weights, ref.weights, rtol=1e-5, atol=1e-7)
        assert_losses_close(summary["losses"], ref.losses)
    assert runs[1][0]["compute_dtype"] == "bfloat16" and max_abs_diff(runs[1][1], runs[0][1]) > 1e-3
    (summary, weights), (base, base_weights) = runs[3], runs[0]
    assert all(torch.equal(weights[k], base_weights[k]) for k in base_weights) and summary["losses"] == base["losses"]
    sw = summary["ranks"][0]["swap"]
    assert sw["swapped_out"] > 0 and (sw["swapped_in"], sw["swapped_in_bytes"]) == (
        sw["swapped_out"],
        sw["swapped_out_bytes"],
    )
    assert sw["unused"] == 0


@pytest.mark.slow
def test_sharded_optimizer_with_documents_trains_as_one_process(tmp_path):
    cfg = _config(tmp_path, d=2, w=2, m=2)
    cfg.optim.sharded = True
    ((summary, weights),) = run_jobs(tmp_path, [cfg], world_size=4)
    ref = reference(cfg, delayed=True)
    torch.testing.assert_close(weights, ref.weights, rtol=1e-5, atol=1e-7)
    assert_losses_close(summary["losses"], ref.losses)
