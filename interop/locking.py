"""One writer per checkpoint root and per conversion target, across processes.

Two trainers saving into one output directory, or two conversions into one destination, would each publish
over the other's work and both report success. An exclusive ``flock`` on a lock file refuses the second
writer at once, with the first one's pid. The kernel drops the lock when its holder dies, so a killed run
never leaves a stale lock behind. Within one process a path may be claimed more than once (a trainer and a
test in the same interpreter); only other processes are refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from typing import Iterator

from .errors import CheckpointInUseError

RUN_LOCK = ".interop.lock"  # in a run's output directory, held by its rank 0 while the run lives

_held: dict[str, tuple[int, int]] = {}  # lock path -> (fd, claims) held by this process
_guard = threading.Lock()


def _open_locked(lock_path: str, what: str) -> int:
    """An fd of ``lock_path`` holding its exclusive lock; refuses when another process holds it. A holder may
    remove the file while we open it: the lock is only ours if the path still names the inode we locked."""
    for _ in range(8):
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointInUseError(
                f"{what}: another interop process (pid {holder}) is writing here; wait for it to finish or choose another path"
            ) from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock_path))
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)
    raise CheckpointInUseError(f"{what}: could not take the lock {lock_path}; it keeps being replaced")


def claim(lock_path: str, what: str) -> None:
    """Hold ``lock_path`` until ``release`` or the end of this process."""
    lock_path = os.path.abspath(lock_path)
    with _guard:
        fd, count = _held.get(lock_path, (None, 0))
        if fd is None:
            fd = _open_locked(lock_path, what)
        _held[lock_path] = (fd, count + 1)


def release(lock_path: str, remove: bool = False) -> None:
    lock_path = os.path.abspath(lock_path)
    with _guard:
        fd, count = _held.get(lock_path, (None, 0))
        if fd is None:
            return
        if count > 1:
            _held[lock_path] = (fd, count - 1)
            return
        del _held[lock_path]
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)  # while still locked: a waiter that opened it re-checks the inode
        os.close(fd)


def holder_elsewhere(lock_path: str) -> str | None:
    """The pid of another process holding ``lock_path`` now, or None (not held, held by this process, or no
    such file). Tests without taking or creating anything."""
    lock_path = os.path.abspath(lock_path)
    if lock_path in _held:
        return None
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)  # closing releases a shared lock we may have taken
    return None


def refuse_if_in_use(path: str, what: str) -> None:
    """Refuse to write ``path`` while another process writes it or a directory holding it: a running trainer
    (its output directory's ``RUN_LOCK``) or a conversion (the destination's lock beside it)."""
    current = os.path.abspath(path)
    while True:
        for lock in (os.path.join(current, RUN_LOCK), _beside(current)):
            holder = holder_elsewhere(lock)
            if holder is not None:
                raise CheckpointInUseError(f"{what}: another interop process (pid {holder}) is writing {current}; "
                                           "wait for it to finish or choose another path")
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent


def _beside(path: str) -> str:
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.lock")


@contextlib.contextmanager
def exclusive(lock_path: str, what: str, remove: bool = True) -> Iterator[None]:
    """Hold ``lock_path`` for the block; by default the lock file is removed afterwards."""
    claim(lock_path, what)
    try:
        yield
    finally:
        release(lock_path, remove)
