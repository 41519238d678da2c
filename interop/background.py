"""Finishing a save off the training thread: one pending commit at a time, its failure raised where it is awaited.

A save's blocking part ends once the state is on its way to disk (the engine's files written, or, staged, the state
copied in memory); fsync, digests, the manifest, publication, ``latest`` and retention run on a
:class:`PendingCommit`'s thread. Nothing is published before all of that holds on every rank, so a process killed
at any moment leaves the previous checkpoint as ``latest`` and a staging directory nothing loads.

The thread's collectives use their own process group (:func:`commit_collective`): collectives of one group must
come in the same order on every rank, and the training thread keeps issuing its own meanwhile.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from typing import Any, Callable

from .digests import beside_training
from .dist import Collective, LocalCollective, TorchCollective


class PendingCommit:
    """``work()`` on a thread of its own; :meth:`wait` joins it and raises what it raised."""

    def __init__(self, work: Callable[[], Any], name: str):
        self._error: BaseException | None = None
        self._result: Any = None
        # not a daemon: an interpreter that exits normally finishes the commit first
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"interop-commit-{name}", daemon=False)
        self._thread.start()

    def _run(self, work: Callable[[], Any]) -> None:
        _yield_to_training()
        try:
            with beside_training(BACKGROUND_DIGEST_THREADS, BACKGROUND_DIGEST_READ):
                self._result = work()
        except BaseException as exc:  # noqa: BLE001 - raised again by wait(), on the thread that awaits it
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Any:
        self._thread.join()
        error, self._error = self._error, None  # raised once: kept, it and its traceback (through _run's frame, this
        if error is not None:                   # object) were a cycle holding the failed save's state until gc ran
            raise error
        return self._result


BACKGROUND_NICENESS = 10
# A background commit's digests share the GIL with the training thread, which launches a step's kernels from Python:
# each hashing thread takes the GIL back after every read and hash, and each time the training thread may wait for
# it. So they take fewer threads and larger reads than a conversion's (every core, interop.digests.HASH_READ).
# Threads: on an H200 (16 cores), an FSDP2 step beside an --async-save's commit took 1.145x a step alone with 16
# hashing threads, 1.091x with 4 and 1.074x with 2 (DCP's async_save 1.143x in the same run); the commit took as
# long (8.6-9.5 s with 2, 8.2-10.4 s with 16): 2 threads keep up with the disk.
BACKGROUND_DIGEST_THREADS = 2
# Reads: on the 2-core CPU machine, a launch-bound loop (tiny ops on one thread, as a GPU step's host side) beside one
# thread digesting 4 GiB from the page cache ran 1.25x slower than alone with 1 MiB reads, 1.13-1.15x with 2 MiB,
# 1.06-1.11x with 4 MiB, 1.03-1.05x with 8 MiB and 1.04-1.06x with 16 MiB; the digest took as long with 8 MiB as
# with 1 MiB (with 16 MiB, 20% longer).
BACKGROUND_DIGEST_READ = 8 << 20


def _yield_to_training() -> None:
    """Lower this thread's scheduling priority (Linux schedules threads, so a thread has a niceness of its own,
    inherited by threads it starts: the hashing pool): where the cores are busy training, the commit takes what
    they leave rather than a share of each step."""
    import os

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(os.PRIO_PROCESS, 0) + BACKGROUND_NICENESS))
    except (AttributeError, OSError):  # not Linux, or not permitted: the commit runs at the trainer's priority
        pass


def commit_collective(collective: Collective) -> Collective:
    """A collective over the same ranks on a process group of its own (gloo: the commit exchanges Python objects
    on the CPU whatever the training backend is); a single process needs none."""
    if isinstance(collective, LocalCollective) or collective.world_size == 1:
        return LocalCollective()
    import torch.distributed as dist

    return TorchCollective(dist.new_group(backend="gloo"))


_staging_thread: Any = None  # one ThreadPoolExecutor worker for the process, started by the first staged save
_staging_lock = threading.Lock()
_staging = threading.local()  # .active: this thread runs a staged copy or save (the staging thread; inline at exit)


def on_staging_thread(copy_state: Callable[..., Any], *args: Any) -> Any:
    """``copy_state(*args)`` on the process's staging thread, the caller waiting: where every staged copy is made,
    and every engine's staged save runs (what its own code allocates in host memory for the save lies there too).

    glibc gives each thread an arena of its own. A copy made on the training thread lies in the main arena, which the
    training thread allocates from at every step; the commit thread that later frees gigabytes of it holds that
    arena's lock while they go back, and each allocation the training loop makes meanwhile waits (seen on an H200:
    0.12 s FSDP2 steps took 0.35-0.52 s while a staged save was freed and trimmed). Made here, the copy lies in heaps
    of this thread's arena that nothing else allocates from, which glibc unmaps as they empty. The caller's CUDA device
    and stream are this thread's while it copies (both are per thread); no copy records gradients.

    Freed memory is not handed back (no ``malloc_trim``): glibc keeps it in this one thread's arena for the next
    save's copy, so the process holds about a copy's worth between saves and no more (tested), as DCP's cached
    staging does (tensors above glibc's mmap threshold, 32 MiB at most, are unmapped when freed and mapped anew).
    Trimmed after each commit, every next copy faulted all its pages in again: 0.31 s instead of 0.09 s to stage
    512 MiB on the CPU, as would any host copy an engine's own save makes (in the main arena)."""
    global _staging_thread
    if getattr(_staging, "active", False):  # a staged save's own staged copies (the engine's writers): made here
        return copy_state(*args)
    import sys

    torch = sys.modules.get("torch")  # a state with tensors has imported it; no torch, no device to carry over
    cuda = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    device, stream = (torch.cuda.current_device(), torch.cuda.current_stream()) if cuda else (None, None)

    def run() -> Any:
        _staging.active = True
        try:
            with contextlib.ExitStack() as scope:
                if torch is not None:
                    scope.enter_context(torch.no_grad())
                if cuda:
                    torch.cuda.set_device(device)
                    scope.enter_context(torch.cuda.stream(stream))
                return copy_state(*args)
        finally:
            _staging.active = False

    future = None
    with _staging_lock:
        if _staging_thread is None:
            from concurrent.futures import ThreadPoolExecutor

            _staging_thread = ThreadPoolExecutor(1, thread_name_prefix="interop-staging")
        try:
            future = _staging_thread.submit(run)
        except RuntimeError:  # the interpreter is shutting down: no new threads
            pass
    if future is None:  # the copy is made here, the lock released: the engine's writers stage through it again
        return run()
    try:
        return _outcome(future)
    finally:
        future = None  # what it raised holds this frame (see _outcome)


def _outcome(future: Any) -> Any:
    """The staged work's result, or what it raised. An interrupt while waiting (Ctrl-C) is raised only once the work
    is done: an engine's save on the staging thread holds its patches (a replaced checkpoint engine, a patched
    ``dcp.save``) and issues collectives until it returns, and a save made from the interrupt's handler meanwhile
    would stage into the first one's lists or interleave its collectives."""
    interrupt = error = value = None
    while True:
        try:
            value = future.result()
        except BaseException as exc:  # noqa: BLE001 - an interrupt is raised after the work, its error as it is
            if not future.done():
                interrupt = interrupt or exc
                continue
            error = exc
        break
    try:
        if interrupt is not None:
            raise interrupt
        if error is not None:
            raise error
        return value
    finally:  # raised, the error's traceback holds this frame: no reference left here to it, or to the future,
        interrupt = error = value = future = None  # which holds it (a cycle that kept what the work had staged)


def _forget_staging_thread() -> None:
    """In a forked child: the parent's staging thread is not there, so the first staged copy starts one anew."""
    global _staging_thread, _staging_lock
    _staging_thread, _staging_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_staging_thread)


def staged(state: Any) -> Any:
    """A copy of ``state`` in host memory that later training steps cannot change (made :func:`on_staging_thread`):
    ``copy.deepcopy``, which keeps storage sharing (``torch.save`` of the copy writes what the original would, byte
    for byte: tested), with tensors on an accelerator copied to the CPU instead of on their device (a copy there would
    hold device memory until the commit thread wrote it): one host copy per storage, views rebuilt on it, a
    Parameter's type and a tensor's own attributes kept."""
    return on_staging_thread(_host_copy, state)


def _host_copy(state: Any) -> Any:
    import torch

    storages: dict[tuple[Any, int], Any] = {}
    memo: dict[int, Any] = {}

    def host_copy(t: "torch.Tensor") -> "torch.Tensor":
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key not in storages:
            storages[key] = storage.cpu()
        out = torch.empty(0, dtype=t.dtype)
        out.set_(storages[key], t.storage_offset(), t.size(), t.stride())
        if isinstance(t, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
        return out

    def walk(obj: Any) -> None:
        if type(obj) in (torch.Tensor, torch.nn.Parameter):  # subclasses (DTensor) are left to deepcopy
            if obj.device.type not in ("cpu", "meta") and id(obj) not in memo:
                memo[id(obj)] = host_copy(obj.detach() if type(obj) is torch.Tensor else obj)
                if obj.__dict__:
                    walk(obj.__dict__)
                    memo[id(obj)].__dict__.update(copy.deepcopy(obj.__dict__, memo))
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    try:
        with torch.no_grad():
            walk(state)
            return copy.deepcopy(state, memo)
    finally:
        walk = None  # it named itself: a reference cycle that kept memo, every copy, until the garbage collector ran
