"""Which of a checkpoint's tensors are a MoE layer's experts, and whether each layer holds every expert exactly
once: what ``inspect`` and ``diff`` count and every conversion checks before it writes.

The model says which tensors hold experts, not a list of names kept here: transformers marks its expert modules
(``use_experts_implementation`` gives them ``_is_expert_parallel`` and ``num_experts``) and declares the tensors
expert parallelism splits on their first dimension (the model's ``_ep_plan``, ``grouped_gemm``). Stored tensors
are placed by transformers' own renaming and its conversion patterns (:mod:`.fusion`): ``...experts.2.w1.weight``
is expert 2 of ``...experts.gate_up_proj``; a tensor stored fused (GPT-OSS) holds its first dimension's experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from interop.logical import LogicalCheckpoint

from . import facts, fusion


@dataclass(frozen=True)
class ExpertTensor:
    """A module tensor holding a layer's experts along its first dimension."""

    name: str  # the module tensor (model.layers.1.mlp.experts.down_proj)
    layer: str  # its experts module (model.layers.1.mlp.experts)
    experts: int  # how many the model has


@dataclass
class LayerCount:
    """What a checkpoint holds of one layer's experts."""

    layer: str
    experts: int  # the model's count
    # each of the layer's module tensors -> the stored patterns that make it (None: one tensor stored fused)
    expected: dict[str, list[str | None]] = field(default_factory=dict)
    # (module tensor, stored pattern or None) -> expert index -> stored names
    held: dict[tuple[str, str | None], dict[int, list[str]]] = field(default_factory=dict)
    example: dict[tuple[str, str], str] = field(default_factory=dict)  # (tensor, pattern) -> a stored name of it

    def complete(self) -> set[int]:
        """The experts (of the model's) that every tensor of the layer holds."""
        sets = []
        for tensor, patterns in self.expected.items():
            for p in [None] if (tensor, None) in self.held else patterns:
                sets.append(set(self.held.get((tensor, p), {})))
        return set(range(self.experts)).intersection(*sets)

    def problems(self, what: str = "", complete: bool = True) -> list[str]:
        """One line per extra or duplicated expert, and per missing one if it must be ``complete``, naming the
        layer and the expert."""
        out = []
        of = f" ({what})" if what else ""
        for (tensor, pattern), by in sorted(self.held.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
            for i, names in sorted(by.items()):
                if i >= self.experts:
                    out.append(f"layer {self.layer}, expert {i}: beyond the model's {self.experts} experts{of} ({names[0]})")
                elif len(names) > 1:
                    out.append(f"layer {self.layer}, expert {i}: stored {len(names)} times{of} ({', '.join(names)})")
        for tensor, patterns in self.expected.items() if complete else ():
            if (tensor, None) in self.held:  # stored fused, whatever transformers' own files do
                patterns = [None]
            for p in patterns:
                missing = sorted(set(range(self.experts)) - set(self.held.get((tensor, p), {})))
                if missing:
                    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
                    out.append(f"layer {self.layer}, expert {missing[0]}{more} of {self.experts}: missing{of} "
                               f"({self._absent(tensor, p, missing[0])})")
        return out

    def _absent(self, tensor: str, pattern: str | None, expert: int) -> str:
        if pattern is None:
            return f"{tensor} lacks it"
        seen = self.example.get((tensor, pattern)) or next((n for (t, _), n in self.example.items() if t == tensor), None)
        if seen is None:
            return f"no tensor {fusion.pattern_name(pattern, expert)!r}"
        # a sibling's stored name with this pattern and index: the name the missing tensor would have
        found = fusion.pattern_regex(next(p for (t, p) in self.example if self.example[(t, p)] == seen)).search(seen)
        return f"no {seen[:found.start()] + fusion.pattern_name(pattern, expert)!r}" if found else f"no tensor {pattern!r}"


def expert_tensors(config: dict[str, Any] | None) -> dict[str, ExpertTensor]:
    """The model's expert tensors by module name; empty for a dense model or one transformers cannot build."""
    return {name: ExpertTensor(name, layer, experts) for name, (layer, experts) in facts.expert_parameters(config).items()}


def count(config: dict[str, Any] | None, shapes: dict[str, tuple[int, ...]]) -> dict[str, LayerCount]:
    """Each MoE layer's experts as the stored tensors ``shapes`` (universal's names -> shape) hold them."""
    tensors = expert_tensors(config)
    if not tensors:
        return {}
    to_module, _ = facts._renamers(facts._key(config))
    layers = {t.layer: LayerCount(t.layer, t.experts) for t in tensors.values()}
    splits = facts.split_plans(config)
    per_expert = {n for n, p in splits.items() if any("*" in pattern for pattern in p.patterns)}
    for t in tensors.values():  # transformers' files store it per expert where a converter makes it of such tensors
        layers[t.layer].expected[t.name] = list(splits[t.name].patterns) if t.name in per_expert else [None]
    for name, shape in shapes.items():
        module, pattern = to_module(name)
        t = tensors.get(module)
        if t is None:
            continue
        if module not in per_expert:  # stored fused, as held or rearranged (a transpose): one stored tensor
            pattern = None
        held = layers[t.layer].held.setdefault((module, pattern), {})
        if pattern is None:  # stored fused: the dimension that is the module tensor's first
            dim = _experts_dim(splits.get(module), name)
            for i in range(shape[dim] if len(shape) > dim else 0):
                held.setdefault(i, []).append(name)
            continue
        expert = fusion.expert_of(fusion.pattern_regex(pattern).search(name))
        if expert is None:
            continue
        held.setdefault(expert, []).append(name)
        layers[t.layer].example.setdefault((module, pattern), name)
    return layers


def _experts_dim(plan: fusion.SplitPlan | None, stored: str) -> int:
    """Which dimension of a fused stored tensor holds the experts: the module tensor's first, found where the
    split plan lays the stored tensor out in it (a transposing converter may move it); 0 without a plan."""
    view = next((v for v in (plan.views or ()) if v.stored == stored), None) if plan is not None else None
    if view is None or not plan.shape:
        return 0
    first = math.prod(plan.shape[1:])  # the module tensor's stride along its experts dimension
    return next((d for d, (size, stride) in enumerate(zip(view.shape, view.stride)) if stride == first and size == plan.shape[0]), 0)


def problems(ckpt: LogicalCheckpoint, config: dict[str, Any] | None = None) -> list[str]:
    """Every expert a MoE checkpoint (universal's names) lacks, holds twice or holds beyond the model's count.
    Optimizer state is checked for extra and duplicated experts only: an engine that keeps one parameter per
    expert has no Adam state for an expert that has had no tokens yet."""
    config = config or ckpt.config
    if not ckpt.model or not expert_tensors(config):
        return []
    out = []
    for c in count(config, {n: tuple(t.spec.shape) for n, t in ckpt.model.items()}).values():
        out += c.problems()
    for key, per in (ckpt.optimizer.tensors.items() if ckpt.optimizer is not None else ()):
        for c in count(config, {n: tuple(t.spec.shape) for n, t in per.items()}).values():
            out += c.problems(f"optimizer {key!r}", complete=False)
    return out


def summary(ckpt: LogicalCheckpoint) -> str | None:
    """'4 experts in each of 2 layers' (or per layer where they differ), from the model's weights; None if dense."""
    layers = count(ckpt.config, {n: tuple(t.spec.shape) for n, t in ckpt.model.items()})
    if not layers:
        return None
    held = {layer: len(c.complete()) for layer, c in layers.items()}
    model = {c.experts for c in layers.values()}
    if len(set(held.values())) == 1 and set(held.values()) == model:
        return f"{next(iter(model))} experts in each of {len(layers)} MoE layer{'s' if len(layers) > 1 else ''}"
    return "; ".join(f"{layer}: {n} of {layers[layer].experts}" for layer, n in held.items())
