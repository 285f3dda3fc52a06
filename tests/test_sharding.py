"""optim.sharded (ZeRO-1) and train.weight_dtype: oracles, measured memory, checkpoints, refusals.

The runs share two spawns (test_precision's ``run_jobs``: one process group start-up per world size): 4 ranks
for the d=2 x w=2 and d=4 x w=1 runs, 8 ranks for d=2 x w=4; each spawn runs once per session (a fixture).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Sequence

import pytest
import torch
from dist_helper import spawn
from reference import reference_run
from test_models import tied_config
from test_precision import fp16_config, fp16_skip_reference, run_jobs
from test_semantics import tiny_config

from partitioner.auto import apply_choices
from partitioner.planner import Plan, save_plan
from pipedream2bw.config import (
    Config,
    ConfigError,
    GPTConfig,
    OptimConfig,
    PartitionConfig,
    gpt_balance,
    validate,
)
from pipedream2bw.io import checkpoint
from pipedream2bw.memory.memprobe import tensor_peak
from pipedream2bw.memory.precision import param_memory
from pipedream2bw.memory.sharding import BucketShard, ShardedVersions
from pipedream2bw.pipeline import comm
from pipedream2bw.pipeline.layout import make_layout
from pipedream2bw.pipeline.versions import WeightVersions
from pipedream2bw.run.model import training_settings
from pipedream2bw.run.runner import TRAIN_RANGE, run

STEPS = 4
FP16_SKIPPED = 2  # the batch whose stage-0 gradient is infinite on replica 1 only


def _replicated(cfg: Config, w: int, *, sharded: bool = True) -> Config:
    """``cfg``'s 4 microbatches of 4 sequences, split over ``w`` replicas (the same batches at every w)."""
    cfg.pipeline.data_parallel, cfg.pipeline.microbatch_size = w, 4 // w
    cfg.optim.sharded = sharded
    return cfg


def _tied_clipped(schedule: str, d: int, w: int, *, sharded: bool = True, every: int = 0, resume: str = "never"):
    cfg = _replicated(tied_config(schedule, d, steps=STEPS), w, sharded=sharded)
    cfg.optim.clip_grad_norm = 1e-3
    cfg.optim.kwargs = {"momentum": 0.9, "weight_decay": 0.01}
    cfg.train.checkpoint_every, cfg.train.resume = every, resume
    return cfg


def _bf16_versions(d: int, w: int, *, sharded: bool = False, every: int = 0, resume: str = "never") -> Config:
    cfg = tiny_config(schedule="2bw", num_stages=d, num_microbatches=4, num_steps=STEPS)
    cfg = _replicated(cfg, w, sharded=sharded)
    cfg.train.precision, cfg.train.weight_dtype = "bf16", "compute"
    cfg.train.checkpoint_every, cfg.train.resume = every, resume
    return cfg


def _adamw(w: int, *, sharded: bool, every: int = 0, resume: str = "never") -> Config:
    cfg = _replicated(
        tiny_config(schedule="2bw", num_stages=2, num_microbatches=4, num_steps=STEPS), w, sharded=sharded
    )
    cfg.optim.name, cfg.optim.kwargs = "adamw", {"weight_decay": 0.1}
    cfg.train.checkpoint_every, cfg.train.resume = every, resume
    return cfg


def _fp16_composed() -> Config:
    cfg = fp16_config(d=2, w=2, steps=STEPS)
    cfg.train.checkpoint_every = 0
    cfg.optim.sharded, cfg.swap.optimizer, cfg.swap.enabled, cfg.swap.min_bytes = True, "host", True, 0
    cfg.swap.resident = 0  # stage 0 holds 2 microbatches in flight: one waits on the host
    return cfg


def _step(run_dir, n: int) -> str:
    return str(run_dir / "checkpoints" / f"step_{n:08d}")


def _plan_of(cfg: Config, **choices) -> Plan:
    """A plan file's content that runs ``cfg``'s pipeline as it is (balance, rank map: the defaults), with
    ``choices`` (sharded, weight_dtype, precision; or a field of the pipeline's own: schedule, balance); the
    predictions are placeholders."""
    p, d, w = cfg.pipeline, cfg.pipeline.num_stages, cfg.pipeline.data_parallel
    balance = choices.pop("balance", None) or gpt_balance(cfg.model, d)
    return Plan(
        schedule=choices.pop("schedule", p.schedule),
        num_stages=d,
        data_parallel=w,
        microbatch_size=p.microbatch_size,
        num_microbatches=p.num_microbatches,
        global_batch_size=w * p.num_microbatches * p.microbatch_size,
        balance=balance,
        rank_map=[list(r) for r in make_layout(d, w, ranks_per_node=d * w).ranks],
        recompute=False,
        swap_stages=[],
        objective="throughput",
        topology="cpu",
        devices=d * w,
        memory_per_device_bytes=2**30,
        costs="analytic",
        predicted_batch_time_s=1.0,
        predicted_samples_per_s=1.0,
        predicted_stage_time_s=[0.1] * d,
        predicted_peak_memory_bytes=[1] * d,
        **choices,
    )


def _from_plan(cfg: Config, path: Path) -> Config:
    """``cfg`` run from the plan file ``path``, leaving optim.sharded and train.weight_dtype to it."""
    cfg = copy.deepcopy(cfg)
    cfg.optim.sharded, cfg.train.weight_dtype = None, None
    cfg.partition = PartitionConfig(mode="file", path=str(path))
    return cfg


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """One spawn of 4 ranks: {name: (run dir, summary, final weights)}."""
    root = tmp_path_factory.mktemp("sharding4")
    job = lambda i: root / f"job{i}"  # noqa: E731 (run_jobs's directories)
    bf16_sharded = _bf16_versions(2, 2, sharded=True, every=2)
    save_plan(_plan_of(bf16_sharded, sharded=True, weight_dtype="compute", precision="bf16"), root / "plan.yaml")
    jobs = {
        "2bw": _tied_clipped("2bw", 2, 2, every=2),
        "flush": _tied_clipped("flush", 2, 2),
        "fp16": _fp16_composed(),
        "bf16": _bf16_versions(4, 1, every=2),
        # a sharded d=2 x w=2 checkpoint resumed unsharded at d=4 x w=1; a bf16 one (float32 masters) at d=4
        "2bw resumed d=4 w=1": _tied_clipped("2bw", 4, 1, sharded=False, resume=_step(job(0), 2)),
        "bf16 resumed": _bf16_versions(4, 1, resume=_step(job(3), 2)),
        "bf16 sharded": bf16_sharded,
        # the same run from a plan file that chose sharded and compute weights; the config leaves both unset
        "bf16 sharded, from a plan": _from_plan(bf16_sharded, root / "plan.yaml"),
    }
    m = jobs["fp16"].pipeline.num_microbatches
    runs = run_jobs(root, list(jobs.values()), world_size=4, inject={2: (1, 1, FP16_SKIPPED * m + 1)}, timeout_s=300)
    return {name: (job(i), *run) for i, (name, run) in enumerate(zip(jobs, runs))}


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory, four_ranks):
    """One spawn of 8 ranks (d=2 x w=4), after ``four_ranks`` (it resumes one of its checkpoints)."""
    root = tmp_path_factory.mktemp("sharding8")
    job = lambda i: root / f"job{i}"  # noqa: E731
    jobs = {
        "adamw": _adamw(4, sharded=False, every=2),
        "adamw sharded": _adamw(4, sharded=True),
        "adamw unsharded -> sharded": _adamw(4, sharded=True, resume=_step(job(0), 2)),
        "2bw resumed w=4": _tied_clipped("2bw", 2, 4, resume=_step(four_ranks["2bw"][0], 2)),
    }
    runs = run_jobs(root, list(jobs.values()), world_size=8, timeout_s=300)
    return {name: (job(i), *run) for i, (name, run) in enumerate(zip(jobs, runs))}


def test_bucket_shards_cover_the_bucket_once():
    numels = (5, 1, 7, 3)  # 16 elements: S = 6 at w = 3 (the last shard padded), S = 4 at w = 4
    for w in (1, 2, 3, 4, 7, 20):
        layouts = [BucketShard((3, 0, 2, 1), numels, r, w) for r in range(w)]
        covered = [(p.param, e) for layout in layouts for p in layout.pieces() for e in range(p.start, p.stop)]
        assert sorted(covered) == sorted((i, e) for i, n in zip((3, 0, 2, 1), numels) for e in range(n))
        for layout in layouts:  # pieces sit in the shard in flat order, within its S elements
            offsets = [(p.offset, p.offset + p.stop - p.start) for p in layout.pieces()]
            assert all(0 <= a < b <= layout.shard_numel for a, b in offsets)


@pytest.mark.parametrize("schedule", ["2bw", "flush"])
def test_the_all_gather_lands_before_the_first_reader_and_not_before(schedule):
    """Two replicas' ShardedVersions in one process, their all-gather a stand-in that writes only when
    waited: after APPLY(t) nothing is written yet (the gather is in flight), and the replica batch t+2
    (2bw; flush: t+1) reads holds the unsharded step's W(t+1), bucket by bucket."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))  # 23 elements, 2 buckets
    buckets = [[0, 1], [2, 3]]
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    plain = WeightVersions(copy.deepcopy(module), schedule=schedule, optimizer_factory=sgd, buckets=buckets)
    shards = [
        ShardedVersions(
            copy.deepcopy(module),
            schedule=schedule,
            optimizer_factory=sgd,
            buckets=buckets,
            num_sharded=2,
            shard_index=r,
            num_shards=2,
        )
        for r in range(2)
    ]
    in_flight = []
    for v in shards:  # writes every replica's stepped shard of bucket b into ``full``, once waited
        v.connect(lambda shard, full: in_flight.append(full) or (lambda full=full: _gather_now(shards, full)))
    reads = 2 if schedule == "2bw" else 1
    for t in range(4):
        grads = [torch.randn_like(p) for p in module.parameters()]
        for p, g in zip(plain.module_for_batch(t).parameters(), grads):
            p.grad = g.clone()
        plain.step(t, grad_scale=0.5)
        for r, v in enumerate(shards):
            flat = [torch.cat([grads[i].reshape(-1) for i in b]) for b in buckets]
            v.step(t, grad_scale=0.5, before_bucket=lambda b, r=r, flat=flat: _shard_of(flat[b], r, 2))
        assert len(in_flight) == 4 and all(v._pending for v in shards)  # each replica: a gather per bucket, unwaited
        for v in shards:
            torch.testing.assert_close(
                list(v.module_for_batch(t + reads).parameters()), list(plain.module_for_batch(t + reads).parameters())
            )
        in_flight.clear()


def _shard_of(flat: torch.Tensor, r: int, w: int) -> torch.Tensor:
    size = -(-flat.numel() // w)
    padded = torch.zeros(size * w)
    padded[: flat.numel()] = flat
    return padded[r * size : (r + 1) * size].clone()


def _gather_now(shards, full: torch.Tensor) -> None:
    """The stand-in all-gather's write: the bucket whose flat storage is ``full``, from every replica's shard."""
    b = next(b for v in shards for row in v.flat for b, f in enumerate(row) if f is full)
    full.copy_(torch.cat([v.shards[b] for v in shards]))


@pytest.mark.parametrize("schedule", ["2bw", "flush"])
def test_sharded_tied_clipped_equals_the_reference(four_ranks, schedule):
    """d=2 x w=2: the tied GPT with active clipping, sharded, ends on the single-process reference's weights
    with its gradient norms (every shard counted once, the tie once)."""
    _, summary, weights = four_ranks[schedule]
    cfg = _tied_clipped(schedule, 2, 2)
    reference = tied_config(schedule, 1, steps=STEPS)
    reference.optim, reference.pipeline.microbatch_size = cfg.optim, 4
    expected = reference_run(reference, delayed=schedule == "2bw")
    assert min(expected.grad_norms) > cfg.optim.clip_grad_norm  # the clip is active on every step
    torch.testing.assert_close(torch.tensor(summary["grad_norms"]), torch.tensor(expected.grad_norms))
    torch.testing.assert_close(weights, expected.weights)
    assert summary["ties"][0]["checked_steps"] == STEPS  # the tied copies stayed bit-identical


@pytest.mark.slow
def test_sharded_zbv_tied_clipped_equals_the_reference(tmp_path):
    """zbv at d=2 x w=2 (issue 46), sharded: each rank's reducer, armed at its last W of a batch, reduce-scatters both
    chunks' buckets (the tie, chunks 0 and 3 on rank 0, one parameter in one of them); each replica steps its shards
    and the all-gather lands before the next batch. The tied GPT with active clipping ends on the single-process
    reference's weights with its gradient norms."""
    cfg = _tied_clipped("zbv", 2, 2)
    cfg.pipeline.check_ties = False  # the tie is one parameter on rank 0: no copies to compare (refused)
    ((summary, weights),) = run_jobs(tmp_path, [cfg], world_size=4)
    reference = tied_config("flush", 1, steps=STEPS)
    reference.optim, reference.pipeline.microbatch_size = cfg.optim, 4
    expected = reference_run(reference, delayed=False)
    assert min(expected.grad_norms) > cfg.optim.clip_grad_norm  # the clip is active on every step
    torch.testing.assert_close(torch.tensor(summary["grad_norms"]), torch.tensor(expected.grad_norms))
    torch.testing.assert_close(weights, expected.weights)
    assert [r["allreduce_calls"] for r in summary["ranks"]] == [STEPS] * 4  # one reduction a step, both chunks


def test_sharded_checkpoint_resumes_at_any_layout_and_consolidates(four_ranks, eight_ranks):
    """A checkpoint of the sharded d=2 x w=2 run (step 2) holds each replica's pieces; resumed unsharded at
    d=4 x w=1 and sharded at d=2 x w=4, both end on the straight run's weights and losses. An unsharded
    AdamW checkpoint resumed sharded ends on the unsharded run's. ``consolidate`` gives the final weights."""
    run_dir, straight, weights = four_ranks["2bw"]
    files = sorted(p.name for p in (run_dir / "checkpoints" / "step_00000002").glob("layer_*.shard_*"))
    assert {f.split(".shard_")[1] for f in files} == {f"rank{r:05d}.pt" for r in range(4)}, files
    for name in ("2bw resumed d=4 w=1",):
        _, summary, resumed = four_ranks[name]
        torch.testing.assert_close(resumed, weights)
        torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(straight["losses"]))
    _, summary, resumed = eight_ranks["2bw resumed w=4"]
    torch.testing.assert_close(resumed, weights)
    assert summary["resumed_from"].endswith("step_00000002")
    _, _, unsharded = eight_ranks["adamw"]
    torch.testing.assert_close(eight_ranks["adamw unsharded -> sharded"][2], unsharded)
    out = checkpoint.consolidate(run_dir)  # the step-4 checkpoint: the final weights
    torch.testing.assert_close(torch.load(out), weights)


def test_sharded_adamw_equals_unsharded_with_a_wth_of_the_optimizer_state(eight_ranks):
    """d=2 x w=4, AdamW under 2bw: the sharded run's weights are the unsharded run's to float32 round-off,
    and each rank measures 1/w of the unsharded run's optimizer state (within one bucket's padding)."""
    _, plain, plain_weights = eight_ranks["adamw"]
    _, sharded, sharded_weights = eight_ranks["adamw sharded"]
    torch.testing.assert_close(sharded_weights, plain_weights)
    assert sharded["losses"] == plain["losses"]
    for a, b in zip(plain["ranks"], sharded["ranks"]):
        # Adam: two float32 moments per element and a step count per parameter (or piece); the last replica's
        # shard lacks the padding (at most w - 1 elements of the one bucket): 512 B is well within one bucket
        assert abs(b["optimizer_state_bytes"] - a["optimizer_state_bytes"] / 4) <= 512, (a, b)


def train_measured(cfgs: Sequence[Config], run_dirs: Sequence[str]) -> None:
    """Runs the jobs one after another in the same ranks, each under ``memprobe.tensor_peak``: this rank's
    peak tensor bytes of the training loop go to ``peak_rank{R}.txt`` in the job's directory."""
    rank, world_size, _ = comm.env_rank()
    store = comm.make_store(rank=rank, world_size=world_size, timeout_s=60)
    for cfg, run_dir in zip(cfgs, run_dirs):
        with tensor_peak(torch.device("cpu"), within=TRAIN_RANGE) as peak:
            run(cfg, Path(run_dir), store=store)
        Path(run_dir, f"peak_rank{rank}.txt").write_text(str(peak["bytes"]))


def _memory_config(schedule: str, precision: str, weight_dtype: str, *, sharded: bool) -> Config:
    """One stage on 2 replicas of a GPT whose largest parameter and gradient buckets are 4% of it
    (scripts/bench_memory.py's at a quarter of the depth): per-bucket transients stay within the tolerance.
    Two steps: the second batch's last backward, the peak, meets the optimizer state the first step made."""
    cfg = tiny_config(schedule=schedule, num_stages=1, num_microbatches=2, num_steps=2)
    cfg.model = GPTConfig(num_layers=8, d_model=64, num_heads=4, seq_len=4)
    cfg.optim = OptimConfig(name="adamw", lr=1e-4, sharded=sharded)
    cfg.pipeline.data_parallel, cfg.pipeline.microbatch_size, cfg.pipeline.bucket_mb = 2, 1, 0.0625
    cfg.train.precision, cfg.train.weight_dtype = precision, weight_dtype
    return cfg


MEMORY_CASES = [("2bw", "bf16", "compute"), ("flush", "fp32", "fp32")]


@pytest.mark.slow
@pytest.mark.long  # 11 to 15 s loaded: run with the long ones to keep the suite under 10 min
def test_sharding_at_w2_holds_half_the_optimizer_state_and_the_peak_falls_as_param_memory_says(tmp_path):
    """Measured, not counted (memprobe: peak tensor bytes of the training loop, every thread's frees counted):
    at w=2 each rank's AdamW state is 1/2 of the unsharded run's (within one bucket's padding), and the
    peak falls from the unsharded run's by param_memory's prediction within 5% (2bw, bf16 versions: 6 B
    per parameter; flush, fp32: 2 B). Regressions it guards: the unsharded all-reduce kept both the
    gradients and their flat copy until the step (4 B more unsharded); the sharded all-gather held a
    cast copy of the shard past the next batch's backwards (2/w B more sharded, 2bw with bf16 versions)."""
    cfgs = [_memory_config(*case, sharded=sh) for case in MEMORY_CASES for sh in (False, True)]
    dirs = [str(tmp_path / f"job{i}") for i in range(len(cfgs))]
    results = spawn(train_measured, world_size=2, args=(cfgs, dirs), log_dir=tmp_path / "logs", timeout_s=120)
    assert all(r.exitcode == 0 for r in results), "\n".join(r.log for r in results)
    params = sum(p.numel() for p in torch.load(Path(dirs[0], "final_model.pt")).values())
    measured = []
    for d in dirs:
        summary = json.loads(Path(d, "summary.json").read_text())
        peaks = [int(Path(d, f"peak_rank{r}.txt").read_text()) for r in range(2)]
        measured.append((max(peaks) / params, [r["optimizer_state_bytes"] for r in summary["ranks"]]))
    for k, (schedule, precision, weight_dtype) in enumerate(MEMORY_CASES):
        (plain, plain_state), (sharded, sharded_state) = measured[2 * k], measured[2 * k + 1]
        for a, b in zip(plain_state, sharded_state):  # Adam's step counts and the last shard's padding: < 512 B
            assert abs(b - a / 2) <= 512, (schedule, plain_state, sharded_state)
        predicted = [
            param_memory(
                precision,
                schedule=schedule,
                optimizer="adamw",
                weight_dtype_name=weight_dtype,
                sharded=sh,
                data_parallel=2,
            ).total
            for sh in (False, True)
        ]
        fall = predicted[0] - predicted[1]
        assert abs((plain - sharded) - fall) <= 0.05 * fall, (schedule, precision, plain, sharded, fall)


def test_sharded_fp16_skip_host_optimizer_and_swapping_equal_the_scaled_reference(four_ranks):
    """d=2 x w=2 under 2bw, sharded with the shards on the host (swap.optimizer=host), activations swapped,
    fp16 loss scaling, an inf in stage 0's gradient on replica 1 only at batch 2: every rank skips batch 2
    (replica 0's shard is finite: it skips by agreement), the scales follow the scaler, and the weights
    are the reference's that skips batch 2, at fp16's tolerance (as test_precision's unsharded run)."""
    _, summary, weights = four_ranks["fp16"]
    batch = FP16_SKIPPED
    assert [r["skipped_steps"] for r in summary["ranks"]] == [[batch]] * 4
    assert [(r["swap"] or {}).get("swapped_out_bytes", 0) > 0 for r in summary["ranks"]] == [True, True, False, False]
    expected, losses, info = fp16_skip_reference(steps=STEPS, batch=batch)
    assert info["skipped_steps"] == [batch] and summary["loss_scale"]["per_step"] == info["loss_scales"]
    fp16_close = dict(rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(weights, expected, **fp16_close)
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(losses), **fp16_close)


def _assert_rounded_masters(summary: dict, weights: dict, *, schedule: str, num_stages: int) -> None:
    """A run with bf16 weight versions (``_bf16_versions(num_stages, 1)``) equals one process applying ``schedule``'s
    rule (2bw: delayed) with those versions, at the run's balance; final_model.pt holds the float32 masters
    (regression, issue 23: it held the newest version as stored, in bf16); and the rounding shows (far from the
    float32-versions reference)."""
    reference = tiny_config(schedule=schedule, num_stages=1, num_microbatches=4, num_steps=STEPS)
    reference.train, reference.pipeline.microbatch_size = _bf16_versions(num_stages, 1).train, 4
    delayed = schedule == "2bw"
    expected = reference_run(reference, delayed=delayed, balance=summary["balance"])
    torch.testing.assert_close(weights, expected.weights)
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(expected.losses))
    reference.train.weight_dtype = "fp32"
    fp32_versions = reference_run(reference, delayed=delayed, balance=summary["balance"])
    assert max(float((expected.weights[k] - fp32_versions.weights[k]).abs().max()) for k in weights) > 1e-3


def test_bf16_weight_versions_equal_the_rounded_masters_reference(four_ranks):
    """train.weight_dtype=compute under bf16, 2bw, d=4 x w=1: the versions are bf16 roundings of float32
    masters, microbatch gradients summed in float32, the stages run in bf16: equal to the single-process
    reference applying that rule; final_model.pt holds its float32 masters; the rounding shows (far from
    the float32-versions reference). Its checkpoint keeps the float32 masters: resumed from step 2, the run
    ends on the same weights."""
    _, summary, weights = four_ranks["bf16"]
    _assert_rounded_masters(summary, weights, schedule="2bw", num_stages=4)
    _, _, resumed = four_ranks["bf16 resumed"]
    torch.testing.assert_close(resumed, weights, rtol=0, atol=0)


@pytest.mark.slow
def test_bf16_weight_versions_under_zbv_equal_the_rounded_masters_reference(tmp_path):
    """train.weight_dtype=compute under bf16 and zbv (issue 46), d=2: both chunks of a rank run on bf16 roundings of
    its float32 masters, the hand-off from chunk 1 to 2 stays bf16 as a send does: one process applying flush's rule
    with bf16 versions, rounding where a 4-stage pipeline of the same balance sends."""
    cfg = _bf16_versions(2, 1)
    cfg.pipeline.schedule = "zbv"
    ((summary, weights),) = run_jobs(tmp_path, [cfg], world_size=2)
    assert len(summary["balance"]) == 4  # the chunks
    _assert_rounded_masters(summary, weights, schedule="flush", num_stages=2)


def test_sharding_refuses_what_it_cannot_step():
    cfg = _replicated(tiny_config(schedule="2bw", num_stages=2, num_microbatches=4), 2)
    cfg.optim.target = "torch.optim.SGD"
    with pytest.raises(ConfigError, match=r"optim.sharded \(true\) steps pieces .* optimizer; torch.optim.SGD"):
        validate(cfg, world_size=4)
    cfg.optim.target, cfg.train.checkpoint_every = None, 2  # checkpoints are written per shard
    validate(cfg, world_size=4)
    cfg.pipeline.data_parallel = 1  # nothing to shard over: accepted, and a plain run
    validate(cfg, world_size=2)
    cfg.train.precision, cfg.train.weight_dtype = "bf16", "compute"
    cfg.model.tie_embeddings = True
    with pytest.raises(ConfigError, match=r"train.weight_dtype \(compute\) with model.tie_embeddings"):
        validate(cfg, world_size=2)
    cfg.train.weight_dtype = "bf16"
    with pytest.raises(ConfigError, match=r"train.weight_dtype \('bf16'\) is unknown"):
        validate(cfg, world_size=2)


def test_compute_weights_refuse_ties_of_any_model_before_a_group_starts(tmp_path):
    """A layer list's tie is found by run() (not config): refused there, before any process group."""
    from matrix import Cell, cell_config

    cell = Cell(
        **dict(schedule="2bw", d=1, w=1, resume=False, swap=False, precision="bf16", tied=True, clip=False),
        **dict(skip=False, recompute=False, host_optim=False, validation=False, structured=True),
        **dict(sharded=False, weight_dtype="compute"),
    )
    with pytest.raises(ConfigError, match=r"train.weight_dtype \(compute\) with tied weights \(\[\["):
        run(cell_config(cell), tmp_path)


# --- issue 23's loose ends: a plan's choices, strict resume, full-precision final weights ------------------


def test_compute_weights_final_model_holds_the_gathered_float32_masters(four_ranks):
    """train.weight_dtype=compute sharded over d=2 x w=2: final_model.pt holds the float32 masters, gathered from
    the replicas' shards, bit for bit what ``consolidate`` reads from the last checkpoint (each replica's pieces),
    not their bf16 rounding. Regression (issue 23): it held the newest version as stored, in bf16."""
    run_dir, _, weights = four_ranks["bf16 sharded"]
    files = sorted(p.name for p in Path(_step(run_dir, STEPS)).glob("layer_*.shard_*"))
    assert {f.split(".shard_")[1] for f in files} == {f"rank{r:05d}.pt" for r in range(4)}, files
    masters = torch.load(checkpoint.consolidate(run_dir))
    assert weights.keys() == masters.keys()
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, masters[name]), name
    assert any(not torch.equal(v, v.bfloat16().float()) for v in weights.values())  # not the rounded version


def test_a_run_of_a_plan_takes_its_sharded_and_weight_dtype_choices(four_ranks):
    """A plan file that chose optim.sharded and weight_dtype=compute, run by a config that sets neither: the
    run is the one that sets both (bytes per parameter, each rank's optimizer state, weights bit for bit).
    Regression (issue 23): the run ignored both, training unsharded with float32 versions."""
    _, explicit, weights = four_ranks["bf16 sharded"]
    _, planned, planned_weights = four_ranks["bf16 sharded, from a plan"]
    expected = param_memory(
        "bf16", schedule="2bw", optimizer="adam", weight_dtype_name="compute", sharded=True, data_parallel=2
    )
    assert planned["bytes_per_parameter"] == explicit["bytes_per_parameter"] == expected.as_dict()
    states = [[r["optimizer_state_bytes"] for r in s["ranks"]] for s in (planned, explicit)]
    assert states[0] == states[1], states
    assert planned["losses"] == explicit["losses"]
    for name, tensor in weights.items():
        assert torch.equal(planned_weights[name], tensor), name


def test_plan_choices_fill_what_the_run_leaves_unset_and_refuse_a_contradiction():
    """optim.sharded and train.weight_dtype from a plan: unset, the plan's; set, they must agree with it where
    that changes the run; the refusal names both values and the fix. Regression (issue 23): runs of a plan
    ignored both."""
    cfg = _bf16_versions(2, 2, sharded=True)
    plan = _plan_of(cfg, sharded=True, weight_dtype="compute", precision="bf16")
    unset = _from_plan(cfg, Path("plan.yaml"))
    optim, train = apply_choices(unset.optim, unset.train, plan, precision="bf16")
    assert (optim.sharded, train.weight_dtype) == (True, "compute")
    optim, train = apply_choices(cfg.optim, cfg.train, plan, precision="bf16")  # set as planned: kept
    assert (optim.sharded, train.weight_dtype) == (True, "compute")
    cfg.optim.sharded, cfg.train.weight_dtype = False, "fp32"
    with pytest.raises(ConfigError) as refused:
        apply_choices(cfg.optim, cfg.train, plan, precision="bf16")
    assert str(refused.value) == (
        "optim.sharded (false) contradicts the plan's sharded (true, over 2 replicas): drop optim.sharded or set "
        "optim.sharded=true to run the plan, or plan again with partition.sharded=false; train.weight_dtype (fp32) "
        "contradicts the plan's weight_dtype (compute, under bf16): drop train.weight_dtype or set "
        "train.weight_dtype=compute to run the plan, or plan again with train.weight_dtype=fp32"
    )
    # where the difference changes nothing, a set value stands: no replicas to shard over; compute under fp32
    one = dataclasses.replace(plan, data_parallel=1, sharded=False)
    cfg.optim.sharded = True
    assert apply_choices(cfg.optim, cfg.train, one, precision="fp32")[0].sharded is True
    with pytest.raises(ConfigError, match=r"the plan's weight_dtype \('bf16'\) is unknown"):
        apply_choices(unset.optim, unset.train, dataclasses.replace(plan, weight_dtype="bf16"), precision="bf16")


def test_a_contradicted_plan_is_refused_before_any_group(tmp_path):
    """partition=file with optim.sharded=false set against a plan that shards: refused by run() before any
    process group starts (here in one process, before the launch's size is checked)."""
    cfg = _bf16_versions(2, 2, sharded=False)
    save_plan(_plan_of(cfg, sharded=True, weight_dtype="compute", precision="bf16"), tmp_path / "plan.yaml")
    cfg.partition = PartitionConfig(mode="file", path=str(tmp_path / "plan.yaml"))
    with pytest.raises(ConfigError, match=r"optim.sharded \(false\) contradicts the plan's sharded \(true"):
        run(cfg, tmp_path / "run", store=torch.distributed.HashStore())
    assert not torch.distributed.is_initialized()


def test_resuming_with_another_weight_dtype_is_refused_unless_not_strict(four_ranks, tmp_path, caplog):
    """A weight_dtype=compute checkpoint resumed with float32 versions. The checkpoint holds the float32 masters
    (beside bf16 versions), which such a resume takes as its weights: the state carries over exactly, but from
    there the forwards read float32 weights instead of bf16 ones, a change of the training as a train.precision
    change is. Refused before any process group, naming it; train.resume_strict=false resumes and logs it.
    Regression (issue 23): train.weight_dtype was not among the strict-resume settings."""
    step = Path(_step(four_ranks["bf16"][0], 2))
    manifest = json.loads((step / checkpoint.MANIFEST).read_text())
    state = checkpoint.load_layers(step, range(manifest["num_layers"]))
    assert all(torch.equal(v, v.bfloat16().float()) for v in state["weights"].values())  # the stored versions
    assert state["masters"].keys() == state["weights"].keys()
    assert any(not torch.equal(v, v.bfloat16().float()) for v in state["masters"].values())  # float32 masters
    cfg = _bf16_versions(1, 1, resume=str(step))
    cfg.train.weight_dtype = "fp32"
    with pytest.raises(ConfigError, match=r"train.weight_dtype: checkpoint 'compute', this run 'fp32'.*resume_strict"):
        run(cfg, tmp_path / "run", store=torch.distributed.HashStore())
    assert not torch.distributed.is_initialized()
    with caplog.at_level("WARNING"):
        differences = checkpoint.check_settings(
            manifest, model={}, training=training_settings(cfg), where=step, strict=False
        )
    assert differences == ["train.weight_dtype: checkpoint 'compute', this run 'fp32'"]
    assert "train.resume_strict=false: resuming from" in caplog.text
    # under fp32, compute stores float32 versions: the same training, not a difference
    fp32_compute = _bf16_versions(1, 1)
    fp32_compute.train.precision = cfg.train.precision = "fp32"
    assert training_settings(fp32_compute) == training_settings(cfg)


def test_sharded_collectives_raise_no_deprecation_warning():
    # issue 35: optim.sharded=true printed torch's FutureWarning (all_gather_into_tensor, reduce_scatter_tensor are
    # deprecated from torch 2.13) on every rank. One process, a group of one, every warning an error.
    import datetime
    import warnings
    from types import SimpleNamespace

    from pipedream2bw.pipeline import comm

    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            full = torch.zeros(4)
            comm.all_gather_async(
                SimpleNamespace(rank=0, timeout=datetime.timedelta(seconds=60)), torch.arange(4.0), full, group=None
            )()
            out = torch.zeros(4)
            comm._REDUCE_SCATTER(out, torch.arange(4.0), group=None)
    finally:
        dist.destroy_process_group()
    assert full.tolist() == out.tolist() == [0.0, 1.0, 2.0, 3.0]
