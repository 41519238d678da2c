"""Digests of an output's files taken by their writers, as the bytes were written.

An engine writer (a Megatron stage's rank files, a ZeRO rank's optimizer file, a DCP data file) hashes each
file's bytes beside its writes (:mod:`interop.hashed_writes`), and the manifest needs every file's digest: taken
there, no pass over every byte after the last write is needed (a second, for 3 GiB here). A digest is used only
for the file it was taken of: same device, inode, size, modification and change times when the manifest is made,
else the file is hashed again then.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

from . import digests


class WrittenDigests:
    """The digests writers took of their files (:meth:`record`), and those still current for the manifest
    (:meth:`digest`)."""

    def __init__(self) -> None:
        self._taken: dict[str, tuple[tuple[int, ...] | None, digests.FileDigest]] = {}
        self._lock = threading.Lock()
        self.closed = False

    def record(self, path: str, found: digests.FileDigest) -> None:
        """``path`` is written, closed and will not change, and its writer hashed its bytes as it wrote them."""
        key = os.path.realpath(path)
        taken = (digests._identity(key), found)
        with self._lock:
            self._taken[key] = taken

    def digest(self, path: str) -> digests.FileDigest | None:
        """The digest taken of ``path`` as it is now, or None (never recorded, or changed since: the caller hashes it)."""
        with self._lock:
            taken = self._taken.get(os.path.realpath(path))
        if taken is None:
            return None
        identity, found = taken
        return found if identity is not None and digests._identity(path) == identity else None

    def close(self) -> None:
        self.closed = True


_CURRENT: WrittenDigests | None = None
_CURRENT_LOCK = threading.Lock()


@contextlib.contextmanager
def digesting_as_written() -> Iterator[WrittenDigests]:
    """Files whose digests writers :func:`record` in this block (on any thread) are not read again for the manifest."""
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


def record(path: str, found: digests.FileDigest) -> None:
    """A writer's finished file and the digest it took of the bytes as it wrote them (:class:`digests.BlockHasher`):
    used for the manifest when a :func:`digesting_as_written` block is open, else the file is hashed at commit."""
    current = _CURRENT
    if current is not None:
        current.record(path, found)
