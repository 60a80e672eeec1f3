"""Config errors and the text they point into: ``ConfigError``, strict YAML/JSON reading,
field paths, and pydantic reports turned into one line per problem with its YAML line.

Knows nothing of the config classes (the schema passes in what it needs). Imports only
pydantic, PyYAML and the standard library.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

CONFIG_SUFFIXES: dict[str, str] = {".yaml": "yaml", ".yml": "yaml", ".json": "json"}

FieldsAt = Callable[[tuple[int | str, ...]], Iterable[str]]
"""The valid field names of the model that holds the field at a path (for 'unknown field')."""


class ConfigError(ValueError):
    """A recompute config that is malformed, inconsistent, or does not fit the model."""


# ---------------------------------------------------------------------------------------
# Reading text


class _StrictSafeLoader(yaml.SafeLoader):
    """Safe YAML loading that rejects a key given twice (YAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice (first on line {first_line[key]}); keep one",
                    key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _strict_json_object(source: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A ``json.loads`` hook that refuses a key given twice in one object (JSON keeps the last)."""

    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for key, value in pairs:
            if key in data:
                raise ConfigError(
                    f"malformed JSON in {source}: key {key!r} appears twice in one object; keep one"
                )
            data[key] = value
        return data

    return build


def load_yaml(text: str, source: str) -> Any:
    """Plain data from YAML text (safe loading, no repeated keys); errors name the line."""
    try:
        return yaml.load(text, Loader=_StrictSafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark else source
        problem = " ".join(p for p in (err.context, err.problem) if p)
        raise ConfigError(f"malformed YAML in {where}: {problem}; fix the syntax there") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"malformed YAML in {source}: {err}; fix the syntax") from None


def load_json(text: str, source: str) -> Any:
    """Plain data from JSON text (no repeated keys); errors name the line and column."""
    try:
        return json.loads(text, object_pairs_hook=_strict_json_object(source))
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"malformed JSON in {source}, line {err.lineno}, column {err.colno}: {err.msg}; "
            "fix the syntax there"
        ) from None


def file_kind(path: Path, lead: str) -> str:
    """``'yaml'`` or ``'json'`` from the suffix; for any other, an error that starts with ``lead``."""
    kind = CONFIG_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise ConfigError(
            f"{lead} unsupported suffix {path.suffix!r}; use one of {', '.join(CONFIG_SUFFIXES)}"
        )
    return kind


def read_config_text(path: Path) -> str:
    """The UTF-8 text of a config file; errors say what was wrong with the file."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read config file {str(path)!r}: {err.strerror}; check the path") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {err.object[err.start]:#04x} at "
            f"offset {err.start}); save it as UTF-8"
        ) from None


# ---------------------------------------------------------------------------------------
# Field paths and lines


def format_field_path(loc: tuple[int | str, ...]) -> str:
    """``('overrides', 1, 'keep', 0)`` -> ``'overrides[1].keep[0]'``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def parse_field_path(path: str) -> tuple[int | str, ...]:
    """``'overrides[1].keep[0]'`` -> ``('overrides', 1, 'keep', 0)`` (``format_field_path``'s inverse)."""
    return tuple(int(part) if part.isdigit() else part for part in re.findall(r"[A-Za-z_]+|\d+", path))


# A message that starts with a field path ("overrides[0].layers: ...", "keep lists ...").
_FIELD_AT_START = re.compile(r"^([A-Za-z_]+(?:\[\d+\]|\.[A-Za-z_]+)*)[: ]")


def leading_field_path(message: str) -> tuple[int | str, ...]:
    """The field path an error message starts with, or ``()``."""
    match = _FIELD_AT_START.match(message)
    return parse_field_path(match.group(1)) if match else ()


def yaml_line(text: str, loc: tuple[int | str, ...]) -> int | None:
    """1-based line of the deepest YAML node on ``loc``; None if the text does not compose."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    if node is None:
        return None
    # A field's line is its key's (a value may start on the next line); an item's is its own.
    at = node
    for part in loc:
        child = key_node = None
        if isinstance(node, yaml.MappingNode):
            # The last duplicate key wins when loading, so point at that one.
            key_node, child = next(((k, v) for k, v in reversed(node.value) if k.value == part), (None, None))
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            child = node.value[part]
        if child is None:
            break
        node, at = child, key_node if key_node is not None else child
    return at.start_mark.line + 1


# ---------------------------------------------------------------------------------------
# Validation reports


def _describe_error(error: Mapping[str, Any], fields_at: FieldsAt) -> str:
    kind = error["type"]
    loc = tuple(error["loc"])
    if kind == "value_error":
        return str(error["ctx"]["error"])
    if kind == "extra_forbidden":
        valid = list(fields_at(loc))
        near = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        return f"unknown field {loc[-1]!r}; {hint}valid fields here: {', '.join(valid)}"
    if kind == "missing":
        return f"required field {loc[-1]!r} is missing; add it"
    message = error["msg"]
    return f"{message[0].lower()}{message[1:]}, got {error['input']!r}"


def report_validation_error(
    err: ValidationError, fields_at: FieldsAt, source: str | None = None, yaml_text: str | None = None
) -> str:
    """Pydantic's report as one readable line per problem, with field paths and YAML lines."""
    problems = []
    for error in err.errors():
        loc = tuple(error["loc"])
        field = format_field_path(loc) or "(top level)"
        line = yaml_line(yaml_text, loc) if yaml_text is not None else None
        at = f" (line {line})" if line is not None else ""
        problems.append(f"  {field}{at}: {_describe_error(error, fields_at)}")
    where = f" in {source}" if source else ""
    return f"invalid recompute config{where}:\n" + "\n".join(problems)
