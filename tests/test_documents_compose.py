"""Packed documents (data.packing=documents, issue 45) with bf16, zb1p, activation swapping and optim.sharded: each
against the single-process reference (fp32 rel 1e-5; bf16 as an autocast process that rounds where the pipeline
sends), swapping also bit for bit against the same run without it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from reference import reference_run
from test_documents import _hf, doc_config
from test_precision import run_jobs
from test_semantics import assert_losses_close, max_abs_diff

from pipedream2bw.config import validate

MASK_BYTES = 2 * 16 * 16 * 4  # one block's document mask as attention saves it: (b, 1, T, T) float32, b = 2


def reference(cfg, summary):
    """One process on the pipeline's global batch (its w * m microbatches, each replica's gradients summed first),
    rounding to the compute dtype where the pipeline of ``summary`` (its stages' balance) sends."""
    p = cfg.pipeline
    one = dataclasses.replace(
        cfg, pipeline=dataclasses.replace(p, num_microbatches=p.data_parallel * p.num_microbatches)
    )
    delayed = p.schedule == "2bw"
    return reference_run(one, delayed=delayed, replicas=(p.data_parallel,) * 2, balance=summary["balance"])


def assert_as_one_process(cfg, summary, weights):
    ref = reference(cfg, summary)
    torch.testing.assert_close(weights, ref.weights, rtol=1e-5, atol=1e-7)
    assert_losses_close(summary["losses"], ref.losses)


def assert_swapped_bit_for_bit(swapped, plain):
    (summary, weights), (base, base_weights) = swapped, plain
    assert all(torch.equal(weights[k], base_weights[k]) for k in base_weights) and summary["losses"] == base["losses"]
    sw = summary["ranks"][0]["swap"]
    assert sw["swapped_out"] > 0 and sw["unused"] == 0
    assert (sw["swapped_in"], sw["swapped_in_bytes"]) == (sw["swapped_out"], sw["swapped_out_bytes"])


def _config(tmp_path, **kw):
    cfg = doc_config(tmp_path, eval_every=0, num_steps=4, **kw)
    validate(cfg, world_size=cfg.pipeline.num_stages * cfg.pipeline.data_parallel)  # accepted: not refused
    return cfg


@pytest.mark.slow
@pytest.mark.long  # the default tier has these pairs in the matrix's documents cells (tests/matrix.py)
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
        assert_as_one_process(cfg, summary, weights)
    assert runs[1][0]["compute_dtype"] == "bfloat16" and max_abs_diff(runs[1][1], runs[0][1]) > 1e-3
    assert_swapped_bit_for_bit(runs[3], runs[0])


@pytest.mark.slow
def test_sharded_optimizer_with_documents_trains_as_one_process(tmp_path):
    # in the default tier: the matrix's documents cell with optim.sharded has w = 1, where sharding is inert
    cfg = _config(tmp_path, d=2, w=2, m=2)
    cfg.optim.sharded = True
    ((summary, weights),) = run_jobs(tmp_path, [cfg], world_size=4)
    assert_as_one_process(cfg, summary, weights)


@pytest.mark.slow
@pytest.mark.long
def test_a_llama_with_documents_composes_as_the_gpt_does(tmp_path):
    # model=hf's Llama family builds its 4-D mask from the positions in each decoder layer: bf16, zb1p, swapping
    # (bit for bit) at d = 2, optim.sharded at d = 2 x w = 2
    pytest.importorskip("transformers")
    plain, bf16, zb1p, swapped = (_config(tmp_path, **kw) for kw in ({}, {}, {"schedule": "zb1p"}, {}))
    for cfg in (plain, bf16, zb1p, swapped):
        cfg.model = _hf("llama")
    bf16.train.precision = "bf16"
    swapped.swap.stages, swapped.swap.resident, swapped.swap.min_bytes = [0], 0, MASK_BYTES
    runs = run_jobs(tmp_path / "d2", [plain, bf16, zb1p, swapped], world_size=2)
    for cfg, (summary, weights) in zip([plain, bf16, zb1p], runs):
        assert_as_one_process(cfg, summary, weights)
    assert max_abs_diff(runs[1][1], runs[0][1]) > 1e-4  # far outside the comparison's tolerance: bf16 shows
    assert_swapped_bit_for_bit(runs[3], runs[0])
    sharded = _config(tmp_path, d=2, w=2, m=2)
    sharded.model, sharded.optim.sharded = _hf("llama"), True
    ((summary, weights),) = run_jobs(tmp_path / "d2w2", [sharded], world_size=4)
    assert_as_one_process(sharded, summary, weights)
