"""Qwen2-MoE: Qwen2's attention (q/k/v biases) with routed experts beside a shared expert whose output a sigmoid
gate scales: megatron-core's shared experts with ``--moe-shared-expert-gate`` (``mlp.shared_experts``)."""

from __future__ import annotations

from .llama import ATTENTION, INPUT_NORM, TOP
from .megatron_family import CAT, COLS, GATED, REPLICATED, Family, Param, register
from .mixtral import PRE_MOE_NORM
from .qwen3_moe import EXPERT

SHARED = (
    Param("mlp.shared_experts.linear_fc1.weight", ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), GATED, CAT),
    Param("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_expert.down_proj.weight",), COLS),
    Param("mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",), REPLICATED),
)

QWEN2_MOE = register(Family(
    name="qwen2_moe", model_types=("qwen2_moe",),
    layer=(*INPUT_NORM, *ATTENTION, *PRE_MOE_NORM, Param("mlp.router.weight", ("mlp.gate.weight",), REPLICATED), *SHARED),
    experts=EXPERT, qkv_bias="qkv_bias", proj_bias=False, linear_bias=False, ffn_attr="moe_intermediate_size",
    megatron_args={"moe_shared_expert_gate": True}, renormalised_attr="norm_topk_prob",
    config_args=(("num_experts", "num_experts"), ("num_experts_per_tok", "moe_router_topk"),
                 ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size")), **TOP,
))
