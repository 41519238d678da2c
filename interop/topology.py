"""Topology: ranks, the node of each rank, and named process-group families.

A group family ("dp", "tp", "pp", or any name a trainer uses) is a partition of the ranks: every rank is in
exactly one group of it. Pure data, so the planner can be tested at thousands of ranks without processes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Mapping

from .errors import TopologyError

Partition = tuple[tuple[int, ...], ...]


def _canonical(groups) -> Partition:
    return tuple(sorted((tuple(sorted(g)) for g in groups), key=lambda g: g[0]))


@dataclass(frozen=True)
class Topology:
    world_size: int
    node_of_rank: tuple[int, ...]
    groups: Mapping[str, Partition] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.world_size < 1 or len(self.node_of_rank) != self.world_size:
            raise TopologyError(f"topology: {len(self.node_of_rank)} node entries for world size {self.world_size}")
        canon = {name: _canonical(parts) for name, parts in self.groups.items()}
        object.__setattr__(self, "groups", canon)
        for name, parts in canon.items():
            members = sorted(r for g in parts for r in g)
            if members != list(range(self.world_size)):
                raise TopologyError(
                    f"process-group family {name!r} does not place every rank in exactly one group: {list(parts)[:8]}"
                )
        index: dict[str, tuple[int, ...]] = {}
        for name, parts in canon.items():
            of_rank = [0] * self.world_size
            for i, g in enumerate(parts):
                for r in g:
                    of_rank[r] = i
            index[name] = tuple(of_rank)
        object.__setattr__(self, "_group_of_rank", index)
        nodes = sorted(set(self.node_of_rank))
        if nodes != list(range(len(nodes))):
            raise TopologyError(f"node numbers must be 0..N-1, got {nodes[:8]}")

    # construction -----------------------------------------------------------------------------------
    @classmethod
    def uniform(cls, world_size: int, ranks_per_node: int | None = None, groups: Mapping[str, Partition] | None = None) -> "Topology":
        per = ranks_per_node or world_size
        return cls(world_size, tuple(r // per for r in range(world_size)), dict(groups or {}))

    @classmethod
    def mesh(cls, dims: Mapping[str, int], ranks_per_node: int | None = None) -> "Topology":
        """A device mesh; ``dims`` lists dimensions outermost first (Megatron: pp, dp, tp with tp fastest).

        Each dimension becomes a group family of the same name: the ranks that differ only in that coordinate.
        """
        names, sizes = list(dims), [dims[n] for n in dims]
        world = math.prod(sizes)
        coords = list(itertools.product(*(range(s) for s in sizes)))  # rank r has coords[r] (row-major)
        groups: dict[str, Partition] = {}
        for d, name in enumerate(names):
            buckets: dict[tuple, list[int]] = {}
            for rank, c in enumerate(coords):
                buckets.setdefault(c[:d] + c[d + 1 :], []).append(rank)
            groups[name] = tuple(tuple(g) for g in buckets.values())
        return cls.uniform(world, ranks_per_node, groups)

    # queries ----------------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return max(self.node_of_rank) + 1

    def node_ranks(self, node: int) -> tuple[int, ...]:
        return tuple(r for r, n in enumerate(self.node_of_rank) if n == node)

    def node_leader(self, node: int) -> int:
        """Local rank 0 of the node: its lowest global rank."""
        return self.node_of_rank.index(node)

    def family(self, name: str) -> Partition:
        try:
            return self.groups[name]
        except KeyError:
            raise TopologyError(f"no process-group family named {name!r} (known: {sorted(self.groups)})") from None

    def group_index(self, name: str, rank: int) -> int:
        self.family(name)
        return self._group_of_rank[name][rank]  # type: ignore[attr-defined]

    # serialisation ----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        per = self.world_size // self.num_nodes
        uniform = self.node_of_rank == tuple(r // per for r in range(self.world_size))
        out: dict = {"world_size": self.world_size, "num_nodes": self.num_nodes}
        if uniform:
            out["ranks_per_node"] = per
        else:
            out["node_of_rank"] = list(self.node_of_rank)
        out["groups"] = {name: [list(g) for g in parts] for name, parts in self.groups.items()}
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Topology":
        ws = int(data["world_size"])
        groups = {name: tuple(tuple(g) for g in parts) for name, parts in data.get("groups", {}).items()}
        if "node_of_rank" in data:
            return cls(ws, tuple(data["node_of_rank"]), groups)
        return cls.uniform(ws, int(data.get("ranks_per_node", ws)), groups)
