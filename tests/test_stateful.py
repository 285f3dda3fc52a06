"""Layers with state besides parameters: dropout's random streams and BatchNorm's statistics, exact under 2bw,
resume, recomputation and any partition (pipedream2bw/stateful.py)."""

from __future__ import annotations

import pytest
import torch
from custom_models import stateful_layers
from dist_helper import run_ok
from reference import reference_run
from test_checkpoint import assert_equal_bits, weights
from test_semantics import tiny_config

from pipedream2bw.config import LayerListConfig


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
