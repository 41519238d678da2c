"""Digests a manifest records for files and tensors, and recomputing them by the algorithm that wrote them.

A digest is ``<algorithm>:<hex>``. New checkpoints use XXH3-128 (``xxh128``, from xxhash): a digest against
corruption, not tampering. Whoever can rewrite a checkpoint's files can rewrite its manifest beside them, so a
cryptographic hash buys nothing there unless the manifest is pinned somewhere else; and XXH3 hashes at memory
speed (25 GB/s on one core here against BLAKE3's 5 and sha256's 1.8), which is the CPU a save takes beside
training and a conversion beside its writes. ``INTEROP_DIGEST=blake3`` (or ``sha256``) writes collision-resistant
digests instead, for a manifest whose own digest is kept apart. Digests of every algorithm here are checked by
their own, whatever wrote them.

A safetensors file's digest (``<algorithm>-st:``) is the hash of its header (length prefix and JSON, padding
included) followed by the raw digest of each tensor's bytes in file order, so a writer hashes every byte once
and gets the file's and every tensor's digest together.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple

from .errors import ConfigurationError, CorruptCheckpointError

DIGEST_ENV = "INTEROP_DIGEST"  # the algorithm new digests are taken with (default ``xxh128``)
COMPOSITE_SUFFIX = "-st"
BLOCKS_SUFFIX = "-blocks"
BLOCK_BYTES = 16 << 20  # a file larger than one block is recorded block by block (FileRecord.blocks)
PLAIN, COMPOSITE, BLOCKS = "", COMPOSITE_SUFFIX, BLOCKS_SUFFIX  # the kinds of digest parse() tells apart


def _blake3() -> Any:
    import blake3

    return blake3.blake3()


def _sha256() -> Any:
    import hashlib  # (2-5 ms of every start-up that never takes a sha256)

    return hashlib.sha256()


def _xxh128() -> Any:
    import xxhash

    return xxhash.xxh3_128()


_HASHERS: dict[str, Callable[[], Any]] = {"xxh128": _xxh128, "blake3": _blake3, "sha256": _sha256}
_HEX_LENGTH = {"xxh128": 32, "blake3": 64, "sha256": 64}


def _chosen() -> str:
    algo = os.environ.get(DIGEST_ENV) or "xxh128"
    if algo not in _HASHERS:
        raise ConfigurationError(f"{DIGEST_ENV}={algo!r}: no such digest algorithm (known: {', '.join(_HASHERS)})")
    return algo


ALGO = _chosen()
_FORMAT = re.compile(r"^([a-z0-9]+)(-st|-blocks)?:([0-9a-f]+)$")


def hasher(algo: str = ALGO) -> Any:
    """A fresh hash object (``update``, ``digest``, ``hexdigest``) of ``algo``."""
    try:
        return _HASHERS[algo]()
    except KeyError:
        raise ValueError(f"unknown digest algorithm {algo!r} (known: {', '.join(_HASHERS)})") from None


def parse(digest: str, where: str = "") -> tuple[str, str]:
    """(algorithm, kind: PLAIN, COMPOSITE or BLOCKS) of a recorded digest; a malformed one is a corrupt manifest
    entry."""
    m = _FORMAT.match(digest) if isinstance(digest, str) else None
    if m is None or m.group(1) not in _HASHERS or len(m.group(3)) != _HEX_LENGTH[m.group(1)]:
        raise CorruptCheckpointError(where or None, f"malformed digest {digest!r} (expected <algorithm>:<hex>, one of {', '.join(_HASHERS)})")
    return m.group(1), m.group(2) or PLAIN


def label(algo: str, hexdigest: str, kind: str = PLAIN) -> str:
    """``<algorithm><kind>:<hex>``, kind one of PLAIN, COMPOSITE, BLOCKS."""
    return f"{algo}{kind}:{hexdigest}"


# --- files recorded block by block -----------------------------------------------------------------------------
# A large file's digest is the hash of its blocks' digests (the record's block_bytes each, BLOCK_BYTES when written,
# the last one shorter), and the record keeps each block's: a reader that uses part of the file (a ZeRO file's fp32 weights, a third of it) checks only
# the blocks it reads (:mod:`interop.ranged`), and the blocks of one file are hashed side by side on every core.
def of_blocks(block_digests: list[str], algo: str = ALGO) -> str:
    h = hasher(algo)
    for d in block_digests:
        h.update(bytes.fromhex(d))
    return label(algo, h.hexdigest(), BLOCKS)


def block_count(size: int, block_bytes: int) -> int:
    return max(1, -(-size // block_bytes))


def read_exactly(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset`` with pread (threads may share ``fd``; one read returns at most about
    2 GiB on Linux); the bytes read, fewer only where the file ends first."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


HASH_READ = 1 << 20  # a block is read and hashed this much at a time: the bytes are still in the core's cache when
# they are hashed (a 16 MiB block read whole, then hashed, went through memory twice; side by side with a writer's
# copies on two cores, memory is what they wait for)


def hash_block(fd: int, index: int, block_bytes: int, algo: str = ALGO, buffer: bytearray | None = None) -> tuple[str, int]:
    """(hex digest, bytes read) of block ``index`` of the open file ``fd`` (:func:`hash_range`, into ``buffer`` or
    one of HASH_READ bytes); fewer bytes only where the file ends first."""
    h = hasher(algo)
    view = memoryview(buffer if buffer is not None else bytearray(min(HASH_READ, block_bytes)))
    got = hash_range(h, fd, index * block_bytes, block_bytes, view)
    return h.hexdigest(), got


def hash_range(h: Any, fd: int, offset: int, length: int, view: memoryview) -> int:
    """Feed ``length`` bytes of the open file ``fd`` from ``offset`` to the hash ``h``, read with pread (threads
    share ``fd``) ``view``'s length at a time; the bytes fed, fewer only where the file ends first."""
    if not len(view) and length:
        raise ValueError("hash_range needs a buffer of at least one byte")
    done = 0
    while done < length:
        want = min(len(view), length - done)
        got = read_exactly(fd, view[:want], offset + done)
        h.update(view[:got])
        done += got
        if got < want:
            break
    return done


class FileDigest(NamedTuple):
    digest: str
    blocks: list[str] | None = None  # each block's digest, for a file hashed by blocks
    block_bytes: int | None = None


_LIMIT = threading.local()


@contextlib.contextmanager
def beside_training(threads: int, read_bytes: int):
    """Within it, digests taken on this thread use at most ``threads`` threads, each reading and hashing
    ``read_bytes`` at a time (a background commit's: see ``interop.background``): a training thread shares the GIL
    with them, and each thread takes it back once per read."""
    if threads < 1 or read_bytes < 1:
        raise ValueError(f"beside_training({threads}, {read_bytes}): at least one thread reads at least one byte")
    before = getattr(_LIMIT, "pace", None)
    _LIMIT.pace = (threads, read_bytes)
    try:
        yield
    finally:
        _LIMIT.pace = before


def default_threads() -> int:
    """Every core, or fewer where :func:`beside_training` says so for this thread."""
    cores = os.cpu_count() or 1
    pace = getattr(_LIMIT, "pace", None)
    return min(cores, pace[0]) if pace else cores


def read_size() -> int:
    """How much a digest reads and hashes at a time on this thread: HASH_READ, or what :func:`beside_training` says."""
    pace = getattr(_LIMIT, "pace", None)
    return pace[1] if pace else HASH_READ


def of_files(paths: list[str], algo: str = ALGO, threads: int | None = None,
             blocked: bool | None = None, block_bytes: int | None = None) -> dict[str, FileDigest]:
    """Each file's digest: a file of one block or less gets a plain digest, a larger one its blocks' digests and
    the digest of them (``blocked`` True or False: every file one way, as a record being checked says; ``block_bytes``:
    the record's block size, else BLOCK_BYTES). Every block of every file is one task on ``threads`` threads
    (:func:`default_threads`: every core), so one large file is hashed on every core."""
    from concurrent.futures import ThreadPoolExecutor

    block_bytes = block_bytes or BLOCK_BYTES
    sizes = {p: os.path.getsize(p) for p in paths}
    out: dict[str, FileDigest] = {}
    large = [p for p in paths if (sizes[p] > block_bytes if blocked is None else blocked)]
    chosen = set(large)
    small = [p for p in paths if p not in chosen]
    fds = {p: os.open(p, os.O_RDONLY) for p in large}
    local = threading.local()
    read = min(read_size(), block_bytes)  # the caller's: the pool's threads have none of its thread-locals

    def block(task: tuple[str, int]) -> str:
        path, index = task
        if getattr(local, "buffer", None) is None:
            local.buffer = bytearray(read)
        digest, got = hash_block(fds[path], index, block_bytes, algo, local.buffer)
        if got != min(block_bytes, sizes[path] - index * block_bytes):
            raise CorruptCheckpointError(path, f"changed size while it was hashed (block {index} read {got} bytes)")
        return digest

    tasks = [(p, i) for p in large for i in range(block_count(sizes[p], block_bytes))]
    threads = threads or default_threads()
    try:
        if threads == 1:  # on the caller's thread: no pool to start for a small file
            plain = [of_file(p, algo) for p in small]
            hashed = [block(t) for t in tasks]
        else:
            with ThreadPoolExecutor(threads) as pool:
                plain = list(pool.map(lambda p: of_file(p, algo), small))
                hashed = list(pool.map(block, tasks))
        out.update(zip(small, (FileDigest(d) for d in plain)))
    finally:
        for fd in fds.values():
            os.close(fd)
    done = 0
    for p in large:
        n = block_count(sizes[p], block_bytes)
        blocks = hashed[done : done + n]
        done += n
        out[p] = FileDigest(of_blocks(blocks, algo), blocks, block_bytes)
    return {p: out[p] for p in paths}


class BlockHasher:
    """A file's digest as :func:`of_files` takes it (plain up to one block, else by blocks), from the file's bytes
    fed in order as they are written: a writer that has the bytes in memory hashes them there, not by reading
    the finished file back."""

    def __init__(self, algo: str = ALGO, block_bytes: int = BLOCK_BYTES):
        self.algo, self.block_bytes = algo, block_bytes
        self.blocks: list[str] = []
        self.total = self.filled = 0
        self._h = hasher(algo)

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.block_bytes - self.filled)
            self._h.update(view[:take])
            view, self.filled, self.total = view[take:], self.filled + take, self.total + take
            if self.filled == self.block_bytes:
                self.blocks.append(self._h.hexdigest())
                self._h, self.filled = hasher(self.algo), 0

    def digest(self) -> FileDigest:
        if self.total <= self.block_bytes:
            return FileDigest(label(self.algo, self.blocks[0] if self.blocks else self._h.hexdigest()))
        blocks = self.blocks + ([self._h.hexdigest()] if self.filled else [])
        return FileDigest(of_blocks(blocks, self.algo), blocks, self.block_bytes)


def of_bytes(data: bytes | memoryview, algo: str = ALGO) -> str:
    h = hasher(algo)
    h.update(data)
    return label(algo, h.hexdigest())


_CHUNK = 64 << 20


def of_file(path: str, algo: str = ALGO) -> str:
    """The plain digest of a whole file's bytes: the one :func:`hash_ahead` computed if the file is the same file,
    unchanged (inode, size, modification and change times), else computed now."""
    ahead = _AHEAD.pop(os.path.abspath(path), None)
    if ahead is not None and ahead[0] == algo:
        try:
            identity, digest = ahead[1].result()
        except Exception:  # noqa: BLE001 - unsettled or unreadable: computed again below, where an error is raised for what it is
            identity = digest = None
        if identity is not None and identity == _identity(path):
            return digest
    return _of_file(path, algo)


def _of_file(path: str, algo: str) -> str:
    with open(path, "rb") as f:
        return _of_handle(f, algo)


def _of_handle(f: Any, algo: str) -> str:
    """Read into one reused buffer (resident memory stays at one chunk; reading and BLAKE3 / sha256 release the
    GIL). Not through a map: a file shortened meanwhile would kill the process with SIGBUS, where a read ends
    short and the digest simply differs."""
    h = hasher(algo)
    buffer = bytearray(max(1, min(_CHUNK, os.fstat(f.fileno()).st_size)))  # a small file: no 64 MiB to zero
    view = memoryview(buffer)
    while n := f.readinto(buffer):
        h.update(view[:n])
    return label(algo, h.hexdigest())


# --- digests started early -------------------------------------------------------------------------------
# path -> (algorithm, the (identity, digest) to come: see _hash_if_settled)
_AHEAD: dict[str, tuple[str, Future]] = {}


def _identity(path: str) -> tuple[int, ...] | None:
    try:
        return _of_stat(os.stat(path))
    except OSError:
        return None


def _of_stat(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


RACY_SECONDS = 2.0  # a file changed this recently may change again within its timestamps' resolution (git's rule)


def _hash_if_settled(path: str, algo: str) -> tuple[tuple[int, ...], str]:
    """(identity, digest) of the file as hashed through one handle: the identity is the handle's, taken before
    and after hashing, and the digest is refused (ValueError: of_file hashes again) if the file changed while it
    was read or had changed too recently for its times to show a later change."""
    import time

    with open(path, "rb") as f:
        before = _of_stat(os.fstat(f.fileno()))
        if time.time() - max(before[3], before[4]) / 1e9 < RACY_SECONDS:
            raise ValueError(f"{path}: changed {RACY_SECONDS} s ago or less")
        digest = _of_handle(f, algo)
        if _of_stat(os.fstat(f.fileno())) != before:
            raise ValueError(f"{path}: changed while it was read")
    return before, digest


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def hash_ahead(files: list[tuple[str, str]], threads: int | None = None) -> None:
    """Start digesting ``files`` ((path, algorithm), largest first) on ``threads`` daemon threads (default: one
    per core: a conversion that reads without torch waits for them, one that imports torch shares the cores)
    now, for :func:`of_file` to take later. Why: a conversion's first second may be spent importing torch, and
    checking the source's digests (which needs no torch) fits beside it. Nothing is trusted early: a digest
    is only a digest of the bytes, compared with the manifest where it always was; a file changed since, while
    it was hashed or shortly before (its times could hide a later change) is hashed again. The threads are
    daemons: an early exit does not wait for them."""
    pending = []
    for path, algo in files:
        key = os.path.abspath(path)
        if key in _AHEAD or algo not in _HASHERS:
            continue  # asked twice: already under way
        future: Future = Future()
        _AHEAD[key] = (algo, future)
        pending.append((_size(path), path, algo, future))
    pending.sort(key=lambda p: -p[0])
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not pending:
                    return
                _, path, algo, future = pending.pop(0)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(_hash_if_settled(path, algo))
            except BaseException as exc:  # noqa: BLE001 - handed to of_file, which hashes again
                future.set_exception(exc)

    threads = threads or os.cpu_count() or 1
    for i in range(min(threads, len(pending))):
        threading.Thread(target=work, name=f"digest-ahead-{i}", daemon=True).start()
