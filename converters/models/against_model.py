"""A checkpoint held against the model its config describes, as transformers builds it.

A tensor of the wrong size (a damaged or hostile file, a config from another model), a tensor the source lacks or
an optimizer moment of another shape than its parameter's would otherwise convert without a word: every target
writes what it is given, and the consumer finds out later, or never (``from_pretrained`` refuses a wrong-sized
norm but quietly initialises a missing one at random; DeepSpeed's flat partitions shift every later moment by
the extra element). transformers knows each key's shape; nothing is hand-listed here. A model transformers
cannot build is not held against one (its tensors are kept as stored, as the readers say in a note).

Reading does not refuse (``inspect``, ``diff`` and ``verify`` report what is wrong); every writer refuses before
writing anything (``check``, in :mod:`converters.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from interop.errors import ConversionError
from interop.logical import LogicalCheckpoint

from . import experts
from .facts import stored_model, tied_groups


@dataclass(frozen=True)
class Disagreement:
    """A tensor that is not the model's."""

    cls: str  # the transformers class the config builds
    name: str
    shape: tuple[int, ...] | None  # the checkpoint's; None: it lacks the tensor
    wanted: tuple[int, ...]
    origin: str


def disagreements(ckpt: LogicalCheckpoint, config: dict[str, Any] | None = None) -> list[Disagreement]:
    """How ``ckpt`` (universal's names) is not the model ``config`` (its own by default) describes: the tensors of
    another shape, in the source's order, then the tensors it lacks (a tied one is held through its partner; a
    module tensor save_pretrained splits, MoE experts, either whole or as its pieces). Tensors the model has no
    place for are not judged here (a user's buffers, a hub release's multi-token-prediction layers: the writers
    say what they keep). Empty where transformers cannot build the model."""
    config = config if config is not None else ckpt.config
    model = stored_model(config)
    if model is None:
        return []
    out = [Disagreement(model.cls, n, tuple(t.spec.shape), model.shapes[n], t.origin) for n, t in ckpt.model.items()
           if n in model.shapes and tuple(t.spec.shape) != model.shapes[n]]
    tied = {n: set(group) for group in ckpt.tied or tied_groups(config) for n in group}

    def held(name: str) -> bool:
        return name in ckpt.model or any(m in ckpt.model for m in tied.get(name, ()))

    return out + [Disagreement(model.cls, n, None, model.shapes.get(n, ()), "") for ways in model.required
                  if not any(all(held(n) for n in way) for way in ways) for n in ways[0] if not held(n)]


def _in(name: str, origin: str) -> str:
    """Where tensor ``name`` was read: its file where its origin is one (``file:key``), else the origin itself."""
    if origin.endswith(f":{name}"):
        return f" in {origin[: -len(name) - 1]}"
    return f" ({origin})" if origin and origin != "memory" else ""


def _optimizer_problems(ckpt: LogicalCheckpoint) -> list[str]:
    """Every optimizer state tensor but a scalar (a 0-dim step) is its parameter's shape, as torch's optimizers keep
    it and every engine format lays it out (DeepSpeed and Megatron flatten it beside the parameter)."""
    if ckpt.optimizer is None:
        return []
    out = []
    for key, per_name in sorted(ckpt.optimizer.tensors.items()):
        for name, t in per_name.items():
            shape = tuple(t.spec.shape)
            if shape and name in ckpt.model and shape != tuple(ckpt.model[name].spec.shape):
                out.append(f"optimizer state {key} of {name} is {list(shape)}{_in(name, t.origin)}, but the parameter is "
                           f"{list(ckpt.model[name].spec.shape)}")
    return out


def problems(ckpt: LogicalCheckpoint) -> list[str]:
    """What makes ``ckpt`` unfit to write, one line each: its experts' problems in the experts' own words (which
    expert of which layer) where it has any, else every tensor that is not the model's and every optimizer moment
    that is not its parameter's shape."""
    found = experts.problems(ckpt)
    if found:
        return found
    for d in disagreements(ckpt):
        if d.shape is None:
            found.append(f"{d.name}: missing, which the {d.cls} its config describes has (a model loaded from it would "
                         "have it at random)")
        else:
            found.append(f"{d.name} is {list(d.shape)}{_in(d.name, d.origin)}, but the {d.cls} its config describes has "
                         f"{list(d.wanted)}")
    return found + _optimizer_problems(ckpt)


def check(ckpt: LogicalCheckpoint, destination: str) -> None:
    """Refuse to write ``destination`` from a checkpoint with any of ``problems``, naming the first."""
    found = problems(ckpt)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ConversionError(f"{destination}: not written: {found[0]}{more}")
