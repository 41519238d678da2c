"""The Megatron-style trainer's checkpoint: an interop checkpoint whose ``dcp/`` directory holds model and
optimizer as torch.distributed.checkpoint data, beside the trainer's other components.

``dcp/`` keeps logical tensors under canonical names, however the run was split: ``model.<name>`` and the
optimizer flattened per parameter (``optimizer.state.<name>.exp_avg``, ``optimizer.param_groups.<name>.lr``,
torch's ``flatten_optimizer_state_dict`` layout), so any DP x TP x PP layout loads it with ``dcp.load``.
Writing one needs no process group: the tensors are written whole, and each rank of a run reads its part.
"""

from __future__ import annotations

from typing import Any

from interop.commit import resolve_checkpoint_dir
from interop.errors import CorruptCheckpointError
from interop.logical import LogicalCheckpoint, OptimizerState
from interop.manifest import Manifest
from interop.sharding import ShardingMetadata, Strategy
from interop.universal import saved_scalar, split_optimizer_state
from interop.verify import open_checkpoint

from .dcp import DCPReader, drop_tied_aliases, model_tree, write_dcp
from .detection import INTEROP_DCP_KEY, is_interop_dcp  # noqa: F401
from .engine_checkpoint import carried_components, native_dir, write_engine_checkpoint
from .models.facts import tied_groups
from .param_order import EngineOrder, engine_order

NATIVE_KEY = INTEROP_DCP_KEY
STATE, GROUPS = "state.", "param_groups."


# --- reading ------------------------------------------------------------------------------------------------
def _split_name(flat: str, names: list[str], where: str) -> tuple[str, str]:
    """``<parameter name>.<rest>`` -> (name, rest); parameter names hold dots, so the longest known one wins."""
    for name in names:
        if flat.startswith(name + "."):
            return name, flat[len(name) + 1 :]
    raise CorruptCheckpointError(where, f"optimizer entry {flat!r} names no parameter of the model")


def _optimizer(reader: DCPReader, manifest: Manifest, model_names: list[str]) -> OptimizerState | None:
    flat = {path[1]: key for key, path in reader.paths.items() if path[0] == "optimizer" and len(path) == 2}
    if not flat:
        return None
    names = sorted(model_names, key=len, reverse=True)
    tensor_keys = set(reader.tensor_keys())
    per_param: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for entry, key in flat.items():
        if entry.startswith(STATE):
            name, field = _split_name(entry[len(STATE):], names, reader.directory)
            per_param.setdefault(name, {})[field] = reader.lazy(key) if key in tensor_keys else reader.read_object(key)
        elif entry.startswith(GROUPS):
            name, field = _split_name(entry[len(GROUPS):], names, reader.directory)
            hyper.setdefault(name, {})[field] = reader.read_object(key)
        else:
            raise CorruptCheckpointError(reader.directory, f"optimizer entry {entry!r} is neither state.* nor param_groups.*")
    recorded = (manifest.optimizer or {}).get("param_names")
    if recorded:
        members = [[n for n in group if n in hyper] for group in recorded]
    else:  # group parameters whose hyper-parameters agree, in model order
        members, seen = [], []
        for name in (n for n in model_names if n in hyper):
            for i, h in enumerate(seen):
                if h == hyper[name]:
                    members[i].append(name)
                    break
            else:
                seen.append(hyper[name])
                members.append([name])
    stray = sorted(set(hyper) - {n for g in members for n in g})
    if stray:
        raise CorruptCheckpointError(reader.directory, f"optimizer holds {stray[:3]}, which the manifest's param_names lack")
    groups = [{**_tuples(hyper[g[0]]), "params": g} for g in members if g]
    tensors, scalars = split_optimizer_state(per_param, reader.directory)
    return OptimizerState((manifest.optimizer or {}).get("class", "AdamW"), groups, tensors, scalars)


def _tuples(hyper: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in hyper.items()}


def read_interop_dcp(path: str, verify_digests: bool = True) -> LogicalCheckpoint:
    directory = resolve_checkpoint_dir(path)
    manifest = open_checkpoint(directory, verify_digests)
    reader = DCPReader(native_dir(directory, manifest, NATIVE_KEY))
    tensor_keys = set(reader.tensor_keys())
    model = {path[1]: reader.lazy(key) for key, path in reader.paths.items() if path[0] == "model" and key in tensor_keys}
    if not model:
        raise CorruptCheckpointError(reader.directory, "holds no model.* tensors")
    info = manifest.model or {}
    config = info.get("config")
    tied = info.get("tied") or tied_groups(config)
    optimizer = _optimizer(reader, manifest, list(model))
    sharding = manifest.sharding or {}
    return LogicalCheckpoint(
        model=drop_tied_aliases(model, tied),
        config=config,
        optimizer=optimizer,
        components=carried_components(directory, manifest, NATIVE_KEY),
        source={**(manifest.source or {}), "format": "interop-dcp", "strategy": sharding.get("strategy"),
                "world_size": manifest.topology.get("world_size", 1), "tp": sharding.get("tp", 1), "pp": sharding.get("pp", 1),
                "dp": sharding.get("dp", 1), "ep": sharding.get("ep", 1), "dtype": sharding.get("precision"), "step": manifest.step},
        topology=manifest.topology,
        tied=tied,
        frozen=info.get("frozen", []),
        step=manifest.step,
    )


# --- writing ------------------------------------------------------------------------------------------------
def flat_optimizer(ckpt: LogicalCheckpoint, order: EngineOrder) -> dict[str, Any]:
    """The optimizer in ``flatten_optimizer_state_dict``'s layout: every value under its parameter's name."""
    opt = ckpt.optimizer
    out: dict[str, Any] = {}
    for names, hyper in zip(order.groups, order.hyper):
        for name in names:
            for key, per in (opt.tensors.items() if opt else []):
                if name in per:
                    out[f"{STATE}{name}.{key}"] = per[name]
            for key, per in (opt.scalars.items() if opt else []):
                if name in per:
                    out[f"{STATE}{name}.{key}"] = saved_scalar(per[name])
            for key, value in hyper.items():
                out[f"{GROUPS}{name}.{key}"] = value
    return out


def write_interop_dcp(ckpt: LogicalCheckpoint, dst: str, overwrite: bool = False) -> Manifest:
    """A checkpoint the Megatron-style trainer resumes from on any layout; the source's other components
    (scheduler, data position, trainer state, RNG) are carried beside ``dcp/``."""
    import torch

    order = engine_order(ckpt)
    state: dict[str, Any] = {"model": model_tree(ckpt, order)}
    if ckpt.optimizer is not None:
        state["optimizer"] = flat_optimizer(ckpt, order)
    sharding = ShardingMetadata(strategy=Strategy.SINGLE, precision=ckpt.source.get("dtype") or "float32", any_world_size=True)
    optimizer = {"class": ckpt.optimizer.cls if ckpt.optimizer else "AdamW", "param_names": order.groups}
    return write_engine_checkpoint(
        ckpt, dst, NATIVE_KEY, lambda directory: write_dcp(state, directory), sharding, {"torch": torch.__version__},
        optimizer, overwrite, frozenset({"model", "optimizer"}),
    )
