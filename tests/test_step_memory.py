"""The optimizer step's transient bytes (memory/step_memory.py, partitioner/step.py) against what a step allocates.

Regression (issue 44's planner memory): the planner left the step's transients out, so under the default optimizer
(Muon + error feedback) its peak was about 30% under the runs' on a small GPT: a plan it said fits went over."""

from __future__ import annotations

import pytest
import torch

from partitioner.step import gpt_step_fields
from pipedream2bw.config import GPTConfig, OptimConfig
from pipedream2bw.config.optim import build_optimizer
from pipedream2bw.config.optimizers import tag_muon_params
from pipedream2bw.memory.memprobe import tensor_peak
from pipedream2bw.memory.step_memory import StepModel
from pipedream2bw.models import build_gpt_layers
from pipedream2bw.models.gpt import layer_kind

BLOCK = 1  # of the one-block GPT's layers: 0 the embedding, 1 the block, 2 the final norm, 3 the head
CASES = [
    ("muon", "error_feedback", {}, BLOCK),
    ("muon", "predict", {}, BLOCK),
    ("adamw", "none", {}, BLOCK),
    ("adamw", "none", {"foreach": True}, BLOCK),  # torch's multi-tensor path, its default on CUDA
    ("sgd", "none", {"momentum": 0.9}, BLOCK),
    ("muon", "error_feedback", {}, 3),  # Muon's others (AdamW) step the head (and the embedding)
]


def _measured_step(layer: torch.nn.Module, optim: OptimConfig) -> int:
    """The most bytes one step of ``optim`` over ``layer`` allocates at once (its second step: state made)."""
    tag_muon_params(layer, optim.muon_exclude)
    opt = build_optimizer(list(layer.parameters()), optim)
    for _ in range(2):
        for p in layer.parameters():
            p.grad = torch.randn_like(p)
        with tensor_peak(torch.device("cpu")) as box:
            opt.step()
    return box["bytes"]


@pytest.mark.parametrize("name,correction,kwargs,index", CASES)
def test_a_layers_step_transient_is_what_its_step_allocates(name, correction, kwargs, index):
    cfg = GPTConfig(num_layers=1, d_model=64, num_heads=4, seq_len=16, vocab_size=96)
    optim = OptimConfig(name=name, delay_correction=correction, kwargs=kwargs)
    layer = build_gpt_layers(cfg, seed=0, indices=[index])[0]
    measured = _measured_step(layer, optim)
    fields = gpt_step_fields(
        StepModel.of(optim, device_type="cpu"),
        layer_kind(cfg, index),
        d_model=cfg.d_model,
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
    )
    predicted = sum(fields.values())  # a stage of this layer alone, under 2bw (the correction in effect)
    # never under what the step allocates; over by at most one tensor's leftover (the previous tensor's, taken as
    # the largest one's, where the largest comes first)
    largest = max(p.numel() for p in layer.parameters()) * 4
    assert measured <= predicted + 64 and predicted <= measured + largest, (fields, measured)


@pytest.mark.slow
@pytest.mark.long  # two runs (1 and 2 ranks) under torch.profiler's memory events: 30 to 90 s loaded
def test_the_planners_peak_is_each_ranks_under_the_default_optimizer_at_t_1_and_2(tmp_path):
    # docs/planner.md's GPT that fits only at t = 2 (2 blocks x 256), one stage, 2bw, Muon + error feedback: each
    # rank's measured peak tensor bytes is the planner's predicted peak (segment_costs' memory, runtime 0) within
    # 10%: 1.000 at t = 1 and 0.951 at t = 2 measured (scripts/bench_memory.py --optimizers), so at most 2% under at
    # t = 1; at t = 2 up to 7% under, the embedding and the head, which the planner splits by the vocabulary and this
    # runtime keeps whole on each tensor rank. Before the step's transients were counted the planner said 0.900 of
    # the measured peak at t = 1 and 0.814 at t = 2 (issue 44).
    import json

    from dist_helper import spawn
    from test_bench import _script
    from test_sharding import train_measured

    bench = _script("bench_memory")
    for t in (1, 2):
        j = dict(
            bench.job(schedule="2bw", d=1, w=1, t=t, precision="fp32", weight_dtype="fp32", sharded=False, steps=3,
                      model=bench.OPTIM_MODEL, bucket_mb=25.0),
            optim="muon", correction="error_feedback",
        )  # fmt: skip
        run_dir = tmp_path / f"t{t}"
        results = spawn(
            train_measured, world_size=t, args=([bench.make_config(j, cuda=False)], [str(run_dir)]),
            log_dir=tmp_path / f"logs{t}", timeout_s=240,
        )  # fmt: skip
        assert all(r.exitcode == 0 for r in results), "\n".join(r.log for r in results)
        summary = json.loads((run_dir / "summary.json").read_text())
        predicted = bench.planner_ranks(j, summary["balance"])[0]["memory"]
        for rank in range(t):
            peak = int((run_dir / f"peak_rank{rank}.txt").read_text())
            assert (0.98 if t == 1 else 0.93) <= predicted / peak <= 1.1, (t, rank, predicted, peak)


@pytest.mark.slow
@pytest.mark.long  # two 4-rank runs: 11 s loaded
def test_the_planners_optimizer_bytes_are_each_ranks_under_the_prediction_at_t_2(tmp_path):
    # Muon's default at t = 2, the prediction around error feedback, keeps d(t-1) (4 B a parameter a rank holds: its
    # pieces and its whole parameters) besides error feedback's u(t-1), Muon's momentum and its others' AdamW moments.
    # d = 2 x t = 2, 2bw, docs/planner.md's GPT (2 blocks x 256): each rank's optimizer state (the summary's, counted
    # from its tensors) is the planner's (segment_costs on tensor.split_layers) within 0.5% (measured 0.9994: the
    # planner 3 kB under, as much under every correction, so not the correction's state), and what the prediction
    # adds over error feedback alone is 4 B per parameter held in both, to the byte (1,779,200 and 1,715,712 B on
    # stages 0 and 1). Without d in the planner's state (corrections.state_copies) it said 0.679 of the measured state.
    from dist_helper import run_ok
    from test_bench import _script

    bench = _script("bench_memory")
    state = {}
    for correction in ("predict_error_feedback", "error_feedback"):
        j = dict(
            bench.job(schedule="2bw", d=2, w=1, t=2, precision="fp32", weight_dtype="fp32", sharded=False, steps=2,
                      model=bench.OPTIM_MODEL, bucket_mb=0.25),
            optim="muon", correction=correction,
        )  # fmt: skip
        summary = run_ok(bench.make_config(j, cuda=False), tmp_path / correction)
        assert summary["delay_correction"] == correction and summary["tensor_parallel"] == 2
        planned = bench.planner_ranks(j, summary["balance"])
        state[correction] = {
            r["rank"]: (r["optimizer_state_bytes"], planned[r["stage"]]["optimizer"], r["weight_bytes"] // 2 // 4)
            for r in summary["ranks"]
        }
    for rank, (measured, predicted, held) in state["predict_error_feedback"].items():
        assert predicted == pytest.approx(measured, rel=0.005), (rank, measured, predicted)
        ef_measured, ef_predicted, _ = state["error_feedback"][rank]
        assert measured - ef_measured == predicted - ef_predicted == 4 * held, (rank, state)


def test_the_step_lies_on_the_next_batchs_microbatches_under_2bw_only():
    # Under 2bw stage s steps after batch t's last backward with n_s - 1 of batch t+1's microbatches forwarded (no
    # flush): the step's transients lie on their activations (measured: the 2 x 1 x 2 default-optimizer run's stage
    # 0, docs/planner.md). Flush and gpipe step with nothing in flight.
    from partitioner.cost import live_at_step

    assert [live_at_step("2bw", s, 4, 8) for s in range(4)] == [3, 2, 1, 0]
    assert [live_at_step("2bw", s, 2, 4, forward_lead=1) for s in range(2)] == [2, 0]
    assert all(live_at_step(k, s, 4, 8) == 0 for k in ("flush", "gpipe", "zb1p") for s in range(4))
