"""Shared helpers: launching real torchrun process groups, tiny Hugging Face models."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from trainers.launch import free_port  # noqa: F401  (the tests' one port helper)

ROOT = Path(__file__).resolve().parent.parent
# what transformers says about each model is kept between conversions (converters.models.facts): the suite keeps
# it in a directory of its own, not the user's cache, and every test process (and its children) shares it
if "INTEROP_CACHE_DIR" not in os.environ:
    os.environ["INTEROP_CACHE_DIR"] = tempfile.mkdtemp(prefix="interop-test-cache-")
    atexit.register(shutil.rmtree, os.environ["INTEROP_CACHE_DIR"], True)
WORKER = str(ROOT / "tests" / "dist_worker.py")


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return env


# the end of a child script that tries each of its ``reads`` ((name, callable) pairs) and prints what became of it
EACH_READ = """
from interop.errors import CorruptCheckpointError
for what, read in reads:
    try:
        read()
        print(what, "read")
    except CorruptCheckpointError as exc:
        print(what, exc)
"""


def reads_in_a_child(script: str, *args: str) -> list[tuple[str, str]]:
    """(name, what it printed) of each read ``script`` (ending in EACH_READ) tried, run in a child process: a read
    that met a signal (SIGBUS from a mapping cut short) would take the test run with it; here it fails the test."""
    result = subprocess.run([sys.executable, "-c", script + EACH_READ, *args], env=worker_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    return [tuple(line.split(" ", 1)) for line in result.stdout.splitlines()]


def torchrun_cmd(nproc: int, *args: str, nnodes: int = 1, node_rank: int = 0, port: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    if nnodes == 1 and port is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}"]
    return cmd + [WORKER, *args]


def run_workers(cmd: list[str], env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    """Run a torchrun command; fail with each rank's first errors (a SIGABRT in native code is retried, twice at most)."""
    from trainers.launch import LaunchError, run_processes

    try:
        return run_processes(cmd, env, timeout)
    except LaunchError as exc:
        raise AssertionError(str(exc)) from None


def torchrun(nproc: int, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(nproc, *args), env=worker_env(), capture_output=True, text=True, timeout=timeout)


def listing(root) -> list[str]:
    """What a run root holds, without the writer's lock file (held while the run lives)."""
    return sorted(n for n in os.listdir(root) if n != ".interop.lock")


def reseal(checkpoint, *rels: str) -> None:
    """Record the current size and digest of files ``rels`` of ``checkpoint`` in its manifest, as someone who
    edits a checkpoint on purpose would: what is left to catch the edit is the readers' own checks."""
    from interop.commit import write_manifest
    from interop.manifest import read_manifest
    from interop.verify import digest_as

    manifest = read_manifest(str(checkpoint))
    for rel in rels:
        record = manifest.files[rel]
        path = os.path.join(str(checkpoint), rel)
        record.bytes, record.digest = os.path.getsize(path), digest_as(path, record.digest, record.block_bytes)
        if record.blocks is not None:
            from interop import digests

            record.digest, record.blocks, record.block_bytes = digests.of_files([path], blocked=True, block_bytes=record.block_bytes)[path]
    write_manifest(str(checkpoint), manifest)


def by_blocks(checkpoint, block_bytes: int) -> list[str]:
    """Record ``checkpoint``'s files of more than one block of ``block_bytes`` block by block, as a trainer records
    its files over 16 MiB (small blocks give the tiny models' files many); the names of those files."""
    from interop import digests
    from interop.commit import write_manifest
    from interop.manifest import read_manifest

    manifest = read_manifest(str(checkpoint))
    blocked = []
    for rel, record in manifest.files.items():
        if digests.parse(record.digest)[1] == digests.PLAIN and record.bytes > block_bytes:
            path = os.path.join(str(checkpoint), rel)
            record.digest, record.blocks, record.block_bytes = digests.of_files([path], block_bytes=block_bytes)[path]
            blocked.append(rel)
    write_manifest(str(checkpoint), manifest)
    return blocked


@pytest.fixture
def copied(monkeypatch) -> list[int]:
    """The bytes writers took from mapped sources' files rather than from the mappings or loaded tensors, one count
    per call: copied file to file in the kernel (``os.copy_file_range``, through the page cache) or read into a
    write's buffer (``output_files.read_source``)."""
    from interop import output_files

    counts: list[int] = []
    copy, read = os.copy_file_range, output_files.read_source

    def counting(src, dst, count, *args):
        n = copy(src, dst, count, *args)
        counts.append(n)
        return n

    def reading(fd, view, offset):
        n = read(fd, view, offset)
        counts.append(n)
        return n

    monkeypatch.setattr(os, "copy_file_range", counting)
    monkeypatch.setattr(output_files, "read_source", reading)
    return counts


def as_written(chunks) -> list[tuple[bytes, bool]]:
    """What a writer takes from ``hashed_writes.tensor_bytes``, each chunk's bytes and whether they are a mapped
    source's (read from its file), fed to their digest check as a writer feeds it, before the generator goes on."""
    from interop.hashed_writes import SourceBytes

    out = []
    for c in chunks:
        if isinstance(c, SourceBytes):
            data = bytes(c.piece.data)
            if c.check is not None:
                c.check.update(data)
            out.append((data, c.piece.source is not None))
        else:
            out.append((bytes(c), False))
    return out


def flip_byte(path, at: int) -> None:
    """One bit of the byte at ``at`` (from the end where negative) changed in place, after its digest was recorded."""
    with open(path, "r+b") as f:
        f.seek(at, os.SEEK_END if at < 0 else os.SEEK_SET)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))


@pytest.fixture
def tiny_llama():
    from trainers.base import tiny_config

    def make(tied: bool = False):
        import torch
        import transformers

        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(tiny_config("llama", tied))

    return make


def held_commit_cmd(out_json, module: str, *args: str) -> list[str]:
    """``module`` run as __main__ with every background commit held until awaited (tests/held_commit.py)."""
    return [str(ROOT / "tests" / "held_commit.py"), str(out_json), module, *args]


def native_files(checkpoint) -> dict[str, bytes]:
    """The engine's own files of one of our checkpoints (everything but our manifest and folders), by name."""
    from interop.manifest import MANIFEST, OUR_FOLDERS

    root = Path(checkpoint)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST and p.relative_to(root).parts[0] not in OUR_FOLDERS}
