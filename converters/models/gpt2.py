"""GPT-2: learned absolute positions, LayerNorm, GELU (tanh approximation: Megatron-LM's ``--openai-gelu``)
and transformers' Conv1D layers, which store weights (in, out); c_attn holds [q; k; v] of all heads."""

from __future__ import annotations

from .megatron_family import COLS, PACKED_QKV, PACKED_QKV_T, REPLICATED, ROWS, T, Family, Param, norm, register

GPT2 = register(Family(
    name="gpt2", model_types=("gpt2",), embedding="transformer.wte.weight", position_embedding="transformer.wpe.weight",
    final_norm="transformer.ln_f", output="lm_head.weight", layer_prefix="transformer.h.{i}.", norm="LayerNorm", eps_attr="layer_norm_epsilon", ffn_attr="n_inner",
    activation=("gelu_new", "gelu_pytorch_tanh"), gated=False, qkv_bias=True, proj_bias=True, linear_bias=True,
    megatron_args={"openai_gelu": True},
    layer=(
        *norm("input_layernorm", "ln_1", norm_of="self_attention.linear_qkv"),
        Param("self_attention.linear_proj.weight", ("attn.c_proj.weight",), COLS, T),
        Param("self_attention.linear_proj.bias", ("attn.c_proj.bias",), REPLICATED),
        Param("self_attention.linear_qkv.weight", ("attn.c_attn.weight",), ROWS, PACKED_QKV_T),
        Param("self_attention.linear_qkv.bias", ("attn.c_attn.bias",), ROWS, PACKED_QKV),
        *norm("pre_mlp_layernorm", "ln_2", norm_of="mlp.linear_fc1"),
        Param("mlp.linear_fc1.weight", ("mlp.c_fc.weight",), ROWS, T),
        Param("mlp.linear_fc1.bias", ("mlp.c_fc.bias",), ROWS),
        Param("mlp.linear_fc2.weight", ("mlp.c_proj.weight",), COLS, T),
        Param("mlp.linear_fc2.bias", ("mlp.c_proj.bias",), REPLICATED),
    ),
))
