"""Closing 2bw's step gap (issue 46): pipeline.sync_warmup_steps (flush's steps first, then 2bw) and
optim.delay_correction=predict (the version a batch reads is a prediction of the weights its gradient is applied
to), each against the single-process reference of its own rule (reference.reference_run), resumed exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_helper import run_ok
from reference import reference_eval, reference_train
from test_checkpoint import assert_equal_bits
from test_semantics import tiny_config

from pipedream2bw.config import ConfigError, OptimConfig, build_optimizer, validate
from pipedream2bw.config.optimizers import PREDICT_STATE, predicted_offsets
from pipedream2bw.memory.step_memory import StepModel
from pipedream2bw.pipeline import schedule
from pipedream2bw.pipeline.versions import PREDICTED_WEIGHTS, WeightVersions, max_versions_alive, version_of_batch


def _config(*, warmup=2, d=2, steps=5, **optim):
    cfg = tiny_config(schedule="2bw", num_stages=d, num_microbatches=4, num_steps=steps)
    cfg.pipeline.sync_warmup_steps = warmup
    # named, as on a command line: a replace keeps the mark of the adam default's auto (optim.auto_correction)
    cfg.optim = dataclasses.replace(cfg.optim, **{"name": "adamw", "lr": 1e-2, "auto_correction": False, **optim})
    return cfg


def test_batches_read_their_own_version_through_the_warm_up_then_the_previous_one():
    assert [version_of_batch("2bw", t, sync_warmup_steps=2) for t in range(6)] == [0, 1, 2, 2, 3, 4]
    assert [version_of_batch("2bw", t) for t in range(4)] == [0, 0, 1, 2]  # N = 0: W(-1) = W(0)
    assert [version_of_batch("flush", t, sync_warmup_steps=2) for t in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize("d,m,n", [(2, 2, 1), (2, 4, 3), (4, 4, 2), (4, 8, 5)])
def test_flush_then_2bw_holds_two_versions_and_never_reads_one_not_made(d, m, n):
    """The warm-up's flush list, then 2bw's from batch N (build.actions joins them): at the switch W(N) is the one
    version alive, batch N reads it, batch N+1 too (W(N+1) is not made until batch N closes)."""
    for s in range(d):
        flush = schedule.stage_actions("flush", stage_index=s, num_stages=d, num_microbatches=m, num_batches=n)
        twobw = schedule.stage_actions("2bw", stage_index=s, num_stages=d, num_microbatches=m, num_batches=4)
        actions = flush + schedule.shift_batches(twobw, first_batch=n, num_microbatches=m)
        assert max_versions_alive(actions, schedule="2bw", num_microbatches=m, sync_warmup_steps=n) <= 2
        if s < d - 1:  # 2bw's rule from the first batch would read W(N+1) in batch N+1's warm-up forwards
            with pytest.raises(schedule.ScheduleError, match="needs W"):
                max_versions_alive(actions, schedule="2bw", num_microbatches=m, sync_warmup_steps=n + 1)


@pytest.mark.parametrize(
    "change,pattern",
    [
        (dict(precision="fp16"), r"pipeline.sync_warmup_steps \(2\) with train.precision \(fp16\)"),
        (dict(delay_correction="lookahead"), r"pipeline.sync_warmup_steps \(2\) with optim.delay_correction"),
        (dict(host=True), r"pipeline.sync_warmup_steps \(2\) with swap.optimizer \(host\)"),
        (dict(sharded=True), r"pipeline.sync_warmup_steps \(2\) with optim.sharded"),
        (dict(tensor=2), r"pipeline.sync_warmup_steps \(2\) with pipeline.tensor_parallel \(2\)"),
    ],
)
def test_warm_up_refused_where_the_versions_keep_2bws_rule(change, pattern):
    cfg = _config(delay_correction=change.get("delay_correction", "none"), sharded=change.get("sharded", False))
    _assert_refused(cfg, change, pattern)


def _assert_refused(cfg, change, pattern) -> None:
    """``cfg`` with ``change`` (sharded: two replicas; precision; host: the host optimizer; tensor: t) is refused."""
    w = 2 if change.get("sharded") else 1
    cfg.pipeline.data_parallel = w
    if "precision" in change:
        cfg.train.precision = change["precision"]
    if change.get("host"):
        cfg.swap.optimizer = "host"
    cfg.pipeline.tensor_parallel = t = change.get("tensor", 1)
    with pytest.raises(ConfigError, match=pattern):
        validate(cfg, world_size=2 * w * t, local_world_size=2 * w * t)


@pytest.mark.slow
@pytest.mark.parametrize("d", [2, pytest.param(4, marks=pytest.mark.long)])  # d = 4: matrix.EXTRA's resumed cell too
def test_warm_up_equals_its_reference(tmp_path, d):
    """N = 2 flushing steps, then 2bw, with error feedback: the weights and losses equal the reference's rule
    (batches t <= N at W(t), later at W(t-1); corrected only after N), and neither plain 2bw's nor flush's."""
    cfg = _config(d=d, delay_correction="error_feedback")
    summary = run_ok(cfg, tmp_path)
    weights = torch.load(tmp_path / "final_model.pt")
    expected, losses = reference_train(cfg, delayed=True)
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(losses))
    for warmup, delayed in ((0, True), (2, False)):  # plain 2bw; flush throughout
        other, _ = reference_train(_config(d=d, warmup=warmup, delay_correction="error_feedback"), delayed=delayed)
        assert max(float((weights[k] - other[k]).abs().max()) for k in weights) > 1e-4


@pytest.mark.slow
def test_warm_up_resumes_exactly_during_it_and_after_it(tmp_path):
    """N = 3: runs resumed from the straight run's checkpoints after 2 steps (mid-warm-up) and after 4 (past the
    switch) end with its weights and losses, bit for bit."""
    cfg = _config(warmup=3, steps=6, delay_correction="error_feedback")
    cfg.train.checkpoint_every, cfg.train.keep_checkpoints = 2, 3
    straight = run_ok(cfg, tmp_path / "straight")
    for stop in (2, 4):
        path = tmp_path / f"straight/checkpoints/step_{stop:08d}"
        resumed = run_ok(
            dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=str(path))), tmp_path / f"from{stop}"
        )
        assert resumed["first_step"] == stop
        assert resumed["losses"] == straight["losses"]
        assert_equal_bits(
            torch.load(tmp_path / f"from{stop}/final_model.pt"), torch.load(tmp_path / "straight/final_model.pt")
        )


@pytest.mark.parametrize(
    "change,pattern",
    [
        (dict(host=True), r"optim.delay_correction \(predict\) with swap.optimizer \(host\)"),
        (dict(sharded=True), r"optim.delay_correction \(predict\) with optim.sharded"),
    ],
)
def test_prediction_refused_where_the_versions_are_not_what_batches_read(change, pattern):
    cfg = _config(warmup=0, delay_correction="predict", sharded=change.get("sharded", False))
    _assert_refused(cfg, change, pattern)


@pytest.mark.slow
@pytest.mark.parametrize(
    "d,warmup,name,correction",
    [(2, 0, "adamw", "predict"), (4, 2, "muon", "predict"), (2, 0, "muon", "predict_error_feedback")],
)
def test_prediction_equals_its_reference(tmp_path, d, warmup, name, correction):
    """Batch t reads W(t-1) + d(t-2), in the replica of W(t-1): the final weights (W, not the prediction), the
    losses and the validation loss equal the reference's rule, and differ from plain 2bw's; with error feedback
    inside (predict_error_feedback, its beta 0.5 by default), from each of the two alone."""
    cfg = _config(d=d, warmup=warmup, name=name, delay_correction=correction)
    cfg.data.val_fraction, cfg.train.eval_every = 0.1, cfg.train.num_steps
    summary = run_ok(cfg, tmp_path)
    weights = torch.load(tmp_path / "final_model.pt")
    expected, losses = reference_train(cfg, delayed=True)
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(losses))
    torch.testing.assert_close(summary["final_val_loss"], reference_eval(cfg, expected))
    others = ["none"] + (["predict", "error_feedback"] if correction == "predict_error_feedback" else [])
    for other in others:
        beta = dict(error_feedback_beta=cfg.optim.error_feedback_beta)  # error feedback alone at the same beta
        plain, _ = reference_train(_config(d=d, warmup=warmup, name=name, delay_correction=other, **beta), delayed=True)
        assert max(float((weights[k] - plain[k]).abs().max()) for k in weights) > 1e-4, other


@pytest.mark.slow
def test_prediction_resumes_exactly(tmp_path):
    """A run resumed from the straight run's checkpoint after 3 steps (its replicas hold predictions that W + d
    does not give back bit for bit: the checkpoint keeps them) ends with its weights and losses, bit for bit."""
    cfg = _config(warmup=0, steps=5, delay_correction="predict")
    cfg.train.checkpoint_every = 3
    straight = run_ok(cfg, tmp_path / "straight")
    path = tmp_path / "straight/checkpoints/step_00000003"
    resumed = run_ok(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=str(path))), tmp_path / "r")
    assert resumed["first_step"] == 3 and resumed["losses"] == straight["losses"]
    assert_equal_bits(torch.load(tmp_path / "r/final_model.pt"), torch.load(tmp_path / "straight/final_model.pt"))


def _stepped_versions(correction: str):
    """WeightVersions of a two-layer MLP under 2bw with ``correction``, after three steps (grads on both replicas)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    optim = OptimConfig(name="adamw", lr=0.05, delay_correction=correction)
    versions = WeightVersions(module, schedule="2bw", optimizer_factory=lambda ps: build_optimizer(ps, optim))
    for t in range(3):
        versions.module_for_batch(t)(torch.randn(3, 4)).square().mean().backward()
        versions.step(t, grad_scale=1.0)
    return versions


def test_a_prediction_checkpoint_resumes_to_the_prediction_or_to_the_weights():
    """state() saves W(n) as the weights and keeps P(n) beside d(n-1); a predicting run loads P(n) bit for bit, one
    without the prediction loads W(n) and drops d (it would otherwise run on P(n) as if it were W(n))."""
    versions = _stepped_versions("predict")
    held = {n: p.detach().clone() for n, p in versions.newest().named_parameters()}
    state = versions.state()
    assert any(not torch.equal(state["weights"][n], held[n]) for n in held)  # W(n) = P(n) - d(n-1), not P(n)
    for correction, expected in (("predict", held), ("none", state["weights"])):
        fresh = _stepped_versions(correction)
        fresh.load_state(**{k: state[k] for k in ("step", "weights", "previous", "optimizer")})
        for n, p in fresh.newest().named_parameters():
            assert torch.equal(p, expected[n]), (correction, n)
        assert_equal_bits(
            {n: p.detach() for n, p in fresh.weights().named_parameters()},
            {n: state["weights"][n] for n in held},
        )
        states = [st for opt in fresh.optimizers for st in opt.state.values()]
        assert all(PREDICTED_WEIGHTS not in st for st in states)
        assert any(PREDICT_STATE in st for st in states) == (correction == "predict")


def test_a_tied_weights_w_is_under_every_name_in_the_runtime_and_the_reference():
    """A weight tied within a stage (an embedding and a head sharing it) holds P(n) between steps under the prediction;
    what validation, the final weights and checkpoints take (``weights()``, ``state()``) is W(n) = P(n) - d(n-1) under
    both of its names, and so is the reference's ``weights`` (it once subtracted d under the first name only, its
    named_parameters()', leaving a tied head one update off: 0.015 at d=2 t=2, which looked like the runtime's)."""
    from reference import ReferenceOptimizer

    optim = OptimConfig(name="adamw", lr=0.05, delay_correction="predict_error_feedback")

    def tied():
        torch.manual_seed(0)
        emb, head = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False)
        head.weight = emb.weight
        return torch.nn.Sequential(emb, head)

    def loss(model):
        return model(torch.tensor([[0, 3, 4]])).square().mean()

    module = tied()
    versions = WeightVersions(module, schedule="2bw", optimizer_factory=lambda ps: build_optimizer(ps, optim))
    model = tied()
    ref = ReferenceOptimizer(model, optim)
    for t in range(3):
        loss(versions.module_for_batch(t)).backward()
        versions.step(t, grad_scale=1.0)
        loss(model).backward()
        ref.step(optim.lr)
        model.zero_grad()
    (offset,) = predicted_offsets(versions.optimizers, versions.master)  # d(2), one tensor for the tie
    for name, state, p, d in (
        ("weights()", versions.weights().state_dict(), versions.newest()[0].weight, offset),
        ("state()", versions.state()["weights"], versions.newest()[0].weight, offset),
        ("reference", ref.weights(model.state_dict()), model[0].weight, ref.prev[0]),
    ):
        assert torch.equal(state["0.weight"], state["1.weight"]), name
        assert torch.equal(state["1.weight"], p - d) and d.abs().max() > 0, name  # W(3) = P(3) - d(2), not P(3)


def test_prediction_with_error_feedback_takes_its_own_beta_and_the_predictions_refusals():
    """predict_error_feedback (issue 46): optim.error_feedback_beta null resolves to 0.5 under it (1.5 over-corrects
    a prediction: docs/convergence.md), 1.5 under error feedback alone; a beta given stays; it is refused where the
    prediction is, naming itself; its step clones the weights twice (the prediction's W(t), error feedback's)."""
    assert OptimConfig(name="muon", delay_correction="predict_error_feedback").error_feedback_beta == 0.5
    assert OptimConfig(name="muon", delay_correction="error_feedback").error_feedback_beta == 1.5
    assert OptimConfig(delay_correction="predict_error_feedback", error_feedback_beta=1.0).error_feedback_beta == 1.0
    cfg = _config(warmup=0, delay_correction="predict_error_feedback")
    pattern = r"optim.delay_correction \(predict_error_feedback\) with swap.optimizer \(host\)"
    _assert_refused(cfg, dict(host=True), pattern)
    model = StepModel.of(cfg.optim, device_type="cpu")
    assert model.correction_copies == 2
