"""transformers' ``Trainer`` checkpoints, read into logical tensors and written from any source.

What ``Trainer._save_checkpoint`` writes into ``checkpoint-<step>/`` (transformers 4.4x - 5.x):

- the model through ``save_pretrained``: ``config.json``, ``model.safetensors`` (tied copies dropped);
- ``optimizer.pt``: a torch optimizer state dict, parameters by integer id, the decay group then the no-decay
  group (biases and norms), each in module order, as ``Trainer.create_optimizer`` builds them;
- ``scheduler.pt``: the LR scheduler's state dict (stepped once per optimizer step);
- ``rng_state.pth`` (one process) or ``rng_state_<i>.pth``: python, numpy and torch generator states;
- ``trainer_state.json``: ``global_step`` and the log; ``training_args.bin``: a pickled ``TrainingArguments``,
  never read here (it needs unrestricted pickle, and nothing in it is training state).

``trainer.train(resume_from_checkpoint=dir)`` loads them all and skips ``global_step`` batches of its
dataloader. Every pickle loads with ``weights_only=True`` (numpy's RNG arrays allowlisted).

Our Hugging Face trainer (``trainers.hf_trainer``) keeps such a directory as its native component
``hf_trainer/`` inside an interop checkpoint, with the data position and trainer progress beside it.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from typing import Any


from interop.errors import ConfigurationError, ConversionError, CorruptCheckpointError, MissingFileError
from interop.logical import LogicalCheckpoint
from interop.manifest import Manifest
from interop.rng import numpy_state_dict, numpy_state_tuple, python_state_dict, python_state_tuple
from interop.sharding import ShardingMetadata, Strategy
from interop.topology import Topology
from interop.jsonio import read_json
from interop.safetensors_io import read_hf_safetensors
from interop.structure import Absent, Keys, ListOf, OneOf, check
from interop.universal import model_entries, write_sharded

from .accelerate import NUMPY_RNG, PYTHON_RNG, SCHEDULER, fresh_rng_states, load_accelerate_file, optimizer_from_torch_file, rank_rng_states, torch_optimizer_state
from .detection import HF_TRAINER_KEY, TRAINER_STATE, is_hf_trainer_checkpoint, locate_hf_trainer as locate  # noqa: F401
from .engine_checkpoint import RNG, carried_components, component_state, owning_checkpoint, write_engine_checkpoint
from .models.facts import in_module_names, in_stored_names, tied_groups
from .models.adapters import ADAPTER_CONFIG, engine_model, has_peft_names, in_peft_names, write_adapter_files
from .param_order import EngineOrder, engine_order, regroup, trainer_decay_names
from .pickle_safety import numpy_allowlist, save_torch, screen_pickles
from .torch_zip import TENSOR

NATIVE_KEY = HF_TRAINER_KEY  # our trainer's native component: a transformers Trainer checkpoint directory
OPTIM_PT, SCHEDULER_PT, RNG_PT = "optimizer.pt", "scheduler.pt", "rng_state.pth"
TRAINER_STATE_KEY = "hf_trainer_state"  # a Trainer source's trainer_state.json, carried to a Trainer target


def screen_trainer_checkpoint(directory: str, trust_pickle: bool = False) -> None:
    """What ``Trainer.train(resume_from_checkpoint=directory)`` unpickles (optimizer, scheduler, scaler, RNG
    states, a ``pytorch_model.bin``), through the restricted loader first. ``training_args.bin`` is not
    among them: Trainer does not read it back, and it needs unrestricted pickle."""
    names = [n for n in os.listdir(directory)
             if n in (OPTIM_PT, SCHEDULER_PT, "scaler.pt", "pytorch_model.bin") or (n.startswith("rng_state") and n.endswith(".pth"))]
    screen_pickles([os.path.join(directory, n) for n in sorted(names)], trust_pickle, numpy_allowlist())


def rng_from_hf(state: dict[str, Any], path: str) -> dict[str, Any]:
    """``rng_state.pth`` (``path``) as ``interop.rng.RNGState``'s state dict."""
    check(path, state, Keys(python=PYTHON_RNG, numpy=NUMPY_RNG, cpu=TENSOR, cuda=Absent(OneOf(TENSOR, ListOf(TENSOR)))))
    out = {"python": python_state_dict(state["python"]), "numpy": numpy_state_dict(state["numpy"]), "torch": state["cpu"]}
    if "cuda" in state:
        cuda = state["cuda"]
        out["cuda"] = list(cuda) if isinstance(cuda, (list, tuple)) else [cuda]
    return out


def rng_to_hf(state: dict[str, Any]) -> dict[str, Any]:
    out = {"python": python_state_tuple(state["python"]), "numpy": numpy_state_tuple(state["numpy"]), "cpu": state["torch"]}
    if state.get("cuda"):
        out["cuda"] = list(state["cuda"])
    return out


def _adapter_only(directory: str, base_model: str | None, trust_pickle: bool) -> tuple[dict[str, Any], dict]:
    """A Trainer checkpoint of a peft model as transformers writes it: Trainer.save_model saved the adapter only
    (adapter_config.json, adapter_model.safetensors), so the base model comes from ``--base-model``; the config
    and the whole peft model's tensors under its module names, as the engines save a peft model."""
    from . import hf
    from .models.adapters import with_adapter_dir
    from .models.facts import in_module_names as module_names_of

    if not base_model:
        raise ConfigurationError(f"{directory}: a Trainer checkpoint of a peft model holds the adapter only ({ADAPTER_CONFIG}, "
                                 "adapter_model.safetensors); pass the base model it trained with --base-model DIR")
    base = hf.read_hf(base_model, trust_pickle)
    whole = in_peft_names(module_names_of(with_adapter_dir(base, directory, base_model)))
    return whole.config, whole.model


def read_hf_trainer(path: str, trust_pickle: bool = False, verify_digests: bool = True, base_model: str | None = None) -> LogicalCheckpoint:
    directory = locate(path)
    manifest, owner = owning_checkpoint(directory, NATIVE_KEY, verify_digests)
    trainer_state_json = read_json(os.path.join(directory, TRAINER_STATE), "Trainer state")
    if not isinstance(trainer_state_json, dict):
        raise CorruptCheckpointError(os.path.join(directory, TRAINER_STATE), "is not a Trainer state (an object)")
    step = trainer_state_json.get("global_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CorruptCheckpointError(os.path.join(directory, TRAINER_STATE), f"global_step is {step!r}, not a step number")
    model = read_hf_safetensors(directory)
    if not model and not os.path.isfile(os.path.join(directory, "config.json")):
        config, model = _adapter_only(directory, base_model, trust_pickle)
    else:
        config = read_json(os.path.join(directory, "config.json"), "model config")
    if not model:
        raise MissingFileError(os.path.join(directory, "model.safetensors"), "no model weights in the Trainer checkpoint")
    # optimizer.pt numbers the module's parameters: read it under the module's names, then all in universal's (a
    # peft model's are its module names already: read as base + adapter by registry.read)
    peft = has_peft_names(LogicalCheckpoint(model=model))
    if not peft:
        model = in_module_names(LogicalCheckpoint(model=model, config=config)).model
    optim_path = os.path.join(directory, OPTIM_PT)
    optimizer = optimizer_from_torch_file(optim_path, manifest, config, model, trust_pickle, own="trainer") if os.path.isfile(optim_path) else None
    extra: dict[str, Any] = {TRAINER_STATE_KEY: trainer_state_json}
    sched_path = os.path.join(directory, SCHEDULER_PT)
    if os.path.isfile(sched_path):
        extra[SCHEDULER] = load_accelerate_file(sched_path, trust_pickle)
    rng_files = sorted((f for f in os.listdir(directory) if f.startswith("rng_state")), key=lambda f: (len(f), f))
    rank_state = {RNG: [rng_from_hf(load_accelerate_file(p, trust_pickle), p) for p in (os.path.join(directory, f) for f in rng_files)]
                  } if rng_files else {}
    components = carried_components(owner, manifest, NATIVE_KEY)
    world = max(1, len(rng_files))
    source = dict((manifest.source or {}) if manifest else {})
    source.update({"format": "hf-trainer", "world_size": world, "step": step})
    ckpt = LogicalCheckpoint(
        model=model, config=config, optimizer=optimizer, components=components, source=source,
        topology=manifest.topology if manifest else Topology.uniform(world).to_json(),
        frozen=((manifest.model or {}).get("frozen") if manifest else None) or [],
        step=step, extra_state=extra, rank_state=rank_state,
    )
    if peft:
        return ckpt
    ckpt = in_stored_names(ckpt)
    ckpt.tied = ((manifest.model or {}).get("tied") if manifest else None) or tied_groups(config)
    return ckpt


def _trainer_view(ckpt: LogicalCheckpoint) -> tuple[LogicalCheckpoint, EngineOrder, EngineOrder, list[str]]:
    """The checkpoint under the module's (a peft model's) names, its parameter order, that order with the param
    groups Trainer makes, and the notes regrouping it gave."""
    module = in_peft_names(in_module_names(ckpt))
    order = engine_order(module)
    return (module, order, *trainer_groups(order, module))


def write_native(ckpt: LogicalCheckpoint, directory: str) -> list[str]:
    """The files ``Trainer._save_checkpoint`` writes for one process; returns notes."""

    notes: list[str] = []
    if ckpt.config is None:  # a Trainer checkpoint is a model directory: from_pretrained reads its config.json
        raise ConversionError("the source records no model config, so no Trainer checkpoint can be written; "
                              "pass the model's config with --config CONFIG.json (or the model's directory)")
    os.makedirs(directory, exist_ok=True)
    # optimizer.pt numbers the module's parameters, and model.safetensors holds them under the module's names too:
    # Trainer.train(resume_from_checkpoint=...) loads it with load_state_dict(strict=False), which would leave
    # any tensor save_pretrained names otherwise (a MoE model's per-expert tensors) as initialised, silently;
    # from_pretrained takes the module's names as well
    module, source_order, order, regrouped = _trainer_view(ckpt)
    notes += regrouped
    write_sharded(directory, "", "model", model_entries(module), sys.maxsize, hashed=False)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(ckpt.config, f, indent=2)
    if ckpt.adapter is not None:  # what Trainer's save_model writes for a peft model, for peft's loaders
        write_adapter_files(ckpt, directory)
    save_torch(torch_optimizer_state(module, order), os.path.join(directory, OPTIM_PT))
    scheduler = component_state(ckpt, SCHEDULER)
    if scheduler is not None:
        save_torch(_with_groups(scheduler, len(source_order.groups), len(order.groups)), os.path.join(directory, SCHEDULER_PT))
    states = rank_rng_states(ckpt, 1)
    if states is None:
        notes.append("RNG streams: the source's do not map onto 1 process; it starts a fresh one")
        states = fresh_rng_states(ckpt.step or 0, 1)
    save_torch(rng_to_hf(states[0]), os.path.join(directory, RNG_PT))
    trainer_state(ckpt).save_to_json(os.path.join(directory, TRAINER_STATE))
    return notes


def trainer_state(ckpt: LogicalCheckpoint) -> Any:
    """trainer_state.json for ``ckpt``: a Trainer source's own (its log, logging/save/eval cadence, epoch, best
    checkpoint, callbacks' states), which a resumed Trainer takes over its arguments', at this step; otherwise
    a fresh one. Either way with TrainerControl's state, which a resumed Trainer looks up by name at its next
    save (KeyError: 'TrainerControl' without it)."""
    import dataclasses

    import transformers

    carried = component_state(ckpt, TRAINER_STATE_KEY) if TRAINER_STATE_KEY in ckpt.components or TRAINER_STATE_KEY in ckpt.extra_state else None
    if isinstance(carried, dict):
        known = {f.name for f in dataclasses.fields(transformers.TrainerState)}
        state = transformers.TrainerState(**{k: v for k, v in carried.items() if k in known})
        state.global_step = ckpt.step or 0
    else:
        state = transformers.TrainerState(global_step=ckpt.step or 0, train_batch_size=_global_batch(ckpt), stateful_callbacks=[])
    if not isinstance(state.stateful_callbacks, dict):
        state.stateful_callbacks = {}
    state.stateful_callbacks.setdefault("TrainerControl", transformers.TrainerControl().state())
    return state


def trainer_groups(order: EngineOrder, module: LogicalCheckpoint) -> tuple[EngineOrder, list[str]]:
    """The optimizer groups as ``Trainer.create_optimizer`` makes them: decay and no decay by transformers' own rule,
    both present even when one is empty (a LoRA run's adapters are all matrices), since its
    ``optimizer.load_state_dict`` takes only the groups it built. A run grouped otherwise (one that decayed every
    matrix, where Trainer spares 2-D biases and decays 1-D weights) is regrouped, with a note naming the parameters
    whose weight decay that changes; returns the order and its notes."""
    decay = trainer_decay_names(engine_model(module))
    trainable = [n for n in order.module_keys if any(n in g for g in order.groups)]
    if not decay or not trainable:  # no model to ask: the source's groups, with Trainer's empty no-decay group
        if len(order.groups) != 1 or not order.groups[0] or any(len(module.model[n].spec.shape) < 2 for n in order.groups[0]):
            return order, []
        return replace(order, groups=[*order.groups, []], hyper=[*order.hyper, {**order.hyper[0], "weight_decay": 0.0}]), []
    wanted = [[n for n in trainable if n in decay], [n for n in trainable if n not in decay]]
    same = [g for g in wanted if g] == [g for g in order.groups if g]
    source = order if same else regroup(order, module, "decay")
    held = {tuple(g): h for g, h in zip(source.groups, source.hyper) if g}
    other = next(iter(held.values()))  # an empty group's hyper-parameters: the other's (no decay for no-decay's)
    hyper = [held.get(tuple(g)) or {**other, **({"weight_decay": 0.0} if i else {})} for i, g in enumerate(wanted)]
    new = replace(order, groups=wanted, hyper=hyper)
    if same or module.optimizer is None:  # the same groups, or groups that were a default rather than a run's
        return new, []
    decay_of = lambda o: {n: h.get("weight_decay") for g, h in zip(o.groups, o.hyper) for n in g}  # noqa: E731
    before, after = decay_of(order), decay_of(new)
    changed = [n for n in trainable if before[n] != after[n]]
    note = (f"optimizer groups: regrouped as transformers' Trainer makes them ({len(wanted[0])} decay, "
            f"{len(wanted[1])} no decay), the only groups its resume loads")
    if changed:
        note += f"; weight decay changes for {len(changed)} parameter(s): " + ", ".join(
            f"{n} {before[n]} -> {after[n]}" for n in changed[:3]) + (" ..." if len(changed) > 3 else "")
    return new, [note]


def _with_groups(scheduler: Any, before: int, after: int) -> Any:
    """A scheduler state for ``after`` param groups where the source had ``before``: torch's LR schedulers keep
    one entry per group in their lists (base_lrs, _last_lr, lr_lambdas), and the group Trainer adds (empty) runs
    the same schedule as the last one."""
    if after == before or not isinstance(scheduler, dict):
        return scheduler
    return {k: [*v, *[v[-1]] * (after - before)] if isinstance(v, list) and len(v) == before and v else v
            for k, v in scheduler.items()}


def save_peft_whole(model: Any, directory: str) -> None:
    """A peft model's whole state (base and adapter, under its module names) and its base model's config.json
    beside what Trainer's save_model writes for it (the adapter alone): the checkpoint then holds the frozen
    base it was trained on, which Trainer's resume loads from model.safetensors (load_state_dict)."""
    from safetensors.torch import save_file

    seen, state = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():  # a tied parameter once, as save_pretrained keeps it
        if id(t) not in seen:
            seen.add(id(t))
            state[name] = t.detach().contiguous()
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    base = model.get_base_model()
    config = {**base.config.to_dict(), "architectures": [type(base).__name__]}  # as save_pretrained records it
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _global_batch(ckpt: LogicalCheckpoint) -> int:
    """Samples per optimizer step, from our data position (first epoch); Trainer only compares it, warning."""
    data = component_state(ckpt, "data") if "data" in ckpt.components or "data" in ckpt.extra_state else None
    if isinstance(data, dict) and ckpt.step and not data.get("epoch") and data.get("index"):
        return int(data["index"]) // int(ckpt.step)
    return 1


def write_hf_trainer(ckpt: LogicalCheckpoint, dst: str, overwrite: bool = False) -> Manifest:
    """An interop checkpoint that is itself a transformers Trainer checkpoint for one process (its files beside the manifest):
    ``trainer.train(resume_from_checkpoint=dst)`` continues it, and our Hugging Face trainer
    resumes from ``dst`` with the data position and trainer progress beside it."""
    import transformers

    order = _trainer_view(ckpt)[2]
    sharding = ShardingMetadata(strategy=Strategy.SINGLE, world_size=1, precision=ckpt.source.get("dtype") or "float32")
    optimizer = {"class": ckpt.optimizer.cls if ckpt.optimizer else "AdamW", "param_names": order.groups} if ckpt.optimizer else None
    return write_engine_checkpoint(
        ckpt, dst, NATIVE_KEY, lambda directory: write_native(ckpt, directory), sharding,
        {"transformers": transformers.__version__}, optimizer, overwrite, frozenset({SCHEDULER, RNG, TRAINER_STATE_KEY}),
    )
