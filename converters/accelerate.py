"""Accelerate's ``save_state`` layout, DDP and FSDP2, read into logical tensors and written for any process count.

What ``accelerator.save_state(dir)`` writes (accelerate 1.x):

- DDP (and one process): ``model.safetensors`` (tied copies dropped), ``optimizer.bin`` (a torch optimizer
  state dict: parameters by integer id, in the order the optimizer was given them).
- FSDP2 (``SHARDED_STATE_DICT``): ``pytorch_model_fsdp_0/`` and ``optimizer_0/``, torch DCP directories keyed
  ``model.<name>`` and ``optimizer.state.<name>.<key>`` / ``optimizer.param_groups.<i>.<field>``.
- Both: ``scheduler.bin``, ``random_states_<rank>.pkl`` per process, ``custom_checkpoint_<i>.pkl`` per object
  registered with ``register_for_checkpointing``.

Accelerate steps a prepared scheduler once per process per optimizer step, so ``scheduler.bin`` counts
optimizer steps x processes. The logical checkpoint holds it per optimizer step (engine-neutral); writing for N
processes multiplies by N again. RNG states become the per-rank ``rng`` component (the layout of
``interop.rng.RNGState``), and back.

Every pickle here loads with ``weights_only=True`` and an allowlist (numpy arrays for the RNG states).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, Callable


from interop.errors import ConversionError, CorruptCheckpointError, MissingFileError
from interop.logical import DeferredName, LogicalCheckpoint, OptimizerState
from interop.manifest import Manifest
from interop.rng import numpy_state_dict, numpy_state_tuple, python_state_dict, python_state_tuple
from interop.sharding import ShardingMetadata, Strategy
from interop.topology import Topology
from interop.safetensors_io import read_hf_safetensors
from interop.structure import Is, Keys, ListOf, Maybe, TupleOf, check
from interop.universal import model_entries, saved_scalar, split_optimizer_state, write_sharded

from .dcp import DCPReader, drop_tied_aliases, model_tree, optimizer_from_tree, optimizer_tree, unflatten_lists, write_dcp
from .detection import (ACCELERATE_KEY, BIN_MODEL, MODEL_DCP, RANDOM_STATES, SAFE_MODEL,  # noqa: F401
                        is_accelerate_checkpoint, locate_accelerate as locate)
from .engine_checkpoint import carried_components, component_state, owning_checkpoint, RNG, rank_rng_states, write_engine_checkpoint
from .models.adapters import has_peft_names, peft_model_near
from .models.facts import meta_model, tied_groups
from .hf import config_near
from .param_order import GROUP_RULES, EngineOrder, engine_order, positional_fits, with_initial_optimizer
from .pickle_safety import load_torch_file, numpy_allowlist, save_torch
from . import optimizer_class
from .torch_zip import TENSOR, TORCH_OPTIMIZER, materialize, state_shapes

log = logging.getLogger(__name__)

NATIVE_KEY = ACCELERATE_KEY  # our trainer's native component: accelerate's save_state directory
OPTIM_DCP, OPTIM_BIN, SCHEDULER_BIN = "optimizer_0", "optimizer.bin", "scheduler.bin"
CUSTOM = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")
SCHEDULER = "scheduler"


def load_accelerate_file(path: str, trust_pickle: bool = False, stored: bool = False) -> Any:
    """One of accelerate's pickles, weights-only with numpy's RNG types; ``stored``: read without torch where it
    can be, its tensors and torch types then materialized (torch is imported only if it holds any)."""
    if stored:
        return materialize(load_torch_file(path, trust_pickle, allow=numpy_allowlist(), stored=True))
    return load_torch_file(path, trust_pickle, allow=numpy_allowlist())


def screen_save_state(directory: str, trust_pickle: bool = False) -> None:
    """Everything ``accelerator.load_state(directory)`` unpickles, through our restricted loaders first:
    its torch pickles (optimizer, scheduler, RNG states, registered objects: ``weights_only`` with numpy's RNG
    types) and, for FSDP2, the DCP metadata that torch's reader unpickles with plain ``pickle``."""
    if trust_pickle:
        return
    from .dcp import METADATA, read_metadata

    for dirpath, _, names in os.walk(directory):
        for name in sorted(names):
            if name == METADATA:
                read_metadata(dirpath)
            elif name.endswith((".bin", ".pkl", ".pt", ".pth")):
                load_accelerate_file(os.path.join(dirpath, name))


# --- where the files are ------------------------------------------------------------------------------------
@dataclass
class AccelerateFiles:
    directory: str
    fsdp: bool
    num_processes: int
    custom: list[str] = field(default_factory=list)


def describe(directory: str) -> AccelerateFiles:
    names = os.listdir(directory)
    ranks = sorted(int(m.group(1)) for f in names if (m := RANDOM_STATES.match(f)))
    missing = sorted(set(range(max(ranks) + 1)) - set(ranks)) if ranks else [0]
    if missing:
        raise MissingFileError(
            os.path.join(directory, f"random_states_{missing[0]}.pkl"),
            f"missing: accelerate saved {max(ranks, default=-1) + 1} processes' RNG states and this one is absent",
        )
    custom = sorted((f for f in names if CUSTOM.match(f)), key=lambda f: int(CUSTOM.match(f).group(1)))
    return AccelerateFiles(directory, os.path.isdir(os.path.join(directory, MODEL_DCP)), len(ranks), custom)


# --- reading ------------------------------------------------------------------------------------------------
def _config_near(directory: str, manifest: Manifest | None, root: str) -> dict[str, Any] | None:
    if manifest is not None and manifest.model and isinstance(manifest.model.get("config"), dict):
        return manifest.model["config"]
    return config_near(directory, root)


def _optimizer_from_dcp(directory: str) -> OptimizerState:
    reader = DCPReader(os.path.join(directory, OPTIM_DCP))
    return optimizer_from_tree(unflatten_lists(reader.nested(("optimizer",))), reader.directory)


def _param_names(path: str, manifest: Manifest | None, config, model: dict, groups: list[dict], per_id: dict,
                 own: str | None, moments: Callable[[], frozenset[str]]) -> list[list[str]]:
    """Which parameter each integer id of a torch optimizer file is. Our trainers record it; otherwise it is the
    model's parameters in module order, split as the code that built the optimizer splits them: ``own``, the
    engine's own rule (transformers' Trainer for its optimizer.pt), where it fits, else the one rule of
    :data:`GROUP_RULES` that fits the file's group sizes and the shapes of its ``moments()`` (the state its
    optimizer keeps in the parameter's shape)."""
    recorded = ((manifest.optimizer or {}) if manifest else {}).get("param_names")
    if recorded:
        return recorded
    directory, name = os.path.dirname(path), os.path.basename(path)
    # a peft model's optimizer holds its trainable parameters (the adapters): peft's model of it says which
    meta = peft_model_near(directory, config, list(model)) if has_peft_names(LogicalCheckpoint(model=model)) else meta_model(config)
    if meta is None:
        raise ConversionError(
            f"{directory}: {name} keeps parameters by position only, and there is no config.json to tell "
            "their names; pass the model's config with --config CONFIG.json (or the model's directory)"
        )

    moment_keys = moments()
    held = [[[s for k, s in state_shapes(per_id.get(i, {})).items() if k in moment_keys] for i in g["params"]] for g in groups]
    rules = (own, *(r for r in GROUP_RULES if r != own)) if own else tuple(GROUP_RULES)
    shapes = {n: tuple(t.spec.shape) for n, t in model.items()}
    fits = positional_fits(meta, shapes, held, rules)
    if len(fits) == 1 or (fits and fits[0][0] in (own, "single")):
        return fits[0][1]
    by_sizes = [] if fits else positional_fits(meta, shapes, [[[] for _ in g] for g in held], rules)
    if by_sizes:  # the groups fit, a state's shape does not: the check of each entry names it
        return by_sizes[0][1]
    sizes = [len(g["params"]) for g in groups]
    if fits:
        raise ConversionError(
            f"{directory}: {name} keeps parameters by position only, and its groups of {sizes} fit more than one way of "
            f"grouping them that puts different parameters at the same positions ({GROUP_RULES[fits[0][0]]}; "
            f"{GROUP_RULES[fits[1][0]]}); save with an interop trainer, which records the names")
    raise ConversionError(
        f"{directory}: cannot tell which parameter each of {name}'s {sum(sizes)} entries is (groups of {sizes}; the "
        f"model has {len(list(meta.parameters()))} parameters, and no known way of grouping them gives these groups); "
        "save with an interop trainer, which records the names"
    )


def _torch_optimizer_parts(path: str, state: Any) -> tuple[list[dict], dict[int, dict]]:
    """A torch optimizer state dict's param groups and per-parameter state, their structure checked
    (:data:`TORCH_OPTIMIZER`), each parameter id in one group only."""
    if not isinstance(state, dict) or "param_groups" not in state or "state" not in state:
        raise CorruptCheckpointError(path, "not a torch optimizer state dict (no 'state' and 'param_groups')")
    check(path, state, TORCH_OPTIMIZER)
    seen: set[int] = set()
    for group in state["param_groups"]:
        for i in group["params"]:
            if i in seen:
                raise CorruptCheckpointError(path, f"parameter id {i} is listed twice in the param groups")
            seen.add(i)
    return state["param_groups"], state["state"]


def optimizer_from_torch_file(path: str, manifest, config, model, trust_pickle: bool, own: str | None = None) -> OptimizerState:
    """A torch optimizer state dict saved by position (accelerate's optimizer.bin, transformers' optimizer.pt),
    by parameter name: the manifest's ``param_names``, or the model's parameters split as the engine (``own``,
    a rule of :data:`GROUP_RULES`) or its users split them."""
    groups, per_id = _torch_optimizer_parts(path, load_accelerate_file(path, trust_pickle))
    cls = DeferredName(lambda: optimizer_class.class_of(groups))
    names = _param_names(path, manifest, config, model, groups, per_id, own, lambda: optimizer_class.moments(optimizer_class.class_of(groups), groups))
    if [len(g["params"]) for g in groups] != [len(n) for n in names]:
        raise CorruptCheckpointError(path, f"param groups of {[len(g['params']) for g in groups]} parameters, names for {[len(n) for n in names]}")
    by_id = {i: n for g, ns in zip(groups, names) for i, n in zip(g["params"], ns)}
    unknown = sorted(set(per_id) - set(by_id))
    if unknown:
        raise CorruptCheckpointError(path, f"optimizer state for parameter ids no param group holds: {unknown[:5]}")
    named_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": ns} for g, ns in zip(groups, names)]
    return OptimizerState(cls, named_groups, *split_optimizer_state({by_id[i]: e for i, e in per_id.items()}, path))


def scale_scheduler(state: dict[str, Any], from_factor: int, to_factor: int, where: str = SCHEDULER_BIN) -> dict[str, Any]:
    """A torch LR scheduler's counters, stepped ``from_factor`` times per optimizer step, as if stepped
    ``to_factor`` times (accelerate steps a prepared scheduler once per process)."""
    state = dict(state)
    if from_factor == to_factor:
        return state
    last = state.get("last_epoch")
    if isinstance(last, int) and last >= 0:
        if last % from_factor:
            raise ConversionError(f"{where}: last_epoch {last} is not a multiple of the {from_factor} scheduler steps per optimizer step")
        state["last_epoch"] = last // from_factor * to_factor
    count = state.get("_step_count")
    if isinstance(count, int) and count >= 1:
        state["_step_count"] = (count - 1) // from_factor * to_factor + 1
    return state


# random.getstate() and numpy's RandomState.get_state(), as every framework's RNG file pickles them
PYTHON_RNG = TupleOf(Integral, ListOf(Integral), Maybe(Real))
NUMPY_RNG = TupleOf(str, Is(lambda v: hasattr(v, "shape") and hasattr(v, "dtype"), "an array"), Integral, Integral, Real)
RANDOM_STATES_FILE = Keys(random_state=PYTHON_RNG, numpy_random_seed=NUMPY_RNG, torch_manual_seed=TENSOR)


def rng_from_accelerate(states: dict[str, Any], path: str) -> dict[str, Any]:
    """accelerate's random_states_<rank>.pkl (``path``) as interop.rng.RNGState's state dict."""
    check(path, states, RANDOM_STATES_FILE)
    out = {
        "python": python_state_dict(states["random_state"]),
        "numpy": numpy_state_dict(states["numpy_random_seed"]),
        "torch": states["torch_manual_seed"],
    }
    if "torch_cuda_manual_seed" in states:
        out["cuda"] = list(states["torch_cuda_manual_seed"])
    return out


def rng_to_accelerate(state: dict[str, Any], step: int) -> dict[str, Any]:
    out = {
        "step": step,
        "random_state": python_state_tuple(state["python"]),
        "numpy_random_seed": numpy_state_tuple(state["numpy"]),
        "torch_manual_seed": state["torch"],
    }
    if "cuda" in state:
        out["torch_cuda_manual_seed"] = list(state["cuda"])
    return out


def read_accelerate(path: str, trust_pickle: bool = False, verify_digests: bool = True,
                    config: dict[str, Any] | None = None) -> LogicalCheckpoint:
    directory = locate(path)
    files = describe(directory)
    manifest, owner = owning_checkpoint(directory, NATIVE_KEY, verify_digests)
    config = config or _config_near(directory, manifest, path)
    tied = ((manifest.model or {}).get("tied") if manifest else None) or tied_groups(config)
    if files.fsdp:
        reader = DCPReader(os.path.join(directory, MODEL_DCP))
        keys = set(reader.tensor_keys())
        model = drop_tied_aliases(
            {".".join(map(str, p[1:])): reader.lazy(k) for k, p in reader.paths.items() if p[0] == "model" and k in keys}, tied
        )
    else:
        model = read_hf_safetensors(directory) or _bin_model(directory, trust_pickle)
    optimizer = None
    if files.fsdp and os.path.isdir(os.path.join(directory, OPTIM_DCP)):
        optimizer = _optimizer_from_dcp(directory)
    elif os.path.isfile(os.path.join(directory, OPTIM_BIN)):
        optimizer = optimizer_from_torch_file(os.path.join(directory, OPTIM_BIN), manifest, config, model, trust_pickle)
    if optimizer is not None and manifest and (manifest.optimizer or {}).get("class"):
        optimizer.cls = manifest.optimizer["class"]
    frozen = ((manifest.model or {}).get("frozen") if manifest else None)
    if frozen is None:
        trainable = {n for g in (optimizer.param_groups if optimizer else []) for n in g["params"]}
        aliases = {t for t, *_ in tied}
        params = _param_names_of(config)
        frozen = [n for n in model if optimizer is not None and n not in trainable and n not in aliases
                  and (params is None or n in params)]
    factor = int(((manifest.optimizer or {}) if manifest else {}).get("scheduler_steps_per_step", files.num_processes))
    extra: dict[str, Any] = {}
    rank_state: dict[str, list[Any]] = {}
    sched_path = os.path.join(directory, SCHEDULER_BIN)
    if os.path.isfile(sched_path):
        extra[SCHEDULER] = scale_scheduler(load_accelerate_file(sched_path, trust_pickle, stored=True), factor, 1, sched_path)
    for name in files.custom:
        extra[name[: -len(".pkl")]] = load_accelerate_file(os.path.join(directory, name), trust_pickle, stored=True)
    components = carried_components(owner, manifest, NATIVE_KEY)
    if RNG not in components:
        rank_state[RNG] = [
            rng_from_accelerate(load_accelerate_file(path, trust_pickle), path)
            for path in (os.path.join(directory, f"random_states_{r}.pkl") for r in range(files.num_processes))
        ]
    step = manifest.step if manifest else _step_of(directory, optimizer, trust_pickle)
    source = dict((manifest.source or {}) if manifest else {})
    source.update({"format": "accelerate", "strategy": "fsdp" if files.fsdp else "ddp", "world_size": files.num_processes, "step": step})
    return LogicalCheckpoint(
        model=model,
        config=config,
        optimizer=optimizer,
        components=components,
        source=source,
        topology=manifest.topology if manifest else Topology.uniform(files.num_processes).to_json(),
        tied=tied,
        frozen=frozen,
        step=step,
        extra_state=extra,
        rank_state=rank_state,
    )


def _param_names_of(config) -> set[str] | None:
    """The model's parameter names (buffers excluded), from its config on the meta device; None without one."""
    meta = meta_model(config)
    return None if meta is None else {n for n, _ in meta.named_parameters()}


def _bin_model(directory: str, trust_pickle: bool) -> dict:
    from interop.tensors import LazyTensor

    path = os.path.join(directory, BIN_MODEL)
    state = load_accelerate_file(path, trust_pickle)
    return {k: LazyTensor.of(v, f"{path}[{k}]") for k, v in state.items()}


def _step_of(directory: str, optimizer: OptimizerState | None, trust_pickle: bool) -> int | None:
    """Optimizer steps taken: AdamW's per-parameter step when it agrees everywhere, else accelerate's counter."""
    steps = {e["value"] for e in (optimizer.scalars.get("step", {}) if optimizer else {}).values()}
    if len(steps) == 1:
        return int(steps.pop())
    states = load_accelerate_file(os.path.join(directory, "random_states_0.pkl"), trust_pickle)
    step = states.get("step") if isinstance(states, dict) else None
    return int(step) if step is not None else None


# --- writing ------------------------------------------------------------------------------------------------
def torch_optimizer_state(ckpt: LogicalCheckpoint, order: EngineOrder) -> dict[str, Any]:
    """``optimizer.state_dict()`` of a torch optimizer given ``order``'s groups: parameters by integer id; its
    tensors the source's LazyTensors, which :func:`save_torch` streams into the file (never all in memory)."""
    opt = ckpt.optimizer
    ids = {n: i for i, n in enumerate(n for g in order.groups for n in g)}
    per_id: dict[int, dict[str, Any]] = {}
    for key, per in (opt.scalars.items() if opt else []):
        for name, entry in per.items():
            per_id.setdefault(ids[name], {})[key] = saved_scalar(entry)
    for key, per in (opt.tensors.items() if opt else []):
        for name, t in per.items():
            per_id.setdefault(ids[name], {})[key] = t
    groups = [{**h, "params": [ids[n] for n in g]} for h, g in zip(order.hyper, order.groups)]
    return {"state": dict(sorted(per_id.items())), "param_groups": groups}


def fresh_rng_states(step: int, world: int) -> list[dict[str, Any]]:
    """RNG states for ``world`` ranks when the source's cannot be mapped onto them: seeded by step and rank."""
    from interop.rng import RNGState

    fresh = RNGState()
    saved = fresh.state_dict()
    states = []
    for r in range(world):
        fresh.reseed(1_000_003 * step + r)
        states.append(fresh.state_dict())
    fresh.load_state_dict(saved)
    return states


def write_native(ckpt: LogicalCheckpoint, directory: str, world_size: int, fsdp: bool, order: EngineOrder | None = None) -> list[str]:
    """accelerate's save_state files for ``world_size`` processes into ``directory``; returns notes."""
    notes: list[str] = []
    os.makedirs(directory, exist_ok=True)
    order = order or engine_order(ckpt)
    if fsdp:
        write_dcp({"model": model_tree(ckpt, order)}, os.path.join(directory, MODEL_DCP))
        # DCP loads only what the target state dict asks for, and a prepared optimizer asks for every entry
        write_dcp({"optimizer": optimizer_tree(with_initial_optimizer(ckpt, order), order)}, os.path.join(directory, OPTIM_DCP))
    else:  # model.safetensors, one file whatever its size (load_state reads no index), streamed
        write_sharded(directory, "", SAFE_MODEL.removesuffix(".safetensors"), model_entries(ckpt), sys.maxsize, hashed=False)
        save_torch(torch_optimizer_state(ckpt, order), os.path.join(directory, OPTIM_BIN))
    scheduler = component_state(ckpt, SCHEDULER)
    if scheduler is not None:
        save_torch(scale_scheduler(scheduler, 1, world_size), os.path.join(directory, SCHEDULER_BIN))
    for key in sorted(k for k in ckpt.extra_state if CUSTOM.match(k + ".pkl")):
        save_torch(ckpt.extra_state[key], os.path.join(directory, key + ".pkl"))
    states = rank_rng_states(ckpt, world_size)
    if states is None:
        notes.append(f"RNG streams: the source's do not map onto {world_size} processes; each process starts fresh ones (seeded by rank)")
        states = fresh_rng_states(ckpt.step or 0, world_size)
    for r, s in enumerate(states):
        save_torch(rng_to_accelerate(s, ckpt.step or 0), os.path.join(directory, f"random_states_{r}.pkl"))
    return notes


def write_accelerate(ckpt: LogicalCheckpoint, dst: str, world_size: int, fsdp: bool, overwrite: bool = False) -> Manifest:
    """An interop checkpoint whose ``accelerate/`` is accelerate's save_state output for ``world_size``
    processes: ``accelerator.load_state(dst + "/accelerate")`` loads it, and our Accelerate trainer resumes from
    ``dst`` with the source's data position and trainer state beside it."""
    import accelerate

    order = engine_order(ckpt)
    sharding = ShardingMetadata(
        strategy=Strategy.FSDP if fsdp else Strategy.DDP, world_size=world_size, dp=world_size,
        precision=ckpt.source.get("dtype") or "float32", sharding_strategy="full_shard" if fsdp else None,
    )
    optimizer = {"class": ckpt.optimizer.cls if ckpt.optimizer else "AdamW", "param_names": order.groups,
                 "scheduler_steps_per_step": world_size}
    consumed = frozenset({SCHEDULER} | {k for k in ckpt.extra_state if CUSTOM.match(k + ".pkl")})  # in accelerate/ now
    return write_engine_checkpoint(
        ckpt, dst, NATIVE_KEY, lambda directory: write_native(ckpt, directory, world_size, fsdp, order), sharding,
        {"accelerate": accelerate.__version__}, optimizer, overwrite, consumed,
    )
