"""Work on a writer's bytes beside its writes: one thread hashes what was just written (a file's digest for the
manifest, taken from memory instead of reading the finished file back) and checks sources' digests, in the order
it is handed them, while the writer goes on to its next bytes. Hashing (BLAKE3) and writing both release the GIL,
so on two cores the digest costs the writer no time."""

from __future__ import annotations

import contextlib
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, Callable, Iterator

from . import digests, written_digests
from .errors import CorruptCheckpointError, OutputWriteError
from .tensors import LazyTensor, Piece, raw_bytes


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
    (a :class:`digests.BlockHasher`) on the :class:`Beside` thread. A mapped source's bytes (:meth:`write_piece`)
    are copied file to file in the kernel. The caller must not change a buffer after writing it. Writeback starts
    every ``writeback`` bytes, so the final fsync waits for little. A failed write or sync is an
    :class:`OutputWriteError` naming the file (and only these: a source's read failing is not the output's).

    Small writes (a torch.save archive's headers, a pickle) are copied into one batch that the hasher gets when it
    fills, or before the next large write: handing each to the thread on its own cost more than hashing it."""

    SMALL = 64 << 10

    def __init__(self, f: BinaryIO, beside: Beside, hasher: Any, path: str, writeback: int = 64 << 20):
        self._f, self.beside, self._hasher, self.path = f, beside, hasher, path
        self.sources: dict[str, int] = {}  # mapped source files copied from, open (closed by hashed_output)
        self._writeback, self._dirty_from = writeback, 0
        self._pos = f.tell()  # kept here: a buffered file's tell() is a system call
        self._batch = bytearray()

    def write(self, data: Any) -> int:
        try:
            n = self._f.write(data)
        except OSError as exc:
            raise OutputWriteError.of(self.path, exc) from None
        return self._written(data, n)

    def write_piece(self, piece: Piece) -> int:
        """``piece``'s bytes: copied from its file in the kernel where it is a view of a mapped file (no copy
        through this process), else written from memory."""
        try:
            n = write_piece(self._f, piece, self.sources)
        except OSError as exc:
            raise OutputWriteError.of(self.path, exc) from None
        return self._written(piece.data, n)

    def _written(self, data: Any, n: int) -> int:
        self._pos += n
        if n < self.SMALL:
            self._batch += data
            if len(self._batch) >= self.SMALL:
                self._hash_batch()
            return n
        self._hash_batch()
        self.beside.submit(self._hasher.update, data, nbytes=n)
        if self._pos - self._dirty_from >= self._writeback:
            try:
                start_writeback(self._f, self._dirty_from, self._pos - self._dirty_from)
            except OSError as exc:
                raise OutputWriteError.of(self.path, exc) from None
            self._dirty_from = self._pos
        return n

    def _hash_batch(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, bytearray()
            self.beside.submit(self._hasher.update, batch, nbytes=len(batch))

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        self._hash_batch()
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


@contextlib.contextmanager
def hashed_output(path: str) -> Iterator[HashedFile]:
    """``path`` opened for writing as a :class:`HashedFile` with its own :class:`Beside` thread (``.beside``, for
    the writer's own work on its bytes); once the block ends without error, its digest is recorded for the manifest
    (:func:`written_digests.record`). The caller flushes (or syncs) before the block ends."""
    hasher = digests.BlockHasher()
    try:
        raw = open(path, "wb")
    except OSError as exc:
        raise OutputWriteError.of(path, exc) from None
    with Beside() as beside, raw:
        f = HashedFile(raw, beside, hasher, path)
        with closing_fds(f.sources):
            yield f
            f.flush()  # the last small writes to the hasher
    written_digests.record(path, hasher.digest())


# --- a LazyTensor's bytes, streamed ---------------------------------------------------------------------------
def tensor_bytes(lazy: LazyTensor, beside: Beside, ahead: Any) -> Iterator[Any]:
    """A tensor's bytes in order: its parts' one after another where it has parts (each one index of its leading
    dimensions, or a block of its rows; and theirs where they have parts: a layer of a stack made of runs of its
    sources' rows); each part's (or its own) as views of a mapped source where it has them, their digest checked
    beside the writes (the mapped pages let go once checked), else the loaded tensor's (``load`` checks the
    digest). The next part is fetched on ``ahead`` (one thread) while this one is written: reading, hashing and
    fusing overlap the writes."""
    parts = _leaves(lazy)
    pending = ahead.submit(_fetch, parts[0]) if parts else None
    for i, part in enumerate(parts):
        fetched = pending.result()
        pending = ahead.submit(_fetch, parts[i + 1]) if i + 1 < len(parts) else None
        if not isinstance(fetched, list):  # a loaded tensor
            yield raw_bytes(fetched)
            continue
        h = digests.hasher() if part.digest is not None else None
        for p in fetched:
            if h is not None:
                beside.submit(h.update, p.data, nbytes=p.data.nbytes)
            yield p  # a view of a mapped file: copied file to file
        beside.submit(_checked, part, h, fetched)


def _leaves(lazy: LazyTensor) -> list[LazyTensor]:
    """The tensor's parts, theirs in turn where they have parts, in order; each checked to be a part of its whole."""
    if lazy.parts is None:
        return [lazy]
    parts = list(lazy.parts())
    whole = lazy.spec.shape
    for part in parts:  # one index of the whole's leading dimensions (a layer, an expert of a layer), a block of its rows,
        shape = part.spec.shape  # or a run of its elements (1-D)
        fits = (shape == whole[len(whole) - len(shape):] if len(shape) < len(whole) else (len(shape) == len(whole) and shape[1:] == whole[1:])
                ) or len(shape) == 1
        if part.spec.dtype_name != lazy.spec.dtype_name or not fits:
            raise CorruptCheckpointError(part.origin, f"is {part.spec.describe()}, not a part of {lazy.origin} ({lazy.spec.describe()})")
    total = sum(p.spec.nbytes for p in parts)
    if total != lazy.spec.nbytes:
        raise CorruptCheckpointError(lazy.origin, f"its parts hold {total} bytes; {lazy.spec.describe()} is {lazy.spec.nbytes}")
    return [leaf for part in parts for leaf in _leaves(part)]


def _fetch(part: LazyTensor) -> Any:
    """A part's mapped pieces (their digest is checked as they are written), or where it has none (or a digest
    of another algorithm than the one hashed beside the writes) the part loaded and checked."""
    pieces = part.mapped_pieces() if part.mapped_pieces is not None else None
    if pieces is not None and (part.digest is None or digests.parse(part.digest, part.origin)[0] == digests.ALGO):
        if sum(p.data.nbytes for p in pieces) != part.spec.nbytes:
            raise CorruptCheckpointError(part.origin, f"its mapped bytes do not make up {part.spec.describe()}")
        return pieces
    tensor = part.load()
    if tuple(tensor.shape) != part.spec.shape or tensor.dtype != part.spec.dtype:
        raise CorruptCheckpointError(part.origin, f"is {tensor.dtype}{list(tensor.shape)}, expected {part.spec.describe()}")
    return tensor


def _checked(part: LazyTensor, h: Any, pieces: list) -> None:
    """A mapped part's bytes, hashed as they were written, against the digest its manifest records; then its
    mapped pages let go (out of this process's memory, still in the page cache)."""
    if h is not None:
        part.check_digest(digests.label(digests.ALGO, h.hexdigest()))
    for p in pieces:
        if p.release is not None:
            p.release()


# --- writing helpers shared with the safetensors writer ----------------------------------------------------------
def write_piece(f, piece: Piece, sources: dict[str, int]) -> int:
    """``piece``'s bytes at ``f``'s position: copied from its file in the kernel where it is a view of a mapped file
    (:func:`copy_range`), else written from memory; the bytes written."""
    copied = copy_range(f, piece, sources)
    return f.write(piece.data) if copied is None else copied


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
    try:
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


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
    path, source_offset, inode = piece.source
    if path not in sources:
        sources[path] = os.open(path, os.O_RDONLY)
    if os.fstat(sources[path]).st_ino != inode:  # replaced since it was mapped: the mapping's bytes are the ones hashed
        return None
    done, remaining = 0, piece.data.nbytes
    try:
        while remaining:
            n = os.copy_file_range(sources[path], fd, remaining, source_offset + done, offset + done)
            if n == 0:
                raise OSError(f"{path}: ended {remaining} bytes early")
            done += n
            remaining -= n
    except OSError:
        if done:
            raise
        return None  # nothing copied: written the ordinary way
    return done
