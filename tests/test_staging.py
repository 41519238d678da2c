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
