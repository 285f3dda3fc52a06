"""pipeline.tensor_parallel: each stage's GPT blocks split across t ranks (Megatron's column/row split), exact
against the single-process reference; checkpoints hold whole tensors, so a run resumes at another t."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_helper import run_ok
from reference import reference_run
from test_semantics import assert_losses_close, tiny_config


def tp_config(schedule: str, d: int, w: int, t: int = 2, *, m: int = 2, num_steps: int = 6):
    """The tiny GPT (2 heads, MLP width 128) with tied embeddings and dropout 0.1, SGD with momentum."""
    cfg = tiny_config(schedule=schedule, num_stages=d, num_microbatches=m, optim="sgd_momentum", num_steps=num_steps)
    cfg.pipeline = dataclasses.replace(cfg.pipeline, data_parallel=w, tensor_parallel=t)
    cfg.model = dataclasses.replace(cfg.model, tie_embeddings=True, dropout=0.1)
    return cfg


def reference(cfg, *, w: int):
    """The unpartitioned model trained on the same global batches (m * w microbatches a batch)."""
    m = cfg.pipeline.num_microbatches * w
    p = dataclasses.replace(cfg.pipeline, num_stages=1, data_parallel=1, tensor_parallel=1, num_microbatches=m)
    return reference_run(dataclasses.replace(cfg, pipeline=p), delayed=cfg.pipeline.schedule == "2bw", replicas=(w, w))


@pytest.mark.slow
@pytest.mark.parametrize("schedule,d,w", [("2bw", 2, 1), ("flush", 1, 2)])
def test_tensor_parallel_equals_reference(tmp_path, schedule, d, w):
    cfg = tp_config(schedule, d, w)
    summary = run_ok(cfg, tmp_path)
    ref = reference(cfg, w=w)
    weights = torch.load(tmp_path / "final_model.pt")
    assert weights.keys() == ref.weights.keys()
    torch.testing.assert_close(weights, ref.weights, rtol=1e-5, atol=1e-6)
    assert_losses_close(summary["losses"], ref.losses)


@pytest.mark.slow
def test_tensor_parallel_clips_by_the_global_norm_of_every_shard_once(tmp_path):
    # The global norm sums each split parameter's pieces over the tensor group and counts the whole ones (norms,
    # biases after the sum, embedding, head) once: counted on every tensor rank, the clip would scale differently.
    cfg = tp_config("2bw", 2, 1)
    cfg.optim.clip_grad_norm = 0.05  # below every step's norm: each step is clipped
    summary = run_ok(cfg, tmp_path)
    ref = reference(cfg, w=1)
    assert min(ref.grad_norms) > cfg.optim.clip_grad_norm
    torch.testing.assert_close(summary["grad_norms"], ref.grad_norms, rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), ref.weights, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.long  # four runs, two of 4 ranks: a minute or two loaded
@pytest.mark.parametrize("t_before,t_after", [(2, 1), (1, 2)])
def test_checkpoint_holds_whole_tensors_and_resumes_at_another_t(tmp_path, t_before, t_after):
    # 3 steps at t_before, checkpointed; 3 more at t_after from it: the 6-step reference (both weight versions and
    # the momenta were saved whole and cut again), and the checkpoint's tensors have the unsplit shapes.
    src = tmp_path / "src"
    before = tp_config("2bw", 2, 1, t_before, num_steps=3)
    before.train.checkpoint_every = 3
    run_ok(before, src)
    layer = torch.load(src / "checkpoints" / "step_00000003" / "layer_00001.pt")
    assert layer["weights"]["1.qkv.weight"].shape == (96, 32) and layer["optimizer"]["1.fc.weight"][
        "momentum_buffer"
    ].shape == (128, 32)
    after = tp_config("2bw", 2, 1, t_after)
    after.train.resume = str(src)
    summary = run_ok(after, tmp_path / "after")
    assert summary["first_step"] == 3
    ref = reference(after, w=1)
    torch.testing.assert_close(torch.load(tmp_path / "after" / "final_model.pt"), ref.weights, rtol=1e-5, atol=1e-6)
    assert_losses_close(summary["losses"], ref.losses)
