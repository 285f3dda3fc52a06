"""The launcher (``pipedream2bw-train``, ``python -m pipedream2bw.launch``): a mistake is one line and exit 2 before
any rank starts; a rank's refusal, a failure and Ctrl-C end in at most one line of its own (issue 43)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_helper import children

from pipedream2bw.launch import launch, split_args

ROOT = Path(__file__).resolve().parents[1]
TINY = ["pipeline.num_stages=2", "model.d_model=32", "model.seq_len=32", "wandb.mode=disabled"]


def _env() -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "WANDB_SILENT": "true"}


def _launch(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipedream2bw.launch", *args],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a SIGINT sent to the launcher alone, as a terminal's reaches torchrun alone
    )


def test_split_args_keeps_torchrun_options_apart_from_the_overrides():
    assert split_args(["--nproc-per-node", "4", "--standalone", "train.num_steps=5"]) == (
        ["--nproc-per-node", "4", "--standalone"],
        ["train.num_steps=5"],
    )
    assert split_args(["--nproc-per-node=2", "-m", "pipeline.schedule=2bw,gpipe"]) == (
        ["--nproc-per-node=2"],
        ["-m", "pipeline.schedule=2bw,gpipe"],  # Hydra's multirun, not torchrun's --module
    )
    assert split_args(["--nnodes", "1", "--help"]) == (["--nnodes", "1"], ["--help"])
    assert split_args([]) == ([], [])


# Under torchrun each of these cost 20-55 s and ~55 lines of ChildFailedError traceback, exit 1 (issue 43); the
# first two named the wrong key, or none (a ZeroDivisionError).
MISTAKES = {
    "train.num_steps=-5": "train.num_steps (-5) must be >= 1",
    "model.num_heads=0": "model.num_heads (0) must be >= 1",
    "train.num_step=5": "unknown config key: train.num_step (did you mean train.num_steps?)",
    "pipeline.schedule=pipedream": "pipeline.schedule ('pipedream') is unknown",
    "data.path=/no/such/file.bin": "/no/such/file.bin",
}


def _finished_run(run_dir: Path, step: int) -> Path:
    """A run directory whose one checkpoint is at ``step`` (its manifest; the launcher reads no more)."""
    ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(f'{{"step": {step}, "lineage": "x", "written_at": 1}}')
    return run_dir


@pytest.mark.parametrize(
    "override", list(MISTAKES) + ["2 ranks, 4 stages", "a link", "a finished run", "no checkpoint"]
)
def test_a_mistake_is_one_line_and_exit_2_before_any_rank_starts(override, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--nproc-per-node", "4", override]
    want = MISTAKES.get(override)
    if override == "a finished run":  # was found by rank 0 once the ranks had started (8-20 s)
        run = _finished_run(tmp_path / "linked", 150)
        argv, want = [*argv[:2], f"train.resume={run}"], "is at step 150, and train.num_steps is 150: nothing left"
    if override == "no checkpoint":
        (tmp_path / "linked").mkdir()
        argv, want = [*argv[:2], f"train.resume={tmp_path / 'linked'}"], "holds no complete checkpoint"
    if override == "2 ranks, 4 stages":
        argv, want = ["--nproc-per-node", "2"], "world size (2) is not divisible by pipeline.num_stages (4)"
    if override == "a link":
        (tmp_path / "linked").mkdir()
        (tmp_path / "linked" / "train.log").symlink_to(tmp_path / "outside.log")  # a run would append through it
        argv, want = [*argv[:2], f"hydra.run.dir={tmp_path / 'linked'}"], "train.log is a symbolic link"
    assert launch(argv) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [err.strip()] and err.startswith("bad configuration: "), err
    assert want in err and out == "", (out, err)
    assert [p.name for p in tmp_path.iterdir()] in ([], ["linked"])  # no run directory made


def test_the_console_script_refuses_in_seconds(tmp_path):
    # the whole command, in its own interpreter: imports and the check, no rank started
    start = time.monotonic()
    proc = _launch("--nproc-per-node", "4", "train.num_steps=-5", cwd=tmp_path)
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 2 and err.startswith("bad configuration: train.num_steps (-5)"), err
    assert took < 30, took  # ~3 s on a quiet 2-core machine; under torchrun 20-55 s
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.long  # a launch of 2 ranks: 10-40 s on 2 loaded cores (.ci/run runs it)
def test_a_ranks_refusal_is_its_one_line_and_exit_2(tmp_path):
    # what only the ranks can see (here a custom layer list's length, known once it is built): torchrun exited 1
    # with its traceback
    custom = ["model=custom", "model._target_=custom_models.shared_buffer_layers"]  # a buffer shared by 2 stages
    proc = _launch("--nproc-per-node", "2", *TINY[:1], "wandb.mode=disabled", *custom, cwd=tmp_path)
    out, err = proc.communicate(timeout=180)
    text = out + err
    assert proc.returncode == 2, text
    assert "Traceback" not in text and "ChildFailedError" not in text and "Setting OMP_NUM_THREADS" not in text, text
    assert err.strip() == "pipedream2bw-train: configuration checked; starting 2 ranks (torchrun)", text  # at once
    lines = [ln for ln in out.splitlines() if ln.strip()]  # rank 0's, in Hydra's log format
    assert len(lines) == 1 and "bad configuration: buffers shared by layers (1.scale, 2.scale)" in lines[0], text


@pytest.mark.slow
@pytest.mark.long  # a launch of 2 ranks training 4 steps: 10-40 s
def test_a_warning_is_said_once_per_run_not_per_rank(tmp_path):
    # the launcher's check, each rank's check and each rank's run logged the config's warning: 5 times at 2 ranks
    proc = _launch("--nproc-per-node", "2", *TINY, "train.num_steps=4", "optim.min_lr=0.0001", cwd=tmp_path)
    out, err = proc.communicate(timeout=180)
    text = out + err
    assert proc.returncode == 0, text
    assert text.count("optim.min_lr (0.0001) is ignored by optim.scheduler=constant") == 1, text


@pytest.mark.slow
@pytest.mark.long  # a launch of 2 ranks that fails at its first step: 10-40 s
def test_a_ranks_failure_is_exit_1_and_a_line_naming_the_rank_and_its_cause(tmp_path):
    # a run that goes wrong (a non-finite gradient) stops every rank; torchrun printed ChildFailedError's traceback
    proc = _launch("--nproc-per-node", "2", *TINY, "optim.name=sgd", "optim.lr=1e30", cwd=tmp_path)
    out, err = proc.communicate(timeout=180)
    text = out + err
    assert proc.returncode == 1, text
    assert "Traceback" not in text and "ChildFailedError" not in text, text
    last = err.strip().splitlines()[-1]
    assert re.match(r"pipedream2bw-train: rank \d failed with exit status 1: .*NonFiniteError: non-finite", last), text


@pytest.mark.slow
@pytest.mark.long  # a launch of 2 ranks, interrupted: 8-22 s
def test_ctrl_c_while_the_ranks_start_is_one_line_and_exit_130(tmp_path):
    # Ctrl-C while the ranks imported printed 147 lines of KeyboardInterrupt tracebacks, torchrun exit 1
    proc = _launch("--nproc-per-node", "2", *TINY, "train.num_steps=1000", cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not children(proc.pid) and time.monotonic() < deadline:  # the check is done, torchrun starts the ranks
        time.sleep(0.05)
    time.sleep(0.5)  # the ranks are importing torch
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    text = out + err
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert text.strip().splitlines()[-1] == "pipedream2bw-train: stopped by SIGINT", text


@pytest.mark.parametrize(
    "old, new, name",
    [
        ("pipedream2bw.runner", "pipedream2bw.run.runner", "run"),
        ("pipedream2bw.versions", "pipedream2bw.pipeline.versions", "WeightVersions"),
        ("pipedream2bw.tracking", "pipedream2bw.io.tracking", "Tracker"),
    ],
)
def test_an_old_import_path_still_imports_with_a_deprecation_warning(old, new, name):
    # issue 43: `from pipedream2bw.runner import run` and `pipedream2bw.versions` broke without a word
    import importlib

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    with pytest.warns(DeprecationWarning, match="pipedream2bw.run.launch"):
        from pipedream2bw.launch import launch_train
    from pipedream2bw.run.launch import launch_train as now

    assert launch_train is now


def test_without_nproc_per_node_it_launches_the_configs_ranks(monkeypatch, capsys, tmp_path):
    import pipedream2bw.launch as launcher

    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr(launcher, "_run", lambda args, nproc: started.append((args.nproc_per_node, nproc)) or 0)
    assert launcher.launch([]) == 0  # torchrun's default, 1 rank, was refused by the default 4 stages
    assert launcher.launch(["pipeline.num_stages=2", "pipeline.data_parallel=2"]) == 0
    assert launcher.launch(["--nproc-per-node", "2", "pipeline.num_stages=2"]) == 0
    assert started == [("4", 4), ("4", 4), ("2", 2)]
    assert "starting 4 ranks (torchrun)" in capsys.readouterr().err


def test_a_bad_torchrun_option_is_one_line(capsys):
    # argparse printed torchrun's 30-line usage, then the error
    assert launch(["--nproc-per-node", "2", "--bogus", "x", "pipeline.num_stages=2", "train.num_steps=10"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines() == [
        "pipedream2bw-train: unrecognized arguments: --bogus; torchrun's options: torchrun --help"
    ], err


@pytest.mark.parametrize(
    "override",
    [
        "train.num_steps=-5",
        "model.num_heads=0",
        "pipeline.schedule=zz",
        "trian.num_steps=3",
        "2 ranks",
        "data.path=nope",
    ]
    + ["a finished run", "a run directory in use"],
)
def test_a_mistake_is_found_without_importing_torch(override, tmp_path):
    # importing torch was most of a refusal's 3 s (5-13 s on a loaded machine): the config's checks up to the
    # optimizer's, the launcher's count of the ranks, a resume's manifests and a live run's lock need none of it
    from pipedream2bw.io.rundir import RunLock

    args = ["--nproc-per-node", "2"] if override == "2 ranks" else ["--nproc-per-node", "4", override]
    if override == "a finished run":  # 7-11 s with a 4-rank training beside it, found after the torch checks
        args[2] = f"train.resume={_finished_run(tmp_path / 'run', 150)}"
    if override == "a run directory in use":
        (tmp_path / "live").mkdir()
        args[2] = f"hydra.run.dir={tmp_path / 'live'}"
    code = f"import sys; from pipedream2bw.launch import launch; print(launch({args!r}), 'torch' in sys.modules)"
    with RunLock() as lock:
        if override == "a run directory in use":
            lock.acquire(tmp_path / "live")
        proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    assert proc.stderr.startswith("bad configuration: "), proc.stderr
