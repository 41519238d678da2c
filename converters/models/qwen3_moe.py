"""Qwen3-MoE: Qwen3's attention (RMSNorm over each head's queries and keys) with Mixtral's mixture of experts,
named as Qwen3-MoE names them (``mlp.gate``, ``mlp.experts.<e>.{gate,up,down}_proj``). Its ``norm_topk_prob``
is Megatron's routing order: renormalised top-k (False) is ``--moe-router-pre-softmax``'s opposite."""

from __future__ import annotations

from .llama import ATTENTION, INPUT_NORM, QK_NORMS, TOP
from .megatron_family import CAT, COLS, GATED, REPLICATED, Family, Param, register
from .mixtral import PRE_MOE_NORM

EXPERT = (
    Param("mlp.experts.local_experts.{e}.linear_fc1.weight",
          ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"), GATED, CAT),
    Param("mlp.experts.local_experts.{e}.linear_fc2.weight", ("mlp.experts.{e}.down_proj.weight",), COLS),
)

QWEN3_MOE = register(Family(
    name="qwen3_moe", model_types=("qwen3_moe",), layer=(*INPUT_NORM, *ATTENTION, *QK_NORMS, *PRE_MOE_NORM,
                                                          Param("mlp.router.weight", ("mlp.gate.weight",), REPLICATED)),
    experts=EXPERT, qk_norm=True, linear_bias=False, ffn_attr="moe_intermediate_size",
    megatron_args={"qk_layernorm": True}, renormalised_attr="norm_topk_prob",
    config_args=(("num_experts", "num_experts"), ("num_experts_per_tok", "moe_router_topk")), **TOP,
))
