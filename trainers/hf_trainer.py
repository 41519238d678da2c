"""The reference Hugging Face trainer: transformers' own ``Trainer`` on the base trainer's model and data.

    python -m trainers.hf_trainer --steps 8 --save-every 4 --output-dir out/hf
    python -m trainers.hf_trainer --steps 8 --resume out/hf/checkpoint-4
    python -m trainers.hf_trainer --steps 8 --resume path/to/any/checkpoint    # converted in-process first

``Trainer`` builds the AdamW groups (decay, then biases and norms without), the linear warmup schedule,
gradient clipping and the RNG handling itself; the data is the base trainer's stream in the same order (a
sequential sampler over it), so the losses are the other trainers'. One process.

Each checkpoint's ``hf_trainer/`` is what ``Trainer`` itself writes (``model.safetensors``, ``optimizer.pt``,
``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``), so ``trainer.train(resume_from_checkpoint=...)``
works on it directly; the data position and trainer progress are components beside it. Resuming is
``Trainer``'s own: it restores every file and skips ``global_step`` batches of the stream.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import torch

from converters import hf_trainer as hf_format
from converters import registry
from converters.pickle_safety import numpy_allowlist, weights_only_loads
from interop import CheckpointManager, SharingPattern, StateComponent, WorldSizePolicy
from interop.errors import CorruptCheckpointError, LoadFailedError, TopologyError
from interop.sharding import ShardingMetadata, Strategy
from interop.state import NativeLoad

from .base import BETAS, TrainerConfig, build_model, check_adapter, configure_logging, described, import_checkpoint, model_metadata, run
from .base import parse_config as base_parse_config
from .staging import deferred_writes, run_all
from .state import DataPosition, TokenDataset, TrainerState

log = logging.getLogger(__name__)


@dataclass
class HFTrainerConfig(TrainerConfig):
    output_dir: str = "out/hf"


class DataStream(torch.utils.data.Dataset):
    """The base trainer's sample order, flattened: item i is the i-th sample a DataPosition from the start
    draws, so a sequential sampler (and Trainer's skip of ``global_step`` batches) follows it exactly."""

    def __init__(self, dataset: TokenDataset, seed: int, num_samples: int):
        self.dataset, self.seed, self.num_samples = dataset, seed, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = self.dataset.num_samples
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + i // n))
        sample = self.dataset.sample(int(order[i % n]))
        return {"input_ids": sample, "labels": sample}


def _checkpointing_flag(transformers) -> str:
    """``activation_checkpointing`` (transformers 5), ``gradient_checkpointing`` before."""
    fields = transformers.TrainingArguments.__dataclass_fields__
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def position_after(steps: int, cfg: TrainerConfig, dataset: TokenDataset) -> DataPosition:
    """Where the base trainer's data stream is after ``steps`` global batches from the start."""
    position = DataPosition(seed=cfg.seed)
    for _ in range(steps):
        position.next_batch(dataset, cfg.batch_size)
    return position


class TrainerCheckpoint:
    """The Trainer's own checkpoint files, written and resumed by transformers itself (a native component),
    beside the manifest: ``Trainer.train(resume_from_checkpoint=checkpoint)`` takes one of the run's checkpoints
    as it is."""

    native_top = True

    def __init__(self, owner: "HFTrainer"):
        self.owner = owner

    def save_native(self, directory: str) -> None:
        trainer = self.owner.trainer
        os.makedirs(directory, exist_ok=True)
        trainer.save_model(directory)  # a peft model's: the adapter directory (adapter_config.json, adapter_model.safetensors)
        if described(self.owner.model)[2] is not None:
            hf_format.save_peft_whole(self.owner.model, directory)
        trainer._save_optimizer_and_scheduler(directory)
        trainer._save_rng_state(directory)
        trainer.state.save_to_json(os.path.join(directory, hf_format.TRAINER_STATE))

    def stage_native(self, directory: str, group: Any = None) -> Callable[[], None]:
        """The Trainer's own save (``save_native``) as it is, with the state it hands safetensors' ``save_file``
        and ``torch.save`` staged in memory now and written by those functions later (``trainers.staging``):
        the weights, the optimizer and scheduler state, RNG states and training arguments."""
        import safetensors.torch
        import transformers.modeling_utils

        writers = [(torch, "save"), (safetensors.torch, "save_file"), (transformers.modeling_utils, "safe_save_file")]
        try:
            import peft.peft_model

            writers.append((peft.peft_model, "safe_save_file"))  # an adapter's file, as peft writes it
        except ImportError:
            pass
        with deferred_writes(*[(ns, name) for ns, name in writers if hasattr(ns, name)]) as saves:
            self.save_native(directory)
        return run_all(saves)

    def load_native(self, load: NativeLoad) -> None:
        written_for = int((load.manifest.sharding or {}).get("world_size") or 1)
        if written_for != 1:
            raise TopologyError(f"{load.directory}: a Trainer checkpoint of {written_for} processes; this trainer runs one "
                                "(convert it: interop convert SRC DST --to hf-trainer)")
        hf_format.screen_trainer_checkpoint(load.directory, self.owner.cfg.trust_pickle)
        self.owner.resume_from = load.directory  # Trainer loads it when training starts (weights-only, see train)


class HFTrainer:
    """One process, ``transformers.Trainer`` doing the training, our adapter doing the checkpoints."""

    def __init__(self, cfg: HFTrainerConfig):
        import transformers

        self.cfg, self.rank, self.world_size = cfg, 0, 1
        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg)
        self.dataset = TokenDataset(cfg.seq_len)
        self.data = DataPosition(seed=cfg.seed)
        self.state = TrainerState()
        self.resume_from: str | None = None
        self.imported: str | None = None  # a converted copy of a foreign checkpoint, removed after training
        self.losses: list[float] = []
        self.scratch = tempfile.mkdtemp(prefix="hf-trainer-")  # Trainer's output_dir: it saves nothing there itself
        args = transformers.TrainingArguments(
            output_dir=self.scratch, max_steps=cfg.steps, per_device_train_batch_size=cfg.batch_size,
            learning_rate=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
            max_grad_norm=cfg.max_grad_norm, lr_scheduler_type="linear", warmup_steps=cfg.warmup_steps,
            optim="adamw_torch", seed=cfg.seed, save_strategy="no", logging_strategy="no", report_to=[],
            use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, disable_tqdm=True,
            # every trainable parameter takes part in each step; True (Trainer's default under a launcher) makes
            # torch's DDP reducer warn on every run that it found none unused
            ddp_find_unused_parameters=False,
            **{_checkpointing_flag(transformers): cfg.activation_checkpointing},
        )
        owner = self

        class Trainer(transformers.Trainer):
            def _get_train_sampler(self, *args, **kwargs):
                return torch.utils.data.SequentialSampler(self.train_dataset)

            def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
                owner.load_weights(resume_from_checkpoint, model or self.model)

            def training_step(self, *args, **kwargs):
                loss = super().training_step(*args, **kwargs)
                owner.losses.append(float(loss))
                return loss

        class Progress(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                owner._after_step(state.global_step, control)

        stream = DataStream(self.dataset, cfg.seed, cfg.steps * cfg.batch_size)
        self.trainer = Trainer(model=self.model, args=args, train_dataset=stream, callbacks=[Progress()],
                               data_collator=lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]})
        self.checkpoints = CheckpointManager(cfg.output_dir, self, keep_last=cfg.keep_last)
        self.checkpoints.claim()
        self._stop_at = cfg.steps

    def check_checkpoint(self, directory: str, manifest, shown_as: str) -> None:
        check_adapter(self.model, manifest, directory, shown_as)

    def load_weights(self, directory: str, model: torch.nn.Module) -> None:
        """The checkpoint's weights into ``model``, every tensor placed. transformers' own Trainer loads
        model.safetensors with ``load_state_dict(strict=False)`` (Trainer._load_from_checkpoint), so tensors that
        save_pretrained stores under other names than the module's (a MoE model's per-expert tensors, fused in
        the module) are silently left as initialised: a Mixtral run resumed by it continues from random experts.
        Here they go through transformers' own renaming and fusion, as from_pretrained places them."""
        from converters.models.adapters import in_peft_names, tied_to_held
        from converters.models.facts import in_module_names

        options = registry.Options(trust_pickle=self.cfg.trust_pickle, verify_digests=False)  # the load checked them
        module = in_peft_names(in_module_names(registry.read(directory, options, as_format="hf")[1]))
        result = model.load_state_dict({n: t.load() for n, t in module.model.items()}, strict=False)
        expected = dict(model.state_dict(keep_vars=True))
        missing = [k for k in result.missing_keys if not tied_to_held(k, expected, module.model)]
        if missing or result.unexpected_keys:
            raise CorruptCheckpointError(directory, f"its weights do not fit the model: missing {missing[:3]}, "
                                                    f"unexpected {result.unexpected_keys[:3]}")

    # --- the adapter's view ------------------------------------------------------------------------
    def get_state_components(self) -> list[StateComponent]:
        return [
            StateComponent(hf_format.NATIVE_KEY, TrainerCheckpoint(self), SharingPattern.PER_RANK,
                           on_world_size_change=WorldSizePolicy.RESHARD),
            StateComponent("data", self.data, SharingPattern.GLOBAL),
            StateComponent("trainer", self.state, SharingPattern.GLOBAL),
        ]

    def get_checkpoint_metadata(self) -> dict[str, Any]:
        frozen = [n for n, p in self.model.named_parameters() if not p.requires_grad]
        config, architecture, adapter = described(self.model)
        return {
            "model": model_metadata(config, architecture, adapter, frozen),
            "sharding": ShardingMetadata(strategy=Strategy.SINGLE, world_size=1, precision=self.cfg.dtype).to_json(),
            "optimizer": {"class": "AdamW", "param_names": self._optimizer_names()},
        }

    def _optimizer_names(self) -> list[list[str]]:
        """The names of the parameters in each of the optimizer's groups, in its order: optimizer.pt keeps them by
        position. Taken from Trainer's optimizer itself (its groups are transformers' decay rule's, not the base
        trainer's: they differ for a model with 2-D biases or 1-D weights that are no norm, GPT-OSS's sinks);
        before it exists, Trainer's rule asked directly (both groups, an empty one too: a LoRA run's adapters)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        optimizer = self.trainer.optimizer
        if optimizer is not None:
            return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        decay = set(self.trainer.get_decay_parameter_names(self.model))
        trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
        return [[n for n in trainable if n in decay], [n for n in trainable if n not in decay]]

    # --- the loop ----------------------------------------------------------------------------------
    def _after_step(self, step: int, control) -> None:
        self.state.step = step
        self.state.tokens_seen += self.cfg.batch_size * self.cfg.seq_len
        self.state.losses.append(self.losses[-1])
        self.data.load_state_dict(position_after(step, self.cfg, self.dataset).state_dict())
        log.info("step %d loss %.6f lr %.3g", step, self.losses[-1], self.trainer.lr_scheduler.get_last_lr()[0])
        if self.cfg.save_every and step % self.cfg.save_every == 0:
            self.save(wait=False)
        if step >= self._stop_at:
            control.should_training_stop = True

    def train(self, until: int | None = None) -> list[float]:
        self._stop_at = self.cfg.steps if until is None else until
        start = len(self.losses)
        try:
            if self.state.step < self._stop_at:
                with weights_only_loads(self.cfg.trust_pickle, numpy_allowlist()):  # Trainer's torch.load of the checkpoint
                    self.trainer.train(resume_from_checkpoint=self.resume_from)
            self.checkpoints.wait()
        finally:
            self._remove_scratch()
        self.resume_from = None
        return self.losses[start:]

    def _remove_scratch(self) -> None:
        for scratch in (self.scratch, self.imported):  # Trainer's empty output_dir; a converted copy it has read
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)
        self.imported = None

    def save(self, wait: bool = True) -> str:
        """As the base trainer's (``wait=False``: the commit finishes beside the next steps)."""
        return self.checkpoints.save(self.state.step, wait=wait, stage=self.cfg.async_save and not wait)

    def resume(self, path: str | None = None) -> int:
        target = None if path in (None, "latest") else path
        origin = target
        if target is not None and not _is_ours(target):  # Trainer reads the converted copy when training starts
            target = self.imported = import_checkpoint(self, target, registry.writes_as(
                "hf-trainer", lambda ckpt, out: hf_format.write_hf_trainer(ckpt, out, overwrite=True)))
        try:
            result = self.checkpoints.load(target, verify=self.cfg.verify, shown_as=origin)
            expected = position_after(self.state.step, self.cfg, self.dataset)
            if self.data.state_dict() != expected.state_dict():
                raise LoadFailedError(
                    f"{origin}: data position {self.data.state_dict()} is not where transformers' Trainer resumes after "
                    f"{self.state.step} batches of {self.cfg.batch_size} ({expected.state_dict()}): was it saved with another --batch-size?"
                )
            if not result.step:  # weights converted from a model: Trainer starts from them with a fresh optimizer
                self._start_from_weights()
        except BaseException:
            self._remove_scratch()
            raise
        log.info("resumed from %s at step %d", origin or result.path, self.state.step)
        return self.state.step

    def _start_from_weights(self) -> None:
        from safetensors.torch import load_file

        self.model.load_state_dict(load_file(os.path.join(self.resume_from, "model.safetensors")), strict=False)
        self.model.tie_weights()
        self.resume_from = None


def _is_ours(path: str) -> bool:
    from converters.engine_checkpoint import holds_native

    return holds_native(path, hf_format.NATIVE_KEY)


def parse_config(argv: list[str] | None = None) -> HFTrainerConfig:
    return base_parse_config(argv, HFTrainerConfig, __doc__)


def main(argv: list[str] | None = None) -> None:
    configure_logging(argv)
    run(lambda: HFTrainer(parse_config(argv)))


if __name__ == "__main__":
    main()
