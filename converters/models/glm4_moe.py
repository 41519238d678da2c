"""GLM-4.5 / GLM-4.6 (``glm4_moe``): the DeepSeek-V3 mixture of experts on grouped-query attention.

- Attention: q/k/v biases (``attention_bias``), optional RMSNorm over each head's queries and keys (``use_qk_norm``:
  ``--qk-layernorm``), rotary embeddings on the first half of each head (``partial_rotary_factor``: ``--rotary-percent``).
- The first ``first_k_dense_replace`` layers are dense (Megatron's ``--moe-layer-freq [0]*k+[1]*(n-k)``); the rest are
  MoE layers: a sigmoid router whose top-k is chosen with a score-correction bias (``e_score_correction_bias``, a
  buffer: megatron-core's ``--moe-router-enable-expert-bias`` keeps it as ``router.expert_bias``), the chosen scores
  renormalised and scaled (``routed_scaling_factor``: ``--moe-router-topk-scaling-factor``), optionally limited to the
  best ``topk_group`` of ``n_group`` expert groups, and an ungated shared expert ``n_shared_experts`` experts wide.
- transformers computes the router in fp32 whatever the model's dtype: ``--moe-router-dtype fp32``.
"""

from __future__ import annotations

from .llama import ATTENTION, INPUT_NORM, MLP, PRE_MLP_NORM, QK_NORMS, TOP
from .megatron_family import CAT, COLS, GATED, REPLICATED, Family, Param, register
from .mixtral import PRE_MOE_NORM
from .qwen3_moe import EXPERT

QK = tuple(Param(p.megatron, p.hf, p.split, when="qk_layernorm") for p in QK_NORMS)  # only with use_qk_norm
ROUTER = (
    Param("mlp.router.weight", ("mlp.gate.weight",), REPLICATED),
    Param("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",), REPLICATED, buffer=True),
)
SHARED = (  # no gate: its output is added as it is
    Param("mlp.shared_experts.linear_fc1.weight", ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"), GATED, CAT),
    Param("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_experts.down_proj.weight",), COLS),
)

GLM4_MOE = register(Family(
    name="glm4_moe", model_types=("glm4_moe",),
    layer=(*INPUT_NORM, *ATTENTION, *QK, *PRE_MOE_NORM, *ROUTER, *SHARED), experts=EXPERT,
    dense_layer=(*INPUT_NORM, *ATTENTION, *QK, *PRE_MLP_NORM, *MLP), dense_first_attr="first_k_dense_replace",
    shared_multiple_attr="n_shared_experts", routing_groups=("n_group", "topk_group"),
    qkv_bias="attention_bias", proj_bias=False, linear_bias=False, ffn_attr="moe_intermediate_size",
    renormalised_attr="norm_topk_prob",
    megatron_args={"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True, "moe_router_dtype": "fp32"},
    config_args=(("n_routed_experts", "num_experts"), ("num_experts_per_tok", "moe_router_topk"),
                 ("routed_scaling_factor", "moe_router_topk_scaling_factor"), ("use_qk_norm", "qk_layernorm")), mtp=True, **TOP,
))
