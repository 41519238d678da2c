"""Writing a large output file with direct I/O (``O_DIRECT``): its bytes go from a few aligned buffers straight to
the disk instead of through the page cache.

Why: a buffered write copies every byte into a page-cache page that the kernel must allocate, account, mark dirty
and later write back. Converting a 257M model to one 1 GiB Hugging Face file on a 2-core machine, that bookkeeping
cost as much CPU as the copy itself and took the core that the source's digest check needed (1 GiB copied file to
file and fsynced: 0.65-1.2 s and about 0.75 core-s; the same bytes written direct from 4-8 MiB buffers with three
writes in flight: 0.40-0.46 s and about 0.2 core-s, in one run beside each other). The bytes are gathered into the
buffers with one copy (``pread`` from a mapped piece's file, else from memory) and written on threads, several
writes in flight, into a file allocated at its final size up front (ext4 takes extending direct writes one at a
time).

Where direct I/O is not to be had (tmpfs, some network filesystems) the file is written the ordinary way
(:class:`BufferedFile`); where the device refuses a direct write, the same buffers are written through the page
cache. The bytes are the same whichever way they went.
"""

from __future__ import annotations

import errno
import functools
import logging
import mmap
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable

from .errors import CorruptCheckpointError, OutputWriteError
from .hashed_writes import pwrite_all, start_writeback, write_piece
from .tensors import Piece

log = logging.getLogger(__name__)

ALIGN = 4096  # offsets and buffer sizes: a multiple of any logical block size short of 8 KiB, and of the page
CHUNK = 4 << 20  # one write
IN_FLIGHT = 3  # writes at a time (16 MiB of buffers with the one being filled)
DIRECT_FROM = 64 << 20  # smaller files go through the page cache: too little to gain, and a reader soon after finds them there
WRITEBACK = 64 << 20  # a buffered file starts writing back every this many bytes, so its final fsync waits for little


class BufferedFile:
    """An output file written through the page cache: mapped pieces copied file to file in the kernel, writeback
    started as it goes."""

    direct = False

    def __init__(self, path: str):
        self.path = path
        try:
            self._f = open(path, "wb")
        except OSError as exc:
            raise OutputWriteError.of(path, exc) from None
        self._sources: dict[str, int] = {}
        self._pos = self._dirty_from = 0

    def write(self, data: Any) -> int:
        return self._advance(self._f.write(data))

    def write_piece(self, piece: Piece) -> int:
        return self._advance(write_piece(self._f, piece, self._sources))

    def _advance(self, n: int) -> int:
        self._pos += n
        if self._pos - self._dirty_from >= WRITEBACK:
            start_writeback(self._f, self._dirty_from, self._pos - self._dirty_from)
            self._dirty_from = self._pos
        return n

    def sync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        try:
            self._f.close()
        finally:
            _close_all(self._sources.values())


class DirectFile:
    """An output file of ``size`` bytes written in order with direct I/O (see the module's docstring). ``write``
    and ``write_piece`` copy into the buffer being filled; a full buffer is written on a thread while the next
    fills. ``sync`` writes the rest and fsyncs; an error of a write on a thread is raised there or at the next
    buffer taken. Open it with :func:`open_output`, which falls back to :class:`BufferedFile`."""

    direct = True

    def __init__(self, path: str, size: int, fd: int):
        self.path, self.size, self._fd = path, size, fd
        self._plain: int | None = None  # the file without O_DIRECT: its last partial block, or all once a direct write is refused
        self._plain_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="direct-writes")
        self._pending: deque[tuple[Future, mmap.mmap]] = deque()
        self._spare: list[mmap.mmap] = []
        self._buffer: mmap.mmap | None = None
        self._fill = 0  # bytes in the buffer being filled
        self._offset = 0  # where the buffer being filled goes in the file
        self._sources: dict[str, int] = {}
        _preallocate(fd, size)

    def write(self, data: Any) -> int:
        with memoryview(data) as view:
            flat = view if view.format == "B" and view.ndim == 1 else view.cast("B")
            n, done = flat.nbytes, 0
            while done < n:
                buffer = self._take()
                take = min(CHUNK - self._fill, n - done)
                buffer[self._fill:self._fill + take] = flat[done:done + take]
                self._filled(take)
                done += take
        return n

    def write_piece(self, piece: Piece) -> int:
        """``piece``'s bytes: read from its file where it is a view of a mapped file (no page faults, no copy
        under the GIL), else copied from memory."""
        fd = _source_fd(piece, self._sources)
        if fd is None:
            return self.write(piece.data)
        path, offset, _ = piece.source
        n, done = piece.data.nbytes, 0
        while done < n:
            buffer = self._take()
            take = min(CHUNK - self._fill, n - done)
            with memoryview(buffer) as view:
                try:
                    got = os.preadv(fd, [view[self._fill:self._fill + take]], offset + done)
                except OSError as exc:
                    raise CorruptCheckpointError(path, f"cannot be read at byte {offset + done}: {exc.strerror}") from None
            if got == 0:
                raise CorruptCheckpointError(path, f"ended {n - done} bytes early (shortened while it was read)")
            self._filled(got)
            done += got
        return n

    def _take(self) -> mmap.mmap:
        """The buffer being filled; a fresh one (or one whose write has finished) when there is none."""
        if self._buffer is None:
            while self._pending and (len(self._pending) >= IN_FLIGHT or self._pending[0][0].done()):
                future, buffer = self._pending.popleft()
                self._spare.append(buffer)
                future.result()
            self._buffer = self._spare.pop() if self._spare else mmap.mmap(-1, CHUNK)
        return self._buffer

    def _filled(self, n: int) -> None:
        self._fill += n
        if self._fill == CHUNK:
            self._submit()

    def _submit(self) -> None:
        buffer, n, offset = self._buffer, self._fill, self._offset
        self._pending.append((self._pool.submit(self._write_out, buffer, n, offset), buffer))
        self._buffer, self._fill, self._offset = None, 0, offset + n

    def _write_out(self, buffer: mmap.mmap, n: int, offset: int) -> None:
        """One buffer's ``n`` bytes at ``offset``: the whole blocks direct, a last partial block (or everything,
        once the device has refused a direct write) through the page cache."""
        with memoryview(buffer) as view:
            done = 0
            if self.direct:
                try:
                    done = n - n % ALIGN
                    pwrite_all(self._fd, view[:done], offset)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    log.debug("%s: direct writes refused (%s); written through the page cache", self.path, exc.strerror)
                    self.direct, done = False, 0
            if done < n:
                pwrite_all(self._plain_fd(), view[done:n], offset + done)

    def _plain_fd(self) -> int:
        with self._plain_lock:
            if self._plain is None:
                self._plain = os.open(self.path, os.O_WRONLY)
            return self._plain

    def sync(self) -> None:
        if self._fill:
            self._submit()
        while self._pending:
            future, buffer = self._pending.popleft()
            self._spare.append(buffer)
            future.result()
        if self._offset != self.size:
            raise OutputWriteError(self.path, f"was given {self._offset} bytes for its {self.size} (a writer's error)")
        os.fsync(self._fd)

    def close(self) -> None:
        try:
            self._pool.shutdown(wait=True, cancel_futures=True)
        finally:
            for buffer in (*self._spare, *(b for _, b in self._pending), *([self._buffer] if self._buffer is not None else [])):
                try:
                    buffer.close()
                except BufferError:  # a view of it lives on in a failed write's traceback: the buffer goes with that
                    pass
            _close_all([self._fd, *([self._plain] if self._plain is not None else []), *self._sources.values()])


def open_output(path: str, size: int) -> DirectFile | BufferedFile:
    """``path`` created for ``size`` bytes written in order: direct where the file is large enough to gain and the
    filesystem takes direct I/O, else through the page cache."""
    flag = getattr(os, "O_DIRECT", 0)
    if size < DIRECT_FROM or not flag:
        return BufferedFile(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o666)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: this filesystem takes no direct I/O
            raise OutputWriteError.of(path, exc) from None
        return BufferedFile(path)
    try:
        return DirectFile(path, size, fd)
    except BaseException:
        os.close(fd)
        raise


def _source_fd(piece: Piece, sources: dict[str, int]) -> int | None:
    """The open file a mapped piece's bytes lie in, or None where it is not a mapped view or the file was replaced
    since it was mapped (the mapping's bytes are the ones hashed: they are written from memory)."""
    if piece.source is None:
        return None
    path, _, inode = piece.source
    if path not in sources:
        try:
            sources[path] = os.open(path, os.O_RDONLY)
        except OSError:
            return None
    return sources[path] if os.fstat(sources[path]).st_ino == inode else None


def _preallocate(fd: int, size: int) -> None:
    """The file's blocks allocated at its final size, so the direct writes overwrite and run side by side. Only
    the kernel's fallocate: glibc's posix_fallocate writes zeros where a filesystem has none, a second write of
    the whole file. A full disk is refused here, before any byte is written."""
    fallocate = _fallocate()
    if fallocate is not None and fallocate(fd, 0, 0, size) != 0:
        import ctypes

        code = ctypes.get_errno()
        if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise OSError(code, os.strerror(code))
        log.debug("fallocate: %s; the file grows as it is written", os.strerror(code))


@functools.lru_cache(maxsize=None)
def _fallocate() -> Any:
    """libc's fallocate(2) wrapper, or None where there is none (not Linux, not glibc)."""
    import ctypes

    try:
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    return fallocate


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)
