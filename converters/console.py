"""The ``interop`` console script. It imports nothing heavy itself, so an interrupt at any moment, while torch
and the converters are still being imported included, ends in one line instead of a traceback."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys

from interop.errors import ConfigurationError  # (torch-free: os only)


_PATH_OPTIONS = ("--config", "--adapter-config", "--adapter", "--base-model", "--deepspeed-config")


def check_ahead(argv: list[str]) -> None:
    """For ``convert`` and ``verify`` of one of our committed checkpoints: start digesting its files (those with a
    plain digest in its manifest) on threads before torch and the converters are imported, which takes a
    core for a second; the verification then finds them done (``interop.digests.hash_ahead``). Best effort and
    torch-free: anything unexpected starts nothing, and the real checks run as always. Not for a rank of a
    distributed conversion (ranks digest their own shares)."""
    if len(argv) < 2 or argv[0] not in ("convert", "verify") or "--sizes-only" in argv or "--workers" in argv:
        return
    if os.environ.get("WORLD_SIZE", "1") != "1":
        return
    try:
        import stat

        from interop import digests
        from interop.commit import resolve_checkpoint_dir
        from interop.manifest import MANIFEST, read_manifest
        from interop.paths import inside

        # the first argument that is a committed checkpoint (or a root naming one), not an option's value: the
        # source (a convert's destination, if it exists, comes after it)
        for prev, arg in zip(argv, argv[1:]):
            if arg.startswith("-") or prev in _PATH_OPTIONS or not os.path.isdir(arg):
                continue
            directory = resolve_checkpoint_dir(arg)
            if os.path.isfile(os.path.join(directory, MANIFEST)):
                break
        else:
            return
        manifest = read_manifest(directory)
        files = []
        for rel, record in manifest.files.items():
            algo, kind = digests.parse(record.digest, rel)
            path = inside(directory, rel, os.path.join(directory, MANIFEST))
            st = os.lstat(path)
            if kind == digests.PLAIN and stat.S_ISREG(st.st_mode) and st.st_size == record.bytes:  # else the real check says why
                files.append((path, algo))
        digests.hash_ahead(files)
    except Exception:  # noqa: BLE001 - the real checks report it properly
        return


class _TorchImportHeld:
    """A finder that finds ``torch`` as the others do and runs its import (on the main thread: signals arrive
    there) with Ctrl-C held. torch loads when a conversion first needs a tensor, wherever that is, or never."""

    def find_spec(self, fullname, path=None, target=None):
        import threading

        if fullname != "torch" or threading.current_thread() is not threading.main_thread():
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HeldLoader(spec.loader)
                return spec
        return None


class _HeldLoader:
    """The loader it was found with, its ``exec_module`` under ``_interrupts_held``."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        with _interrupts_held(in_import=True):
            self._loader.exec_module(module)


def hold_interrupts_in_torch_import() -> None:
    if not any(isinstance(f, _TorchImportHeld) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportHeld())


@contextlib.contextmanager
def _interrupts_held(in_import: bool = False):
    """Ctrl-C while torch is being imported is acted on once the import is done: raised inside torch's C
    initialisation, a KeyboardInterrupt is swallowed there (torch then runs without numpy) or aborts the process
    through a C++ exception. Where SIGINT is ignored, nothing is held."""
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held and previous is not signal.SIG_IGN:
        if not in_import:
            raise KeyboardInterrupt
        # raised inside an import, it would undo the import that just completed (sys.modules loses torch, whose C
        # extension stays loaded); sent again from a thread 50 ms on, it reaches the previous handler once the main
        # thread has run the few microseconds left of the import machinery (starting the thread lets signals in)
        import threading

        _PENDING.append(signal.SIGINT)
        threading.Timer(0.05, _deliver_pending).start()


_PENDING: list[int] = []  # an interrupt held during torch's import, not yet sent again


def _deliver_pending() -> None:
    if _PENDING:
        _PENDING.clear()
        os.kill(os.getpid(), signal.SIGINT)


def run() -> None:
    """``converters.cli.main``, then exit without the interpreter's teardown. Unloading torch costs about 0.4 s
    per call, a tenth of a large conversion; every output is fsynced before ``main`` returns, and the streams
    are flushed here."""
    hold_interrupts_in_torch_import()
    try:
        with _interrupts_held():
            check_ahead(sys.argv[1:])
            from .cli import main
        code = main()
    except KeyboardInterrupt:  # before main's own handler was reached: nothing was started
        print("interop: interrupted; nothing was written", file=sys.stderr)
        code = 130
    except ConfigurationError as exc:  # a setting read at import (INTEROP_DIGEST): one line, as main's own errors are
        print(f"interop: error: {exc}", file=sys.stderr)
        code = 2
    if _PENDING:  # Ctrl-C came during torch's import and the command ended before it could be sent again: it
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # finished (its output, if any, is whole); die of the signal,
        os.kill(os.getpid(), signal.SIGINT)  # as an interrupted command does, rather than exit as if none came
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(code)
