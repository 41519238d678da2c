"""Hugging Face model directories: read as logical tensors, write one ``from_pretrained`` loads exactly.

Reads safetensors (single or sharded with an index) and, through the safe loader, ``pytorch_model.bin``
(single or sharded). Tied targets absent from the files (``lm_head.weight``) are recorded as tie groups, not
invented. GPT-2 files from before the ``transformer.`` prefix, and its causal-mask buffers, are normalised.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from interop.errors import CorruptCheckpointError, MissingFileError
from interop.jsonio import read_json
from interop.paths import inside
from interop.logical import LogicalCheckpoint
from interop.tensors import LazyTensor
from interop.safetensors_io import read_hf_safetensors
from interop.spread import spread_output
from interop.universal import DEFAULT_MAX_SHARD_SIZE, write_model_dir

from .models.facts import MAX_LAYER_EXPERTS, MAX_LAYERS, stored_names, tied_groups, unknown_model
from .models.quantized import dequantized
from .detection import HF_CONFIG, HF_WEIGHT_FILES, is_hf_dir  # noqa: F401
from .pickle_safety import load_torch_file

log = logging.getLogger(__name__)

CONFIG, _WEIGHT_FILES = HF_CONFIG, HF_WEIGHT_FILES


def read_config(path: str) -> dict[str, Any]:
    cfg_path = inside(path, CONFIG)
    if not os.path.isfile(cfg_path):
        raise MissingFileError(cfg_path, "a Hugging Face model directory needs config.json")
    return read_config_file(cfg_path)


def read_config_file(cfg_path: str) -> dict[str, Any]:
    """A model's config.json (strict JSON, a ``model_type``), wherever it lies."""
    config = read_json(cfg_path, "config.json")
    if not isinstance(config, dict) or "model_type" not in config:
        raise CorruptCheckpointError(cfg_path, "config.json has no model_type")
    for key, count, bound in _counts(config):  # before transformers builds (and we plan) that many layers or experts
        if count > bound:
            raise CorruptCheckpointError(cfg_path, f"{key} {count}: more than any model this reads ({bound} at most); "
                                         "a damaged or hostile checkpoint")
    return config


def _counts(config: dict[str, Any], prefix: str = "") -> list[tuple[str, int, int]]:
    """Every whole number a config counts layers or experts with (``num_hidden_layers``, GPT-2's ``n_layer``,
    ``num_local_experts``, ``n_routed_experts``, a nested ``text_config``'s), by the key's name, and its bound:
    checked before any class reads it."""
    out = []
    for key, value in config.items():
        if isinstance(value, dict):
            out += _counts(value, f"{prefix}{key}.")
        elif isinstance(value, int) and not isinstance(value, bool):
            if re.search(r"layers?$", str(key)):
                out.append((f"{prefix}{key}", value, MAX_LAYERS))
            elif re.search(r"experts$", str(key)):
                out.append((f"{prefix}{key}", value, MAX_LAYER_EXPERTS))
    return out


def config_near(start: str, root: str) -> dict[str, Any] | None:
    """The model's ``config.json`` kept beside an engine checkpoint (HF Trainer and accelerate users keep it
    in the directory above the engine's)."""
    found = file_near(start, root, CONFIG)
    return read_config(os.path.dirname(found)) if found else None


def file_near(start: str, root: str, name: str) -> str | None:
    """The file ``name`` in ``start`` or a directory above it, up to ``root``, the directory the user named,
    never above it."""
    current, top = os.path.realpath(start), os.path.realpath(root)
    while True:
        if os.path.isfile(os.path.join(current, name)):
            return os.path.join(current, name)
        if current == top or not current.startswith(top.rstrip(os.sep) + os.sep):
            return None
        current = os.path.dirname(current)


def _read_bin(path: str, trust_pickle: bool) -> dict[str, LazyTensor]:
    index_path = inside(path, "pytorch_model.bin.index.json")
    if os.path.isfile(index_path):
        weight_map = read_json(index_path, "weight index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(f, str) for f in weight_map.values()):
            raise CorruptCheckpointError(index_path, "not a valid weight index: no weight_map of tensor names to files")
        files = sorted(set(weight_map.values()))
    else:
        files = ["pytorch_model.bin"]
    tensors: dict[str, LazyTensor] = {}
    for fname in files:
        fpath = inside(path, fname, index_path)
        state = load_torch_file(fpath, trust_pickle)
        if not isinstance(state, dict):
            raise CorruptCheckpointError(fpath, f"expected a state dict, found {type(state).__name__}")
        for name, t in state.items():
            tensors[name] = LazyTensor.of(t, f"{fpath}:{name}")
    return tensors


def _normalise(config: dict[str, Any], tensors: dict[str, LazyTensor]) -> dict[str, LazyTensor]:
    """The keys save_pretrained writes for a file's tensors (see models.facts.stored_names)."""
    names = stored_names(config, list(tensors))
    return {new: tensors[old] for old, new in names.items()}


def read_hf(path: str, trust_pickle: bool = False) -> LogicalCheckpoint:
    config = read_config(path)
    tensors = read_hf_safetensors(path)
    if tensors is None:
        tensors = _read_bin(path, trust_pickle)
        if not tensors:
            raise MissingFileError(path, "no model.safetensors or pytorch_model.bin")
    tensors, config, notes = dequantized(config, tensors, os.path.join(path, CONFIG))  # a pre-quantized release, as from_pretrained gives it
    tensors = _normalise(config, tensors)
    unknown = unknown_model(config)
    if unknown:
        notes.append(f"{unknown}: its tensors are kept as stored, no tied weights known; engine targets need a model "
                     "transformers can build")
    return LogicalCheckpoint(
        model=tensors,
        config=config,
        source={"format": "hf", "dtype": config.get("torch_dtype") or config.get("dtype")},
        tied=tied_groups(config),
        notes=notes,
    )


def write_hf(
    ckpt: LogicalCheckpoint,
    dst: str,
    overwrite: bool = False,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    progress=None,
    spread=None,
) -> None:
    """The model part of ``ckpt`` as a Hugging Face directory; optimizer and other state are not exported. With
    ``spread`` (``interop.spread.Spread``) every process of it calls this together and writes its share."""
    if ckpt.config is None:
        raise CorruptCheckpointError(None, "the source records no model config, so no Hugging Face directory can be written; "
                                     "pass the model's config with --config CONFIG.json (or the model's directory)")
    with spread_output(dst, overwrite, spread) as out:
        write_model_dir(out, "", ckpt, max_shard_size, progress, hashed=False, spread=spread)  # no manifest describes it
    log.info("wrote Hugging Face model directory %s", dst)
