"""The offload layer wrapper: ``apply_offload`` puts an ``OffloadEngine``'s saved-tensor hooks around
one layer's forward (its input, or what autograd saves while an offloaded interval is open).

Imports ``boundary`` (the instance-forward helpers both layer wrappers share), ``markers`` (the
marker sink), ``units`` (the marker index) and ``_storage``; the engine itself only for type checking.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from actplan._engine.boundary import RuntimeOnly, inner_forward, install_forward, uninstall_forward
from actplan._storage import storage_key, storage_keys
from actplan._torch_internals import tree_leaves
from actplan.markers import routing_markers
from actplan.units import marker_index

if TYPE_CHECKING:
    from actplan._engine.offload import OffloadEngine

__all__ = ["OffloadState", "apply_offload", "is_offloaded", "remove_offload"]

_STATE_ATTR = "_actplan_offload"


@dataclass
class OffloadState(RuntimeOnly):
    """What ``apply_offload`` installed on a layer (not pickled)."""

    engine: OffloadEngine
    name: str
    layer_input: bool
    # Intervals whose saved tensors move out, in a layer that is not checkpointed.
    opens: dict[str, tuple[Any, ...]]
    closes: dict[str, tuple[Any, ...]]
    what: str
    previous_forward: Callable[..., Any] | None
    position: int | None = None


class _OpenUnits:
    """Follows a non-checkpointed layer's markers: is an offloaded interval open?"""

    __slots__ = ("closes", "open", "opens")

    def __init__(self, opens: dict[str, tuple[Any, ...]], closes: dict[str, tuple[Any, ...]]) -> None:
        self.opens, self.closes = opens, closes
        self.open: set[Any] = set()

    def on_marker(self, marker: str) -> None:
        for span in self.closes.get(marker, ()):
            self.open.discard(span)
        for span in self.opens.get(marker, ()):
            self.open.add(span)


_EAGER_ONLY = (
    "actplan offload runs in eager mode only; remove `offload` from the config of compiled "
    "layers, or do not compile them"
)


def _offloaded_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: OffloadState = getattr(self, _STATE_ATTR)
    inner = inner_forward(self, state.previous_forward)
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    if torch.compiler.is_compiling():
        # Inside a whole-model torch.compile, this call is a graph break: the layer runs eagerly,
        # offload and all. Compiling the layer itself (fullgraph=True) fails here, with the reason.
        return _run_eagerly(self, state, inner, args, kwargs)
    return _run(self, state, inner, args, kwargs)


def _run(self: nn.Module, state: OffloadState, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    engine = state.engine
    group = engine.begin_group(state.name, id(self), state.position)
    with engine.running(group):
        if state.layer_input:
            inputs = storage_keys(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))

            def select(tensor: torch.Tensor) -> bool:
                return storage_key(tensor) in inputs

            with engine.saved_tensor_hooks(group, select):
                out = inner(*args, **kwargs)
        else:
            units = _OpenUnits(state.opens, state.closes)
            with (
                engine.saved_tensor_hooks(group, lambda tensor: bool(units.open)),
                routing_markers(units.on_marker),
            ):
                out = inner(*args, **kwargs)
    engine.end_group(group, state.what)
    return out


_run_eagerly = torch.compiler.disable(_run, reason=_EAGER_ONLY)


def apply_offload(
    module: nn.Module,
    engine: OffloadEngine,
    *,
    name: str,
    layer_input: bool = False,
    intervals: Iterable[Any] = (),
    what: str = "saved tensors",
    position: int | None = None,
) -> nn.Module:
    """Offload what ``module`` saves for backward through ``engine``.

    ``layer_input``: the input a checkpointed layer saves (wrap after
    ``apply_gradient_checkpointing``). ``intervals``: in a layer that is *not* checkpointed,
    the tensors autograd saves while one of these intervals is open. Kept units of a
    selectively checkpointed layer are offloaded by its policy instead. ``position``: the
    layer's index in the model, for prefetch distances. Undo with ``remove_offload``.
    """
    if is_offloaded(module):
        raise ValueError(f"{name} already has an offload wrapper; call remove_offload(module) first")
    opens, closes = marker_index(intervals)
    previous = module.__dict__.get("forward")
    state = OffloadState(
        engine=engine,
        name=name,
        layer_input=layer_input,
        opens=opens,
        closes=closes,
        what=what,
        previous_forward=previous,
        position=position,
    )
    install_forward(module, _STATE_ATTR, state, _offloaded_forward)
    return module


def is_offloaded(module: nn.Module) -> bool:
    # A loaded copy of a pickled offloading module holds None here: it is not wrapped.
    return module.__dict__.get(_STATE_ATTR) is not None


def remove_offload(module: nn.Module) -> bool:
    """Undo ``apply_offload``; returns whether the module was wrapped."""
    return uninstall_forward(module, _STATE_ATTR)
