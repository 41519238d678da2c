"""Which transformer layers each pipeline stage's model chunks hold, as Megatron-LM's pipeline flags split them.

A stage holds one model chunk, or ``V`` of them under the interleaved schedule (``--num-virtual-stages-per-pipeline-
rank V`` / ``--num-layers-per-virtual-pipeline-stage N``). Chunks follow one another chunk-index first: chunk v of
every stage comes before chunk v + 1 of any, so stage p's chunk v starts where the chunks before it end. The
counts: an even split of the layers, or with ``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers`` those counts on the first / last stage and the rest even over the others
(each stage's count split evenly over its chunks); ``--account-for-embedding-in-pipeline-split`` and
``--account-for-loss-in-pipeline-split`` count the embedding / the loss as one layer of the first / last chunk.

Hand-written because megatron-core computes the split inside ``get_transformer_layer_offset`` and
``get_num_layers_to_build``, which read the live ``parallel_state`` and a ``TransformerConfig`` (a heavy, optional
import for a converter); tests/test_megatron_pipeline.py checks this module against both over a grid of settings.
``--pipeline-model-parallel-layout`` (an explicit layer string, ``"Et*3|(tt|)*29|L"``) gives each chunk's layers
itself: its segments, split by ``|``, are the chunks in that order (chunk v of stage p is segment v x PP + p), and a
chunk's count of ``t`` its layers; the embedding and the loss stay on the first and the last chunk (megatron-core
builds them there whatever the string says; it checks only that ``E`` comes first and ``L`` last). The string is
parsed as megatron-core's PipelineParallelLayerLayout.parse_str_to_list parses it (``(..)*n``, ``x*n``, commas),
with a bound on its expanded length (a checkpoint's args are not trusted); MTP layers (``m``) are refused.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

from interop.errors import ConversionError

LAYOUT_FLAG = "pipeline_model_parallel_layout"
# Megatron-LM's pipeline split flags, as its arguments name them (each read by PipelineSplit.from_args)
PIPELINE_FLAGS = ("num_virtual_stages_per_pipeline_rank", "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                  "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                  LAYOUT_FLAG)


@dataclass(frozen=True)
class PipelineSplit:
    num_layers: int
    pp: int
    vpp: int = 1  # model chunks per stage (Megatron-LM's virtual_pipeline_model_parallel_size, None for 1)
    first: int | None = None  # --decoder-first-pipeline-num-layers
    last: int | None = None  # --decoder-last-pipeline-num-layers
    embedding: bool = False  # --account-for-embedding-in-pipeline-split
    loss: bool = False  # --account-for-loss-in-pipeline-split
    layout: str | None = None  # --pipeline-model-parallel-layout, as given

    def __post_init__(self) -> None:
        self.counts()  # refuses a split Megatron-LM refuses

    @classmethod
    def from_args(cls, args: dict[str, Any], where: str) -> "PipelineSplit":
        """The split a run's saved args describe (Megatron-LM's names, after its validate_args)."""
        try:
            n, pp = int(args["num_layers"]), int(args.get("pipeline_model_parallel_size") or 1)
            emb, loss = bool(args.get("account_for_embedding_in_pipeline_split")), bool(args.get("account_for_loss_in_pipeline_split"))
            vpp = args.get("virtual_pipeline_model_parallel_size") or args.get("num_virtual_stages_per_pipeline_rank")
            per_chunk = args.get("num_layers_per_virtual_pipeline_stage")
            layout = args.get(LAYOUT_FLAG)
            if layout is not None:
                return cls._from_layout(layout, n, pp, args)
            if not vpp and per_chunk:  # Megatron-LM's validate_args: the stage's layers (and the embedding / loss) per chunk
                if (n + emb + loss) % pp or ((n + emb + loss) // pp) % int(per_chunk):
                    raise ConversionError(f"{n} layers over {pp} stages do not split into chunks of {per_chunk} "
                                          "(--num-layers-per-virtual-pipeline-stage)")
                vpp = (n + emb + loss) // pp // int(per_chunk)
            return cls(n, pp, int(vpp or 1), _count(args.get("decoder_first_pipeline_num_layers")),
                       _count(args.get("decoder_last_pipeline_num_layers")), emb, loss)
        except ConversionError as e:
            raise ConversionError(f"{where}: {e}") from None
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise ConversionError(f"{where}: the pipeline split's arguments are not Megatron-LM's ({e!r})") from None

    @classmethod
    def _from_layout(cls, layout: Any, n: int, pp: int, args: dict[str, Any]) -> "PipelineSplit":
        """Megatron-LM's validate_args and megatron-core's TransformerConfig: a layout string sets the virtual stages
        (its segments / PP) and takes no other split flag."""
        if not isinstance(layout, str):
            raise ConversionError(f"a pipeline layout of type {type(layout).__name__} (Megatron-LM's is a string)")
        others = [k for k in PIPELINE_FLAGS if k != LAYOUT_FLAG and args.get(k) not in (None, False)]
        if others:
            raise ConversionError(f"--pipeline-model-parallel-layout takes no other pipeline split flag (Megatron-LM refuses it), "
                                  f"but --{others[0].replace('_', '-')} is given too")
        segments = layout_segments(layout, n)
        if pp < 1 or len(segments) % pp:
            raise ConversionError(f"pipeline layout {_shown(layout)}: {len(segments)} segments do not split over {pp} pipeline stages")
        vpp = len(segments) // pp
        recorded = args.get("virtual_pipeline_model_parallel_size")
        if recorded not in (None, vpp) and not (recorded == 1 and vpp == 1):
            raise ConversionError(f"pipeline layout {_shown(layout)} gives {vpp} virtual stages, the args {recorded}")
        return cls(n, pp, vpp, layout=layout)

    def to_args(self) -> dict[str, Any]:
        """Megatron-LM's arguments for this split, as its validate_args leaves them."""
        vpp = self.vpp if self.vpp > 1 else None
        return {
            "pipeline_model_parallel_size": self.pp, "virtual_pipeline_model_parallel_size": vpp,
            "num_virtual_stages_per_pipeline_rank": None if self.layout else vpp, "num_layers_per_virtual_pipeline_stage": None,
            "decoder_first_pipeline_num_layers": self.first, "decoder_last_pipeline_num_layers": self.last,
            "account_for_embedding_in_pipeline_split": self.embedding, "account_for_loss_in_pipeline_split": self.loss,
            LAYOUT_FLAG: self.layout,
        }

    def flags(self) -> dict[str, Any]:
        """The Megatron-LM flags (argument names) that set this split apart from an even one without virtual stages."""
        if self.layout is not None:
            return {LAYOUT_FLAG: self.layout}
        given = {"num_virtual_stages_per_pipeline_rank": self.vpp if self.vpp > 1 else None, "decoder_first_pipeline_num_layers": self.first,
                 "decoder_last_pipeline_num_layers": self.last, "account_for_embedding_in_pipeline_split": self.embedding,
                 "account_for_loss_in_pipeline_split": self.loss}
        return {k: v for k, v in given.items() if v}

    def counts(self) -> list[list[int]]:
        """[stage][chunk]: how many transformer layers each model chunk holds."""
        pp, vpp, n = self.pp, self.vpp, self.num_layers
        if pp < 1 or vpp < 1 or n < 1:
            raise ConversionError(f"a pipeline of {pp} stages x {vpp} chunks over {n} layers")
        if vpp > 1 and pp == 1:
            raise ConversionError(f"{vpp} virtual stages need more than one pipeline stage")
        if self.layout is not None:
            if self.first is not None or self.last is not None or self.embedding or self.loss:
                raise ConversionError("--pipeline-model-parallel-layout takes no other pipeline split flag (Megatron-LM refuses it)")
            segments = layout_segments(self.layout, n)
            if len(segments) != pp * vpp:
                raise ConversionError(f"pipeline layout {_shown(self.layout)}: {len(segments)} segments for {pp} stages x {vpp} chunks")
            return [[segments[v * pp + p].count("t") for v in range(vpp)] for p in range(pp)]
        if pp * vpp > n + 2:  # every chunk but an end one holds a layer (checked before any list of that size is built)
            raise ConversionError(f"{pp} pipeline stages x {vpp} virtual stages for {n} layers: a chunk would hold none")
        if self.first is not None or self.last is not None:
            if self.embedding or self.loss:
                raise ConversionError("--account-for-embedding/loss-in-pipeline-split do not combine with "
                                      "--decoder-first/last-pipeline-num-layers (Megatron-LM refuses it)")
            if pp == 1:
                raise ConversionError("first / last stage layer counts need more than one pipeline stage")
            fixed = {p: c for p, c in ((0, self.first), (pp - 1, self.last)) if c is not None}
            if min(fixed.values()) <= 0:
                raise ConversionError(f"a first / last pipeline stage of {min(fixed.values())} layers (megatron-core wants > 0)")
            middle_stages = pp - len(fixed)
            middle = n - sum(fixed.values())
            # megatron-core's TransformerConfig: middle stages and middle layers both, or neither
            if middle < 0 or bool(middle_stages) != bool(middle) or (middle_stages and middle % middle_stages):
                raise ConversionError(f"{n} layers do not split over {pp} pipeline stages with {fixed.get(0)} on the first "
                                      f"and {fixed.get(pp - 1)} on the last (the rest evenly)")
            if vpp > 1 and not middle_stages:  # its layer offset divides by the middle stages' count
                raise ConversionError("virtual stages with both the first and the last stage's layer counts given and no "
                                      "stage between them: megatron-core cannot place that split")
            per_stage = [fixed.get(p, middle // middle_stages if middle_stages else 0) for p in range(pp)]
            if any(c % vpp for c in per_stage):
                raise ConversionError(f"stage layer counts {per_stage} do not split evenly over {vpp} virtual stages")
            return [[c // vpp] * vpp for c in per_stage]
        total = n + self.embedding + self.loss
        if total % (pp * vpp):
            raise ConversionError(f"{n} layers{' + the embedding' if self.embedding else ''}{' + the loss' if self.loss else ''} "
                                  f"do not split evenly over {pp} pipeline stages x {vpp} virtual stages; give the loading "
                                  "run's split (--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers, ...)")
        per = total // (pp * vpp)
        out = [[per] * vpp for _ in range(pp)]
        out[0][0] -= self.embedding
        out[-1][-1] -= self.loss
        return out

    def chunks(self) -> list[list[range]]:
        """[stage][chunk]: the global layer indices each model chunk holds (chunk v of every stage, then v + 1)."""
        counts = self.counts()
        out: list[list[range]] = [[range(0)] * self.vpp for _ in range(self.pp)]
        at = 0
        for v in range(self.vpp):
            for p in range(self.pp):
                out[p][v] = range(at, at + counts[p][v])
                at += counts[p][v]
        return out


# megatron-core's parse_str_to_list: its two unrolling patterns, in order; and its layer characters
_UNROLL = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))
_LAYER_CHARS = frozenset("ELtm")


def layout_segments(layout: str, num_layers: int) -> list[str]:
    """A --pipeline-model-parallel-layout string's segments (model chunks in layer order), unrolled as megatron-core
    unrolls them, and checked as its validate_layer_layout checks them for a model of ``num_layers`` layers."""
    text = layout.replace(",", "")
    # the unrolled string holds the layers, E, L and the separators; never more than a megabyte (num_layers is the
    # checkpoint's word too)
    bound = min(4 * (num_layers + 2) + 4096, 1 << 20)
    for pattern in _UNROLL:
        try:
            size = len(text) + sum(len(m.group(1)) * int(m.group(2)) - len(m.group(0)) for m in pattern.finditer(text))
        except ValueError:  # a repeat count too long to read
            size = bound + 1
        if size > bound:
            raise ConversionError(f"pipeline layout {_shown(layout)} unrolls to more than {bound} characters for {num_layers} layers")
        text = pattern.sub(lambda m: m.group(1) * int(m.group(2)), text)
    segments = text.split("|")
    flat = "".join(segments)
    bad = sorted(set(flat) - _LAYER_CHARS)
    if bad:
        raise ConversionError(f"pipeline layout {_shown(layout)}: {bad[0]!r} is not a layer (E, t, m, L)")
    if "m" in flat:
        raise ConversionError(f"pipeline layout {_shown(layout)} places multi-token prediction layers (m), which interop does not convert")
    if not flat or flat[0] != "E" or flat[-1] != "L" or flat.count("E") != 1 or flat.count("L") != 1:
        raise ConversionError(f"pipeline layout {_shown(layout)}: the embedding (E) must come first and the loss (L) last, once each")
    if flat.count("t") != num_layers:
        raise ConversionError(f"pipeline layout {_shown(layout)} holds {flat.count('t')} decoder layers (t), the model {num_layers}")
    return segments


def _shown(layout: str) -> str:
    """A layout string for a message (a hostile one can be long)."""
    return repr(layout if len(layout) <= 80 else layout[:77] + "...")


def flag_text(flags: dict[str, Any]) -> str:
    """Pipeline ``flags`` (argument names) as a Megatron-LM command line."""
    return " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {shlex.quote(str(v))}") for k, v in flags.items())


def _count(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConversionError(f"a stage layer count of {value!r}")
    return value


def recorded_flags(args: dict[str, Any], where: str, held: list[list[int]] | None = None) -> dict[str, Any]:
    """A source's split as :meth:`PipelineSplit.flags` (what a target at its pipeline size defaults to): from its
    args, and only where they describe one megatron-core builds and, given ``held`` ([stage][chunk] layer counts
    its files hold), the one its files hold; else none (the target splits evenly unless told)."""
    try:
        split = PipelineSplit.from_args(args, where)
    except ConversionError:
        return {}
    return split.flags() if held is None or split.counts() == held else {}
