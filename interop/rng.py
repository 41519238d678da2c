"""Random-number-generator state as a Stateful: Python, NumPy, torch CPU and (when present) CUDA.

The state dict holds only lists, ints and tensors, so the codec stores it without pickle.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RNGState:
    """Captures and restores every global generator a training loop draws from."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state: dict[str, Any] = {
            "python": {"version": version, "state": list(internal), "gauss_next": gauss},
            "numpy": {"kind": kind, "keys": keys, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        n = state["numpy"]
        np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            saved = list(state["cuda"])
            torch.cuda.set_rng_state_all(saved[: torch.cuda.device_count()])

    def reseed(self, seed: int) -> None:
        """Used when the world size changed and streams cannot be carried over (policy 'reseed')."""
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
