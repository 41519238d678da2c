"""Each tensor-parallel rank's piece of a Megatron tensor, as a LazyTensor that streams into its rank file.

A Megatron writer fuses Hugging Face tensors (q, k, v into one QKV; gate and up), pads the vocabulary and splits
the result over TP ranks. Where that moves whole rows of the Hugging Face tensors only (a row split, the
vocabulary, [gate; up], a fused QKV, a replicated tensor) a rank's piece is runs of consecutive rows of them, and
its bytes are the sources' bytes: copied file to file from a mapped source, never built in memory. Which rows
follows from running the rule's own fuse and split on row numbers (:class:`row_numbers.RowNumbers`), the mirror
of :func:`megatron.row_runs` for reading, so it holds for whatever they do; a cast to the training dtype is made run
by run, from each run's bytes alone. Anything else (a column split, a transpose) builds the whole tensor once for
all TP ranks, and the pieces are cut from it.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Callable

from interop.dtypes import dtype_name
from interop.lazy_import import torch
from interop.tensors import LazyTensor, TensorSpec, concat

from .megatron_map import COLS, VOCAB, Rule, cat, megatron_pieces, split

PAD = -1  # a run of the vocabulary's padding rows, not of a Hugging Face tensor


def piece_runs(rule: Rule, shapes: list[tuple[int, ...]], tp: int, padded: int) -> list[list[tuple[int, int, int]]] | None:
    """Per TP rank, its piece's rows as runs ``(value, first row, rows)``: rows of the rule's Hugging Face tensor
    ``value`` (its index in ``rule.hf``), or of the vocabulary padding (``PAD``). None where the fuse, padding and
    split move anything but whole rows (a column split over several ranks, a transpose)."""
    import numpy as np

    from .row_numbers import RowNumbers

    if not shapes or (rule.split == COLS and tp > 1) or len({len(s) for s in shapes}) != 1 or not shapes[0]:
        return None
    rest = (1,) * (len(shapes[0]) - 1)
    bases, numbers, base = [], [], 0
    for s in shapes:
        bases.append(base)
        numbers.append(RowNumbers.of(np.arange(base, base + s[0], dtype=np.int64).reshape(s[0], *rest)))
        base += s[0]
    try:
        full = rule.fuse(numbers)
        if rule.split == VOCAB and full.shape[0] > padded:
            return None  # built instead, which refuses it (pad_rows: the vocabulary does not fit)
        if rule.split == VOCAB and full.shape[0] < padded:  # numbered past every tensor: padding rows
            full = cat([full, RowNumbers.of(np.arange(base, base + padded - full.shape[0], dtype=np.int64).reshape(-1, *rest))])
        pieces = split(rule, full, tp)
    except Exception:  # noqa: BLE001 - a fuser calling what the stand-in lacks: built with torch instead
        return None
    out = []
    starts = np.asarray(bases + [base], dtype=np.int64)
    for piece in pieces:
        if tuple(piece.shape[1:]) != rest:
            return None
        ids = np.ascontiguousarray(piece, dtype=np.int64).reshape(-1)
        owner = np.searchsorted(starts, ids, side="right") - 1  # len(shapes): the padding
        breaks = np.flatnonzero((ids[1:] != ids[:-1] + 1) | (owner[1:] != owner[:-1])) + 1
        bounds = [0, *breaks.tolist(), int(ids.size)]
        runs = []
        for a, b in zip(bounds, bounds[1:]):
            if b > a:
                value = int(owner[a])
                runs.append((PAD if value == len(shapes) else value, int(ids[a] - starts[value]), b - a))
        out.append(runs)
    return out


# a piece made of more runs of its sources' rows than this is built whole (GPT-OSS's interleaved gate and up bias: a run per
# element); a fused QKV has three per query group, a vocabulary or [gate; up] one or two
_MAX_RUNS = 1024


class _Built:
    """The TP pieces of the last few tensors built whole (a cast, a column split), shared by the rank files being
    written at once, so each is built once for all TP ranks."""

    def __init__(self, keep: int = 4):
        self._lock, self._keep = threading.Lock(), keep
        self._built: OrderedDict[tuple, list[torch.Tensor]] = OrderedDict()

    def get(self, key: tuple, build: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        if not self._keep:
            return build()
        with self._lock:
            if key in self._built:
                self._built.move_to_end(key)
                return self._built[key]
            pieces = self._built[key] = build()
            while len(self._built) > self._keep:
                self._built.popitem(last=False)
            return pieces


class RankPieces:
    """Makes each TP rank's piece of a rule's tensor (its model weights, its master copy, an optimizer state) as a
    LazyTensor. Sources are read under ``lock`` (a reader's caches are not shared across threads)."""

    def __init__(self, tp: int, padded: int, lock: threading.Lock):
        self.tp, self.padded, self.lock = tp, padded, lock
        self._built = _Built(keep=4 if tp > 1 else 0)  # one rank: nothing to share

    def pieces(self, rule: Rule, values: list[LazyTensor], dtype: "torch.dtype", fill: "torch.Tensor | None",
               tag: str) -> list[LazyTensor]:
        """The TP ranks' pieces of ``rule`` fused from ``values`` (its Hugging Face tensors), in ``dtype``;
        ``fill``: the vocabulary's padding rows a Megatron source had (else zeros). ``tag`` names what they are."""
        values = [v.guarded(self.lock) for v in values]
        shape = _piece_shape(rule, [v.spec.shape for v in values], self.tp, self.padded)
        name = f"{rule.megatron} ({tag})"
        runs = piece_runs(rule, [v.spec.shape for v in values], self.tp, self.padded)
        if runs is not None and max(map(len, runs)) > _MAX_RUNS:  # rows picked one by one (an interleave): built whole,
            runs = None  # not cut into thousands of parts each read, cast and hashed on its own
        if runs is not None and all(_rows_of(v, dtype, shape[1:]) for v in values):
            return [self._from_runs(values, r, shape, dtype, fill, f"{name} TP rank {t}") for t, r in enumerate(runs)]

        def build() -> list[torch.Tensor]:
            return [p.contiguous() for p in megatron_pieces(rule, [v.load().to(dtype) for v in values], self.tp, self.padded, fill)]

        key = (rule.megatron, tag, str(dtype))
        return [LazyTensor(TensorSpec(shape, dtype), lambda t=t: self._built.get(key, build)[t], f"{name} TP rank {t}")
                for t in range(self.tp)]

    def _from_runs(self, values: list[LazyTensor], runs: list[tuple[int, int, int]], shape: tuple[int, ...],
                   dtype: "torch.dtype", fill: "torch.Tensor | None", origin: str) -> LazyTensor:
        rest = shape[1:]
        width = math.prod(rest)
        if len(runs) == 1 and runs[0][0] != PAD and runs[0][1] == 0 and values[runs[0][0]].spec.shape == shape:
            return values[runs[0][0]].cast(dtype)  # the whole tensor: as it is, its digest checked as its bytes are written
        pad_shape = (self.padded - sum(v.spec.shape[0] for v in values), *rest)
        parts = []
        for value, first, rows in runs:
            if value != PAD:  # its rows' bytes alone: copied file to file, or read and cast
                parts.append(values[value].flat_slice(first * width, (first + rows) * width).reshaped((rows, *rest)).cast(dtype))
            elif fill is not None and tuple(fill.shape) == pad_shape:  # the rows a Megatron source had there
                parts.append(LazyTensor.of(fill[first : first + rows].to(dtype), "vocabulary padding"))
            else:
                parts.append(LazyTensor(TensorSpec((rows, *rest), dtype), lambda rows=rows: torch.zeros((rows, *rest), dtype=dtype),
                                        "vocabulary padding"))
        piece = concat(parts, dtype_name(dtype), origin)
        if piece.spec.shape != shape:  # a plan that disagrees with the split's shapes would write a wrong file
            raise RuntimeError(f"{origin}: its rows make {piece.spec.describe()}, the split gives {list(shape)}")
        return piece


def fused_dtype(specs: list[TensorSpec]) -> "torch.dtype":
    """The dtype of tensors fused into one: as the fuse's torch.cat promotes theirs."""
    import functools

    return functools.reduce(torch.promote_types, [s.dtype for s in specs])


def _rows_of(value: LazyTensor, dtype: "torch.dtype", rest: tuple[int, ...]) -> bool:
    """Whether a piece's runs can be cut from ``value``'s mapped bytes: rows of the piece's width, checkable from the
    mapping once (no digest, or one of the algorithm hashed here: else each run would load and hash it whole), and
    of ``dtype`` or castable to it run by run. A tensor of another width (a corrupt source) is built, and refused."""
    from interop import digests

    checkable = value.digest is None or digests.parse(value.digest, value.origin)[0] == digests.ALGO
    castable = value.spec.dtype == dtype or (value.spec.is_floating_point and dtype.is_floating_point)
    return value.mapped_pieces is not None and checkable and castable and value.spec.shape[1:] == rest


def _piece_shape(rule: Rule, shapes: list[tuple[int, ...]], tp: int, padded: int) -> tuple[int, ...]:
    """A TP rank's piece's shape, from the Hugging Face tensors' (the fuse and split run on shape-only stand-ins)."""
    from .row_numbers import RowNumbers

    full = rule.fuse([RowNumbers.shaped(s) for s in shapes])
    full_shape = (padded, *full.shape[1:]) if rule.split == VOCAB else tuple(full.shape)
    return tuple(split(rule, RowNumbers.shaped(full_shape), tp)[0].shape)
