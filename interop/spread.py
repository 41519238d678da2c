"""One output written by many processes: a byte plan over its tensor files, and the writer that carries it out.

Why byte ranges rather than whole tensors or files: balance. A 70B Llama's universal checkpoint is ~840 GB of fp32
weights and Adam moments in a few hundred shards, and its largest tensor (the fp32 embedding, 4.2 GB) is five times
a 1,000-rank mean share; whole files or tensors leave most ranks idle and a few writing for minutes. The plan cuts
the concatenation of every file's bytes (header, then tensor data, file after file) into ``world`` equal, page-aligned
ranges, so each process writes the same number of bytes whatever the tensor sizes, and every byte exactly once.

The files are the single-process writer's, byte for byte: the same shards, headers and names (``interop.universal``
plans them; this module only decides who writes which bytes). Digests: a tensor written whole by one rank is hashed
as it is written; a tensor split between ranks is hashed by the rank holding its first byte, reading what was
written back (from the page cache); the file digest is computed from the header and the gathered tensor digests, as
``interop.digests`` defines it, so the manifest is the single-process one.

Every rank reads the source itself (a shared filesystem is assumed, as for ``torchrun`` on several machines); the
first rank creates the files at their final size and, after all have written, commits the output.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from . import digests
from .commit import staged_output
from .dist import Collective, agree
from .errors import OutputWriteError
from .output_files import copy_at, piece_runs, pwrite_all, start_writeback
from .safetensors_io import FETCH_AHEAD_BYTES, TensorEntry, WrittenFile, composite_of, fetch_pieces, hash_pieces, header_bytes, write_safetensors
from .tensors import sub_pieces

log = logging.getLogger(__name__)

ALIGN = 4096  # cut points fall on page boundaries of the byte stream


@dataclass(frozen=True)
class FileLayout:
    """What the plan needs of one output file: its header's length and its tensors' names and sizes, in order."""

    rel: str
    header: int
    tensors: tuple[tuple[str, int], ...]

    @property
    def size(self) -> int:
        return self.header + sum(n for _, n in self.tensors)


@dataclass(frozen=True)
class Span:
    """``length`` bytes of file ``rel`` at ``offset``: bytes ``start``.. of tensor ``tensor`` (None: of the header)."""

    rel: str
    offset: int
    length: int
    tensor: str | None
    start: int


def plan_spans(files: list[FileLayout], world: int) -> list[list[Span]]:
    """Each rank's spans: rank r writes bytes [cut(r), cut(r+1)) of the files' concatenation, cut(r) = r/world of the
    total rounded down to a page. Depends on sizes only, so every rank computes the same plan (and a test can plan
    a 1,000-rank conversion from metadata)."""
    total = sum(f.size for f in files)
    cuts = [min(total, (r * total // world) // ALIGN * ALIGN) for r in range(world)] + [total]
    plan: list[list[Span]] = [[] for _ in range(world)]
    rank, base = 0, 0  # base: the stream offset where the current file starts
    for f in files:
        pieces = [(None, f.header)] + list(f.tensors)
        offset = 0  # in the file
        for name, nbytes in pieces:
            start = 0
            while start < nbytes:
                position = base + offset + start
                while cuts[rank + 1] <= position:
                    rank += 1
                length = min(nbytes - start, cuts[rank + 1] - position)
                plan[rank].append(Span(f.rel, offset + start, length, name, start))
                start += length
            offset += nbytes
        base += f.size
    return plan


@dataclass
class TensorFile:
    """A safetensors file to write: the path relative to the output, its tensors in order, its header metadata."""

    rel: str
    entries: list[TensorEntry]
    metadata: dict[str, str] | None = None


class Spread:
    """The processes writing one output together: rank 0 leads (staging, small files, the manifest, the commit)."""

    def __init__(self, collective: Collective):
        self.collective = collective

    @property
    def rank(self) -> int:
        return self.collective.rank

    @property
    def world_size(self) -> int:
        return self.collective.world_size

    @property
    def leads(self) -> bool:
        return self.collective.rank == 0

    def agree(self, error: BaseException | None, payload: Any = None, what: str = "conversion") -> list[Any]:
        """Every rank's payload, or on every rank the first failure (its own exception where it failed itself)."""
        from .errors import ConversionError

        return agree(self.collective, error, payload, ConversionError, what)

    def each(self, what: str, work: Callable[[], Any]) -> list[Any]:
        """``work()`` on this rank, and every rank's result (sent to all: small ones only); a failure on any rank is
        raised on every rank, once all have tried (none is left waiting in a collective)."""
        return self.agree(*_attempt(work), what)


def _attempt(work: Callable[[], Any]) -> tuple[BaseException | None, Any]:
    try:
        return None, work()
    except Exception as exc:  # noqa: BLE001 - every rank learns of it
        return exc, None


def leads(spread: Spread | None) -> bool:
    """This process writes what one process writes for all (small files, the manifest): alone, or rank 0."""
    return spread is None or spread.leads


def together(spread: Spread | None, what: str, work: Callable[[], Any]) -> Any:
    """``work()``'s result on this rank: raised as it is in one process; with several, a failure on any rank is
    raised on every rank, once all have tried."""
    if spread is None:
        return work()
    error, result = _attempt(work)
    spread.agree(error, what=what)
    return result


def write_tensor_files(out: str, files: list[TensorFile], hashed: bool = True,
                       on_tensor: Callable[[TensorEntry], None] | None = None, spread: Spread | None = None) -> dict[str, WrittenFile]:
    """Write ``files`` under ``out``: one after another in one process, or each rank its share of the bytes."""
    for f in files if leads(spread) else []:
        os.makedirs(os.path.dirname(os.path.join(out, f.rel)), exist_ok=True)
    if spread is None or spread.world_size == 1:
        return {f.rel: write_safetensors(os.path.join(out, f.rel), f.entries, f.metadata, on_tensor, hashed) for f in files}
    headers = {f.rel: header_bytes(f.entries, f.metadata) for f in files}
    layouts = [FileLayout(f.rel, len(headers[f.rel]), tuple((e.name, e.spec.nbytes) for e in f.entries)) for f in files]
    plan = plan_spans(layouts, spread.world_size)
    mine = plan[spread.rank]
    spans_of: dict[tuple[str, str], int] = {}
    first_rank: dict[tuple[str, str], int] = {}
    for r, spans in enumerate(plan):
        for s in spans:
            if s.tensor is not None:
                spans_of[(s.rel, s.tensor)] = spans_of.get((s.rel, s.tensor), 0) + 1
                first_rank.setdefault((s.rel, s.tensor), r)

    # every rank planned from its own read of the source: the same bytes, or nothing is written
    import hashlib

    fingerprint = hashlib.sha256(repr([(f.rel, f.tensors) for f in layouts]).encode() + b"".join(headers.values())).hexdigest()

    def create() -> str:
        for f in layouts if spread.leads else []:  # the files at their final size: every rank writes its own ranges
            path = os.path.join(out, f.rel)
            try:
                with open(path, "wb") as fh:
                    fh.truncate(f.size)
            except OSError as exc:
                raise OutputWriteError.of(path, exc) from None
        return fingerprint

    prints = spread.each("creating the output files", create)
    if len(set(prints)) > 1:
        from .errors import ConversionError

        raise ConversionError(f"the processes read different tensors from the source (ranks planned {len(set(prints))} "
                              "different outputs): is every process reading the same files?")

    entries = {(f.rel, e.name): e for f in files for e in f.entries}
    tensor_digests = together(spread, "writing", lambda: _write_spans(out, mine, headers, entries, spans_of, hashed, on_tensor))

    def hash_split() -> dict[tuple[str, str], str]:
        """The tensors split between ranks, each hashed whole by the rank with its first byte."""
        for f in layouts if hashed else []:
            offset = f.header
            for name, nbytes in f.tensors:
                key = (f.rel, name)
                if spans_of.get(key, 0) > 1 and first_rank[key] == spread.rank:
                    tensor_digests[key] = _hash_range(os.path.join(out, f.rel), offset, nbytes)
                offset += nbytes
        return tensor_digests

    found: dict[tuple[str, str], str] = {}
    for part in spread.each("hashing", hash_split):
        found.update(part)
    for f in files:  # a tensor of no bytes has no span: its digest is that of nothing
        for e in f.entries:
            if e.spec.nbytes == 0:
                found[(f.rel, e.name)] = digests.of_bytes(b"")
                if on_tensor is not None and spread.leads:
                    on_tensor(e)
    written = {}
    for f, layout in zip(files, layouts):
        by_name = {e.name: found[(f.rel, e.name)] for e in f.entries} if hashed else {}
        digest = composite_of(headers[f.rel], list(by_name.values())) if hashed else ""
        written[f.rel] = WrittenFile(os.path.join(out, f.rel), layout.size, digest, by_name)
    return written


def _write_spans(out: str, spans: list[Span], headers: dict[str, bytes], entries: dict[tuple[str, str], TensorEntry],
                 spans_of: dict[tuple[str, str], int], hashed: bool, on_tensor) -> dict[tuple[str, str], str]:
    """This rank's spans, each file fsynced; the digests of the tensors it wrote whole. The tensors after the one
    being written are fetched (their source bytes checked) meanwhile, as one process's safetensors writer does."""
    from concurrent.futures import ThreadPoolExecutor

    from .hashed_writes import fetched_ahead

    fds: dict[str, int] = {}
    sources: dict[str, int] = {}  # mapped source files copied from, open
    done: dict[tuple[str, str], str] = {}

    def fetch(span: Span) -> list | None:  # on the pool: a tensor's pieces, None for a header's span
        if span.tensor is None:
            return None
        try:
            return fetch_pieces(entries[(span.rel, span.tensor)])
        except OSError as exc:
            raise OutputWriteError.of(os.path.join(out, span.rel), exc) from None

    def size(span: Span) -> int:
        return entries[(span.rel, span.tensor)].spec.nbytes if span.tensor is not None else 0

    def write(span: Span, pieces: list | None) -> None:
        if span.rel not in fds:
            fds[span.rel] = os.open(os.path.join(out, span.rel), os.O_WRONLY)
        fd = fds[span.rel]
        if pieces is None:
            pwrite_all(fd, memoryview(headers[span.rel])[span.start:span.start + span.length], span.offset)
            return
        key = (span.rel, span.tensor)
        try:
            at = span.offset
            for piece in sub_pieces(pieces, span.start, span.start + span.length):
                if copy_at(fd, at, piece, sources) is None:  # (else a mapped source's range, copied file to file)
                    into = at
                    for run in piece_runs(piece, sources):
                        pwrite_all(fd, run, into)
                        into += len(run)
                at += piece.data.nbytes
            start_writeback(fd, span.offset, span.length)
            if spans_of[key] == 1:
                if hashed:
                    done[key] = digests.label(digests.ALGO, hash_pieces(pieces).hex())
                if on_tensor is not None:
                    on_tensor(entries[key])
        finally:
            for p in pieces:
                if p.release is not None:
                    p.release()  # out of this process's memory, still in the page cache

    try:
        with ThreadPoolExecutor(1, thread_name_prefix="spans") as pool, \
                contextlib.closing(fetched_ahead(spans, fetch, pool, size, FETCH_AHEAD_BYTES)) as fetched:
            for span, pieces in zip(spans, fetched):
                try:
                    write(span, pieces)
                except OSError as exc:
                    raise OutputWriteError.of(os.path.join(out, span.rel), exc) from None
                del pieces
        for rel, fd in fds.items():
            try:
                os.fsync(fd)
            except OSError as exc:
                raise OutputWriteError.of(os.path.join(out, rel), exc) from None
    finally:
        for fd in (*fds.values(), *sources.values()):
            os.close(fd)
    return done


def _hash_range(path: str, offset: int, length: int) -> str:
    """The digest of bytes ``offset:offset+length`` of an output file, read back (a tensor other processes wrote some of)."""
    h = digests.hasher()
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            got = digests.hash_range(h, fd, offset, length, memoryview(bytearray(digests.HASH_READ)))
        finally:
            os.close(fd)
    except OSError as exc:
        raise OutputWriteError.of(path, exc) from None
    if got < length:
        raise OutputWriteError(path, "ended early while hashing what was written")
    return digests.label(digests.ALGO, h.hexdigest())


@contextlib.contextmanager
def spread_output(dst: str, overwrite: bool, spread: Spread | None) -> Iterator[str]:
    """``staged_output`` for an output many processes write: the lead holds the destination's lock and the staging
    directory, every rank gets its path; the output is published only when every rank's part succeeded, and a
    failure on any rank leaves ``dst`` as it was and raises on every rank."""
    if spread is None or spread.world_size == 1:
        with staged_output(dst, overwrite) as out:
            yield out
        return
    staging = staged_output(dst, overwrite) if spread.leads else None
    out = spread.each("preparing the output", staging.__enter__ if staging is not None else lambda: None)[0]
    failure: BaseException | None = None
    try:
        yield out
    except Exception as exc:  # noqa: BLE001 - raised below, on every rank
        failure = exc
    try:
        spread.agree(failure, what="converting")
    except BaseException as exc:
        if staging is not None:
            staging.__exit__(type(exc), exc, exc.__traceback__)  # removes the staging directory
        raise
    together(spread, "publishing the output", lambda: staging.__exit__(None, None, None) if staging is not None else None)  # fsync, publish
