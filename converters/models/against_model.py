"""A checkpoint held against the model its config describes, as transformers builds it.

A tensor of the wrong size or kind (a damaged or hostile file, a config from another model), a tensor the source
lacks, or an optimizer moment that is not its parameter's shape would otherwise convert without a word: every
target writes what it is given, and the consumer finds out later, or never (``from_pretrained`` refuses a
wrong-sized norm but quietly initialises a missing one at random; DeepSpeed's flat partitions shift every later
moment by the extra element). transformers knows each key's shape and which keys may be absent, torch which
optimizer state is the parameter's shape; nothing is hand-listed here. A model transformers cannot build is not
held against one (its tensors are kept as stored, as the readers say in a note).

Reading does not refuse (``inspect`` and ``verify`` report what is wrong); every writer refuses before writing
anything (``check``, in :mod:`converters.registry`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from interop.errors import ConversionError
from interop.logical import LogicalCheckpoint

from .. import optimizer_class
from . import experts
from .facts import stored_model, tied_groups


@dataclass(frozen=True)
class Disagreement:
    """A tensor that is not the model's."""

    model: str  # "the LlamaForCausalLM its config describes"
    name: str
    shape: tuple[int, ...] | None  # the checkpoint's; None: it lacks the tensor
    wanted: tuple[int, ...]
    origin: str
    dtype: str = ""  # the checkpoint's, where its kind is the problem (an integer tensor for a floating one)


def disagreements(ckpt: LogicalCheckpoint, config: dict[str, Any] | None = None) -> list[Disagreement]:
    """How ``ckpt`` (universal's names) is not the model ``config`` (its own by default) describes: the tensors of
    another shape or of an integer type where the model's is floating, in the source's order, then the tensors it
    lacks. A tensor tied to one it holds (as the config ties them: a checkpoint's own word does not make a tie) is
    held; a module tensor save_pretrained splits (MoE experts) is held whole or as its pieces; a key transformers
    itself does without (``_keys_to_ignore_on_save``, ``_keys_to_ignore_on_load_missing``) is not required. Tensors
    the model has no place for are not judged here (a user's buffers, a hub release's multi-token-prediction
    layers: the writers say what they keep). Empty where transformers cannot build the model."""
    config = config if config is not None else ckpt.config
    model = stored_model(config)
    if model is None:
        return []
    said = f"the {model.cls} {'its config describes' if (config or {}).get('architectures') else 'transformers builds from its config'}"
    out = []
    for n, t in ckpt.model.items():
        if n in model.shapes and tuple(t.spec.shape) != model.shapes[n]:
            out.append(Disagreement(said, n, tuple(t.spec.shape), model.shapes[n], t.origin))
        elif n in model.floating and not t.spec.is_floating_point:
            out.append(Disagreement(said, n, tuple(t.spec.shape), model.shapes[n], t.origin, t.spec.dtype_name))
    tied = {n: set(group) for group in tied_groups(config) for n in group}

    def held(name: str) -> bool:
        return name in ckpt.model or any(m in ckpt.model for m in tied.get(name, ()))

    return out + [Disagreement(said, n, None, model.shapes.get(n, ()), "") for ways in model.required
                  if not any(all(held(n) for n in way) for way in ways) for n in ways[0] if not held(n)]


def _in(name: str, origin: str) -> str:
    """Where tensor ``name`` was read: its file where its origin is one (``file:key``), else the origin itself."""
    if origin.endswith(f":{name}"):
        return f" in {origin[: -len(name) - 1]}"
    return f" ({origin})" if origin and origin != "memory" else ""


def _optimizer_problems(ckpt: LogicalCheckpoint, flat: str | None = None) -> list[str]:
    """Every moment (a state key torch keeps in its parameter's shape) is its parameter's shape and floating, and a
    parameter with state has every moment the checkpoint keeps (DeepSpeed and Megatron lay them out flat beside
    the parameter; a missing one would be zeros, a scalar one broadcast). For such a target (``flat``: its name)
    every state tensor but a scalar is a moment: a factored optimizer's state has no place there."""
    opt = ckpt.optimizer
    if opt is None or not opt.tensors:
        return []
    moments = sorted(optimizer_class.moments(opt.cls, opt.param_groups) & set(opt.tensors))
    out: list[str] = []
    for key in sorted(set(opt.tensors) - set(moments)) if flat else ():
        wrong = next(((n, t) for n, t in opt.tensors[key].items() if t.spec.shape and n in ckpt.model
                      and tuple(t.spec.shape) != tuple(ckpt.model[n].spec.shape)), None)
        if wrong is not None:
            n, t = wrong
            out.append(f"{flat} lays each parameter's optimizer state out as the parameter; {opt.cls}'s {key} of {n} is "
                       f"{list(t.spec.shape)}, the parameter {list(ckpt.model[n].spec.shape)} (a factored optimizer's "
                       "state); convert to universal, accelerate, dcp or hf-trainer, which keep torch's state as it is")
    for key in moments:
        for name, t in opt.tensors[key].items():
            param = ckpt.model.get(name)
            if param is None:
                continue
            if tuple(t.spec.shape) != tuple(param.spec.shape) or (param.spec.is_floating_point and not t.spec.is_floating_point):
                out.append(f"optimizer state {key} of {name} is {t.spec.dtype_name}{list(t.spec.shape)}{_in(name, t.origin)}, "
                           f"but the parameter is {param.spec.dtype_name}{list(param.spec.shape)}")
    with_state = {n for k in moments for n in opt.tensors[k]}
    for name in sorted(with_state & set(ckpt.model)):
        lacking = [k for k in moments if name not in opt.tensors[k]]
        if lacking:
            held = [k for k in moments if k not in lacking]
            out.append(f"optimizer state of {name}: {', '.join(held)} but no {', '.join(lacking)}")
    return out


def _step_problem(what: str, value: Any) -> str | None:
    """A count of steps is a whole number from 0 to 2**53 (a JSON number that stays exact); NaN, a negative or a
    fractional one is no step a run took (the manifest would refuse it after the output was written)."""
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        return f"{what} is {value!r}, not a number of steps"
    if not math.isfinite(v) or v < 0 or v != int(v) or v > 2 ** 53:
        return f"{what} is {value!r}, not a number of steps a run took"
    return None


def _step_problems(ckpt: LogicalCheckpoint, optimizer: bool) -> list[str]:
    found = [_step_problem("the checkpoint's step", ckpt.step)] if ckpt.step is not None else []
    if optimizer and ckpt.optimizer is not None:
        steps = ckpt.optimizer.scalars.get("step", {})
        found += [next((p for n, s in steps.items() for p in [_step_problem(f"optimizer step of {n}", (s or {}).get("value"))] if p), None)]
    return [p for p in found if p]


def problems(ckpt: LogicalCheckpoint, optimizer: bool = True, flat: str | None = None) -> list[str]:
    """What makes ``ckpt`` unfit to write, one line each: its experts' problems in the experts' own words (which
    expert of which layer) where it has any, else every tensor that is not the model's and (``optimizer``: for a
    target that keeps optimizer state) every optimizer moment that is not its parameter's."""
    found = experts.problems(ckpt)
    if found:
        return found
    for d in disagreements(ckpt):
        if d.shape is None:
            found.append(f"{d.name}: missing; {d.model} has it (a model loaded from the output would have it initialised at random)")
        elif d.dtype:
            found.append(f"{d.name} is {d.dtype}{_in(d.name, d.origin)}, but {d.model} has a floating-point tensor there")
        else:
            found.append(f"{d.name} is {list(d.shape)}{_in(d.name, d.origin)}, but {d.model} has {list(d.wanted)}")
    return found + _step_problems(ckpt, optimizer) + (_optimizer_problems(ckpt, flat) if optimizer else [])


def check(ckpt: LogicalCheckpoint, destination: str, optimizer: bool = True, flat: str | None = None) -> None:
    """Refuse to write ``destination`` from a checkpoint with any of ``problems``, naming the first."""
    found = problems(ckpt, optimizer, flat)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ConversionError(f"{destination}: not written: {found[0]}{more}")
