"""Loading the engines' pickled files without letting them run code.

``torch.load(weights_only=True)`` only rebuilds tensors, plain containers and the allowlisted types below;
anything else is refused before it is constructed. ``trust_pickle=True`` (the CLI's ``--trust-pickle``) is the
explicit opt-in for files from a trusted source that hold other objects.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import logging
import os
import pickle
import re
import threading
import zipfile
from typing import Any, Iterable, Iterator

from interop.lazy_import import torch

from interop import ranged
from interop.errors import CorruptCheckpointError, MissingFileError, UnsafePickleError

log = logging.getLogger(__name__)


def allowlist() -> list[Any]:
    """Types beyond tensors and builtin containers that engine checkpoints legitimately hold (extended per engine
    by the ``allow`` arguments below). A function: torch.Size is torch's, imported only when a pickle is loaded."""
    return [collections.OrderedDict, collections.defaultdict, torch.Size]


def numpy_allowlist() -> list[Any]:
    """What a pickled ``np.random.get_state()`` needs (RNG states in accelerate's and Megatron's files), numpy
    imported only when a pickle read without torch names it, or torch's loader is given it (:func:`expanded`)."""
    from .torch_zip import LazyAllow

    return [LazyAllow(_NUMPY_NAMES, _numpy_objects)]


# what _numpy_objects gives, by the names torch_zip's unpickler matches (numpy 2's and numpy 1's _reconstruct: only the
# installed numpy's name then matches what it resolves to; a pickle naming the other goes to torch's loader)
_NUMPY_NAMES = frozenset({"numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct", "numpy.ndarray",
                          "numpy.dtype", "_codecs.encode", "numpy.dtypes.UInt32DType"})


def _numpy_objects() -> list[Any]:
    import codecs

    import numpy as np

    core = getattr(np, "_core", None) or np.core
    allow = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    if hasattr(np, "dtypes"):
        allow.append(np.dtypes.UInt32DType)
    return allow


# torch's safe_globals adds to one set for the whole process and takes its entries out on leaving: two threads'
# weights-only loads (ranks' files parsed side by side) would take each other's allowlist away mid-load
TORCH_LOAD_LOCK = threading.Lock()


def expanded(allow: Iterable[Any] | None) -> list[Any]:
    """An allowlist as torch's ``safe_globals`` takes it: lazy entries resolved."""
    from .torch_zip import LazyAllow

    return [obj for e in allow or [] for obj in (e.resolve() if isinstance(e, LazyAllow) else [e])]


def is_mapped(path: str) -> bool:
    """Whether ``load_torch_file`` maps ``path`` (torch's zip format) rather than reading it into memory."""
    return zipfile.is_zipfile(path)


def load_torch_file(path: str, trust_pickle: bool = False, allow: list[Any] | None = None, stored: bool = False) -> Any:
    """The object in ``path``, loaded weights-only. ``stored``: the caller takes tensors of a zip-format file as
    :class:`.torch_zip.StoredTensor` (read without torch) as well as torch tensors (a file the stand-ins do not
    express is loaded by torch as before), and handles both (``torch_zip.is_tensor`` ...)."""
    if not os.path.isfile(path):
        raise MissingFileError(path, "file not found")
    mmap = is_mapped(path)
    if stored and mmap and not trust_pickle:
        from . import torch_zip

        try:
            return torch_zip.load(path, allow)
        except torch_zip.NeedsTorch as why:
            log.debug("%s is read by torch: %s", path, why)
    ranged.start_whole(path)  # torch reads all of it: a file its reader was to check range by range is checked whole,
    torch.serialization  # noqa: B018 - while torch is imported
    ranged.check_whole(path)
    allowed = allowlist() + expanded(allow) if not trust_pickle else []
    try:
        if trust_pickle:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        with TORCH_LOAD_LOCK, torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        detail = f"it references {found.group(1)}" if found else str(exc).strip().splitlines()[-1]
        raise UnsafePickleError(
            path,
            f"pickle holds objects beyond tensors and plain containers ({detail}); it was not loaded. "
            "Pass --trust-pickle only if you trust where this file came from",
        ) from None
    except UnsafePickleError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch's loaders fail on damaged bytes in many ways (IndexError, KeyError, ...)
        detail = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise CorruptCheckpointError(path, f"not a readable torch file: {detail}") from None


def screen_pickles(paths: Iterable[str], trust_pickle: bool = False, allow: list[Any] | None = None) -> None:
    """Load every file in ``paths`` with the restricted loader and drop it, before an engine's own
    ``torch.load`` (often ``weights_only=False``) sees it: a file holding anything beyond tensors, containers
    and ``allow`` is refused naming it. Zip-format files are mapped, so this reads the pickles, not the
    tensors. ``trust_pickle`` skips the screening (the user's explicit opt-in)."""
    if trust_pickle:
        return
    for path in paths:
        load_torch_file(path, False, allow)


def real_globals(allow: list[Any]) -> list[Any]:
    """The engine's own objects behind an allowlist of stand-ins (``(stand_in, "module.Name")`` pairs, as
    the converters use to read without importing the engine): what the engine itself must get back."""
    out = []
    for entry in allow:
        if isinstance(entry, tuple):
            module, _, name = entry[1].rpartition(".")
            out.append(getattr(importlib.import_module(module), name))
        else:
            out.append(entry)
    return out


@contextlib.contextmanager
def weights_only_loads(trust_pickle: bool = False, allow: list[Any] | None = None) -> Iterator[None]:
    """Inside the block every ``torch.load`` runs weights-only, whatever its caller (an engine's load)
    asked for (torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``), with ``allow`` as safe globals: behind the
    screening, a file swapped after it was screened still cannot run code."""
    if trust_pickle:
        yield
        return
    saved = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(allowlist() + expanded(allow)):
            yield
    except pickle.UnpicklingError as exc:
        raise UnsafePickleError(None, f"an engine's load met a pickle beyond the allowlist ({str(exc).strip().splitlines()[-1]}); "
                                      "it was not loaded. Pass --trust-pickle only if you trust where the checkpoint came from") from None
    finally:
        if saved is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = saved


def save_torch(obj: Any, path: str) -> None:
    """``torch.save(obj, path)``: the same file (:func:`torch_save.save`, torch's pickling with our records), its
    digest for the manifest taken from the bytes as they are written (:func:`hashed_writes.hashed_output`). A write
    failure is one error naming the file."""
    from interop.hashed_writes import hashed_output

    from . import torch_save

    with hashed_output(path) as f:
        torch_save.save(obj, f, torch_save.archive_folder(path))
        f.flush()  # (as torch.save: no fsync here; the commit syncs the whole output once)


