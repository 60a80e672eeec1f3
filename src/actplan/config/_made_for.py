"""``MadeFor``: the model a planned config was made for (model spec, size, layer count and
classes, batch shape, the first layer's input shape, dtype, device, budget, actplan version).
``actplan plan`` writes it as the config's ``made_for`` block; ``actplan._install.plan`` checks
the layer count and classes against the model a config meets, before anything is installed,
and ``actplan._install.apply`` the first layer's input on the first forward (``width_mismatch``,
``more_tokens``).

Imports only pydantic, the config errors and the selectors' range strings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from actplan.config._errors import ConfigError
from actplan.config._selectors import _is_int, format_indices, parse_indices

_CLASSES_FORM = "a mapping of layer class name to its layer indices, e.g. {DecoderLayer: '0-7'}"


def class_ranges(class_names: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """Each layer class with its indices as a range string, in order of first appearance:
    ``['A', 'A', 'B']`` -> ``(('A', '0-1'), ('B', '2'))``."""
    indices: dict[str, list[int]] = {}
    for index, name in enumerate(class_names):
        indices.setdefault(name, []).append(index)
    return tuple((name, format_indices(found)) for name, found in indices.items())


def describe_classes(classes: Sequence[tuple[str, str]]) -> str:
    """``'DecoderLayer 0-6, MoELayer 7'``."""
    return ", ".join(f"{name} {ranges}" for name, ranges in classes)


class MadeFor(BaseModel):
    """What a planned config was made for. ``model`` and ``layers`` are required; the rest
    are recorded when known. ``layers`` and ``layer_classes`` are checked when the config
    meets a model; the other fields are for the reader (and for ``actplan bench --model``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    size: str | None = None
    layers: int
    # Each layer class with its layer indices ('0-3,8'); every layer in exactly one class.
    layer_classes: tuple[tuple[str, str], ...] | None = None
    batch: int | None = None
    seq: int | None = None
    # The first layer's input shape at planning, e.g. (2, 512, 256): its last dimension is the
    # model's width, the product of the others the tokens a layer call runs.
    layer_input: tuple[int, ...] | None = None
    dtype: str | None = None
    device: str | None = None
    budget: str | None = None
    budget_bytes: int | None = None
    # What the budget bounds: "requested" (the bytes tensors ask for), "reserved" (the CUDA
    # caching allocator's segments, what a run runs out of) or "gpu" (reserved plus the CUDA
    # context and NCCL's buffers, outside the allocator).
    budget_of: Literal["requested", "reserved", "gpu"] | None = None
    actplan_version: str | None = None

    @field_validator("budget", mode="before")
    @classmethod
    def _budget_as_text(cls, value: Any) -> Any:
        # A budget is written as the user gave it; a bare number of bytes reads back as text.
        return str(value) if _is_int(value) or isinstance(value, float) else value

    @field_validator("layer_classes", mode="before")
    @classmethod
    def _classes_form(cls, value: Any) -> Any:
        if value is None:
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"expected {_CLASSES_FORM}, got {value!r}")
        pairs = []
        for name, where in value.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"layer class name {name!r} is not a class name; write {_CLASSES_FORM}")
            if _is_int(where):
                where = str(where)
            if not isinstance(where, str):
                raise ConfigError(
                    f"{name}: {where!r} is not layer indices; write a range string like '0-7' or '0-3,8'"
                )
            pairs.append((name, format_indices(parse_indices(where))))
        return tuple(pairs)

    @model_validator(mode="after")
    def _check(self) -> MadeFor:
        if self.layers < 1:
            raise ConfigError(f"layers: {self.layers}; a planned model has at least 1 layer")
        for field in ("batch", "seq", "budget_bytes"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ConfigError(f"{field}: {value} is not positive; give a positive number or remove it")
        if self.layer_classes is not None:
            self._check_classes_cover_the_layers()
        if self.layer_input is not None and (not self.layer_input or min(self.layer_input) < 1):
            raise ConfigError(
                f"layer_input: {list(self.layer_input)} is not a shape; give the first layer's input "
                "shape as positive sizes, e.g. [2, 512, 256], or remove it"
            )
        return self

    def _check_classes_cover_the_layers(self) -> None:
        seen: dict[int, str] = {}
        for name, ranges in self.layer_classes or ():
            for index in parse_indices(ranges):
                if index in seen:
                    raise ConfigError(
                        f"layer_classes: layer {index} is given to both {seen[index]} and {name}; "
                        "give each layer one class"
                    )
                seen[index] = name
        expected = set(range(self.layers))
        missing, extra = sorted(expected - set(seen)), sorted(set(seen) - expected)
        if missing or extra:
            what = "; ".join(
                part
                for part in (
                    f"no class for layers {format_indices(missing)}" if missing else "",
                    f"layers {format_indices(extra)} are past the last of {self.layers}" if extra else "",
                )
                if part
            )
            raise ConfigError(
                f"layer_classes: {what}; give every layer 0-{self.layers - 1} exactly one class"
            )

    def describe(self) -> str:
        """``"model 'hf-llama' (size small): 4 layers (LlamaDecoderLayer 0-3)"``."""
        size = f" (size {self.size})" if self.size else ""
        classes = f" ({describe_classes(self.layer_classes)})" if self.layer_classes else ""
        return f"model {self.model!r}{size}: {self.layers} layers{classes}"

    def mismatch(self, class_names: Sequence[str]) -> str | None:
        """Why a model whose layers have ``class_names`` (in order) is not the one this config
        was made for; None when its layer count and classes agree."""
        found = class_ranges(class_names)
        same_count = len(class_names) == self.layers
        if same_count and (self.layer_classes is None or dict(self.layer_classes) == dict(found)):
            return None
        differs = "layer counts" if not same_count else "layer classes"
        size = f" --size {self.size}" if self.size and ":" not in self.model else ""
        return (
            f"made_for: this config was planned for {self.describe()}, but the model it is applied to "
            f"has {len(class_names)} layers ({describe_classes(found)}); the {differs} differ. A plan "
            "chooses per layer index, so on another model it would checkpoint the wrong layers: use it "
            f"with the model it was made for (on the command line: --model {self.model}{size}), plan "
            "again for this model with `actplan plan`, or, to apply it anyway, delete the made_for block"
        )

    def width_mismatch(self, shape: Sequence[int]) -> str | None:
        """Why a first-layer input of ``shape`` is not the model this config was made for (its
        last dimension, the model's width, differs); None when it agrees or nothing was recorded."""
        if self.layer_input is None or not shape or shape[-1] == self.layer_input[-1]:
            return None
        return (
            f"made_for: this config was planned for {self.describe()} whose first layer's input is "
            f"{list(self.layer_input)} (width {self.layer_input[-1]}), but this model's is {list(shape)} "
            f"(width {shape[-1]}): another model, with the same layers. Each layer's choice was priced "
            "at the planned width, so its memory and time do not hold here: plan again for this model "
            "with `actplan plan`, or, to apply it anyway, delete made_for's layer_input"
        )

    def more_tokens(self, shape: Sequence[int]) -> str | None:
        """A warning when a first-layer input of ``shape`` runs more tokens (its size over its
        width) than the planned one: activations grow with tokens, so the plan's peak does not
        hold. None when it runs as many or fewer, or nothing was recorded."""
        if self.layer_input is None or not shape:
            return None
        planned, now = math.prod(self.layer_input[:-1]), math.prod(shape[:-1])
        if now <= planned:
            return None
        budget = f" (budget {self.budget})" if self.budget else ""
        return (
            f"made_for: this plan was made for {planned:,} tokens per layer call (first layer's input "
            f"{list(self.layer_input)}) and the model now runs {now:,} ({list(shape)}), "
            f"{now / planned:.2f}x: activations grow with tokens, so its peak will be above the planned "
            f"one{budget}. Plan again at this batch and sequence length (`actplan plan`, or "
            "`actplan estimate --out`)"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data, fields left out when unknown; ``MadeFor(**d)`` reads it back."""
        out: dict[str, Any] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if value is None:
                continue
            out[name] = (
                dict(value) if name == "layer_classes" else list(value) if name == "layer_input" else value
            )
        return out
