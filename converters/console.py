"""The ``interop`` console script. It imports nothing heavy itself, so an interrupt at any moment, while torch
and the converters are still being imported included, ends in one line instead of a traceback."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys


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
            algo, composite = digests.parse(record.digest, rel)
            path = inside(directory, rel, os.path.join(directory, MANIFEST))
            st = os.lstat(path)
            if not composite and stat.S_ISREG(st.st_mode) and st.st_size == record.bytes:  # else the real check says why
                files.append((path, algo))
        digests.hash_ahead(files)
    except Exception:  # noqa: BLE001 - the real checks report it properly
        return


@contextlib.contextmanager
def _interrupts_held():
    """Ctrl-C while torch is being imported is acted on once the import is done: raised inside torch's C
    initialisation, a KeyboardInterrupt is swallowed there (torch then runs without numpy) or aborts the process
    through a C++ exception."""
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def run() -> None:
    """``converters.cli.main``, then exit without the interpreter's teardown. Unloading torch costs about 0.4 s
    per call, a tenth of a large conversion; every output is fsynced before ``main`` returns, and the streams
    are flushed here."""
    try:
        with _interrupts_held():
            check_ahead(sys.argv[1:])
            from .cli import main
        code = main()
    except KeyboardInterrupt:  # before main's own handler was reached: nothing was started
        print("interop: interrupted; nothing was written", file=sys.stderr)
        code = 130
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(code)
