"""The sweep entry point: one command runs a Hydra multirun whose jobs launch distributed runs
(torch elastic launch), survive failing jobs, and tabulate what each run measured."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipedream2bw.sweep import train_overrides

TINY = [
    "model.d_model=32", "model.seq_len=32", "model.num_layers=2", "pipeline.num_microbatches=2", "pipeline.microbatch_size=2",
    "train.num_steps=4", "train.warmup_steps=1", "wandb.mode=disabled",
]


def sweep(*args: str, cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, "-m", "pipedream2bw.sweep", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)


def test_sweep_runs_every_job_and_tabulates_what_each_run_measured(tmp_path):
    # 2 depths x 3 schedules = 6 configurations; 'bogus' is a deliberately bad schedule.
    proc = sweep("-m", "pipeline.num_stages=1,2", "pipeline.schedule=2bw,gpipe,bogus", *TINY, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [sweep_dir] = list((tmp_path / "sweeps").glob("*/*"))
    table = json.loads((sweep_dir / "sweep.json").read_text())
    assert table["name"] == str(Path("sweeps") / sweep_dir.relative_to(tmp_path / "sweeps"))
    jobs = table["jobs"]
    assert sorted(j["job"] for j in jobs) == list(range(6))
    ok = [j for j in jobs if j["status"] == "ok"]
    failed = [j for j in jobs if j["status"] != "ok"]
    assert sorted((j["num_stages"], j["schedule"]) for j in ok) == [(1, "2bw"), (1, "gpipe"), (2, "2bw"), (2, "gpipe")]
    assert len(failed) == 2 and all(
        j["error"] == "bad configuration: pipeline.schedule ('bogus') is unknown; use one of ['2bw', 'flush', 'gpipe']" for j in failed
    )
    assert jobs == ok + failed and [j["samples_per_s"] for j in ok] == sorted((j["samples_per_s"] for j in ok), reverse=True)
    for j in ok:  # the table's figures are the run's own
        summary = json.loads((Path(j["run_dir"]) / "summary.json").read_text())
        for key in ("samples_per_s", "tokens_per_s", "final_loss", "peak_memory_bytes", "schedule", "num_stages", "num_microbatches"):
            assert j[key] == summary[key], key
        assert j["max_peak_memory_mib"] == max(summary["peak_memory_bytes"]) / 2**20
        assert j["predicted_samples_per_s"] is None  # no planner prediction in these runs
        assert len(summary["losses"]) == 4
        # The training run got the sweep as its wandb group, and the job's overrides.
        run_overrides = (Path(j["run_dir"]) / ".hydra" / "overrides.yaml").read_text()
        assert f"wandb.group='{table['name']}'" in run_overrides and f"pipeline.schedule={j['schedule']}" in run_overrides
    with open(sweep_dir / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["job"]) for r in rows] == [j["job"] for j in jobs]
    assert [float(r["samples_per_s"]) for r in rows[:4]] == [j["samples_per_s"] for j in ok]
    assert [json.loads(r["peak_memory_bytes"]) for r in rows[:4]] == [j["peak_memory_bytes"] for j in ok]
    # Printed: fastest job first, the failed ones last with their error.
    lines = proc.stdout[proc.stdout.index("job  status"):].splitlines()
    assert [int(line.split()[0]) for line in lines[1:7]] == [j["job"] for j in jobs]
    assert "bogus') is unknown" in lines[6]


def test_a_job_past_its_timeout_is_stopped_and_reported(tmp_path):
    start = time.monotonic()
    proc = sweep("sweep.timeout_s=2", "pipeline.num_stages=2", "hydra.run.dir=job", *TINY, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - start < 60
    [job] = json.loads((tmp_path / "job" / "sweep.json").read_text())["jobs"]
    assert job["status"] == "failed" and job["error"].startswith("timed out after 2 s (sweep.timeout_s)"), job
    assert not (tmp_path / "job" / "summary.json").exists()


@pytest.mark.parametrize("given, expected", [
    (["pipeline.num_stages=2", "sweep.timeout_s=5"], ["pipeline.num_stages=2", "wandb.group='sweeps/x'"]),
    (["wandb.group=mine", "+sweep.name=a"], ["wandb.group=mine"]),
])
def test_train_overrides_drop_sweep_keys_and_add_the_group(given, expected):
    assert train_overrides(given, group="sweeps/x") == expected
