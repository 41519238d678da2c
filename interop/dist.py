"""The few collectives the adapter needs, over torch.distributed or a single process.

Object collectives pickle their payload inside torch's own transport between our own processes; nothing
here reads a pickle from disk.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Protocol

from .errors import ComponentError
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
    """torch.distributed's default group (gloo, nccl or mpi), or ``group`` over all its ranks."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)


def agree(collective: Collective, error: BaseException | str | None, payload: Any = None, failure: type = ComponentError,
          what: str = "work", own: BaseException | None = None) -> list[Any]:
    """All-gather (error, payload) and return every rank's payload; if any rank failed, every rank raises: ``failure``
    naming the first failed rank, or, on a rank that failed itself, its own exception (chained to that; unchained in
    a single process). What makes one rank's failure the same error everywhere instead of a hang in a collective."""
    if isinstance(error, BaseException):
        error, own = f"{type(error).__name__}: {error}", own or error
    if own is not None and collective.world_size == 1:
        raise own
    gathered = collective.all_gather_object((error, payload))
    failed = [(r, e) for r, (e, _) in enumerate(gathered) if e is not None]
    if failed:
        rank, message = failed[0]
        agreed = failure(f"{what} failed on rank {rank}: {message}")
        if own is not None:
            raise own from agreed
        raise agreed
    return [p for _, p in gathered]


def default_collective() -> Collective:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return TorchCollective()
    return LocalCollective()


def node_id() -> str:
    """Which node this process runs on: torchrun's GROUP_RANK (node rank) if set, else the host name."""
    group_rank = os.environ.get("GROUP_RANK") or os.environ.get("NODE_RANK")
    if group_rank is not None:
        return f"node-rank:{int(group_rank):08d}"
    import socket  # (3 ms of every start-up, for a name only a save without a node rank asks for)

    return f"host:{socket.gethostname()}"


def runtime_topology(collective: Collective, process_groups: Callable[[], Mapping[str, Any] | None] | None = None) -> Topology:
    """Gather every rank's node and group memberships into one Topology (identical on all ranks).

    ``process_groups`` (the provider's get_process_groups) is called inside the exchange, so a rank whose
    call fails still takes part and every rank raises the same error instead of waiting forever.
    """
    memberships: dict[str, tuple[int, ...]] = {}
    error = None
    try:
        groups_here = process_groups() if process_groups else None
        if groups_here:
            import torch.distributed as dist

            for name, group in groups_here.items():
                if group is not None:
                    memberships[name] = tuple(sorted(dist.get_process_group_ranks(group)))
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        error = f"{type(exc).__name__}: {exc}"
    gathered = collective.all_gather_object((node_id(), memberships, error))
    failed = [(r, e) for r, (_, _, e) in enumerate(gathered) if e is not None]
    if failed:
        raise ComponentError(f"get_process_groups() failed on rank {failed[0][0]}: {failed[0][1]}")
    nodes = [n for n, _, _ in gathered]
    node_names = sorted(set(nodes), key=nodes.index)
    node_of_rank = tuple(node_names.index(n) for n in nodes)
    groups: dict[str, set[tuple[int, ...]]] = {}
    for _, member, _ in gathered:
        for name, ranks in member.items():
            groups.setdefault(name, set()).add(ranks)
    return Topology(collective.world_size, node_of_rank, {k: tuple(v) for k, v in groups.items()})
