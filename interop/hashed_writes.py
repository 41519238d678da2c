"""Work on a writer's bytes beside its writes: one thread hashes what was just written (a file's digest for the
manifest, taken from memory instead of reading the finished file back) and checks sources' digests, in the order
it is handed them, while the writer goes on to its next bytes. Hashing (BLAKE3) and writing both release the GIL,
so on two cores the digest costs the writer no time."""

from __future__ import annotations

import contextlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, NamedTuple, Sequence, TypeVar

from . import digests, written_digests
from .errors import CorruptCheckpointError, OutputWriteError
from .output_files import closing, open_output
from .tensors import LazyTensor, Piece, raw_bytes


T, R = TypeVar("T"), TypeVar("R")


def fetched_ahead(items: Sequence[T], fetch: Callable[[T], R], pool: Any, size: Callable[[T], int], limit: int) -> Iterator[R]:
    """``fetch(item)`` of each item, in order, each run on ``pool`` ahead of its turn: after the one handed out, the
    next ones are fetched meanwhile while those under way hold less than ``limit`` bytes (``size`` of each), and
    always the next one. A writer writes one while the next are read and checked; fetches not begun when the
    consumer stops (an error) are cancelled, not run for nothing."""
    pending: deque[tuple[Future, int]] = deque()
    held = upto = 0

    def top_up() -> None:
        nonlocal held, upto
        while upto < len(items) and (not pending or held < limit):
            n = size(items[upto])
            pending.append((pool.submit(fetch, items[upto]), n))
            held, upto = held + n, upto + 1

    try:
        top_up()
        while pending:
            future, n = pending.popleft()
            held -= n
            fetched = future.result()
            top_up()
            yield fetched
    finally:
        for future, _ in pending:
            future.cancel()


class Beside:
    """One thread that works through what the writer hands it, in order. A buffer handed over stays alive (the
    task holds it) until the task has run; at most ``limit`` bytes wait. An error there is raised in the writer at
    its next hand-over, or when the block ends."""

    def __init__(self, limit: int = 256 << 20):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hashed-writes")
        self._pending: deque = deque()
        self._bytes, self._limit = 0, limit

    def submit(self, fn: Callable[..., Any], *args: Any, nbytes: int = 0) -> Future:
        """Run ``fn(*args)`` on the thread after what was handed over before; its future. An earlier task's error
        is raised here before this one is handed over (so a future returned is always the caller's to hold)."""
        while self._pending and (self._pending[0][0].done() or self._bytes + nbytes > self._limit):
            done, n = self._pending.popleft()
            self._bytes -= n
            done.result()
        future = self._pool.submit(fn, *args)
        self._pending.append((future, nbytes))
        self._bytes += nbytes
        return future

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
    """The output file ``path``, open for writing as ``out`` (an :mod:`interop.output_files` file: direct once it is
    large, else through the page cache), whose written bytes are also fed, in order, to ``hasher`` (a
    :class:`digests.BlockHasher`) on the :class:`Beside` thread. A mapped source's bytes (:meth:`write_source`) are
    read from its file, not through the mapping, and hashed where the write takes them (the output file holds that
    buffer until they are). The caller must not change a buffer after writing it. A failed
    write or sync is an :class:`OutputWriteError` naming the file (and only these: a source's read failing is not
    the output's).

    Small writes (a torch.save archive's headers, a pickle) are copied into one batch that the hasher gets when it
    fills, or before the next large write: handing each to the thread on its own cost more than hashing it."""

    SMALL = 64 << 10

    def __init__(self, out: Any, beside: Beside, hasher: Any, path: str):
        self._out, self.beside, self._hasher, self.path = out, beside, hasher, path
        self._batch = bytearray()

    def write(self, data: Any) -> int:
        try:
            n = self._out.write(data)
        except OSError as exc:
            raise OutputWriteError.of(self.path, exc) from None
        return self._written(data, n)

    def write_source(self, piece: Piece, check: Any = None, each_run: Callable[[memoryview], None] | None = None) -> int:
        """``piece``'s bytes (a mapped source's: read from its file), fed to this file's hasher and to ``check`` (the
        source's digest check) where they lie as they are written; ``each_run`` (the caller's, on this thread: a
        CRC) is handed each run of them first."""
        self._hash_batch()

        def fed(run: memoryview) -> Future:
            if each_run is not None:
                each_run(run)
            return self.beside.submit(_update, self._hasher, check, run, nbytes=len(run))

        try:
            return self._out.write_piece(piece, fed)
        except OSError as exc:
            raise OutputWriteError.of(self.path, exc) from None

    def _written(self, data: Any, n: int) -> int:
        if n < self.SMALL:
            self._batch += data
            if len(self._batch) >= self.SMALL:
                self._hash_batch()
            return n
        self._hash_batch()
        self.beside.submit(self._hasher.update, data, nbytes=n)
        return n

    def _hash_batch(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, bytearray()
            self.beside.submit(self._hasher.update, batch, nbytes=len(batch))

    def tell(self) -> int:
        return self._out.tell()

    def flush(self) -> None:
        """Everything handed over is in the file (at the end: a direct file's later bytes could not go direct)."""
        self._hash_batch()
        try:
            self._out.flush()
        except OSError as exc:
            raise OutputWriteError.of(self.path, exc) from None

    def sync(self) -> None:
        """Flush and fsync: the bytes are on disk when this returns."""
        self._hash_batch()
        try:
            self._out.sync()
        except OSError as exc:
            raise OutputWriteError.of(self.path, exc) from None


def _update(hasher: Any, also: Any, data: memoryview) -> None:
    hasher.update(data)
    if also is not None:
        also.update(data)


@contextlib.contextmanager
def hashed_output(path: str) -> Iterator[HashedFile]:
    """``path`` opened for writing as a :class:`HashedFile` with its own :class:`Beside` thread (``.beside``, for
    the writer's own work on its bytes); once the block ends without error, its digest is recorded for the manifest
    (:func:`written_digests.record`). The caller flushes (or syncs) before the block ends."""
    hasher = digests.BlockHasher()
    with closing(open_output(path), path) as out, Beside() as beside:
        f = HashedFile(out, beside, hasher, path)
        yield f
        f.flush()  # the last bytes written, and handed to the hasher
    written_digests.record(path, hasher.digest())


# --- a LazyTensor's bytes, streamed ---------------------------------------------------------------------------
class SourceBytes(NamedTuple):
    """A run of a tensor's bytes in a mapped source, to be read from its file (:meth:`HashedFile.write_source`) and
    fed to ``check`` (the hash of the source's digest check, or None) as written: a consumer that does not feed it
    gets a digest error for bytes it did not check."""

    piece: Piece
    check: Any


def tensor_bytes(lazy: LazyTensor, beside: Beside, ahead: Any) -> Iterator[Any]:
    """A tensor's bytes in order: its parts' one after another where it has parts (each one index of its leading
    dimensions, or a block of its rows; and theirs where they have parts: a layer of a stack made of runs of its
    sources' rows); each part's (or its own) as :class:`SourceBytes` where it is in mapped sources, their digest
    checked on ``beside`` once written (the writer feeds the check), else the loaded tensor's bytes (``load``
    checks the digest). The next part is fetched on ``ahead`` (one thread) while this one is written: reading,
    hashing and fusing overlap the writes.

    Why the writer feeds the check: it reads the bytes from the source's file into its buffer, and the hashes take
    them there, in the core's cache, with no second read, no page faults, and no SIGBUS from a source cut short
    since it was mapped (an error naming it instead)."""
    parts = _leaves(lazy)
    for part, fetched in zip(parts, fetched_ahead(parts, _fetch, ahead, lambda p: p.spec.nbytes, limit=1)):  # one ahead
        if not isinstance(fetched, list):  # a loaded tensor
            yield raw_bytes(fetched)
            continue
        h = digests.hasher() if part.digest is not None else None
        for p in fetched:
            yield SourceBytes(p, h)
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
