"""Phi-3: Llama's layer with q/k/v in one ``qkv_proj`` ([q; k; v]) and gate/up in one ``gate_up_proj``
([gate; up], already Megatron's fc1 layout before the tensor-parallel split)."""

from __future__ import annotations

from .llama import INPUT_NORM, PRE_MLP_NORM, TOP
from .megatron_family import COLS, GATED, PACKED_QKV, ROWS, Family, Param, register

PHI3 = register(Family(
    name="phi3", model_types=("phi3",), qkv_bias=False, proj_bias=False, linear_bias=False,
    layer=(
        *INPUT_NORM,
        Param("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), COLS),
        Param("self_attention.linear_qkv.weight", ("self_attn.qkv_proj.weight",), ROWS, PACKED_QKV),
        *PRE_MLP_NORM,
        Param("mlp.linear_fc1.weight", ("mlp.gate_up_proj.weight",), GATED),
        Param("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), COLS),
    ),
    **TOP,
))
