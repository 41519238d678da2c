"""Logical tensors: a name, a global shape and dtype, and bytes that are read only when asked for."""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, Iterable

from . import digests
from .dtypes import dtype_from_name, dtype_name, is_floating, itemsize, unpack_scalar
from .lazy_import import torch

_dtype_name = dtype_name  # TensorSpec's field of that name hides it in __init__
_CHECKING = [threading.Lock() for _ in range(64)]  # LazyTensor.check_once: a lock per tensor, without one in each


@dataclass(frozen=True, init=False)
class TensorSpec:
    """A tensor's shape and dtype. The dtype is kept by name, so a spec read from a file header needs no torch;
    ``dtype`` is torch's, for code that makes tensors."""

    shape: tuple[int, ...]
    dtype_name: str  # torch's name: "bfloat16"

    def __init__(self, shape: tuple[int, ...], dtype: "torch.dtype | str | None" = None, *, dtype_name: str | None = None):
        if (dtype is None) == (dtype_name is None):
            raise TypeError("TensorSpec takes a dtype, or a dtype_name (dataclasses.replace)")
        object.__setattr__(self, "shape", tuple(shape))
        object.__setattr__(self, "dtype_name", _dtype_name(dtype if dtype is not None else dtype_name))

    @cached_property
    def dtype(self) -> "torch.dtype":
        return dtype_from_name(self.dtype_name)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype_name)

    @property
    def is_floating_point(self) -> bool:
        return is_floating(self.dtype_name)

    def describe(self) -> str:
        return f"{self.dtype_name}{list(self.shape)}"


@dataclass
class Piece:
    """Some of a tensor's bytes, in order: ``data`` to hash or write, and where they lie in a file when they are a
    view of its mapping (``source``: path and offset), so a writer copies them file to file in the kernel and then
    lets their pages go (``release``: out of this process's memory, still in the page cache)."""

    data: memoryview
    source: tuple[str, int, int] | None = None  # path, offset, and the inode mapped (a file replaced since is not copied)
    release: Callable[[], None] | None = field(default=None, repr=False)
    dtype: str | None = None  # the dtype the bytes were viewed as, where they came from a tensor

    @classmethod
    def of_tensor(cls, tensor: "torch.Tensor", mapped: bool = False) -> "Piece":
        """A tensor's bytes; with ``mapped``, a contiguous view of a mapped file (``torch.load(mmap=True)``)."""
        data, dtype = raw_bytes(tensor), dtype_name(tensor.dtype)
        if not mapped:
            return cls(data, dtype=dtype)
        return cls(data, mapped_file_range(tensor), lambda: release_mapped_pages(tensor), dtype)

    @property
    def bytes_view(self) -> memoryview:
        """``data`` as one flat run of bytes (indexed and measured in bytes, whatever it was viewed as)."""
        return self.data if self.data.format == "B" and self.data.ndim == 1 else self.data.cast("B")


def _hashed(pieces: list[Piece], algo: str) -> str:
    """The ``algo`` digest of the pieces' bytes, read from their files (not through a mapping: SIGBUS if one was cut
    short meanwhile); their mapped pages let go after."""
    from .safetensors_io import hash_pieces  # (it imports this module)

    try:
        return digests.label(algo, hash_pieces(pieces, algo).hex())
    finally:
        for piece in pieces:
            if piece.release is not None:
                piece.release()


def sub_pieces(pieces: list[Piece], lo: int, hi: int) -> list[Piece]:
    """Bytes ``lo:hi`` of what ``pieces`` hold in order, as pieces of the same memory and files (no copy)."""
    out, at = [], 0
    for p in pieces:
        data = p.bytes_view
        a, b = max(lo - at, 0), min(hi - at, len(data))
        if a < b:
            source = (p.source[0], p.source[1] + a, p.source[2]) if p.source is not None else None
            out.append(Piece(data[a:b], source, p.release, p.dtype))
        at += len(data)
    return out


@dataclass
class LazyTensor:
    """A tensor whose bytes stay on disk until ``load()``; converters stream these one at a time."""

    spec: TensorSpec
    loader: Callable[[], torch.Tensor] = field(repr=False)
    origin: str = ""  # file (and key) it comes from, for error messages and `inspect`
    digest: str | None = None  # the digest a manifest records for these bytes: ``load`` checks it
    # Optional: the bytes as views of memory-mapped files, in order, without a copy (None when they cannot be had
    # after all). A writer that only streams bytes out (safetensors) copies and hashes these, needing no torch.
    mapped_pieces: Callable[[], list[Piece] | None] | None = field(default=None, repr=False)
    # Optional: the tensor as consecutive parts of its first dimension (a stack of layers), each loaded in turn. A
    # writer that streams bytes (torch.save's format, :mod:`converters.torch_save`) writes these one at a time
    # instead of building the whole tensor to write it.
    parts: Callable[[], Iterable["LazyTensor"]] | None = field(default=None, repr=False)
    _checked: bool = field(default=False, init=False, repr=False, compare=False)  # check_once: its digest checked

    @classmethod
    def of(cls, tensor: torch.Tensor, origin: str = "memory") -> "LazyTensor":
        tensor = tensor.detach()
        return cls(TensorSpec(tuple(tensor.shape), tensor.dtype), lambda: tensor, origin)

    def cast(self, dtype: torch.dtype) -> "LazyTensor":
        """This tensor in ``dtype`` (a floating tensor; others and same-dtype ones are returned as they are),
        read and checked only when loaded."""
        if self.spec.dtype_name == dtype_name(dtype) or not self.spec.is_floating_point:
            return self
        return LazyTensor(TensorSpec(self.spec.shape, dtype), lambda: self.load().to(dtype), f"{self.origin} as {dtype_name(dtype)}")

    def guarded(self, lock: "threading.Lock") -> "LazyTensor":
        """This tensor read under ``lock`` (its loader, its mapped pieces, its parts' listing and theirs), for a
        source whose reads share caches that are not safe across threads (a TP merge's), read by writers on several."""
        def under(fn: Callable) -> Callable:
            def run():
                with lock:
                    return fn()
            return run

        parts = None
        if self.parts is not None:
            listed, made = under(lambda: list(self.parts())), []

            def parts() -> list[LazyTensor]:  # made once: a part's digest is then checked once (check_once)
                if not made:
                    made.append([p.guarded(lock) for p in listed()])
                return made[0]
        return replace(self, loader=under(self.loader), mapped_pieces=under(self.mapped_pieces) if self.mapped_pieces else None, parts=parts)

    def flat_slice(self, lo: int, hi: int) -> "LazyTensor":
        """Elements ``lo:hi`` of this tensor flattened, read only when loaded: views of its mapped bytes where it
        has them (copied file to file), else sliced from the loaded tensor. A slice cannot be checked against a
        digest of the whole, so where this tensor has one, the whole tensor's bytes are checked once (hashed as read
        from its files, no torch) before any slice's are handed out."""
        if not 0 <= lo <= hi <= self.spec.numel:
            raise ValueError(f"{self.origin}: elements {lo}:{hi} of {self.spec.describe()}")
        if self.mapped_pieces is None and self.parts is not None:  # the slices of its parts (each checked as a part is)
            return self._slice_of_parts(lo, hi)
        size = itemsize(self.spec.dtype_name)

        def pieces() -> list[Piece] | None:
            whole = self.mapped_pieces() if self.mapped_pieces is not None else None
            if whole is None or not self.check_once():
                return None
            return sub_pieces(whole, lo * size, hi * size)

        def load() -> torch.Tensor:
            """The slice's bytes alone, read from the checked files; else the whole tensor loaded and sliced."""
            viewed = pieces() if self.mapped_pieces is not None else None
            if viewed is None:
                return self.load().reshape(-1)[lo:hi]
            from .output_files import read_pieces  # (it imports this module)

            flat, out = unfilled_bytes((hi - lo) * size)
            read_pieces(viewed, out)  # from their files, not through a mapping (SIGBUS if one was cut short meanwhile)
            return flat.view(self.spec.dtype)

        return LazyTensor(TensorSpec((hi - lo,), dtype_name=self.spec.dtype_name), load, f"{self.origin}[{lo}:{hi}]",
                          mapped_pieces=pieces if self.mapped_pieces is not None else None)

    def _slice_of_parts(self, lo: int, hi: int) -> "LazyTensor":
        """Elements ``lo:hi`` of a tensor that is its parts one after another (a fused stack of stored tensors)."""
        pieces, at = [], 0
        for part in self.parts():
            n = part.spec.numel
            a, b = max(lo - at, 0), min(hi - at, n)
            if a < b:
                pieces.append(part.flat_slice(a, b))
            at += n
        return concat(pieces, self.spec.dtype_name, f"{self.origin}[{lo}:{hi}]")

    def reshaped(self, shape: tuple[int, ...]) -> "LazyTensor":
        """The same bytes as ``shape`` (the digest, of the bytes, still holds); its parts kept where they still are
        parts (flattened for a 1-D shape, as they are for the same row shape), else it streams loaded whole."""
        shape = tuple(shape)
        if shape == self.spec.shape:
            return self
        if math.prod(shape) != self.spec.numel:
            raise ValueError(f"{self.origin}: {self.spec.describe()} cannot be viewed as {list(shape)}")
        parts = None
        if self.parts is not None and len(shape) == 1:
            parts = lambda: [p.reshaped((p.spec.numel,)) for p in self.parts()]  # noqa: E731
        elif self.parts is not None and shape[1:] == self.spec.shape[1:]:
            parts = self.parts
        return LazyTensor(TensorSpec(shape, dtype_name=self.spec.dtype_name), lambda: self.loader().reshape(shape), self.origin,
                          self.digest, self.mapped_pieces, parts)

    def check_once(self) -> bool:
        """This tensor's bytes checked against its digest (its mapped pieces hashed as read from their files, by the
        digest's own algorithm: a checkpoint of an earlier version's too), once; True when they are (or it records
        none), False when they could not be hashed without loading it (no mapped pieces)."""
        if self.digest is None or self._checked:
            return True
        if self.mapped_pieces is None:
            return False
        with _CHECKING[id(self) % len(_CHECKING)]:  # sliced on several threads at once: hashed once, the others wait
            if not self._checked:
                pieces = self.mapped_pieces()
                if pieces is None:
                    return False
                self.check_digest(_hashed(pieces, digests.parse(self.digest, self.origin)[0]))  # raises where they differ
                self._checked = True
        return True

    def load(self, verify: bool = True) -> torch.Tensor:
        """The tensor, checked against its spec and (unless the caller hashes the bytes itself, ``verify=False``)
        against the digest its manifest records."""
        from .errors import CorruptCheckpointError

        tensor = self.loader()
        if tuple(tensor.shape) != self.spec.shape or tensor.dtype != self.spec.dtype:
            raise CorruptCheckpointError(
                self.origin,
                f"tensor is {dtype_name(tensor.dtype)}{list(tensor.shape)}, expected {self.spec.describe()}",
            )
        if verify and self.digest is not None:
            self.check_digest(tensor_digest(tensor, digests.parse(self.digest, self.origin)[0]))
        return tensor

    def item(self) -> int | float | bool:
        """A one-element tensor's value: decoded from its mapped bytes where it has them and no digest to check
        (no torch), else loaded."""
        pieces = self.mapped_pieces() if self.mapped_pieces is not None and self.digest is None and self.spec.numel == 1 else None
        if pieces:
            from .output_files import read_pieces  # (it imports this module)

            raw = bytearray(sum(p.data.nbytes for p in pieces))
            read_pieces(pieces, memoryview(raw))  # from their files, not a mapping (SIGBUS if one was cut short)
            value = unpack_scalar(raw, self.spec.dtype_name)
            if value is not None:
                return value
        return self.load().item()

    def bytes_digest(self) -> str:
        """``tensor_digest`` of this tensor, hashed from its mapped pieces' files where it has them (no torch), and
        checked against the digest its manifest records, as ``load`` checks it."""
        pieces = self.mapped_pieces() if self.mapped_pieces is not None else None
        if pieces is None or (self.digest is not None and digests.parse(self.digest, self.origin)[0] != digests.ALGO):
            return tensor_digest(self.load())
        computed = _hashed(pieces, digests.ALGO)
        self.check_digest(computed)
        return computed

    def check_digest(self, computed: str) -> None:
        """Raise naming the origin when ``computed`` (by the recorded digest's algorithm) is not the recorded one."""
        if self.digest is not None and computed != self.digest:
            from .errors import CorruptCheckpointError

            raise CorruptCheckpointError(self.origin, "tensor bytes differ from the digest its manifest records (corrupted or replaced)")


def concat(parts: list[LazyTensor], dtype: str, origin: str) -> LazyTensor:
    """``parts`` (of ``dtype``, one shape but for the first dimension) one after another along their first dimension:
    a writer that streams (``parts``) writes them in turn, never the whole; ``load`` builds it."""
    rest = {p.spec.shape[1:] for p in parts}
    if any(p.spec.dtype_name != dtype or not p.spec.shape for p in parts) or len(rest) > 1:
        raise ValueError(f"{origin}: concatenates {dtype} parts of one row shape, not {[p.spec.describe() for p in parts]}")
    spec = TensorSpec((sum(p.spec.shape[0] for p in parts), *(rest.pop() if rest else ())), dtype_name=dtype)
    return LazyTensor(spec, lambda: torch.cat([p.load() for p in parts]) if parts else torch.empty(spec.shape, dtype=spec.dtype), origin,
                      parts=lambda: parts)


def zeros(numel: int, dtype: str, origin: str = "zeros") -> LazyTensor:
    """``numel`` zeros of ``dtype``, made only when loaded."""
    return LazyTensor(TensorSpec((numel,), dtype_name=dtype), lambda: torch.zeros(numel, dtype=dtype_from_name(dtype)), origin)


_MADV_DONTNEED = 4  # Linux
# this process's file-backed mappings, sorted: (start, end, offset in the file, path, inode)
_file_maps: list[tuple[int, int, int, str, int]] = []


def _remembered(lo: int, hi: int) -> tuple[int, int, int, str, int] | None:
    import bisect

    maps = _file_maps  # one snapshot: another thread may rebind the list meanwhile (never changes it in place)
    i = bisect.bisect_right(maps, (lo, float("inf"))) - 1
    return maps[i] if i >= 0 and maps[i][0] <= lo and hi <= maps[i][1] else None


def _mapping(lo: int, hi: int) -> tuple[int, int, int, str, int] | None:
    """The file-backed mapping that holds all of ``lo .. hi`` now. A remembered mapping is checked against
    /proc/self/map_files (an address freed since may belong to another file, or to anonymous memory);
    /proc/self/maps is read again when that fails or nothing is remembered."""
    found = _remembered(lo, hi)
    if found is not None:
        try:
            if os.readlink(f"/proc/self/map_files/{found[0]:x}-{found[1]:x}") == found[3]:
                return found
        except OSError:  # unmapped, or map_files not readable here
            pass
    maps = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.rstrip("\n").split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):  # a path: file-backed
                a, b = fields[0].split("-")
                maps.append((int(a, 16), int(b, 16), int(fields[2], 16), fields[5], int(fields[4])))
    global _file_maps
    _file_maps = sorted(maps)  # rebound, not changed in place: readers on other threads keep a whole list
    return _remembered(lo, hi)


def _file_backed(lo: int, hi: int) -> bool:
    return _mapping(lo, hi) is not None


def mapped_file_range(tensor: torch.Tensor) -> tuple[str, int, int] | None:
    """(path, byte offset, inode) of a contiguous tensor that is a view of a mapped file (``torch.load(mmap=True)``):
    its bytes can then be copied file to file by the kernel. None for anything else, and off Linux."""
    import sys

    if sys.platform != "linux" or tensor.numel() == 0 or not tensor.is_contiguous() or tensor.device.type != "cpu":
        return None
    start = tensor.data_ptr()
    found = _mapping(start, start + tensor.numel() * tensor.element_size())
    if found is None:
        return None
    map_start, _, offset, path, inode = found
    try:
        if os.stat(path).st_ino != inode:  # replaced since it was mapped
            return None
    except OSError:  # " (deleted)", or gone
        return None
    return path, offset + start - map_start, inode


def release_mapped_pages(tensor: torch.Tensor) -> None:
    """Let go of the resident pages under ``tensor``, a view of a file mapped with ``torch.load(mmap=True)``
    that has been read and will not be written: they stay in the page cache, but leave this process's RSS,
    so streaming through a large mapped file costs the memory of one tensor, not of the file.

    Does nothing unless the memory is a file-backed mapping (on anonymous memory MADV_DONTNEED would zero
    the data: a tensor copied on load, a non-contiguous reshape), and nothing elsewhere than Linux."""
    import sys

    if sys.platform != "linux" or tensor.numel() == 0:
        return
    import ctypes
    import mmap

    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the range only: a neighbour may share an edge
    hi = end // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo and tensor.is_contiguous() and _file_backed(lo, hi):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


def raw_bytes(tensor: "torch.Tensor") -> memoryview:
    """The tensor's bytes in C order and native (little-endian) byte order, with no copy when contiguous."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def tensor_digest(tensor: torch.Tensor, algo: str = digests.ALGO) -> str:
    """Digest of a logical tensor's bytes: the same whichever format or sharding held it."""
    return digests.of_bytes(raw_bytes(tensor), algo)


def unfilled_bytes(nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """A uint8 tensor of ``nbytes`` that torch allocates without writing it, and a writable view of its memory to
    read or copy a tensor's bytes into. Why: ``bytearray(n)`` writes n zeros first, a pass over the memory that
    the read then writes again (a third of the time of reading a safetensors tensor from the page cache)."""
    flat = torch.empty(nbytes, dtype=torch.uint8)
    return flat, memoryview(flat.numpy()) if nbytes else memoryview(bytearray())
