"""Facts about model families that converters need: tied weights and GPT-2's Conv1D layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Family:
    name: str
    tied: tuple[str, str] | None = None  # (target, source): the target is not stored when tied
    tied_by_default: bool = False  # the config class's default for tie_word_embeddings
    conv1d_suffixes: tuple[str, ...] = ()  # weights stored (in, out) by transformers' Conv1D
    prefix: str = ""  # every parameter name starts with it in the model class


_LLAMA_LIKE = dict(tied=("lm_head.weight", "model.embed_tokens.weight"), prefix="model.")
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", **_LLAMA_LIKE),
    "mistral": Family("mistral", **_LLAMA_LIKE),
    "qwen2": Family("qwen2", **_LLAMA_LIKE),
    "gpt2": Family(
        "gpt2",
        tied=("lm_head.weight", "transformer.wte.weight"),
        tied_by_default=True,
        conv1d_suffixes=("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"),
        prefix="transformer.",
    ),
}


def family_of(config: dict[str, Any] | None) -> Family | None:
    return FAMILIES.get((config or {}).get("model_type", ""))


def tied_groups(config: dict[str, Any] | None) -> list[list[str]]:
    family = family_of(config)
    if family is None or family.tied is None:
        return []
    if not (config or {}).get("tie_word_embeddings", family.tied_by_default):
        return []
    return [list(family.tied)]


def is_conv1d(config: dict[str, Any] | None, name: str) -> bool:
    family = family_of(config)
    return family is not None and name.endswith(family.conv1d_suffixes)


def conv1d_to_linear(weight: torch.Tensor) -> torch.Tensor:
    """transformers' Conv1D computes ``x @ W`` with W (in, out); nn.Linear computes ``x @ W.T`` with W (out, in)."""
    return weight.t().contiguous()


def linear_to_conv1d(weight: torch.Tensor) -> torch.Tensor:
    return weight.t().contiguous()


def meta_model(config: dict[str, Any] | None) -> torch.nn.Module | None:
    """The model a config.json describes, on the meta device (no memory): its parameter names and order."""
    if not config or "model_type" not in config:
        return None
    import transformers

    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)
