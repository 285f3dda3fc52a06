"""The command line: the README's command under torchrun (run directory, results, bad input on every rank),
and every entry point's --help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipedream2bw.config import GPTConfig
from pipedream2bw.models import build_gpt_layers
from pipedream2bw.pipeline.comm import torchrun_command

ROOT = Path(__file__).resolve().parents[1]
# The README's default command, shortened: a smaller GPT for fewer steps, same 4-stage 2bw pipeline.
SHORT = ["model.d_model=64", "model.seq_len=64", "pipeline.microbatch_size=4", "train.num_steps=40", "optim.lr=1e-2"]


def torchrun(*overrides: str, cwd: Path, timeout_s: float = 240) -> subprocess.CompletedProcess:
    cmd = [
        *torchrun_command(4),
        "-m",
        "pipedream2bw.train",
        *overrides,
    ]
    env = {**os.environ, "WANDB_SILENT": "true"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.slow
@pytest.mark.long
def test_readme_command_trains_and_writes_results(tmp_path):
    proc = torchrun(*SHORT, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dirs = list((tmp_path / "outputs").glob("*-*-*/*"))  # <date>/<time>; outputs/latest links it
    assert len(run_dirs) == 1, run_dirs  # every rank wrote into the same run directory
    run_dir = run_dirs[0]
    assert (tmp_path / "outputs" / "latest").resolve() == run_dir.resolve()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["schedule"] == "2bw" and summary["num_stages"] == 4 and len(summary["losses"]) == 40
    assert summary["losses"][0] > 5.0 and summary["final_loss"] < summary["losses"][0] - 1.5  # the loss falls clearly
    assert summary["samples_per_s"] > 0 and summary["tokens_per_s"] == summary["samples_per_s"] * 64
    assert len(summary["peak_memory_bytes"]) == 4 and all(b > 0 for b in summary["peak_memory_bytes"])
    assert all(s["peak_stash_bytes"] > 0 and s["weight_bytes"] > 0 for s in summary["ranks"])
    # The loss is logged on rank 0, although the last stage computes it.
    assert "[stage 0/rank 0] step 40/40 loss" in (run_dir / "train.log").read_text()
    # final_model.pt is the unpartitioned model's state_dict.
    model = nn.Sequential(*build_gpt_layers(GPTConfig(d_model=64, seq_len=64), seed=0))
    model.load_state_dict(torch.load(run_dir / "final_model.pt"), strict=True)
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.mark.slow
@pytest.mark.long  # a torchrun launch of 4 ranks (11 s quiet); test_config holds each refusal
def test_bad_input_is_one_line_exit_2_and_leaves_no_run_directory(tmp_path):
    proc = torchrun("pipeline.num_microbatches=2", "wandb.mode=disabled", cwd=tmp_path, timeout_s=300)
    assert proc.returncode != 0  # torchrun's own status is 1 whatever its workers' are
    out = proc.stdout + proc.stderr
    line = "bad configuration: pipeline.num_microbatches (2) must be >= pipeline.num_stages (4) for 2bw"
    # Every rank finds it before any store or process group; rank 0 prints it, once (it printed once per rank,
    # each in Hydra's log format), and torchrun's summary names it as the root cause (it said "<N/A>").
    assert out.count(f"[rank 0] {line}") == 1 and "[rank 1] bad" not in out and "[ERROR]" not in out, out
    root_cause = out.split("Root Cause")[-1]
    assert "exitcode  : 2" in root_cause and f"traceback : {line}" in root_cause, out
    assert "raise pipeline.num_microbatches to 4 or more" in out
    assert not (tmp_path / "outputs").exists()  # a run directory holding only train.log was left behind


def test_a_key_typo_gets_the_key_meant_in_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "pipedream2bw.train", "train.num_step=5"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # Hydra said "To append to your config use +train.num_step=5" (wrong advice) in 8 lines, exit status 1
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "bad configuration: unknown config key: train.num_step (did you mean train.num_steps?); "
        "python -m pipedream2bw.train --help lists every key"
    ], proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.long
def test_multirun_runs_each_job_in_the_same_ranks(tmp_path):
    proc = torchrun(
        "-m",
        "pipeline.schedule=2bw,gpipe",
        "train.num_steps=4",
        "model.d_model=32",
        "model.seq_len=32",
        "wandb.mode=disabled",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summaries = sorted((tmp_path / "outputs" / "multirun").glob("*/*/*/summary.json"))
    assert [json.loads(p.read_text())["schedule"] for p in summaries] == ["2bw", "gpipe"]
    # Hydra's launcher messages once, from rank 0 (they came once per rank); outputs/latest: the last job
    out = proc.stdout + proc.stderr
    assert out.count("Launching 2 jobs locally") == 1 and out.count("#1 : pipeline.schedule=gpipe") == 1, out
    assert (tmp_path / "outputs" / "latest").resolve() == summaries[-1].parent.resolve()


# Every entry point and what its --help must say: its usage line and, for Hydra ones, the config groups.
# Regression: `python -m partitioner plan --help` ended in a Hydra override-grammar traceback, and
# scripts/bench_precision.py failed at import (a helper of scripts/bench.py it imported had moved).
HYDRA_GROUPS = ["== Configuration groups ==", "model: ", "partition: ", "topology: "]
ENTRY_POINTS = {  # name: (arguments after python, what the help must contain)
    "train": (
        ["-m", "pipedream2bw.train", "--help"],
        ["usage: torchrun --nproc-per-node N -m pipedream2bw.train", *HYDRA_GROUPS],
    ),
    "sweep": (["-m", "pipedream2bw.sweep", "--help"], ["usage: python -m pipedream2bw.sweep -m", *HYDRA_GROUPS]),
    "partitioner": (["-m", "partitioner", "--help"], ["usage: python -m partitioner plan", "commands:"]),
    "partitioner plan": (["-m", "partitioner", "plan", "--help"], ["usage: python -m partitioner plan", *HYDRA_GROUPS]),
    **{
        f"scripts/{p.name}": ([str(p), "--help"], [f"usage: {p.name} "])
        for p in sorted((ROOT / "scripts").glob("*.py"))
    },
}


@pytest.mark.slow
@pytest.mark.long
def test_every_entry_point_answers_help(tmp_path):
    # All at once, each in its own interpreter (imports dominate: ~1-2.5 s each, ~12 s one after another).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs = {
        name: subprocess.Popen(
            [sys.executable, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, (args, _) in ENTRY_POINTS.items()
    }
    failures = []
    try:
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=600)  # a hang, not a slow machine (120 s failed under load)
            expected = ENTRY_POINTS[name][1]
            missing = [s for s in expected if s not in out]
            if proc.returncode != 0 or "Traceback" in out or missing:
                failures.append(f"{name}: rc {proc.returncode}, missing {missing}:\n{out[-2000:]}")
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    assert not failures, "\n\n".join(failures)
    assert len(procs) >= 11  # 4 module entry points and every script
    assert not list(tmp_path.iterdir())  # --help runs nothing: no outputs/ or plan file


def test_config_error_imports_without_torch():
    # ConfigError's module must stay torch-free: tools that only raise or catch it need not load torch.
    code = "import sys; from pipedream2bw.errors import ConfigError; assert 'torch' not in sys.modules, 'torch'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    from pipedream2bw.config import ConfigError as reexported
    from pipedream2bw.errors import ConfigError

    assert reexported is ConfigError and issubclass(ConfigError, ValueError)


def test_help_lists_user_facing_groups_and_every_key_with_a_meaning():
    # Regression: --help listed the schemas (base_gpt, ...) as config groups, the config as bare YAML with
    # no meanings, and a removed key (partition.analytic_dtype_bytes).
    from pipedream2bw.config.docs import help_text, keys

    text = help_text([], config_name="config")
    assert "base_" not in text and "analytic_dtype_bytes" not in text
    [models] = [ln for ln in text.splitlines() if ln.startswith("model: ")]
    assert {"custom", "gpt", "gpt175b", "hf_gpt2"} <= set(models[len("model: ") :].split(", ")), models
    for _, _, rows in keys():
        for k in rows:
            lines = [
                ln for ln in text.splitlines() if ln.startswith(f"  {k.name}=")
            ]  # a key's own line, not a wrapped one
            assert lines and all(len(ln.split(maxsplit=1)[1]) > 5 for ln in lines), (k, lines)  # with a meaning
    assert "  pipeline.schedule=2bw  " in text and "  wandb.mode=offline  " in text  # composed defaults
    assert "  train.num_steps=7  " in help_text(["train.num_steps=7"], config_name="config")  # after overrides
    assert "outputs/sweeps/<date>/<time>/" in help_text([], config_name="sweep")


def test_a_refused_launch_removes_a_run_directory_holding_only_its_log(tmp_path):
    from pipedream2bw.train import _remove_if_only_log

    refused, kept = tmp_path / "outputs" / "2026-11-25" / "10-00-00", tmp_path / "outputs" / "2026-11-25" / "09-00-00"
    for d in (refused, kept):
        d.mkdir(parents=True)
        (d / "train.log").write_text("bad configuration: ...\n")
    (kept / "checkpoints").mkdir()  # an earlier run's directory, relaunched and refused: kept whole
    (refused / ".lock").write_text("host h, pid 1\n")  # issue 43: a refused resume had taken the lock: left behind
    _remove_if_only_log(refused)
    _remove_if_only_log(kept)
    assert not refused.exists() and (kept / "train.log").is_file()
    _remove_if_only_log(refused.parent / "nothing")  # absent: nothing to do
    (kept / "checkpoints").rmdir()
    _remove_if_only_log(kept)
    assert not (tmp_path / "outputs" / "2026-11-25").exists()  # the date folder went with its last run


def test_help_wraps_each_meaning_whole_instead_of_cutting_it():
    # Regression (issue 35): --help cut 41 meanings at 100 characters with " ...".
    from pipedream2bw.config.docs import HELP_WIDTH, help_text

    lines = help_text([], config_name="config").splitlines()
    assert not [line for line in lines if line.endswith("...")]
    assert max(len(line) for line in lines) <= HELP_WIDTH
    text = " ".join(line.strip() for line in lines)
    assert "null keeps a stage's replicas on one node when they fit." in text
