"""Atomic writes: every file we save is complete or absent, also after a crash (tmp, fsync, rename, fsync dir)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional


@contextlib.contextmanager
def atomic_open(path: Path, *, mode: Optional[int] = None) -> Iterator[BinaryIO]:
    """Yields a binary file that replaces ``path`` when the block ends without an exception.

    The data goes to a temporary file beside ``path`` (so the rename stays on one file system),
    which is flushed and fsynced, renamed over ``path``, and then the directory is fsynced so the
    rename itself survives a power cut. If the block raises (even ``SystemExit`` or
    ``KeyboardInterrupt``), the temporary file is removed and ``path`` keeps its old content.

    Args:
        path: the file to write; its directory must exist.
        mode: permission bits of the new file; by default those a plain ``open()`` would give
            (0o666 less the umask; ``mkstemp`` alone makes 0o600).
    """
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise _naming(e, path) from e
    try:
        os.fchmod(fd, _open_mode() if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise _naming(e, path) from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _naming(error: OSError, path: Path) -> OSError:
    """``error`` with the file it failed on in its message (a full disk's ENOSPC names none)."""
    if error.filename is not None or str(path) in str(error):
        return error
    return type(error)(error.errno, f"{error.strerror or error} (writing {path})")


def atomic_write(path: Path, data: bytes, *, mode: Optional[int] = None) -> None:
    """Writes ``data`` to ``path``, complete or not at all (see ``atomic_open``)."""
    with atomic_open(path, mode=mode) as f:
        f.write(data)


def atomic_write_text(path: Path, text: str, *, mode: Optional[int] = None) -> None:
    """Writes ``text`` (UTF-8) to ``path``, complete or not at all."""
    atomic_write(path, text.encode("utf-8"), mode=mode)


def atomic_write_json(path: Path, obj: Any, *, indent: Optional[int] = 2) -> None:
    """Writes ``obj`` as JSON with a final newline to ``path``, complete or not at all."""
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")


def atomic_torch_save(obj: Any, path: Path) -> bytes:
    """``torch.save(obj, path)``, complete or not at all; returns the bytes written (to checksum them)."""
    import torch  # here, so that the rest of this module stays a standard-library leaf

    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    atomic_write(path, data)
    return data


def atomic_rename(src: Path, dst: Path) -> None:
    """Renames ``src`` (a file or a directory) to ``dst`` and fsyncs ``dst``'s directory, so that a
    crash after the call cannot bring back the old name (a rename is durable only then)."""
    Path(src).rename(dst)
    fsync_dir(Path(dst).parent)


def atomic_symlink(target: Path, link: Path) -> None:
    """Makes ``link`` a symbolic link to ``target``, replacing what ``link`` was in one step: the link is
    made under a temporary name beside it and renamed over it, so a reader sees the old or the new one.

    Raises:
        IsADirectoryError: ``link`` is a real directory (never replaced).
    """
    link = Path(link)
    if link.is_dir() and not link.is_symlink():
        raise IsADirectoryError(f"{link} is a directory, not a link: not replacing it")
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(link.parent)


def fsync_dir(path: Path) -> None:
    """Flushes a directory's entries (the files created, renamed or removed in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_mode() -> int:
    umask = os.umask(0)  # reading the umask means setting it: put it back at once
    os.umask(umask)
    return 0o666 & ~umask
