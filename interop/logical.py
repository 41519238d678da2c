"""The logical checkpoint: what every reader produces and every writer consumes.

Every conversion is reader -> LogicalCheckpoint -> writer. Tensors are lazy, so a conversion holds one
tensor at a time. Names are canonical (Hugging Face names of the model family).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from .manifest import ComponentRecord, FileRecord, Manifest
from .tensors import LazyTensor

OPTIM_PREFIX = "optimizer/"


def optim_key(state_key: str, name: str) -> str:
    """Logical key of an optimizer tensor, as used by the manifest, ``inspect`` and ``diff``."""
    return f"{OPTIM_PREFIX}{state_key}/{name}"


def stored_name(key: str) -> str:
    """The name a logical key's tensor has inside its safetensors file (``optim_key`` undone)."""
    return key.split("/", 2)[2] if key.startswith(OPTIM_PREFIX) and key.count("/") >= 2 else key


class DeferredScalars:
    """Optimizer scalars (key -> name -> a function giving ``{value, dtype}``) read when something first asks for
    ``OptimizerState.scalars``. A checkpoint's 0-dim values (AdamW's step per parameter) lie among its tensors (DCP
    writes each parameter's step beside its moments), so reading them means checking nearly every block of the
    file against the manifest: a conversion whose target keeps no optimizer state (--to hf) never pays for it."""

    def __init__(self, readers: dict[str, dict[str, Callable[[], dict[str, Any]]]]):
        self.readers = readers

    def read(self) -> dict[str, dict[str, dict[str, Any]]]:
        return {key: {name: read() for name, read in per.items()} for key, per in self.readers.items()}


class DeferredName:
    """An optimizer's class name told when something first asks for ``OptimizerState.cls``: telling it from a
    torch state dict's param groups builds torch's optimizers, which a conversion whose target keeps no optimizer
    state (--to hf) never imports."""

    def __init__(self, tell: Callable[[], str]):
        self.tell = tell


class _BuiltOnce:
    """A value built on first use; kept only once built, so a failed build fails again where it is next used."""

    def __init__(self, build: Callable[[], Any]):
        self._build: Callable[[], Any] | None = build
        self._value: Any = None

    def _make(self, built: Any) -> Any:
        raise NotImplementedError

    def _built(self) -> Any:
        if self._build is not None:
            self._value = self._make(self._build())
            self._build = None
        return self._value

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._built()!r})"


class DeferredList(_BuiltOnce, Sequence):
    """A per-rank list built when first used: state a target may never keep (an export to Hugging Face keeps no
    RNG) whose values need torch to build, which such a conversion then never imports. A read-only sequence, so
    anything beyond reading it fails loudly rather than seeing it empty."""

    def _make(self, built: Any) -> list[Any]:
        return list(built)

    def __len__(self) -> int:
        return len(self._built())

    def __getitem__(self, index):
        return self._built()[index]

    def __eq__(self, other: object) -> bool:
        return self._built() == (list(other) if isinstance(other, Sequence) and not isinstance(other, str) else other)


class DeferredMapping(_BuiltOnce, Mapping):
    """A read-only mapping built when first used, as :class:`DeferredList` (Megatron's padded vocabulary rows: kept
    for a Megatron target, built with torch, never wanted by a Hugging Face one)."""

    def _make(self, built: Any) -> dict[Any, Any]:
        return dict(built)

    def __getitem__(self, key):
        return self._built()[key]

    def __iter__(self):
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._built())

    def __eq__(self, other: object) -> bool:
        return self._built() == (dict(other) if isinstance(other, Mapping) else other)


@dataclass
class OptimizerState:
    cls: str  # "AdamW"; given as DeferredName, told on first access of the attribute
    param_groups: list[dict[str, Any]]  # hyper-parameters, with "params": [canonical names]
    tensors: dict[str, dict[str, LazyTensor]] = field(default_factory=dict)  # state key -> name -> tensor
    # key -> name -> {value, dtype}; given as DeferredScalars, read on first access of the attribute
    scalars: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if name == "scalars" and isinstance(value, DeferredScalars):
            value = value.read()
            object.__setattr__(self, "scalars", value)
        elif name == "cls" and isinstance(value, DeferredName):
            value = value.tell()
            object.__setattr__(self, "cls", value)
        return value

    def __repr__(self) -> str:
        """What it holds, reading nothing: a repr in a log or a debugger must not read (and check) the scalars."""
        names = {k: len(per) for k, per in (*self.tensors.items(), *self._scalars_by_key().items())}
        cls = object.__getattribute__(self, "cls")
        return f"OptimizerState({'(not yet told)' if isinstance(cls, DeferredName) else cls}, {len(self.param_groups)} param groups, parameters per state key: {names})"

    @property
    def cls_as_read(self) -> "str | DeferredName":
        """The class as its reader gave it, for a copy to carry: a name not yet told stays untold."""
        return object.__getattribute__(self, "cls")

    @property
    def state_keys(self) -> list[str]:
        return sorted(set(self.tensors) | set(self.scalar_keys))

    @property
    def scalar_keys(self) -> list[str]:
        """The scalars' state keys (AdamW's 'step'), reading nothing."""
        return list(self._scalars_by_key())

    def _scalars_by_key(self) -> dict[str, dict[str, Any]]:
        """The scalars' names by key, as read or as readers (nothing is read)."""
        raw = object.__getattribute__(self, "scalars")
        return raw.readers if isinstance(raw, DeferredScalars) else raw

    def names(self) -> set[str]:
        """Every parameter name the optimizer mentions (its groups' and its state's), reading nothing."""
        out = {n for g in self.param_groups for n in g.get("params", [])}
        for per in (*self.tensors.values(), *self._scalars_by_key().values()):
            out |= set(per)
        return out

    def without(self, names: set[str]) -> "OptimizerState":
        """This state less every parameter in ``names`` (groups, state tensors, scalars); scalars not read stay so."""
        raw = object.__getattribute__(self, "scalars")
        scalars = {k: {n: v for n, v in per.items() if n not in names} for k, per in self._scalars_by_key().items()}
        return OptimizerState(
            self.cls_as_read, [{**g, "params": [n for n in g.get("params", []) if n not in names]} for g in self.param_groups],
            {k: {n: t for n, t in per.items() if n not in names} for k, per in self.tensors.items()},
            DeferredScalars(scalars) if isinstance(raw, DeferredScalars) else scalars,
        )

    def split_names(self, parts: dict[str, list[str]], split: Callable[[str, LazyTensor], list[LazyTensor]]) -> "OptimizerState":
        """Each parameter ``n`` of ``parts`` as the parameters ``parts[n]`` (a stack of experts as each expert): in its
        place in the groups, its state tensors as ``split(n, tensor)`` gives them, its scalars (the step) each part's;
        scalars not read stay so."""
        raw = object.__getattribute__(self, "scalars")
        scalars = {k: {p: v for n, v in per.items() for p in parts.get(n, [n])} for k, per in self._scalars_by_key().items()}
        tensors: dict[str, dict[str, LazyTensor]] = {}
        for k, per in self.tensors.items():
            tensors[k] = {}
            for n, t in per.items():
                tensors[k].update(zip(parts[n], split(n, t)) if n in parts else [(n, t)])
        return OptimizerState(
            self.cls_as_read, [{**g, "params": [p for n in g.get("params", []) for p in parts.get(n, [n])]} for g in self.param_groups],
            tensors, DeferredScalars(scalars) if isinstance(raw, DeferredScalars) else scalars,
        )

    def joined_names(self, parts: dict[str, list[str]], join: Callable[[str, list[LazyTensor]], LazyTensor]) -> "OptimizerState":
        """The inverse of :meth:`split_names`: the parameters ``parts[n]`` as the one ``n``, in the first one's place,
        its state tensors ``join(n, [each part's])``, its scalars the parts' one value. Parts that do not make one
        parameter (state for some of them only, other steps, other param groups) are one line naming the stack."""
        from .errors import ConversionError

        raw = object.__getattribute__(self, "scalars")
        deferred = isinstance(raw, DeferredScalars)
        first = {ps[0]: n for n, ps in parts.items()}
        rest = {p for ps in parts.values() for p in ps[1:]}

        def held(n: str, kind: str, per: dict[str, Any]) -> bool:  # all of a stack's parts or none
            have = [p in per for p in parts[n]]
            if any(have) and not all(have):
                raise ConversionError(f"optimizer {kind} of {n}: {parts[n][have.index(False)]} has none, {parts[n][have.index(True)]} has")
            return all(have)

        def one(n: str, values: list[Any]) -> Any:
            if any(v != values[0] for v in values):
                raise ConversionError(f"optimizer state of {n}: its parts hold different values ({values[0]!r}, ...)")
            return values[0]

        group_of = {p: i for i, g in enumerate(self.param_groups) for p in g.get("params", [])}
        for n, ps in parts.items():
            groups = {group_of[p] for p in ps if p in group_of}
            if len(groups) > 1:
                raise ConversionError(f"optimizer param groups of {n}: its parts are in {len(groups)} different groups")
        scalars: dict[str, dict[str, Any]] = {}
        for k, per in self._scalars_by_key().items():
            scalars[k] = {p: v for p, v in per.items() if p not in rest and p not in first}
            for n, ps in parts.items():
                if held(n, f"scalar {k!r}", per):
                    scalars[k][n] = ((lambda rs=[per[p] for p in ps], n=n: one(n, [r() for r in rs])) if deferred
                                     else one(n, [per[p] for p in ps]))
        tensors: dict[str, dict[str, LazyTensor]] = {}
        for k, per in self.tensors.items():
            tensors[k] = {p: t for p, t in per.items() if p not in rest and p not in first}
            for n, ps in parts.items():
                if held(n, f"state {k!r}", per):
                    tensors[k][n] = join(n, [per[p] for p in ps])
        groups = [{**g, "params": [first.get(p, p) for p in g.get("params", []) if p not in rest]} for g in self.param_groups]
        return OptimizerState(self.cls_as_read, groups, tensors, DeferredScalars(scalars) if deferred else scalars)

    def renamed(self, name: Callable[[str], str]) -> "OptimizerState":
        """This state with every parameter name ``n`` read as ``name(n)``; scalars not read yet stay so."""
        raw = object.__getattribute__(self, "scalars")
        scalars = {k: {name(n): v for n, v in per.items()} for k, per in self._scalars_by_key().items()}
        return OptimizerState(
            self.cls_as_read, [{**g, "params": [name(n) for n in g.get("params", [])]} for g in self.param_groups],
            {k: {name(n): t for n, t in per.items()} for k, per in self.tensors.items()},
            DeferredScalars(scalars) if isinstance(raw, DeferredScalars) else scalars,
        )


@dataclass
class ComponentSource:
    """A non-model component copied verbatim between checkpoints: its record and where its files are."""

    record: ComponentRecord
    directory: str
    files: dict[str, FileRecord]

    @classmethod
    def from_manifest(cls, directory: str, manifest: Manifest, key: str) -> "ComponentSource":
        from .pieces import component_files

        record = manifest.components[key]
        return cls(record, directory, {f: manifest.files[f] for f in component_files(record, manifest.files)})

    def paths(self) -> Iterator[tuple[str, str, FileRecord]]:
        for rel, rec in self.files.items():
            yield rel, os.path.join(self.directory, rel), rec


@dataclass
class AdapterState:
    """A peft adapter (LoRA, DoRA, ...) held beside its frozen base model: peft's adapter config, the adapter's name in
    the module names (``default``), and its tensors, named as peft's ``adapter_model.safetensors`` names them."""

    config: dict[str, Any]
    name: str
    tensors: list[str]


@dataclass
class LogicalCheckpoint:
    model: dict[str, LazyTensor]
    config: dict[str, Any] | None = None
    optimizer: OptimizerState | None = None
    components: dict[str, ComponentSource] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)  # format, world_size, tp, pp, zero_stage, dtype, ...
    topology: dict[str, Any] | None = None  # the saved topology that PER_RANK/GROUP/NODE pieces refer to
    tied: list[list[str]] = field(default_factory=list)  # [[target, source], ...] e.g. lm_head -> embeddings
    frozen: list[str] = field(default_factory=list)
    step: int | None = None
    notes: list[str] = field(default_factory=list)
    # State a reader found in memory rather than in files (a DeepSpeed checkpoint's client state): written as
    # GLOBAL components, encoded without pickle.
    extra_state: dict[str, Any] = field(default_factory=dict)
    # The same for per-rank state (accelerate's RNG states): one entry per rank, written as PER_RANK components.
    rank_state: dict[str, list[Any]] = field(default_factory=dict)
    # peft adapters on the model: ``model`` then holds the base model's tensors under universal's names (frozen)
    # and the adapter's under peft's adapter-file names (trainable, with their optimizer state)
    adapter: AdapterState | None = None

    def names(self) -> set[str]:
        """Every parameter name the checkpoint mentions: model, tied, frozen and optimizer names."""
        out = set(self.model) | {n for group in self.tied for n in group} | set(self.frozen)
        if self.optimizer is not None:
            out |= self.optimizer.names()
        return out

    def renamed(self, mapping: dict[str, str]) -> "LogicalCheckpoint":
        """This checkpoint with every parameter name ``n`` read as ``mapping.get(n, n)`` (the model's,
        the optimizer's state and groups, tied and frozen names); itself when nothing changes."""
        if all(mapping.get(n, n) == n for n in mapping):
            return self
        name = lambda n: mapping.get(n, n)  # noqa: E731
        opt = self.optimizer and self.optimizer.renamed(name)
        model = {name(n): t for n, t in self.model.items()}
        if len(model) != len(self.model):
            from collections import Counter

            from .errors import ConversionError

            twice = next(n for n, c in Counter(map(name, self.model)).items() if c > 1)
            raise ConversionError(f"two of the checkpoint's tensors would both be named {twice!r}")
        adapter = self.adapter and replace(self.adapter, tensors=[name(n) for n in self.adapter.tensors])
        return replace(self, model=model, optimizer=opt, adapter=adapter,
                       tied=[[name(n) for n in group] for group in self.tied], frozen=[name(n) for n in self.frozen])

    def without(self, names: set[str]) -> "LogicalCheckpoint":
        """This checkpoint less the model tensors ``names`` and their optimizer state (a target with no place for them)."""
        return replace(self, model={n: t for n, t in self.model.items() if n not in names},
                       optimizer=self.optimizer and self.optimizer.without(names), frozen=[n for n in self.frozen if n not in names],
                       tied=[g for g in self.tied if not set(g) & names])

    def tensors(self) -> Iterator[tuple[str, LazyTensor]]:
        """Every logical tensor with its logical key: model names, then optimizer/<key>/<name>."""
        yield from self.model.items()
        if self.optimizer is not None:
            for key in sorted(self.optimizer.tensors):
                for name, t in self.optimizer.tensors[key].items():
                    yield optim_key(key, name), t
