"""Mixed precision (train.precision): bf16/fp16 autocast stages against a single-process autocast
oracle, fp16 loss scaling with a skipped step agreed by every rank, and its exact resume."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path
from typing import Sequence

import pytest
import torch
from dist_helper import spawn
from reference import reference_eval, reference_train
from test_semantics import assert_losses_close, max_abs_diff, tiny_config

from partitioner.cost import Segments, StageContext, StageCost
from partitioner.profile import analytic_gpt
from pipedream2bw.config import (
    Config,
    ConfigError,
    GPTConfig,
    OptimConfig,
    TopologyConfig,
    TrainConfig,
    gpt_balance,
    validate,
)
from pipedream2bw.memory.loss_scale import LossScaler
from pipedream2bw.memory.precision import (
    markdown_table,
    markdown_table_sharded,
    needs_agreement,
    param_memory,
    step_waits,
)
from pipedream2bw.models import build_gpt_layers
from pipedream2bw.pipeline import comm
from pipedream2bw.run.runner import run

# ---- pure -------------------------------------------------------------------------------------


def test_loss_scaler_follows_torchs_rule_and_resumes_from_its_state():
    """The scale sequence of torch's own update (GradScaler's kernel) for random overflow flags,
    and a scaler rebuilt from a mid-run state_dict continues identically."""
    rng = random.Random(0)
    flags = [rng.random() < 0.3 for _ in range(60)]
    ours = LossScaler(init_scale=1024.0, growth_interval=3)
    scale, tracker = torch.tensor([1024.0]), torch.tensor([0], dtype=torch.int32)
    resumed = None
    for i, found in enumerate(flags):
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(found)]), 2.0, 0.5, 3)
        ours.update(found)
        assert (ours.scale, ours.clean_steps) == (float(scale), int(tracker)), i
        if i == 20:
            resumed = LossScaler(growth_interval=3)
            resumed.load_state_dict(ours.state_dict())
        elif resumed is not None:
            resumed.update(found)
            assert resumed.state_dict() == ours.state_dict()
    assert ours.skipped_steps == sum(flags)


def test_fp16_overflow_stop_names_the_fixes():
    # issue 35: the stop named train.on_nonfinite=stop, not what fixes an fp16 overflow (bf16, the floor, skip).
    from pipedream2bw.memory.loss_scale import ScaledStepRule
    from pipedream2bw.pipeline.agreement import NonFiniteError, StepOutcome

    rule = ScaledStepRule(LossScaler(init_scale=4.0, min_scale=1.0), lag=2)
    overflow = [StepOutcome(step=t, grad_norm=math.inf, grad_stages=(1,)) for t in range(3)]
    assert rule.decide(overflow[0]).skip and rule.decide(overflow[1]).skip  # scale 2, then 1: skipped
    with pytest.raises(NonFiniteError) as err:
        rule.decide(overflow[2])  # 0.5 < train.loss_scale_min
    assert str(err.value).endswith(
        "the fp16 loss scale fell to 0.5, below train.loss_scale_min (1); the gradients keep overflowing; "
        "train.on_nonfinite=stop ends the run (the last complete checkpoint is kept): set train.precision=bf16 "
        "(float32's range: no loss scale to overflow), lower train.loss_scale_min (now 1), lower optim.lr, "
        "or set train.on_nonfinite=skip to skip such steps"
    ), err.value


def test_bytes_per_parameter_and_the_planner_uses_them():
    assert param_memory("fp32", schedule="2bw", optimizer="adamw").total == 2 * 4 + 4 + 8
    assert (
        param_memory("bf16", schedule="flush", optimizer="sgd", optimizer_kwargs={"momentum": 0.9}).total == 4 + 4 + 4
    )
    # optim=custom names its class by import path (optim._target_): the same bytes as by name
    assert param_memory("fp32", schedule="flush", optimizer="torch.optim.SGD").total == 4 + 4
    assert param_memory("bf16", schedule="2bw", optimizer="adam").cast_per_microbatch == 2
    assert param_memory("fp32", schedule="2bw", optimizer="adam").cast_per_microbatch == 0
    # A waiting step holds the closed batch's gradient (sharded: its shard) while the next one accumulates:
    # under 2bw with a step agreement (fp16's loss scaling is one) or ties; sharded, also with validation.
    assert param_memory("fp32", schedule="2bw", optimizer="adamw", waits=True).total == 2 * 4 + 4 + 4 + 8
    held = param_memory("bf16", schedule="2bw", optimizer="adamw", sharded=True, data_parallel=4, waits=True)
    assert held.held_gradient == 1 and held.total == 2 * 4 + 1 + 4 + 1 + 2
    assert step_waits(
        "2bw", agreement=needs_agreement("fp16", clip_grad_norm=None, on_nonfinite="stop"), tied_across_stages=False
    )
    assert not step_waits("flush", agreement=True, tied_across_stages=True)
    assert step_waits("2bw", agreement=False, tied_across_stages=True)
    assert not step_waits("2bw", agreement=False, tied_across_stages=False, sharded=True)  # APPLY before t+1's B
    assert step_waits("2bw", agreement=False, tied_across_stages=False, sharded=True, early_apply=False)
    # sharded with clipping, APPLY(t) runs 1 + 2s compute steps after CLOSE(t): stage 0 holds nothing
    assert [
        step_waits("2bw", agreement=True, tied_across_stages=False, sharded=True, stage_index=s) for s in (0, 1)
    ] == [
        False,
        True,
    ]
    # The planner's memory model holds exactly those bytes per parameter for a stage's weights,
    # gradients and optimizer state, at every precision, and its activations follow the compute dtype.
    model = GPTConfig(num_layers=4, d_model=64, num_heads=2, seq_len=32)
    blocks = {}
    for precision in ("fp32", "bf16", "fp16"):
        for schedule in ("2bw", "gpipe"):
            layers = analytic_gpt(model, OptimConfig(name="adamw"), 2, TopologyConfig(), precision=precision)
            cost = StageCost.of(Segments(layers), 1, 3, StageContext(0, 2, 4, 1, schedule=schedule))
            num_params = 2 * (12 * 64 * 64 + 13 * 64)
            held = cost["weights"] + cost["gradients"] + cost["optimizer"]
            assert held == num_params * param_memory(precision, schedule=schedule, optimizer="adamw").total
            waits = step_waits(schedule, agreement=True, tied_across_stages=False)  # e.g. with clipping
            waiting = StageCost.of(Segments(layers), 1, 3, StageContext(0, 2, 4, 1, schedule=schedule, waits=waits))
            held = waiting["weights"] + waiting["gradients"] + waiting["optimizer"]
            pm = param_memory(precision, schedule=schedule, optimizer="adamw", waits=waits)
            assert held == num_params * pm.total
            blocks[precision] = layers[1].saved_bytes
    # bf16 activations take half the bytes, plus the 2-byte copy of each matmul weight per microbatch
    assert blocks["bf16"] == blocks["fp32"] // 2 + 2 * 12 * 64 * 64 == blocks["fp16"]
    # ...and docs/precision.md's table is that function's output, not figures written twice.
    docs = Path(__file__).resolve().parent.parent / "docs"
    assert markdown_table() in (docs / "precision.md").read_text()
    assert markdown_table_sharded() in (docs / "sharding.md").read_text()


def test_precision_config_is_checked_before_any_group_starts():
    cfg = tiny_config(schedule="2bw", num_stages=2, num_microbatches=2)
    cfg.train.precision = "fp8"
    with pytest.raises(ConfigError, match=r"train.precision \('fp8'\) is unknown"):
        validate(cfg, world_size=2)
    cfg.train.precision, cfg.train.loss_scale = "fp16", 0.0
    with pytest.raises(ConfigError, match=r"train.loss_scale \(0.0\)"):
        validate(cfg, world_size=2)
    cfg.train.loss_scale = TrainConfig().loss_scale  # each number's range is checked first
    cfg.partition.analytic_dtype_bytes = 2
    with pytest.raises(ConfigError, match="train.precision"):
        validate(cfg, world_size=2)


# ---- multi-process ----------------------------------------------------------------------------


def train_many(cfgs: Sequence[Config], run_dirs: Sequence[str], inject: dict) -> None:
    """Runs several jobs one after another in the same ranks (one rendezvous store), saving the
    start-up of a process group per job. ``inject``: {job index: (rank, layer, backward call)}
    makes that layer's output gradient infinite on that rank's given backward call."""
    rank, world_size, _ = comm.env_rank()
    store = comm.make_store(rank=rank, world_size=world_size, timeout_s=60)
    for job, (cfg, run_dir) in enumerate(zip(cfgs, run_dirs)):
        layers = None
        if job in inject and inject[job][0] == rank:
            layers = inf_gradient_layers(cfg, layer=inject[job][1], call=inject[job][2])
        run(cfg, Path(run_dir), layers=layers, store=store)


class _InfGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, poisoned):
        ctx.poisoned = poisoned
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad * float("inf") if ctx.poisoned else grad), None


def inf_gradient_layers(cfg: Config, *, layer: int, call: int):
    """The GPT whose layer ``layer`` passes an infinite gradient back on its ``call``-th backward
    (a forward hook, so parameter names stay the GPT's)."""
    layers = build_gpt_layers(cfg.model, seed=cfg.seed)
    calls = [0]

    def hook(module, inputs, output):
        calls[0] += 1  # forwards and backwards run in microbatch order: forward call k is backward call k
        return _InfGradient.apply(output, calls[0] == call)

    layers[layer].register_forward_hook(hook)
    return layers


def run_jobs(
    tmp_path: Path, cfgs: Sequence[Config], *, world_size: int, inject: dict = None, timeout_s: float = 120
) -> list:
    import json

    dirs = [str(tmp_path / f"job{i}") for i in range(len(cfgs))]
    results = spawn(
        train_many,
        world_size=world_size,
        args=(list(cfgs), dirs, inject or {}),
        log_dir=tmp_path / "logs",
        timeout_s=timeout_s,
    )
    bad = [r for r in results if r.exitcode != 0]
    assert not bad, "\n".join(f"--- rank {r.rank} exit {r.exitcode}\n{r.log}" for r in bad)
    return [(json.loads((Path(d) / "summary.json").read_text()), torch.load(Path(d) / "final_model.pt")) for d in dirs]


def precision_config(schedule: str, d: int, m: int, precision: str, **kw) -> Config:
    cfg = tiny_config(schedule=schedule, num_stages=d, num_microbatches=m, **kw)
    cfg.train.precision = precision
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("d,schedules", [(2, ("2bw", "flush", "gpipe")), (4, ("2bw",))])
def test_bf16_pipeline_equals_the_autocast_oracle(tmp_path, d, schedules):
    """Each stage's forward under bf16 autocast, float32 masters, bf16 p2p: the same training as one
    process under autocast that rounds the activation to bf16 where the pipeline sends it, applying
    the same update rule. The same operations in the same order: equal to float32 round-off (in
    fact bit for bit). And far from the float32 run: the comparison sees the precision."""
    m = 4
    runs = run_jobs(tmp_path, [precision_config(s, d, m, "bf16") for s in schedules], world_size=d)
    for schedule, (summary, weights) in zip(schedules, runs):
        assert (summary["precision"], summary["compute_dtype"]) == ("bf16", "bfloat16")
        assert (
            summary["bytes_per_parameter"]["total"] == param_memory("bf16", schedule=schedule, optimizer="adam").total
        )
        oracle_cfg = precision_config(schedule, 1, m, "bf16")
        expected, losses = reference_train(
            oracle_cfg, delayed=schedule == "2bw", balance=gpt_balance(oracle_cfg.model, d)
        )
        torch.testing.assert_close(weights, expected)
        assert_losses_close(summary["losses"], losses)
        fp32, _ = reference_train(precision_config(schedule, 1, m, "fp32"), delayed=schedule == "2bw")
        assert max_abs_diff(weights, fp32) > 1e-2


@pytest.mark.slow
def test_bf16_zbv_equals_the_autocast_oracle(tmp_path):
    """zbv under bf16 (issue 46): each chunk's forward under autocast, its output rounded to bf16 at every chunk
    boundary (rank 1's hand-off from chunk 1 to chunk 2 too, as a send would): one process under autocast rounding
    where a 4-stage pipeline of the same balance sends, flush's update, to float32 round-off. Its validation pass
    rounds where training does: the final weights' loss in that process."""
    cfg = precision_config("zbv", 2, 4, "bf16", num_steps=4)
    cfg.data.val_fraction, cfg.train.eval_every, cfg.train.eval_batches = 0.1, 2, 1
    (summary, weights), *_ = run_jobs(tmp_path, [cfg], world_size=2)
    assert (summary["precision"], summary["compute_dtype"]) == ("bf16", "bfloat16")
    oracle_cfg, fp32_cfg = (precision_config("flush", 1, 4, p, num_steps=4) for p in ("bf16", "fp32"))
    oracle_cfg.data.val_fraction = fp32_cfg.data.val_fraction = cfg.data.val_fraction  # the same training windows
    chunks = gpt_balance(oracle_cfg.model, 4)
    expected, losses = reference_train(oracle_cfg, delayed=False, balance=chunks)
    torch.testing.assert_close(weights, expected)
    assert_losses_close(summary["losses"], losses)
    assert_losses_close([summary["final_val_loss"]], [reference_eval(cfg, weights, balance=chunks)])
    fp32, _ = reference_train(fp32_cfg, delayed=False)
    assert max_abs_diff(weights, fp32) > 1e-2


def fp16_config(*, d: int, w: int, steps: int, resume: str = "never", schedule: str = "2bw") -> Config:
    cfg = precision_config(schedule, d, 4 // w, "fp16", optim="sgd_momentum", num_steps=steps)
    cfg.pipeline.data_parallel = w  # w * m * b = 8 sequences per batch at every layout
    cfg.train = dataclasses.replace(
        cfg.train, loss_scale=1024.0, loss_scale_growth_interval=2, checkpoint_every=5, resume=resume
    )
    return cfg


def fp16_skip_reference(*, steps: int, batch: int):
    """The single-process 2bw reference of ``fp16_config`` whose stage-0 gradient is inf at ``batch`` (the
    second-stage layer's backward of that batch's microbatch 2 of 4): (weights, losses, info)."""
    oracle = fp16_config(d=1, w=1, steps=steps)
    info = {}
    expected, losses = reference_train(
        oracle,
        delayed=True,
        balance=gpt_balance(oracle.model, 2),
        layers=inf_gradient_layers(oracle, layer=1, call=batch * 4 + 4 // 2 + 1),
        info=info,
    )
    return expected, losses, info


@pytest.mark.slow
def test_fp16_zbv_skips_an_overflow_on_one_rank_everywhere(tmp_path):
    """zbv under fp16 (issue 46): the loss scaled at chunk 3 (rank 0), an inf in the gradient of layer 1 (chunk 1, on
    rank 1) at batch 3's microbatch 2: both ranks skip batch 3 by agreement, the scale halves, and training is one
    process's under fp16 autocast that rounds where a 4-stage pipeline of the same balance sends, with flush's update
    and the same skip, to float32 round-off."""
    steps, batch = 6, 3
    cfg = fp16_config(d=2, w=1, steps=steps, schedule="zbv")
    ((summary, weights),) = run_jobs(tmp_path, [cfg], world_size=2, inject={0: (1, 1, batch * 4 + 2 + 1)})
    assert [r["skipped_steps"] for r in summary["ranks"]] == [[batch]] * 2
    oracle = fp16_config(d=1, w=1, steps=steps, schedule="flush")
    chunks, info = gpt_balance(oracle.model, 4), {}
    layers = inf_gradient_layers(oracle, layer=1, call=batch * 4 + 2 + 1)
    expected, losses = reference_train(oracle, delayed=False, balance=chunks, layers=layers, info=info)
    assert info["skipped_steps"] == [batch] and summary["loss_scale"]["per_step"] == info["loss_scales"]
    assert info["loss_scales"][batch + 1] < info["loss_scales"][batch]  # the overflow halved it
    torch.testing.assert_close(weights, expected)
    assert_losses_close(summary["losses"], losses)


@pytest.mark.slow
@pytest.mark.long  # 11 to 15 s loaded: run with the long ones to keep the suite under 10 min
def test_fp16_inf_in_one_stage_skips_that_batch_everywhere_and_resumes_exactly(tmp_path):
    """d=2 x w=2, fp16, an inf in the gradient of stage 0 on replica 1 only, at batch 3: every rank
    of both stages skips exactly batch 3 (stage 1's own gradients are finite: it skips by
    agreement), the scale halves, and training equals the oracle that skips batch 3. The scaler's
    state goes into the checkpoint: resuming from step 5 (scale 1024, one clean step counted; the
    next clean step grows it) continues bit for bit at the same layout, and with the same scales
    at another layout (w=1)."""
    steps, batch = 8, 3
    straight = fp16_config(d=2, w=2, steps=steps)
    m = straight.pipeline.num_microbatches
    rank = 1  # stage 0 (layers 0-2), replica 1 under the default layout (a stage's replicas on consecutive ranks)
    resumed = fp16_config(d=2, w=2, steps=steps, resume=str(tmp_path / "job0" / "checkpoints" / "step_00000005"))
    (s0, w0), (s1, w1) = run_jobs(tmp_path, [straight, resumed], world_size=4, inject={0: (rank, 1, batch * m + 1)})

    assert [r["skipped_steps"] for r in s0["ranks"]] == [[batch]] * 4
    # Batch t runs with the scale the update of batch t-2 left (2bw: step t-1 is applied while batch t
    # runs): growth every 2 clean steps, halved by batch 3's overflow from batch 5 on.
    expected_scales = [1024.0, 1024.0, 1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 2048.0]
    assert s0["loss_scale"]["per_step"] == expected_scales
    expected, losses, info = fp16_skip_reference(steps=steps, batch=batch)
    assert info["skipped_steps"] == [batch] and info["loss_scales"] == expected_scales
    # Two replicas sum their float32 gradients in another order than one process: round-off that
    # moves a few fp16 roundings of activations by one unit (2**-11 relative), hence fp16's tolerance.
    fp16_close = dict(rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(w0, expected, **fp16_close)
    torch.testing.assert_close(torch.tensor(s0["losses"]), torch.tensor(losses), **fp16_close)
    oracle_cfg = fp16_config(d=1, w=1, steps=steps)
    not_skipped, _ = reference_train(oracle_cfg, delayed=True, balance=gpt_balance(oracle_cfg.model, 2))
    assert max_abs_diff(w0, not_skipped) > 1e-2  # skipping a step is far above that tolerance

    assert s1["first_step"] == 5 and s1["loss_scale"]["per_step"] == expected_scales[5:]
    assert s1["losses"] == s0["losses"]
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k

    other = fp16_config(d=2, w=1, steps=steps, resume=resumed.train.resume)
    ((s2, w2),) = run_jobs(tmp_path / "w1", [other], world_size=2)
    assert s2["loss_scale"]["per_step"] == expected_scales[5:]
    torch.testing.assert_close(w2, w0, **fp16_close)
