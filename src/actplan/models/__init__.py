"""Reference models and the name -> model registry the CLI and bench use.

Each entry builds a model, a batch maker and, where the model can state it, the
analytic activation floor. Models import only ``actplan.markers`` and
``actplan.units``; nothing in the engine imports this package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from actplan.models import dense, moe, mtp, sparse


@dataclass
class ModelBundle:
    """A model ready to train: ``model(**make_batch(seed))["loss"]`` is a scalar loss."""

    name: str
    size: str
    model: nn.Module
    make_batch: Callable[[int], dict[str, torch.Tensor]]
    description: str

    def activation_floor_bytes(self, batch: dict[str, torch.Tensor]) -> int | None:
        floor = getattr(self.model, "activation_floor_bytes", None)
        return floor(batch) if callable(floor) else None


def _build_dense(size: str, **overrides) -> ModelBundle:
    model, config = dense.build(size, **overrides)
    return ModelBundle(
        name="dense",
        size=size,
        model=model,
        make_batch=lambda seed=0: dense.make_batch(config, seed),
        description=(
            f"dense {size}: {config.n_layers} layers, dim {config.dim}, {config.n_heads} heads "
            f"({config.n_kv_heads} kv), ffn {config.ffn_dim}, vocab {config.vocab_size}, "
            f"batch {config.batch_size}x{config.seq_len}"
        ),
    )


def _build_moe(size: str, **overrides) -> ModelBundle:
    model, config = moe.build(size, **overrides)
    return ModelBundle(
        name="moe",
        size=size,
        model=model,
        make_batch=lambda seed=0: moe.make_batch(config, seed),
        description=(
            f"moe {size}: {config.n_layers} layers ({config.first_k_dense} dense), dim {config.dim}, "
            f"{config.n_experts} experts top-{config.top_k} (ffn {config.expert_ffn_dim}), shared expert "
            f"{config.shared_expert_ffn_dim}, {config.router} router, "
            f"batch {config.batch_size}x{config.seq_len}"
        ),
    )


def _build_mtp(size: str, **overrides) -> ModelBundle:
    model, config = mtp.build(size, **overrides)
    return ModelBundle(
        name="mtp",
        size=size,
        model=model,
        make_batch=lambda seed=0: mtp.make_batch(config, seed),
        description=(
            f"mtp {size}: {config.n_layers} layers + {config.mtp_depths} prediction depths, "
            f"dim {config.dim}, vocab {config.vocab_size}, batch {config.batch_size}x{config.seq_len}"
        ),
    )


def _build_sparse(size: str, **overrides) -> ModelBundle:
    model, config = sparse.build(size, **overrides)
    return ModelBundle(
        name="sparse",
        size=size,
        model=model,
        make_batch=lambda seed=0: sparse.make_batch(config, seed),
        description=(
            f"sparse {size}: {config.n_layers} layers, indexer every {config.index_every} "
            f"(top-{config.index_topk} keys), dim {config.dim}, batch {config.batch_size}x{config.seq_len}"
        ),
    )


MODELS: dict[str, tuple[Callable[..., ModelBundle], tuple[str, ...]]] = {
    "dense": (_build_dense, tuple(dense.PRESETS)),
    "moe": (_build_moe, tuple(moe.PRESETS)),
    "mtp": (_build_mtp, tuple(mtp.PRESETS)),
    "sparse": (_build_sparse, tuple(sparse.PRESETS)),
}


def build_model(name: str = "dense", size: str = "small", **overrides) -> ModelBundle:
    """Build a reference model by name and size (``tiny`` for tests, ``small`` for the bench)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; built-in models: {', '.join(MODELS)}")
    factory, sizes = MODELS[name]
    if size not in sizes:
        raise ValueError(f"model {name!r} has no size {size!r}; sizes: {', '.join(sizes)}")
    return factory(size, **overrides)
