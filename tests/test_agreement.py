"""Steps that need every stage (docs/design.md section 7): global clipping, LR schedules, non-finite steps,
against the oracle."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from dist_helper import poisoned_layers, run_ok, spawn, train_poisoned
from reference import clip_grads, grad_norm, reference_run
from test_checkpoint import assert_equal_bits, weights
from test_semantics import assert_losses_close, tiny_config
from torch import nn

from pipedream2bw.config import ConfigError, OptimConfig, validate
from pipedream2bw.io import checkpoint
from pipedream2bw.pipeline.agreement import NonFiniteError, StepOutcome, StepRule, apply_due, clip_coefficient, sq_norm
from pipedream2bw.pipeline.schedule import STEP, stage_actions
from pipedream2bw.pipeline.versions import WeightVersions
from pipedream2bw.run.lr_schedule import lr_at

CLIP = 0.3  # below every step's gradient norm in these runs (1.0 .. 3.0): clipping acts on every step


def test_reference_clips_from_the_norm_the_pipeline_agrees_on():
    """Regression (issue: zb1p-d1w2-bf16-clip-hostopt-val-muon of the 3-wise matrix failed at 1.fc.weight by
    1.4e-2): the reference took ``clip_grad_norm_``'s norm, the per-tensor norms reduced in float32, one float32 unit
    from the pipeline's float64 sum of squares in some steps; its clip coefficient a unit off, bf16's forward and
    Muon's normalized step grew the unit. On gradients where the two norms differ (seed 3), the reference's norm and
    clipped gradients are the pipeline's, bit for bit."""
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=g) * s for n, s in ((64, 1e-2), (300, 3e-3), (17, 0.5), (1000, 1e-3))]
    params = [nn.Parameter(torch.zeros_like(x)) for x in grads]
    for p, x in zip(params, grads):
        p.grad = x.clone()
    agreed = math.sqrt(float(sq_norm(grads)))  # what StepOutcome.grad_norm holds at w = 1, d = 1
    torch_norm = float(torch.nn.utils.clip_grad_norm_([nn.Parameter(x.clone()) for x in grads], math.inf))
    assert float(torch.tensor(agreed, dtype=torch.float32)) != torch_norm  # the case where the two differ
    assert grad_norm(params) == agreed
    clip_grads(params, CLIP, grad_norm(params))
    coef = clip_coefficient(agreed, CLIP)  # the pipeline folds it into the gradient scale (run/stage.py)
    assert all(torch.equal(p.grad, x * coef) for p, x in zip(params, grads))


def clipped_config(schedule: str, *, d: int, w: int = 1, m: int, steps: int = 6):
    """SGD with momentum (Adam would blow reduction-order round-off on ~zero gradients up to lr-sized
    steps), clipping on every step, warm-up then cosine decay; the global batch is 8 sequences."""
    cfg = tiny_config(schedule=schedule, num_stages=d, num_microbatches=m, optim="sgd_momentum", num_steps=steps)
    cfg.pipeline.data_parallel, cfg.pipeline.microbatch_size = w, 8 // (w * m)
    cfg.optim = OptimConfig(
        name="sgd",
        lr=0.2,
        kwargs={"momentum": 0.9},
        scheduler="cosine",
        warmup_steps=2,
        min_lr=0.02,
        clip_grad_norm=CLIP,
    )
    return cfg


def oracle_config(cfg):
    ref = tiny_config(schedule="2bw", num_stages=1, num_microbatches=4, num_steps=cfg.train.num_steps)
    ref.optim = cfg.optim
    return ref


def assert_matches_oracle(summary: dict, final: dict, cfg, *, delayed: bool, layers=None):
    ref = reference_run(oracle_config(cfg), delayed=delayed, layers=layers)
    torch.testing.assert_close(final, ref.weights)
    assert_losses_close(summary["losses"], ref.losses)
    assert summary["lrs"] == pytest.approx(ref.lrs, rel=1e-12)
    assert summary["skipped_steps"] == ref.skipped_steps
    finite = [t for t in range(len(ref.grad_norms)) if t not in ref.skipped_steps]
    torch.testing.assert_close(
        torch.tensor([summary["grad_norms"][t] for t in finite]), torch.tensor([ref.grad_norms[t] for t in finite])
    )
    return ref


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,d,w,m",
    [
        # 4 ranks (11 s quiet): with the long ones; the matrix's clipped cells hold clipping over replicas
        pytest.param("flush", 2, 2, 2, marks=pytest.mark.long),
        ("gpipe", 2, 1, 4),
        ("2bw", 4, 1, 4),
        pytest.param("zbv", 2, 1, 4, marks=pytest.mark.long),  # the norm over both of a rank's chunks
    ],
)
def test_clipping_and_schedule_match_the_oracle(tmp_path, schedule, d, w, m):
    # flush 2x2: each stage counted once in the norm, though both replicas hold its gradient.
    # 2bw d=4 with sends batched to the next receive (the NCCL transfer mode): the deferred
    # steps and the agreement waits must not deadlock against held sends.
    cfg = clipped_config(schedule, d=d, w=w, m=m)
    if schedule == "2bw":
        cfg.dist.batch_p2p = True
        cfg.pipeline.trace, cfg.pipeline.trace_first_step, cfg.pipeline.trace_steps = True, 2, 2
    summary = run_ok(cfg, tmp_path)
    if schedule == "2bw":  # the step of batch t is applied after 2(m-d+1+s) more forwards and backwards
        spans = [
            e
            for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
            if e["ph"] == "X" and e["cat"] in "FBS"
        ]
        for s in range(d):
            mine = sorted((e for e in spans if e["pid"] == s), key=lambda e: e["ts"])
            for t in (2, 3):
                close, apply = [i for i, e in enumerate(mine) if e["name"] == f"S{t}"]  # CLOSE(t) and APPLY(t)
                assert apply - close - 1 == 2 * (m - d + 1 + s), (s, t, [e["name"] for e in mine])
    assert_matches_oracle(summary, weights(tmp_path), cfg, delayed=schedule == "2bw")
    assert all(n > CLIP for n in summary["grad_norms"]), summary["grad_norms"]  # clipped on every step
    expected_lrs = [
        0.1,
        0.2,
        0.2,
        0.02 + 0.09 * (1 + math.cos(math.pi / 3)),
        0.02 + 0.09 * (1 + math.cos(2 * math.pi / 3)),
        0.02,
    ]
    assert summary["lrs"] == pytest.approx(expected_lrs)
    assert all(r["agreement_exposed_s"] >= 0 for r in summary["ranks"])


@pytest.mark.slow
def test_2bw_clipping_matches_the_oracle_and_resumes_exactly(tmp_path):
    """2bw d=2: deferred steps give the oracle's weights, lrs and norms; resuming from the step-3
    checkpoint gives the same run bit for bit (the lr from the step, losses and norms so far from
    the checkpoint). The schedule spans train.num_steps, so the resumed run keeps num_steps=6."""
    cfg = clipped_config("2bw", d=2, m=2)
    cfg.train.checkpoint_every = 3
    straight = run_ok(cfg, tmp_path / "straight")
    assert_matches_oracle(straight, weights(tmp_path / "straight"), cfg, delayed=True)
    # ...and the clipping is not a no-op: without it the oracle ends elsewhere.
    cfg.optim.clip_grad_norm = None
    unclipped = reference_run(oracle_config(cfg), delayed=True).weights
    assert max(float((weights(tmp_path / "straight")[k] - v).abs().max()) for k, v in unclipped.items()) > 1e-3
    cfg.optim.clip_grad_norm = CLIP
    cfg.train.resume = str(tmp_path / "straight" / "checkpoints" / "step_00000003")
    resumed = run_ok(cfg, tmp_path / "resumed")
    assert resumed["first_step"] == 3
    for key in ("losses", "lrs", "grad_norms", "skipped_steps"):
        assert resumed[key] == straight[key], key
    assert_equal_bits(weights(tmp_path / "resumed"), weights(tmp_path / "straight"))


@pytest.mark.slow
def test_nonfinite_gradient_in_one_stage_skips_that_step_everywhere(tmp_path):
    # An inf in the gradient of layer 1 (stage 0) at batch 3; stage 1's gradients stay finite.
    # Every stage must skip step 3 and go on exactly as the oracle that skips it.
    cfg = clipped_config("2bw", d=2, m=4)  # the oracle's microbatches, so the poisoned call is the same
    cfg.optim.clip_grad_norm = None
    cfg.train.on_nonfinite = "skip"
    cfg.swap.optimizer = "host"  # HostOptimizerVersions: its masters must stay at W(3) through the skip
    layer, call = 1, 3 * 4 + 1
    summary = run_ok_with(train_poisoned, cfg, tmp_path, layer, call, "inf_grad")
    final = weights(tmp_path)
    assert all(torch.isfinite(v).all() for v in final.values())
    ref = assert_matches_oracle(summary, final, cfg, delayed=True, layers=poisoned_layers(cfg, layer, call, "inf_grad"))
    assert summary["skipped_steps"] == ref.skipped_steps == [3]
    assert math.isinf(summary["grad_norms"][3])
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "non-finite gradient on stage 0 at step 3: step skipped on every stage" in log, log


def run_ok_with(fn, cfg, run_dir: Path, *args) -> dict:
    results = spawn(
        fn,
        world_size=cfg.pipeline.num_stages * cfg.pipeline.data_parallel,
        args=(cfg, str(run_dir), *args),
        log_dir=Path(run_dir) / "logs",
        timeout_s=120,
    )
    bad = [r for r in results if r.exitcode != 0]
    assert not bad, "\n".join(f"--- rank {r.rank} exit {r.exitcode}\n{r.log}" for r in bad)
    return json.loads((Path(run_dir) / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "layer,how,what", [(5, "nan", "loss (nan) at step 4 on stage 1"), (1, "inf_grad", "gradient at step 4 on stage 0")]
)
def test_nonfinite_stops_every_rank_and_keeps_the_last_checkpoint(tmp_path, layer, how, what):
    # The LM head (layer 5, stage 1) outputs NaN, or layer 1 (stage 0) gets an inf gradient, on
    # batch 4's first microbatch. Neither clipping nor skipping is on: no agreement runs, the rank
    # that sees it stops and the failure monitor takes the others down.
    cfg = tiny_config(schedule="2bw", num_stages=2, num_microbatches=2, optim="sgd_momentum", num_steps=20)
    cfg.train.checkpoint_every = 1
    results = spawn(
        train_poisoned,
        world_size=2,
        args=(cfg, str(tmp_path), layer, 4 * 2 + 1, how),
        log_dir=tmp_path / "logs",
        timeout_s=240,
    )
    assert all(r.exitcode not in (0, -9) for r in results), [(r.rank, r.exitcode) for r in results]
    stage = int(what[-1])
    for r in results:
        assert (
            f"rank {stage} (stage {stage}) failed: NonFiniteError: non-finite {what}; train.on_nonfinite=stop" in r.log
        ), r.log
        assert "done:" not in r.log
    kept = checkpoint.complete_checkpoints(tmp_path / "checkpoints")
    assert kept and 3 <= json.loads((kept[0] / "manifest.json").read_text())["step"] <= 4
    for f in kept[0].glob("layer_*.pt"):
        assert all(torch.isfinite(v).all() for v in torch.load(f)["weights"].values()), f
    assert not (tmp_path / "summary.json").exists()


# --- pure -------------------------------------------------------------------------------------


def test_lr_schedules():
    o = OptimConfig(lr=1.0, scheduler="linear", warmup_steps=4, min_lr=0.1)
    assert [lr_at(t, o, num_steps=10) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, o, num_steps=10) == 1.0 and lr_at(9, o, num_steps=10) == pytest.approx(0.1)
    assert lr_at(6, o, num_steps=10) == pytest.approx(1.0 - 0.9 * 2 / 5)
    o.scheduler = "cosine"
    assert lr_at(4, o, num_steps=10) == 1.0 and lr_at(9, o, num_steps=10) == pytest.approx(0.1)
    assert lr_at(6, o, num_steps=10) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 2 / 5)))
    o.scheduler, o.warmup_steps = "constant", 0
    assert {lr_at(t, o, num_steps=10) for t in range(10)} == {1.0}


@pytest.mark.parametrize(
    "override,match",
    [
        ({"scheduler": "step"}, r"optim.scheduler \('step'\) is unknown"),
        ({"warmup_steps": 7}, r"optim.warmup_steps \(7\) must be in \[0, train.num_steps \(6\)\]"),
        ({"min_lr": 1.0}, r"optim.min_lr \(1.0\) must be in \[0, optim.lr \(0.2\)\]"),
        ({"clip_grad_norm": 0.0}, r"optim.clip_grad_norm \(0.0\) must be > 0"),  # its range, checked first
    ],
)
def test_bad_step_settings_are_config_errors(override, match):
    cfg = clipped_config("2bw", d=2, m=2)
    for k, v in override.items():
        setattr(cfg.optim, k, v)
    with pytest.raises(ConfigError, match=match):
        validate(cfg, world_size=2)
    cfg = clipped_config("2bw", d=2, m=2)
    cfg.train.on_nonfinite = "ignore"
    with pytest.raises(ConfigError, match=r"train.on_nonfinite \('ignore'\) is unknown; use one of \['stop', 'skip'\]"):
        validate(cfg, world_size=2)


def test_clip_coefficient_is_clip_grad_norm_s():
    grads = [torch.randn(5, 3) * 4, torch.randn(7)]
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
    expected = torch.cat([p.grad.reshape(-1) for p in params])
    coef = clip_coefficient(float(torch.cat([g.reshape(-1) for g in grads]).double().norm()), 0.5)
    torch.testing.assert_close(torch.cat([g.reshape(-1) for g in grads]) * coef, expected)
    assert clip_coefficient(float(norm) / 100, 0.5) == 1.0  # below the threshold: untouched
    rule = StepRule(clip_grad_norm=None, on_nonfinite="stop")
    with pytest.raises(
        NonFiniteError,
        match=r"non-finite loss on stage 3 and gradient on stages 0, 3 at step 5; train.on_nonfinite=stop",
    ):
        rule.decide(StepOutcome(step=5, grad_norm=math.nan, loss_stages=(3,), grad_stages=(0, 3)))
    assert StepRule(on_nonfinite="skip").decide(StepOutcome(step=5, grad_norm=math.inf, grad_stages=(1,))).skip


@pytest.mark.parametrize("d,m", [(1, 1), (2, 2), (3, 4), (4, 4), (4, 7)])
def test_deferred_steps_need_no_third_version(d, m):
    """2bw with APPLY(t) deferred as StageWorker.run does: every forward finds its version alive,
    batch t+1's gradients never land in the replica that APPLY(t) consumes and overwrites, and
    every APPLY but the first and last has work to hide the agreement behind (docs/design.md section 7)."""
    for s in range(d):
        actions = stage_actions("2bw", stage_index=s, num_stages=d, num_microbatches=m, num_batches=5)
        versions = WeightVersions(
            nn.Linear(1, 1), schedule="2bw", optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1)
        )
        pending, slack = None, {}
        for a in actions:
            if pending is not None and apply_due(a, pending, num_microbatches=m):
                versions.step(pending, grad_scale=1.0)
                pending = None
            if a.kind == STEP:
                assert pending is None  # one closed batch at a time
                if versions.module_for_batch(a.index + 1) is versions.module_for_batch(a.index):
                    assert a.index == 0  # only W(-1) = W(0) shares a replica: applied at once
                    versions.step(a.index, grad_scale=1.0)
                else:
                    pending, slack[a.index] = a.index, 0
                continue
            module = versions.module_for_batch(a.index // m)  # asserts that its version is alive
            if pending is not None:
                assert a.index // m == pending + 1 and module is not versions.module_for_batch(pending)
                slack[pending] += 1
        del slack[4]  # the last batch's APPLY is at the end of the run
        # F/B actions between CLOSE(t) and APPLY(t) in steady state: 2(m-d+1+s), from 2(m-d+1) >= 2
        # on stage 0 (one F and one B at m = d) to 2m on the last stage.
        assert min(slack.values()) == 2 * (m - d + 1 + s), (s, slack)


@pytest.mark.parametrize("rank_map", [None, [[1], [0]]])
def test_bug_rank0_as_last_stage_logged_the_next_batchs_loss_under_deferred_steps(tmp_path, rank_map):
    """Bug (found by tests/test_matrix.py): rank 0 holding a last stage kept its own batch loss in one
    slot, which batch t+1's last forward overwrote before the deferred APPLY(t) read it: under 2bw with
    clipping at d=1 (or rank 0 mapped onto the last stage), losses [L0, L2, ..., L5, L5]. Training was right."""
    d = 1 if rank_map is None else 2
    cfg = clipped_config("2bw", d=d, m=4)
    cfg.pipeline.rank_map = rank_map
    summary = run_ok(cfg, tmp_path)
    assert_matches_oracle(summary, weights(tmp_path), cfg, delayed=True)


@pytest.mark.parametrize("schedule", ["2bw", "gpipe"])
def test_bug_grad_norm_counted_tied_copies_unsummed_without_clipping(tmp_path, schedule):
    """Bug (found by tests/test_matrix.py): with a weight tied across stages, the agreed norm summed
    each holder's own (un-exchanged) gradient of the tie, unless clipping was on: under skip (or fp16)
    alone, summary.json's grad_norms were not the global norm (training was right: only finiteness is read)."""
    cfg = clipped_config(schedule, d=2, m=4)
    cfg.optim.clip_grad_norm = None
    cfg.model.tie_embeddings = True
    cfg.train.on_nonfinite = "skip"
    summary = run_ok(cfg, tmp_path)
    ref_cfg = oracle_config(cfg)
    ref_cfg.model.tie_embeddings = True
    ref = reference_run(ref_cfg, delayed=schedule == "2bw")
    torch.testing.assert_close(weights(tmp_path), ref.weights)
    torch.testing.assert_close(torch.tensor(summary["grad_norms"]), torch.tensor(ref.grad_norms))
