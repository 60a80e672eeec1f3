"""The checkpointing users run today without actplan, installed on a model's layers so that
the estimate and the benches can set them next to actplan's plans: whole-layer
``torch.utils.checkpoint``, torchtitan's op-level selective checkpointing, re-stated from its
documented rule (save attention, the reduce-scatter and all-to-all collectives, ``max``, and
every other matmul), and torchtitan's layer-level selective checkpointing (every N-th layer
whole). Imports torch, ``config`` and ``_install.apply``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from actplan._install.apply import find_layers
from actplan.config import ConfigError, RecomputeConfig
from actplan.config._presets import OFFLOAD_VARIANTS

__all__ = [
    "ATTENTION_KERNELS",
    "BASELINES",
    "TITAN_SAVE_OPS",
    "baseline",
    "check_name",
    "checkpoint_every_layer",
    "titan_layer_sac",
    "titan_op_sac",
    "titan_policy",
    "torch_checkpoint",
]

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional


def _existing(names: Iterable[tuple[Any, str]]) -> frozenset:
    """The op overloads among ``names`` that this torch build has."""
    return frozenset(getattr(ns, name).default for ns, name in names if hasattr(ns, name))


ATTENTION_KERNELS = _existing(
    (aten, name)
    for name in (
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
)
"""Fused attention kernels, CPU's included (torchtitan lists the GPU ones; on a CPU run the
CPU kernel stands in for them, or the comparison would recompute attention on one side only)."""

TITAN_SAVE_OPS = ATTENTION_KERNELS | _existing(
    [(_c10d, "reduce_scatter_tensor"), (_c10d, "all_to_all_single"), (aten, "max")]
)
"""Non-matmul ops torchtitan's op-level policy always saves: attention kernels, the
reduce-scatter and all-to-all collectives, and ``max`` (float8 scaling)."""


def checkpoint_every_layer(model: nn.Module, **checkpoint_kwargs: Any) -> None:
    """Wrap every layer in non-reentrant ``torch.utils.checkpoint``, without actplan.

    With no keyword arguments this is what most trainers do; ``checkpoint_kwargs`` (a
    ``context_fn``, ``preserve_rng_state``) make the op-level variants.
    """
    _checkpoint_layers([layer for _, layer in find_layers(model)], **checkpoint_kwargs)


def _checkpoint_layers(layers: Iterable[nn.Module], **checkpoint_kwargs: Any) -> None:
    for layer in layers:
        forward = layer.forward

        def wrapped(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **checkpoint_kwargs, **kwargs)

        layer.forward = wrapped


def titan_policy() -> Callable[..., CheckpointPolicy]:
    """torchtitan's documented op-level rule, fresh for each layer forward: save the ops in
    ``TITAN_SAVE_OPS`` and the 1st, 3rd, 5th, ... matmul; recompute everything else."""
    # torch < 2.13 asks the policy again during recompute and expects the forward's answers:
    # as torchtitan does, the forward and the recompute count their matmuls apart.
    matmuls_seen = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func is aten.mm.default:
            matmuls_seen[ctx.is_recompute] += 1
            saved = matmuls_seen[ctx.is_recompute] % 2
            return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in TITAN_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def torch_checkpoint(model: nn.Module) -> str:
    checkpoint_every_layer(model)
    return "torch.utils.checkpoint(use_reentrant=False) per layer, no actplan"


def titan_op_sac(model: nn.Module) -> str:
    checkpoint_every_layer(
        model,
        context_fn=lambda: create_selective_checkpoint_contexts(titan_policy()),
        preserve_rng_state=False,
    )
    return "op-level SAC, torchtitan's default save list (attention, collectives, every other mm)"


def titan_layer_sac(model: nn.Module, every: int) -> str:
    """torchtitan's layer-level selective checkpointing (``selective_ac_option = "N"``): it
    counts the layers it wraps from 1 and checkpoints each whose count is a multiple of N, so
    with N = 2 the 2nd, 4th, ... layers run whole under ``torch.utils.checkpoint`` (without
    preserving the RNG state, as torchtitan wraps them) and the others keep everything."""
    layers = [layer for _, layer in find_layers(model)]
    _checkpoint_layers(layers[every - 1 :: every], preserve_rng_state=False)
    return f"every {every}th layer whole (torchtitan's layer-level selective checkpointing)"


BASELINES: dict[str, Callable[[nn.Module], str]] = {
    "torch-checkpoint": torch_checkpoint,
    "titan-op-sac": titan_op_sac,
}
"""What users run today, by the name ``actplan estimate --presets`` takes: each installs
itself on every layer and describes itself. ``titan-layer-sac:N`` (``baseline``) is the one
that takes a number."""

LAYER_SAC = "titan-layer-sac:"


def baseline(name: str) -> Callable[[nn.Module], str] | None:
    """The baseline ``name`` installs (``BASELINES``, or ``titan-layer-sac:N`` for every N-th
    layer whole), or None for a name that is not one. A layer-level name without a whole number
    of 1 or more after its colon is refused."""
    if name in BASELINES:
        return BASELINES[name]
    if not name.startswith(LAYER_SAC):
        return None
    every = name.removeprefix(LAYER_SAC)
    if not every.isdigit() or int(every) < 1:
        raise ValueError(
            f"{name!r}: titan-layer-sac takes how often a layer is checkpointed, a whole number of "
            "1 or more (titan-layer-sac:2 checkpoints every 2nd layer)"
        )
    return lambda model: titan_layer_sac(model, int(every))


def check_name(name: str) -> None:
    """Refuses a name that is neither a baseline, nor a preset, nor a config file, naming all
    three kinds (the estimate checks its presets so before any work)."""
    if baseline(name) is not None or name in OFFLOAD_VARIANTS:
        return
    try:
        RecomputeConfig.parse(name)
    except ConfigError as error:
        raise ValueError(
            f"{error}; or a preset with offload: {', '.join(OFFLOAD_VARIANTS)}; or what users run "
            f"today: {', '.join(BASELINES)}, {LAYER_SAC}N"
        ) from None
