"""Per-tensor comparison of two checkpoints of any formats, one tensor pair in memory at a time."""

from __future__ import annotations

from dataclasses import dataclass, field

from interop.lazy_import import torch
from interop.logical import LogicalCheckpoint, optim_key
from interop.tensors import LazyTensor
from interop.universal import model_entries

from .models import experts


@dataclass
class TensorDiff:
    key: str
    status: str  # "exact", "close", "differs", "shape", "dtype", "only_a", "only_b"
    max_abs: float | None = None
    detail: str = ""


@dataclass
class DiffReport:
    entries: list[TensorDiff] = field(default_factory=list)

    @property
    def problems(self) -> list[TensorDiff]:
        return [e for e in self.entries if e.status not in ("exact", "close")]

    @property
    def different(self) -> list[TensorDiff]:
        """Entries on both sides that are not equal (values, shape or dtype); not those on one side only."""
        return [e for e in self.problems if e.status not in ("only_a", "only_b")]

    def count(self, status: str) -> int:
        return sum(e.status == status for e in self.entries)


def _logical(ckpt: LogicalCheckpoint, model_only: bool) -> dict[str, LazyTensor]:
    out = dict(model_entries(ckpt))
    if ckpt.optimizer is not None and not model_only:
        for key, tensors in ckpt.optimizer.tensors.items():
            out.update({optim_key(key, n): t for n, t in tensors.items()})
    return out


def _scalars(ckpt: LogicalCheckpoint) -> dict[str, object]:
    if ckpt.optimizer is None:
        return {}
    return {optim_key(k, n): v["value"] for k, by in ckpt.optimizer.scalars.items() for n, v in by.items()}


def _compare(key: str, a: LazyTensor, b: LazyTensor, atol: float) -> TensorDiff:
    if a.spec.shape != b.spec.shape:
        return TensorDiff(key, "shape", detail=f"shape {list(a.spec.shape)} vs {list(b.spec.shape)}")
    ta, tb = a.load(), b.load()  # each checked against the digest its manifest records, if it has one
    if ta.dtype == tb.dtype and _same_bytes(ta, tb):
        return TensorDiff(key, "exact", 0.0)
    max_abs = float((ta.double() - tb.double()).abs().max()) if ta.numel() else 0.0
    if ta.dtype != tb.dtype:
        return TensorDiff(key, "dtype", max_abs, f"dtype {ta.dtype} vs {tb.dtype}".replace("torch.", ""))
    if atol > 0 and max_abs <= atol:
        return TensorDiff(key, "close", max_abs)
    return TensorDiff(key, "differs", max_abs)


def _same_bytes(x: "torch.Tensor", y: "torch.Tensor") -> bool:
    """Bit for bit (a NaN equals itself, -0.0 is not 0.0), compared, not taken from the two manifests' digests:
    digests are against corruption (XXH3), and a diff against a trusted checkpoint must not take a copy's word."""
    return torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8))


def diff_checkpoints(
    a: LogicalCheckpoint, b: LogicalCheckpoint, atol: float = 0.0, progress=None, model_only: bool = False
) -> DiffReport:
    """Compare every logical tensor (and 0-dim optimizer state); ``model_only`` skips the optimizer."""
    report = DiffReport()
    ta, tb = _logical(a, model_only), _logical(b, model_only)
    keys = list(ta) + [k for k in tb if k not in ta]
    for key in progress(keys, desc="diff", unit="tensor") if progress else keys:
        if key not in tb:
            report.entries.append(TensorDiff(key, "only_a"))
        elif key not in ta:
            report.entries.append(TensorDiff(key, "only_b"))
        else:
            report.entries.append(_compare(key, ta[key], tb[key], atol))
    sa, sb = ({}, {}) if model_only else (_scalars(a), _scalars(b))
    for key in list(sa) + [k for k in sb if k not in sa]:
        if key not in sb:
            report.entries.append(TensorDiff(key, "only_a"))
        elif key not in sa:
            report.entries.append(TensorDiff(key, "only_b"))
        else:
            delta = abs(float(sa[key]) - float(sb[key]))  # type: ignore[arg-type]
            status = "exact" if delta == 0 else ("close" if delta <= atol else "differs")
            report.entries.append(TensorDiff(key, status, delta))
    return report


def expert_differences(a: LogicalCheckpoint, b: LogicalCheckpoint) -> list[str]:
    """One line per MoE layer whose experts differ between the two checkpoints (the model's count, or which
    experts each holds), and each side's own missing, extra or duplicated experts."""
    ca, cb = (experts.count(c.config, {n: tuple(t.spec.shape) for n, t in c.model.items()}) for c in (a, b))
    out = [f"A: {p}" for p in experts.problems(a)] + [f"B: {p}" for p in experts.problems(b)]
    for layer in list(ca) + [k for k in cb if k not in ca]:
        la, lb = ca.get(layer), cb.get(layer)
        if la is None or lb is None:
            side = "A" if lb is None else "B"
            out.append(f"layer {layer}: a MoE layer in {side}'s model only")
        elif la.experts != lb.experts:
            out.append(f"layer {layer}: {la.experts} experts in A's model, {lb.experts} in B's")
        else:
            ia, ib = la.complete(), lb.complete()
            if ia != ib:
                gone = sorted(ia - ib) or sorted(ib - ia)
                out.append(f"layer {layer}: {len(ia)} whole experts in A, {len(ib)} in B (expert {gone[0]} only in "
                           f"{'A' if ia - ib else 'B'})")
    return out
