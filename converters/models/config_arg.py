"""``--config``: the model's config.json for a source that carries none (a bare ``save_state``, a bare ZeRO
directory), checked against the checkpoint's tensors before anything is written.

The check is the one every read makes (:mod:`.against_model`: transformers' model of the config, every tensor's
shape and none missing), phrased for a config given on the command line: a config of another model is refused
naming the first tensor that differs, with both shapes.
"""

from __future__ import annotations

import os
from typing import Any

from interop.errors import CheckpointError, ConfigurationError
from interop.logical import LogicalCheckpoint

from .against_model import disagreements
from .facts import model_facts, stored_model, tied_groups
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


def apply_config(ckpt: LogicalCheckpoint, config: dict[str, Any], where: str) -> None:
    """Give ``ckpt`` the config ``--config`` named, after checking it describes the checkpoint's model (a peft
    model's checkpoint is checked against peft's model of it when it is read as base + adapter: adapters.read_as_adapter)."""
    from .adapters import has_peft_names

    if has_peft_names(ckpt):
        ckpt.config = dict(config)
        return
    try:
        model_facts(config)
        model = stored_model(config)
    except Exception as exc:  # noqa: BLE001 - transformers refuses configs it cannot build; say which
        raise ConfigMismatchError(where, f"--config describes no model transformers can build: {exc}") from None
    model_type = config.get("model_type")
    found = [d for d in disagreements(ckpt, config) if not d.dtype and not d.why]  # (a tensor's kind, experts that do not stack: the writers')
    more = f" (and {len(found) - 1} more tensor(s))" if len(found) > 1 else ""
    if found and found[0].shape is None:
        raise ConfigMismatchError(where, f"lacks tensor {found[0].name!r} {list(found[0].wanted)} of the --config model "
                                  f"({model_type}){more}: the config is of another model")
    if found:
        raise ConfigMismatchError(where, f"tensor {found[0].name!r} is {list(found[0].shape)} in the checkpoint but "
                                  f"{list(found[0].wanted)} in the --config model ({model_type}){more}: the config is of another model")
    extra = [n for n in ckpt.model if model is None or n not in model.shapes]  # a custom buffer or parameter the class adds
    if extra:
        ckpt.notes.append(f"tensors the --config model ({model_type}) does not declare are kept as they are: {extra[:5]}")
    ckpt.config = dict(config)
    if not ckpt.tied:
        ckpt.tied = tied_groups(config)
