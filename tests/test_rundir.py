"""The run directory shows the run: metrics.jsonl, loss.png, the start of the log, outputs/latest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from dist_helper import spawn, train_as_a_script

from pipedream2bw.config import Config, DataConfig, GPTConfig, OptimConfig, PipelineConfig, TrainConfig, WandbConfig
from pipedream2bw.io.fileio import atomic_symlink
from pipedream2bw.io.tracking import MetricsLog, plot_losses, read_metrics
from pipedream2bw.run.logs import format_duration
from pipedream2bw.run.start import link_latest

BLUE, ORANGE = (31, 119, 180), (255, 127, 14)  # matplotlib's tab:blue (training) and tab:orange (validation)


def _pixels_of(png: Path, rgb) -> int:
    import matplotlib.image

    img = (matplotlib.image.imread(str(png))[..., :3] * 255).round().astype(int)
    return int((np.abs(img - np.array(rgb)).sum(axis=-1) <= 30).sum())


@pytest.fixture(scope="module")
def script_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rundir") / "run"
    cfg = Config(
        pipeline=PipelineConfig(num_stages=2, num_microbatches=2, microbatch_size=2),
        model=GPTConfig(d_model=32, seq_len=32, num_layers=2),
        data=DataConfig(val_fraction=0.1),
        optim=OptimConfig(name="adamw"),  # the header line below names it
        train=TrainConfig(num_steps=6, warmup_steps=1, log_every=3, eval_every=3, eval_batches=1, checkpoint_every=3),
        wandb=WandbConfig(mode="disabled"),
    )
    return run_dir, _spawn_ok(cfg, run_dir)


def _spawn_ok(cfg: Config, run_dir: Path) -> list:
    results = spawn(train_as_a_script, world_size=2, args=(cfg, str(run_dir)), log_dir=run_dir.parent / "logs")
    bad = [r for r in results if r.exitcode != 0]
    assert not bad, "\n".join(f"--- rank {r.rank} exit {r.exitcode}\n{r.log}" for r in bad)
    return results


def test_metrics_jsonl_has_a_line_per_step_and_per_validation_pass(script_run):
    run_dir, _ = script_run
    steps, vals = read_metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in steps] == summary["losses"]
    for r in steps:
        assert (
            r["lr"] == 3e-3 and r["samples_per_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 32)
        )
        assert r["memory_bytes"] > 0 and r["eta_s"] >= 0 and "grad_norm" in r
    assert steps[-1]["eta_s"] == 0
    assert [(v["step"], v["val_loss"]) for v in vals] == [(x["step"], x["loss"]) for x in summary["val_losses"]]
    assert [v["step"] for v in vals] == [3, 6]


@pytest.mark.slow
def test_a_run_resumed_into_a_new_directory_keeps_the_history_up_to_its_checkpoint(script_run, tmp_path):
    # Regression (issue 35): the new directory's metrics.jsonl held only the steps after the checkpoint, though
    # its summary.json and loss.png showed them all and docs/results.md said it keeps the lines before.
    run_dir, _ = script_run
    resumed = Config(
        pipeline=PipelineConfig(num_stages=2, num_microbatches=2, microbatch_size=2),
        model=GPTConfig(d_model=32, seq_len=32, num_layers=2),
        data=DataConfig(val_fraction=0.1),
        optim=OptimConfig(name="adamw"),  # the header line below names it
        train=TrainConfig(
            num_steps=4,
            warmup_steps=1,
            log_every=3,
            eval_every=3,
            eval_batches=1,
            resume=str(run_dir / "checkpoints" / "step_00000003"),
        ),
        wandb=WandbConfig(mode="disabled"),
    )
    _spawn_ok(resumed, tmp_path / "resumed")
    before, after = (run_dir / "metrics.jsonl").read_text(), (tmp_path / "resumed" / "metrics.jsonl").read_text()
    steps, vals = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [v["step"] for v in vals] == [3, 4]
    kept = [line for line in before.splitlines() if json.loads(line)["step"] <= 3]
    assert after.splitlines()[: len(kept)] == kept  # the earlier run's lines, as they were
    assert (
        f"steps 1..3 copied from {run_dir.resolve() / 'metrics.jsonl'}"
        in (tmp_path / "resumed" / "train.log").read_text()
    )


def test_loss_png_draws_training_and_validation(script_run):
    run_dir, _ = script_run
    png = run_dir / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _pixels_of(png, BLUE) > 100 and _pixels_of(png, ORANGE) > 50  # both curves, each in its colour


def test_a_script_calling_run_logs_as_the_cli_does_and_quietly(script_run):
    run_dir, results = script_run
    log = (run_dir / "train.log").read_text()
    # The start states the settings, the parameters per stage and the data's size.
    assert "[stage 0/rank 0] run: 2bw schedule, 2 stages x 1 replica (d=2, w=1), m=2 microbatches of b=2" in log, log
    assert "precision fp32, optimizer adamw lr 0.003 (constant)" in log
    assert "parameters: 42,880 in all; per stage: 0: 21,920 (layers 0-1), 1: 20,960 (layers 2-4)" in log
    assert "data: the shipped corpus (bytes), 418,543 tokens to train on, 46,504 held out for validation" in log
    assert "[stage 1/rank 1] 2bw schedule, 2 stages x 1 replica, replica 0" in log  # every rank, in one file
    assert "step 3/6 loss" in log and "left" in log and "done: loss" in log
    for r in results:  # stderr: the same lines, and no warning (it would have failed the run: an error)
        assert "Converting a tensor" not in r.log and "Warning" not in r.log, r.log
    assert "run: 2bw schedule" in results[0].log


def test_parameters_per_stage_add_up_to_the_model():
    from torch import nn

    from pipedream2bw.models import build_gpt_layers

    layers = build_gpt_layers(GPTConfig(d_model=32, seq_len=32, num_layers=2), seed=0)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    assert sum(per_layer[:2]) == 21_920 and sum(per_layer[2:]) == 20_960  # the figures the log above states
    assert sum(p.numel() for p in nn.Sequential(*layers).parameters()) == 42_880


def test_metrics_log_on_resume_keeps_lines_up_to_the_checkpoint(tmp_path):
    log = MetricsLog(tmp_path)
    for n in range(1, 6):
        log.write({"step": n, "loss": float(n)})
    log.write({"step": 3, "val_loss": 9.0})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a line cut short by a crash
    log = MetricsLog(tmp_path, first_step=3)  # resumed from step_3: steps 4.. run again
    log.write({"step": 3, "val_loss": 9.0})  # step 3's validation pass, repeated: its line is there already
    log.write({"step": 4, "loss": 40.0})
    log.close()
    steps, vals = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in steps] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert vals == [{"step": 3, "val_loss": 9.0}]


def test_plot_without_validation_draws_training_only(tmp_path):
    plot_losses([5.0, 4.0, 3.5], [], tmp_path / "loss.png", title="t")
    assert _pixels_of(tmp_path / "loss.png", BLUE) > 100 and _pixels_of(tmp_path / "loss.png", ORANGE) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["loss.png"]  # no temporary left


def test_latest_links_the_newest_run_directory(tmp_path):
    first, second = tmp_path / "outputs" / "2026-11-23" / "10-00-00", tmp_path / "outputs" / "multirun" / "a" / "0"
    for d in (first, second):
        d.mkdir(parents=True)
    assert link_latest(first, cwd=tmp_path) == tmp_path / "outputs" / "latest"
    assert (tmp_path / "outputs" / "latest").resolve() == first.resolve()
    assert not Path(str((tmp_path / "outputs" / "latest").readlink())).is_absolute()  # the folder may move
    link_latest(second, cwd=tmp_path)
    assert (tmp_path / "outputs" / "latest").resolve() == second.resolve()
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["2026-11-23", "latest", "multirun"]
    assert link_latest(tmp_path / "run", cwd=tmp_path) is None  # one level below: no results folder to link in
    assert link_latest(Path("/elsewhere/run/x"), cwd=tmp_path) is None


def test_atomic_symlink_never_replaces_a_directory(tmp_path):
    (tmp_path / "latest").mkdir()
    with pytest.raises(IsADirectoryError):
        atomic_symlink(Path("x"), tmp_path / "latest")


def test_durations():
    assert [format_duration(s) for s in (0.4, 7.2, 83, 3725)] == ["0s", "7s", "1m23s", "1h02m"]
