"""interop: the common state adapter and the universal checkpoint format. Imports no training engine.

The names below are imported on first use (PEP 562), so a tool that needs only the torch-free modules
(digests, manifests, paths) starts without importing torch: the CLI digests a source's files while torch loads.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointManager": ".checkpoint",
    "LoadResult": ".checkpoint",
    "RNGState": ".rng",
    "ComponentSpec": ".state",
    "SharingPattern": ".state",
    "StateComponent": ".state",
    "Stateful": ".state",
    "WorldSizePolicy": ".state",
    "Topology": ".topology",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'interop' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
