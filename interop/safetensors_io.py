"""safetensors files read and written by hand.

Why not ``safetensors.torch``: writing must stream tensor by tensor (the header is planned from specs, then
each tensor is fetched, written, hashed and dropped), and reading must validate the header against the file
size so a truncated or corrupt file gives an error naming the file instead of a crash. The byte layout is the
standard one, so transformers and safetensors read what we write.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from . import digests
from .dtypes import name_of_st_code, st_code
from .errors import CorruptCheckpointError, MissingFileError, OutputWriteError
from .jsonio import loads as json_loads
from .jsonio import read_json
from .paths import inside
from .lazy_import import torch
from .digests import read_exactly
from .output_files import closing, closing_fds, hash_piece, open_output
from .tensors import LazyTensor, Piece, TensorSpec, unfilled_bytes

_MAX_HEADER = 100 * 1024 * 1024
# A writer fetches tensors ahead of the one it writes (their source bytes checked against the manifest, mapped or
# loaded) while those under way hold less than this: one at a time left the writer waiting on each small tensor's
# source check (a MoE's 4 MiB experts, each new 16 MiB block hashed as it was reached), 0.17 s of a 0.95 s export
FETCH_AHEAD_BYTES = 64 << 20


@dataclass
class TensorEntry:
    """One tensor to write: its name and spec up front (for the header), its bytes fetched when written."""

    name: str
    spec: TensorSpec
    fetch: Callable[[], torch.Tensor]
    mapped_pieces: Callable[[], list[Piece] | None] | None = None  # LazyTensor.mapped_pieces: written without a copy


@dataclass
class WrittenFile:
    path: str
    nbytes: int
    digest: str
    tensor_digests: dict[str, str] = field(default_factory=dict)


def header_bytes(entries: list[TensorEntry], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for entry in entries:
        if entry.name in header or entry.name == "__metadata__":
            raise ValueError(f"duplicate tensor name {entry.name!r}")
        size = entry.spec.nbytes
        header[entry.name] = {
            "dtype": st_code(entry.spec.dtype_name),
            "shape": list(entry.spec.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the reference implementation aligns the data section to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


_HASH_BUFFER = threading.local()  # each hashing thread's read buffer, kept between tensors


def hash_pieces(pieces: list[Piece], algo: str = digests.ALGO) -> bytes:
    """The raw ``algo`` digest of the pieces' bytes in order (a mapped piece's read from its file: see
    :func:`output_files.hash_piece`)."""
    h = digests.hasher(algo)
    sources: dict[str, int] = {}
    buffer = getattr(_HASH_BUFFER, "buffer", None)
    if buffer is None:
        buffer = _HASH_BUFFER.buffer = bytearray(digests.HASH_READ)
    with closing_fds(sources):
        for piece in pieces:
            hash_piece(h, piece, sources, buffer)
    return h.digest()


def fetch_pieces(entry: TensorEntry) -> list[Piece]:
    """The entry's bytes: mapped views when the source offers them (no torch needed), else one loaded tensor's."""
    pieces = entry.mapped_pieces() if entry.mapped_pieces is not None else None  # None: not viewable after all
    if pieces is not None:
        if sum(p.data.nbytes for p in pieces) != entry.spec.nbytes or any(p.dtype not in (None, entry.spec.dtype_name) for p in pieces):
            raise ValueError(f"{entry.name}: mapped pieces do not make up {entry.spec.describe()}")
        return pieces
    tensor = entry.fetch()
    if tuple(tensor.shape) != entry.spec.shape or tensor.dtype != entry.spec.dtype:
        raise ValueError(f"{entry.name}: source gave {tensor.dtype}{list(tensor.shape)}, expected {entry.spec.describe()}")
    return [Piece.of_tensor(tensor)]


def safetensors_digests(path: str | os.PathLike, algo: str = digests.ALGO) -> tuple[str, dict[str, str]]:
    """The file's composite digest (see ``interop.digests``) and each tensor's digest, by ``algo``, reading
    the file once. The header is validated first, so the tensors are contiguous and in order."""
    st = SafetensorsFile(path)
    tensor_digests: dict[str, str] = {}
    with open(st.path, "rb") as f:
        f.seek(st.data_start)
        for name in st.in_file_order():
            _, begin, end = st._entries[name]
            t = digests.hasher(algo)
            remaining = end - begin
            while remaining:
                chunk = f.read(min(remaining, 8 << 20))
                if not chunk:
                    raise CorruptCheckpointError(st.path, "truncated while hashing")
                t.update(chunk)
                remaining -= len(chunk)
            tensor_digests[name] = digests.label(algo, t.hexdigest())
    return composite_digest(st, tensor_digests, algo), tensor_digests


def composite_digest(st: "SafetensorsFile", tensor_digests: dict[str, str], algo: str) -> str:
    """The file digest of ``st`` from its header bytes and its tensors' digests (as recorded or computed):
    with a manifest's tensor digests this checks every header byte without reading the tensors again."""
    with open(st.path, "rb") as f:
        header = f.read(st.data_start)
    return composite_of(header, [tensor_digests[name] for name in st.in_file_order()], algo)


def composite_of(header: bytes, tensor_digests: list[str], algo: str = digests.ALGO) -> str:
    """A safetensors file's digest (``interop.digests``): its header bytes, then each tensor's raw digest in file order."""
    h = digests.hasher(algo)
    h.update(header)
    for digest in tensor_digests:
        h.update(bytes.fromhex(digest.split(":", 1)[1]))
    return digests.label(algo, h.hexdigest(), digests.COMPOSITE)


def write_safetensors(
    path: str | os.PathLike,
    entries: Iterable[TensorEntry],
    metadata: dict[str, str] | None = None,
    on_tensor: Callable[[TensorEntry], None] | None = None,
    hashed: bool = True,
) -> WrittenFile:
    """Write ``entries`` to ``path`` (see ``_write_safetensors``); a failed write (a full disk) is one error
    naming the file."""
    try:
        return _write_safetensors(path, entries, metadata, on_tensor, hashed)
    except OSError as exc:
        raise OutputWriteError.of(os.fspath(path), exc) from None


def _write_safetensors(
    path: str | os.PathLike,
    entries: Iterable[TensorEntry],
    metadata: dict[str, str] | None = None,
    on_tensor: Callable[[TensorEntry], None] | None = None,
    hashed: bool = True,
) -> WrittenFile:
    """Write ``entries`` to ``path``, fsync before returning. The next tensors are fetched on a worker thread while
    this one is written (:data:`FETCH_AHEAD_BYTES`). With ``hashed`` (file and tensor digests, for a
    manifest) each tensor is hashed on another thread where the output file has its bytes (a mapped source's read
    from its file into the write's buffer: no second read, no page faults), the buffer held until it is; copying,
    hashing and writing all release the GIL."""
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import closing as closed_after

    from .hashed_writes import Beside, fetched_ahead

    entries = list(entries)
    path = os.fspath(path)
    raw_digests: list[Any] = []  # each tensor's raw digest, a future of the hashing thread
    head = header_bytes(entries, metadata)
    with closing(open_output(path, len(head) + sum(e.spec.nbytes for e in entries)), path) as out, \
            ThreadPoolExecutor(1, thread_name_prefix="safetensors") as pool, Beside() as beside, \
            closed_after(fetched_ahead(entries, fetch_pieces, pool, lambda e: e.spec.nbytes, FETCH_AHEAD_BYTES)) as fetched:
        out.write(head)  # (on an error, the fetches not begun are cancelled before the pool is waited for)
        total = len(head)
        for entry, pieces in zip(entries, fetched):
            seen = None
            if hashed:
                h = digests.hasher()
                seen = lambda run, h=h: beside.submit(h.update, run, nbytes=len(run))  # noqa: E731
            for piece in pieces:
                total += out.write_piece(piece, seen)
            if hashed:
                raw_digests.append(beside.submit(h.digest))
            for p in pieces:  # written (and hashed: after its hash, on that thread): out of RSS, still in the page cache
                if p.release is not None and hashed:
                    beside.submit(p.release)
                elif p.release is not None:
                    p.release()
            del pieces
            if on_tensor is not None:
                on_tensor(entry)
        out.sync()
    if not hashed:
        return WrittenFile(path, total, "", {})
    raws = [d.result() for d in raw_digests]
    tensor_digests = {e.name: digests.label(digests.ALGO, raw.hex()) for e, raw in zip(entries, raws)}
    return WrittenFile(path, total, composite_of(head, list(tensor_digests.values())), tensor_digests)


def release_range(mapping, lo: int, hi: int) -> None:
    """Let go of the resident pages wholly inside ``lo .. hi`` of a read-only mapping (a neighbour may share the
    edge pages): they leave this process's RSS and stay in the page cache."""
    import mmap

    page = mmap.PAGESIZE
    start, stop = -(-lo // page) * page, hi // page * page
    if stop > start and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED, start, stop - start)


class SafetensorsFile:
    """A validated safetensors file; tensors are read one by one, never the whole file."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise MissingFileError(self.path, "file not found")
        self.file_size = os.path.getsize(self.path)
        if self.file_size < 8:
            raise CorruptCheckpointError(self.path, f"truncated safetensors file ({self.file_size} bytes, no header)")
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > _MAX_HEADER or 8 + header_len > self.file_size:
                raise CorruptCheckpointError(
                    self.path, f"truncated or corrupt safetensors header (claims {header_len} bytes)"
                )
            raw = f.read(header_len)
        header = json_loads(raw, self.path, "safetensors header")
        if not isinstance(header, dict):
            raise CorruptCheckpointError(self.path, "corrupt safetensors header: not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise CorruptCheckpointError(self.path, "corrupt safetensors header: __metadata__ is not a map of strings")
        self.metadata: dict[str, str] = metadata
        self.data_start = 8 + header_len
        self._map = None  # the whole file mapped (mmap.mmap) on first use by ``mapped``, and the inode mapped
        self._mapping_lock = threading.Lock()
        self._entries: dict[str, tuple[TensorSpec, int, int]] = {
            name: self._entry(name, info) for name, info in header.items()
        }
        self._check_layout(self.file_size - self.data_start)

    def _entry(self, name: str, info: object) -> tuple[TensorSpec, int, int]:
        def ints(value: object) -> bool:
            return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)

        try:
            if not isinstance(info, dict) or not ints(info["shape"]) or not ints(info["data_offsets"]) or len(info["data_offsets"]) != 2:
                raise ValueError("needs dtype, shape and data_offsets [begin, end] of non-negative integers")
            spec = TensorSpec(tuple(info["shape"]), name_of_st_code(info["dtype"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(self.path, f"bad header entry for tensor {name!r}: {exc}") from None
        begin, end = info["data_offsets"]
        if end - begin != spec.nbytes:
            raise CorruptCheckpointError(self.path, f"tensor {name!r}: offsets {begin}..{end} do not fit {spec.describe()}")
        return spec, begin, end

    def _check_layout(self, data_len: int) -> None:
        """The tensors tile the data section exactly, as the safetensors library requires: sorted by offset each
        starts where the previous ended, none overlap (two names on the same bytes) and nothing is left over."""
        position = 0
        for name, (_, begin, end) in sorted(self._entries.items(), key=lambda e: (e[1][1], e[1][2])):
            if begin != position:
                problem = "overlaps the tensor before it" if begin < position else f"leaves a gap of {begin - position} bytes before it"
                raise CorruptCheckpointError(self.path, f"tensor {name!r} at bytes {begin}..{end} {problem}")
            position = end
        if position != data_len:
            what = "truncated: header describes" if position > data_len else "header describes only"
            raise CorruptCheckpointError(self.path, f"{what} {position} bytes of tensor data, the file holds {data_len}")

    def keys(self) -> list[str]:
        return list(self._entries)

    def in_file_order(self) -> list[str]:
        return sorted(self._entries, key=lambda name: (self._entries[name][1], self._entries[name][2]))

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def spec(self, name: str) -> TensorSpec:
        return self._entries[name][0]

    def read(self, name: str) -> torch.Tensor:
        try:
            spec, begin, end = self._entries[name]
        except KeyError:
            raise CorruptCheckpointError(self.path, f"no tensor named {name!r}") from None
        flat, view = unfilled_bytes(end - begin)
        with open(self.path, "rb") as f:
            if read_exactly(f.fileno(), view, self.data_start + begin) != len(view):
                raise CorruptCheckpointError(self.path, f"truncated while reading tensor {name!r}")
        return flat.view(spec.dtype).reshape(spec.shape)

    def lazy(self, name: str) -> LazyTensor:
        return LazyTensor(self.spec(name), lambda: self.read(name), f"{self.path}:{name}", mapped_pieces=lambda: self.mapped(name))

    def mapped(self, name: str) -> list[Piece] | None:
        """The tensor's bytes as a view of the file mapped read-only (LazyTensor.mapped_pieces): a writer copies them
        file to file in the kernel and hashes them without a copy (two copies through this process fewer than
        ``read``) and without torch. None for an empty tensor, or where the file cannot be mapped."""
        import mmap

        spec, begin, end = self._entries[name]
        if end == begin:
            return None
        with self._mapping_lock:
            if self._map is None:
                try:
                    with open(self.path, "rb") as f:
                        self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), os.fstat(f.fileno()).st_ino
                except (OSError, ValueError):
                    return None
        mapping, inode = self._map
        lo, hi = self.data_start + begin, self.data_start + end
        if hi > len(mapping):  # the file shrank since it was checked
            raise CorruptCheckpointError(self.path, f"truncated while reading tensor {name!r}")
        return [Piece(memoryview(mapping)[lo:hi], (self.path, lo, inode), lambda: release_range(mapping, lo, hi), spec.dtype_name)]

    def read_all(self) -> dict[str, torch.Tensor]:
        return {name: self.read(name) for name in self._entries}


def save_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> WrittenFile:
    """Write in-memory tensors (small files: components, tests)."""
    entries = [
        TensorEntry(name, TensorSpec(tuple(t.shape), t.dtype), (lambda t=t: t)) for name, t in tensors.items()
    ]
    return write_safetensors(path, entries, metadata)


def read_index(index_path: str, directory: str, listed=None, root: str | None = None) -> dict[str, SafetensorsFile]:
    """tensor name -> its shard, from a ``*.safetensors.index.json``: every shard it names stays inside the
    checkpoint and exists, and holds the tensors named for it. With ``listed`` (a manifest's files, relative
    to ``root``) every shard must be listed there and name every tensor it holds, none more."""
    index = read_json(index_path, "safetensors index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptCheckpointError(index_path, "not a valid safetensors index: no weight_map of tensor names to files")
    if not weight_map:
        raise CorruptCheckpointError(index_path, "the index's weight_map names no tensors")
    shards: dict[str, SafetensorsFile] = {}
    out: dict[str, SafetensorsFile] = {}
    for name, fname in weight_map.items():
        if fname not in shards:
            path = inside(directory, fname, index_path)
            if listed is not None and os.path.relpath(path, root) not in listed:
                raise CorruptCheckpointError(index_path, f"names shard {fname!r}, which the manifest does not list")
            if not os.path.isfile(path):
                raise MissingFileError(path, f"named by {os.path.basename(index_path)} but missing")
            shards[fname] = SafetensorsFile(path)
        if name not in shards[fname]:
            raise CorruptCheckpointError(shards[fname].path, f"{os.path.basename(index_path)} says it holds {name!r}; it does not")
        out[name] = shards[fname]
    if listed is not None:
        for st in shards.values():
            unnamed = sorted(n for n in st.keys() if out.get(n) is not st)
            if unnamed:
                raise CorruptCheckpointError(index_path, f"does not name tensor {unnamed[0]!r} of {os.path.basename(st.path)}")
    return out


def read_hf_safetensors(directory: str, stem: str = "model") -> dict[str, LazyTensor] | None:
    """Lazy tensors of ``<stem>.safetensors`` or, as transformers prefers it, its sharded index in
    ``directory``; None if neither exists."""
    index_path = inside(directory, f"{stem}.safetensors.index.json")
    if os.path.lexists(index_path):
        return {name: st.lazy(name) for name, st in read_index(index_path, directory).items()}
    single = inside(directory, f"{stem}.safetensors")
    if os.path.lexists(single):
        st = SafetensorsFile(single)
        return {name: st.lazy(name) for name in st.keys()}
    return None
