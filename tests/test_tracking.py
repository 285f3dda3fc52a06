"""wandb: the offline run files hold what the run measured (read back from the .wandb transaction log)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import wandb
import wandb_reader
from dist_helper import run_ok

from pipedream2bw.config import Config, GPTConfig, PipelineConfig, TrainConfig, WandbConfig, default_plan_choices
from pipedream2bw.io.tracking import Tracker


def _records(run_dir: Path):
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files  # one wandb run per training job
    return wandb_reader.read_records(files[0])


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("wandb") / "run"
    cfg = Config(
        pipeline=PipelineConfig(num_stages=2, num_microbatches=2, microbatch_size=2, trace=True, trace_steps=2),
        model=GPTConfig(d_model=32, seq_len=32, num_layers=2),
        train=TrainConfig(num_steps=6, warmup_steps=2, log_every=3),
        wandb=WandbConfig(mode="offline", group="sweep-a"),
    )
    return cfg, run_dir, run_ok(cfg, run_dir)


@pytest.mark.slow
def test_offline_run_holds_the_runs_figures(traced_run):
    cfg, run_dir, summary = traced_run
    records = _records(run_dir)
    assert wandb_reader.run_record(records).run_group == "sweep-a"
    config = wandb_reader.config(records)
    # Resolved config: what no plan chose and the run left null (optim.sharded, train.weight_dtype) filled in
    resolved = dataclasses.asdict(default_plan_choices(cfg))
    assert {k: config[k] for k in resolved} == json.loads(json.dumps(resolved))
    rows = wandb_reader.history(records)
    assert [r["loss"] for r in rows if "loss" in r] == summary["losses"]  # every step's loss, in order
    # the first step, every train.log_every steps (and, off a terminal, at least every PROGRESS_EVERY_S: issue 43)
    steps = [r["_step"] for r in rows if "samples_per_s" in r]
    assert steps[0] == 0 and {2, 5} <= set(steps) and steps == sorted(set(steps))
    logged = wandb_reader.summary(records)
    for key in ("final_loss", "samples_per_s", "tokens_per_s", "step_time_s"):
        assert logged[key] == summary[key], key
    for stage, peak in enumerate(summary["peak_memory_bytes"]):
        assert logged[f"stage{stage}/peak_memory_bytes"] == peak
        [rank] = [r for r in summary["ranks"] if r["stage"] == stage]
        assert logged[f"stage{stage}/p2p_wait_s"] == rank["p2p_wait_s"] > 0  # each stage waits on the other
        assert logged[f"stage{stage}/allreduce_exposed_s"] == rank["allreduce_exposed_s"]
    assert logged["comm_wait_s"] == pytest.approx(
        sum(r["p2p_wait_s"] + r["allreduce_exposed_s"] for r in summary["ranks"])
    )
    assert logged["bubble_fraction"] == summary["trace"]["bubble_fraction"]
    assert [logged[f"rank{r}/bubble_fraction"] for r in range(2)] == summary["trace"]["bubble_fraction_per_rank"]
    # The timeline picture and the per-stage table are files of the run.
    files = next((run_dir / "wandb").glob("offline-run-*/files"))
    image = files / logged["timeline/path"]
    assert image.read_bytes() == (run_dir / "timeline.png").read_bytes()
    table = json.loads((files / logged["stages/path"]).read_text())
    assert table["columns"][:2] == ["stage", "peak_memory_bytes"]
    assert [row[1] for row in table["data"]] == summary["peak_memory_bytes"]


@pytest.mark.slow
def test_plan_and_predictions_are_logged_when_the_summary_has_them(traced_run, tmp_path):
    cfg, _, measured = traced_run
    # As the planner's summary.json will carry them (its figures here stand in for a prediction).
    summary = {**measured, "predicted_samples_per_s": 123.0, "predicted_peak_memory_bytes": [1000, 2000]}
    plan = {"num_stages": 2, "objective": "throughput", "stages": [{"layers": [0, 1, 2]}, {"layers": [3, 4]}]}
    tracker = Tracker(WandbConfig(mode="offline"), tmp_path, config=dataclasses.asdict(cfg))
    tracker.finish(summary, plan=plan)
    wandb.teardown()  # the wandb service outlives finish() in this process; its teardown flushes the run's file
    records = _records(tmp_path)
    logged = wandb_reader.summary(records)
    assert logged["predicted_samples_per_s"] == 123.0
    assert [logged["stage0/predicted_peak_memory_bytes"], logged["stage1/predicted_peak_memory_bytes"]] == [1000, 2000]
    files = next(tmp_path.glob("wandb/offline-run-*/files"))
    table = json.loads((files / logged["plan/path"]).read_text())
    assert table["columns"] == ["num_stages", "objective", "layers"]
    assert table["data"] == [[2, "throughput", "[0, 1, 2]"], [2, "throughput", "[3, 4]"]]


def test_disabled_writes_no_wandb_files(tmp_path):
    tracker = Tracker(WandbConfig(mode="disabled"), tmp_path)
    tracker.log({"loss": 1.0}, step=0)
    tracker.finish({"final_loss": 1.0})
    assert not (tmp_path / "wandb").exists()


@pytest.mark.slow
@pytest.mark.long
def test_a_resumed_job_continues_under_the_same_wandb_run_id(tmp_path):
    def cfg(steps):
        return Config(
            pipeline=PipelineConfig(num_stages=2, num_microbatches=2, microbatch_size=2),
            model=GPTConfig(d_model=32, seq_len=32, num_layers=2),
            train=TrainConfig(num_steps=steps, checkpoint_every=3, log_every=3, warmup_steps=1),
            wandb=WandbConfig(mode="offline"),
        )

    run_dir = tmp_path / "run"
    run_ok(cfg(3), run_dir)
    resumed = run_ok(cfg(6), run_dir)
    assert resumed["first_step"] == 3
    # wandb cannot resume offline: a second file
    first, second = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    runs = [wandb_reader.read_records(f) for f in (first, second)]
    assert wandb_reader.run_record(runs[0]).run_id == wandb_reader.run_record(runs[1]).run_id
    losses = [(r["_step"], r["loss"]) for r in wandb_reader.history(runs[1]) if "loss" in r]
    assert losses == list(zip(range(3, 6), resumed["losses"][3:]))  # the continuation logs only the steps it trained
    # A fresh run directory (no checkpoint) is a new wandb run.
    run_ok(cfg(3), tmp_path / "other")
    [other] = (tmp_path / "other").glob("wandb/offline-run-*/run-*.wandb")
    assert wandb_reader.run_record(wandb_reader.read_records(other)).run_id != wandb_reader.run_record(runs[0]).run_id
