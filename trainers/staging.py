"""Staged saves of engines whose writers are plain functions: the engine's own save runs as it is, and each call
to its writer (``torch.save``, safetensors' ``save_file``, ``accelerate.utils.save``) stages a copy of what it was
handed in memory instead; the same function writes that copy later, on the commit thread, with the same arguments.
So the files are the engine's own, byte for byte, and the step after the save only waits for the copies."""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any, Callable, Iterator

from interop.background import staged


@contextlib.contextmanager
def deferred_writes(*targets: tuple[Any, str], writes: Callable[..., bool] | None = None) -> Iterator[list[Callable[[], None]]]:
    """While open, each ``(namespace, name)`` writer function, called on this thread, takes a staged copy of its
    first argument and is called with it later by one of the yielded writers, in call order (other threads' calls
    write at once, as asked). ``writes(**arguments)`` (the call's arguments by
    parameter name): whether the call would write anything on this process (a call that writes nothing stages nothing)."""
    writers: list[Callable[[], None]] = []
    originals = [(namespace, name, getattr(namespace, name)) for namespace, name in targets]
    owner = threading.get_ident()  # the saving thread: another thread's call in the meantime writes as it asked

    def stager(original: Callable[..., Any]) -> Callable[..., None]:
        signature = inspect.signature(original)
        first = next(iter(signature.parameters))

        def stage(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != owner:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)  # the state may come by keyword (save_file(tensors=...))
            if writes is None or writes(**bound.arguments):
                bound.arguments[first] = staged(bound.arguments[first])
                call_args, call_kwargs = bound.args, bound.kwargs
                writers.append(lambda: original(*call_args, **call_kwargs))
            return None

        return stage

    for namespace, name, original in originals:
        setattr(namespace, name, stager(original))
    try:
        yield writers
    finally:
        for namespace, name, original in originals:
            setattr(namespace, name, original)


def run_all(writers: list[Callable[[], None]]) -> Callable[[], None]:
    """One writer running ``writers`` in order (each staged copy freed once written)."""
    def write() -> None:
        while writers:
            writers.pop(0)()

    return write
