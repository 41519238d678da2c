"""torch.distributed.checkpoint (DCP) directories, read and written in one process with no process group.

Reading runs no code from the checkpoint. torch's own reader unpickles ``.metadata`` with ``pickle.load`` and
non-tensor entries with ``weights_only=False``; here ``.metadata`` goes through an unpickler that builds only
DCP's metadata types, and every stored object (tensor chunk or value) through ``torch.load(weights_only=True)``.

Tensors are read one region at a time: only the chunks that overlap the region are read, each copied into
place, so a reader holds one tensor (or one slice of it), never the checkpoint.

Writing goes through torch's own ``dcp.save`` (its planner makes the plan and its ``finish`` writes ``.metadata``,
so any torch that reads DCP reads ours) with meta tensors in the state dict, and a storage writer of ours that
writes each tensor's record in torch.save's format (:mod:`converters.torch_save`) from its source as it reaches
it: a stacked tensor layer by layer, a source's mapped bytes copied file to file, never the whole tensor in memory.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from interop.lazy_import import torch

from interop import ranged
from interop.background import on_staging_thread
from interop.hashed_writes import Beside, tensor_bytes
from interop.dtypes import is_dtype_name
from interop.errors import CorruptCheckpointError, MissingFileError, UnsafePickleError
from interop.logical import DeferredName, LogicalCheckpoint, OptimizerState
from interop.paths import inside
from interop.tensors import LazyTensor, TensorSpec
from interop.universal import saved_scalar, split_optimizer_state

from . import optimizer_class, torch_zip
from .param_order import EngineOrder
from .detection import DCP_METADATA, is_dcp_dir  # noqa: F401
from .pickle_safety import TORCH_LOAD_LOCK, expanded
from .torch_zip import as_torch, dtype_name_of, is_tensor, materialize, piece_of

log = logging.getLogger(__name__)

METADATA = DCP_METADATA


# --- .metadata ----------------------------------------------------------------------------------------------
_METADATA_TYPES = {
    "torch.distributed.checkpoint.metadata": ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
}


def _allowed_globals() -> dict[tuple[str, str], Any]:
    import pathlib

    import torch.distributed.checkpoint.metadata as md
    import torch.distributed.checkpoint.planner as planner
    from torch.distributed.checkpoint import filesystem

    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # maps a layout name to torch.strided etc.
        ("pathlib", "PosixPath"): pathlib.PurePosixPath,  # a path is only a label here: never a real file
        ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
        ("pathlib", "Path"): pathlib.PurePath,
        ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    }
    modules = {"torch.distributed.checkpoint.metadata": md, "torch.distributed.checkpoint.planner": planner,
               "torch.distributed.checkpoint.filesystem": filesystem}
    # (megatron-core's torch_dist strategy keeps its save plans in the metadata, to cache them: plain dataclasses)
    for module, names in _METADATA_TYPES.items():
        for name in names:
            if hasattr(modules[module], name):
                allowed[(module, name)] = getattr(modules[module], name)
    return allowed


class MetadataStub:
    """One of DCP's metadata objects as its attributes only, for a reader that needs no torch (DCPReader). Equal
    and hashed by its attributes: a MetadataIndex is a dict key."""

    def __init__(self, *args: Any):  # an enum member, rebuilt from its value
        if args:
            self.value = args[0]

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif type(self).__name__ == "TensorProperties" and isinstance(state, tuple) and len(state) == 5:
            # TensorProperties.__getstate__ pickles these five, in this order (torch cannot pickle a memory format)
            self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state
        elif isinstance(state, tuple) and len(state) == 2 and all(part is None or isinstance(part, dict) for part in state):
            for part in state:  # (instance dict, slots)
                self.__dict__.update(part or {})
        else:
            raise ValueError(f"unexpected pickled state for DCP's {type(self).__name__}")

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted((k, _hashable(v)) for k, v in vars(self).items()))))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def _stub_globals() -> dict[tuple[str, str], Any]:
    """The same names as :func:`_allowed_globals`, each to a torch-free stand-in: the stub classes (which take
    state only through ``__setstate__``), a builtin type, or a function made for this one unpickler, so that no
    BUILD can change anything another file will meet (see :class:`_StubUnpickler`)."""
    import collections
    import pathlib

    from .torch_zip import StoredSize

    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): lambda *args: StoredSize(*args),
        ("torch.serialization", "_get_layout"): lambda name: str(name),
        ("pathlib", "PosixPath"): lambda *parts: pathlib.PurePosixPath(*parts),
        ("pathlib", "WindowsPath"): lambda *parts: pathlib.PureWindowsPath(*parts),
        ("pathlib", "Path"): lambda *parts: pathlib.PurePath(*parts),
        ("collections", "OrderedDict"): collections.OrderedDict,
    }
    for module, names in _METADATA_TYPES.items():
        for name in names:
            allowed[(module, name)] = _STUB_CLASSES.setdefault(name, type(name, (MetadataStub,), dict(_STUB_DEFAULTS.get(name, {}))))
    return allowed


_STUB_CLASSES: dict[str, type] = {}
# Class-level defaults DCP's own classes have and their pickles leave out (MetadataIndex sets no offset when it
# has none; _StorageInfo pickles only the fields that are not None)
_STUB_DEFAULTS = {"MetadataIndex": {"offset": None, "index": None}, "_StorageInfo": {"transform_descriptors": None}}


class _Resolver:
    """find_class for the two metadata unpicklers: DCP's metadata types (or their stand-ins) and torch's dtypes."""

    path: str
    stubs: bool
    allowed: dict[tuple[str, str], Any]

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is not None:
            return found
        if module == "torch" and self.stubs and is_dtype_name(name):
            from .torch_zip import StoredDtype

            return StoredDtype(name)
        if module == "torch" and not self.stubs and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePickleError(
            self.path, f"DCP metadata references {module}.{name}, which is not one of DCP's metadata types; it was not loaded"
        )


class _MetadataUnpickler(_Resolver, pickle._Unpickler):  # the Python unpickler: its opcodes can be checked one by one
    """Builds only DCP's metadata types. BUILD may set state on an instance, never on a class itself: an allowed
    class must not be changed for the rest of the process by a file that is then refused."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path, self.stubs, self.allowed = path, False, _allowed_globals()

    def _load_build(self) -> None:
        if isinstance(self.stack[-2], type):
            raise UnsafePickleError(self.path, "DCP metadata sets attributes of a class; it was not loaded")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build


class _StubUnpickler(_Resolver, pickle.Unpickler):
    """Builds DCP's metadata as stand-ins, with the C unpickler (a large checkpoint's metadata is megabytes). A
    BUILD cannot reach past this file: on a stub class it calls the unbound ``__setstate__`` (a TypeError), on
    OrderedDict (a builtin type) it fails, and every other global is a function made for this unpickler."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path, self.stubs, self.allowed = path, True, _stub_globals()


def read_metadata(directory: str, stubs: bool = False):
    """DCP's ``Metadata`` of ``directory``, unpickled with DCP's own types only (``stubs``: as MetadataStubs,
    without torch)."""
    path = os.path.join(directory, METADATA)
    if not os.path.isdir(directory):
        raise MissingFileError(directory, "no such directory")
    if not os.path.isfile(path):
        raise MissingFileError(
            path, "missing: not a torch.distributed.checkpoint directory, or its save never finished (DCP writes .metadata last)"
        )
    try:
        with open(path, "rb") as f:
            metadata = (_StubUnpickler if stubs else _MetadataUnpickler)(f, path).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a damaged file
        raise CorruptCheckpointError(path, f"unreadable DCP metadata ({type(exc).__name__}: {exc})") from None
    if not hasattr(metadata, "state_dict_metadata") or not hasattr(metadata, "storage_data"):
        raise CorruptCheckpointError(path, f"is a {type(metadata).__name__}, not DCP metadata")
    named: set[str] = set()
    for info in (metadata.storage_data or {}).values():  # every data file it names stays inside the directory
        rel = getattr(info, "relative_path", None)
        if not (isinstance(rel, str) and rel in named):  # each file once (resolving links is a system call per
            inside(directory, rel, path)                 # component: a tenth of a second for a model's thousand chunks)
            named.add(rel)
        if getattr(info, "transform_descriptors", None):  # compressed or transformed data: neither reader expands it
            raise CorruptCheckpointError(path, f"stores {info.relative_path} through transforms {info.transform_descriptors}; "
                                               "only plain DCP data is read")
        if not all(isinstance(v, int) and v >= 0 for v in (getattr(info, "offset", None), getattr(info, "length", None))):
            raise CorruptCheckpointError(path, f"names a byte range {getattr(info, 'offset', None)}+{getattr(info, 'length', None)} of {info.relative_path}")
    return metadata


NATIVE_KEY = "torch_dcp"  # the native component of our checkpoint around a plain DCP directory


# --- reading ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class Tiles:
    """One stacked slot of a tensor (a layer's weight in torch_dist's ``[layers, ...]``) as the chunks holding it,
    which tile its dimension ``dim`` in equal pieces of ``shape``: ``pieces[i]()`` gives the i-th as a stand-in of
    its bytes in the data file (a torch_zip.StoredTensor, read and checked only where used)."""

    dim: int
    shape: tuple[int, ...]
    pieces: list[Callable[[], Any]]


def _regular_file(path: str) -> None:
    """Refuse a data file that is a pipe or device: opening it would wait forever or read something else."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise CorruptCheckpointError(path, "is not a regular file; DCP data files are")


class DCPReader:
    """One DCP directory: its entries by flattened key, each readable on its own.

    ``paths`` maps a flattened key (``optimizer.state.model.norm.weight.exp_avg``) to the nested path the
    saver flattened (``("optimizer", "state", "model.norm.weight", "exp_avg")``), from the planner data DCP
    records; a checkpoint saved without flattening has one-element paths.
    """

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)
        self.metadata = read_metadata(self.directory, stubs=True)  # torch is imported only if a value needs it
        self._storage = self.metadata.storage_data or {}
        self._objects = {index.fqn: info for index, info in self._storage.items() if index.offset is None}
        planner = self.metadata.planner_data if isinstance(getattr(self.metadata, "planner_data", None), dict) else {}
        self.paths: dict[str, tuple] = {k: tuple(planner.get(k, (k,))) for k in self.metadata.state_dict_metadata}
        self._chunks: dict[str, list[_Chunk]] = {}
        self._maps: dict[str, Any] = {}  # data file -> (its read-only mapping, the inode mapped), shared by its chunks
        for index, info in self._storage.items():
            tensor_md = self.metadata.state_dict_metadata.get(index.fqn)
            if tensor_md is None or not hasattr(tensor_md, "chunks"):
                continue
            # the index is a hint (DCP's own find_tensor_shard checks it against the offset): megatron-core's
            # saves number it per rank, or leave it out, so the offset decides when they disagree
            hint = index.index if index.index is not None and 0 <= index.index < len(tensor_md.chunks) else None
            chunk_md = tensor_md.chunks[hint] if hint is not None else None
            if index.offset is not None and (chunk_md is None or tuple(chunk_md.offsets) != tuple(index.offset)):
                chunk_md = next((c for c in tensor_md.chunks if tuple(c.offsets) == tuple(index.offset)), None)
            offsets = tuple(index.offset) if index.offset is not None else tuple(chunk_md.offsets)
            sizes = tuple(chunk_md.sizes) if chunk_md is not None else tuple(tensor_md.size)
            self._chunks.setdefault(index.fqn, []).append(_Chunk(offsets, sizes, info.relative_path, info.offset, info.length))

    # what is in it
    def tensor_keys(self) -> list[str]:
        return [k for k, v in self.metadata.state_dict_metadata.items() if hasattr(v, "chunks")]

    def object_keys(self) -> list[str]:
        return [k for k, v in self.metadata.state_dict_metadata.items() if not hasattr(v, "chunks")]

    def spec(self, key: str) -> TensorSpec:
        md = self.metadata.state_dict_metadata[key]
        return TensorSpec(tuple(md.size), md.properties.dtype)

    def lazy(self, key: str) -> LazyTensor:
        pieces = (lambda: [piece_of(t, mapped=True) for t in self.row_pieces(key)]) if self._rows_tile(key) else None
        return LazyTensor(self.spec(key), lambda: self.read(key), origin=f"{self.directory}[{key}]", mapped_pieces=pieces)

    def _rows_tile(self, key: str) -> bool:
        """Whether the chunks are whole-row blocks that tile dim 0 (FSDP2's sharding), or one chunk is the whole
        tensor (a 0-dim step): then the tensor's bytes are the chunks' bytes one after another."""
        spec, chunks = self.spec(key), sorted(self._chunks.get(key, []), key=lambda c: c.offsets)
        if len(chunks) == 1 and not any(chunks[0].offsets) and tuple(chunks[0].sizes) == spec.shape:
            return True
        if not chunks or not spec.shape:
            return False
        row = 0
        for c in chunks:
            if c.offsets[0] != row or any(o != 0 for o in c.offsets[1:]) or tuple(c.sizes[1:]) != spec.shape[1:]:
                return False
            row += c.sizes[0]
        return row == spec.shape[0]

    def row_pieces(self, key: str) -> list[Any]:
        """LazyTensor.mapped_pieces: each chunk (a torch_zip.StoredTensor, or torch's) as one contiguous run of its
        file, in row order."""
        spec, out = self.spec(key), []
        for c in sorted(self._chunks[key], key=lambda c: c.offsets):
            data = self._mapped(c.file, c.offset, c.length, f"chunk {list(c.offsets)} of {key!r}")
            if tuple(data.shape) != c.sizes or dtype_name_of(data) != spec.dtype_name or not data.is_contiguous():
                raise CorruptCheckpointError(
                    os.path.join(self.directory, c.file), f"chunk {list(c.offsets)} of {key!r} is not {spec.dtype}{list(c.sizes)}"
                )
            out.append(data.reshape(-1))
        return out

    def tiles(self, key: str, lead: tuple[int, ...] = ()) -> Tiles | None:
        """The slot at leading index ``lead`` of ``key`` (all of it for ``()``) as the chunks holding it, when they
        tile one of its dimensions in equal pieces (each rank's share of a layer, or one chunk for all of it); None
        for any other layout (read with :meth:`read`). Metadata only: no data file is opened."""
        spec, n = self.spec(key), len(lead)
        shape = spec.shape[n:]
        if not shape or len(spec.shape) < n:
            return None
        holding = [c for c in self._chunks.get(key, []) if all(o <= i < o + k for i, o, k in zip(lead, c.offsets, c.sizes))]
        split = {d for c in holding for d in range(len(shape)) if c.sizes[n + d] != shape[d]}
        if not holding or len(split) > 1:
            return None
        dim = split.pop() if split else 0
        ordered = sorted(holding, key=lambda c: c.offsets[n + dim])
        size = ordered[0].sizes[n + dim]
        for i, c in enumerate(ordered):
            if c.sizes[n + dim] != size or c.offsets[n + dim] != i * size or any(c.offsets[n + d] for d in range(len(shape)) if d != dim):
                return None
        if size * len(ordered) != shape[dim]:
            return None
        piece_shape = tuple(size if d == dim else k for d, k in enumerate(shape))
        return Tiles(dim, piece_shape, [lambda c=c: self._slot(key, c, lead) for c in ordered])

    def _slot(self, key: str, chunk: _Chunk, lead: tuple[int, ...]) -> Any:
        """The part of ``chunk`` at leading index ``lead``: contiguous in it, so a stand-in of its bytes."""
        data = self._chunk(key, chunk)
        if not data.is_contiguous():
            return data  # not a view of one run of bytes: the caller merges it with torch instead
        tail = chunk.sizes[len(lead):]
        per, index = math.prod(tail), 0
        for i, o, k in zip(lead, chunk.offsets, chunk.sizes):
            index = index * k + (i - o)
        return data.reshape(-1)[index * per : (index + 1) * per].reshape(tail)

    def view(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any | None:
        """The region ``offsets .. offsets + sizes`` of ``key`` as a stand-in of its bytes, when one chunk holds it
        and it is whole rows of that chunk (Megatron's padded vocabulary rows); None otherwise."""
        for c in self._chunks.get(key, []):
            inside_ = all(c0 <= o and o + s <= c0 + k for o, s, c0, k in zip(offsets, sizes, c.offsets, c.sizes))
            if inside_ and offsets and tuple(sizes[1:]) == tuple(c.sizes[1:]) and not any(offsets[1:]):
                rows = self._slot(key, c, ())
                width = math.prod(c.sizes[1:])
                start = offsets[0] - c.offsets[0]
                return rows.reshape(-1)[start * width : (start + sizes[0]) * width].reshape(sizes)
        return None

    def start_checks(self, key: str) -> None:
        """Start checking the bytes of ``key``'s chunks against the manifest now, on the checking threads (hashing
        releases the GIL), for the reader to plan meanwhile: the tensor a writer asks for first then waits for no
        hashing. Nothing for a file checked whole, or no checkpoint's."""
        for c in self._chunks.get(key, []):
            check = ranged.registered(os.path.join(self.directory, c.file))
            if check is not None:
                check.start(c.offset, c.offset + c.length)

    # the bytes
    def _chunk(self, key: str, chunk: _Chunk) -> Any:
        """A chunk of ``key`` as read (a stand-in, or torch's), the tensor its metadata says it is."""
        data = self._mapped(chunk.file, chunk.offset, chunk.length, f"chunk {list(chunk.offsets)} of {key!r}")
        spec = self.spec(key)
        if not is_tensor(data) or tuple(data.shape) != chunk.sizes or dtype_name_of(data) != spec.dtype_name:
            got = f"{dtype_name_of(data)}{list(data.shape)}" if is_tensor(data) else type(data).__name__
            raise CorruptCheckpointError(
                os.path.join(self.directory, chunk.file),
                f"chunk {list(chunk.offsets)} of {key!r} is {got}, metadata says {spec.dtype_name}{list(chunk.sizes)}",
            )
        return data

    def _mapped(self, relative: str, offset: int, length: int, what: str) -> Any:
        """A stored tensor chunk, read without torch (a torch_zip.StoredTensor over the mapped file); torch's
        weights-only loader for anything the stand-ins do not express."""
        path = os.path.join(self.directory, relative)
        _regular_file(path)
        try:
            found = torch_zip.load(path, base=offset, length=length, maps=self._maps)
        except torch_zip.NeedsTorch:
            return self._load(relative, offset, length, what)
        except FileNotFoundError:
            raise MissingFileError(path, f"holds {what} but is missing") from None
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(path, f"{what}: {exc.problem}") from None
        return found

    def _load(self, relative: str, offset: int, length: int, what: str, allow: list[Any] | None = None) -> Any:
        path = os.path.join(self.directory, relative)
        _regular_file(path)
        try:
            with open(path, "rb") as f:
                check = ranged.registered(path)
                if check is not None:
                    check.check(offset, offset + length, os.fstat(f.fileno()).st_ino)
                f.seek(offset)
                data = f.read(length)
        except FileNotFoundError:
            raise MissingFileError(path, f"holds {what} but is missing") from None
        if len(data) != length:
            raise CorruptCheckpointError(path, f"truncated: {what} needs bytes {offset}..{offset + length}, file has {offset + len(data)}")
        allowed = expanded(allow)
        try:
            with TORCH_LOAD_LOCK, torch.serialization.safe_globals(allowed):
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafePickleError(path, f"{what} is not plain data ({str(exc).splitlines()[0]}); it was not loaded") from None
        except Exception as exc:  # noqa: BLE001
            raise CorruptCheckpointError(path, f"{what} is unreadable ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None

    def read(self, key: str, offsets: tuple[int, ...] | None = None, sizes: tuple[int, ...] | None = None) -> torch.Tensor:
        """The region ``offsets .. offsets + sizes`` of tensor ``key`` (all of it by default)."""
        spec = self.spec(key)
        offsets = tuple(offsets) if offsets is not None else (0,) * len(spec.shape)
        sizes = tuple(sizes) if sizes is not None else spec.shape
        out = torch.empty(sizes, dtype=spec.dtype)
        covered = 0
        for chunk in self._chunks.get(key, []):
            lo = [max(o, c) for o, c in zip(offsets, chunk.offsets)]
            hi = [min(o + s, c + n) for o, s, c, n in zip(offsets, sizes, chunk.offsets, chunk.sizes)]
            if any(h <= low for low, h in zip(lo, hi)) and len(sizes) > 0:
                continue
            data = self._chunk(key, chunk)
            src, dst = as_torch(data), out  # (a stored chunk is copied out of the mapping, its pages let go)
            for dim, (low, h) in enumerate(zip(lo, hi)):
                src = src.narrow(dim, low - chunk.offsets[dim], h - low)
                dst = dst.narrow(dim, low - offsets[dim], h - low)
            dst.copy_(src)
            covered += dst.numel()
        if covered != out.numel():
            raise CorruptCheckpointError(
                self.directory, f"the chunks of {key!r} cover {covered} of the {out.numel()} elements asked for"
            )
        return out

    def read_object(self, key: str, allow: list[Any] | None = None) -> Any:
        """A non-tensor entry (a hyper-parameter, a list of names), loaded as plain data only (and the ``allow``ed
        globals: numpy's for an RNG state)."""
        info = self._objects.get(key)
        if info is None:
            raise CorruptCheckpointError(os.path.join(self.directory, METADATA), f"entry {key!r} has no storage record")
        path = os.path.join(self.directory, info.relative_path)
        _regular_file(path)
        try:  # plain values need no torch; a tensor in one is torch's again (materialize)
            return materialize(torch_zip.load(path, allow, base=info.offset, length=info.length, maps=self._maps))
        except (torch_zip.NeedsTorch, CorruptCheckpointError, OSError):
            return self._load(info.relative_path, info.offset, info.length, f"entry {key!r}", allow)

    def nested(self, prefix: tuple = ()) -> dict:
        """Every entry under ``prefix`` as a nested dict: tensors lazy, other values loaded."""
        root: dict = {}
        for key, path in self.paths.items():
            if path[: len(prefix)] != prefix:
                continue
            value = self.lazy(key) if hasattr(self.metadata.state_dict_metadata[key], "chunks") else self.read_object(key)
            node = root
            for part in path[len(prefix):-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
        return root


def unflatten_lists(node: Any) -> Any:
    """DCP flattens a list into dict entries keyed 0, 1, ...; turn those back into lists."""
    if isinstance(node, dict):
        node = {k: unflatten_lists(v) for k, v in node.items()}
        if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
            return [node[i] for i in range(len(node))]
    return node


# --- writing ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it 'assumes' a single process whenever there is no process group; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def save_dcp(state: dict[str, Any], directory: str) -> None:
    """``dcp.save`` of a live state dict by every rank of the run (or by one process without a group)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with _single_process_quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory), no_dist=not dist.is_initialized())


def stage_dcp(state: dict[str, Any], directory: str | None, process_group: Any = None, storage_writer: Any = None,
              planner: Any = None, live: Sequence[Any] | None = None) -> Callable[[], None]:
    """DCP's asynchronous save split where a commit thread needs it: the state is staged now (DCP's own stager: a copy
    in CPU memory that later training steps cannot change) and the returned writer runs ``dcp.save`` of the copy over
    ``process_group``. Writers run one after another on one thread, so several staged saves of one checkpoint
    (accelerate saves model and optimizer apart) never issue collectives side by side, as separate ``async_save``
    threads would on one group.

    ``live``: every tensor later training steps change in place (``trainers.state.live_tensors``: a model's
    parameters, gradients and buffers, its optimizer's state and parameter groups). A host tensor of ``state`` that
    shares storage with none of them is already a copy that nothing else reaches (a state dict taken with
    ``cpu_offload`` from a model on an accelerator: accelerate's FSDP2 saves) and is kept as it is rather than copied
    again, which cost its size again in memory and a host copy in the blocking part. With no ``live``, every tensor
    is copied."""
    import torch.distributed as dist
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    from torch.distributed.checkpoint.state_dict_saver import save as blocking_save  # not dcp.save: a caller may have patched it
    import torch.distributed.checkpoint as dcp

    stager = StateDictStager(pin_memory=False, share_memory=False)
    memo = {id(t): t for t in _unshared_host_tensors(state, live)} if live is not None else {}
    try:
        held = [on_staging_thread(stager.deepcopy_with_tensor_offload, state, memo)]  # apart from training's memory (see there)
    finally:  # its cache (of every copy, for a next stage() we never make) is held by a cycle through the stager itself:
        stager.close()  # cleared now, the copies go with the staged state, even when it is dropped unwritten
    storage_writer = storage_writer or dcp.FileSystemWriter(directory)

    def write() -> None:
        with _single_process_quiet():
            blocking_save(held.pop(), storage_writer=storage_writer, planner=planner, process_group=process_group,
                          no_dist=not dist.is_initialized())

    return write


def _unshared_host_tensors(state: Any, live: Sequence[Any]) -> list[Any]:
    """The tensors of ``state`` that lie in host memory and share no storage with a host tensor of ``live`` (a
    DTensor by its local shard). A tensor whose storage cannot be told (a wrapper subclass other than DTensor) is
    never among them: it is copied."""
    taken = {_host_storage(t) for t in live} | {None}
    return [t for t in tensor_leaves(state) if _host_storage(t) not in taken]


def _host_storage(t: Any) -> int | None:
    """Where the storage of ``t`` (a DTensor's local shard) lies in host memory; None on a device, for an empty
    storage, or where a tensor subclass has none to tell."""
    try:
        shard = t.to_local() if hasattr(t, "to_local") else t
        if shard.device.type != "cpu":
            return None
        return shard.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def tensor_leaves(node: Any) -> list[Any]:
    """Every tensor in the nested dicts, lists and tuples of ``node``, in order."""
    if isinstance(node, torch.Tensor):
        return [node]
    if isinstance(node, dict):
        node = list(node.values())
    if isinstance(node, (list, tuple)):
        return [t for v in node for t in tensor_leaves(v)]
    return []


def write_dcp(
    state: dict[str, Any],
    directory: str,
    progress: Callable[[Iterable], Iterator] | None = None,
) -> None:
    """Save the nested ``state`` as a DCP checkpoint in ``directory``, which must be empty. Readable by
    ``dcp.load`` on any number of ranks. DCP's own planner makes the plan and ``.metadata``; the data file is
    written here (:func:`_streaming_writer`): a LazyTensor leaf streams from its source, part by part, as the
    writer reaches it. An ``io.BytesIO`` leaf is stored as its bytes; any other object as torch.save's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    lazies: dict[int, LazyTensor] = {}

    def meta(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: meta(v) for k, v in node.items()}
        if isinstance(node, list):
            return [meta(v) for v in node]
        if isinstance(node, LazyTensor):
            t = torch.empty(node.spec.shape, dtype=node.spec.dtype, device="meta")
            lazies[id(t)] = node
            return t
        return node

    skeleton = meta(state)
    meta = None  # it named itself: a reference cycle that kept every LazyTensor until the garbage collector ran
    written: list[LazyTensor] = []

    class _LazyPlanner(DefaultSavePlanner):
        def transform_object(self, write_item, object):
            if isinstance(object, io.BytesIO):  # bytes already serialized (megatron-core's ShardedObjects): stored as they are
                return object
            return super().transform_object(write_item, object)

    from torch.distributed.checkpoint.api import CheckpointException

    from interop.errors import InteropError

    try:
        with _single_process_quiet():
            dcp.save(skeleton, storage_writer=_streaming_writer(directory, lazies, written), planner=_LazyPlanner(), no_dist=True)
    except CheckpointException as exc:  # DCP wraps what its writer raised: ours (a corrupt source, a full disk) is raised as it is
        ours = [e for e, _ in exc.failures.values() if isinstance(e, InteropError)]
        if ours:
            raise ours[0] from None
        raise
    if len(written) != len(lazies):
        raise RuntimeError(f"DCP save wrote {len(written)} of {len(lazies)} tensors")  # would be a torch behaviour change
    log.info("wrote DCP checkpoint %s (%d tensors)", directory, len(lazies))


def _streaming_writer(directory: str, lazies: dict[int, LazyTensor], written: list[LazyTensor]) -> Any:
    """DCP's FileSystemWriter (one data file per rank, as with its one thread), writing each tensor item with
    :func:`torch_save.write_tensor` from the LazyTensor the planner's meta tensor stands for: its parts (or its
    mapped bytes, or the loaded tensor) one after another, never the whole stacked tensor. Beside the writes, one
    thread hashes what was written (the data file's digest for the manifest, no reading it back) and checks each
    mapped source's bytes against its digest. The WriteResults are DCP's, so its own ``finish`` writes ``.metadata``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    from concurrent.futures import ThreadPoolExecutor

    from interop.hashed_writes import hashed_output

    class _StreamingWriter(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            path = os.path.join(str(self.path), name)
            results = []
            items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO] + [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
            with hashed_output(path) as f, ThreadPoolExecutor(1, thread_name_prefix="dcp-fetch") as ahead:
                for item in items:
                    offset = f.tell()
                    if item.type == WriteItemType.BYTE_IO:
                        length = f.write(planner.resolve_data(item).getbuffer())
                    else:
                        length = _write_tensor_item(f, item, planner, lazies, written, f.beside, ahead)
                    results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length)))
                f.sync()
            done = torch.futures.Future()
            done.set_result(results)
            return done

    return _StreamingWriter(directory)


def _write_tensor_item(f, item, planner, lazies: dict[int, LazyTensor], written: list[LazyTensor], beside: Beside, ahead: Any) -> int:
    """One tensor write item at ``f``'s position, in torch.save's format; its length."""
    from interop.tensors import raw_bytes

    from . import torch_save

    obj = planner.lookup_object(item.index)
    lazy = lazies.get(id(obj)) if isinstance(obj, torch.Tensor) and obj.is_meta else None
    chunk = item.tensor_data.chunk
    if lazy is None:  # a real tensor (or the planner's chunk of one)
        tensor = planner.resolve_data(item).detach().cpu().contiguous()
        return torch_save.write_tensor(f, tuple(tensor.shape), tensor.dtype, tensor.nbytes, [raw_bytes(tensor)])
    if any(chunk.offsets) or tuple(chunk.sizes) != lazy.spec.shape:
        raise RuntimeError(f"DCP planned {item.index.fqn} as a chunk of it")  # plain tensors are saved whole
    written.append(lazy)
    return torch_save.write_tensor(f, lazy.spec.shape, lazy.spec.dtype, lazy.spec.nbytes, tensor_bytes(lazy, beside, ahead))


def load_dcp(state: dict[str, Any], directory: str, metadata=None) -> None:
    """``dcp.load`` of ``directory`` into ``state`` (DTensors reshard to whatever layout they have now), reading
    only data: ``.metadata`` through DCP's own types (or the ``metadata`` the caller already read), stored
    objects with ``weights_only``. torch's own reader unpickles both without restriction."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class _SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            where = f"entry {read_item.dest_index.fqn!r} of {directory}"
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise UnsafePickleError(where, f"is not plain data ({str(exc).splitlines()[0]}); it was not loaded") from None
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    import torch.distributed as dist

    if metadata is None:
        metadata = read_metadata(directory)  # a clear error for a missing or damaged directory before any collective
    with _single_process_quiet():
        dcp.load(state, storage_reader=_SafeReader(directory), planner=_SafePlanner(), no_dist=not dist.is_initialized())


# --- logical checkpoints ------------------------------------------------------------------------------------
def optimizer_from_tree(tree: dict[str, Any], where: str) -> OptimizerState:
    """torch's name-keyed optimizer state dict (``get_optimizer_state_dict``'s layout, as FSDP2 saves it)."""
    groups = tree.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise CorruptCheckpointError(where, "holds no optimizer param_groups with parameter names")
    members = {n for g in groups for n in g["params"]}
    state = tree.get("state") or {}
    unknown = [name for name in state if name not in members]
    if unknown:
        raise CorruptCheckpointError(where, f"optimizer state for {unknown[0]!r}, which no param group holds")
    return OptimizerState(DeferredName(lambda: optimizer_class.class_of(groups)), groups, *split_optimizer_state(state, where))


def drop_tied_aliases(model: dict[str, LazyTensor], tied: list[list[str]]) -> dict[str, LazyTensor]:
    """DCP (``get_model_state_dict``) holds both names of a tied pair; a logical checkpoint holds the source."""
    aliases = {g[0] for g in tied if len(g) > 1 and g[1] in model}
    return {n: t for n, t in model.items() if n not in aliases}


def model_tree(ckpt: LogicalCheckpoint, order: EngineOrder) -> dict[str, LazyTensor]:
    """Model tensors by name, tied names included (``get_model_state_dict`` holds both)."""
    return dict(ckpt.model) | {t: ckpt.model[s] for t, s in order.aliases.items() if t not in ckpt.model}


def optimizer_tree(ckpt: LogicalCheckpoint, order: EngineOrder) -> dict[str, Any]:
    """The optimizer in ``get_optimizer_state_dict``'s layout: state by name, groups naming their members."""
    opt = ckpt.optimizer
    state: dict[str, dict[str, Any]] = {}
    for name in (n for g in order.groups for n in g):
        entry: dict[str, Any] = {}
        for key, per in (opt.scalars.items() if opt else []):
            if name in per:
                entry[key] = saved_scalar(per[name])
        for key, per in (opt.tensors.items() if opt else []):
            if name in per:
                entry[key] = per[name]
        if entry:
            state[name] = entry
    return {"state": state, "param_groups": [{**h, "params": list(g)} for h, g in zip(order.hyper, order.groups)]}


def read_dcp_checkpoint(path: str, verify_digests: bool = True) -> LogicalCheckpoint:
    """Any DCP checkpoint: ``model.*`` entries (or, with no ``model`` prefix, every top-level tensor) are the
    model; an ``optimizer`` subtree in torch's name-keyed layout is the optimizer. Other entries are left out."""
    from .engine_checkpoint import carried_components, owning_checkpoint
    from .models.facts import tied_groups
    from .hf import read_config

    manifest, owner = owning_checkpoint(path, NATIVE_KEY, verify_digests)  # ours: every file checked first
    reader = DCPReader(path)
    keys = set(reader.tensor_keys())
    prefixed = {".".join(map(str, p[1:])): k for k, p in reader.paths.items() if p[0] == "model" and k in keys}
    if prefixed:
        model = {n: reader.lazy(k) for n, k in prefixed.items()}
    else:
        model = {k: reader.lazy(k) for k, p in reader.paths.items() if k in keys and p[0] != "optimizer"}
    optimizer = None
    if any(p[0] == "optimizer" for p in reader.paths.values()):
        optimizer = optimizer_from_tree(unflatten_lists(reader.nested(("optimizer",))), reader.directory)
    config = read_config(path) if os.path.isfile(os.path.join(path, "config.json")) else None
    tied = tied_groups(config)
    model = drop_tied_aliases(model, tied)
    skipped = sorted(k for k, p in reader.paths.items() if p[0] not in ("model", "optimizer") and prefixed)
    notes = [f"DCP entries outside model/optimizer not converted: {skipped[:5]}"] if skipped else []
    return LogicalCheckpoint(model=model, config=config, optimizer=optimizer, source={"format": "dcp"}, tied=tied, notes=notes,
                             components=carried_components(owner, manifest, NATIVE_KEY),
                             topology=manifest.topology if manifest is not None else None,
                             step=manifest.step if manifest is not None else None)


def write_dcp_checkpoint(ckpt: LogicalCheckpoint, dst: str, overwrite: bool = False) -> None:
    """``{"model": ..., "optimizer": ...}`` as one DCP checkpoint at ``dst`` (``dcp.load(state, checkpoint_id=dst)``),
    config.json, our manifest and the source's other components beside it."""
    import json

    import torch

    from interop.commit import durable_write
    from interop.sharding import ShardingMetadata, Strategy

    from .engine_checkpoint import write_engine_checkpoint
    from .param_order import engine_order

    order = engine_order(ckpt)
    state: dict[str, Any] = {"model": model_tree(ckpt, order)}
    if ckpt.optimizer is not None:
        state["optimizer"] = optimizer_tree(ckpt, order)

    def write_files(out: str) -> None:
        write_dcp(state, out)
        if ckpt.config is not None:
            durable_write(os.path.join(out, "config.json"), json.dumps(ckpt.config, indent=2).encode())

    sharding = ShardingMetadata(strategy=Strategy.SINGLE, precision=ckpt.source.get("dtype") or "float32")
    write_engine_checkpoint(ckpt, dst, NATIVE_KEY, write_files, sharding, {"torch": torch.__version__},
                            {"class": ckpt.optimizer.cls} if ckpt.optimizer is not None else None, overwrite)
