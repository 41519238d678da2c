"""Tensor-parallel merges and fusers run on numbers instead of values, without torch.

An export from Megatron only moves bytes: which rows of which rank file make each Hugging Face tensor follows from
the merge and the unfuse alone. Running those same functions (``megatron_map``'s rules, written against torch's
tensor methods) on arrays of row numbers says it for whatever they do; :class:`RowNumbers` is a numpy array with
the few torch methods they call, so the plan needs numpy (a tenth of a second) and not torch (a second or more).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class RowNumbers(np.ndarray):
    """A numpy array answering the torch tensor methods of the TP merge and the fusers (``megatron_map.cat``
    takes these in place of ``torch.cat``). Values are row numbers; a shape-only stand-in (``shaped``) is all
    zero strides, so planning a shape allocates nothing but what a concatenation makes."""

    @classmethod
    def of(cls, array: Any) -> "RowNumbers":
        return np.asarray(array).view(cls)

    @classmethod
    def shaped(cls, shape: tuple[int, ...]) -> "RowNumbers":
        return np.broadcast_to(np.zeros((), dtype=np.bool_), shape).view(cls)

    @classmethod
    def cat(cls, parts: list["RowNumbers"], dim: int = 0) -> "RowNumbers":
        arrays = [np.asarray(p) for p in parts]
        if all(not any(a.strides) for a in arrays):  # shape-only stand-ins: a shape-only result (no array of the whole)
            shape = list(arrays[0].shape)
            shape[dim] = sum(a.shape[dim] for a in arrays)
            return cls.shaped(tuple(shape))
        return np.concatenate(arrays, axis=dim).view(cls)

    def t(self) -> "RowNumbers":
        if self.ndim > 2:
            raise ValueError("t() expects a tensor with <= 2 dimensions")
        return self.T

    def contiguous(self) -> "RowNumbers":
        return self  # the same values in another memory layout: nothing a plan sees

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return int(self.size)

    def chunk(self, chunks: int, dim: int = 0) -> list["RowNumbers"]:
        """torch.chunk's split: pieces of ceil(n / chunks), the last smaller (and fewer pieces if they run out)."""
        n = self.shape[dim]
        if n == 0:
            return [self] * chunks
        size = -(-n // chunks)
        return [self[(slice(None),) * dim + (slice(i, i + size),)] for i in range(0, n, size)]

    def split(self, sizes: int | list[int], dim: int = 0) -> list["RowNumbers"]:  # type: ignore[override]
        """torch.split: pieces of the given sizes, or of one size (the last smaller)."""
        n = self.shape[dim]
        if isinstance(sizes, int):
            sizes = [min(sizes, n - i) for i in range(0, n, sizes)]
        if sum(sizes) != n:
            raise ValueError(f"split sizes {sizes} do not add up to {n}")
        bounds, at = [], 0
        for s in sizes[:-1]:
            at += s
            bounds.append(at)
        return list(np.split(self, bounds, axis=dim))
