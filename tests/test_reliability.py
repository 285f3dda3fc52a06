"""The reliability promises at their edges (issue 34): a run directory in use, links planted in it, mixed
preemption signals, rank 0's memory over a long run."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
from pathlib import Path

import pytest
import torch
from dist_helper import spawn, train_cli
from test_semantics import tiny_config

from pipedream2bw.config import ConfigError
from pipedream2bw.io import checkpoint, rundir
from pipedream2bw.pipeline.comm import free_port
from pipedream2bw.run import preempt
from pipedream2bw.run.runner import run


@pytest.fixture
def one_rank(monkeypatch):
    """A one-process ``run()`` in this process (its store on a free port)."""
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    cfg = tiny_config(schedule="2bw", num_stages=1, num_microbatches=2, num_steps=2)
    cfg.train.resume = "auto"
    return cfg


def _leftovers(root: Path) -> list:
    """What start-up clean-up deletes in a checkpoints directory: a prune's trash, a step without a manifest."""
    made = [root / ".step_00000003.0badc0de.trash", root / "step_00000099"]
    for d in made:
        d.mkdir(parents=True)
        (d / "layer_00000.pt").write_bytes(b"x")
    return made


# --- a run directory in use --------------------------------------------------------------------------------


def test_second_run_in_a_live_run_directory_is_refused_before_it_touches_it(tmp_path, one_rank):
    # Issue 34: a second run in a directory a live run was writing broke the first one's checkpoint write, and
    # with resume=auto resumed from it, deleted its checkpoint in progress and replaced its metrics.jsonl
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    live = rundir.RunLock()
    live.acquire(run_dir)  # the live run (this process: flock locks are per open file, so it conflicts all the same)
    try:
        kept = _leftovers(run_dir / "checkpoints")
        with pytest.raises(rundir.RunDirInUse, match=rf"run directory {run_dir} is in use by a live run \(host "):
            run(one_rank, run_dir)
        assert f"pid {os.getpid()}" in (run_dir / rundir.LOCK).read_text()
        assert all(d.exists() for d in kept)  # untouched: the live run's own
        assert not (run_dir / "summary.json").exists()
    finally:
        live.release()


def test_lock_of_a_run_that_ended_is_taken_over(tmp_path):
    # flock: the kernel drops a lock with its descriptor (its process), so a dead run's lock file holds no one
    (tmp_path / rundir.LOCK).write_text("host elsewhere, pid 1, since 2026-01-01 00:00:00 UTC\n")
    with rundir.RunLock() as first:
        first.acquire(tmp_path)
        assert (tmp_path / rundir.LOCK).read_text().startswith(f"host {socket.gethostname()}, pid {os.getpid()},")
    with rundir.RunLock() as second:
        second.acquire(tmp_path)  # released by the first's context: no refusal


def test_resume_from_inside_a_live_run_directory_is_refused(tmp_path, one_rank):
    # Issue 34: train.resume=PATH into a run directory a live run was writing was read without its lock: the live
    # run's pruning could delete the checkpoint being read
    live_dir = tmp_path / "live"
    source = live_dir / "checkpoints" / "step_00000002"
    source.mkdir(parents=True)
    one_rank.train.resume = str(source)
    with rundir.RunLock() as live:
        live.acquire(live_dir)
        with pytest.raises(
            rundir.RunDirInUse, match=rf"train.resume \({source}\) is inside run directory {live_dir}, "
        ):
            run(one_rank, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"holds no complete checkpoint"):  # the live run ended: read as usual
        run(one_rank, tmp_path / "run")


# --- links inside the run directory ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["checkpoints", "train.log", "metrics.jsonl"])
def test_link_planted_in_a_run_directory_is_refused_and_nothing_behind_it_is_deleted(tmp_path, one_rank, name):
    # Issue 34: a planted `checkpoints` link sent checkpoints outside the run directory, and start-up clean-up
    # deleted the target's step_00000099/ and .step_*.trash/; train.log and metrics.jsonl were appended through
    outside = tmp_path / "outside"
    kept = _leftovers(outside)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).symlink_to(outside)
    with pytest.raises(ConfigError, match=rf"{run_dir / name} is a symbolic link \(to {outside}\)"):
        run(one_rank, run_dir)
    assert all(d.exists() for d in kept)
    assert sorted(p.name for p in outside.iterdir()) == sorted(d.name for d in kept)


def test_partial_checkpoint_link_is_refused(tmp_path, one_rank):
    # a planted .partial link would have a checkpoint written outside the run directory
    outside = tmp_path / "outside"
    outside.mkdir()
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / ".step_00000002.partial").symlink_to(outside)
    with pytest.raises(ConfigError, match=r"\.step_00000002\.partial is a symbolic link"):
        run(one_rank, run_dir)
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("name", ["../../outside.bin", "/etc/hostname", "..", "a/../../b"])
def test_manifest_naming_a_file_outside_its_checkpoint_is_refused(tmp_path, name):
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (tmp_path / "outside.bin").write_bytes(b"secret")
    manifest = {"format": checkpoint.FORMAT, "step": 2, "files": {name: "0" * 64}}
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    got, why = checkpoint.verify(ckpt)
    assert got is None and why == f"its manifest names a file outside it ({name!r})"


def test_manifest_file_that_is_a_link_is_refused(tmp_path):
    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    (tmp_path / "outside.bin").write_bytes(b"secret")
    (ckpt / "layer_00000.pt").symlink_to(tmp_path / "outside.bin")
    sha = checkpoint._sha256(tmp_path / "outside.bin")
    (ckpt / checkpoint.MANIFEST).write_text(
        json.dumps({"format": checkpoint.FORMAT, "step": 2, "files": {"layer_00000.pt": sha}})
    )
    got, why = checkpoint.verify(ckpt)
    assert got is None and why.startswith("layer_00000.pt is a symbolic link"), why


# --- mixed preemption signals -----------------------------------------------------------------------------------


class _Sum:
    """What ``comm.AsyncSum`` does for ranks in one process: each ``start``s its share, ``wait`` gives the sum."""

    def __init__(self, num_ranks: int):
        self.num_ranks, self.shares = num_ranks, []

    def start(self, tensor, *, what: str) -> None:
        self.shares.append(tensor.clone())

    def wait(self):
        assert len(self.shares) >= self.num_ranks
        return sum(self.shares[: self.num_ranks])


@pytest.mark.parametrize(
    "got,expected",
    [
        (["SIGTERM", "SIGUSR1"], "SIGUSR1"),  # one each: the lowest number
        (["SIGTERM", "SIGUSR1", "SIGTERM"], "SIGTERM"),  # the one most ranks got
        (["SIGTERM", None, None], "SIGTERM"),
    ],
)
def test_ranks_with_different_signals_agree_on_one_that_was_sent(got, expected):
    # Issue 34: the agreement averaged the signals' numbers: SIGTERM (15) on one rank and SIGUSR1 (10) on
    # another stopped the run "preempted by SIGUSR2" with exit 140, a signal nobody sent
    channel = _Sum(len(got))
    agreements = []
    for name in got:
        watch = preempt.Watch(["SIGTERM", "SIGUSR1", "SIGUSR2"])  # not entered: the flag is set by hand
        watch.received = None if name is None else int(signal.Signals[name])
        agreements.append(preempt.Agreement(watch, channel, last_step=9))
    assert not any(a.after_step(0) for a in agreements)  # each starts its flag of step 0
    assert all(a.after_step(1) for a in agreements)  # and reads the sum after step 1: all stop
    assert {signal.Signals(a.signum).name for a in agreements} == {expected}
    counts = {n: got.count(n) for n in sorted(set(got) - {None})}
    assert (
        preempt.Preempted(2, agreements[0].signum, agreements[0].received).exit_code == 128 + signal.Signals[expected]
    )
    assert all(a.received == counts for a in agreements)


# --- rank 0's memory over a long run ---------------------------------------------------------------------


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads RSS from /proc")
@pytest.mark.long  # many redraws (6.5 s quiet): with the long ones, to keep the suite under 10 minutes
def test_redrawing_the_loss_plot_keeps_memory_flat(tmp_path):
    # Issue 34: rank 0 redraws loss.png at every checkpoint and validation pass; each figure (reference cycles
    # holding its canvas's pixels) waited for a later garbage collection: 6,000 points x 40 redraws grew RSS
    # from 256 to 357 MiB here. Now each is freed at once, whatever the run's length.
    import random

    from pipedream2bw.io.tracking import plot_losses

    losses = [5 + random.random() for _ in range(500)]
    val = [(s, 4.0) for s in range(50, 500, 50)]
    plot_losses(losses, val, tmp_path / "loss.png")  # imports and caches, once
    before = _rss_mib()
    for _ in range(6):
        plot_losses(losses, val, tmp_path / "loss.png")
    assert _rss_mib() - before < 5  # today: +0.0 MiB; before the fix: +11 MiB


def test_plot_draws_a_bounded_number_of_points_that_keep_the_mean():
    from pipedream2bw.io.tracking import PLOT_POINTS, downsample

    assert downsample([3.0, 1.0]) == ([1.0, 2.0], [3.0, 1.0])
    losses = [float(t % 7) for t in range(10 * PLOT_POINTS + 3)]
    steps, values = downsample(losses)
    assert len(steps) == len(values) == PLOT_POINTS
    assert steps[0] > 1 and steps[-1] < len(losses) and steps == sorted(steps)
    assert abs(sum(values) / len(values) - sum(losses) / len(losses)) < 0.01


# --- bad numbers are refused before anything is built ----------------------------------------------------------


def _numeric_keys() -> list:
    from pipedream2bw.config import Config, HFModelConfig, LayerListConfig
    from pipedream2bw.config.ranges import numeric_fields

    keys = {k for k, _ in numeric_fields(Config())}
    for model in (HFModelConfig(), LayerListConfig(target="x.y")):
        keys |= {k for k, _ in numeric_fields(Config(model=model))}
    return sorted(keys)


def _set(cfg, key: str, value) -> None:
    *path, name = key.split(".")
    node = cfg
    for part in path:
        node = getattr(node, part)
    setattr(node, name, value)


def test_every_numeric_field_has_a_range():
    from pipedream2bw.config.ranges import RANGES

    assert [k for k in _numeric_keys() if k not in RANGES and not k.startswith("topology.")] == []


def _fuzz_cases():
    import hypothesis.strategies as st

    bad = st.one_of(
        st.floats(max_value=-1e-9, allow_nan=False),
        st.integers(max_value=-1),
        st.sampled_from([math.nan, math.inf, -math.inf]),
    )
    return st.tuples(st.sampled_from(_numeric_keys()), bad)


def test_numeric_fields_refuse_negative_nan_inf_naming_the_key():
    # Issue 34: model.d_model=-32 died building a tensor, dist.timeout_s=nan converting NaN to an integer,
    # both after the process groups started. hypothesis draws a field and a value no field accepts.
    from hypothesis import given, settings

    from pipedream2bw.config import Config, HFModelConfig
    from pipedream2bw.config.ranges import check_ranges

    @settings(max_examples=100, deadline=None, derandomize=True)
    @given(_fuzz_cases())
    def refused(case):
        key, value = case
        cfg = Config(model=HFModelConfig()) if key == "model.dropout" else Config()
        _set(cfg, key, value)
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)} \({re.escape(str(value))}\) must be "):
            check_ranges(cfg)

    refused()


def test_zero_and_huge_sizes_are_refused_and_the_defaults_accepted():
    from pipedream2bw.config import Config, HFModelConfig
    from pipedream2bw.config.ranges import AT_LEAST_1, BIG, POSITIVE, RANGES, check_ranges

    check_ranges(Config())
    check_ranges(Config(model=HFModelConfig()))
    for key in [k for k in _numeric_keys() if RANGES.get(k, POSITIVE) in (AT_LEAST_1, POSITIVE)]:
        cfg = Config(model=HFModelConfig()) if key == "model.dropout" else Config()
        _set(cfg, key, 0)
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)} \(0\) must be "):
            check_ranges(cfg)
    for key in [k for k in _numeric_keys() if RANGES.get(k) == AT_LEAST_1]:
        cfg = Config()
        _set(cfg, key, BIG + 1)
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)} \({BIG + 1}\) must be >= 1 and <= {BIG}"):
            check_ranges(cfg)
    cfg = Config()
    cfg.data.val_fraction = 1.0
    with pytest.raises(ConfigError, match=r"data.val_fraction \(1.0\) must be >= 0 and < 1"):
        check_ranges(cfg)


@pytest.mark.parametrize("key,value", [("model.d_model", -32), ("model.d_model", 0), ("dist.timeout_s", math.nan)])
def test_run_refuses_a_bad_number_before_it_builds_anything(tmp_path, one_rank, key, value):
    _set(one_rank, key, value)
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} \({value}\) must be "):
        run(one_rank, tmp_path / "run")


# --- a resume that changes what it should not ----------------------------------------------------------------


@pytest.mark.slow  # two short runs in this process
def test_resume_with_another_seed_or_other_data_is_refused_naming_it(tmp_path, one_rank):
    # Issue 34: seed=4 on resume and a token file replaced between save and resume were accepted without a word
    corpus, held_out = tmp_path / "corpus.txt", tmp_path / "held_out.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    held_out.write_text("sphinx of black quartz, judge my vow. " * 10)
    one_rank.data.path, one_rank.data.val_path, one_rank.train.checkpoint_every = str(corpus), str(held_out), 2
    run(one_rank, tmp_path / "run")
    one_rank.train.num_steps, one_rank.seed = 4, 4
    with pytest.raises(ConfigError, match=r"other settings \(seed: checkpoint 3, this run 4\)"):
        run(one_rank, tmp_path / "run")
    one_rank.seed = 3
    corpus.write_text("pack my box with five dozen liquor jugs. " * 40)
    with pytest.raises(ConfigError, match=r"other settings \(data.path: checkpoint 'corpus.txt, 1800 bytes, sha256"):
        run(one_rank, tmp_path / "run")
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    held_out.write_text("how vexingly quick daft zebras jump! " * 10)  # the held-out data: validation losses differ
    with pytest.raises(ConfigError, match=r"other settings \(data.val_path: checkpoint 'held_out.txt, 380 bytes"):
        run(one_rank, tmp_path / "run")


# --- one exit code for bad input ----------------------------------------------------------------------------


@pytest.mark.slow
def test_hydras_own_refusals_and_a_bad_signal_name_exit_2(tmp_path):
    # Issue 34: Hydra's refusals (a value of the wrong type, a key typo without +, an output directory it cannot
    # create) and a bad train.preempt_signals exited 1, where bad input exits 2 (docs/checkpoints.md)
    common = ["wandb.mode=disabled", "pipeline.num_stages=1", f"hydra.run.dir={tmp_path / 'run'}"]
    runs = [["train.num_steps=abc", *common], ["train.preempt_signals=[SIGFOO]", *common]]
    results = spawn(train_cli, world_size=1, args=(runs,), log_dir=tmp_path / "logs", timeout_s=240)
    log = results[0].log
    assert log.count("EXIT 2") == 2 and "process group was started" not in log, log
    assert "'SIGFOO' is not a signal that can be caught here" in log, log


# --- an optimizer whose state no longer fits its settings ------------------------------------------------------


@pytest.mark.slow  # three short runs in this process
def test_optimizer_state_that_no_longer_fits_its_settings_starts_afresh_with_a_warning(tmp_path, one_rank, caplog):
    # Issue 34: +optim.kwargs.amsgrad=true with train.resume_strict=false crashed at the first step with
    # KeyError: 'max_exp_avg_sq' (Adam's state of the checkpoint has no such entry)
    one_rank.train.checkpoint_every = 2
    run(one_rank, tmp_path / "run")
    one_rank.train.num_steps = 4
    one_rank.optim.kwargs = {"amsgrad": True}
    with pytest.raises(
        ConfigError, match=r"other settings \(optim.kwargs: checkpoint \{\}, this run \{'amsgrad': True\}"
    ):
        run(one_rank, tmp_path / "run")  # strict: refused at start-up, naming the setting
    one_rank.train.resume_strict = False
    with caplog.at_level("WARNING"):
        summary = run(one_rank, tmp_path / "run")
    assert summary["first_step"] == 2 and len(summary["losses"]) == 4 and all(map(math.isfinite, summary["losses"]))
    warned = [r.getMessage() for r in caplog.records if "starts afresh" in r.getMessage()]
    assert len(warned) == 1 and "lacks 'max_exp_avg_sq'" in warned[0] and "optim.kwargs" in warned[0], warned


def test_optimizer_state_misfits_are_what_a_step_would_miss():
    from pipedream2bw.config import OptimConfig
    from pipedream2bw.config.optim import state_misfits

    adam = [
        ("matrix", frozenset({"step", "exp_avg", "exp_avg_sq"})),
        ("vector", frozenset({"step", "exp_avg", "exp_avg_sq"})),
    ]
    o = OptimConfig(name="adamw")
    assert state_misfits(o, adam) == {}
    o.kwargs = {"amsgrad": True}
    assert state_misfits(o, adam) == {"matrix": ["max_exp_avg_sq"], "vector": ["max_exp_avg_sq"]}
    o.kwargs, o.delay_correction = {}, "error_feedback"
    assert state_misfits(o, adam) == {}  # error feedback makes its entry when missing: no misfit
    o.delay_correction, o.name = "none", "lbfgs"
    assert state_misfits(o, adam) is None  # needs a closure: the probe cannot tell


# --- files and directories that cannot be used are refused, naming them ----------------------------------------


def _unreadable_inputs(tmp_path: Path) -> dict:
    """A corrupt .gz text file, a binary plan file, a run directory under a file, a planted train.log link."""
    (tmp_path / "corrupt.txt.gz").write_bytes(b"\x1f\x8b\x08\x00 this is no gzip stream")
    (tmp_path / "plan.yaml").write_bytes(bytes(range(128, 256)) * 4)
    (tmp_path / "a_file").write_text("not a directory\n")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "train.log").symlink_to(tmp_path / "outside.log")
    return {
        "gz": tmp_path / "corrupt.txt.gz",
        "plan": tmp_path / "plan.yaml",
        "under_file": tmp_path / "a_file" / "sub",
        "linked": linked,
    }


def test_unreadable_data_and_plan_files_are_refused_naming_them(tmp_path, one_rank):
    # Issue 34: a corrupt .gz text file died with BadGzipFile, a binary plan file with UnicodeDecodeError, neither
    # naming the file, after the process groups started
    from partitioner.planner import load_plan
    from pipedream2bw.config import DataConfig
    from pipedream2bw.data import check_data, load_splits

    paths = _unreadable_inputs(tmp_path)
    gz = re.escape(str(paths["gz"]))
    with pytest.raises(ConfigError, match=rf"^data.path \({gz}\) cannot be read as gzip-compressed text \(.gz\): "):
        check_data(DataConfig(path=str(paths["gz"])), vocab_size=256, seq_len=8, need_val=False)
    with pytest.raises(ConfigError, match=rf"^data.val_path \({gz}\) cannot be read as gzip"):
        load_splits(DataConfig(path=None, val_path=str(paths["gz"])))
    with pytest.raises(
        ConfigError, match=rf"^partition.path \({re.escape(str(paths['plan']))}\) cannot be read as a plan"
    ):
        load_plan(paths["plan"])
    one_rank.partition.mode, one_rank.partition.path = "file", str(paths["plan"])
    with pytest.raises(ConfigError, match=r"cannot be read as a plan file \(YAML text\): UnicodeDecodeError"):
        run(one_rank, tmp_path / "run")  # before any process group: run() makes them after the plan


@pytest.mark.slow
@pytest.mark.long  # four launches of the entry point; the checks themselves are unit-tested above
def test_unreadable_files_and_unusable_run_directories_exit_2_in_one_line(tmp_path):
    # Issue 34: each was exit 1 with a traceback (a read-only output directory: four of them); a planted
    # train.log link was appended through by Hydra's log before the run refused it
    paths = _unreadable_inputs(tmp_path)
    common = ["wandb.mode=disabled", "pipeline.num_stages=1", "train.num_steps=5"]
    run_dir = f"hydra.run.dir={tmp_path / 'run'}"
    runs = [
        [*common, f"data.path={paths['gz']}", run_dir],
        [*common, "partition=file", f"partition.path={paths['plan']}", run_dir],
        [*common, f"hydra.run.dir={paths['under_file']}"],
        [*common, f"hydra.run.dir={paths['linked']}"],
    ]
    results = spawn(train_cli, world_size=1, args=(runs,), log_dir=tmp_path / "logs", timeout_s=120)
    log = results[0].log
    assert log.count("EXIT 2") == 4 and "process group was started" not in log and "Traceback" not in log, log
    assert f"data.path ({paths['gz']}) cannot be read as gzip-compressed text" in log, log
    assert f"partition.path ({paths['plan']}) cannot be read as a plan file" in log, log
    assert f"hydra.run.dir ({paths['under_file']}) cannot be made: {paths['under_file'].parent} is a file" in log, log
    assert f"{paths['linked'] / 'train.log'} is a symbolic link" in log, log
    assert not (tmp_path / "outside.log").exists()  # nothing written through the link


def test_unusable_run_directory_is_named_before_hydra_makes_it(tmp_path):
    from pipedream2bw.precheck import check_run_dir

    paths = _unreadable_inputs(tmp_path)
    fix = "point hydra.run.dir at a directory this user can write"

    def problem(run_dir):
        return check_run_dir([f"hydra.run.dir={run_dir}", "pipeline.num_stages=1"])

    under = paths["under_file"]
    assert problem(under) == f"hydra.run.dir ({under}) cannot be made: {under.parent} is a file; {fix}"
    assert problem(under.parent) == f"hydra.run.dir ({under.parent}) is not a directory; {fix}"
    assert problem(paths["linked"]).startswith(f"{paths['linked'] / 'train.log'} is a symbolic link")
    assert problem(tmp_path / "new" / "run") is None and (tmp_path / "new" / "run").is_dir()
    # issue 43: a second run in a live run's directory appended its refusal to the live run's train.log
    from pipedream2bw.io.rundir import RunLock

    with RunLock() as lock:
        lock.acquire(tmp_path / "new" / "run")
        assert "is in use by a live run (host " in problem(tmp_path / "new" / "run")
        # a rank other than 0 asks not: rank 0 of its own launch may hold the lock already (it refused its own run)
        assert check_run_dir([f"hydra.run.dir={tmp_path / 'new' / 'run'}"], live=False) is None
    assert problem(tmp_path / "new" / "run") is None  # released: the next run takes it over
    if os.geteuid() != 0:  # root writes through a mode of 0555
        (tmp_path / "ro").mkdir(mode=0o555)
        assert problem(tmp_path / "ro" / "run").startswith(
            f"hydra.run.dir ({tmp_path / 'ro' / 'run'}) cannot be written"
        )


# --- a token file that shrinks under a run ---------------------------------------------------------------------


def train_cutting_its_data(cfg, run_dir: str, at_batch: int) -> None:
    """``run()``, rank 0 cutting the token file to nothing just before it reads batch ``at_batch``."""
    from pipedream2bw.data import tokens

    read = tokens.MicrobatchFeed._batch_windows

    def cut_then_read(feed, batch_index):
        if batch_index == at_batch and int(os.environ["RANK"]) == 0:
            os.truncate(cfg.data.path, 0)
        return read(feed, batch_index)

    tokens.MicrobatchFeed._batch_windows = cut_then_read
    run(cfg, Path(run_dir))


@pytest.mark.slow
def test_token_file_cut_under_a_run_is_named_on_every_rank(tmp_path):
    # Issue 34: a token file truncated mid-run killed a rank with SIGBUS (its memory mapping read past the file's
    # new end) while the other reported a misleading connection reset; the file was never named
    import numpy as np

    path = tmp_path / "tokens.bin"
    np.arange(6000, dtype=np.uint16).__mod__(300).astype(np.uint16).tofile(path)
    cfg = tiny_config(schedule="2bw", num_stages=2, num_microbatches=2, num_steps=8)
    cfg.model.vocab_size, cfg.data.path = 300, str(path)
    results = spawn(
        train_cutting_its_data, world_size=2, args=(cfg, str(tmp_path / "run"), 3), log_dir=tmp_path / "logs"
    )
    said = f"token file {path} shrank while the run reads it: 0 bytes now, 12000 when the run opened it (batch 3)"
    for r in results:
        assert r.exitcode not in (0, -signal.SIGBUS, -9) and said in r.log, (r.rank, r.exitcode, r.log[-3000:])


# --- a failed run() leaves no process group behind ----------------------------------------------------------


class _FailsAt(torch.nn.Module):
    """A layer whose third forward raises."""

    def __init__(self, layer):
        super().__init__()
        self.layer, self.calls = layer, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("planted failure")
        return self.layer(x)


@pytest.mark.slow  # two short runs in this process
def test_failed_run_leaves_no_process_group_and_the_next_run_starts(tmp_path, one_rank, monkeypatch):
    # Issue 34: a run() that failed after its groups started left the default group initialised, so a second
    # run() in the same process failed at once ("trying to initialize the default process group twice")
    import torch.distributed as dist

    from pipedream2bw.models import build_gpt_layers

    layers = build_gpt_layers(one_rank.model, seed=one_rank.seed)
    layers[1] = _FailsAt(layers[1])
    with pytest.raises(RuntimeError, match="planted failure"):
        run(one_rank, tmp_path / "failed", layers=layers)
    assert not dist.is_initialized()
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert run(one_rank, tmp_path / "next")["status"] == "completed"
