"""Tensor and sequence parallelism for ``parallelize``: which ``torch.distributed.tensor.parallel``
style goes on which module (``tensor_parallel_plan``), and applying it (``tensor_parallelize``).

The reference models state their own plans (``tensor_parallel_plan`` methods, in
``actplan.models``); the built-in plan here covers Llama-style Hugging Face decoders, found by
their submodule names. Imports only torch: ``parallel`` composes this step with the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["tensor_parallel_plan", "tensor_parallelize"]

TPStyles = ParallelStyle | Sequence[ParallelStyle]
TPPlanArg = Literal["auto"] | Mapping[str, TPStyles] | None


def tensor_parallelize(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    tp_plan: Literal["auto"] | Mapping[str, TPStyles] = "auto",
    *,
    sequence_parallel: bool | None = None,
) -> None:
    """Step 1 of ``parallelize`` alone: split ``model`` over the 1-D ``tp_mesh`` with
    ``tp_plan`` (as ``parallelize`` takes it). Call it before ``actplan.apply`` and
    ``fully_shard``, on the unsharded model."""
    if not isinstance(tp_mesh, DeviceMesh) or tp_mesh.ndim != 1:
        raise ValueError("tensor_parallelize takes the 1-D tensor-parallel mesh, e.g. mesh['tp']")
    reject_tensor_parallel(model)
    apply_tp_plan(model, tp_mesh, resolve_tp_plan(model, tp_mesh, tp_plan, sequence_parallel))


def tensor_parallel_plan(
    model: nn.Module, tp: int, sequence_parallel: bool | None = None
) -> dict[str, tuple[ParallelStyle, ...]]:
    """The plan ``tp_plan="auto"`` applies over ``tp`` ranks: module name -> styles in order.

    A model that states its own (``model.tensor_parallel_plan(tp, sequence_parallel)``, as
    the reference models do) gets that one. A Llama-style Hugging Face decoder
    (``model.model.layers[i]`` with ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
    ``input_layernorm`` and ``post_attention_layernorm``; Llama, Mistral, Qwen2, Qwen3) gets
    Megatron's split: q/k/v and gate/up colwise, o and down rowwise, QK-norms per local head,
    the embedding split by vocabulary (all-reduced: the model builds its mask and positions
    from it), the head split by vocabulary with its logits gathered. With sequence parallelism
    (its default) the first layer takes its share of the sequence, the norms run on sequence
    shards, the rowwise projections reduce-scatter and the final norm's shards are gathered
    by the head. Raises ``ValueError`` for other models and for sizes that do not divide.
    """
    own = getattr(model, "tensor_parallel_plan", None)
    if callable(own):
        return dict(own(tp, sequence_parallel))
    return _hf_decoder_plan(model, tp, True if sequence_parallel is None else sequence_parallel)


def resolve_tp_plan(
    model: nn.Module, tp_mesh: DeviceMesh, tp_plan: Any, sequence_parallel: bool | None
) -> dict[str, tuple[ParallelStyle, ...]]:
    if tp_plan == "auto":
        return tensor_parallel_plan(model, tp_mesh.size(), sequence_parallel)
    if sequence_parallel is not None:
        raise ValueError(
            "sequence_parallel applies to tp_plan='auto' only; a plan you give states its own "
            "layouts (SequenceParallel on the norms)"
        )
    if not isinstance(tp_plan, Mapping):
        raise TypeError(
            f"tp_plan must be 'auto', a mapping of module names to ParallelStyles, or None; got "
            f"{type(tp_plan).__name__}"
        )
    resolved = {}
    for name, styles in tp_plan.items():
        styles = (styles,) if isinstance(styles, ParallelStyle) else tuple(styles)
        if not styles or not all(isinstance(style, ParallelStyle) for style in styles):
            raise TypeError(f"tp_plan[{name!r}] must be a ParallelStyle or a sequence of them")
        resolved[name] = styles
    return resolved


def apply_tp_plan(
    model: nn.Module, tp_mesh: DeviceMesh, styles: Mapping[str, Sequence[ParallelStyle]]
) -> None:
    # One style per call: parallelize_module's dict takes one per name, and a norm may need two
    # (SequenceParallel, then the gather of its output).
    for name, module_styles in styles.items():
        for style in module_styles:
            parallelize_module(model, tp_mesh, {name: style})


# -- Hugging Face decoders ---------------------------------------------------------------------
# The dense and MoE reference models state their plans themselves (models/attention.py);
# these mirror them for Llama-style Hugging Face decoders, found by their submodule names.

_HF_LAYER_MODULES = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _gathered_norm(sequence_parallel: bool) -> tuple[ParallelStyle, ...]:
    # The norm's output goes to the colwise projections as one replicated DTensor, gathered
    # from the sequence shards under sequence parallelism: backward then reduces once.
    layout = Shard(1) if sequence_parallel else Replicate()
    gather = PrepareModuleOutput(
        output_layouts=layout, desired_output_layouts=Replicate(), use_local_output=False
    )
    return (SequenceParallel(), gather) if sequence_parallel else (gather,)


def _hf_decoder_plan(
    model: nn.Module, tp: int, sequence_parallel: bool
) -> dict[str, tuple[ParallelStyle, ...]]:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    root = ("model.embed_tokens", "model.norm", "lm_head")
    known = (
        isinstance(layers, nn.ModuleList)
        and len(layers) > 0
        and all(_has(model, name) for name in root)
        and all(_has(layer, name) for layer in layers for name in _HF_LAYER_MODULES)
    )
    if not known:
        raise ValueError(
            f"no built-in tensor-parallel plan for {type(model).__name__}: tp_plan='auto' knows the "
            "actplan reference models and Llama-style Hugging Face decoders (model.layers[i] with "
            "self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj and the two layer norms); pass "
            "tp_plan={module name: ParallelStyle, ...}, or apply the styles yourself and pass tp_plan=None"
        )
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError(
            "the built-in tensor-parallel plan splits the embedding and the head differently, and this "
            "model ties them (tie_word_embeddings); pass your own tp_plan"
        )
    sizes = {
        name: getattr(config, name)
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
        if isinstance(getattr(config, name, None), int)
    }
    uneven = [f"{name} ({size})" for name, size in sizes.items() if size % tp]
    if uneven:
        raise ValueError(
            f"cannot split {type(model).__name__} over {tp} tensor-parallel ranks: {', '.join(uneven)} "
            f"must divide by {tp}"
        )
    seq = Shard(1) if sequence_parallel else Replicate()
    # The embedding's output stays whole: the model builds its causal mask and positions from it.
    plan: dict[str, tuple[ParallelStyle, ...]] = {
        "model.embed_tokens": (RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),),
    }
    if sequence_parallel:
        # The first layer takes this rank's share of the sequence (a slice, no communication).
        plan["model.layers.0"] = (
            PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(seq,), use_local_output=True
            ),
        )
    for index, layer in enumerate(layers):
        prefix = f"model.layers.{index}."
        plan[f"{prefix}input_layernorm"] = _gathered_norm(sequence_parallel)
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{prefix}self_attn.{name}"] = (ColwiseParallel(),)
        for name in ("q_norm", "k_norm"):  # Qwen3's per-head norms: a rank holds n_heads / tp heads
            if _has(layer, f"self_attn.{name}"):
                plan[f"{prefix}self_attn.{name}"] = (SequenceParallel(sequence_dim=2, use_local_output=True),)
        plan[f"{prefix}self_attn.o_proj"] = (RowwiseParallel(output_layouts=seq),)
        plan[f"{prefix}post_attention_layernorm"] = _gathered_norm(sequence_parallel)
        plan[f"{prefix}mlp.gate_proj"] = (ColwiseParallel(),)
        plan[f"{prefix}mlp.up_proj"] = (ColwiseParallel(),)
        plan[f"{prefix}mlp.down_proj"] = (RowwiseParallel(output_layouts=seq),)
    if sequence_parallel:
        plan["model.norm"] = (SequenceParallel(use_local_output=True),)
    plan["lm_head"] = (ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),)
    return plan


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def reject_tensor_parallel(model: nn.Module) -> None:
    split = [name for name, param in model.named_parameters() if isinstance(param, DTensor)]
    if split:
        raise ValueError(
            f"the model is already tensor-parallel ({split[0]} is a DTensor); pass tp_plan=None to "
            "keep your own split, or pass the plain model and let parallelize split it"
        )
