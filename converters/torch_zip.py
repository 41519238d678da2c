"""Files ``torch.save`` writes (its zip format), read without torch.

The file is a zip archive, stored and not compressed: ``<prefix>/data.pkl`` is the object, pickled, where each
tensor names a storage record ``<prefix>/data/<key>`` by a persistent id, and the records hold the storages'
raw bytes. :func:`load` unpickles data.pkl into stand-ins: a tensor becomes a :class:`StoredTensor` (dtype,
shape, stride and where its bytes lie in the file), so a conversion that only moves bytes (a ZeRO checkpoint's
fp32 weights into HF safetensors) copies them file to file and never imports torch, and one that needs values
gets them from :meth:`StoredTensor.tensor`.

Why by hand: torch has no reader that leaves tensors unbuilt, and importing torch is a second of every
conversion. It is no looser than ``torch.load(weights_only=True)``: only the globals below and the caller's
allowlist resolve, each to a stand-in or to what torch's weights-only loader would resolve it to. Anything else
(a global beyond them, a class given state, a sparse, quantized or subclassed tensor, big-endian data) raises
:class:`NeedsTorch`, and the caller loads the file with torch's own weights-only loader, which decides.
:func:`materialize` turns stand-ins into what ``torch.load`` returns, for state that is carried as it is.
"""

from __future__ import annotations

import collections
import io
import math
import mmap
import os
import pickle
import struct
import threading
import zipfile
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from interop.dtypes import is_dtype_name, itemsize, unpack_scalar
from interop.errors import CorruptCheckpointError
from interop.structure import Is, Keys, ListOf, MapOf, Maybe, OneOf
from interop.lazy_import import instance_of, torch
from interop.tensors import LazyTensor, Piece, TensorSpec, unfilled_bytes

# torch's legacy storage classes, as data.pkl names them, and the dtype each holds (torch.serialization).
STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "UntypedStorage": "uint8",
}


class NeedsTorch(Exception):
    """The file holds something the stand-ins do not express: load it with torch's weights-only loader."""


# --- the archive -------------------------------------------------------------------------------------------------
class _Window(io.RawIOBase):
    """Bytes ``base .. base + length`` of an open file, as a file of their own (a zip inside a DCP data file)."""

    def __init__(self, f: Any, base: int, length: int):
        self.f, self.base, self.length, self.pos = f, base, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        if pos < 0:  # a zip whose offsets point before the window: refused, never read from the bytes before it
            raise ValueError(f"offset {pos} lies before the archive")
        self.pos = pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        got = os.preadv(self.f.fileno(), [memoryview(b)[:n]], self.base + self.pos) if n else 0
        self.pos += got
        return got


class Archive:
    """One zip archive's records (a file, or bytes ``base .. base + length`` of one: DCP stores each tensor so):
    where each record's bytes lie in the file, and the file mapped read-only on first use (``maps``: a dict the
    caller keeps, to share one mapping among the archives of one file).

    A file our manifest records block by block and a reader registered (:mod:`interop.ranged`) is checked as it is
    used: the zip directory and data.pkl before they are trusted, each storage's header and the bytes of a tensor
    before they are handed out."""

    def __init__(self, path: str, base: int = 0, length: int | None = None, maps: dict | None = None):
        from interop import ranged

        self.path = path
        self._maps = maps if maps is not None else {}
        self._lock = threading.Lock()
        self.ranges = ranged.registered(path)
        if self.ranges is not None:  # torch.save writes data.pkl first: its block is hashed beside the directory's
            self.ranges.start(base, base + 1)
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            self.inode = st.st_ino
            self.base = base
            self.size = base + length if length is not None else st.st_size  # the archive's end in the file
            if self.size > st.st_size:
                raise CorruptCheckpointError(path, f"truncated: bytes {base}..{self.size} are asked of {st.st_size}")
            try:
                zf = zipfile.ZipFile(_Window(f, base, self.size - base) if base or length is not None else f)
                infos = zf.infolist()
            except (zipfile.BadZipFile, OSError, ValueError) as exc:
                if self.ranges is not None:  # a file the manifest vouches for: say first whether it was altered
                    self.ranges.check(base, self.size, self.inode)
                raise CorruptCheckpointError(path, f"not a readable torch zip file at byte {base}: {exc}") from None
            if not 0 <= zf.start_dir <= self.size - base:
                raise CorruptCheckpointError(path, f"its zip directory lies outside the archive at byte {base}")
            self._checked(base + zf.start_dir, self.size)  # the central directory and its end record
            pickles = [i for i in infos if (i.filename.endswith("/data.pkl") and i.filename.count("/") == 1) or i.filename == "data.pkl"]
            if len(pickles) != 1:
                raise CorruptCheckpointError(path, f"holds {len(pickles)} data.pkl records at byte {base}; a torch file has one")
            self.prefix = pickles[0].filename[: -len("data.pkl")]
            self.records = {i.filename: i for i in infos}
            self._headers: dict[str, tuple[int, int]] = {}  # record name -> file offsets of its local header, its bytes
            for info in infos:
                at = base + info.header_offset
                if not base <= at <= self.size - 30:  # (zipfile shifts offsets by what it takes for prepended bytes)
                    raise CorruptCheckpointError(path, f"record {info.filename} lies outside the archive at byte {base}")
                head = os.pread(f.fileno(), 30, at)
                if len(head) == 30 and head[:4] == b"PK\x03\x04":
                    name_len, extra_len = struct.unpack("<HH", head[26:30])
                    self._headers[info.filename] = (at, at + 30 + name_len + extra_len)
            byteorder = self.records.get(self.prefix + "byteorder")
            if byteorder is not None and self._read(f, byteorder).strip() != b"little":
                raise NeedsTorch("big-endian storages")
            self.pickle = self._read(f, pickles[0])

    def _checked(self, lo: int, hi: int, ahead: bool = False) -> None:
        """Bytes ``lo .. hi`` checked before they are used; ``ahead``: a tensor's, read on in order (the directory,
        data.pkl and the records' headers are looked at and the reader moves elsewhere)."""
        if self.ranges is not None:
            self.ranges.check(lo, hi, self.inode, ahead)

    def _read(self, f: Any, info: zipfile.ZipInfo) -> bytes:
        """A small stored record's bytes (data.pkl, byteorder), checked with its local header."""
        header, start = self._headers.get(info.filename, (None, None))
        if info.compress_type != zipfile.ZIP_STORED:
            raise NeedsTorch(f"{info.filename} is compressed")
        if start is None or start + info.file_size > self.size:
            raise CorruptCheckpointError(self.path, f"record {info.filename} has no entry header or runs past the archive's end")
        self._checked(header, start + info.file_size)
        data = os.pread(f.fileno(), info.file_size, start)
        if len(data) != info.file_size:
            raise CorruptCheckpointError(self.path, f"truncated: record {info.filename}")
        return data

    def checked_storage(self, key: str, lo: int, hi: int) -> None:
        """Before bytes ``lo .. hi`` of storage ``key`` are used: they, and the header that placed them, are the
        manifest's."""
        if self.ranges is not None:
            header, start = self._headers[f"{self.prefix}data/{key}"]
            self._checked(header, start)
            self._checked(lo, hi, ahead=True)

    def storage(self, key: str, nbytes: int) -> tuple[int, int]:
        """(file offset, bytes) of storage record ``key``, which must be stored uncompressed, hold ``nbytes``
        and lie inside the file."""
        name = f"{self.prefix}data/{key}"
        info = self.records.get(name)
        if info is None:
            raise CorruptCheckpointError(self.path, f"data.pkl names storage {key!r}, which the archive does not hold")
        if info.compress_type != zipfile.ZIP_STORED:
            raise NeedsTorch(f"storage {key} is compressed")
        if info.file_size != nbytes:
            raise CorruptCheckpointError(self.path, f"storage {key} holds {info.file_size} bytes; data.pkl says {nbytes}")
        start = self._headers.get(name, (None, None))[1]
        if start is None:
            raise CorruptCheckpointError(self.path, f"storage {key}: no zip entry header at byte {self.base + info.header_offset}")
        if start + nbytes > self.size:
            raise CorruptCheckpointError(self.path, f"truncated: storage {key} runs to byte {start + nbytes} of {self.size}")
        return start, nbytes

    def mapping(self) -> mmap.mmap:
        with self._lock:
            found = self._maps.get(self.path)
            if found is None or found[1] != self.inode:
                with open(self.path, "rb") as f:
                    if os.fstat(f.fileno()).st_ino != self.inode:
                        raise CorruptCheckpointError(self.path, "was replaced while it was read")
                    found = self._maps[self.path] = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), self.inode)
            if len(found[0]) < self.size:
                raise CorruptCheckpointError(self.path, "was truncated while it was read")
            return found[0]

    def read_into(self, lo: int, view: memoryview) -> None:
        """Fill ``view`` with the file's bytes from ``lo``, read from the file as mapped (not through the mapping:
        a file cut short meanwhile is an error naming it, where the mapping would kill the process with SIGBUS)."""
        from interop.output_files import read_run

        fd = os.open(self.path, os.O_RDONLY)
        try:
            if os.fstat(fd).st_ino != self.inode:
                raise CorruptCheckpointError(self.path, "was replaced while it was read")
            read_run(fd, view, self.path, lo, len(view))
        finally:
            os.close(fd)

    def release(self, lo: int, hi: int) -> None:
        from interop.safetensors_io import release_range

        found = self._maps.get(self.path)
        if found is not None:
            release_range(found[0], lo, hi)


# --- tensors --------------------------------------------------------------------------------------------------------
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True, eq=False)
class StoredTensor:
    """A tensor in a torch zip file, known by where its bytes lie. Answers what the readers ask of a tensor
    (numel, dim, dtype, reshape and 1-D slices of a contiguous one) without reading it; ``piece()`` gives the
    bytes as a view of the mapped file, ``tensor()`` the values, with torch."""

    archive: Archive = field(repr=False)
    key: str
    dtype_name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    start: int  # file offset of the storage's first byte
    storage_offset: int  # in elements
    parameter: bool = False  # rebuilt as torch.nn.Parameter
    requires_grad: bool = False
    attributes: tuple[tuple[str, Any], ...] = ()  # set on the tensor as torch sets them (DeepSpeed's ds_id)

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def element_size(self) -> int:
        return itemsize(self.dtype_name)

    @property
    def dtype(self) -> "torch.dtype":
        return getattr(torch, self.dtype_name)

    def is_contiguous(self) -> bool:
        if self.numel() == 0:
            return True
        return all(st == want for n, st, want in zip(self.shape, self.stride, _contiguous_strides(self.shape)) if n != 1)

    def reshape(self, *shape: Any) -> "StoredTensor":
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            shape = tuple(self.numel() // max(known, 1) if n == -1 else n for n in shape)
        if math.prod(shape) != self.numel():
            raise ValueError(f"cannot view {self.shape} as {shape}")
        if not self.is_contiguous():
            return self.tensor().reshape(shape)  # as torch does: a copy (a torch tensor; readers take either kind)
        return replace(self, shape=shape, stride=_contiguous_strides(shape))

    def __getitem__(self, index: slice) -> "StoredTensor":
        if not isinstance(index, slice) or len(self.shape) != 1 or index.step not in (None, 1):
            raise TypeError("a stored tensor is sliced only as a 1-D range")
        lo, hi, _ = index.indices(self.shape[0])
        hi = max(lo, hi)
        return replace(self, shape=(hi - lo,), storage_offset=self.storage_offset + lo * self.stride[0])

    def _span(self) -> tuple[int, int]:
        """File offsets of the first and one past the last byte any element of this view occupies."""
        size = self.element_size()
        lo = self.start + self.storage_offset * size
        if self.numel() == 0:
            return lo, lo
        return lo, lo + (sum((n - 1) * st for n, st in zip(self.shape, self.stride)) + 1) * size

    def piece(self) -> Piece:
        """This contiguous tensor's bytes as a view of the file mapped read-only, with where they lie (a writer
        copies them file to file in the kernel), and a release that lets the pages go once used."""
        if not self.is_contiguous():
            raise ValueError("only a contiguous tensor is one piece")
        lo, hi = self._span()
        if hi == lo:
            return Piece(memoryview(b""), dtype=self.dtype_name)
        self.archive.checked_storage(self.key, lo, hi)
        return Piece(memoryview(self.archive.mapping())[lo:hi], (self.archive.path, lo, self.archive.inode),
                     lambda: self.archive.release(lo, hi), self.dtype_name)

    def item(self) -> int | float | bool:
        """A one-element tensor's value, read from the file without torch."""
        if self.numel() != 1:
            raise ValueError(f"item() of a tensor of {self.numel()} elements")
        lo, hi = self._span()
        self.archive.checked_storage(self.key, lo, hi)
        raw = bytearray(hi - lo)
        self.archive.read_into(lo, memoryview(raw))
        value = unpack_scalar(raw, self.dtype_name)
        return self.tensor().item() if value is None else value

    def tensor(self) -> "torch.Tensor":
        """The values as a torch tensor of their own (a copy of the bytes this view spans, nothing else)."""
        lo, hi = self._span()
        dtype = self.dtype
        if hi == lo:
            return torch.empty(self.shape, dtype=dtype)
        self.archive.checked_storage(self.key, lo, hi)
        flat, view = unfilled_bytes(hi - lo)
        self.archive.read_into(lo, view)  # one copy, into memory nothing filled before
        return flat.view(dtype).as_strided(self.shape, self.stride, 0)


# --- the restricted unpickler ----------------------------------------------------------------------------------
class _Global:
    """A torch global the stand-ins resolve by name (a storage class, torch.Size, torch.Tensor ...)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args: Any) -> Any:
        if self.name == "torch.Size":
            return StoredSize(*args)
        if self.name == "torch.device":
            return StoredDevice(*args)
        raise NeedsTorch(f"{self.name} called")


class StoredSize(tuple):
    """torch.Size, as a tuple (materialize gives the torch.Size back)."""


class StoredDtype(str):
    """A torch dtype, by name ("float16")."""


class StoredDevice(str):
    """torch.device, by name."""

    def __new__(cls, kind: Any, index: Any = None) -> "StoredDevice":
        return super().__new__(cls, f"{kind}:{index}" if index is not None else str(kind))


@dataclass(frozen=True)
class _StorageRef:
    """A storage record a tensor is built on; one left bare in the object (a pickled storage) is torch's to load."""

    archive: Archive = field(repr=False)
    key: str
    dtype: str
    start: int
    nbytes: int


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    if backward_hooks or metadata:
        raise NeedsTorch("a tensor with hooks or metadata")
    if not isinstance(storage, _StorageRef):
        raise NeedsTorch("a tensor on something other than a storage record")
    archive, key, dtype, start, nbytes = storage.archive, storage.key, storage.dtype, storage.start, storage.nbytes
    shape, stride, offset = tuple(int(n) for n in size), tuple(int(s) for s in stride), int(storage_offset)
    if len(shape) != len(stride) or any(n < 0 for n in shape) or any(s < 0 for s in stride) or offset < 0:
        raise CorruptCheckpointError(archive.path, f"tensor on storage {key}: size {shape}, stride {stride}, offset {offset}")
    t = StoredTensor(archive, key, dtype, shape, stride, start, offset, requires_grad=bool(requires_grad))
    lo, hi = t._span()
    if hi > start + nbytes:
        raise CorruptCheckpointError(archive.path, f"a tensor {shape} at offset {offset} runs past storage {key} ({nbytes} bytes)")
    return t


def _rebuild_parameter(data, requires_grad, backward_hooks, state=None):
    if backward_hooks or state or not isinstance(data, StoredTensor):
        raise NeedsTorch("a parameter with hooks or state")
    return replace(data, parameter=True, requires_grad=bool(requires_grad))


def _rebuild_from_type_v2(func, new_type, args, state):
    """torch's way of pickling a tensor whose class is named: plain torch.Tensor (or Parameter), whose attributes,
    if any, are plain values."""
    if not (isinstance(new_type, _Global) and new_type.name in ("torch.Tensor", "torch.nn.parameter.Parameter")):
        raise NeedsTorch("a tensor subclass")
    plain = (str, int, float, bool, type(None))
    if state and not (isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, plain) for k, v in state.items())):
        raise NeedsTorch("a tensor with attributes beyond plain values")
    t = func(*args)
    if not isinstance(t, StoredTensor):
        raise NeedsTorch("a tensor rebuilt by another function")
    return replace(t, parameter=t.parameter or new_type.name.endswith("Parameter"), attributes=tuple((state or {}).items()))


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "collections.OrderedDict": collections.OrderedDict,
    "collections.Counter": collections.Counter,
    "builtins.set": set,
    "builtins.bytearray": bytearray,
    "builtins.complex": complex,
    "_codecs.encode": lambda text, encoding="utf-8": _latin1(text, encoding),  # how protocol 2 pickles bytes
}


def _latin1(text: Any, encoding: str) -> bytes:
    if encoding != "latin1" or not isinstance(text, str):
        raise NeedsTorch(f"_codecs.encode with {encoding!r}")
    return text.encode("latin1")

_NAMED = {"torch.Size", "torch.device", "torch.Tensor", "torch.nn.parameter.Parameter"} | {f"torch.{s}" for s in STORAGE_DTYPES}


@dataclass(frozen=True)
class LazyAllow:
    """Allowlist entries imported only when a pickle names one of them (``resolve`` gives the objects): numpy's
    RNG-state types cost 70 ms of import, and most files (a scheduler's, an optimizer's) name none. A pickle that
    names them under other names (an older numpy's) is left to torch's loader, given the resolved objects."""

    names: frozenset[str]
    resolve: Callable[[], list[Any]]


def _name(entry: Any) -> tuple[str, Any]:
    if isinstance(entry, tuple):
        return entry[1], entry[0]
    return f"{entry.__module__}.{entry.__qualname__}", entry


class _Unpickler(pickle._Unpickler):  # the Python unpickler: BUILD can be checked before it runs
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, archive: Archive, allow: list[Any]):
        super().__init__(io.BytesIO(archive.pickle))
        self.archive = archive
        self.deferred = [e for e in allow if isinstance(e, LazyAllow)]
        self.allowed = dict(_name(e) for e in allow if not isinstance(e, LazyAllow))
        self.built = tuple(v for v in self.allowed.values() if isinstance(v, type))

    def _allowed(self, full: str) -> Any:
        for lazy in self.deferred:
            if full in lazy.names:
                self.deferred.remove(lazy)
                self.allowed.update(_name(e) for e in lazy.resolve())
                self.built = tuple(v for v in self.allowed.values() if isinstance(v, type))
                break
        return self.allowed.get(full)

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3:  # Python 2 names, as pickle maps them (protocol 2 writes __builtin__.set)
            import _compat_pickle

            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (_compat_pickle.IMPORT_MAPPING.get(module, module), name))
        full = f"{module}.{name}"
        if full in _FUNCTIONS:
            return _FUNCTIONS[full]
        if full in _NAMED:
            return _Global(full)
        found = self._allowed(full)
        if found is not None:
            return found
        if module == "torch" and is_dtype_name(name):
            return StoredDtype(name)
        raise NeedsTorch(f"references {full}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Global)):
            raise NeedsTorch(f"persistent id {pid!r:.80}")
        dtype = STORAGE_DTYPES.get(pid[1].name.removeprefix("torch."))
        if dtype is None or not isinstance(pid[4], int) or pid[4] < 0:
            raise NeedsTorch(f"storage {pid[1].name}")
        key = str(pid[2])
        start, nbytes = self.archive.storage(key, pid[4] * itemsize(dtype))
        return _StorageRef(self.archive, key, dtype, start, nbytes)

    def _load_build(self) -> None:
        """As torch's weights-only loader: an OrderedDict takes attributes (a state dict's ``_metadata``), an
        instance of an allowlisted class its state; nothing else, never a class itself."""
        state, target = self.stack[-1], self.stack[-2]
        if type(target) is collections.OrderedDict and isinstance(state, dict):
            self.stack.pop()
            target.__dict__.update(state)
            return
        if type(target) not in self.built:
            raise NeedsTorch(f"sets state on a {type(target).__name__}")
        if getattr(target, "__setstate__", None) is None and not isinstance(state, dict):
            raise NeedsTorch(f"sets slots of a {type(target).__name__}")  # setattr could run a property's setter
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build

    # Items go only into the containers pickle makes (as torch's loader requires), never through another object's
    # append, extend, add or __setitem__.
    _LISTS, _DICTS, _SETS = (list,), (dict, collections.OrderedDict, collections.Counter), (set,)

    def _into(self, target: Any, kinds: tuple[type, ...], what: str) -> None:
        if type(target) not in kinds:
            raise NeedsTorch(f"{what} into a {type(target).__name__}")

    def _load_append(self) -> None:
        self._into(self.stack[-2], self._LISTS, "APPEND")
        pickle._Unpickler.load_append(self)

    def _load_appends(self) -> None:
        self._into(self.metastack[-1][-1], self._LISTS, "APPENDS")
        pickle._Unpickler.load_appends(self)

    def _load_setitem(self) -> None:
        self._into(self.stack[-3], self._DICTS, "SETITEM")
        pickle._Unpickler.load_setitem(self)

    def _load_setitems(self) -> None:
        self._into(self.metastack[-1][-1], self._DICTS, "SETITEMS")
        pickle._Unpickler.load_setitems(self)

    def _load_additems(self) -> None:
        self._into(self.metastack[-1][-1], self._SETS, "ADDITEMS")
        pickle._Unpickler.load_additems(self)

    dispatch[pickle.APPEND[0]] = _load_append
    dispatch[pickle.APPENDS[0]] = _load_appends
    dispatch[pickle.SETITEM[0]] = _load_setitem
    dispatch[pickle.SETITEMS[0]] = _load_setitems
    dispatch[pickle.ADDITEMS[0]] = _load_additems


def _bare_storage(obj: Any, seen: set[int]) -> bool:
    """Whether a storage record is left in ``obj`` other than under a tensor (a pickled storage, a bare tuple)."""
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, _StorageRef):
        return True
    if isinstance(obj, dict):
        return any(_bare_storage(k, seen) or _bare_storage(v, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return any(_bare_storage(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, StoredTensor)):
        return _bare_storage(vars(obj), seen)
    return False


def load(path: str, allow: list[Any] | None = None, base: int = 0, length: int | None = None, maps: dict | None = None) -> Any:
    """The object ``torch.save`` wrote to ``path`` (or to its bytes ``base .. base + length``), tensors as
    StoredTensors (see the module's docstring). Raises NeedsTorch where torch's weights-only loader must decide,
    CorruptCheckpointError for damage."""
    archive = Archive(path, base, length, maps)
    try:
        found = _Unpickler(archive, list(allow or [])).load()
        if _bare_storage(found, set()):
            raise NeedsTorch("a storage outside a tensor")
        return found
    except (NeedsTorch, CorruptCheckpointError):
        raise
    except Exception as exc:  # noqa: BLE001 - damaged pickles fail in many ways; torch's loader says what it makes of them
        raise NeedsTorch(f"{type(exc).__name__}: {exc}") from None


# --- working with either kind of tensor ----------------------------------------------------------------------
def is_tensor(value: Any) -> bool:
    return isinstance(value, StoredTensor) or instance_of(value, "torch", "Tensor")


def state_shapes(entries: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shapes of one parameter's optimizer state tensors (either kind), its scalars (a 0-dim step) left out:
    what must be the parameter's own shape."""
    return {k: tuple(v.shape) for k, v in entries.items() if is_tensor(v) and v.dim() > 0}


TENSOR = Is(is_tensor, "a tensor")
NUMBER = (int, float)
# a torch optimizer's state dict, as its readers use it: param groups numbering parameters, each one's state a
# map of tensors and numbers (AdamW's step is either)
TORCH_OPTIMIZER = Keys(
    param_groups=ListOf(Keys(params=ListOf(int), weight_decay=Maybe(NUMBER), lr=Maybe(OneOf(NUMBER, TENSOR)))),
    state=MapOf(int, MapOf(str, Maybe(OneOf(TENSOR, NUMBER, bool)))),  # None: an optimizer's unset slot
)


def dtype_name_of(value: Any) -> str:
    from interop.dtypes import dtype_name

    return value.dtype_name if isinstance(value, StoredTensor) else dtype_name(value.dtype)


def as_torch(value: Any) -> "torch.Tensor":
    return value.tensor() if isinstance(value, StoredTensor) else value


def piece_of(value: Any, mapped: bool = False) -> Piece:
    """A contiguous tensor's bytes as a Piece; ``mapped``: a torch tensor that is a view of a mapped file."""
    return value.piece() if isinstance(value, StoredTensor) else Piece.of_tensor(value, mapped=mapped)


def lazy_of(value: Any, origin: str) -> LazyTensor:
    """A LazyTensor of either kind of tensor: a stored one is read when loaded, and its bytes are mapped pieces."""
    if not isinstance(value, StoredTensor):
        return LazyTensor.of(value, origin)
    pieces = (lambda: [value.piece()]) if value.is_contiguous() else None
    return LazyTensor(TensorSpec(value.shape, dtype_name=value.dtype_name), value.tensor, origin, mapped_pieces=pieces)


def copy_into(out: "torch.Tensor", value: Any, mapped: bool = False) -> None:
    """``out.copy_(value)`` for either kind of tensor of ``out``'s dtype and size, letting the source's pages go
    after (``mapped``: a torch tensor that is a view of a mapped file)."""
    from interop.tensors import raw_bytes, release_mapped_pages

    if not isinstance(value, StoredTensor):
        out.copy_(value)
        if mapped:
            release_mapped_pages(value)
        return
    if value.dtype_name != dtype_name_of(out) or value.numel() != out.numel():
        raise CorruptCheckpointError(value.archive.path, f"storage {value.key} holds {value.dtype_name}[{value.numel()}] "
                                                         f"where {dtype_name_of(out)}[{out.numel()}] is read")
    from interop.output_files import read_pieces

    read_pieces([value.piece()], raw_bytes(out))  # from its file, not through its mapping (SIGBUS if cut short)


def materialize(obj: Any) -> Any:
    """``obj`` with every stand-in replaced by what torch.load returns for it (tensors, parameters, torch.Size,
    torch.device): for state carried as it is (client state, a scheduler's). Imports torch only if one is met."""
    if isinstance(obj, StoredTensor):
        t = obj.tensor()
        if obj.parameter:
            t = torch.nn.Parameter(t, requires_grad=obj.requires_grad)
        elif obj.requires_grad:
            t.requires_grad_(True)
        for k, v in obj.attributes:
            setattr(t, k, v)
        return t
    if isinstance(obj, StoredSize):
        return torch.Size(obj)
    if isinstance(obj, StoredDevice):
        return torch.device(str(obj))
    if isinstance(obj, StoredDtype):
        return getattr(torch, str(obj))
    if isinstance(obj, dict):
        items = [(materialize(k), materialize(v)) for k, v in obj.items()]  # keys too: a dict keyed by dtype
        out = type(obj)() if type(obj) in (dict, collections.OrderedDict, collections.Counter) else obj
        if out is obj:
            obj.clear()
        for k, v in items:
            out[k] = v
        if out is not obj and getattr(obj, "__dict__", None):
            out.__dict__.update(materialize(dict(vars(obj))))  # a state dict's _metadata
        return out
    if isinstance(obj, list):
        return [materialize(v) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(materialize(v) for v in obj)
    if isinstance(obj, set):
        return {materialize(v) for v in obj}
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        for k, v in list(vars(obj).items()):
            setattr(obj, k, materialize(v))
    return obj
