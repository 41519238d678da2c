"""Where each format keeps its files, and whether a directory holds them: what detection asks of every format in
turn, apart from the readers.

Detection tries the formats one after another until one says yes, so whatever a detector imports, every
conversion from a format tried later imports too. Here it is ``os``, ``re`` and our manifest code (which every
command loads anyway), not a reader's module: trying DCP before DeepSpeed used to import the DCP reader, and
detecting a Hugging Face directory, tried last, imported every other format's (34 ms of a conversion's start-up).
Each format's module takes its file names and ``locate`` from here, so there is one definition of each.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

from interop.commit import LATEST_UNIVERSAL, MEGATRON_TRACKER, read_iteration_tracker, read_tag, resolve_checkpoint_dir
from interop.errors import MissingFileError, UnknownFormatError
from interop.jsonio import read_json
from interop.manifest import CHECKPOINT_FORMAT, MANIFEST, Manifest, read_manifest
from interop.paths import inside

# --- our own checkpoints ---------------------------------------------------------------------------------------
INTEROP_MODEL = "model"  # the model component of an interop trainer's checkpoint
INTEROP_STRATEGIES = ("single", "ddp")  # the trainers whose model component is plain safetensors


def committed_manifest(path: str) -> Manifest | None:
    """The manifest of the interop checkpoint at ``path`` (or its ``latest``), or None: for detection, which
    never raises (reading does)."""
    try:
        directory = resolve_checkpoint_dir(path)
        if not os.path.isfile(os.path.join(directory, MANIFEST)):
            return None
        return read_manifest(directory)
    except Exception:  # noqa: BLE001
        return None


def holds_component(path: str, key: str, native: bool | None = None) -> bool:
    """Whether ``path`` is one of our committed checkpoints (or its root) with component ``key`` (native or not,
    when asked): detected by its manifest, so a damaged engine directory is reported by the reader, not as
    'unknown'."""
    manifest = committed_manifest(path)
    record = manifest.components.get(key) if manifest is not None and manifest.format == CHECKPOINT_FORMAT else None
    return record is not None and (native is None or record.native == native)


def holds_native(path: str, key: str) -> bool:
    """Whether ``path`` is one of our checkpoints (or its root) around the engine's own ``key/`` directory."""
    return holds_component(path, key, native=True)


def _ours_or_located(path: str, key: str, locate: Callable[[str], Any]) -> bool:
    """Whether ``path`` is one of our checkpoints around the engine's ``key`` files, or ``locate`` finds them."""
    if holds_native(path, key):
        return True
    try:
        locate(path)
        return True
    except Exception:  # noqa: BLE001 - detection never raises; reading does
        return False


def is_interop_checkpoint(path: str) -> bool:
    m = committed_manifest(path)
    return (
        m is not None
        and m.format == CHECKPOINT_FORMAT
        and (m.sharding or {}).get("strategy", "single") in INTEROP_STRATEGIES
        and INTEROP_MODEL in m.components
        and not m.components[INTEROP_MODEL].native
    )


INTEROP_DCP_KEY = "dcp"  # our FSDP2 trainer's native component: a DCP directory


def is_interop_dcp(path: str) -> bool:
    return holds_native(path, INTEROP_DCP_KEY)


# --- DeepSpeed -------------------------------------------------------------------------------------------------
DEEPSPEED_KEY = "deepspeed"  # the native component of our DeepSpeed trainer's checkpoints
OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def locate_deepspeed(path: str) -> str:
    """The tag directory holding the ZeRO files, from any of: the tag directory (ours has them beside the
    manifest), a directory with ``latest``, an older checkpoint of ours (``<ckpt>/deepspeed``)."""
    if not os.path.exists(path):
        raise MissingFileError(path, "no such file or directory")
    if not os.path.isdir(path):
        raise UnknownFormatError(path, "is a file; point at a DeepSpeed checkpoint directory")
    if any(OPTIM_FILE.match(n) for n in os.listdir(path)):
        return path
    if os.path.isdir(os.path.join(path, DEEPSPEED_KEY)):
        return locate_deepspeed(os.path.join(path, DEEPSPEED_KEY))
    latest = os.path.join(path, "latest")
    tag = read_tag(latest, "DeepSpeed 'latest' file")
    if tag is not None:
        target = inside(path, tag, latest)
        if not os.path.isdir(target):
            raise MissingFileError(target, f"named by {latest} but missing (a stale 'latest'?)")
        return locate_deepspeed(target)
    if os.path.isdir(os.path.join(path, "pytorch_model")):  # accelerate's save_state without 'latest'
        return locate_deepspeed(os.path.join(path, "pytorch_model"))
    raise UnknownFormatError(path, "holds no DeepSpeed ZeRO files (*_optim_states.pt) and no 'latest' naming a tag")


def is_deepspeed_checkpoint(path: str) -> bool:
    return _ours_or_located(path, DEEPSPEED_KEY, locate_deepspeed)


DS_UNIVERSAL_ZERO_DIR = "zero"
DS_UNIVERSAL_OPTIMIZER_STATE = "optimizer_state.pt"


def locate_ds_universal(path: str) -> str:
    """The universal tag directory, from itself or from a root whose ``latest_universal`` names it."""
    if not os.path.isdir(path):
        raise MissingFileError(path, "no such directory")
    if os.path.isdir(os.path.join(path, DS_UNIVERSAL_ZERO_DIR)):
        return path
    latest = os.path.join(path, LATEST_UNIVERSAL)
    tag = read_tag(latest, f"'{LATEST_UNIVERSAL}' file")
    if tag is not None:
        target = inside(path, tag, latest)
        if not os.path.isdir(os.path.join(target, DS_UNIVERSAL_ZERO_DIR)):
            raise MissingFileError(os.path.join(target, DS_UNIVERSAL_ZERO_DIR), f"named by {latest} but missing (a stale '{LATEST_UNIVERSAL}'?)")
        return target
    raise UnknownFormatError(path, f"no DeepSpeed universal checkpoint here (no '{DS_UNIVERSAL_ZERO_DIR}/' and no '{LATEST_UNIVERSAL}')")


def is_ds_universal(path: str) -> bool:
    try:
        tag_dir = locate_ds_universal(path)
    except Exception:  # detection never raises; reading does
        return False
    return os.path.isfile(os.path.join(tag_dir, DS_UNIVERSAL_ZERO_DIR, DS_UNIVERSAL_OPTIMIZER_STATE))


# --- Accelerate ------------------------------------------------------------------------------------------------
ACCELERATE_KEY = "accelerate"  # our trainer's native component: accelerate's save_state directory
MODEL_DCP, SAFE_MODEL, BIN_MODEL = "pytorch_model_fsdp_0", "model.safetensors", "pytorch_model.bin"
RANDOM_STATES = re.compile(r"^random_states_(\d+)\.pkl$")


def _holds_accelerate_state(path: str) -> bool:
    return os.path.isdir(path) and (
        any(os.path.exists(os.path.join(path, f)) for f in (SAFE_MODEL, BIN_MODEL, MODEL_DCP))
        and any(RANDOM_STATES.match(f) for f in os.listdir(path))
    )


def locate_accelerate(path: str) -> str:
    """The save_state directory, from itself or from one of our trainer's checkpoints (``<ckpt>/accelerate``)."""
    if _holds_accelerate_state(path):
        return path
    try:
        directory = resolve_checkpoint_dir(path)
    except Exception:  # noqa: BLE001 - not a checkpoint root either
        directory = path
    for candidate in (directory, os.path.join(directory, ACCELERATE_KEY)):
        if _holds_accelerate_state(candidate):
            return candidate
    raise MissingFileError(path, "no accelerate save_state files (model.safetensors or pytorch_model_fsdp_0/, random_states_0.pkl)")


def is_accelerate_checkpoint(path: str) -> bool:
    return _ours_or_located(path, ACCELERATE_KEY, locate_accelerate)


# --- Megatron --------------------------------------------------------------------------------------------------
MEGATRON_FILE = "model_optim_rng.pt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
METADATA_JSON = "metadata.json"  # a torch_dist checkpoint's backend


def torch_dist_backend(directory: str) -> dict[str, Any] | None:
    path = os.path.join(directory, METADATA_JSON)
    if not os.path.isfile(path):
        return None
    return read_json(path, METADATA_JSON)


def locate_torch_dist(path: str) -> str:
    """The torch_dist directory: ``path`` itself, or the iteration ``latest_checkpointed_iteration.txt`` names."""
    tracker = os.path.join(path, MEGATRON_TRACKER)
    if os.path.isfile(tracker) and not os.path.isfile(os.path.join(path, METADATA_JSON)):
        path = os.path.join(path, read_iteration_tracker(path) or "")
        if not os.path.isdir(path):
            raise MissingFileError(path, f"missing: {tracker} names it as the latest checkpoint")
    return path


def is_megatron_dist(path: str) -> bool:
    try:
        backend = torch_dist_backend(locate_torch_dist(path))
    except Exception:  # detection never raises; reading does
        return False
    return bool(backend) and backend.get("sharded_backend") == "torch_dist"


def is_iteration_dir(path: str) -> bool:
    """Whether ``path`` holds Megatron-LM's legacy rank directories (``mp_rank_*/model_optim_rng.pt``)."""
    try:
        return any(RANK_DIR.match(d) and os.path.isfile(os.path.join(path, d, MEGATRON_FILE)) for d in os.listdir(path))
    except OSError:
        return False


def is_megatron_legacy(path: str) -> bool:
    if os.path.isfile(os.path.join(path, MEGATRON_TRACKER)):
        return True
    return is_iteration_dir(path)


# --- torch DCP -------------------------------------------------------------------------------------------------
DCP_METADATA = ".metadata"


def is_dcp_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DCP_METADATA))


# --- Hugging Face ----------------------------------------------------------------------------------------------
HF_CONFIG = "config.json"
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
ADAPTER_CONFIG = "adapter_config.json"  # peft's save_pretrained


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, HF_CONFIG)) and any(os.path.isfile(os.path.join(path, f)) for f in HF_WEIGHT_FILES)


HF_TRAINER_KEY = "hf_trainer"  # our trainer's native component: a transformers Trainer checkpoint directory
TRAINER_STATE = "trainer_state.json"


def locate_hf_trainer(path: str) -> str:
    """The Trainer checkpoint directory: ``path`` itself, or our trainer's checkpoint around it (or its root)."""
    directory = resolve_checkpoint_dir(path)
    nested = os.path.join(directory, HF_TRAINER_KEY)
    return nested if os.path.isfile(os.path.join(nested, TRAINER_STATE)) else directory


def is_hf_trainer_checkpoint(path: str) -> bool:
    if holds_native(path, HF_TRAINER_KEY):
        return True
    try:
        directory = locate_hf_trainer(path)
    except Exception:  # detection never raises
        return False
    # a peft model's Trainer checkpoint holds Trainer.save_model's adapter directory instead of the model
    return os.path.isfile(os.path.join(directory, TRAINER_STATE)) and (
        os.path.isfile(os.path.join(directory, HF_CONFIG)) or os.path.isfile(os.path.join(directory, ADAPTER_CONFIG)))
