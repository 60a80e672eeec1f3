"""One model's run of the peers bench: the rows (no checkpointing, the peers, actplan's presets,
the compiled rows, plans at each peer's peak) prepared on the same weights and batch, timed
interleaved, compared at equal memory, and gathered into the report's record."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from actplan.config import RecomputeConfig
from actplan.evaluate.bench import machine_summary, policy_config
from actplan.evaluate.contenders import (
    Contender,
    Installer,
    policy_rows,
    prepare_contender,
    time_contenders,
)
from actplan.measure import TimingStats, compare_steps
from actplan.models import ModelBundle
from actplan.planning.budget import pareto_points
from actplan.planning.cache import get_profile
from actplan.planning.profile import ModelProfile
from bench.peers.compare import SAME_MEMORY, PlannedRow, compare, evaluate_goals, plan_rows
from bench.peers.methods import (
    COMPILE_BACKEND,
    COMPILE_BUDGETS,
    remat_version,
    rockmate_unavailable,
    titan_version,
)
from bench.peers.overhead import cpu_overhead
from bench.peers.rows import (
    ACTPLAN_PRESETS,
    COMPILED_MODELS,
    COMPILED_PRESETS,
    TITAN_MODEL_SKIPS,
    TITAN_MODELS,
    actplan_installer,
    allow_compile_noise,
    automatic_peer_entries,
    build_bench_model,
    compiled_installer,
    peer_entries,
    titan_entry,
)

CPU = torch.device("cpu")


@dataclass
class _Rows:
    """The rows of one model's run, in the order they are prepared, and the kind of each."""

    bundle: ModelBundle
    batch: dict[str, torch.Tensor]
    label: str
    progress: Callable[[str], None]
    contenders: list[Contender] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=lambda: {"none": "baseline"})

    def prepare(self, name: str, install: Installer, *, compiled: bool = False) -> Contender:
        """One row's parity step and metered step on its own copy of the model."""
        what = "compile, parity and memory" if compiled else "parity and memory"
        self.progress(f"{self.label}: {what} of {name}")
        contender = prepare_contender(self.bundle, name, install, self.batch, CPU, compiled=compiled)
        self.contenders.append(contender)
        return contender


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
    bundle = build_bench_model(model, size)
    batch = bundle.make_batch(0)
    skipped, titan_source = _skipped_peers(bundle, model, batch, f"{model} {size}", progress)
    rows = _Rows(bundle, batch, f"{model} {size}", progress)
    _add_eager_rows(rows, model)
    compile_floor = _add_compiled_rows(rows, model, compile_budgets)
    progress(f"{model} {size}: profile (cached after the first run)")
    profile, cached = get_profile(
        bundle, model, CPU, cache_dir=cache_dir, progress=lambda s: progress(f"  {s}")
    )
    planned, infeasible = _add_plan_rows(rows, profile, model, compile_floor)
    timings = _time_rows(rows, repeats, warmup)
    measured = policy_rows(rows.contenders, timings)
    by_peak = compare(measured, rows.kinds, "peak_bytes")
    by_activations = compare(measured, rows.kinds, "activation_bytes")
    overhead = cpu_overhead(model, repeats=overhead_repeats, progress=progress) if overhead_repeats else None
    return {
        **_run_header(bundle, model, size, repeats, warmup),
        "profile_from_cache": cached,
        "torchtitan": titan_source,
        "compile_backend": COMPILE_BACKEND if compile_budgets else None,
        "compile_grad_floor": compile_floor,
        "skipped_peers": skipped,
        "rows": [{**asdict(r), "kind": rows.kinds[r.name]} for r in measured],
        "plans": [asdict(p) for p in planned],
        "budgets_without_a_plan": infeasible,
        "same_memory_tolerance": SAME_MEMORY,
        "at_same_peak": by_peak,
        "at_same_activation_bytes": by_activations,
        "goals": evaluate_goals(by_peak),
        "cpu_overhead": overhead,
        "pareto": [asdict(p) for p in pareto_points(profile)],
    }


def _skipped_peers(
    bundle: ModelBundle,
    model: str,
    batch: dict[str, torch.Tensor],
    label: str,
    progress: Callable[[str], None],
) -> tuple[list[dict[str, str]], str]:
    """The peers that give no row here, with why (rockmate always; torchtitan where it does not
    import; on torchtitan's model, the peers that need our model classes), and where the
    torchtitan rows come from."""
    rockmate_reason = rockmate_unavailable(bundle.model, batch)
    skipped: list[dict[str, str]] = [{"peer": "rockmate", "reason": rockmate_reason}]
    titan_name, _, titan_source = titan_entry()
    if model in TITAN_MODELS:
        titan_source = f"torchtitan {titan_version()}: its own model, FullAC, SelectiveAC and MemoryBudgetAC"
        skipped += TITAN_MODEL_SKIPS
    elif titan_name != "titan-sac":
        skipped.append({"peer": "torchtitan's own AC", "reason": titan_source})
    for entry in skipped:
        progress(f"{label}: skipping {entry['peer']}: {entry['reason']}")
    return skipped, titan_source


def _add_eager_rows(rows: _Rows, model: str) -> None:
    """``none``, the peers, then actplan's presets."""
    entries: list[tuple[str, Installer]] = [
        ("none", actplan_installer(model, RecomputeConfig.from_preset("none")))
    ]
    for name, install in peer_entries(model):
        entries.append((name, install))
        rows.kinds[name] = "peer"
    for preset in ACTPLAN_PRESETS:
        entries.append((preset, actplan_installer(model, policy_config(preset))))
        rows.kinds[preset] = "preset"
    for name, install in entries:
        rows.prepare(name, install)


def _add_compiled_rows(rows: _Rows, model: str, compile_budgets: tuple[float, ...]) -> float | None:
    """The torch.compile peers (budget 1.0 first: the compile noise floor) and, where layers compile
    whole, actplan's presets with compiled layers; returns the noise floor (None: no compiled rows)."""
    if not compile_budgets:
        return None
    # 1.0 first: the noise floor
    entries = [
        (name, install, "automatic-peer") for name, install in automatic_peer_entries(model, compile_budgets)
    ]
    if model in COMPILED_MODELS:
        entries += [
            (f"{preset}, compiled", compiled_installer(model, policy_config(preset)), "compiled")
            for preset in COMPILED_PRESETS
        ]
    compile_floor = None
    for name, install, kind in entries:
        contender = rows.prepare(name, install, compiled=True)
        if compile_floor is None:
            compile_floor = compare_steps(rows.contenders[0].capture, contender.capture).max_abs_grad_diff
        allow_compile_noise(contender, compile_floor)
        rows.kinds[name] = kind
    return compile_floor


def _add_plan_rows(
    rows: _Rows, profile: ModelProfile, model: str, compile_floor: float | None
) -> tuple[list[PlannedRow], list[str]]:
    """Plans at each peer's measured peak (and, at an automatic peer's peak where layers compile
    whole, the recompute-only plan with compiled layers); returns them and the budgets with none."""
    peers = [c for c in rows.contenders if rows.kinds[c.name] in ("peer", "automatic-peer")]
    planned, infeasible = plan_rows(profile, peers)
    for plan in planned:
        config = RecomputeConfig.from_dict(plan.config, source=plan.name)
        rows.prepare(plan.name, actplan_installer(model, config))
        rows.kinds[plan.name] = "plan"
        automatic = any(rows.kinds[peer] == "automatic-peer" for peer in plan.for_peers)
        if model in COMPILED_MODELS and automatic and not plan.offload_allowed:
            name = f"{plan.name}, compiled"
            contender = rows.prepare(name, compiled_installer(model, config), compiled=True)
            allow_compile_noise(contender, compile_floor)
            rows.kinds[name] = "compiled"
    return planned, infeasible


def _time_rows(rows: _Rows, repeats: int, warmup: int) -> dict[str, TimingStats]:
    """Every row timed in interleaved rounds after the warm-up, with a progress line per round."""
    contenders = rows.contenders
    total = len(contenders) * (warmup + repeats)
    done = 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if done % len(contenders) == 0:
            rounds = f"{done // len(contenders)} of {warmup + repeats}"
            rows.progress(f"{rows.label}: timing round {rounds} ({total} steps)")

    return time_contenders(contenders, rows.batch, repeats=repeats, warmup=warmup, progress=tick)


def _run_header(bundle: ModelBundle, model: str, size: str, repeats: int, warmup: int) -> dict[str, Any]:
    """The record's opening fields: what ran, where, when, with which versions and rounds."""
    return {
        "model": bundle.description,
        "model_name": model,
        "size": size,
        "device": str(CPU),
        "torch_version": torch.__version__,
        "torch_remat_version": remat_version(),
        "machine": machine_summary(),
        "command": " ".join(["python -m bench.peers", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "repeats": repeats,
        "warmup": warmup,
    }
