"""The peers bench's rows: which model (ours, or torchtitan's), which peers run per model
(torch's whole-layer checkpoint, torchtitan, torch_remat, Megatron's ``--recompute-modules``
choices; on torchtitan's model, torchtitan's own FullAC, SelectiveAC and MemoryBudgetAC), which
actplan presets, how each model's layers compile, and the parity allowance of compiled rows."""

from __future__ import annotations

from typing import Any

from torch import nn

from actplan._install.apply import apply, find_layers, interval_map_of
from actplan._install.plan import format_indices
from actplan._torch_internals import capture_data_dependent_shapes
from actplan.config import RecomputeConfig
from actplan.evaluate.bench import OFFLOAD_VARIANTS, TORCH_CHECKPOINT
from actplan.evaluate.contenders import Installer, config_installer, torch_checkpoint_installer
from actplan.models import ModelBundle, build_model
from bench.peers.methods import (
    DynamoFlags,
    compile_budget_installer,
    compiled_actplan_installer,
    remat_installer,
    titan_import_error,
    titan_op_sac_installer,
    titan_sac_installer,
    titan_version,
)
from bench.peers.titan import (
    TITAN_MODELS,
    build_titan_model,
    titan_actplan_installer,
    titan_compile_flags,
    titan_memory_budget_installer,
    titan_memory_budget_name,
    titan_peer_entries,
    titan_plan,
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
COMPILE_FLAGS: dict[str, DynamoFlags] = {
    "dense": None,
    "moe": capture_data_dependent_shapes,
    "titan-llama3": titan_compile_flags,
}
"""Per model, the dynamo flags its layers compile under with ``fullgraph=True``: none on dense;
on MoE, data-dependent shapes captured (the per-expert token split's ``.tolist()`` becomes a
symbolic size instead of a graph break, docs/compile.md); on torchtitan's model, the two flags
torchtitan's ``apply_compile`` sets."""
COMPILED_MODELS = tuple(COMPILE_FLAGS)
"""Models whose layers compile whole: their compile peers use ``fullgraph=True``, and actplan's
presets and recompute-only plans also run with compiled layers."""
TITAN_MODEL_SKIPS: list[dict[str, str]] = [
    {
        "peer": "torch-checkpoint",
        "reason": "on torchtitan's model its own FullAC is this row (non-reentrant checkpoint of each "
        "block, RNG state kept, through torch's checkpoint_wrapper)",
    },
    {
        "peer": "torch_remat",
        "reason": "its save regions live in model source (bench/peers/methods.py annotates our "
        "model classes); torchtitan's blocks would need their forward edited",
    },
    {
        "peer": "megatron",
        "reason": "Megatron's --recompute-modules choices are benched on our reference models only",
    },
]
"""The peers our models get and torchtitan's model does not, with why."""
MODEL_CHOICES = ("dense", "moe", *TITAN_MODELS)
"""``--models`` of the peers bench: our reference models, and torchtitan's own."""


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


def build_bench_model(model: str, size: str, **overrides: Any) -> ModelBundle:
    """A model of the peers bench: torchtitan's (``bench.peers.titan``) or our reference model."""
    if model in TITAN_MODELS:
        return build_titan_model(model, size, **overrides)
    return build_model(model, size, **overrides)


def actplan_installer(model: str, config: RecomputeConfig) -> Installer:
    """actplan's ``config`` as a row: ``actplan.apply`` on a torchtitan model's
    decoder (what ``ActplanAC`` does), ``actplan.apply`` on ours."""
    return titan_actplan_installer(config) if model in TITAN_MODELS else config_installer(config)


def compiled_installer(model: str, config: RecomputeConfig) -> Installer:
    """actplan's ``config`` with every layer compiled whole, under the model's dynamo flags."""
    plan = titan_plan if model in TITAN_MODELS else apply
    return compiled_actplan_installer(config, flags=COMPILE_FLAGS[model], plan=plan)


def automatic_peer_entries(model: str, budgets: tuple[float, ...]) -> list[tuple[str, Installer]]:
    """The compiled peers at each budget, 1.0 first (the compile noise floor): torchtitan's
    ``MemoryBudgetAC`` on a torchtitan model; on ours, each layer compiled under
    ``activation_memory_budget`` (whole where the model's layers compile whole)."""
    ordered = sorted(set(budgets) | {1.0}, reverse=True)
    if model in TITAN_MODELS:
        return [(titan_memory_budget_name(b), titan_memory_budget_installer(b)) for b in ordered]
    fullgraph = model in COMPILED_MODELS
    flags = COMPILE_FLAGS.get(model)
    return [
        (compile_peer_name(b), compile_budget_installer(b, fullgraph=fullgraph, flags=flags)) for b in ordered
    ]


def peer_entries(model: str) -> list[tuple[str, Installer]]:
    if model in TITAN_MODELS:
        return titan_peer_entries()
    titan_name, titan_install, _ = titan_entry()
    entries: list[tuple[str, Installer]] = [
        (TORCH_CHECKPOINT, torch_checkpoint_installer),
        (titan_name, titan_install),
        *((f"remat-{preset}", remat_installer(preset)) for preset in ("full", "attn", "matmuls")),
    ]
    for modules in MEGATRON_CHOICES.get(model, ()):
        entries.append((f"megatron[{','.join(modules)}]", megatron_installer(modules)))
    return entries
