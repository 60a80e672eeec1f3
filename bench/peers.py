"""actplan next to the tools its users reach for today, measured in one run.

    python -m bench.peers                      # dense small and moe small (about 15 minutes on 2 cores)
    python -m bench.peers --models dense --size tiny --repeats 2 --overhead-repeats 5   # quick

Per model, every row below trains on the same weights and batch: one step checks parity
against no checkpointing (loss, every gradient, grad census), one metered step gives the
activation bytes at the end of forward and the step's peak, then all rows are timed
interleaved (A B C, B C A, ...) after a warm-up.

- ``none``: no checkpointing.
- Peers: ``torch-checkpoint`` (whole layer, non-reentrant, as Hugging Face and most
  trainers do it); ``titan-sac`` (torchtitan's own SelectiveAC; where torchtitan does not
  import, ``titan-op-sac``, our re-statement of its rule); ``remat-{full,attn,matmuls}``
  (torch_remat with save regions matching actplan's presets); ``megatron[...]`` (Megatron
  ``--recompute-modules`` choices, run through actplan's config since Megatron itself is not
  in the picture).
- Automatic peers: ``compile[budget=B]``, each layer compiled (aot_eager) with
  ``torch._functorch.config.activation_memory_budget=B``; rockmate is tried and reported as
  not run, with the reason. Compiled rows pass parity within the compile noise floor.
- actplan's presets, with and without offload; on the dense model also with compiled layers.
- Planner plans at each peer's measured peak: one free to offload, one recompute-only (and,
  at a compiled peer's peak on the dense model, the recompute-only plan with compiled layers).

Then, per peer: the fastest actplan row whose peak is within 0.5% of the peer's (and, as a
second view, whose activation bytes are), with the step-time ratios side by side.

Last, the CPU-side cost per checkpointed layer, on the tiny size of the model with 8
layers, where Python and dispatch overhead dominate the step.

Writes ``bench/results/peers_<model>_<size>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from actplan._install.apply import apply, find_layers, interval_map_of
from actplan._install.plan import format_indices
from actplan.config import RecomputeConfig
from actplan.evaluate.bench import OFFLOAD_VARIANTS, TORCH_CHECKPOINT, machine_summary, policy_config
from actplan.evaluate.contenders import (
    Contender,
    Installer,
    PolicyRow,
    config_installer,
    policy_rows,
    prepare_contender,
    time_contenders,
    torch_checkpoint_installer,
)
from actplan.measure import compare_steps, interleaved_timing
from actplan.models import build_model, train_step
from actplan.planning.budget import get_profile, pareto_points
from actplan.planning.choose import config_for
from actplan.planning.planner import BudgetError, PlanProblem, solve
from actplan.planning.profile import ModelProfile
from actplan.sizes import mib
from bench.peer_methods import (
    COMPILE_BACKEND,
    COMPILE_BUDGETS,
    compile_budget_installer,
    compiled_actplan_installer,
    op_sac_matmuls_installer,
    remat_installer,
    remat_version,
    rockmate_unavailable,
    titan_import_error,
    titan_op_sac_installer,
    titan_sac_installer,
    titan_version,
)

RESULTS = Path("bench/results")
SAME_MEMORY = 0.005
"""Rows count as "at the same memory" when within this fraction above the peer's bytes."""

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
AUTOMATIC_PEER_GAIN = 0.10
"""Goal: at an automatic peer's peak, actplan's best row has a step-time ratio at least 10% lower."""


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


@dataclass
class PlannedRow:
    name: str
    offload_allowed: bool
    budget_bytes: int
    for_peers: list[str]
    candidates: list[str]
    predicted_peak_bytes: float
    predicted_ratio: float
    config: dict[str, Any]


def _without_offload(problem: PlanProblem) -> tuple[PlanProblem, list[list[int]]]:
    """The problem with offloading candidates removed, and each kept candidate's old index."""
    kept = [[i for i, c in enumerate(cs) if c.offloaded_bytes == 0] for cs in problem.layers]
    layers = tuple(tuple(cs[i] for i in keep) for cs, keep in zip(problem.layers, kept, strict=True))
    return replace(problem, layers=layers), kept


def plan_rows(profile: ModelProfile, peers: list[Contender]) -> tuple[list[PlannedRow], list[str]]:
    """Planner plans at each peer's measured peak, deduplicated by the choices they make, and
    the budgets no plan fits under (with the planner's reason).

    The budget is the peer's peak plus ``SAME_MEMORY``, the slack the comparison allows: the
    planner's peak model is calibrated to within a fraction of a percent, and without the
    slack a budget equal to whole-layer checkpointing's peak is infeasible by that margin.
    """
    full_problem = profile.problem()
    recompute_problem, index_map = _without_offload(full_problem)
    planned: dict[tuple[int, ...], PlannedRow] = {}
    infeasible: list[str] = []
    for peer in peers:
        budget = peer.peak_bytes * (1 + SAME_MEMORY)
        for offload_allowed, problem in ((True, full_problem), (False, recompute_problem)):
            try:
                solution = solve(problem, budget)
            except BudgetError as err:
                infeasible.append(f"{peer.name}{'' if offload_allowed else ', no offload'}: {err}")
                continue
            choices = solution.choices
            if not offload_allowed:
                choices = tuple(index_map[layer][c] for layer, c in enumerate(choices))
            if choices in planned:
                if peer.name not in planned[choices].for_peers:
                    planned[choices].for_peers.append(peer.name)
                continue
            suffix = "" if offload_allowed else ", no offload"
            planned[choices] = PlannedRow(
                name=f"plan@{peer.peak_bytes / 2**20:.1f}MiB{suffix}",
                offload_allowed=offload_allowed,
                budget_bytes=int(budget),
                for_peers=[peer.name],
                candidates=list(solution.names),
                predicted_peak_bytes=solution.predicted_peak_bytes,
                predicted_ratio=solution.predicted_seconds / profile.base_seconds,
                config=config_for(profile, choices).to_dict(),
            )
    return list(planned.values()), infeasible


def compare(rows: list[PolicyRow], kinds: dict[str, str], by: str) -> list[dict[str, Any]]:
    """Per peer: the fastest actplan row at no more memory (``by``: peak or activation bytes)."""
    out = []
    ours = [r for r in rows if kinds[r.name] in ("preset", "plan", "compiled") and r.parity_ok]
    for peer in (r for r in rows if kinds[r.name] in ("peer", "automatic-peer")):
        limit = getattr(peer, by) * (1 + SAME_MEMORY)
        fitting = [r for r in ours if getattr(r, by) <= limit]
        entry: dict[str, Any] = {
            "peer": peer.name,
            "peer_bytes": getattr(peer, by),
            "peer_ratio": peer.ratio_to_none,
        }
        entry["peer_spread"] = peer.ratio_spread
        entry["automatic"] = kinds[peer.name] == "automatic-peer"
        for label, pool in (
            ("best", fitting),
            ("best_recompute_only", [r for r in fitting if r.offloaded_bytes is None]),
            ("best_compiled", [r for r in fitting if kinds[r.name] == "compiled"]),
        ):
            if not pool:
                entry[label] = None
                continue
            best = min(pool, key=lambda r: r.ratio_to_none)
            overhead_cut = (
                1 - (best.ratio_to_none - 1) / (peer.ratio_to_none - 1) if peer.ratio_to_none > 1 else None
            )
            entry[label] = {
                "name": best.name,
                "bytes": getattr(best, by),
                "ratio": best.ratio_to_none,
                "spread": best.ratio_spread,
                "ratio_vs_peer": best.ratio_to_none / peer.ratio_to_none,
                "overhead_cut": overhead_cut,
                "at_least_as_fast": best.ratio_to_none <= peer.ratio_to_none,
            }
        out.append(entry)
    return out


def evaluate_goals(comparisons: list[dict[str, Any]]) -> list[dict[str, Any]]:
    goals = []
    for c in comparisons:
        best = c["best"]
        goals.append(
            {
                "goal": f"at {c['peer']}'s peak, an actplan row at least as fast",
                "value": best["ratio_vs_peer"] if best else None,
                "met": bool(best and best["at_least_as_fast"]),
            }
        )
        if c.get("automatic"):
            value = best["ratio_vs_peer"] if best else None
            goals.append(
                {
                    "goal": f"at {c['peer']}'s peak, an actplan row at least "
                    f"{AUTOMATIC_PEER_GAIN:.0%} faster (ratio to none at most "
                    f"{1 - AUTOMATIC_PEER_GAIN:.2f}x the peer's)",
                    "value": value,
                    "met": value is not None and value <= 1 - AUTOMATIC_PEER_GAIN,
                }
            )
        if c["peer"] == TORCH_CHECKPOINT:
            cut = best["overhead_cut"] if best else None
            goals.append(
                {
                    "goal": "at whole-layer checkpointing's peak, at least 15% less step-time overhead",
                    "value": cut,
                    "met": cut is not None and cut >= 0.15,
                }
            )
    return goals


# -- CPU-side overhead -------------------------------------------------------------------------

OVERHEAD_ROWS: tuple[tuple[str, Callable[[], Installer]], ...] = (
    ("none", lambda: config_installer(RecomputeConfig.from_preset("none"))),
    (TORCH_CHECKPOINT, lambda: torch_checkpoint_installer),
    ("full", lambda: config_installer(RecomputeConfig.from_preset("full"))),
    ("remat-full", lambda: remat_installer("full")),
    ("attn", lambda: config_installer(RecomputeConfig.from_preset("attn"))),
    ("remat-attn", lambda: remat_installer("attn")),
    ("matmuls", lambda: config_installer(RecomputeConfig.from_preset("matmuls"))),
    ("remat-matmuls", lambda: remat_installer("matmuls")),
    ("op-sac-matmuls", lambda: op_sac_matmuls_installer),
)
OVERHEAD_PAIRS = (
    ("full", TORCH_CHECKPOINT),
    ("full", "remat-full"),
    ("attn", "remat-attn"),
    ("matmuls", "remat-matmuls"),
    ("matmuls", "op-sac-matmuls"),
)
"""(actplan row, peer row) pairs whose per-layer CPU overheads are compared; these peers save the
same regions as actplan. The torchtitan row (``titan_entry``), which saves a different set, is
added to the rows and paired with ``matmuls``."""


def cpu_overhead(
    model: str, *, layers: int = 8, repeats: int = 40, steps: int = 4, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Per checkpointed layer, the extra time of a training step over ``none`` at tiny shapes.

    Each timed sample runs ``steps`` training steps; rounds are interleaved, and a row's
    overhead is the median over rounds of (its time - none's time in the same round).
    """
    bundle = build_model(model, "tiny", n_layers=layers)
    batch = bundle.make_batch(0)
    device = torch.device("cpu")
    titan_name, titan_install, _ = titan_entry()
    rows = [*((name, make()) for name, make in OVERHEAD_ROWS), (titan_name, titan_install)]
    contenders = [prepare_contender(bundle, name, install, batch, device) for name, install in rows]
    parity = {
        r.name: r.parity_ok
        for r in policy_rows(contenders, time_contenders(contenders, batch, repeats=1, warmup=0))
    }

    def run(contender: Contender) -> None:
        for _ in range(steps):
            _step(contender, batch)

    progress(
        f"timing CPU overhead ({model} tiny, {layers} layers, {len(contenders)} rows x {repeats} rounds)"
    )
    timings = interleaved_timing(
        {c.name: (lambda c=c: run(c)) for c in contenders}, repeats=repeats, warmup=3
    )
    none = timings["none"].samples
    per_layer_us: dict[str, dict[str, float]] = {}
    for c in contenders:
        if c.name == "none":
            continue
        extra = sorted(
            (t - n) / (layers * steps) * 1e6 for t, n in zip(timings[c.name].samples, none, strict=True)
        )
        per_layer_us[c.name] = {
            "median": statistics.median(extra),
            "q25": extra[len(extra) // 4],
            "q75": extra[(3 * len(extra)) // 4],
        }
    pairs = []
    for ours, peer in (*OVERHEAD_PAIRS, ("matmuls", titan_name)):
        value = per_layer_us[ours]["median"] / per_layer_us[peer]["median"]
        pairs.append({"actplan": ours, "peer": peer, "ratio": value, "met": value <= 1.0})
    return {
        "model": bundle.description,
        "layers": layers,
        "steps_per_sample": steps,
        "rounds": repeats,
        "step_median_s": {name: stats.median for name, stats in timings.items()},
        "overhead_per_layer_us": per_layer_us,
        "pairs": pairs,
        "parity_ok": parity,
    }


def _step(contender: Contender, batch: dict[str, torch.Tensor]) -> None:
    train_step(contender.model, batch, contender.optimizer)


# -- one model ---------------------------------------------------------------------------------


def run_model(
    model: str,
    size: str,
    *,
    repeats: int,
    warmup: int,
    overhead_repeats: int,
    cache_dir: Path | None,
    progress: Callable[[str], None],
    compile_budgets: tuple[float, ...] = COMPILE_BUDGETS,
) -> dict[str, Any]:
    bundle = build_model(model, size)
    batch = bundle.make_batch(0)
    device = torch.device("cpu")
    kinds: dict[str, str] = {"none": "baseline"}
    rockmate_reason = rockmate_unavailable(bundle.model, batch)
    skipped: list[dict[str, str]] = [{"peer": "rockmate", "reason": rockmate_reason}]
    titan_name, _, titan_source = titan_entry()
    if titan_name != "titan-sac":
        skipped.append({"peer": "torchtitan's own AC", "reason": titan_source})
    for entry in skipped:
        progress(f"{model} {size}: skipping {entry['peer']}: {entry['reason']}")
    entries: list[tuple[str, Installer]] = [("none", config_installer(RecomputeConfig.from_preset("none")))]
    for name, install in peer_entries(model):
        entries.append((name, install))
        kinds[name] = "peer"
    for preset in ACTPLAN_PRESETS:
        entries.append((preset, config_installer(policy_config(preset))))
        kinds[preset] = "preset"
    contenders = []
    for name, install in entries:
        progress(f"{model} {size}: parity and memory of {name}")
        contenders.append(prepare_contender(bundle, name, install, batch, device))

    compiled_layers = model in COMPILED_MODELS
    compile_floor = None
    if compile_budgets:
        compiled_entries = [
            (compile_peer_name(b), compile_budget_installer(b, fullgraph=compiled_layers), "automatic-peer")
            for b in sorted(set(compile_budgets) | {1.0}, reverse=True)  # 1.0 first: the noise floor
        ]
        if compiled_layers:
            compiled_entries += [
                (f"{preset}, compiled", compiled_actplan_installer(policy_config(preset)), "compiled")
                for preset in COMPILED_PRESETS
            ]
        for name, install, kind in compiled_entries:
            progress(f"{model} {size}: compile, parity and memory of {name}")
            contender = prepare_contender(bundle, name, install, batch, device, compiled=True)
            if compile_floor is None:
                compile_floor = compare_steps(contenders[0].capture, contender.capture).max_abs_grad_diff
            _allow_compile_noise(contender, compile_floor)
            contenders.append(contender)
            kinds[name] = kind

    progress(f"{model} {size}: profile (cached after the first run)")
    profile, cached = get_profile(
        bundle, model, device, cache_dir=cache_dir, progress=lambda s: progress(f"  {s}")
    )
    peers = [c for c in contenders if kinds[c.name] in ("peer", "automatic-peer")]
    planned, infeasible = plan_rows(profile, peers)
    for plan in planned:
        progress(f"{model} {size}: parity and memory of {plan.name}")
        config = RecomputeConfig.from_dict(plan.config, source=plan.name)
        contenders.append(prepare_contender(bundle, plan.name, config_installer(config), batch, device))
        kinds[plan.name] = "plan"
        automatic = any(kinds[peer] == "automatic-peer" for peer in plan.for_peers)
        if compiled_layers and automatic and not plan.offload_allowed:
            name = f"{plan.name}, compiled"
            progress(f"{model} {size}: compile, parity and memory of {name}")
            install = compiled_actplan_installer(config)
            contender = prepare_contender(bundle, name, install, batch, device, compiled=True)
            _allow_compile_noise(contender, compile_floor)
            contenders.append(contender)
            kinds[name] = "compiled"

    total = len(contenders) * (warmup + repeats)
    done = 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if done % len(contenders) == 0:
            rounds = f"{done // len(contenders)} of {warmup + repeats}"
            progress(f"{model} {size}: timing round {rounds} ({total} steps)")

    timings = time_contenders(contenders, batch, repeats=repeats, warmup=warmup, progress=tick)
    rows = policy_rows(contenders, timings)
    by_peak = compare(rows, kinds, "peak_bytes")
    by_activations = compare(rows, kinds, "activation_bytes")
    overhead = cpu_overhead(model, repeats=overhead_repeats, progress=progress) if overhead_repeats else None
    return {
        "model": bundle.description,
        "model_name": model,
        "size": size,
        "device": str(device),
        "torch_version": torch.__version__,
        "torch_remat_version": remat_version(),
        "machine": machine_summary(),
        "command": " ".join(["python -m bench.peers", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "repeats": repeats,
        "warmup": warmup,
        "profile_from_cache": cached,
        "torchtitan": titan_source,
        "compile_backend": COMPILE_BACKEND if compile_budgets else None,
        "compile_grad_floor": compile_floor,
        "skipped_peers": skipped,
        "rows": [{**asdict(r), "kind": kinds[r.name]} for r in rows],
        "plans": [asdict(p) for p in planned],
        "budgets_without_a_plan": infeasible,
        "same_memory_tolerance": SAME_MEMORY,
        "at_same_peak": by_peak,
        "at_same_activation_bytes": by_activations,
        "goals": evaluate_goals(by_peak),
        "cpu_overhead": overhead,
        "pareto": [asdict(p) for p in pareto_points(profile)],
    }


def _allow_compile_noise(contender: Contender, floor: float) -> None:
    """Parity tolerances of a compiled row, from the compile noise floor measured in this run."""
    contender.grad_atol = COMPILE_GRAD_FLOOR_FACTOR * floor + COMPILE_GRAD_FLOOR_SLACK
    contender.loss_atol = COMPILE_LOSS_ATOL


# -- reports -----------------------------------------------------------------------------------


def _fmt_best(best: dict[str, Any] | None) -> str:
    if best is None:
        return "none fits | - | -"
    cut = "-" if best["overhead_cut"] is None else f"{best['overhead_cut']:+.0%}"
    return f"{best['name']} | {best['ratio']:.3f} ± {best['spread']:.3f} | {cut}"


def to_markdown(out: dict[str, Any]) -> str:
    lines = [
        f"# actplan and its peers: {out['model']}",
        "",
        f"- command: `{out['command']}`",
        f"- device: {out['device']}; torch {out['torch_version']}; torch_remat {out['torch_remat_version']}; "
        f"{out['machine']}",
        f"- started: {out['started']}; timing: {out['warmup']} warm-up + {out['repeats']} interleaved "
        "rounds, median and interquartile spread of the ratio to `none`",
        f"- torchtitan: {out['torchtitan']}",
    ]
    if out["compile_backend"]:
        lines.append(
            f"- compiled rows: each layer compiled with `backend=\"{out['compile_backend']}\"`; parity "
            f"allows the loss within {COMPILE_LOSS_ATOL:g} and gradients within "
            f"{COMPILE_GRAD_FLOOR_FACTOR:g} x {out['compile_grad_floor']:.1e} (the largest gradient "
            f"difference compiling alone makes, this run) + {COMPILE_GRAD_FLOOR_SLACK:g}"
        )
    for entry in out["skipped_peers"]:
        lines.append(f"- not run: {entry['peer']}: {entry['reason']}")
    lines += [
        "",
        "## Rows",
        "",
        "| row | kind | parity | activations @ fwd end (MiB) | peak (MiB) | ratio to none |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(out["rows"], key=lambda r: (r["peak_bytes"], r["ratio_to_none"])):
        parity = "ok" if r["parity_ok"] else "FAILED"
        if r["grad_atol"]:
            parity += f" (dgrad {r['max_abs_grad_diff']:.1e})"
        lines.append(
            f"| {r['name']} | {r['kind']} | {parity} | {mib(r['activation_bytes'])} | "
            f"{mib(r['peak_bytes'])} | {r['ratio_to_none']:.3f} ± {r['ratio_spread']:.3f} |"
        )
    for title, key in (
        ("At each peer's peak", "at_same_peak"),
        ("At each peer's activation bytes (end of forward)", "at_same_activation_bytes"),
    ):
        lines += [
            "",
            f"## {title}",
            "",
            "Fastest actplan row (preset or plan, parity ok) within "
            f"{out['same_memory_tolerance']:.1%} of the peer's bytes; "
            "overhead cut = 1 - (ours - 1) / (peer - 1).",
            "",
            "| peer | peer MiB | peer ratio | actplan row | its ratio | overhead cut "
            "| recompute-only row | its ratio | overhead cut |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in out[key]:
            lines.append(
                f"| {c['peer']} | {mib(c['peer_bytes'])} | {c['peer_ratio']:.3f} ± {c['peer_spread']:.3f} | "
                f"{_fmt_best(c['best'])} | {_fmt_best(c['best_recompute_only'])} |"
            )
    automatic = [c for c in out["at_same_peak"] if c.get("automatic")]
    if automatic:
        lines += [
            "",
            "## Automatic peers: torch.compile's activation_memory_budget",
            "",
            "At each budget's measured peak (within "
            f"{out['same_memory_tolerance']:.1%}): the fastest actplan row of any kind, its ratio to the "
            f"peer's (goal: at most {1 - AUTOMATIC_PEER_GAIN:.2f}), and the fastest actplan row with "
            "compiled layers.",
            "",
            "| peer | peak (MiB) | peer ratio | actplan row | its ratio | / peer | compiled actplan row "
            "| its ratio | / peer |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in automatic:
            cells = []
            for best in (c["best"], c["best_compiled"]):
                if best is None:
                    cells.append("none fits | - | -")
                else:
                    cells.append(
                        f"{best['name']} | {best['ratio']:.3f} ± {best['spread']:.3f} | "
                        f"{best['ratio_vs_peer']:.3f}"
                    )
            lines.append(
                f"| {c['peer']} | {mib(c['peer_bytes'])} | {c['peer_ratio']:.3f} ± {c['peer_spread']:.3f} | "
                f"{cells[0]} | {cells[1]} |"
            )
    lines += ["", "## Goals", ""]
    for g in out["goals"]:
        value = "-" if g["value"] is None else f"{g['value']:.3f}"
        lines.append(f"- {'met' if g['met'] else 'NOT met'}: {g['goal']} (measured {value})")
    if out["plans"] or out["budgets_without_a_plan"]:
        lines += ["", "## Plans", ""]
        for p in out["plans"]:
            lines.append(
                f"- {p['name']} (for {', '.join(p['for_peers'])}): predicted peak "
                f"{mib(p['predicted_peak_bytes'])} MiB, ratio {p['predicted_ratio']:.3f}; "
                f"layers: {', '.join(p['candidates'])}"
            )
    for reason in out["budgets_without_a_plan"]:
        lines.append(f"- no plan at {reason}")
    overhead = out["cpu_overhead"]
    if overhead:
        lines += [
            "",
            f"## CPU-side overhead per checkpointed layer ({overhead['model']})",
            "",
            f"{overhead['rounds']} interleaved rounds of {overhead['steps_per_sample']} training steps; "
            "per round, (row - none) / (layers x steps).",
            "",
            "| row | µs per layer per step (median) | quartiles | parity |",
            "|---|---|---|---|",
        ]
        for name, v in overhead["overhead_per_layer_us"].items():
            parity = "ok" if overhead["parity_ok"][name] else "FAILED"
            lines.append(f"| {name} | {v['median']:.0f} | {v['q25']:.0f}-{v['q75']:.0f} | {parity} |")
        lines += ["", "| actplan | peer | overhead ratio | <= 1.0 |", "|---|---|---|---|"]
        for p in overhead["pairs"]:
            lines.append(
                f"| {p['actplan']} | {p['peer']} | {p['ratio']:.2f} | {'met' if p['met'] else 'NOT met'} |"
            )
    lines += ["", f"![Pareto plot](peers_{out['model_name']}_{out['size']}.png)", ""]
    return "\n".join(lines)


def write_plot(out: dict[str, Any], path: Path) -> None:
    """Peak (x) against step-time ratio (y): the planner's predicted front, and every measured row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    front = sorted((p for p in out["pareto"] if p["kind"] == "plan"), key=lambda p: p["peak_bytes"])
    ax.plot(
        [p["peak_bytes"] / 2**20 for p in front],
        [p["time_ratio"] for p in front],
        "-",
        drawstyle="steps-post",
        color="tab:blue",
        alpha=0.5,
        label="planner, predicted (budget sweep)",
    )
    styles = {
        "baseline": ("o", "black", "no checkpointing"),
        "peer": ("^", "tab:red", "peers"),
        "automatic-peer": ("v", "tab:orange", f"torch.compile, activation_memory_budget ({COMPILE_BACKEND})"),
        "compiled": ("D", "tab:green", "actplan, compiled layers"),
        "preset": ("s", "tab:gray", "actplan presets"),
        "plan": ("*", "tab:blue", "actplan plans at a peer's peak"),
    }
    seen = set()
    for r in out["rows"]:
        marker, color, label = styles[r["kind"]]
        ax.plot(
            r["peak_bytes"] / 2**20,
            r["ratio_to_none"],
            marker,
            color=color,
            markersize=10 if r["kind"] == "plan" else 7,
            label=None if r["kind"] in seen else label,
        )
        seen.add(r["kind"])
        if r["kind"] in ("peer", "automatic-peer", "baseline"):
            ax.annotate(
                r["name"],
                (r["peak_bytes"] / 2**20, r["ratio_to_none"]),
                xytext=(5, 4),
                textcoords="offset points",
                fontsize=7,
                color=color,
            )
    ax.set_xlabel("peak memory of a training step (MiB)")
    ax.set_ylabel("step time / no checkpointing (measured)")
    ax.set_title(textwrap.fill(f"{out['model']} (CPU, torch {out['torch_version']})", 100), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe")
    parser.add_argument("--size", default="small")
    parser.add_argument("--repeats", type=int, default=5, help="timed interleaved rounds")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--overhead-repeats",
        type=int,
        default=40,
        help="rounds of the tiny-shape CPU overhead timing (0: skip)",
    )
    parser.add_argument(
        "--compile-budgets",
        default=",".join(str(b) for b in COMPILE_BUDGETS),
        help="activation_memory_budget values of the torch.compile peers, comma-separated; 1.0 (the "
        "noise-floor row) is always added; an empty string skips every compiled row",
    )
    parser.add_argument("--cache-dir", help="profile cache (default ~/.cache/actplan/profiles)")
    parser.add_argument("--out", default=str(RESULTS), help="where the results go")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MEGATRON_CHOICES]
    if unknown:
        parser.error(f"--models takes {', '.join(MEGATRON_CHOICES)}; got {', '.join(unknown)}")
    wrong_budgets = f"--compile-budgets takes numbers from 0 to 1, e.g. 0.1,0.5; got {args.compile_budgets!r}"
    try:
        budgets = tuple(float(b) for b in args.compile_budgets.split(",") if b.strip())
    except ValueError:
        parser.error(wrong_budgets)
    if any(not 0 <= b <= 1 for b in budgets):
        parser.error(wrong_budgets)
    out_dir = Path(args.out)
    ok = True
    for model in models:
        out = run_model(
            model,
            args.size,
            repeats=args.repeats,
            warmup=args.warmup,
            overhead_repeats=args.overhead_repeats,
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
            progress=lambda s: print(s, file=sys.stderr, flush=True),
            compile_budgets=budgets,
        )
        stem = out_dir / f"peers_{model}_{args.size}"
        stem.with_suffix(".json").parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
        write_plot(out, stem.with_suffix(".png"))
        report = to_markdown(out)
        stem.with_suffix(".md").write_text(report)
        print(report)
        ok = ok and all(r["parity_ok"] for r in out["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
