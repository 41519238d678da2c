"""Output files written in order: large ones with direct I/O (``O_DIRECT``), their bytes going from a few aligned
buffers straight to the disk; small ones, and any on a filesystem without direct I/O, through the page cache.

Why direct: a buffered write copies every byte into a page-cache page that the kernel must allocate, account,
mark dirty and later write back. Converting a 257M model to one 1 GiB Hugging Face file on a 2-core machine, that
bookkeeping cost as much CPU as the copy itself and took the core that the source's digest check needed (1 GiB
copied file to file and fsynced: 0.65-1.2 s and about 0.75 core-s; the same bytes written direct from 4-8 MiB
buffers, three writes in flight: 0.40-0.46 s and about 0.2 core-s, in one run beside each other). The bytes are
gathered into the buffers with one copy (``pread`` from a mapped piece's file, else from memory) and written on
threads, several writes in flight, into a file allocated at its final size where that is known (ext4 takes
extending direct writes one at a time).

Where direct I/O is not to be had (tmpfs, some network filesystems) a file of known size is written by
:class:`BufferedFile` (mapped pieces copied file to file in the kernel, ``copy_file_range``, unless the writer must
see their bytes); where the device refuses a direct write, the same buffers go through the page cache. The bytes
are the same whichever way they went.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import mmap
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterable, Iterator

from . import digests
from .errors import CorruptCheckpointError, OutputWriteError
from .tensors import Piece

log = logging.getLogger(__name__)

Seen = Callable[[memoryview], "Future | None"]  # handed a run of a piece's bytes as written (see DirectFile.write_piece)

ALIGN = max(4096, mmap.PAGESIZE)  # offsets and buffer sizes: a multiple of any logical block size short of 8 KiB, and of
# the page (a direct write and a page-cache write never share one: on a 64 KiB-page kernel either could undo the other)
CHUNK = 8 << 20  # one write (two of the virtio disk's largest requests here)
IN_FLIGHT = 4  # writes at a time (40 MiB of buffers with the one being filled); 4 MiB x 3 took 5-10% longer here
DIRECT_FROM = 64 << 20  # smaller files go through the page cache: too little to gain, and a reader soon after finds them there
WRITEBACK = 64 << 20  # a buffered file starts writing back every this many bytes, so its final fsync waits for little


UNLOCKED_COPY = 256 << 10  # a copy this large or larger lets the GIL go (see copy_into)


def copy_into(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src``, with the GIL let go for a large copy: ``ctypes.memmove`` releases it, where a slice
    assignment copies holding it. A background commit writes a staged state through these buffers beside a training
    thread that launches kernels from Python: holding the GIL for each 8 MiB buffer's copy made a launch-bound loop
    beside a 1 GiB commit 1.8-2.5x slower. Only contiguous views of bytes are moved so (a read-only source has no
    address ctypes may take; a strided one or one of wider items is not one run of bytes): the rest is copied as a
    slice."""
    n = src.nbytes
    if (n < UNLOCKED_COPY or src.readonly or not (src.c_contiguous and dst.c_contiguous)
            or src.format != "B" or dst.format != "B"):
        dst[:] = src
        return
    if dst.nbytes != n:
        raise ValueError(f"copy_into: {dst.nbytes} bytes to fill from {n}")
    # each buffer's first byte as a c_char (one type: an array type per length would be cached for good, one per
    # size a conversion copies), held while memmove runs
    into, start = ctypes.c_char.from_buffer(dst), ctypes.c_char.from_buffer(src)
    try:
        ctypes.memmove(ctypes.addressof(into), ctypes.addressof(start), n)
    finally:
        into = start = None  # the buffer exports end here, not when the collector finds them


class BufferedFile:
    """An output file written through the page cache: mapped pieces copied file to file in the kernel (or read into
    a few buffers and written from them, where the writer hashes them: ``seen``), writeback started as it goes."""

    direct = False

    def __init__(self, path: str, size: int | None = None):
        self.path, self.size = path, size
        try:
            self._f = open(path, "wb")
        except OSError as exc:
            raise OutputWriteError.of(path, exc) from None
        self._sources: dict[str, int] = {}
        self._pos = self._dirty_from = 0
        self._read: deque[tuple[bytearray, Future | None]] = deque()  # buffers a source was read into, what holds each

    def write(self, data: Any) -> int:
        return self._advance(self._f.write(data))

    def write_piece(self, piece: Piece, seen: Seen | None = None) -> int:
        """``piece``'s bytes: copied file to file in the kernel where it is a view of a mapped file; with ``seen``
        (which is handed the bytes as written), read from its file a MiB at a time into fresh buffers and written
        from them."""
        if seen is None:
            return self._advance(write_piece(self._f, piece, self._sources))
        fd = source_fd(piece, self._sources)
        if fd is None:
            data = piece.bytes_view
            self._f.write(data)
            seen(data)
            return self._advance(data.nbytes)
        path, offset, _ = piece.source
        n, done = piece.data.nbytes, 0
        while done < n:
            buffer = self._read_buffer()
            with memoryview(buffer) as view:
                run = view[:min(len(buffer), n - done)]
                read_run(fd, run, path, offset + done, n - done)
                self._f.write(run)
                self._read.append((buffer, seen(run)))
            done += len(run)
        return self._advance(n)

    def _read_buffer(self) -> bytearray:
        """A buffer to read a source's bytes into: the oldest once nothing holds it, else a new one (three at most)."""
        if self._read and (len(self._read) >= 3 or self._read[0][1] is None or self._read[0][1].done()):
            buffer, held = self._read.popleft()
            if held is not None:
                wait([held])
            return buffer
        return bytearray(digests.read_size())

    def _advance(self, n: int) -> int:
        self._pos += n
        if self._pos - self._dirty_from >= WRITEBACK:
            start_writeback(self._f, self._dirty_from, self._pos - self._dirty_from)
            self._dirty_from = self._pos
        return n

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        """What was written is in the file, and on its way to disk (a small file's whole: the commit's fsync of a
        ds-universal checkpoint's 600 files then waits for what the disk has mostly done)."""
        self._f.flush()
        start_writeback(self._f, self._dirty_from, self._pos - self._dirty_from)
        self._dirty_from = self._pos

    def sync(self) -> None:
        self.flush()
        _check_size(self.path, self._pos, self.size)
        os.fsync(self._f.fileno())

    def close(self) -> None:
        try:
            self._f.close()
        finally:
            _close_all(self._sources.values())


class DirectFile:
    """An output file written in order with direct I/O (see the module's docstring), from byte ``start`` on (the
    bytes before it already in the file: see :class:`GrowingFile`): ``size`` bytes in all, allocated up front, or
    where the size is not known, as many as are written. ``write`` and ``write_piece`` copy into the buffer being
    filled; a full buffer is written on a thread while the next fills. ``flush`` writes what was handed over (at
    the end: what follows it cannot go direct), ``sync`` flushes and fsyncs; an error of a write on a thread is
    raised there or at the next buffer taken. Open it with :func:`open_output`.

    ``write_piece``'s ``seen`` is handed each run of the piece's bytes where it lies in a buffer, and may return a
    future: the buffer is not filled again until that is done (work on the bytes beside the writes, a digest, reads
    them where the write reads them, with no copy and no other read)."""

    def __init__(self, path: str, size: int | None, fd: int, direct_fd: int | None, start: int = 0):
        self.path, self.size = path, size
        self._plain = fd  # the file without O_DIRECT: a last partial block, or all once a device refuses direct writes
        self._direct_fd = direct_fd
        self.direct = direct_fd is not None
        self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="direct-writes")
        self._pending: deque[tuple[Future, mmap.mmap, list[Future]]] = deque()  # a write, its buffer, what holds it
        self._holds: list[Future] = []  # what holds the buffer being filled (see ``write_piece``)
        self._spare: list[mmap.mmap] = []
        self._buffer: mmap.mmap | None = None
        self._offset = start - start % ALIGN  # where the buffer being filled goes in the file: a block's start
        self._fill = 0  # bytes in the buffer being filled
        self._sources: dict[str, int] = {}
        if size is not None:
            _preallocate(fd, size)
        if start > self._offset:  # the start of its block, already written, read back to go out again with the rest
            with memoryview(self._take()) as view:
                got = os.preadv(fd, [view[:start - self._offset]], self._offset)
            if got != start - self._offset:
                raise OSError(errno.EIO, f"read back {got} of the {start - self._offset} bytes before byte {start}")
            self._fill = got

    def tell(self) -> int:
        return self._offset + self._fill

    def write(self, data: Any, seen: Seen | None = None) -> int:
        """``data``'s bytes copied into the buffers (each run handed to ``seen`` where it lies)."""
        with memoryview(data) as view:
            flat = view if view.format == "B" and view.ndim == 1 else view.cast("B")
            n, done = flat.nbytes, 0
            while done < n:
                buffer = self._take()
                take = min(CHUNK - self._fill, n - done)
                with memoryview(buffer) as into:
                    run = into[self._fill:self._fill + take]
                    copy_into(run, flat[done:done + take])
                    if seen is not None:
                        self._hold(seen(run))
                self._filled(take)
                done += take
        return n

    def write_piece(self, piece: Piece, seen: Seen | None = None) -> int:
        """``piece``'s bytes: read from its file where it is a view of a mapped file (no page faults, no copy
        under the GIL), else copied from memory; each run of them handed to ``seen`` where it lies."""
        fd = source_fd(piece, self._sources)
        if fd is None:
            return self.write(piece.data, seen)
        path, offset, _ = piece.source
        n, done = piece.data.nbytes, 0
        while done < n:
            buffer = self._take()
            take = min(CHUNK - self._fill, n - done)
            with memoryview(buffer) as view:
                run = view[self._fill:self._fill + take]
                read_run(fd, run, path, offset + done, n - done)
                if seen is not None:
                    self._hold(seen(run))
            self._filled(take)
            done += take
        return n

    def _hold(self, future: Future | None) -> None:
        if future is not None:
            self._holds.append(future)

    def _take(self) -> mmap.mmap:
        """The buffer being filled; a fresh one (or one whose write has finished) when there is none."""
        if self._buffer is None:
            while self._pending and (len(self._pending) >= IN_FLIGHT or _all_done(self._pending[0])):
                self._recycle()
            self._buffer = self._spare.pop() if self._spare else mmap.mmap(-1, CHUNK)
        return self._buffer

    def _recycle(self) -> None:
        """The oldest write waited for, and its buffer a spare once nothing holds it (the holds' errors are their
        owner's to raise; a buffer whose write failed or was interrupted goes when unreferenced)."""
        future, buffer, holds = self._pending.popleft()
        future.result()
        wait(holds)
        self._spare.append(buffer)

    def _filled(self, n: int) -> None:
        self._fill += n
        if self._fill == CHUNK:
            self._submit()

    def _submit(self) -> None:
        buffer, n, offset = self._buffer, self._fill, self._offset
        self._pending.append((self._pool.submit(self._write_out, buffer, n, offset), buffer, self._holds))
        self._buffer, self._fill, self._offset, self._holds = None, 0, offset + n, []

    def _write_out(self, buffer: mmap.mmap, n: int, offset: int) -> None:
        """One buffer's ``n`` bytes at ``offset``: the whole blocks direct, a last partial block (or everything,
        once the device has refused a direct write, or after a flush left the file mid-block) through the page cache."""
        with memoryview(buffer) as view:
            done = 0
            if self.direct and offset % ALIGN == 0:
                try:
                    done = n - n % ALIGN
                    pwrite_all(self._direct_fd, view[:done], offset)
                except OSError as exc:
                    if exc.errno not in _NO_DIRECT:
                        raise
                    log.debug("%s: direct writes refused (%s); written through the page cache", self.path, exc.strerror)
                    self.direct, done = False, 0
            if done < n:
                pwrite_all(self._plain, view[done:n], offset + done)

    def flush(self) -> None:
        if self._fill:
            self._submit()
        while self._pending:
            self._recycle()

    def sync(self) -> None:
        self.flush()
        _check_size(self.path, self._offset, self.size)
        os.fsync(self._plain)

    def close(self) -> None:
        try:
            self._pool.shutdown(wait=True, cancel_futures=True)
        finally:
            for buffer in (*self._spare, *(b for _, b, _ in self._pending), *([self._buffer] if self._buffer is not None else [])):
                try:
                    buffer.close()
                except BufferError:  # a view of it lives on in a failed write's traceback: the buffer goes with that
                    pass
            _close_all([self._plain, *([self._direct_fd] if self._direct_fd is not None else []), *self._sources.values()])


class GrowingFile:
    """An output file whose size is known only at its end (a torch.save archive): through the page cache
    (:class:`BufferedFile`) up to DIRECT_FROM bytes, then direct (:class:`DirectFile`, from where the first file
    left off) where the filesystem takes it. Most such files are small (a rank's RNG state, a scheduler, one of a
    ds-universal checkpoint's 600 per-parameter files) and gain nothing from direct writes; a large one is mostly
    past the mark."""

    def __init__(self, path: str):
        self.path = path
        self._file: BufferedFile | DirectFile = BufferedFile(path)
        self._grown = False

    @property
    def direct(self) -> bool:
        return self._file.direct

    def write(self, data: Any) -> int:
        return self._grow(self._file.write(data))

    def write_piece(self, piece: Piece, seen: Seen | None = None) -> int:
        return self._grow(self._file.write_piece(piece, seen))

    def _grow(self, n: int) -> int:
        if not self._grown and self._file.tell() >= DIRECT_FROM:
            self._grown = True
            self._file.flush()
            direct_fd = _open_direct(self.path)
            if direct_fd is not None:
                fds = [direct_fd]
                try:
                    fds.append(os.open(self.path, os.O_RDWR))  # (the block's start is read back)
                    direct = DirectFile(self.path, None, fds[1], direct_fd, self._file.tell())
                except BaseException:
                    _close_all(fds)
                    raise
                buffered, self._file = self._file, direct
                buffered.close()
        return n

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        self._file.flush()

    def sync(self) -> None:
        self._file.sync()

    def close(self) -> None:
        self._file.close()


def open_output(path: str, size: int | None = None) -> DirectFile | BufferedFile | GrowingFile:
    """``path`` created for bytes written in order: direct where the file is large enough to gain (``size``, or
    where it is not known, once it has grown past DIRECT_FROM: :class:`GrowingFile`) and the filesystem takes
    direct I/O, else through the page cache."""
    if not hasattr(os, "O_DIRECT") or (size is not None and size < DIRECT_FROM):
        return BufferedFile(path, size)
    if size is None:
        return GrowingFile(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    except OSError as exc:
        raise OutputWriteError.of(path, exc) from None
    direct_fd = None
    try:
        direct_fd = _open_direct(path)
        if direct_fd is None:  # this filesystem takes no direct I/O: the kernel copies file to file
            os.close(fd)
            return BufferedFile(path, size)
        return DirectFile(path, size, fd, direct_fd)
    except BaseException:
        _close_all([fd, *([direct_fd] if direct_fd is not None else [])])
        raise


def _all_done(pending: tuple[Future, Any, list[Future]]) -> bool:
    """A buffer's write is done and nothing holds it."""
    return pending[0].done() and all(f.done() for f in pending[2])


def _open_direct(path: str) -> int | None:
    """``path`` opened again for direct writes, or None where its filesystem takes none (tmpfs, some network and
    FUSE filesystems)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno not in _NO_DIRECT:
            raise
        return None


_NO_DIRECT = (errno.EINVAL, errno.EOPNOTSUPP)  # a filesystem or device that takes no direct I/O (or not this alignment)


# --- writing a piece or a range -------------------------------------------------------------------------------
def write_piece(f, piece: Piece, sources: dict[str, int]) -> int:
    """``piece``'s bytes at ``f``'s position: copied from its file in the kernel where it is a view of a mapped file
    (:func:`copy_range`), else read from it (:func:`piece_runs`) or written from memory; the bytes written."""
    copied = copy_range(f, piece, sources)
    if copied is not None:
        return copied
    for run in piece_runs(piece, sources):
        f.write(run)
    return piece.data.nbytes


READ_RUN = 8 << 20  # a mapped piece's bytes read from its file at a time (piece_runs)


def piece_runs(piece: Piece, sources: dict[str, int]) -> Iterator[memoryview]:
    """``piece``'s bytes in order: read from its file READ_RUN at a time into one buffer where it is a view of a
    mapped file (each run good until the next is asked for; a file cut short since it was mapped is an error naming
    it, where reading its mapping would kill the process with SIGBUS), else its memory in one run."""
    fd = source_fd(piece, sources)
    if fd is None:
        yield piece.bytes_view
        return
    n = piece.data.nbytes
    path, offset, _ = piece.source
    buffer = memoryview(bytearray(min(n, READ_RUN)))
    for lo in range(0, n, READ_RUN):
        run = buffer[:min(READ_RUN, n - lo)]
        read_run(fd, run, path, offset + lo, n - lo)
        yield run


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """All of ``view`` at ``offset`` of ``fd`` (a write may take less than it is given)."""
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def start_writeback(f, offset: int, length: int) -> None:
    """Start writing this range of ``f`` (a file, flushed first, or a descriptor) to disk now (Linux: DONTNEED on
    dirty pages initiates writeback), so the final fsync waits for little and a large save does not pile up dirty
    pages until the kernel throttles."""
    if hasattr(os, "posix_fadvise") and length:
        if not isinstance(f, int):
            f.flush()
            f = f.fileno()
        os.posix_fadvise(f, offset, length, os.POSIX_FADV_DONTNEED)


@contextlib.contextmanager
def closing_fds(fds: dict[str, int]):
    """``fds`` (open source files by path) all closed when the block ends."""
    try:
        yield fds
    finally:
        _close_all(fds.values())


def copy_range(f, piece: Piece, sources: dict[str, int]) -> int | None:
    """Write ``piece``, a view of a mapped file, at ``f``'s position by copying its file range in the kernel (no
    page faults, no copy through this process); the bytes written, or None when it is not (see :func:`copy_at`)."""
    if piece.source is None or not hasattr(os, "copy_file_range"):
        return None
    f.flush()
    start = f.tell()
    copied = copy_at(f.fileno(), start, piece, sources)
    if copied is not None:
        f.seek(start + copied)
    return copied


def copy_at(fd: int, offset: int, piece: Piece, sources: dict[str, int]) -> int | None:
    """Copy ``piece``, a view of a mapped file, to ``fd`` at ``offset`` in the kernel; the bytes written, or None
    when nothing was (not a mapped view, the file replaced since it was mapped, another filesystem, an old kernel):
    the caller writes the bytes from memory."""
    if piece.source is None or not hasattr(os, "copy_file_range"):
        return None
    source = source_fd(piece, sources)
    if source is None:
        return None
    path, source_offset, _ = piece.source
    done, remaining = 0, piece.data.nbytes
    try:
        while remaining:
            n = os.copy_file_range(source, fd, remaining, source_offset + done, offset + done)
            if n == 0:  # the source was cut short since it was mapped (its mapping would fault)
                raise _cut_short(path, remaining)
            done += n
            remaining -= n
    except OSError:
        if done:
            raise
        return None  # nothing copied: written the ordinary way
    return done


def read_source(fd: int, view: memoryview, offset: int) -> int:
    """A mapped piece's bytes read from its file into a write's buffer (not through the mapping: no page faults,
    and the GIL is let go); the bytes read, fewer than asked only where the file ends."""
    return digests.read_exactly(fd, view, offset)


def read_run(fd: int, run: memoryview, path: str, offset: int, left: int) -> None:
    """Fill ``run`` with a mapped piece's bytes from its file at ``offset`` (``left`` of the piece's bytes to come):
    a file that ends first was cut short since it was mapped, one error naming it."""
    try:
        got = read_source(fd, run, offset)
    except OSError as exc:
        raise _unreadable(path, offset, exc) from None
    if got < len(run):
        raise _cut_short(path, left - got)


def read_piece(piece: Piece, into: memoryview, sources: dict[str, int]) -> None:
    """Fill ``into`` (a flat, writable run of ``piece``'s size) with ``piece``'s bytes: read from its file where it
    is a view of a mapped file (no page faults; a file cut short since it was mapped is an error naming it, where
    copying from its mapping would kill the process with SIGBUS), else copied from memory."""
    if not len(into):
        return
    fd = source_fd(piece, sources)
    if fd is None:
        copy_into(into, piece.bytes_view)
        return
    path, offset, _ = piece.source
    read_run(fd, into, path, offset, len(into))


def read_pieces(pieces: Iterable[Piece], into: memoryview) -> None:
    """Fill ``into`` (flat and writable) with ``pieces``' bytes one after another, each as :func:`read_piece` reads
    it, their files opened and closed here."""
    with closing_fds({}) as sources:
        at = 0
        for piece in pieces:
            n = piece.data.nbytes
            read_piece(piece, into[at:at + n], sources)
            at += n
    if at != len(into):
        raise ValueError(f"read_pieces: {at} bytes of pieces for {len(into)}")


def hash_piece(h: Any, piece: Piece, sources: dict[str, int], buffer: bytearray) -> None:
    """Feed ``piece``'s bytes to the hash ``h``: read from its file a ``buffer`` at a time where it is a view of a
    mapped file (the same bytes a writer reads there; no page faults, and a file cut short since it was mapped is
    an error naming it, where its mapping would kill the process with SIGBUS), else from memory."""
    fd = source_fd(piece, sources)
    if fd is None:
        h.update(piece.data)
        return
    path, offset, _ = piece.source
    n = piece.data.nbytes
    try:
        got = digests.hash_range(h, fd, offset, n, memoryview(buffer))
    except OSError as exc:
        raise _unreadable(path, offset, exc) from None
    if got < n:
        raise _cut_short(path, n - got)


def _unreadable(path: str, offset: int, exc: OSError) -> CorruptCheckpointError:
    return CorruptCheckpointError(path, f"cannot be read from byte {offset}: {exc.strerror}")


def _cut_short(path: str, missing: int) -> CorruptCheckpointError:
    """A mapped source that ends before the bytes it was mapped with (cut short since)."""
    return CorruptCheckpointError(path, f"ended {missing} bytes early (shortened while it was read)")


def source_fd(piece: Piece, sources: dict[str, int]) -> int | None:
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
        libc = ctypes.CDLL(None, use_errno=True)
        fallocate = getattr(libc, "fallocate64", None) or libc.fallocate  # (64-bit offsets on a 32-bit build too)
    except (OSError, AttributeError):
        return None
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    return fallocate


def _close_all(fds: Iterable[int]) -> None:
    """Close every one; the first error raised after."""
    error = None
    for fd in fds:
        try:
            os.close(fd)
        except OSError as exc:
            error = error or exc
    if error is not None:
        raise error


def _check_size(path: str, written: int, size: int | None) -> None:
    """A file opened for ``size`` bytes holds that many (a preallocated one would look whole either way)."""
    if size is not None and written != size:
        raise OutputWriteError(path, f"was given {written} bytes for its {size} (a writer's error)")


@contextlib.contextmanager
def closing(out: "BufferedFile | DirectFile | GrowingFile", path: str) -> Iterator[Any]:
    """``out`` closed when the block ends: a failure to close is the output's error where the block succeeded, and
    does not hide the block's own error where it failed."""
    try:
        yield out
    except BaseException:
        with contextlib.suppress(OSError):
            out.close()
        raise
    try:
        out.close()
    except OSError as exc:
        raise OutputWriteError.of(path, exc) from None
