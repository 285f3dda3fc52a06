"""optim.sharded (ZeRO-1 over a stage's replicas) and train.weight_dtype: oracles, measured memory, refusals."""

from __future__ import annotations

import pytest
import torch
from dist_helper import run_ok
from reference import reference_run, reference_train
from test_models import tied_config
from test_precision import fp16_config, inf_gradient_layers, run_jobs
from test_semantics import tiny_config

from pipedream2bw.config import Config, ConfigError, gpt_balance, validate
from pipedream2bw.sharding import BucketShard


def _replicated(cfg: Config, w: int, *, sharded: bool = True) -> Config:
    """``cfg``'s 4 microbatches of 4 sequences, split over ``w`` replicas (the same batches at every w)."""
    cfg.pipeline.data_parallel, cfg.pipeline.microbatch_size = w, 4 // w
    cfg.optim.sharded = sharded
    return cfg


def test_bucket_shards_cover_the_bucket_once():
    numels = (5, 1, 7, 3)  # 16 elements: S = 6 at w = 3 (the last shard padded), S = 4 at w = 4
    for w in (1, 2, 3, 4, 7, 20):
        layouts = [BucketShard((3, 0, 2, 1), numels, r, w) for r in range(w)]
        covered = [(p.param, e) for layout in layouts for p in layout.pieces() for e in range(p.start, p.stop)]
        assert sorted(covered) == sorted((i, e) for i, n in zip((3, 0, 2, 1), numels) for e in range(n))
        for layout in layouts:  # pieces sit in the shard in flat order, within its S elements
            offsets = [(p.offset, p.offset + p.stop - p.start) for p in layout.pieces()]
            assert all(0 <= a < b <= layout.shard_numel for a, b in offsets)


@pytest.mark.parametrize("schedule,w", [("2bw", 2), ("2bw", 4), ("flush", 2), ("flush", 4)])
def test_sharded_tied_clipped_equals_the_reference(tmp_path, schedule, w):
    """d=2 x w: the tied GPT with active clipping, sharded, ends on the single-process reference's weights
    with its gradient norms (every shard counted once, the tie once)."""
    cfg = _replicated(tied_config(schedule, 2), w)
    cfg.optim.clip_grad_norm = 1e-3
    cfg.optim.kwargs = {"momentum": 0.9, "weight_decay": 0.01}
    summary = run_ok(cfg, tmp_path, timeout_s=300)
    reference = tied_config(schedule, 1)
    reference.optim, reference.pipeline.microbatch_size = cfg.optim, 4
    expected = reference_run(reference, delayed=schedule == "2bw")
    assert min(expected.grad_norms) > cfg.optim.clip_grad_norm  # the clip is active on every step
    torch.testing.assert_close(torch.tensor(summary["grad_norms"]), torch.tensor(expected.grad_norms))
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected.weights)
    assert summary["ties"][0]["checked_steps"] == cfg.train.num_steps  # the tied copies stayed bit-identical


def test_sharded_adamw_equals_unsharded_with_a_wth_of_the_optimizer_state(tmp_path):
    """d=2 x w=4, AdamW under 2bw: the sharded run's weights are the unsharded run's to float32 round-off,
    and each rank measures 1/w of the unsharded run's optimizer state (within one bucket's padding)."""
    runs = {}
    for sharded in (False, True):
        cfg = _replicated(tiny_config(schedule="2bw", num_stages=2, num_microbatches=4), 4, sharded=sharded)
        cfg.optim.name, cfg.optim.kwargs = "adamw", {"weight_decay": 0.1}
        summary = run_ok(cfg, tmp_path / str(sharded), timeout_s=300)
        runs[sharded] = summary, torch.load(tmp_path / str(sharded) / "final_model.pt")
    (plain, plain_weights), (sharded, sharded_weights) = runs[False], runs[True]
    torch.testing.assert_close(sharded_weights, plain_weights)
    assert sharded["losses"] == plain["losses"]
    for a, b in zip(plain["ranks"], sharded["ranks"]):
        # Adam: two float32 moments per element and a step count per parameter (or piece); the last replica's
        # shard lacks the padding (at most w - 1 elements of the one bucket): 512 B is well within one bucket
        assert abs(b["optimizer_state_bytes"] - a["optimizer_state_bytes"] / 4) <= 512, (a, b)


def test_sharded_fp16_skip_host_optimizer_and_swapping_equal_the_scaled_reference(tmp_path):
    """d=2 x w=2 under 2bw, sharded with the shards on the host (swap.optimizer=host), activations swapped,
    fp16 loss scaling, an inf in stage 0's gradient on replica 1 only at batch 3: every rank skips batch 3
    (replica 0's shard is finite: it skips by agreement), the scales follow the scaler, and the weights
    are the reference's that skips batch 3, at fp16's tolerance (as test_precision's unsharded run)."""
    steps, batch = 8, 3
    cfg = fp16_config(d=2, w=2, steps=steps)
    cfg.train.checkpoint_every = 0
    cfg.optim.sharded, cfg.swap.optimizer, cfg.swap.enabled, cfg.swap.min_bytes = True, "host", True, 0
    cfg.swap.resident = 0  # stage 0 holds 2 microbatches in flight: one waits on the host
    m = cfg.pipeline.num_microbatches
    ((summary, weights),) = run_jobs(tmp_path, [cfg], world_size=4, inject={0: (1, 1, batch * m + 1)})
    assert [r["skipped_steps"] for r in summary["ranks"]] == [[batch]] * 4
    assert [(r["swap"] or {}).get("swapped_out_bytes", 0) > 0 for r in summary["ranks"]] == [True, True, False, False]
    oracle = fp16_config(d=1, w=1, steps=steps)
    info = {}
    expected, losses = reference_train(
        oracle,
        delayed=True,
        balance=gpt_balance(oracle.model, 2),
        layers=inf_gradient_layers(oracle, layer=1, call=batch * 4 + 4 // 2 + 1),
        info=info,
    )
    assert info["skipped_steps"] == [batch] and summary["loss_scale"]["per_step"] == info["loss_scales"]
    fp16_close = dict(rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(weights, expected, **fp16_close)
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(losses), **fp16_close)


def test_sharding_refuses_what_it_cannot_step_or_save():
    cfg = _replicated(tiny_config(schedule="2bw", num_stages=2, num_microbatches=4), 2)
    cfg.optim.target = "torch.optim.SGD"
    with pytest.raises(ConfigError, match=r"optim.sharded \(true\) steps pieces .* optimizer; torch.optim.SGD"):
        validate(cfg, world_size=4)
    cfg.optim.target, cfg.train.checkpoint_every = None, 2
    with pytest.raises(ConfigError, match=r"train.checkpoint_every \(2\) with optim.sharded"):
        validate(cfg, world_size=4)
    cfg.pipeline.data_parallel = 1  # nothing to shard over: accepted, and a plain run
    validate(cfg, world_size=2)
    cfg.train.precision, cfg.train.weight_dtype, cfg.train.checkpoint_every = "bf16", "compute", 0
    cfg.model.tie_embeddings = True
    with pytest.raises(ConfigError, match=r"train.weight_dtype \(compute\) with model.tie_embeddings"):
        validate(cfg, world_size=2)
    cfg.train.weight_dtype = "bf16"
    with pytest.raises(ConfigError, match=r"train.weight_dtype \('bf16'\) is unknown"):
        validate(cfg, world_size=2)


def _bf16_versions(w: int, sharded: bool) -> Config:
    cfg = _replicated(tiny_config(schedule="2bw", num_stages=2, num_microbatches=4, num_steps=4), w, sharded=sharded)
    cfg.train.precision, cfg.train.weight_dtype = "bf16", "compute"
    return cfg


def test_bf16_weight_versions_equal_the_rounded_masters_reference(tmp_path):
    """train.weight_dtype=compute under bf16, 2bw, d=2: the versions are bf16 roundings of float32 masters,
    microbatch gradients summed in float32, the stages run in bf16. w=1: equal to the single-process
    reference applying that rule; the rounding shows (far from the float32-versions reference). w=2,
    sharded: equal to the unsharded w=2 run (both sum the replicas in another order than one process)."""
    cfgs = [_bf16_versions(1, False), _bf16_versions(2, False), _bf16_versions(2, True)]
    runs = [
        run_jobs(tmp_path / f"w{c.pipeline.data_parallel}", [c], world_size=2 * c.pipeline.data_parallel)[0]
        for c in cfgs[:1]
    ] + run_jobs(tmp_path / "w2", cfgs[1:], world_size=4)
    (summary, weights), (_, plain), (_, sharded) = runs
    reference = tiny_config(schedule="2bw", num_stages=1, num_microbatches=4, num_steps=4)
    reference.train, reference.pipeline.microbatch_size = cfgs[0].train, 4
    expected = reference_run(reference, delayed=True, balance=summary["balance"])
    assert all(v.dtype == torch.bfloat16 for v in weights.values())  # the newest version, as stored
    torch.testing.assert_close(weights, {k: v.to(torch.bfloat16) for k, v in expected.weights.items()})
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(expected.losses))
    reference.train.weight_dtype = "fp32"
    fp32_versions = reference_run(reference, delayed=True, balance=summary["balance"])
    assert max(float((expected.weights[k] - fp32_versions.weights[k]).abs().max()) for k in weights) > 1e-3
    torch.testing.assert_close(sharded, plain)
