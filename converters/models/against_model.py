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
from .facts import mtp_disagreements, past_layers, stored_model, tied_groups


@dataclass(frozen=True)
class Disagreement:
    """A tensor that is not the model's."""

    model: str  # "the LlamaForCausalLM its config describes"
    name: str
    shape: tuple[int, ...] | None  # the checkpoint's; None: it lacks the tensor
    wanted: tuple[int, ...]
    origin: str
    dtype: str = ""  # the checkpoint's, where its kind is the problem (an integer tensor for a floating one)
    why: str = ""  # what else is wrong (a multi-token-prediction layer's experts that do not stack)


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

    out += [Disagreement(said, n, None, model.shapes.get(n, ()), "") for ways in model.required
            if not any(all(held(n) for n in way) for way in ways) for n in ways[0] if not held(n)]
    # (only tensors in layers past the module's own: anything else a checkpoint holds beyond the model, a buffer of
    # a user's, must not cost building the model)
    beyond = {n: (tuple(ckpt.model[n].spec.shape), ckpt.model[n].spec.dtype_name) for n in past_layers(ckpt, config)}
    mtp = f"transformers' MtpModel of {said}"
    return out + [Disagreement(mtp, d.name, d.shape, d.wanted, ckpt.model[d.name].origin if d.name in ckpt.model else "", d.dtype, d.why)
                  for d in mtp_disagreements(config, beyond)]


def _in(name: str, origin: str) -> str:
    """Where tensor ``name`` was read: its file where its origin is one (``file:key``), else the origin itself."""
    if origin.endswith(f":{name}"):
        return f" in {origin[: -len(name) - 1]}"
    return f" ({origin})" if origin and origin != "memory" else ""


def _optimizer_problems(ckpt: LogicalCheckpoint, flat: str | None = None) -> list[str]:
    """Every state tensor the optimizer keeps is the shape it keeps for its parameter under its param group's
    hyperparameters (torch's own answer, :func:`optimizer_class.state_shapes`: Adam's moments the parameter's,
    transformers' Adafactor's row variances its rows) and floating where the parameter is, and a parameter with
    some of that state has all of it that the checkpoint keeps for any (DeepSpeed and Megatron lay moments out
    flat beside the parameter: a missing one would be zeros, a scalar one broadcast; torch's own step crashes on a
    cut one). State keys the optimizer
    does not keep are not judged (an engine's optimizer torch does not know), but for a target (``flat``: its
    name) that lays state out as the parameter, where every state tensor must be the parameter's shape: a factored
    optimizer's state has no place there."""
    opt = ckpt.optimizer
    if opt is None or not opt.tensors:
        return []
    groups = {n: i for i, g in enumerate(opt.param_groups) for n in g.get("params", [])}
    asked: dict[tuple[int, tuple[int, ...]], dict[str, tuple[int, ...]]] = {}  # (group, shape): few of each

    def kept(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        i = groups.get(name, -1)
        if (i, shape) not in asked:
            found = optimizer_class.state_shapes(opt.cls, opt.param_groups[i] if i >= 0 else {}, shape) or {}
            asked[(i, shape)] = {k: s for k, s in found.items() if s}  # (a step is no tensor of its parameter's)
        return asked[(i, shape)]

    held: dict[str, dict[str, Any]] = {}
    for key, per in opt.tensors.items():
        for name, t in per.items():
            if name in ckpt.model:
                held.setdefault(name, {})[key] = t
    out: list[str] = []
    factored: set[str] = set()  # keys already said to have no place in a flat target
    for name, state in held.items():
        param = ckpt.model[name]
        shape = tuple(param.spec.shape)
        want = kept(name, shape)
        for key, t in sorted(state.items()):
            got = tuple(t.spec.shape)
            if key in want and (got != want[key] or (param.spec.is_floating_point and not t.spec.is_floating_point)):
                but = "the parameter is" if want[key] == shape else f"{opt.cls} keeps {list(want[key])} for a parameter of"
                out.append(f"optimizer state {key} of {name} is {t.spec.dtype_name}{list(got)}{_in(name, t.origin)}, "
                           f"but {but} {param.spec.dtype_name}{list(shape)}")
            elif flat and got and got != shape and key not in factored and (key not in want or want[key] != shape):
                factored.add(key)
                out.append(f"{flat} lays each parameter's optimizer state out as the parameter; {opt.cls}'s {key} of {name} is "
                           f"{list(got)}, the parameter {list(shape)} (a factored optimizer's state); convert to universal, "
                           "accelerate, dcp or hf-trainer, which keep torch's state as it is")
        lacking = [k for k in want if k not in state and k in opt.tensors]  # (an optimizer taken for AdamW, Lion, keeps no exp_avg_sq)
        if lacking and any(k in state for k in want):
            out.append(f"optimizer state of {name}: {', '.join(k for k in want if k in state)} but no {', '.join(lacking)}")
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
        if d.why:
            found.append(f"{d.name}: {d.why}, for {d.model}")
        elif d.shape is None:
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
