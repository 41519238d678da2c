"""LoRA / PEFT adapters: an engine's checkpoint of a peft model, and the logical checkpoint's view of it.

Engines save a peft model's state dict under its module names (``base_model.model.<name>``, the adapted linears'
``base_layer``, ``lora_A.<adapter>``). A logical checkpoint holds the same model the way peft and transformers
store it on disk: the frozen base model under save_pretrained's names and the adapter under peft's
adapter-file names (``adapter_model.safetensors``), with the adapter config beside (``ckpt.adapter``). Universal
writes exactly those two directories, and every engine writer maps the names back to the peft model's.

Which module name is which stored name is peft's answer, asked of peft itself: the base model is built from its
config on the meta device and wrapped by ``get_peft_model``; peft's injected layers keep the base model's own
parameter objects (so identity says which base tensor a ``base_layer`` weight is), and peft's
``get_peft_model_state_dict`` names the adapter's tensors (asked with placeholders, so identity again says which
module tensor each saved key is). The adapter config (rank, alpha, targets) is never guessed: a wrong alpha
scales every update (verl's lora_alpha=0 adapters), so it comes from the checkpoint's own record, peft's
``adapter_config.json`` beside it, or ``--adapter-config``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from functools import lru_cache
from typing import Any

from interop.lazy_import import torch

from interop.errors import ConfigurationError, ConversionError
from interop.jsonio import read_json
from interop.logical import AdapterState, LogicalCheckpoint
from interop.universal import checked_adapter_config
from interop.tensors import LazyTensor

from . import facts

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"  # peft's save_pretrained
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# peft's tuner layers wrap the module they adapt as ``base_layer``: how a peft model's state dict is told from a plain
# one before any config is at hand (without importing peft); which names are the adapter's is peft's own list
_BASE_LAYER = ".base_layer."


@lru_cache(maxsize=1)
def _adapter_pattern() -> re.Pattern:
    """``.<adapter tensor name>.<adapter>.`` for every tuner peft has (LoRA's lora_A ... lora_magnitude_vector,
    IA3's ia3_l, LoKr's, ...): each tuner layer class lists its own in ``adapter_layer_names``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    names, todo = set(), [BaseTunerLayer]
    while todo:
        cls = todo.pop()
        names |= set(getattr(cls, "adapter_layer_names", ()))
        todo += cls.__subclasses__()
    return re.compile(r"\.(" + "|".join(sorted(map(re.escape, names))) + r")\.([^.]+)(\.|$)")


def _adapter_names(names) -> set[str]:
    """The adapters (``default``, ...) a peft model's state dict names."""
    return {m.group(2) for n in names for m in [_adapter_pattern().search(n)] if m}

def summary(adapter: AdapterState) -> str:
    c = adapter.config
    targets = c.get("target_modules")
    targets = sorted(targets) if isinstance(targets, (list, set, tuple)) else targets
    return (f"{c.get('peft_type', 'LORA')} '{adapter.name}': r={c.get('r')}, alpha={c.get('lora_alpha')}, "
            f"targets={targets}, dropout={c.get('lora_dropout')}, {len(adapter.tensors)} adapter tensors")


def has_peft_names(ckpt: LogicalCheckpoint) -> bool:
    """The checkpoint is a peft model's state dict under its module names (not yet read as base + adapter)."""
    return ckpt.adapter is None and any(_BASE_LAYER in n for n in ckpt.model)


def json_config(config: Any) -> dict[str, Any]:
    """An adapter config as JSON holds it (peft keeps target_modules as a set in memory)."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    return {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in dict(config).items()}


def find_config(src: str, explicit: str | None) -> dict[str, Any] | None:
    """The adapter config: ``--adapter-config`` (the file or its directory), else the one our manifest records
    (a trainer's or converter's checkpoint), else peft's ``adapter_config.json`` in the directory named (HF
    Trainer's checkpoint-N keeps it beside global_stepN, a DeepSpeed user's ``model.save_pretrained(out)`` beside
    ``latest``)."""
    from interop.commit import resolve_checkpoint_dir
    from interop.manifest import MANIFEST, read_manifest

    from ..hf import file_near

    if explicit:
        path = os.path.join(explicit, ADAPTER_CONFIG) if os.path.isdir(explicit) else explicit
        if not os.path.isfile(path):
            raise ConfigurationError(f"--adapter-config {explicit}: no {ADAPTER_CONFIG} there")
    else:
        start = src if os.path.isdir(src) else os.path.dirname(src)
        directory = resolve_checkpoint_dir(start)
        if os.path.isfile(os.path.join(directory, MANIFEST)):
            recorded = ((read_manifest(directory).model or {}).get("adapter") or {}).get("config")
            if isinstance(recorded, dict):
                return checked_adapter_config(recorded, os.path.join(directory, MANIFEST))
        path = file_near(start, start, ADAPTER_CONFIG)
    if path is None:
        return None
    return checked_adapter_config(read_json(path, ADAPTER_CONFIG), path)


def _base_config(ckpt: LogicalCheckpoint, config: dict[str, Any]) -> dict[str, Any]:
    """The base model's config.json: the checkpoint's, or ``--config``. The adapter config's
    base_model_name_or_path is a path outside the checkpoint (or a hub id): named in the message, never followed."""
    if ckpt.config is not None:
        return ckpt.config
    base = config.get("base_model_name_or_path")
    raise ConfigurationError(f"the base model's config is unknown (the adapter config names {base!r}; paths a checkpoint "
                             f"names outside itself are not followed): pass it with --config {base or 'CONFIG.json'} "
                             "(the base model's directory or its config.json)")


def _peft_version() -> str:
    import peft

    return peft.__version__


def peft_config(config: dict[str, Any]) -> Any:
    """peft's config object for an adapter_config.json's content (keys this peft does not know are dropped, logged)."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    cls = PEFT_TYPE_TO_CONFIG_MAPPING.get(config.get("peft_type"))
    if cls is None:
        raise ConversionError(f"adapter type {config.get('peft_type')!r} is not one this peft knows")
    known = {f.name for f in dataclasses.fields(cls)}
    dropped = sorted(set(config) - known)
    if dropped:
        log.info("adapter config keys this peft does not know, dropped: %s", dropped)
    # the training model's: peft's save_pretrained records inference_mode=True, which would freeze the adapter too
    return cls(**{k: v for k, v in config.items() if k in known and k != "inference_mode"}, inference_mode=False)


def _peft_model(base_config: dict[str, Any], config: dict[str, Any], device: str, adapter: str = "default") -> tuple[torch.nn.Module, dict[int, str]]:
    """``get_peft_model`` of the base model built from its config (on the meta device for names, on the CPU to
    merge), and each of the base model's modules' name, by identity: peft's layers keep the module they adapt as
    their ``base_layer`` (``modules_to_save`` as ``original_module``), so the module says which base name a peft
    model's tensor is, tied heads included."""
    from peft import get_peft_model

    with torch.device(device):
        base = facts.fresh_model(base_config)
    by_id = {id(module): name for name, module in base.named_modules(remove_duplicate=False)}
    try:
        return get_peft_model(base, peft_config(config), adapter_name=adapter, autocast_adapter_dtype=False), by_id
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # peft's own refusals (targets the model lacks, ...)
        raise ConfigurationError(f"peft cannot apply this adapter config to the {base_config.get('model_type')} base model: "
                                 f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


@dataclasses.dataclass(frozen=True)
class PeftNames:
    """The peft model's module names -> the logical checkpoint's (base module names, adapter-file keys)."""

    model: torch.nn.Module  # on the meta device: parameter order and trainability
    canonical: dict[str, str]
    adapter_keys: frozenset[str]
    frozen: tuple[str, ...]  # module names of the parameters peft leaves frozen
    saved_base: dict[str, str]  # base tensors peft saves with the adapter (adapter-file key -> base module name)


def _key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, default=str)


def peft_names(base_config: dict[str, Any], config: dict[str, Any], adapter: str) -> PeftNames:
    return _peft_names(_key(base_config), _key(config), adapter)


@lru_cache(maxsize=8)
def _peft_names(base_key: str, config_key: str, adapter: str) -> PeftNames:
    from peft.utils import get_peft_model_state_dict

    model, base_modules = _peft_model(json.loads(base_key), json.loads(config_key), "meta", adapter)
    state = model.state_dict(keep_vars=True)
    probe = {n: torch.empty(0, device="meta") for n in state}
    picked = get_peft_model_state_dict(model, state_dict=probe, adapter_name=adapter)
    saved_as = {id(t): key for key, t in picked.items()}
    canonical: dict[str, str] = {}
    adapter_keys, saved_base = set(), {}
    for name in state:
        owner, _, attr = name.rpartition(".")
        base = base_modules.get(id(model.get_submodule(owner)))
        if base is not None:  # the base model's (peft may save it with the adapter too: embeddings, bias="all")
            canonical[name] = f"{base}.{attr}" if base else attr
            if id(probe[name]) in saved_as:
                saved_base[saved_as[id(probe[name])]] = canonical[name]
        elif id(probe[name]) in saved_as:
            canonical[name] = saved_as[id(probe[name])]
            adapter_keys.add(canonical[name])
        else:
            raise ConversionError(f"peft's model holds {name}, which is neither a base-model tensor nor one peft saves")
    frozen = tuple(canonical[n] for n, p in model.named_parameters() if not p.requires_grad)
    return PeftNames(model, canonical, frozenset(adapter_keys), frozen, saved_base)


def peft_model_near(directory: str, config: dict[str, Any] | None, names: list[str]) -> torch.nn.Module | None:
    """peft's model (meta device) of the adapter config beside ``directory`` (or recorded in its manifest) on the
    base model ``config`` describes, for a state dict with ``names``: which of a peft model's parameters an
    optimizer saved by position holds."""
    adapter = find_config(directory, None)
    found = _adapter_names(names)
    if adapter is None or config is None or len(found) != 1:
        return None
    return peft_names(config, adapter, found.pop()).model


def read_as_adapter(ckpt: LogicalCheckpoint, src: str, explicit_config: str | None) -> LogicalCheckpoint:
    """A checkpoint of a peft model (module names) as base model + adapter, checked against peft's own model of
    it; the checkpoint itself when it holds no adapters."""
    if not has_peft_names(ckpt):
        return ckpt
    config = find_config(src, explicit_config)
    if config is None:
        raise ConfigurationError(
            f"{src}: the checkpoint holds peft adapters (e.g. {next(n for n in ckpt.model if _BASE_LAYER in n)}) but no "
            f"{ADAPTER_CONFIG} lies beside it: pass peft's adapter config with --adapter-config (interop convert, inspect; "
            "rank, alpha and target modules are not guessed)")
    base_config = _base_config(ckpt, config)
    adapter = _adapter_names(ckpt.model)
    if len(adapter) != 1:
        raise ConversionError(f"{src}: {len(adapter)} adapters ({sorted(adapter)}); one adapter at a time is read")
    name = adapter.pop()
    peft = peft_names(base_config, config, name)
    expected = dict(peft.model.state_dict(keep_vars=True))
    missing = [n for n in expected if n not in ckpt.model and not tied_to_held(n, expected, ckpt.model)]
    extra = sorted(set(ckpt.model) - set(expected))
    if missing or extra:
        first = f"lacks {missing[0]!r} ({len(missing)} in all)" if missing else f"holds {extra[0]!r}, which it has no place for"
        raise ConversionError(f"{src}: the checkpoint is not this adapter config's peft model of its base model: peft's "
                              f"model {first}")
    for key, param in expected.items():
        if key in ckpt.model and tuple(ckpt.model[key].spec.shape) != tuple(param.shape):
            raise ConversionError(f"{src}: {key} is {list(ckpt.model[key].spec.shape)}; peft's model with this adapter "
                                  f"config has {list(param.shape)} (another rank or base model)")
    renamed = ckpt.renamed({n: peft.canonical.get(n, n) for n in ckpt.names()})
    trained = {n for g in (renamed.optimizer.param_groups if renamed.optimizer else []) for n in g.get("params", [])}
    unfrozen = sorted(trained & set(peft.frozen))
    if unfrozen:  # peft's model freezes it, the run trained it: writing it frozen would drop its optimizer state
        raise ConversionError(f"{src}: the run trained {unfrozen[0]!r} ({len(unfrozen)} base tensors in all), which this "
                              "adapter config's peft model keeps frozen; base tensors trained beside the adapters are not supported")
    held = sorted(n for n in renamed.model if n in peft.adapter_keys)
    unknown = sorted(set(config) - set(json_config(peft_config(config))))
    notes = [f"adapter config keys this peft {_peft_version()} does not know, ignored: {', '.join(unknown)}"] if unknown else []
    out = dataclasses.replace(renamed, config=base_config, frozen=list(peft.frozen), tied=[], notes=[*renamed.notes, *notes],
                              adapter=AdapterState(json_config(config), name, held))
    out = facts.in_stored_names(out)
    out.tied = facts.tied_groups(base_config)
    return out


def tied_to_held(name: str, expected: dict[str, torch.Tensor], held) -> bool:
    """A tied parameter of a model (its one tensor under two names: a tied head, ``expected`` its state dict with
    keep_vars) whose other name is ``held``."""
    return any(other is expected[name] and other_name in held for other_name, other in expected.items())


def in_peft_names(ckpt: LogicalCheckpoint) -> LogicalCheckpoint:
    """``ckpt`` (the base model under its module names, the adapter under its file keys) under the peft model's
    module names, as an engine saves a peft model; itself without adapters."""
    if ckpt.adapter is None:
        return ckpt
    peft = engine_names(ckpt)
    back = {c: n for n, c in peft.canonical.items()}
    unknown = sorted(n for n in ckpt.names() if n not in back)
    if unknown:
        raise ConversionError(f"{unknown[0]!r} has no place in the peft model of this adapter config "
                              f"({summary(ckpt.adapter)})")
    return ckpt.renamed(back)


def engine_names(ckpt: LogicalCheckpoint) -> PeftNames:
    if ckpt.config is None:
        raise ConfigurationError("a checkpoint with peft adapters needs its base model's config: pass --config")
    return peft_names(ckpt.config, ckpt.adapter.config, ckpt.adapter.name)


def engine_model(ckpt: LogicalCheckpoint) -> torch.nn.Module | None:
    """The model an engine trains for ``ckpt`` (names and order of its parameters): peft's model of its adapter,
    or the base model; on the meta device, shared, read only."""
    if ckpt.adapter is not None:
        return engine_names(ckpt).model
    return facts.meta_model(ckpt.config)


def with_adapter_dir(ckpt: LogicalCheckpoint, directory: str, src: str) -> LogicalCheckpoint:
    """A base model and peft's adapter directory for it (``--adapter DIR``), as one checkpoint to train on: what
    ``PeftModel.from_pretrained(base, DIR)`` builds, checked against peft's model of that adapter config."""
    from interop.safetensors_io import read_hf_safetensors

    if ckpt.adapter is not None or has_peft_names(ckpt):
        raise ConfigurationError(f"--adapter {directory}: {src} already holds peft adapters")
    if not os.path.isfile(os.path.join(directory, ADAPTER_CONFIG)):
        raise ConfigurationError(f"--adapter {directory}: no {ADAPTER_CONFIG} there (a peft adapter directory holds "
                                 f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    config = find_config(directory, directory)
    held = read_hf_safetensors(directory, "adapter_model")
    if held is None:
        raise ConfigurationError(f"--adapter {directory}: no {ADAPTER_WEIGHTS} there (a peft adapter directory holds "
                                 f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    base_config = _base_config(ckpt, config)
    name = "default"  # peft's name for an adapter loaded without one
    peft = peft_names(base_config, config, name)
    expected = {peft.canonical[n]: tuple(t.shape) for n, t in peft.model.state_dict(keep_vars=True).items()
                if peft.canonical[n] in peft.adapter_keys}
    where = os.path.join(directory, ADAPTER_WEIGHTS)
    modules = None
    for key in sorted(set(held) & set(peft.saved_base)):  # peft saves some base tensors with the adapter (embeddings)
        modules = modules or facts.in_module_names(ckpt)
        base = modules.model.get(peft.saved_base[key])
        if base is None or not torch.equal(held[key].load(), base.load()):
            raise ConversionError(f"{where}: {key} is not the base model's {peft.saved_base[key]} (a resized or trained base "
                                  "tensor saved with the adapter is not supported)")
        del held[key]  # the base model holds it
    for key, t in held.items():
        if key not in expected:
            raise ConversionError(f"{where}: {key!r} is no tensor of peft's model of this adapter config on the "
                                  f"{base_config.get('model_type')} base model")
        if tuple(t.spec.shape) != expected[key]:
            raise ConversionError(f"{where}: {key} is {list(t.spec.shape)}; peft's model with this adapter config has "
                                  f"{list(expected[key])}")
    missing = sorted(set(expected) - set(held))
    if missing:
        raise ConversionError(f"{where}: lacks {missing[0]!r} ({len(missing)} in all)")
    clash = sorted(set(held) & set(ckpt.model))
    if clash:
        raise ConversionError(f"{src}: holds {clash[0]!r}, a name of the adapter's")
    return dataclasses.replace(ckpt, model={**ckpt.model, **held}, optimizer=None, frozen=list(ckpt.model),
                               adapter=AdapterState(json_config(config), name, sorted(held)),
                               notes=[*ckpt.notes, f"adapters from {directory} ({len(held)} tensors) on the base model from {src}"])


def adapter_state(ckpt: LogicalCheckpoint) -> dict[str, torch.Tensor]:
    """What peft's save_pretrained writes, under its names (peft's own get_peft_model_state_dict, asked with
    placeholders so only the tensors it picks are read): the adapter, and the base tensors peft saves with it
    (embedding layers of an adapted embedding, biases it trains)."""
    from peft.utils import get_peft_model_state_dict

    modules = in_peft_names(facts.in_module_names(dataclasses.replace(ckpt, optimizer=None)))
    probe = {n: torch.empty(0, device="meta") for n in modules.model}
    picked = get_peft_model_state_dict(engine_names(ckpt).model, state_dict=probe, adapter_name=ckpt.adapter.name)
    source = {id(t): n for n, t in probe.items()}
    out = {}
    for key, t in picked.items():
        if id(t) not in source:
            raise ConversionError(f"peft's adapter state holds {key!r}, which is none of the checkpoint's tensors; not exported")
        out[key] = modules.model[source[id(t)]].load()
    return out


def merged(ckpt: LogicalCheckpoint) -> LogicalCheckpoint:
    """The base model with the adapters merged in, by peft's own merge_and_unload, as a checkpoint of the base
    model (universal's names; frozen base and adapters become one set of weights, no optimizer state)."""
    adapter = ckpt.adapter
    model, _ = _peft_model(ckpt.config, adapter.config, "cpu", adapter.name)
    modules = in_peft_names(facts.in_module_names(dataclasses.replace(ckpt, optimizer=None)))
    result = model.load_state_dict({n: t.load() for n, t in modules.model.items()}, strict=False)
    expected = dict(model.state_dict(keep_vars=True))
    missing = [k for k in result.missing_keys if not tied_to_held(k, expected, modules.model)]
    if missing or result.unexpected_keys:
        raise ConversionError(f"peft's model does not take the checkpoint: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")
    base = model.merge_and_unload()
    note = (f"adapters merged by peft's merge_and_unload ({summary(adapter)}); the optimizer state of the adapters "
            "is not part of a merged model")
    out = LogicalCheckpoint(model={n: LazyTensor.of(t.detach()) for n, t in base.state_dict().items()}, config=ckpt.config,
                            source=dict(ckpt.source), step=ckpt.step, notes=[*ckpt.notes, note])
    out = facts.in_stored_names(out)
    out.tied = facts.tied_groups(ckpt.config)
    return out


def write_adapter_files(ckpt: LogicalCheckpoint, directory: str) -> int:
    """peft's adapter files in ``directory``, as its save_pretrained writes them (adapter_model.safetensors under
    peft's keys, adapter_config.json for inference): what ``PeftModel.from_pretrained(base, directory)`` loads.
    The number of tensors written."""
    from safetensors.torch import save_file

    state = adapter_state(ckpt)
    if not state:
        raise ConversionError("the checkpoint's adapter holds no tensors; nothing to write")
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(directory, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump({**ckpt.adapter.config, "inference_mode": True}, f, indent=2, sort_keys=True)
    return len(state)


def write_peft(ckpt: LogicalCheckpoint, dst: str, overwrite: bool) -> None:
    """peft's adapter directory, written whole or not at all."""
    from interop.commit import staged_output

    with staged_output(dst, overwrite) as out:
        count = write_adapter_files(ckpt, out)
    log.info("wrote peft adapter directory %s (%d tensors)", dst, count)
