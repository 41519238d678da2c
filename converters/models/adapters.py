"""LoRA / PEFT adapters in a checkpoint: a model wrapped by peft (``base_model.model.<name>``, the adapted linears'
``base_layer`` and ``lora_A.<adapter>`` / ``lora_B.<adapter>``), as every engine saves a peft model's state dict.

Which tensors are adapters, what the adapter files call them and what merging does are peft's answers, asked of
peft itself: the checkpoint's model is rebuilt as ``get_peft_model(<the base model from its config>, <its
adapter config>)`` (on the meta device to check names, on the CPU to merge), and peft's own
``get_peft_model_state_dict`` and ``merge_and_unload`` do the rest. The adapter config (rank, alpha, target
modules) is never guessed: a wrong alpha scales every update (verl's lora_alpha=0 adapters), so it comes from the
``adapter_config.json`` peft saved beside the checkpoint, or from ``--adapter-config``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from interop.errors import ConfigurationError, ConversionError, CorruptCheckpointError
from interop.jsonio import read_json
from interop.logical import LogicalCheckpoint
from interop.tensors import LazyTensor

from . import facts

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"  # peft's save_pretrained
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# peft's tuner layers hold the base weight as base_layer and the adapter's as lora_* (LoRA, DoRA's magnitude)
_MARKS = re.compile(r"\.(base_layer|lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(\.|$)")
_ADAPTER = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.([^.]+)(\.|$)")


@dataclass
class Adapters:
    """What a checkpoint's peft model is made of."""

    config: dict[str, Any]  # peft's adapter config (adapter_config.json's content)
    base_config: dict[str, Any]  # the base model's config.json
    adapter: str  # the adapter's name in the module names ("default")
    tensors: list[str]  # the checkpoint's adapter tensors (module names)

    def summary(self) -> str:
        c = self.config
        targets = c.get("target_modules")
        targets = sorted(targets) if isinstance(targets, (list, set, tuple)) else targets
        return (f"{c.get('peft_type', 'LORA')} '{self.adapter}': r={c.get('r')}, alpha={c.get('lora_alpha')}, "
                f"targets={targets}, dropout={c.get('lora_dropout')}, {len(self.tensors)} adapter tensors")


def has_adapters(ckpt: LogicalCheckpoint) -> bool:
    return any(_MARKS.search(n) for n in ckpt.model)


def find_config(src: str, explicit: str | None) -> dict[str, Any] | None:
    """The adapter config: ``--adapter-config`` (the file or its directory), else peft's ``adapter_config.json``
    in the directory named (HF Trainer's checkpoint-N keeps it beside global_stepN, a DeepSpeed user's
    ``model.save_pretrained(out)`` beside ``latest``)."""
    from ..hf import file_near

    if explicit:
        path = os.path.join(explicit, ADAPTER_CONFIG) if os.path.isdir(explicit) else explicit
        if not os.path.isfile(path):
            raise ConfigurationError(f"--adapter-config {explicit}: no {ADAPTER_CONFIG} there")
    else:
        start = src if os.path.isdir(src) else os.path.dirname(src)
        path = file_near(start, start, ADAPTER_CONFIG)
    if path is None:
        return None
    config = read_json(path, ADAPTER_CONFIG)
    if not isinstance(config, dict) or "peft_type" not in config:
        raise CorruptCheckpointError(path, "is not peft's adapter config (no peft_type)")
    return config


def _base_config(ckpt: LogicalCheckpoint, config: dict[str, Any]) -> dict[str, Any]:
    """The base model's config.json: the checkpoint's, else the one in the adapter config's base_model_name_or_path
    when that is a local model directory (no hub is asked)."""
    from ..hf import CONFIG, read_config

    if ckpt.config is not None:
        return ckpt.config
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and os.path.isfile(os.path.join(base, CONFIG)):
        return read_config(base)
    raise ConfigurationError(f"the base model's config is unknown (the adapter config names {base!r}, not a local model "
                             "directory): pass it with --config CONFIG.json (or the base model's directory)")


def peft_config(config: dict[str, Any]) -> Any:
    """peft's config object for an adapter_config.json's content (keys this peft does not know are dropped, logged)."""
    import dataclasses

    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    cls = PEFT_TYPE_TO_CONFIG_MAPPING.get(config.get("peft_type"))
    if cls is None:
        raise ConversionError(f"adapter type {config.get('peft_type')!r} is not one this peft knows")
    known = {f.name for f in dataclasses.fields(cls)}
    dropped = sorted(set(config) - known)
    if dropped:
        log.info("adapter config keys this peft does not know, dropped: %s", dropped)
    return cls(**{k: v for k, v in config.items() if k in known})


def _peft_model(base_config: dict[str, Any], config: dict[str, Any], device: str, adapter: str = "default") -> torch.nn.Module:
    """``get_peft_model`` of the base model built from its config: on the meta device for names, on the CPU to merge."""
    from peft import get_peft_model

    with torch.device(device):
        base = facts.fresh_model(base_config)
    try:
        return get_peft_model(base, peft_config(config), adapter_name=adapter, autocast_adapter_dtype=False)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # peft's own refusals (targets the model lacks, ...)
        raise ConfigurationError(f"peft cannot apply this adapter config to the {base_config.get('model_type')} base model: "
                                 f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def recognise(ckpt: LogicalCheckpoint, src: str, explicit_config: str | None) -> Adapters | None:
    """The checkpoint's adapters, checked against peft's own model of them; None for a checkpoint without any."""
    if not has_adapters(ckpt):
        return None
    config = find_config(src, explicit_config)
    if config is None:
        raise ConfigurationError(
            f"{src}: the checkpoint holds peft adapters (e.g. {next(n for n in ckpt.model if _MARKS.search(n))}) but no "
            f"{ADAPTER_CONFIG} lies beside it: pass peft's adapter config with --adapter-config (rank, alpha and target "
            "modules are not guessed)")
    base_config = _base_config(ckpt, config)
    names = [n for n in ckpt.model if _ADAPTER.search(n)]
    adapter = {_ADAPTER.search(n).group(2) for n in names}
    if len(adapter) != 1:
        raise ConversionError(f"{src}: {len(adapter)} adapters ({sorted(adapter)}); one adapter at a time is exported")
    adapter_name = adapter.pop()
    model = _peft_model(base_config, config, "meta", adapter_name)
    expected = dict(model.state_dict(keep_vars=True))
    missing = [n for n in expected if n not in ckpt.model and not _tied_to_held(n, expected, ckpt)]
    extra = sorted(set(ckpt.model) - set(expected))
    if missing or extra:
        first = f"lacks {missing[0]!r} ({len(missing)} in all)" if missing else f"holds {extra[0]!r}, which it has no place for"
        raise ConversionError(f"{src}: the checkpoint is not this adapter config's peft model of its base model: peft's "
                              f"model {first}")
    for name, param in expected.items():
        if name in ckpt.model and tuple(ckpt.model[name].spec.shape) != tuple(param.shape):
            raise ConversionError(f"{src}: {name} is {list(ckpt.model[name].spec.shape)}; peft's model with this adapter "
                                  f"config has {list(param.shape)} (another rank or base model)")
    return Adapters(config, base_config, adapter_name, names)


def _tied_to_held(name: str, expected: dict[str, torch.Tensor], ckpt: LogicalCheckpoint) -> bool:
    """A tied parameter (the model's one tensor under two names: a tied head) whose other name the checkpoint holds."""
    return any(other is expected[name] and other_name in ckpt.model for other_name, other in expected.items())


def adapter_state(ckpt: LogicalCheckpoint, adapters: Adapters) -> dict[str, torch.Tensor]:
    """What peft's save_pretrained writes, under its names (peft's get_peft_model_state_dict): the adapters, and
    what else peft saves with them (modules_to_save, embedding layers). Asked with placeholders first, so only the
    tensors peft picks are read."""
    from peft.utils import get_peft_model_state_dict

    model = _peft_model(adapters.base_config, adapters.config, "meta", adapters.adapter)
    probe = {n: torch.empty(0, device="meta") for n in ckpt.model}
    picked = get_peft_model_state_dict(model, state_dict=probe, adapter_name=adapters.adapter)
    source = {id(t): n for n, t in probe.items()}
    out = {}
    for key, t in picked.items():
        if id(t) not in source:
            raise ConversionError(f"peft's adapter state holds {key!r}, which is none of the checkpoint's tensors; not exported")
        out[key] = ckpt.model[source[id(t)]].load()
    return out


def merged(ckpt: LogicalCheckpoint, adapters: Adapters) -> LogicalCheckpoint:
    """The base model with the adapters merged in, by peft's own merge_and_unload, as a checkpoint of the base
    model (module names; frozen base and adapters become one set of weights, no optimizer state)."""
    model = _peft_model(adapters.base_config, adapters.config, "cpu", adapters.adapter)
    state = {n: t.load() for n, t in ckpt.model.items()}
    result = model.load_state_dict(state, strict=False)
    expected = dict(model.state_dict(keep_vars=True))
    missing = [k for k in result.missing_keys if not _tied_to_held(k, expected, ckpt)]
    if missing or result.unexpected_keys:
        raise ConversionError(f"peft's model does not take the checkpoint: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")
    base = model.merge_and_unload()
    out = {n: LazyTensor.of(t.detach()) for n, t in base.state_dict().items()}
    note = (f"adapters merged by peft's merge_and_unload ({adapters.summary()}); the optimizer state of the adapters "
            "is not part of a merged model")
    return LogicalCheckpoint(model=out, config=adapters.base_config, source=dict(ckpt.source), step=ckpt.step,
                             notes=[*ckpt.notes, note])


def write_peft(ckpt: LogicalCheckpoint, adapters: Adapters, dst: str, overwrite: bool) -> None:
    """peft's adapter directory: adapter_config.json and adapter_model.safetensors, what
    ``PeftModel.from_pretrained(base, dst)`` loads."""
    from interop.commit import staged_output
    from safetensors.torch import save_file

    state = adapter_state(ckpt, adapters)
    if not state:
        raise ConversionError("peft names none of the checkpoint's adapter tensors; nothing to write")
    with staged_output(dst, overwrite) as out:
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(out, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
            json.dump({**adapters.config, "inference_mode": True}, f, indent=2, sort_keys=True)
    log.info("wrote peft adapter directory %s (%d tensors)", dst, len(state))


