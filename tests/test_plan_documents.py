"""The planner with packed documents (data.packing=documents, issue 45): rows padded to model.seq_len, so a
microbatch costs the windows' figures plus the document mask's; partition=auto plans and runs them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_helper import run_ok
from test_documents import SEQ_LEN, doc_config, reference
from test_semantics import assert_losses_close

from partitioner.auto import make_request, plan_config
from partitioner.planner import load_plan
from partitioner.profile import analytic_gpt, profile_gpt, with_document_mask
from pipedream2bw.config import ConfigError, HFModelConfig, OptimConfig, PartitionConfig, validate

ADAMW = OptimConfig(name="adamw")


def _diff(a, b, key):
    return [getattr(x, key) - getattr(y, key) for x, y in zip(a, b)]


def test_the_analytic_mask_is_what_attention_saves_and_the_positions_cross_every_boundary(tmp_path):
    # measured (saved_tensors_hooks) on packed rows against windows, and the analytic model's difference: each
    # block's SDPA keeps the (b, 1, T, T) mask, converted to float32, for its backward; the positions (b, T) int64
    # travel with the activations into every layer and out of every layer but the head
    cfg = doc_config(tmp_path).model
    b = 2
    windows = profile_gpt(cfg, ADAMW, b, cache_dir=tmp_path, repeats=1)
    packed = profile_gpt(cfg, ADAMW, b, cache_dir=tmp_path, repeats=1, documents=True)
    plain = analytic_gpt(cfg, ADAMW, b, doc_config(tmp_path).topology)
    modeled = with_document_mask(plain, cfg, b, doc_config(tmp_path).topology)
    mask, pos = b * SEQ_LEN * SEQ_LEN * 4, b * SEQ_LEN * 8
    blocks = [i for i, c in enumerate(plain) if c.name.endswith("block")]
    assert [_diff(packed, windows, "saved_bytes")[i] for i in blocks] == [mask] * len(blocks)
    assert [_diff(modeled, plain, "saved_bytes")[i] for i in blocks] == [mask] * len(blocks)
    for key, want in (("input_bytes", [pos] * len(plain)), ("output_bytes", [pos] * (len(plain) - 1) + [0])):
        assert _diff(packed, windows, key) == want and _diff(modeled, plain, key) == want, key
    assert all(
        m.forward_s > p.forward_s and m.backward_s > p.backward_s for i in blocks for m, p in [(modeled[i], plain[i])]
    )
    # the cache keeps the two apart
    assert profile_gpt(cfg, ADAMW, b, cache_dir=tmp_path, repeats=1, documents=True) == packed


def _planned(tmp_path, **partition):
    cfg = doc_config(tmp_path)
    cfg.partition = PartitionConfig(mode="auto", costs="analytic", microbatch_sizes=[1, 2], **partition)
    cfg.train.global_batch_size = 8
    cfg.topology.runtime_overhead_gib = 0.25  # not measured: the two plans compared below differ by the mask alone
    return cfg


def test_plans_for_documents_count_the_mask_and_choose_only_what_documents_run(tmp_path):
    cfg = _planned(tmp_path, depths=[2], swap=False, stream=True)
    cfg.train.eval_every = 0  # streaming refuses validation
    windows = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, packing="windows"))
    req = make_request(cfg, devices=2)
    assert (req.stream, req.tensor, req.tensor_widths) == (False, None, None)  # refused with documents: not searched
    assert make_request(windows, devices=2).stream and make_request(windows, devices=2).tensor is not None
    packed, plain = plan_config(cfg, devices=2), plan_config(windows, devices=2)
    same = [p for p in plain if (p.microbatch_size, p.balance) == (packed[0].microbatch_size, packed[0].balance)]
    assert same and max(packed[0].predicted_peak_memory_bytes) > max(same[0].predicted_peak_memory_bytes)
    assert all(not p.stream_stages and p.tensor_parallel == 1 for p in packed)
    cfg.pipeline.schedule = "auto"  # zb1p among the candidates: documents run it
    assert "zb1p" in plan_config(cfg, devices=2)[0].schedule_choice


def test_partition_auto_with_documents_is_refused_for_model_hf_only(tmp_path):
    cfg = _planned(tmp_path)
    validate(cfg, world_size=2)
    cfg.model = HFModelConfig(name="llama", seq_len=SEQ_LEN)
    with pytest.raises(ConfigError, match=r"partition=auto for model=hf .* data\.packing=windows"):
        validate(cfg, world_size=2, num_layers=4)


@pytest.mark.slow
def test_partition_auto_with_documents_runs_its_plan_as_one_process_trains(tmp_path):
    # rank 0 plans (measured costs, packed rows) and every rank runs the plan: the reference at the plan's layout
    cfg = doc_config(tmp_path, eval_every=0)
    cfg.partition = PartitionConfig(mode="auto", cache_dir=str(tmp_path / "cache"), repeats=1, microbatch_sizes=[1, 2])
    cfg.train.global_batch_size = 8
    summary = run_ok(cfg, tmp_path / "run")
    plan = load_plan(tmp_path / "run" / "plan.yaml")
    assert (summary["num_stages"], summary["microbatch_size"], summary["balance"]) == (
        plan.num_stages,
        plan.microbatch_size,
        plan.balance,
    )
    assert summary["predicted_peak_memory_bytes"] == plan.predicted_peak_memory_bytes
    ran = doc_config(tmp_path, schedule=plan.schedule, d=plan.num_stages, w=plan.data_parallel, m=plan.num_microbatches)
    ran.pipeline.microbatch_size, ran.pipeline.balance = plan.microbatch_size, list(plan.balance)
    ran.train.eval_every = 0
    ref = reference(ran, delayed=plan.schedule == "2bw")
    torch.testing.assert_close(torch.load(tmp_path / "run" / "final_model.pt"), ref.weights, rtol=1e-5, atol=1e-7)
    assert_losses_close(summary["losses"], ref.losses)
