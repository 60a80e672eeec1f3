"""The error for a model whose layer layout actplan cannot derive, and the rows that list derived
layouts, shared by the Hugging Face,
torchtitan and plain PyTorch sources: what was found, what is unclear, and a ``layouts=`` to
pass. A leaf of the integrations: imports ``config`` (``ConfigError``), ``hf_derive`` and
``units``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from actplan.config import ConfigError
from actplan.integrations.hf_derive import Span, submodule_names
from actplan.units import MarkerInterval, RecomputeIntervalMap

__all__ = ["format_interval", "format_spans", "found_layout_rows", "unclear_layout_error"]


def format_spans(spans: Sequence[Span]) -> str:
    return ", ".join(repr(s) if isinstance(s, str) else f"({s[0]!r}, {s[1]!r})" for s in spans)



def unclear_layout_error(
    model: nn.Module,
    problems: Sequence[Any],
    *,
    found: str,
    kind: str,
    per: str,
    default_class: str,
    attention: str,
    apply_call: str,
    doc: str,
) -> ConfigError:
    """What actplan found (``problems``, or ``found`` when there are none), what is unclear,
    and a ``layouts=`` to pass, made from what was derived where anything was: shared by the
    Hugging Face, torchtitan and plain PyTorch sources (``kind``: "decoder layers", ...)."""
    lines = []
    by_class: dict[str, Any] = {}
    for layer in problems:
        by_class.setdefault(type(layer.module).__name__, layer)
    for class_name, layer in by_class.items():
        count = sum(type(x.module).__name__ == class_name for x in problems)
        lines.append(
            f"  {class_name} ({layer.name}{f' and {count - 1} more' if count > 1 else ''}): {layer.problem}\n"
            f"    submodules: {', '.join(submodule_names(layer.module))}"
        )
    if found:
        lines.append(f"  found {found}")
    example_class = next(iter(by_class), default_class)
    partial = next(iter(by_class.values())).layout if by_class else {}
    example = {u.value: format_spans(s) for u, s in partial.items()} or {
        "qkv_proj": f"'{attention}.q_proj', '{attention}.k_proj', '{attention}.v_proj'",
        "attn_core": f"('{attention}.v_proj:exit', '{attention}.o_proj:enter')",
        "attn_proj": f"'{attention}.o_proj'",
        "mlp_up": "'mlp.up_proj'",
        "mlp_down": "'mlp.down_proj'",
    }
    body = "".join(f"        {unit!r}: [{spans}],\n" for unit, spans in example.items())
    return ConfigError(
        f"actplan cannot tell the units of {type(model).__name__}'s {kind} from their "
        "module names:\n" + "\n".join(lines) + "\n"
        f"Pass a layout per {per}; a pair of "
        "points for work with no module of its own; None for a class not to checkpoint), e.g.\n"
        f"    {apply_call}{{{example_class!r}: {{\n{body}    }}}})\n"
        f"and check it with `actplan verify` ({doc})"
    )


def format_interval(interval: MarkerInterval) -> str:
    start_path, _, start_kind = interval.start.rpartition(":")
    end_path, _, end_kind = interval.end.rpartition(":")
    if start_path == end_path and (start_kind, end_kind) == ("enter", "exit"):
        return start_path
    return f"[{interval.start}, {interval.end})"


def found_layout_rows(found: Sequence[Any]) -> list[tuple[str, str, str, str, str]]:
    """(layer class, layers, source, unit, spans) per unit of each distinct layout among the
    ``found`` layers: what ``actplan units`` lists, for every source."""
    groups: dict[tuple[str, RecomputeIntervalMap | None, str], list[Any]] = {}
    for layer in found:
        groups.setdefault((type(layer.module).__name__, layer.interval_map, layer.source), []).append(layer)
    rows = []
    for (class_name, interval_map, source), members in groups.items():
        where = (
            ", ".join(m.name for m in members)
            if len(members) <= 2
            else f"{members[0].name} +{len(members) - 1}"
        )
        if interval_map is None:
            rows.append((class_name, where, source, "-", members[0].problem or "not checkpointed"))
            continue
        for unit, intervals in interval_map.items():
            rows.append((class_name, where, source, unit.value, " + ".join(map(format_interval, intervals))))
    return rows
