"""Integrations: frameworks whose layers actplan checkpoints without declarations in their code.

The core never names a framework. An integration is a ``LayerSource`` that says which models
it recognises, gives the ``RecomputeIntervalMap`` of their layers, and installs (and removes)
whatever makes those layers emit markers. Integrations register themselves through the
``actplan.integrations`` entry-point group (a third-party package declares one in its
``pyproject.toml``), or ``register`` adds one at run time. The ones shipped here are loaded
by name on first use, only then importing their modules: Hugging Face ``transformers``
(``actplan.integrations.hf``), torchtitan (``actplan.integrations.torchtitan``; torchtitan
itself is never imported by it) and plain PyTorch decoders with conventionally named blocks
(``actplan.integrations.blocks``).

Imports only ``actplan.units``; integrations import the config errors and markers they need.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any, Protocol

from torch import nn

from actplan.units import RecomputeIntervalMap

ENTRY_POINT_GROUP = "actplan.integrations"

Layouts = Mapping[str, Any]
"""Per layer class name: a user-given layout (its form is the integration's), or ``None``."""


class LayerSource(Protocol):
    """What the core asks of an integration. ``layouts`` are the user's overrides (``apply(...,
    layouts=)``), passed through untouched."""

    name: str

    def recognises(self, model: nn.Module) -> bool:
        """Whether ``model`` contains layers of this framework."""
        ...

    def interval_map(self, module: nn.Module) -> RecomputeIntervalMap | None:
        """The map of one of the framework's layer modules (built in or derived), else ``None``."""
        ...

    def layer_maps(self, model: nn.Module, layouts: Layouts | None) -> dict[int, RecomputeIntervalMap | None]:
        """Per layer module (by ``id``) under ``model``: its map under ``layouts``."""
        ...

    def saved_layouts(self, model: nn.Module) -> dict[str, Any]:
        """Layouts an earlier ``prepare`` was given, so a later install keeps them."""
        ...

    def prepare(self, model: nn.Module, layouts: Layouts | None) -> None:
        """Make the layers emit their markers (idempotent: nothing if already prepared)."""
        ...

    def release(self, model: nn.Module) -> None:
        """Undo ``prepare``."""
        ...

    def no_layers_error(self, model: nn.Module, layouts: Layouts | None) -> Exception:
        """The error for a recognised model none of whose layers has a usable map."""
        ...

    def call_check(self, module: nn.Module) -> Callable[..., None] | None:
        """Optional (the core reads it with ``getattr``): for one of the framework's layers, a
        check ``check(layer, args, kwargs, name)`` that the checkpoint wrapper runs before each
        call it checkpoints, raising when the framework's settings or the call's arguments would
        make the replay differ from the forward; ``None`` for no check."""
        ...


# Shipped integrations: module:attribute of their LayerSource, imported on first use.
_SHIPPED = (
    "actplan.integrations.hf:SOURCE",
    "actplan.integrations.torchtitan:SOURCE",
    "actplan.integrations.blocks:SOURCE",
)
_registered: list[LayerSource] = []
_loaded = False


def _load(reference: str) -> LayerSource:
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


def register(source: LayerSource) -> None:
    """Add an integration (once; a second registration of the same name replaces the first)."""
    _registered[:] = [s for s in _registered if s.name != source.name]
    _registered.append(source)


def sources() -> tuple[LayerSource, ...]:
    """Every registered integration, the entry-point ones loaded on first use."""
    global _loaded
    if not _loaded:
        _loaded = True
        for reference in _SHIPPED:
            register(_load(reference))
        for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
            register(entry.load())
    return tuple(_registered)


def recognising(model: nn.Module) -> list[LayerSource]:
    """The integrations that recognise ``model``."""
    return [source for source in sources() if source.recognises(model)]
