"""torch.save's file format, written here a record at a time, so a tensor's bytes can stream into place.

torch.save needs the whole tensor in memory, and its zip writer computes each record's CRC-32 at about 1.3 GB/s
on one core: for a stored tensor that is a stack of layers, the stack is built only to be saved, and the CRC
costs as much CPU as the write. Here a tensor's bytes come as consecutive pieces (one layer after another, or
views of a source's mapped file), each written and CRC'd (ISA-L's CRC-32, several times zlib's speed) as it
comes, then dropped.

The layout is what torch 2.x writes (``caffe2/serialize/inline_container.cc`` on miniz; the tests compare the
bytes with torch.save's): records ``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``, the
storages ``data/<key>``, ``version`` and ``.data/serialization_id``, each under the archive's folder; every
record's data at a multiple of 64 bytes (an ``FB`` extra field of padding); local headers with the sizes and CRC
in a data descriptor (flags 0x0808); ZIP64 fields where a size or offset reaches 4 GiB; and a ZIP64 end record
always. ``torch.load`` reads it, and so does any zip reader (the CRCs are real).
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Iterator

from interop.hashed_writes import SourceBytes
from interop.output_files import closing_fds, piece_runs

try:  # ISA-L: the same CRC-32 as zlib's, at several times its speed
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - a platform without its wheel: zlib's, slower
    from zlib import crc32

ALIGNMENT = 64  # torch's kFieldAlignment: a record's data starts at a multiple of this
FORMAT_VERSION = b"1"  # torch.serialization._save's .format_version
VERSION = b"3\n"  # the archive version torch writes (kProducedFileFormatVersion)
_U32 = 0xFFFFFFFF
_UTF8, _DESCRIBED = 0x0800, 0x0008  # flags: names are UTF-8; a data descriptor follows the data (miniz: not after none)


@dataclass
class _Entry:
    name: bytes
    offset: int  # of its local header, from the archive's start
    size: int
    crc: int

    @property
    def flags(self) -> int:
        return _UTF8 | (_DESCRIBED if self.size else 0)


class ArchiveWriter:
    """The records of one torch.save archive, written at ``f``'s position (offsets count from there, as in a
    DCP data file whose items are archives one after another)."""

    def __init__(self, f: BinaryIO, folder: str = "archive", alignment: int = ALIGNMENT):
        self.f = f
        self.folder = folder.encode() + b"/"
        self.alignment = alignment
        self.pos = 0
        self.entries: list[_Entry] = []

    def _write(self, data: Any) -> int:
        """``data``'s bytes (bytes-like) at the end."""
        n = memoryview(data).nbytes
        if n:
            self.f.write(data)
        self.pos += n
        return n

    def _write_source(self, chunk: SourceBytes, entry: _Entry) -> None:
        """A mapped source's bytes at the end, their CRC taken where they lie once read: a :class:`HashedFile`
        reads them from the source's file and feeds ``chunk.check`` there; another file gets them from memory."""
        def crc(run: memoryview) -> None:
            entry.crc = crc32(run, entry.crc)

        if hasattr(self.f, "write_source"):
            self.pos += self.f.write_source(chunk.piece, chunk.check, crc)
            return
        with closing_fds({}) as sources:
            for data in piece_runs(chunk.piece, sources):  # from its file, not through its mapping
                crc(data)
                if chunk.check is not None:
                    chunk.check.update(data)
                self._write(data)

    def _zip64(self, size: int, offset: int) -> list[int]:
        """miniz's ZIP64 local fields: the size (and a compressed size of 0) from 4 GiB, the header's offset from 4 GiB."""
        return ([size, 0] if size >= _U32 else []) + ([offset] if offset >= _U32 else [])

    def begin(self, name: str, size: int) -> None:
        """The local header of a record of ``size`` bytes; its data follows (:meth:`data`, then :meth:`end`)."""
        full = self.folder + name.encode()
        wide = self._zip64(size, self.pos)
        extra = struct.pack(f"<HH{len(wide)}Q", 1, 8 * len(wide), *wide) if wide else b""
        start = self.pos + 30 + len(full) + len(extra) + 4
        pad = -start % self.alignment
        extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad
        self.entries.append(_Entry(full, self.pos, size, 0))
        self._write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, self.entries[-1].flags, 0, 0, 0, 0, 0, 0, len(full), len(extra)) + full + extra)
        self._start = self.pos

    def data(self, chunk: Any) -> None:
        """More of the current record's bytes (bytes-like, or a mapped source's: :class:`SourceBytes`)."""
        entry = self.entries[-1]
        if isinstance(chunk, SourceBytes):
            self._write_source(chunk, entry)
            return
        entry.crc = crc32(chunk, entry.crc)
        self._write(chunk)

    def end(self) -> None:
        """The current record is complete: its data descriptor (CRC and sizes)."""
        entry = self.entries[-1]
        if self.pos - self._start != entry.size:
            raise ValueError(f"record {entry.name.decode()}: {self.pos - self._start} bytes written, {entry.size} declared")
        if not entry.size:
            return
        wide = bool(self._zip64(entry.size, entry.offset))
        self._write(struct.pack("<IIQQ" if wide else "<IIII", 0x08074B50, entry.crc, entry.size, entry.size))

    def record(self, name: str, data: bytes) -> None:
        """A whole record of bytes in memory."""
        self.begin(name, len(data))
        self.data(data)
        self.end()

    def finish(self) -> int:
        """The version and id records, the central directory and the end records; the archive's length."""
        self.record("version", VERSION)
        names = crc32(b"".join(e.name for e in self.entries))
        combined = 0
        for e in self.entries:
            combined = crc32(struct.pack("<I", e.crc), combined)
        self.record(".data/serialization_id", b"%020d%020d" % (names, combined))  # an opaque id to torch
        start = self.pos
        for e in self.entries:
            wide = ([e.size, e.size] if e.size >= _U32 else []) + ([e.offset] if e.offset >= _U32 else [])
            extra = struct.pack(f"<HH{len(wide)}Q", 1, 8 * len(wide), *wide) if wide else b""
            size = _U32 if e.size >= _U32 else e.size
            self._write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, e.flags, 0, 0, 0, e.crc, size, size, len(e.name),
                                    len(extra), 0, 0, 0, 0, min(e.offset, _U32)) + e.name + extra)
        size, count, end = self.pos - start, len(self.entries), self.pos
        self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x002D, 0, 0, count, count, size, start))
        self._write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
        self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF), min(size, _U32),
                                min(start, _U32), 0))
        return self.pos


# --- a tensor's pickle -----------------------------------------------------------------------------------------
class _Storage:
    """Stands for a tensor's storage in its pickle: torch.save's persistent id for it (a typed storage of ``numel``
    elements, or for the dtypes torch pickles on untyped storages, ``numel`` bytes)."""

    def __init__(self, dtype: Any, numel: int, key: str = "0"):
        self.dtype, self.numel, self.key = dtype, numel, key


class _Tensor:
    """Pickles as torch pickles a contiguous CPU tensor whose storage starts at its first element
    (``Tensor._reduce_ex_internal``: ``_rebuild_tensor_v2`` on a typed storage, or for the dtypes newer than typed
    storages (float8, uint16 ...) ``_rebuild_tensor_v3`` on an untyped one, the dtype after the hooks)."""

    def __init__(self, shape: tuple[int, ...], dtype: Any):
        self.shape, self.dtype = tuple(shape), dtype

    def __reduce_ex__(self, protocol: int) -> tuple:
        import math

        import torch

        stride, step = [], 1
        for n in reversed(self.shape):
            stride.insert(0, step)
            step *= max(n, 1)
        numel = math.prod(self.shape)
        if self.dtype in torch.storage._new_dtypes():
            storage = _Storage(None, numel * self.dtype.itemsize)
            return (torch._utils._rebuild_tensor_v3, (storage, 0, self.shape, tuple(stride), False, collections.OrderedDict(), self.dtype))
        return (torch._utils._rebuild_tensor_v2, (_Storage(self.dtype, numel), 0, self.shape, tuple(stride), False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", storage_type(obj.dtype), obj.key, "cpu", obj.numel)
        return None


def storage_type(dtype: Any) -> Any:
    """The storage class torch.save names for ``dtype`` (``torch.BFloat16Storage`` ...; ``UntypedStorage`` for None)."""
    import torch

    if dtype is None:
        return torch.UntypedStorage
    return getattr(torch, torch.empty(0, dtype=dtype)._typed_storage()._pickle_storage_type())


def tensor_pickle(shape: tuple[int, ...], dtype: Any) -> bytes:
    """``data.pkl`` of torch.save of one contiguous tensor (its storage is record ``data/0``)."""
    import io

    out = io.BytesIO()
    _Pickler(out, protocol=2).dump(_Tensor(shape, dtype))
    return out.getvalue()


def write_tensor(f: BinaryIO, shape: tuple[int, ...], dtype: Any, nbytes: int, chunks: Iterable[Any]) -> int:
    """torch.save of one contiguous tensor (as DCP stores each of its tensors) at ``f``'s position, its ``nbytes``
    bytes taken from ``chunks`` in order; the archive's length."""
    import sys

    archive = ArchiveWriter(f)
    archive.record("data.pkl", tensor_pickle(shape, dtype))
    archive.record(".format_version", FORMAT_VERSION)
    archive.record(".storage_alignment", str(ALIGNMENT).encode())
    archive.record("byteorder", sys.byteorder.encode())
    archive.begin("data/0", nbytes)
    for chunk in chunks:
        archive.data(chunk)
    archive.end()
    return archive.finish()


# --- any object, as torch.save pickles it ----------------------------------------------------------------------
class _Records:
    """What torch.serialization._save writes its records to (its zip writer's ``write_record``): here, an
    :class:`ArchiveWriter`. Storages are written from their memory, no copy; a stand-in's storage (see
    :class:`_Pickler`) from its LazyTensor's bytes as they stream."""

    def __init__(self, archive: ArchiveWriter, standins: "_Standins"):
        self.archive, self.standins = archive, standins

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        self.archive.begin(name, nbytes)
        lazy = self.standins.lazy_for(data) if nbytes and not isinstance(data, (str, bytes)) else None
        if lazy is not None:
            for chunk in self.standins.stream(lazy):
                self.archive.data(chunk)
        elif nbytes:
            self.archive.data(data.encode() if isinstance(data, str) else data if isinstance(data, bytes) else _storage_bytes(data))
        self.archive.end()


class _Standins:
    """The LazyTensor leaves of an object being saved, each pickled as a stand-in tensor of its shape and dtype, so
    torch's own pickling names its storage and places its record exactly as for the real tensor (the file is
    torch.save's of the loaded object); the record's bytes are then the LazyTensor's, streamed
    (:func:`hashed_writes.tensor_bytes`: a mapped source's bytes read from its file into the write's buffer, their
    CRC and digests taken there).

    Why a stand-in tensor: torch's pickling reduces a tensor to a storage it keys by identity, and only a real
    storage passes its checks. ``torch.empty`` reserves the address space and never touches it, so a stand-in of
    any size costs no memory (fresh anonymous pages, untouched), and its storage's address names the LazyTensor
    when its record comes to be written."""

    def __init__(self, f: Any, resources: "contextlib.ExitStack"):
        self.f, self._resources = f, resources
        self._by_address: dict[int, Any] = {}  # storage address -> LazyTensor
        self._by_lazy: dict[int, tuple[Any, Any]] = {}  # id of the LazyTensor -> (stand-in tensor, LazyTensor): both kept alive
        self._beside = self._ahead = None

    def standin(self, lazy: Any) -> Any:
        """The stand-in tensor of ``lazy`` (one per LazyTensor: a :class:`Leading` view of it shares its storage)."""
        import torch

        found = self._by_lazy.get(id(lazy))
        if found is not None:
            return found[0]
        tensor = torch.empty(lazy.spec.shape, dtype=lazy.spec.dtype)
        self._by_lazy[id(lazy)] = (tensor, lazy)
        if tensor.numel():
            self._by_address[tensor.untyped_storage().data_ptr()] = lazy
        else:  # nothing to stream: an empty tensor's record is empty
            lazy.load()  # still read: a missing or mismatched source is an error, as with the loaded object
        return tensor

    def lazy_for(self, storage: Any) -> Any:
        return self._by_address.get(storage.data_ptr()) if hasattr(storage, "data_ptr") else None

    def stream(self, lazy: Any) -> Iterator[Any]:
        """The LazyTensor's bytes, its next part fetched on a thread while this one is written; checked beside the
        writes on ``f``'s own :class:`Beside` thread where it is a :class:`HashedFile`."""
        from concurrent.futures import ThreadPoolExecutor

        from interop.hashed_writes import Beside, tensor_bytes

        if self._ahead is None:
            self._ahead = self._resources.enter_context(ThreadPoolExecutor(1, thread_name_prefix="torch-save-fetch"))
            self._beside = getattr(self.f, "beside", None) or self._resources.enter_context(Beside())
        yield from tensor_bytes(lazy, self._beside, self._ahead)


@dataclass(frozen=True)
class Leading:
    """The first ``numel`` elements of a LazyTensor, flattened, saved as a view of its whole storage (the storage is
    written whole, once, however many views name it): as DeepSpeed saves a ZeRO partition without its padding."""

    lazy: Any  # a LazyTensor
    numel: int


def _pickle_module(standins: _Standins) -> Any:
    """The ``pickle`` module torch.serialization._save is given: its Pickler turns a LazyTensor into its stand-in
    tensor (``reducer_override`` comes after torch's persistent ids and before the usual reduction; the pickler's
    memo makes a LazyTensor met twice one tensor, as the same tensor twice is one storage)."""
    import pickle
    import types

    from interop.tensors import LazyTensor

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, LazyTensor):
                return standins.standin(obj).__reduce_ex__(2)  # torch pickles at protocol 2
            if isinstance(obj, Leading):
                return standins.standin(obj.lazy).reshape(-1)[: obj.numel].__reduce_ex__(2)
            return NotImplemented

    return types.SimpleNamespace(Pickler=Pickler)


def _storage_bytes(storage: Any) -> memoryview:
    import torch

    return memoryview(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())


def archive_folder(path: str) -> str:
    """The folder torch.save names inside the file: the file's name without its extension (``archive`` where
    the name is not ASCII: torch then writes through a Python stream)."""
    name = os.path.basename(path)
    if not name.isascii():
        return "archive"
    stem = name[: name.rfind(".")] if "." in name else name
    if not stem:
        raise ValueError(f"{path}: torch.save cannot name an archive after this file name")
    return stem


def save(obj: Any, f: BinaryIO, folder: str) -> None:
    """``torch.save(obj, ...)`` into the open binary file ``f``, as torch.save would write it under ``folder`` (see
    :func:`archive_folder`): torch's own pickling (its ``_save``, the one torch.save calls) with this module's records.
    A :class:`~interop.tensors.LazyTensor` anywhere in ``obj`` is saved as the tensor it loads to, its bytes
    streamed into place from its source, never whole in memory. Why: torch's zip writer spends as much CPU on its
    CRC-32 as on the write, and a writer that hashes its files for a manifest can take their digests from these
    bytes as they go by (``f`` a :class:`HashedFile`)."""
    import torch.serialization as serialization

    alignment = serialization._get_storage_alignment() if hasattr(serialization, "_get_storage_alignment") else ALIGNMENT
    archive = ArchiveWriter(f, folder, alignment)
    with contextlib.ExitStack() as resources:
        standins = _Standins(f, resources)
        serialization._save(obj, _Records(archive, standins), _pickle_module(standins), serialization.DEFAULT_PROTOCOL, False)
        archive.finish()
