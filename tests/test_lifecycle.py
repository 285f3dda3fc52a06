"""Runs that cannot be hijacked or lost (issue 22): no pickle on resume, pruning that keeps to its own
lineage, no silent restart from zero, strict keys and resumes, preemption that checkpoints."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from dist_helper import children, cli_config, run_ok, spawn, train, train_cli
from hydra import compose, initialize_config_dir
from test_checkpoint import TINY_TORCHRUN_OVERRIDES, assert_equal_bits, config, weights
from test_semantics import tiny_config

from pipedream2bw.config import ConfigError, from_hydra, register_configs
from pipedream2bw.io import checkpoint, fileio
from pipedream2bw.pipeline.comm import free_port, torchrun_command
from pipedream2bw.run import preempt
from pipedream2bw.run.runner import run

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


# --- no pickle on resume ----------------------------------------------------------------------------


class _Payload:
    """Unpickled, it creates ``marker``: what a hijacked checkpoint would do instead."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _plant(ckpt: Path, name: str, marker: Path) -> None:
    """Puts a payload into file ``name`` of checkpoint ``ckpt`` beside its content, and its checksum into the
    manifest: whoever can write the file can write the manifest too."""
    file = ckpt / name
    content = torch.load(file, weights_only=False)
    torch.save({**content, "payload": _Payload(marker)}, file)
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    manifest["files"][name] = hashlib.sha256(file.read_bytes()).hexdigest()
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.slow
def test_planted_pickle_in_any_file_a_resume_reads_never_runs(tmp_path):
    # Regression (issue 22): rng_rank<r>.pt was loaded with weights_only=False; a payload in it ran on resume.
    run_ok(config(steps=2, every=2), tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    marker = tmp_path / "hijacked"
    for rank in range(2):
        _plant(ckpt, f"rng_rank{rank}.pt", marker)
    resumed = run_ok(config(steps=4, every=2), tmp_path / "run")  # the RNG files are ignored, with a warning
    assert not marker.exists()
    assert resumed["first_step"] == 2
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "RNG states not restored: rng_rank0.pt holds more than tensors and plain values" in log, log

    for name in [n for n in json.loads((ckpt / checkpoint.MANIFEST).read_text())["files"] if n.startswith("layer_")]:
        _plant(ckpt, name, marker)
    with pytest.raises(checkpoint.NoLoadableCheckpoint, match="layer_00000.pt holds more than tensors and plain"):
        checkpoint.select(ckpt)
    assert checkpoint.load_rng(ckpt, 0) is None
    assert not marker.exists()


def test_rng_states_are_plain_tensors_and_restore_exactly():
    import random

    import numpy as np

    state = checkpoint.rng_state()
    a = (torch.rand(3), random.random(), np.random.rand(2))
    buf = Path(os.environ.get("TMPDIR", "/tmp")) / f"rng-{os.getpid()}.pt"
    torch.save(state, buf)
    checkpoint.set_rng_state(torch.load(buf, weights_only=True))
    buf.unlink()
    b = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2])


# --- pruning keeps to its lineage ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.long  # 11 to 15 s loaded: run with the long ones to keep the suite under 10 min
def test_resume_never_keeps_its_own_checkpoints_beside_an_older_runs_later_ones(tmp_path):
    # Regression (issue 22): pruning sorted by step over both runs, so the new run's checkpoints were
    # removed as soon as written and a later resume=auto picked the old run's step.
    run_dir, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    run_ok(config(steps=10, every=5), run_dir)  # the older run: steps 5 and 10
    # what a prune killed half-way left under earlier versions and this one: never a checkpoint, removed at start
    (root / "step_00000007").mkdir()
    (root / "step_00000007" / checkpoint.layer_file(0)).write_bytes(b"half deleted")
    (root / ".step_00000003.0a1b2c3d.trash").mkdir()
    run_ok(config(steps=4, every=2, resume="never"), run_dir)  # keep_checkpoints=2: its 2 and 4
    steps = {p.name: checkpoint.lineage_of(p) for p in checkpoint.complete_checkpoints(root)}
    assert sorted(steps) == ["step_00000002", "step_00000004", "step_00000005", "step_00000010"], steps
    assert steps["step_00000002"] == steps["step_00000004"] != steps["step_00000005"] == steps["step_00000010"]
    assert not (root / "step_00000007").exists() and not list(root.glob("*.trash"))
    resumed = run_ok(config(steps=6, every=2), run_dir)  # auto: the latest lineage's newest, not step 10
    assert resumed["first_step"] == 4 and resumed["resumed_from"].endswith("step_00000004")
    names = sorted(p.name for p in checkpoint.complete_checkpoints(root))
    assert names == ["step_00000004", "step_00000005", "step_00000006", "step_00000010"], names


def test_prune_renames_before_it_deletes(tmp_path, monkeypatch):
    """A kill during a prune leaves a .trash directory (removed at the next start), never a step_* one."""
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        d = checkpoint.step_dir(root, step)
        d.mkdir(parents=True)
        (d / checkpoint.MANIFEST).write_text(json.dumps({"lineage": "L", "written_at": step}))
    killed = []
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda p, **kw: killed.append(Path(p)))  # dies before deleting
    assert [p.name for p in checkpoint.prune(root, lineage="L", keep=1, newest=checkpoint.step_dir(root, 3))] == [
        "step_00000002",
        "step_00000001",
    ]
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == ["step_00000003"]
    assert all(p.name.endswith(".trash") for p in killed) and len(killed) == 2
    monkeypatch.undo()
    assert len(checkpoint.clean_leftovers(root)) == 2 and sorted(p.name for p in root.iterdir()) == ["step_00000003"]


# --- no silent restart from zero ------------------------------------------------------------------------


@pytest.mark.slow
def test_all_checkpoints_unloadable_refuses_under_auto(tmp_path):
    # Regression (issue 22): each was logged and renamed aside, then the run started again at step 0 and exited 0.
    run_ok(config(steps=4, every=2), tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    for step in (2, 4):
        victim = checkpoint.step_dir(root, step) / checkpoint.layer_file(1)
        victim.write_bytes(victim.read_bytes()[:-100])
    for attempt in range(2):  # a relaunch (torchrun --max-restarts) is refused again: nothing was renamed
        results = spawn(
            train,
            world_size=2,
            args=(config(steps=6, every=2), str(tmp_path / "run")),
            log_dir=tmp_path / f"l{attempt}",
        )
        for r in results:
            assert r.exitcode != 0 and "none of the 2 checkpoint(s) at" in r.log, r.log
            assert "step_00000004: layer_00001.pt does not match its checksum" in r.log
            assert "train.resume=never" in r.log and "train.resume=<path>" in r.log
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == ["step_00000004", "step_00000002"]
    assert (
        not (tmp_path / "run" / "summary.json").exists()
        or json.loads((tmp_path / "run" / "summary.json").read_text())["num_steps"] == 4
    )  # the first run's


# --- strict keys ------------------------------------------------------------------------------------------


def _compose(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(
    "override,error",
    [
        ("+train.num_step=5", r"train.num_step \(did you mean train.num_steps\?\)"),
        ("+model.num_head=2", r"model.num_head \(did you mean model.num_heads\?\)"),
        ("+pipeline.balanse=[1,2]", r"pipeline.balanse \(did you mean pipeline.balance\?\)"),
        ("+optim.foo=1", r"optim.foo \(optim. has name, lr"),
    ],
)
def test_unknown_key_added_with_plus_is_refused_naming_the_closest(override, error):
    # Regression (issue 22): OmegaConf.to_object dropped keys the schema does not have; the run ignored them.
    with pytest.raises(ConfigError, match=error):
        from_hydra(_compose(override))


def test_free_form_entries_take_any_key():
    cfg = from_hydra(_compose("model=custom", "model._target_=a.b", "+model.width=3", "+optim.kwargs.momentum=0.9"))
    assert cfg.model.kwargs == {"width": 3} and cfg.optim.kwargs == {"momentum": 0.9}


@pytest.mark.slow
def test_refused_launch_exits_2_before_any_group_and_keeps_the_run_directorys_record(tmp_path):
    # Regressions (issue 22): +train.num_step=5 was accepted and ignored; Hydra wrote .hydra/ before the run
    # was checked, so a refused relaunch overwrote the record of the run directory it was pointed at.
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("the original run's record\n")
    runs = [
        ["+train.num_step=5", "wandb.mode=disabled", f"hydra.run.dir={run_dir}"],
        ["pipeline.num_stages=2", "wandb.mode=disabled", f"hydra.run.dir={run_dir}"],  # 1 rank for 2 stages
    ]
    results = spawn(train_cli, world_size=1, args=(runs,), log_dir=tmp_path / "logs", timeout_s=240)
    log = results[0].log
    assert log.count("EXIT 2") == 2 and "process group was started" not in log, log
    assert "unknown config key: train.num_step (did you mean train.num_steps?)" in log, log
    assert (run_dir / ".hydra" / "config.yaml").read_text() == "the original run's record\n"


# --- strict resume ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_with_another_head_count_is_refused_unless_not_strict(tmp_path):
    # Regression (issue 22): same shapes, another model: the manifest stored no model settings.
    run_ok(config(steps=2, every=2), tmp_path / "src")
    other = config(steps=4, resume=str(tmp_path / "src"))
    other.model.num_heads = 4  # d_model 32: 4 heads of 8 instead of 2 of 16, every shape the same
    other.optim.lr *= 2
    results = spawn(train, world_size=2, args=(other, str(tmp_path / "dst")), log_dir=tmp_path / "logs", timeout_s=240)
    for r in results:
        assert r.exitcode != 0 and "was written with other settings" in r.log, r.log
        assert (
            "model.num_heads: checkpoint 2, this run 4" in r.log and "optim.lr: checkpoint 0.2, this run 0.4" in r.log
        )
        assert "train.resume_strict=false" in r.log
    other.train.resume_strict = False
    summary = run_ok(other, tmp_path / "dst")
    assert summary["first_step"] == 2
    log = (tmp_path / "dst" / "logs" / "rank0.log").read_text()
    assert "train.resume_strict=false: resuming from" in log and "model.num_heads: checkpoint 2, this run 4" in log


# --- smaller items ------------------------------------------------------------------------------------------


def test_plan_file_values_of_the_wrong_type_are_named():
    # Regression (issue 22): an edited plan gave a raw TypeError or a message saying 2 != 2.
    from partitioner.planner import Plan, plan_from_text, plan_to_text

    plan = Plan(
        schedule="2bw",
        num_stages=2,
        data_parallel=1,
        microbatch_size=2,
        num_microbatches=2,
        global_batch_size=4,
        balance=[3, 3],
        rank_map=[[0], [1]],
        recompute=False,
        swap_stages=[],
        objective="throughput",
        topology="cpu",
        devices=2,
        memory_per_device_bytes=2**30,
        costs="analytic",
        predicted_batch_time_s=1.0,
        predicted_samples_per_s=4.0,
        predicted_stage_time_s=[0.1, 0.1],
        predicted_peak_memory_bytes=[1, 1],
    )
    text = plan_to_text(plan)
    assert plan_from_text(text) == plan
    with pytest.raises(ConfigError, match=r"plan: balance \('abc'\) must be a list of integers"):
        plan_from_text(text.replace("balance: [3, 3]", "balance: abc"))
    with pytest.raises(ConfigError, match=r"plan: num_stages \('2'\) must be an integer"):
        plan_from_text(text.replace("num_stages: 2", "num_stages: '2'"))


def test_malformed_token_sidecar_names_the_file(tmp_path):
    import numpy as np

    from pipedream2bw.config import DataConfig
    from pipedream2bw.data import check_data

    path = tmp_path / "tokens.bin"
    path.write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    Path(str(path) + ".json").write_text("{ not json")
    with pytest.raises(
        ConfigError, match=rf"{tmp_path}/tokens.bin.json \(the description of .*tokens.bin\) cannot be read"
    ):
        check_data(DataConfig(path=str(path)), vocab_size=256, seq_len=8, need_val=False)


def test_full_disk_error_names_the_file(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fileio.os, "fsync", full)
    with pytest.raises(OSError, match=rf"No space left on device \(writing {tmp_path}/summary.json\)"):
        fileio.atomic_write_json(tmp_path / "summary.json", {"x": 1})
    assert list(tmp_path.iterdir()) == []  # no temporary file left either


def test_auto_partition_checks_warmup_before_it_profiles(tmp_path, monkeypatch):
    import partitioner.auto

    def never(*args, **kwargs):
        raise AssertionError("profiled and planned before rejecting the config")

    monkeypatch.setattr(partitioner.auto, "plan_config", never)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    cfg = tiny_config(schedule="2bw", num_stages=1, num_microbatches=2)
    cfg.partition.mode, cfg.train.warmup_steps = "auto", cfg.train.num_steps
    with pytest.raises(ConfigError, match=r"train.warmup_steps \(6\) must be in \[0, train.num_steps \(6\)\)"):
        run(cfg, tmp_path / "run")


# --- preemption ---------------------------------------------------------------------------------------------

PREEMPT_OVERRIDES = [
    *TINY_TORCHRUN_OVERRIDES,
    "train.num_steps=200",
    "train.checkpoint_every=40",
    "train.log_every=1000",
]


@pytest.fixture
def launches():
    """Starts torchrun in its own session; kills what is left of each (its workers too) at teardown."""
    procs = []

    def launch(run_dir: Path, log: Path) -> subprocess.Popen:
        cmd = [*torchrun_command(2), "-m", "pipedream2bw.train", *PREEMPT_OVERRIDES, f"hydra.run.dir={run_dir}"]
        proc = subprocess.Popen(
            cmd, cwd=run_dir.parent, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        procs.append(proc)
        return proc

    yield launch
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the session's process group: torchrun and its workers
        except ProcessLookupError:
            pass
        proc.wait()


def _preempt_at(proc: subprocess.Popen, run_dir: Path, log: Path, *, after: int, send) -> None:
    """Once checkpoint ``after`` exists, ``send``s the signal; waits (minutes at most) until every process is gone."""
    deadline = time.monotonic() + 180
    while not checkpoint.step_dir(run_dir / "checkpoints", after).is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    workers = children(proc.pid)
    assert len(workers) == 2
    send(proc)
    proc.wait(timeout=240)  # minutes: a hang (a stop waiting for the 300 s dist timeout), not a slow machine
    for pid in workers:  # not even a zombie: torchrun reaped them
        assert not Path(f"/proc/{pid}").exists(), pid


@pytest.mark.slow
@pytest.mark.long
def test_sigterm_checkpoints_every_rank_at_one_step_and_the_requeued_run_is_bit_exact(tmp_path, launches):
    # Regression (issue 22): SIGTERM killed the ranks with no checkpoint, summary or log line.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = tmp_path / "launch1.log"
    # torchrun forwards the signal to its workers ...
    _preempt_at(launches(run_dir, log), run_dir, log, after=40, send=lambda p: p.send_signal(signal.SIGTERM))
    summary = json.loads((run_dir / "summary.json").read_text())
    first = summary["preempted"]["step"]
    assert summary["status"] == "preempted" and summary["preempted"]["signal"] == "SIGTERM" and first > 40, summary
    assert len(summary["losses"]) == first and summary["preempted"]["exit_code"] == 143
    manifest = json.loads((checkpoint.step_dir(run_dir / "checkpoints", first) / checkpoint.MANIFEST).read_text())
    assert manifest["step"] == first and manifest["preempted"] == "SIGTERM"
    text = log.read_text()
    assert f"preempted by SIGTERM: every rank stopped after step {first} of 200" in text, text
    assert "exiting with 143" in text and not (run_dir / "final_model.pt").exists()

    # ... one rank alone gets it (the others must still stop at the same step: the flags are summed) ...
    previous = first
    for launch, send in (
        (2, lambda p: os.kill(max(children(p.pid)), signal.SIGTERM)),
        (3, lambda p: os.killpg(p.pid, signal.SIGTERM)),  # ... and srun signals every process at once
    ):
        log = tmp_path / f"launch{launch}.log"
        proc = launches(run_dir, log)
        _preempt_at(proc, run_dir, log, after=previous + 40 - previous % 40, send=send)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["first_step"] == previous and summary["preempted"]["step"] > previous, summary
        assert f"resuming from {run_dir}/checkpoints/step_{previous:08d}" in log.read_text()
        for rank in range(2):
            assert f"[stage {rank}/rank {rank}] exiting with 143: preempted by SIGTERM" in log.read_text()
        previous = summary["preempted"]["step"]
    second = previous

    log = tmp_path / "launch4.log"
    proc = launches(run_dir, log)
    assert proc.wait(timeout=180) == 0, log.read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["first_step"] == second

    expected = run_ok(cli_config(*PREEMPT_OVERRIDES), tmp_path / "uninterrupted", timeout_s=240)
    assert summary["losses"] == expected["losses"]
    assert_equal_bits(weights(run_dir), weights(tmp_path / "uninterrupted"))


def test_one_process_decides_alone_after_the_step_it_got_the_signal():
    # One process needs no agreement: the gloo all-reduce of the flag cost 1-2 ms a step (issue 26).
    watch = preempt.Watch(["SIGTERM"])  # not entered: no handler installed, the flag is set by hand
    agreement = preempt.Agreement(watch, None, last_step=9)
    assert not agreement.after_step(0) and not agreement.after_step(1)
    watch.received = int(signal.SIGTERM)
    assert agreement.after_step(2) and agreement.signum == signal.SIGTERM


def _signal_self_after(cfg, run_dir: str, step: int, signum: int = signal.SIGTERM) -> None:
    """One rank: sends itself ``signum`` once checkpoint ``step`` exists; the run must stop, checkpointed."""
    run_dir = Path(run_dir)

    def kill() -> None:
        while not checkpoint.step_dir(run_dir / "checkpoints", step).is_dir():
            time.sleep(0.002)
        os.kill(os.getpid(), signum)

    threading.Thread(target=kill, daemon=True).start()
    try:
        run(cfg, run_dir)
    except preempt.Preempted as e:
        assert e.exit_code == 128 + signum
        return
    raise AssertionError("the run was not preempted")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_one_process_run_stops_on_sigterm_or_ctrl_c_with_a_checkpoint(tmp_path, signum):
    # Regression (issue 35): Ctrl-C (SIGINT) printed a traceback and exited 1, with no checkpoint and no summary.
    cfg = tiny_config(schedule="2bw", num_stages=1, num_microbatches=2, num_steps=400)
    cfg.train.checkpoint_every = 4
    assert cfg.train.preempt_signals == ["SIGTERM", "SIGINT"]  # the default
    results = spawn(
        _signal_self_after, world_size=1, args=(cfg, str(tmp_path / "run"), 4, signum), log_dir=tmp_path / "logs"
    )
    assert results[0].exitcode == 0, results[0].log
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    stopped = summary["preempted"]["step"]
    assert summary["status"] == "preempted" and 4 < stopped < 400, summary
    assert checkpoint.step_dir(tmp_path / "run" / "checkpoints", stopped).is_dir()


def test_a_second_ctrl_c_exits_at_once_and_the_same_ctrl_c_twice_does_not(tmp_path):
    # The terminal sends Ctrl-C to torchrun and its workers, and torchrun passes its own on: a worker gets two
    # SIGINTs at once, which must not abort the checkpoint; a second Ctrl-C later must not wait for it.
    script = """
import os, signal, sys, time
from pipedream2bw.run import preempt
preempt.AGAIN_AFTER_S = 0.2
with preempt.Watch(["SIGTERM", "SIGINT"]) as watch:
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C, passed on by torchrun
    time.sleep(0.05)
    print("noted", watch.received, flush=True)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again
    time.sleep(5)
print("not reached", flush=True)
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 130 and proc.stdout.split() == ["noted", str(int(signal.SIGINT))], proc
    assert proc.stderr.strip() == "interrupted again: exiting at once, without a checkpoint of the last steps"
