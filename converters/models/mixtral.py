"""Mixtral: Llama's attention with a mixture of experts in place of the MLP. megatron-core's MoE layer
(``--num-experts``, SequentialMLP: one ``linear_fc1`` / ``linear_fc2`` per expert) routes as Mixtral does: the
top-k of the router's logits, softmax over them (Mixtral's softmax, top-k, renormalised: the same weights)."""

from __future__ import annotations

from .llama import ATTENTION, INPUT_NORM, TOP
from .megatron_family import CAT, COLS, GATED, REPLICATED, Family, Param, norm, register

# no linear_fc1 in the layer to fuse it into: the pre-MLP norm is its own module, pre_mlp_layernorm in Transformer
# Engine's MoE spec; megatron-core's local spec saves it in torch_dist under TE's dense name (megatron_dist._stored_key)
PRE_MOE_NORM = norm("pre_mlp_layernorm", "post_attention_layernorm", norm_of="mlp.linear_fc1")
ROUTER = (Param("mlp.router.weight", ("block_sparse_moe.gate.weight",), REPLICATED),)
EXPERT = (  # "{e}": the expert's index
    Param("mlp.experts.local_experts.{e}.linear_fc1.weight",
          ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight"), GATED, CAT),
    Param("mlp.experts.local_experts.{e}.linear_fc2.weight", ("block_sparse_moe.experts.{e}.w2.weight",), COLS),
)

MIXTRAL = register(Family(
    name="mixtral", model_types=("mixtral",), layer=(*INPUT_NORM, *ATTENTION, *PRE_MOE_NORM, *ROUTER), experts=EXPERT,
    linear_bias=False, proj_bias=False, qkv_bias=False,
    config_args=(("num_local_experts", "num_experts"), ("num_experts_per_tok", "moe_router_topk")), **TOP,
))
