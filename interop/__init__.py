"""interop: the common state adapter and the universal checkpoint format. Imports no training engine."""

__version__ = "0.1.0"

from .checkpoint import CheckpointManager, LoadResult  # noqa: E402
from .rng import RNGState  # noqa: E402
from .state import ComponentSpec, SharingPattern, StateComponent, Stateful, WorldSizePolicy  # noqa: E402
from .topology import Topology  # noqa: E402

__all__ = [
    "CheckpointManager",
    "ComponentSpec",
    "LoadResult",
    "RNGState",
    "SharingPattern",
    "StateComponent",
    "Stateful",
    "Topology",
    "WorldSizePolicy",
    "__version__",
]
