"""WeightVersions on one process: the 2BW rule step by step, and autograd's in-place checks."""

from __future__ import annotations

import torch
from torch import nn

from pipedream2bw.versions import WeightVersions, bucketize


def _sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def test_2bw_keeps_two_versions_and_applies_the_delayed_gradient():
    module = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        module.weight.fill_(10.0)
    versions = WeightVersions(module, schedule="2bw", optimizer_factory=_sgd)
    x = torch.ones(1, 1)
    seen = []
    for t in range(4):  # loss = w * x, so each gradient is 1 and W(t+1) = W(t) - 1
        m = versions.module_for_batch(t)
        seen.append(m.weight.item())
        m(x).sum().backward()
        versions.step(t, grad_scale=1.0)
    assert seen == [10.0, 10.0, 9.0, 8.0]  # batch t runs with W(t-1), W(-1) = W(0)
    assert versions.newest().weight.item() == 6.0
    assert len(versions.replicas) == 2


def test_step_while_the_next_batch_is_in_flight_passes_autograds_checks():
    # Regression: the optimizer's master parameters shared the replicas' version counters, so
    # stepping (which writes the other buffer) made autograd reject the in-flight backward of
    # the next batch ("modified by an inplace operation"). Saved-tensor hooks hid it.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    versions = WeightVersions(module, schedule="2bw", optimizer_factory=lambda p: torch.optim.Adam(p, lr=0.1))
    x = torch.randn(2, 4)
    for t in range(4):
        versions.module_for_batch(t)(x).sum().backward()
        in_flight = versions.module_for_batch(t + 1)(x).sum()  # batch t+1 forwarded before batch t steps
        versions.step(t, grad_scale=1.0)
        in_flight.backward()  # raised before the fix
        for p in versions.module_for_batch(t + 1).parameters():
            p.grad = None


def test_buckets_start_with_the_last_parameters():
    params = [nn.Parameter(torch.zeros(n)) for n in (4, 4, 4, 4)]
    assert bucketize(params, bucket_bytes=32) == [[3, 2], [1, 0]]
    assert bucketize(params, bucket_bytes=1) == [[3], [2], [1], [0]]
