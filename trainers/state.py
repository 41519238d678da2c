"""Statefuls the reference trainers declare as components: optimizer, data position, trainer progress."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from importlib.resources import files
from typing import Any

import torch
from converters.dcp import tensor_leaves
from interop.errors import ConfigurationError
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

VOCAB_SIZE = 256  # byte-level tokens: no tokenizer download needed


def live_tensors(model: torch.nn.Module, optimizer: Any) -> list[torch.Tensor]:
    """What training steps change in place: the model's parameters, their gradients and its buffers, and every
    tensor of the optimizer's state (Adam's ``step`` is one, on the host even when the model is not) and of its
    parameter groups (a tensor learning rate, which schedulers fill in place)."""
    params = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return params + list(model.buffers()) + tensor_leaves([list(optimizer.state.values()), groups])


class OptimizerStateful:
    """Optimizer state keyed by parameter name (not position), so it maps onto any layout by name."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


def corpus_tokens() -> torch.Tensor:
    """The small deterministic corpus shipped with the package, as byte tokens."""
    data = files("trainers").joinpath("data/corpus.txt").read_bytes()
    return torch.tensor(list(data), dtype=torch.long)


class TokenDataset:
    """Fixed windows of ``seq_len + 1`` tokens; a seeded permutation per epoch decides the order."""

    def __init__(self, seq_len: int, tokens: torch.Tensor | None = None):
        self.tokens = corpus_tokens() if tokens is None else tokens
        self.seq_len = seq_len
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ConfigurationError(f"corpus of {len(self.tokens)} tokens is shorter than one sequence of {seq_len}")

    def sample(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]


@dataclass
class DataPosition:
    """Where the data stream is: epoch, next index into the epoch's permutation, and the shuffle seed.

    With ``num_replicas`` > 1 each replica takes every num_replicas-th sample of the permutation from
    ``offset``, so the global order is the same whatever the number of replicas.
    """

    seed: int = 0
    epoch: int = 0
    index: int = 0  # samples of this epoch already consumed, over all replicas

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed, self.epoch, self.index = int(state["seed"]), int(state["epoch"]), int(state["index"])

    def _order(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def next_batch(self, dataset: TokenDataset, batch_size: int, replica: int = 0, num_replicas: int = 1) -> torch.Tensor:
        """This replica's part of the next global batch of ``batch_size * num_replicas`` samples."""
        rows = []
        global_batch = batch_size * num_replicas
        order = self._order(dataset.num_samples)
        for j in range(global_batch):
            if self.index >= dataset.num_samples:
                self.epoch, self.index = self.epoch + 1, 0
                order = self._order(dataset.num_samples)
            if j % num_replicas == replica:
                rows.append(dataset.sample(int(order[self.index])))
            self.index += 1
        return torch.stack(rows)


@dataclass
class TrainerState:
    step: int = 0
    tokens_seen: int = 0
    losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen, self.losses = int(state["step"]), int(state["tokens_seen"]), list(state["losses"])
