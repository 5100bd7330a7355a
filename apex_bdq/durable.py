"""Files that survive a crash: one helper for every checkpoint, snapshot and cache write.

`atomic_write(path, write)` writes through a temporary file of its own (unique per writer:
two writers never share one), fsyncs it, renames it over `path` and fsyncs the directory, so
a reader sees the old file or the new one, never a torn one, and the rename itself survives a
power cut (POSIX: a file's fsync does not make its directory entry durable).
"""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


_UMASK = os.umask(0)
os.umask(_UMASK)  # read once: the mode a plain open() would give a new file


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync the directory holding `path`, so that a file created or renamed there is durable.
    Filesystems that cannot fsync a directory (some FUSE mounts) are let through: the file's
    own fsync is all they offer."""
    fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.ENOSYS, errno.EBADF):
            raise
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Write `path` atomically and durably: `write(f)` fills a unique temporary file in the
    same directory, which is fsynced and renamed over `path`; the directory is fsynced. On an
    error the temporary file is removed and `path` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; the file gets what open() would give it
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))
