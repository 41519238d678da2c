"""Loading the engines' pickled files without letting them run code.

``torch.load(weights_only=True)`` only rebuilds tensors, plain containers and the allowlisted types below;
anything else is refused before it is constructed. ``trust_pickle=True`` (the CLI's ``--trust-pickle``) is the
explicit opt-in for files from a trusted source that hold other objects.
"""

from __future__ import annotations

import collections
import pickle
import re
import zipfile
from typing import Any

import torch

from interop.errors import CorruptCheckpointError, MissingFileError, UnsafePickleError

# Types beyond tensors and builtin containers that engine checkpoints legitimately hold. Extended per engine.
ALLOWLIST: list[Any] = [collections.OrderedDict, collections.defaultdict, torch.Size]


def numpy_allowlist() -> list[Any]:
    """What a pickled ``np.random.get_state()`` needs (RNG states in accelerate's and Megatron's files)."""
    import codecs

    import numpy as np

    core = getattr(np, "_core", None) or np.core
    allow = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    if hasattr(np, "dtypes"):
        allow.append(np.dtypes.UInt32DType)
    return allow


def is_mapped(path: str) -> bool:
    """Whether ``load_torch_file`` maps ``path`` (torch's zip format) rather than reading it into memory."""
    return zipfile.is_zipfile(path)


def load_torch_file(path: str, trust_pickle: bool = False, allow: list[Any] | None = None) -> Any:
    import os

    if not os.path.isfile(path):
        raise MissingFileError(path, "file not found")
    mmap = is_mapped(path)
    try:
        if trust_pickle:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        with torch.serialization.safe_globals(ALLOWLIST + list(allow or [])):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        detail = f"it references {found.group(1)}" if found else str(exc).strip().splitlines()[-1]
        raise UnsafePickleError(
            path,
            f"pickle holds objects beyond tensors and plain containers ({detail}); it was not loaded. "
            "Pass --trust-pickle only if you trust where this file came from",
        ) from None
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile, OSError) as exc:
        raise CorruptCheckpointError(path, f"not a readable torch file: {str(exc).splitlines()[0]}") from None
