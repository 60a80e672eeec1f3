"""Decoder blocks of plain PyTorch models, their units derived from module names.

A model none of whose modules declares units (a nanoGPT ``Block`` in a ``ModuleList``, a
torchtitan ``TransformerBlock`` in ``model.layers``) still names its submodules in the shared
vocabulary ``hf_derive`` reads. ``BlockSource`` is the ``LayerSource`` for such models: its
blocks are the members of the first ``ModuleList`` or ``ModuleDict`` whose members all have
attention projections; each block's layout is the one given by class name (``layouts=``,
as for Hugging Face models), else the derived one. ``prepare`` puts the marker hooks on the
named submodules (``_hf_hooks.install_hooks``) and gives each block its
``recompute_intervals``; ``release`` takes them away again.

It refuses, with a ``ConfigError`` naming the fix: blocks already wrapped by torch's
``checkpoint_wrapper`` (torchtitan's own activation checkpointing); a layout it cannot
derive (what was unclear, the submodules, the ``layouts=`` to pass); and, at the first
checkpointed call, tensor parallelism applied after the plan (``TensorParallelCheck``).
``SOURCE`` serves plain models; ``actplan.integrations.torchtitan`` subclasses it.
Imports ``config`` (its error), ``units``, ``hf`` (``FoundLayer``, ``interval_map_for``),
``hf_derive`` and ``_hf_hooks``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from actplan.config import ConfigError
from actplan.integrations._hf_hooks import install_hooks
from actplan.integrations._layout_error import found_layout_rows, unclear_layout_error
from actplan.integrations.hf import FoundLayer, Layout, interval_map_for
from actplan.integrations.hf_derive import ATTENTION_INPUTS, Span, derive_layout
from actplan.units import RecomputeIntervalMap, RecomputeUnit, parse_unit

Layouts = Mapping[str, Layout | None]

_STATE_ATTR = "_actplan_blocks"
# Per declared block: whether its parameters were already DTensors (tensor parallel) then.
_SHARDED_ATTR = "_actplan_sharded_at_apply"
# Frameworks with an integration of their own: the plain source leaves their models alone.
_FRAMEWORKS = ("transformers.", "transformers_modules.", "torchtitan.")


@dataclass
class _Declared:
    source: str
    layers: list[nn.Module] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)
    layouts: dict[str, Layout | None] = field(default_factory=dict)


def classes_from(module: nn.Module, prefixes: tuple[str, ...]) -> bool:
    """Whether a class in ``module``'s MRO comes from a package starting with one of ``prefixes``."""
    return any(cls.__module__.startswith(prefixes) for cls in type(module).__mro__)


def _has_attention(block: nn.Module) -> bool:
    return any(path.rpartition(".")[2].lower() in ATTENTION_INPUTS for path, _ in block.named_modules())


def attention_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The members of the first ``ModuleList`` or ``ModuleDict`` under ``model`` whose members
    all have attention input projections, in model order (``[]`` when there is none)."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module):
            members = list(module.named_children())
            if all(_has_attention(m) for _, m in members):
                return [(f"{name}.{child}" if name else child, m) for child, m in members]
    return []


def is_checkpoint_wrapper(module: nn.Module) -> bool:
    """torch's ``checkpoint_wrapper`` (what torchtitan's ``FullAC`` and ``SelectiveAC`` wrap
    blocks in), told by class name so nothing private of torch is imported."""
    return any(
        cls.__name__ in ("CheckpointWrapper", "ActivationWrapper") and cls.__module__.startswith("torch.")
        for cls in type(module).__mro__
    )


def _declares_units(model: nn.Module) -> bool:
    return any(
        isinstance(getattr(m, "recompute_intervals", None), RecomputeIntervalMap) for m in model.modules()
    )


def _has_dtensor_parameter(module: nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _normalised(layout: Layout) -> dict[RecomputeUnit, list[Span]]:
    return {
        parse_unit(unit): [s if isinstance(s, str) else tuple(s) for s in spans]
        for unit, spans in layout.items()
    }


def layout_of(block: nn.Module, layouts: Layouts | None) -> tuple[str, dict[RecomputeUnit, list[Span]], str]:
    """(source, layout, problem) for one block: "given" (by class name in ``layouts``),
    "skipped" (``None`` given), "derived", or "unsure" (a partial layout and what is unclear)."""
    class_name = type(block).__name__
    if layouts is not None and class_name in layouts:
        given = layouts[class_name]
        return ("given", _normalised(given), "") if given is not None else ("skipped", {}, "")
    derived = derive_layout(block)
    if derived.sure:
        return "derived", derived.units, ""
    return "unsure", derived.units, "; ".join(derived.reasons)


class TensorParallelCheck:
    """Run by the checkpoint wrapper before each checkpointed call of a declared block: refuses
    a block whose parameters became DTensors after ``actplan.apply`` (tensor parallelism applied
    after the plan). Its input and output redistributions would then sit outside the module
    spans the plan was made for, and a recompute could rerun their collectives. One object
    serves every block; the flag it reads is on the block."""

    def __call__(self, layer: nn.Module, args: tuple, kwargs: dict, name: str | None = None) -> None:
        if layer.__dict__.get(_SHARDED_ATTR) is False and _has_dtensor_parameter(layer):
            where = name or type(layer).__name__
            raise ConfigError(
                f"{where}: its parameters became DTensors after actplan.apply, so tensor parallelism "
                "was applied after the plan; apply it in torchtitan's order: tensor parallelism "
                "(model.parallelize or parallelize_module) first, then actplan (actplan.apply, "
                "or ActplanAC where torchtitan applies activation checkpointing), then torch.compile "
                "and FSDP. Call actplan.remove(model) and apply the plan again after TP"
            )


class BlockSource:
    """The ``LayerSource`` for models whose blocks are plain modules with conventional names.

    Subclasses change ``blocks`` (which modules are blocks), ``recognises`` and the words of
    the errors (``framework``, ``apply_example``, ``doc``)."""

    name = "pytorch"
    framework = "PyTorch"
    apply_example = "actplan.apply(model, config, layouts="
    doc = 'docs/torchtitan.md, "Other models"'
    _check = TensorParallelCheck()

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return attention_blocks(model)

    def recognises(self, model: nn.Module) -> bool:
        state = model.__dict__.get(_STATE_ATTR)
        if state is not None:
            return state.source == self.name
        if any(classes_from(m, _FRAMEWORKS) for m in model.modules()) or _declares_units(model):
            return False
        return bool(self.blocks(model))

    def interval_map(self, module: nn.Module) -> RecomputeIntervalMap | None:
        return None  # a lone module is no block of a plain model: only its model tells

    def find(self, model: nn.Module, layouts: Layouts | None = None) -> list[FoundLayer]:
        """Every block of ``model`` with its interval map and where its layout comes from."""
        found = []
        for name, block in self.blocks(model):
            source, layout, problem = layout_of(block, layouts)
            usable = source in ("given", "derived")
            found.append(
                FoundLayer(
                    name, block, interval_map_for(block, layout) if usable else None, source, layout, problem
                )
            )
        return found

    def layer_maps(self, model: nn.Module, layouts: Layouts | None) -> dict[int, RecomputeIntervalMap | None]:
        self.refuse_wrapped(model)
        found = self.find(model, layouts)
        unsure = [layer for layer in found if layer.source == "unsure"]
        if unsure:
            raise self.layout_error(model, unsure)
        return {id(layer.module): layer.interval_map for layer in found}

    def saved_layouts(self, model: nn.Module) -> dict[str, Layout | None]:
        state = model.__dict__.get(_STATE_ATTR)
        return dict(state.layouts) if state is not None and state.source == self.name else {}

    def prepare(self, model: nn.Module, layouts: Layouts | None) -> None:
        # A declaration on the model or inside it (a plan applied to the decoder, then to a
        # module around it) already emits the markers: hooks twice would emit them twice.
        if not any(_STATE_ATTR in m.__dict__ for m in model.modules()):
            self.declare(model, layouts)

    def release(self, model: nn.Module) -> None:
        undeclare(model)

    def no_layers_error(self, model: nn.Module, layouts: Layouts | None) -> Exception:
        return self.layout_error(model, [x for x in self.find(model, layouts) if x.source == "unsure"])

    def call_check(self, module: nn.Module) -> TensorParallelCheck | None:
        return self._check if _SHARDED_ATTR in module.__dict__ else None

    def declare(self, model: nn.Module, layouts: Layouts | None = None) -> int:
        """Hooks and ``recompute_intervals`` on every block with a layout; returns how many."""
        self.layer_maps(model, layouts)  # the errors: wrapped blocks, an unsure layout
        found = [layer for layer in self.find(model, layouts) if layer.interval_map is not None]
        if not found:
            raise self.layout_error(model, [])
        undeclare(model)
        state = _Declared(self.name, layouts=dict(layouts or {}))
        try:
            for layer in found:
                install_hooks(layer.module, layer.interval_map, state.handles)
                layer.module.recompute_intervals = layer.interval_map
                layer.module.__dict__[_SHARDED_ATTR] = _has_dtensor_parameter(layer.module)
                state.layers.append(layer.module)
        except BaseException:
            _undo(state)
            raise
        model.__dict__[_STATE_ATTR] = state
        return len(state.layers)

    def refuse_wrapped(self, model: nn.Module) -> None:
        """A ``ConfigError`` when modules under ``model`` are already checkpoint-wrapped."""
        wrapped = [name or "<root>" for name, m in model.named_modules() if is_checkpoint_wrapper(m)]
        if wrapped:
            where = ", ".join(wrapped[:3]) + (f" and {len(wrapped) - 3} more" if len(wrapped) > 3 else "")
            raise ConfigError(
                f"{where} of {type(model).__name__} are already wrapped by torch's checkpoint_wrapper "
                "(activation checkpointing of its own), so actplan would checkpoint inside a "
                f"checkpoint; {self.wrapped_fix()}"
            )

    def wrapped_fix(self) -> str:
        return (
            "build the model without checkpoint_wrapper / apply_activation_checkpointing and let "
            "actplan's config decide what is recomputed"
        )

    def layout_error(self, model: nn.Module, problems: Sequence[FoundLayer]) -> ConfigError:
        """What actplan found, what is unclear, and the ``layouts=`` to pass."""
        found = ""
        if not problems:
            classes = sorted({type(m).__name__ for _, m in self.blocks(model)})
            found = (
                f"blocks {', '.join(classes)}, none given a layout"
                if classes
                else "no blocks (no ModuleList or ModuleDict whose members all have attention "
                "input projections)"
            )
        return unclear_layout_error(
            model,
            problems,
            found=found,
            kind=f"{self.framework} blocks",
            per="block class (module paths relative to the block",
            default_class="MyBlock",
            attention="attn",
            apply_call=self.apply_example,
            doc=self.doc,
        )


def layout_rows(found: Sequence[FoundLayer]) -> list[tuple[str, str, str, str, str]]:
    """(block class, blocks, source, unit, spans) per unit of each distinct block layout: the
    derived units, listed as ``actplan units`` lists a Hugging Face model's."""
    return found_layout_rows(found)


def _undo(state: _Declared) -> None:
    for handle in state.handles:
        handle.remove()
    for layer in state.layers:
        layer.__dict__.pop("recompute_intervals", None)
        layer.__dict__.pop(_SHARDED_ATTR, None)


def undeclare(model: nn.Module) -> bool:
    """Remove the hooks and attributes a ``BlockSource`` declared on ``model``."""
    state: _Declared | None = model.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return False
    _undo(state)
    return True


SOURCE = BlockSource()
"""Registered by ``actplan.integrations`` on first use: plain PyTorch models."""
