"""State dicts to (JSON skeleton, named tensors) and back, with no pickle.

A state dict (nested dicts, lists and tuples of tensors, numpy arrays and Python scalars) becomes a JSON
document where each tensor is a ``{"__tensor__": name}`` placeholder, plus a flat name -> tensor map saved as
safetensors. Tuples, non-string dict keys, non-finite floats, numpy arrays and bytes are tagged so they come
back as the same Python types. Tensors that share storage (tied weights) are stored once and come back as one
tensor.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from typing import Any, Callable

from .dtypes import dtype_from_name, dtype_name
from .errors import UnsupportedStateError
from .lazy_import import instance_of, torch
from .lazy_import import numpy as np

_TAGS = ("__tensor__", "__ndarray__", "__tuple__", "__dict__", "__float__", "__bytes__", "__dtype__")


def _tensor_identity(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def encode(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``state`` into a JSON-serialisable skeleton and a name -> tensor map."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}

    def tensor_name(path: list[str]) -> str:
        name = ".".join(path) or "value"
        base, n = name, 1
        while name in tensors:
            name, n = f"{base}#{n}", n + 1
        return name

    def enc(obj: Any, path: list[str]) -> Any:
        if instance_of(obj, "torch", "Tensor"):  # no torch imported: no tensor here (plain values need none)
            obj = obj.detach()
            if obj.device.type != "meta" and obj.numel() > 0:
                ident = _tensor_identity(obj)
                if ident in seen:
                    return {"__tensor__": seen[ident]}
            name = tensor_name(path)
            tensors[name] = obj.to("cpu").contiguous()
            if obj.numel() > 0:
                seen[_tensor_identity(obj)] = name
            return {"__tensor__": name}
        if instance_of(obj, "numpy", "ndarray"):
            name = tensor_name(path)
            arr = np.ascontiguousarray(obj)
            tensors[name] = torch.from_numpy(arr.astype(np.int64) if arr.dtype.kind in "u" else arr).clone()
            return {"__ndarray__": name, "dtype": arr.dtype.str}
        if instance_of(obj, "numpy", "generic"):
            return enc(obj.item(), path)
        if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"__float__": repr(obj)}
        if isinstance(obj, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(obj)).decode()}
        if instance_of(obj, "torch", "dtype"):
            return {"__dtype__": dtype_name(obj)}
        if instance_of(obj, "torch", "Size"):
            return {"__tuple__": [int(d) for d in obj]}
        if isinstance(obj, tuple):
            return {"__tuple__": [enc(v, path + [str(i)]) for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [enc(v, path + [str(i)]) for i, v in enumerate(obj)]
        if isinstance(obj, Mapping):  # a dict, or one built on first use (interop.logical.DeferredMapping)
            if all(isinstance(k, str) and k not in _TAGS for k in obj):
                return {k: enc(v, path + [k]) for k, v in obj.items()}
            return {"__dict__": [[enc(k, path), enc(v, path + [str(k)])] for k, v in obj.items()]}
        where = ".".join(path) or "<root>"
        raise UnsupportedStateError(
            f"state value at {where!r} is a {type(obj).__module__}.{type(obj).__qualname__}; "
            "only tensors, numpy arrays, containers and Python scalars can be saved without pickle"
        )

    try:
        return enc(state, []), tensors
    finally:
        enc = None  # it named itself: a reference cycle that kept every tensor until the garbage collector ran


def decode(skeleton: Any, tensor: Callable[[str], Any]) -> Any:
    """Rebuild a state dict; ``tensor(name)`` supplies each tensor (loaded, or lazy)."""
    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            cache[name] = tensor(name)
        return cache[name]

    def dec(obj: Any) -> Any:
        if isinstance(obj, list):
            return [dec(v) for v in obj]
        if not isinstance(obj, dict):
            return obj
        if "__tensor__" in obj:
            return get(obj["__tensor__"])
        if "__ndarray__" in obj:
            value = get(obj["__ndarray__"])
            value = value.load() if hasattr(value, "load") else value
            return value.numpy().astype(np.dtype(obj["dtype"]))
        if "__tuple__" in obj:
            return tuple(dec(v) for v in obj["__tuple__"])
        if "__dict__" in obj:
            return {_hashable(dec(k)): dec(v) for k, v in obj["__dict__"]}
        if "__float__" in obj:
            return float(obj["__float__"])
        if "__bytes__" in obj:
            return base64.b64decode(obj["__bytes__"])
        if "__dtype__" in obj:
            return dtype_from_name(obj["__dtype__"])
        return {k: dec(v) for k, v in obj.items()}

    try:
        return dec(skeleton)
    finally:
        dec = None  # it named itself: a reference cycle that kept every loaded tensor until the garbage collector ran


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
