"""Running one step of a benchmark in its own process: wall time and peak RSS, printed as a table."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def workdir(given: str | None, prefix: str) -> str:
    """``given``, kept for the next run; or a temporary directory, removed when the benchmark exits (its
    checkpoints are gigabytes)."""
    if given:
        return given
    import atexit
    import tempfile

    work = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, work, True)
    return work


class Measured(NamedTuple):
    """One step's median wall seconds and largest peak RSS (bytes); for a conversion, also the median wall seconds
    of ``dd`` writing as many bytes as its output holds, with fsync, run right after each of its runs."""

    wall: float
    peak: int
    floor: float | None = None


def measure(cmd: list[str], env: dict[str, str] | None = None, repeat: int = 1, output: str | None = None,
            floor: bool = False) -> Measured:
    """Median wall seconds until the output is durable over ``repeat`` runs, and the largest peak RSS (bytes) of
    one child process: its own, or its largest waited-for descendant's. ``output`` is removed before each run.

    Each step runs in a fresh process because a child forked from a parent holding a model would inherit
    (and report) the parent's resident pages. The median, because on a shared VM disk one run can be off by
    half its time. ``floor``: after each run, ``dd`` writes as many bytes as ``output`` then holds, so the disk
    floor is sampled beside the step it is compared with (this VM's disk speed drifts by 2-3x within minutes:
    a floor measured once, minutes apart, made a ratio of noise)."""
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), **(env or {}))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # each tool starts as installed, from compiled bytecode (below)
    _compile_once()
    walls, floors, peak = [], [], 0
    for _ in range(repeat):
        if output:
            shutil.rmtree(output, ignore_errors=True)
        wall, rss = _timed(cmd, env)
        walls.append(wall)
        peak = max(peak, rss)
        if floor:
            floors.append(_disk_floor(tree_bytes(output), os.path.dirname(os.path.abspath(output))))
    return Measured(statistics.median(walls), peak, statistics.median(floors) if floors else None)


def _timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Wall seconds until ``cmd``'s writes are on disk, and its peak RSS (bytes)."""
    os.sync()  # the previous step's dirty pages are written back now, not during this step
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    os.sync()  # until the output is on disk: a tool that exits with its writes still in the page cache has not finished
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr.read().decode()[-3000:]}")
    return wall, usage.ru_maxrss * 1024


_COMPILED = False


def _compile_once() -> None:
    """Bytecode for this repository's modules, as an installed package has it (pip compiles at install; a clone
    compiles on first import): a shell that sets PYTHONDONTWRITEBYTECODE would otherwise have every measured run
    compile interop's modules from source, a tenth of a second each time that no user pays. The engines' own
    tools are in site-packages, compiled when installed."""
    global _COMPILED
    if not _COMPILED:
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *(os.path.join(REPO, d) for d in ("interop", "converters", "trainers"))],
                       check=True, stdout=subprocess.DEVNULL)
        _COMPILED = True


def dd_writing(target: str, nbytes: int) -> list[str]:
    """The command for dd writing ``nbytes`` of zeros to ``target`` (in 16 MiB blocks) and fsyncing it: the floor
    under any writer of that many bytes."""
    return ["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={max(1, nbytes >> 24)}", "conv=fsync", "status=none"]


def _disk_floor(nbytes: int, directory: str) -> float:
    """What writing ``nbytes`` to ``directory`` and fsyncing costs with no work at all (dd): the floor under any
    conversion that writes that much there."""
    target = os.path.join(directory, "disk-floor.bin")
    try:
        return _timed(dd_writing(target, nbytes))[0]
    finally:
        if os.path.exists(target):
            os.remove(target)


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def print_table(rows: list[tuple[str, tuple]], reference: dict[str, str]) -> None:
    """``rows``: (name, (wall s, peak RSS bytes[, floor s])); ``reference``: for a row, the row it is compared
    with (time ratio > 1: faster; RSS ratio < 1: smaller). A conversion's floor is its own dd's, beside it."""
    by_name = {name: Measured(*m) for name, m in rows}
    width = max([62, *(len(name) for name, _ in rows)])
    print(f"\n{'step':<{width}} {'wall s':>8} {'peak RSS':>10} {'speed-up':>9} {'RSS ratio':>10} {'dd s':>6} {'vs dd':>7}")
    for name, (wall, rss, floor) in by_name.items():
        ref = reference.get(name)
        speed = f"{by_name[ref].wall / wall:>8.2f}x" if ref else f"{'':>9}"
        mem = f"{rss / by_name[ref].peak:>9.2f}x" if ref and by_name[ref].peak >= 64 << 20 else f"{'':>10}"  # not of a growth near 0
        dd = f"{floor:>6.2f} {wall / floor:>6.2f}x" if floor else f"{'':>6} {'':>7}"
        print(f"{name:<{width}} {wall:>8.2f} {rss / 2**20:>7.0f} MiB {speed} {mem} {dd}")
    for name, ref in reference.items():
        print(f"  {name!r} is compared with {ref!r}")
    if any(m.floor for m in by_name.values()):
        print("  dd s: dd writing as many bytes as the row's output holds, with fsync, run right after each of its runs (median);"
              " vs dd: the row's wall time over that floor")
    sys.stdout.flush()


@dataclass
class Section:
    """One benchmark's measurements: rows (name, (wall s, peak RSS bytes[, floor s])), the row each interop row
    is compared with, the output directories, and where the files are."""

    rows: list
    reference: dict[str, str]
    outputs: dict[str, str]
    work: str
