"""trainers.staging.deferred_writes: what the saving thread hands a writer is copied now and written later with
the same arguments; another thread's call in the meantime writes at once; the state may come by keyword."""

from __future__ import annotations

import threading
import types

import torch

from trainers.staging import deferred_writes, run_all


def test_deferred_writes_stage_the_saving_threads_calls_only():
    written = []

    def save(state, path, flag=False):
        written.append((path, {k: v.clone() for k, v in state.items()}, flag))

    namespace = types.SimpleNamespace(save=save)
    live = {"w": torch.zeros(3)}
    with deferred_writes((namespace, "save")) as writers:
        namespace.save(live, "a", flag=True)
        namespace.save(path="b", state=live)  # by keyword
        other = threading.Thread(target=namespace.save, args=({"w": torch.ones(1)}, "other"))
        other.start()
        other.join()
        assert [p for p, _, _ in written] == ["other"]  # another thread's call wrote as it asked
    assert namespace.save is save
    live["w"].add_(5)  # training goes on: the staged copies keep the state of the save
    run_all(writers)()
    assert [(p, s["w"].tolist(), f) for p, s, f in written[1:]] == [("a", [0.0] * 3, True), ("b", [0.0] * 3, False)]
    assert writers == []


ARENAS = r"""
import ctypes, re, sys, torch
import torch.distributed.checkpoint.state_dict_saver as saver
from converters.dcp import stage_dcp
from interop.background import staged

libc = ctypes.CDLL("libc.so.6")
libc.open_memstream.restype = ctypes.c_void_p
libc.fclose.argtypes = [ctypes.c_void_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]


def main_arena() -> int:
    # glibc's malloc_info: each arena's bytes taken from the system; heap nr 0 is the main arena, the main thread's
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    fp = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    xml = ctypes.string_at(buf, size.value).decode()
    return int(re.search(r'<heap nr="0">.*?<system type="current" size="(\d+)"/>', xml, re.S).group(1))


libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: 1 MiB tensors from an arena, as once glibc's threshold has grown
state = {str(i): torch.full((1 << 18,), float(i)) for i in range(64)}  # 64 MiB in the main arena
before = main_arena()
copy = staged(state)
grown = [main_arena() - before]
assert all(torch.equal(copy[i], state[i]) and copy[i].data_ptr() != state[i].data_ptr() for i in state)
written = []
saver.save = lambda staged_state, **kw: written.append(staged_state)
before = main_arena()
stage_dcp(state, sys.argv[1])()  # DCP's stager on the staging thread too
grown.append(main_arena() - before)
assert len(written) == 1 and all(torch.equal(written[0][i], state[i]) and written[0][i].data_ptr() != state[i].data_ptr() for i in state)


class Offloading:  # an engine whose staged save makes its own host copy (accelerate FSDP2's cpu_offload state dicts)
    native_top = False

    def save_native(self, directory):
        raise AssertionError("a staged save calls stage_native")

    def load_native(self, load):
        pass

    def stage_native(self, directory, group):
        own = {k: v.clone() for k, v in state.items()}

        def write():  # on the commit thread, which frees the copy once it is written: only after it is measured
            measured.wait(60)
            os.makedirs(directory, exist_ok=True)
            torch.save(own, os.path.join(directory, "state.pt"))
            own.clear()
        return write


class Provider:
    def get_state_components(self):
        return [StateComponent("engine", Offloading(), SharingPattern.PER_RANK)]


import os, threading
from interop.checkpoint import CheckpointManager
from interop.state import SharingPattern, StateComponent

measured = threading.Event()
manager = CheckpointManager(sys.argv[1] + "-run", Provider())
before = main_arena()
manager.save(1, wait=False, stage=True)  # the engine's own staged save on the staging thread too
grown.append(main_arena() - before)
measured.set()
manager.wait()
assert torch.equal(torch.load(os.path.join(manager.path_for(1), "engine", "state.pt"))["3"], state["3"])
print(*(g >> 20 for g in grown))
"""


def test_staged_copies_lie_outside_the_training_threads_arena(tmp_path):
    """A staged copy (ours, DCP's stager's in a staged DCP save, and an engine's own in its staged save) is made on
    the staging thread, so it lies in a glibc arena of its own: freeing it later on the commit thread never holds the lock of the arena the training
    thread allocates from (a 0.12 s GPU step stalled 0.4 s when it did). On the main arena each copy would grow it
    by 64 MiB; here neither grows it by any of that."""
    import subprocess
    import sys

    from .conftest import worker_env

    out = subprocess.run([sys.executable, "-c", ARENAS, str(tmp_path / "dcp")], env=worker_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [int(g) < 8 for g in out.stdout.split()] == [True, True, True], out.stdout


FORKED = r"""
import os, signal, torch
from interop.background import staged

staged({"w": torch.ones(4)})  # the parent's staging thread runs
pid = os.fork()
if pid == 0:
    signal.alarm(20)  # a child waiting on the parent's thread would hang: SIGALRM ends it instead
    copy = staged({"w": torch.ones(4)})
    os._exit(0 if torch.equal(copy["w"], torch.ones(4)) else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_stages_on_a_thread_of_its_own():
    """A child forked after a staged save has no staging thread (threads do not survive fork): its first staged copy
    starts one rather than waiting for ever on the parent's."""
    import subprocess
    import sys

    from .conftest import worker_env

    out = subprocess.run([sys.executable, "-c", FORKED], env=worker_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["0"], out.stdout + out.stderr[-2000:]


def test_a_staged_dcp_save_copies_what_training_changes_and_keeps_host_copies_nothing_else_reaches(tmp_path, monkeypatch):
    """converters.dcp.stage_dcp with ``live``: a host tensor sharing storage with a live one (a parameter, Adam's step,
    a view of either) is copied; one that is already a copy of its own (a ``cpu_offload`` state dict of a model on an
    accelerator) is kept as it is, not copied a second time. What is written is the state at the save either way."""
    import torch.distributed.checkpoint as dcp

    from converters.dcp import stage_dcp

    weight, step = torch.arange(6.0), torch.tensor(3.0)
    offloaded = weight.clone() * 2  # already a copy: nothing but this state reaches it
    state = {"model": {"w": weight, "w_view": weight[2:], "moved": offloaded}, "optim": {"state": {"w": {"step": step}}}}
    import torch.distributed.checkpoint.state_dict_saver as saver

    written, save = [], saver.save
    monkeypatch.setattr(saver, "save", lambda staged, **kw: (written.append(staged["model"]["moved"].data_ptr()), save(staged, **kw)))
    kept = []
    for live, directory in (([weight, step], tmp_path / "live"), (None, tmp_path / "all")):
        write = stage_dcp(state, str(directory), live=live)
        kept.append(write)
    weight.add_(100)  # later steps change the live tensors in place; the offloaded copy is left alone
    step.add_(1)
    for write in kept:
        write()
    assert written[0] == offloaded.data_ptr() != written[1]  # kept with ``live``; copied without
    for directory in ("live", "all"):
        back = {"model": {"w": torch.zeros(6), "w_view": torch.zeros(4), "moved": torch.zeros(6)},
                "optim": {"state": {"w": {"step": torch.tensor(0.0)}}}}
        dcp.load(back, checkpoint_id=str(tmp_path / directory), no_dist=True)
        assert back["model"]["w"].tolist() == list(range(6)) and back["model"]["w_view"].tolist() == [2.0, 3.0, 4.0, 5.0]
        assert back["model"]["moved"].tolist() == [2.0 * i for i in range(6)] and float(back["optim"]["state"]["w"]["step"]) == 3.0


def test_a_staged_dcp_save_that_is_never_written_frees_its_copies_at_once(tmp_path, monkeypatch):
    """A staged DCP save dropped unwritten (the ranks agreed the save failed) frees its staged copies when its writer
    goes, without waiting for the garbage collector: DCP's stager refers to itself, and its cache held every copy."""
    import gc
    import weakref

    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    from converters.dcp import stage_dcp

    copies = []
    real = StateDictStager._stage_untyped_storage
    monkeypatch.setattr(StateDictStager, "_stage_untyped_storage",
                        lambda self, storage, **kw: (lambda out: copies.append(weakref.ref(out)) or out)(real(self, storage, **kw)))
    state = {"model": {"w": torch.arange(6.0)}, "optim": {"state": {"w": {"step": torch.tensor(3.0)}}}}
    gc.collect()
    gc.disable()
    try:
        write = stage_dcp(state, str(tmp_path / "never"))
        assert len(copies) == 2 and all(ref() is not None for ref in copies)
        del write
        assert [ref() for ref in copies] == [None, None]
    finally:
        gc.enable()
    assert not (tmp_path / "never").exists()


def test_stage_dcp_keeps_the_unshared_host_tensors_only():
    from torch.testing._internal.two_tensor import TwoTensor

    from converters.dcp import _unshared_host_tensors

    weight, step = torch.arange(6.0), torch.tensor(3.0)
    offloaded = weight.clone()
    wrapped = TwoTensor(torch.zeros(2), torch.zeros(2))  # a subclass with no storage of its own to compare: copied
    state = {"a": [weight, weight[1:], (offloaded,)], "b": {"step": step, "n": 1}, "empty": torch.empty(0), "w": wrapped}
    assert [t is offloaded for t in _unshared_host_tensors(state, [weight, step, wrapped])] == [True]
    assert len(_unshared_host_tensors(state, [])) == 4  # nothing live: every host tensor with storage


def test_a_host_models_offloaded_state_dicts_are_all_live():
    """On the host, ``cpu_offload`` state dicts (what accelerate hands DCP) are the live tensors themselves: every
    one of them, a tensor learning rate in the parameter groups and Adam's step too, is found live, so a staged
    save copies them all; their clones are all kept."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from converters.dcp import _unshared_host_tensors, tensor_leaves
    from trainers.state import live_tensors

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    options = StateDictOptions(cpu_offload=True)
    state = {"model": get_model_state_dict(model, options=options), "optim": get_optimizer_state_dict(model, optimizer, options=options)}
    live = live_tensors(model, optimizer)
    leaves = tensor_leaves(state)
    assert any(t is optimizer.param_groups[0]["lr"] for t in leaves)
    assert _unshared_host_tensors(state, live) == []
    clones = [t.clone() for t in leaves]
    assert len(_unshared_host_tensors(clones, live)) == len(leaves)
