"""Logical tensors: a name, a global shape and dtype, and bytes that are read only when asked for."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .dtypes import dtype_name, itemsize

DIGEST_ALGO = "sha256"


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    def describe(self) -> str:
        return f"{dtype_name(self.dtype)}{list(self.shape)}"


@dataclass
class LazyTensor:
    """A tensor whose bytes stay on disk until ``load()``; converters stream these one at a time."""

    spec: TensorSpec
    loader: Callable[[], torch.Tensor] = field(repr=False)
    origin: str = ""  # file (and key) it comes from, for error messages and `inspect`
    digest: str | None = None  # known digest of the bytes (from a manifest): lets `diff` skip loading

    @classmethod
    def of(cls, tensor: torch.Tensor, origin: str = "memory") -> "LazyTensor":
        tensor = tensor.detach()
        return cls(TensorSpec(tuple(tensor.shape), tensor.dtype), lambda: tensor, origin)

    def load(self) -> torch.Tensor:
        tensor = self.loader()
        if tuple(tensor.shape) != self.spec.shape or tensor.dtype != self.spec.dtype:
            from .errors import CorruptCheckpointError

            raise CorruptCheckpointError(
                self.origin,
                f"tensor is {dtype_name(tensor.dtype)}{list(tensor.shape)}, expected {self.spec.describe()}",
            )
        return tensor


_MADV_DONTNEED = 4  # Linux


def release_mapped_pages(tensor: torch.Tensor) -> None:
    """Let go of the resident pages under ``tensor``, a view of a file mapped with ``torch.load(mmap=True)``
    that has been read and will not be written: they stay in the page cache, but leave this process's RSS,
    so streaming through a large mapped file costs the memory of one tensor, not of the file.

    Only for file-backed memory: on anonymous memory this would zero the data, so callers pass only
    tensors they know were mapped from a file. Elsewhere than Linux it does nothing."""
    import sys

    if sys.platform != "linux" or tensor.numel() == 0:
        return
    import ctypes
    import mmap

    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the range only: a neighbour may share an edge
    hi = end // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order and native (little-endian) byte order, with no copy when contiguous."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def tensor_digest(tensor: torch.Tensor) -> str:
    """Digest of a logical tensor's bytes: the same whichever format or sharding held it."""
    return f"{DIGEST_ALGO}:" + hashlib.sha256(raw_bytes(tensor)).hexdigest()


def tensor_from_bytes(buffer: bytearray | bytes, spec: TensorSpec) -> torch.Tensor:
    if spec.numel == 0:
        return torch.empty(spec.shape, dtype=spec.dtype)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(spec.dtype).reshape(spec.shape)
