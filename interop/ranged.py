"""Checking a listed file against its manifest as a reader uses it, block by block.

A file larger than one block is recorded with each block's digest (``FileRecord.blocks``). A reader that uses
part of it (a ZeRO optimizer file's fp32 weights, a third of its bytes, for an HF export) registers it here
instead of having it hashed whole up front, and asks :meth:`RangeCheck.check` for every byte range before it
uses those bytes: each block a range touches is hashed once and compared with its record, and the next blocks
are hashed ahead on threads, so checking runs beside the reader's copying. The rule stays the manifest's:
no byte is used unchecked; bytes never used are never read.

Only a reader that checks every range it uses may register a file (:func:`defer`); everything else finds the file
checked whole as before (:func:`check_whole` before any other loader sees it).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

from . import digests
from .errors import CorruptCheckpointError
from .manifest import FileRecord

log = logging.getLogger(__name__)

AHEAD = 2  # blocks hashed ahead of the last one asked for: a reader goes through a file in order


class RangeCheck:
    """One registered file: its record, the inode it had when registered (a reader that opened a replacement is
    refused, and each block is read from that inode), and each block's check, started on first need. It holds no
    descriptor: a registration replaced or forgotten stays good for the readers that hold it."""

    def __init__(self, path: str, record: FileRecord):
        self.path = path
        self.record = record
        self.algo = digests.parse(record.digest, path)[0]
        st = os.stat(path)
        self.inode, self.size = st.st_ino, st.st_size
        self.block = record.block_bytes or 0
        if (self.size != record.bytes or not record.blocks or self.block < 1
                or len(record.blocks) != digests.block_count(record.bytes, self.block)):
            raise CorruptCheckpointError(path, f"size {self.size} bytes or its {len(record.blocks or [])} block digests "
                                               f"do not fit the manifest's {record.bytes} bytes")
        self._checks: dict[int, Future] = {}
        self._lock = threading.Lock()

    def _check_block(self, index: int) -> None:
        want = min(self.block, self.size - index * self.block)
        lo = index * self.block
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise CorruptCheckpointError(self.path, f"cannot be read to check bytes {lo}..{lo + want}: {exc.strerror}") from None
        buffer = _take_buffer(min(digests.HASH_READ, want))
        try:
            if os.fstat(fd).st_ino != self.inode:
                raise CorruptCheckpointError(self.path, "was replaced after it was checked against the manifest")
            digest, got = digests.hash_block(fd, index, self.block, self.algo, buffer)
        finally:
            os.close(fd)
            _BUFFERS.put(buffer)
        if got != want or digest != self.record.blocks[index]:
            raise CorruptCheckpointError(self.path, f"bytes {lo}..{lo + want} differ from the manifest's digest of them "
                                                    "(the file was altered or corrupted)")

    def _start(self, index: int) -> Future:
        with self._lock:
            future = self._checks.get(index)
            if future is None or future.cancelled():  # (cancelled unstarted by ``clear``: a reader still holding it asks again)
                future = self._checks[index] = _pool().submit(self._check_block, index)
            return future

    def cancel_pending(self) -> None:
        """Drop the block checks not yet begun: hashed ahead (``start``, a next block) for a use that never came."""
        with self._lock:
            for future in self._checks.values():
                future.cancel()

    def check(self, lo: int, hi: int, inode: int | None = None, ahead: bool = True) -> None:
        """Return once bytes ``lo .. hi`` of the file (as the reader opened it: ``inode``) match the manifest;
        raise CorruptCheckpointError naming the file otherwise. ``ahead``: the reader goes on through the file in
        order, so the next blocks are hashed meanwhile (not for a look at a file's index or pickle: the next bytes
        it reads lie elsewhere, and a block hashed for nothing takes a core from the blocks it does need)."""
        if inode is not None and inode != self.inode:
            raise CorruptCheckpointError(self.path, "was replaced after it was checked against the manifest")
        if not 0 <= lo <= hi <= self.size:
            raise CorruptCheckpointError(self.path, f"bytes {lo}..{hi} lie outside its {self.size} bytes")
        if hi == lo:
            return
        first, last = lo // self.block, (hi - 1) // self.block
        futures = {i: self._start(i) for i in range(first, last + 1)}
        for i in range(last + 1, min(last + 1 + AHEAD, len(self.record.blocks))) if ahead else ():
            self._start(i)
        for i, future in futures.items():
            while True:
                try:
                    future.result()
                    break
                except CancelledError:  # dropped unstarted by ``clear`` meanwhile: this reader still needs it
                    future = self._start(i)

    def start(self, lo: int, hi: int) -> None:
        """Start checking the blocks of bytes ``lo .. hi`` now, on the threads, for a ``check`` of them to come (a
        reader that will need two far-apart ranges has both hashed at once rather than one after the other)."""
        lo, hi = max(0, lo), min(hi, self.size)
        for i in range(lo // self.block, (hi - 1) // self.block + 1) if hi > lo else ():
            self._start(i)

    def check_whole(self, inode: int | None = None) -> None:
        self.check(0, self.size, inode)

    def start_whole(self) -> None:
        """Start hashing every block now (on the threads), for a ``check_whole`` to come."""
        self.start(0, self.size)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_BUFFERS: "queue.SimpleQueue[bytearray]" = queue.SimpleQueue()  # block buffers between checks; clear() lets them go


def _take_buffer(size: int) -> bytearray:
    try:
        buffer = _BUFFERS.get_nowait()
    except queue.Empty:
        return bytearray(size)
    return buffer if len(buffer) >= size else bytearray(size)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="ranged-check")
        return _POOL


_REGISTERED: dict[str, RangeCheck] = {}
_REGISTRY_LOCK = threading.Lock()


def _key(path: str) -> str:
    return os.path.realpath(path)


def defer(path: str, record: FileRecord) -> RangeCheck:
    """Register ``path`` to be checked range by range by its reader (replacing an earlier registration, which stays
    good for the readers that hold it: ``interop diff X X`` reads one checkpoint twice)."""
    check = RangeCheck(path, record)
    with _REGISTRY_LOCK:
        _REGISTERED[_key(path)] = check
    log.debug("%s: checked block by block as it is read", path)
    return check


def forget(path: str) -> None:
    with _REGISTRY_LOCK:
        _REGISTERED.pop(_key(path), None)


def registered(path: str) -> RangeCheck | None:
    """The range check a reader must pass ``path``'s bytes through, or None when it was checked whole (or is no
    checkpoint's)."""
    with _REGISTRY_LOCK:
        return _REGISTERED.get(_key(path))


def start_whole(path: str) -> None:
    """Start checking a registered file whole (:func:`check_whole` waits for it): the caller imports torch meanwhile."""
    check = registered(path)
    if check is not None:
        check.start_whole()


def check_whole(path: str) -> None:
    """For a reader that does not check ranges (torch's own loader, which opens ``path`` itself): a registered
    file is checked whole first, and must still be the file registered."""
    check = registered(path)
    if check is not None:
        try:
            inode = os.stat(path).st_ino
        except OSError as exc:
            raise CorruptCheckpointError(path, f"is gone since it was listed: {exc.strerror}") from None
        check.check_whole(inode)


def clear() -> None:
    """Forget every registration and the spare block buffers (the end of a command), and drop the block checks not
    yet begun: a command that never read what was hashed ahead (``interop inspect`` of a checkpoint whose reader
    starts its first weight's check) does not wait at exit for gigabytes to be hashed for nothing."""
    with _REGISTRY_LOCK:
        checks = list(_REGISTERED.values())
        _REGISTERED.clear()
    for check in checks:
        check.cancel_pending()
    while True:
        try:
            _BUFFERS.get_nowait()
        except queue.Empty:
            return
