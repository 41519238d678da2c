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
import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from . import digests
from .commit import staged_output
from .dist import Collective, agree
from .errors import OutputWriteError
from .safetensors_io import TensorEntry, WrittenFile, fetch_pieces, hash_pieces, header_bytes, write_safetensors
from .tensors import raw_bytes

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


def write_tensor_files(out: str, files: list[TensorFile], hashed: bool = True,
                       on_tensor: Callable[[TensorEntry], None] | None = None, spread: Spread | None = None) -> dict[str, WrittenFile]:
    """Write ``files`` under ``out``: one after another in one process, or each rank its share of the bytes."""
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
    fingerprint = hashlib.sha256(repr([(f.rel, f.tensors) for f in layouts]).encode() + b"".join(headers.values())).hexdigest()
    error = None
    if spread.leads:  # the files at their final size, so every rank writes into its own ranges
        try:
            for f in layouts:
                path = os.path.join(out, f.rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as fh:
                    fh.truncate(f.size)
        except OSError as exc:
            error = OutputWriteError.of(os.path.join(out, f.rel), exc)
    prints = spread.agree(error, fingerprint, what="creating the output files")
    if len(set(prints)) > 1:
        from .errors import ConversionError

        raise ConversionError(f"the processes read different tensors from the source (ranks planned {len(set(prints))} "
                              "different outputs): is every process reading the same files?")

    entries = {(f.rel, e.name): e for f in files for e in f.entries}
    error, tensor_digests = None, {}
    try:
        tensor_digests = _write_spans(out, mine, headers, entries, spans_of, hashed, on_tensor)
    except Exception as exc:  # noqa: BLE001 - every rank learns of it
        error = exc
    spread.agree(error, what="writing")

    error = None
    if hashed:  # the tensors split between ranks, each hashed whole by the rank with its first byte
        try:
            offsets = {(f.rel, name): (f.header + sum(n for _, n in f.tensors[:i]), nbytes)
                       for f in layouts for i, (name, nbytes) in enumerate(f.tensors)}
            for key, count in spans_of.items():
                if count > 1 and first_rank[key] == spread.rank:
                    tensor_digests[key] = _hash_range(os.path.join(out, key[0]), *offsets[key])
        except Exception as exc:  # noqa: BLE001
            error = exc
    gathered = spread.agree(error, tensor_digests, what="hashing")
    found: dict[tuple[str, str], str] = {}
    for part in gathered:
        found.update(part)
    for f in files:  # a tensor of no bytes has no span: its digest is that of nothing
        for e in f.entries:
            if e.spec.nbytes == 0:
                found[(f.rel, e.name)] = digests.of_bytes(b"")
                if on_tensor is not None and spread.leads:
                    on_tensor(e)
    written = {}
    for f in files:
        by_name = {e.name: found[(f.rel, e.name)] for e in f.entries} if hashed else {}
        digest = ""
        if hashed:
            h = digests.hasher()
            h.update(headers[f.rel])
            for e in f.entries:
                h.update(bytes.fromhex(by_name[e.name].split(":", 1)[1]))
            digest = digests.label(digests.ALGO, h.hexdigest(), composite=True)
        written[f.rel] = WrittenFile(os.path.join(out, f.rel), next(x.size for x in layouts if x.rel == f.rel), digest, by_name)
    return written


def _write_spans(out: str, spans: list[Span], headers: dict[str, bytes], entries: dict[tuple[str, str], TensorEntry],
                 spans_of: dict[tuple[str, str], int], hashed: bool, on_tensor) -> dict[tuple[str, str], str]:
    """This rank's spans, each file fsynced; the digests of the tensors it wrote whole."""
    fds: dict[str, int] = {}
    done: dict[tuple[str, str], str] = {}
    try:
        for span in spans:
            path = os.path.join(out, span.rel)
            if span.rel not in fds:
                fds[span.rel] = os.open(path, os.O_WRONLY)
            fd = fds[span.rel]
            try:
                if span.tensor is None:
                    _pwrite_all(fd, memoryview(headers[span.rel])[span.start:span.start + span.length], span.offset)
                    continue
                key = (span.rel, span.tensor)
                entry = entries[key]
                data = [raw_bytes(p) for p in fetch_pieces(entry)]
                position = 0  # in the tensor's bytes, across its pieces
                for view in data:
                    lo, hi = max(span.start, position), min(span.start + span.length, position + len(view))
                    if lo < hi:
                        _pwrite_all(fd, view[lo - position:hi - position], span.offset + lo - span.start)
                    position += len(view)
                if spans_of[key] == 1:
                    if hashed:
                        done[key] = digests.label(digests.ALGO, hash_pieces(data).hex())
                    if on_tensor is not None:
                        on_tensor(entry)
                del data
            except OSError as exc:
                raise OutputWriteError.of(path, exc) from None
        for rel, fd in fds.items():
            try:
                os.fsync(fd)
            except OSError as exc:
                raise OutputWriteError.of(os.path.join(out, rel), exc) from None
    finally:
        for fd in fds.values():
            os.close(fd)
    return done


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _hash_range(path: str, offset: int, length: int) -> str:
    h = digests.hasher()
    with open(path, "rb") as f:
        f.seek(offset)
        while length:
            chunk = f.read(min(length, 8 << 20))
            if not chunk:
                raise OutputWriteError(path, "ended early while hashing what was written")
            h.update(chunk)
            length -= len(chunk)
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
    staging = None
    error: BaseException | None = None
    if spread.leads:
        staging = staged_output(dst, overwrite)
        try:
            out = staging.__enter__()
        except Exception as exc:  # noqa: BLE001 - every rank learns of it
            error, staging = exc, None
            out = None
    else:
        out = None
    out = spread.agree(error, out, what="preparing the output")[0]
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
    error = None
    if staging is not None:
        try:
            staging.__exit__(None, None, None)  # fsync, publish
        except Exception as exc:  # noqa: BLE001
            error = exc
    spread.agree(error, what="publishing the output")
