"""Qwen3: Llama's layer with RMSNorm over each head's queries and keys (megatron-core's ``qk_layernorm``)."""

from __future__ import annotations

from .llama import INPUT_NORM, ATTENTION, MLP, PRE_MLP_NORM, QK_NORMS, TOP
from .megatron_family import Family, register

QWEN3 = register(Family(
    name="qwen3", model_types=("qwen3",), layer=(*INPUT_NORM, *ATTENTION, *QK_NORMS, *PRE_MLP_NORM, *MLP), qk_norm=True,
    linear_bias=False, megatron_args={"qk_layernorm": True}, **TOP,
))
