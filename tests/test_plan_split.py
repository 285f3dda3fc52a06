"""The split backward's cost in the planner (issue 46): zb1p and zbv run each backward as B then W, two autograd
passes, which take ``LayerCost.split_s`` more than the whole backward; the planner charges it where a backward runs
split (partitioner/split.py) and profiles it per layer (partitioner/profile.py)."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from partitioner import profile as profile_mod
from partitioner.cost import LayerCost, Segments, StageContext, StageCost, simulate
from partitioner.profile import SPLIT_ANALYTIC, analytic_gpt, profile_gpt
from partitioner.split import split_share
from partitioner.topology import Link
from pipedream2bw.config import GPTConfig, OptimConfig, TopologyConfig

FAST = Link("l", math.inf, 0)


def layers(n: int, split_s: float, *, only=None) -> list:
    # F 1 s, B 2 s a layer; the split costs ``split_s`` more (on layer ``only`` alone where given)
    base = LayerCost(
        "block", forward_s=1.0, backward_s=2.0, param_bytes=1, saved_bytes=1, input_bytes=1, output_bytes=1
    )
    return [dataclasses.replace(base, split_s=split_s if only in (None, i) else 0.0) for i in range(n)]


def stage_costs(schedule: str, seg: Segments, d: int, m: int) -> list:
    """One layer a stage (zbv: a chunk, 2d of them), its context as the planner makes it."""
    n = 2 * d if schedule == "zbv" else d
    ctxs = [
        StageContext(stage_index=v, num_stages=d, num_microbatches=m, data_parallel=1, schedule=schedule)
        for v in range(n)
    ]
    return [
        StageCost.of(seg, v, v + 1, dataclasses.replace(c, link_next=FAST, link_prev=FAST)) for v, c in enumerate(ctxs)
    ]


def batch(schedule: str, seg: Segments, d: int, m: int) -> float:
    return simulate(stage_costs(schedule, seg, d, m), schedule=schedule, num_microbatches=m).batch_time_s


def test_split_cost_enters_zb1p_batch_time_on_every_stage_but_the_first():
    d, m, x = 4, 8, 0.5
    plain, split = Segments(layers(d, 0.0)), Segments(layers(d, x))
    costs = stage_costs("zb1p", split, d, m)
    # the first stage's input needs no gradient: B does nothing, W the whole backward, no second pass
    assert [c["backward_s"] for c in costs] == pytest.approx([2.0] + [2.0 + x] * (d - 1))
    # flush and 2bw run the whole backward: not charged
    for schedule in ("flush", "2bw"):
        assert [c["backward_s"] for c in stage_costs(schedule, split, d, m)] == pytest.approx([2.0] * d)
        assert batch(schedule, split, d, m) == pytest.approx(batch(schedule, plain, d, m))
    # a later stage pays x on each of its m microbatches' W; the drain's bubble hides at most d - 1 of them
    assert (m - d + 1) * x <= batch("zb1p", split, d, m) - batch("zb1p", plain, d, m) <= m * x + 1e-9


def test_split_cost_under_zbv_follows_the_whole_backwards():
    # d = 2: chunk 2's B k hands chunk 1 its gradient on the same rank; where W k follows at once it runs the whole
    # backward (schedule.whole_backwards): all of a batch's B's but the last (docs/benchmarks.md)
    d, m, x = 2, 8, 10.0
    assert [split_share("zbv", v, d, m) for v in range(2 * d)] == [0.0, 1.0, 1 / m, 1.0]
    assert split_share("zb1p", 0, d, m) == 0.0 and split_share("zb1p", 1, d, m) == 1.0
    assert split_share("flush", 1, d, m) == split_share("2bw", 1, d, m) == 0.0
    plain = batch("zbv", Segments(layers(2 * d, 0.0)), d, m)
    # a split cost on chunk 2 alone: charged once a batch (its last B), not m times
    only = Segments(layers(2 * d, x, only=d))
    assert stage_costs("zbv", only, d, m)[d]["backward_s"] == pytest.approx(2.0 + x / m)
    assert 0.5 * x <= batch("zbv", only, d, m) - plain <= x + 1e-9
    # on every chunk but the first: chunks 1 and 3 pay it on every microbatch
    every = batch("zbv", Segments(layers(2 * d, x)), d, m)
    assert every - plain >= m * x


def test_profile_times_the_split_backward_of_a_layer_whose_input_needs_a_gradient(tmp_path, monkeypatch):
    # the split made 20 ms slower than it is: each layer that runs it records about that much more than its whole
    # backward (the measured figure itself is a few tenths of a block's backward: docs/planner.md)
    split = profile_mod.split_backward

    def slower(*args, **kwargs):
        time.sleep(0.02)
        return split(*args, **kwargs)

    monkeypatch.setattr(profile_mod, "split_backward", slower)
    cfg = GPTConfig(num_layers=1, d_model=32, num_heads=2, seq_len=16, vocab_size=64)
    emb, block, norm, head = profile_gpt(cfg, OptimConfig(name="adamw"), 2, cache_dir=tmp_path, repeats=5)
    assert emb.split_s == 0.0  # token ids in: nothing to split (the first stage's W runs the whole backward)
    assert min(block.split_s, norm.split_s, head.split_s) >= 0.01  # (a margin for a loaded machine)
    # the sleep is in B: its own time, which W's is the rest of
    assert emb.input_s == 0.0 and min(block.input_s, norm.input_s, head.input_s) >= 0.01
    analytic = analytic_gpt(cfg, OptimConfig(name="adamw"), 2, TopologyConfig())
    assert analytic[0].split_s == 0.0 and analytic[1].split_s == pytest.approx(SPLIT_ANALYTIC * analytic[1].backward_s)
    assert analytic[1].input_s is None  # not measured: B takes half the backward


def test_a_split_b_takes_the_profiled_input_gradient_and_w_the_rest():
    # d = 2, m = 2, F 1, backward 2 a stage, no split cost. The last stage's B's are on zb1p's path (F0 F0 B0 F1 B1 on
    # stage 1, then the first stage's W1, its whole backward): a step of max(4 + b, 3 + 2b) + 2 with B = b. At b = 1,
    # the half that analytic costs assume, 7 (docs/planner.md); as B nears the whole backward, zb1p nears flush's 9
    # (measured: B is 0.7-0.9 of a GPT block's backward at d_model 64, docs/planner.md)
    for b, want in ((None, 7.0), (1.0, 7.0), (1.5, 8.0), (2.0, 9.0)):
        seg = Segments([dataclasses.replace(c, input_s=b) for c in layers(2, 0.0)])
        assert batch("zb1p", seg, 2, 2) == pytest.approx(want)
    assert batch("flush", seg, 2, 2) == pytest.approx(9.0)


def test_the_profiled_split_backward_gives_the_whole_backwards_gradients(monkeypatch):
    # what the profile times must be the backward's work, all of it: the same gradients as a whole backward, the
    # input's from B (which returns it, as the runtime's B does) and the weights' from W
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8, requires_grad=True)
    grad = torch.randn(4, 8)
    layer(x).backward(grad)
    whole = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    for t in [*layer.parameters(), x]:
        t.grad = None
    from_b = []
    b = profile_mod.backward_input
    monkeypatch.setattr(profile_mod, "backward_input", lambda *a, **k: from_b.append(b(*a, **k)) or from_b[-1])
    weight = profile_mod.split_backward([layer(x)], [grad], [x], list(layer.parameters()), plans=None)
    assert all(p.grad is None for p in layer.parameters())  # B left the weights' to W
    weight()
    (dx,), _ = from_b[0]
    for got, want in zip([*(p.grad for p in layer.parameters()), dx], whole):
        torch.testing.assert_close(got, want)
