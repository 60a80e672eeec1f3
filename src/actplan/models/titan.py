"""torchtitan's own decoders, for ``actplan estimate --titan MODEL:FLAVOR``: the code a torchtitan
user trains (its RMSNorm, its complex-valued fp32 RoPE, its fused QKV projection, its fp32 loss),
built from torchtitan's registry (``torchtitan.models.<model>.<model>_configs[flavor]``) at the
flavour's numbers, with the estimate's sequence, batch and depth.

FlexAttention, torchtitan's attention for language models, needs a GPU compiler; its
``ScaledDotProductAttention`` stands in (the same causal attention, flash kernel, no mask held).
The decoder is wrapped so that ``model(**batch)`` is torchtitan's ``cross_entropy_loss`` (logits
upcast to fp32, summed) over the batch's tokens, as its trainer scales it. Dense flavours only:
a flavour with MoE layers is refused. torchtitan is imported when a model is built.

Imports torch, ``_torch_internals`` and ``models.shape``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from actplan._torch_internals import FakeTensor
from actplan.models.shape import Shape

__all__ = ["TitanLoss", "shape_from_titan", "titan_config", "titan_model"]

_OVERRIDABLE = ("layers", "seq", "batch", "dtype")


def titan_config(spec: str) -> Any:
    """torchtitan's model config for ``MODEL:FLAVOR`` (``llama3:8B``, ``qwen3:0.6B``)."""
    model, _, flavour = spec.partition(":")
    if not model or not flavour:
        raise ValueError(f"--titan {spec!r}: give MODEL:FLAVOR, for example llama3:8B")
    try:
        importlib.import_module("torchtitan")
    except ImportError:
        raise ValueError(
            "--titan builds torchtitan's own model: install torchtitan (pip install torchtitan)"
        ) from None
    try:
        module = importlib.import_module(f"torchtitan.models.{model}")
    except ImportError:
        raise ValueError(
            f"--titan {spec!r}: torchtitan has no model {model!r} (torchtitan.models.{model})"
        ) from None
    configs = getattr(module, f"{model}_configs", None)
    if not isinstance(configs, dict):
        raise ValueError(
            f"--titan {spec!r}: torchtitan.models.{model} has no {model}_configs registry of flavours"
        )
    if flavour not in configs:
        raise ValueError(
            f"--titan {spec!r}: no flavour {flavour!r}; {model}'s flavours: {', '.join(configs)}"
        )
    return configs[flavour](attn_backend="flex")


def shape_from_titan(spec: str, **overrides: Any) -> Shape:
    """The shape of torchtitan's ``MODEL:FLAVOR`` (its numbers read from its config), with the
    estimate's ``seq``, ``batch``, ``dtype`` and ``layers`` from ``overrides``; other numbers are
    the flavour's, and giving one is refused."""
    given = {name: value for name, value in overrides.items() if value is not None}
    fixed = sorted(set(given) - set(_OVERRIDABLE))
    if fixed:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in fixed)
        raise ValueError(
            f"--titan {spec} builds the flavour's own numbers; {flags} would change torchtitan's model. "
            f"Drop them (only --{', --'.join(_OVERRIDABLE)} apply), or use --model with every number"
        )
    config = titan_config(spec)
    if any(getattr(layer, "moe", None) is not None for layer in config.layers):
        raise ValueError(
            f"--titan {spec} has MoE layers, which the estimate does not build from torchtitan yet; "
            "use --shape or --hf-config for a MoE model"
        )
    attention = config.layers[0].attention
    heads = attention.n_heads
    head_dim = attention.head_dim or getattr(attention.qkv_linear, "head_dim", None)
    found = {
        "layers": len(config.layers),
        "hidden": config.dim,
        "heads": heads,
        "kv_heads": attention.n_kv_heads or heads,
        "ffn": config.layers[0].feed_forward.w1.out_features,
        "vocab": config.vocab_size,
    }
    if head_dim and head_dim * heads != config.dim:
        found["head_dim"] = head_dim
    shape = Shape(name=spec, titan=spec, **found)
    shape = dataclasses.replace(shape, **given)
    shape.check()
    return shape


class TitanLoss(nn.Module):
    """torchtitan's decoder returning its training loss: ``cross_entropy_loss`` (fp32 logits,
    summed) divided by the tokens, as torchtitan's trainer rescales it. ``spmd_backend`` is the
    torchtitan SPMD backend its code reads while the forward runs (its trainer sets it for the
    whole process; here it is set for the forward alone and restored after, so other models in
    the process keep theirs)."""

    def __init__(
        self, decoder: nn.Module, loss: Callable[..., torch.Tensor], spmd_backend: str | None = None
    ) -> None:
        super().__init__()
        self.decoder = decoder
        self.loss = loss
        self.spmd_backend = spmd_backend

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.spmd_backend is None:
            return self.loss(self.decoder(tokens), labels) / labels.numel()
        from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend

        before = get_spmd_backend()
        set_spmd_backend(self.spmd_backend)
        try:
            return self.loss(self.decoder(tokens), labels) / labels.numel()
        finally:
            set_spmd_backend(before)


def titan_model(
    shape: Shape, tp_mesh: DeviceMesh | None = None
) -> tuple[nn.Module, Callable[[int], dict[str, torch.Tensor]], str]:
    """torchtitan's model for ``shape.titan`` at ``shape.layers`` (the flavour's first layers, or
    its last one repeated), SDPA standing in for FlexAttention; with ``make_batch(seed)`` of
    ``shape.batch`` x ``shape.seq`` tokens and a description.

    With ``tp_mesh`` (a 1-D mesh) the model is split over it by torchtitan's own tensor
    parallelism, as its trainer applies it before FSDP: the flavour's sharding declarations
    (``torchtitan.models.<model>.sharding``, sequence parallel on, torchtitan's default) applied
    by ``Module.parallelize`` on torchtitan's DTensor path, the head's logits sharded by
    vocabulary for a loss-parallel cross-entropy. Build it on the meta device: parallelizing
    inside a fake mode fails."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = titan_config(shape.titan)
    layers = config.layers
    config.layers = [layers[min(index, len(layers) - 1)] for index in range(shape.layers)]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if tp_mesh is not None:  # declared after the swap: the attention's own local map with it
        _declare_sharding(shape.titan, config)
    decoder = config.build()
    if tp_mesh is not None:
        decoder.parallelize(_tensor_parallel_dims(tp_mesh))
    weight = next(decoder.parameters())
    if weight.device.type != "meta" and not isinstance(weight, FakeTensor):
        decoder.init_states()  # values (RoPE's table among them); meta and fake tensors have none
    model = TitanLoss(decoder.train(), cross_entropy_loss, None if tp_mesh is None else _BACKEND)

    def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=generator)
        return {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}

    return model, make_batch, f"torchtitan {shape.titan} ({shape.layers} layers, SDPA for FlexAttention)"


_BACKEND = "partial_dtensor"
"""torchtitan's DTensor path for tensor parallelism, FSDP applied apart (as ``parallelize`` does)."""


def _declare_sharding(spec: str, config: Any) -> None:
    """The flavour's own tensor-parallel declarations on ``config``, sequence parallel on."""
    model = spec.partition(":")[0]
    try:
        module = importlib.import_module(f"torchtitan.models.{model}.sharding")
    except ImportError:
        module = None
    declare = getattr(module, f"set_{model}_sharding_config", None)
    if declare is None:
        raise ValueError(
            f"--titan {spec} under tensor parallelism: this torchtitan declares no sharding for "
            f"{model} (torchtitan.models.{model}.sharding.set_{model}_sharding_config, torchtitan "
            "0.3 and later); drop --tp, or estimate the shape with --shape or --hf-config"
        )
    options = inspect.signature(declare).parameters
    declare(config, enable_sp=True, **({"enable_ep": False} if "enable_ep" in options else {}))


def _tensor_parallel_dims(tp_mesh: DeviceMesh) -> Any:
    """torchtitan's ``ParallelDims`` for its DTensor path (``partial_dtensor``: FSDP applied
    apart, as ``actplan.parallelize`` applies it) with its tensor-parallel axis on ``tp_mesh``:
    a dimension of the mesh FSDP shards over, as FSDP2 requires of a DTensor parameter's mesh.
    Its own meshes would be a second device mesh over the same ranks, on the accelerator."""
    from torchtitan.distributed import ParallelDims

    class OnTheEstimatesMesh(ParallelDims):
        def resolve_mesh(self, axes: Any) -> DeviceMesh | None:
            names = {getattr(axis, "value", axis) for axis in axes}
            return tp_mesh if "tp" in names else None  # DP and CP stay out of band on this path

        def get_optional_mesh(self, dims: Any, **_: Any) -> DeviceMesh | None:
            if dims in ("tp", ["tp"]):
                return tp_mesh
            raise ValueError(
                f"torchtitan's model asked for the {dims} mesh, which the estimate does not lay "
                "out for --titan (a tensor-parallel mesh only); drop --tp"
            )

    tp = tp_mesh.size()
    world = torch.distributed.get_world_size()
    return OnTheEstimatesMesh(
        dp_replicate=1, dp_shard=world // tp, cp=1, tp=tp, pp=1, ep=1, world_size=world,
        spmd_backend=_BACKEND,
    )  # fmt: skip
