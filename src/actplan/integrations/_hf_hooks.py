"""The marker hooks ``actplan.integrations.hf.declare`` puts on a decoder layer's submodules:
a pre/post hook per module boundary a layout names, and the "after the input projections"
point. Hooks are small classes (not closures) so a declared model pickles.

Also the checks of Hugging Face settings that would make a checkpointed layer's replay differ
from its forward: ``check_hf_checkpointing_off`` (when a plan is installed) and ``CallCheck``
(before every checkpointed call: HF's own checkpointing switched on since, or a KV cache).

Imports only ``actplan.config`` (its error), ``actplan.markers`` and ``actplan.units``;
``transformers`` is never imported (its ``Cache`` class is looked up once it is loaded).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
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


# ---------------------------------------------------------------------------------------------
# Settings that would make the replay differ from the forward

_HF_CHECKPOINTING_FIX = (
    "call model.activation_checkpointing_disable() (model.gradient_checkpointing_disable() on "
    "transformers before 5.24) and let actplan's config decide what is recomputed. With the Trainer, "
    "leave activation_checkpointing (gradient_checkpointing before 5.24) off in TrainingArguments: "
    "TrainingArguments(gradient_checkpointing=False)"
)


def check_hf_checkpointing_off(model: nn.Module) -> None:
    """Refuse a model on which Hugging Face's own gradient checkpointing is on (at ``declare``)."""
    if any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        raise ConfigError(
            "Hugging Face gradient checkpointing is enabled on this model, and actplan would "
            f"checkpoint the same layers again; {_HF_CHECKPOINTING_FIX}"
        )


# Keyword names transformers versions give a decoder layer's KV cache.
_CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past", "cache_params")


class CallCheck:
    """Run by the checkpoint wrapper before each call of a declared decoder layer that it
    checkpoints (gradients on, something to differentiate). Refuses, naming the setting to
    change:

    - Hugging Face's own gradient checkpointing switched on after ``actplan.apply`` (the
      ``Trainer`` does it at ``train()`` for ``TrainingArguments(gradient_checkpointing=True)``):
      its checkpoint would run inside actplan's, and the replay would save other tensors;
    - a KV cache (``use_cache=True``, a ``Cache`` object or a legacy tuple): the layer appends
      its keys and values to it, and its recompute would append them a second time.

    One object serves every layer (``torch.compile`` guards on it); it holds no module."""

    def __init__(self) -> None:
        # transformers is loaded by now (the model is one of its); nothing is imported here.
        cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
        self.cache_types: tuple[type, ...] = (cache,) if isinstance(cache, type) else ()

    def __call__(self, layer: nn.Module, args: tuple, kwargs: dict, name: str | None = None) -> None:
        where = name or type(layer).__name__
        if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
            raise ConfigError(
                f"{where}: Hugging Face gradient checkpointing was switched on after actplan.apply "
                "(the layer's gradient_checkpointing is True; the Trainer does this when "
                "TrainingArguments sets gradient_checkpointing=True), so the layer would be "
                f"checkpointed inside actplan's own checkpoint; {_HF_CHECKPOINTING_FIX}"
            )
        cache = self._cache_in(args, kwargs)
        if cache:
            raise ConfigError(
                f"{where}: a KV cache reached a planned layer in a forward with gradients ({cache}). "
                "The layer appends its keys and values to the cache, and its recompute in backward "
                "would append them again, so the replay would not match the forward. Pass "
                "use_cache=False (and no past_key_values) to training forwards, e.g. "
                "model(input_ids, labels=labels, use_cache=False); generate under torch.no_grad() "
                "(model.generate does) or after actplan.remove(model)"
            )

    def _cache_in(self, args: tuple, kwargs: dict) -> str:
        if kwargs.get("use_cache"):
            return "use_cache=True"
        for keyword in _CACHE_KEYWORDS:
            if kwargs.get(keyword) is not None:
                return f"{keyword}={type(kwargs[keyword]).__name__}"
        if self.cache_types and any(isinstance(arg, self.cache_types) for arg in args):
            return "a Cache passed positionally"
        return ""
