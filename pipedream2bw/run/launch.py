"""Launches a training run on this node through torch's elastic launch API (what torchrun runs), and waits."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator, Optional, Sequence

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A launched run failed or ran out of time; the message says which and why."""


class _TimedOut(BaseException):
    """Raised in the main thread by the alarm; a BaseException so no library code swallows it."""


@contextlib.contextmanager
def _deadline(timeout_s: Optional[float]) -> Iterator[None]:
    """Raises _TimedOut in this (main) thread after ``timeout_s``; the elastic agent then stops its workers."""
    if not timeout_s or threading.current_thread() is not threading.main_thread():
        if timeout_s:
            log.warning("no timeout for a launch outside the main thread (signals reach only the main thread)")
        yield
        return

    def on_alarm(signum, frame):
        raise _TimedOut()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    previous_left, _ = signal.setitimer(signal.ITIMER_REAL, timeout_s)  # someone else's alarm (e.g. pytest-timeout)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if previous_left:  # put the caller's alarm back, less the time spent here
            signal.setitimer(signal.ITIMER_REAL, max(previous_left - (time.monotonic() - start), 1e-3))


def worker_threads(nproc: int) -> str:
    """The OMP_NUM_THREADS a launch of ``nproc`` local ranks gives each: the caller's, else 1 where several ranks
    share the node (what torchrun sets: each rank's threads would otherwise fight the others' for the cores, and a
    sweep or benchmark would measure that), else torch's default ('' here: all cores)."""
    return os.environ.get("OMP_NUM_THREADS") or ("1" if nproc > 1 else "")


@contextlib.contextmanager
def _worker_env(nproc: int) -> Iterator[None]:
    """OMP_NUM_THREADS=worker_threads(nproc) in this process's environment, which the launched ranks inherit."""
    threads, before = worker_threads(nproc), os.environ.get("OMP_NUM_THREADS")
    if threads:
        os.environ["OMP_NUM_THREADS"] = threads
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)


def train_args(overrides: Sequence[str], *, run_dir: Path) -> list:
    """The arguments after ``python``: ``-m pipedream2bw.train <overrides> hydra.run.dir=<run_dir>``."""
    return ["-m", "pipedream2bw.train", *overrides, f"hydra.run.dir='{Path(run_dir).resolve()}'"]


def launch_train(overrides: Sequence[str], *, nproc: int, run_dir: Path, timeout_s: Optional[float] = None) -> None:
    """Runs ``python -m pipedream2bw.train <overrides>`` on ``nproc`` local ranks in ``run_dir``.

    Each rank's stdout and stderr go to ``run_dir/launch/`` (the ranks also log to
    ``run_dir/train.log``). No restarts: a failed run is reported, not retried. Each rank runs with
    ``OMP_NUM_THREADS=worker_threads(nproc)``, as under torchrun.

    Raises:
        LaunchError: a rank exited with an error, or the run took longer than ``timeout_s``
            (its ranks are then stopped).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"pd2bw-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # as torchrun --standalone: a free port, no races
        max_restarts=0,
        monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "launch"), redirects=Std.ALL, tee=Std.NONE),
    )
    try:
        with _deadline(timeout_s), _worker_env(nproc):
            elastic_launch(config, sys.executable)(*train_args(overrides, run_dir=run_dir))
    except _TimedOut:
        raise LaunchError(f"timed out after {timeout_s:g} s (sweep.timeout_s); its ranks were stopped") from None
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        raise LaunchError(f"rank {rank} exited with code {failure.exitcode}") from e
