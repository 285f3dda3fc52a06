"""SLURM: ranks and rendezvous from SLURM's environment; on a real one-node cluster (tests/slurm_cluster.py),
2-rank runs through hydra/launcher=slurm and scripts/slurm/train.sbatch that SLURM signals, requeues and
that resume bit for bit, and a 3-job sweep as one job array."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_helper import cli_config, run_ok
from hydra import compose, initialize_config_dir
from slurm_cluster import INSTALL, Cluster, missing
from test_checkpoint import TINY_TORCHRUN_OVERRIDES, assert_equal_bits, weights

from pipedream2bw.config import register_configs
from pipedream2bw.io import checkpoint
from pipedream2bw.run import slurm

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
# SLURM signals the job once the checkpoint of step SIGNAL_AFTER exists: the 50 steps left take about 1 s on
# an idle 2-core machine, 20 times what the signal takes to arrive
NUM_STEPS, SIGNAL_AFTER = 60, 10
RUN_OVERRIDES = [*TINY_TORCHRUN_OVERRIDES, f"train.num_steps={NUM_STEPS}", "train.checkpoint_every=10"]
SLOW_MACHINE_S = 600  # pytest-timeout: these runs crawl when the machine is shared (a step took 0.8 s at load 14)


# --- SLURM's environment (no cluster) -------------------------------------------------------------------


def test_nodelists_and_tasks_per_node_expand_as_slurm_writes_them():
    assert slurm.expand_nodelist("gpu[01-03,7],login2,n[9-10]") == [
        "gpu01",
        "gpu02",
        "gpu03",
        "gpu7",
        "login2",
        "n9",
        "n10",
    ]
    assert slurm.expand_nodelist("localhost") == ["localhost"]
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="unreadable SLURM tasks-per-node list 'two'"):
        slurm.tasks_per_node("two")


STEP = {  # task 5 of a step of 2 nodes x 4 tasks (srun's variables)
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NODELIST": "node[07-08]",
}


def test_a_task_of_a_step_is_a_rank_with_the_rendezvous_on_the_first_node():
    assert slurm.rank_env(STEP) == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node07",
        "MASTER_PORT": str(20000 + 4242),
    }
    assert slurm.rank_env({**STEP, "MASTER_PORT": "1234"})["MASTER_PORT"] == "1234"


def test_torchrun_ranks_and_a_batch_shell_keep_their_environment():
    # Inside torchrun under srun the SLURM_* variables describe torchrun's task: RANK is read first.
    assert slurm.rank_env({**STEP, "RANK": "3", "WORLD_SIZE": "16"}) == {}
    # The batch script's shell is no step: SLURM_NTASKS is the allocation's, not a world size.
    assert slurm.rank_env({k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")}) == {}
    assert slurm.rank_env({}) == {}


def test_the_slurm_launcher_signals_sigterm_before_the_limit_and_makes_the_job_requeueable():
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(
            "config", overrides=["hydra/launcher=slurm", "hydra.launcher.signal_delay_s=90"], return_hydra_config=True
        )
    params = cfg.hydra.launcher
    assert params._target_.endswith("SlurmLauncher")
    assert dict(params.additional_parameters) == {"signal": "TERM@90", "requeue": True}
    assert "SIGTERM" in cfg.train.preempt_signals  # what the signal must reach


# --- a real cluster ---------------------------------------------------------------------------------------

needs_slurm = pytest.mark.skipif(missing() is not None, reason=str(missing()))
on_cluster = pytest.mark.slurm


def _submitit_missing():
    try:
        import hydra_plugins.hydra_submitit_launcher  # noqa: F401
        import submitit  # noqa: F401
    except ImportError:
        return "hydra/launcher=slurm needs submitit: pip install -c constraints.txt -e '.[slurm]'"
    return None


needs_submitit = pytest.mark.skipif(_submitit_missing() is not None, reason=str(_submitit_missing()))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if missing() is not None:
        pytest.skip(missing())
    c = Cluster(tmp_path_factory.mktemp("slurm")).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run every SLURM run below must reproduce, bit for bit: the same config, uninterrupted, in-process ranks."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    return run_ok(cli_config(*RUN_OVERRIDES), run_dir, timeout_s=240), run_dir


def _env(cluster: Cluster) -> dict:
    return {**os.environ, **cluster.env, "PYTHONPATH": str(ROOT), "WANDB_SILENT": "true"}


def _signal_once_checkpointed(cluster: Cluster, run_dir: Path, job_id: str, watched: subprocess.Popen = None) -> None:
    """SLURM sends the job SIGTERM (as at signal_delay_s before its time limit) once step SIGNAL_AFTER is saved."""
    deadline = time.monotonic() + 240
    while not checkpoint.step_dir(run_dir / "checkpoints", SIGNAL_AFTER).is_dir():
        assert time.monotonic() < deadline and (watched is None or watched.poll() is None), "no checkpoint"
        time.sleep(0.05)
    cluster.run("scancel", "--signal=TERM", job_id)


def _assert_requeued_and_bit_exact(run_dir: Path, log: str, uninterrupted) -> None:
    expected, reference_dir = uninterrupted
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["num_stages"] == 2, summary
    assert SIGNAL_AFTER <= summary["first_step"] < NUM_STEPS, summary  # the second attempt resumed ...
    assert "preempted by SIGTERM: every rank stopped after step" in log, log
    assert "requeued: it starts again in this run directory" in log, log
    assert f"resuming from {run_dir}/checkpoints/step_{summary['first_step']:08d}" in log, log
    assert summary["losses"] == expected["losses"]  # ... and ends as if it never stopped
    assert_equal_bits(weights(run_dir), weights(reference_dir))


@pytest.mark.slow
@on_cluster
@pytest.mark.timeout(SLOW_MACHINE_S)
@needs_slurm
def test_sbatch_job_signalled_before_its_limit_is_requeued_and_resumes_bit_for_bit(cluster, tmp_path, uninterrupted):
    run_dir, out = tmp_path / "run", tmp_path / "slurm.out"
    env = {**_env(cluster), "NPROC_PER_NODE": "2", "RUN_DIR": str(run_dir)}
    job_id = cluster.run(
        "sbatch",
        "--parsable",
        "--cpus-per-task=2",
        f"--output={out}",
        str(SBATCH),
        *RUN_OVERRIDES,
        env=env,
        cwd=tmp_path,
    ).stdout.strip()
    _signal_once_checkpointed(cluster, run_dir, job_id)
    assert cluster.wait_job(job_id, timeout_s=300) == "COMPLETED", out.read_text()
    log = out.read_text()
    assert f"job {job_id} (restart 1): 1 node(s) x 2 rank(s)" in log, log
    _assert_requeued_and_bit_exact(run_dir, log + (run_dir / "train.log").read_text(), uninterrupted)


@pytest.mark.slow
@on_cluster
@pytest.mark.timeout(SLOW_MACHINE_S)
@needs_slurm
@needs_submitit
def test_launcher_job_signalled_before_its_limit_is_requeued_and_resumes_bit_for_bit(cluster, tmp_path, uninterrupted):
    sweep_dir = tmp_path / "multirun"
    cmd = [
        sys.executable,
        "-m",
        "pipedream2bw.train",
        "-m",
        "hydra/launcher=slurm",
        "hydra.launcher.tasks_per_node=2",
        f"hydra.sweep.dir={sweep_dir}",
        *RUN_OVERRIDES,
    ]
    log = tmp_path / "launcher.log"
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(cluster), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240  # the submitting process alone took over 60 s at load 15
        while not list(sweep_dir.glob(".submitit/*/*_submitted.pkl")):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        job_id = next(sweep_dir.glob(".submitit/*/*_submitted.pkl")).parent.name
        _signal_once_checkpointed(cluster, sweep_dir / "0", job_id, watched=proc)
        assert proc.wait(timeout=300) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert cluster.wait_job(job_id, timeout_s=300) == "COMPLETED"
    tasks = "".join(p.read_text() for p in sorted(sweep_dir.glob(f".submitit/{job_id}/*_log.*")))
    _assert_requeued_and_bit_exact(sweep_dir / "0", tasks + (sweep_dir / "0" / "train.log").read_text(), uninterrupted)


@pytest.mark.slow
@on_cluster
@needs_slurm
def test_a_cancelled_job_is_not_requeued(cluster, tmp_path):
    # Bug: scancel sends SIGTERM too; rank 0's scontrol requeue, accepted while the job was still completing,
    # brought the cancelled job back (seen with the module's cluster teardown).
    script, out = tmp_path / "job.sh", tmp_path / "job.out"
    (tmp_path / "requeue.py").write_text("from pipedream2bw.run import slurm\nprint('requeued:', slurm.requeue())\n")
    script.write_text(
        f"#!/bin/bash\ntrap '{sys.executable} {tmp_path / 'requeue.py'}; exit 0' TERM\n"
        "echo started\nfor i in $(seq 600); do sleep 0.1; done\n"
    )
    job_id = cluster.run("sbatch", "--parsable", "--requeue", f"--output={out}", str(script), env=_env(cluster)).stdout
    deadline = time.monotonic() + 60
    while "started" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cluster.run("scancel", job_id.strip())
    assert cluster.wait_job(job_id.strip(), timeout_s=300) == "CANCELLED"
    assert "requeued: False" in out.read_text(), out.read_text()


@pytest.mark.slow
@on_cluster
@pytest.mark.timeout(SLOW_MACHINE_S)
@needs_slurm
@needs_submitit
def test_a_sweep_of_three_runs_as_one_job_array_and_tabulates_them(cluster, tmp_path):
    sweep_dir = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "pipedream2bw.sweep",
        "-m",
        "hydra/launcher=slurm",
        f"hydra.sweep.dir={sweep_dir}",
        *[o for o in TINY_TORCHRUN_OVERRIDES if not o.startswith(("pipeline.num_stages", "seed"))],
        "pipeline.num_stages=1",
        "train.num_steps=4",
        "seed=1,2,3",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(cluster), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    script = next(sweep_dir.glob(".submitit/*/*_submission.sh")).read_text()
    assert "#SBATCH --array=0-2%3" in script, script
    rows = json.loads((sweep_dir / "sweep.json").read_text())["jobs"]
    assert sorted(r["job"] for r in rows) == [0, 1, 2] and {r["status"] for r in rows} == {"ok"}, rows
    assert f"sweep {sweep_dir}: 3 jobs, 0 failed" in proc.stdout, proc.stdout


def test_skip_reason_names_the_install_command(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setattr(Path, "exists", lambda self: False)
    assert INSTALL in missing() and "slurmctld" in missing()
