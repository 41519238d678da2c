"""GPT-OSS (``gpt_oss``): grouped-query attention with q/k/v and output biases, a learned sink logit per head, a sliding
window on every other layer, and a mixture of experts with biases everywhere. As Megatron-LM's own GPT-OSS recipe
(examples/gptoss) runs it:

- sinks: megatron-core's ``--softmax-type learnable`` (``core_attention.softmax_offset``: one logit per head joined to
  each row's softmax, split with the heads over tensor-parallel ranks);
- the experts' activation ``(clamp(up) + 1) * gate * sigmoid(1.702 * gate)``, gate clamped above at ``swiglu_limit``:
  ``--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value <swiglu_limit>``; quick_gelu's 1.702 is fixed,
  so another ``swiglu_alpha`` is refused;
- the router: a biased linear, the top-k of its logits, softmax over them (megatron-core's softmax router without
  pre-softmax; ``--add-bias-linear`` gives it its bias);
- the window: ``--window-size <sliding_window - 1>,0 --window-attn-skip-freq`` (its layers per the config's layer_types).

transformers stores each layer's experts in four tensors holding every expert (``gate_up_proj`` [E, hidden, 2 x ffn],
gate and up interleaved by column; ``down_proj`` [E, ffn, hidden]; their biases): each expert's slice is megatron-core's
SequentialMLP expert (``linear_fc1`` = [gate; up], transposed).
"""

from __future__ import annotations

from .llama import ATTENTION, INPUT_NORM, TOP
from .megatron_family import COLS, GATED, INTERLEAVED, INTERLEAVED_T, REPLICATED, ROWS, T, Family, Param, register
from .mixtral import PRE_MOE_NORM

SINKS = Param("self_attention.core_attention.softmax_offset", ("self_attn.sinks",), ROWS)  # megatron-core's module order: first
ROUTER = (
    Param("mlp.router.weight", ("mlp.router.weight",), REPLICATED),
    Param("mlp.router.bias", ("mlp.router.bias",), REPLICATED, when="linear_bias"),
)
EXPERT = (
    Param("mlp.experts.local_experts.{e}.linear_fc1.weight", ("mlp.experts.gate_up_proj",), GATED, INTERLEAVED_T, stacked=True),
    Param("mlp.experts.local_experts.{e}.linear_fc1.bias", ("mlp.experts.gate_up_proj_bias",), GATED, INTERLEAVED, stacked=True),
    Param("mlp.experts.local_experts.{e}.linear_fc2.weight", ("mlp.experts.down_proj",), COLS, T, stacked=True),
    Param("mlp.experts.local_experts.{e}.linear_fc2.bias", ("mlp.experts.down_proj_bias",), REPLICATED, stacked=True),
)

GPT_OSS = register(Family(
    name="gpt_oss", model_types=("gpt_oss",), layer=(*INPUT_NORM, SINKS, *ATTENTION, *PRE_MOE_NORM, *ROUTER), experts=EXPERT,
    qkv_bias="attention_bias", proj_bias="attention_bias", linear_bias=True,  # the experts and router always have biases
    megatron_args={"swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0, "softmax_type": "learnable",
                   "bias_gelu_fusion": False},
    fixed_config=(("swiglu_alpha", 1.702),), window=True, required_args=("activation_func_clamp_value",),
    config_args=(("num_local_experts", "num_experts"), ("num_experts_per_tok", "moe_router_topk"),
                 ("swiglu_limit", "activation_func_clamp_value")), **TOP,
))
