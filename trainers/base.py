"""The base trainer: one process, a tiny Hugging Face causal LM, and every piece of state as a component.

    python -m trainers.base --steps 8 --save-every 4 --output-dir out/base
    python -m trainers.base --steps 8 --resume --output-dir out/base      # continue from 'latest'
    python -m trainers.base --init-from path/to/hf_model ...

Resume is exact: N steps, save, resume, N more steps gives the same losses, bit for bit, as 2N steps.
The engine trainers subclass it and change how the model is wrapped and which components are declared.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

import torch

from converters.models.facts import tied_groups
from interop import CheckpointManager, RNGState, SharingPattern, StateComponent, WorldSizePolicy
from interop.errors import ConfigurationError, InteropError, one_line
from interop.logs import quiet_libraries
from interop.usage import OneLineParser
from interop.sharding import LocalModel, ShardingMetadata

from . import memory
from .state import VOCAB_SIZE, DataPosition, OptimizerStateful, TokenDataset, TrainerState

log = logging.getLogger(__name__)

BETAS = (0.9, 0.95)


def flag(default: Any, help: str) -> Any:
    """A config field and its command-line help (``--name``, see :func:`config_parser`)."""
    return field(default=default, metadata={"help": help})


@dataclass
class TrainerConfig:
    model: str = flag("llama", "tiny model built from a config: llama | gpt2 | mixtral (MoE: 4 experts, 2 per token)")
    tied: bool = flag(False, "tie input embeddings and output layer")
    init_from: str | None = flag(None, "a Hugging Face model directory to start from instead of a fresh model")
    steps: int = flag(8, "length of the run (the schedule's horizon)")
    stop_at: int | None = flag(None, "stop early at this step, as an interrupted run would")
    batch_size: int = flag(4, "samples per optimizer step, over all data-parallel ranks")
    seq_len: int = flag(32, "tokens per sample")
    lr: float = flag(3e-3, "peak learning rate (linear warmup, then linear decay to 0 at --steps)")
    weight_decay: float = flag(0.1, "AdamW weight decay (norms and biases: none)")
    max_grad_norm: float = flag(1.0, "clip the global gradient norm (0: off); DeepSpeed's and Hugging Face's default")
    warmup_steps: int = flag(2, "learning-rate warmup steps")
    seed: int = flag(1234, "seed of the model, the data order and every RNG stream")
    output_dir: str = flag("out/base", "where checkpoint-<step> directories are saved")
    save_every: int = flag(0, "save a checkpoint every N steps (0: at the end only)")
    async_save: bool = flag(False, "the step after a save starts once the state is copied in memory: the files are written, "
                                   "fsynced, digested and committed in the background (the next save waits for it)")
    keep_last: int | None = flag(3, "checkpoints kept (older ones are removed after a save commits)")
    resume: str | None = flag(None, "a checkpoint of this trainer (any layout), 'latest' for output_dir's latest, or, for the "
                                    "engine trainers, one of any format interop reads (converted in-process)")
    backend: str = flag("auto", "process-group backend for multi-process trainers: auto | gloo | nccl | mpi")
    activation_checkpointing: bool = flag(False, "recompute activations in the backward pass (less memory)")
    dtype: str = flag("float32", "training precision: float32 | bfloat16 (fp32 master weights kept)")
    freeze: str = flag("", "comma-separated parameter-name prefixes to freeze, e.g. 'model.layers.0.mlp'")
    lora_rank: int = flag(0, "train LoRA adapters of this rank on the frozen model (peft's get_peft_model; 0: full fine-tuning)")
    lora_alpha: float = flag(8.0, "LoRA scaling numerator (peft's lora_alpha; the update is scaled by alpha / rank)")
    lora_targets: str = flag("q_proj,v_proj", "comma-separated module names LoRA adapts (peft's target_modules)")
    verify: bool = flag(True, "on resume, check every file's digest against the manifest (--no-verify: sizes only)")
    debug: bool = flag(False, "show the traceback of an error instead of its one line")
    verbose: bool = flag(False, "show the engines' own log lines and library warnings (DeepSpeed, accelerate, torch)")
    trust_pickle: bool = flag(False, "let the engine unpickle anything in the checkpoint's files (trusted sources only)")


_BASE_HELP = {f.name: f.metadata.get("help", "") for f in fields(TrainerConfig)}


def tiny_config(kind: str, tied: bool = False):
    """Small, deliberately odd sizes (hidden 48, intermediate 100) so padding and tie bugs show."""
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(
            vocab_size=VOCAB_SIZE, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
        )
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB_SIZE, n_positions=128, n_embd=48, n_layer=2, n_head=4,
            tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
        )
    if kind == "mixtral":  # the Llama above with its MLP as 4 experts of intermediate 100, 2 per token
        return transformers.MixtralConfig(
            vocab_size=VOCAB_SIZE, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_local_experts=4,
            num_experts_per_tok=2, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
        )
    raise ConfigurationError(f"unknown tiny model {kind!r} (llama, gpt2 or mixtral)")


def build_model(cfg: TrainerConfig) -> torch.nn.Module:
    import transformers

    dtype = getattr(torch, cfg.dtype)
    if cfg.init_from:
        from converters import registry
        from converters.pickle_safety import weights_only_loads

        # the directory is read as `interop convert` reads it first (paths and links kept inside it, every
        # pickle through the restricted loader, our checkpoints' digests), then transformers loads it weights-only
        # (as the Hugging Face directory transformers will read, whatever else lies there), then transformers
        # loads it weights-only and never runs code the directory brings (auto_map)
        ckpt = registry.read(cfg.init_from, registry.Options(trust_pickle=cfg.trust_pickle, verify_digests=cfg.verify), as_format="hf")[1]
        if (ckpt.config or {}).get("auto_map"):
            raise ConfigurationError(f"{cfg.init_from}/config.json asks to run code shipped with the model (auto_map); "
                                     "interop never runs a checkpoint's own code")
        with weights_only_loads(cfg.trust_pickle):
            model = transformers.AutoModelForCausalLM.from_pretrained(cfg.init_from, dtype=dtype, trust_remote_code=False)
    else:
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(cfg.model, cfg.tied), dtype=dtype)
    if cfg.activation_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:  # transformers 5
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return with_lora(freeze(model, cfg.freeze), cfg)


def with_lora(model: torch.nn.Module, cfg: TrainerConfig) -> torch.nn.Module:
    """The model wrapped by peft's LoRA when --lora-rank asks for it: the base frozen, the adapters trainable."""
    if not cfg.lora_rank:
        return model
    if cfg.freeze:
        raise ConfigurationError("--freeze with --lora-rank: LoRA freezes the whole base model already and trains the adapters")
    from peft import LoraConfig, get_peft_model

    targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    try:
        return get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets, lora_dropout=0.0))
    except ValueError as exc:  # peft's refusal: targets the model lacks
        raise ConfigurationError(f"--lora-targets {cfg.lora_targets!r}: {str(exc).splitlines()[0]}") from None


# what an adapter config says that is not the adapter's shape or arithmetic (how it was made, where it is from)
_NOT_COMPARED = {"base_model_name_or_path", "inference_mode", "revision", "task_type", "peft_version", "init_lora_weights", "auto_mapping"}
_FLAGS = {"r": "--lora-rank", "lora_alpha": "--lora-alpha", "target_modules": "--lora-targets"}


def check_adapter(model: torch.nn.Module, manifest, directory: str, shown_as: str) -> None:
    """The run trains the adapter the checkpoint holds: same rank, alpha, targets, dropout, DoRA... A different
    alpha has the same tensor names and shapes, so it would load and train every update at another scale."""
    from converters.models.adapters import json_config, peft_config, summary
    from interop.jsonio import read_json
    from interop.logical import AdapterState
    from interop.paths import inside

    ours = described(model)[2]
    recorded = (manifest.model or {}).get("adapter")
    if not ours and not recorded:
        return
    config = None
    if recorded:
        config = recorded["config"] if isinstance(recorded["config"], dict) else read_json(inside(directory, recorded["config"]), "adapter config")
    if not ours:
        raise ConfigurationError(f"{shown_as} trains peft adapters ({summary(AdapterState(config, recorded['name'], []))}): "
                                 "resume it with the same --lora-rank, --lora-alpha and --lora-targets")
    if not recorded:
        raise ConfigurationError(f"{shown_as} holds no peft adapters and this run trains LoRA (--lora-rank): resume it without "
                                 "--lora-rank, or put an adapter on its model first (interop convert BASE DST --adapter DIR)")
    theirs, mine = json_config(peft_config(config)), json_config(peft_config(ours["config"]))
    differ = [k for k in sorted(set(theirs) | set(mine)) if k not in _NOT_COMPARED and theirs.get(k) != mine.get(k)]
    if differ:
        said = "; ".join(f"{_FLAGS.get(k, k)}: the checkpoint's {theirs.get(k)!r}, this run's {mine.get(k)!r}" for k in differ)
        raise ConfigurationError(f"{shown_as} trains another adapter than this run: {said}")


def described(model: torch.nn.Module) -> tuple[Any, str, dict[str, Any] | None]:
    """A model's config, its transformers architecture and its peft adapter (config and name), under any wrapper
    peft put around it: a LoRA run's checkpoint says which base model and which adapter it trains."""
    from converters.models.adapters import json_config

    peft_configs = getattr(model, "peft_config", None)
    base = model.get_base_model() if peft_configs is not None and hasattr(model, "get_base_model") else model
    adapter = None
    if peft_configs:
        name = getattr(model, "active_adapter", "default")
        config = json_config(peft_configs[name])
        config.pop("base_model_name_or_path", None)  # a path of this machine's, which a checkpoint does not follow
        adapter = {"config": config, "name": name}
    return base.config, type(base).__name__.removeprefix("FSDP"), adapter


def freeze(model: torch.nn.Module, spec: str) -> torch.nn.Module:
    """Freeze the parameters whose names start with one of the comma-separated prefixes in ``spec``."""
    prefixes = tuple(p.strip() for p in spec.split(",") if p.strip())
    if prefixes:
        frozen = [n for n, _ in model.named_parameters() if n.startswith(prefixes)]
        if not frozen:
            raise ConfigurationError(f"--freeze {spec!r} matches no parameter of {type(model).__name__}")
        for n, p in model.named_parameters():
            if n in frozen:
                p.requires_grad_(False)
    return model


def param_group_names(model: torch.nn.Module) -> list[list[str]]:
    """Decay for matrices, none for biases, norms and other 1-D parameters (the usual convention); trainable
    parameters only, in module order; an empty group left out (LoRA's adapters are all matrices). A checkpoint
    records these names: optimizers keep parameters by position."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(n)
    return [g for g in (decay, no_decay) if g] or [decay]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    params = dict(model.named_parameters())
    return [{"params": [params[n] for n in g], "weight_decay": weight_decay if not g or params[g[0]].dim() >= 2 else 0.0}
            for g in param_group_names(model)]


def model_metadata(config, architecture: str, adapter: dict[str, Any] | None, frozen: list[str]) -> dict[str, Any]:
    """The manifest's model section: the Hugging Face config (with its architecture), tied and frozen names, and
    the peft adapter trained on it."""
    data = config.to_dict()
    data["architectures"] = [architecture]
    out = {"family": data.get("model_type"), "config": data, "tied": tied_groups(data), "frozen": frozen}
    return {**out, "adapter": adapter} if adapter else out


def resolve_backend(name: str) -> str:
    if name != "auto":
        return name
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str = "auto") -> tuple[int, int]:
    """Start the default process group when launched by torchrun/deepspeed/accelerate with >1 process."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=resolve_backend(backend))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class BaseTrainer:
    def __init__(self, cfg: TrainerConfig):
        self.cfg = cfg
        self.rank, self.world_size = self.init_distributed()
        torch.manual_seed(cfg.seed)
        self.model = self.build_model()
        self.optimizer = self.build_optimizer(param_groups(self.model, cfg.weight_decay))
        self.scheduler = self.build_scheduler()
        self.dataset = TokenDataset(cfg.seq_len)
        self.data = DataPosition(seed=cfg.seed)
        self.state = TrainerState()
        self.rng = RNGState()
        self.checkpoints = CheckpointManager(cfg.output_dir, self, keep_last=cfg.keep_last)
        self.checkpoints.claim()  # a second run into the same output directory is refused now, not at its first save

    # --- construction hooks the engine trainers override ----------------------------------------------
    def init_distributed(self) -> tuple[int, int]:
        return init_distributed(self.cfg.backend)

    def build_model(self) -> torch.nn.Module:
        return build_model(self.cfg)

    def build_optimizer(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, lr=self.cfg.lr, betas=BETAS)

    def build_scheduler(self):
        from transformers import get_linear_schedule_with_warmup

        return get_linear_schedule_with_warmup(self.optimizer, self.cfg.warmup_steps, max(self.cfg.steps, 1))

    # --- the adapter's view ------------------------------------------------------------------------
    def get_state_components(self) -> list[StateComponent]:
        return [
            StateComponent("model", LocalModel(self.model), SharingPattern.GLOBAL),
            StateComponent("optimizer", OptimizerStateful(self.model, self.optimizer), SharingPattern.GLOBAL),
            StateComponent("scheduler", self.scheduler, SharingPattern.GLOBAL),
            StateComponent("data", self.data, SharingPattern.GLOBAL),
            StateComponent("trainer", self.state, SharingPattern.GLOBAL),
            StateComponent("rng", self.rng, SharingPattern.PER_RANK, on_world_size_change=WorldSizePolicy.RESEED),
        ]

    def core_model(self) -> torch.nn.Module:
        """The Hugging Face model itself, under whatever wrapper the engine put around it."""
        return self.model

    def get_checkpoint_metadata(self) -> dict[str, Any]:
        model = self.core_model()
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        return {
            "model": model_metadata(*described(model), frozen),
            "sharding": self.sharding_metadata().to_json(),
            "optimizer": {"class": type(self.optimizer).__name__},
        }

    def sharding_metadata(self) -> ShardingMetadata:
        return LocalModel(self.model, self.rank, self.world_size).sharding_metadata()

    # --- the loop ----------------------------------------------------------------------------------
    def next_batch(self) -> torch.Tensor:
        return self.data.next_batch(self.dataset, self.cfg.batch_size)

    def train_step(self, batch: torch.Tensor) -> float:
        self.model.train()
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        self.clip_gradients()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def clip_gradients(self) -> None:
        """Scale the gradients to a global norm of at most ``max_grad_norm``, as every engine does by default."""
        if self.cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)

    def train(self, until: int | None = None) -> list[float]:
        """Train to step ``until`` (default cfg.steps); returns the losses of the steps run by this call."""
        until = self.cfg.steps if until is None else until
        losses = []
        while self.state.step < until:
            batch = self.next_batch()
            loss = self.train_step(batch)
            self.state.step += 1
            self.state.tokens_seen += batch.numel() * self.world_size
            self.state.losses.append(loss)
            losses.append(loss)
            log.info("step %d loss %.6f lr %.3g", self.state.step, loss, self.scheduler.get_last_lr()[0])
            if self.cfg.save_every and self.state.step % self.cfg.save_every == 0:
                self.save(wait=False)
        self.checkpoints.wait()
        return losses

    def memory_stats(self) -> dict[str, Any]:
        """Every rank's memory now (a collective: all ranks call it together), summarised across ranks."""
        samples = self.checkpoints.collective.all_gather_object(memory.sample(self.rank))
        return memory.summarize(samples, memory.activation_checkpoints(self.core_model()))

    def save(self, wait: bool = True) -> str:
        """Checkpoint the current step. ``wait=False`` (the loop's saves) returns once the engine's files are written,
        or with --async-save once the state is copied in memory; the commit finishes beside the next steps."""
        stats = self.memory_stats()
        log.info("%s", memory.describe(stats))
        return self.checkpoints.save(self.state.step, metadata={"memory": stats}, wait=wait, stage=self.cfg.async_save and not wait)

    # the component that holds this trainer's model and optimizer: a checkpoint without it is another format's
    primary_component = "model"

    def import_writer(self) -> Callable[[Any, str], Any] | None:
        """How a checkpoint of another format becomes one of this trainer's layout (``write(logical, dir)``);
        None where no converter writes this trainer's format."""
        return None

    def resume(self, path: str | None = None) -> int:
        """Resume from ``path``: a checkpoint of this trainer (any layout the engine reshards) as it is, or one of
        any other format interop reads, converted on rank 0 into a scratch directory first."""
        target = None if path in (None, "latest") else path
        if target is None or self.reads_as_is(target):
            return self.load_checkpoint(target)
        write = self.import_writer()
        if write is None:
            from converters import registry

            fmt = _our_format(target)
            if fmt in ("", "interop"):  # ours, or damaged: the manager's load says which component or file is wrong
                return self.load_checkpoint(target)
            fmt = fmt or registry.detect(target).name  # raises naming the problem when nothing reads it
            if fmt == "hf":
                raise ConfigurationError(f"{target} is a Hugging Face model, not a checkpoint to resume: start from it with --init-from {target}")
            raise ConfigurationError(
                f"{target} is a {fmt} checkpoint, and no converter writes {type(self).__name__}'s format: resume it "
                f"with the trainer of its engine, or with trainers.hf_trainer (one process), which convert any format")
        scratch = import_checkpoint(self, target, write)
        try:
            return self.load_checkpoint(scratch, origin=target)
        finally:
            self.checkpoints.collective.barrier()
            if self.rank == 0:
                import shutil

                shutil.rmtree(scratch, ignore_errors=True)

    def reads_as_is(self, path: str) -> bool:
        """``path`` is a committed checkpoint (or run root) holding this trainer's primary component."""
        from converters.engine_checkpoint import holds_component

        return holds_component(path, self.primary_component)

    def check_checkpoint(self, directory: str, manifest, shown_as: str) -> None:
        """Called by the checkpoint manager before anything is loaded: the checkpoint's adapter is this run's."""
        check_adapter(self.core_model(), manifest, directory, shown_as)

    def load_checkpoint(self, target: str | None, origin: str | None = None) -> int:
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        result = self.checkpoints.load(target, verify=self.cfg.verify, shown_as=origin)
        if not result.step:  # weights converted from a model: no training yet, so no optimizer state to keep
            self.optimizer.state.clear()
            for group, hyper in zip(self.optimizer.param_groups, fresh):
                group.update(hyper)
            log.info("%s is at step 0: weights loaded, the optimizer starts fresh", origin or result.path)
        log.info("resumed from %s at step %d", origin or result.path, self.state.step)
        return self.state.step


def _our_format(path: str) -> str | None:
    """For a checkpoint with our manifest: the format it is (another trainer's, "interop" for this one's), or ""
    where it is damaged past detecting; None where ``path`` has no manifest."""
    from converters import registry
    from interop.commit import resolve_checkpoint_dir
    from interop.manifest import MANIFEST

    try:
        if not os.path.isfile(os.path.join(resolve_checkpoint_dir(path), MANIFEST)):
            return None
    except Exception:  # noqa: BLE001 - an unresolvable path is reported by whoever reads it
        return None
    try:
        return registry.detect(path).name
    except Exception:  # noqa: BLE001 - the manager's load names what is wrong with it
        return ""


def import_checkpoint(trainer, path: str, write: Callable[[Any, str], Any]) -> str:
    """For a trainer resuming from a checkpoint of another format: rank 0 reads ``path`` (any readable format)
    and ``write(logical, scratch)`` puts it into the trainer's own format in a scratch directory beside its
    checkpoints; every rank learns whether that worked. Returns the scratch directory (the caller removes it)."""
    scratch = os.path.join(os.path.abspath(trainer.cfg.output_dir), f".import-{os.path.basename(os.path.normpath(path))}")

    def convert() -> None:
        from converters import registry

        options = registry.Options(trust_pickle=trainer.cfg.trust_pickle, verify_digests=trainer.cfg.verify)
        fmt, ckpt = registry.read(path, options)
        log.info("converting %s (%s) for this run", path, fmt.name)
        write(ckpt, scratch)

    trainer.checkpoints.on_rank_zero(convert, what=f"converting {path}")
    return scratch


def config_parser(cls=TrainerConfig, description: str | None = None) -> argparse.ArgumentParser:
    """Flags for every TrainerConfig field (``--save-every``), so the engines' launchers can pass them."""
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    here = os.path.dirname(os.path.abspath(__file__))
    prog = f"python -m trainers.{os.path.basename(script)[:-3]}" if os.path.dirname(script) == here else None  # one of ours
    parser = OneLineParser(prog=prog, description=description or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                           allow_abbrev=False)  # --verbose is read from the command line before parsing: spelled out
    defaults = cls()
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        text = f.metadata.get("help") or _BASE_HELP.get(f.name, "")  # a trainer's own default keeps the base's help
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif f.name == "resume":
            parser.add_argument(flag, nargs="?", const="latest", default=None, help=f"{text} (bare --resume: latest)")
        else:
            kind = type(default) if default is not None else str
            parser.add_argument(flag, type=int if f.name in ("keep_last", "stop_at") else kind, default=default,
                                help=f"{text} (default: {default})" if text else f"default: {default}")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return parser


def parse_config(argv: list[str] | None = None, cls=TrainerConfig, description: str | None = None) -> TrainerConfig:
    args = vars(config_parser(cls, description).parse_args(argv))
    return cls(**{f.name: args[f.name] for f in fields(cls)})


def run(make: Callable[[], Any]) -> None:
    """Shared __main__ body: build the trainer (``make``, so that its own start-up errors are caught too),
    resume if asked, train, save at the end, print one JSON summary line. Whatever ends the run early is one
    line on stderr and exit code 2, as the CLI does; ``--debug`` (or INTEROP_DEBUG=1) shows the traceback.
    A finished run exits 0 without the interpreter's teardown: its checkpoint is committed and its process
    group left, and a gloo CPU process now and then aborts in C++ static destructors there ("terminate called
    without an active exception", exit -6), which torchrun reports as a failed run."""
    try:
        _run(make())
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback, unless asked for
        if "--debug" in sys.argv or os.environ.get("INTEROP_DEBUG") == "1":
            raise
        what = "" if isinstance(exc, InteropError) else f"unexpected {type(exc).__name__}: "
        hint = "" if isinstance(exc, InteropError) else " (rerun with --debug for the traceback)"
        print(f"error: {what}{one_line(exc)}{hint}", file=sys.stderr, flush=True)
        os._exit(2)  # a process group may be half torn down; nothing of this run is left to flush
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(trainer: Any) -> None:
    cfg = trainer.cfg
    if cfg.resume:
        trainer.resume(cfg.resume)
    start = trainer.state.step
    losses = trainer.train(cfg.stop_at)
    if trainer.state.step == start and cfg.resume:  # a finished run resumed: saving again would only replace a checkpoint
        log.warning("nothing to train: the checkpoint is at step %d and the run ends at step %d (--steps, --stop-at); "
                    "no checkpoint written", start, cfg.stop_at or cfg.steps)
        path = None
    else:
        saved_by_loop = cfg.save_every and trainer.state.step % cfg.save_every == 0
        path = trainer.checkpoints.path_for(trainer.state.step) if saved_by_loop else trainer.save()
    if trainer.rank == 0:
        print(json.dumps({"step": trainer.state.step, "losses": losses, "checkpoint": path, "config": asdict(cfg)}), flush=True)
    shutdown()


def shutdown() -> None:
    """Leave the process group together: exiting with a live group can abort a rank (gloo threads)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def configure_logging(argv: list[str] | None = None) -> None:
    """INFO on rank 0, warnings only on the others: one copy of each progress line. The engines' own lines
    (accelerate's per saved file, DeepSpeed's accelerator detection, torch's deprecations) with --verbose only.
    Read from the command line before the trainer's flags are parsed: the engines log while they import."""
    rank0 = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_libraries("--verbose" in (sys.argv[1:] if argv is None else argv))


def main(argv: list[str] | None = None) -> None:
    configure_logging(argv)
    run(lambda: BaseTrainer(parse_config(argv)))


if __name__ == "__main__":
    main()
