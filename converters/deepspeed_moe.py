"""DeepSpeed's own MoE layout (``deepspeed.moe.layer.MoE``): which ranks hold which experts, under which names.

A model with ``MoE(..., num_experts=N, ep_size=EP)`` layers keeps N / EP experts per rank, numbered locally
(``...deepspeed_experts.0`` on every rank). The optimizer puts them in their own param groups (``moe: True``,
``name: ep_size_EP``) split over the expert-data-parallel ranks only; ``save_checkpoint`` writes each expert's
weights to ``layer_<L>_expert_<E>_mp_rank_00_model_states.pt`` under its global number E, and leaves them out of
``module``. Rank r is expert-parallel rank r % EP (utils/groups.py), or r // (W / EP) with
``use_data_before_expert_parallelism``.

Interop names every expert by its global number, as DeepSpeed's expert files do, so a checkpoint read at one EP
size is written at any other. Hand-written: DeepSpeed has no function from a checkpoint to this layout (its
zero_to_fp32 fails on these checkpoints: "layer_0_expert_0_mp_rank_00_model_states.pt is not a model state
checkpoint"), so the rules above are read from engine._save_moe_checkpoint and load_moe_state_dict.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

from interop.errors import ConversionError

# DeepSpeed's own pattern for an expert's parameters (engine._save_moe_checkpoint's moe_str_prefix)
EXPERT_NAME = re.compile(r"^(.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..*)$")
DATA_BEFORE_EXPERT = "use_data_before_expert_parallelism"  # the DeepSpeed config key that changes the rank order


def expert_of(name: str) -> tuple[str, int, str] | None:
    """(layer prefix, expert number, parameter suffix) of an expert's parameter, or None."""
    m = EXPERT_NAME.match(name)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


def ep_ranks(world: int, ep: int, data_before_expert: bool = False) -> list[tuple[int, ...]]:
    """The ranks holding each expert-parallel rank's experts (its expert-data-parallel group), in group order."""
    if data_before_expert:
        stride = world // ep
        return [tuple(range(e * stride, (e + 1) * stride)) for e in range(ep)]
    return [tuple(range(e, world, ep)) for e in range(ep)]


@dataclass(frozen=True)
class ExpertLayers:
    """The MoE layers of a list of expert parameter names (global numbers), in module order."""

    experts: dict[str, int]  # layer prefix -> number of experts, in order of first appearance
    suffixes: dict[str, list[str]]  # layer prefix -> an expert's parameter suffixes, in order

    @classmethod
    def of(cls, names: list[str]) -> "ExpertLayers":
        experts: dict[str, set[int]] = {}
        suffixes: dict[str, list[str]] = {}
        for name in names:
            prefix, index, suffix = expert_of(name)
            experts.setdefault(prefix, set()).add(index)
            if suffix not in suffixes.setdefault(prefix, []):
                suffixes[prefix].append(suffix)
        for prefix, ids in experts.items():
            if ids != set(range(len(ids))):
                missing = sorted(set(range(max(ids) + 1)) - ids)
                raise ConversionError(f"layer {prefix.rstrip('.')}, expert {missing[0]}: missing (experts {sorted(ids)} present)")
        return cls({p: len(ids) for p, ids in experts.items()}, suffixes)

    def per_rank(self, ep: int) -> dict[str, int]:
        out = {}
        for prefix, n in self.experts.items():
            if n % ep:
                raise ConversionError(f"layer {prefix.rstrip('.')}: {n} experts cannot be split over {ep} expert-parallel ranks")
            out[prefix] = n // ep
        return out

    def local(self, ep: int, e: int) -> list[tuple[str, str]]:
        """(global name, the name on expert-parallel rank ``e``) of that rank's experts, in its module order."""
        out = []
        for prefix, n in self.per_rank(ep).items():
            for i in range(n):
                out += [(f"{prefix}{e * n + i}{s}", f"{prefix}{i}{s}") for s in self.suffixes[prefix]]
        return out

    def files(self) -> list[tuple[int, int, str]]:
        """(MoE layer id, global expert, layer prefix) of every expert file, as save_checkpoint numbers them."""
        return [(layer, e, prefix) for layer, (prefix, n) in enumerate(self.experts.items()) for e in range(n)]


def expert_file(layer: int, expert: int) -> str:
    return f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"


def split_moe_groups(groups: list[list[str]], hyper: list[dict], ep: int) -> tuple[list[list[str]], list[dict]]:
    """What ``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer`` does to a model's param
    groups: each group's expert parameters move to a group of their own (its hyper-parameters, ``moe: True``,
    ``name: ep_size_<EP>``), after all the others. A group already of experts keeps its place, renamed."""
    dense, dense_hyper, moe, moe_hyper = [], [], [], []
    for names, h in zip(groups, hyper):
        if h.get("moe"):
            moe.append(list(names))
            moe_hyper.append({**h, "name": f"ep_size_{ep}"})
            continue
        experts = [n for n in names if expert_of(n)]
        dense.append([n for n in names if not expert_of(n)])
        dense_hyper.append(h)
        if experts:
            moe.append(experts)
            moe_hyper.append({**h, "name": f"ep_size_{ep}", "moe": True})
    return dense + moe, dense_hyper + moe_hyper


def expert_state_dicts(names: list[str], load) -> "OrderedDict[str, OrderedDict]":
    """Each expert file's contents: its parameters under their global names, ``load(name)`` each tensor."""
    layers = ExpertLayers.of(names)
    out: OrderedDict[str, OrderedDict] = OrderedDict()
    for layer, e, prefix in layers.files():
        out[expert_file(layer, e)] = OrderedDict((f"{prefix}{e}{s}", load(f"{prefix}{e}{s}")) for s in layers.suffixes[prefix])
    return out


def expert_names(ckpt) -> list[str]:
    return [n for n in ckpt.model if expert_of(n)]


def summary(ckpt) -> str | None:
    """'4 experts in each of 2 deepspeed.moe layers, saved over 2 expert-parallel ranks', or None."""
    names = expert_names(ckpt)
    if not names:
        return None
    layers = ExpertLayers.of(names)
    counts = sorted(set(layers.experts.values()))
    each = f"{counts[0]} experts in each of" if len(counts) == 1 else f"{counts} experts in"
    ep = ckpt.source.get("ep_size")
    return f"{each} {len(layers.experts)} deepspeed.moe layers" + (f", saved over {ep} expert-parallel ranks" if ep else "")


def check(ckpt, destination: str) -> None:
    """Refuse to write a checkpoint whose deepspeed.moe layers lack an expert: numbers not 0..N-1, or fewer
    than the model's own count where the source recorded it (DeepSpeed's ``num_experts``, per layer)."""
    names = expert_names(ckpt)
    if not names:
        return
    try:
        layers = ExpertLayers.of(names)
        recorded = ckpt.source.get("num_experts") or []
        for (prefix, held), model in zip(layers.experts.items(), recorded):
            if held != int(model):
                raise ConversionError(f"layer {prefix.rstrip('.')}, expert {held}{'' if held + 1 == model else ' and more'}: "
                                      f"missing ({held} of the model's {model} experts present)")
    except ConversionError as exc:
        raise ConversionError(f"{destination}: not written: {exc}") from None
