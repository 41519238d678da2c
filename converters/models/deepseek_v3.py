"""DeepSeek-V3 (and R1, Kimi-K2 / Moonlight, which keep its model): GLM-4.5's mixture of experts (dense layers
first, a sigmoid router with a score-correction bias, expert groups, scaled top-k, an ungated shared expert) on
multi-latent attention, megatron-core's MLASelfAttention (``--multi-latent-attention``):

- q through a low-rank bottleneck (``q_a_proj`` -> RMSNorm -> ``q_b_proj``: ``linear_q_down_proj`` ->
  ``q_layernorm`` -> ``linear_q_up_proj``, ``--q-lora-rank``), or one projection without one (``q_proj``:
  ``linear_q_proj``, DeepSeek-V2-Lite's ``q_lora_rank`` None);
- k and v from one compressed latent and a shared rotary key (``kv_a_proj_with_mqa``: ``linear_kv_down_proj``,
  ``[kv_lora_rank; qk_rope_head_dim]`` rows, ``--kv-lora-rank``, ``--qk-pos-emb-head-dim``), its RMSNorm
  (``kv_layernorm``) and up-projection per head (``kv_b_proj``: ``linear_kv_up_proj``, each head's
  ``[qk_nope_head_dim; v_head_dim]`` rows, ``--qk-head-dim``, ``--v-head-dim``);
- rotary embeddings on the even/odd pairs of the rotary part (``rope_interleave``, transformers' default), which is
  what megatron-core's MLA does too (it takes the even entries, then the odd ones, and rotates halves; it refuses
  ``--rotary-interleaved``, which means something else there): the rows are stored as they are. A model with
  ``rope_interleave`` False rotates halves, and its rope rows (each head's of q, the shared ones of the kv
  down-projection) are stored interleaved so that megatron-core's reordering gives them back (``ROPE_Q`` /
  ``ROPE_KV``; the flag kept as ``hf_rope_interleave``).

megatron-core's local spec has the q/kv norms only with ``--qk-layernorm`` (Megatron-LM's DeepSeek recipes set it).
Its down-projections are column-parallel in the local spec and duplicated in Transformer Engine's: the same global
tensors in torch_dist, different per-rank files in the legacy format (which is refused for this family).
"""

from __future__ import annotations

from .glm4_moe import ROUTER, SHARED
from .llama import INPUT_NORM, MLP, PRE_MLP_NORM, TOP
from .megatron_family import COLS, REPLICATED, ROPE_KV, ROPE_Q, ROWS, Family, Param, register
from .mixtral import PRE_MOE_NORM
from .qwen3_moe import EXPERT

# megatron-core's module order: the attention's output projection (built by its base class) first
MLA = (
    Param("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), COLS),
    Param("self_attention.linear_q_proj.weight", ("self_attn.q_proj.weight",), ROWS, ROPE_Q, when="no_q_lora"),
    Param("self_attention.linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",), ROWS, when="q_lora"),
    Param("self_attention.linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",), ROWS, ROPE_Q, when="q_lora"),
    Param("self_attention.linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",), ROWS, ROPE_KV),
    Param("self_attention.linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",), ROWS),
    Param("self_attention.q_layernorm.weight", ("self_attn.q_a_layernorm.weight",), REPLICATED, when="q_lora",
          norm_of="self_attention.linear_q_up_proj"),
    Param("self_attention.kv_layernorm.weight", ("self_attn.kv_a_layernorm.weight",), REPLICATED,
          norm_of="self_attention.linear_kv_up_proj"),
)

DEEPSEEK_V3 = register(Family(
    name="deepseek_v3", model_types=("deepseek_v3",),
    layer=(*INPUT_NORM, *MLA, *PRE_MOE_NORM, *ROUTER, *SHARED), experts=EXPERT,
    dense_layer=(*INPUT_NORM, *MLA, *PRE_MLP_NORM, *MLP), dense_first_attr="first_k_dense_replace",
    shared_multiple_attr="n_shared_experts", routing_groups=("n_group", "topk_group"),
    qkv_bias=False, proj_bias="attention_bias", linear_bias=False, ffn_attr="moe_intermediate_size",
    renormalised_attr="norm_topk_prob",
    megatron_args={"multi_latent_attention": True, "qk_layernorm": True,
                   "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True, "moe_router_dtype": "fp32"},
    config_args=(("n_routed_experts", "num_experts"), ("num_experts_per_tok", "moe_router_topk"),
                 ("routed_scaling_factor", "moe_router_topk_scaling_factor"), ("q_lora_rank", "q_lora_rank"),
                 ("kv_lora_rank", "kv_lora_rank"), ("qk_nope_head_dim", "qk_head_dim"), ("qk_rope_head_dim", "qk_pos_emb_head_dim"),
                 ("v_head_dim", "v_head_dim"), ("rope_interleave", "hf_rope_interleave")), nullable=("q_lora_rank",), mtp=True, **TOP,
))
