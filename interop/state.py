"""State components: what a trainer declares so the adapter knows who saves and who loads each piece.

Sharing patterns (who writes, who reads):

- GLOBAL: one copy exists (rank 0 holds it). Rank 0 saves; every rank loads the same file.
- REPLICATED: every rank holds an identical copy (DDP weights, scheduler). Rank 0 saves; every rank loads.
  ``validate_replication`` checks the copies really are identical before saving.
- PER_RANK: every rank holds its own state (RNG, a pipeline stage). Every rank saves and loads its own file.
- PER_GROUP: identical within each group of the named process-group family, different across groups
  (a model shard within a DP group). The lowest rank of each group saves; every member loads its group's file.
- PER_NODE: one copy per node (node-local caches). Local rank 0 of each node saves; the node's ranks load it.

A pattern may be a callable resolved at save time (a data loader whose sharing depends on dp/mp sizes); the
pattern it resolved to is recorded in the manifest and drives loading.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Protocol, runtime_checkable

from .errors import ComponentError

log = logging.getLogger(__name__)


class SharingPattern(str, Enum):
    GLOBAL = "GLOBAL"
    PER_RANK = "PER_RANK"
    REPLICATED = "REPLICATED"
    PER_GROUP = "PER_GROUP"
    PER_NODE = "PER_NODE"

    @property
    def sharded(self) -> bool:
        """True when the checkpoint holds one piece per rank, group or node."""
        return self in (SharingPattern.PER_RANK, SharingPattern.PER_GROUP, SharingPattern.PER_NODE)


class WorldSizePolicy(str, Enum):
    """What loading does when the number of owners (ranks, groups, nodes) differs from the save."""

    KEEP = "keep"  # GLOBAL/REPLICATED only: the state does not depend on the world size
    RESHARD = "reshard"  # the stateful's load_resharded() gets every saved piece and the two world sizes
    REMAP = "remap"  # owner i loads saved owner i % saved_count
    RESEED = "reseed"  # nothing is loaded; the stateful's reseed(rank) is called
    DROP = "drop"  # nothing is loaded; a warning says so
    REFUSE = "refuse"  # loading fails with an error naming the component and both sizes


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@runtime_checkable
class NativeStateful(Protocol):
    """State an engine writes in its own format (DeepSpeed's ``save_checkpoint``, accelerate's ``save_state``).

    Every rank calls both methods together, as the engines require. ``save_native`` writes into a directory
    the adapter owns (inside the staging directory, so the commit protocol still decides what is committed);
    the adapter then lists and digests every file it finds there. ``load_native`` gets a :class:`NativeLoad`.

    A stateful with ``native_top = True`` writes at the checkpoint's top level, beside the manifest, so the
    engine's own loader pointed at the checkpoint (or at the run's root, through ``latest``) finds its files;
    otherwise it gets a folder named by the component's key. At most one component of a checkpoint is at the top.
    """

    def save_native(self, directory: str) -> None: ...

    def load_native(self, load: "NativeLoad") -> None: ...

    # Optional, for staged (asynchronous) saves: do the engine's collective part now, keeping what it would write
    # in memory, and return the function that writes it (called on the commit's thread; ``group`` is the commit's
    # process group, None in one process). Without it a staged save calls ``save_native`` and commits in the background.
    # def stage_native(self, directory: str, group: Any) -> Callable[[], None]: ...


@dataclass
class NativeLoad:
    """What a native component's loader needs: its directory and both topologies (they may differ)."""

    directory: str
    saved: Any  # Topology at save time
    current: Any  # Topology now
    rank: int
    manifest: Any  # the checkpoint's Manifest (sharding, model, step sections)
    scratch: str  # a directory this load may use for a converted copy; the adapter removes it afterwards


def is_native(stateful: Any) -> bool:
    return callable(getattr(stateful, "save_native", None)) and callable(getattr(stateful, "load_native", None))


def native_base(component: "StateComponent") -> str:
    """Where a native component's files go inside its checkpoint (see :class:`NativeStateful`)."""
    from .manifest import NATIVE_TOP

    return NATIVE_TOP if getattr(component.stateful, "native_top", False) else component.key


_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


@dataclass
class StateComponent:
    key: str
    stateful: Stateful | None
    sharing_pattern: SharingPattern | Callable[[], SharingPattern]
    required: bool = True
    process_group_name: str | None = None
    validate_replication: bool = False
    on_world_size_change: WorldSizePolicy | None = None

    def __post_init__(self) -> None:
        if not _KEY.match(self.key):
            raise ComponentError(f"component key {self.key!r} must be letters, digits, '_', '.' or '-'")
        if self.on_world_size_change is not None:
            self.on_world_size_change = WorldSizePolicy(self.on_world_size_change)

    def resolve_pattern(self) -> SharingPattern:
        pattern = self.sharing_pattern() if callable(self.sharing_pattern) else self.sharing_pattern
        try:
            pattern = SharingPattern(pattern)
        except ValueError:
            raise ComponentError(f"component {self.key!r}: {pattern!r} is not a SharingPattern") from None
        if pattern is SharingPattern.PER_GROUP and not self.process_group_name:
            raise ComponentError(f"component {self.key!r} is PER_GROUP but names no process_group_name")
        return pattern

    def resolve(self) -> "ComponentSpec":
        pattern = self.resolve_pattern()
        policy = self.on_world_size_change or (WorldSizePolicy.REFUSE if pattern.sharded else WorldSizePolicy.KEEP)
        if policy is WorldSizePolicy.KEEP and pattern.sharded:
            raise ComponentError(
                f"component {self.key!r}: policy 'keep' is for GLOBAL/REPLICATED state; "
                f"a {pattern.value} component must remap, reshard, reseed, drop or refuse"
            )
        return ComponentSpec(
            key=self.key,
            pattern=pattern,
            group=self.process_group_name if pattern is SharingPattern.PER_GROUP else None,
            policy=policy,
            required=self.required,
            validate_replication=self.validate_replication,
        )


@dataclass(frozen=True)
class ComponentSpec:
    """A component with its pattern resolved: plain data, the planner's input."""

    key: str
    pattern: SharingPattern
    group: str | None = None
    policy: WorldSizePolicy = WorldSizePolicy.KEEP
    required: bool = True
    validate_replication: bool = False


def components_of(provider: Any, for_load: bool = False) -> list[StateComponent]:
    """The provider's declared components; legacy ``get_statefuls_for_save/load`` providers still work.

    Legacy statefuls become GLOBAL components (rank 0 saves, all load), except a key named ``rng``, which
    is per rank: that is what those trainers did by hand.
    """
    getter = getattr(provider, "get_state_components", None)
    if getter is not None:
        components = getter()
        if components is not None:
            return [c for c in components if c.stateful is not None]
    legacy = getattr(provider, "get_statefuls_for_load" if for_load else "get_statefuls_for_save", None)
    if legacy is None:
        raise ComponentError(
            f"{type(provider).__name__} declares no state: implement get_state_components() "
            "(or the legacy get_statefuls_for_save()/get_statefuls_for_load())"
        )
    log.info("%s uses the legacy stateful API; declare get_state_components() for explicit sharing", type(provider).__name__)
    return [
        StateComponent(key, stateful, SharingPattern.PER_RANK if key == "rng" else SharingPattern.GLOBAL)
        for key, stateful in (legacy() or {}).items()
        if stateful is not None
    ]
