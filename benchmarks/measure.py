"""Running one step of a benchmark in its own process: wall time and peak RSS, printed as a table."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

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


def measure(cmd: list[str], env: dict[str, str] | None = None, repeat: int = 1, output: str | None = None) -> tuple[float, int]:
    """Median wall seconds until the output is durable over ``repeat`` runs, and the largest peak RSS (bytes) of
    one child process: its own, or its largest waited-for descendant's. ``output`` is removed before each run.

    Each step runs in a fresh process because a child forked from a parent holding a model would inherit
    (and report) the parent's resident pages. The median, because on a shared VM disk one run can be off by
    half its time."""
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), **(env or {}))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # each tool starts as installed, from compiled bytecode (below)
    _compile_once()
    walls, peak = [], 0
    for _ in range(repeat):
        if output:
            shutil.rmtree(output, ignore_errors=True)
        os.sync()  # the previous step's dirty pages are written back now, not during this step
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        os.sync()  # until the output is on disk: a tool that exits with its writes still in the page cache has not finished
        walls.append(time.perf_counter() - start)
        if status != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr.read().decode()[-3000:]}")
        peak = max(peak, usage.ru_maxrss * 1024)
    return statistics.median(walls), peak


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


def disk_floor(nbytes: int, directory: str, repeat: int = 1) -> tuple[float, int]:
    """What writing ``nbytes`` to ``directory`` and fsyncing costs with no work at all (dd): the floor under any
    conversion that writes that much there."""
    target = os.path.join(directory, "disk-floor.bin")
    count = max(1, nbytes >> 24)
    try:
        return measure(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={count}", "conv=fsync", "status=none"],
                       None, repeat, None)
    finally:
        if os.path.exists(target):
            os.remove(target)


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def print_table(rows: list[tuple[str, tuple[float, int]]], reference: dict[str, str], floors: dict[str, str] | None = None) -> None:
    """``reference``: for a row, the row it is compared with (time ratio > 1: faster; RSS ratio < 1: smaller);
    ``floors``: for a conversion row, the disk-floor row of its output's bytes (the ratio: how far above the floor)."""
    by_name = dict(rows)
    floors = floors or {}
    width = max([62, *(len(name) for name, _ in rows)])
    print(f"\n{'step':<{width}} {'wall s':>8} {'peak RSS':>10} {'speed-up':>9} {'RSS ratio':>10} {'vs dd':>7}")
    for name, (wall, rss) in rows:
        ref = reference.get(name)
        speed = f"{by_name[ref][0] / wall:>8.2f}x" if ref else f"{'':>9}"
        mem = f"{rss / by_name[ref][1]:>9.2f}x" if ref and by_name[ref][1] >= 64 << 20 else f"{'':>10}"  # not of a growth near 0
        floor = f"{wall / by_name[floors[name]][0]:>6.2f}x" if name in floors and floors[name] in by_name else f"{'':>7}"
        print(f"{name:<{width}} {wall:>8.2f} {rss / 2**20:>7.0f} MiB {speed} {mem} {floor}")
    for name, ref in reference.items():
        print(f"  {name!r} is compared with {ref!r}")
    if floors:
        print("  vs dd: wall time over the disk floor's (dd writing the output's bytes, with fsync) in the same run")
    sys.stdout.flush()


# a conversion row's marker in its name, and the output it writes, whose bytes dd writes for the floor
FLOORED = (("-> universal", "universal"), ("-> ds-universal", "ds_universal"), ("-> HF", "hf"), ("-> ZeRO", "zero"),
           ("-> Megatron", "megatron"), ("-> Megatron torch_dist", "megatron_dist"))  # later markers win: the more specific


@dataclass
class Section:
    """One benchmark's measurements: rows (name, (wall s, peak RSS bytes)), the row each interop row is
    compared with, the output directories, and where the files are."""

    rows: list
    reference: dict[str, str]
    outputs: dict[str, str]
    work: str

    def with_disk_floor(self, repeat: int) -> list:
        """The rows, and below them the floor under the interop outputs: dd writing as many bytes, with fsync."""
        return self.rows + [
            (floor_row(name), disk_floor(tree_bytes(self.outputs[name]), self.work, repeat))
            for _, name in FLOORED if name in self.outputs
        ]

    def floors(self) -> dict[str, str]:
        """Each interop conversion row, and the disk-floor row of its output's bytes."""
        out = {}
        for name, _ in self.rows:
            for marker, output in FLOORED:
                if marker in name and output in self.outputs:
                    out[name] = floor_row(output)
        return out


def floor_row(output: str) -> str:
    return f"dd, {output} output's bytes + fsync (disk floor)"
