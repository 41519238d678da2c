"""Digests of an output's files taken as each file is finished, beside the writing of the next ones.

An engine writer (a Megatron stage's rank files, a ZeRO rank's optimizer file) finishes its files one after
another, and the manifest needs every file's digest. Hashed at the end, they cost a pass over every byte after the
last write (a second, for 3 GiB here); hashed as each is finished, that pass runs while the writer builds and
writes the next files, on a core the writer leaves idle. A digest is used only for the file it was taken of: same
device, inode, size, modification and change times when the manifest is made, else the file is hashed again then.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

from . import digests

log = logging.getLogger(__name__)


def _digest_of(path: str) -> tuple[tuple[int, ...] | None, digests.FileDigest]:
    """The file's digest and its identity (device, inode, size, modification and change times), None where the
    file changed while it was read. No "changed too recently" window as for a source's early digests
    (``digests.hash_ahead``): these files were just finished by their only writer, in a staged output no one else
    writes, and a change after this is still seen by its times."""
    before = digests._identity(path)
    found = digests.of_files([path], threads=1)[path]
    return (before if digests._identity(path) == before else None), found


class WrittenDigests:
    """Files hashed on a background thread as writers report them finished (:meth:`finished`), and their digests
    for the manifest (:meth:`digest`)."""

    def __init__(self, threads: int = 1):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="written-digests")
        self._taken: dict[str, Future] = {}
        self._lock = threading.Lock()
        self.closed = False

    def finished(self, path: str) -> None:
        """``path`` is written and will not change: hash it now (or, once closed, at commit as before)."""
        key = os.path.realpath(path)
        try:
            future = self._pool.submit(_digest_of, key)
        except RuntimeError:  # closed meanwhile: the file is hashed where its manifest is made
            return
        with self._lock:
            self._taken[key] = future

    def record(self, path: str, found: digests.FileDigest) -> None:
        """``path`` is written, closed and will not change, and its writer hashed its bytes as it wrote them."""
        key = os.path.realpath(path)
        taken: Future = Future()
        taken.set_result((digests._identity(key), found))
        with self._lock:
            self._taken[key] = taken

    def digest(self, path: str) -> digests.FileDigest | None:
        """The digest taken of ``path`` as it is now, or None (never reported, changed since, or its hashing failed:
        the caller hashes it)."""
        with self._lock:
            taken = self._taken.get(os.path.realpath(path))
        if taken is None:
            return None
        try:
            identity, found = taken.result()
        except Exception as exc:  # noqa: BLE001 - hashed again by the caller, which reports what is wrong
            log.debug("%s: hashed again (%s)", path, exc)
            return None
        return found if identity is not None and digests._identity(path) == identity else None

    def close(self) -> None:
        self.closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)


_CURRENT: WrittenDigests | None = None
_CURRENT_LOCK = threading.Lock()


@contextlib.contextmanager
def digesting_as_written() -> Iterator[WrittenDigests]:
    """Files reported by :func:`finished` in this block (by any thread) are hashed as they come."""
    global _CURRENT
    ahead = WrittenDigests()
    with _CURRENT_LOCK:
        outer, _CURRENT = _CURRENT, ahead
    try:
        yield ahead
    finally:
        with _CURRENT_LOCK:
            if _CURRENT is ahead:  # blocks on other threads may close out of order: never put back a closed one
                _CURRENT = outer if outer is None or not outer.closed else None
        ahead.close()


def finished(path: str) -> None:
    """A writer's file is complete: hashed now when a :func:`digesting_as_written` block is open, else at commit as before."""
    current = _CURRENT
    if current is not None:
        current.finished(path)


def record(path: str, found: digests.FileDigest) -> None:
    """A writer's finished file and the digest it took of the bytes as it wrote them (:class:`digests.BlockHasher`):
    used for the manifest when a :func:`digesting_as_written` block is open, else the file is hashed at commit."""
    current = _CURRENT
    if current is not None:
        current.record(path, found)
