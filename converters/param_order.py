"""The order a training engine sees parameters in: trainable groups in optimizer order, frozen parameters,
buffers and tied aliases. Writers of engine-native layouts (DeepSpeed's flat groups, a torch optimizer's
integer ids) lay tensors out in this order, so the engine's own loader finds each one where it looks.

A source without optimizer state (a Hugging Face model) gets the usual decay / no-decay split with torch's
AdamW defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from interop.lazy_import import torch

from interop.errors import ConversionError
from interop.logical import LogicalCheckpoint, OptimizerState
from interop.tensors import LazyTensor, TensorSpec

from .models.adapters import engine_model
from .models.facts import parameter_layout

ADAMW_DEFAULTS = {
    "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False, "maximize": False, "foreach": None,
    "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
}

@dataclass
class EngineOrder:
    """The engine's view of the model: trainable groups in flat order, frozen parameters, buffers, aliases."""

    groups: list[list[str]]
    hyper: list[dict[str, Any]]
    frozen: list[str]
    buffers: list[str]
    aliases: dict[str, str]  # tied target -> source
    module_keys: list[str]


GROUPINGS = ("source", "single", "decay")


def trainer_decay_names(model: torch.nn.Module | None) -> set[str]:
    """The parameters transformers' Trainer puts in its weight-decay group (``get_decay_parameter_names``: not
    biases, not norms, by module class and by name); empty without a model."""
    if model is None:
        return set()
    import transformers

    return set(transformers.Trainer.get_decay_parameter_names(None, model))  # ``self`` is unused there


# How the code that builds an optimizer splits a model's parameters into a decay and a no-decay group, for a file
# that keeps them by position only (a torch optimizer's state dict). transformers' Trainer's rule is asked of
# transformers; the others live in users' scripts, not in any library, so they are written out here:
GROUP_RULES = {
    "trainer": "transformers' Trainer's (get_decay_parameter_names)",
    "matrices": "decay for parameters of two or more dimensions (nanoGPT, torchtitan, interop's trainers)",
    # transformers' examples/pytorch/*_no_trainer.py (accelerate scripts), now and in older copies of them
    "examples": 'no decay for names holding "bias" or "layer_norm.weight" (transformers\' no_trainer examples)',
    "examples-bert": 'no decay for names holding "bias" or "LayerNorm.weight" (older copies of those examples)',
}
_NO_DECAY_SUBSTRINGS = {"examples": ("bias", "layer_norm.weight"), "examples-bert": ("bias", "LayerNorm.weight")}


def _split(rule: str, names: list[str], model: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> list[list[str]]:
    if rule == "trainer":
        decay = trainer_decay_names(model)
    elif rule == "matrices":
        decay = {n for n in names if len(shapes[n]) >= 2}
    else:
        decay = {n for n in names if not any(s in n for s in _NO_DECAY_SUBSTRINGS[rule])}
    return [[n for n in names if n in decay], [n for n in names if n not in decay]]


def positional_fits(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]], state_shapes: list[list[list[tuple[int, ...]]]],
                    rules: tuple[str, ...] = tuple(GROUP_RULES)) -> list[tuple[str, list[list[str]]]]:
    """Which parameter each position of a torch optimizer's groups holds, where the file names none: each of
    ``rules`` (one group: the parameters in module order) whose groups have the file's sizes and put a parameter of
    the state's shape at every position, distinct assignments only, in ``rules``' order. ``shapes``: the
    checkpoint's tensors under the module's names; ``state_shapes[g][k]``: the shapes of the state held at group
    ``g``'s ``k``-th position (none before the first step)."""
    named = [(n, p) for n, p in model.named_parameters() if n in shapes]
    sizes = [len(g) for g in state_shapes]
    # the parameters an optimizer holds: those trainable as the model is built, or every one: from_pretrained
    # loads each parameter trainable, one its module builds frozen too (Ernie 4.5 MoE's e_score_correction_bias)
    held: list[list[str]] = []
    for names in ([n for n, p in named if p.requires_grad], [n for n, _ in named]):
        if names not in held:
            held.append(names)
    fits: list[tuple[str, list[list[str]]]] = []
    for names in held:
        for rule in (rules if len(sizes) == 2 else ("single",) if len(sizes) == 1 else ()):
            split = [names] if rule == "single" else _split(rule, names, model, shapes)
            if [len(g) for g in split] != sizes or any(fit == split for _, fit in fits):
                continue
            if all(s == shapes[n] for group, held_shapes in zip(split, state_shapes) for n, at in zip(group, held_shapes) for s in at):
                fits.append((rule, split))
    return fits


def regroup(order: EngineOrder, ckpt: LogicalCheckpoint, grouping: str, hyper: dict[str, Any] | None = None) -> EngineOrder:
    """``order`` with its trainable parameters grouped as a user's optimizer groups them: ``source`` (as saved),
    ``single`` (one group, as ``model.parameters()``), ``decay`` (transformers' Trainer: decay / no decay).
    ``hyper`` (a DeepSpeed config's optimizer params) overrides the groups' hyper-parameters."""
    if grouping not in GROUPINGS:
        raise ConversionError(f"param grouping {grouping!r} is not one of {', '.join(GROUPINGS)}")
    trainable = [n for n in order.module_keys if any(n in g for g in order.groups)]
    base = dict(order.hyper[0]) if order.hyper else {**ADAMW_DEFAULTS}
    steps = {float(e["value"]) for e in (ckpt.optimizer.scalars.get("step", {}).values() if ckpt.optimizer else [])}
    if grouping != "source" and len(steps) > 1:
        raise ConversionError(f"the source's groups are at different optimizer steps {sorted(steps)}; they cannot be regrouped")
    if grouping == "single":
        groups, hypers = [trainable], [base]
    elif grouping == "decay":
        decay = trainer_decay_names(engine_model(ckpt)) or {n for n in trainable if len(ckpt.model[n].spec.shape) >= 2}
        decayed = next((h for h, g in zip(order.hyper, order.groups) if g and g[0] in decay), base)
        groups = [[n for n in trainable if n in decay], [n for n in trainable if n not in decay]]
        hypers = [dict(decayed), {**decayed, "weight_decay": 0.0}]
    else:
        groups, hypers = [list(g) for g in order.groups], [dict(h) for h in order.hyper]
    if hyper:
        hypers = [{**h, **hyper, **({"weight_decay": 0.0} if grouping == "decay" and i == 1 else {})} for i, h in enumerate(hypers)]
    kept = [(g, h) for g, h in zip(groups, hypers) if g]
    return replace(order, groups=[g for g, _ in kept], hyper=[h for _, h in kept])


def engine_order(ckpt: LogicalCheckpoint) -> EngineOrder:
    aliases = {t: s for t, *sources in ckpt.tied for s in sources[:1] if s in ckpt.model}
    layout = parameter_layout(ckpt.config) if ckpt.adapter is None else None  # transformers' (kept) answer
    model = engine_model(ckpt) if layout is None else None  # peft's model of the base model when the checkpoint holds adapters
    if layout is not None:
        params, buffers = list(layout[0]), list(layout[1])
    elif model is not None:
        params = [n for n, _ in model.named_parameters()]  # a tied alias appears once, under its source
        buffers = [n for n, _ in model.state_dict().items() if n not in dict(model.named_parameters(remove_duplicate=False))]
    else:  # no config: optimizer groups and the frozen list say which tensors are parameters
        grouped = {n for g in (ckpt.optimizer.param_groups if ckpt.optimizer else []) for n in g.get("params", [])}
        named = [n for n in ckpt.model if n not in aliases]
        params = [n for n in named if not grouped or n in grouped or n in ckpt.frozen]
        buffers = [n for n in named if n not in params]
    known = set(params) | set(buffers) | set(aliases)
    extra = [n for n in ckpt.model if n not in known]  # tensors the config's model lacks (custom buffers)
    missing = [n for n in params if n not in ckpt.model and n not in aliases]
    if missing:
        raise ConversionError(f"the checkpoint lacks parameters its config's model has: {missing[:5]}")
    frozen = [n for n in params if n in set(ckpt.frozen)]
    opt = ckpt.optimizer
    if opt is not None and opt.param_groups:
        members = [set(g.get("params", [])) for g in opt.param_groups]
        grouped = set().union(*members)
        buffers += [n for n in extra if n not in grouped and n not in ckpt.frozen]
        params += [n for n in extra if n in grouped or n in ckpt.frozen]
        order = [n for n in params if n not in ckpt.frozen]
        kept = [(m, g) for m, g in zip(members, opt.param_groups) if m]  # an empty group holds no state (Trainer's)
        groups = [[n for n in order if n in m] for m, _ in kept]
        hyper = [{k: v for k, v in g.items() if k != "params"} for _, g in kept]
        stray = [n for n in order if n not in grouped]
        if stray:
            raise ConversionError(f"trainable parameters in no optimizer param group: {stray[:5]}")
    else:
        buffers += extra
        order = [n for n in params if n not in ckpt.frozen]
        shapes = {n: ckpt.model[n].spec.shape for n in order}
        groups = [[n for n in order if len(shapes[n]) >= 2], [n for n in order if len(shapes[n]) < 2]]
        # with the key an LR scheduler adds, so loaders that match keys (DCP) find every group entry they expect
        defaults = {**ADAMW_DEFAULTS, "initial_lr": ADAMW_DEFAULTS["lr"]}
        hyper = [{**defaults, "weight_decay": 0.01}, {**defaults, "weight_decay": 0.0}]
    return EngineOrder(groups, hyper, frozen, buffers, aliases, params + buffers + list(aliases))


def with_initial_optimizer(ckpt: LogicalCheckpoint, order: EngineOrder) -> LogicalCheckpoint:
    """``ckpt``, or, when it holds no optimizer state (a model), a copy holding AdamW's state before its first
    step: zero moments, step 0. That is what a fresh optimizer starts from; engines whose loaders need every
    entry to exist (DCP, DeepSpeed's universal loader) get it written."""
    if ckpt.optimizer is not None:
        return ckpt

    def zeros(name: str) -> LazyTensor:
        shape = ckpt.model[name].spec.shape
        return LazyTensor(TensorSpec(shape, torch.float32), lambda: torch.zeros(shape, dtype=torch.float32), "AdamW's initial state")

    names = [n for g in order.groups for n in g]
    state = OptimizerState(
        "AdamW", [{**h, "params": list(g)} for h, g in zip(order.hyper, order.groups)],
        {key: {n: zeros(n) for n in names} for key in ("exp_avg", "exp_avg_sq")},
        {"step": {n: {"value": 0.0, "dtype": "float32"} for n in names}},
    )
    return replace(ckpt, optimizer=state)
