"""optim.name=muon and optim.delay_correction (pipedream2bw/optimizers.py): config refusals, the optimizer object's
state and checkpoints, and the pipeline's weights against the single-process reference (reference.ReferenceOptimizer)
at d = 1, 2, 4. The pairwise matrix (test_matrix.py) crosses Muon and error feedback with the other features."""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict

import pytest
import torch
from dist_helper import run_ok
from reference import ReferenceOptimizer, reference_train
from test_semantics import tiny_config
from torch import nn

from pipedream2bw.config import ConfigError, GPTConfig, OptimConfig, build_optimizer, validate
from pipedream2bw.config.optimizers import EF_STATE, MUON_ROLE, Muon, muon_edge_layers, tag_muon_params
from pipedream2bw.models.gpt import build_gpt_layers


def _config(schedule="2bw", d=2, w=1, **optim):
    cfg = tiny_config(schedule=schedule, num_stages=d, num_microbatches=4)
    cfg.pipeline.data_parallel = w
    # named, as on a command line: a replace keeps the mark of the adam default's auto (optim.auto_correction)
    cfg.optim = dataclasses.replace(cfg.optim, **{"name": "adamw", "lr": 1e-2, "auto_correction": False, **optim})
    return cfg


@pytest.mark.parametrize(
    "optim,w,pattern",
    [
        (dict(delay_correction="ef"), 1, r"optim.delay_correction \('ef'\) is unknown; use one of \['auto', 'none'"),
        (dict(name="muon", sharded=True), 2, r"optim.name \(muon\) with optim.sharded \(true\).*whole matrices"),
        (dict(name="muon", muon_others="muon"), 1, r"optim.muon_others \(muon\)"),
        (dict(name="sgd", delay_correction="lookahead"), 1, r"optim.delay_correction \(lookahead\) with optim.name"),
        (dict(delay_correction="lookahead", kwargs={"betas": [0.9, 0.95]}), 1, r"sets beta1"),
        (dict(delay_correction="error_feedback", error_feedback_beta=-1.0), 1, r"optim.error_feedback_beta \(-1.0\)"),
    ],
)
def test_refused_at_config_time(optim, w, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate(_config(w=w, **optim), world_size=2 * w)


def test_the_planner_never_shards_muon_nor_suggests_it():
    from partitioner.auto import make_request

    cfg = _config(name="muon")
    cfg.partition = dataclasses.replace(cfg.partition, mode="auto", sharded=None)  # "let the search try both"
    req = make_request(cfg, devices=4)
    assert req.sharded is False and not req.shardable  # a sharded plan would be refused when it runs
    cfg.partition = dataclasses.replace(cfg.partition, sharded=True)
    with pytest.raises(ConfigError, match=r"partition.sharded \(true\) with optim.name \(muon\)"):
        validate(cfg, world_size=2)


def test_muon_takes_the_hidden_matrices_only():
    """The default split: Muon for the blocks' 2-D weights; embeddings, the LM head (tied or not), norms and biases
    go to the other optimizer; optim.muon_exclude overrides it."""
    for tie in (False, True):
        model = nn.Sequential(*build_gpt_layers(GPTConfig(num_layers=2, d_model=16, tie_embeddings=tie), seed=0))
        tag_muon_params(model, OptimConfig().muon_exclude, edge_layers=muon_edge_layers(len(model)))
        muon = {n for n, p in model.named_parameters() if getattr(p, MUON_ROLE)}
        assert muon == {f"{b}.{k}.weight" for b in (1, 2) for k in ("qkv", "proj", "fc", "fc_proj")}
    tag_muon_params(model, ["*fc*", "*Embedding*", "*Head*"])
    assert {n for n, p in model.named_parameters() if getattr(p, MUON_ROLE)} == {"1.qkv.weight", "1.proj.weight"} | {
        "2.qkv.weight",
        "2.proj.weight",
    }


def test_muon_leaves_a_plain_linear_head_and_input_of_a_layer_list_to_the_other_optimizer():
    # issue 43: the class-name patterns sent a custom layer list's nn.Linear output projection (and input
    # projection) to Muon, against Muon's rule (hidden matrices only); the roles come from the positions now
    layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    tag_muon_params(layers, OptimConfig().muon_exclude, edge_layers=muon_edge_layers(len(layers)))
    assert {n for n, p in layers.named_parameters() if getattr(p, MUON_ROLE)} == {"2.weight"}
    # a stage holds some of the layers, keyed by their global index: its last layer is not the model's
    stage = nn.Sequential(OrderedDict((str(i), layers[i]) for i in (2, 3, 4)))
    tag_muon_params(stage, [], edge_layers=muon_edge_layers(5))
    assert {n for n, p in stage.named_parameters() if getattr(p, MUON_ROLE)} == {"2.weight"}


def test_error_feedback_steps_with_one_temporary_the_size_of_the_weights():
    """The correction's step allocates one copy of the weights (W(t), which becomes u(t), the new state), not three
    (W(t), u(t) and u(t) - u(t-1) alive together: 8 B a parameter more at the step's peak)."""
    from pipedream2bw.config.optimizers import ErrorFeedback
    from pipedream2bw.memory.memprobe import tensor_peak

    w = nn.Parameter(torch.randn(128, 128))
    opt = ErrorFeedback(torch.optim.SGD([w], lr=0.1), beta=1.0)
    for _ in range(3):  # from the second step on, u(t-1) is there
        w.grad = torch.randn_like(w)
        with tensor_peak(torch.device("cpu")) as box:
            opt.step()
    nbytes = w.numel() * w.element_size()
    assert nbytes <= box["bytes"] < 2 * nbytes, box


def _newton_schulz64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """torch.optim.Muon's quintic iteration (its coefficients), in float64: the reference for the float32 one."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    x = g.double().T if g.size(0) > g.size(1) else g.double()
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.size(0) > g.size(1) else x


@pytest.mark.parametrize("adjust_lr_fn,nesterov", [(None, True), ("match_rms_adamw", False)])
def test_muon_is_torchs_step_with_its_newton_schulz_in_the_dtype_asked(adjust_lr_fn, nesterov):
    """optim.muon_kwargs.ns_dtype: 'bfloat16' is torch.optim.Muon bit for bit; 'auto' on a CPU is 'float32', whose
    update is torch's iteration to float32 round-off, not torch's bfloat16 one (what a CPU emulates 10-20x slower)."""
    torch.manual_seed(0)
    shapes = [(24, 8), (8, 24)]  # both orientations: the iteration runs on the wide one
    start = [torch.randn(*s) for s in shapes]
    runs = {}
    for name, cls, kw in [
        ("torch", torch.optim.Muon, {}),
        ("bfloat16", Muon, {"ns_dtype": "bfloat16"}),
        ("auto", Muon, {}),
        ("float32", Muon, {"ns_dtype": "float32"}),
    ]:
        params = [nn.Parameter(p.clone()) for p in start]
        opt = cls(params, lr=0.02, adjust_lr_fn=adjust_lr_fn, nesterov=nesterov, weight_decay=0.0, **kw)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            before = [p.detach().clone() for p in params]
            opt.step()
        runs[name] = ([p.detach() for p in params], [p - q for p, q in zip(params, before)], opt, params)
    same = lambda x, y: all(torch.equal(a, b) for a, b in zip(runs[x][0], runs[y][0]))  # noqa: E731
    assert same("torch", "bfloat16") and same("auto", "float32") and not same("torch", "float32")
    _, updates, opt, params = runs["float32"]
    for p, u in zip(params, updates):  # the last step's update: -lr * ratio * NS(nesterov or plain momentum)
        buf = opt.state[p]["momentum_buffer"]
        rows, cols = p.shape
        ratio = 0.2 * max(rows, cols) ** 0.5 if adjust_lr_fn else max(1, rows / cols) ** 0.5
        expected = -0.02 * ratio * _newton_schulz64(p.grad.lerp(buf, 0.95) if nesterov else buf)
        torch.testing.assert_close(u.double(), expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="ns_dtype 'float16'"):
        Muon(params, ns_dtype="float16")


@pytest.mark.parametrize(
    "optim",
    [
        dict(name="muon", delay_correction="error_feedback"),
        dict(name="muon", delay_correction="lookahead"),
        dict(delay_correction="error_feedback", error_feedback_beta=0.5),
        dict(delay_correction="predict"),
        dict(name="muon", delay_correction="predict"),
    ],
)
def test_one_optimizer_that_resumes_and_matches_the_reference(optim):
    """Muon with AdamW and the corrections are one Optimizer: its state_dict holds every part's state (the error
    feedback's u(t-1) too), a fresh one loaded from it continues exactly as the original, and both follow the
    reference's rule (ReferenceOptimizer, written apart)."""
    cfg = OptimConfig(lr=1e-2, **optim)
    torch.manual_seed(0)
    base = nn.Sequential(*build_gpt_layers(GPTConfig(num_layers=1, d_model=16, num_heads=2, seq_len=8), seed=0))
    a, ref = copy.deepcopy(base), copy.deepcopy(base)
    tag_muon_params(a, cfg.muon_exclude)  # a deep copy does not carry the tags
    opt, ref_opt = build_optimizer(a.parameters(), cfg), ReferenceOptimizer(ref, cfg)
    x = torch.randint(0, 256, (2, 8))

    def step(model, o, lr=None):
        model.zero_grad()
        model(x).float().square().mean().backward()
        o.step() if lr is None else o.step(lr)

    for _ in range(3):
        step(a, opt)
        step(ref, ref_opt, cfg.lr)
    torch.testing.assert_close(a.state_dict(), ref.state_dict())
    saved = opt.state_dict()
    if cfg.delay_correction == "error_feedback":
        assert all(EF_STATE in s for s in saved["state"].values())
    b = copy.deepcopy(a)
    tag_muon_params(b, cfg.muon_exclude)
    fresh = build_optimizer(b.parameters(), cfg)
    fresh.load_state_dict(copy.deepcopy(saved))
    for lr in (cfg.lr, cfg.lr / 3):  # the schedule sets every group's lr: it reaches every part
        for model, o in ((a, opt), (b, fresh)):
            for g in o.param_groups:
                g["lr"] = lr
            step(model, o)
        step(ref, ref_opt, lr)
    torch.testing.assert_close(b.state_dict(), a.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(a.state_dict(), ref.state_dict())


CASES = [  # (schedule, d, optim); the matrix crosses Muon and error feedback with the other features
    ("2bw", 1, dict(name="adamw", delay_correction="error_feedback")),
    ("2bw", 2, dict(name="muon", delay_correction="lookahead")),
    ("2bw", 4, dict(name="muon", delay_correction="error_feedback")),
    ("flush", 1, dict(name="muon", delay_correction="error_feedback")),  # no delay: the correction is off
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,d,optim", CASES, ids=[f"{s}-d{d}-{o['name']}-{o['delay_correction']}" for s, d, o in CASES]
)
def test_pipeline_equals_the_reference(tmp_path, schedule, d, optim):
    """2bw at d stages with Muon and a correction: the weights equal the reference's to float32 round-off, and the
    correction moved them (the uncorrected rule's weights are far off). flush: the uncorrected rule's weights."""
    cfg = _config(schedule=schedule, d=d, **optim)
    run_ok(cfg, tmp_path)
    weights = torch.load(tmp_path / "final_model.pt")
    delayed = schedule == "2bw"
    uncorrected, _ = reference_train(
        _config(schedule=schedule, d=d, **dict(optim, delay_correction="none")), delayed=delayed
    )
    if not delayed:
        torch.testing.assert_close(weights, uncorrected)
        return
    expected, _ = reference_train(cfg, delayed=True)
    torch.testing.assert_close(weights, expected)
    assert max(float((weights[k] - uncorrected[k]).abs().max()) for k in weights) > 1e-3
