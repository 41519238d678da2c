"""Megatron-LM's legacy checkpoint format (``--ckpt-format torch``), read and written at any TP and PP.

    <dir>/latest_checkpointed_iteration.txt          the iteration, or "release"
    <dir>/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt   one file per tensor x pipeline rank

Each file is a pickle holding ``args`` (Megatron-LM's argparse Namespace: the model's shape and the layout),
``checkpoint_version`` 3.0, ``iteration``, ``model`` (``model0``, ``model1``, ... with virtual pipeline
stages), ``optimizer`` (torch's state dict by parameter position, or mixed precision's dict around it with the
fp32 master copies), ``opt_param_scheduler`` and ``rng_state``. Each pipeline stage numbers its layers from 0.

Reading maps every tensor to its Hugging Face name through ``megatron_map`` and stays lazy: files are mapped,
and a tensor's TP pieces are read and merged when a writer asks for it. The pickles are read with
``weights_only``; Megatron's own objects in ``args`` (enums) become inert stand-ins, never imported.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import re
import threading
from collections import OrderedDict
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from interop.lazy_import import torch

from interop.commit import MEGATRON_TRACKER, durable_write, read_iteration_tracker
from interop.dtypes import dtype_from_name, dtype_name, is_floating, itemsize
from interop.errors import ConversionError, CorruptCheckpointError, MissingFileError
from interop.logical import DeferredList, DeferredMapping, DeferredScalars, LogicalCheckpoint, OptimizerState
from interop.sharding import ShardingMetadata, Strategy
from interop.structure import Absent, Is, Keys, ListOf, MapOf, Maybe, OneOf, check
from interop.tensors import LazyTensor, Piece, TensorSpec, concat, raw_bytes, release_mapped_pages, sub_pieces, zeros
from interop.universal import same_values, scalar_entry, scalar_value

from .detection import MEGATRON_FILE, RANK_DIR, is_iteration_dir as _is_iteration_dir, is_megatron_legacy  # noqa: F401
from .megatron_arch import MTP_KEYS, SHAPE_KEYS, MegatronArch, padded_vocab, rope_scaling_notes
from .megatron_map import (
    COLS, EXPERTS, GATED, LAYER_PREFIX, REPLICATED, ROWS, VOCAB, Rule, cat, check_pieces, extra_state_key, layer_of, local_name, merge, parameters, rules,
    MTP_PREFIX, chunk_rules, expert_index, linear_shape, mtp_copies, stacked_experts, tied_output_rule,
)
from .megatron_pipeline import PipelineSplit, recorded_flags
from .stacked_experts import per_expert, restacked
from .param_order import ADAMW_DEFAULTS
from .engine_checkpoint import Written, at_once, carried_components, component_state, owning_checkpoint, rank_rng_states, write_engine_checkpoint
from .megatron_pieces import RankPieces, fused_dtype
from .megatron_rng import DEFAULT_SEED, megatron_rng_states, our_rng
from .pickle_safety import is_mapped, load_torch_file, numpy_allowlist, save_torch
from . import megatron_buffer as buffer, torch_zip
from .torch_zip import NUMBER, TENSOR, TORCH_OPTIMIZER, StoredTensor, as_torch, dtype_name_of, is_tensor, materialize, state_shapes

if TYPE_CHECKING:
    from .dcp import Tiles

log = logging.getLogger(__name__)

TRACKER = MEGATRON_TRACKER
NATIVE_KEY = "megatron"  # the native component of our checkpoint around an iteration directory
FILE = MEGATRON_FILE
ITER_DIR = re.compile(r"^iter_(\d{7})$")
CHECKPOINT_VERSION = 3.0
SCHEDULER = "opt_param_scheduler"  # Megatron's OptimizerParamScheduler state, carried as it is
PADDING = "megatron_vocab_padding"  # extra state: the padded vocabulary rows, per "<model|master|optim:key>/<name>"


# --- Megatron's pickled objects, as inert stand-ins ---------------------------------------------------------
class MegatronObject:
    """Stands in for an object of Megatron's inside ``args`` (an enum, a config): its arguments, nothing runnable."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    def __repr__(self) -> str:
        return f"MegatronObject{self.args}"


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_megatron_file(path: str, trust_pickle: bool = False, stored: bool = False) -> Any:
    """A Megatron pickle with ``weights_only``: argparse's Namespace is allowed, and each ``megatron.*`` global
    the file names is replaced by :class:`MegatronObject` (found one at a time from torch's refusal). ``stored``:
    tensors may come back as ``torch_zip.StoredTensor`` (read, and checked, only where used)."""
    from interop.errors import UnsafePickleError

    allow: list[Any] = [argparse.Namespace, *numpy_allowlist()]

    def stand_in(problem: str) -> bool:
        """Allow a stand-in for the ``megatron.*`` global ``problem`` names; False if it names none or a known one."""
        found = re.search(r"references (megatron\.[\w.]+)", problem)
        if not found or any(isinstance(a, tuple) and a[1] == found.group(1) for a in allow):
            return False
        allow.append((MegatronObject, found.group(1)))
        return True

    # stored: the stand-in reader's own refusals name the globals (torch's loader would check the whole file first)
    stored = stored and not trust_pickle and is_mapped(path)
    for _ in range(64):
        try:
            if stored:
                return torch_zip.load(path, allow)
            return load_torch_file(path, trust_pickle, allow=allow)
        except torch_zip.NeedsTorch as why:  # anything else stand-ins cannot express: torch's loader decides
            stored = stand_in(str(why))
        except UnsafePickleError as exc:
            if not stand_in(exc.problem):
                raise
    raise CorruptCheckpointError(path, "names too many Megatron objects to stand in for")


# --- where the files are -------------------------------------------------------------------------------------
@dataclass
class LegacyFiles:
    root: str | None  # the directory with latest_checkpointed_iteration.txt, when there is one
    iteration_dir: str
    iteration: int | None  # None for "release"
    tp: int
    pp: int
    paths: dict[tuple[int, int], str]  # (tp rank, pp rank) -> model_optim_rng.pt (expert-parallel rank 0's)
    ep: int = 1
    all_paths: dict[tuple[int, int, int], str] = field(default_factory=dict)  # (tp, pp, ep rank) -> its file


def _read_tracker(root: str) -> str:
    name = read_iteration_tracker(root)
    if name is None:
        raise MissingFileError(os.path.join(root, TRACKER), "missing: Megatron-LM's tracker names the iteration")
    return name


def _rank_dir(t: int, p: int, e: int, named: tuple[bool, bool]) -> str:
    """Megatron-LM's get_checkpoint_name: ``mp_rank_TT``, ``_PPP`` with pipeline parallelism, ``_EEE`` with expert
    parallelism."""
    return f"mp_rank_{t:02d}" + (f"_{p:03d}" if named[0] else "") + (f"_{e:03d}" if named[1] else "")


def locate(path: str, args: dict[str, Any] | None = None, check: bool = True) -> LegacyFiles:
    """The iteration directory ``path`` means (the root's latest, or the directory itself), and its rank files.

    Every TP x PP x EP rank must be present: the sizes come from the directory names, and from ``args`` when
    given, so a rank directory that is missing at either end of the grid is named. Two numbers in a name are
    ``TT_PPP`` or, with expert parallelism and one stage, ``TT_EEE``: only the arguments tell them apart.
    ``check=False``: only rank 0's file is needed (to read the arguments from)."""
    root = None
    if os.path.isfile(os.path.join(path, TRACKER)):
        root = path
        iteration_dir = os.path.join(path, _read_tracker(path))
        if not os.path.isdir(iteration_dir):
            raise MissingFileError(iteration_dir, f"named by {TRACKER} but missing")
    else:
        iteration_dir = path
    name = os.path.basename(os.path.normpath(iteration_dir))
    found = ITER_DIR.match(name)
    iteration = int(found.group(1)) if found else None
    a = args or {}
    ep_arg, pp_arg = (int(a.get(k) or 1) for k in ("expert_model_parallel_size", "pipeline_model_parallel_size"))
    ranks: dict[tuple[int, int, int], str] = {}
    named: set[tuple[bool, bool]] = set()
    for d in sorted(os.listdir(iteration_dir)):
        m = RANK_DIR.match(d)
        if not m:
            continue
        nums = [int(g) for g in m.groups() if g is not None]
        if len(nums) == 3:
            key, how = (nums[0], nums[1], nums[2]), (True, True)
        elif len(nums) == 2 and ep_arg > 1 and pp_arg == 1:
            key, how = (nums[0], 0, nums[1]), (False, True)
        else:
            key, how = (nums[0], nums[1] if len(nums) == 2 else 0, 0), (len(nums) == 2, False)
        named.add(how)
        ranks[key] = os.path.join(iteration_dir, d, FILE)
    if not ranks:
        raise MissingFileError(iteration_dir, "holds no mp_rank_* directories: not a Megatron checkpoint iteration")
    if len(named) > 1:
        raise CorruptCheckpointError(iteration_dir, "holds rank directories named for different layouts "
                                     f"({sorted(_rank_dir(0, 0, 0, n) for n in named)}): files of two runs")
    how = named.pop()
    tp, pp, ep = (max(k[i] for k in ranks) + 1 for i in range(3))
    tp = max(tp, int(a.get("tensor_model_parallel_size") or 1))
    pp, ep = max(pp, pp_arg), max(ep, ep_arg)
    grid = [(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)] if check else [(0, 0, 0)]
    for t, p, e in grid:
        if (t, p, e) not in ranks or not os.path.isfile(ranks[(t, p, e)]):
            sizes = f"TP {tp} x PP {pp}" + (f" x EP {ep}" if ep > 1 else "")
            raise MissingFileError(os.path.join(iteration_dir, _rank_dir(t, p, e, how)),
                                   f"missing: a checkpoint with {sizes} has one directory per rank")
    return LegacyFiles(root, iteration_dir, iteration, tp, pp, {(t, p): f for (t, p, e), f in ranks.items() if e == 0}, ep, ranks)


# --- reading --------------------------------------------------------------------------------------------------
# What the reader uses of a rank's model_optim_rng.pt (megatron/training/checkpointing.py's save_checkpoint):
# the model (or each virtual-pipeline chunk's, model0, model1, ...), the arguments, the optimizer (a MoE's chained
# optimizers: a list) and the RNG states; checked once the file is loaded
_STATE_MAP = MapOf(str, object)
MEGATRON_ARGS = Is(lambda a: isinstance(a, dict) or hasattr(a, "__dict__"), "Megatron's arguments (a namespace)")
RANK_STATE = Keys(
    model=Absent(_STATE_MAP), iteration=Maybe(int), checkpoint_version=Maybe(NUMBER), rng_state=Maybe(ListOf(object)),
    args=Maybe(MEGATRON_ARGS),
    optimizer=Maybe(OneOf(_STATE_MAP, ListOf(_STATE_MAP))),
)


def _rank_state(path: str, state: Any) -> dict[str, Any]:
    if not isinstance(state, dict):
        raise CorruptCheckpointError(path, f"is a {type(state).__name__}, not a Megatron rank's state dict")
    check(path, state, Keys(RANK_STATE, **{k: _STATE_MAP for k in state if re.fullmatch(r"model\d+", str(k))}))
    return state


def _model_chunks(state: dict[str, Any], path: str) -> list[dict[str, Any]]:
    if "model" in state:
        return [state["model"]]
    chunks = sorted((int(k[5:]), v) for k, v in state.items() if re.fullmatch(r"model\d+", str(k)))
    if not chunks:
        raise CorruptCheckpointError(path, "holds no 'model' entry")
    return [v for _, v in chunks]


def _layers_in(chunk: dict[str, Any]) -> int:
    found = {layer_of(k) for k in chunk if layer_of(k) is not None}
    return max(found) + 1 if found else 0


def _canonical(all_rules: list[Rule]) -> dict[str, Rule]:
    names: dict[str, Rule] = {}
    for r in all_rules:
        for n in (r.megatron, *r.aliases):
            names[n] = r
    return names


class MergedCache:
    """The last full Megatron tensor built, so q, k and v (or gate and up) merge their TP pieces once. When
    the next one is built, the pages of the mapped files under the previous one's pieces are let go, so
    streaming a checkpoint costs the memory of a tensor, not of the files."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.value: list[torch.Tensor] = []
        self.pieces: list[torch.Tensor] = []

    def get(self, key: tuple, build: Callable[[], tuple[list[torch.Tensor], list[torch.Tensor]]]) -> list[torch.Tensor]:
        if key != self.key:
            for piece in self.pieces:
                release_mapped_pages(piece)
            self.key, self.value, self.pieces = None, [], []
            self.value, self.pieces = build()
            self.key = key
        return self.value


@dataclass(frozen=True, eq=False)
class RowPlan:
    """The piece rows one Hugging Face tensor is made of, in order: ``ids[i]`` is row ``ids[i] % rows`` of TP piece
    ``ids[i] // rows``; ``starts`` where each run of consecutive rows of one piece begins. Kept as arrays: a column
    split's plan is a run per piece row, thousands per tensor."""

    ids: Any  # numpy int64, one per row of the Hugging Face tensor (in piece rows)
    starts: Any  # numpy int64, ascending, starts[0] == 0
    rows: int  # rows of each piece

    def runs(self) -> list[tuple[int, int, int]]:
        """``(TP piece, first row, rows)`` of each run."""
        bounds = [*self.starts.tolist(), int(self.ids.size)]
        firsts = self.ids[self.starts].tolist()
        return [(first // self.rows, first % self.rows, b - a) for first, a, b in zip(firsts, bounds, bounds[1:])]


def row_runs(rule: Rule, arch: MegatronArch, piece_shape: tuple[int, ...], tp: int,
             shapes: list[tuple[int, ...]], tiled: int | None = None) -> list[RowPlan] | None:
    """For each Hugging Face tensor of ``rule``, the piece rows it is made of (:class:`RowPlan`), where merging the
    pieces and unfusing moves whole rows of the pieces only (a row split, the vocabulary, [gate; up], a fused QKV, and
    a column split, whose every row is one piece row after another); None where anything else moves (a transpose).
    Worked out by running the merge and the unfuse themselves on each piece's row numbers (numpy, no torch), so it
    holds for whatever they do. The pieces are the TP ranks' (merged by the rule), or with ``tiled`` the chunks of a
    torch_dist slot that tile that dimension of the full tensor (joined along it)."""
    import numpy as np

    from .row_numbers import RowNumbers

    if not piece_shape:
        return None
    rows, rest = piece_shape[0], (1,) * (len(piece_shape) - 1)
    # a row of the full tensor is one row of each piece, side by side
    across = (rule.split == COLS if tiled is None else tiled == 1) and tp > 1
    if across and len(piece_shape) != 2:
        return None
    numbers = [RowNumbers.of(np.arange(t * rows, (t + 1) * rows).reshape(rows, *rest)) for t in range(tp)]
    try:
        full = merge(rule, numbers) if tiled is None else cat(numbers, dim=tiled) if tp > 1 else numbers[0]
        if rule.split == VOCAB:
            full = full[: arch.vocab]
        parts = rule.unfuse(full)
    except Exception as exc:  # noqa: BLE001 - a fuser calling what the stand-in lacks: merged with torch instead
        log.debug("no row plan for %s: %s", rule.megatron, exc)
        return None
    unit = (tp,) if across else rest  # what one row of the Hugging Face tensor is, in piece rows
    width = (tp * piece_shape[1],) if across else tuple(piece_shape[1:])
    out = []
    for part, shape in zip(parts, shapes):
        if tuple(part.shape) != (shape[0], *unit) or tuple(shape[1:]) != width:
            return None
        ids = np.ascontiguousarray(part, dtype=np.int64).reshape(-1)
        # a run breaks where the next row is not the next one of the same piece
        breaks = np.flatnonzero((ids[1:] != ids[:-1] + 1) | (ids[1:] // rows != ids[:-1] // rows)) + 1
        out.append(RowPlan(ids, np.concatenate([np.zeros(min(ids.size, 1), np.int64), breaks]), rows))
    return out if len(out) == len(shapes) else None


_JOIN_BELOW = 1 << 16  # runs shorter than this on average are copied into one buffer, not written one by one


def _gather_rows(plan: RowPlan, whole: dict[int, Piece], row_bytes: int) -> memoryview:
    """The plan's rows, one after another (numpy, no torch): each piece's rows read from its file (not through its
    mapping, where a file cut short meanwhile would kill the process with SIGBUS) and put in place, a piece whose
    rows land evenly spaced (a column split: every TP-th row) in one strided assignment."""
    import numpy as np

    from interop.output_files import read_pieces

    out = np.empty((plan.ids.size, row_bytes), np.uint8)
    of_piece = plan.ids // plan.rows
    for t, piece in whole.items():
        at = np.flatnonzero(of_piece == t)
        if not at.size:
            continue
        local = plan.ids[at] - t * plan.rows
        lo, hi = int(local.min()), int(local.max()) + 1
        source = np.empty((hi - lo, row_bytes), np.uint8)
        read_pieces(sub_pieces([piece], lo * row_bytes, hi * row_bytes), source.reshape(-1).data)
        local = local - lo
        step = int(at[1] - at[0]) if at.size > 1 else 1
        if np.all(np.diff(at) == step) and np.all(np.diff(local) == 1):
            out[at[0] :: step][: at.size] = source[local[0] : local[0] + at.size]
        else:
            out[at] = source[local]
    return out.reshape(-1).data


def _mapped_rows(pieces: list[Callable[[], Any]], plans: Callable[[], list[RowPlan] | None], i: int, dtype: str,
                 piece_shape: tuple[int, ...]) -> Callable[[], list | None]:
    """LazyTensor.mapped_pieces from the ``i``-th of a rule's row plans: each run a view of its TP piece's file, or,
    where the runs are short (a column split's rows), their bytes gathered in one buffer; None where the rule has no
    row plan or a piece is not a contiguous stand-in of the tensor's dtype and the pieces' shape (the tensor is then
    loaded, checked and merged with torch)."""
    width = math.prod(piece_shape[1:])
    row_bytes = width * itemsize(dtype)

    def mapped() -> list | None:
        planned = plans()
        if planned is None:
            return None
        plan = planned[i]
        stored = {}
        used = sorted(set((plan.ids // plan.rows).tolist())) if plan.ids.size else []
        for t in used:
            piece = pieces[t]()
            if (not isinstance(piece, StoredTensor) or tuple(piece.shape) != tuple(piece_shape) or not piece.is_contiguous()
                    or piece.dtype_name != dtype):
                return None
            stored[t] = piece.reshape(-1)
        if len(plan.starts) > 1 and plan.ids.size * row_bytes < len(plan.starts) * _JOIN_BELOW:
            whole = {t: s.piece() for t, s in stored.items()}  # each piece's bytes checked against the manifest once
            try:
                joined = _gather_rows(plan, whole, row_bytes)
            finally:
                for p in whole.values():
                    if p.release is not None:
                        p.release()
            return [Piece(joined, dtype=dtype)]
        return [stored[t][first * width : (first + count) * width].piece() for t, first, count in plan.runs()]

    return mapped


def hf_tensors(
    rule: Rule, pieces: list[Callable[[], torch.Tensor]], arch: MegatronArch, where: str, cache: MergedCache, tag: str,
    dtype: str, shapes: list[tuple[int, ...]], piece_shape: tuple[int, ...] | None = None, tiles: Tiles | None = None,
) -> dict[str, LazyTensor]:
    """Lazy Hugging Face tensors of one rule: each merges the TP pieces and unfuses when first loaded. Given the
    pieces' shape, a tensor whose rows lie whole in the pieces' files is also offered as views of them
    (``mapped_pieces``: a writer copies them file to file), see :func:`row_runs`; given ``tiles`` (a torch_dist
    slot's chunks), views of those instead."""

    def build() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        loaded = [as_torch(p()) for p in pieces]
        check_pieces(rule, loaded, where)
        full = merge(rule, loaded)
        if rule.split == VOCAB:
            full = full[: arch.vocab]
        return rule.unfuse(full), loaded

    if tiles is not None:
        viewed, piece_shape, tiled = tiles.pieces, tiles.shape, tiles.dim
    else:
        viewed, tiled = pieces, None
    # worked out when a writer first asks for a tensor's bytes, on its thread: a target that never does (an export
    # leaves the optimizer's state) plans nothing, and a reader hands its checkpoint over without planning each row
    plans = functools.cache(lambda: row_runs(rule, arch, piece_shape, len(viewed), shapes, tiled=tiled)) if piece_shape else None
    out = {}
    for i, (name, shape) in enumerate(zip(rule.hf, shapes)):
        out[name] = LazyTensor(
            TensorSpec(shape, dtype), lambda i=i: cache.get((rule.megatron, tag), build)[i], f"{where}:{rule.megatron}",
            mapped_pieces=_mapped_rows(viewed, plans, i, dtype, piece_shape) if plans else None,
        )
    return out


def hf_shapes(rule: Rule, arch: MegatronArch, full_shape: tuple[int, ...], where: str = "") -> list[tuple[int, ...]]:
    """Shapes of the Hugging Face tensors a rule unfuses into, from the full tensor's shape, without loading (nor
    torch: the unfuse runs on a shape-only stand-in). An attention's, MLP's or expert's linear whose shape is not the
    arguments' is one line naming ``where`` (a damaged file would otherwise convert to a model its config does not describe)."""
    from .row_numbers import RowNumbers

    wanted = linear_shape(rule, arch)
    if wanted is not None and tuple(full_shape) != wanted:
        raise CorruptCheckpointError(where or None, f"{rule.megatron} is {list(full_shape)}, the arguments' model has {list(wanted)}")

    if rule.split == VOCAB:
        full_shape = (arch.vocab, *full_shape[1:])
    try:
        return [tuple(t.shape) for t in rule.unfuse(RowNumbers.shaped(full_shape))]
    except Exception as exc:  # noqa: BLE001 - a fuser calling what the stand-in lacks: torch's meta tensors answer
        log.debug("shapes of %s through torch: %s", rule.megatron, exc)
        return [tuple(t.shape) for t in rule.unfuse(torch.empty(full_shape, device="meta"))]


def _full_shape(rule: Rule, piece_shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    if rule.split in (ROWS, VOCAB, GATED):
        return (piece_shape[0] * tp, *piece_shape[1:])
    if rule.split == COLS:
        return (piece_shape[0], piece_shape[1] * tp, *piece_shape[2:])
    return piece_shape


@dataclass
class _RankModel:
    """One TP x PP rank's parameters in Megatron's module order, with global layer numbers."""

    names: list[str]  # global Megatron names, canonical (no aliases)
    tensors: dict[str, torch.Tensor]
    # tied copies, after every name in module order: the last pipeline stage's output_layer.weight, a parameter of
    # its own there (megatron-core's shared_embedding_or_output_weight), which that stage's optimizer numbers too
    copies: dict[str, torch.Tensor] = field(default_factory=dict)
    # the model chunk (virtual pipeline stage) holding each name; the tied copies are the last chunk's
    chunk: dict[str, int] = field(default_factory=dict)
    buffers: tuple[str, ...] = ()  # names in ``tensors`` that are buffers (a router's expert bias): in no optimizer

    def chunks(self, names: list[str], copies: dict[str, torch.Tensor]) -> list[tuple[int, list[tuple[str, tuple[int, ...]]]]]:
        """``names`` (and the tied ``copies``) as (chunk, [(name, shape)]) per gradient buffer
        (:func:`.megatron_buffer.chunk_buffers`)."""
        last = max(self.chunk.values(), default=0)
        return buffer.chunk_buffers([(self.chunk.get(n, 0), (n, tuple(self.tensors[n].shape))) for n in names]
                                    + [(last, (n, tuple(t.shape))) for n, t in copies.items()])

    def dense_and_experts(self) -> tuple[list[str], list[str]]:
        """The names of a MoE model's two chained optimizers (megatron-core's at EP > 1), in module order."""
        return [n for n in self.names if not _is_expert(n)], [n for n in self.names if _is_expert(n)]


def _expert_at(name: str) -> tuple[str, int] | None:
    """(its layer, local expert) of a tensor in a SequentialMLP expert (a decoder layer's or an MTP layer's), None
    outside the experts."""
    expert, layer = expert_index(name), layer_of(name)
    if expert is None:
        return None
    return (f"layer {layer}" if layer is not None else f"MTP layer {name[len(MTP_PREFIX):].split('.', 1)[0]}"), expert


GROUPED = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)weight([12])$")  # GroupedMLP: a rank's experts in two tensors
TE_GROUPED = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight\d+$")  # TEGroupedMLP: weight<i> per local expert


def _is_expert(name: str) -> bool:
    return _expert_at(name) is not None or GROUPED.match(name) is not None


def _ungroup(name: str, t: torch.Tensor, first: int, per: int, hidden: int, width: dict[str, int], path: str) -> dict[str, torch.Tensor]:
    """GroupedMLP's ``weight1`` ([hidden, experts x fc1 rows], read as [experts, hidden, fc1 rows]) or ``weight2``
    ([experts x fc2 columns, hidden]) as each expert's SequentialMLP tensor (its transpose; the same tensor-parallel
    piece), experts numbered from ``first``. megatron-core's GroupedMLP.forward views them so. ``width``: an
    expert's fc1 rows and fc2 columns on this tensor-parallel rank."""
    prefix, which = GROUPED.match(name).groups()
    expected = (hidden, per * width["1"]) if which == "1" else (per * width["2"], hidden)
    if tuple(t.shape) != expected or not t.is_contiguous():
        raise CorruptCheckpointError(path, f"{name} has shape {tuple(t.shape)}; GroupedMLP's weight{which} of {per} experts "
                                     f"is {expected}")
    experts = t.view(per, hidden, -1) if which == "1" else t.view(per, -1, hidden)
    return {f"{prefix}local_experts.{first + j}.linear_fc{which}.weight": experts[j].t() for j in range(per)}


def _with_expert(name: str, expert: int) -> str:
    """``...local_experts.<e>.x`` with another expert index (an expert-parallel rank numbers its own from 0)."""
    head, _, rest = name.partition(EXPERTS)
    return f"{head}{EXPERTS}{expert}.{rest.split('.', 1)[1]}"


def _rank_models(files: LegacyFiles, states: dict[tuple[int, int, int], dict], canon: dict[str, Rule],
                 experts: int) -> dict[tuple[int, int, int], _RankModel]:
    """Every (TP, PP, EP) rank's model with global layer and expert indices: stage p's chunk v starts where the
    layers before it end (with virtual stages, chunk v of every stage comes before chunk v + 1 of any), expert
    rank e's local expert j is expert e x (experts / EP) + j. An expert rank other than 0 contributes its experts
    only (its dense tensors are the same replica's)."""
    chunks = {key: _model_chunks(s, files.all_paths[key]) for key, s in states.items()}
    vpp = len(chunks[(0, 0, 0)])
    sizes = [[_layers_in(chunks[(0, p, 0)][v]) for p in range(files.pp)] for v in range(vpp)]
    offsets, total = {}, 0
    for v in range(vpp):
        for p in range(files.pp):
            offsets[(p, v)] = total
            total += sizes[v][p]
    per = experts // files.ep if experts else 0
    out = {}
    for (t, p, e), cs in chunks.items():
        path = files.all_paths[(t, p, e)]
        if len(cs) != vpp:
            raise CorruptCheckpointError(path, f"holds {len(cs)} model chunks; rank (0, 0) holds {vpp}")
        names, tensors, copies, chunk_of, buffers = [], {}, {}, {}, []
        for v, chunk in enumerate(cs):
            for key, value in chunk.items():
                if not is_tensor(value):
                    continue  # _extra_state
                name = key
                if key.startswith(LAYER_PREFIX):
                    name = local_name(key, -offsets[(p, v)])
                at = _expert_at(name)
                if GROUPED.match(name):  # expanded into the experts once the optimizer has numbered it
                    names.append(name)
                    tensors[name] = value
                    chunk_of[name] = v
                    continue
                if TE_GROUPED.search(name):
                    raise ConversionError(f"{path}: {key!r} is Transformer Engine's grouped-GEMM expert (TEGroupedMLP), whose legacy "
                                          "layout is not read here; save with --ckpt-format torch_dist, which stores it as SequentialMLP's")
                if at is None and e > 0:
                    continue
                if at is not None:
                    if not 0 <= at[1] < per:
                        raise CorruptCheckpointError(path, f"{at[0]} holds local expert {at[1]}, but {experts} experts "
                                                     f"over {files.ep} expert-parallel ranks give each {per}: an expert would "
                                                     "be duplicated or dropped")
                    name = _with_expert(name, e * per + at[1])
                rule = canon.get(name)
                if rule is None:
                    if name == "output_layer.weight":  # tied: the last stage's copy of the embedding
                        copies[name] = value
                        continue
                    raise ConversionError(
                        f"{path}: tensor {key!r} has no Hugging Face name (Megatron-LM from before megatron-core?)"
                    )
                if rule.megatron in tensors:
                    raise CorruptCheckpointError(path, f"holds {rule.megatron} twice (as {key!r} too)")
                tensors[rule.megatron] = value
                if rule.buffer:
                    buffers.append(rule.megatron)
                    continue
                names.append(rule.megatron)
                chunk_of[rule.megatron] = v
        out[(t, p, e)] = _RankModel(names, tensors, copies, chunk_of, tuple(buffers))
    return out


def _ungrouped(rank: _RankModel, optim: tuple, ep_rank: int, per: int, hidden: int, width: dict[str, int],
               path: str) -> tuple[_RankModel, tuple]:
    """A rank's model and optimizer with GroupedMLP's weight1 / weight2 as each expert's tensors: the weights, every
    optimizer state of their shape (Adam's moments), the fp32 masters and the param groups' members."""
    grouped = [n for n in rank.names if GROUPED.match(n)]
    if not grouped:
        return rank, optim
    per_name, groups, master = optim
    names, tensors, expanded = [], dict(rank.tensors), {}
    for n in rank.names:
        if n not in grouped:
            names.append(n)
            continue
        def split(t: Any, n: str = n) -> dict[str, torch.Tensor]:
            return _ungroup(n, as_torch(t), ep_rank * per, per, hidden, width, path)

        parts = split(tensors.pop(n))
        expanded[n] = list(parts)
        names.extend(parts)
        tensors.update(parts)
        if n in master:
            master.update(split(master.pop(n)))
        entries = per_name.pop(n, None)
        if entries:  # Adam's moments are split like the weight; the step is every expert's
            shape = tuple(rank.tensors[n].shape)
            pieces = {k: split(v) for k, v in entries.items() if is_tensor(v) and tuple(v.shape) == shape}
            for m in parts:
                per_name[m] = {k: pieces[k][m] if k in pieces else v for k, v in entries.items()}
    groups = [{**g, "params": [m for n in g["params"] for m in expanded.get(n, [n])]} for g in groups]
    return _RankModel(names, tensors, buffers=rank.buffers), (per_name, groups, master)


def _check_experts(arch: MegatronArch, files: LegacyFiles, args: dict[str, Any], where: str) -> None:
    """A MoE model's experts split evenly over the expert-parallel ranks, and over tensor-parallel ranks as the
    dense layers are (Megatron-LM's default expert tensor-parallel size: the TP size)."""
    if files.ep > 1 and not arch.experts:
        raise CorruptCheckpointError(where, f"expert-parallel rank directories (EP {files.ep}) of a model without experts")
    if not arch.experts:
        return
    if arch.experts % files.ep:
        raise CorruptCheckpointError(where, f"{arch.experts} experts do not split over {files.ep} expert-parallel ranks")
    etp = args.get("expert_tensor_parallel_size")
    if etp not in (None, files.tp):
        raise ConversionError(f"{where}: experts split over expert tensor-parallel size {etp}, the dense layers over TP "
                              f"{files.tp}; legacy files are read with the two equal (Megatron-LM's default)")


def _same_state_kinds(optim3: dict, paths: dict) -> None:
    """Every parameter's optimizer state holds the same keys, each a tensor of its shape or a scalar alike, on every
    rank: the conversion takes each key's kind from one entry and reads the others' as that."""
    first = None
    held = [key for key, (per_name, _, _) in optim3.items() if per_name]
    empty = [key for key in optim3 if key not in held]
    if held and empty:
        raise CorruptCheckpointError(paths[empty[0]], f"holds no optimizer state, where {paths[held[0]]} holds it")
    for key, (per_name, _, _) in optim3.items():
        for name, entries in per_name.items():
            kinds = {k: "a tensor" if is_tensor(v) and v.dim() > 0 else "a scalar" for k, v in entries.items()}
            if first is None:
                first = (kinds, name)
            elif kinds != first[0]:
                raise CorruptCheckpointError(paths[key], f"optimizer state of {name} is {kinds}, where {first[1]}'s is {first[0]}")


def _merge_expert_ranks(files: LegacyFiles, ranks3: dict, optim3: dict) -> tuple[dict, dict]:
    """Each (TP, PP) rank's model and optimizer with the experts of every expert-parallel rank: the expert groups
    of rank e > 0 (its only groups) extend the last groups of rank 0's."""
    ranks, optim = {}, {}
    for (t, p, e) in sorted(ranks3):
        rm, (per_name, groups, master) = ranks3[(t, p, e)], optim3[(t, p, e)]
        if e == 0:
            ranks[(t, p)] = _RankModel(list(rm.names), dict(rm.tensors), buffers=rm.buffers)
            optim[(t, p)] = (dict(per_name), [{**g, "params": list(g["params"])} for g in groups], dict(master))
            continue
        twice = set(rm.names) & set(ranks[(t, p)].tensors)
        if twice:
            raise CorruptCheckpointError(files.all_paths[(t, p, e)], f"holds {sorted(twice)[0]}, which another expert rank holds")
        if bool(per_name) != bool(optim[(t, p)][0]):
            raise CorruptCheckpointError(files.all_paths[(t, p, e)], "has optimizer state where expert rank 0's file has none, "
                                         "or none where it has")
        ranks[(t, p)].names.extend(rm.names)
        ranks[(t, p)].tensors.update(rm.tensors)
        into = optim[(t, p)]
        into[0].update(per_name)
        into[2].update(master)
        if len(groups) > len(into[1]):
            raise CorruptCheckpointError(files.all_paths[(t, p, e)], f"{len(groups)} expert optimizer groups; expert rank 0 has fewer")
        for g, mine in zip(into[1][len(into[1]) - len(groups):], groups):
            g["params"].extend(mine["params"])
    return ranks, optim


def is_no_decay(name: str, shape: tuple[int, ...]) -> bool:
    """Megatron's standard rule: no weight decay for biases and one-dimensional parameters (norms)."""
    return name.endswith(".bias") or len(shape) == 1


def _group_members(groups: list[dict[str, Any]], rank: _RankModel, path: str) -> list[list[str]]:
    """Which Megatron parameters each optimizer group numbers, in order (ids run over the groups in turn): the
    rank's tied copy too where the groups number it (Megatron-LM's own files), else only its names."""
    shapes = {n: tuple(t.shape) for n, t in {**rank.tensors, **rank.copies}.items()}
    problem = ""
    for params in ([*rank.names, *rank.copies], rank.names) if rank.copies else (rank.names,):
        decay = [n for n in params if not is_no_decay(n, shapes[n])]
        no_decay = [n for n in params if is_no_decay(n, shapes[n])]
        members: list[list[str]] = []
        for g in groups:
            zero_wd = float(g.get("wd_mult", 1.0)) == 0.0 or float(g.get("weight_decay", 1.0)) == 0.0
            pool = no_decay if zero_wd else decay
            count = len(g["params"])
            if count > len(pool):
                problem = problem or f"optimizer group of {count} parameters; the model has {len(pool)} of that kind"
                break
            members.append(pool[:count])
            del pool[:count]
        else:
            left = decay + no_decay
            if not left:
                return members
            problem = problem or f"parameters in no optimizer group: {left[:3]}"
    raise ConversionError(f"{path}: {problem}")


def _rank_optimizer(state: dict[str, Any], rank: _RankModel, path: str) -> tuple[dict[str, dict[str, Any]], list[dict], dict[str, torch.Tensor]]:
    """One rank's optimizer: per Megatron name its state entries, the param groups, and fp32 master weights.
    A MoE model's is megatron-core's ChainedOptimizer, whose legacy state dict is a list: the dense parameters'
    optimizer, then the experts' (each numbering its own parameters); an expert-parallel rank other than 0 gives its
    experts' part only."""
    opt = state.get("optimizer")
    if opt is None:
        return {}, [], {}
    if not isinstance(opt, (list, tuple)):
        return _one_optimizer(opt, rank, path)
    dense, experts = rank.dense_and_experts()
    if len(opt) != 2 or not experts:
        raise CorruptCheckpointError(path, f"optimizer chains {len(opt)} optimizers; megatron-core chains a MoE model's "
                                     "dense and expert optimizers (2), and a dense model's none")
    per_name: dict[str, dict[str, Any]] = {}
    groups: list[dict] = []
    master: dict[str, torch.Tensor] = {}
    for part, names in zip(opt, (dense, experts)):
        if not names:
            continue  # an expert-parallel rank other than 0: its dense optimizer is rank 0's replica
        got = _one_optimizer(part, _RankModel(names, {n: rank.tensors[n] for n in names}, rank.copies if names is dense else {}), path)
        per_name.update(got[0])
        groups += got[1]
        master.update(got[2])
    return per_name, groups, master


# Megatron's mixed-precision optimizer (megatron/core/optimizer/optimizer.py, Float16OptimizerWithFloat16Params's
# state_dict): torch's state dict inside, and the fp32 master copies of each group's parameters beside it
MEGATRON_TORCH = Keys(TORCH_OPTIMIZER, param_groups=ListOf(Keys(params=ListOf(int), weight_decay=Maybe(NUMBER), wd_mult=Maybe(NUMBER))))
MEGATRON_OPTIMIZER = Keys(optimizer=MEGATRON_TORCH, fp32_from_fp16_params=Maybe(ListOf(ListOf(TENSOR))))


def _one_optimizer(opt: Any, rank: _RankModel, path: str) -> tuple[dict[str, dict[str, Any]], list[dict], dict[str, torch.Tensor]]:
    master: dict[str, torch.Tensor] = {}
    inner = opt.get("optimizer", opt) if isinstance(opt, dict) else None
    if not isinstance(inner, dict) or "param_groups" not in inner:
        raise CorruptCheckpointError(path, "optimizer entry is neither torch's state dict nor Megatron's mixed-precision dict")
    check(path, opt, MEGATRON_OPTIMIZER if inner is not opt else MEGATRON_TORCH)
    groups = inner["param_groups"]
    members = _group_members(groups, rank, path)
    by_id = [n for m in members for n in m]
    per_name: dict[str, dict[str, Any]] = {}
    for pid, entries in inner.get("state", {}).items():
        if not isinstance(pid, int) or pid >= len(by_id):
            raise CorruptCheckpointError(path, f"optimizer state for parameter id {pid!r}, which no group holds")
        name = by_id[pid]
        shape = tuple((rank.tensors[name] if name in rank.tensors else rank.copies[name]).shape)
        wrong = next(((k, s) for k, s in state_shapes(entries).items() if s != shape), None)
        if wrong is not None:
            raise CorruptCheckpointError(path, f"optimizer state {wrong[0]!r} of {name} is {list(wrong[1])}, not its shape {list(shape)}")
        per_name[name] = entries
    if "fp32_from_fp16_params" in opt:
        flat = [t for g in opt["fp32_from_fp16_params"] for t in g]
        if len(flat) != len(by_id):
            raise CorruptCheckpointError(path, f"{len(flat)} fp32 master copies for {len(by_id)} parameters")
        master = dict(zip(by_id, flat))
    for copy in rank.copies:  # numbered, and the embedding's replica: its state is the embedding's
        per_name.pop(copy, None)
        master.pop(copy, None)
    named_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [n for n in m if n not in rank.copies]}
                    for g, m in zip(groups, members)]
    return per_name, named_groups, master


DISTRIB_OPTIM = "distrib_optim.pt"  # --use-distributed-optimizer: the optimizer's state, beside model_optim_rng.pt
def _distributed_optimizer(state: dict[str, Any], rank: _RankModel, model_path: str, trust_pickle: bool,
                           shared: frozenset[str], bucket_size: Callable[[int], int | None]):
    """One rank's optimizer saved by megatron-core's DistributedOptimizer: the param groups (and step) stay in
    model_optim_rng.pt, the fp32 main params and Adam moments of the whole rank are in distrib_optim.pt (gathered
    from every DP rank), flat in the buffer's layout (:mod:`.megatron_buffer`; ``shared``: the tied embedding's
    names, ``bucket_size``: the run's for each model chunk). The last stage's tied copy has its place there too; its state is the
    embedding's, as in the plain optimizer. A MoE model at EP > 1 has megatron-core's ChainedOptimizer: both files
    hold a list, the dense optimizer's part and the experts' (ChainedOptimizer.save_parameter_state); an
    expert-parallel rank other than 0 holds the experts' only (None for the dense part, expert rank 0's replica)."""
    path = os.path.join(os.path.dirname(model_path), DISTRIB_OPTIM)
    saved = load_megatron_file(path, trust_pickle)
    opt = state.get("optimizer")
    dense, experts = rank.dense_and_experts()
    if isinstance(saved, list) and len(saved) == 2 and isinstance(opt, (list, tuple)) and len(opt) == 2 and experts:
        parts = [(saved[0], opt[0], dense, rank.copies, shared), (saved[1], opt[1], experts, {}, frozenset())]
    elif isinstance(saved, list) and len(saved) == 2:
        raise CorruptCheckpointError(path, "holds two optimizers' parameter states (a MoE model's dense and expert parts); "
                                     f"{os.path.basename(model_path)}'s model has {'no experts' if not experts else 'one optimizer'}")
    else:
        parts = [(saved[0] if isinstance(saved, list) and len(saved) == 1 else saved, opt, rank.names, rank.copies, shared)]
    per_name: dict[str, dict[str, Any]] = {}
    named_groups: list[dict] = []
    master: dict[str, torch.Tensor] = {}
    for i, (part, part_opt, names, copies, part_shared) in enumerate(parts):
        if part is None and not names:
            continue  # an expert-parallel rank other than 0: its dense optimizer is rank 0's replica
        got = _distributed_part(part, part_opt, names, rank, copies, path, model_path, part_shared, bucket_size,
                                f"[{i}]" if len(parts) > 1 else "")
        per_name.update(got[0])
        named_groups += got[1]
        master.update(got[2])
    return per_name, named_groups, master


# DistributedOptimizer.get_parameter_state_dp_zero: per gradient buffer, per (param dtype, grad dtype), the flat fp32
# main params and Adam moments of the buffer's buckets, their end padding dropped
DISTRIB_OPTIM_BUFFERS = MapOf(int, MapOf(tuple, Keys(param=TENSOR, exp_avg=TENSOR, exp_avg_sq=TENSOR, numel_unpadded=int)))


def _distributed_part(saved: Any, opt: Any, names: list[str], rank: _RankModel, copies: dict[str, torch.Tensor], path: str,
                      model_path: str, shared: frozenset[str], bucket_size: Callable[[int], int | None], where: str = ""):
    """One DistributedOptimizer's state of ``names`` (in module order; ``copies``: the tied copy in its buffer);
    ``where``: its place in the file (a ChainedOptimizer's list)."""
    check(path, saved, Keys(buckets_coalesced=bool), where)
    if not saved["buckets_coalesced"]:
        raise CorruptCheckpointError(path, "is not a distributed optimizer's parameter state of this Megatron version "
                                     "(buckets_coalesced)")
    buffers = {k: v for k, v in saved.items() if k != "buckets_coalesced"}
    check(path, buffers, DISTRIB_OPTIM_BUFFERS, where)
    chunks = rank.chunks(names, copies)  # one gradient buffer per model chunk holding any of the parameters
    if list(buffers) != list(range(len(chunks))) or any(len(b) != 1 for b in buffers.values()):
        raise ConversionError(f"{path}: gradient buffers {sorted(buffers)} of {[list(v) for v in buffers.values()]} dtypes; "
                              f"this rank's {len(chunks)} model chunk(s) have one buffer each, of one dtype (one precision "
                              "is supported)")
    located: dict[str, tuple[dict[str, torch.Tensor], int, int]] = {}  # name -> (its buffer's tensors, start, end)
    for g, (v, params) in enumerate(chunks):
        (dtypes, flat), = buffers[g].items()
        if not all(flat[k].dim() == 1 for k in ("param", "exp_avg", "exp_avg_sq")):
            raise CorruptCheckpointError(path, f"buffer {g} {dtypes}'s param / exp_avg / exp_avg_sq are not flat (1-D) tensors")
        size = bucket_size(v)
        index, total = buffer.coalesced(buffer.buckets(params, shared, size))
        if flat.get("numel_unpadded") != total or any(flat[k].numel() != total for k in ("param", "exp_avg", "exp_avg_sq")):
            bucketing = f"buckets of {size} elements" if size else "one bucket"
            raise CorruptCheckpointError(path, f"buffer {g} holds {flat.get('numel_unpadded')} elements per tensor; this "
                                         f"rank's parameters of model chunk {v} lay out to {total} in {bucketing}, as the "
                                         "saved args' --overlap-grad-reduce and --ddp-bucket-size give (another model)")
        located.update({n: (flat, a, b) for n, (a, b) in index.items()})
    inner = opt.get("optimizer", opt) if isinstance(opt, dict) else None
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if not isinstance(groups, list) or not groups:
        raise CorruptCheckpointError(model_path, "optimizer entry holds no param_groups beside distrib_optim.pt")
    check(model_path, groups, buffer.DISTRIBUTED_GROUPS, f"optimizer{where}.param_groups")
    decay = [n for n in names if not is_no_decay(n, tuple(rank.tensors[n].shape))]
    no_decay = [n for n in names if is_no_decay(n, tuple(rank.tensors[n].shape))]
    named_groups, per_name, master, seen = [], {}, {}, set()
    for g in groups:  # Megatron's groups: decay, and no decay (biases, norms); their order does not matter
        zero_wd = float(g.get("wd_mult", 1.0)) == 0.0 or float(g.get("weight_decay", 1.0)) == 0.0
        if zero_wd in seen:
            raise ConversionError(f"{model_path}: two optimizer groups {'without' if zero_wd else 'with'} weight decay; "
                                  "only Megatron's decay / no-decay split can be placed in distrib_optim.pt")
        seen.add(zero_wd)
        members = no_decay if zero_wd else decay
        named_groups.append({**{k: v for k, v in g.items() if k not in ("params", "step")}, "params": list(members)})
        for n in members:
            flat, a, b = located[n]
            shape = tuple(rank.tensors[n].shape)
            per_name[n] = {"exp_avg": flat["exp_avg"][a:b].view(shape), "exp_avg_sq": flat["exp_avg_sq"][a:b].view(shape),
                           "step": g.get("step", 0)}
            master[n] = flat["param"][a:b].view(shape)
    left = [n for n in names if n not in per_name]
    if left:
        raise ConversionError(f"{model_path}: parameters in no optimizer group: {left[:3]}")
    return per_name, named_groups, master


def _one_save(states: dict[tuple, dict[str, Any]], paths: dict[tuple, str]) -> None:
    """Every rank file from the same save: one iteration (a rank's file copied in from another save would merge
    two models' pieces into one that is neither)."""
    first = next(iter(states))
    for key, state in states.items():
        if state.get("iteration") != states[first].get("iteration"):
            raise CorruptCheckpointError(paths[key], f"is iteration {state.get('iteration')!r}, {os.path.relpath(paths[first], os.path.dirname(os.path.dirname(paths[key])))} "
                                         f"iteration {states[first].get('iteration')!r}: rank files of different saves")


def read_megatron(path: str, trust_pickle: bool = False, verify_digests: bool = True,
                  config: dict[str, Any] | None = None) -> LogicalCheckpoint:
    files = locate(path, check=False)  # rank 0's file says how to read the others' names
    manifest, owner = owning_checkpoint(files.iteration_dir, NATIVE_KEY, verify_digests)  # ours: checked first
    first = files.paths[(0, 0)]
    # the rank files as stand-ins: each tensor's bytes are read, and checked against the manifest, only where used
    # (an HF export reads the fp32 masters, not the moments)
    head = _rank_state(first, load_megatron_file(first, trust_pickle, stored=True))
    args = head.get("args")
    if args is not None:
        args_d = vars(args) if not isinstance(args, dict) else args
        files = locate(path, args_d)  # now also checks the grid the arguments describe
        arch = MegatronArch.from_args(args_d, first, grouped_gemm=True)  # GroupedMLP's weight1 / weight2 are read
    elif config is not None:  # saved without args (a conversion script's output): the shape from --config
        files = locate(path)
        arch = MegatronArch.from_hf(config)
        args_d = {**arch.to_args(files.tp, files.pp), "hf_config": dict(config)}
    else:
        raise CorruptCheckpointError(first, "holds no 'args': the model's shape is unknown; pass the model's config "
                                     "with --config CONFIG.json (or the model's directory)")
    arch.check_tp(files.tp, first)
    legacy_layout(arch, first, files.pp)
    _check_experts(arch, files, args_d, first)
    states3 = {key: (head if key == (0, 0, 0) else _rank_state(p, load_megatron_file(p, trust_pickle, stored=True)))
               for key, p in files.all_paths.items()}
    _one_save(states3, files.all_paths)
    all_rules = rules(arch)
    ranks3 = _rank_models(files, states3, _canonical(all_rules), arch.experts)
    optim3 = {
        key: _distributed_optimizer(states3[key], ranks3[key], files.all_paths[key], trust_pickle,
                                    buffer.shared_names(arch, files.pp, key[1]), lambda v, p=key[1]: buffer.run_bucket_size(args_d, p, v))
        if os.path.isfile(os.path.join(os.path.dirname(files.all_paths[key]), DISTRIB_OPTIM))
        else _rank_optimizer(states3[key], ranks3[key], files.all_paths[key])
        for key in ranks3
    }
    _same_state_kinds(optim3, files.all_paths)
    if arch.experts:
        for key in ranks3:
            width = {"1": arch.ffn * (2 if arch.gated else 1) // files.tp, "2": arch.ffn // files.tp}
            ranks3[key], optim3[key] = _ungrouped(ranks3[key], optim3[key], key[2], arch.experts // files.ep, arch.hidden,
                                                  width, files.all_paths[key])
    ranks, optim = _merge_expert_ranks(files, ranks3, optim3)
    padded = int(args_d.get("padded_vocab_size") or padded_vocab(arch.vocab, files.tp))
    _check_vocab(files, ranks, padded)

    placed = {n: key for key, rm in sorted(ranks.items()) for n in (*rm.names, *rm.buffers) if key[0] == 0}
    missing = [r.megatron for r in all_rules if r.megatron not in placed]
    if missing:
        raise CorruptCheckpointError(files.iteration_dir, f"no rank holds {missing[0]} ({len(missing)} tensors missing)")
    for (t, p), rm in sorted(ranks.items()):  # every TP rank of a stage holds its pieces of what its TP rank 0 holds
        gone = [n for n in (*ranks[(0, p)].names, *ranks[(0, p)].buffers) if n not in rm.tensors]
        if gone:
            raise CorruptCheckpointError(files.paths.get((t, p), files.iteration_dir), f"lacks {gone[0]}, which TP rank 0 of its "
                                         f"pipeline stage holds ({len(gone)} tensor(s) missing)")
    drift = _replicated_drift(files, ranks, all_rules)

    has_master = all(o[2] for o in optim.values()) and any(o[2] for o in optim.values())
    model_dtype = dtype_name_of(next(iter(ranks[(0, 0)].tensors.values())))
    cache = MergedCache()

    def pieces_of(rule: Rule, getter: Callable[[tuple[int, int]], torch.Tensor]) -> list[Callable[[], torch.Tensor]]:
        p = placed[rule.megatron][1]
        return [lambda t=t: getter((t, p)) for t in range(files.tp)]

    padding: dict[str, tuple[Any, tuple[int, ...]]] = {}  # the padded rows, as read (a stand-in), and their shape

    def lazy_for(rule: Rule, tag: str, getter, dtype: str, piece_shape: tuple[int, ...]) -> dict[str, LazyTensor]:
        extra_rows = piece_shape[0] * files.tp - arch.vocab
        if rule.split == VOCAB and 0 < extra_rows <= piece_shape[0]:  # the padded rows: all in the last TP piece
            last = getter((files.tp - 1, placed[rule.megatron][1]))  # only the padded rows of it are read
            width = math.prod(piece_shape[1:])
            rows = last.reshape(-1)[(piece_shape[0] - extra_rows) * width :]
            padding[f"{tag}/{rule.megatron}"] = (rows, (extra_rows, *piece_shape[1:]))
        where = files.paths[placed[rule.megatron]]
        shapes = hf_shapes(rule, arch, _full_shape(rule, piece_shape, files.tp), where)
        return hf_tensors(rule, pieces_of(rule, getter), arch, where, cache, tag, dtype, shapes, piece_shape)

    model: dict[str, LazyTensor] = {}
    for rule in all_rules:
        key0 = placed[rule.megatron]
        piece = ranks[key0].tensors[rule.megatron]
        if has_master and not rule.buffer:
            getter = lambda key, r=rule: optim[key][2][r.megatron]  # noqa: E731
            model.update(lazy_for(rule, "master", getter, "float32", tuple(piece.shape)))
        else:
            getter = lambda key, r=rule: ranks[key].tensors[r.megatron]  # noqa: E731
            model.update(lazy_for(rule, "model", getter, dtype_name_of(piece), tuple(piece.shape)))

    optimizer = _logical_optimizer(parameters(all_rules), optim, placed, lazy_for, files)
    step = files.iteration if files.iteration is not None else int(head.get("iteration") or 0)
    extra: dict[str, Any] = {}
    if any(_nonzero(rows) for rows, _ in padding.values()):  # not part of the Hugging Face model, but of Megatron's
        # softmax: kept for a Megatron target (zero rows, as a conversion pads, are not kept); built with torch when
        # a target reads them, so an export to Hugging Face of a Megatron-LM run (its padded rows trained) needs none
        extra[PADDING] = DeferredMapping(lambda: {k: as_torch(rows).reshape(shape).clone() for k, (rows, shape) in padding.items()})
    if head.get("opt_param_scheduler") is not None:
        extra[SCHEDULER] = materialize(head["opt_param_scheduler"])
    rank_state = {}
    rng = _rng_states(files, states3)
    if rng is not None:
        rank_state["rng"] = rng
    held = [[_layers_in(c) for c in _model_chunks(states3[(0, p, 0)], files.all_paths[(0, p, 0)])] for p in range(files.pp)]
    pipeline = recorded_flags(args_d, first, held)
    source = {
        "format": "megatron", "tp": files.tp, "pp": files.pp, "world_size": files.tp * files.pp * files.ep,
        "dtype": model_dtype, "iteration": step, **({"ep": files.ep} if arch.experts else {}), **({"pipeline": pipeline} if pipeline else {}),
    }
    if has_master:
        source["master_dtype"] = "float32"
    config = hf_config(arch, args_d)
    model.update({copy: model[main] for copy, main in mtp_copies(arch).items()})  # as a hub checkpoint keeps them
    notes = norm_eps_notes(arch, config) + drift
    if not args_d.get("vocab_size"):
        notes.append(f"args record no unpadded vocab_size; the padded {padded} rows are kept")
    return restacked(LogicalCheckpoint(
        model=model, config=config, optimizer=optimizer, source=source,
        tied=[["lm_head.weight", all_rules[0].hf[0]]] if arch.tied else [], step=step,
        extra_state=extra, rank_state=rank_state, notes=notes,
        components=carried_components(owner, manifest, NATIVE_KEY),
        topology=manifest.topology if manifest is not None else None,
    ), stacked_experts(arch))


def _nonzero(value: Any) -> bool:
    """Whether a tensor holds a value other than zero, as ``bool(t.any())`` says (a float's -0.0 is zero), read
    from a stand-in's bytes without torch."""
    if not isinstance(value, StoredTensor):
        return bool(value.any())
    import numpy as np

    size = itemsize(value.dtype_name)
    if size not in (1, 2, 4, 8) or not value.is_contiguous():
        return bool(as_torch(value).any())
    words = np.frombuffer(_stored_bytes(value), dtype=f"<u{size}")
    if is_floating(value.dtype_name):
        words = words & np.array((1 << (8 * size - 1)) - 1, dtype=words.dtype)  # every bit but the sign
    return bool(words.any())


def hf_config(arch: MegatronArch, args: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face config: the one the writer recorded (``args.hf_config``) with the shape from the
    arguments, else one built from the arguments alone (token ids outside the vocabulary dropped)."""
    config = arch.to_hf()
    recorded = args.get("hf_config")
    if isinstance(recorded, dict) and recorded.get("model_type") == config["model_type"]:
        # the MTP layers the run has (a recorded config may declare layers its source did not hold)
        return {**recorded, **{k: v for k, v in config.items() if k in SHAPE_KEYS or (arch.mtp_layers and k in MTP_KEYS)}}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(config.get(key), int) and config[key] >= arch.vocab:
            config[key] = None
    return config


def _check_vocab(files: LegacyFiles, ranks: dict[tuple[int, int], _RankModel], padded: int) -> None:
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        for (t, p), rm in ranks.items():
            if name in rm.tensors and rm.tensors[name].shape[0] * files.tp != padded:
                raise CorruptCheckpointError(
                    files.paths[(t, p)],
                    f"{name} has {rm.tensors[name].shape[0]} rows per rank x TP {files.tp} = "
                    f"{rm.tensors[name].shape[0] * files.tp}, but args.padded_vocab_size is {padded} (mismatched vocabulary padding)",
                )


def _stored_bytes(value: Any) -> memoryview:
    """A rank file's tensor's bytes in C order, read from the file (not its mapping: SIGBUS if cut short) without
    torch where it is a contiguous stand-in."""
    if isinstance(value, StoredTensor) and value.is_contiguous():
        from interop.output_files import read_pieces

        out = bytearray(value.numel() * value.element_size())
        read_pieces([value.piece()], memoryview(out))
        return memoryview(out)
    return raw_bytes(as_torch(value))


def _replicated_drift(files: LegacyFiles, ranks: dict[tuple[int, int], _RankModel], all_rules: list[Rule]) -> list[str]:
    """Every tensor-parallel rank of a stage holds its own copy of a replicated parameter (a norm, a row-parallel
    linear's bias), and a conversion takes TP rank 0's, as Megatron's own checkpoint tools do. A copy of another
    dtype or shape is a rank file of another model: refused. Copies whose values differ are said in a note (a rank
    file of another run, a damaged one, or the slow drift real runs show under sequence parallelism, which
    DeepSpeed's ds_to_universal averages for the parameters it is told drift): never taken in silence. Read as
    bytes (norms: small), no torch."""
    import numpy as np

    if files.tp == 1:
        return []
    differing: list[tuple[str, str, int, int]] = []  # (name, rank file, elements differing, elements)
    for rule in all_rules:
        if rule.split != REPLICATED or rule.buffer:
            continue
        for p in sorted({p for (t, p), rm in ranks.items() if t == 0 and rule.megatron in rm.tensors}):
            first = ranks[(0, p)].tensors[rule.megatron]
            kind, size, mine = (dtype_name_of(first), tuple(first.shape)), first.element_size(), bytes(_stored_bytes(first))
            words = np.frombuffer(mine, dtype=f"<u{size}") if size in (1, 2, 4, 8) else None
            for t in range(1, files.tp):
                other = ranks[(t, p)].tensors[rule.megatron]
                if (dtype_name_of(other), tuple(other.shape)) != kind:
                    raise CorruptCheckpointError(
                        files.paths[(t, p)], f"its copy of {rule.megatron} is {dtype_name_of(other)}{list(other.shape)}, TP rank 0's "
                        f"{kind[0]}{list(kind[1])} ({files.paths[(0, p)]}): a rank file of another model")
                theirs = _stored_bytes(other)
                if words is None:
                    apart = int(bytes(theirs) != mine)
                else:
                    apart = int(np.count_nonzero(np.frombuffer(theirs, dtype=words.dtype) != words))
                if apart:
                    differing.append((rule.megatron, files.paths[(t, p)], apart, first.numel()))
    if not differing:
        return []
    name, path, apart, count = max(differing, key=lambda d: d[2] / max(d[3], 1))
    note = (f"{len(differing)} replicated tensor(s) differ between tensor-parallel ranks, TP rank 0's copies kept (as Megatron's own "
            f"tools keep them); the most: {apart} of {count} elements of {name} in {path}: a rank file of another run or a damaged "
            "one, or the drift of a run whose replicated gradients were not all-reduced")
    log.warning("%s", note)
    return [note]


def _logical_optimizer(all_rules, optim, placed, lazy_for, files: LegacyFiles) -> OptimizerState | None:
    if not any(o[0] for o in optim.values()):
        return None
    tensors: dict[str, dict[str, LazyTensor]] = {}
    scalars: dict[str, dict[str, Callable[[], dict[str, Any]]]] = {}
    hf_of = {r.megatron: r for r in all_rules}
    for rule in all_rules:
        key0 = placed[rule.megatron]
        entries = optim[key0][0].get(rule.megatron)
        if entries is None:
            continue
        for skey, value in entries.items():
            if is_tensor(value) and value.dim() > 0:
                getter = lambda key, r=rule, s=skey: optim[key][0][r.megatron][s]  # noqa: E731
                tensors.setdefault(skey, {}).update(lazy_for(rule, f"optim:{skey}", getter, dtype_name_of(value), tuple(value.shape)))
            else:  # read when a target asks for them (AdamW's step lies between the moments)
                read = lambda v=value: scalar_entry(as_torch(v) if is_tensor(v) else torch.tensor(v))  # noqa: E731
                for name in rule.hf:
                    scalars.setdefault(skey, {})[name] = read
    groups = optim[(0, 0)][1]
    named = []
    for g in groups:
        params = [n for m in g["params"] if m in hf_of for n in hf_of[m].hf]
        named.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    # every rank numbers its own parameters; the logical groups hold all of them
    for key, (_, rank_groups, _) in optim.items():
        if key == (0, 0):
            continue
        for g, rg in zip(named, rank_groups):
            for m in rg["params"]:
                for n in hf_of[m].hf:
                    if n not in g["params"]:
                        g["params"].append(n)
    return OptimizerState("AdamW", named, tensors, DeferredScalars(scalars))


def _rng_states(files: LegacyFiles, states: dict[tuple[int, int, int], dict]) -> list[dict[str, Any]] | None:
    """Each rank's generators in our RNG layout, when every file holds one state (one data-parallel replica's), in
    Megatron's rank order (t + TP x e + TP x EP x p: its default order, expert ranks within the data-parallel ones)."""
    out = []
    for p in range(files.pp):
        for e in range(files.ep):
            for t in range(files.tp):
                rng = states[(t, p, e)].get("rng_state")
                entry = our_rng(rng[0]) if isinstance(rng, list) and len(rng) == 1 else None
                if entry is None:
                    return None
                out.append(entry)
    # the generators' tensors built with torch only when a target keeps them (an export to HF does not)
    return DeferredList(lambda: [materialize(entry) for entry in out])


# --- writing --------------------------------------------------------------------------------------------------
def hf_values(rule: Rule, get: Callable[[str], torch.Tensor | None]) -> list[torch.Tensor] | None:
    values = [get(n) for n in rule.hf]
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        missing = [n for n, v in zip(rule.hf, values) if v is None]
        raise ConversionError(f"{rule.megatron} fuses {list(rule.hf)}, but {missing} have no state (frozen in part?)")
    return values


def padding_rows(padding: dict[str, torch.Tensor], rule: Rule, *tags: str) -> torch.Tensor | None:
    """The padded vocabulary rows a Megatron source had under this rule's name (or an alias), first tag first."""
    return next((padding[f"{tag}/{n}"] for tag in tags for n in (rule.megatron, *rule.aliases) if f"{tag}/{n}" in padding), None)


@dataclass
class _StageWrite:
    model: list[list[OrderedDict]]  # per TP rank, per model chunk (virtual pipeline stage): local name -> tensor
    master: list[list[torch.Tensor]]  # per TP rank, in parameter order (mixed precision only)
    state: list[dict[str, dict[str, torch.Tensor]]]  # per TP rank: megatron name -> optimizer entries
    names: list[str]  # the stage's parameters, chunk by chunk, each in module order
    no_decay: list[bool]  # per parameter: Megatron's no-weight-decay group
    chunk: list[int]  # per parameter: its model chunk
    local: list[str]  # per parameter: its name in its chunk (layers numbered from the chunk's first)

    def weight(self, t: int, i: int) -> LazyTensor:
        return self.model[t][self.chunk[i]][self.local[i]]


def target_shape(ckpt: LogicalCheckpoint, tp: int) -> tuple[MegatronArch, int, torch.dtype]:
    """What a Megatron writer needs from the source: the architecture (checked against ``tp``), the padded
    vocabulary at ``tp`` and the dtype to store weights in."""
    if ckpt.config is None:
        raise ConversionError("the source records no model config; a Megatron checkpoint needs the model's shape")
    arch = MegatronArch.from_hf(ckpt.config)
    arch.check_tp(tp)
    arch, said = mtp_held(ckpt, arch)
    if arch.spec.beyond_megatron_lm:
        said.append(f"{arch.model_type}: {arch.spec.beyond_megatron_lm}")
    window = ckpt.config.get("sliding_window")
    layer_types = ckpt.config.get("layer_types")
    used = ckpt.config.get("use_sliding_window") is not False and (  # a window the model attends with (Qwen2-MoE's
        not isinstance(layer_types, list) or "sliding_attention" in layer_types)  # config keeps 0 beside use_sliding_window false)
    if isinstance(window, int) and window > 0 and used and not arch.spec.window:  # (a window family's is written)
        said.append(f"sliding_window {window}: not written as a Megatron argument (its attention spans the whole sequence, "
                    "the same up to that many tokens); the recorded Hugging Face config keeps it")
    said += norm_eps_notes(arch, ckpt.config) + rope_scaling_notes(dict(arch.options))
    ckpt.notes.extend(n for n in said if n not in ckpt.notes)
    dtype = dtype_from_name(str(ckpt.source.get("dtype") or "float32").removeprefix("torch."))
    return arch, padded_vocab(arch.vocab, tp), dtype


def legacy_layout(arch: MegatronArch, where: str, pp: int) -> None:
    """Legacy per-rank files hold each rank's own piece, which for multi-latent attention's down-projections
    depends on the spec (column-parallel in the local one, duplicated in Transformer Engine's), and the files do
    not say which: refused in one line; torch_dist stores the global tensors, which both load. So are MTP layers
    over pipeline stages (see :func:`mtp_stages`)."""
    if arch.spec.megatron_args.get("multi_latent_attention"):
        raise ConversionError(f"{where}: a {arch.model_type} model's multi-latent attention in legacy per-rank files is not "
                              "read or written (its pieces depend on the run's spec); use --ckpt-format torch_dist (--to megatron-dist)")
    mtp_stages(arch, pp, f"{where}: legacy per-rank files")


def mtp_stages(arch: MegatronArch, pp: int, what: str) -> None:
    """With pipeline stages, megatron-core's last stage keeps a copy of the embedding of its own for its MTP layers
    (GPTModel builds one where the MTP block is): a per-rank layout (legacy files, dp_reshardable buckets) that no
    run here has judged. Refused in one line; torch_dist's global tensors (and fully_reshardable) hold it once."""
    if arch.mtp_layers and pp > 1:
        raise ConversionError(f"{what} of a model with {arch.mtp_layers} multi-token-prediction layer(s) over {pp} pipeline stages "
                              "are not read or written (the last stage's own embedding copy); use torch_dist "
                              "(--to megatron-dist, fully_reshardable for a distributed optimizer)")


def mtp_held(ckpt: LogicalCheckpoint, arch: MegatronArch) -> tuple[MegatronArch, list[str]]:
    """A Hugging Face source's multi-token-prediction layers, and notes: the config declares them (transformers'
    num_mtp_layers), the checkpoint holds those a hub release ships (``model.layers.<num_hidden_layers + k>.``;
    transformers' save_pretrained writes none). Written are those it holds, each whole (a missing tensor is
    refused when its rule is written); their copies of the embedding and head must be the model's own, which
    megatron-core's MTP layers use (another value is refused, never dropped)."""
    if not arch.spec.mtp:
        return arch, []
    prefix = arch.spec.layer_prefix
    held = 0
    while held < arch.mtp_layers and any(n.startswith(prefix.format(i=arch.num_layers + held)) for n in ckpt.model):
        held += 1
    notes = []
    if held < arch.mtp_layers:
        written = f"written with --mtp-num-layers {held}" if held else "written without them (no --mtp-num-layers)"
        notes.append(f"the config declares {arch.mtp_layers} multi-token-prediction layer(s), the checkpoint holds "
                     f"{held or 'none'} (transformers' save_pretrained writes none): {written}")
    arch = dataclasses.replace(arch, mtp_layers=held)
    for copy, main in mtp_copies(arch).items():
        if copy in ckpt.model and (main not in ckpt.model or not same_values(ckpt.model[copy], ckpt.model[main])):
            raise ConversionError(f"{copy} is not {main}: megatron-core's multi-token-prediction layers use the model's own "
                                  "embedding and output layer, so it has no place for another")
    return arch, notes


def norm_eps_notes(arch: MegatronArch, config: dict[str, Any]) -> list[str]:
    """megatron-core builds every norm with --norm-epsilon; the Hugging Face model may build some with another
    (DeepSeek-V3's q/kv latent norms keep RMSNorm's default 1e-6 whatever rms_norm_eps says; asked of the built
    modules). Written and read all the same, the outputs then differ slightly: said in a note, both ways."""
    from .models.facts import norm_epsilons

    other: dict[float, set[str]] = {}
    for name, eps in norm_epsilons(config).items():
        if eps != arch.eps:
            other.setdefault(eps, set()).add(re.sub(r"\.\d+\.", ".<n>.", name))
    return [f"transformers builds {', '.join(sorted(names))} with eps {eps:g}, megatron-core every norm with --norm-epsilon "
            f"{arch.eps:g}: their outputs differ slightly" for eps, names in sorted(other.items())]


def note_unmapped(ckpt: LogicalCheckpoint, all_rules: list[Rule], arch: MegatronArch) -> None:
    """A note naming the source's tensors Megatron's GPT model has no place for (a hub GLM-4.5's multi-token
    prediction layer, model.layers.<n>): not written, and said, never dropped in silence."""
    mapped = {n for r in all_rules for n in r.hf} | {g[0] for g in ckpt.tied} | set(mtp_copies(arch))
    unmapped = sorted(set(ckpt.model) - mapped)
    if unmapped:
        ckpt.notes.append(f"Megatron's model has no place for {len(unmapped)} tensor(s), not written: {unmapped[:5]}")
        log.warning("%s", ckpt.notes[-1])


def pipeline_split(arch: MegatronArch, pp: int, flags: dict[str, Any] | None, where: str | None = None) -> PipelineSplit:
    """A run's pipeline split: ``pp`` stages of the model's layers, as its Megatron-LM pipeline ``flags`` (a loading
    run's, or a saved run's args; virtual stages, first / last stage layer counts, ...) split them; even without.
    ``where``: what errors name (the flags, ``--pp``, by default)."""
    return PipelineSplit.from_args({**(flags or {}), "num_layers": arch.num_layers, "pipeline_model_parallel_size": pp},
                                   where or f"--pp {pp}")


def expert_parallel_size(ckpt: LogicalCheckpoint, arch: MegatronArch, ep: int | None) -> int:
    """The expert-parallel size a Megatron target is written for (1 when not given, said in a note when it decides
    the optimizer's layout): megatron-core gives experts an optimizer of their own (a ChainedOptimizer) only when
    EP > 1, so the run that loads the optimizer must have this size."""
    if not arch.experts:
        if ep not in (None, 1):
            raise ConversionError(f"--ep-size {ep}: a {arch.model_type} model has no experts to split")
        return 1
    if ep is None:
        ep = 1
        if ckpt.optimizer is not None:
            ckpt.notes.append("--ep-size 1: neither given nor recorded by the source; the optimizer is laid out as megatron-core's "
                              "at expert-parallel size 1 (one optimizer; EP > 1 chains the experts' own): pass --ep-size to choose")
    if arch.experts % ep:
        raise ConversionError(f"{arch.experts} experts do not split over {ep} expert-parallel ranks (--ep-size {ep})")
    return ep


def expert_tensor_parallel_size(arch: MegatronArch, tp: int, ep: int, etp: Any, where: str, notes: list[str] | None = None,
                                optimizer: bool = True) -> int:
    """The experts' tensor-parallel size (Megatron-LM's --expert-tensor-parallel-size; its validate_args sets the
    TP size when none is given): another size is read and written where it divides TP and the experts have an
    optimizer of their own (EP > 1: megatron-core's ChainedOptimizer, its expert buffers per expert tensor x expert x
    pipeline rank); at EP 1 megatron-core keeps the experts in the dense buffers, a layout not read here. Experts with
    biases (GPT-OSS's) megatron-core builds only at size 1 (its TransformerConfig asserts it): the size a writer takes
    for them when none is given (said in ``notes``), and the only one it takes. Without ``optimizer`` state only the
    arguments record the size (torch_dist's tensors are global), at any EP."""
    if arch.experts and arch.linear_bias and tp > 1 and etp != 1:
        if etp is not None:
            raise ConversionError(f"{where}: a {arch.model_type} model's experts have biases, which megatron-core builds only at "
                                  "expert tensor-parallel size 1 (--expert-tensor-parallel-size 1)")
        etp = 1
        if notes is not None:
            notes.append(f"--expert-tensor-parallel-size 1: a {arch.model_type} model's experts have biases, which megatron-core "
                         "builds only at that size (as Megatron-LM's GPT-OSS recipe runs them)")
    if etp is None or etp == tp or not arch.experts:
        return tp
    if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1 or tp % etp:
        raise ConversionError(f"{where}: an expert tensor-parallel size of {etp!r} with TP {tp}: read and written where it divides TP")
    if ep == 1 and optimizer:
        raise ConversionError(f"{where}: experts split over expert tensor-parallel size {etp} at expert-parallel size 1, "
                              f"the dense layers over TP {tp}: not read or written here (EP > 1 is: pass --ep-size)")
    return etp


def write_megatron(
    ckpt: LogicalCheckpoint, dst: str, tp: int, pp: int, te_names: bool = True, overwrite: bool = False,
    progress: Callable[[str], None] | None = None, distributed_optimizer: bool = False, ep: int | None = None,
    ddp: dict[str, Any] | None = None, pipeline: dict[str, Any] | None = None, etp: int | None = None,
) -> None:
    """A Megatron-LM legacy checkpoint of ``ckpt`` at TP x PP: ``dst/latest_checkpointed_iteration.txt`` and
    ``dst/iter_<step>/mp_rank_TT[_PPP]/model_optim_rng.pt`` (Megatron-LM's ``--load dst``), our manifest and the
    source's other components beside the rank folders. Each rank's tensors stream into its file from the source
(:mod:`.megatron_pieces`): memory holds the tensors in flight, not a stage.
    ``distributed_optimizer``: the optimizer state as --use-distributed-optimizer saves it, ``distrib_optim.pt``
    beside each rank's file (for any data-parallel size: see :mod:`.megatron_buffer`). A MoE model's experts
    split over ``ep`` expert-parallel ranks: ``mp_rank_TT[_PPP]_EEE`` each with the dense layers and its experts.
    ``ddp``: the loading run's Megatron-LM data-parallel flags (``overlap_grad_reduce``, ``ddp_bucket_size``), which
    set distrib_optim.pt's buckets; ``pipeline``: its pipeline split flags (virtual stages: ``model0``, ``model1``, ...
    in each rank's file, a gradient buffer each; uneven stages), :meth:`.megatron_pipeline.PipelineSplit.from_args`'s
    names. Both recorded in the args."""
    arch, padded, dtype = target_shape(ckpt, tp)
    legacy_layout(arch, "--to megatron", pp)
    split = pipeline_split(arch, pp, pipeline)
    ep = expert_parallel_size(ckpt, arch, ep)
    given = etp
    etp = expert_tensor_parallel_size(arch, tp, ep, etp, f"--expert-tensor-parallel-size {etp}", optimizer=False)
    if etp != tp:
        # legacy files of such a run hold each (TP, EP) shard once, saved by whichever rank holds it (Megatron-LM's
        # save_checkpoint: data-parallel or expert data-parallel rank 0), a layout no run of ours has judged
        size = (f"--expert-tensor-parallel-size {etp}" if given is not None else f"a {arch.model_type} model's experts (biased: "
                "megatron-core builds them at --expert-tensor-parallel-size 1 only)")
        raise ConversionError(f"{size} with --tp {tp}: legacy files are written with the two equal; convert --to megatron-dist "
                              "for such a run")
    if arch.experts:
        ckpt.notes.append("experts written as SequentialMLP's (local_experts.<j>); a --moe-grouped-gemm run's legacy load "
                          "expects GroupedMLP's weight1/weight2: convert --to megatron-dist for it (torch_dist loads into either)")
    mixed = dtype != torch.float32
    all_rules = rules(arch, te_names)
    stages = chunk_rules(all_rules, arch, split)
    if arch.tied and pp > 1:
        stages[-1][-1].append(tied_output_rule(arch))
    step = int(ckpt.step or 0)
    opt = ckpt.optimizer
    args = argparse.Namespace(**arch.to_args(
        tp, pp, iteration=step, params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        ckpt_format="torch", transformer_impl="transformer_engine" if te_names else "local", world_size=tp * pp * ep,
        data_parallel_size=ep, use_distributed_optimizer=distributed_optimizer, no_save_optim=opt is None,
        hf_config=dict(ckpt.config), seed=DEFAULT_SEED, no_save_rng=False,
        **({"expert_model_parallel_size": ep, "expert_tensor_parallel_size": tp} if arch.experts else {}), **(ddp or {}),
        **split.to_args(),
    ))
    if distributed_optimizer and te_names:
        # the flat layout follows megatron-core's module order, checked against its local spec; TE's fused norms
        # are another order
        raise ConversionError("--use-distributed-optimizer is written for --transformer-impl local; convert without it "
                              "(Megatron-LM loads the plain optimizer too)")
    viewed = per_expert(ckpt, stacked_experts(arch))  # the rules name each expert's slice of a stacked tensor
    opt = viewed.optimizer
    hyper = megatron_hyper(opt)
    model = viewed.model
    note_unmapped(viewed, all_rules, arch)
    padding = component_state(ckpt, PADDING) or {}
    scheduler = component_state(ckpt, SCHEDULER)
    rng, rng_notes = megatron_rng_states(rank_rng_states(ckpt, tp * pp * ep), tp, pp, args.seed, ep)
    ckpt.notes.extend(rng_notes)
    rank_pieces = RankPieces(tp, padded, threading.Lock())

    def write_files(out: str) -> Written:
        iteration_dir = os.path.join(out, f"iter_{step:07d}")

        def write_rank(stage_write: _StageWrite, p: int, t: int, e: int) -> str:
            with_optim = opt is not None and not distributed_optimizer
            experts = _ExpertShare(e, arch.experts // ep) if ep > 1 else None
            state = _rank_file(args, step, stage_write, t, hyper, with_optim, mixed, scheduler, rng[(t, p, e)], experts)
            d = os.path.join(iteration_dir, _rank_dir(t, p, e, (pp > 1, ep > 1)))
            os.makedirs(d)
            if distributed_optimizer and opt is not None:
                shared = buffer.shared_names(arch, pp, p)
                bucket_size = lambda v: buffer.run_bucket_size(vars(args), p, v)  # noqa: E731
                if experts is None:
                    state["optimizer"], param_state = _distributed_files(stage_write, t, list(range(len(stage_write.names))), hyper,
                                                                         dtype, opt, shared, bucket_size)
                else:  # megatron-core's ChainedOptimizer: the dense part (expert rank 0's; the others' is its replica) and
                    # this rank's experts' (ChainedOptimizer.save_parameter_state's list)
                    dense, mine = experts.members(stage_write.names)
                    dense_opt, dense_state = _distributed_files(stage_write, t, dense, hyper, dtype, opt, shared, bucket_size)
                    expert_opt, expert_state = _distributed_files(stage_write, t, mine, expert_hyper(hyper), dtype, opt, frozenset(),
                                                                  bucket_size, skip_empty=True)
                    state["optimizer"], param_state = [dense_opt, expert_opt], [dense_state if e == 0 else None, expert_state]
                save_torch(param_state, os.path.join(d, DISTRIB_OPTIM))
            save_torch(state, os.path.join(d, FILE))
            return d

        for p, chunks in enumerate(stages):
            offsets = [held.start for held in split.chunks()[p]]
            stage_write = _write_stage(chunks, offsets, model, opt, rank_pieces, dtype, mixed, padding)
            # the stage's rank files at once: one is pickled while another's bytes go to the disk
            for d in at_once(write_rank, [(stage_write, p, t, e) for t in range(tp) for e in range(ep)], "megatron-rank"):
                if progress:
                    progress(d)
            del stage_write
        durable_write(os.path.join(out, TRACKER), str(step).encode())
        return Written(at=os.path.basename(iteration_dir))

    sharding = ShardingMetadata(strategy=Strategy.HYBRID, world_size=tp * pp * ep, tp=tp, pp=pp, ep=ep,
                                precision=dtype_name(dtype), master_precision="float32" if mixed else None)
    # Megatron's files hold the scheduler, the vocabulary padding and every rank's RNG: not carried again
    write_engine_checkpoint(ckpt, dst, NATIVE_KEY, write_files, sharding, {"megatron": "legacy torch"},
                            {"class": opt.cls} if opt is not None else None, overwrite,
                            frozenset({SCHEDULER, PADDING, "rng"}))
    log.info("wrote Megatron checkpoint %s (TP %d x PP %d, iteration %d)", dst, tp, pp, step)


def _distributed_files(stage: _StageWrite, t: int, members: list[int], hyper: list[dict[str, Any]], dtype: torch.dtype,
                       opt: OptimizerState, shared: frozenset[str], bucket_size: Callable[[int], int | None],
                       skip_empty: bool = False) -> tuple[dict[str, Any], dict[Any, Any]]:
    """TP rank ``t``'s DistributedOptimizer of the stage's parameters ``members`` (indices) as it saves it: the param
    groups (with the step) for model_optim_rng.pt, and distrib_optim.pt's flat fp32 main params and Adam moments
    (zeros in the gaps), a gradient buffer per model chunk holding any of them, in the loading run's buckets
    (:func:`.megatron_buffer.buckets`; ``bucket_size``: per chunk). ``skip_empty`` as :func:`_optimizer_part`'s."""
    grad_dtype = torch.float32  # Megatron-LM reduces bf16 / fp16 gradients in fp32 (--accumulate-allreduce-grads-in-fp32)
    param_state: dict[Any, Any] = {"buckets_coalesced": True}
    for g, (v, ids) in enumerate(buffer.chunk_buffers([(stage.chunk[i], i) for i in members])):
        params = [(stage.names[i], stage.weight(t, i).spec.shape) for i in ids]
        index, total = buffer.coalesced(buffer.buckets(params, shared, bucket_size(v)))
        parts: dict[str, list[LazyTensor]] = {k: [] for k in ("param", "exp_avg", "exp_avg_sq")}
        at = 0
        for (a, b), i, name in sorted((index[stage.names[i]], i, stage.names[i]) for i in ids):
            if a > at:  # the alignment gap before it
                for k in parts:
                    parts[k].append(zeros(a - at, "float32", "alignment"))
            master = stage.master[t][i] if stage.master[t] else stage.weight(t, i)
            parts["param"].append(master.cast(torch.float32).reshaped((b - a,)))
            for key in ("exp_avg", "exp_avg_sq"):
                value = stage.state[t].get(name, {}).get(key)
                if value is None:
                    raise ConversionError(f"the source has no {key} for Megatron's {name}; DistributedOptimizer needs both moments")
                parts[key].append(value.cast(torch.float32).reshaped((b - a,)))
            at = b
        flat = {k: concat(c, "float32", f"TP rank {t}'s distributed optimizer {k}") for k, c in parts.items()}
        param_state[g] = {(dtype, grad_dtype): {**flat, "numel_unpadded": total}}
    steps = {float(e["value"]) for e in opt.scalars.get("step", {}).values()}
    if len(steps) > 1:
        raise ConversionError(f"Megatron keeps one optimizer step for all parameters; the source has {sorted(steps)}")
    step = steps.pop() if steps else 0.0
    groups = [{**{k: v for k, v in h.items() if k != "params"}, "step": step} for h, _ in _groups(stage, members, hyper, skip_empty)]
    return {"optimizer": {"param_groups": groups}}, param_state


def megatron_hyper(opt: OptimizerState | None) -> list[dict[str, Any]]:
    """The decay and no-decay groups' hyper-parameters, as Megatron's optimizer holds them."""
    base = [{**ADAMW_DEFAULTS, "weight_decay": 0.01}, {**ADAMW_DEFAULTS, "weight_decay": 0.0}]
    if opt is not None and opt.param_groups:
        decay = [g for g in opt.param_groups if float(g.get("weight_decay", 0.0)) != 0.0]
        none = [g for g in opt.param_groups if float(g.get("weight_decay", 0.0)) == 0.0]
        if decay:
            base[0] = {k: v for k, v in decay[0].items() if k != "params"}
        if none:
            base[1] = {k: v for k, v in none[0].items() if k != "params"}
    base[0].update(wd_mult=1.0, lr_mult=1.0, is_expert_parallel=False, is_decoupled_lr=False)
    base[1].update(wd_mult=0.0, lr_mult=1.0, is_expert_parallel=False, is_decoupled_lr=False)
    return base


def _write_stage(chunks: list[list[Rule]], offsets: list[int], model, opt: OptimizerState | None, pieces: RankPieces, dtype,
                 mixed: bool, padding: dict[str, torch.Tensor]) -> _StageWrite:
    """The stage's rank files' tensors, as LazyTensors, chunk by chunk (``offsets``: each chunk's first global
    layer): nothing is read here; each streams into its rank's file (:mod:`.megatron_pieces`), so a stage costs the
    memory of the tensors in flight, not of the stage."""
    tp = pieces.tp
    models = [[OrderedDict() for _ in chunks] for _ in range(tp)]
    masters: list[list[LazyTensor]] = [[] for _ in range(tp)]
    states: list[dict[str, dict[str, Any]]] = [{} for _ in range(tp)]
    names, no_decay, chunk_of, locals_ = [], [], [], []
    for v, stage in enumerate(chunks):
        for rule in stage:
            values = hf_values(rule, lambda n: model.get(n))
            if values is None:
                raise ConversionError(f"the source has no {list(rule.hf)} for Megatron's {rule.megatron}")
            if rule.buffer:  # in the model's state only, in its own dtype (the expert bias: fp32); no optimizer numbers it
                for t, piece in enumerate(pieces.pieces(rule, values, fused_dtype([x.spec for x in values]), None, "model")):
                    models[t][v][local_name(rule.megatron, offsets[v])] = piece
                continue
            fill = padding_rows(padding, rule, "master", "model")
            weights = pieces.pieces(rule, values, dtype, fill, "model")
            name = local_name(rule.megatron, offsets[v])
            names.append(rule.megatron)
            chunk_of.append(v)
            locals_.append(name)
            no_decay.append(is_no_decay(rule.megatron, weights[0].spec.shape))
            master = pieces.pieces(rule, values, torch.float32, fill, "master") if mixed else None
            for t in range(tp):
                models[t][v][name] = weights[t]
                if master is not None:
                    masters[t].append(master[t])
                extra = extra_state_key(name)
                if extra is not None:
                    models[t][v][extra] = None
            if opt is not None:
                for skey, per in opt.tensors.items():
                    vals = hf_values(rule, lambda n: per.get(n))
                    if vals is None:
                        continue
                    fill = padding_rows(padding, rule, f"optim:{skey}")
                    for t, piece in enumerate(pieces.pieces(rule, vals, fused_dtype([x.spec for x in vals]), fill, f"optim:{skey}")):
                        states[t].setdefault(rule.megatron, {})[skey] = piece
                for skey, per in opt.scalars.items():
                    entry = next((per[n] for n in rule.hf if n in per), None)
                    if entry is not None:
                        for t in range(tp):
                            states[t].setdefault(rule.megatron, {})[skey] = scalar_value(entry)
    return _StageWrite(models, masters, states, names, no_decay, chunk_of, locals_)


@dataclass(frozen=True)
class _ExpertShare:
    """The experts one expert-parallel rank holds: ``per`` of them from ``rank`` x ``per``, numbered from 0 in its file."""

    rank: int
    per: int

    def local(self, name: str) -> str | None:
        """The name in this rank's file; None for another rank's expert."""
        at = _expert_at(name)
        if at is None:
            return name
        first = self.rank * self.per
        return _with_expert(name, at[1] - first) if first <= at[1] < first + self.per else None

    def members(self, names: list[str]) -> tuple[list[int], list[int]]:
        """The stage's parameters (indices into ``names``) of megatron-core's two chained optimizers on this rank:
        the dense ones, and this rank's experts."""
        dense = [i for i, n in enumerate(names) if _expert_at(n) is None]
        mine = [i for i, n in enumerate(names) if _expert_at(n) is not None and self.local(n) is not None]
        return dense, mine


def _rank_file(args, step: int, stage: _StageWrite, t: int, hyper, with_optim: bool, mixed: bool, scheduler: Any,
               rng: dict[str, Any], experts: _ExpertShare | None = None) -> dict[str, Any]:
    """One rank's model_optim_rng.pt (a virtual pipeline's chunks as ``model0``, ``model1``, ...). A MoE model's optimizer is megatron-core's ChainedOptimizer, saved as a list:
    the dense parameters' optimizer and this expert rank's experts' (each numbering its parameters from 0)."""
    models = stage.model[t]
    if experts is not None:
        models = [OrderedDict((experts.local(k), v) for k, v in m.items() if experts.local(k) is not None) for m in models]
    state: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": step}
    # Megatron-LM's generate_state_dict: "model", or "model<i>" per chunk of a virtual pipeline
    state.update({"model": models[0]} if len(models) == 1 else {f"model{v}": m for v, m in enumerate(models)})
    if with_optim:
        if experts is None:
            state["optimizer"] = _optimizer_part(stage, t, list(range(len(stage.names))), hyper, mixed)
        else:
            dense, mine = experts.members(stage.names)
            state["optimizer"] = [_optimizer_part(stage, t, dense, hyper, mixed),
                                  _optimizer_part(stage, t, mine, expert_hyper(hyper), mixed, skip_empty=True)]
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler
    state["rng_state"] = [rng]  # one data-parallel replica's (Megatron-LM without --data-parallel-random-init)
    return state


def expert_hyper(hyper: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """megatron-core's expert optimizer's groups: the dense ones', marked expert-parallel."""
    return [{**h, "is_expert_parallel": True} for h in hyper]


def _groups(stage: _StageWrite, members: list[int], hyper, skip_empty: bool) -> list[tuple[dict[str, Any], list[int]]]:
    """Megatron's param groups over ``members``: (hyper-parameters, indices) of the decay group, then the no-decay
    one; ``skip_empty``: no group for a kind of parameter it does not hold."""
    decay = [i for i in members if not stage.no_decay[i]]
    none = [i for i in members if stage.no_decay[i]]
    return [(h, ids) for h, ids in zip(hyper, (decay, none)) if ids or not skip_empty]


def _optimizer_part(stage: _StageWrite, t: int, members: list[int], hyper, mixed: bool, skip_empty: bool = False) -> dict[str, Any]:
    """One Megatron optimizer's state dict over the stage's parameters ``members`` (indices): torch's, numbered decay
    group first, or mixed precision's around it. ``skip_empty``: no group for a kind of parameter it does not hold
    (megatron-core's expert optimizer has a no-decay group only when an expert has a bias)."""
    kinds = _groups(stage, members, hyper, skip_empty)
    order = [i for _, ids in kinds for i in ids]
    ids = {stage.names[i]: pid for pid, i in enumerate(order)}
    per_id = {ids[stage.names[i]]: stage.state[t][stage.names[i]] for i in order if stage.names[i] in stage.state[t]}
    groups, start = [], 0
    for h, members_ in kinds:
        groups.append({**h, "params": list(range(start, start + len(members_)))})
        start += len(members_)
    inner = {"state": dict(sorted(per_id.items())), "param_groups": groups}
    if not mixed:
        return inner
    return {"optimizer": inner, "fp32_from_fp16_params": [[stage.master[t][i] for i in ids_] for _, ids_ in kinds]}
