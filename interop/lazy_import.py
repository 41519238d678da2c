"""Modules imported on first use.

``import torch`` takes about a second (more than writing a GiB to disk), and a conversion that only moves bytes
(safetensors to safetensors, a tensor's bytes copied as they lie) never touches a tensor. Modules on that path
name ``torch`` through this proxy, so torch loads the first time anything of it is used, and never otherwise.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


class LazyModule:
    """Stands for the module ``name``: each attribute is the module's, the module imported at the first. (Patch
    the module itself, not this stand-in: an attribute set here would hide the module's from then on.)"""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        module = self.__dict__.get("_module")
        if module is None:
            # import_module, not a look in sys.modules: a module another thread is still importing is waited for
            module = importlib.import_module(self._name)
            if not getattr(getattr(module, "__spec__", None), "_initializing", False):
                self.__dict__["_module"] = module  # whole: later uses skip the import machinery
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<{self._name}, imported on first use>"


torch: Any = LazyModule("torch")
numpy: Any = LazyModule("numpy")  # RNG states and numpy values need it; safetensors bytes do not


def instance_of(obj: Any, module: str, *names: str) -> bool:
    """``isinstance(obj, module.name...)`` without importing ``module``: nothing is an instance of a class of a
    module no one has imported."""
    loaded = sys.modules.get(module)
    if loaded is None:
        return False
    # one class, no tuple built: asked of every entry of an optimizer's state (tens of thousands for a large MoE)
    return isinstance(obj, getattr(loaded, names[0]) if len(names) == 1 else tuple(getattr(loaded, n) for n in names))
