"""Weights stored one way on disk and held another way in the module: a MoE layer's experts, one tensor per
expert in the files, stacked (gate and up concatenated) into one module tensor per layer. Which stored keys
make which module tensor, and how, is transformers' own conversion mapping (the ``WeightConverter``s
``from_pretrained`` applies, matched by transformers' own ``rename_source_key``); this module runs exactly
those operations, lazily, one module tensor at a time, in both directions, on the weights and on every
optimizer state tensor laid out like them.

Why not transformers' loader itself: it fuses a whole model in memory while loading it; converters stream
one tensor at a time and also carry each weight's optimizer state through the same fusion.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Callable

from interop.lazy_import import torch

from interop.errors import ConversionError
from interop.logical import LogicalCheckpoint, OptimizerState
from interop.tensors import LazyTensor, TensorSpec


def pattern_regex(pattern: str) -> re.Pattern:
    """Where a conversion pattern (``.experts.*.w1.weight``: ``*`` an expert index) lies in a name that
    transformers already matched to it (for the index and the name's prefix and suffix)."""
    return re.compile(re.escape(pattern).replace(r"\*", r"(\d+)") + r"(?!\w)")


@dataclass(frozen=True)
class Fused:
    """One module tensor made of stored tensors: ``sources[i]`` are the stored names matching the converter's
    i-th source pattern, in expert order."""

    target: str
    converter: Any  # transformers' WeightConverter, loading direction
    sources: tuple[tuple[str, ...], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for group in self.sources for n in group)


def _run(converter: Any, inputs: dict[str, Any], target: str, meta: Any) -> dict[str, torch.Tensor]:
    """transformers' operations of ``converter`` on ``inputs``, given what its own loader gives them (the model,
    here the meta one, and its config); a failure is one line naming the tensor."""
    out, op = inputs, None
    try:
        for op in converter.operations:
            out = op.convert(out, source_patterns=converter.source_patterns, target_patterns=converter.target_patterns,
                             full_layer_name=target, model=meta, config=meta.config, missing_keys=set())
    except Exception as exc:  # noqa: BLE001 - any failure of transformers' operation means the same here
        raise ConversionError(f"{target}: transformers' {type(op).__name__} cannot convert it ({exc})") from None
    return out


def plan(names: list[str], matched: Callable[[str], tuple[str, str | None]], converters: list[Any]) -> list[Fused]:
    """The fused module tensors ``names`` (stored keys) make: ``matched(name)`` is transformers' renaming of a
    stored key (module name, the converter source pattern it matched or None)."""
    groups: dict[str, dict[str, dict[int, str]]] = {}
    owner: dict[str, Any] = {}
    for name in names:
        target, pattern = matched(name)
        if pattern is None:
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        found = pattern_regex(pattern).search(name)
        if found is None or not found.groups():  # not a list of experts: another kind of conversion
            ops = ", ".join(type(op).__name__ for op in converter.operations)
            raise ConversionError(f"{name}: transformers converts it into {target} with {ops}, which engine layouts here do "
                                  "not run (only expert lists are fused); convert to universal or hf")
        groups.setdefault(target, {}).setdefault(pattern, {})[int(found.group(1))] = name
        owner[target] = converter
    out = []
    for target, by_pattern in groups.items():
        converter = owner[target]
        experts = max(len(by_pattern.get(p, {})) for p in converter.source_patterns)
        for p in converter.source_patterns:
            missing = sorted(set(range(experts)) - set(by_pattern.get(p, {})))
            if missing:
                raise ConversionError(f"{target}: expert {missing[0]} has no {p.replace('*', str(missing[0]))!r} tensor "
                                      f"({experts} experts elsewhere in the layer); the checkpoint is incomplete")
        out.append(Fused(target, converter, tuple(tuple(by_pattern[p][i] for i in range(experts)) for p in converter.source_patterns)))
    return out


def parameter_shapes(meta: Any) -> dict[str, tuple[int, ...]]:
    """The module's parameter shapes, what fused tensors are checked against (read once per conversion)."""
    return {n: tuple(p.shape) for n, p in meta.named_parameters()}


def _fused_tensor(fused: Fused, parts: dict[str, LazyTensor], meta: Any, expected: tuple[int, ...] | None) -> LazyTensor:
    """The module tensor ``fused`` makes of ``parts`` (stored name -> tensor), read only when loaded; its shape
    checked against the module's, ``expected`` (an expert missing from every pattern is found here)."""
    patterns = fused.converter.source_patterns
    empty = {p: [torch.empty(parts[n].spec.shape, dtype=parts[n].spec.dtype, device="meta") for n in group]
             for p, group in zip(patterns, fused.sources)}
    shape = tuple(next(iter(_run(fused.converter, empty, fused.target, meta).values())).shape)
    if expected is not None and shape != expected:
        raise ConversionError(f"{fused.target}: its {len(fused.sources[0])} experts make {list(shape)}, but the model's "
                              f"tensor is {list(expected)}: experts are missing from the checkpoint")
    dtype = parts[fused.sources[0][0]].spec.dtype

    def load() -> torch.Tensor:
        inputs = {p: [parts[n].load() for n in group] for p, group in zip(patterns, fused.sources)}
        return next(iter(_run(fused.converter, inputs, fused.target, meta).values())).contiguous()

    return LazyTensor(TensorSpec(shape, dtype), load, f"{fused.target} (fused from {fused.sources[0][0]}...)")


def fuse(ckpt: LogicalCheckpoint, plans: list[Fused], meta: Any) -> LogicalCheckpoint:
    """``ckpt`` (stored names) with each plan's stored tensors replaced by its module tensor: weights, each
    optimizer state tensor, scalars (equal across the experts), param groups, frozen names."""
    if not plans:
        return ckpt
    member = {n: f for f in plans for n in f.names}
    shapes = parameter_shapes(meta)
    model = {n: t for n, t in ckpt.model.items() if n not in member}
    for f in plans:
        if all(n in ckpt.model for n in f.names):
            model[f.target] = _fused_tensor(f, ckpt.model, meta, shapes.get(f.target))
    for group in ckpt.tied:
        if any(n in member for n in group):
            raise ConversionError(f"{next(n for n in group if n in member)} is tied and fused into an expert tensor; no engine layout holds that")
    frozen_set = set(ckpt.frozen)
    frozen = [n for n in ckpt.frozen if n not in member]
    for f in plans:
        held = [n in frozen_set for n in f.names]
        if any(held) and not all(held):
            raise ConversionError(f"{f.target}: some of its experts are frozen and some not; one module tensor cannot be both")
        if all(held):
            frozen.append(f.target)
    opt = ckpt.optimizer
    if opt is not None:
        opt = OptimizerState(opt.cls, _groups(opt.param_groups, plans, member), _fused_state(opt.tensors, plans, member, meta, shapes),
                             _fused_scalars(opt.scalars, plans, member))
    return replace(ckpt, model=model, optimizer=opt, frozen=frozen)


def _groups(groups: list[dict[str, Any]], plans: list[Fused], member: dict[str, Fused]) -> list[dict[str, Any]]:
    out, first = [], {f.names[0] for f in plans}
    for g in groups:
        params = g.get("params", [])
        inside = set(params)
        for f in {member[n].target: member[n] for n in params if n in member}.values():
            if not all(n in inside for n in f.names):
                raise ConversionError(f"{f.target}: its experts are in different optimizer groups; one module tensor is in one")
        out.append({**g, "params": [member[n].target if n in first else n for n in params if n in first or n not in member]})
    return out


def _fused_state(tensors: dict[str, dict[str, LazyTensor]], plans: list[Fused], member: dict[str, Fused],
                 meta: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, dict[str, LazyTensor]]:
    out = {}
    for key, per in tensors.items():
        kept = {n: t for n, t in per.items() if n not in member}
        for f in plans:
            held = sum(n in per for n in f.names)
            if held == len(f.names):
                kept[f.target] = _fused_tensor(f, per, meta, shapes.get(f.target))
            elif held:
                raise ConversionError(f"{f.target}: optimizer state {key!r} exists for {held} of its {len(f.names)} expert tensors only")
        out[key] = kept
    return out


def _fused_scalars(scalars: dict[str, dict[str, dict[str, Any]]], plans: list[Fused],
                   member: dict[str, Fused]) -> dict[str, dict[str, dict[str, Any]]]:
    out = {}
    for key, per in scalars.items():
        kept = {n: v for n, v in per.items() if n not in member}
        for f in plans:
            values = [per[n] for n in f.names if n in per]
            if 0 < len(values) < len(f.names):
                raise ConversionError(f"{f.target}: optimizer {key!r} exists for {len(values)} of its {len(f.names)} expert tensors only")
            if any(v != values[0] for v in values):
                raise ConversionError(f"{f.target}: its experts' optimizer {key!r} differ ({values[0]} vs "
                                      f"{next(v for v in values if v != values[0])}); one module tensor has one")
            if values:
                kept[f.target] = values[0]
        out[key] = kept
    return out


@dataclass(frozen=True)
class Split:
    """A module tensor read back as its stored pieces: ``pieces`` maps each stored name to its key in the
    reverse operations' output."""

    source: str
    reverse: Any  # the WeightConverter reversed (transformers' reverse_transform)
    pieces: tuple[tuple[str, str], ...]  # (stored name, key in the reverse output)


def plan_split(name: str, reverse: Any, spec: TensorSpec, to_stored: Callable[[str], str], meta: Any) -> Split:
    """How module tensor ``name`` (matched by transformers to the reversed converter ``reverse``) splits into
    stored tensors, from the reverse operations run on a meta tensor of its shape."""
    (target_pattern,) = reverse.source_patterns
    found = pattern_regex(target_pattern).search(name)
    if found is None:
        raise ConversionError(f"{name}: transformers' pattern {target_pattern!r} does not place it; convert to universal or hf")
    prefix, suffix = name[:found.start()], name[found.end():]
    out = _run(reverse, {target_pattern: torch.empty(spec.shape, dtype=spec.dtype, device="meta")}, name, meta)
    return Split(name, reverse, tuple((to_stored(prefix + key + suffix), key) for key in out))


def split(ckpt: LogicalCheckpoint, splits: list[Split], meta: Any) -> LogicalCheckpoint:
    """``ckpt`` (module names) with each fused module tensor, and its optimizer state, back as stored pieces."""
    if not splits:
        return ckpt
    by_source = {s.source: s for s in splits}

    def pieces(per: dict[str, LazyTensor]) -> dict[str, LazyTensor]:
        out = {n: t for n, t in per.items() if n not in by_source}
        for name, t in per.items():
            s = by_source.get(name)
            if s is None:
                continue
            (pattern,) = s.reverse.source_patterns
            cache: dict[str, Any] = {}

            def piece(key: str, t=t, s=s, pattern=pattern, cache=cache) -> torch.Tensor:
                """One stored piece (its own copy). The module tensor is read and split once for a pass over its
                pieces, and dropped when the pass has taken each: a later read of a piece reads it again."""
                if not cache.get("left"):
                    cache["out"], cache["left"] = _run(s.reverse, {pattern: t.load()}, s.source, meta), {k for _, k in s.pieces}
                tensor = cache["out"][key].clone()
                cache["left"].discard(key)
                if not cache["left"]:
                    cache.clear()
                return tensor

            shapes = _run(s.reverse, {pattern: torch.empty(t.spec.shape, dtype=t.spec.dtype, device="meta")}, s.source, meta)
            for stored, key in s.pieces:
                out[stored] = LazyTensor(TensorSpec(tuple(shapes[key].shape), shapes[key].dtype),
                                         lambda key=key, piece=piece: piece(key), f"{s.source} ({key})")
        return out

    names = {s.source: [stored for stored, _ in s.pieces] for s in splits}
    opt = ckpt.optimizer
    if opt is not None:
        opt = OptimizerState(
            opt.cls, [{**g, "params": [p for n in g.get("params", []) for p in names.get(n, [n])]} for g in opt.param_groups],
            {k: pieces(per) for k, per in opt.tensors.items()},
            {k: {p: v for n, v in per.items() for p in names.get(n, [n])} for k, per in opt.scalars.items()},
        )
    frozen = [p for n in ckpt.frozen for p in names.get(n, [n])]
    return replace(ckpt, model=pieces(ckpt.model), optimizer=opt, frozen=frozen)
