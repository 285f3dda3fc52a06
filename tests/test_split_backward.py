"""zb1p's backward in two (pipeline/split_backward.py): B's input gradient and W's weight gradients equal one
backward's."""

from __future__ import annotations

import copy

import torch
from torch import nn

from pipedream2bw.config import GPTConfig
from pipedream2bw.models.gpt import build_gpt_layers
from pipedream2bw.pipeline.split_backward import GraphPlans, backward_input, backward_weight


def _gpt_stage() -> nn.Module:
    layers = build_gpt_layers(GPTConfig(num_layers=2, d_model=32, num_heads=2, seq_len=8, vocab_size=64), seed=0)
    return nn.Sequential(*layers[1:3])  # two blocks: a middle stage


class _SideBranch(nn.Module):
    """Two outputs, one of them from a weight alone: its branch joins no path from the input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.side = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.lin(x), self.side * 3.0


def test_split_equals_one_backward_bit_for_bit_and_fires_each_hook_once_per_microbatch():
    stage = _gpt_stage()
    ref = copy.deepcopy(stage)
    fired = []
    for p in stage.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    torch.manual_seed(1)
    for k in range(2):  # two microbatches accumulate, as a batch's do
        x, g = torch.randn(2, 8, 32, requires_grad=True), torch.randn(2, 8, 32)
        before = [None if p.grad is None else p.grad.clone() for p in stage.parameters()]
        (dx,), work = backward_input([stage(x)], [g], [x], list(stage.parameters()))
        assert len(fired) == k * len(before)  # B computes no weight gradient...
        assert all((a is None and p.grad is None) or torch.equal(a, p.grad) for a, p in zip(before, stage.parameters()))
        backward_weight(work)  # ...W all of them
        x_ref = x.detach().clone().requires_grad_()
        ref(x_ref).backward(g)
        assert torch.equal(dx, x_ref.grad)
    for (name, p), q in zip(stage.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert len(fired) == 2 * len(list(stage.parameters()))  # the data-parallel reducer's hooks see every gradient


def test_a_weight_off_the_input_path_still_gets_its_gradient():
    stage = _SideBranch()
    ref = copy.deepcopy(stage)
    x, g = torch.randn(3, 4, requires_grad=True), [torch.randn(3, 4), torch.randn(4)]
    (dx,), work = backward_input(list(stage(x)), g, [x], list(stage.parameters()))
    assert stage.side.grad is None
    backward_weight(work)
    x_ref = x.detach().clone().requires_grad_()
    torch.autograd.backward(list(ref(x_ref)), g)
    assert torch.equal(dx, x_ref.grad)
    assert torch.equal(stage.side.grad, ref.side.grad) and torch.equal(stage.lin.weight.grad, ref.lin.weight.grad)


def test_first_stage_defers_its_whole_backward_to_w():
    layers = build_gpt_layers(GPTConfig(num_layers=1, d_model=32, num_heads=2, seq_len=8, vocab_size=64), seed=0)
    stage, ids = layers[0], torch.randint(0, 64, (2, 8))  # the embedding: its input is token ids
    ref = copy.deepcopy(stage)
    g = torch.randn(2, 8, 32)
    dinputs, work = backward_input([stage(ids)], [g], [], list(stage.parameters()))
    assert dinputs == [] and all(p.grad is None for p in stage.parameters())
    backward_weight(work)
    ref(ids).backward(g)
    for p, q in zip(stage.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_weight_used_twice_on_the_input_path_is_counted_once():
    # y = x * w; z = y * w: both products are where w joins the input's path, one below the other. W runs from
    # both with the gradients B caught there; y's must not take z's contribution a second time.
    w = nn.Parameter(torch.tensor([1.5, -0.5]))
    x, g = torch.randn(3, 2, requires_grad=True), torch.randn(3, 2)
    (dx,), work = backward_input([x * w * w], [g], [x], [w])
    backward_weight(work)
    w_ref, x_ref = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    (x_ref * w_ref * w_ref).backward(g)
    assert torch.equal(dx, x_ref.grad) and torch.allclose(w.grad, w_ref.grad, rtol=1e-6, atol=0)


class _Swapping(nn.Module):
    """Two linears applied in an order the input picks (a branch on its data): both graphs have the same nodes, of the
    same types, wired alike, but each weight sits where the other did."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        first, second = (self.a, self.b) if x.sum() > 0 else (self.b, self.a)
        return torch.tanh(second(torch.relu(first(x))))


def test_kept_analyses_follow_a_graph_whose_structure_changes_between_microbatches():
    # B keeps each graph's analysis by the graph's shape (GraphPlans); a microbatch that takes the other branch or
    # comes in another shape must be analysed anew, not given the analysis of the last graph (gradients of a to b)
    stage, plans = _Swapping(), GraphPlans()
    ref = copy.deepcopy(stage)
    torch.manual_seed(2)
    for k, (sign, rows) in enumerate([(1, 3), (-1, 3), (-1, 5), (1, 3), (-1, 5)]):
        x = (torch.rand(rows, 4) * sign).requires_grad_()
        g = torch.randn(rows, 4)
        (dx,), work = backward_input([stage(x)], [g], [x], list(stage.parameters()), plans=plans)
        backward_weight(work)
        x_ref = x.detach().clone().requires_grad_()
        ref(x_ref).backward(g)
        assert torch.equal(dx, x_ref.grad), k
        for (name, p), q in zip(stage.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), (k, name)
    assert plans.misses == 2  # one analysis a branch: the batch's size does not change the graph's structure


def test_kept_analyses_give_a_gpt_stage_the_gradients_of_one_backward_bit_for_bit():
    stage, plans = _gpt_stage(), GraphPlans()
    ref = copy.deepcopy(stage)
    torch.manual_seed(3)
    for _ in range(3):
        x, g = torch.randn(2, 8, 32, requires_grad=True), torch.randn(2, 8, 32)
        (dx,), work = backward_input([stage(x)], [g], [x], list(stage.parameters()), plans=plans)
        backward_weight(work)
        x_ref = x.detach().clone().requires_grad_()
        ref(x_ref).backward(g)
        assert torch.equal(dx, x_ref.grad)
    for (name, p), q in zip(stage.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert plans.misses == 1


class _TwoOut(torch.autograd.Function):
    """(x * w, x + w): one node, two outputs, where w joins the input's path."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w, x + w

    @staticmethod
    def backward(ctx, g_mul, g_add):
        x, w = ctx.saved_tensors
        g_mul = torch.zeros_like(x) if g_mul is None else g_mul
        g_add = torch.zeros_like(x) if g_add is None else g_add
        return g_mul * w + g_add, (g_mul * x + g_add).sum(0)


def test_a_weight_joining_at_a_node_of_two_outputs_gets_both_outputs_gradients():
    # B catches a gradient per output of the node where w joins (output 1 alone, then both, then output 1 as an output
    # of the stage itself): W must give that node what it got in B at each of them
    w = nn.Parameter(torch.tensor([0.5, -2.0, 1.5]))
    for use in ["add", "both", "root"]:
        x, g = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3)
        w_ref, x_ref = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        outs = []
        for xx, ww in ((x, w), (x_ref, w_ref)):
            mul, add = _TwoOut.apply(xx, ww)
            outs.append({"add": torch.tanh(add), "both": torch.tanh(add) * mul.exp(), "root": add}[use])
        w.grad = None
        (dx,), work = backward_input([outs[0]], [g], [x], [w], plans=GraphPlans())
        backward_weight(work)
        outs[1].backward(g)
        assert torch.equal(dx, x_ref.grad) and torch.equal(w.grad, w_ref.grad), use
