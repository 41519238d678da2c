"""Who writes and who reads each file: a pure function of (components, topology).

No process group, no I/O: the same plan is computed on every rank, and tests run it at 4096 ranks.
A *piece* is one owner's copy of one component, stored as ``<base>.json`` (+ ``<base>.safetensors``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .errors import ComponentError, TopologyError
from .state import ComponentSpec, SharingPattern, WorldSizePolicy
from .topology import Topology


@dataclass(frozen=True)
class Piece:
    component: str
    owner: str  # "global", "rank/00003", "group/dp/00002", "node/00001"
    base: str  # relative path without extension, e.g. "ranks/00003/rng"
    writer: int
    readers: tuple[int, ...]


def _owner_base(spec: ComponentSpec, kind: str, index: int) -> tuple[str, str]:
    if kind == "global":
        return "global", f"components/{spec.key}"
    if kind == "rank":
        return f"rank/{index:05d}", f"ranks/{index:05d}/{spec.key}"
    if kind == "group":
        return f"group/{spec.group}/{index:05d}", f"groups/{spec.group}/{index:05d}/{spec.key}"
    return f"node/{index:05d}", f"nodes/{index:05d}/{spec.key}"


def pieces_for(spec: ComponentSpec, topology: Topology) -> list[Piece]:
    """Every piece of one component at one topology, each with exactly one writer."""
    p = spec.pattern
    if p in (SharingPattern.GLOBAL, SharingPattern.REPLICATED):
        owner, base = _owner_base(spec, "global", 0)
        return [Piece(spec.key, owner, base, 0, tuple(range(topology.world_size)))]
    if p is SharingPattern.PER_RANK:
        return [Piece(spec.key, *_owner_base(spec, "rank", r), r, (r,)) for r in range(topology.world_size)]
    if p is SharingPattern.PER_GROUP:
        if spec.group not in topology.groups:
            raise ComponentError(
                f"component {spec.key!r} is PER_GROUP over process group {spec.group!r}, "
                f"which the trainer does not provide (get_process_groups() has {sorted(topology.groups)})"
            )
        return [Piece(spec.key, *_owner_base(spec, "group", i), min(g), g) for i, g in enumerate(topology.family(spec.group))]
    return [
        Piece(spec.key, *_owner_base(spec, "node", n), topology.node_leader(n), topology.node_ranks(n))
        for n in range(topology.num_nodes)
    ]


@dataclass
class SavePlan:
    pieces: list[Piece]
    _by_writer: dict[int, list[Piece]] = field(default_factory=dict, repr=False)
    _by_reader: dict[int, list[Piece]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for piece in self.pieces:
            self._by_writer.setdefault(piece.writer, []).append(piece)
            for r in piece.readers:
                self._by_reader.setdefault(r, []).append(piece)

    def writes_of(self, rank: int) -> list[Piece]:
        return self._by_writer.get(rank, [])

    def reads_of(self, rank: int) -> list[Piece]:
        return self._by_reader.get(rank, [])


def plan_save(specs: Sequence[ComponentSpec], topology: Topology) -> SavePlan:
    keys = [s.key for s in specs]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ComponentError(f"component keys declared twice: {dupes}")
    return SavePlan([piece for spec in specs for piece in pieces_for(spec, topology)])


# ---------------------------------------------------------------------------------------------------
# Loading, possibly at another topology
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadAction:
    """What one rank does for one component: read these pieces, or reseed, or skip."""

    component: str
    kind: str  # "load" | "reshard" | "reseed" | "drop"
    bases: tuple[str, ...] = ()
    note: str = ""  # one line for the log and the manifest when the topology changed


def _owner_count(spec: ComponentSpec, topology: Topology) -> int:
    return len(pieces_for(spec, topology))


def _owner_index(spec: ComponentSpec, topology: Topology, rank: int) -> int:
    if spec.pattern is SharingPattern.PER_RANK:
        return rank
    if spec.pattern is SharingPattern.PER_GROUP:
        return topology.group_index(spec.group, rank)  # type: ignore[arg-type]
    if spec.pattern is SharingPattern.PER_NODE:
        return topology.node_of_rank[rank]
    return 0


def _same_layout(spec: ComponentSpec, saved: Topology, current: Topology) -> bool:
    if spec.pattern is SharingPattern.PER_GROUP:
        return spec.group in current.groups and saved.family(spec.group) == current.family(spec.group)  # type: ignore[arg-type]
    if spec.pattern is SharingPattern.PER_NODE:
        return saved.node_of_rank == current.node_of_rank
    return saved.world_size == current.world_size


def resolve_load(spec: ComponentSpec, saved: Topology, current: Topology, rank: int) -> LoadAction:
    """The action for ``rank`` of ``current`` given how ``spec`` was saved at ``saved``."""
    saved_pieces = pieces_for(spec, saved)
    if _same_layout(spec, saved, current):
        index = _owner_index(spec, current, rank)
        return LoadAction(spec.key, "load", (saved_pieces[index].base,))
    if spec.pattern is SharingPattern.PER_GROUP and spec.group not in current.groups:
        raise TopologyError(f"component {spec.key!r} was saved per group of {spec.group!r}; this run has no such group")
    what = {
        SharingPattern.PER_RANK: "ranks",
        SharingPattern.PER_GROUP: f"{spec.group!r} groups",
        SharingPattern.PER_NODE: "nodes",
    }.get(spec.pattern, "ranks (world size)")
    before, after = (
        (_owner_count(spec, saved), _owner_count(spec, current))
        if spec.pattern.sharded
        else (saved.world_size, current.world_size)
    )
    change = f"{spec.pattern.value} component {spec.key!r} was saved with {before} {what}, now {after}"
    policy = spec.policy
    if policy is WorldSizePolicy.KEEP:
        return LoadAction(spec.key, "load", (saved_pieces[0].base,))
    if policy is WorldSizePolicy.REFUSE:
        raise TopologyError(f"{change}; its policy is 'refuse' (declare on_world_size_change to allow this)")
    if policy is WorldSizePolicy.REMAP:
        index = _owner_index(spec, current, rank) % len(saved_pieces)
        return LoadAction(spec.key, "load", (saved_pieces[index].base,), f"{change}: remapped")
    if policy is WorldSizePolicy.RESHARD:
        return LoadAction(spec.key, "reshard", tuple(p.base for p in saved_pieces), f"{change}: resharded")
    if policy is WorldSizePolicy.RESEED:
        return LoadAction(spec.key, "reseed", (), f"{change}: not restored, reseeded per rank")
    return LoadAction(spec.key, "drop", (), f"{change}: dropped")
