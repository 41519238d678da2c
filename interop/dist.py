"""The few collectives the adapter needs, over torch.distributed or a single process.

Object collectives pickle their payload inside torch's own transport between our own processes; nothing
here reads a pickle from disk.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Mapping, Protocol

from .topology import Topology


class Collective(Protocol):
    rank: int
    world_size: int

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def barrier(self) -> None: ...


class LocalCollective:
    rank = 0
    world_size = 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass


class TorchCollective:
    """torch.distributed's default group (gloo, nccl or mpi)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        self._dist.barrier()


def default_collective() -> Collective:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return TorchCollective()
    return LocalCollective()


def node_id() -> str:
    """Which node this process runs on: torchrun's GROUP_RANK (node rank) if set, else the host name."""
    group_rank = os.environ.get("GROUP_RANK") or os.environ.get("NODE_RANK")
    return f"node-rank:{int(group_rank):08d}" if group_rank is not None else f"host:{socket.gethostname()}"


def runtime_topology(collective: Collective, process_groups: Mapping[str, Any] | None = None) -> Topology:
    """Gather every rank's node and group memberships into one Topology (identical on all ranks)."""
    memberships: dict[str, tuple[int, ...]] = {}
    if process_groups:
        import torch.distributed as dist

        for name, group in process_groups.items():
            if group is None:
                continue
            memberships[name] = tuple(sorted(dist.get_process_group_ranks(group)))
    gathered = collective.all_gather_object((node_id(), memberships))
    node_names = sorted({n for n, _ in gathered}, key=lambda n: min(r for r, (m, _) in enumerate(gathered) if m == n))
    node_of_rank = tuple(node_names.index(n) for n, _ in gathered)
    groups: dict[str, set[tuple[int, ...]]] = {}
    for _, member in gathered:
        for name, ranks in member.items():
            groups.setdefault(name, set()).add(ranks)
    return Topology(collective.world_size, node_of_rank, {k: tuple(v) for k, v in groups.items()})
