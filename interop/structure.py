"""What a loaded pickle must look like where a reader relies on it: checked once, right after loading, so that a
file holding a value of another type (damaged, hand-edited, or from a version of the engine that wrote another
layout) is one error naming the file and the key, not a TypeError from deep inside the reader.

A spec is a type or tuple of types (``int`` never matches a bool), :class:`Is` (a test), :class:`Keys` (a mapping
with these keys; each required unless :class:`Maybe` or :class:`Absent`), :class:`ListOf`, :class:`TupleOf`,
:class:`MapOf` or :class:`OneOf`. Only what readers use is described; other keys pass unchecked, as the engines'
own loaders ignore them too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from .errors import CorruptCheckpointError


@dataclass(frozen=True)
class Maybe:
    """A key that may be absent, or a value that may be None."""

    spec: Any


@dataclass(frozen=True)
class Absent:
    """A key that may be absent; present, it is ``spec`` (None only if ``spec`` allows it)."""

    spec: Any


@dataclass(frozen=True)
class ListOf:
    """A list or tuple whose every item is ``spec``."""

    spec: Any


@dataclass(frozen=True)
class _Specs:
    """A spec made of several, given one by one."""

    specs: tuple[Any, ...]

    def __init__(self, *specs: Any):
        object.__setattr__(self, "specs", specs)


class TupleOf(_Specs):
    """A list or tuple of exactly these items (``random.getstate()``'s triple)."""


@dataclass(frozen=True)
class MapOf:
    """A mapping whose every key is ``key`` and every value ``value``."""

    key: Any
    value: Any


class OneOf(_Specs):
    """A value that is any of these specs."""


@dataclass(frozen=True)
class Is:
    """A value ``test`` accepts (a tensor of either kind, without importing torch to ask), called ``name``."""

    test: Callable[[Any], bool]
    name: str


class Keys(dict):
    """A mapping holding these keys, each value its spec (wrap in :class:`Maybe` for a key that may be absent)."""


def check(path: str, value: Any, spec: Any, where: str = "") -> None:
    """Raise :class:`CorruptCheckpointError` naming ``path`` and the key path where ``value`` is not ``spec``."""
    if _ok(value, spec):  # the common case, without building a single key path
        return
    problem = _problem(value, spec, where)
    if problem is not None:
        at, found, wanted = problem
        raise CorruptCheckpointError(path, f"{at or 'its top level'} is {found}, not {wanted}")


def _ok(value: Any, spec: Any) -> bool:
    """Whether ``value`` is ``spec``: :func:`_problem`'s answer without its message, by a test built once per spec
    (an optimizer's state is checked entry by entry: tens of thousands for a large MoE)."""
    return _test(spec)(value)


_tests: dict[int, tuple[Any, Callable[[Any], bool]]] = {}  # id(spec) -> (the spec, kept alive; its test)


def _test(spec: Any) -> Callable[[Any], bool]:
    hit = _tests.get(id(spec))
    if hit is None or hit[0] is not spec:
        hit = _tests[id(spec)] = (spec, _built(spec))
    return hit[1]


def _built(spec: Any) -> Callable[[Any], bool]:
    if isinstance(spec, Maybe):
        inner = _test(spec.spec)
        return lambda v: v is None or inner(v)
    if isinstance(spec, Absent):
        return _test(spec.spec)
    if isinstance(spec, OneOf):
        tests = [_test(s) for s in spec.specs]
        return lambda v: any(t(v) for t in tests)
    if isinstance(spec, Keys):
        items = [(k, _test(sub), isinstance(sub, (Maybe, Absent))) for k, sub in spec.items()]
        return lambda v: isinstance(v, Mapping) and all(t(v[k]) if k in v else optional for k, t, optional in items)
    if isinstance(spec, TupleOf):
        tests = [_test(s) for s in spec.specs]
        return lambda v: isinstance(v, (list, tuple)) and len(v) == len(tests) and all(t(x) for t, x in zip(tests, v))
    if isinstance(spec, ListOf):
        item = _test(spec.spec)
        return lambda v: isinstance(v, (list, tuple)) and all(map(item, v))
    if isinstance(spec, MapOf):
        key, value = _test(spec.key), _test(spec.value)
        return lambda v: isinstance(v, Mapping) and all(map(key, v.keys())) and all(map(value, v.values()))
    if isinstance(spec, Is):
        return spec.test
    types = spec if isinstance(spec, tuple) else (spec,)
    if bool in types or not any(issubclass(bool, t) for t in types):
        return lambda v: isinstance(v, types)
    return lambda v: isinstance(v, types) and not isinstance(v, bool)


def _problem(value: Any, spec: Any, where: str) -> tuple[str, str, str] | None:
    if isinstance(spec, Maybe):
        return None if value is None else _problem(value, spec.spec, where)
    if isinstance(spec, Absent):
        return _problem(value, spec.spec, where)
    if isinstance(spec, OneOf):
        if any(_ok(value, s) for s in spec.specs):
            return None
        problems = [_problem(value, s, where) for s in spec.specs]
        deepest = max(problems, key=lambda p: len(p[0]))  # an alternative of the value's own kind, wrong inside
        return deepest if len(deepest[0]) > len(where) else (where, _kind(value), _describe(spec))
    if isinstance(spec, Keys):
        if not isinstance(value, Mapping):
            return where, _kind(value), "a map"
        for key, sub in spec.items():
            if key not in value:
                if isinstance(sub, (Maybe, Absent)):
                    continue
                return _join(where, key), "absent", _describe(sub)
            problem = _problem(value[key], sub, _join(where, key))
            if problem is not None:
                return problem
        return None
    if isinstance(spec, TupleOf):
        if not isinstance(value, (list, tuple)) or len(value) != len(spec.specs):
            return where, _kind(value), _describe(spec)
        for i, (item, sub) in enumerate(zip(value, spec.specs)):
            problem = _problem(item, sub, f"{where}[{i}]")
            if problem is not None:
                return problem
        return None
    if isinstance(spec, ListOf):
        if not isinstance(value, (list, tuple)):
            return where, _kind(value), _describe(spec)
        for i, item in enumerate(value):
            problem = _problem(item, spec.spec, f"{where}[{i}]")
            if problem is not None:
                return problem
        return None
    if isinstance(spec, MapOf):
        if not isinstance(value, Mapping):
            return where, _kind(value), _describe(spec)
        for key, item in value.items():
            if _problem(key, spec.key, where) is not None:
                return f"{where}[{key!r}]", f"keyed by {_kind(key)}", f"keyed by {_describe(spec.key)}"
            problem = _problem(item, spec.value, f"{where}[{key!r}]")
            if problem is not None:
                return problem
        return None
    if spec.test(value) if isinstance(spec, Is) else _is(value, spec):
        return None
    return where, _kind(value), _describe(spec)


def _is(value: Any, types: Any) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types:
        return False
    return isinstance(value, types)


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def _kind(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return "None" if value is None else _a(type(value).__name__)


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _describe(spec: Any) -> str:
    if isinstance(spec, Maybe):
        return _describe(spec.spec) + " or None"
    if isinstance(spec, Absent):
        return _describe(spec.spec)
    if isinstance(spec, OneOf):
        return " or ".join(_describe(s) for s in spec.specs)
    if isinstance(spec, Keys):
        return "a map"
    if isinstance(spec, Is):
        return spec.name
    if isinstance(spec, TupleOf):
        return f"a tuple of {len(spec.specs)} ({', '.join(_describe(s) for s in spec.specs)})"
    if isinstance(spec, ListOf):
        return f"a list of ({_describe(spec.spec)})"
    if isinstance(spec, MapOf):
        return f"a map of ({_describe(spec.value)})"
    types = spec if isinstance(spec, tuple) else (spec,)
    return " or ".join(_a(getattr(t, "__name__", str(t))) for t in types)
