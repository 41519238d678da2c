"""A checkpoint whose Hugging Face tensors hold every expert of a layer (GPT-OSS's ``mlp.experts.gate_up_proj``) seen
one expert at a time, and back.

Megatron's formats keep each expert apart (SequentialMLP's ``local_experts.<e>``, an expert-parallel rank's share), so
the Megatron writers see each expert's slice under a name of its own (:func:`.megatron_map.stacked_experts`) and the
readers stack the slices again. A slice is a view of the stacked tensor's bytes (``LazyTensor.flat_slice``: a digest
the source records is checked once, over the whole tensor, before any slice is used); a stack streams its slices one
after another (``interop.tensors.concat``). Optimizer state follows its parameter; the step is each slice's.
"""

from __future__ import annotations

import dataclasses

from interop.errors import ConversionError
from interop.logical import LogicalCheckpoint
from interop.tensors import LazyTensor, concat


def _slices(name: str, t: LazyTensor, experts: int) -> list[LazyTensor]:
    shape = t.spec.shape
    if not shape or shape[0] != experts:
        raise ConversionError(f"{name}: {t.spec.describe()} does not hold the model's {experts} experts along its first dimension")
    rows = t.spec.numel // experts
    return [t.flat_slice(e * rows, (e + 1) * rows).reshaped(shape[1:]) for e in range(experts)]


def _stack(name: str, parts: list[LazyTensor]) -> LazyTensor:
    return concat([p.reshaped((1, *p.spec.shape)) for p in parts], parts[0].spec.dtype_name, name)


def per_expert(ckpt: LogicalCheckpoint, stacks: dict[str, list[str]]) -> LogicalCheckpoint:
    """``ckpt`` with each stacked tensor of ``stacks`` (name -> its experts' names) as its experts' slices."""
    if not stacks:
        return ckpt
    model: dict[str, LazyTensor] = {}
    for name, t in ckpt.model.items():
        model.update(zip(stacks[name], _slices(name, t, len(stacks[name]))) if name in stacks else [(name, t)])
    named = ckpt.optimizer.names() if ckpt.optimizer else set()
    opt = ckpt.optimizer and ckpt.optimizer.split_names(
        {n: ps for n, ps in stacks.items() if n in named}, lambda n, t: _slices(n, t, len(stacks[n])))
    return dataclasses.replace(ckpt, model=model, optimizer=opt,
                               frozen=[p for n in ckpt.frozen for p in stacks.get(n, [n])])


def restacked(ckpt: LogicalCheckpoint, stacks: dict[str, list[str]]) -> LogicalCheckpoint:
    """The inverse of :func:`per_expert`: each stack's experts' slices as the one tensor."""
    if not stacks:
        return ckpt
    parts = {p: n for n, ps in stacks.items() for p in ps}
    model: dict[str, LazyTensor] = {}
    for name, t in ckpt.model.items():
        if name not in parts:
            model[name] = t
        elif name == stacks[parts[name]][0]:
            model[parts[name]] = _stack(parts[name], [ckpt.model[p] for p in stacks[parts[name]]])
    named = ckpt.optimizer.names() if ckpt.optimizer else set()
    opt = ckpt.optimizer and ckpt.optimizer.joined_names({n: ps for n, ps in stacks.items() if named.intersection(ps)}, _stack)
    frozen = [parts.get(p, p) for p in ckpt.frozen if p not in parts or p == stacks[parts[p]][0]]
    return dataclasses.replace(ckpt, model=model, optimizer=opt, frozen=frozen)
