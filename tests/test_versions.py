"""WeightVersions on one process: the 2BW rule step by step, and autograd's in-place checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipedream2bw.memory.host_optim import HostOptimizerVersions
from pipedream2bw.pipeline.versions import WeightVersions, bucketize


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


@pytest.mark.parametrize("cls", [WeightVersions, HostOptimizerVersions])
@pytest.mark.parametrize("schedule", ["2bw", "flush"])
def test_state_round_trip_continues_bit_for_bit(cls, schedule):
    """A copy restored from ``state()`` after 3 steps trains on exactly as the original."""

    def make():
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        return cls(
            module,
            schedule=schedule,
            optimizer_factory=lambda ps: torch.optim.Adam(ps, lr=0.05),
            buckets=[[3, 2], [1, 0]],
        )

    def train(versions, batches):
        for t in batches:
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(t))
            versions.module_for_batch(t)(x).square().sum().backward()
            versions.step(t, grad_scale=0.5)

    original = make()
    train(original, range(3))
    state = original.state()
    assert state["step"] == 3 and (state["previous"] is not None) == (schedule == "2bw")
    restored = make()
    restored.load_state(step=3, weights=state["weights"], previous=state["previous"], optimizer=state["optimizer"])
    train(original, range(3, 6))
    train(restored, range(3, 6))
    for a, b in [(original.newest(), restored.newest()), (original.module_for_batch(6), restored.module_for_batch(6))]:
        for (name, p), q in zip(a.named_parameters(), b.parameters()):  # both versions (the same one under flush)
            assert torch.equal(p, q), name
    # ...and restoring nothing but the newest weights would not do: the state matters.
    fresh = make()
    fresh.load_state(step=3, weights=state["weights"], previous=state["previous"], optimizer={})
    train(fresh, range(3, 6))
    assert not torch.equal(fresh.newest()[0].weight, original.newest()[0].weight)
