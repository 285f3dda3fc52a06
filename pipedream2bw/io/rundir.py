"""A run directory in use is locked (one live run at a time), and nothing inside it follows a link.

Rank 0 holds an exclusive ``fcntl.flock`` on ``<run_dir>/.lock`` from before it looks at the
directory's checkpoints until the run ends. The kernel drops the lock with the process, so a
run that died (killed, or restarted by torchrun) leaves no stale lock: the next one takes it
over. A second run started in a directory that a live run holds is refused at once, naming the
directory and the live run's host and PID, before it touches anything there (its checkpoints,
``metrics.jsonl``, ``train.log``).

What the run writes or deletes inside its directory is never reached through a symbolic link:
``check_no_links`` refuses a run directory whose ``checkpoints``, ``train.log``, ``metrics.jsonl``
or any checkpoint entry is a link, naming it (and ``checkpoint.verify`` a manifest that names a file
outside its checkpoint, or a link).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import Optional

from pipedream2bw.errors import ConfigError

LOCK = ".lock"
WATCHED = ("checkpoints", "train.log", "metrics.jsonl", "summary.json", "final_model.pt", "loss.png", ".lock")
"""Names in a run directory that the run writes or deletes: none may be a link."""


class RunDirInUse(ConfigError):
    """Another live run holds the run directory."""


class RunLock:
    """The run directory's lock (rank 0's): ``acquire(run_dir)`` takes it; leaving the context releases it."""

    def __init__(self) -> None:
        self.fd: Optional[int] = None
        self.path: Optional[Path] = None

    def acquire(self, run_dir: Path) -> None:
        """Takes the lock of ``run_dir`` (created if needed).

        Raises:
            RunDirInUse: a live run holds it, named by its host and PID.
            ConfigError: ``run_dir/.lock`` is a link.
        """
        if self.fd is not None:
            return
        path = Path(run_dir) / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfigError(f"{path} is a symbolic link; remove it (a run directory holds no links)") from e
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "a process that has not written its name"
            os.close(fd)
            raise RunDirInUse(
                f"run directory {Path(run_dir).resolve()} is in use by a live run ({holder}); wait for it to end, "
                f"or start this one in another directory (hydra.run.dir=...)"
            ) from None
        os.ftruncate(fd, 0)
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {when}\n".encode())
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def live_holder(run_dir: Path) -> Optional[str]:
    """Who holds ``run_dir``'s lock (the host and PID it wrote) while a live run does; None when no run holds it."""
    try:
        fd = os.open(Path(run_dir) / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # no lock file (or a link, which check_no_links refuses where it matters): no live run
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken (then dropped with the descriptor) unless one holds it
        return None
    except BlockingIOError:
        return os.read(fd, 4096).decode(errors="replace").strip() or "a process that has not written its name"
    finally:
        os.close(fd)


def check_resume_source(path: Path, *, own: Path) -> None:
    """Refuses to resume from ``path`` (``train.resume``: a checkpoint, a ``checkpoints/`` directory or a run
    directory) inside another run directory that a live run holds: its pruning may delete the checkpoint while
    this run reads it, and ``resume=auto`` there would take a checkpoint the live run is still adding to.

    Raises:
        RunDirInUse: naming the path, the run directory and the live run's host and PID.
    """
    path, own = Path(path).resolve(), Path(own).resolve()
    if own == path or own in path.parents:  # this run's own directory: its lock is this run's
        return
    for run_dir in (path, path.parent, path.parent.parent):
        holder = live_holder(run_dir)
        if holder is not None:
            raise RunDirInUse(
                f"train.resume ({path}) is inside run directory {run_dir}, in use by a live run ({holder}); wait for "
                "it to end, or copy the checkpoint out of it and resume from the copy"
            )


def check_no_links(run_dir: Path) -> None:
    """Refuses a run directory where the run would write or delete through a symbolic link.

    Raises:
        ConfigError: naming the link and where it points.
    """
    run_dir = Path(run_dir)
    names = [run_dir / n for n in WATCHED]
    root = run_dir / "checkpoints"
    if root.is_dir() and not root.is_symlink():
        names += sorted(root.iterdir())
    for path in names:
        if path.is_symlink():
            raise ConfigError(
                f"{path} is a symbolic link (to {os.readlink(path)}); a run writes and deletes there, so it follows "
                f"no link inside its run directory: remove the link, or start in another directory"
            )
