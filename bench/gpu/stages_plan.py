"""The GPU suite's planner stages: ``actplan plan`` at two budgets, predicted against measured;
and ``bench.peers.main`` on the device, with plans at each peer's metered peak."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from actplan.evaluate.bench import policy_config
from actplan.evaluate.contenders import PolicyRow, config_installer
from actplan.evaluate.runner import release_cache
from actplan.models import ModelBundle
from actplan.sizes import mib
from bench.gpu.context import StageContext, say
from bench.gpu.models import batch_on
from bench.gpu.report import StageReport, fmt_value
from bench.gpu.rows import RowRunner, RowSpec, meter_check, rows_markdown

PLAN_SHARES = (0.5, 0.15)
"""The two budgets of ``stage_plan``: these shares of the way from ``full``'s peak to ``none``'s."""


def _profile(ctx: StageContext, bundle: ModelBundle, model: str) -> tuple[Any, bool]:
    """The model's profile, shared by the stages through the suite's profile cache."""
    from actplan.planning.cache import get_profile

    return get_profile(
        bundle,
        ctx.profile_name(model),
        ctx.device,
        cache_dir=ctx.cache_dir,
        repeats=ctx.settings.profile_repeats,
        progress=lambda s: say(f"  {s}"),
    )


# -- stage plan --------------------------------------------------------------------------------


def stage_plan(ctx: StageContext, report: StageReport) -> None:
    """``actplan plan`` at two budgets between ``full``'s and ``none``'s peak; the two plans run
    side by side against ``none``."""
    spec = ctx.spec("dense")
    bundle = spec.build(ctx.device)
    batch = batch_on(bundle, ctx.device)
    profile, cached = _profile(ctx, bundle, "dense")
    report.data.update(model=f"{bundle.description}, {spec.dtype}", profile_seconds=profile.seconds_spent)
    report.headline(f"profile: {profile.seconds_spent:.0f} s{' (cached)' if cached else ''}")
    plans = _plans_at_two_budgets(ctx, report, bundle, profile)
    rows = _run_plans(RowRunner(ctx, bundle, batch, report, "dense"), report, plans)
    report.markdown += [
        "## Predicted against measured",
        "",
        "| budget (MiB) | candidates | peak predicted / meter / max_memory_allocated (MiB) "
        "| time ratio predicted / measured |",
        "|---|---|---|---|",
    ]
    for plan, row in zip(plans, rows[1:], strict=False):
        _predicted_against_measured(report, plan, row)
    meter_check(ctx, report, rows)
    report.markdown += ["", *rows_markdown(report.data["model"], rows, ctx.cuda)]
    _roofline_against_measured(ctx, report, bundle, profile)


def roofline_name(device: Any) -> str:
    """The roofline table's entry for this device (``h100`` where the table has none)."""
    from actplan.measure import ACCELERATORS

    if getattr(device, "type", None) != "cuda":
        return "h100"
    name = torch.cuda.get_device_name(device).lower()
    return next((key for key in ACCELERATORS if key in name), "h100")


def _roofline_against_measured(ctx: StageContext, report: StageReport, bundle: Any, profile: Any) -> None:
    """The same model profiled on the roofline clock for this GPU (one clocked step per
    candidate, no timer): each candidate's predicted extra time next to the measured one. A
    record for whoever tunes the clock; nothing is checked."""
    from actplan.planning.profile import profile_model

    gpu = roofline_name(ctx.device)
    clocked = profile_model(
        bundle, spec=ctx.profile_name("dense"), device=ctx.device, gpu=gpu, repeats=1,
        progress=lambda event: None,
    )  # fmt: skip
    rows = []
    for measured_type, clocked_type in zip(profile.layer_types, clocked.layer_types, strict=True):
        by_name = {c.name: c for c in clocked_type.candidates}
        for c in measured_type.candidates:
            if c.name in by_name and not c.offload:
                rows.append(
                    {
                        "layer_type": measured_type.class_name,
                        "candidate": c.name,
                        "measured_extra_s": c.extra_seconds,
                        "roofline_extra_s": by_name[c.name].extra_seconds,
                        "measured_layer_s": c.layer_seconds,
                        "roofline_layer_s": by_name[c.name].layer_seconds,
                    }
                )
    report.data["roofline"] = {
        "gpu": gpu,
        "base_seconds": {"measured": profile.base_seconds, "roofline": clocked.base_seconds},
        "candidates": rows,
    }
    report.headline(
        f"roofline {gpu}: step {clocked.base_seconds * 1e3:.1f} ms predicted, "
        f"{profile.base_seconds * 1e3:.1f} ms measured"
    )
    report.markdown += [
        "",
        f"## Roofline clock ({gpu}) against measured",
        "",
        "| layer | candidate | layer ms measured / roofline | extra ms measured / roofline |",
        "|---|---|---|---|",
    ]
    for row in rows:
        report.markdown.append(
            f"| {row['layer_type']} | {row['candidate']} | {row['measured_layer_s'] * 1e3:.2f} / "
            f"{row['roofline_layer_s'] * 1e3:.2f} | {row['measured_extra_s'] * 1e3:.2f} / "
            f"{row['roofline_extra_s'] * 1e3:.2f} |"
        )
    report.write()


def _plans_at_two_budgets(
    ctx: StageContext, report: StageReport, bundle: ModelBundle, profile: Any
) -> list[dict[str, Any]]:
    """``plan_under_budget`` at each of ``PLAN_SHARES``; each plan is written as it comes."""
    from actplan.planning.budget import plan_under_budget

    plans: list[dict[str, Any]] = []
    for share in PLAN_SHARES:
        budget = int(profile.full_peak_bytes + share * (profile.none_peak_bytes - profile.full_peak_bytes))
        result = plan_under_budget(
            bundle, ctx.profile_name("dense"), budget, ctx.device,
            out=ctx.out / f"gpu_plan_{len(plans)}.yaml", run=False,
            cache_dir=ctx.cache_dir, repeats=ctx.settings.profile_repeats,
        )  # fmt: skip
        plans.append({"budget_bytes": budget, "full_to_none_share": share, **result.to_dict()})
        report.data["plans"] = plans
        report.write()
    return plans


def _run_plans(runner: RowRunner, report: StageReport, plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The plans as rows next to ``none``."""
    from actplan.config import RecomputeConfig

    report.data["rows"] = runner.rows
    runner.start()
    for index, plan in enumerate(plans):
        config = RecomputeConfig.from_dict(plan["config"], source=f"plan {index}")
        runner.add(RowSpec(f"plan {index} @{mib(plan['budget_bytes'])}MiB", config_installer(config), "plan"))
        report.write()
    return runner.finish()


def _predicted_against_measured(report: StageReport, plan: dict[str, Any], row: dict[str, Any]) -> None:
    """One plan's predicted peak and time ratio against its row's: recorded, checked, tabled."""
    predicted = plan["solution"]
    plan["measured"] = {k: row.get(k) for k in ("peak_bytes", "cuda_peak_bytes", "ratio_to_none")}
    if "ratio_to_none" in row:
        peak_error = predicted["predicted_peak_bytes"] / row["peak_bytes"] - 1
        time_error = predicted["predicted_ratio"] / row["ratio_to_none"] - 1
        plan["prediction_error"] = {"peak": peak_error, "time_ratio": time_error}
        report.check(
            f"{row['name']}: metered peak within 1% of the budget or under",
            row["peak_bytes"] <= 1.01 * plan["budget_bytes"],
            f"{mib(row['peak_bytes'])} MiB against {mib(plan['budget_bytes'])} MiB",
        )
        report.headline(
            f"{row['name']}: peak {mib(predicted['predicted_peak_bytes'])} predicted, "
            f"{mib(row['peak_bytes'])} metered, {mib(row['cuda_peak_bytes'])} allocated; time "
            f"{predicted['predicted_ratio']:.2f}x predicted, {row['ratio_to_none']:.2f}x measured"
        )
    report.markdown.append(
        f"| {mib(plan['budget_bytes'])} | {', '.join(sorted(set(predicted['candidates'])))} | "
        f"{mib(predicted['predicted_peak_bytes'])} / {mib(row.get('peak_bytes'))} / "
        f"{mib(row.get('cuda_peak_bytes'))} | {predicted['predicted_ratio']:.3f} / "
        f"{fmt_value(row.get('ratio_to_none'))} |"
    )


# -- stage peers -------------------------------------------------------------------------------


@dataclass
class _MeasuredPeak:
    """What ``bench.peers.compare.plan_rows`` reads of a peer: its name and metered peak."""

    name: str
    peak_bytes: int


def _remat_missing() -> bool:
    return importlib.util.find_spec("torch_remat") is None


def stage_peers(ctx: StageContext, report: StageReport) -> None:
    """``bench.peers.main`` on the device: peers, presets, and plans at each peer's metered peak."""
    if _remat_missing():
        report.skip("torch_remat rows", "torch_remat is not importable here (`pip install torch_remat`)")
    report.data["models"] = {}
    for model in ctx.settings.peers_models:
        _peers_of_model(ctx, report, model)
        release_cache(ctx.device)


def _peers_of_model(ctx: StageContext, report: StageReport, model: str) -> None:
    """One model's peers, presets and plans as rows, compared at equal peak and activation bytes."""
    from bench.peers import compare as peers_compare

    spec = ctx.spec(model)
    bundle = spec.build(ctx.device)
    batch = batch_on(bundle, ctx.device)
    entry: dict[str, Any] = {"model": f"{bundle.description}, {spec.dtype}"}
    report.data["models"][model] = entry
    runner = RowRunner(ctx, bundle, batch, report, f"{model} peers")
    entry["rows"] = runner.rows
    runner.start()
    _add_peers_and_presets(runner, report, model)
    runner.flush()
    profile, _ = _profile(ctx, bundle, model)
    entry["budgets_without_a_plan"] = _add_plans(runner, report, profile)
    rows = runner.finish()
    kinds = {r["name"]: r["kind"] for r in rows}
    policy_rows = [PolicyRow.from_record(r) for r in rows if "ratio_to_none" in r]
    entry["at_same_peak"] = peers_compare.compare(policy_rows, kinds, "peak_bytes")
    entry["at_same_activation_bytes"] = peers_compare.compare(policy_rows, kinds, "activation_bytes")
    entry["goals"] = peers_compare.evaluate_goals(entry["at_same_peak"])
    for goal in entry["goals"]:
        report.goal(f"{model}: {goal['goal']}", goal.get("value"), goal.get("met"))
    report.headline(_peers_headline(model, rows, entry["at_same_peak"]))
    meter_check(ctx, report, rows)
    report.markdown += rows_markdown(entry["model"], rows, ctx.cuda)
    report.write()


def _add_peers_and_presets(runner: RowRunner, report: StageReport, model: str) -> None:
    """The peers (torch_remat's only where it imports), then actplan's presets."""
    from bench.peers.rows import ACTPLAN_PRESETS, peer_entries

    for name, install in peer_entries(model):
        if name.startswith("remat-") and _remat_missing():
            continue
        runner.add(RowSpec(name, install, "peer"))
        report.write()
    for preset in ACTPLAN_PRESETS:
        runner.add(RowSpec(preset, config_installer(policy_config(preset))))
        report.write()


def _add_plans(runner: RowRunner, report: StageReport, profile: Any) -> list[str]:
    """Plans at each peer's metered peak as rows; returns the budgets no plan fits under."""
    from actplan.config import RecomputeConfig
    from bench.peers.compare import plan_rows

    measured = [
        _MeasuredPeak(r["name"], r["peak_bytes"])
        for r in runner.rows
        if r["kind"] == "peer" and "peak_bytes" in r
    ]
    planned, infeasible = plan_rows(profile, measured)
    for plan in planned:
        config = RecomputeConfig.from_dict(plan.config, source=plan.name)
        runner.add(RowSpec(plan.name, config_installer(config), "plan"))
        report.write()
    return infeasible


def _peers_headline(model: str, rows: list[dict[str, Any]], at_same_peak: list[dict[str, Any]]) -> str:
    best = [c for c in at_same_peak if c.get("best")]
    return (
        f"{model}: {len(rows)} rows, {sum(not r.get('parity_ok', False) for r in rows)} parity failures; "
        + "; ".join(
            f"{c['peer']} {c['peer_ratio']:.2f}x vs {c['best']['name']} {c['best']['ratio']:.2f}x"
            for c in best
        )
    )
