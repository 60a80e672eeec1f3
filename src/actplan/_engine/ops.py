"""What the selective engine needs to know about an aten op, worked out once per op.

A leaf module (torch only): both the traced policy (``region``) and the eager
scoped engine (``scoped``) classify ops with it, so neither imports the other.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from actplan._torch_internals import op_name, op_schema

_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})


def _routing_ops() -> frozenset:
    aten = torch.ops.aten
    names = [
        ("topk", "default"),
        ("sort", "default"),
        ("sort", "stable"),
        ("argsort", "default"),
        ("argsort", "stable"),
        ("nonzero", "default"),
        ("bincount", "default"),
        ("histc", "default"),
        ("_local_scalar_dense", "default"),
        ("unique_consecutive", "default"),
        ("_unique2", "default"),
    ]
    ops = set()
    for packet, overload in names:
        op = getattr(getattr(aten, packet, None), overload, None)
        if op is not None:
            ops.add(op)
    return frozenset(ops)


ROUTING_OPS = _routing_ops()
"""Ops whose outputs are routing decisions (top-k, sorts, counts, ``.item()``)."""
EXPENSIVE_ATEN_OPS = frozenset(
    {
        # GEMMs
        "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "mv", "dot", "vdot", "addr",
        "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm", "_int_mm", "_weight_int8pack_mm",
        "_weight_int4pack_mm", "_addmm_activation",
        # convolutions
        "convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution",
        "convolution_overrideable", "miopen_convolution",
        # attention kernels
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
        "_efficient_attention_forward", "_cudnn_attention_forward",
    }
)  # fmt: skip
"""aten ops a kept unit never reruns; its other aten ops (elementwise, norms, reductions,
reshapes) may rerun in the replay when that holds less than keeping their outputs."""
UNINITIALIZED_OPS = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
_TO_COPY = torch.ops.aten._to_copy.default


class OpTraits(NamedTuple):
    """What the policy needs to know about an op, worked out once per op."""

    is_view: bool
    seeded: bool  # may draw random numbers
    dropout_position: int | None  # where its dropout_p argument sits, if it has one
    always_saved: bool  # collective or routing op
    collective: bool  # moves data between ranks (its floating outputs are held only while read)
    is_to_copy: bool  # may be a device-to-host copy
    mutated: tuple[tuple[int, str], ...]  # (position, name) of arguments written in place
    uninitialized: bool  # returns uninitialised memory (empty, empty_like, ...)
    expensive: bool  # a GEMM, convolution, attention kernel or custom kernel: never rerun when kept
    # Aliases its input without sharing its version counter (``_unsafe_view``, which reshapes
    # a 3D linear's 2D ``mm`` output back): a write through the alias does not show on the input.
    unsafe_alias: bool
    # None of the above that changes what the engine does with it (not a view, routing,
    # collective, host copy, in-place, uninitialised or seeded op): the engine's fast path.
    plain: bool = False


# Keyed by id(): ops are process-lived singletons, and OpOverload.__hash__ runs in
# Python, which a per-op policy cannot afford several times per op.
_TRAITS: dict[int, OpTraits] = {}


def op_traits(func) -> OpTraits:
    traits = _TRAITS.get(id(func))
    if traits is not None:
        return traits
    schema = op_schema(func)
    arguments = schema.arguments if schema is not None else ()
    seeded = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
    traits = _with_plain(OpTraits(
        # _unsafe_view aliases its input but its schema does not say so.
        is_view=bool(getattr(func, "is_view", False)) or func is torch.ops.aten._unsafe_view.default,
        seeded=seeded,
        dropout_position=next((i for i, a in enumerate(arguments) if a.name == "dropout_p"), None),
        always_saved=func in ROUTING_OPS or getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES,
        collective=getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES,
        is_to_copy=func is _TO_COPY,
        mutated=tuple(
            (position, argument.name)
            for position, argument in enumerate(arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        ),
        uninitialized=op_name(func) in UNINITIALIZED_OPS,
        expensive=_is_expensive(func),
        unsafe_alias=func is torch.ops.aten._unsafe_view.default,
    ))
    _TRAITS[id(func)] = traits
    return traits


def _with_plain(traits: OpTraits) -> OpTraits:
    plain = not (
        traits.is_view
        or traits.seeded
        or traits.always_saved
        or traits.collective
        or traits.is_to_copy
        or traits.mutated
        or traits.uninitialized
        or traits.unsafe_alias
    )
    return traits._replace(plain=plain)


def _is_expensive(func) -> bool:
    namespace = getattr(func, "namespace", None)
    if namespace not in ("aten", "prims", "prim"):
        return True  # custom kernels (flash-attn, triton ops, ...): assume costly
    return op_name(func) in EXPENSIVE_ATEN_OPS


def draws_random(traits: OpTraits, args, kwargs) -> bool:
    if not traits.seeded or traits.dropout_position is None:
        return traits.seeded
    # Attention kernels are tagged random but draw only when dropout_p > 0.
    if "dropout_p" in kwargs:
        return kwargs["dropout_p"] != 0
    position = traits.dropout_position
    return position < len(args) and args[position] != 0


def is_device_to_host(args, kwargs) -> bool:
    device = kwargs.get("device")
    if device is None or torch.device(device).type != "cpu":
        return False
    source = args[0] if args else None
    return isinstance(source, torch.Tensor) and source.device.type != "cpu"


def always_replayed(traits: OpTraits, args, kwargs) -> bool:
    """Views, in-place and ``out=`` ops, uninitialised allocations and random draws: never
    held or served. A view is free and a held one would pin its base; a served in-place
    result would alias a tensor later ops change; a skipped random op would leave the generator
    behind in the replay, shifting every later draw."""
    return (
        traits.is_view
        or bool(traits.mutated)
        or traits.uninitialized
        or (traits.seeded and draws_random(traits, args, kwargs))
    )


def always_saved(traits: OpTraits, args, kwargs) -> bool:
    """Routing decisions, collectives and device-to-host copies: saved under every plan."""
    return traits.always_saved or (traits.is_to_copy and is_device_to_host(args, kwargs))


class Keep(enum.Enum):
    """What the engine does with one op of a checkpointed layer (``keep_decision``)."""

    RERUN = "rerun"  # the replay runs it again
    HOLD = "hold"  # its outputs are held while something reads them (never rerun)
    HOLD_ROUTING = "hold-routing"  # its outputs are held whatever reads them (routing, host copies)


def keep_decision(
    traits: OpTraits,
    args: Any,
    kwargs: Any,
    in_kept: bool,
    save_collectives: bool,
    reads_held: Callable[[Any, Any], bool],
) -> Keep:
    """The keep rule, for both engines (docs/concepts.md, "The policy", states it as a table).

    ``in_kept``: a kept interval is open. ``reads_held(args, kwargs)``: whether the op reads an
    output this call holds; asked only when the answer decides (a cheap op in a kept interval).
    Views, in-place, uninitialised and random ops rerun. A kept interval's expensive ops hold,
    and so do its cheap ops that read a held output; its other cheap ops rerun (holding their
    output would cost memory to save a little elementwise work). Routing, collective and
    device-to-host ops hold anywhere while ``save_collectives`` is on; a collective's
    floating-point outputs only while read, the others' whatever reads them."""
    if traits.plain:
        if in_kept and (traits.expensive or reads_held(args, kwargs)):
            return Keep.HOLD
        return Keep.RERUN
    if always_replayed(traits, args, kwargs):
        return Keep.RERUN
    routing = save_collectives and always_saved(traits, args, kwargs)
    if routing:
        return Keep.HOLD if traits.collective else Keep.HOLD_ROUTING
    if in_kept and (traits.expensive or reads_held(args, kwargs)):
        return Keep.HOLD
    return Keep.RERUN


def _ignored_ops() -> frozenset:
    # Ops checkpoint itself issues a different number of times in forward and replay.
    try:
        from torch.utils.checkpoint import SAC_IGNORED_OPS
    except ImportError:  # older torch
        return frozenset({torch.ops.aten.detach.default})
    return frozenset(SAC_IGNORED_OPS)


IGNORED_OPS = _ignored_ops()
"""Ops neither held nor counted: ``torch.utils.checkpoint`` adds them itself."""
IGNORED_OP_IDS = frozenset(id(op) for op in IGNORED_OPS)
"""The same, by ``id()``: the per-op check cannot afford ``OpOverload.__hash__`` (Python)."""
