"""Model factories for the tests, importable as ``model_factories:<name>`` (the
``--model package.module:factory`` form): tiny reference models with batches long enough
that activations, not weights and optimizer state, set the peak; and a model whose replay
is wrong, for ``actplan verify`` to catch."""

import random

import torch
from torch import nn

from actplan import MarkerInterval, RecomputeIntervalMap, checkpoint_record
from actplan.models import build_model


def dense_long():
    bundle = build_model("dense", "tiny", batch_size=16, seq_len=64)
    return bundle.model, bundle.make_batch


def moe_long():
    return build_model("moe", "tiny", batch_size=16, seq_len=64)


def not_a_pair():
    return 42


class NoisyBlock(nn.Module):
    """Scales its input by a draw from Python's ``random``, which checkpointing does not
    restore: a replay draws a different number, so what the linear saves changes."""

    recompute_intervals = RecomputeIntervalMap({"mlp_up": MarkerInterval("up", "up_end")})

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, dim)
        self.draws = random.Random(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        checkpoint_record("up")
        h = self.up(x * (1.0 + self.draws.random()))
        checkpoint_record("up_end")
        return x + torch.tanh(h)


class NoisyModel(nn.Module):
    def __init__(self, dim: int = 16, n_layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(NoisyBlock(dim) for _ in range(n_layers))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.mse_loss(x, target)


def noisy():
    torch.manual_seed(0)
    model = NoisyModel()

    def make_batch(seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(4, 16, generator=gen), "target": torch.randn(4, 16, generator=gen)}

    return model, make_batch


def with_flags():
    """A batch that carries non-tensor keyword arguments beside its tensors, as Hugging Face
    batches do (``return_dict``, ``use_cache``)."""
    torch.manual_seed(0)
    model = NoisyModel()
    model.layers = nn.ModuleList(FlagBlock(16) for _ in range(3))

    def make_batch(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        x, target = torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen)
        return {"x": x, "target": target, "scale": 0.5}

    return FlaggedModel(model), make_batch


class FlagBlock(nn.Module):
    recompute_intervals = RecomputeIntervalMap({"mlp_up": MarkerInterval("up", "up_end")})

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        checkpoint_record("up")
        h = self.up(x)
        checkpoint_record("up_end")
        return x + torch.tanh(h)


class FlaggedModel(nn.Module):
    def __init__(self, inner: NoisyModel) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, target: torch.Tensor, scale: float) -> torch.Tensor:
        return self.inner(x * scale, target)


def broken():
    raise KeyError("no such checkpoint")
