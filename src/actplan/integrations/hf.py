"""Hugging Face ``transformers`` decoder layers, as they are: units declared by module path.

A unit is a list of spans; a span is a submodule path (its entry and exit are the span's
markers) or a pair of points ``("path:exit", "other.path:enter")`` (what runs between
them, such as RoPE and the attention kernel, which are function calls rather than
modules). A layer's *layout* (unit -> spans) comes, in this order, from ``layouts=`` given
by the user (by decoder-layer class name), from the built-in ``LAYOUTS``, or is derived
from the names and nesting of the layer's submodules (``hf_derive``). Decoder layers are
the modules transformers' own gradient checkpointing wraps (``GradientCheckpointingLayer``)
or, for models that predate it, the blocks of the model's ``ModuleList`` of layers.

``declare(model)`` puts forward pre/post hooks on the named submodules that emit
``checkpoint_record`` markers (module hooks are traced by ``torch.compile``, so the markers
survive compilation) and gives each layer its ``recompute_intervals``; ``actplan.apply``
then treats the layers like any other. ``undeclare`` removes every hook and attribute again.
The source's ``call_check`` gives the checkpoint wrapper of each layer a check run before
every checkpointed call: Hugging Face's own checkpointing switched on since, or a KV cache,
is a ``ConfigError`` naming the setting to change (``_hf_hooks.CallCheck``).

``actplan.apply(hf_model, config, layouts=...)`` calls ``declare`` by itself. Imports:
``markers``, ``units``, ``hf_derive`` and ``config`` (for its error type); ``transformers``
is never imported here, except by ``reference_model``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from actplan._callsite import warn
from actplan.config import ConfigError
from actplan.integrations._hf_hooks import CallCheck, check_hf_checkpointing_off, install_hooks
from actplan.integrations._layout_error import format_interval, found_layout_rows, unclear_layout_error
from actplan.integrations.hf_derive import (
    ATTENTION_INPUTS,
    Span,
    derive_layout,
    submodule_names,
)
from actplan.units import MarkerInterval, RecomputeIntervalMap, RecomputeUnit, parse_unit

Layout = Mapping[RecomputeUnit | str, Sequence[Span]]
Layouts = Mapping[str, Layout | None]
"""Layouts by decoder-layer class name; ``None`` says "not a layer to checkpoint"."""

_ATTENTION = {
    RecomputeUnit.ATTN_NORM: ["input_layernorm"],
    RecomputeUnit.QKV_PROJ: ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    RecomputeUnit.QK_NORM: ["self_attn.q_norm", "self_attn.k_norm"],
    # RoPE, the attention kernel and the reshapes around them: no module of their own.
    RecomputeUnit.ATTN_CORE: [("self_attn.v_proj:exit", "self_attn.o_proj:enter")],
    RecomputeUnit.ATTN_PROJ: ["self_attn.o_proj"],
    RecomputeUnit.MLP_NORM: ["post_attention_layernorm"],
}
# The current transformers MoE layout: a top-k router module and fused experts.
_MOE_MLP = {
    RecomputeUnit.MOE_ROUTER: ["mlp.gate"],
    RecomputeUnit.MOE_EXPERTS: ["mlp.experts"],
}
_DENSE_MLP = {
    RecomputeUnit.MLP_UP: ["mlp.gate_proj", "mlp.up_proj"],
    RecomputeUnit.MLP_ACT: ["mlp.act_fn"],
    RecomputeUnit.MLP_DOWN: ["mlp.down_proj"],
}
LAYOUTS: dict[str, dict[RecomputeUnit, list[Span]]] = {
    "LlamaDecoderLayer": {**_ATTENTION, **_DENSE_MLP},
    "MistralDecoderLayer": {**_ATTENTION, **_DENSE_MLP},
    "Qwen2DecoderLayer": {**_ATTENTION, **_DENSE_MLP},
    "Qwen3DecoderLayer": {**_ATTENTION, **_DENSE_MLP},
    "Qwen3MoeDecoderLayer": {**_ATTENTION, **_DENSE_MLP, **_MOE_MLP},
}
"""Built-in declarations by decoder layer class name (tested longest; other architectures are
derived). A span whose module is missing in a given layer (a dense layer of an MoE model, a
model without QK-norm) is left out.

Routers that normalise their top-k weights in place (Qwen3-MoE with ``norm_topk_prob=True``,
Mixtral) are exact in eager layers: the engine replays the update on a copy of the routing
output taken before it."""

_STATE_ATTR = "_actplan_hf"


@dataclass
class _Declared:
    layers: list[nn.Module] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)
    # config.use_cache before declare turned it off (None: left alone).
    use_cache: bool | None = None
    # The layouts declare was given, so that actplan.apply declares the same again.
    layouts: dict[str, Layout | None] = field(default_factory=dict)


@dataclass(frozen=True)
class FoundLayer:
    """A decoder layer of a ``transformers`` model and where its units come from."""

    name: str
    module: nn.Module
    interval_map: RecomputeIntervalMap | None  # None: no usable layout (see ``problem``)
    source: str  # "given", "built-in", "derived", "skipped" or "unsure"
    layout: dict[RecomputeUnit, list[Span]] = field(default_factory=dict)
    problem: str = ""


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` model (checked without importing transformers)."""
    return any(cls.__module__.startswith("transformers.") for cls in type(model).__mro__)


def _from_transformers(module: nn.Module) -> bool:
    return any(
        cls.__module__.startswith(("transformers.", "transformers_modules.")) for cls in type(module).__mro__
    )


def _is_checkpointing_layer(module: nn.Module) -> bool:
    # transformers' own gradient checkpointing wraps exactly these (transformers >= 4.53).
    return any(
        cls.__name__ == "GradientCheckpointingLayer" and cls.__module__.startswith("transformers.")
        for cls in type(module).__mro__
    )


def contains_transformers(model: nn.Module) -> bool:
    """Whether any module under ``model`` (itself included) comes from ``transformers``."""
    return any(_from_transformers(m) for m in model.modules())


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks transformers' gradient checkpointing would wrap, outermost only, in model
    order; for models without ``GradientCheckpointingLayer`` blocks, the members of the first
    ``ModuleList`` whose members all have attention projections."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if _is_checkpointing_layer(module) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    if found or not _from_transformers(model):
        return found
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(_has_attention(m) for m in module):
            return [(f"{name}.{child}" if name else child, m) for child, m in module.named_children()]
    return []


def _has_attention(block: nn.Module) -> bool:
    return any(path.rpartition(".")[2].lower() in ATTENTION_INPUTS for path, _ in block.named_modules())


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _normalised(layout: Layout) -> dict[RecomputeUnit, list[Span]]:
    return {
        parse_unit(unit): [s if isinstance(s, str) else tuple(s) for s in spans]
        for unit, spans in layout.items()
    }


def interval_map_for(layer: nn.Module, layout: Layout) -> RecomputeIntervalMap:
    """The units ``layer`` has under ``layout``; spans whose modules are absent are dropped.

    A point is ``"<path>:enter"``, ``"<path>:exit"`` or ``"<path>:projected"`` (after the
    last of the layout's ``qkv_proj`` modules under ``<path>`` has run)."""
    units: dict[RecomputeUnit, list[MarkerInterval]] = {}
    for unit, spans in _normalised(layout).items():
        intervals = []
        for span in spans:
            if isinstance(span, str):
                if _has(layer, span):
                    intervals.append(MarkerInterval(f"{span}:enter", f"{span}:exit"))
            else:
                start, end = span
                if all(_has(layer, point.rpartition(":")[0]) for point in (start, end)):
                    intervals.append(MarkerInterval(start, end))
        if intervals:
            units[unit] = intervals
    if not units:
        raise ConfigError(
            f"no span of the layout for {type(layer).__name__} names a submodule it has "
            f"(it has: {', '.join(submodule_names(layer, 2))}); write the spans as module paths "
            "relative to the decoder layer"
        )
    return RecomputeIntervalMap(units)


def _layout_of(layer: nn.Module, layouts: Layouts | None) -> tuple[str, dict[RecomputeUnit, list[Span]], str]:
    """(source, layout, problem) for one decoder layer: source "given", "built-in", "derived",
    "skipped" (``None`` given: empty layout) or "unsure" (a partial layout and the problem)."""
    class_name = type(layer).__name__
    if layouts is not None and class_name in layouts:
        given = layouts[class_name]
        return ("given", _normalised(given), "") if given is not None else ("skipped", {}, "")
    if class_name in LAYOUTS and type(layer).__module__.startswith("transformers."):
        return "built-in", LAYOUTS[class_name], ""
    derived = derive_layout(layer)
    if derived.sure:
        return "derived", derived.units, ""
    return "unsure", derived.units, "; ".join(derived.reasons)


def find_decoder_layers(model: nn.Module, layouts: Layouts | None = None) -> list[FoundLayer]:
    """Every decoder layer of ``model`` with its interval map and where the map comes from;
    a layer whose layout cannot be derived has ``source == "unsure"`` and says why."""
    found = []
    for name, layer in decoder_layers(model):
        source, layout, problem = _layout_of(layer, layouts)
        interval_map = interval_map_for(layer, layout) if source in ("given", "built-in", "derived") else None
        found.append(FoundLayer(name, layer, interval_map, source, layout, problem))
    return found


def unsure_layers(model: nn.Module, layouts: Layouts | None = None) -> list[FoundLayer]:
    return [layer for layer in find_decoder_layers(model, layouts) if layer.source == "unsure"]


def layer_maps(model: nn.Module, layouts: Layouts | None = None) -> dict[int, RecomputeIntervalMap | None]:
    """``id(layer) -> interval map`` for every decoder layer of ``model`` (``None``: a class
    ``layouts`` says not to checkpoint). On a ``transformers`` model, a decoder layer whose
    layout cannot be derived is an error (``layout_error``); inside a model of your own, such
    layers are left out."""
    found = find_decoder_layers(model, layouts)
    unsure = [layer for layer in found if layer.source == "unsure"]
    if unsure and is_hf_model(model):
        raise layout_error(model, unsure)
    return {id(layer.module): layer.interval_map for layer in found if layer.source != "unsure"}


def layout_error(model: nn.Module, problems: Sequence[FoundLayer] = ()) -> ConfigError:
    """The error for a ``transformers`` model actplan cannot find units in: the decoder
    layers and submodules it found, what is unclear, and how to pass ``layouts=``."""
    found = ""
    if not problems:
        blocks = decoder_layers(model)
        found = (
            f"decoder layers {', '.join(sorted({type(m).__name__ for _, m in blocks}))}, none of them usable"
            if blocks
            else "no decoder layers (no GradientCheckpointingLayer, no ModuleList of attention blocks)"
        )
    return unclear_layout_error(
        model,
        problems,
        found=found,
        kind="decoder layers",
        per="decoder-layer class (module paths relative to the layer",
        default_class="MyDecoderLayer",
        attention="self_attn",
        apply_call="actplan.apply(model, config, layouts=",
        doc='docs/huggingface.md, "Other architectures"',
    )


def declare(model: nn.Module, layouts: Layouts | None = None) -> int:
    """Declare the units of every decoder layer in ``model``; returns how many.

    ``layouts`` (decoder-layer class name -> unit -> spans, or ``None`` to leave a class
    alone) takes precedence over the built-in declarations and over derivation; ``actplan.apply``
    keeps using them. Raises ``ConfigError`` when Hugging Face's own gradient checkpointing
    is on (both would checkpoint the same layers), when a layer's layout cannot be derived,
    or when no decoder layer has a layout.
    """
    check_hf_checkpointing_off(model)
    undeclare(model)
    layer_maps(model, layouts)  # the error for an unsure layer of a transformers model
    found = [layer for layer in find_decoder_layers(model, layouts) if layer.interval_map is not None]
    if not found:
        raise layout_error(model, unsure_layers(model, layouts))
    state = _Declared(layouts=dict(layouts or {}))
    try:
        for layer in found:
            install_hooks(layer.module, layer.interval_map, state.handles)
            layer.module.recompute_intervals = layer.interval_map
            state.layers.append(layer.module)
    except BaseException:
        for handle in state.handles:
            handle.remove()
        for module in state.layers:
            module.__dict__.pop("recompute_intervals", None)
        raise
    if kv_cache_off(model):  # `undeclare` turns it back on
        warn(
            f"actplan sets {type(model).__name__}.config.use_cache = False while its plan is "
            "installed: a KV cache would change between a layer's forward and its recompute"
        )
        state.use_cache = True
    model.__dict__[_STATE_ATTR] = state
    return len(state.layers)


def kv_cache_off(model: nn.Module) -> bool:
    """Turn a transformers model's KV cache off (``config.use_cache = False``), as a plan trains;
    True when it was on. A cache passed to every layer is appended to again when a layer is
    recomputed (or replayed alone by the profiler), so the replay would attend over twice the
    keys; transformers turns it off under its own gradient checkpointing too."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return False
    config.use_cache = False
    return True


def undeclare(model: nn.Module) -> bool:
    """Remove the hooks and ``recompute_intervals`` that ``declare`` added."""
    state: _Declared | None = model.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return False
    for handle in state.handles:
        handle.remove()
    for layer in state.layers:
        layer.__dict__.pop("recompute_intervals", None)
    if state.use_cache is not None:
        model.config.use_cache = state.use_cache
    return True


def is_declared(model: nn.Module) -> bool:
    return _STATE_ATTR in model.__dict__


def declared_inside(model: nn.Module) -> bool:
    """Whether ``declare`` ran on ``model`` or on a module inside it (and still holds)."""
    return any(is_declared(m) for m in model.modules())


def declared_layouts(model: nn.Module) -> dict[str, Layout | None]:
    """The ``layouts`` the current declaration of ``model`` was made with (empty if none)."""
    state: _Declared | None = model.__dict__.get(_STATE_ATTR)
    return dict(state.layouts) if state is not None else {}


def known_interval_map(module: nn.Module, layouts: Layouts | None = None) -> RecomputeIntervalMap | None:
    """The interval map of one ``transformers`` decoder layer (given, built-in or derived),
    or ``None`` for other modules and for layers whose layout cannot be derived."""
    class_name = type(module).__name__
    listed = layouts is not None and class_name in layouts
    builtin = class_name in LAYOUTS and type(module).__module__.startswith("transformers.")
    if not (listed or builtin or _is_checkpointing_layer(module)):
        return None
    source, layout, _ = _layout_of(module, layouts)
    return interval_map_for(module, layout) if source in ("given", "built-in", "derived") else None


def layout_rows(model: nn.Module, layouts: Layouts | None = None) -> list[tuple[str, str, str, str, str]]:
    """(layer class, layers, source, unit, spans) per unit of each distinct decoder-layer
    layout of ``model``: what ``actplan units --model`` shows."""
    return found_layout_rows(find_decoder_layers(model, layouts))


def unit_modules(model: nn.Module, layouts: Layouts | None = None) -> dict[RecomputeUnit, str]:
    """Per unit, the modules it spans in ``model``'s decoder layers with their classes
    (``ln_1 (LayerNorm)``, ``mlp.act (NewGELUActivation)``): what the unit is in this model."""
    found: dict[RecomputeUnit, dict[str, None]] = {}
    for layer in find_decoder_layers(model, layouts):
        for unit, intervals in (layer.interval_map or {}).items():
            for path in map(format_interval, intervals):
                # "[a, b)" is a span between two points, not one module.
                kind = "" if path.startswith("[") else f" ({type(layer.module.get_submodule(path)).__name__})"
                found.setdefault(unit, {})[path + kind] = None
    return {unit: ", ".join(names) for unit, names in found.items()}


class _HuggingFace:
    """The ``LayerSource`` for ``transformers`` models (see ``actplan.integrations``)."""

    name = "huggingface"
    _check: CallCheck | None = None

    def recognises(self, model: nn.Module) -> bool:
        return contains_transformers(model)

    def interval_map(self, module: nn.Module) -> RecomputeIntervalMap | None:
        return known_interval_map(module) if type(module).__module__.startswith("transformers.") else None

    def layer_maps(self, model: nn.Module, layouts: Layouts | None) -> dict[int, RecomputeIntervalMap | None]:
        return layer_maps(model, layouts)

    def saved_layouts(self, model: nn.Module) -> dict[str, Layout | None]:
        return declared_layouts(model)

    def prepare(self, model: nn.Module, layouts: Layouts | None) -> None:
        if not declared_inside(model):
            declare(model, layouts)

    def release(self, model: nn.Module) -> None:
        undeclare(model)

    def no_layers_error(self, model: nn.Module, layouts: Layouts | None) -> Exception:
        return layout_error(model, unsure_layers(model, layouts))

    def call_check(self, module: nn.Module) -> CallCheck | None:
        if not _from_transformers(module):
            return None
        if self._check is None:  # made once transformers is loaded: it looks up its Cache class
            self._check = CallCheck()
        return self._check


SOURCE = _HuggingFace()
"""Registered by ``actplan.integrations`` on first use."""
