"""What transformers knows about a model, asked once per config: the class ``config.json`` names, built on the
meta device (no memory), and from it the tied parameters, the base-model prefix, the parameter names in module
order and the stored keys ``from_pretrained`` ignores.

No table of model types: a new architecture is known as soon as the installed transformers knows it.

Asking costs seconds (importing transformers and the model's module is most of a conversion's start-up), so the
answers a conversion needs (the facts, transformers' renaming of the model's own keys, and how MoE experts split
and fuse) are kept on disk per transformers version and config (see ``_Answers``); a question they do not answer
(a key the model does not have, a fusion that is no views, the meta model itself) asks transformers as before.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from interop.lazy_import import torch

from interop.dtypes import dtype_from_name
from interop.errors import ConversionError
from interop.logical import LogicalCheckpoint

from . import fusion
from .kept import CACHE_ENV, kept  # noqa: F401 - CACHE_ENV: the variable's name, for callers

log = logging.getLogger(__name__)

# the heads a config.json without ``architectures`` is tried with, in order (a bare model last)
_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM", "AutoModelForImageTextToText",
                 "AutoModelForSequenceClassification", "AutoModel")


@dataclass(frozen=True)
class ModelFacts:
    model_type: str
    cls: str  # the transformers class built
    tied: tuple[tuple[str, str], ...]  # (target, source): the target is the source's tensor and not stored apart
    prefix: str  # the base model's attribute ("model", "transformer"): bare-model files lack "<prefix>."
    names: tuple[str, ...]  # the state dict's keys, in module order
    ignore_unexpected: tuple[str, ...]  # patterns of stored keys from_pretrained drops (old causal-mask buffers)
    # the stored keys of a hub release's multi-token-prediction layers, which from_pretrained ignores too but
    # transformers' MtpModel loads (its get_mtp_weights_regex): kept as stored, never dropped; "" without any
    mtp_weights: str = ""


def _first(exc: Exception) -> str:
    """An exception's first sentence, short (transformers' messages can list every model type it knows)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = text.split(". ")[0]
    return text if len(text) <= 160 else text[:157] + "..."


def _key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, default=str)


def fresh_model(config: dict[str, Any]) -> torch.nn.Module:
    """A new model of ``config`` on the current default device (not the shared meta model: the caller may change it,
    as peft's get_peft_model does)."""
    return _build(config, device=None)


# Counts a checkpoint's config or arguments may claim, checked before anything is built or planned from them: every
# layer becomes modules to build and rules to plan, every layer's expert rules too (num_layers 10**9 in a damaged or
# hostile common.pt planned for hours, then ran out of memory). Far past any released model (the deepest have about
# 200 layers; DeepSeek-V3 61 x 256 experts, Kimi-K2 61 x 384).
MAX_LAYERS = 10_000
MAX_LAYER_EXPERTS = 1 << 18


def check_counts(layers: int, where: str, experts: int = 0, mtp: int = 0) -> None:
    """One line for counts past :data:`MAX_LAYERS` / :data:`MAX_LAYER_EXPERTS` (``layers`` and ``mtp`` layers, each
    of ``experts`` experts)."""
    if layers + mtp > MAX_LAYERS or (layers + mtp) * max(experts, 1) > MAX_LAYER_EXPERTS:
        held = f"{layers} layers" + (f" and {mtp} MTP layers" if mtp else "") + (f" of {experts} experts each" if experts else "")
        raise ConversionError(f"{where}: {held}: more than any model this reads ({MAX_LAYERS} layers, {MAX_LAYER_EXPERTS} "
                              "layer-experts at most); a damaged or hostile checkpoint")


def _build(config: dict[str, Any], device: str | None = "meta") -> torch.nn.Module:
    import transformers

    model_type = config.get("model_type")
    try:
        cfg = transformers.AutoConfig.for_model(**config)
    except Exception as exc:  # noqa: BLE001 - any failure is the same for the user: transformers cannot build it
        raise ConversionError(f"transformers {transformers.__version__} has no model type {model_type!r} ({_first(exc)})") from None
    layers = getattr(cfg.get_text_config(), "num_hidden_layers", None)
    if isinstance(layers, int) and not isinstance(layers, bool):
        check_counts(layers, "config.json")
    named = [getattr(transformers, a, None) for a in (config.get("architectures") or [])]
    candidates = [c for c in named if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)]
    candidates += [getattr(transformers, a) for a in _AUTO_CLASSES]
    errors = []
    for cls in candidates:
        try:
            with torch.device(device) if device else contextlib.nullcontext():
                return cls.from_config(cfg) if cls.__name__.startswith("Auto") else cls._from_config(cfg)
        except Exception as exc:  # noqa: BLE001 - the next head may fit
            errors.append(f"{cls.__name__}: {_first(exc)}")
    raise ConversionError(f"transformers {transformers.__version__} cannot build a {model_type!r} model from this config "
                          f"({errors[0]})")


def _facts(key: str) -> tuple[ModelFacts, torch.nn.Module]:
    built = _built(key)
    if isinstance(built, ConversionError):
        raise built
    return built


@lru_cache(maxsize=16)
def _built(key: str) -> tuple[ModelFacts, torch.nn.Module] | ConversionError:
    """The facts, or why transformers cannot build the model (cached too: readers and writers ask several times)."""
    config = json.loads(key)
    try:
        model = _build(config)
        layers = dict(_expert_parameters(model).values())  # each MoE layer's module: its experts
        if layers:  # before anything is traced or planned expert by expert (transformers' splits list each one)
            check_counts(len(layers), "config.json", max(layers.values()))
    except ConversionError as exc:
        return exc
    tied = tuple((t, s) for t, s in (getattr(model, "all_tied_weights_keys", None) or {}).items())
    facts = ModelFacts(
        model_type=config.get("model_type", ""), cls=type(model).__name__, tied=tied,
        prefix=getattr(model, "base_model_prefix", "") or "", names=tuple(model.state_dict(keep_vars=True)),
        ignore_unexpected=tuple(sorted(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())),
        mtp_weights=_mtp_weights(model),
    )
    return facts, model


def _mtp_weights(model: torch.nn.Module) -> str:
    """transformers' own pattern of the model's multi-token-prediction weights (the ignored-key patterns past its
    decoder layers: ``model.layers.61`` of DeepSeek-V3), where its config counts MTP layers; "" otherwise."""
    if not getattr(model.config.get_text_config(), "num_mtp_layers", 0):
        return ""
    try:
        from transformers.modeling_layers import MtpModel

        return MtpModel.get_mtp_weights_regex(model).pattern
    except (ImportError, AttributeError, ValueError):  # a transformers without MtpModel, a model with no such pattern
        return ""


def model_facts(config: dict[str, Any] | None) -> ModelFacts | None:
    """None when there is no config to ask about; one line (ConversionError) when transformers cannot build it."""
    if not config or "model_type" not in config:
        return None
    answers = _answers(_key(config))
    if isinstance(answers, ConversionError):
        raise answers
    return answers.facts


# --- the answers kept on disk ------------------------------------------------------------------------------

_SCHEMA = 8  # of the file below: a change makes every kept answer unread (asked again)


@dataclass(frozen=True)
class _Answers:
    """What conversions ask transformers about one model: its facts; save_pretrained's name for each of the
    module's keys (``to_stored``) and from_pretrained's renaming of each of those stored names back
    (``to_module``: module name and the fusing converter's source pattern or None), the stored experts' names
    included; whether transformers fuses any stored keys (MoE experts); and how each fused module tensor splits
    (``splits``: where each stored tensor lies in it, traced from transformers' converters)."""

    facts: ModelFacts
    to_stored: dict[str, str]
    to_module: dict[str, tuple[str, str | None]]
    fuses: bool
    experts: dict[str, tuple[str, int]]  # expert parameters (module names): (their layer's module, experts)
    parameters: tuple[str, ...]  # named_parameters(): a tied alias once, under its source
    buffers: tuple[str, ...]  # the state dict's keys that are no parameter under any name
    # module tensors save_pretrained splits into stored ones (MoE experts): their shape, and where each stored
    # tensor lies in them (None where transformers' operations are no views and must run on the values)
    splits: dict[str, fusion.SplitPlan]
    built_frozen: tuple[str, ...] = ()  # parameters the model's modules build with requires_grad=False
    # each norm module's epsilon as the model builds it (``variance_epsilon`` or ``eps``): not always the config's
    # (DeepSeek-V3's q/kv latent norms keep their class default whatever rms_norm_eps says)
    norm_eps: dict[str, float] = dataclasses.field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # each state dict key's, as built
    floating: tuple[str, ...] = ()  # the state dict's floating-point keys
    # keys from_pretrained does without: save_pretrained leaves them out (``_keys_to_ignore_on_save``: Marian's
    # sinusoidal positions) or a missing one is not reported (``_keys_to_ignore_on_load_missing``: BART's final_logits_bias)
    optional: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        f = self.facts
        return {"schema": _SCHEMA, "model_type": f.model_type, "cls": f.cls, "tied": [list(t) for t in f.tied],
                "prefix": f.prefix, "names": list(f.names), "ignore_unexpected": list(f.ignore_unexpected), "mtp_weights": f.mtp_weights,
                "to_stored": self.to_stored, "to_module": {k: list(v) for k, v in self.to_module.items()}, "fuses": self.fuses,
                "experts": {k: list(v) for k, v in self.experts.items()}, "parameters": list(self.parameters),
                "buffers": list(self.buffers),
                "splits": {k: {"shape": list(p.shape), "patterns": list(p.patterns), "views": None if p.views is None else
                               [[v.stored, list(v.shape), list(v.stride), v.offset] for v in p.views]}
                           for k, p in self.splits.items()},
                "built_frozen": list(self.built_frozen), "norm_eps": self.norm_eps,
                "shapes": {k: list(v) for k, v in self.shapes.items()}, "floating": list(self.floating),
                "optional": list(self.optional)}

    @classmethod
    def from_json(cls, raw: Any) -> "_Answers":
        """Every field checked: a damaged or foreign file is a ValueError (and is asked again), never a wrong answer
        taken on trust."""
        def strings(v: Any) -> list[str]:
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise ValueError("not a list of strings")
            return v

        def string_map(v: Any) -> dict[str, Any]:
            if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
                raise ValueError("not a map")
            return v

        if not isinstance(raw, dict) or raw.get("schema") != _SCHEMA:
            raise ValueError("another schema")
        tied = [tuple(strings(t)) for t in raw["tied"]] if isinstance(raw.get("tied"), list) else None
        if tied is None or any(len(t) != 2 for t in tied):
            raise ValueError("tied is not a list of pairs")
        to_module = {}
        for k, v in string_map(raw["to_module"]).items():
            if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and (v[1] is None or isinstance(v[1], str))):
                raise ValueError(f"to_module[{k!r}]")
            to_module[k] = (v[0], v[1])
        to_stored = string_map(raw["to_stored"])
        if not all(isinstance(v, str) for v in to_stored.values()) or not isinstance(raw.get("fuses"), bool):
            raise ValueError("to_stored or fuses")
        experts = {}
        for k, v in string_map(raw["experts"]).items():
            if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and type(v[1]) is int):
                raise ValueError(f"experts[{k!r}]")
            experts[k] = (v[0], v[1])
        for field in ("model_type", "cls", "prefix", "mtp_weights"):
            if not isinstance(raw.get(field), str):
                raise ValueError(field)

        def ints(v: Any) -> tuple[int, ...]:
            if not isinstance(v, list) or not all(type(x) is int and x >= 0 for x in v):
                raise ValueError("not a list of sizes")
            return tuple(v)

        splits = {}
        for k, v in string_map(raw["splits"]).items():
            if not isinstance(v, dict) or not isinstance(v.get("views"), (list, type(None))):
                raise ValueError(f"splits[{k!r}]")
            views = None
            if v["views"] is not None:
                if not all(isinstance(x, list) and len(x) == 4 and isinstance(x[0], str) and type(x[3]) is int for x in v["views"]):
                    raise ValueError(f"splits[{k!r}]")
                views = tuple(fusion.View(x[0], ints(x[1]), ints(x[2]), x[3]) for x in v["views"])
                if len({x.stored for x in views}) != len(views) or not fusion.tiles(ints(v.get("shape")), list(views)):
                    raise ValueError(f"splits[{k!r}]: the views are not the tensor once")
            splits[k] = fusion.SplitPlan(ints(v.get("shape")), tuple(strings(v.get("patterns"))), views)
        facts = ModelFacts(raw["model_type"], raw["cls"], tuple(tied), raw["prefix"], tuple(strings(raw["names"])),
                           tuple(strings(raw["ignore_unexpected"])), raw["mtp_weights"])
        norm_eps = string_map(raw["norm_eps"])
        if not all(type(v) is float for v in norm_eps.values()):
            raise ValueError("norm_eps")
        shapes = {k: ints(v) for k, v in string_map(raw["shapes"]).items()}
        return cls(facts, to_stored, to_module, raw["fuses"], experts, tuple(strings(raw["parameters"])),
                   tuple(strings(raw["buffers"])), splits, tuple(strings(raw["built_frozen"])), norm_eps, shapes,
                   tuple(strings(raw["floating"])), tuple(strings(raw["optional"])))


def _asked(key: str) -> _Answers | ConversionError:
    """The answers from transformers itself (building the model on the meta device)."""
    built = _built(key)
    if isinstance(built, ConversionError):
        return built
    facts, model = built
    to_module, to_stored = _live_renamers(key)
    stored = {n: to_stored(n) for n in facts.names}
    named = dict(model.named_parameters(remove_duplicate=False))
    state = model.state_dict(keep_vars=True)
    splits = _split_plans(key, to_module, to_stored)
    pieces = [v.stored for p in splits.values() for v in p.views or ()]  # the stored names the splits give
    return _Answers(facts, stored, {s: to_module(s) for s in dict.fromkeys([*stored.values(), *pieces])},
                    bool(_live_converters(key)), _expert_parameters(model), tuple(n for n, _ in model.named_parameters()),
                    tuple(n for n in model.state_dict() if n not in named), splits,
                    tuple(n for n, p in model.named_parameters() if not p.requires_grad), _norm_epsilons(model),
                    {n: tuple(t.shape) for n, t in state.items()}, tuple(n for n, t in state.items() if t.is_floating_point()),
                    _optional(model, list(state)))


def _optional(model: torch.nn.Module, names: list[str]) -> tuple[str, ...]:
    """The state dict's keys from_pretrained does without, as transformers' own lists say: left out by save_pretrained
    (``_keys_to_ignore_on_save``, exact names) or not reported missing (``_keys_to_ignore_on_load_missing``, patterns
    searched, as ``_adjust_missing_and_unexpected_keys`` does)."""
    unsaved = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or ()]
    return tuple(n for n in names if n in unsaved or any(p.search(n) for p in patterns))


def _norm_epsilons(model: torch.nn.Module) -> dict[str, float]:
    """Every module with a float epsilon (LayerNorm's ``eps``, the RMSNorms' ``variance_epsilon`` or ``eps``) and
    that epsilon, as built."""
    out = {}
    for name, module in model.named_modules():
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if type(eps) is float:
            out[name] = eps
    return out


def _split_plans(key: str, to_module: Callable[[str], tuple[str, str | None]],
                 to_stored: Callable[[str], str]) -> dict[str, fusion.SplitPlan]:
    """The module tensors save_pretrained splits (matched by transformers' own rename_source_key on the reversed
    converters, as save_pretrained matches them): their shape, the stored patterns that make them, and where
    each stored tensor lies in them. Each converter is traced once per shape (the layers share it); views are
    kept only where transformers' loading renaming takes each stored tensor back to this module tensor."""
    converters = _live_converters(key)
    if not converters:
        return {}
    facts, model = _facts(key)
    reversed_ = [c.reverse_transform() for c in converters]
    state = model.state_dict(keep_vars=True)
    traced: dict[tuple[int, tuple[int, ...]], list[tuple[str, fusion.View]] | None] = {}
    out = {}
    for name in facts.names:
        i = _splitting(name, reversed_)
        if i is None:
            continue
        shape = tuple(state[name].shape)
        if (i, shape) not in traced:
            traced[(i, shape)] = fusion.trace(name, reversed_[i], shape, model)
        views = _named(name, reversed_[i], traced[(i, shape)], to_module, to_stored)
        out[name] = fusion.SplitPlan(shape, tuple(converters[i].source_patterns), views)
    return out


def _splitting(name: str, reversed_: list[Any]) -> int | None:
    """Which of the reversed converters splits module tensor ``name`` as save_pretrained matches it, or None."""
    from transformers.core_model_loading import rename_source_key

    pattern = rename_source_key(name, [], reversed_, reverse=True)[1]
    return None if pattern is None else next(i for i, r in enumerate(reversed_) if pattern in r.source_patterns)


def _named(name: str, reverse: Any, traced: list[tuple[str, fusion.View]] | None,
           to_module: Callable[[str], tuple[str, str | None]], to_stored: Callable[[str], str]) -> tuple[fusion.View, ...] | None:
    """The traced views of module tensor ``name`` under the stored names they make; None where they cannot be
    named, or where loading would not fuse those names back into it (transformers' operations then run)."""
    if traced is None:
        return None
    try:
        _, prefix, suffix = fusion.placed(name, reverse)
    except ConversionError:  # said when (if ever) the tensor is split
        return None
    views = tuple(dataclasses.replace(v, stored=to_stored(prefix + k + suffix)) for k, v in traced)
    if len({v.stored for v in views}) != len(views):
        return None
    return views if all(to_module(v.stored)[0] == name and to_module(v.stored)[1] is not None for v in views) else None


def _expert_parameters(meta: torch.nn.Module) -> dict[str, tuple[str, int]]:
    """The model's expert parameters: those of a module transformers marks expert-parallel whose first dimension
    is its expert count, or that its expert-parallel plan shards as grouped GEMM."""
    plan = [re.compile(re.escape(p).replace(r"\*", r"\d+")) for p, style in (getattr(meta, "_ep_plan", None) or {}).items()
            if style == "grouped_gemm"]
    out = {}
    for module_name, module in meta.named_modules():
        marked = hasattr(module, "_is_expert_parallel") and isinstance(getattr(module, "num_experts", None), int)
        for pname, p in module.named_parameters(recurse=False):
            name = f"{module_name}.{pname}" if module_name else pname
            if p.dim() and ((marked and p.shape[0] == module.num_experts) or any(r.fullmatch(name) for r in plan)):
                out[name] = (module_name, int(p.shape[0]))
    return out


def parameter_layout(config: dict[str, Any] | None) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The model's parameters (``named_parameters()``: a tied alias once, under its source) and buffers, in module
    order: the order an engine sees them in. None without a model transformers can build."""
    answers = _kept(config)
    return (answers.parameters, answers.buffers) if answers is not None else None


def built_frozen(config: dict[str, Any] | None) -> tuple[str, ...]:
    """The parameters the model's own modules build frozen (``requires_grad=False``, as Ernie 4.5 MoE's
    ``e_score_correction_bias``), module names; from_pretrained makes every loaded floating-point weight trainable,
    these too. Empty for a model transformers cannot build."""
    answers = _kept(config)
    return answers.built_frozen if answers is not None else ()


def norm_epsilons(config: dict[str, Any] | None) -> dict[str, float]:
    """The epsilon each of the model's norm modules is built with (module name -> eps); empty for a model
    transformers cannot build."""
    answers = _kept(config)
    return answers.norm_eps if answers is not None else {}


def expert_parameters(config: dict[str, Any] | None) -> dict[str, tuple[str, int]]:
    """The expert parameters (module name -> (layer module, experts)) of the model ``config`` describes; empty for
    a dense model or one transformers cannot build."""
    answers = _kept(config)
    return answers.experts if answers is not None else {}


def split_plans(config: dict[str, Any] | None) -> dict[str, fusion.SplitPlan]:
    """The module tensors (module names) save_pretrained splits into stored ones (MoE experts) and how; empty for
    a model that has none or that transformers cannot build."""
    answers = _kept(config)
    return answers.splits if answers is not None else {}


@dataclass(frozen=True)
class StoredModel:
    """The model a config describes under universal's (save_pretrained's) names, what a checkpoint of it must hold:
    each key's shape as transformers builds it, and the tensors its state dict needs, each as the ways a file may
    hold it (a module tensor save_pretrained splits, MoE experts, as its stored pieces or whole, under the module's
    name, as from_pretrained takes it too)."""

    cls: str
    shapes: dict[str, tuple[int, ...]]
    required: tuple[tuple[tuple[str, ...], ...], ...]
    floating: frozenset[str]


def stored_model(config: dict[str, Any] | None) -> StoredModel | None:
    """None for a model transformers cannot build (or no config)."""
    return _stored_model(_key(config)) if _known(config) is not None else None


@lru_cache(maxsize=16)
def _stored_model(key: str) -> StoredModel:
    answers = _answers(key)
    assert isinstance(answers, _Answers)  # _known said it builds
    stored = {m: answers.to_stored.get(m, m) for m in answers.shapes}
    shapes = {stored[m]: shape for m, shape in answers.shapes.items()}
    pieces = {m: tuple(v.stored for v in p.views) for m, p in answers.splits.items() if p.views is not None}
    shapes.update({v.stored: v.shape for p in answers.splits.values() for v in p.views or ()})
    floating = {stored.get(m, m) for m in answers.floating} | {v.stored for m, p in answers.splits.items() if m in answers.floating
                                                                for v in p.views or ()}
    # a config naming no architecture names no head: the head transformers' first guess builds is not required
    # (AutoModel.from_pretrained loads a bare model's files whole)
    head_guessed = not json.loads(key).get("architectures")
    base = f"{answers.facts.prefix}." if answers.facts.prefix else ""
    optional = set(answers.optional)
    required = tuple((pieces[m], (stored.get(m, m),)) if m in pieces else ((stored.get(m, m),),)
                     for m in (*answers.parameters, *answers.buffers)
                     if (m not in answers.splits or m in pieces) and m not in optional and not (head_guessed and not m.startswith(base)))
    return StoredModel(answers.facts.cls, shapes, required, frozenset(floating))


def _kept(config: dict[str, Any] | None) -> _Answers | None:
    """The answers about ``config``'s model; None without a config or for a model transformers cannot build."""
    return _answers(_key(config)) if _known(config) is not None else None


@lru_cache(maxsize=16)
def _answers(key: str) -> _Answers | ConversionError:
    """``key``'s answers: kept ones if there are (one small file read), else asked and kept (see ``kept``)."""
    return kept("model", _SCHEMA, key, lambda: _asked(key), _Answers.to_json, _Answers.from_json,
                keep=lambda answers: not isinstance(answers, ConversionError))


def meta_model(config: dict[str, Any] | None) -> torch.nn.Module | None:
    """The model a config.json describes, on the meta device: its parameter names and order. Shared: read only."""
    if not config or "model_type" not in config:
        return None
    return _facts(_key(config))[1]


def _known(config: dict[str, Any] | None) -> ModelFacts | None:
    """The facts, or None for a model transformers cannot build: readers then keep the files' tensors as they
    are (a universal or Hugging Face output needs no more), and the writers that need the model refuse."""
    try:
        return model_facts(config)
    except ConversionError as exc:
        log.debug("%s; its tensors are kept as stored, with no tied weights known", exc)
        return None


def unknown_model(config: dict[str, Any] | None) -> str | None:
    """Why transformers cannot build the model ``config`` describes (a reader's note), or None."""
    try:
        model_facts(config)
    except ConversionError as exc:
        return str(exc)
    return None


def tied_groups(config: dict[str, Any] | None) -> list[list[str]]:
    """[[target, source], ...] as transformers ties them for this config (its tie flags honoured), under the
    names save_pretrained stores (universal's)."""
    facts = _known(config)
    if facts is None or not facts.tied:
        return []
    _, to_stored = _renamers(_key(config))
    return [[to_stored(t), to_stored(s)] for t, s in facts.tied]


@lru_cache(maxsize=16)
def _renamers(key: str) -> tuple[Callable[[str], tuple[str, str | None]], Callable[[str], str]]:
    """:func:`_live_renamers`, answered from the kept answers where they have the name."""
    answers = _answers(key)
    if isinstance(answers, ConversionError):
        raise answers

    def to_module(name: str) -> tuple[str, str | None]:
        found = answers.to_module.get(name)
        return found if found is not None else _live_renamers(key)[0](name)

    def to_stored(name: str) -> str:
        found = answers.to_stored.get(name)
        return found if found is not None else _live_renamers(key)[1](name)

    return to_module, to_stored


@lru_cache(maxsize=16)
def _live_renamers(key: str) -> tuple[Callable[[str], tuple[str, str | None]], Callable[[str], str]]:
    """transformers' own key renaming for this model: stored -> module name (what from_pretrained applies,
    with the base-model prefix added or stripped; and the source pattern of the WeightConverter that fuses
    the key, as MoE experts are, or None), and module -> stored name (what save_pretrained applies)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming, rename_source_key

    facts, model = _facts(key)
    loading = get_model_conversion_mapping(model)
    renamings = [t for t in loading if isinstance(t, WeightRenaming)]
    converters = [t for t in loading if isinstance(t, WeightConverter)]
    meta = dict.fromkeys(facts.names, True)

    def to_module(name: str) -> tuple[str, str | None]:
        renamed = rename_source_key(name, renamings, converters, facts.prefix or None, meta)
        if renamed[0] not in meta and name in meta:  # as from_pretrained: a key the model has is not renamed away
            return rename_source_key(name, [], [], facts.prefix or None, meta)  # (DeepSeek-V4's `.norm.` -> `.kv_norm.` hits model.norm)
        return renamed

    saving = [t.reverse_transform() for t in get_model_conversion_mapping(model, add_legacy=False)[::-1]
              if not isinstance(t, PrefixChange)]  # as revert_weight_conversion for a model not from from_pretrained
    back_renamings = [t for t in saving if isinstance(t, WeightRenaming)]

    def to_stored(name: str) -> str:
        return rename_source_key(name, back_renamings, [], reverse=True)[0]

    return to_module, to_stored


def stored_names(config: dict[str, Any] | None, names: list[str]) -> dict[str, str]:
    """A file's key -> the key save_pretrained writes for it today (universal's naming): an old file's keys
    without the base-model prefix get it, renamed keys their new name, as from_pretrained then save_pretrained
    would do; keys transformers fuses (MoE experts) stay as stored. Keys from_pretrained drops as unexpected
    (old causal-mask buffers) are left out, but for a hub release's multi-token-prediction layers (transformers'
    MtpModel loads them, a Megatron target writes them): kept as stored."""
    facts = _known(config)
    if facts is None:
        return {n: n for n in names}
    to_module, to_stored = _renamers(_key(config))
    known, out = set(facts.names), {}
    for name in names:
        module, fused = to_module(name)
        if fused is not None:
            out[name] = name
        elif module in known:
            out[name] = to_stored(module)
        elif not any(re.search(p, name) for p in facts.ignore_unexpected) or (facts.mtp_weights and re.search(facts.mtp_weights, name)):
            out[name] = name
    return out


def placed_in_module(ckpt: LogicalCheckpoint, config: dict[str, Any] | None = None) -> LogicalCheckpoint:
    """``ckpt`` under the module's names (:func:`in_module_names`) less the layers past the module's own: an engine
    format holds the module's state dict, which its own loader loads strictly (DeepSpeed's load_checkpoint,
    accelerate's load_state), so a layer after the decoder's (a hub release's multi-token-prediction layer,
    ``model.layers.<num_hidden_layers>``) would make the engine refuse the whole checkpoint. Left out, with their
    optimizer state, and said in a note, never dropped in silence. (Other tensors transformers' class lacks stay:
    a user's model may hold more, a buffer of its own, which its engine loads.)"""
    extra = past_layers(ckpt, config)
    if not extra:  # (none too where transformers cannot build the model)
        return ckpt
    note = (f"the {_known(config or ckpt.config).cls} module has no place for {len(extra)} tensor(s) of the source in layers past its own (its engine "
            f"loads the module's state strictly), not written: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    log.warning("%s", note)
    ckpt.notes.append(note)  # (the list the converting call holds: the checkpoint below shares it)
    return ckpt.without(set(extra))


def past_layers(ckpt: LogicalCheckpoint, config: dict[str, Any] | None = None) -> list[str]:
    """The model tensors in layers past the module's own (``model.layers.<i>`` beyond the last ``i`` transformers'
    model has: a hub release's multi-token-prediction layers), sorted; none where transformers cannot build it."""
    facts = _known(config or ckpt.config)
    if facts is None:
        return []
    last: dict[str, int] = {}  # each layer list's last index in the module (``model.layers.``: num_hidden_layers - 1)
    for name in facts.names:
        found = _LAYER.match(name)
        if found:
            last[found[1]] = max(last.get(found[1], -1), int(found[2]))
    known = set(facts.names)
    return sorted(n for n in ckpt.model for found in [_LAYER.match(n)]
                  if found and found[1] in last and int(found[2]) > last[found[1]] and n not in known)


_LAYER = re.compile(r"^(.*\.layers\.)(\d+)\.")


def module_names(config: dict[str, Any] | None, names: list[str]) -> dict[str, str]:
    """Universal's (save_pretrained's) key -> the model's module name, which engine formats store (a DeepSpeed
    or accelerate state dict is the module's). Keys transformers fuses into one module tensor (MoE experts) are
    :func:`in_module_names`' to fuse, not renamed here."""
    facts = _known(config)
    if facts is None:
        return {n: n for n in names}
    to_module, _ = _renamers(_key(config))
    return {name: module for name in names for module, fused in [to_module(name)] if fused is None}


def _converters(key: str) -> list[Any]:
    """transformers' converters fusing stored keys into module tensors (none asked for when the kept answers say
    there are none)."""
    answers = _answers(key)
    if isinstance(answers, _Answers) and not answers.fuses:
        return []
    return _live_converters(key)


@lru_cache(maxsize=16)
def _live_converters(key: str) -> list[Any]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    return [t for t in get_model_conversion_mapping(_facts(key)[1]) if isinstance(t, WeightConverter)]


def _adapter_names(ckpt: LogicalCheckpoint) -> set[str]:
    """A peft adapter's tensors: named as peft's adapter file names them, which transformers' renaming does not touch."""
    return set(ckpt.adapter.tensors) if ckpt.adapter is not None else set()


def in_module_names(ckpt: LogicalCheckpoint, config: dict[str, Any] | None = None) -> LogicalCheckpoint:
    """``ckpt`` (universal's names) under the module's names, as engine formats store them: keys renamed, and
    the keys transformers fuses (MoE experts) fused into their module tensors, with their optimizer state."""
    config = config or ckpt.config
    if _known(config) is None:
        return ckpt
    key = _key(config)
    to_module, _ = _renamers(key)
    names = sorted(ckpt.names() - _adapter_names(ckpt))
    answers = _answers(key)
    if (isinstance(answers, _Answers) and all(p.views is not None for p in answers.splits.values())
            and all(n in answers.to_module for n in names)):  # every name known: the fused ones are the plans' pieces
        plans = fusion.plan_from_views(names, answers.splits)
        shapes = {n: p.shape for n, p in answers.splits.items()}
    else:
        plans, shapes = fusion.plan(names, to_module, _converters(key)), None
    fused = {n for p in plans for n in p.names}
    renamed = ckpt.renamed({n: m for n, m in module_names(config, names).items() if n not in fused})
    meta = _facts(key)[1] if plans and shapes is None else None
    return fusion.fuse(renamed, plans, meta, shapes)


def in_stored_names(ckpt: LogicalCheckpoint, config: dict[str, Any] | None = None) -> LogicalCheckpoint:
    """``ckpt`` read under the module's names, under universal's (save_pretrained's) names: fused module
    tensors (MoE experts) split back into the stored per-expert tensors (as the kept split plans say, which
    transformers' own reversed converters gave), the rest renamed."""
    config = config or ckpt.config
    if _known(config) is None:
        return ckpt
    key = _key(config)
    _, to_stored = _renamers(key)
    answers = _answers(key)
    plans = answers.splits if isinstance(answers, _Answers) else {}
    splits = []
    for name in sorted(n for n in ckpt.model if n in plans):
        p = plans[name]
        if tuple(ckpt.model[name].spec.shape) != p.shape:  # split by its size, it would give another number of experts
            raise ConversionError(f"{name}: {list(ckpt.model[name].spec.shape)} in the checkpoint, but the model's fused "
                                  f"tensor is {list(p.shape)}: experts are missing or extra")
        splits.append(fusion.Split(name, p.views, p.shape) if p.views is not None else _split_by_values(key, name, ckpt.model[name].spec))
    fused = {s.source for s in splits}
    renamed = ckpt.renamed({n: to_stored(n) for n in ckpt.names() - _adapter_names(ckpt) if n not in fused})
    return fusion.split(renamed, splits, _facts(key)[1] if any(s.views is None for s in splits) else None)


def _split_by_values(key: str, name: str, spec: Any) -> fusion.Split:
    """The split of module tensor ``name`` whose operations are no views: transformers' reversed converter run on it."""
    reversed_ = [c.reverse_transform() for c in _live_converters(key)]
    reverse = reversed_[_splitting(name, reversed_)]
    return fusion.plan_split(name, reverse, spec, _renamers(key)[1], _facts(key)[1])


# --- multi-token-prediction layers, held against transformers' MtpModel ------------------------------------
@dataclass(frozen=True)
class MtpDisagreement:
    """A stored MTP tensor transformers' MtpModel would not load as it is: ``shape`` None where it is missing, ``why``
    where its pieces do not make the module's tensor (experts of different sizes)."""

    name: str
    shape: tuple[int, ...] | None
    wanted: tuple[int, ...]
    why: str = ""
    dtype: str = ""  # an integer tensor's, where MtpModel has floating ones only


@contextlib.contextmanager
def _no_progress_bars():
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def mtp_disagreements(config: dict[str, Any] | None, held: dict[str, tuple[tuple[int, ...], str]]) -> list[MtpDisagreement]:
    """How the stored multi-token-prediction layers in ``held`` (stored name -> (shape, dtype name); a hub release's
    ``model.layers.<num_hidden_layers + k>``) are not what transformers' MtpModel of ``config``'s model loads: its own
    loading (``convert_and_load_state_dict_in_model``, the MTP renamings and the model's expert fusing) run on meta
    tensors of their shapes, as ``MtpModel.from_pretrained`` runs it. A layer the source holds none of is not
    required (save_pretrained writes none). Empty where the config counts no MTP layers, or transformers has no
    MtpModel for the model (said in a warning)."""
    if not held:
        return []
    model = meta_model(config)
    text = model.config.get_text_config() if model is not None else None
    first, count = getattr(text, "num_hidden_layers", 0), getattr(text, "num_mtp_layers", 0)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (first, count)):
        log.warning("multi-token-prediction layers not checked: the config counts %r of them", count)
        return []
    mine = {n: s for n, s in held.items() if (m := _LAYER.match(n)) and first <= int(m[2]) < first + count}
    if not mine:
        return []
    built = max(int(_LAYER.match(n)[2]) for n in mine) - first + 1  # the layers it holds, not all the config counts
    try:
        from transformers.core_model_loading import WeightConverter, WeightRenaming, convert_and_load_state_dict_in_model, rename_source_key
        from transformers.modeling_layers import MtpModel
        from transformers.modeling_utils import LoadStateDictConfig

        with torch.device("meta"):
            mtp = MtpModel(model, built)
        # its embedding and head are the shared meta model's own modules: its loading must not touch them
        mtp.embed_tokens, mtp.shared_head = copy.deepcopy(mtp.embed_tokens), copy.deepcopy(mtp.shared_head)
        wanted = {k: tuple(t.shape) for k, t in mtp.state_dict().items()}
        conversions = mtp.get_weight_conversions(model)
        state = {n: torch.empty(shape, dtype=dtype_from_name(dtype), device="meta") for n, (shape, dtype) in mine.items()}
        with _no_progress_bars():  # (a check's loading of nothing: no "Loading weights" bar)
            info, _ = convert_and_load_state_dict_in_model(model=mtp, state_dict=state, load_config=LoadStateDictConfig(
                weight_mapping=conversions, device_map={"": "meta"}))
        renamings = [t for t in conversions if isinstance(t, WeightRenaming)]
        fusing = [t for t in conversions if isinstance(t, WeightConverter)]
        into = {n: rename_source_key(n, renamings, fusing, None, dict.fromkeys(wanted, True))[0] for n in mine}
    except Exception as exc:  # noqa: BLE001 - a model (or config) transformers builds no MtpModel for: kept as stored
        log.warning("multi-token-prediction layers not checked: transformers builds no MtpModel of this %s (%s)",
                    model.config.model_type, _first(exc))
        return []
    stored: dict[str, list[str]] = {}  # MtpModel's key -> the stored tensors it is loaded from
    for n, key in into.items():
        stored.setdefault(key, []).append(n)
    out = []
    for key, got, want in sorted(info.mismatched_keys):
        name = stored[key][0] if len(stored.get(key, ())) == 1 else f"{key} (transformers' MtpModel's name)"
        out.append(MtpDisagreement(name, tuple(got), tuple(want)))
    for key, error in sorted(info.conversion_errors.items()):
        odd = _odd_pieces({n: mine[n][0] for n in stored.get(key, ())}, wanted.get(key, ())[1:])
        if odd:  # the expert whose size is not its fellows'
            out += odd
            continue
        cause = next((line for line in reversed(error.splitlines()) if re.match(r"^\w+(Error|Exception): ", line)), error.strip().splitlines()[-1])
        out.append(MtpDisagreement(f"{key} (transformers' MtpModel's name)", None, wanted.get(key, ()),
                                   f"its stored pieces do not make it ({cause.strip()})"))
    # the copies of the embedding and head a hub layer stores (unexpected keys transformers ignores: MtpModel uses
    # the model's own, its attribute of that name): held to theirs, for a loader that reads the copies
    for key in sorted(info.unexpected_keys):
        for pattern in getattr(mtp, "_keys_to_ignore_on_load_unexpected", None) or ():
            own = f"{pattern.split('.')[0]}.weight"
            if re.search(pattern, key) and own in wanted and len(stored.get(key, ())) == 1 and mine[stored[key][0]][0] != wanted[own]:
                out.append(MtpDisagreement(stored[key][0], mine[stored[key][0]][0], wanted[own]))
                break
    if all(t.is_floating_point() for t in mtp.state_dict().values()):  # (its loading casts an integer tensor without a word)
        out += [MtpDisagreement(n, shape, shape, dtype=dtype) for n, (shape, dtype) in sorted(mine.items())
                if not dtype_from_name(dtype).is_floating_point]
    held_layers = {int(_LAYER.match(n)[2]) - first for n in mine}
    layers = _LAYER.match(next(iter(mine)))[1]  # the stored layer list's prefix: model.layers.
    for key in sorted(info.missing_keys):
        layer = re.match(r"^layers\.(\d+)\.", key)
        if layer is not None and int(layer[1]) in held_layers and key not in info.conversion_errors:
            # named as MtpModel names it: several stored names load into one key (DeepSeek's shared_head.norm,
            # another release's norm), and which the source would have used it does not say
            out.append(MtpDisagreement(f"{layers}{first + int(layer[1])} (transformers' MtpModel's {key})",
                                       None, wanted.get(key, ())))
    return out


def _odd_pieces(pieces: dict[str, tuple[int, ...]], piece_shape: tuple[int, ...]) -> list[MtpDisagreement]:
    """Of the stored pieces of one module tensor (its experts' down_proj; gate_proj and up_proj of a fused
    gate_up_proj, each kind apart), those not of their kind's shape: the module's piece shape (``piece_shape``, a
    stack's) where some are of it, else the shape most of them have; none where no shape is most's."""
    kinds: dict[str, dict[str, tuple[int, ...]]] = {}
    for n, shape in pieces.items():
        kinds.setdefault(re.sub(r"\.\d+\.", ".*.", n), {})[n] = shape
    out = []
    for members in kinds.values():
        shapes = list(members.values())
        counts = sorted(((shapes.count(s), s) for s in set(shapes)), reverse=True)
        if piece_shape in shapes:
            common = piece_shape
        elif len(counts) == 1 or counts[0][0] > counts[1][0]:
            common = counts[0][1]
        else:
            return []
        out += [MtpDisagreement(n, s, common) for n, s in sorted(members.items()) if s != common]
    return out
