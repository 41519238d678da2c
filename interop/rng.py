"""Random-number-generator state as a Stateful: Python, NumPy, torch CPU and (when present) CUDA.

The state dict holds only lists, ints and tensors, so the codec stores it without pickle.
"""

from __future__ import annotations

import random
from typing import Any

from .lazy_import import numpy as np
from .lazy_import import torch


def python_state_dict(state: tuple) -> dict[str, Any]:
    """``random.getstate()`` as plain data."""
    version, internal, gauss = state
    return {"version": version, "state": list(internal), "gauss_next": gauss}


def python_state_tuple(state: dict[str, Any]) -> tuple:
    return (state["version"], tuple(state["state"]), state["gauss_next"])


def numpy_state_dict(state: tuple) -> dict[str, Any]:
    """A NumPy ``RandomState.get_state()`` tuple as plain data (its keys an array the codec stores without pickle)."""
    kind, keys, pos, has_gauss, cached = state
    return {"kind": kind, "keys": keys, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def numpy_state_tuple(state: dict[str, Any]) -> tuple:
    keys = state["keys"].numpy() if isinstance(state["keys"], torch.Tensor) else state["keys"]
    return (state["kind"], np.asarray(keys, dtype=np.uint32), state["pos"], state["has_gauss"], state["cached_gaussian"])


class RNGState:
    """Captures and restores every global generator a training loop draws from."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": python_state_dict(random.getstate()),
            "numpy": numpy_state_dict(np.random.get_state()),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(python_state_tuple(state["python"]))
        np.random.set_state(numpy_state_tuple(state["numpy"]))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            saved = list(state["cuda"])
            torch.cuda.set_rng_state_all(saved[: torch.cuda.device_count()])

    def reseed(self, seed: int) -> None:
        """Used when the world size changed and streams cannot be carried over (policy 'reseed')."""
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
