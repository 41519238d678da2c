"""Gradient compression through torch's DDP communication hooks (fp16, bf16, PowerSGD), with PowerSGD's state
checkpointable so a resumed run continues as if never stopped.

PowerSGD keeps per-rank state between steps: the error-feedback residual and the warm-start P/Q matrices, each
a flat tensor per DDP *bucket*. Bucket layouts are not stable: DDP rebuilds its buckets after the first
iteration in gradient-ready order, so a resumed process starts with a different parameter order inside each
bucket than the run it continues. Restoring the flat tensors by bucket index would silently apply every residual
to the wrong parameters. :class:`PowerSGDStateful` therefore saves them by parameter name, cut along the layout
the hook last saw, and lays them out again for whatever layout the hook sees next. (The Accelerate trainer also
keeps DDP from re-bucketing, so the factors sit at the same offsets and even their rounding repeats.)
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from interop.rng import numpy_state_dict, numpy_state_tuple
from interop.errors import ConfigurationError

log = logging.getLogger(__name__)

HOOKS = ("none", "fp16", "bf16", "powersgd")
_KEYS = ("error", "p", "q")  # error feedback, warm-start P and Q


def _pieces(names: list[str], params: list[torch.Tensor], rank: int, min_rate: float) -> tuple[list, list, list]:
    """(name, numel) of each parameter in the bucket's flat buffer, and of its P and Q rows when PowerSGD
    compresses it. The hook's own rules: a gradient is viewed as (shape[0], rest); it is compressed when that
    pays; the P/Q memories hold the compressed ones grouped by shape (shapes in order of first appearance)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    flat, by_shape = [], {}
    for name, p in zip(names, params):
        flat.append((name, p.numel()))
        n = p.shape[0] if p.dim() else 1
        m = p.numel() // max(n, 1)
        r = min(n, m, rank)
        if _should_compress(n, m, r, min_rate)[0]:
            by_shape.setdefault((n, m), []).append((name, n * r, m * r))
    compressed = [entry for group in by_shape.values() for entry in group]
    return flat, [(name, pn) for name, pn, _ in compressed], [(name, qm) for name, _, qm in compressed]


def _split(flat: torch.Tensor, pieces: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, numel in pieces:
        out[name] = flat[offset : offset + numel].clone()
        offset += numel
    return out


def _join(by_name: dict[str, torch.Tensor], pieces: list[tuple[str, int]]) -> torch.Tensor | None:
    if not pieces or any(name not in by_name for name, _ in pieces):
        return None
    return torch.cat([by_name[name].reshape(-1) for name, _ in pieces])


class PowerSGDStateful:
    """A PowerSGD hook and its state, registered on a DDP model; a PER_RANK state component."""

    def __init__(self, ddp_model: torch.nn.Module, named: dict[torch.Tensor, str], rank: int = 1, start_iter: int = 2):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        self.state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter)
        self._names = named
        self._params: dict[str, torch.Tensor] = {n: p for p, n in named.items()}
        self._layouts: dict[int, list[str]] = {}  # bucket index -> parameter names, as the hook last saw them
        self._pool: dict[str, dict[str, torch.Tensor]] = {k: {} for k in _KEYS}  # by name, not laid out yet
        hook = powerSGD_hook.powerSGD_hook
        # torch's hook issues each bucket's later all-reduces (P, then Q) from its futures' callbacks, which run
        # inline when a future is already done and on gloo's thread otherwise: with two buckets in flight the
        # ranks can issue them in different orders, and gloo then pairs one rank's P with another's Q ("Received
        # data size doesn't match expected size", an abort now and then). On gloo each bucket's chain finishes
        # before the next bucket's starts: the same collectives in the same order on every rank.
        import torch.distributed as dist

        serial = dist.is_initialized() and dist.get_backend() == "gloo"
        self._in_flight: Any = None

        def laid_out_hook(state, bucket):
            index = bucket.index()
            names = [self._names[p] for p in bucket.parameters()]
            old = self._layouts.get(index)
            if old != names:  # first call, a resumed run, or DDP's bucket rebuild after the first iteration
                if old is not None:
                    self._to_pool(index, old)
                self._layouts[index] = names
                self._from_pool(index, names)
            if serial and self._in_flight is not None:
                self._in_flight.wait()
            future = hook(state, bucket)
            self._in_flight = future if serial else None
            return future

        ddp_model.register_comm_hook(self.state, laid_out_hook)

    def _dicts(self) -> dict[str, dict[int, torch.Tensor]]:
        s = self.state
        return {"error": s.error_dict, "p": s.p_memory_dict, "q": s.q_memory_dict}

    def _pieces(self, names: list[str]) -> dict[str, list[tuple[str, int]]]:
        s = self.state
        flat, p_rows, q_rows = _pieces(names, [self._params[n] for n in names], s.matrix_approximation_rank, s.min_compression_rate)
        return {"error": flat, "p": p_rows, "q": q_rows}

    def _split_bucket(self, index: int, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        pieces, dicts = self._pieces(names), self._dicts()
        return {k: _split(dicts[k][index], pieces[k]) if index in dicts[k] else {} for k in _KEYS}

    def _to_pool(self, index: int, names: list[str]) -> None:
        for key, by_name in self._split_bucket(index, names).items():
            self._pool[key].update(by_name)
            self._dicts()[key].pop(index, None)

    def _from_pool(self, index: int, names: list[str]) -> None:
        pieces, dicts = self._pieces(names), self._dicts()
        for key in _KEYS:
            joined = _join(self._pool[key], pieces[key])
            if joined is not None:
                dicts[key][index] = joined
                for name, _ in pieces[key]:
                    del self._pool[key][name]

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        by_name = {k: dict(v) for k, v in self._pool.items()}
        for index, names in self._layouts.items():
            for key, pieces in self._split_bucket(index, names).items():
                by_name[key].update(pieces)
        return {
            **by_name,
            "iter": s.iter,
            "rng": numpy_state_dict(s.rng.get_state()),
            "total_numel_before_compression": s.total_numel_before_compression,
            "total_numel_after_compression": s.total_numel_after_compression,
            "next_stats_report": s.next_stats_report,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.state
        s.iter = int(state["iter"])
        s.rng.set_state(numpy_state_tuple(state["rng"]))
        s.total_numel_before_compression = state["total_numel_before_compression"]
        s.total_numel_after_compression = state["total_numel_after_compression"]
        s.next_stats_report = state["next_stats_report"]
        for d in self._dicts().values():
            d.clear()
        self._pool = {k: dict(state[k]) for k in _KEYS}
        self._layouts.clear()  # the hook lays the pool out for the buckets it sees next


def register_compression(ddp_model: torch.nn.Module, hook: str, named: dict[torch.Tensor, str], **powersgd) -> PowerSGDStateful | None:
    """Register ``hook`` on ``ddp_model``; returns the PowerSGD stateful (the others keep no state)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if hook == "none":
        return None
    if hook == "fp16":
        ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        import torch.distributed as dist

        if dist.get_backend() == "gloo":
            raise ConfigurationError("--comm-hook bf16: torch's bf16 hook needs NCCL (or XCCL); with gloo use fp16 or powersgd")
        ddp_model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        return PowerSGDStateful(ddp_model, named, **powersgd)
    else:
        raise ConfigurationError(f"unknown gradient compression {hook!r} (one of {', '.join(HOOKS)})")
    return None
