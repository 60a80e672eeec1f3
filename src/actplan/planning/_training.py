"""The training setup an estimate steps: which optimizer (any ``torch.optim`` class or one named
by import path, AdamW by default) in which implementation, how many micro-batches accumulate
into one optimizer step, and which parameters are frozen. Each changes what a rank holds: an
optimizer's state is what its step allocates, a frozen parameter has no gradient and no state,
and accumulation keeps the sharded gradients alive across micro-batches. Imports torch and
``_torch_internals``.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from actplan._torch_internals import local_shard

__all__ = ["DEFAULT_TRAINING", "OPTIMIZER_IMPLS", "TrainingSetup"]

OPTIMIZER_IMPLS = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}
"""Optimizer implementations, by torchtitan's names for them, as ``torch.optim`` flags."""

LEARNING_RATE = 1e-4  # any value: it changes no allocation


ELEMENTWISE = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
"""Optimizers whose step is elementwise over each parameter (no reduction across a tensor)."""


class _OnLocalShards:
    """An elementwise optimizer stepping the local shards of DTensor parameters: each step
    hands it the gradients' local shards, and takes them back after."""

    def __init__(
        self, cls: type[torch.optim.Optimizer], parameters: list[torch.Tensor], options: dict
    ) -> None:
        self.parameters = parameters
        self.shards = [local_shard(p) for p in parameters]
        self.inner = cls(self.shards, **options)
        self.param_groups = self.inner.param_groups  # what the memory meter reads
        self.state = self.inner.state

    def step(self) -> None:
        for parameter, shard in zip(self.parameters, self.shards, strict=True):
            if local_shard(parameter) is not shard:
                raise RuntimeError(
                    "a parameter's local shard was replaced after the optimizer was made (FSDP2's "
                    "lazy init); make the optimizer after the first forward"
                )
            shard.grad = None if parameter.grad is None else local_shard(parameter.grad)
        self.inner.step()
        for shard in self.shards:
            shard.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:
            raise ValueError("the estimate's steps drop their gradients: zero_grad(set_to_none=True)")
        for parameter in self.parameters:
            parameter.grad = None


def _torch_optimizers() -> list[str]:
    base = torch.optim.Optimizer
    classes = {name: value for name, value in vars(torch.optim).items() if isinstance(value, type)}
    return sorted(name for name, value in classes.items() if issubclass(value, base) and value is not base)


@dataclass(frozen=True)
class TrainingSetup:
    """What the estimated run trains with besides the model and the layout.

    ``optimizer``: a ``torch.optim`` class name (``AdamW``, ``SGD``, ``Adafactor``...) or an
    import path (``package.module.Class``). ``optimizer_impl``: ``foreach`` (torch's default
    on a GPU, temporaries the size of the parameter shards at the step), ``fused`` or
    ``for-loop``, for optimizers that take those flags. ``grad_accum``: micro-batches per
    optimizer step, each of the shape's batch. ``freeze``: a regular expression; parameters
    whose names it finds are frozen (no gradient, no optimizer state), as a LoRA base is.
    """

    optimizer: str = "AdamW"
    optimizer_impl: str = "foreach"
    grad_accum: int = 1
    freeze: str | None = None

    def check(self) -> None:
        """Refuses a setup that cannot run, naming the field and the fix (before any work)."""
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(
                f"unknown optimizer implementation {self.optimizer_impl!r}; choose one of "
                f"{', '.join(OPTIMIZER_IMPLS)}"
            )
        if self.grad_accum < 1:
            raise ValueError(f"--grad-accum must be 1 or more micro-batches, got {self.grad_accum}")
        if self.freeze is not None:
            try:
                re.compile(self.freeze)
            except re.error as error:
                raise ValueError(f"--freeze {self.freeze!r} is not a regular expression: {error}") from None
        self.optimizer_class()

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        name = self.optimizer
        if "." not in name:
            found = getattr(torch.optim, name, None)
            where = f"torch.optim has no {name!r}"
        else:
            module_name, _, attribute = name.rpartition(".")
            try:
                module = importlib.import_module(module_name)
            except ImportError as error:
                raise ValueError(f"--optimizer {name!r}: cannot import {module_name!r} ({error})") from None
            found = getattr(module, attribute, None)
            where = f"{module_name!r} has no {attribute!r}"
        if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
            problem = where if found is None else f"{name!r} is not a torch.optim.Optimizer"
            raise ValueError(
                f"--optimizer: {problem}; name a torch.optim class ({', '.join(_torch_optimizers())}) "
                "or one by import path (package.module.Class)"
            )
        flags = inspect.signature(found).parameters
        if self.optimizer_impl != "foreach" and not set(OPTIMIZER_IMPLS[self.optimizer_impl]) <= set(flags):
            raise ValueError(
                f"--optimizer-impl {self.optimizer_impl}: {name} takes no such flag; leave the "
                "implementation at its default for this optimizer"
            )
        return found

    def make_optimizer(self, parameters: Iterable[torch.nn.Parameter]) -> Any:
        """The optimizer over ``parameters`` that need gradients (frozen ones are left out, as a
        trainer hands only those it trains), in the named implementation where it takes one.

        An optimizer of ``ELEMENTWISE`` over sharded (DTensor) parameters steps each rank's local
        shards: every op it runs is elementwise, so the local ops and their bytes are the ones
        DTensor would run, without DTensor's sharding propagation (about a third of an
        estimated step's time). Any other optimizer steps the DTensors, as a user's would."""
        cls = self.optimizer_class()
        flags = inspect.signature(cls).parameters
        options = {k: v for k, v in OPTIMIZER_IMPLS[self.optimizer_impl].items() if k in flags}
        if "lr" in flags:
            options["lr"] = LEARNING_RATE
        trained = [p for p in parameters if p.requires_grad]
        if cls in ELEMENTWISE and any(local_shard(p) is not p for p in trained):
            return _OnLocalShards(cls, trained, options)
        return cls(trained, **options)

    def apply_freeze(self, model: torch.nn.Module) -> int:
        """Freezes the parameters ``freeze`` finds; returns how many. A pattern that finds none,
        or every one, is refused: it would estimate a run that is not the user's."""
        if self.freeze is None:
            return 0
        pattern = re.compile(self.freeze)
        named = list(model.named_parameters())
        frozen = [p for n, p in named if pattern.search(n)]
        if not frozen:
            sample = ", ".join(n for n, _ in named[:4])
            raise ValueError(f"--freeze {self.freeze!r} finds no parameter; names look like: {sample}")
        if len(frozen) == len(named):
            raise ValueError(f"--freeze {self.freeze!r} finds every parameter; nothing would train")
        for parameter in frozen:
            parameter.requires_grad_(False)
        return len(frozen)

    def describe(self) -> str:
        parts = [f"{self.optimizer} ({self.optimizer_impl})"]
        if self.grad_accum > 1:
            parts.append(f"{self.grad_accum} micro-batches per step")
        if self.freeze is not None:
            parts.append(f"parameters matching {self.freeze!r} frozen")
        return ", ".join(parts)


DEFAULT_TRAINING = TrainingSetup()
"""AdamW (foreach), one micro-batch per step, nothing frozen."""
