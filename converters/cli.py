"""`interop inspect | verify | convert | diff` (and commands other packages register, such as `demo`).

Exit codes: 0 success; 1 verify found problems or diff found differences; 2 the input could not be used
(the one-line error names the file and the problem; no traceback, nothing written).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import Callable

import os

if __name__ == "__main__":  # python -m converters.cli is the console script: its run() digests the source before the
    from converters.console import run  # imports below, reports a bad setting they read in one line, imports this

    run()  # module as converters.cli and exits

from interop import __version__, ranged
from interop.commit import check_destination, destination_lock, resolve_checkpoint_dir
from interop.lazy_import import LazyModule
from interop.errors import ConfigurationError, ConversionError, InteropError, UnknownFormatError, one_line
from interop.locking import exclusive
from interop.logs import quiet_libraries
from interop.usage import OneLineParser
from interop.logical import LogicalCheckpoint
from interop.manifest import MANIFEST, OUR_FOLDERS, STAGING_SUFFIX, Manifest, read_manifest
from interop.topology import Topology
from interop.spread import leads, together
from interop.universal import parse_size

from . import registry
from . import deepspeed_moe
from .models import adapters as adapter_models
from .models import against_model, experts
from .models import facts as model_facts

# imported when a command uses them (see registry: start-up is a tenth of a 1 GiB conversion)
config_arg, diff, workers = (LazyModule(f"converters.{m}") for m in ("models.config_arg", "diff", "workers"))

log = logging.getLogger("interop.cli")

EXIT_PROBLEMS, EXIT_ERROR = 1, 2


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _tqdm(**kwargs):
    """A progress bar on a terminal; tqdm is not imported where it would draw none (``disable=None``: stderr is not
    a terminal), since importing it costs 25-35 ms of a command's start-up (its version lookup imports
    importlib.metadata; tqdm.auto's notebook check, asyncio)."""
    if _in_notebook():  # main() called in a notebook: tqdm.auto's widget
        from tqdm.auto import tqdm
    else:
        from tqdm import tqdm

    return tqdm(disable=None, leave=False, **kwargs)


def _in_notebook() -> bool:
    return "ipykernel" in sys.modules


def _draws() -> bool:
    if _in_notebook():
        return True
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stderr
        return False


def _bytes_progress(total: int, desc: str) -> tuple[Callable, Callable]:
    if not _draws():
        return None, lambda: None
    bar = _tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)
    return (lambda entry: bar.update(entry.spec.nbytes)), bar.close


def _iter_progress(items, **kwargs):
    return _tqdm(iterable=items, total=len(items), **kwargs) if _draws() else items


def _options(args: argparse.Namespace) -> registry.Options:
    return registry.Options(
        trust_pickle=getattr(args, "trust_pickle", False),
        overwrite=getattr(args, "overwrite", False),
        max_shard_size=getattr(args, "max_shard_size", None) or parse_size("5GiB"),
        extra={k: getattr(args, k, None) for k in (*registry.TARGET_FLAGS, "dtype", "merge_adapters", "adapter_config", "base_model")},
        config=config_arg.load_config_arg(args.config) if getattr(args, "config", None) else None,
    )


# --- inspect -------------------------------------------------------------------------------------------


def _print_topology(manifest: Manifest | None, ckpt: LogicalCheckpoint) -> None:
    topo = ckpt.topology
    if topo:
        t = Topology.from_json(topo)
        groups = ", ".join(f"{name}: {len(parts)} groups of {len(parts[0])}" for name, parts in t.groups.items())
        print(f"topology:  world size {t.world_size}, {t.num_nodes} node(s)" + (f"; {groups}" if groups else ""))
    src = {k: v for k, v in ckpt.source.items() if v is not None}
    if src:
        print("source:    " + ", ".join(f"{k}={v}" for k, v in src.items()))
    if manifest is not None and manifest.sharding:
        s = {k: v for k, v in manifest.sharding.items() if v not in (None, {}, [])}
        for key, what in (("tensors", "split tensors"), ("pp_stage_of_layer", "layers")):  # per-tensor maps: a count
            if key in s:
                s[key] = f"{len(s[key])} {what}"
        print("sharding:  " + ", ".join(f"{k}={v}" for k, v in s.items()))


def cmd_inspect(args: argparse.Namespace) -> int:
    fmt, ckpt = registry.read(args.path, _options(args))
    manifest = None
    directory = resolve_checkpoint_dir(args.path)
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        manifest = read_manifest(directory)
    print(f"path:      {directory}")
    print(f"format:    {fmt.name} ({fmt.description})")
    if ckpt.step is not None:
        print(f"step:      {ckpt.step}")
    if ckpt.config:
        print(f"model:     {ckpt.config.get('model_type')} ({', '.join(ckpt.config.get('architectures') or [])})")
    _print_topology(manifest, ckpt)
    if ckpt.tied:
        print("tied:      " + "; ".join(" <- ".join(g) for g in ckpt.tied))
    moe = experts.summary(ckpt) or deepspeed_moe.summary(ckpt)
    if moe:
        print(f"experts:   {moe}")
    found = against_model.problems(ckpt)  # what every writer would refuse it for
    for problem in found[:10]:
        print(f"  ! {problem}")
    if len(found) > 10:
        print(f"  ! ... and {len(found) - 10} more")
    past = model_facts.past_layers(ckpt)
    if past:  # a hub release's multi-token-prediction layers: which targets hold them
        layers = sorted({n.split(".layers.", 1)[0] + ".layers." + n.split(".layers.", 1)[1].split(".", 1)[0] for n in past})
        print(f"beyond:    {len(past)} tensors in {', '.join(layers)}, past the model's own layers (multi-token prediction): "
              "kept by universal, hf and the Megatron targets, left out of the engine formats")
    if ckpt.adapter is not None:
        print(f"adapters:  {adapter_models.summary(ckpt.adapter)}")
    if ckpt.frozen:
        print(f"frozen:    {len(ckpt.frozen)} tensors")
    for note in ckpt.notes:  # what the reader made of it (a pre-quantized release read dequantized, a model transformers lacks)
        print(f"note:      {note}")
    if ckpt.optimizer is not None:
        o = ckpt.optimizer
        print(f"optimizer: {o.cls}, {len(o.param_groups)} param group(s), state keys {', '.join(o.state_keys)}")
    comps = dict(manifest.components) if manifest else {k: c.record for k, c in ckpt.components.items()}
    if comps:
        print("\ncomponents:")
        print(f"  {'key':<20} {'pattern':<11} {'on world-size change':<21} pieces")
        for key, rec in comps.items():
            print(f"  {key:<20} {rec.pattern:<11} {rec.policy:<21} {len(rec.pieces)}")
    rows = [(key, list(t.spec.shape), t.spec.dtype_name, t.spec.nbytes) for key, t in ckpt.tensors()]
    if rows:
        width = min(max(len(r[0]) for r in rows), 70)
        print(f"\n  {'tensor':<{width}} {'shape':<18} {'dtype':<9} {'bytes':>10}")
        for key, shape, dtype, nbytes in rows[: args.limit or None]:
            print(f"  {key:<{width}} {str(shape):<18} {dtype:<9} {human_bytes(nbytes):>10}")
        if args.limit and len(rows) > args.limit:
            print(f"  ... {len(rows) - args.limit} more (use --limit 0 for all)")
    n_model = sum(t.spec.numel for t in ckpt.model.values())
    total = sum(r[3] for r in rows)
    print(f"\ntotal:     {len(rows)} tensors, {human_bytes(total)}; model parameters {n_model:,}")
    return 0


# --- verify --------------------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from interop.verify import verify_checkpoint

    directory = resolve_checkpoint_dir(args.path)
    ours = os.path.isfile(os.path.join(directory, MANIFEST)) or os.path.normpath(directory).endswith(STAGING_SUFFIX) or any(
        os.path.isdir(os.path.join(directory, d)) for d in OUR_FOLDERS)
    if not ours:  # nothing records what it should hold: unusable input for verify, like any other (exit 2)
        fmt = registry.detect(args.path)  # one line for what is no checkpoint at all
        raise UnknownFormatError(args.path, f"is a {fmt.name} checkpoint with no interop {MANIFEST}: nothing records what it "
                                 "should hold, so there is nothing to verify it against (interop inspect reads it; interop "
                                 "convert checks each tensor it reads)")
    progress = None if args.quiet else (lambda items, **kw: _iter_progress(items, **kw))
    manifest, problems = verify_checkpoint(directory, digests=not args.sizes_only, progress=progress)
    if not problems:  # the bytes are the manifest's: are they the model (every expert once, every tensor its size)?
        problems = _model_problems(args.path)
    if problems:
        print(f"{directory}: {len(problems)} problem(s)")
        for p in problems:
            print(f"  - {p}")
        return EXIT_PROBLEMS
    assert manifest is not None
    checked = "sizes" if args.sizes_only else "sizes and digests"
    print(f"{directory}: OK ({manifest.format}, {len(manifest.files)} files, {checked} match the manifest)")
    return 0


def _model_problems(path: str) -> list[str]:
    """How a checkpoint whose files match its manifest is not its config's model (the MoE experts it lacks,
    duplicates or invents, tensors of another size, missing ones: what every writer refuses; read again without
    digests: verify has just checked them)."""
    try:
        _, ckpt = registry.read(path, registry.Options(verify_digests=False))
    except ConversionError as exc:  # what it holds cannot be the model's (an expert tensor of another size)
        return [one_line(exc)]
    except InteropError as exc:  # not readable without a flag (--trust-pickle, --config): the bytes were what verify checks
        log.debug("not held against its model: %s", exc)
        return []
    return against_model.problems(ckpt)


# --- convert -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _parents_of(dst: str):
    """DST's parent directories, made for the conversion (its lock lies there) and removed again if it fails."""
    made, d = [], os.path.dirname(os.path.abspath(dst))
    while not os.path.isdir(d):
        made.append(d)
        d = os.path.dirname(d)
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    try:
        yield
    except BaseException:
        for d in made:  # deepest first
            with contextlib.suppress(OSError):
                os.rmdir(d)
        raise


def _written(directory: str) -> tuple[int, int]:
    """Files and bytes under ``directory`` (what a conversion wrote there)."""
    files = size = 0
    for root, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):
                size += os.path.getsize(os.path.join(root, name))
                files += 1
    return files, size


def cmd_convert(args: argparse.Namespace) -> int:
    options = _options(args)
    target = registry.writer(args.to)
    registry.check_dtype_flag(target, args.dtype)
    registry.check_target_flags(target, options.extra)
    several = args.workers > 1 or workers.launched()
    if several and not target.spreads:
        raise ConfigurationError(f"--to {target.name} is written by one process; several processes write "
                                 f"{', '.join(n for n, f in registry.FORMATS.items() if f.spreads)} (drop --workers / torchrun)")
    if args.workers > 1 and not workers.launched():
        return workers.run_workers(workers.without_workers(args.argv), args.workers)
    spread = options.spread = workers.join() if several else None
    lead = leads(spread)
    try:
        with contextlib.ExitStack() as held:
            def prepare() -> None:
                if lead:  # refuse before reading anything; the lead holds DST's lock (one conversion into it at a
                    # time: the others would see the lead's) and makes its parents
                    check_destination(args.dst, options.overwrite, src=args.src)
                    held.enter_context(_parents_of(args.dst))
                    held.enter_context(exclusive(destination_lock(args.dst), args.dst))

            def read() -> tuple[registry.Format, LogicalCheckpoint]:
                fmt, ckpt = registry.read(args.src, options)
                if args.adapter:
                    ckpt = adapter_models.with_adapter_dir(ckpt, args.adapter, args.src)
                return fmt, _adapters_for(ckpt, args, target)

            together(spread, "preparing the destination", prepare)
            src_fmt, ckpt = together(spread, "reading the source", read)
            missing = registry.missing_config(ckpt, target)
            if missing:
                ckpt.notes.append(missing)  # printed below and recorded in the output's manifest
            total = sum(t.spec.nbytes for _, t in ckpt.tensors())
            options.progress, close = _bytes_progress(total, f"{src_fmt.name} -> {target.name}") if lead else (None, lambda: None)
            try:
                target.write(ckpt, args.dst, options)  # type: ignore[misc]
            finally:
                close()
    finally:
        if spread is not None:
            workers.leave()
    if not lead:
        return 0
    files, written_bytes = _written(args.dst)
    print(f"converted {args.src} ({src_fmt.name}) -> {args.dst} ({target.name}): wrote {human_bytes(written_bytes)} in "
          f"{files} file(s) (the source's tensors: {human_bytes(total)})")
    if target.loads_with:
        print(f"load it with: {target.loads_with.replace('{dst}', args.dst)}")
    if ckpt.adapter is not None and target.name == "universal":
        print(f"its adapters: peft.PeftModel.from_pretrained(<the model>, '{os.path.join(args.dst, 'adapter')}')")
    directory = resolve_checkpoint_dir(args.dst)  # an engine's tag file may lead to the folder with our manifest
    written = os.path.join(directory, MANIFEST)  # what was lost on the way is recorded there too (reader's and writer's)
    notes = read_manifest(directory).notes if os.path.isfile(written) else list(ckpt.notes)
    lost = registry.left_out(ckpt, target)
    for note in notes + ([lost] if lost and lost not in notes else []):
        print(f"note: {note}")
    return 0


def _adapters_for(ckpt: LogicalCheckpoint, args: argparse.Namespace, target: registry.Format) -> LogicalCheckpoint:
    """A source with peft adapters goes to peft's adapter directory, or merged into the base model (--merge-adapters),
    or whole (base, adapter and the adapter's optimizer state) to a target that keeps a peft model's state; a Hugging
    Face model directory cannot hold the adapters apart (from_pretrained would initialise every adapted weight at
    random), so --to hf alone is refused offering both (the registry's writers that have no place for adapters)."""
    if ckpt.adapter is None:
        if target.name == "peft" or args.merge_adapters:
            raise ConfigurationError(f"{'--to peft' if target.name == 'peft' else '--merge-adapters'}: {args.src} holds no peft adapters")
        return ckpt
    if args.merge_adapters and target.name == "peft":
        raise ConfigurationError("--merge-adapters writes the base model with the adapters merged in; --to peft writes the "
                                 "adapters apart: choose one")
    if args.merge_adapters:
        return adapter_models.merged(ckpt)
    return ckpt


# --- diff ----------------------------------------------------------------------------------------------


def cmd_diff(args: argparse.Namespace) -> int:
    options = _options(args)
    fa, a = registry.read(args.a, options)
    fb, b = registry.read(args.b, options)
    report = diff.diff_checkpoints(
        a, b, args.atol, progress=lambda items, **kw: _iter_progress(items, **kw), model_only=args.model_only
    )
    sides = {"only_a": f"A ({args.a})", "only_b": f"B ({args.b})"}
    for status, side in sides.items():
        by_prefix: dict[str, list[str]] = {}
        for e in report.entries:
            if e.status == status:
                prefix = e.key.rsplit("/", 1)[0] + "/" if e.key.startswith("optimizer/") else ""
                by_prefix.setdefault(prefix, []).append(e.key)
        for prefix, keys in by_prefix.items():
            if prefix and len(keys) > 3 and not args.verbose:
                print(f"! {prefix}*: {len(keys)} tensors only in {side}")
            else:
                for key in keys:
                    print(f"! {key}: only in {side}")
    for e in report.entries:
        if (e.status == "exact" and not args.verbose) or e.status in sides:
            continue
        elif e.status in ("shape", "dtype"):
            print(f"! {e.key}: {e.detail}" + (f", max |a-b| {e.max_abs:.3g}" if e.max_abs is not None else ""))
        elif e.status == "differs":
            print(f"! {e.key}: max |a-b| {e.max_abs:.6g}")
        else:
            print(f"{'=' if e.status == 'exact' else '~'} {e.key}: {e.status}" + (f" (max |a-b| {e.max_abs:.3g})" if e.status == "close" else ""))
    # which experts each side holds can differ only where names or shapes do (asking transformers about the
    # model's experts costs its import, which a diff of equal layouts never pays)
    moe = diff.expert_differences(a, b) if any(e.status in ("only_a", "only_b", "shape") for e in report.entries) else []
    for line in moe:
        print(f"! experts: {line}")
    both = len(report.entries) - report.count("only_a") - report.count("only_b")
    print(
        f"{fa.name} vs {fb.name}: {both} compared, {report.count('exact')} exact, {report.count('close')} within atol, "
        f"{len(report.different)} different; {report.count('only_a')} only in A, {report.count('only_b')} only in B"
    )
    if not args.model_only and (a.optimizer is None) != (b.optimizer is None):
        side = "A" if a.optimizer is None else "B"
        print(f"hint: {side} holds no optimizer state; compare the weights alone with --model-only")
    return EXIT_PROBLEMS if report.problems or moe else 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: a size is at least 1")
    return value


def _size_arg(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 5GiB, 500MB, 1048576)") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a shard needs at least one byte")
    return size


# --- wiring --------------------------------------------------------------------------------------------


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser; with ``argv``, the plugins' commands are loaded only where it names none of
    the built-in ones (looking them up imports importlib.metadata: a tenth of a small conversion's start-up). A
    plugin (entry point group ``interop.commands``) adds commands of its own; it does not change the built-in ones."""
    parser = OneLineParser(
        prog="interop", description="Inspect, verify, convert and compare training checkpoints across engines."
    )
    parser.add_argument("--version", action="version", version=f"interop {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        return p

    p = add("inspect", cmd_inspect, "show a checkpoint's format, topology, components and tensors")
    p.add_argument("path", help="checkpoint directory (or a root whose 'latest' names one)")
    p.add_argument("--limit", type=int, default=50, help="rows of the tensor table to print (0: all; default 50)")
    p.add_argument("--trust-pickle", action="store_true", help="allow arbitrary objects in pickled native files")
    p.add_argument("--config", metavar="PATH", help="the model's config.json (or its model directory), for a source that carries none")
    p.add_argument("--adapter-config", metavar="PATH", help="peft's adapter_config.json (or its directory), for adapters without one beside them")
    p.add_argument("--base-model", metavar="DIR", help="the base model a Trainer checkpoint of a peft model was trained on (it holds the adapter only)")

    p = add("verify", cmd_verify, "check a committed checkpoint: every file present, sizes and digests match")
    p.add_argument("path", help="checkpoint directory (or a root whose 'latest' names one)")
    p.add_argument("--sizes-only", action="store_true", help="skip digests (fast)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    p = add("convert", cmd_convert, "convert a checkpoint to another format; the source format is detected")
    p.add_argument("src", help="source checkpoint or model directory")
    p.add_argument("dst", help="output directory (built in staging, moved into place when complete)")
    writable = [n for n, f in registry.FORMATS.items() if f.write is not None]
    p.add_argument("--to", required=True, choices=writable, help="target format")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    p.add_argument("--trust-pickle", action="store_true", help="allow arbitrary objects in pickled native files")
    p.add_argument("--config", metavar="PATH", help="the model's config.json (or its model directory), for a source that carries none")
    p.add_argument("--max-shard-size", type=_size_arg, default="5GiB", help="largest safetensors file (default 5GiB; e.g. 500MB, 2GiB)")
    p.add_argument("--workers", type=_positive_int, default=1, help="write the output with N processes on this machine, "
                   "each a share of the bytes (universal, hf; several machines: torchrun ... -m converters.cli convert ...)")
    g = p.add_argument_group("engine layout (native targets; default: the source's)")
    g.add_argument("--world-size", type=_positive_int, help="number of data-parallel ranks the output is for")
    g.add_argument("--zero-stage", type=int, choices=(1, 2, 3), help="DeepSpeed ZeRO stage")
    g.add_argument("--ep-size", "--expert-model-parallel-size", dest="ep_size", type=_positive_int,
                   help="expert-parallel ranks of a MoE model: deepspeed.moe's ep_size, Megatron's "
                        "--expert-model-parallel-size (megatron: one mp_rank_*_EEE directory each; default: the source's)")
    g.add_argument("--expert-tensor-parallel-size", dest="etp_size", type=_positive_int, metavar="N",
                   help="Megatron: the loading run's --expert-tensor-parallel-size, the experts' own TP size (dividing --tp, "
                        "at EP > 1; --to megatron-dist; default: the source's where it divides --tp, else --tp)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), help="training precision (master weights stay fp32)")
    g.add_argument("--deepspeed-config", help="DeepSpeed JSON config to record in the files")
    g.add_argument("--param-groups", choices=("source", "single", "decay"),
                   help="DeepSpeed: how the loading script groups its optimizer's parameters: as the source did (default; "
                        "one group if --deepspeed-config has an optimizer section), one group (model.parameters()), or "
                        "decay / no-decay as transformers' Trainer")
    g.add_argument("--fsdp", action="store_true", help="accelerate: the FSDP2 sharded layout (DCP) instead of DDP's")
    g.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=_positive_int, help="Megatron: tensor-parallel size")
    g.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=_positive_int, help="Megatron: pipeline-parallel size")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron: the optimizer state as Megatron-LM's --use-distributed-optimizer saves it (megatron: distrib_optim.pt; "
                        "megatron-dist: the fully_reshardable layout, loadable at any DP x TP x PP)")
    g.add_argument("--dist-optim-layout", choices=("fully_reshardable", "dp_reshardable"),
                   help="megatron-dist: the distributed optimizer's layout (implies --use-distributed-optimizer): "
                        "fully_reshardable (default; loads at any DP x TP x PP) or dp_reshardable (Megatron-LM's default "
                        "without --dist-ckpt-optim-fully-reshardable: flat buckets, loads at this --tp x --pp and any DP; "
                        "needs --transformer-impl local)")
    g = p.add_argument_group("peft adapters (a source saved from a peft model)")
    g.add_argument("--adapter-config", metavar="PATH", help="peft's adapter_config.json (or its directory), when none lies "
                   "beside the checkpoint")
    g.add_argument("--adapter", metavar="DIR", help="peft's adapter directory (adapter_config.json, adapter_model.safetensors) "
                   "to put on the source's base model: the run continues fine-tuning it (written with the base frozen)")
    g.add_argument("--base-model", metavar="DIR", help="the Hugging Face base model a Trainer checkpoint of a peft model "
                   "was trained on (transformers saves the adapter only)")
    g.add_argument("--merge-adapters", action="store_true", help="merge the adapters into the base model (peft's "
                   "merge_and_unload) and write the base model")
    g = p.add_argument_group("Megatron")
    g.add_argument("--transformer-impl", choices=("transformer_engine", "local"),
                   help="Megatron: name norms as Transformer Engine's fused layers hold them (default) or as the local spec")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Megatron: the loading run's --overlap-grad-reduce, whose gradient buckets lay out the distributed "
                        "optimizer's state (distrib_optim.pt, dp_reshardable); buckets of --ddp-bucket-size, else "
                        "Megatron-LM's default of 40M parameters (max(40M, 1M x DP): pass --ddp-bucket-size for DP > 40)")
    g.add_argument("--ddp-bucket-size", type=_positive_int, metavar="N", help="Megatron: the loading run's --ddp-bucket-size")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=_positive_int, metavar="V",
                   help="Megatron: the loading run's interleaved pipeline, V model chunks per stage (model0, model1, ... in each "
                        "rank's file; a gradient buffer each)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=_positive_int, metavar="N",
                   help="Megatron: the same given as layers per chunk")
    g.add_argument("--decoder-first-pipeline-num-layers", type=_positive_int, metavar="N",
                   help="Megatron: the loading run's layers on the first pipeline stage (the rest split evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=_positive_int, metavar="N",
                   help="Megatron: the loading run's layers on the last pipeline stage")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="Megatron: the embedding counts as a layer of the first stage")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="Megatron: the loss counts as a layer of the last stage")
    g.add_argument("--pipeline-model-parallel-layout", metavar="LAYOUT",
                   help="Megatron: the loading run's layer layout, e.g. 'Ett|(tt|)*2,t|L' (E embedding, t layer, L loss; "
                        "| between model chunks, PP x V of them; megatron-core's syntax)")

    p = add("diff", cmd_diff, "compare two checkpoints tensor by tensor, across formats")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bit-exact)")
    p.add_argument("--model-only", action="store_true", help="compare model weights only, not optimizer state")
    p.add_argument("--trust-pickle", action="store_true", help="allow arbitrary objects in pickled native files")
    p.add_argument("--config", metavar="PATH", help="the model's config.json (or its model directory), for a source that carries none")

    command = next((a for a in argv if not a.startswith("-")), None) if argv is not None else None
    if command in sub.choices:
        return parser
    from importlib.metadata import entry_points

    for ep in entry_points(group="interop.commands"):
        try:
            ep.load()(sub)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the core commands
            log.debug("command plugin %s failed to load: %s", ep.name, exc)
    return parser


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(given)
    args = parser.parse_args(given)
    args.argv = given
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_libraries(args.verbose)
    if args.command in ("convert", "verify", "inspect", "diff"):
        # these run torch only to copy and save tensors, between threads that read, hash and write; OpenMP's default
        # wait policy keeps its idle threads spinning after each copy, on the cores those threads need (a seventh of
        # universal -> Megatron's time on 2 cores). Set before torch loads (libgomp reads it once; nothing here has
        # imported torch yet); a user's own setting wins, and a plugin command (a demo that trains) is left alone
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `interop inspect ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (InteropError, OSError) as exc:
        joined = getattr(sys.modules.get("converters.workers"), "joined", False)  # (not imported here, in an error)
        if os.environ.get("RANK", "0") == "0" or not joined:  # one line from a group: its lead's
            print(f"interop {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"interop {args.command}: interrupted; nothing was committed", file=sys.stderr)
        return 130
    except RecursionError:
        print(f"interop {args.command}: error: the input is nested too deeply to read", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 - input no check foresaw: one line, never a traceback (unless -v)
        log.debug("unexpected error", exc_info=True)
        print(f"interop {args.command}: error: unexpected {type(exc).__name__}: {one_line(exc)} "
              "(the input may be damaged; rerun with -v for the traceback)", file=sys.stderr)
        return EXIT_ERROR
    finally:
        ranged.clear()  # the files registered to be checked as they are read: this command is done with them

