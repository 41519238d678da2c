"""interop.background: a background commit's digests take few threads and large reads, so the training thread keeps the GIL."""

from __future__ import annotations

import threading
import time

import pytest

from interop import background, digests


def test_a_background_commit_digests_on_few_threads_in_large_reads_and_a_foreground_one_on_every_core(tmp_path, monkeypatch):
    """Each hashing thread takes the GIL back once per read, and the training thread may wait each time: a background
    commit's digest takes fewer threads and larger reads than a conversion's, and the same digest."""
    path = tmp_path / "shard.bin"
    path.write_bytes(bytes(range(256)) * (32 << 12))  # 4 blocks of 8 MiB
    used: set[int] = set()
    reads: set[int] = set()
    hash_block, hash_range = digests.hash_block, digests.hash_range

    def spread(*args, **kwargs):
        used.add(threading.get_ident())
        time.sleep(0.05)  # every pool thread gets a block
        return hash_block(*args, **kwargs)

    def read(h, fd, offset, length, view):
        reads.add(len(view))
        return hash_range(h, fd, offset, length, view)

    monkeypatch.setattr(digests.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(digests, "hash_block", spread)
    monkeypatch.setattr(digests, "hash_range", read)
    foreground = digests.of_files([str(path)], block_bytes=8 << 20)[str(path)]
    assert len(used) > background.BACKGROUND_DIGEST_THREADS and reads == {digests.HASH_READ}
    used.clear()
    reads.clear()
    commit = background.PendingCommit(lambda: digests.of_files([str(path)], block_bytes=8 << 20)[str(path)], "test")
    assert commit.wait() == foreground  # the same digest, on fewer threads, in larger reads
    assert 1 <= len(used) <= background.BACKGROUND_DIGEST_THREADS
    assert reads == {background.BACKGROUND_DIGEST_READ} and background.BACKGROUND_DIGEST_READ > digests.HASH_READ
    assert digests.default_threads() == 8 and digests.read_size() == digests.HASH_READ  # the commit thread's alone


def test_beside_training_refuses_no_threads_or_no_bytes():
    for threads, read in ((0, 1 << 20), (2, 0)):
        with pytest.raises(ValueError, match="at least one thread reads at least one byte"):
            with digests.beside_training(threads, read):
                pass


def test_a_staged_copy_goes_when_it_is_dropped_not_when_the_garbage_collector_runs():
    """Nothing in staging, encoding, decoding or fingerprinting holds a tensor in a reference cycle: such a copy stayed until the collector ran,
    so a run saving every few steps held several (3 GiB each on a GPU run)."""
    import gc
    import weakref

    import torch

    from interop.codec import decode, encode
    from interop.pieces import state_fingerprint

    was = gc.isenabled()
    gc.disable()
    try:
        copy = background.staged({"w": torch.ones(4), "nested": [{"b": torch.zeros(2)}]})
        gone = weakref.ref(copy["nested"][0]["b"])
        del copy
        assert gone() is None
        t = torch.ones(4)
        gone = weakref.ref(t)
        state = {"w": t, "pair": (t, 3)}
        del t
        skeleton, tensors = encode(state)
        del state, tensors
        assert gone() is None
        loaded = torch.full((4,), 2.0)  # what a load reads, handed to the state's owner
        gone = weakref.ref(loaded)
        state = decode(skeleton, lambda name, given=[loaded]: given[0])
        del loaded, state
        assert gone() is None
        t = torch.ones(3)
        gone = weakref.ref(t)
        state_fingerprint({"t": t})  # a replicated component's, at every save
        del t
        assert gone() is None
    finally:
        if was:
            gc.enable()


REPEATED = r"""
import ctypes, gc, sys, torch
from interop.checkpoint import CheckpointManager
from interop.state import SharingPattern, StateComponent

ctypes.CDLL("libc.so.6").mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: 1 MiB tensors from arenas, as once it has grown
gc.disable()  # a copy in a reference cycle would stay for good
state = {str(i): torch.full((1 << 18,), float(i)) for i in range(64)}  # 64 MiB


class Box:
    def state_dict(self):
        return state

    def load_state_dict(self, s):
        pass


class Provider:
    def get_state_components(self):
        return [StateComponent("box", Box(), SharingPattern.PER_RANK)]


def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) >> 10


manager = CheckpointManager(sys.argv[1], Provider(), keep_last=1)
after = []
for step in range(1, 9):
    for t in state.values():
        t.add_(1)
    manager.save(step, wait=False, stage=True)
    manager.wait()
    after.append(rss())
print(after[1], after[-1])
"""


def test_repeated_staged_saves_hold_one_copy_at_most(tmp_path):
    """Freed staged copies are not handed back to the system (see on_staging_thread): the next save's copy reuses
    their memory, so memory does not grow from save to save (a copy kept alive by a reference cycle, or made in
    another arena each time, would add 64 MiB a save)."""
    import subprocess
    import sys

    from .conftest import worker_env

    out = subprocess.run([sys.executable, "-c", REPEATED, str(tmp_path / "run")], env=worker_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    second, last = map(int, out.stdout.split())
    assert last - second < 32, out.stdout  # MiB: six saves of 64 MiB each after the second


def test_a_failed_staged_save_keeps_nothing_it_staged(tmp_path):
    """An engine's staged save that fails part-way (its error raised by the commit, where every rank agrees on it)
    leaves nothing it staged alive, with the garbage collector off: no traceback or future holds it in a cycle."""
    import gc
    import weakref

    import torch

    from interop.checkpoint import CheckpointManager
    from interop.errors import SaveFailedError
    from interop.state import SharingPattern, StateComponent

    gone = []

    class Failing:
        def save_native(self, directory):
            raise AssertionError("a staged save calls stage_native")

        def load_native(self, load):
            pass

        def stage_native(self, directory, group):
            kept = background.staged({"w": torch.ones(1 << 16)})
            gone.append(weakref.ref(kept["w"]))
            raise RuntimeError("disk on fire")

    class Provider:
        def get_state_components(self):
            return [StateComponent("engine", Failing(), SharingPattern.PER_RANK)]

    was = gc.isenabled()
    gc.disable()
    try:
        manager = CheckpointManager(str(tmp_path), Provider())
        manager.save(1, wait=False, stage=True)
        with pytest.raises(SaveFailedError, match="disk on fire"):
            manager.wait()
        assert gone and gone[0]() is None
    finally:
        if was:
            gc.enable()


INTERRUPTED = r"""
import os, signal, threading, time
from interop.background import on_staging_thread

finished = []

def slow_save():
    time.sleep(0.6)  # an engine's save: its patches and collectives last until it returns
    finished.append(time.monotonic())

threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
try:
    on_staging_thread(slow_save)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted after the save" if finished else "interrupted during the save")
"""

AT_EXIT = r"""
import atexit, torch
from interop.background import on_staging_thread, staged

staged({"w": torch.ones(2)})  # the staging thread runs

def save_at_exit():  # a save from an exit handler: the engine's save stages its writers' state inside it
    copy = on_staging_thread(lambda: staged({"w": torch.full((2,), 3.0)}))
    print("staged at exit", copy["w"].tolist())

atexit.register(save_at_exit)
"""


def test_an_interrupt_while_an_engine_stages_is_raised_once_its_save_returns():
    import subprocess
    import sys

    from .conftest import worker_env

    out = subprocess.run([sys.executable, "-c", INTERRUPTED], env=worker_env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "interrupted after the save", (out.stdout, out.stderr[-2000:])


def test_a_staged_save_at_interpreter_exit_runs_inline_and_stages_inside_itself():
    """At exit no thread can start: the save runs on the caller's thread, and the staged copies its engine makes
    inside it run there too rather than wait for ever on the lock the outer call held."""
    import subprocess
    import sys

    from .conftest import worker_env

    out = subprocess.run([sys.executable, "-c", AT_EXIT], env=worker_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "staged at exit [3.0, 3.0]", (out.stdout, out.stderr[-2000:])
