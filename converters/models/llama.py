"""Llama and the models that kept its layer: Mistral, Qwen2 / Qwen2.5 (q/k/v biases). Also the shared
attention and MLP tables the other rotary families build on."""

from __future__ import annotations

from .megatron_family import CAT, COLS, GATED, QKV, REPLICATED, ROWS, Family, Param, norm, register

ATTENTION = (
    Param("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), COLS),
    Param("self_attention.linear_proj.bias", ("self_attn.o_proj.bias",), REPLICATED, when="linear_bias"),
    Param("self_attention.linear_qkv.weight", tuple(f"self_attn.{x}_proj.weight" for x in "qkv"), ROWS, QKV),
    Param("self_attention.linear_qkv.bias", tuple(f"self_attn.{x}_proj.bias" for x in "qkv"), ROWS, QKV, when="qkv_bias"),
)
QK_NORMS = (
    Param("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), REPLICATED),
    Param("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), REPLICATED),
)
MLP = (
    Param("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GATED, CAT),
    Param("mlp.linear_fc1.bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias"), GATED, CAT, when="linear_bias"),
    Param("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), COLS),
    Param("mlp.linear_fc2.bias", ("mlp.down_proj.bias",), REPLICATED, when="linear_bias"),
)
INPUT_NORM = norm("input_layernorm", "input_layernorm", norm_of="self_attention.linear_qkv")
PRE_MLP_NORM = norm("pre_mlp_layernorm", "post_attention_layernorm", norm_of="mlp.linear_fc1")
LAYER = (*INPUT_NORM, *ATTENTION, *PRE_MLP_NORM, *MLP)
TOP = dict(embedding="model.embed_tokens.weight", final_norm="model.norm", output="lm_head.weight", layer_prefix="model.layers.{i}.")

LLAMA = register(Family(name="llama", model_types=("llama", "mistral"), layer=LAYER, **TOP))
QWEN2 = register(Family(name="qwen2", model_types=("qwen2",), layer=LAYER, qkv_bias=True, proj_bias=False, linear_bias=False, **TOP))
