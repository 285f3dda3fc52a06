"""Checkpoints: exact resume, re-partition on load, corrupt and foreign checkpoints, consolidation."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_helper import children, cli_config, run_ok, spawn, train
from test_semantics import assert_losses_close, tiny_config
from torch import nn

from pipedream2bw import checkpoint as checkpoint_cli
from pipedream2bw.config import ConfigError, GPTConfig
from pipedream2bw.io import checkpoint
from pipedream2bw.models import build_gpt_layers
from pipedream2bw.pipeline.comm import torchrun_command


def config(schedule="2bw", *, d=2, w=1, m=2, steps=6, every=3, optim="sgd_momentum", resume="auto"):
    cfg = tiny_config(schedule=schedule, num_stages=d, num_microbatches=m, optim=optim, num_steps=steps)
    cfg.pipeline.data_parallel = w
    cfg.pipeline.microbatch_size = 8 // (w * m)  # the same global batch, 8 sequences, at every layout
    cfg.train.checkpoint_every, cfg.train.resume = every, resume
    return cfg


def weights(run_dir: Path) -> dict:
    return torch.load(Path(run_dir) / "final_model.pt")


def assert_equal_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.isfinite(a[k]).all(), k
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["2bw", "flush", pytest.param("zbv", marks=pytest.mark.long)])
def test_resume_is_exact(tmp_path, schedule):
    """2N steps straight == N steps, stop, resume, N more: weights and every loss, bit for bit."""
    straight = run_ok(config(schedule, steps=6), tmp_path / "straight")
    run_ok(config(schedule, steps=3), tmp_path / "resumed")
    resumed = run_ok(config(schedule, steps=6), tmp_path / "resumed")
    assert resumed["first_step"] == 3 and resumed["resumed_from"].endswith("step_00000003")
    assert all(r["checkpoint_s"] > 0 for r in straight["ranks"])  # every rank took part in both checkpoints
    assert resumed["losses"] == straight["losses"]  # the first 3 come from the checkpoint, the rest are recomputed
    assert_equal_bits(weights(tmp_path / "resumed"), weights(tmp_path / "straight"))
    # ...and it is not trivially so: without the second version, 2bw would train differently.
    if schedule == "2bw":
        layer = torch.load(tmp_path / "straight/checkpoints/step_00000003" / checkpoint.layer_file(2))
        assert any(not torch.equal(layer["weights"][k], layer["previous"][k]) for k in layer["weights"])


@pytest.mark.slow
@pytest.mark.long  # 11 to 15 s loaded: run with the long ones to keep the suite under 10 min
def test_checkpoint_written_at_2x2_resumes_at_other_layouts(tmp_path):
    """(d=2, w=2) -> (4, 1) and (1, 1): same weights loaded, same next-step loss to round-off."""
    reference = run_ok(config(d=2, w=2, steps=4), tmp_path / "ref")
    run_ok(config(d=2, w=2, steps=3), tmp_path / "src")
    saved = checkpoint.consolidate(tmp_path / "src", tmp_path / "saved.pt")
    for d in (4, 1):
        run_dir = tmp_path / f"d{d}"
        summary = run_ok(config(d=d, w=1, m=4, steps=4, resume=str(tmp_path / "src")), run_dir)
        assert summary["first_step"] == 3 and len(summary["losses"]) == 4
        assert_losses_close(summary["losses"], reference["losses"])
        torch.testing.assert_close(weights(run_dir), weights(tmp_path / "ref"))
    # The source run ended at the checkpoint's step: its final_model.pt holds the checkpoint's newest weights.
    assert_equal_bits(torch.load(saved), weights(tmp_path / "src"))


@pytest.mark.slow
def test_corrupt_checkpoint_is_skipped_for_the_previous_one(tmp_path, caplog):
    run_ok(config(steps=4, every=2), tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == ["step_00000004", "step_00000002"]
    victim = root / "step_00000004" / checkpoint.layer_file(1)
    victim.write_bytes(victim.read_bytes()[:-100])  # truncated
    chosen, manifest = checkpoint.select(tmp_path / "run")
    assert chosen.name == "step_00000002" and manifest["step"] == 2
    assert "layer_00001.pt does not match its checksum" in caplog.text
    assert [p.name for p in root.glob("step_00000004.corrupt-*")]  # kept aside, not deleted


@pytest.mark.slow
@pytest.mark.long  # 11 to 15 s loaded: run with the long ones to keep the suite under 10 min
def test_resume_skips_corrupt_newest_and_trains_on(tmp_path):
    straight = run_ok(config(steps=6, every=2), tmp_path / "straight")
    run_ok(config(steps=4, every=2), tmp_path / "run")
    (tmp_path / "run" / "checkpoints" / "step_00000004" / "manifest.json").write_text("{ truncated")
    resumed = run_ok(config(steps=6, every=2), tmp_path / "run")
    assert resumed["first_step"] == 2 and resumed["losses"] == straight["losses"]
    assert_equal_bits(weights(tmp_path / "run"), weights(tmp_path / "straight"))
    kept = [p.name for p in checkpoint.complete_checkpoints(tmp_path / "run" / "checkpoints")]
    assert kept == ["step_00000006", "step_00000004"]  # train.keep_checkpoints=2 pruned the rest


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused_on_every_rank(tmp_path):
    run_ok(config(steps=2, every=2), tmp_path / "src")
    other = config(steps=4, resume=str(tmp_path / "src"))
    other.model.d_model = 48
    results = spawn(train, world_size=2, args=(other, str(tmp_path / "dst")), log_dir=tmp_path / "logs", timeout_s=240)
    for r in results:
        assert r.exitcode != 0
        assert "ConfigError" in r.log and "written for another model" in r.log, r.log
    assert "1.ln1.weight: checkpoint [32], model [48]" in results[0].log
    assert not (tmp_path / "dst" / "summary.json").exists()


def test_check_model_names_the_mismatched_parameters():
    manifest = {"param_shapes": {"0.weight": [4, 2], "1.bias": [3]}}
    with pytest.raises(
        ConfigError,
        match=r"0.weight: checkpoint \[4, 2\], model \[4, 3\]; 2.weight: not in the checkpoint; 1.bias: not in the "
        r"model",
    ):
        checkpoint.check_model(manifest, {"0.weight": [4, 3], "2.weight": [1]}, Path("ckpt"))


@pytest.mark.slow
def test_resume_path_without_checkpoint_is_a_config_error(tmp_path):
    cfg = config(steps=2, resume=str(tmp_path))
    results = spawn(train, world_size=2, args=(cfg, str(tmp_path / "run")), log_dir=tmp_path / "logs", timeout_s=240)
    assert all(r.exitcode != 0 and "holds no complete checkpoint" in r.log for r in results), [r.log for r in results]


@pytest.mark.slow
def test_consolidated_state_dict_loads_without_this_project(tmp_path):
    run_ok(config(steps=3, every=3), tmp_path / "run")
    out = checkpoint_cli.main(["consolidate", str(tmp_path / "run")])
    assert out == 0
    state = torch.load(tmp_path / "run" / "consolidated_step_00000003.pt")
    model = nn.Sequential(*build_gpt_layers(GPTConfig(num_layers=3, d_model=32, num_heads=2, seq_len=16), seed=0))
    model.load_state_dict(state)  # strict: every name of the unpartitioned model, nothing else
    assert_equal_bits(state, weights(tmp_path / "run"))
    assert checkpoint_cli.main(["consolidate", str(tmp_path / "nothing")]) == 2


@pytest.mark.slow
def test_partial_checkpoint_is_never_chosen(tmp_path):
    run_ok(config(steps=3, every=3), tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(root / "step_00000003", root / ".step_00000006.partial")
    (root / ".step_00000006.partial" / "manifest.json").unlink()
    assert checkpoint.select(tmp_path / "run")[0].name == "step_00000003"
    manifest = json.loads((root / "step_00000003" / "manifest.json").read_text())
    assert manifest["step"] == 3 and len(manifest["losses"]) == 3 and manifest["layout"]["balance"] == [3, 3]


# A tiny 2-stage 2bw run, sgd with momentum at lr 0.05, as command-line overrides of a torchrun launch (the tests
# that signal or kill its processes); the rest is configs/'s defaults, so their uninterrupted reference runs
# cli_config(the same overrides)
TINY_TORCHRUN_OVERRIDES = [
    "pipeline.num_stages=2",
    "pipeline.num_microbatches=2",
    "pipeline.microbatch_size=2",
    "model.num_layers=3",
    "model.d_model=32",
    "model.num_heads=2",
    "model.seq_len=16",
    "optim.name=sgd",
    "optim.lr=0.05",
    "+optim.kwargs.momentum=0.9",
    "optim.delay_correction=error_feedback",  # named: sgd's default (auto) is none; resumes must carry its state
    "wandb.mode=disabled",
    "seed=3",
]


def _cli_and_in_process(overrides, cfg, cli_dir: str, in_process_dir: str) -> None:
    """On one rank: ``python -m pipedream2bw.train *overrides`` (as ``-m`` runs it) into ``cli_dir``, then the
    in-process run of ``cfg`` into ``in_process_dir``."""
    import runpy

    from pipedream2bw.run.runner import run

    sys.argv = ["pipedream2bw.train", *overrides, f"hydra.run.dir={cli_dir}"]
    runpy.run_module("pipedream2bw.train", run_name="__main__")
    run(cfg, Path(in_process_dir))


@pytest.mark.slow
def test_a_launched_run_trains_what_its_in_process_reference_trains(tmp_path):
    """The restart and requeue tests (a SIGKILL here, SIGTERM in test_lifecycle, requeues in test_slurm) launch
    ``python -m pipedream2bw.train`` and compare it bit for bit with an in-process run of cli_config(the same
    overrides). Regression (issue 32): their references were Python configs, which lack the defaults of configs/:
    with error feedback the default (configs/optim/default.yaml), the launched runs corrected their steps and the
    references did not; under 2bw loss 3 is the first taken at weights a correction moved (step 1's), and all four
    tests failed there, which read as a resume that was not bit for bit."""
    overrides = [*TINY_TORCHRUN_OVERRIDES, "pipeline.num_stages=1", "train.num_steps=4", "train.log_every=100"]
    reference = cli_config(*overrides)
    assert reference.optim.delay_correction == "error_feedback"  # named in the overrides (auto gives sgd none)
    cli, in_process = tmp_path / "cli", tmp_path / "in_process"
    (result,) = spawn(
        _cli_and_in_process, world_size=1, args=(overrides, reference, str(cli), str(in_process)), log_dir=tmp_path
    )
    assert result.exitcode == 0, result.log
    losses = [json.loads((d / "summary.json").read_text())["losses"] for d in (cli, in_process)]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    assert "optimizer sgd lr 0.05 (constant), delay correction error_feedback" in (cli / "train.log").read_text()
    assert_equal_bits(weights(cli), weights(in_process))


@pytest.mark.slow
@pytest.mark.long
def test_sigkilled_rank_restarts_under_torchrun_and_finishes_with_the_same_weights(tmp_path):
    overrides = [*TINY_TORCHRUN_OVERRIDES, "train.num_steps=120", "train.checkpoint_every=10", "train.log_every=100"]
    cmd = [
        *torchrun_command(2, "--max-restarts", "1"),
        "-m",
        "pipedream2bw.train",
        *overrides,
    ]
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("outputs/*/*/checkpoints/step_00000020")):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()
            time.sleep(0.02)
        victim = max(children(proc.pid))
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(timeout=180) == 0, (tmp_path / "torchrun.log").read_text()
    finally:
        proc.kill()
    run_dir = next(tmp_path.glob("outputs/*-*-*/*"))  # the restart kept the run directory (not outputs/latest)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 20 <= summary["first_step"] < 120, summary["first_step"]  # it did restart, from a checkpoint
    assert (
        f"resuming from {run_dir}/checkpoints/step_{summary['first_step']:08d}"
        in (tmp_path / "torchrun.log").read_text()
    )

    expected = run_ok(cli_config(*overrides), tmp_path / "uninterrupted")  # what torchrun trained, uninterrupted
    assert summary["losses"] == expected["losses"]
    assert_equal_bits(weights(run_dir), weights(tmp_path / "uninterrupted"))


@pytest.mark.slow
def test_ranks_with_their_own_run_directories_agree_on_resuming(tmp_path):
    """What rank 0 decides before the groups start is keyed by run, not by its run directory."""
    from dist_helper import train_in_own_dir

    results = spawn(
        train_in_own_dir,
        world_size=2,
        args=(config(steps=2, every=2), str(tmp_path)),
        log_dir=tmp_path / "logs",
        timeout_s=240,
    )
    assert all(r.exitcode == 0 for r in results), [r.log for r in results]
    assert json.loads((tmp_path / "rank0" / "summary.json").read_text())["first_step"] == 0
