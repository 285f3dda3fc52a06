"""Layers with state besides parameters: dropout's random streams and BatchNorm's statistics, exact under 2bw,
resume, recomputation and any partition (pipedream2bw/pipeline/stateful.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from custom_models import stateful_layers
from dist_helper import run_ok
from reference import reference_run
from test_checkpoint import assert_equal_bits, weights
from test_semantics import tiny_config
from torch import nn

from pipedream2bw.config import LayerListConfig
from pipedream2bw.pipeline import stateful
from pipedream2bw.pipeline.versions import WeightVersions
from pipedream2bw.run.model import stage_module


def stateful_config(*, d: int = 2, m: int = 2, steps: int = 4, recompute: bool = False, every: int = 0):
    cfg = tiny_config(schedule="2bw", num_stages=d, num_microbatches=m, optim="sgd_momentum", num_steps=steps)
    cfg.model = LayerListConfig(target="custom_models.stateful_layers", kwargs={"width": 16, "p": 0.5}, seq_len=8)
    cfg.pipeline.recompute = recompute
    cfg.train.checkpoint_every = every
    return cfg


@pytest.mark.slow
def test_2bw_with_dropout_and_batchnorm_resumes_bit_for_bit_and_equals_the_reference(tmp_path):
    """Regressions (issue 33): stage 0's checkpoint took its RNG state after batch t+1's first forward had drawn
    (resumed losses differed from step 3); recomputation counted BatchNorm statistics twice; every stage seeded
    the same stream; under 2bw each weight version kept its own statistics (half the forwards each)."""
    cfg = stateful_config(recompute=True, every=2)
    straight = run_ok(cfg, tmp_path / "straight")
    # from a checkpoint of a run that went on (a 2-step run's last step has no batch t+1 forwards before it)
    cfg.train.resume = str(tmp_path / "straight/checkpoints/step_00000002")
    resumed = run_ok(cfg, tmp_path / "resumed")
    assert resumed["first_step"] == 2
    assert resumed["losses"] == straight["losses"]
    assert_equal_bits(weights(tmp_path / "resumed"), weights(tmp_path / "straight"))
    # the 2bw rule on the unpartitioned model, each layer on its own stream, one set of BatchNorm statistics
    ref = reference_run(stateful_config(d=1), delayed=True)
    final = weights(tmp_path / "straight")
    torch.testing.assert_close(final, ref.weights)
    assert int(final["2.bn.num_batches_tracked"]) == 4 * 2  # every microbatch counted once
    torch.testing.assert_close(torch.tensor(straight["losses"]), torch.tensor(ref.losses))


def _stage(indices, *, recompute=False, p=0.5):
    return stage_module(indices, stateful_layers(width=8, seed=1, p=p), None, recompute=recompute)


def _ids(microbatch: int) -> torch.Tensor:
    return torch.randint(0, 256, (4, 6), generator=torch.Generator().manual_seed(microbatch))


def test_masks_depend_on_layer_and_microbatch_only():
    """Issue 33: every rank seeded one stream, so stage 1's first dropout drew stage 0's mask. Each layer now
    draws from (seed, layer, microbatch): the same at any split into stages and in any order, other per layer,
    and the process's own generator does not move."""
    whole, first, second = _stage(range(5)), _stage(range(3)), _stage(range(3, 5))
    state = torch.get_rng_state()
    outs = {}
    for k in (7, 3, 7):  # out of order, and again
        with stateful.microbatch_streams(0, k, torch.device("cpu")):
            outs.setdefault(k, []).append((whole(_ids(k))[0], second(first(_ids(k)))[0]))
    assert torch.equal(torch.get_rng_state(), state)
    (a, b), (c, d) = outs[7]
    assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(c, d)  # split and order do not matter
    assert not torch.equal(outs[3][0][0][:2], a[:2])  # another microbatch, other masks (and samples)
    drop1, drop3 = (_stage([i]) for i in (1, 3))
    drop3.load_state_dict({"3." + k[2:]: v for k, v in drop1.state_dict().items()})  # the same weights
    h = (torch.randn(4, 6, 8), None)
    with stateful.microbatch_streams(0, 7, torch.device("cpu")):
        assert not torch.equal(drop1(h)[0], drop3(h)[0])  # two layers, two masks


def test_recomputation_counts_batchnorm_statistics_once():
    """Issue 33: pipeline.recompute ran each layer again in backward and BatchNorm counted the microbatch twice
    (num_batches_tracked 32 instead of 16, running statistics rel 0.35 off). Microbatches in 1F1B order."""
    plain, recomputed = _stage(range(5)), _stage(range(5), recompute=True)
    recomputed.load_state_dict(plain.state_dict())
    for module in (plain, recomputed):
        outs = {}
        for op, k in [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]:
            if op == "F":
                with stateful.microbatch_streams(0, k, torch.device("cpu")):
                    outs[k] = module(_ids(k))[0]
            else:
                outs.pop(k).square().mean().backward()
    assert int(recomputed.get_buffer("2.bn.num_batches_tracked")) == 3
    for (n, a), (_, b) in zip(plain.state_dict().items(), recomputed.state_dict().items()):
        assert torch.equal(a, b), n
    for (n, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)  # the recomputation drew the same masks


class _Rotary(nn.Module):
    """A layer with buffers training never changes: a persistent table and a non-persistent cache."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("table", torch.arange(8.0))
        self.register_buffer("cache", torch.ones(8), persistent=False)

    def forward(self, h):
        return self.lin(h) * self.cache + self.table


def test_2bw_buffers_are_named_only_when_training_changes_them(caplog):
    """Issue 33: every 2bw rank warned that buffers are not versioned, also for models whose buffers never
    change (Llama's rotary caches). Only buffers a training forward changes count, and the two weight
    versions share them."""
    optimizer = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    constant = nn.Sequential(_Rotary())
    with caplog.at_level(logging.WARNING):
        versions = WeightVersions(constant, schedule="2bw", optimizer_factory=optimizer)
    assert "buffer" not in caplog.text
    watch = stateful.BufferWatch()
    watch.before(constant)
    constant(torch.randn(2, 8))
    watch.after(constant)
    assert watch.names == []
    bn = nn.Sequential(nn.BatchNorm1d(8))
    versions = WeightVersions(bn, schedule="2bw", optimizer_factory=optimizer)
    watch = stateful.BufferWatch()
    watch.before(bn)
    versions.replicas[1](torch.randn(4, 8))  # either version's forward updates the one set
    watch.after(bn)
    assert watch.names == ["0.num_batches_tracked", "0.running_mean", "0.running_var"]


@pytest.mark.slow
def test_2bw_hf_gpt2_with_dropout_resumes_bit_for_bit(tmp_path):
    """Issue 33: model=hf GPT-2 with model.dropout=0.1 under 2bw at d=2 resumed with other losses from step 3."""
    pytest.importorskip("transformers", reason="model=hf needs the optional extra: pip install -e '.[hf]'")
    from hf_models import save_tiny

    from pipedream2bw.config import HFModelConfig

    save_tiny(tmp_path / "pretrained", "gpt2")
    cfg = tiny_config(schedule="2bw", num_stages=2, num_microbatches=2, optim="sgd_momentum", num_steps=4)
    cfg.model = HFModelConfig(pretrained=str(tmp_path / "pretrained"), seq_len=16, dropout=0.1)
    cfg.train.checkpoint_every = 2
    straight = run_ok(cfg, tmp_path / "straight")
    cfg.train.resume = str(tmp_path / "straight/checkpoints/step_00000002")
    resumed = run_ok(cfg, tmp_path / "resumed")
    assert resumed["first_step"] == 2
    assert resumed["losses"] == straight["losses"]
    assert_equal_bits(weights(tmp_path / "resumed"), weights(tmp_path / "straight"))
