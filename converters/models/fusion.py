"""Weights stored one way on disk and held another way in the module: a MoE layer's experts, one tensor per
expert in the files, stacked (gate and up concatenated) into one module tensor per layer. Which stored keys
make which module tensor, and how, is transformers' own conversion mapping (the ``WeightConverter``s
``from_pretrained`` applies); this module runs exactly those operations, lazily, one module tensor at a time,
in both directions, on the weights and on every optimizer state tensor laid out like them.

Why not transformers' loader itself: it fuses a whole model in memory while loading it; converters stream
one tensor at a time and also carry each weight's optimizer state through the same fusion.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from interop.errors import ConversionError
from interop.logical import LogicalCheckpoint, OptimizerState
from interop.tensors import LazyTensor, TensorSpec


def pattern_regex(pattern: str) -> re.Pattern:
    """A conversion pattern (``.experts.*.w1.weight``: ``*`` is an expert index) as a regex."""
    return re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))


@dataclass(frozen=True)
class Fused:
    """One module tensor made of stored tensors: ``sources[i]`` are the stored names matching the converter's
    i-th source pattern, in expert order."""

    target: str
    converter: Any  # transformers' WeightConverter, loading direction
    sources: tuple[tuple[str, ...], ...]

    @property
    def names(self) -> list[str]:
        return [n for group in self.sources for n in group]


def _run(converter: Any, inputs: dict[str, Any], target: str, config: Any) -> dict[str, torch.Tensor]:
    out = inputs
    for op in converter.operations:
        out = op.convert(out, source_patterns=converter.source_patterns, target_patterns=converter.target_patterns,
                         full_layer_name=target, config=config)
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
        if found is None or not found.groups():
            raise ConversionError(f"{name}: transformers fuses it into {target}, but its expert index cannot be read from "
                                  f"the pattern {pattern!r}; convert to universal or hf")
        groups.setdefault(target, {}).setdefault(pattern, {})[int(found.group(1))] = name
        owner[target] = converter
    out = []
    for target, by_pattern in groups.items():
        converter = owner[target]
        counts = {p: len(by_pattern.get(p, {})) for p in converter.source_patterns}
        experts = max(counts.values())
        for p in converter.source_patterns:
            missing = sorted(set(range(experts)) - set(by_pattern.get(p, {})))
            if missing:
                raise ConversionError(f"{target}: expert {missing[0]} has no {p.replace('*', str(missing[0]))!r} tensor "
                                      f"({experts} experts elsewhere in the layer); the checkpoint is incomplete")
        out.append(Fused(target, converter, tuple(tuple(by_pattern[p][i] for i in range(experts)) for p in converter.source_patterns)))
    return out


def _fused_tensor(fused: Fused, parts: dict[str, LazyTensor], config: Any) -> LazyTensor:
    """The module tensor ``fused`` makes of ``parts`` (stored name -> tensor), read only when loaded."""
    patterns = fused.converter.source_patterns
    meta = {p: [torch.empty(parts[n].spec.shape, dtype=parts[n].spec.dtype, device="meta") for n in group]
            for p, group in zip(patterns, fused.sources)}
    shape = next(iter(_run(fused.converter, meta, fused.target, config).values()))

    def load() -> torch.Tensor:
        inputs = {p: [parts[n].load() for n in group] for p, group in zip(patterns, fused.sources)}
        return next(iter(_run(fused.converter, inputs, fused.target, config).values())).contiguous()

    return LazyTensor(TensorSpec(tuple(shape.shape), shape.dtype), load, f"{fused.target} (fused from {fused.sources[0][0]}...)")


def fuse(ckpt: LogicalCheckpoint, plans: list[Fused], config: Any) -> LogicalCheckpoint:
    """``ckpt`` (stored names) with each plan's stored tensors replaced by its module tensor: weights, each
    optimizer state tensor, scalars (equal across the experts), param groups, frozen names."""
    if not plans:
        return ckpt
    gone = {n for f in plans for n in f.names}
    model = {n: t for n, t in ckpt.model.items() if n not in gone}
    for f in plans:
        if all(n in ckpt.model for n in f.names):
            model[f.target] = _fused_tensor(f, ckpt.model, config)
    for group in ckpt.tied:
        if gone & set(group):
            raise ConversionError(f"{sorted(gone & set(group))[0]} is tied and fused into an expert tensor; no engine layout holds that")
    frozen = [n for n in ckpt.frozen if n not in gone]
    for f in plans:
        held = [n in ckpt.frozen for n in f.names]
        if any(held) and not all(held):
            raise ConversionError(f"{f.target}: some of its experts are frozen and some not; one module tensor cannot be both")
        if all(held):
            frozen.append(f.target)
    opt = ckpt.optimizer
    if opt is not None:
        opt = OptimizerState(opt.cls, _groups(opt.param_groups, plans), _fused_state(opt.tensors, plans, config),
                             _fused_scalars(opt.scalars, plans))
    return replace(ckpt, model=model, optimizer=opt, frozen=frozen)


def _groups(groups: list[dict[str, Any]], plans: list[Fused]) -> list[dict[str, Any]]:
    first = {f.names[0]: f for f in plans}
    member = {n: f for f in plans for n in f.names}
    out = []
    for g in groups:
        params = g.get("params", [])
        for f in plans:
            inside = [n in params for n in f.names]
            if any(inside) and not all(inside):
                raise ConversionError(f"{f.target}: its experts are in different optimizer groups; one module tensor is in one")
        out.append({**g, "params": [first[n].target if n in first else n for n in params if n in first or n not in member]})
    return out


def _fused_state(tensors: dict[str, dict[str, LazyTensor]], plans: list[Fused], config: Any) -> dict[str, dict[str, LazyTensor]]:
    out = {}
    for key, per in tensors.items():
        kept = {n: t for n, t in per.items() if not any(n in f.names for f in plans)}
        for f in plans:
            held = [n in per for n in f.names]
            if all(held):
                kept[f.target] = _fused_tensor(f, per, config)
            elif any(held):
                raise ConversionError(f"{f.target}: optimizer state {key!r} exists for some of its experts only")
        out[key] = kept
    return out


def _fused_scalars(scalars: dict[str, dict[str, dict[str, Any]]], plans: list[Fused]) -> dict[str, dict[str, dict[str, Any]]]:
    out = {}
    for key, per in scalars.items():
        kept = {n: v for n, v in per.items() if not any(n in f.names for f in plans)}
        for f in plans:
            values = [per[n] for n in f.names if n in per]
            if values and any(v != values[0] for v in values) or 0 < len(values) < len(f.names):
                raise ConversionError(f"{f.target}: its experts' optimizer {key!r} differ ({values[0]} vs others); "
                                      "one module tensor has one")
            if values:
                kept[f.target] = values[0]
        out[key] = kept
    return out


@dataclass(frozen=True)
class Split:
    """A module tensor read back as its stored pieces: ``pieces`` maps each stored name to its index in the
    reverse operations' output."""

    source: str
    reverse: Any  # the WeightConverter reversed (transformers' reverse_transform)
    pieces: tuple[tuple[str, str], ...]  # (stored name, key in the reverse output)


def plan_split(name: str, converter: Any, spec: TensorSpec, to_stored: Callable[[str], str], config: Any) -> Split:
    """How module tensor ``name`` (made by ``converter``) splits into stored tensors, from the reverse
    operations run on a meta tensor of its shape."""
    reverse = converter.reverse_transform()
    (target_pattern,) = reverse.source_patterns
    found = pattern_regex(target_pattern).search(name)
    if found is None:
        raise ConversionError(f"{name}: transformers' pattern {target_pattern!r} does not place it; convert to universal or hf")
    prefix, suffix = name[:found.start()], name[found.end():]
    out = _run(reverse, {target_pattern: torch.empty(spec.shape, dtype=spec.dtype, device="meta")}, name, config)
    return Split(name, reverse, tuple((to_stored(prefix + key + suffix), key) for key in out))


def split(ckpt: LogicalCheckpoint, splits: list[Split], config: Any) -> LogicalCheckpoint:
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
                """One stored piece; the module tensor is read and split once for all its pieces, then dropped."""
                if "out" not in cache:
                    cache["out"], cache["left"] = _run(s.reverse, {pattern: t.load()}, s.source, config), set(dict(s.pieces).values())
                tensor = cache["out"][key].contiguous()
                cache["left"].discard(key)
                if not cache["left"]:
                    cache.clear()
                return tensor

            shapes = _run(s.reverse, {pattern: torch.empty(t.spec.shape, dtype=t.spec.dtype, device="meta")}, s.source, config)
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
