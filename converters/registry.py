"""Format name -> reader / writer, and detection of which format a directory holds."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from interop.dtypes import dtype_from_name
from interop.lazy_import import LazyModule
from interop.errors import ConfigurationError, MissingFileError, UncommittedCheckpointError, UnknownFormatError
from interop.logical import LogicalCheckpoint
from interop.commit import resolve_checkpoint_dir
from interop.manifest import MANIFEST, OUR_FOLDERS, STAGING_SUFFIX, UNIVERSAL_FORMAT, read_manifest
from interop.paths import refuse_escaping_links
from interop.verify import enclosing_checkpoint, open_checkpoint
from interop.universal import DEFAULT_MAX_SHARD_SIZE, read_universal, write_universal

from . import detection, optimizer_class
from .megatron_pipeline import PIPELINE_FLAGS, flag_text

# The converter modules, imported when first used: a conversion imports its source's reader and its target's writer,
# not every format's (start-up is a tenth of a 1 GiB conversion); detection asks converters.detection, which
# imports none of them.
accelerate, dcp, deepspeed, ds_universal, hf, hf_trainer, interop_ckpt, interop_dcp, megatron, megatron_dist, deepspeed_moe = (
    LazyModule(f"converters.{m}") for m in ("accelerate", "dcp", "deepspeed", "ds_universal", "hf", "hf_trainer", "interop_ckpt",
                                       "interop_dcp", "megatron", "megatron_dist", "deepspeed_moe"))
adapters, model_facts, config_arg, against_model = (
    LazyModule(f"converters.models.{m}") for m in ("adapters", "facts", "config_arg", "against_model"))


@dataclass
class Options:
    """Everything a reader or writer may need from the command line."""

    trust_pickle: bool = False
    overwrite: bool = False
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    verify_digests: bool = True  # every byte a reader uses is checked against the manifest
    progress: Callable | None = None
    extra: dict = field(default_factory=dict)  # target-specific flags (world size, stage, ...) for later formats
    config: dict | None = None  # --config: the model's config.json, for sources that carry none
    spread: Any = None  # interop.spread.Spread: the processes writing the output together (None: this one alone)


@dataclass
class Format:
    name: str
    description: str
    detect: Callable[[str], bool]
    read: Callable[[str, Options], LogicalCheckpoint] | None = None
    write: Callable[[LogicalCheckpoint, str, Options], None] | None = None
    # what a written checkpoint holds besides weights and config: "optimizer", "components" (any: scheduler,
    # data position, trainer state, RNG, ...) or named ones; a conversion into a narrower format says what it left out
    keeps: frozenset[str] = frozenset({"optimizer", "components"})
    # the one line that loads a written checkpoint in its consumer, pointed at the output as it is ({dst})
    loads_with: str = ""
    promises_config: bool = False  # the output has a place for the model's config.json that consumers read
    takes_dtype: bool = False  # --dtype sets the precision the output's weights are stored (or trained) in
    # its files name tensors as the model's modules do (an engine's state dict), not as save_pretrained stores them
    # (universal's naming): reading and writing go through transformers' own renaming for the model
    module_names: bool = False
    # it has a place for a peft model's state (base + adapter, the adapter's optimizer state): engines that save the
    # peft model's state dict; the others refuse a checkpoint with adapters rather than write what loads wrong
    holds_adapters: bool = False
    # several processes can write it together (``torchrun ... convert`` / ``--workers``), each a share of the bytes
    spreads: bool = False
    # the loading run's layout flags (TARGET_FLAGS, as convert's options name them) its writer reads
    flags: frozenset[str] = frozenset()
    # it lays each parameter's optimizer state out as the parameter (flat beside it, or split as it is): state of
    # another shape (a factored optimizer's: Adafactor's row and column variances) has no place there
    flat_state: bool = False


# what Megatron targets read of the loading run
MEGATRON_FLAGS = frozenset({"tp", "pp", "ep_size", "etp_size", "transformer_impl", "use_distributed_optimizer", "overlap_grad_reduce",
                            "ddp_bucket_size", *PIPELINE_FLAGS})
# convert's options that describe the loading run's layout: each read by the targets whose ``flags`` name it
TARGET_FLAGS = ("world_size", "zero_stage", "ep_size", "etp_size", "deepspeed_config", "param_groups", "fsdp", "tp", "pp", "transformer_impl",
                "use_distributed_optimizer", "dist_optim_layout", "overlap_grad_reduce", "ddp_bucket_size", *PIPELINE_FLAGS)
_OPTION_NAMES = {"etp_size": "--expert-tensor-parallel-size"}  # where the option is not its key's spelling


def check_target_flags(fmt: Format, extra: dict[str, Any]) -> None:
    """A layout flag the target does not read is refused, not ignored: the user meant a loading run the output
    would not be written for."""
    for key in TARGET_FLAGS:
        if extra.get(key) not in (None, False) and key not in fmt.flags:
            option = _OPTION_NAMES.get(key, "--" + key.replace("_", "-"))
            takers = ", ".join(n for n, f in FORMATS.items() if key in f.flags)
            raise ConfigurationError(f"{option}: --to {fmt.name} has no place for it (it describes the loading run of {takers})")


def check_dtype_flag(fmt: Format, dtype: str | None) -> None:
    """--dtype is honoured by the formats that store a training precision, and refused by the others."""
    if dtype and not fmt.takes_dtype:
        takers = ", ".join(n for n, f in FORMATS.items() if f.takes_dtype)
        raise ConfigurationError(f"--dtype: {fmt.name} keeps the source's tensors as they are and has no precision "
                                 f"to set; --dtype applies to {takers}")


def with_dtype(ckpt: LogicalCheckpoint, dtype: str | None) -> LogicalCheckpoint:
    """``ckpt`` with its floating weights stored in ``dtype`` (and recorded as its precision)."""
    if not dtype:
        return ckpt
    target = dtype_from_name(dtype)
    config = dict(ckpt.config) if ckpt.config is not None else None
    if config is not None:
        config.pop("dtype", None)
        config["torch_dtype"] = dtype
    return dataclasses.replace(ckpt, model={n: t.cast(target) for n, t in ckpt.model.items()}, config=config,
                               source={**ckpt.source, "dtype": dtype})


def missing_config(ckpt: LogicalCheckpoint, fmt: Format) -> str | None:
    """A note when the output would lack the config.json its format promises (the source carries none)."""
    if ckpt.config is not None or not fmt.promises_config:
        return None
    return (f"the source carries no model config: the {fmt.name} output has no config.json, so from_pretrained "
            "cannot load its model; convert again with --config CONFIG.json (or the model's directory)")


def left_out(ckpt: LogicalCheckpoint, fmt: Format) -> str | None:
    """One line naming the source state that ``fmt`` has no place for, or None."""
    lost = []
    if ckpt.optimizer is not None and "optimizer" not in fmt.keeps:
        lost.append("optimizer state")
    if "components" not in fmt.keeps:
        lost += [k for k in sorted(set(ckpt.components) | set(ckpt.extra_state) | set(ckpt.rank_state)) if k not in fmt.keeps]
    return f"{fmt.name} has no place for: {', '.join(lost)} (not written)" if lost else None


FORMATS: dict[str, Format] = {}
_CHECKPOINT_SUBDIRS = (*OUR_FOLDERS, "model", "optimizer")


def register(fmt: Format) -> Format:
    if fmt.module_names:
        fmt = dataclasses.replace(fmt, read=_stored_naming(fmt.read), write=_module_naming(fmt.write))
    fmt = dataclasses.replace(fmt, write=_model_checked(fmt.write if fmt.holds_adapters else _no_adapters(fmt.name, fmt.write), fmt))
    FORMATS[fmt.name] = fmt
    return fmt


def writes_as(name: str, write: Callable[[LogicalCheckpoint, str], object]) -> Callable[[LogicalCheckpoint, str], object]:
    """``write(ckpt, dst)`` (a trainer's own call of a format's writer, with the layout it runs) given what the
    registered format ``name``'s writer is given: experts checked, and the module's names where the format
    stores them (a MoE model's per-expert tensors fused)."""
    fmt = FORMATS[name]
    plain = lambda ckpt, dst, o: write(ckpt, dst)  # noqa: E731
    wrapped = _model_checked(_module_naming(plain) if fmt.module_names else plain, fmt)
    wrapped = wrapped if fmt.holds_adapters else _no_adapters(name, wrapped)
    return lambda ckpt, dst: wrapped(ckpt, dst, Options())


def _no_adapters(name: str, write):
    if write is None:
        return None

    def wrapped(ckpt: LogicalCheckpoint, dst: str, o: Options) -> None:
        if ckpt.adapter is not None:
            raise ConfigurationError(f"{name} has no place for peft adapters ({adapters.summary(ckpt.adapter)}), and its loaders would not "
                                     f"take the peft model's names: interop convert SRC DST --to peft writes the adapters apart, "
                                     f"--to {name} --merge-adapters the base model with them merged in")
        write(ckpt, dst, o)
    return wrapped


def _model_checked(write, fmt: Format):
    """Every writer refuses, before it writes anything, a checkpoint that is not the model its config describes
    (a MoE checkpoint that would drop, duplicate or invent an expert, a tensor of another size or missing, an
    optimizer moment not its parameter's shape, where the format keeps optimizer state: converters.models.against_model)."""
    if write is None:
        return None

    def wrapped(ckpt: LogicalCheckpoint, dst: str, o: Options) -> None:
        if "optimizer" in fmt.keeps and ckpt.optimizer is not None:  # a manifest's word for the class, held to the groups
            ckpt.optimizer.cls = optimizer_class.claimed(ckpt.optimizer.cls, ckpt.optimizer.param_groups)
        against_model.check(ckpt, dst, optimizer="optimizer" in fmt.keeps, flat=fmt.name if fmt.flat_state else None)
        deepspeed_moe.check(ckpt, dst)  # a model of DeepSpeed's own MoE layers (no transformers model to ask)
        write(ckpt, dst, o)
    return wrapped


def _stored_naming(read):
    if read is None:
        return None

    def wrapped(path: str, o: Options) -> LogicalCheckpoint:
        ckpt = read(path, o)
        if adapters.has_peft_names(ckpt):  # a peft model's: read as base + adapter (registry.read), then renamed
            return ckpt
        return model_facts.in_stored_names(ckpt, o.config)
    return wrapped


def _module_naming(write):
    if write is None:
        return None

    def wrapped(ckpt: LogicalCheckpoint, dst: str, o: Options) -> None:
        write(adapters.in_peft_names(model_facts.placed_in_module(model_facts.in_module_names(ckpt))), dst, o)
    return wrapped


def _is_universal(path: str) -> bool:
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        return False
    try:
        return read_manifest(path).format == UNIVERSAL_FORMAT
    except Exception:  # detection never raises; reading does
        return False


register(
    Format(
        "universal",
        "interop universal checkpoint (safetensors + JSON, no pickle)",
        _is_universal,
        lambda p, o: read_universal(p, o.verify_digests),
        lambda c, d, o: write_universal(c, d, o.max_shard_size, o.overwrite, o.progress, o.spread),
        spreads=True,
        loads_with="interop convert {dst} OUT --to <format>; transformers.AutoModelForCausalLM.from_pretrained('{dst}/model')",
        promises_config=True,
        holds_adapters=True,
    )
)
register(
    Format(
        "interop",
        "checkpoint saved by an interop trainer (single process or DDP)",
        detection.is_interop_checkpoint,
        lambda p, o: interop_ckpt.read_interop_checkpoint(p, o.verify_digests),
        module_names=True,  # the trainer's model component is the module's state dict (a MoE's fused experts)
        holds_adapters=True,
    )
)
register(
    Format(
        "interop-dcp",
        "checkpoint of the interop Megatron-style trainer (DTensor TP x pipelining): model and optimizer as DCP, any layout",
        detection.is_interop_dcp,
        lambda p, o: interop_dcp.read_interop_dcp(p, o.verify_digests),
        lambda c, d, o: interop_dcp.write_interop_dcp(c, d, o.overwrite),
        loads_with='python -m trainers.megatron --resume {dst}',
        module_names=True,
    )
)


def layout_value(ckpt: LogicalCheckpoint, o: Options, key: str, default: int) -> int:
    """A layout size: its flag, else the source's, else ``default``, said in a note (the output's manifest
    records it and convert prints it), since nothing asked for it."""
    value = o.extra.get(key) or ckpt.source.get(key)
    if value is None:
        flag = "--" + key.replace("_", "-")
        value = default
        ckpt.notes.append(f"{flag} {default}: neither given nor recorded by the source (pass {flag} to choose)")
    return int(value)


def _deepspeed_config(o: Options) -> dict | None:
    import json

    path = o.extra.get("deepspeed_config")
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_deepspeed(ckpt: LogicalCheckpoint, dst: str, o: Options) -> None:
    from .deepspeed import NativeLayout
    from .deepspeed_writer import write_deepspeed

    extra = o.extra
    config = _deepspeed_config(o)
    world = layout_value(ckpt, o, "world_size", 1)
    stage = layout_value(ckpt, o, "zero_stage", 2)
    dtype = extra.get("dtype") or ckpt.source.get("dtype") or "float32"
    ep = int(extra.get("ep_size") or ckpt.source.get("ep_size") or 1)  # only a deepspeed.moe model has experts to split
    write_deepspeed(ckpt, dst, NativeLayout(int(world), int(stage), dtype, ep), config, o.overwrite, extra.get("param_groups"))


register(
    Format(
        "deepspeed",
        "DeepSpeed ZeRO-1/2/3 checkpoint (DeepSpeed's own, accelerate's, or an interop DeepSpeed trainer's)",
        detection.is_deepspeed_checkpoint,
        lambda p, o: deepspeed.read_deepspeed(p, o.trust_pickle, o.verify_digests, o.config),
        _write_deepspeed,
        loads_with="engine.load_checkpoint('{dst}')",
        takes_dtype=True,
        module_names=True,
        holds_adapters=True,
        flags=frozenset({"world_size", "zero_stage", "ep_size", "deepspeed_config", "param_groups"}),
        flat_state=True,
    )
)
def _write_ds_universal(ckpt: LogicalCheckpoint, dst: str, o: Options) -> None:
    ds_universal.write_ds_universal(ckpt, dst, _deepspeed_config(o), o.overwrite, o.progress)


register(
    Format(
        "ds-universal",
        "DeepSpeed universal checkpoint (ds_to_universal's layout; load_universal loads it on any stage and world size)",
        detection.is_ds_universal,
        lambda p, o: ds_universal.read_ds_universal(p, o.trust_pickle, o.verify_digests),
        _write_ds_universal,
        loads_with='engine.load_checkpoint(\'{dst}\') with "checkpoint": {"load_universal": true} in the DeepSpeed config',
        module_names=True,
        holds_adapters=True,
        flags=frozenset({"deepspeed_config"}),
    )
)
def _write_accelerate(ckpt: LogicalCheckpoint, dst: str, o: Options) -> None:
    world = layout_value(ckpt, o, "world_size", 1)
    fsdp = bool(o.extra.get("fsdp")) or (not o.extra.get("world_size") and ckpt.source.get("strategy") == "fsdp")
    accelerate.write_accelerate(ckpt, dst, int(world), fsdp, o.overwrite)


register(
    Format(
        "accelerate",
        "Accelerate save_state directory, DDP (model.safetensors + optimizer.bin) or FSDP2 (DCP directories)",
        detection.is_accelerate_checkpoint,
        lambda p, o: accelerate.read_accelerate(p, o.trust_pickle, o.verify_digests, o.config),
        _write_accelerate,
        loads_with="accelerator.load_state('{dst}')",
        module_names=True,
        holds_adapters=True,
        flags=frozenset({"world_size", "fsdp"}),
    )
)
def _at_precision(ckpt: LogicalCheckpoint, o: Options) -> LogicalCheckpoint:
    """``ckpt`` recording --dtype as its training precision (for writers that take it from ``source``)."""
    dtype = o.extra.get("dtype")
    return dataclasses.replace(ckpt, source={**ckpt.source, "dtype": dtype}) if dtype else ckpt


def _megatron_ep(ckpt: LogicalCheckpoint, o: Options) -> int | None:
    """The expert-parallel size a Megatron target is for: --ep-size, else the source's (Megatron's or deepspeed.moe's),
    else None (the writer takes 1 and, for a MoE model with optimizer state, says so)."""
    value = o.extra.get("ep_size") or ckpt.source.get("ep") or ckpt.source.get("ep_size")
    return int(value) if value else None


def _megatron_etp(ckpt: LogicalCheckpoint, o: Options, tp: int) -> int | None:
    """The loading run's --expert-tensor-parallel-size: given, else a Megatron source's own where it divides the
    target's TP (said in a note), else None (the TP size, Megatron-LM's default)."""
    given = o.extra.get("etp_size")
    source = ckpt.source.get("etp")
    if given or not isinstance(source, int) or source < 1 or tp % source or source == tp:
        return given
    ckpt.notes.append(f"--expert-tensor-parallel-size {source}: the source's (the experts' own TP size); pass it for another")
    return source


def _megatron_ddp(o: Options) -> dict[str, Any]:
    """The loading run's Megatron-LM --overlap-grad-reduce and --ddp-bucket-size (the distributed optimizer's buckets)."""
    size = o.extra.get("ddp_bucket_size")
    if size and not o.extra.get("overlap_grad_reduce"):
        raise ConfigurationError("--ddp-bucket-size sizes --overlap-grad-reduce's buckets (Megatron-LM ignores it without): "
                                 "pass both, as the loading run does")
    return {"overlap_grad_reduce": bool(o.extra.get("overlap_grad_reduce")), "ddp_bucket_size": int(size) if size else None}


def _megatron_pipeline(ckpt: LogicalCheckpoint, o: Options, pp: int) -> dict[str, Any]:
    """The loading run's Megatron-LM pipeline split flags: those given, else a Megatron source's own split when the
    target has its pipeline size (said in a note), else none (an even split)."""
    given = {k: o.extra[k] for k in PIPELINE_FLAGS if o.extra.get(k)}
    source = ckpt.source.get("pipeline")
    if given or not isinstance(source, dict) or not source or int(ckpt.source.get("pp") or 1) != pp:
        return given
    ckpt.notes.append(f"pipeline split: the source's ({flag_text(source)}); pass the loading run's pipeline flags for another")
    return {k: v for k, v in source.items() if k in PIPELINE_FLAGS}


def _write_megatron_dist(ckpt: LogicalCheckpoint, dst: str, o: Options) -> None:
    ckpt = _at_precision(ckpt, o)
    layout = o.extra.get("dist_optim_layout") or ("fully_reshardable" if o.extra.get("use_distributed_optimizer") else None)
    pp, tp = layout_value(ckpt, o, "pp", 1), layout_value(ckpt, o, "tp", 1)  # (each asked once: a default is one note)
    megatron_dist.write_megatron_dist(ckpt, dst, tp, o.overwrite, distributed_optimizer=layout, pp=pp,
                                      transformer_impl=o.extra.get("transformer_impl") or "transformer_engine", ep=_megatron_ep(ckpt, o),
                                      ddp=_megatron_ddp(o), pipeline=_megatron_pipeline(ckpt, o, pp), etp=_megatron_etp(ckpt, o, tp))


register(  # before "dcp" and "megatron": a torch_dist directory is DCP data, and its root has Megatron's tracker file
    Format(
        "megatron-dist",
        "Megatron torch_dist checkpoint (metadata.json, common.pt, DCP data with stacked layers); loads at any TP x PP",
        detection.is_megatron_dist,
        lambda p, o: megatron_dist.read_megatron_dist(p, o.trust_pickle, o.verify_digests),
        _write_megatron_dist,
        loads_with='Megatron-LM: --load {dst} --ckpt-format torch_dist (--use-distributed-optimizer exactly when converted with it)',
        takes_dtype=True,
        flags=MEGATRON_FLAGS | {"dist_optim_layout"},
        flat_state=True,
    )
)
register(
    Format(
        "dcp",
        "torch.distributed.checkpoint directory (.metadata + .distcp files), e.g. torchtitan's or dcp.save's",
        detection.is_dcp_dir,
        lambda p, o: dcp.read_dcp_checkpoint(p, o.verify_digests),
        lambda c, d, o: dcp.write_dcp_checkpoint(c, d, o.overwrite),
        loads_with="torch.distributed.checkpoint.load(state_dict, checkpoint_id='{dst}')",
        module_names=True,
        holds_adapters=True,
    )
)
def _write_megatron(ckpt: LogicalCheckpoint, dst: str, o: Options) -> None:
    tp = layout_value(ckpt, o, "tp", 1)
    pp = layout_value(ckpt, o, "pp", 1)
    te = (o.extra.get("transformer_impl") or "transformer_engine") == "transformer_engine"
    if o.extra.get("dist_optim_layout"):
        raise ConfigurationError("--dist-optim-layout is a torch_dist layout (--to megatron-dist); the legacy format's "
                              "distributed optimizer is distrib_optim.pt: --use-distributed-optimizer")
    ckpt = _at_precision(ckpt, o)
    megatron.write_megatron(ckpt, dst, int(tp), int(pp), te, o.overwrite,
                            distributed_optimizer=bool(o.extra.get("use_distributed_optimizer")), ep=_megatron_ep(ckpt, o),
                            ddp=_megatron_ddp(o), pipeline=_megatron_pipeline(ckpt, o, int(pp)),
                            etp=_megatron_etp(ckpt, o, int(tp)))


register(
    Format(
        "megatron",
        "Megatron-LM legacy checkpoint (latest_checkpointed_iteration.txt, iter_*/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt)",
        detection.is_megatron_legacy,
        lambda p, o: megatron.read_megatron(p, o.trust_pickle, o.verify_digests, o.config),
        _write_megatron,
        loads_with='Megatron-LM: --load {dst} --ckpt-format torch (--use-distributed-optimizer exactly when converted with it)',
        takes_dtype=True,
        flags=MEGATRON_FLAGS | {"dist_optim_layout"},  # refused by the writer in one line that names the legacy flag
        flat_state=True,
    )
)
def _write_peft(ckpt: LogicalCheckpoint, dst: str, o: Options) -> None:
    if ckpt.adapter is None:
        raise ConfigurationError("--to peft: the source holds no peft adapters")
    adapters.write_peft(ckpt, dst, o.overwrite)


register(
    Format(
        "peft",
        "peft adapter directory (adapter_config.json, adapter_model.safetensors): a LoRA run's adapters, exported",
        lambda p: False,  # written only: a base model and an adapter directory are read as the base model's (not yet)
        None,
        _write_peft,
        keeps=frozenset(),
        loads_with="PeftModel.from_pretrained(<the base model>, '{dst}')",
        holds_adapters=True,
    )
)
register(  # before "hf": a Trainer checkpoint directory is also a model directory
    Format(
        "hf-trainer",
        "transformers Trainer checkpoint (model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json)",
        detection.is_hf_trainer_checkpoint,
        lambda p, o: hf_trainer.read_hf_trainer(p, o.trust_pickle, o.verify_digests, o.extra.get("base_model")),
        lambda c, d, o: hf_trainer.write_hf_trainer(c, d, o.overwrite),
        loads_with="Trainer(...).train(resume_from_checkpoint='{dst}')",
        holds_adapters=True,  # a peft model's whole state in model.safetensors (Trainer loads it), its adapter beside
    )
)
register(
    Format(
        "hf",
        "Hugging Face model directory (config.json + safetensors or pytorch_model.bin)",
        detection.is_hf_dir,
        lambda p, o: hf.read_hf(p, o.trust_pickle),
        lambda c, d, o: hf.write_hf(with_dtype(c, o.extra.get("dtype")), d, o.overwrite, o.max_shard_size, o.progress, o.spread),
        spreads=True,
        takes_dtype=True,
        keeps=frozenset(()),
        loads_with="transformers.AutoModelForCausalLM.from_pretrained('{dst}')",
    )
)


def detect(path: str) -> Format:
    if not os.path.exists(path):
        raise MissingFileError(path, "no such file or directory")
    if not os.path.isdir(path):
        raise UnknownFormatError(path, "is a file; point at a checkpoint directory")
    for fmt in FORMATS.values():
        if fmt.detect(path):
            return fmt
    directory = resolve_checkpoint_dir(path)
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        manifest = read_manifest(directory)  # raises naming what is wrong with it
        strategy = (manifest.sharding or {}).get("strategy")
        raise UnknownFormatError(
            directory, f"{manifest.format} checkpoint" + (f" of strategy {strategy!r}" if strategy else "") + " has no registered reader"
        )
    if os.path.normpath(path).endswith(STAGING_SUFFIX):
        read_manifest(path)  # refuses staging directories with the reason
    if any(os.path.isdir(os.path.join(path, d)) for d in _CHECKPOINT_SUBDIRS):
        raise UncommittedCheckpointError(
            path, f"has no {MANIFEST}: the save never committed, or the manifest was removed; it will not be loaded"
        )
    raise UnknownFormatError(
        path, f"not a checkpoint this tool recognises (known formats: {', '.join(FORMATS)}); is the path right?"
    )


def writer(name: str) -> Format:
    fmt = FORMATS.get(name)
    if fmt is None or fmt.write is None:
        writable = [n for n, f in FORMATS.items() if f.write is not None]
        raise UnknownFormatError(None, f"cannot write format {name!r} (writable: {', '.join(writable)})")
    return fmt


def read(path: str, options: Options | None = None, as_format: str | None = None) -> tuple[Format, LogicalCheckpoint]:
    """Detect ``path``'s format (or take ``as_format``) and read it. Before any format looks at it: links
    leading out of it and special files are refused, and if it is one of our committed checkpoints (or its
    root, or a part of one: ``ckpt/model``, ``ckpt/deepspeed``) that whole checkpoint is checked against its
    manifest, so no format can be detected from, or read, a file the manifest does not vouch for."""
    options = options or Options()
    refuse_escaping_links(path)
    if check_ours(path, options.verify_digests):
        options = dataclasses.replace(options, verify_digests=False)  # every file of it was just checked
    fmt = FORMATS[as_format] if as_format else detect(path)
    if fmt.read is None:
        raise UnknownFormatError(path, f"format {fmt.name!r} can be written but not read")
    ckpt = fmt.read(path, options)
    if options.config is not None:
        config_arg.apply_config(ckpt, options.config, path)
    return fmt, adapters.read_as_adapter(ckpt, path, options.extra.get("adapter_config"))


# Files the converters read only through readers that check each byte range they use against the manifest
# (interop.ranged) or, for torch's own loader, the whole file first: torch's pickles through
# pickle_safety.load_torch_file, DCP's data files through dcp.DCPReader. Such a file, when recorded block by block,
# is not hashed whole before reading: a conversion reads (and checks) only what it uses.
RANGE_CHECKED_SUFFIXES = (".pt", ".pth", ".bin", ".distcp")


def reads_ranges(rel: str) -> bool:
    return rel.endswith(RANGE_CHECKED_SUFFIXES)


def check_ours(path: str, digests_checked: bool = True) -> bool:
    """Check the committed checkpoint ``path`` is, names by ``latest``, or lies inside against its manifest;
    refuse a staging directory or our layout without a manifest. False when ``path`` is no checkpoint of ours."""
    if os.path.normpath(path).endswith(STAGING_SUFFIX):
        read_manifest(path)  # refuses staging directories with the reason
    directory = resolve_checkpoint_dir(path)
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        open_checkpoint(directory, digests_checked, ranged=reads_ranges)
        return True
    if any(os.path.isdir(os.path.join(directory, d)) for d in OUR_FOLDERS):  # only our checkpoints hold these
        raise UncommittedCheckpointError(
            directory, f"has no {MANIFEST}: the save never committed, or the manifest was removed; it will not be loaded"
        )
    owner = enclosing_checkpoint(path)
    if owner is not None:
        open_checkpoint(owner, digests_checked, by_tensor=False, ranged=reads_ranges)  # its reader does not know the manifest's tensors
        return True
    return False
