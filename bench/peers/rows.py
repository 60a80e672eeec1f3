"""The peers bench's rows: which peers run per model (torch's whole-layer checkpoint, torchtitan,
torch_remat, Megatron's ``--recompute-modules`` choices), which actplan presets, and the parity
allowance of rows with compiled layers."""

from __future__ import annotations

from typing import Any

from torch import nn

from actplan._install.apply import apply, find_layers, interval_map_of
from actplan._install.plan import format_indices
from actplan.config import RecomputeConfig
from actplan.evaluate.bench import OFFLOAD_VARIANTS, TORCH_CHECKPOINT
from actplan.evaluate.contenders import Contender, Installer, torch_checkpoint_installer
from bench.peers.methods import (
    remat_installer,
    titan_import_error,
    titan_op_sac_installer,
    titan_sac_installer,
    titan_version,
)

MEGATRON_MODULES: dict[str, tuple[str, ...]] = {
    "core_attn": ("attn_core",),
    "layernorm": ("attn_norm", "mlp_norm"),
    "mlp": ("mlp_up", "mlp_act", "mlp_down"),
    "moe_act": ("moe_act",),
    "moe": ("moe_dispatch", "moe_experts", "moe_act", "moe_combine"),
    "shared_experts": ("shared_experts",),
}
"""Megatron's ``--recompute-modules`` names and the actplan units each one recomputes."""

MEGATRON_CHOICES: dict[str, tuple[tuple[str, ...], ...]] = {
    "dense": (("core_attn",), ("layernorm", "mlp")),
    "moe": (("core_attn",), ("layernorm", "moe_act"), ("moe",)),
}
"""The Megatron choices benched per model: its default, and the common memory-saving sets."""

ACTPLAN_PRESETS = ("full", "attn", "matmuls", *OFFLOAD_VARIANTS)
COMPILED_PRESETS = ("full", "attn", "matmuls")
"""actplan presets also run with compiled layers, next to the compiled peers (offload is eager-only)."""
COMPILED_MODELS = ("dense",)
"""Models whose layers compile with ``fullgraph=True``; MoE layers split tokens per expert with
``.tolist()``, so their compiled peers run with graph breaks and actplan's layers stay eager."""
COMPILE_GRAD_FLOOR_FACTOR = 4.0
COMPILE_GRAD_FLOOR_SLACK = 1e-7
COMPILE_LOSS_ATOL = 1e-6
"""Parity of a compiled row (docs/compile.md): loss within 1e-6 of ``none``; every gradient within
4x the compile noise floor (``none`` compiled against ``none`` eager, this run) plus 1e-7."""


def titan_entry() -> tuple[str, Installer, str]:
    """torchtitan's own SelectiveAC when it imports; else the re-statement of its rule, with why."""
    error = titan_import_error()
    if error is None:
        return "titan-sac", titan_sac_installer, f"torchtitan {titan_version()}, its own SelectiveAC"
    return "titan-op-sac", titan_op_sac_installer, f"re-statement of torchtitan's rule ({error})"


def compile_peer_name(budget: float) -> str:
    return f"compile[budget={budget}]"


def megatron_installer(modules: tuple[str, ...]) -> Installer:
    """Recomputes the units of Megatron's ``modules`` in every layer that has them (an MoE
    model's dense layers have no ``moe_act``); a layer with none of them is not checkpointed."""

    def install(model: nn.Module) -> str:
        wanted = [unit for module in modules for unit in MEGATRON_MODULES[module]]
        groups: dict[tuple[str, ...], list[int]] = {}
        for index, (_, layer) in enumerate(find_layers(model)):
            declared = {str(unit) for unit in interval_map_of(layer)}
            groups.setdefault(tuple(u for u in wanted if u in declared), []).append(index)
        ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))

        def choice(units: tuple[str, ...]) -> dict[str, Any]:
            return {"recompute": list(units)} if units else {"mode": "none"}

        data = choice(ordered[0][0])
        if len(ordered) > 1:
            data["overrides"] = [{"layers": format_indices(ix), **choice(units)} for units, ix in ordered[1:]]
        config = RecomputeConfig.from_dict(data, source=f"megatron --recompute-modules {' '.join(modules)}")
        return apply(model, config).summary()

    return install


def peer_entries(model: str) -> list[tuple[str, Installer]]:
    titan_name, titan_install, _ = titan_entry()
    entries: list[tuple[str, Installer]] = [
        (TORCH_CHECKPOINT, torch_checkpoint_installer),
        (titan_name, titan_install),
        *((f"remat-{preset}", remat_installer(preset)) for preset in ("full", "attn", "matmuls")),
    ]
    for modules in MEGATRON_CHOICES.get(model, ()):
        entries.append((f"megatron[{','.join(modules)}]", megatron_installer(modules)))
    return entries


def allow_compile_noise(contender: Contender, floor: float) -> None:
    """Parity tolerances of a compiled row, from the compile noise floor measured in this run."""
    contender.grad_atol = COMPILE_GRAD_FLOOR_FACTOR * floor + COMPILE_GRAD_FLOOR_SLACK
    contender.loss_atol = COMPILE_LOSS_ATOL
