"""Gemma, Gemma 2 and Gemma 3 (text). Their norms scale by ``1 + weight``, which is Megatron's zero-centred
gamma (``--apply-layernorm-1p``), so the weights copy as they are. Gemma 2 and 3 add a norm after attention
and after the MLP (Megatron-Bridge's ``linear_proj.post_layernorm`` / ``linear_fc2.post_layernorm``);
Gemma 3 adds q/k norms. The embedding scaling, GeGLU and soft-capping are the model's, carried as
configuration (Megatron-Bridge's provider names) and in the recorded Hugging Face config."""

from __future__ import annotations

from .llama import ATTENTION, INPUT_NORM, MLP, QK_NORMS, TOP
from .megatron_family import Family, norm, register

GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu")
BEYOND = ("its embedding is scaled by sqrt(hidden_size) and its MLP is GeGLU, which Megatron-LM's arguments cannot "
          "express: build it with Megatron-Bridge's Gemma provider")
PRE_FFN_NORM = norm("pre_mlp_layernorm", "pre_feedforward_layernorm", norm_of="mlp.linear_fc1")
POST_ATTENTION = norm("self_attention.linear_proj.post_layernorm", "post_attention_layernorm")
POST_MLP = norm("mlp.linear_fc2.post_layernorm", "post_feedforward_layernorm")
PROJ, QKV = ATTENTION[:2], ATTENTION[2:]
SOFT = (("query_pre_attn_scalar", "query_pre_attn_scalar"), ("attn_logit_softcapping", "attn_logit_softcapping"),
        ("final_logit_softcapping", "final_logit_softcapping"))
ONE_P = {"apply_layernorm_1p": True}

GEMMA = register(Family(
    name="gemma", model_types=("gemma",), layer=(*INPUT_NORM, *ATTENTION, *norm("pre_mlp_layernorm", "post_attention_layernorm",
                                                                                 norm_of="mlp.linear_fc1"), *MLP),
    activation=GELU, linear_bias=False, megatron_args=ONE_P, beyond_megatron_lm=BEYOND, **TOP,
))
GEMMA2 = register(Family(
    name="gemma2", model_types=("gemma2",), layer=(*INPUT_NORM, *PROJ, *POST_ATTENTION, *QKV, *PRE_FFN_NORM, *MLP, *POST_MLP),
    activation=GELU, linear_bias=False, megatron_args=ONE_P, config_args=SOFT,
    beyond_megatron_lm=BEYOND.replace("GeGLU", "GeGLU with soft-capped logits"), **TOP,
))
GEMMA3 = register(Family(
    name="gemma3", model_types=("gemma3_text",),
    layer=(*INPUT_NORM, *PROJ, *POST_ATTENTION, *QKV, *QK_NORMS, *PRE_FFN_NORM, *MLP, *POST_MLP), qk_norm=True,
    activation=GELU, linear_bias=False, megatron_args={**ONE_P, "qk_layernorm": True}, config_args=SOFT[:1],
    beyond_megatron_lm=BEYOND.replace("GeGLU", "GeGLU with local and global rotary bases"), **TOP,
))
