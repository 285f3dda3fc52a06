"""The sweep entry point: one command runs a Hydra multirun whose jobs launch distributed runs
(torch elastic launch), survive failing jobs, and tabulate what each run measured."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipedream2bw.config import Config, ConfigError
from pipedream2bw.sweep import (
    check_objective,
    format_table,
    job_row,
    objective_value,
    sort_rows,
    sweeper_direction,
    train_overrides,
)

TINY = [
    "model.d_model=32",
    "model.seq_len=32",
    "model.num_layers=2",
    "pipeline.num_microbatches=2",
    "pipeline.microbatch_size=2",
    "train.num_steps=4",
    "train.warmup_steps=1",
    "wandb.mode=disabled",
]


def sweep(*args: str, cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_SILENT": "true"}
    return subprocess.run(
        [sys.executable, "-m", "pipedream2bw.sweep", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.mark.slow
@pytest.mark.long
def test_sweep_runs_every_job_and_tabulates_what_each_run_measured(tmp_path):
    # 2 depths x 3 schedules = 6 configurations; 'bogus' is a deliberately bad schedule.
    proc = sweep("-m", "pipeline.num_stages=1,2", "pipeline.schedule=2bw,gpipe,bogus", *TINY, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [sweep_dir] = list((tmp_path / "outputs" / "sweeps").glob("*/*"))
    table = json.loads((sweep_dir / "sweep.json").read_text())
    assert table["name"] == str(Path("outputs", "sweeps") / sweep_dir.relative_to(tmp_path / "outputs" / "sweeps"))
    jobs = table["jobs"]
    assert sorted(j["job"] for j in jobs) == list(range(6))
    ok = [j for j in jobs if j["status"] == "ok"]
    failed = [j for j in jobs if j["status"] != "ok"]
    assert sorted((j["num_stages"], j["schedule"]) for j in ok) == [(1, "2bw"), (1, "gpipe"), (2, "2bw"), (2, "gpipe")]
    assert len(failed) == 2 and all(
        j["error"]
        == "bad configuration: pipeline.schedule ('bogus') is unknown; use one of ['2bw', 'flush', 'zb1p', 'zbv', "
        "'gpipe'] or auto"
        for j in failed
    )
    assert jobs == ok + failed and [j["samples_per_s"] for j in ok] == sorted(
        (j["samples_per_s"] for j in ok), reverse=True
    )
    for j in ok:  # the table's figures are the run's own
        summary = json.loads((Path(j["run_dir"]) / "summary.json").read_text())
        for key in (
            "samples_per_s",
            "tokens_per_s",
            "final_loss",
            "peak_memory_bytes",
            "schedule",
            "num_stages",
            "num_microbatches",
        ):
            assert j[key] == summary[key], key
        assert j["max_peak_memory_mib"] == max(summary["peak_memory_bytes"]) / 2**20
        assert j["predicted_samples_per_s"] is None  # no planner prediction in these runs
        assert len(summary["losses"]) == 4
        # The training run got the sweep as its wandb group, and the job's overrides.
        run_overrides = (Path(j["run_dir"]) / ".hydra" / "overrides.yaml").read_text()
        assert (
            f"wandb.group='{table['name']}'" in run_overrides and f"pipeline.schedule={j['schedule']}" in run_overrides
        )
    with open(sweep_dir / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["job"]) for r in rows] == [j["job"] for j in jobs]
    assert [float(r["samples_per_s"]) for r in rows[:4]] == [j["samples_per_s"] for j in ok]
    assert [json.loads(r["peak_memory_bytes"]) for r in rows[:4]] == [j["peak_memory_bytes"] for j in ok]
    # Printed: fastest job first, the failed ones last with their error.
    lines = proc.stdout[proc.stdout.index("job  status") :].splitlines()
    assert [int(line.split()[0]) for line in lines[1:7]] == [j["job"] for j in jobs]
    assert "bogus') is unknown" in lines[6]


@pytest.mark.slow
@pytest.mark.long  # a sweep job stopped at its timeout (9 s quiet); the suite measured 9 min 55 s with it
def test_a_job_past_its_timeout_is_stopped_and_reported(tmp_path):
    # thousands of steps: the job cannot end within the timeout (4 steps did, on a quiet machine, and wrote its summary)
    steps = [a if not a.startswith("train.num_steps=") else "train.num_steps=5000" for a in TINY]
    proc = sweep("sweep.timeout_s=2", "pipeline.num_stages=2", "hydra.run.dir=job", *steps, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [job] = json.loads((tmp_path / "job" / "sweep.json").read_text())["jobs"]
    assert job["status"] == "failed" and job["error"].startswith("timed out after 2 s (sweep.timeout_s)"), job
    # The sweep stops its ranks with SIGTERM, which a run answers as a preemption (a checkpoint, then exit 143):
    # its summary says so, never that it finished.
    summary = tmp_path / "job" / "summary.json"
    assert not summary.exists() or json.loads(summary.read_text())["status"] == "preempted"


@pytest.mark.parametrize(
    "given, expected",
    [
        (["pipeline.num_stages=2", "sweep.timeout_s=5"], ["pipeline.num_stages=2", "wandb.group='sweeps/x'"]),
        (["wandb.group=mine", "+sweep.name=a"], ["wandb.group=mine"]),
    ],
)
def test_train_overrides_drop_sweep_keys_and_add_the_group(given, expected):
    assert train_overrides(given, group="sweeps/x") == expected


def test_a_job_returns_its_objective_and_a_failed_job_the_worst_value():
    ok = {"job": 0, "status": "ok", "samples_per_s": 12.5, "final_loss": 3.0, "final_val_loss": None}
    failed = {"job": 1, "status": "failed", "error": "bad configuration: ..."}
    assert objective_value(ok, "samples_per_s", "maximize") == 12.5
    assert objective_value(ok, "final_loss", "minimize") == 3.0
    assert objective_value(failed, "samples_per_s", "maximize") == -math.inf
    assert objective_value(failed, "final_loss", "minimize") == math.inf
    assert objective_value({**ok, "final_loss": math.nan}, "final_loss", "minimize") == math.inf  # a diverged run
    # The table lists the best first in the objective's own direction, failed jobs last.
    rows = [failed, {**ok, "job": 2, "final_loss": 2.0, "samples_per_s": 5.0}, ok]
    assert [r["job"] for r in sort_rows(rows, objective="final_loss")] == [2, 0, 1]
    assert [r["job"] for r in sort_rows(rows, objective="samples_per_s")] == [0, 2, 1]


def test_objective_and_direction_checks():
    cfg = Config()
    assert check_objective(cfg) == "maximize"  # samples_per_s by default
    cfg.sweep.objective = "final_val_loss"
    with pytest.raises(ConfigError, match=r"sweep.objective \(final_val_loss\) needs validation: set train.eval_every"):
        check_objective(cfg)
    cfg.train.eval_every = 5
    assert check_objective(cfg) == "minimize"
    cfg.sweep.objective = "accuracy"
    with pytest.raises(ConfigError, match=r"sweep.objective \('accuracy'\) is unknown"):
        check_objective(cfg)
    assert sweeper_direction(OmegaConf.create({}), "maximize") == "maximize"  # the basic sweeper has none
    assert sweeper_direction(OmegaConf.create({"direction": "minimize"}), "maximize") == "minimize"
    assert sweeper_direction(OmegaConf.create({"direction": ["maximize"]}), "minimize") == "maximize"


def _has_optuna_sweeper() -> bool:
    try:
        return importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None
    except ModuleNotFoundError:  # no hydra_plugins namespace at all
        return False


@pytest.mark.slow
@pytest.mark.skipif(
    not _has_optuna_sweeper(),
    reason="the optional extra is not installed: pip install 'pipedream2bw[optuna]' (hydra-optuna-sweeper)",
)
@pytest.mark.long
def test_optuna_searches_microbatches_and_learning_rate_and_reports_the_best_trial(tmp_path):
    # The README's search, shrunk: 6 trials; m=4 breaks train.global_batch_size=4, so those trials fail
    # before launching and must come back as the worst value rather than stop the search.
    proc = sweep(
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=6",
        "hydra.sweeper.direction=minimize",
        "hydra.sweeper.sampler.seed=0",
        "sweep.objective=final_val_loss",
        "pipeline.num_microbatches=choice(2,4)",
        "optim.lr=tag(log,interval(1e-3,1e-1))",
        "train.global_batch_size=4",
        "pipeline.num_stages=1",
        *(o for o in TINY if not o.startswith("pipeline.num_microbatches=")),
        "train.eval_every=4",
        "train.eval_batches=1",
        "data.val_fraction=0.1",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [sweep_dir] = list((tmp_path / "outputs" / "sweeps").glob("*/*"))
    table = json.loads((sweep_dir / "sweep.json").read_text())
    jobs = {j["job"]: j for j in table["jobs"]}
    assert sorted(jobs) == list(range(6)) and table["objective"] == "final_val_loss"
    ok = [j for j in jobs.values() if j["status"] == "ok"]
    assert (
        ok
        and len(ok) < 6
        and all("global_batch_size (4) must equal" in j["error"] for j in jobs.values() if j["status"] != "ok")
    )
    for j in jobs.values():  # what each job returned to Optuna
        value = j["final_val_loss"] if j["status"] == "ok" else math.inf
        assert f"job {j['job']}: final_val_loss = {value}" in proc.stderr + proc.stdout
    best = min(ok, key=lambda j: j["final_val_loss"])
    results = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    assert results.best_value == best["final_val_loss"] and table["jobs"][0]["job"] == best["job"]
    assert f"pipeline.num_microbatches={results.best_params['pipeline.num_microbatches']}" in best["overrides"]
    assert f"best final_val_loss: {best['final_val_loss']:.6g}, job {best['job']}" in proc.stdout
    # Quiet: the sweep opened with a "setup plugin alembic..." line per alembic plugin and Optuna's own study line
    assert "setup plugin" not in proc.stderr + proc.stdout and "A new study created" not in proc.stderr + proc.stdout


def test_launched_ranks_get_one_thread_each_unless_the_user_set_it(tmp_path, monkeypatch):
    # Regression (issue 35): the elastic launch API, unlike torchrun, left OMP_NUM_THREADS unset, so a sweep's
    # (and bench_layouts.py's) ranks each ran a thread per core and measured 4-10x too low on a small machine.
    import torch.distributed.launcher.api as launcher_api

    from pipedream2bw.run import launch

    seen = []

    class FakeLaunch:  # records what the ranks would inherit
        def __init__(self, config, entrypoint):
            pass

        def __call__(self, *args):
            seen.append(os.environ.get("OMP_NUM_THREADS"))

    monkeypatch.setattr(launcher_api, "elastic_launch", FakeLaunch)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    launch.launch_train([], nproc=4, run_dir=tmp_path / "a")
    assert seen == ["1"] and "OMP_NUM_THREADS" not in os.environ  # put back as it was
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    launch.launch_train([], nproc=4, run_dir=tmp_path / "b")
    assert seen == ["1", "3"] and launch.worker_threads(4) == "3"
    row = job_row(0, [], tmp_path / "a", 1.0, "failed", threads=launch.worker_threads(4))
    assert row["threads_per_rank"] == "3" and "threads" in format_table([row])


def test_the_table_counts_each_job_once_when_a_run_links_latest_inside_the_sweep(tmp_path, capsys):
    # Bug: with hydra.sweep.dir one folder below the working directory (hydra.sweep.dir=mysweep), each run's
    # <results folder>/latest link is mysweep/latest, and the table read the last job twice (through the link).
    from omegaconf import OmegaConf

    from pipedream2bw.sweep import RESULT_FILE, SweepTable

    for job in range(2):
        (tmp_path / str(job)).mkdir()
        row = {"job": job, "status": "failed", "error": "x", "overrides": "", "run_dir": "", "wall_s": 0.0}
        (tmp_path / str(job) / RESULT_FILE).write_text(json.dumps(row))
    (tmp_path / "latest").symlink_to("1")
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}, "sweep": {"name": "s", "objective": None}})
    SweepTable().on_multirun_end(config)
    assert [r["job"] for r in json.loads((tmp_path / "sweep.json").read_text())["jobs"]] == [0, 1]
