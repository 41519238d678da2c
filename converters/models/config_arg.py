"""``--config``: the model's config.json for a source that carries none (a bare ``save_state``, a bare ZeRO
directory), checked against the checkpoint's tensors before anything is written.

The check builds the model the config describes on the meta device (transformers knows its parameter names
and shapes; no memory is used) and compares every tensor the checkpoint holds: a config of another model is
refused naming the first tensor that differs, with both shapes.
"""

from __future__ import annotations

import os
from typing import Any

from interop.errors import CheckpointError, ConfigurationError
from interop.logical import LogicalCheckpoint
from interop.tensors import LazyTensor, TensorSpec

from .facts import in_stored_names, meta_model, tied_groups
from ..hf import CONFIG, read_config, read_config_file


class ConfigMismatchError(CheckpointError):
    """The config given with ``--config`` describes another model than the checkpoint holds."""


def load_config_arg(path: str) -> dict[str, Any]:
    """A ``--config`` argument: a config.json file, or a Hugging Face model directory holding one."""
    if os.path.isdir(path):
        return read_config(path)
    if os.path.basename(path) != CONFIG and not path.endswith(".json"):
        raise ConfigurationError(f"--config {path}: expected a config.json file or a model directory holding one")
    if not os.path.isfile(path):
        raise ConfigurationError(f"--config {path}: no such file")
    return read_config_file(path)


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor (parameters and persistent buffers) of the model ``config`` describes, by the name
    save_pretrained stores it under (universal's naming)."""
    model = meta_model(config)
    if model is None:
        return {}
    module = LogicalCheckpoint(model={n: LazyTensor(TensorSpec(tuple(t.shape), t.dtype), lambda: None, "meta")
                                      for n, t in model.state_dict().items()}, config=config)
    return {name: tuple(t.spec.shape) for name, t in in_stored_names(module).model.items()}


def apply_config(ckpt: LogicalCheckpoint, config: dict[str, Any], where: str) -> None:
    """Give ``ckpt`` the config ``--config`` named, after checking it describes the checkpoint's model (a peft
    model's checkpoint is checked against peft's model of it when it is read as base + adapter: adapters.read_as_adapter)."""
    from .adapters import has_peft_names

    if has_peft_names(ckpt):
        ckpt.config = dict(config)
        return
    try:
        expected = expected_shapes(config)
    except Exception as exc:  # noqa: BLE001 - transformers refuses configs it cannot build; say which
        raise ConfigMismatchError(where, f"--config describes no model transformers can build: {exc}") from None
    model_type = config.get("model_type")
    extra = []
    for name, tensor in ckpt.model.items():
        shape = tuple(tensor.spec.shape)
        if name not in expected:
            extra.append(name)  # a custom buffer or parameter the model class adds: kept as it is
        elif expected[name] != shape:
            raise ConfigMismatchError(
                where, f"tensor {name!r} is {list(shape)} in the checkpoint but {list(expected[name])} in the --config "
                f"model ({model_type}): the config is of another model"
            )
    aliases = {t for t, *_ in (ckpt.tied or tied_groups(config))}
    missing = [n for n in expected if n not in ckpt.model and n not in aliases]
    if missing:
        raise ConfigMismatchError(
            where, f"lacks tensor {missing[0]!r} {list(expected[missing[0]])} of the --config model ({model_type}) "
            f"and {len(missing) - 1} more: the config is of another model"
        )
    if extra:
        ckpt.notes.append(f"tensors the --config model ({model_type}) does not declare are kept as they are: {extra[:5]}")
    ckpt.config = dict(config)
    if not ckpt.tied:
        ckpt.tied = tied_groups(config)
