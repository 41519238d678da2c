"""How Hugging Face tensors become Megatron tensors and how Megatron splits them over tensor-parallel ranks.

One :class:`Rule` per Megatron tensor says which Hugging Face tensors it is made of (q/k/v fused per query
group, gate and up stacked, GPT-2's Conv1D transposed), how it is split over TP ranks, and which pipeline
stage holds it. Every Megatron format (legacy per-rank files, torch_dist) and the optimizer state (Adam's
moments are laid out exactly like their parameters) go through these rules, so there is one place for
each layout fact:

- rows: column-parallel weights (QKV, fc1 without gating) and their biases, split on dim 0;
- cols: row-parallel weights (proj, fc2), split on dim 1; their biases are replicated;
- gated: SwiGLU's fc1: rank r holds ``[gate_r; up_r]``, not the r-th slice of ``[gate; up]``;
- vocab: embedding and output layer, padded to Megatron's vocabulary size, then split on dim 0;
- replicated: norms and the biases added after a reduction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from interop.lazy_import import torch

from interop.errors import ConversionError

from .megatron_arch import MegatronArch
from .megatron_pipeline import PipelineSplit
from .models.megatron_family import (  # noqa: F401 - the split kinds are also this module's
    CAT, COLS, GATED, INTERLEAVED, INTERLEAVED_T, MTP, MTP_COPIES, MTP_FINAL_NORM, MTP_LAYER, ONE, PACKED_QKV, PACKED_QKV_T, QKV, REPLICATED,
    ROPE_KV, ROPE_Q, ROWS, VOCAB, T, Family, Param, expert_name,
)

FIRST, LAST = -1, -2  # stage markers for tensors outside the layers
LAYER_PREFIX = "decoder.layers."
MTP_PREFIX = "mtp.layers."  # megatron-core's MultiTokenPredictionBlock: mtp.layers.<k>.


@dataclass(frozen=True)
class Rule:
    megatron: str  # name in a TP=1, PP=1 model (global layer index)
    hf: tuple[str, ...]  # the Hugging Face tensors it is made of, in fuse order
    split: str
    layer: int  # global layer index, or FIRST / LAST
    fuse: Callable[[list[torch.Tensor]], torch.Tensor]
    unfuse: Callable[[torch.Tensor], list[torch.Tensor]]
    aliases: tuple[str, ...] = ()  # other names of the same tensor (Transformer Engine fuses norms into linears)
    buffer: bool = False  # a persistent buffer (the router's expert bias): no gradient, no optimizer state


def cat(ts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat; on :class:`row_numbers.RowNumbers` the same without torch (an export plans its byte copies so)."""
    if type(ts[0]).__name__ == "RowNumbers":  # by name: planning imports numpy, values import torch, neither the other
        return type(ts[0]).cat(ts, dim)
    return torch.cat(ts, dim=dim)


def _one(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0]


def _as_list(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


def _t(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0].t().contiguous()


def _t_back(t: torch.Tensor) -> list[torch.Tensor]:
    return [t.t().contiguous()]


def _qkv(arch: MegatronArch) -> tuple[Callable, Callable]:
    """Megatron's fused QKV: for each query group g, ``[q heads of g; k_g; v_g]`` (rows of head_dim each)."""
    g, d = arch.groups, arch.head_dim
    per = arch.heads // arch.groups

    def fuse(ts: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = ts
        rest = tuple(q.shape[1:])
        parts = (q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest))
        return cat(list(parts), dim=1).reshape((arch.heads + 2 * g) * d, *rest)

    def unfuse(t: torch.Tensor) -> list[torch.Tensor]:
        rest = tuple(t.shape[1:])
        grouped = t.reshape(g, (per + 2) * d, *rest)
        q, k, v = grouped.split([per * d, d, d], dim=1)
        return [q.reshape(arch.heads * d, *rest).contiguous(), k.reshape(g * d, *rest).contiguous(), v.reshape(g * d, *rest).contiguous()]

    return fuse, unfuse


def _packed_qkv(arch: MegatronArch, transposed: bool) -> tuple[Callable, Callable]:
    """One [q; k; v] tensor (all heads of each; GPT-2's c_attn stores it (in, out)) in Megatron's per-group order."""
    fuse3, unfuse3 = _qkv(arch)
    sizes = [arch.heads * arch.head_dim, arch.groups * arch.head_dim, arch.groups * arch.head_dim]

    def fuse(ts: list[torch.Tensor]) -> torch.Tensor:
        t = ts[0].t() if transposed else ts[0]
        return fuse3(list(t.split(sizes, dim=0)))

    def unfuse(t: torch.Tensor) -> list[torch.Tensor]:
        full = cat(unfuse3(t), dim=0)
        return [full.t().contiguous() if transposed else full]

    return fuse, unfuse


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return cat(ts, dim=0)


def _half(t: torch.Tensor) -> int:
    """Half of a [gate; up] tensor's rows; a tensor of an odd number of rows is none (a damaged checkpoint's)."""
    if t.shape[0] % 2:
        raise ConversionError(f"a gated MLP's fc1 of {t.shape[0]} rows: [gate; up] has an even number")
    return t.shape[0] // 2


def _halves(t: torch.Tensor) -> list[torch.Tensor]:
    _half(t)
    return [p.contiguous() for p in t.chunk(2, dim=0)]


def _interleaved(transposed: bool) -> tuple[Callable, Callable]:
    """Gate and up interleaved along a tensor's last dimension (GPT-OSS's ``gate_up_proj``, stored (in, out), and its
    bias) as megatron-core's fc1 rows ``[gate; up]``; back by picking each row of the two halves in turn."""
    def fuse(ts: list[torch.Tensor]) -> torch.Tensor:
        x = ts[0].t() if transposed else ts[0]
        return cat([x[0::2], x[1::2]], dim=0)

    def unfuse(t: torch.Tensor) -> list[torch.Tensor]:
        half = _half(t)
        order = [r // 2 + (half if r % 2 else 0) for r in range(2 * half)]  # gate 0, up 0, gate 1, up 1, ...
        x = t[order]
        return [x.t().contiguous() if transposed else x.contiguous()]

    return fuse, unfuse


def _rope_rows(arch: MegatronArch, lead_arg: str | None, heads: int) -> tuple[Callable, Callable]:
    """Multi-latent attention's rotary rows: each of ``heads`` blocks is ``[lead; rope]`` (``lead_arg``'s rows: a
    head's no-rope part, or the kv latent). megatron-core's MLA takes the rope rows' even then odd entries before
    rotating halves (rope_utils' ``multi_latent_attention`` branch), as transformers does with ``rope_interleave``
    (its default): those rows are stored as they are. A model that rotates halves without it (``rope_interleave``
    False) has its rope rows stored interleaved, so that megatron-core's reordering gives them back."""
    options = dict(arch.options)
    rope = options.get("qk_pos_emb_head_dim") or 0
    lead = options.get(lead_arg) or 0 if lead_arg else 0
    if options.get("hf_rope_interleave") is not False or not rope:
        return _one, _as_list

    def interleave(ts: list[torch.Tensor]) -> torch.Tensor:  # halves -> pairs
        rest = tuple(ts[0].shape[1:])
        g = ts[0].reshape(heads, lead + rope, *rest)
        half = rope // 2
        pairs = cat([g[:, lead:lead + half].reshape(heads, half, 1, *rest), g[:, lead + half:].reshape(heads, half, 1, *rest)],
                    dim=2).reshape(heads, rope, *rest)  # (cat, not torch.stack: the planner's RowNumbers pass here too)
        return cat([g[:, :lead], pairs], dim=1).reshape(heads * (lead + rope), *rest).contiguous()

    def halves(t: torch.Tensor) -> list[torch.Tensor]:  # pairs -> halves: megatron-core's own reordering
        rest = tuple(t.shape[1:])
        g = t.reshape(heads, lead + rope, *rest)
        return [cat([g[:, :lead], g[:, lead::2], g[:, lead + 1::2]], dim=1).reshape(heads * (lead + rope), *rest).contiguous()]

    return interleave, halves


def _fusers(arch: MegatronArch) -> dict[str, tuple[Callable, Callable]]:
    return {ONE: (_one, _as_list), T: (_t, _t_back), QKV: _qkv(arch), PACKED_QKV: _packed_qkv(arch, False),
            PACKED_QKV_T: _packed_qkv(arch, True), CAT: (_cat, _halves), INTERLEAVED: _interleaved(False), INTERLEAVED_T: _interleaved(True),
            ROPE_Q: _rope_rows(arch, "qk_head_dim", arch.heads), ROPE_KV: _rope_rows(arch, "kv_lora_rank", 1)}


def _exists(param: Param, arch: MegatronArch) -> bool:
    flags = {"linear_bias": arch.linear_bias, "qkv_bias": arch.qkv_bias, "layernorm": arch.norm == "LayerNorm",
             "qk_layernorm": bool(dict(arch.options).get("qk_layernorm")), None: True,
             "q_lora": dict(arch.options).get("q_lora_rank") is not None, "no_q_lora": dict(arch.options).get("q_lora_rank") is None}
    return flags[param.when]


def _te_name(param: Param) -> str:
    """A norm Transformer Engine fuses into a linear: ``<linear>.layer_norm_<weight|bias>``."""
    return f"{param.norm_of}.layer_norm_{param.megatron.rpartition('.')[2]}"


def _layer_order(layer: tuple[Param, ...], te_names: bool) -> list[Param]:
    """The family's table is in the local spec's module order; Transformer Engine's moves each fused norm to
    just before its linear's weight."""
    if not te_names:
        return list(layer)
    linears = _linears(layer)
    fused = [p for p in layer if p.norm_of in linears]
    out: list[Param] = []
    for p in layer:
        if p.norm_of in linears:
            continue
        if p.megatron.endswith(".weight"):
            out.extend(n for n in fused if n.norm_of == _linear_of(p))
        out.append(p)
    return out


def _linear_of(param: Param) -> str:
    return param.megatron.rpartition(".")[0]


def _linears(layer: tuple[Param, ...]) -> set[str]:
    """The modules of a layer with a weight: what Transformer Engine can fuse a norm into (a MoE layer has no
    ``mlp.linear_fc1``, so its pre-MLP norm stays a module of its own)."""
    return {_linear_of(p) for p in layer if p.megatron.endswith(".weight")}


def rules(arch: MegatronArch, te_names: bool = True) -> list[Rule]:
    """Every tensor of the model in Megatron's order, from its family's table. ``te_names``: norms named as
    Transformer Engine's fused layers hold them (``linear_qkv.layer_norm_weight``, Megatron-LM's default);
    otherwise as the local spec's separate modules (``input_layernorm.weight``). Both are accepted when reading."""
    fam: Family = arch.spec
    fusers = _fusers(arch)
    out: list[Rule] = []
    norm_params = ("weight", "bias") if arch.norm == "LayerNorm" else ("weight",)

    out.append(Rule("embedding.word_embeddings.weight", (fam.embedding,), VOCAB, FIRST, _one, _as_list))
    if fam.position_embedding:
        out.append(Rule("embedding.position_embeddings.weight", (fam.position_embedding,), REPLICATED, FIRST, _one, _as_list))
    for i in range(arch.num_layers):
        out += _layer_rules(arch, fusers, arch.is_moe_layer(i) or not arch.experts, f"{LAYER_PREFIX}{i}.", fam.layer_prefix.format(i=i), i, te_names)
    for p in norm_params:
        out.append(Rule(f"decoder.final_layernorm.{p}", (f"{fam.final_norm}.{p}",), REPLICATED, LAST, _one, _as_list))
    for k in range(arch.mtp_layers):  # megatron-core registers its MTP block after the decoder, before the output layer
        m, h = f"{MTP_PREFIX}{k}.", fam.layer_prefix.format(i=arch.num_layers + k)
        out += [Rule(f"{m}{p.megatron}", (f"{h}{p.hf[0]}",), p.split, LAST, _one, _as_list) for p in MTP]
        # its transformer layer is of the last decoder layer's kind (Megatron-LM's gpt_builders), a MoE model's MoE
        out += _layer_rules(arch, fusers, arch.is_moe_layer(arch.num_layers - 1) or not arch.experts, f"{m}{MTP_LAYER}", h, LAST, te_names)
        out.append(Rule(f"{m}{MTP_FINAL_NORM.megatron}", (f"{h}{MTP_FINAL_NORM.hf[0]}",), REPLICATED, LAST, _one, _as_list))
    if not arch.tied:
        out.append(Rule("output_layer.weight", (fam.output,), VOCAB, LAST, _one, _as_list))
    return out


def _layer_rules(arch: MegatronArch, fusers: dict[str, tuple[Callable, Callable]], moe: bool, m: str, h: str, layer: int,
                 te_names: bool) -> list[Rule]:
    """One transformer layer's rules: Megatron names under ``m``, Hugging Face ones under ``h``; a MoE model's dense
    layers (first_k_dense_replace) are the family's ``dense_layer``."""
    fam: Family = arch.spec
    table = fam.layer if moe else fam.dense_layer
    fused_into = _linears(table)
    out = []
    for p in _layer_order(table, te_names):
        if not _exists(p, arch):
            continue
        names = [f"{m}{p.megatron}"] + ([f"{m}{_te_name(p)}"] if p.norm_of else [])
        if p.norm_of and te_names and p.norm_of in fused_into:  # TE fuses it into its linear; a MoE layer has none
            names.reverse()
        fuse, unfuse = fusers[p.fuse]
        out.append(Rule(names[0], tuple(f"{h}{x}" for x in p.hf), p.split, layer, fuse, unfuse, tuple(names[1:]), p.buffer))
    for e in range(arch.experts if moe else 0):
        for p in fam.experts:
            if _exists(p, arch):
                fuse, unfuse = fusers[p.fuse]
                hf = tuple(f"{h}{expert_name(x, e) if p.stacked else x.format(e=e)}" for x in p.hf)
                out.append(Rule(f"{m}{p.megatron.format(e=e)}", hf, p.split, layer, fuse, unfuse))
    return out


def stacked_experts(arch: MegatronArch) -> dict[str, list[str]]:
    """Each Hugging Face tensor holding a layer's experts along its first dimension (the family's ``stacked``
    expert tensors, in every MoE layer and MTP layer), and the names its experts' slices go by in the rules."""
    fam: Family = arch.spec
    stacked = [x for p in fam.experts if p.stacked and _exists(p, arch) for x in p.hf]
    if not stacked:
        return {}
    layers = [i for i in range(arch.num_layers) if arch.is_moe_layer(i)]
    layers += [arch.num_layers + k for k in range(arch.mtp_layers) if arch.is_moe_layer(arch.num_layers - 1)]
    return {f"{fam.layer_prefix.format(i=i)}{x}": [f"{fam.layer_prefix.format(i=i)}{expert_name(x, e)}" for e in range(arch.experts)]
            for i in layers for x in stacked}


def linear_shape(rule: Rule, arch: MegatronArch) -> tuple[int, ...] | None:
    """The full shape the arguments give an attention's or MLP's linear (a routed expert's too: fc1 [gate; up] rows where
    gated, fc2 the width in; q/k/v of every head and query group), or None for other tensors (shared experts' widths
    and multi-latent attention's projections are their own)."""
    name = rule.megatron
    leaf = name.split(".", name.count(".") - 1)[-1]
    if ".self_attention." in name and not arch.spec.megatron_args.get("multi_latent_attention"):
        qkv = (arch.heads + 2 * arch.groups) * arch.head_dim
        return {"linear_qkv.weight": (qkv, arch.hidden), "linear_qkv.bias": (qkv,),
                "linear_proj.weight": (arch.hidden, arch.heads * arch.head_dim)}.get(leaf)
    if ".mlp.shared_experts." in name or ".mlp." not in name:
        return None
    width = arch.ffn if expert_index(name) is not None or not arch.dense_first else arch.dense_ffn
    rows = width * (2 if arch.gated else 1)
    return {"linear_fc1.weight": (rows, arch.hidden), "linear_fc1.bias": (rows,), "linear_fc2.weight": (arch.hidden, width)}.get(leaf)


def mtp_copies(arch: MegatronArch) -> dict[str, str]:
    """The copies of the embedding and head a Hugging Face checkpoint keeps in each MTP layer, and the model tensor
    each copies: megatron-core's MTP layers use the model's own (``MTP_COPIES``)."""
    fam: Family = arch.spec
    main = {"embedding": fam.embedding, "output": fam.embedding if arch.tied else fam.output}
    return {f"{fam.layer_prefix.format(i=arch.num_layers + k)}{name}": main[attr]
            for k in range(arch.mtp_layers) for name, attr in MTP_COPIES.items()}


def parameters(all_rules: list[Rule]) -> list[Rule]:
    """The rules of the model's parameters, in order: what an optimizer holds (buffers have no state)."""
    return [r for r in all_rules if not r.buffer]


def tied_output_rule(arch: MegatronArch) -> Rule:
    """With tied embeddings and more than one stage, the last stage holds its own copy of the embedding as
    ``output_layer.weight`` (Megatron keeps the two in sync with an all-reduce)."""
    return Rule("output_layer.weight", (arch.spec.embedding,), VOCAB, LAST, _one, _as_list, aliases=("embedding.word_embeddings.weight",))


# the attention's (multi-latent attention's projections too), an MLP's, an expert's or an MTP layer's
LINEAR_MODULES = ("linear_proj", "linear_qkv", "linear_fc1", "linear_fc2", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                  "linear_kv_down_proj", "linear_kv_up_proj", "eh_proj")  # (an MTP layer's projection)


def extra_state_key(name: str) -> str | None:
    """``<linear>._extra_state`` for a linear layer's weight (Transformer Engine's and the local spec's linears
    have one, experts' and shared experts' too; Megatron-LM's state dicts hold it, ``None`` without FP8)."""
    module, _, leaf = name.rpartition(".")
    if leaf == "weight" and (module.rpartition(".")[2] in LINEAR_MODULES or module == "output_layer"):
        return f"{module}._extra_state"
    return None


# --- tensor-parallel split and merge ------------------------------------------------------------------------
def pad_rows(t: torch.Tensor, rows: int, fill: torch.Tensor | None = None) -> torch.Tensor:
    """The vocabulary padded to Megatron's padded size: with ``fill`` (the rows a Megatron source had there,
    which take part in its softmax) when it fits, else with zeros."""
    if t.shape[0] > rows:
        raise ConversionError(f"vocabulary of {t.shape[0]} rows does not fit Megatron's padded size {rows}")
    if t.shape[0] == rows:
        return t
    shape = (rows - t.shape[0], *t.shape[1:])
    if fill is not None and tuple(fill.shape) == shape:
        return torch.cat([t, fill.to(t.dtype)])
    return torch.cat([t, t.new_zeros(shape)])


def split(rule: Rule, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """The TP ranks' pieces of a full Megatron tensor (the vocabulary already padded)."""
    if rule.split == REPLICATED or tp == 1:
        return [full] * tp
    if rule.split in (ROWS, VOCAB):
        return [p.contiguous() for p in full.chunk(tp, dim=0)]
    if rule.split == COLS:
        return [p.contiguous() for p in full.chunk(tp, dim=1)]
    gate, up = full.chunk(2, dim=0)
    return [cat([g, u]) for g, u in zip(gate.chunk(tp, dim=0), up.chunk(tp, dim=0))]


def megatron_pieces(rule: Rule, values: list[torch.Tensor], tp: int, padded: int, fill: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The TP ranks' pieces of ``rule`` fused from its Hugging Face ``values``, the vocabulary padded (``fill``: the
    padding rows a Megatron source had)."""
    full = rule.fuse(values)
    if rule.split == VOCAB:
        full = pad_rows(full, padded, fill)
    return split(rule, full, tp)


def merge(rule: Rule, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor from the TP ranks' pieces (inverse of :func:`split`)."""
    if rule.split == REPLICATED or len(pieces) == 1:
        return pieces[0]
    if rule.split in (ROWS, VOCAB):
        return cat(pieces, dim=0)
    if rule.split == COLS:
        return cat(pieces, dim=1)
    halves = [p.chunk(2, dim=0) for p in pieces]
    return cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def check_pieces(rule: Rule, pieces: list[torch.Tensor], where: str) -> None:
    """Pieces of a split tensor must agree on their shape (otherwise a rank's file belongs to another model)."""
    shapes = {tuple(p.shape) for p in pieces}
    if len(shapes) > 1:
        raise ConversionError(f"{where}: tensor-parallel pieces of {rule.megatron} have different shapes {sorted(shapes)}")


# --- pipeline stages ----------------------------------------------------------------------------------------
def local_name(name: str, offset: int) -> str:
    """``decoder.layers.<global>.x`` -> ``decoder.layers.<global - offset>.x`` (each stage numbers from 0)."""
    if not name.startswith(LAYER_PREFIX):
        return name
    index, rest = name[len(LAYER_PREFIX):].split(".", 1)
    return f"{LAYER_PREFIX}{int(index) - offset}.{rest}"


def layer_of(name: str) -> int | None:
    if not name.startswith(LAYER_PREFIX):
        return None
    return int(name[len(LAYER_PREFIX):].split(".", 1)[0])


EXPERTS = "mlp.experts.local_experts."  # megatron-core's SequentialMLP: decoder.layers.<i>.mlp.experts.local_experts.<e>.


def expert_index(name: str) -> int | None:
    """The routed expert a tensor belongs to (a decoder layer's or an MTP layer's), None outside the experts."""
    _, found, rest = name.partition(EXPERTS)
    return int(rest.split(".", 1)[0]) if found else None


def is_expert(rule: Rule) -> bool:
    """A routed expert's tensor: a MoE model's expert optimizer holds it at EP > 1."""
    return expert_index(rule.megatron) is not None


def stack_index(name: str) -> tuple[int, ...]:
    """Where a tensor lies in torch_dist's stacking: () outside the layers, (layer,), (layer, expert), or (expert,)
    in an MTP layer (megatron-core stacks its experts, not the MTP layers)."""
    layer, expert = layer_of(name), expert_index(name)
    return ((layer,) if layer is not None else ()) + ((expert,) if expert is not None else ())


def chunk_rules(all_rules: list[Rule], arch: MegatronArch, split: PipelineSplit) -> list[list[list[Rule]]]:
    """[stage][chunk]: the rules each model chunk holds: its layers (:class:`.megatron_pipeline.PipelineSplit`), the
    embedding in the first stage's first chunk, the final norm and head in the last stage's last chunk."""
    if split.num_layers != arch.num_layers:
        raise ConversionError(f"a pipeline split of {split.num_layers} layers for a model of {arch.num_layers}")
    last = (split.pp - 1, split.vpp - 1)
    return [[[r for r in all_rules if r.layer in held or (r.layer == FIRST and (p, v) == (0, 0)) or (r.layer == LAST and (p, v) == last)]
             for v, held in enumerate(chunks)] for p, chunks in enumerate(split.chunks())]
