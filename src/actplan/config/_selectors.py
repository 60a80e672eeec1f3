"""Layer selectors: ``LayerSelector`` (which layers a config entry applies to), the forms it
accepts, their parse-time checks, and the range checks once the layer count is known.

Imports only pydantic, the config errors and the standard library.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ConfigDict, RootModel, model_validator

from actplan.config._errors import ConfigError

_RANGE_PIECE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
_SELECTOR_FORMS = (
    "'all', 'none', a layer index, a range string like '0-11' or '0-3,8,10-11', "
    "a list of indices and range strings, {every: N} (optionally with offset: k), "
    "{first: K} or {last: K}"
)
_DICT_SELECTOR_KEYS: tuple[frozenset[str], ...] = (
    frozenset({"every"}),
    frozenset({"every", "offset"}),
    frozenset({"first"}),
    frozenset({"last"}),
)


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `layers: true` is a mistake, not layer 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_ranges(text: str) -> tuple[tuple[int, int], ...]:
    """Parse ``'0-3,8,10-11'`` into inclusive ``(first, last)`` pairs."""
    ranges: list[tuple[int, int]] = []
    for piece in text.split(","):
        match = _RANGE_PIECE.match(piece)
        if match is None:
            if piece.strip().startswith("-"):
                raise ConfigError(
                    f"layer selector {text!r}: {piece.strip()!r} is negative; layer indices count "
                    "from 0 (to select the last layers use {last: K})"
                )
            raise ConfigError(
                f"layer selector {text!r}: {piece.strip()!r} is not a layer index or range; "
                "write indices like '3' and inclusive ranges like '0-11', separated by commas"
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise ConfigError(
                f"layer selector {text!r}: range '{first}-{last}' is reversed; write '{last}-{first}'"
            )
        ranges.append((first, last))
    return tuple(ranges)


def format_indices(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``'0-2,5,7-8'`` (the layer selector string form)."""
    ordered = sorted(set(indices))
    pieces: list[str] = []
    start = 0
    for position in range(1, len(ordered) + 1):
        if position == len(ordered) or ordered[position] != ordered[position - 1] + 1:
            first, last = ordered[start], ordered[position - 1]
            pieces.append(str(first) if first == last else f"{first}-{last}")
            start = position
    return ",".join(pieces)


def parse_indices(text: str) -> list[int]:
    """``'0-2,5'`` -> ``[0, 1, 2, 5]`` (in the order written, repeats kept); a ``ConfigError``
    for a malformed string."""
    return [index for first, last in _parse_ranges(text) for index in range(first, last + 1)]


def _check_selector(raw: Any) -> Any:
    """Validate a selector in its user form; return it with tuples turned into lists."""
    if isinstance(raw, str):
        if raw not in ("all", "none"):
            _parse_ranges(raw)
        return raw
    if _is_int(raw):
        _check_index(raw)
        return raw
    if isinstance(raw, list | tuple):
        return _check_list_selector(raw)
    if isinstance(raw, Mapping):
        return _check_dict_selector(raw)
    raise ConfigError(f"layer selector {raw!r} has an unsupported form; use {_SELECTOR_FORMS}")


def _check_index(index: int) -> None:
    if index < 0:
        raise ConfigError(
            f"layer index {index} is negative; layer indices count from 0 "
            "(to select the last layers use {last: K})"
        )


def _check_list_selector(raw: list | tuple) -> list:
    if not raw:
        raise ConfigError(
            "layer selector [] selects no layers; list at least one index, "
            "or write 'none' to turn checkpointing off"
        )
    for item in raw:
        if isinstance(item, str):
            _parse_ranges(item)
        elif _is_int(item):
            _check_index(item)
        else:
            raise ConfigError(
                f"layer selector list item {item!r} is neither a layer index nor a range string like '0-11'"
            )
    return list(raw)


def _check_dict_selector(raw: Mapping) -> dict:
    keys = frozenset(raw)
    if keys not in _DICT_SELECTOR_KEYS:
        raise ConfigError(
            f"layer selector {dict(raw)!r} has keys {sorted(map(str, keys))}; use one of "
            "{every: N}, {every: N, offset: k}, {first: K} or {last: K}"
        )
    for key, value in raw.items():
        if not _is_int(value):
            raise ConfigError(f"layer selector {key}: {value!r} must be an integer")
    if "every" in raw and raw["every"] < 1:
        raise ConfigError(
            f"layer selector every: {raw['every']} must be at least 1 "
            "(every: 1 selects all layers; layers: none turns checkpointing off)"
        )
    if raw.get("offset", 0) < 0:
        raise ConfigError(f"layer selector offset: {raw['offset']} is negative; offsets count from 0")
    for key in ("first", "last"):
        if key in raw and raw[key] < 1:
            raise ConfigError(
                f"layer selector {key}: {raw[key]} selects no layers; use {key}: 1 or more, "
                "or layers: none to turn checkpointing off"
            )
    return dict(raw)


class LayerSelector(RootModel[str | int | list[int | str] | dict[str, int]]):
    """Which layers a config entry applies to, kept in the form the user wrote it.

    Forms: ``'all'``, ``'none'``, an index, ``'0-3,8,10-11'`` (inclusive ranges), a list of
    indices and range strings, ``{every: N}`` / ``{every: N, offset: k}``, ``{first: K}``,
    ``{last: K}``. Malformed forms fail at parse time; indices past the model's last
    layer fail in ``resolve``.
    """

    model_config = ConfigDict(frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _validate_form(cls, raw: Any) -> Any:
        return _check_selector(raw)

    @property
    def selects_nothing(self) -> bool:
        """True only for the literal ``'none'``, the explicit way to select no layers."""
        return self.root == "none"

    def resolve(self, num_layers: int) -> tuple[int, ...]:
        """The selected layer indices, sorted and unique, for a model with ``num_layers`` layers."""
        selected = self._indices(self.root, num_layers)
        if not selected and not self.selects_nothing:
            raise ConfigError(
                f"layer selector {self.root!r} selects no layers of a model with {num_layers}; "
                "select at least one layer, or write 'none' to turn checkpointing off"
            )
        return tuple(sorted(set(selected)))

    @classmethod
    def _indices(cls, raw: Any, num_layers: int) -> list[int]:
        if raw == "all":
            return list(range(num_layers))
        if raw == "none":
            return []
        if _is_int(raw):
            _check_in_range(raw, num_layers)
            return [raw]
        if isinstance(raw, str):
            out: list[int] = []
            for first, last in _parse_ranges(raw):
                _check_in_range(last, num_layers)
                out.extend(range(first, last + 1))
            return out
        if isinstance(raw, list):
            return [index for item in raw for index in cls._indices(item, num_layers)]
        if "every" in raw:
            offset = raw.get("offset", 0)
            _check_in_range(offset, num_layers, what=f"offset {offset}")
            return list(range(offset, num_layers, raw["every"]))
        key = "first" if "first" in raw else "last"
        count = raw[key]
        if count > num_layers:
            raise ConfigError(
                f"layer selector {key}: {count} asks for more layers than the model has ({num_layers}); "
                f"use {key}: {num_layers} or less"
            )
        return list(range(count)) if key == "first" else list(range(num_layers - count, num_layers))


def _check_in_range(index: int, num_layers: int, what: str | None = None) -> None:
    if index >= num_layers:
        valid = f"0-{num_layers - 1}" if num_layers else "none"
        raise ConfigError(
            f"{what or f'layer index {index}'} is out of range for a model with {num_layers} layers "
            f"(valid indices: {valid}); select only existing layers"
        )
