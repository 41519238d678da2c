"""A decoder-only causal LM laid out as Llama's (Llama, Mistral, Qwen2, and MoE models such as Mixtral or
Qwen3-MoE) cut into pipeline stages, tensor- and expert-parallel with DTensor, as Megatron lays it out.

A stage keeps the Hugging Face modules and their canonical names (``model.layers.5.mlp.up_proj.weight`` is
the same name on stage 1 of 2 as in the whole model), so its state dict, its optimizer state and a
checkpoint of it need no renaming. Tensor parallelism follows Megatron: q/k/v, gate and up column-parallel;
o and down row-parallel; the embedding and the output layer split over the vocabulary, with the loss taken
over vocabulary shards (``loss_parallel``) rather than on gathered logits. Expert parallelism is
transformers' own: the model's ``_ep_plan`` shards every MoE layer's experts over the ``ep`` ranks and its
all-to-all implementation sends each token to the ranks of the experts it is routed to.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from interop.errors import ConfigurationError
from torch import nn

LAYOUT = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")  # what a stage takes
COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


@dataclass(frozen=True)
class StageLayout:
    """Which decoder layers a pipeline stage holds, and whether it holds the embedding and the head."""

    stage: int
    num_stages: int
    layers: tuple[int, ...]

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1


def stage_layouts(num_layers: int, num_stages: int) -> list[StageLayout]:
    """Megatron's even split: stage s holds layers [s*L/P, (s+1)*L/P)."""
    if num_stages < 1 or num_layers % num_stages:
        raise ConfigurationError(f"{num_layers} decoder layers do not split evenly over {num_stages} pipeline stages")
    per = num_layers // num_stages
    return [StageLayout(s, num_stages, tuple(range(s * per, (s + 1) * per))) for s in range(num_stages)]


class CausalLMStage(nn.Module):
    """One pipeline stage of a Hugging Face Llama-family model: embedding (first stage), some decoder layers,
    final norm and output layer (last stage). Input: token ids on the first stage, hidden states after it.
    Output: hidden states, or the logits on the last stage."""

    def __init__(self, hf_model: nn.Module, layout: StageLayout):
        super().__init__()
        config = hf_model.config
        missing = [name for name in LAYOUT if _submodule(hf_model, name) is None]
        if missing:
            raise ConfigurationError(f"the Megatron-style trainer runs decoder-only models laid out as Llama's ({', '.join(LAYOUT)}); "
                                     f"{config.model_type!r} has no {', '.join(missing)}")
        unsupported = _attention_beyond_causal(config)
        if unsupported:
            raise ConfigurationError(f"the Megatron-style trainer's stages run full causal attention with no mask (sdpa's "
                                     f"is_causal); {config.model_type!r} has {unsupported}")
        if layout.num_stages > 1 and config.tie_word_embeddings:
            raise ConfigurationError("tied input and output embeddings live on the first and last stage; untie them to run pipeline parallel")
        self.config = config
        self.layout = layout
        self.checkpoint_stage = False  # recompute the whole stage in backward (set by enable_activation_checkpointing)
        self.model = nn.Module()
        if layout.first:
            self.model.embed_tokens = hf_model.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): hf_model.model.layers[i] for i in layout.layers})
        if layout.last:
            self.model.norm = hf_model.model.norm
            self.lm_head = hf_model.lm_head
        self.model.rotary_emb = hf_model.model.rotary_emb  # a buffer only (inv_freq), not in the state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_stage and self.training:
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.layout.first else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = self.model.rotary_emb(h, positions)
        for layer in self.model.layers.values():  # no mask: sdpa/eager attention are causal without one
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        if self.layout.last:
            h = self.lm_head(self.model.norm(h))
        return h


def _attention_beyond_causal(config) -> str | None:
    """What a layer called without a mask would get wrong: eager attention applies no causal mask of its own,
    and sliding windows and soft-capping need what the model's forward adds around its layers."""
    impl = getattr(config, "_attn_implementation", None)
    if impl != "sdpa":
        return f"attention implementation {impl!r} (eager attention sees every token without a mask)"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "sliding-window layers"
    capped = [a for a in ("attn_logit_softcapping", "final_logit_softcapping") if getattr(config, a, None)]
    return f"logit soft-capping ({', '.join(capped)})" if capped else None


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def split_linears(model: nn.Module, layers) -> dict[str, str]:
    """Layer ``i``'s linear layers Megatron splits -> "column" or "row": the attention's q/k/v/o and a dense MLP's
    gate/up/down, each set only where the layer has all of it (a MoE layer's experts and router are not split
    over tp: expert-tensor-parallel size 1, Megatron's default with expert parallelism)."""
    out: dict[str, str] = {}
    for i in layers:
        for kind in ("self_attn", "mlp"):
            names = {f"model.layers.{i}.{n}": style for names, style in ((COLUMN_PARALLEL, "column"), (ROW_PARALLEL, "row"))
                     for n in names if n.startswith(kind + ".")}
            present = [n for n in names if isinstance(_submodule(model, n), nn.Linear)]
            if len(present) == len(names):
                out.update(names)
            elif kind == "self_attn":
                raise ConfigurationError(f"tensor parallelism splits the attention's q/k/v/o projections; layer {i} of "
                                         f"{model.config.model_type!r} has no {', '.join(n for n in names if n not in present)}")
    return out


def tensor_parallel_plan(stage: CausalLMStage) -> dict:
    """Megatron's split of every linear layer, embedding and output layer of the stage."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict = {}
    if stage.layout.first:  # vocabulary-parallel embedding: rows split, each rank looks up its own tokens
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for name, style in split_linears(stage, stage.layout.layers).items():
        plan[name] = ColwiseParallel() if style == "column" else RowwiseParallel()
    if stage.layout.last:  # vocabulary-parallel output layer: logits stay split over the vocabulary
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def tensor_sharding(model: nn.Module, tp: int) -> dict:
    """Which weights the plan splits over ``tp`` ranks, and along which axis (for the manifest)."""
    from interop.sharding import TensorSharding

    if tp == 1:
        return {}
    out = {"model.embed_tokens.weight": TensorSharding(tp, 0), "lm_head.weight": TensorSharding(tp, 0)}
    for name, style in split_linears(model, range(model.config.num_hidden_layers)).items():
        out[f"{name}.weight"] = TensorSharding(tp, 0 if style == "column" else 1)
    return out


def apply_tensor_parallel(stage: CausalLMStage, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    config, tp = stage.config, tp_mesh.size()
    plan = tensor_parallel_plan(stage)
    sizes = [("attention heads", config.num_attention_heads), ("key/value heads", config.num_key_value_heads),
             ("vocabulary", config.vocab_size)]
    if any(name.endswith("mlp.gate_proj") for name in plan):
        sizes.append(("MLP width", config.intermediate_size))
    for what, n in sizes:
        if n % tp:
            raise ConfigurationError(f"tensor parallel size {tp} does not divide the {what} ({n})")
    parallelize_module(stage, tp_mesh, plan)


def expert_plan(stage: nn.Module) -> dict[str, str]:
    """The model's own expert-parallel plan (transformers' ``base_model_ep_plan``: which tensors hold experts
    along their first dimension, which modules dispatch tokens to them) for the layers this stage holds."""
    plan = getattr(stage.config, "base_model_ep_plan", None) or {}
    names = dict(stage.named_parameters()) | dict(stage.named_modules())
    out = {}
    for pattern, style in plan.items():
        found = re.compile(r"model\." + re.escape(pattern).replace(r"\*", r"\d+") + "$")
        out.update({name: style for name in names if found.match(name)})
    return out


def apply_expert_parallel(stage: CausalLMStage, ep_mesh, tp_mesh) -> list[str]:
    """Each ``ep`` rank keeps 1/ep of every MoE layer's experts (DTensors split on their first dimension, so a
    checkpoint holds them whole under their names) and exchanges tokens with the others by all-to-all
    (transformers' ``AllToAllEP``; the ranks of a tp group split their shared tokens between them). Returns
    the expert tensors' names: their gradients are reduced over the ranks holding the same experts."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    plan = expert_plan(stage)
    experts = [name for name, style in plan.items() if style == "grouped_gemm"]
    if not experts:
        raise ConfigurationError(f"--ep {ep_mesh.size()}: {stage.config.model_type!r} has no experts to split "
                                 "(its config has no expert-parallel plan)")
    ep = ep_mesh.size()
    for name in experts:
        count = stage.get_parameter(name).shape[0]
        if count % ep:
            raise ConfigurationError(f"--ep {ep} does not divide the {count} experts of {name}")
    apply_expert_parallelism(stage, ep_mesh, tp_mesh, plan, ep_implementation="all_to_all")
    return experts


def enable_activation_checkpointing(stage: CausalLMStage, granularity: str) -> None:
    """``layer``: each decoder layer recomputed in backward (Hugging Face's own hook, so the base trainer's
    memory statistics count them); ``stage``: the whole stage recomputed, keeping only its input per microbatch."""
    if granularity == "layer":
        for layer in stage.model.layers.values():
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    elif granularity == "stage":
        stage.checkpoint_stage = True
        stage.gradient_checkpointing = True  # what memory.activation_checkpoints counts
    else:
        raise ConfigurationError(f"activation checkpointing granularity {granularity!r}: layer or stage")
