"""Work on a writer's bytes beside its writes: one thread hashes what was just written (a file's digest for the
manifest, taken from memory instead of reading the finished file back) and checks sources' digests, in the order
it is handed them, while the writer goes on to its next bytes. Hashing (BLAKE3) and writing both release the GIL,
so on two cores the digest costs the writer no time."""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, Callable

from .errors import OutputWriteError


class Beside:
    """One thread that works through what the writer hands it, in order. A buffer handed over stays alive (the
    task holds it) until the task has run; at most ``limit`` bytes wait. An error there is raised in the writer at
    its next hand-over, or when the block ends."""

    def __init__(self, limit: int = 256 << 20):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hashed-writes")
        self._pending: deque = deque()
        self._bytes, self._limit = 0, limit

    def submit(self, fn: Callable[..., Any], *args: Any, nbytes: int = 0) -> None:
        self._pending.append((self._pool.submit(fn, *args), nbytes))
        self._bytes += nbytes
        while self._pending and (self._pending[0][0].done() or self._bytes > self._limit):
            future, n = self._pending.popleft()
            self._bytes -= n
            future.result()

    def __enter__(self) -> "Beside":
        return self

    def __exit__(self, kind, *_: Any) -> None:
        try:
            if kind is None:
                while self._pending:
                    self._pending.popleft()[0].result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)


class HashedFile:
    """The output file ``path``, open for writing as ``f``, whose written bytes are also fed, in order, to ``hasher``
    (a :class:`digests.BlockHasher`) on the :class:`Beside` thread. The caller must not change a buffer after
    writing it. A failed write or sync is an :class:`OutputWriteError` naming the file (and only these: a source's
    read failing meanwhile is not reported as the output's)."""

    def __init__(self, f: BinaryIO, beside: Beside, hasher: Any, path: str):
        self._f, self._beside, self._hasher, self.path = f, beside, hasher, path

    def write(self, data: Any) -> int:
        try:
            n = self._f.write(data)
        except OSError as exc:
            raise OutputWriteError.of(self.path, exc) from None
        self._beside.submit(self._hasher.update, data, nbytes=n)
        return n

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as exc:
            raise OutputWriteError.of(self.path, exc) from None

    def sync(self) -> None:
        """Flush and fsync: the bytes are on disk when this returns."""
        self.flush()
        try:
            os.fsync(self._f.fileno())
        except OSError as exc:
            raise OutputWriteError.of(self.path, exc) from None
