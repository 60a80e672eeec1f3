"""One model's run of the peers bench: the rows (no checkpointing, the peers, actplan's presets,
the compiled rows, plans at each peer's peak) prepared on the same weights and batch, timed
interleaved, compared at equal memory, and gathered into the report's record."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from actplan.config import RecomputeConfig
from actplan.evaluate.bench import machine_summary, policy_config
from actplan.evaluate.contenders import Installer, PolicyRow
from actplan.evaluate.runner import RowRunner, RowSpec
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
    automatic_peer_entries,
    build_bench_model,
    compiled_installer,
    peer_entries,
    titan_entry,
)

CPU = torch.device("cpu")


class _Rows:
    """One model's rows on the evaluate runner, with a progress line per row and per timing round."""

    def __init__(
        self, bundle: ModelBundle, batch: dict[str, torch.Tensor], label: str, progress, repeats, warmup
    ):
        self.label, self.progress = label, progress
        self.runner = RowRunner(bundle, batch, CPU, repeats=repeats, warmup=warmup)
        self.runner.progress = self._tick
        self._timed = 0

    @property
    def kinds(self) -> dict[str, str]:
        return {row.name: row.kind for row in self.runner.rows}

    def start(self, install: Installer) -> None:
        self.progress(f"{self.label}: parity and memory of none")
        self.runner.start(install)

    def prepare(self, spec: RowSpec) -> PolicyRow:
        """One row's parity step and metered step on its own copy of the model."""
        what = "compile, parity and memory" if spec.compiled else "parity and memory"
        self.progress(f"{self.label}: {what} of {spec.name}")
        return self.runner.add(spec)

    def _tick(self, label: str) -> None:
        self._timed += 1
        count = len(self.runner.rows)
        if self._timed % count == 0:
            rounds = self.runner.warmup + self.runner.repeats
            self.progress(
                f"{self.label}: timing round {self._timed // count} of {rounds} ({rounds * count} steps)"
            )


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
    rows = _Rows(bundle, batch, f"{model} {size}", progress, repeats, warmup)
    _add_eager_rows(rows, model)
    compile_floor = _add_compiled_rows(rows, model, compile_budgets)
    progress(f"{model} {size}: profile (cached after the first run)")
    profile, cached = get_profile(
        bundle, model, CPU, cache_dir=cache_dir, progress=lambda s: progress(f"  {s}")
    )
    planned, infeasible = _add_plan_rows(rows, profile, model)
    measured = rows.runner.finish()
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
        "rows": [asdict(r) for r in measured],
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
    rows.start(actplan_installer(model, RecomputeConfig.from_preset("none")))
    for name, install in peer_entries(model):
        rows.prepare(RowSpec(name, install, "peer"))
    for preset in ACTPLAN_PRESETS:
        rows.prepare(RowSpec(preset, actplan_installer(model, policy_config(preset))))


def _add_compiled_rows(rows: _Rows, model: str, compile_budgets: tuple[float, ...]) -> float | None:
    """The torch.compile peers (budget 1.0 first: it saves what ``none`` saves, so its difference
    from ``none`` is the compile noise floor) and, where layers compile whole, actplan's presets
    with compiled layers; returns the noise floor (None: no compiled rows)."""
    if not compile_budgets:
        return None
    specs = [
        RowSpec(name, install, "automatic-peer", compiled=True, floor=position == 0)
        for position, (name, install) in enumerate(automatic_peer_entries(model, compile_budgets))
    ]
    if model in COMPILED_MODELS:
        specs += [
            RowSpec(
                f"{preset}, compiled",
                compiled_installer(model, policy_config(preset)),
                "compiled",
                compiled=True,
            )
            for preset in COMPILED_PRESETS
        ]
    for spec in specs:
        rows.prepare(spec)
    return rows.runner.noise["compile_grad"]


def _add_plan_rows(rows: _Rows, profile: ModelProfile, model: str) -> tuple[list[PlannedRow], list[str]]:
    """Plans at each peer's measured peak (and, at an automatic peer's peak where layers compile
    whole, the recompute-only plan with compiled layers); returns them and the budgets with none."""
    kinds = rows.kinds
    peers = [row for row in rows.runner.rows if kinds[row.name] in ("peer", "automatic-peer")]
    planned, infeasible = plan_rows(profile, peers)
    for plan in planned:
        config = RecomputeConfig.from_dict(plan.config, source=plan.name)
        rows.prepare(RowSpec(plan.name, actplan_installer(model, config), "plan"))
        automatic = any(kinds[peer] == "automatic-peer" for peer in plan.for_peers)
        if model in COMPILED_MODELS and automatic and not plan.offload_allowed:
            rows.prepare(
                RowSpec(
                    f"{plan.name}, compiled", compiled_installer(model, config), "compiled", compiled=True
                )
            )
    return planned, infeasible


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
