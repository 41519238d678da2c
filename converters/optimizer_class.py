"""Which optimizer a torch optimizer state dict is from, and which of its state is the parameter's shape, asked of
the optimizers themselves.

A state dict names no class (torch saves ``state`` and ``param_groups`` only), but every optimizer puts its own
hyperparameters in each group: SGD's momentum and nesterov, Adam's betas and amsgrad, transformers' Adafactor's
clip_threshold and relative_step. Building each optimizer we know on a small parameter tells its keys, and which
of them the class fixes (AdamW's decoupled_weight_decay, which it does not take as an argument), with no hand list
of optimizers to go stale. A checkpoint's word for its class (a manifest's) is only ever looked up among these
classes, never imported.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable

from interop.lazy_import import torch

log = logging.getLogger(__name__)

# what a torch state dict from an optimizer no known class matches is called: the engines' fused Adams
# (DeepSpeed's FusedAdam and CPUAdam, apex's and Transformer Engine's) keep Adam's moments under torch's names
DEFAULT = "AdamW"


@lru_cache(maxsize=1)
def _torch_classes() -> dict[str, type]:
    return {n: c for n, c in vars(torch.optim).items()
            if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}


@lru_cache(maxsize=1)
def _transformers_classes() -> dict[str, type]:
    try:
        from transformers import optimization
    except ImportError:  # transformers is optional to the converters that read torch files
        return {}
    return {f"transformers.{n}": c for n, c in vars(optimization).items()
            if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c.__module__ == optimization.__name__}


def known(name: str | None = None) -> dict[str, type]:
    """The optimizer classes a state dict is matched against, by the name a checkpoint records: torch.optim's by
    their own name, transformers' (its Trainer's ``optim="adafactor"``) as ``transformers.<name>``. transformers
    (seconds to import) is asked only for a name of its own (``name``) or where torch's classes fit nothing."""
    if name is not None and not name.startswith("transformers."):
        return _torch_classes()
    return _torch_classes() | _transformers_classes()


def _held(groups: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The hyperparameters of a state dict's param groups (a later group's value where they differ)."""
    held: dict[str, Any] = {}
    for g in groups:
        held.update({k: v for k, v in g.items() if k != "params"})
    return held


@dataclass(frozen=True)
class _Shape:
    """What one optimizer class puts in a param group: every key, and those the class fixes (with their value); and
    the known classes it derives from (AdamW: Adam)."""

    keys: frozenset[str]
    fixed: tuple[tuple[str, Any], ...]
    parents: frozenset[str] = frozenset()


def _built(cls: type, param: "torch.nn.Parameter", **kwargs: Any):
    """``cls`` on ``param`` with its defaults, or with a learning rate where it needs one given; None where it
    cannot be built on a plain matrix (it needs more: sparse gradients, a closure)."""
    for extra in ({}, {"lr": 1e-3}):
        try:
            return cls([param], **kwargs, **extra)
        except Exception:  # noqa: BLE001 - an optimizer that cannot be built this way is not matched by its groups
            continue
    return None


@lru_cache(maxsize=None)
def _shape(name: str) -> _Shape | None:
    classes = known(name)
    cls = classes[name]
    opt = _built(cls, torch.nn.Parameter(torch.ones(2, 3)))
    if opt is None:
        return None
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    takes = set(inspect.signature(cls).parameters)
    return _Shape(frozenset(group), tuple(sorted((k, v) for k, v in group.items() if k not in takes and isinstance(v, (bool, int, float, str)))),
                  frozenset(n for n, c in classes.items() if c is not cls and issubclass(cls, c)))


def _transformers_shapes() -> dict[str, _Shape]:
    """transformers' optimizers' group shapes, kept on disk beside the model answers: asking imports transformers
    (a second), which a conversion of DeepSpeed's FusedAdam state (no torch class fits its groups) would pay each
    time only to learn that none of transformers' fits either."""
    from .models.kept import kept

    def ask() -> dict[str, _Shape]:
        return {n: s for n in _transformers_classes() if (s := _shape(n)) is not None}

    def to_json(shapes: dict[str, _Shape]) -> dict[str, Any]:
        return {"classes": {n: {"keys": sorted(s.keys), "fixed": [list(f) for f in s.fixed], "parents": sorted(s.parents)}
                            for n, s in shapes.items()}}

    def from_json(raw: dict[str, Any]) -> dict[str, _Shape]:
        out = {}
        for n, s in raw["classes"].items():
            if not (isinstance(n, str) and n.startswith("transformers.") and all(isinstance(k, str) for k in s["keys"] + s["parents"])
                    and all(isinstance(k, str) and isinstance(v, (bool, int, float, str)) for k, v in s["fixed"])):
                raise ValueError("optimizer groups")
            out[n] = _Shape(frozenset(s["keys"]), tuple((k, v) for k, v in s["fixed"]), frozenset(s["parents"]))
        return out

    return kept("optimizer-groups", 1, "transformers.optimization", ask, to_json, from_json)


def class_of(groups: Iterable[dict[str, Any]], default: str = DEFAULT) -> str:
    """The optimizer whose param groups these are: the known class whose every key the groups hold, none of its
    fixed values contradicted, and that lacks no key the groups hold that another known optimizer puts there (an
    older torch's Adam, without decoupled_weight_decay, holds every key of Adamax, but also Adam's amsgrad); of a
    class and its subclass that both fit (Adam, AdamW with decoupled weight decay), the subclass. Keys no known
    optimizer puts in a group (a scheduler's ``initial_lr``, a user's group name, Megatron's lr_mult) do not count.
    ``default`` where no class fits or several do: an engine's own optimizer (DeepSpeed's FusedAdam has no
    ``maximize``), or a checkpoint of an older torch that lacks a key its class has now."""
    held = _held(groups)
    torch_shapes = {n: s for n in _torch_classes() if (s := _shape(n)) is not None}
    found = _fitting(held, torch_shapes)
    if found is None:  # transformers' asked only where none of torch's fits
        found = _fitting(held, torch_shapes | _transformers_shapes())
    return found or default


def claimed(claim: str, groups: Iterable[dict[str, Any]]) -> str:
    """The class a checkpoint's manifest names, held to its param groups: where the groups tell another known class
    (a manifest's word is the checkpoint's, trusted no more than its groups), or the name is no known class's, the
    groups' answer."""
    told = class_of(groups, default="")
    if told and told != claim:
        log.debug("the manifest says optimizer %r, its param groups are %s's", claim, told)
        return told
    return claim if claim == DEFAULT or claim in known(claim) else told or DEFAULT


def _same(held: Any, fixed: Any) -> bool:
    """A checkpoint's value is the one a class fixes (a tensor or a list a file holds there is not)."""
    return isinstance(held, (bool, int, float, str)) and type(held) is type(fixed) and held == fixed


def _fitting(held: dict[str, Any], shapes: dict[str, _Shape]) -> str | None:
    """The one class of ``shapes`` that ``held`` fits; "" where several fit, None where none does."""
    hyper = set(held) & {k for s in shapes.values() for k in s.keys}
    fits = {n for n, s in shapes.items() if s.keys == hyper and all(_same(held[k], v) for k, v in s.fixed)}
    if not fits:
        return None
    most = [n for n in fits if not any(n in shapes[o].parents for o in fits)]  # (a subclass over its base)
    if len(most) != 1:
        log.debug("param groups fit %d optimizer classes", len(most))
        return ""
    return most[0]


# --- the shapes of its state ---------------------------------------------------------------------------------
# where and how a step runs, not what it keeps: a checkpoint's values (fused, a CUDA tensor's capturable) may not
# build on this machine
_PLACEMENT = frozenset({"foreach", "fused", "capturable", "differentiable"})
# a probe parameter's dimensions: distinct primes, so that each dimension of a state tensor tells which of the
# parameter's it is (or which product of them: a flattened state), and what is left is the optimizer's own constant
_PROBE = (11, 13, 17, 19, 23)

Template = tuple[tuple[tuple[int, ...], int], ...]  # per state dimension: the parameter's dimensions it multiplies, a constant


def _given(cls: type, group: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A param group's hyperparameters that ``cls`` takes, as a key for the cache (lists as tuples); where a value
    cannot be one, none."""
    takes = inspect.signature(cls).parameters
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in group.items()
             if k in takes and k != "params" and k not in _PLACEMENT and isinstance(v, (bool, int, float, str, list, tuple))}
    try:
        hash(tuple(given.items()))
    except TypeError:  # a list of lists
        return ()
    return tuple(sorted(given.items()))


def state_shapes(name: str, group: dict[str, Any], shape: tuple[int, ...]) -> dict[str, tuple[int, ...]] | None:
    """The shape of each state tensor optimizer ``name`` (:data:`DEFAULT` where no known class has that name) keeps
    for a parameter of ``shape`` in ``group`` (its hyperparameters: SGD keeps a momentum_buffer only with momentum,
    Adam a max_exp_avg_sq only with amsgrad), the 0-dim ones (a step) as ``()``: AdamW's exp_avg is the parameter's
    shape, transformers' Adafactor's exp_avg_sq_row its rows. Asked by one step on a parameter of the same number
    of dimensions, each prime-sized, every dimension of its state traced back to the parameter's; with the class's
    defaults where the group's values do not step (a damaged file's). None where the class does not step on a
    plain parameter (it needs a closure, sparse gradients) or the parameter has more than five dimensions."""
    name = name if name in known(name) else DEFAULT
    if len(shape) > len(_PROBE):
        return None
    cls = known(name)[name]
    layout = _layout(name, _given(cls, group), len(shape))
    if layout is None:
        layout = _layout(name, (), len(shape))
    if layout is None:
        return None
    return {k: tuple(math.prod(shape[i] for i in dims) * const for dims, const in template) for k, template in layout.items()}


@lru_cache(maxsize=256)
def _layout(name: str, given: tuple[tuple[str, Any], ...], rank: int) -> dict[str, Template] | None:
    probe = _PROBE[:rank]
    param = torch.nn.Parameter(torch.ones(probe))
    param.grad = torch.ones_like(param)
    opt = _built(known(name)[name], param, **dict(given))
    if opt is None:
        return None
    try:
        opt.step()
    except Exception:  # noqa: BLE001 - values it cannot step with (a damaged file's), or it needs a closure
        return None
    return {k: tuple(_traced(n, probe) for n in v.shape) for k, v in opt.state[param].items() if torch.is_tensor(v)}


def _traced(n: int, probe: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    dims = []
    for i, p in enumerate(probe):
        if n % p == 0:
            dims.append(i)
            n //= p
    return tuple(dims), n


def moments(name: str, groups: Iterable[dict[str, Any]] = ()) -> frozenset[str]:
    """The state keys optimizer ``name`` keeps in its parameter's shape (a matrix's) under any of ``groups``'
    hyperparameters or its own defaults: what tells which parameter a state entry saved by position is."""
    out: set[str] = set()
    for group in (*groups, {}):
        found = state_shapes(name, group, _PROBE[:2]) or {}
        out.update(k for k, s in found.items() if s == _PROBE[:2])
    return frozenset(out)
