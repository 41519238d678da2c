"""Writing native ZeRO-1/2/3 checkpoints for any world size, stage and precision.

The files are what DeepSpeed's own ``save_checkpoint`` would have written from a run with that layout, so
``engine.load_checkpoint`` takes them with no special flag, and ``zero_to_fp32.py``/``ds_to_universal`` read
them. A ZeRO checkpoint stores flat vectors without names, so their order must be the engine's: parameters
in module order within each optimizer param group (the order the optimizer was given them). Module order
comes from the model built on the meta device from its config; groups from the optimizer state, or, for a
model without one (a Hugging Face import), the usual decay / no-decay split with torch's AdamW defaults.

Nothing is built in memory: each rank's flat fp32 partitions are slices of the source's tensors and zeros
(LazyTensors), streamed into its files as they are written (a mapped source's bytes copied file to file), several
ranks' files at once.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable

from interop.lazy_import import torch

from interop.dtypes import dtype_from_name, dtype_name
from interop.errors import ConversionError
from interop.logical import LogicalCheckpoint
from interop.manifest import Manifest
from interop.sharding import ShardingMetadata, Strategy
from interop.tensors import LazyTensor, TensorSpec, concat, zeros
from interop.universal import scalar_value

from . import deepspeed_moe
from .deepspeed import NATIVE_KEY, NativeLayout
from .engine_checkpoint import Written, at_once, write_engine_checkpoint
from .param_order import EngineOrder, engine_order, regroup
from .pickle_safety import save_torch
from .torch_save import Leading

log = logging.getLogger(__name__)

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000


def _deepspeed():
    try:
        import deepspeed  # noqa: F401 - the classes inside the files must be DeepSpeed's own
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError as exc:
        raise ConversionError(
            f"writing a DeepSpeed checkpoint needs deepspeed installed (pip install 'interop[deepspeed]'): {exc}"
        ) from None
    return deepspeed, LossScaler, ZeroStageEnum, fragment_address


def deepspeed_version() -> str:
    """The installed DeepSpeed's version, without importing it (a second and more with torch): for files that hold
    none of DeepSpeed's classes, only its version string (a universal checkpoint's)."""
    from interop.installed import version

    found = version("deepspeed")
    if found is None:
        raise ConversionError("writing a DeepSpeed checkpoint needs deepspeed installed (pip install 'interop[deepspeed]')")
    return found


def shapes(ckpt: LogicalCheckpoint, names: list[str]) -> OrderedDict:
    """``name -> torch.Size``, as DeepSpeed records ``param_shapes`` and ``frozen_param_shapes``."""
    return OrderedDict((n, torch.Size(ckpt.model[n].spec.shape)) for n in names)


def _numel(ckpt: LogicalCheckpoint, name: str) -> int:
    return math.prod(ckpt.model[name].spec.shape)


def _group_scalars(ckpt: LogicalCheckpoint, names: list[str]) -> dict[str, torch.Tensor]:
    """Per-group scalar state (AdamW's step): one value for the group, as DeepSpeed keeps it."""
    out = {}
    if ckpt.optimizer is None or not names:
        return out
    for key, per_param in ckpt.optimizer.scalars.items():
        values = {scalar_value(per_param[n]).item() for n in names if n in per_param}
        if len(values) > 1:
            raise ConversionError(f"optimizer state {key!r} differs between parameters of one group ({sorted(values)}); ZeRO keeps one per group")
        if values:
            out[key] = scalar_value(per_param[next(n for n in names if n in per_param)])
    return out


def _tensor_keys(ckpt: LogicalCheckpoint) -> list[str]:
    return sorted(ckpt.optimizer.tensors) if ckpt.optimizer is not None else []


# --- partitioning ----------------------------------------------------------------------------------------
def zero12_partition(total: int, world: int) -> int:
    """Partition size of a ZeRO-1/2 flat group: padded to a multiple of 2 x world size, split evenly."""
    return math.ceil(total / (2 * world)) * 2 * world // world


def zero12_padding(total: int, world: int, rank: int) -> int:
    size = zero12_partition(total, world)
    left = rank * size
    return size if total <= left else max(0, left + size - total)


Owners = list[list[tuple[tuple[int, ...], list[tuple[str, str]]]]]


def zero12_owners(order: EngineOrder, world: int, ep: int, data_before_expert: bool = False) -> Owners:
    """Per param group, (ranks, [(name, name on those ranks)]) for each copy of it the ranks hold: a group is
    split over every rank; a deepspeed.moe expert group, once per expert-parallel rank over its ranks, each copy
    holding that rank's experts under their local numbers (:mod:`.deepspeed_moe`)."""
    out: Owners = []
    for names, hyper in zip(order.groups, order.hyper):
        if hyper.get("moe"):
            layers = deepspeed_moe.ExpertLayers.of(names)
            out.append([(ranks, layers.local(ep, e)) for e, ranks in enumerate(deepspeed_moe.ep_ranks(world, ep, data_before_expert))])
        else:
            out.append([(tuple(range(world)), [(n, n) for n in names])])
    return out


def _zero12_partition(owners: Owners, g: int, rank: int, numel: Callable[[str], int],
                      slice_of: Callable[[str, int, int], LazyTensor | None], origin: str) -> LazyTensor:
    """Rank ``rank``'s partition of group ``g``'s fp32 weights or one optimizer state (``slice_of(name, lo, hi)``:
    elements lo:hi of the tensor flattened, or None where the source has none): the flat buffer of its copy's tensors
    in order, cut into equal rank partitions, zeros where there is no state and after the last tensor. Nothing is
    read here: the partition streams into its file slice by slice (a mapped source's bytes copied file to file)."""
    index, count, pairs = _copy_of(owners, g, rank)
    size = zero12_partition(sum(numel(n) for n, _ in pairs), count)
    first, end = index * size, (index + 1) * size
    parts, offset = [], 0
    for n, _ in pairs:
        lo, hi = max(offset, first), min(offset + numel(n), end)
        if lo < hi:
            parts.append(slice_of(n, lo - offset, hi - offset) or zeros(hi - lo, "float32"))
        offset += numel(n)
        if offset >= end:
            break
    filled = sum(p.spec.numel for p in parts)
    if filled < size:
        parts.append(zeros(size - filled, "float32", "padding"))
    return concat(parts, "float32", origin)


class _Flats:
    """Slices of each parameter's fp32 weight (key None) or optimizer state, flattened, for the ranks' partitions.
    One source LazyTensor per tensor, so its digest is checked once however many partitions slice it; read under
    ``lock`` (a reader's caches, a TP merge's, are not shared across threads). A slice of a mapped source is its
    bytes alone (copied file to file, or read and cast to fp32); a source with no mapping is loaded once for the
    slices that follow one another (a tensor larger than a partition spans several ranks' partitions), not once
    for each."""

    def __init__(self, ckpt: LogicalCheckpoint, lock: threading.Lock):
        self.ckpt, self.lock = ckpt, lock
        self._sources: dict[tuple[str | None, str], LazyTensor | None] = {}
        self._last: dict[str | None, tuple[str, torch.Tensor]] = {}
        self._guard = threading.Lock()

    def source(self, key: str | None, name: str) -> LazyTensor | None:
        with self._guard:
            if (key, name) not in self._sources:
                opt = self.ckpt.optimizer
                lazy = self.ckpt.model[name] if key is None else opt.tensors.get(key, {}).get(name) if opt is not None else None
                self._sources[(key, name)] = None if lazy is None else lazy.guarded(self.lock)
            return self._sources[(key, name)]

    def slicer(self, key: str | None) -> Callable[[str, int, int], LazyTensor | None]:
        def slice_of(name: str, lo: int, hi: int) -> LazyTensor | None:
            source = self.source(key, name)
            if source is None:
                return None
            part = source.flat_slice(lo, hi)
            if source.mapped_pieces is None and source.parts is None:  # no bytes of its own to slice: loaded whole
                part = replace(part, loader=lambda: self._whole(key, name, source)[lo:hi])
            return as_float32(part)

        return slice_of

    def _whole(self, key: str | None, name: str, source: LazyTensor) -> torch.Tensor:
        with self._guard:
            last = self._last.get(key)
            if last is None or last[0] != name:
                self._last[key] = last = (name, source.load().reshape(-1))
            return last[1]


def as_float32(lazy: LazyTensor) -> LazyTensor:
    """``lazy`` as ZeRO's flat fp32 buffers hold it: cast, or (a state that is not floating) converted."""
    if lazy.spec.is_floating_point:
        return lazy.cast(torch.float32)
    return LazyTensor(TensorSpec(lazy.spec.shape, torch.float32), lambda: lazy.load().to(torch.float32), f"{lazy.origin} as float32")


def _copy_of(owners: Owners, g: int, rank: int) -> tuple[int, int, list[tuple[str, str]]]:
    """(this rank's index among the ranks of its copy of group ``g``, how many they are, the copy's names)."""
    ranks, pairs = next((ranks, pairs) for ranks, pairs in owners[g] if rank in ranks)
    return ranks.index(rank), len(ranks), pairs


def _sub_groups(ckpt, names: list[str], world: int, sub_group_size: int) -> list[list[str]]:
    """Stage 3 splits a param group into sub-groups of ``sub_group_size`` partitioned elements."""
    total = sum(math.ceil(_numel(ckpt, n) / world) for n in names)
    if sub_group_size >= total:
        return [names]
    subs, current, size = [], [], 0
    for n in names:
        current.append(n)
        size += math.ceil(_numel(ckpt, n) / world)
        if size >= sub_group_size or n == names[-1]:
            subs.append(current)
            current, size = [], 0
    return subs


def _zero3_flats(ckpt, subs: list[list[str]], world: int, rank: int, slice_of: Callable[[str, int, int], LazyTensor | None],
                 origin: str) -> list[LazyTensor]:
    """Rank ``rank``'s flat buffer of each sub-group: its slice of every tensor (each padded to a multiple of the
    world size), zeros in the padding and where there is no state; streamed, never built."""
    return [concat([p for n in names for p in _zero3_share(_numel(ckpt, n), world, rank, lambda lo, hi, n=n: slice_of(n, lo, hi), "float32")],
                   "float32", f"{origin} sub-group {i}") for i, names in enumerate(subs)]


def _zero3_share(numel: int, world: int, rank: int, slice_of: Callable[[int, int], LazyTensor | None], dtype: str) -> list[LazyTensor]:
    """A tensor's share on ``rank`` under ZeRO-3, as parts: its slice of the flattened tensor (zeros where
    ``slice_of(lo, hi)`` has none), then zeros to ceil(numel / world) (each tensor padded to a multiple of the world)."""
    c = math.ceil(numel / world)
    lo, hi = min(rank * c, numel), min((rank + 1) * c, numel)
    parts = [slice_of(lo, hi) or zeros(hi - lo, dtype)] if hi > lo else []
    if c > hi - lo:
        parts.append(zeros(c - (hi - lo), dtype, "padding"))
    return parts


def _zero3_fragment(t: LazyTensor, world: int, rank: int, dtype: torch.dtype) -> LazyTensor:
    """Rank ``rank``'s fragment of a frozen parameter under ZeRO-3, in ``dtype``: its slice of the flattened tensor
    padded to a multiple of the world size, zeros after its end."""
    parts = _zero3_share(t.spec.numel, world, rank, lambda lo, hi: t.flat_slice(lo, hi).cast(dtype), dtype_name(dtype))
    return concat(parts, dtype_name(dtype), f"{t.origin}, rank {rank}'s fragment")


# --- files ---------------------------------------------------------------------------------------------------
def _optimizer_state_dict(state: dict[int, dict[str, Any]], hyper: list[dict], flats_of_group: list[list[int]]) -> dict:
    return {
        "state": state,
        "param_groups": [{**h, "params": list(ids)} for h, ids in zip(hyper, flats_of_group)],
    }


def optimizer_grouping(ds_config: dict[str, Any] | None, grouping: str | None) -> tuple[str, dict[str, Any] | None]:
    """How the engine that loads the checkpoint groups its parameters, and the hyper-parameters its config
    sets. A DeepSpeed config with an ``optimizer`` section builds it from ``model.parameters()``: one group."""
    section = (ds_config or {}).get("optimizer") or {}
    params = dict(section.get("params") or {})
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    return grouping or ("single" if section else "source"), (params or None)


def grouped_order(ckpt: LogicalCheckpoint, ds_config: dict[str, Any] | None, grouping: str | None, ep: int = 1) -> EngineOrder:
    """The engine's param groups; a model's deepspeed.moe experts in groups of their own, as
    ``split_params_into_different_moe_groups_for_optimizer`` makes them for ``ep`` expert-parallel ranks."""
    name, hyper = optimizer_grouping(ds_config, grouping)
    order = regroup(engine_order(ckpt), ckpt, name, hyper)
    if not any(deepspeed_moe.expert_of(n) for g in order.groups for n in g):
        return order
    groups, hypers = deepspeed_moe.split_moe_groups(order.groups, order.hyper, ep)
    return replace(order, groups=groups, hyper=hypers)


def write_native(
    ckpt: LogicalCheckpoint,
    directory: str,
    layout: NativeLayout,
    ds_config: dict[str, Any] | None = None,
    step: int | None = None,
    grouping: str | None = None,
    order: EngineOrder | None = None,
) -> str:
    """Write ``ckpt`` as DeepSpeed would save it from a run of ``layout``, its optimizer's parameters grouped
    as ``grouping`` says (see :func:`optimizer_grouping`), or in ``order`` when the caller has it; returns the
    tag directory."""
    deepspeed, LossScaler, ZeroStageEnum, fragment_address = _deepspeed()
    world, stage = layout.world_size, layout.zero_stage
    if stage not in (1, 2, 3):
        raise ConversionError(f"ZeRO stage must be 1, 2 or 3, not {stage}")
    if world < 1:
        raise ConversionError(f"world size must be at least 1, not {world}")
    dtype = dtype_from_name(layout.precision)
    step = ckpt.step if step is None else step
    step = int(step or 0)
    order = order or grouped_order(ckpt, ds_config, grouping, layout.ep_size)
    experts = [n for g in order.groups for n in g if deepspeed_moe.expert_of(n)]
    if experts and stage == 3:
        raise ConversionError("the model has deepspeed.moe expert layers, which DeepSpeed does not run with ZeRO-3 (\"Native "
                              "DeepSpeed MoE is not supported with ZeRO Stage 3\"); write --zero-stage 1 or 2")
    if experts and world % layout.ep_size:
        raise ConversionError(f"--ep-size {layout.ep_size} does not divide the world size {world}")
    if not experts and layout.ep_size > 1:
        raise ConversionError(f"--ep-size {layout.ep_size}: the checkpoint has no deepspeed.moe experts to split over ranks")
    ds_config = dict(ds_config or {})
    ds_config.setdefault("zero_optimization", {})
    ds_config["zero_optimization"] = {**ds_config["zero_optimization"], "stage": stage}
    if layout.precision == "bfloat16":
        ds_config["bf16"] = {**(ds_config.get("bf16") or {}), "enabled": True}
    version = deepspeed.__version__
    tag = f"global_step{step}"
    tag_dir = os.path.join(directory, tag)
    os.makedirs(tag_dir, exist_ok=True)
    keys = _tensor_keys(ckpt)
    prefix = "bf16_" if layout.precision == "bfloat16" else ""

    if stage == 3:
        sub_group_size = int((ds_config["zero_optimization"]).get("sub_group_size", DEFAULT_SUB_GROUP_SIZE))
        subs, group_of_sub = [], []
        for g, names in enumerate(order.groups):
            for sub in _sub_groups(ckpt, names, world, sub_group_size) if names else []:
                subs.append(sub)
                group_of_sub.append(g)
        flat_ids = [[i for i, g2 in enumerate(group_of_sub) if g2 == g] for g in range(len(order.groups))]
        scalars = [_group_scalars(ckpt, sub) for sub in subs]
        param_shapes = [shapes(ckpt, sub) for sub in subs]
    else:
        owners = zero12_owners(order, world, layout.ep_size, bool(ds_config.get(deepspeed_moe.DATA_BEFORE_EXPERT)))
        flat_ids = [[g] for g in range(len(order.groups))]
        scalars = [_group_scalars(ckpt, names) for names in order.groups]
        # rank 0's view, which it saves: its own experts under their local numbers
        param_shapes = [OrderedDict((local, torch.Size(ckpt.model[n].spec.shape)) for n, local in _copy_of(owners, g, 0)[2])
                        for g in range(len(owners))]
        subs = order.groups

    reading = threading.Lock()
    flats = _Flats(ckpt, reading)
    module = _module(ckpt, order, dtype, placeholders=stage == 3, lock=reading)
    if experts:  # save_checkpoint leaves the experts out of `module` and writes each expert's own file
        module = OrderedDict((k, v) for k, v in module.items() if not deepspeed_moe.expert_of(k))
        for name, tensors in deepspeed_moe.expert_state_dicts(experts, lambda n: ckpt.model[n].cast(dtype)).items():
            save_torch(tensors, os.path.join(tag_dir, name))  # each expert streamed from the source
    frozen = {n: ckpt.model[n].guarded(reading) for n in order.frozen}  # streamed into each rank's model states
    frozen_whole = {n: t.cast(dtype) for n, t in frozen.items()}  # one per tensor: ranks' files that hold it share it

    def write_rank(r: int) -> None:
        """Rank ``r``'s files, as its engine's save_checkpoint writes them: its flat buffers stream from the source."""
        where = f"rank {r}'s"
        if stage == 3:  # every rank holds a slice of every tensor
            fp32_r = _zero3_flats(ckpt, subs, world, r, flats.slicer(None), f"{where} fp32")
            states_r = {k: _zero3_flats(ckpt, subs, world, r, flats.slicer(k), f"{where} {k}") for k in keys}
        else:
            numel = lambda n: _numel(ckpt, n)  # noqa: E731
            fp32_r = [_zero12_partition(owners, g, r, numel, flats.slicer(None), f"{where} fp32 group {g}") for g in range(len(owners))]
            states_r = {k: [_zero12_partition(owners, g, r, numel, flats.slicer(k), f"{where} {k} group {g}") for g in range(len(owners))]
                        for k in keys}
        state = {}
        for i in range(len(subs)):
            entry = {k: states_r[k][i] for k in keys if _has_state(ckpt, k, subs[i])}
            if entry or scalars[i]:
                state[i] = {**{k: v.clone() for k, v in scalars[i].items()}, **entry}
        base = _optimizer_state_dict(state, order.hyper, flat_ids)
        if stage == 3:
            osd = {
                "zero_stage": ZeroStageEnum.weights,
                "loss_scaler": LossScaler(1.0),
                "dynamic_loss_scale": False,
                "overflow": False,
                "partition_count": world,
                "optimizer_state_dict": base,
                "fp32_flat_groups": fp32_r,
            }
        else:
            copies = [_copy_of(owners, g, r) for g in range(len(owners))]
            paddings = [zero12_padding(sum(_numel(ckpt, n) for n, _ in pairs), count, i) for i, count, pairs in copies]
            osd = {
                "loss_scaler": LossScaler(1.0),
                "dynamic_loss_scale": False,
                "overflow": False,
                "base_optimizer_state": base,
                "single_partition_of_fp32_groups": [Leading(t, t.spec.numel - p) for t, p in zip(fp32_r, paddings)],
                "zero_stage": ZeroStageEnum(stage),
                "group_paddings": paddings,
                "param_alignment_paddings": [[0] * len(pairs) for _, _, pairs in copies],
                "partition_count": [count for _, count, _ in copies],
                "ds_version": version,
                "param_slice_mappings": _slice_mappings(ckpt, copies, fragment_address),
            }
        save_torch({"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": version},
                   os.path.join(tag_dir, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        if stage == 3 or r == 0:
            states_dict = model_states(
                ckpt, order, module, param_shapes,
                frozen_shapes=shapes(ckpt, order.frozen) if stage >= 2 else None,
                frozen_fragments=(
                    OrderedDict((n, _zero3_fragment(t, world, r, dtype) if stage == 3 else frozen_whole[n]) for n, t in frozen.items())
                    if stage >= 2 else None
                ),
                step=step, ds_config=ds_config, world=world, version=version,
            )
            if experts:
                states_dict.update(num_experts=list(deepspeed_moe.ExpertLayers.of(experts).experts.values()), ds_autoep_layers=None)
            name = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
            save_torch(states_dict, os.path.join(tag_dir, name))
    # the ranks' files at once, in rank order: one is pickled while another's bytes go to the disk
    for _ in at_once(write_rank, [(r,) for r in range(world)], "deepspeed-rank"):
        pass
    with open(os.path.join(directory, "latest"), "w", encoding="utf-8") as f:
        f.write(tag)
    script = os.path.join(os.path.dirname(deepspeed.__file__), "utils", "zero_to_fp32.py")
    if os.path.isfile(script):
        shutil.copyfile(script, os.path.join(directory, "zero_to_fp32.py"))
    log.info("wrote DeepSpeed %s checkpoint %s", layout.describe(), tag_dir)
    return tag_dir


def model_states(
    ckpt: LogicalCheckpoint,
    order: EngineOrder,
    module: OrderedDict,
    param_shapes: list[OrderedDict],
    frozen_shapes: OrderedDict | None,
    frozen_fragments: OrderedDict | None,
    step: int,
    ds_config: dict[str, Any],
    world: int,
    version: str,
) -> dict[str, Any]:
    """A model-states file as ``save_checkpoint`` writes it, with the source's scheduler and client state."""
    return {
        **dict(ckpt.extra_state.get("client_state") or {}),
        "module": module,
        "buffer_names": list(order.buffers),
        "optimizer": None,
        "param_shapes": param_shapes,
        "frozen_param_shapes": frozen_shapes,
        "shared_params": dict(order.aliases),
        "frozen_param_fragments": frozen_fragments,
        "lr_scheduler": ckpt.extra_state.get("lr_scheduler"),
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": step,
        "global_samples": step * int(ds_config.get("train_batch_size", 1) or 1),
        "dp_world_size": world,
        "mp_world_size": 1,
        "ds_config": ds_config,
        "ds_version": version,
    }


def _has_state(ckpt: LogicalCheckpoint, key: str, names: list[str]) -> bool:
    per = ckpt.optimizer.tensors.get(key, {}) if ckpt.optimizer is not None else {}
    return any(n in per for n in names)


def _module(ckpt: LogicalCheckpoint, order: EngineOrder, dtype: torch.dtype, placeholders: bool, lock: threading.Lock) -> OrderedDict:
    """``module`` as the engine saves it: the model in its training dtype (ZeRO-3: empty parameters), each parameter
    streamed into the file from the source (read under ``lock``)."""
    out = OrderedDict()
    buffers = set(order.buffers)
    for name in order.module_keys:
        source = order.aliases.get(name, name)
        if name in buffers:  # DeepSpeed casts parameters to the training dtype, never buffers
            out[name] = ckpt.model[name].load()
        elif placeholders:
            out[name] = torch.empty(0, dtype=dtype)
        else:
            out[name] = ckpt.model[source].cast(dtype).guarded(lock)
    if not placeholders:  # a tied alias is the same tensor as its source, as in the engine's state dict
        for alias, source in order.aliases.items():
            out[alias] = out[source]
    return out


def _slice_mappings(ckpt, copies: list[tuple[int, int, list[tuple[str, str]]]], fragment_address) -> list[OrderedDict]:
    """Where each parameter's piece sits in this rank's partition (what ds_to_universal reads), by the name it
    has on this rank; ``copies``: per group, this rank's index, its copy's rank count and names."""
    out = []
    for index, count, pairs in copies:
        size = zero12_partition(sum(_numel(ckpt, n) for n, _ in pairs), count)
        lo, hi = index * size, (index + 1) * size
        mapping, offset = OrderedDict(), 0
        for n, local in pairs:
            numel = _numel(ckpt, n)
            start, end = max(offset, lo), min(offset + numel, hi)
            if start < end:
                mapping[local] = fragment_address(numel=end - start, start=start - lo)
            offset += numel
        out.append(mapping)
    return out


def write_deepspeed(
    ckpt: LogicalCheckpoint,
    dst: str,
    layout: NativeLayout,
    ds_config: dict[str, Any] | None = None,
    overwrite: bool = False,
    grouping: str | None = None,
) -> Manifest:
    """``dst`` as ``engine.save_checkpoint(dst)`` leaves it for a run of ``layout`` (``latest``, ``global_step<N>/``,
    ``zero_to_fp32.py``), our manifest and the source's other components (scheduler, data position, RNG, ...)
    beside the ZeRO files in ``global_step<N>/``: ``engine.load_checkpoint(dst)``, ``zero_to_fp32.py dst`` and our
    DeepSpeed trainer's ``--resume dst`` all load it."""
    sharding = ShardingMetadata(
        strategy=Strategy.ZERO, world_size=layout.world_size, dp=layout.world_size, precision=layout.precision,
        master_precision="float32", zero_stage=layout.zero_stage, ep=layout.ep_size,
    )
    order = grouped_order(ckpt, ds_config, grouping, layout.ep_size)  # the files and the manifest's record of their groups

    def write_files(directory: str) -> Written:
        return Written(at=os.path.basename(write_native(ckpt, directory, layout, ds_config, order=order)))

    name, _ = optimizer_grouping(ds_config, grouping)
    optimizer = {"class": ckpt.optimizer.cls if ckpt.optimizer is not None else "AdamW", "grouping": name,
                 "param_names": order.groups}
    return write_engine_checkpoint(
        ckpt, dst, NATIVE_KEY, write_files, sharding, {"deepspeed": _deepspeed()[0].__version__}, optimizer, overwrite,
    )
