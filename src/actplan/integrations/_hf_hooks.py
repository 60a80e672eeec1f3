"""The marker hooks ``actplan.integrations.hf.declare`` puts on a decoder layer's submodules:
a pre/post hook per module boundary a layout names, and the "after the input projections"
point. Hooks are small classes (not closures) so a declared model pickles.

Imports only ``actplan.config`` (its error), ``actplan.markers`` and ``actplan.units``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from actplan.config import ConfigError
from actplan.integrations.hf_derive import PROJECTED
from actplan.markers import checkpoint_record
from actplan.units import RecomputeIntervalMap, RecomputeUnit


class _AfterProjections:
    """Emits ``"<attention>:projected"`` once every input projection of the attention has run
    in the current call, whatever their order; or, if one did not run, before the span's end."""

    def __init__(self, marker: str, projections: Sequence[str]) -> None:
        self.marker = marker
        self.count = len(set(projections))
        self.seen: set[str] = set()
        self.emitted = False

    def projection_hook(self, name: str) -> Callable[..., None]:
        # A partial of a method, not a closure: a pickled model keeps its hooks.
        return functools.partial(self.projection_ran, name)

    def projection_ran(self, name: str, *_: Any) -> None:
        if name in self.seen:  # a new call of the attention (or a replay) began
            self.seen.clear()
            self.emitted = False
        self.seen.add(name)
        if not self.emitted and len(self.seen) == self.count:
            self.emitted = True
            checkpoint_record(self.marker)

    def before_end(self, *_: Any) -> None:
        if not self.emitted:
            checkpoint_record(self.marker)
        self.seen.clear()
        self.emitted = False


class _Mark:
    """A module hook that records one marker; a class (not a closure) so that
    ``torch.save(model)`` pickles a declared model, hooks and all."""

    __slots__ = ("marker",)

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __call__(self, *_: Any) -> None:
        checkpoint_record(self.marker)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_Mark, (self.marker,))


def install_hooks(layer: nn.Module, interval_map: RecomputeIntervalMap, handles: list[Any]) -> None:
    markers = interval_map.markers
    for name, sub in layer.named_modules():
        if f"{name}:enter" in markers:
            handles.append(sub.register_forward_pre_hook(_Mark(f"{name}:enter")))
        if f"{name}:exit" in markers:
            handles.append(sub.register_forward_hook(_Mark(f"{name}:exit")))
    projected = sorted(m for m in markers if m.endswith(f":{PROJECTED}"))
    for marker in projected:
        attention = marker.rpartition(":")[0]
        projections = [
            span.start.rpartition(":")[0]
            for span in interval_map.get(RecomputeUnit.QKV_PROJ, ())
            if span.start.endswith(":enter") and (not attention or span.start.startswith(f"{attention}."))
        ]
        if not projections:
            raise ConfigError(
                f"{type(layer).__name__}: point {marker!r} follows the layout's qkv_proj modules "
                f"under {attention or 'the layer'}, and the layout declares none there; list them "
                "under qkv_proj or start the span at a module's ':exit'"
            )
        point = _AfterProjections(marker, projections)
        for path in projections:
            # After the projection's own exit marker, registered above.
            handles.append(layer.get_submodule(path).register_forward_hook(point.projection_hook(path)))
        for span in interval_map.values():
            for interval in span:
                if interval.start != marker:
                    continue
                end_path, _, end_kind = interval.end.rpartition(":")
                end = layer.get_submodule(end_path)
                # Before the end marker's own hook: prepended.
                if end_kind == "enter":
                    handles.append(end.register_forward_pre_hook(point.before_end, prepend=True))
                else:
                    handles.append(end.register_forward_hook(point.before_end, prepend=True))
