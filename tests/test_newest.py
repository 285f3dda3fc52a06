"""pipeline.weight_versions=newest: each forward on its stage's newest version, against its rule written out in one
process (tests/reference.py's ``reference_newest``), and what it refuses (gloo, CPU)."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
from dist_helper import run_ok
from reference import reference_newest
from test_config import make
from test_semantics import OPTIMIZERS, _oracle, assert_losses_close, max_abs_diff, tiny_config
from torch import nn

from pipedream2bw.config import ConfigError, OptimConfig, PipelineConfig, build_optimizer, gpt_balance, validate
from pipedream2bw.data import make_feeds
from pipedream2bw.models.factory import model_source
from pipedream2bw.pipeline import schedule
from pipedream2bw.pipeline.versions import NewestVersions, PredictedNewestVersions


def newest_config(*, num_stages: int, num_microbatches: int = 4, forward_lead: int = 0):
    cfg = tiny_config(schedule="2bw", num_stages=num_stages, num_microbatches=num_microbatches)
    cfg.pipeline.weight_versions, cfg.pipeline.forward_lead = "newest", forward_lead
    cfg.pipeline.auto_weight_versions = False  # named, as pipeline.weight_versions=newest on a command line
    return cfg


def _run_in_one_process(cfg, balance, kind=NewestVersions):
    """Every stage's ``kind`` (``NewestVersions``, ``PredictedNewestVersions``) driven through the 2bw schedule's
    actions in one process, in the order of ``schedule.simulate``'s ticks (activations and gradients handed over in
    memory): (each stage's newest weights, the batch losses, each stage's replicas)."""
    d, m, num_steps = len(balance), cfg.pipeline.num_microbatches, cfg.train.num_steps
    torch.manual_seed(cfg.seed)
    source = model_source(cfg.model, seed=cfg.seed)
    layers, ends = source.build(), [sum(balance[:s]) for s in range(d + 1)]
    lead = cfg.pipeline.forward_lead
    stepped = dataclasses.replace(cfg.optim, delay_correction="none")  # the prediction is the versions' (build.py)
    versions = [
        kind(
            nn.Sequential(*layers[ends[s] : ends[s + 1]]),
            schedule="2bw",
            optimizer_factory=lambda params: build_optimizer(params, stepped),
            early_forwards=d - s - 1 + schedule.lead(s, d, m, lead),
            num_microbatches=m,
            **({"horizon": cfg.optim.predict_horizon} if kind is PredictedNewestVersions else {}),
        )
        for s in range(d)
    ]
    feed = make_feeds(
        cfg.data,
        seq_len=cfg.model.seq_len,
        microbatch_size=2,
        num_microbatches=m,
        seed=cfg.seed,
        num_replicas=1,
        replica=0,
    )[0]
    actions = schedule.pipeline_actions(
        "2bw", num_stages=d, num_microbatches=m, num_batches=num_steps, forward_lead=cfg.pipeline.forward_lead
    )
    stash, handed, losses = {}, {}, [0.0] * num_steps
    for tick in schedule.simulate(actions):
        for s, a in ((s, a) for s, a in enumerate(tick) if a is not None):
            k = a.index
            if a.kind == schedule.FORWARD:
                x, y = feed.microbatch(k)
                x = x if s == 0 else handed.pop(("F", s, k)).detach().requires_grad_()
                out = versions[s].module_for_forward(k, m)(x)
                if s == d - 1:
                    out = source.loss_fn(out, y)
                    losses[k // m] += float(out.detach()) / m
                handed[("F", s + 1, k)] = out
                stash[s, k] = (x, out)
            elif a.kind == schedule.BACKWARD:
                x, out = stash.pop((s, k))
                if (k + 1) % m == 0:  # as the stage worker: the batch's gradients gathered before its last backward
                    versions[s].gather_gradients(k // m)
                out.backward(None if s == d - 1 else handed.pop(("B", s, k)))
                handed[("B", s - 1, k)] = x.grad if s > 0 else None
            elif a.kind == schedule.STEP:
                versions[s].step(k, grad_scale=1.0 / m)
    weights = [p.detach() for v in versions for p in v.newest().parameters()]
    return weights, losses, [len(v.replicas) for v in versions]


@pytest.mark.parametrize("d,lead", [(2, 0), (3, 1)])
def test_newest_versions_in_one_process_equal_the_rule(d, lead):
    """No processes: the versions' choices (``module_for_forward``) and sums (``step``) under the real schedule are
    the rule's, to float32 round-off."""
    cfg = newest_config(num_stages=d, forward_lead=lead)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference and the ranks (Adam turns reduction-order noise into steps)
    try:
        weights, losses, _ = _run_in_one_process(cfg, gpt_balance(cfg.model, d))
    finally:
        torch.set_num_threads(threads)
    expected = reference_newest(cfg, balance=gpt_balance(cfg.model, d))
    torch.testing.assert_close(weights, list(expected.weights.values()))
    torch.testing.assert_close(losses, expected.losses)


def predict_config(*, num_stages: int, num_microbatches: int, forward_lead: int = 0, optim: str = "adam"):
    """``newest_config`` with optim.delay_correction=predict and one of test_semantics' ``OPTIMIZERS``."""
    cfg = newest_config(num_stages=num_stages, num_microbatches=num_microbatches, forward_lead=forward_lead)
    cfg.optim = dataclasses.replace(copy.deepcopy(OPTIMIZERS[optim]), delay_correction="predict")
    return cfg


# (d, m, lead, optimizer, each stage's replicas). At an odd m Adam turns the round-off of a gradient that is zero in
# exact arithmetic (attention's key bias) into whole steps, under newest without the prediction too: 2bw's SGD there.
PREDICT_CASES = [
    (2, 2, 0, "adam", [2, 2]),
    (2, 4, 1, "adam", [2, 2]),
    (3, 4, 0, "adam", [2, 2, 2]),
    (3, 4, 1, "adam", [3, 2, 2]),  # stage 0: E = 3 early forwards of m = 4
    (4, 4, 0, "adam", [3, 2, 2, 2]),  # stage 0: E = 3
    (3, 3, 0, "sgd_momentum", [3, 2, 2]),  # stage 0: E = 2
]


@pytest.mark.parametrize("d,m,lead,optim,replicas", PREDICT_CASES)
def test_the_prediction_in_one_process_equals_the_rule(d, m, lead, optim, replicas):
    """optim.delay_correction=predict under newest, no processes: each stage's early forwards run on P(t) = W(t-1) +
    d(t-2) (``PredictedNewestVersions``), the rest on W(t), to float32 round-off of the rule; and not newest's. A
    stage whose E early forwards are more than half of m holds two predictions, P(t) in replica 1 + t % 2: with one,
    batch t+1's prediction overwrites the weights batch t's early microbatches still have to backward through
    (autograd's in-place error)."""
    cfg = predict_config(num_stages=d, num_microbatches=m, forward_lead=lead, optim=optim)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        weights, losses, held = _run_in_one_process(cfg, gpt_balance(cfg.model, d), PredictedNewestVersions)
    finally:
        torch.set_num_threads(threads)
    assert held == replicas
    expected = reference_newest(cfg, balance=gpt_balance(cfg.model, d))
    torch.testing.assert_close(weights, list(expected.weights.values()))
    torch.testing.assert_close(losses, expected.losses)
    plain = reference_newest(
        dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, delay_correction="none")),
        balance=gpt_balance(cfg.model, d),
    )
    assert max(float((a - b).abs().max()) for a, b in zip(weights, plain.weights.values())) > 1e-4


@pytest.mark.slow
def test_newest_equals_its_rule_at_two_stages(tmp_path):
    """Stage 0's microbatch 0 of each batch t >= 1 runs on W(t-1), the rest of the batch on W(t); the pipeline's
    weights and losses are the rule's to float32 round-off, and neither 2bw's batch rule nor flush's."""
    cfg = newest_config(num_stages=2)
    summary = run_ok(cfg, tmp_path)
    assert summary["weight_versions"] == "newest" and summary["delay_correction"] == "none"
    weights = torch.load(tmp_path / "final_model.pt")
    expected = reference_newest(cfg, balance=gpt_balance(cfg.model, 2))
    torch.testing.assert_close(weights, expected.weights)
    assert_losses_close(summary["losses"], expected.losses)
    for delayed in (True, False):  # 2bw's batch rule, flush's minibatch training: far above round-off
        assert max_abs_diff(weights, _oracle(4, "adam", delayed)[0]) > 1e-4


def test_the_predictions_horizon_is_the_rules():
    """optim.predict_horizon = h: the early forwards run on P(t) = W(t-1) + h d(t-2), to float32 round-off of the
    rule at h (d = 3, m = 4: two stages with early forwards), and far from the rule at another h."""
    cfg = predict_config(num_stages=3, num_microbatches=4)
    cfg.optim = dataclasses.replace(cfg.optim, predict_horizon=2.5)
    balance = gpt_balance(cfg.model, 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        weights, losses, _ = _run_in_one_process(cfg, balance, PredictedNewestVersions)
    finally:
        torch.set_num_threads(threads)
    expected = reference_newest(cfg, balance=balance)
    torch.testing.assert_close(weights, list(expected.weights.values()))
    torch.testing.assert_close(losses, expected.losses)
    one = reference_newest(
        dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, predict_horizon=1.0)), balance=balance
    )
    assert max(float((a - b).abs().max()) for a, b in zip(weights, one.weights.values())) > 1e-4


def test_the_predictions_d_counts_as_optimizer_state():
    """d lives in the versions, not the optimizer: summary.json's optimizer_state_bytes (``optimizer_state_bytes``)
    still counts its 4 B a parameter, as it counts the batch rule's prediction in its optimizer's state."""
    module = nn.Linear(3, 2)  # 8 parameters
    adam = lambda params: torch.optim.Adam(params)  # noqa: E731
    versions = PredictedNewestVersions(
        module, schedule="2bw", optimizer_factory=adam, early_forwards=1, num_microbatches=2
    )
    assert versions.optimizer_state_bytes() == 8 * 4  # before any step Adam holds nothing
    plain = NewestVersions(nn.Linear(3, 2), schedule="2bw", optimizer_factory=adam, early_forwards=1)
    assert plain.optimizer_state_bytes() == 0


@pytest.mark.slow
def test_the_prediction_equals_its_rule_at_two_stages(tmp_path):
    """optim.delay_correction=predict under newest at d = 2, m = 2: stage 0's microbatch 0 of batch t >= 1 runs on
    P(t) = W(t-1) + h d(t-2) (h the default), the rest on W(t); the pipeline's weights and losses are the rule's to
    float32 round-off."""
    cfg = newest_config(num_stages=2, num_microbatches=2)
    cfg.optim = dataclasses.replace(cfg.optim, delay_correction="predict")
    summary = run_ok(cfg, tmp_path)
    assert summary["weight_versions"] == "newest" and summary["delay_correction"] == "predict"
    expected = reference_newest(cfg, balance=gpt_balance(cfg.model, 2))
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected.weights)
    assert_losses_close(summary["losses"], expected.losses)


def _planned_weight_bytes(cfg, balance, *, newest_predict: bool):
    """The planner's weight bytes of each stage of ``balance`` (partitioner/cost.py's ``segment_costs`` on the
    analytic costs of ``cfg``'s GPT), under newest's prediction or not (``StageContext.newest_predict``)."""
    from partitioner.cost import Segments, segment_costs
    from partitioner.planner import stage_contexts
    from partitioner.profile import analytic_gpt

    d, p = len(balance), cfg.pipeline
    seg = Segments(analytic_gpt(cfg.model, cfg.optim, p.microbatch_size, cfg.topology))
    contexts = stage_contexts(
        cfg.topology,
        [[s] for s in range(d)],
        schedule="2bw",
        num_microbatches=p.num_microbatches,
        recompute=False,
        swap=False,
        swap_resident=0,
        runtime_bytes=0,
        forward_lead=p.forward_lead,
        newest_predict=newest_predict,
    )
    starts = [sum(balance[:s]) for s in range(d + 1)]
    return [int(segment_costs(seg, starts[s], starts[s + 1], contexts[s])["weights"]) for s in range(d)]


@pytest.mark.parametrize("d,m,lead,optim,replicas", PREDICT_CASES)
def test_the_planner_counts_the_second_prediction_where_the_versions_hold_it(d, m, lead, optim, replicas):
    """A stage holding two predictions (2E > m) has one W more of weights in the planner than the same stage with
    one (or without the prediction: W and the two versions' other buffer), exactly where ``PredictedNewestVersions``
    builds the third replica; the other stages' weights are the same."""
    cfg = predict_config(num_stages=d, num_microbatches=m, forward_lead=lead, optim=optim)
    balance = gpt_balance(cfg.model, d)
    predicted = _planned_weight_bytes(cfg, balance, newest_predict=True)
    plain = _planned_weight_bytes(cfg, balance, newest_predict=False)
    one_w = [w // 2 for w in plain]  # two copies of the stage's float32 weights
    assert [p - q for p, q in zip(predicted, plain)] == [(r - 2) * w for r, w in zip(replicas, one_w)]


@pytest.mark.slow
@pytest.mark.long  # 3 ranks: about 20 s loaded
def test_the_prediction_equals_its_rule_with_a_second_prediction_at_three_stages(tmp_path):
    """d = 3, m = 3: stage 0 runs 2 forwards of each batch on the prediction, more than half of m, so it holds P(t)
    in replica 1 + t % 2 (batch t's early microbatches still backward through P(t) when batch t+1's first forward
    needs P(t+1)); the pipeline's weights and losses are the rule's to float32 round-off (SGD with momentum: at an
    odd m Adam makes steps of the round-off of a zero gradient, ``PREDICT_CASES``). Each rank's weight bytes (its
    replicas' tensors) are the planner's: three copies on stage 0, two on the others; the summary's
    bytes_per_parameter (rank 0's) counts three."""
    cfg = predict_config(num_stages=3, num_microbatches=3, optim="sgd_momentum")
    summary = run_ok(cfg, tmp_path)
    assert summary["weight_versions"] == "newest" and summary["delay_correction"] == "predict"
    expected = reference_newest(cfg, balance=gpt_balance(cfg.model, 3))
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected.weights)
    assert_losses_close(summary["losses"], expected.losses)
    planned = _planned_weight_bytes(cfg, summary["balance"], newest_predict=True)
    assert {r["stage"]: r["weight_bytes"] for r in summary["ranks"]} == dict(enumerate(planned))
    assert summary["bytes_per_parameter"]["versions"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("correction,m", [("none", 4), ("predict", 2)])
def test_newest_with_replicas_equals_its_rule(tmp_path, correction, m):
    """d = 2, w = 2 (4 ranks): each replica runs the rule on its own microbatches; before a batch's last backward a
    stage adds its early microbatches' gradients (on W(t-1), or P(t) under the prediction) into the replica that
    backward runs on (W(t)'s), which the all-reduce averages as it goes. Weights and losses are the rule's, g(t) over
    m * w microbatches, to float32 round-off. Fails with the reducer armed on the early replica, or without the
    gather."""
    cfg = newest_config(num_stages=2, num_microbatches=m)
    cfg.pipeline.data_parallel = 2
    cfg.optim = dataclasses.replace(cfg.optim, delay_correction=correction)
    summary = run_ok(cfg, tmp_path)
    assert (summary["weight_versions"], summary["delay_correction"]) == ("newest", correction)
    expected = reference_newest(cfg, balance=gpt_balance(cfg.model, 2))
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected.weights)
    assert_losses_close(summary["losses"], expected.losses)


@pytest.mark.slow
def test_newest_at_one_stage_is_minibatch_training(tmp_path):
    """At d = 1 every forward of batch t follows step t-1: the rule is flush's, plain minibatch training."""
    summary = run_ok(newest_config(num_stages=1), tmp_path)
    expected, expected_losses = _oracle(4, "adam", False)
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected)
    assert_losses_close(summary["losses"], expected_losses)


@pytest.mark.long
@pytest.mark.slow
def test_newest_equals_its_rule_at_three_stages_with_a_forward_lead(tmp_path):
    """d = 3, pipeline.forward_lead=1, m = 4: stage 0 runs microbatches 0-2 of batch t on W(t-1), stage 1 0-1, the
    last stage none."""
    cfg = newest_config(num_stages=3, forward_lead=1)
    summary = run_ok(cfg, tmp_path)
    expected = reference_newest(cfg, balance=gpt_balance(cfg.model, 3))
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected.weights)
    assert_losses_close(summary["losses"], expected.losses)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["pipeline.schedule=flush"], "pipeline.schedule (flush)"),
        (["pipeline.schedule=zb1p"], "pipeline.schedule (zb1p)"),
        (["optim.delay_correction=error_feedback"], "optim.delay_correction (error_feedback)"),
        (["optim.clip_grad_norm=1.0"], "optim.clip_grad_norm"),
        (["train.precision=fp16"], "train.precision (fp16)"),
        (["train.precision=bf16", "train.weight_dtype=compute", "optim.name=adamw"], "train.weight_dtype (compute)"),
        (["model.tie_embeddings=true"], "model.tie_embeddings"),
        (["optim.sharded=true", "optim.name=adamw"], "optim.sharded"),
        (["pipeline.sync_warmup_steps=2"], "pipeline.sync_warmup_steps"),
        (["swap.optimizer=host"], "swap.optimizer (host)"),
    ],
)
def test_newest_refuses_what_it_is_not_proven_with_in_one_line(overrides, key):
    cfg = make("pipeline.weight_versions=newest", "pipeline.num_stages=2", *overrides)
    world = 2 * cfg.pipeline.data_parallel
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=world)
    assert str(e.value).startswith(f"pipeline.weight_versions=newest with {key}")
    assert "\n" not in str(e.value) and str(e.value).endswith("or pipeline.weight_versions=batch")


@pytest.mark.parametrize(
    "overrides, rule",
    [
        (["optim.name=adamw"], "pipeline.weight_versions=batch with optim.delay_correction=none"),
        (
            ["pipeline.weight_versions=batch"],
            "pipeline.weight_versions=batch with optim.delay_correction=predict_error",
        ),
        (["pipeline.weight_versions=newest", "optim.delay_correction=none"], "newest with optim.delay_correction=none"),
    ],
)
def test_a_horizon_where_newests_prediction_does_not_run_is_refused(overrides, rule):
    """optim.predict_horizon sets newest's prediction alone: another value where it does not run would change
    nothing, so it is refused in one line naming the rule; the default passes there, and the value runs under it."""
    cfg = make("pipeline.num_stages=2", "optim.predict_horizon=2", *overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=2)
    assert str(e.value).startswith(
        "optim.predict_horizon (2.0) sets how far newest's prediction reaches"
    ) and rule in str(e.value)
    assert "\n" not in str(e.value)
    validate(make("pipeline.num_stages=2", *overrides), world_size=2)
    assert make("pipeline.num_stages=2", "optim.predict_horizon=2").optim.delay_correction == "predict"
    validate(make("pipeline.num_stages=2", "optim.predict_horizon=2"), world_size=2)


@pytest.mark.parametrize("extra", [[], ["optim.delay_correction=predict", "pipeline.num_microbatches=2"]])
def test_newest_runs_with_replicas(extra):
    """pipeline.data_parallel > 1 is no longer refused, with or without the prediction (run: ``test_newest_with_
    replicas_equals_its_rule``)."""
    cfg = make("pipeline.weight_versions=newest", "pipeline.num_stages=2", "pipeline.data_parallel=2", *extra)
    validate(cfg, world_size=4)


def _early_and_free(d: int, m: int, lead: int, s: int):
    """Walks stage s's 2bw actions for 4 batches: (its forwards of batch 2 before step 1, whether batch t-1's early
    microbatches are all through their backwards before batch t's first forward, and whether all of batch t-2's are),
    t = 2 and 3."""
    actions = schedule.stage_actions(
        "2bw", stage_index=s, num_stages=d, num_microbatches=m, num_batches=4, forward_lead=lead
    )
    position = {(a.kind, a.index): i for i, a in enumerate(actions)}
    early = sum(1 for j in range(m) if position[(schedule.FORWARD, 2 * m + j)] < position[(schedule.STEP, 1)])

    def through(batch: int, count: int, t: int) -> bool:  # batch's first `count` backwards before t's first forward
        return all(
            position[(schedule.BACKWARD, batch * m + j)] < position[(schedule.FORWARD, t * m)] for j in range(count)
        )

    return early, all(through(t - 1, early, t) for t in (2, 3)), all(through(t - 2, m, t) for t in (2, 3))


def test_the_predictions_replicas_are_the_schedules():
    """config/newest.py's count of each stage's early forwards is the schedule's; its one prediction replica (2 x
    early <= m) is exactly where it is free again before the next batch's first forward, and where it is not, a
    second one, alternating by batch, always is (batch t-2 is through all its backwards before batch t starts)."""
    from pipedream2bw.config.newest import early_forwards, prediction_replicas

    for d in range(1, 6):
        for m in range(d, 10):
            for lead in range(3):
                for s in range(d):
                    early, free, free_two_back = _early_and_free(d, m, lead, s)
                    assert early_forwards(d, m, lead, stage_index=s) == early, (d, m, lead, s)
                    assert free == (prediction_replicas(early, m) == 1), (d, m, lead, s)
                    assert free_two_back, (d, m, lead, s)


@pytest.mark.parametrize(
    "overrides",
    [
        ["pipeline.num_microbatches=3", "pipeline.num_stages=3"],
        ["pipeline.num_microbatches=3", "pipeline.forward_lead=1"],
    ],
)
def test_the_prediction_runs_where_a_stage_holds_two_predictions(overrides):
    """Regression: 2 x stage 0's early forwards > m was refused (one prediction replica would be overwritten under
    its microbatches' backwards); a second replica now takes every other batch's prediction."""
    cfg = make(
        "pipeline.weight_versions=newest",
        "pipeline.num_stages=2",
        "pipeline.num_microbatches=2",
        "optim.delay_correction=predict",
        *overrides,
    )
    validate(cfg, world_size=cfg.pipeline.num_stages)


def test_newest_resolves_muons_auto_to_its_prediction_and_runs_at_the_defaults():
    """Under newest Muon's optim.delay_correction=auto is newest's own prediction at every m (where 2 x stage 0's
    early forwards > m with two prediction replicas there); AdamW's none; the batch rule keeps its default."""
    cfg = make("pipeline.weight_versions=newest", "pipeline.num_stages=2")
    assert cfg.optim.delay_correction == "predict"
    validate(cfg, world_size=2)
    few = make("pipeline.weight_versions=newest", "pipeline.num_stages=4", "pipeline.num_microbatches=4")
    assert few.optim.delay_correction == "predict"
    validate(few, world_size=4)
    assert (
        make("pipeline.weight_versions=newest", "pipeline.num_stages=2", "optim.name=adamw").optim.delay_correction
        == "none"
    )
    assert make("pipeline.num_stages=2", "pipeline.weight_versions=batch").optim.delay_correction == (
        "predict_error_feedback"
    )


@pytest.mark.long
@pytest.mark.slow
def test_newest_under_bf16_equals_its_rule(tmp_path):
    """bf16 autocast stages with float32 versions: the rule under autocast, the activation rounded to bf16 where
    stage 0 sends it (``reference_newest``), to float32 round-off; far from the float32 rule."""
    cfg = newest_config(num_stages=2)
    cfg.train.precision = "bf16"
    summary = run_ok(cfg, tmp_path)
    assert (summary["precision"], summary["weight_versions"]) == ("bf16", "newest")
    weights = torch.load(tmp_path / "final_model.pt")
    torch.testing.assert_close(weights, reference_newest(cfg, balance=gpt_balance(cfg.model, 2)).weights)
    cfg.train.precision = "fp32"
    assert max_abs_diff(weights, reference_newest(cfg, balance=gpt_balance(cfg.model, 2)).weights) > 1e-2


def _resumes_on_the_straight_runs_bits(cfg, tmp_path, *, num_stages: int, resume_at=(2,)) -> None:
    """Runs ``cfg`` straight (its weights: the rule's) and resumed from its checkpoint after each of ``resume_at``
    steps: the same losses and the same bits."""
    summary = run_ok(cfg, tmp_path / "straight")
    weights = torch.load(tmp_path / "straight" / "final_model.pt")
    torch.testing.assert_close(weights, reference_newest(cfg, balance=gpt_balance(cfg.model, num_stages)).weights)
    for n in resume_at:
        path = tmp_path / "straight" / "checkpoints" / f"step_{n:08d}"
        again = run_ok(
            dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=str(path))), tmp_path / f"from{n}"
        )
        assert again["first_step"] == n and again["losses"] == summary["losses"], n
        resumed_weights = torch.load(tmp_path / f"from{n}" / "final_model.pt")
        assert all(torch.equal(resumed_weights[k], w) for k, w in weights.items()), n


@pytest.mark.slow
@pytest.mark.long  # two 2-rank runs (the default tier is at its 10-minute budget)
def test_newest_resumes_where_it_left_off(tmp_path):
    """A resumed pipeline starts afresh at batch n, where no step n-1 comes first: stage 0's first forward (d - s - 1 =
    1 of them at d = 2) runs on the checkpoint's W(n-1), as in the run that wrote it, the rest on W(n). 4 steps straight
    and 2 + 2 resumed end on the same bits (and the 4-step run on its rule). Fails with that forward on W(n)."""
    cfg = newest_config(num_stages=2)
    cfg.train.num_steps, cfg.train.checkpoint_every = 4, 2
    _resumes_on_the_straight_runs_bits(cfg, tmp_path, num_stages=2)


@pytest.mark.slow
@pytest.mark.long
def test_the_prediction_resumes_where_it_left_off(tmp_path):
    """Under the prediction a checkpoint after n steps holds P(n) (stage 0's first forward of batch n runs on it) and
    d(n-1) (the next prediction adds it): 2 + 2 resumed steps end on the 4-step run's bits, which are the rule's."""
    cfg = newest_config(num_stages=2, num_microbatches=2)
    cfg.optim = dataclasses.replace(cfg.optim, delay_correction="predict")
    cfg.train.num_steps, cfg.train.checkpoint_every = 4, 2
    _resumes_on_the_straight_runs_bits(cfg, tmp_path, num_stages=2)


@pytest.mark.slow
@pytest.mark.long
def test_the_prediction_resumes_across_its_second_prediction(tmp_path):
    """d = 3, m = 3, stage 0 holding P(t) in replica 1 + t % 2: a checkpoint after n steps holds P(n) (from replica 2
    at n = 3, replica 1 at n = 2), which the resumed run loads into P(n)'s replica and its first forwards run on;
    2 + 2 and 3 + 1 resumed steps end on the 4-step run's bits, which are the rule's. Fails (at n = 3) with P(n)
    taken from replica 1 whatever n."""
    cfg = predict_config(num_stages=3, num_microbatches=3, optim="sgd_momentum")
    cfg.train.num_steps, cfg.train.checkpoint_every, cfg.train.keep_checkpoints = 4, 1, 4
    _resumes_on_the_straight_runs_bits(cfg, tmp_path, num_stages=3, resume_at=(2, 3))


def test_a_newest_checkpoint_resumes_at_another_layout_but_not_under_the_batch_rule():
    """A checkpoint records newest's rule alone: a resume at other stages, layers, microbatches or forward lead applies
    its own layout's rule (run: matrix.EXTRA's newest cells); one under the batch rule is refused as other settings,
    naming the key and the value to set."""
    from pipedream2bw.io.checkpoint import check_settings
    from pipedream2bw.run.model import training_settings

    cfg = newest_config(num_stages=2)
    manifest = {"training_settings": training_settings(cfg)}
    for other in (cfg, newest_config(num_stages=2, forward_lead=1), newest_config(num_stages=3)):
        assert check_settings(manifest, model={}, training=training_settings(other), where="ckpt", strict=True) == []
    batch = tiny_config(schedule="2bw", num_stages=2, num_microbatches=4)
    batch = dataclasses.replace(batch, pipeline=dataclasses.replace(batch.pipeline, weight_versions="batch"))
    match = r"pipeline.weight_versions: checkpoint 'newest', this run 'batch' \(set pipeline.weight_versions=newest"
    with pytest.raises(ConfigError, match=match):
        check_settings(manifest, model={}, training=training_settings(batch), where="ckpt", strict=True)


def test_a_predicting_newest_checkpoint_records_its_horizon_and_refuses_another():
    """optim.predict_horizon changes what newest's early forwards run on: a newest checkpoint with its prediction
    records it, a resume at another horizon is refused as other settings; without the prediction nothing is recorded."""
    from pipedream2bw.io.checkpoint import check_settings
    from pipedream2bw.run.model import training_settings

    cfg = predict_config(num_stages=2, num_microbatches=2)
    recorded = training_settings(cfg)
    assert recorded["optim.predict_horizon"] == cfg.optim.predict_horizon
    assert "optim.predict_horizon" not in training_settings(newest_config(num_stages=2))
    other = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, predict_horizon=2.0))
    with pytest.raises(ConfigError, match=r"optim.predict_horizon: checkpoint 1.5, this run 2.0"):
        check_settings(
            {"training_settings": recorded}, model={}, training=training_settings(other), where="c", strict=True
        )


@pytest.mark.parametrize(
    "overrides, rule, correction",
    [
        ([], "newest", "predict"),  # Muon at the defaults
        (["pipeline.num_stages=4", "pipeline.num_microbatches=4"], "newest", "predict"),  # a third buffer there
        (["pipeline.schedule=auto"], "newest", "predict"),  # the 2bw candidate's rule
        (["optim.delay_correction=none"], "newest", "none"),
        (["optim.name=adamw"], "batch", "none"),  # newest is measured with Muon only
        (["optim.clip_grad_norm=1.0"], "batch", "predict_error_feedback"),  # newest refuses it: the batch rule's
        (["optim.delay_correction=error_feedback"], "batch", "error_feedback"),
        (["pipeline.recompute=true"], "batch", "predict_error_feedback"),
        (["train.precision=fp16"], "batch", "predict_error_feedback"),
        (["pipeline.schedule=flush"], "batch", "predict_error_feedback"),  # moot: no delay, no correction in effect
    ],
)
def test_auto_picks_newest_for_muon_wherever_newest_runs(overrides, rule, correction):
    """pipeline.weight_versions=auto, the default: newest with its prediction for Muon where newest runs, else the batch
    rule with Muon's default correction there; the choice marked (auto_weight_versions) and validated."""
    cfg = make("pipeline.num_stages=2", *overrides)
    assert (cfg.pipeline.weight_versions, cfg.optim.delay_correction) == (rule, correction)
    assert cfg.pipeline.auto_weight_versions
    if cfg.pipeline.schedule != "auto":
        validate(cfg, world_size=cfg.pipeline.num_stages)


def test_auto_chooses_again_when_the_config_is_made_again():
    """A Config made again from one whose rule 'auto' chose (a plan's keys applied, dataclasses.replace) is resolved
    again: recomputation (which newest refuses) gives the batch rule and Muon's correction under it; undone, newest
    again. A rule named is kept, and refused where newest does not run."""
    cfg = make("pipeline.num_stages=2")
    recompute = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, recompute=True))
    assert (recompute.pipeline.weight_versions, recompute.optim.delay_correction) == ("batch", "predict_error_feedback")
    back = dataclasses.replace(recompute, pipeline=dataclasses.replace(recompute.pipeline, recompute=False))
    assert (back.pipeline.weight_versions, back.optim.delay_correction) == ("newest", "predict")
    named = make("pipeline.num_stages=2", "pipeline.weight_versions=newest")
    assert not named.pipeline.auto_weight_versions
    again = dataclasses.replace(named, pipeline=dataclasses.replace(named.pipeline, recompute=True))
    assert again.pipeline.weight_versions == "newest"
    with pytest.raises(ConfigError, match="^pipeline.weight_versions=newest with pipeline.recompute"):
        validate(again, world_size=2)


def test_auto_runs_a_layer_lists_tie_across_stages_under_the_batch_rule():
    """A layer list's tie across stages shows only once it is built: where 'auto' chose newest, start falls back to the
    batch rule (and Muon's correction under it) instead of refusing; untied, newest stays."""
    from custom_models import masked_layers

    from pipedream2bw.config import LayerListConfig
    from pipedream2bw.run.model import RunModel
    from pipedream2bw.run.start import _check, _newest_or_batch

    cfg = make("pipeline.num_stages=2", "pipeline.num_microbatches=2")
    cfg = dataclasses.replace(cfg, model=LayerListConfig(target="custom_models.masked_layers", kwargs={"width": 8}))
    assert cfg.pipeline.weight_versions == "newest" and cfg.pipeline.auto_weight_versions
    for tie, rule, correction in ((False, "newest", "predict"), (True, "batch", "predict_error_feedback")):
        model = RunModel.of(cfg, masked_layers(width=8, tie=tie), None)
        balance = _check(cfg, model, world_size=2, local_world_size=2)
        ran = _newest_or_batch(cfg, model.tied, balance)
        assert (ran.pipeline.weight_versions, ran.optim.delay_correction) == (rule, correction)


def test_newest_refuses_a_layer_lists_tie_across_stages_before_any_group_starts():
    """A layer list's tie shows once it is built (run/start.py's check, before any group): across stages its gradient
    sum would defer the step. The same list untied passes."""
    from custom_models import masked_layers

    from pipedream2bw.config import LayerListConfig
    from pipedream2bw.run.model import RunModel
    from pipedream2bw.run.start import _check

    cfg = newest_config(num_stages=2, num_microbatches=2)
    cfg.model = LayerListConfig(target="custom_models.masked_layers", kwargs={"width": 8}, seq_len=8)
    assert _check(cfg, RunModel.of(cfg, masked_layers(width=8), None), world_size=2, local_world_size=2) == [3, 2]
    tied = RunModel.of(cfg, masked_layers(width=8, tie=True), None)
    with pytest.raises(ConfigError, match=r"^pipeline.weight_versions=newest with weights tied across stages \(\[\["):
        _check(cfg, tied, world_size=2, local_world_size=2)


def test_under_schedule_auto_newest_is_the_2bw_candidates_rule():
    """pipeline.schedule=auto may choose 2bw: newest is its rule there (moot under the others, partitioner/auto.py);
    what newest refuses whatever the schedule is still refused, naming the key."""
    from pipedream2bw.config.newest import newest_refusal

    assert newest_refusal(make("pipeline.weight_versions=newest", "pipeline.schedule=auto")) is None
    refused = newest_refusal(
        make("pipeline.weight_versions=newest", "pipeline.schedule=auto", "optim.clip_grad_norm=1")
    )
    assert refused.startswith("pipeline.weight_versions=newest with optim.clip_grad_norm")


def _planned(cfg, schedule: str, balance):
    """``cfg`` (pipeline.schedule=auto) with a plan of ``schedule`` applied, as run/start.py applies it."""
    from test_sharding import _plan_of

    from partitioner.auto import apply_plan

    d = len(balance)
    plan = _plan_of(cfg, schedule=schedule, balance=list(balance))
    pipeline, swap = apply_plan(cfg.pipeline, cfg.swap, plan, world_size=d, num_layers=sum(balance))
    return dataclasses.replace(cfg, pipeline=pipeline, swap=swap)


def test_under_schedule_auto_a_tie_across_stages_is_refused_once_the_plan_picks_2bw():
    """As pipeline.check_ties under schedule=auto: a layer list's tie across stages is refused under newest only where
    the plan picks 2bw (after planning, before any group); a plan of flush runs it (newest moot there, the batch rule
    recorded)."""
    from custom_models import masked_layers

    from pipedream2bw.config import LayerListConfig
    from pipedream2bw.run.model import RunModel, training_settings
    from pipedream2bw.run.start import _check

    cfg = newest_config(num_stages=2, num_microbatches=2)
    cfg.pipeline.schedule = "auto"
    cfg.model = LayerListConfig(target="custom_models.masked_layers", kwargs={"width": 8}, seq_len=8)
    tied = RunModel.of(cfg, masked_layers(width=8, tie=True), None)
    with pytest.raises(ConfigError, match=r"^pipeline.weight_versions=newest with weights tied across stages \(\[\["):
        _check(_planned(cfg, "2bw", [3, 2]), tied, world_size=2, local_world_size=2)
    flush = _planned(cfg, "flush", [3, 2])
    assert _check(flush, tied, world_size=2, local_world_size=2) == [3, 2]
    assert flush.pipeline.weight_versions == "batch" and "pipeline.weight_versions" not in training_settings(flush)
    assert training_settings(_planned(cfg, "2bw", [3, 2]))["pipeline.weight_versions"] == "newest"


def _muon(num_stages: int = 1, *, steps: int = 4, **pipeline):
    """A tiny Muon run whose rule and correction 'auto' chooses (newest with its prediction here) unless ``pipeline``
    names them; a checkpoint every 2 steps."""
    cfg = tiny_config(schedule="2bw", num_stages=num_stages, num_microbatches=2, num_steps=steps)
    optim = OptimConfig(name="muon", lr=1e-2, muon_others="adam")
    cfg = dataclasses.replace(cfg, optim=optim, pipeline=dataclasses.replace(cfg.pipeline, **pipeline))
    cfg.train.checkpoint_every = 2
    return cfg


def _resumed(cfg, path, **train):
    """``cfg`` resuming checkpoint ``path`` as run/start.py's ``start`` resumes it (its manifest read first)."""
    from pipedream2bw.io.manifests import resumed_settings

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=str(path), **train))
    return resumed_settings(cfg, path)


def _manifest_of(cfg, tmp_path):
    """A checkpoint directory whose manifest records ``cfg``'s training settings (the rest of it is not read here)."""
    import json

    from pipedream2bw.run.model import training_settings

    path = tmp_path / "checkpoints" / "step_00000002"
    path.mkdir(parents=True)
    manifest = {"step": 2, "training_settings": training_settings(cfg)}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path, manifest


@pytest.mark.slow
def test_a_batch_checkpoint_resumes_at_the_defaults_under_its_rule(tmp_path, caplog):
    """Regression: a checkpoint of the batch rule with its predict_error_feedback (Muon's default before 2026-11-28)
    resumed at today's defaults ('auto': newest with its prediction) was refused as other settings. 'auto' follows the
    checkpoint: 2 + 2 resumed steps end on the bits of 4 straight steps under the batch rule, summary.json records the
    rule and correction that ran, and the planner prices that rule. Fails with auto's own choice on a resume."""
    from test_sharding import _plan_of

    from partitioner.auto import plan_rule

    defaults = _muon()
    assert (defaults.pipeline.weight_versions, defaults.optim.delay_correction) == ("newest", "predict")
    batch = _muon(weight_versions="batch", auto_weight_versions=False)
    assert batch.optim.delay_correction == "predict_error_feedback"
    straight = run_ok(batch, tmp_path / "batch")
    path = tmp_path / "batch" / "checkpoints" / "step_00000002"
    with caplog.at_level("INFO", logger="pipedream2bw.config.newest"):
        followed = _resumed(defaults, path)
    assert (followed.pipeline.weight_versions, followed.optim.delay_correction) == ("batch", "predict_error_feedback")
    assert "under its own pipeline.weight_versions=batch, optim.delay_correction=predict_error_feedback" in caplog.text
    assert plan_rule(followed, _plan_of(followed, schedule="2bw", balance=[3])) == "batch"
    resumed = dataclasses.replace(defaults, train=dataclasses.replace(defaults.train, resume=str(path)))
    again = run_ok(resumed, tmp_path / "resumed")
    assert (again["weight_versions"], again["delay_correction"]) == ("batch", "predict_error_feedback")
    assert again["first_step"] == 2 and again["losses"] == straight["losses"]
    want, got = (torch.load(tmp_path / d / "final_model.pt") for d in ("batch", "resumed"))
    assert all(torch.equal(got[k], w) for k, w in want.items())


def test_a_rule_or_correction_named_is_never_replaced_by_the_checkpoints(tmp_path):
    """Only 'auto' follows a checkpoint: pipeline.weight_versions=newest named on a batch checkpoint is kept, and the
    resume refused as other settings naming the rule to set; a correction named is kept too. A checkpoint written
    before newest existed records no rule: 'auto' resumes it under the batch rule."""
    from pipedream2bw.io.checkpoint import check_settings
    from pipedream2bw.run.model import training_settings

    path, manifest = _manifest_of(_muon(weight_versions="batch", auto_weight_versions=False), tmp_path)
    named = _resumed(_muon(weight_versions="newest", auto_weight_versions=False), path)
    assert (named.pipeline.weight_versions, named.optim.delay_correction) == ("newest", "predict")
    match = r"pipeline.weight_versions: checkpoint 'batch', this run 'newest' \(set pipeline.weight_versions=batch"
    with pytest.raises(ConfigError, match=match):
        check_settings(manifest, model={}, training=training_settings(named), where=path, strict=True)
    ef = _muon()
    ef.optim.delay_correction, ef.optim.auto_correction = "error_feedback", False
    ef = _resumed(dataclasses.replace(ef), path)
    assert (ef.pipeline.weight_versions, ef.optim.delay_correction) == ("batch", "error_feedback")
    del manifest["training_settings"]["pipeline.weight_versions"]  # as written before 2026-11-27
    (path / "manifest.json").write_text(__import__("json").dumps(manifest))
    assert _resumed(_muon(), path).pipeline.weight_versions == "batch"


def test_a_newest_checkpoint_with_a_key_newest_refuses_names_the_fixes_that_work(tmp_path):
    """Regression: a newest checkpoint resumed with pipeline.recompute=true had 'auto' pick batch, whose refusal said
    to set newest, which recompute refuses: a dead end. The refusal now names the key and each way on, and each
    works: the key set back resumes under newest (the settings match and the config validates);
    train.resume_strict=false goes on under the batch rule (run: tests/test_newest.py's next test)."""
    from pipedream2bw.io.checkpoint import check_settings
    from pipedream2bw.run.model import training_settings

    path, manifest = _manifest_of(_muon(), tmp_path)
    recompute = _muon(recompute=True)
    assert recompute.pipeline.weight_versions == "batch"
    match = (
        r"^checkpoint .*step_00000002 was trained under pipeline.weight_versions=newest, optim.delay_correction="
        r"predict, which 'auto' resumes it under, but this run refuses it: pipeline.recompute: not proven; set it "
        r"false to resume as trained, train.resume_strict=false to go on under pipeline.weight_versions=batch, "
        r"optim.delay_correction=predict_error_feedback, .*or train.resume=never to start afresh$"
    )
    with pytest.raises(ConfigError, match=match):
        _resumed(recompute, path)
    fixed = _resumed(_muon(recompute=False), path)
    assert (fixed.pipeline.weight_versions, fixed.optim.delay_correction) == ("newest", "predict")
    assert check_settings(manifest, model={}, training=training_settings(fixed), where=path, strict=True) == []
    validate(fixed, world_size=1)
    loose = _resumed(recompute, path, resume_strict=False)
    assert (loose.pipeline.weight_versions, loose.optim.delay_correction) == ("batch", "predict_error_feedback")
    validate(loose, world_size=1)


@pytest.mark.slow
def test_a_newest_checkpoint_goes_on_under_the_batch_rule_when_not_strict(tmp_path):
    """What the refusal above offers: train.resume_strict=false resumes a newest checkpoint with pipeline.recompute=true
    under the batch rule (the difference logged) and trains to the end from the checkpoint's step."""
    run_ok(_muon(), tmp_path / "newest")
    path = tmp_path / "newest" / "checkpoints" / "step_00000002"
    cfg = _muon(recompute=True)
    cfg.train.resume, cfg.train.resume_strict = str(path), False
    again = run_ok(cfg, tmp_path / "loose")
    assert (again["weight_versions"], again["delay_correction"], again["first_step"]) == (
        "batch",
        "predict_error_feedback",
        2,
    )
    log = (tmp_path / "loose" / "logs" / "rank0.log").read_text()
    assert "although its settings differ" in log and "pipeline.weight_versions: checkpoint 'newest'" in log


def test_a_newest_checkpoint_recorded_with_its_layout_resumes_as_newest(tmp_path):
    """Regression: checkpoints written on 2026-11-27 record pipeline.weight_versions as 'newest (num_stages 2, ...)'.
    'auto' did not follow it (a run whose keys refuse newest fell to batch), and check_settings' refusal said to set
    that string, which is no value. It is read as newest: 'auto' follows it (and refuses, in one line, where a key
    refuses newest), pipeline.weight_versions=newest named matches it at its layout; under newest's prediction, whose
    last stage then kept no P(n), another layout is refused naming the layout to set."""
    import json

    from pipedream2bw.config.newest import read_layout_record
    from pipedream2bw.io.checkpoint import check_settings
    from pipedream2bw.run.model import training_settings

    path, manifest = _manifest_of(_muon(2), tmp_path)
    old = "newest (num_stages 2, balance even, num_microbatches 2, forward_lead 0)"
    manifest["training_settings"]["pipeline.weight_versions"] = old
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert manifest["training_settings"]["optim.delay_correction"] == "predict"
    with pytest.raises(ConfigError, match=r"trained under pipeline.weight_versions=newest, optim.delay_correction=pre"):
        _resumed(_muon(2, recompute=True), path)
    named = _muon(2, weight_versions="newest", auto_weight_versions=False)
    for cfg in (_resumed(_muon(2), path), _resumed(named, path)):
        assert (cfg.pipeline.weight_versions, cfg.optim.delay_correction) == ("newest", "predict")
        recorded = {"training_settings": read_layout_record(manifest["training_settings"], cfg.pipeline)}
        assert check_settings(recorded, model={}, training=training_settings(cfg), where=path, strict=True) == []
    other = _resumed(_muon(2, num_microbatches=4), path)
    recorded = {"training_settings": read_layout_record(manifest["training_settings"], other.pipeline)}
    fix = (
        "set pipeline.weight_versions=newest pipeline.num_stages=2 pipeline.balance=null pipeline.num_microbatches=2 "
        "pipeline.forward_lead=0 to resume as trained"
    )
    with pytest.raises(ConfigError, match=re.escape(fix)):
        check_settings(recorded, model={}, training=training_settings(other), where=path, strict=True)


@pytest.mark.parametrize("balance", [None, [3, 2], [2, 2, 1]])
def test_a_layout_records_hint_names_its_layout_as_overrides(balance):
    """Regression: the hint split the record at ', ', which a balance list holds too ('balance [3, 2]'), and raised
    ValueError in place of the refusal. Each layout 2026-11-27 recorded reads back as the overrides that set it."""
    from pipedream2bw.config.newest import layout_hint, layout_record

    p = PipelineConfig(num_stages=len(balance or [1, 1]), balance=balance, num_microbatches=8, forward_lead=1)
    want = "null" if balance is None else str(balance).replace(" ", "")
    assert layout_hint(layout_record(p)) == (
        f"pipeline.weight_versions=newest pipeline.num_stages={p.num_stages} pipeline.balance={want} "
        "pipeline.num_microbatches=8 pipeline.forward_lead=1"
    )


@pytest.mark.parametrize("resume", ["path", "auto"])
def test_the_launchers_precheck_refuses_a_resume_that_follow_checkpoint_refuses(tmp_path, resume):
    """Regression: the precheck (the launcher's and each rank's, before any process group) did not follow the
    checkpoint, so a resume 'auto' would refuse (a newest checkpoint with pipeline.recompute=true) was refused only
    by the ranks after launch. Now its one line comes first, for train.resume=PATH and for resume=auto in
    hydra.run.dir."""
    from pipedream2bw import precheck

    path, _ = _manifest_of(_muon(), tmp_path)
    where = [f"train.resume={path}"] if resume == "path" else [f"hydra.run.dir={tmp_path}"]
    mistake = precheck.check([*where, "pipeline.recompute=true"], world_size=4, local_world_size=4)
    assert mistake is not None and mistake.startswith("checkpoint "), mistake
    assert (
        "was trained under pipeline.weight_versions=newest" in mistake and "pipeline.recompute: not proven" in mistake
    )
