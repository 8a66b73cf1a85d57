"""The file operations behind everything the Synchronizer keeps on disk.

The write-ahead log, checkpoints and the epoch file are written only through a `Disk`, so a test
can put another in its place: one that fails writes (a full disk), or one that records what was
written and what was made durable and then loses power (`tests/powercut.py`). Reading goes to the
filesystem directly.

What is durable, as POSIX promises it and no more: a file's bytes once the file is fsynced; a
directory's entries (a created, renamed or deleted file, a new subdirectory) once the directory
is fsynced. Every caller here fsyncs both, in that order, before it relies on either.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of the range's dirty pages


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call  # type: ignore[no-any-return]


class Disk:
    """The real filesystem."""

    def open(self, path: Path) -> int:
        """A file opened for appending (created if missing)."""
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def reuse(self, old: Path, path: Path) -> int:
        """Renames the file `old` to `path` (one directory) and opens it for writing over its
        bytes from the start, neither emptied nor appended to: durable once the directory is
        fsynced, and its bytes once it is."""
        os.replace(old, path)
        return os.open(path, os.O_WRONLY)

    def create(self, path: Path) -> int:
        """A new, empty file opened for writing (an existing one of that name is emptied)."""
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        """Writes at the file's position (its end, for `open`); returns the bytes written."""
        return os.write(fd, data)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        """Writes at `offset`, leaving the file's position where it was."""
        return os.pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        os.fdatasync(fd)  # the data and the file's length

    def forget(self, fd: int, offset: int, length: int) -> None:
        """Drops a fsynced range's pages from the page cache (advice only: a platform without
        it, or a refusal, changes nothing). For bytes that are written and not read back while
        serving: the cache would keep them at the cost of fresh pages for every later write, and
        on a virtual machine a page the guest never touched costs a host fault (measured here:
        25 MiB written in 7 ms into pages freed this way, in 110-160 ms into fresh ones)."""
        advise = getattr(os, "posix_fadvise", None)
        if advise is not None and length > 0:
            try:
                advise(fd, offset, length, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass

    def start_writeback(self, fd: int, offset: int, length: int) -> None:
        """Starts writing a range's dirty pages to the device without waiting (Linux's
        sync_file_range; nothing elsewhere): a later fsync then waits only for what is still
        in flight. Promises nothing about durability."""
        call = _sync_file_range()
        if call is not None and length > 0:
            call(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # an error is left to the fsync

    def truncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def close(self, fd: int) -> None:
        os.close(fd)

    def replace(self, src: Path, dst: Path) -> None:
        """Renames `src` over `dst` (one directory): durable once the directory is fsynced."""
        os.replace(src, dst)

    def unlink(self, path: Path) -> None:
        """Deletes a file if it is there: durable once its directory is fsynced."""
        path.unlink(missing_ok=True)

    def mkdir(self, path: Path) -> None:
        """Creates a directory (and its missing parents) if it is not there; each new one is
        durable once its parent is fsynced (`make_dirs` does both)."""
        path.mkdir(parents=True, exist_ok=True)

    def fsync_dir(self, path: Path) -> None:
        """Makes a directory's entries (a rename, a new or deleted file) durable."""
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # Built from the operations above ---------------------------------------------------------

    def write_all(self, fd: int, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            view = view[self.write(fd, view) :]

    def make_dirs(self, path: Path) -> None:
        """`path` and its missing parents created and their entries made durable."""
        missing = []
        at = path
        while not at.exists():
            missing.append(at)
            at = at.parent
        if not missing:
            return
        self.mkdir(path)
        for new in reversed(missing):
            self.fsync_dir(new.parent)
