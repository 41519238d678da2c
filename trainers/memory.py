"""Memory statistics from every rank: current and peak host memory (and device memory on a GPU), summed and
compared across ranks, with the number of activation checkpoints. Logged at each save, kept in the manifest."""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass
class RankMemory:
    rank: int
    host_current: int  # bytes resident now
    host_peak: int  # bytes, the process's high-water mark
    device_current: int | None = None
    device_peak: int | None = None


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is the best available figure
        return _peak_bytes()


def _peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def sample(rank: int) -> RankMemory:
    now = _resident_bytes()
    mem = RankMemory(rank, now, max(now, _peak_bytes()))  # the kernel updates its high-water mark lazily
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mem.device_current = torch.cuda.memory_allocated()
        mem.device_peak = torch.cuda.max_memory_allocated()
    return mem


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def summarize(samples: list[RankMemory], activation_checkpoints: int) -> dict[str, Any]:
    """Per rank, and total / mean / min / max of each figure over the ranks (bytes)."""
    out: dict[str, Any] = {"ranks": [asdict(s) for s in samples], "activation_checkpoints": activation_checkpoints}
    for key in ("host_current", "host_peak", "device_current", "device_peak"):
        values = [getattr(s, key) for s in samples if getattr(s, key) is not None]
        if values:
            out[key] = {"total": sum(values), "mean": sum(values) / len(values), "min": min(values), "max": max(values)}
    return out


def describe(summary: dict[str, Any]) -> str:
    """One log line in human units."""
    parts = []
    for key, label in (("host_current", "host now"), ("host_peak", "host peak"), ("device_current", "device now"),
                       ("device_peak", "device peak")):
        if key in summary:
            s = summary[key]
            parts.append(f"{label} {human(s['total'])} total, {human(s['mean'])} mean, "
                         f"{human(s['min'])}..{human(s['max'])} per rank")
    parts.append(f"{summary['activation_checkpoints']} activation checkpoints")
    return f"memory over {len(summary['ranks'])} rank(s): " + "; ".join(parts)


def activation_checkpoints(model: torch.nn.Module) -> int:
    """Modules whose forward is recomputed in backward: the innermost ones with checkpointing turned on."""
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    return sum(1 for m in flagged if not any(c is not m and getattr(c, "gradient_checkpointing", False) is True for c in m.modules()))
