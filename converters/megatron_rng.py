"""Megatron-LM's per-rank RNG state, ``rng_state`` in each rank's file (legacy) or the ``rng_state`` object of
each TP x PP rank (torch_dist): python's, numpy's and torch's CPU generators, CUDA's, and megatron-core's
tracker streams (``data-parallel-rng``, ``model-parallel-rng``, ``expert-parallel-rng``).

Megatron-LM's ``--load`` restores all of it (legacy: always, unless --no-load-rng; torch_dist: at the saved TP x
PP) and exits or fails on a partial state, so every rank gets a whole one: the source's streams where it has
them for this rank, and elsewhere the state Megatron-LM itself starts from with ``--seed``: its
``_set_random_seed`` (seed + 100 x pipeline rank for every generator) and megatron-core's
``model_parallel_cuda_manual_seed`` (the tracker's streams from that seed). Written by hand because the
converters do not import megatron-core (an optional extra); the seeds are checked against its own code in the
tests.
"""

from __future__ import annotations

import math
import random
import struct
from typing import Any

from interop.lazy_import import numpy as np
from interop.lazy_import import torch
from interop.rng import numpy_state_dict, numpy_state_tuple, python_state_dict, python_state_tuple

from .torch_zip import dtype_name_of, is_tensor

DEFAULT_SEED = 1234  # Megatron-LM's --seed
DATA, MODEL, EXPERT = "data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"
TRACKER = "megatron_tracker"  # our RNG layout's key for the tracker's streams (name -> CUDA state)
CUDA_STATE_BYTES = 16  # torch's CUDA generator state: the seed (uint64) and the Philox offset (int64)


def cuda_state(seed: int, offset: int = 0) -> torch.Tensor:
    """The CUDA generator state ``torch.cuda.manual_seed(seed)`` leaves (CUDAGeneratorImpl::get_state's layout)."""
    return torch.frombuffer(bytearray(struct.pack("<Qq", seed % 2**64, offset)), dtype=torch.uint8).clone()


def is_cuda_state(t: Any) -> bool:
    """A CUDA generator's state (torch's, or a stand-in read without torch)."""
    return is_tensor(t) and dtype_name_of(t) == "uint8" and len(t.shape) == 1 and math.prod(t.shape) == CUDA_STATE_BYTES


def rank_seed(seed: int, pp_rank: int) -> int:
    return seed + 100 * pp_rank  # Megatron-LM's _set_random_seed (without --data-parallel-random-init)


def tracker_states(seed: int, tp_rank: int, ep_rank: int = 0, etp_rank: int | None = None) -> dict[str, torch.Tensor]:
    """megatron-core's model_parallel_cuda_manual_seed(seed) on TP rank ``tp_rank``, expert-parallel rank
    ``ep_rank`` and expert tensor-parallel rank ``etp_rank`` (by default the TP rank: the default expert TP size is
    the TP size)."""
    return {DATA: cuda_state(seed), MODEL: cuda_state(seed + 2718 + tp_rank),
            EXPERT: cuda_state(seed + 1024 + 100 * ep_rank + (tp_rank if etp_rank is None else etp_rank))}


def megatron_rank_rng(source: dict[str, Any] | None, seed: int, tp_rank: int, pp_rank: int, ep_rank: int = 0,
                      etp_rank: int | None = None) -> tuple[dict[str, Any], bool]:
    """One rank's ``rng_state`` entry, and whether its CUDA and tracker streams came from the source."""
    s = rank_seed(seed, pp_rank)
    if source is None:
        py, nps, cpu = random.Random(s).getstate(), np.random.RandomState(s).get_state(), torch.Generator().manual_seed(s).get_state()
    else:
        py, nps, cpu = python_state_tuple(source["python"]), numpy_state_tuple(source["numpy"]), source["torch"]
    cuda = (source or {}).get("cuda")
    cuda = cuda[0] if isinstance(cuda, (list, tuple)) and cuda else cuda
    tracker = (source or {}).get(TRACKER)
    carried = is_cuda_state(cuda) and isinstance(tracker, dict) and bool(tracker) and all(is_cuda_state(v) for v in tracker.values())
    if not carried:
        cuda, tracker = cuda_state(s), tracker_states(s, tp_rank, ep_rank, etp_rank)
    return {"random_rng_state": py, "np_rng_state": nps, "torch_rng_state": cpu, "cuda_rng_state": cuda,
            "rng_tracker_states": dict(tracker)}, carried


def our_rng(entry: Any) -> dict[str, Any] | None:
    """Megatron's ``rng_state`` entry (one data-parallel replica's) in our RNG layout; None if it is not one."""
    if not isinstance(entry, dict):
        return None
    try:
        out: dict[str, Any] = {"python": python_state_dict(entry["random_rng_state"]), "numpy": numpy_state_dict(entry["np_rng_state"]),
                               "torch": entry["torch_rng_state"]}
    except (KeyError, TypeError, ValueError):
        return None
    if not is_tensor(out["torch"]):
        return None
    if is_cuda_state(entry.get("cuda_rng_state")):
        out["cuda"] = [entry["cuda_rng_state"]]
    tracker = entry.get("rng_tracker_states")
    if isinstance(tracker, dict) and tracker and all(is_cuda_state(v) for v in tracker.values()):
        out[TRACKER] = dict(tracker)
    return out


def megatron_rng_states(sources: list[dict[str, Any]] | None, tp: int, pp: int, seed: int = DEFAULT_SEED, ep: int = 1,
                        etp: int | None = None) -> tuple[dict[tuple[int, int, int], dict[str, Any]], list[str]]:
    """Every (tp rank, pp rank, expert-parallel rank)'s ``rng_state`` entry, rank t + tp x e + tp x ep x p (Megatron's
    default order) taking the source's rank of that number (``sources``: one per rank, or None), and a note on what
    is not the source's. ``etp``: the expert tensor-parallel size (dividing ``tp``; by default ``tp``), rank t's
    expert TP rank t mod etp."""
    entries, carried = {}, 0
    for p in range(pp):
        for e in range(ep):
            for t in range(tp):
                rank = t + tp * e + tp * ep * p
                entries[(t, p, e)], whole = megatron_rank_rng(sources[rank] if sources else None, seed, t, p, e, t % (etp or tp))
                carried += whole
    note = rng_note(seed, carried, tp * pp * ep, sources is not None)
    return entries, [note] if note else []


def rng_note(seed: int, carried: int, ranks: int, cpu_from_source: bool) -> str | None:
    """What the written RNG is, when it is not entirely the source's."""
    if carried == ranks:
        return None
    cpu = "the source's python / numpy / torch streams" if cpu_from_source else f"Megatron-LM's initial streams for --seed {seed}"
    return (f"Megatron RNG: {cpu}; CUDA and the model-parallel tracker's streams seeded as Megatron-LM seeds them "
            f"(--seed {seed}) on {ranks - carried} of {ranks} ranks (the source has none for them)")
