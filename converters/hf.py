"""Hugging Face model directories: read as logical tensors, write one ``from_pretrained`` loads exactly.

Reads safetensors (single or sharded with an index) and, through the safe loader, ``pytorch_model.bin``
(single or sharded). Tied targets absent from the files (``lm_head.weight``) are recorded as tie groups, not
invented. GPT-2 files from before the ``transformer.`` prefix, and its causal-mask buffers, are normalised.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from interop.commit import staged_output
from interop.errors import CorruptCheckpointError, MissingFileError
from interop.logical import LogicalCheckpoint
from interop.tensors import LazyTensor
from interop.universal import DEFAULT_MAX_SHARD_SIZE, read_hf_safetensors, write_model_dir

from .families import family_of, tied_groups
from .pickle_safety import load_torch_file

log = logging.getLogger(__name__)

CONFIG = "config.json"
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG)) and any(os.path.isfile(os.path.join(path, f)) for f in _WEIGHT_FILES)


def read_config(path: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, CONFIG)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise MissingFileError(cfg_path, "a Hugging Face model directory needs config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(cfg_path, f"not valid JSON: {exc}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CorruptCheckpointError(cfg_path, "config.json has no model_type")
    return config


def _read_bin(path: str, trust_pickle: bool) -> dict[str, LazyTensor]:
    index_path = os.path.join(path, "pytorch_model.bin.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["pytorch_model.bin"]
    tensors: dict[str, LazyTensor] = {}
    for fname in files:
        fpath = os.path.join(path, fname)
        state = load_torch_file(fpath, trust_pickle)
        if not isinstance(state, dict):
            raise CorruptCheckpointError(fpath, f"expected a state dict, found {type(state).__name__}")
        for name, t in state.items():
            tensors[name] = LazyTensor.of(t, f"{fpath}:{name}")
    return tensors


def _normalise(config: dict[str, Any], tensors: dict[str, LazyTensor]) -> dict[str, LazyTensor]:
    family = family_of(config)
    if family is None or family.name != "gpt2":
        return tensors
    out = {}
    for name, t in tensors.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers, rebuilt by the model
        if name != "lm_head.weight" and not name.startswith(family.prefix):
            name = family.prefix + name
        out[name] = t
    return out


def read_hf(path: str, trust_pickle: bool = False) -> LogicalCheckpoint:
    config = read_config(path)
    tensors = read_hf_safetensors(path)
    if tensors is None:
        tensors = _read_bin(path, trust_pickle)
        if not tensors:
            raise MissingFileError(path, "no model.safetensors or pytorch_model.bin")
    tensors = _normalise(config, tensors)
    return LogicalCheckpoint(
        model=tensors,
        config=config,
        source={"format": "hf", "dtype": config.get("torch_dtype") or config.get("dtype")},
        tied=tied_groups(config),
    )


def write_hf(
    ckpt: LogicalCheckpoint,
    dst: str,
    overwrite: bool = False,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    progress=None,
) -> None:
    """The model part of ``ckpt`` as a Hugging Face directory; optimizer and other state are not exported."""
    if ckpt.config is None:
        raise CorruptCheckpointError(None, "the source records no model config, so no Hugging Face directory can be written")
    with staged_output(dst, overwrite) as out:
        write_model_dir(out, "", ckpt, max_shard_size, progress, digests=False)  # no manifest describes it
    log.info("wrote Hugging Face model directory %s", dst)
