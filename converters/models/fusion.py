"""Weights stored one way on disk and held another way in the module: a MoE layer's experts, one tensor per
expert in the files, stacked (gate and up concatenated) into one module tensor per layer. Which stored keys
make which module tensor, and how, is transformers' own conversion mapping (the ``WeightConverter``s
``from_pretrained`` applies, matched by transformers' own ``rename_source_key``).

Where transformers' reversed operations only cut their input into views (chunk, unbind, squeeze: every MoE
model it knows today whose experts are stored one tensor each), they are run once on the meta device and what they do is kept as data: where each
stored tensor lies in the module tensor (:class:`View`, kept with the model's answers). Splitting and fusing
are then slicing and copying, without importing transformers (seconds) or building the model; an expert that
is one run of the module tensor's bytes is copied file to file. Other operations (an interleave) run as
transformers wrote them, on the values.

Why not transformers' loader itself: it fuses a whole model in memory while loading it; converters stream
one tensor at a time and also carry each weight's optimizer state through the same fusion.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Callable

from interop.lazy_import import torch

from interop.errors import ConversionError
from interop.logical import LogicalCheckpoint, OptimizerState
from interop.tensors import LazyTensor, Piece, TensorSpec, sub_pieces


def pattern_regex(pattern: str) -> re.Pattern:
    """Where a conversion pattern (``.experts.*.w1.weight``: ``*`` an expert index) lies in a name that
    transformers already matched to it (for the index, ``expert_of``, and the name's prefix and suffix). A pattern
    is a regular expression to transformers, ``*.`` standing for one key component and a name ending on a name
    boundary (WeightTransform compiles its sources so): DeepSeek-V4's are written escaped (``\\.experts.*.w1``)."""
    body = pattern.replace("*.", r"(?P<expert>\d+)\.", 1)
    return re.compile(body + (r"(?!\w)" if re.search(r"[a-zA-Z0-9]$", pattern) else ""))


def expert_of(found: re.Match | None) -> int | None:
    """The expert index a ``pattern_regex`` match found, or None (no match, or a pattern that lists no experts)."""
    return int(found.group("expert")) if found is not None and "expert" in found.re.groupindex else None


def pattern_name(pattern: str, expert: int) -> str:
    """The key a conversion pattern names for ``expert`` (the regular expression's escapes and anchor undone, as
    transformers' own process_target_pattern undoes them)."""
    return pattern.removeprefix("^").replace("*", str(expert)).replace("\\.", ".")


@dataclass(frozen=True)
class Fused:
    """One module tensor made of stored tensors: each placed by its ``views`` entry, or (where transformers'
    operations are no views) by running ``converter`` on ``sources``: ``sources[i]`` the stored names matching
    the converter's i-th source pattern, in expert order."""

    target: str
    views: tuple["View", ...] | None
    converter: Any = None  # transformers' WeightConverter, loading direction, with views None
    sources: tuple[tuple[str, ...], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(v.stored for v in self.views) if self.views is not None else tuple(n for group in self.sources for n in group)


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
        if expert_of(found) is None:  # not a list of experts: another kind of conversion
            ops = ", ".join(type(op).__name__ for op in converter.operations)
            raise ConversionError(f"{name}: transformers converts it into {target} with {ops}, which engine layouts here do "
                                  "not run (only expert lists are fused); convert to universal or hf")
        groups.setdefault(target, {}).setdefault(pattern, {})[expert_of(found)] = name
        owner[target] = converter
    out = []
    for target, by_pattern in groups.items():
        converter = owner[target]
        experts = max(len(by_pattern.get(p, {})) for p in converter.source_patterns)
        for p in converter.source_patterns:
            missing = sorted(set(range(experts)) - set(by_pattern.get(p, {})))
            if missing:
                raise ConversionError(f"{target}: expert {missing[0]} has no {pattern_name(p, missing[0])!r} tensor "
                                      f"({experts} experts elsewhere in the layer); the checkpoint is incomplete")
        out.append(Fused(target, None, converter, tuple(tuple(by_pattern[p][i] for i in range(experts)) for p in converter.source_patterns)))
    return out


def plan_from_views(names: list[str], plans: dict[str, "SplitPlan"]) -> list[Fused]:
    """The fused module tensors ``names`` (stored keys) make, by the kept split plans (every one with views)."""
    present, out = set(names), []
    for target, p in plans.items():
        stored = [v.stored for v in p.views or ()]
        held = sum(n in present for n in stored)
        if held and held < len(stored):
            missing = next(n for n in stored if n not in present)
            found = next((m for m in (pattern_regex(pat).search(missing) for pat in p.patterns) if expert_of(m) is not None), None)
            what = (f"expert {expert_of(found)} has no {missing[found.start():found.end()]!r} tensor" if found
                    else f"no {missing!r} tensor")
            raise ConversionError(f"{target}: {what} (the model's {len(stored) // max(len(p.patterns), 1)} experts make "
                                  f"{list(p.shape)}); the checkpoint is incomplete")
        if held:
            out.append(Fused(target, p.views))
    return out


def parameter_shapes(meta: Any) -> dict[str, tuple[int, ...]]:
    """The module's parameter shapes, what fused tensors are checked against (read once per conversion)."""
    return {n: tuple(p.shape) for n, p in meta.named_parameters()}


def _fused_tensor(fused: Fused, parts: dict[str, LazyTensor], meta: Any, expected: tuple[int, ...] | None) -> LazyTensor:
    """The module tensor ``fused`` makes of ``parts`` (stored name -> tensor), read only when loaded; its shape
    checked against the module's, ``expected`` (an expert missing from every pattern is found here)."""
    first = parts[fused.names[0]]
    if fused.views is not None:
        for v in fused.views:
            part = parts[v.stored]
            if tuple(part.spec.shape) != v.shape or part.spec.dtype != first.spec.dtype:
                raise ConversionError(f"{part.origin}: {part.spec.describe()}, but its place in {fused.target} is "
                                      f"{first.spec.dtype_name}{list(v.shape)}")
        shape = expected

        def load() -> torch.Tensor:
            out = torch.empty(shape, dtype=first.spec.dtype)
            for v in fused.views:
                out.as_strided(v.shape, v.stride, v.offset).copy_(parts[v.stored].load())
            return out

        tiled = sorted(fused.views, key=lambda v: v.offset)
        at = 0
        for v in tiled:  # one run each, one after another: the module tensor's bytes are the stored tensors' in turn
            if not v.contiguous or v.offset != at:
                break
            at += v.numel
        else:
            if shape is not None and at == math.prod(shape):
                runs = [parts[v.stored].reshaped((v.numel,)) for v in tiled]
                return LazyTensor(TensorSpec(shape, first.spec.dtype), load, _fused_origin(fused), parts=lambda: runs)
    else:
        patterns = fused.converter.source_patterns
        empty = {p: [torch.empty(parts[n].spec.shape, dtype=parts[n].spec.dtype, device="meta") for n in group]
                 for p, group in zip(patterns, fused.sources)}
        shape = tuple(next(iter(_run(fused.converter, empty, fused.target, meta).values())).shape)
        if expected is not None and shape != expected:
            raise ConversionError(f"{fused.target}: its {len(fused.sources[0])} experts make {list(shape)}, but the model's "
                                  f"tensor is {list(expected)}: experts are missing from the checkpoint")

        def load() -> torch.Tensor:
            inputs = {p: [parts[n].load() for n in group] for p, group in zip(patterns, fused.sources)}
            return next(iter(_run(fused.converter, inputs, fused.target, meta).values())).contiguous()

    return LazyTensor(TensorSpec(shape, first.spec.dtype), load, _fused_origin(fused))


def _fused_origin(fused: Fused) -> str:
    return f"{fused.target} (fused from {fused.names[0]}...)"


def fuse(ckpt: LogicalCheckpoint, plans: list[Fused], meta: Any, shapes: dict[str, tuple[int, ...]] | None = None) -> LogicalCheckpoint:
    """``ckpt`` (stored names) with each plan's stored tensors replaced by its module tensor: weights, each
    optimizer state tensor, scalars (equal across the experts), param groups, frozen names. The module's shapes
    are ``shapes``, or the meta model's."""
    if not plans:
        return ckpt
    member = {n: f for f in plans for n in f.names}
    shapes = shapes if shapes is not None else parameter_shapes(meta)
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
        opt = OptimizerState(opt.cls_as_read, _groups(opt.param_groups, plans, member), _fused_state(opt.tensors, plans, member, meta, shapes),
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
class View:
    """Where one stored tensor lies in its module tensor: the elements of ``module.as_strided(shape, stride,
    offset)`` (element units, of the module tensor laid out contiguously)."""

    stored: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @property
    def contiguous(self) -> bool:
        """Whether the view is one run of the module tensor's bytes (a file range where the module tensor is one)."""
        expected, step = [], 1
        for size in reversed(self.shape):
            expected.append(step)
            step *= size
        return all(size == 1 or s == e for size, s, e in zip(self.shape, self.stride, reversed(expected)))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def dense(self) -> bool:
        """Whether the view's elements are one run of the module tensor (in some order of its dimensions: a
        transpose of a block is dense), so bounds alone say what it covers."""
        step = 1
        for size, stride in sorted(((sz, st) for sz, st in zip(self.shape, self.stride) if sz != 1), key=lambda d: d[1]):
            if stride != step:
                return False
            step *= size
        return True


@dataclass(frozen=True)
class SplitPlan:
    """How save_pretrained splits one module tensor (what the kept answers say of it): its shape, the stored
    patterns its converter fuses (``.experts.*.w1.weight``, ...) and where each stored tensor lies in it (None
    where transformers' operations are no views and must run on the values)."""

    shape: tuple[int, ...]
    patterns: tuple[str, ...]
    views: tuple[View, ...] | None


# what transformers' reverse operations may call and still leave every output a view of their input. A split
# traced through only these is kept as views (data: no transformers needed to apply it); any other call
# (arithmetic, a gather, a copy) and the split runs transformers' operations on the values instead.
_VIEW_CALLS = frozenset({
    "chunk", "split", "split_with_sizes", "tensor_split", "unbind", "narrow", "select", "__getitem__", "transpose",
    "swapaxes", "swapdims", "permute", "movedim", "t", "view", "reshape", "squeeze", "unsqueeze", "flatten",
    "unflatten", "size", "dim", "numel", "stride", "storage_offset", "is_contiguous", "__get__", "__len__",
    "_set_grad_enabled", "is_grad_enabled",
})


def placed(name: str, reverse: Any) -> tuple[str, str, str]:
    """The reversed converter's source pattern (a module tensor's) and ``name``'s text before and after it."""
    if len(reverse.source_patterns) != 1:
        raise ConversionError(f"{name}: transformers stores it joined with other module tensors "
                              f"({', '.join(reverse.source_patterns)}); a checkpoint of the module's tensors is not "
                              "joined into that here")
    (pattern,) = reverse.source_patterns
    found = pattern_regex(pattern).search(name)
    if found is None:
        raise ConversionError(f"{name}: transformers' pattern {pattern!r} does not place it; convert to universal or hf")
    return pattern, name[:found.start()], name[found.end():]


def trace(name: str, reverse: Any, shape: tuple[int, ...], meta: Any) -> list[tuple[str, View]] | None:
    """What transformers' reversed converter does to module tensor ``name`` of ``shape``, as data: for each key of
    its output, where that output lies in the input (a View, its ``stored`` the key). Found by running it on a meta
    tensor with copies made no-ops (``contiguous``, ``clone``: they change no value), so each output is a view
    whose strides and offset say which elements it holds. None where a call is not a view, or the outputs are
    not the whole tensor once (the operations then run on the values)."""
    from torch.overrides import TorchFunctionMode

    class Traced(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.other: set[str] = set()  # calls that are not views

        def __torch_function__(self, func, types, args=(), kwargs=None):
            called = getattr(func, "__name__", "")
            if called in ("contiguous", "clone") and args and isinstance(args[0], torch.Tensor):
                return args[0]
            if called not in _VIEW_CALLS:
                self.other.add(called)
            return func(*args, **(kwargs or {}))

    root, mode = torch.empty(shape, device="meta"), Traced()
    try:
        pattern = placed(name, reverse)[0]
        with mode:
            out = _run(reverse, {pattern: root}, name, meta)
    except ConversionError:
        return None  # the values path runs the operations as they are and says what fails
    if mode.other or not all(isinstance(t, torch.Tensor) and (t is root or t._base is root) for t in out.values()):
        return None
    views = [(key, View(key, tuple(t.shape), tuple(t.stride()), t.storage_offset())) for key, t in out.items()]
    return views if tiles(shape, [v for _, v in views]) else None


def tiles(shape: tuple[int, ...], views: list[View]) -> bool:
    """Whether ``views`` hold every element of a tensor of ``shape`` exactly once (then they also say how the
    stored tensors fuse back). Runs of bytes are checked by their bounds; other views by counting (torch)."""
    numel = math.prod(shape)
    if not views or sum(v.numel for v in views) != numel:
        return False
    for v in views:
        if (v.offset < 0 or len(v.shape) != len(v.stride) or any(x < 0 for x in (*v.shape, *v.stride))
                or any(st == 0 and n > 1 for n, st in zip(v.shape, v.stride))  # an element held twice by one view
                or (v.numel and v.offset + sum((n - 1) * st for n, st in zip(v.shape, v.stride)) >= numel)):
            return False
    if all(v.dense for v in views):
        at = 0
        for lo, hi in sorted((v.offset, v.offset + v.numel) for v in views if v.numel):
            if lo != at:
                return False
            at = hi
        return at == numel
    count = torch.zeros(numel, dtype=torch.uint8)  # as many elements as the views hold, so no element can
    try:  # wrap around to 1 without another being left at 0
        for v in views:
            count.as_strided(v.shape, v.stride, v.offset).add_(1)
    except RuntimeError:  # a view that holds one element twice (torch refuses to add through it)
        return False
    return bool((count == 1).all())


@dataclass(frozen=True)
class Split:
    """A module tensor read back as its stored pieces: by ``views`` (where each lies in it, a tensor of
    ``shape``), or, where transformers' operations are no views, by running ``reverse`` on the values (``keys``
    maps each stored name to its key in the output)."""

    source: str
    views: tuple[View, ...] | None
    shape: tuple[int, ...] | None = None  # with views
    reverse: Any = None  # the WeightConverter reversed (transformers' reverse_transform), with views None
    keys: tuple[tuple[str, str], ...] = ()  # (stored name, key in the reverse output)

    @property
    def stored(self) -> list[str]:
        return [v.stored for v in self.views] if self.views is not None else [n for n, _ in self.keys]


def plan_split(name: str, reverse: Any, spec: TensorSpec, to_stored: Callable[[str], str], meta: Any) -> Split:
    """How module tensor ``name`` (matched by transformers to the reversed converter ``reverse``) splits into
    stored tensors by running the reverse operations, from their run on a meta tensor of its shape."""
    pattern, prefix, suffix = placed(name, reverse)
    out = _run(reverse, {pattern: torch.empty(spec.shape, dtype=spec.dtype, device="meta")}, name, meta)
    return Split(name, None, None, reverse, tuple((to_stored(prefix + key + suffix), key) for key in out))


def _split_tensor(s: Split, t: LazyTensor, meta: Any) -> dict[str, LazyTensor]:
    """``t`` (module tensor ``s.source``, or an optimizer state laid out like it) as its stored pieces. A view that
    is one run of ``t``'s bytes is also offered as that range of ``t``'s mapped pieces (copied file to file)."""
    if s.views is not None:
        if tuple(t.spec.shape) != s.shape:
            raise ConversionError(f"{t.origin}: {t.spec.describe()}, but {s.source} is {list(s.shape)}: it does not split "
                                  "into the stored tensors as the module tensor does")

        def cut(full: torch.Tensor) -> dict[str, torch.Tensor]:
            return {v.stored: full.as_strided(v.shape, v.stride, v.offset) for v in s.views}

        specs = {v.stored: TensorSpec(v.shape, dtype_name=t.spec.dtype_name) for v in s.views}
    else:
        (pattern,) = s.reverse.source_patterns

        def cut(full: torch.Tensor) -> dict[str, torch.Tensor]:
            out = _run(s.reverse, {pattern: full}, s.source, meta)
            return {stored: out[key] for stored, key in s.keys}

        shapes = cut(torch.empty(t.spec.shape, dtype=t.spec.dtype, device="meta"))
        specs = {stored: TensorSpec(tuple(x.shape), x.dtype) for stored, x in shapes.items()}
    cache: dict[str, Any] = {}

    def piece(stored: str) -> torch.Tensor:
        """One stored piece (its own copy). The module tensor is read and split once for a pass over its pieces,
        and dropped when the pass has taken each: a later read of a piece reads it again."""
        if not cache.get("left"):
            cache["out"], cache["left"] = cut(t.load()), set(specs)
        tensor = cache["out"][stored].clone(memory_format=torch.contiguous_format)
        cache["left"].discard(stored)
        if not cache["left"]:
            cache.clear()
        return tensor

    whole: dict[str, list[Piece] | None] = {}  # t's mapped pieces, found once for all its views

    def ranged(v: View) -> Callable[[], list[Piece] | None] | None:
        if t.mapped_pieces is None or t.digest is not None or not v.contiguous:
            return None  # a digest covers the whole tensor: a part of it cannot be checked alone
        size = t.spec.nbytes // max(t.spec.numel, 1)

        def mapped() -> list[Piece] | None:
            if "pieces" not in whole:
                whole["pieces"] = t.mapped_pieces()
            pieces = whole["pieces"]
            return sub_pieces(pieces, v.offset * size, (v.offset + v.numel) * size) if pieces is not None else None

        return mapped

    views = {v.stored: v for v in s.views or ()}
    return {stored: LazyTensor(spec, lambda stored=stored: piece(stored), f"{s.source} ({stored})",
                               mapped_pieces=ranged(views[stored]) if stored in views else None)
            for stored, spec in specs.items()}


def split(ckpt: LogicalCheckpoint, splits: list[Split], meta: Any) -> LogicalCheckpoint:
    """``ckpt`` (module names) with each fused module tensor, and its optimizer state, back as stored pieces
    (``meta``, the meta model, is needed only by splits without views)."""
    if not splits:
        return ckpt
    by_source = {s.source: s for s in splits}

    def pieces(per: dict[str, LazyTensor]) -> dict[str, LazyTensor]:
        out = {n: t for n, t in per.items() if n not in by_source}
        for name, t in per.items():
            if name in by_source:
                out.update(_split_tensor(by_source[name], t, meta))
        return out

    names = {s.source: s.stored for s in splits}
    opt = ckpt.optimizer
    if opt is not None:
        opt = OptimizerState(
            opt.cls_as_read, [{**g, "params": [p for n in g.get("params", []) for p in names.get(n, [n])]} for g in opt.param_groups],
            {k: pieces(per) for k, per in opt.tensors.items()},
            {k: {p: v for n, v in per.items() for p in names.get(n, [n])} for k, per in opt.scalars.items()},
        )
    frozen = [p for n in ckpt.frozen for p in names.get(n, [n])]
    return replace(ckpt, model=pieces(ckpt.model), optimizer=opt, frozen=frozen)
