"""Reader for checkpoints saved by our single-process and DDP trainers through the adapter.

Their ``model`` component is the model's state dict (canonical names), their ``optimizer`` component the
optimizer state keyed by parameter name (torch.distributed.checkpoint's get_optimizer_state_dict layout);
every other component is carried over as saved.
"""

from __future__ import annotations

from typing import Any


from interop.errors import ConversionError, CorruptCheckpointError
from interop.logical import ComponentSource, LogicalCheckpoint, OptimizerState
from interop.manifest import CHECKPOINT_FORMAT, Manifest
from interop.commit import resolve_checkpoint_dir
from interop.pieces import read_piece
from interop.universal import split_optimizer_state
from interop.verify import open_checkpoint

from .detection import INTEROP_MODEL as MODEL, INTEROP_STRATEGIES as STRATEGIES, is_interop_checkpoint  # noqa: F401
from .models.facts import tied_groups

OPTIMIZER = "optimizer"


def _global_piece(directory: str, manifest: Manifest, key: str) -> str:
    record = manifest.components[key]
    if record.pattern not in ("GLOBAL", "REPLICATED"):
        raise ConversionError(f"{directory}: component {key!r} is {record.pattern}; this reader expects one global copy")
    return record.pieces["global"]


def _optimizer(directory: str, manifest: Manifest) -> OptimizerState:
    state = read_piece(directory, _global_piece(directory, manifest, OPTIMIZER), lazy=True)
    try:
        per_param: dict[str, dict[str, Any]] = state["state"]
        groups: list[dict[str, Any]] = state["param_groups"]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(directory, "optimizer component lacks 'state'/'param_groups'") from None
    tensors, scalars = split_optimizer_state(per_param, directory)
    cls = (manifest.optimizer or {}).get("class", "AdamW")
    return OptimizerState(cls, groups, tensors, scalars)


def read_interop_checkpoint(path: str, verify_digests: bool = True) -> LogicalCheckpoint:
    directory = resolve_checkpoint_dir(path)
    manifest = open_checkpoint(directory, verify_digests)
    if manifest.format != CHECKPOINT_FORMAT:
        raise CorruptCheckpointError(directory, f"is {manifest.format}, not {CHECKPOINT_FORMAT}")
    if MODEL not in manifest.components:
        raise CorruptCheckpointError(directory, "checkpoint has no 'model' component")
    model_state = read_piece(directory, _global_piece(directory, manifest, MODEL), lazy=True)
    model_info = dict(manifest.model or {})
    config = model_info.get("config")
    tied = model_info.get("tied") or tied_groups(config)
    optimizer = _optimizer(directory, manifest) if OPTIMIZER in manifest.components else None
    others = {
        key: ComponentSource.from_manifest(directory, manifest, key)
        for key in manifest.components
        if key not in (MODEL, OPTIMIZER)
    }
    sharding = manifest.sharding or {}
    return LogicalCheckpoint(
        model=dict(model_state),
        config=config,
        optimizer=optimizer,
        components=others,
        source={
            "format": CHECKPOINT_FORMAT,
            "strategy": sharding.get("strategy", "single"),
            "world_size": manifest.topology.get("world_size", 1),
            "dtype": sharding.get("precision"),
            "master_dtype": sharding.get("master_precision"),
            "step": manifest.step,
        },
        topology=manifest.topology,
        tied=tied,
        frozen=model_info.get("frozen", []),
        step=manifest.step,
    )
