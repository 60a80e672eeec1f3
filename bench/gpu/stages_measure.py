"""The GPU suite's measuring stages: the CUDA tests, copy bandwidth and layer-input offload,
the bench rows on the dense and MoE models, and the rows with Inductor-compiled layers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from actplan.evaluate.bench import OFFLOAD_VARIANTS, TORCH_CHECKPOINT, policy_config
from actplan.evaluate.contenders import config_installer, torch_checkpoint_installer
from actplan.evaluate.runner import NOISE_FACTOR
from actplan.sizes import mib
from bench.gpu.context import REPO, Determinism, StageContext, deterministic_allowed, say
from bench.gpu.models import batch_on
from bench.gpu.report import StageReport
from bench.gpu.rows import (
    RowRunner,
    RowSpec,
    bench_headline,
    compiled_installer,
    meter_check,
    rows_markdown,
)
from bench.gpu.testlog import TestLog, read_log

BENCH_ROWS = ("none", "full", "attn", "matmuls", "megatron-selective", *OFFLOAD_VARIANTS)


TEST_PARTS = (("eager", "cuda and not compile"), ("compile", "cuda and compile"))
"""The ``tests`` stage's two pytest calls: the eager CUDA tests first, then the Inductor ones,
whose cold compiles take most of the stage, so a stage cut at its cap keeps the eager results."""


def stage_tests(ctx: StageContext, report: StageReport) -> None:
    """``pytest -m cuda`` on ``tests/test_cuda.py`` in two calls (``TEST_PARTS``); each test's
    result is appended to ``gpu_tests.jsonl`` and the report rewritten as it finishes."""
    try:
        import pytest
    except ImportError:
        report.skip("CUDA tests", "pytest is not importable here: `pip install pytest` (or `-e '.[dev]'`)")
        report.data["nothing_ran"] = True
        return
    log_path = tests_log_path(ctx.out, ctx.name)
    log_path.unlink(missing_ok=True)
    report.data.update(results_log=log_path.name, cases=[], pytest_exit_codes={})
    allowed, why_not = deterministic_allowed(ctx.device)
    report.data["deterministic"] = {
        "on": allowed,
        "where": "the parity tests (their `exact` fixture; per test in cases[].properties)",
        "warn_only": True,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "reason_off": why_not,
    }
    for name in ctx.settings.deselected_tests:
        report.skip(name, "left out to fit the 10-minute device run; `--extra` runs it")

    def on_result(case: dict[str, Any]) -> None:
        report.data["cases"].append(case)
        if case["outcome"] in ("failed", "error"):
            report.check(case["name"], False, case["message"])
        report.data["headline"] = [tests_headline(report.data["cases"], None)]
        report.write()

    for part, marker in TEST_PARTS:
        # The repository's pytest settings (markers, pythonpath) whatever file runs.
        args = ["-c", str(REPO / "pyproject.toml"), "--rootdir", str(REPO), "-m", marker]
        args += ["-q", "-p", "no:cacheprovider", ctx.tests_file]
        args += [f"--deselect={ctx.tests_file}::{name}" for name in ctx.settings.deselected_tests]
        say(f"pytest ({part}) " + " ".join(args))
        code = int(pytest.main(args, plugins=[TestLog(log_path, part, on_result)]))
        report.data["pytest_exit_codes"][part] = code
        # 5: nothing collected (every test of the part deselected): not a failure.
        report.check(
            f"pytest -m '{marker}' exit status (0: passed or all skipped)", code in (0, 5), f"exit {code}"
        )
        report.write()
    finish_tests_report(report.data, report.data["cases"], None)
    ops = {op for case in report.data["cases"] for op in case.get("nondeterministic_ops", [])}
    report.data["deterministic"]["nondeterministic_ops"] = sorted(ops)
    report.markdown += tests_markdown(report.data["cases"])


def tests_log_path(out: Path, stage: str) -> Path:
    return out / f"gpu_{stage}.jsonl"


_OUTCOMES = {"passed": ("passed",), "failed": ("failed", "error"), "skipped": ("skipped",)}


def tests_headline(cases: list[dict[str, Any]], running: str | None) -> str:
    counts = {key: sum(c["outcome"] in kinds for c in cases) for key, kinds in _OUTCOMES.items()}
    line = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    if running is not None:
        line += f"; stopped at the cap while running {running.split('::', 1)[-1]}"
    return line


def finish_tests_report(data: dict[str, Any], cases: list[dict[str, Any]], running: str | None) -> None:
    """The parts of a ``tests`` report that depend on every case (headline, skips, whether
    anything ran): at the stage's end, and by the driver on what a killed stage left."""
    data["cases"] = cases
    data["running_when_stopped"] = running
    data["headline"] = [tests_headline(cases, running)]
    skipped = [c for c in cases if c["outcome"] == "skipped"]
    if skipped:
        reasons = sorted({c["message"] for c in skipped})
        data["skipped"].append({"what": f"{len(skipped)} CUDA tests", "reason": "; ".join(reasons)})
    data["nothing_ran"] = bool(cases) and len(skipped) == len(cases) and running is None


def tests_markdown(cases: list[dict[str, Any]]) -> list[str]:
    lines = ["## Tests", "", "| test | part | outcome | seconds | message |", "|---|---|---|---|---|"]
    lines += [
        f"| {c['name']} | {c['part']} | {c['outcome']} | {c['seconds']:.1f} | {c['message']} |" for c in cases
    ]
    return lines


def salvage_tests(out: Path, stage: str, report: dict[str, Any] | None) -> dict[str, Any]:
    """The ``tests`` report of a stage killed before its end, rebuilt from its results log:
    every test that finished, and the one that was running."""
    cases, running = read_log(tests_log_path(out, stage))
    data = report if report is not None else {"stage": stage, "complete": False}
    data.setdefault("skipped", [])
    data.setdefault("checks", [])
    finish_tests_report(data, cases, running)
    named = {c["what"] for c in data["checks"]}
    data["checks"] += [
        {"what": c["name"], "ok": False, "detail": c["message"]}
        for c in cases
        if c["outcome"] in ("failed", "error") and c["name"] not in named
    ]
    if running is not None:
        name = running.split("::", 1)[-1]
        data["checks"].append({"what": f"{name} ended", "ok": False, "detail": "the stage stopped during it"})
    return data


def stage_offload(ctx: StageContext, report: StageReport) -> None:
    """Copy bandwidth, then the layer-input offload figures of ``bench.gpu.offload``."""
    from bench.gpu import offload as gpu_offload

    bandwidth = _copy_bandwidth(ctx, report)
    spec = ctx.spec("dense")
    min_bytes = "64KiB" if ctx.cuda else "0"
    exact = Determinism(ctx.device)
    result = gpu_offload.run_model(
        spec,
        ctx.device,
        ctx.settings.offload_repeats,
        ctx.settings.warmup,
        min_bytes,
        progress=say,
        exact=exact,
    )
    figures = gpu_offload.overlap_figures(result, bandwidth)
    report.data["model"] = result["model"]
    report.data["noise_floor"] = result["noise_floor"]
    report.data["deterministic"] = result["deterministic"]
    report.data["rows"] = result["rows"]
    report.data["layer_input_offload"] = figures
    _offload_checks(ctx, report, result, figures)
    report.headline(
        f"layer-input offload at hidden size {result['hidden_size']}: "
        f"copy {figures['copy_seconds'] * 1e3:.1f} ms, "
        f"exposed {figures['exposed_seconds'] * 1e3:.1f} ms, hidden {figures['hidden_fraction']:.1%}; "
        f"end-of-forward cut {mib(figures['forward_end_cut_bytes'])} MiB for "
        f"{mib(figures['offloaded_bytes'])} MiB offloaded ({figures['forward_end_cut_over_offloaded']:.3f}x)"
    )
    report.markdown += _offload_markdown(result)


def _copy_bandwidth(ctx: StageContext, report: StageReport) -> dict[str, float]:
    """Pinned copy bandwidth both ways, reported (and written) before the offload rows run."""
    from actplan.planning.profile import copy_bandwidth

    bandwidth = copy_bandwidth(ctx.device, ctx.settings.bandwidth_bytes, repeats=5)
    report.data["bandwidth_bytes_per_s"] = bandwidth
    line = (
        f"copy bandwidth (pinned, {mib(ctx.settings.bandwidth_bytes)} MiB): device->host "
        f"{bandwidth['device_to_host'] / 1e9:.1f} GB/s, "
        f"host->device {bandwidth['host_to_device'] / 1e9:.1f} GB/s"
    )
    if not ctx.cuda:
        report.skip("pinned copy bandwidth", "needs CUDA (measured here host to host)")
        line += " (host to host: not a figure)"
    report.headline(line)
    report.write()
    return bandwidth


def _offload_checks(
    ctx: StageContext, report: StageReport, result: dict[str, Any], figures: dict[str, Any]
) -> None:
    """Parity of every offload row, every offloaded byte back, and the overlap and cut goals."""
    floor = result["noise_floor"]
    for label, row in result["rows"].items():
        report.check(
            f"{label}: loss and every gradient within {NOISE_FACTOR:g}x the two-run noise floor of none",
            row["parity_ok"],
            f"loss diff {row['loss_abs_diff']:.2e}, grad diff {row['max_abs_grad_diff']:.2e} "
            f"(allowed {row['grad_atol']:.2e}; floor {floor['grad']:.2e}), "
            f"census {'match' if row['census_match'] else 'MISMATCH'}"
            f"{', bit-exact' if row['bit_exact'] else ''}",
        )
    report.check(
        "full+offload moved bytes and brought every one back",
        figures["offloaded_bytes"] > 0
        and result["rows"]["full+offload"]["reloaded_bytes"]
        + result["rows"]["full+offload"]["reload_skipped_bytes"]
        == figures["offloaded_bytes"],
    )
    hidden, cut = figures["goals"]
    # Overlap needs CUDA streams; the end-of-forward cut is the memory meter's off CUDA, where
    # the host tier is a separate pool: judged everywhere.
    report.goal(hidden["goal"], hidden["value"], hidden["met"] if ctx.cuda else None)
    report.goal(f"{cut['goal']} ({figures['forward_end_source']})", cut["value"], cut["met"])
    if not ctx.cuda:
        report.skip("copy overlap goal", "needs CUDA streams")


def _offload_markdown(result: dict[str, Any]) -> list[str]:
    lines = [
        f"## {result['model']}",
        "",
        f"Noise floor (none twice): loss {result['noise_floor']['loss']:.2e}, "
        f"gradient {result['noise_floor']['grad']:.2e}.",
        "",
        "| row | parity | at end of forward (MiB) | step peak (MiB) | moved out (MiB) | moved back (MiB) "
        "| step (s) | ratio to none |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, row in result["rows"].items():
        parity = ("bit-exact" if row["bit_exact"] else "ok") if row["parity_ok"] else "FAIL"
        lines.append(
            f"| {label} | {parity} | {mib(row['forward_end_bytes'])} | {mib(row['peak_bytes'])} | "
            f"{mib(row['offloaded_bytes'])} | {mib(row['reloaded_bytes'])} | {row['step_median_s']:.3f} | "
            f"{row['ratio_to_none']:.3f} |"
        )
    return lines


def _bench_model(ctx: StageContext, report: StageReport, model: str) -> None:
    bundle = ctx.spec(model).build(ctx.device)
    batch = batch_on(bundle, ctx.device)
    report.data["model"] = f"{bundle.description}, {ctx.spec(model).dtype}"
    runner = RowRunner(ctx, bundle, batch, report, model)
    report.data["rows"] = runner.rows
    runner.start()
    specs = [RowSpec(name, config_installer(policy_config(name))) for name in BENCH_ROWS if name != "none"]
    specs.append(RowSpec(TORCH_CHECKPOINT, torch_checkpoint_installer, "peer"))
    for spec in specs:
        runner.add(spec)
        report.write()
    rows = runner.finish()
    report.headline(bench_headline(rows, model))
    meter_check(ctx, report, rows)
    report.markdown += rows_markdown(report.data["model"], rows, ctx.cuda)


def stage_bench_dense(ctx: StageContext, report: StageReport) -> None:
    _bench_model(ctx, report, "dense")


def stage_bench_moe(ctx: StageContext, report: StageReport) -> None:
    _bench_model(ctx, report, "moe")


def stage_compiled(ctx: StageContext, report: StageReport) -> None:
    """The presets of ``settings.compiled_presets`` with compiled layers, against eager ``none``.

    Deterministic algorithms stay off here: dynamo guards on that setting, so turning it on for
    the parity steps would compile every graph twice. Parity allows the compile noise floor.
    """
    backend = "inductor" if ctx.cuda else "aot_eager"
    if not ctx.cuda:
        report.skip("Inductor", "needs CUDA here; the rows run with the aot_eager backend instead")
    cut = [p for p in ("none", "full", "matmuls") if p not in ctx.settings.compiled_presets]
    if cut:
        report.skip(
            f"{', '.join(cut)} with compiled layers",
            "left out to fit the 10-minute device run; `--extra` runs it",
        )
    torch._dynamo.reset()
    bundle = ctx.spec("dense").build(ctx.device)
    batch = batch_on(bundle, ctx.device)
    report.data["model"] = f"{bundle.description}, {ctx.spec('dense').dtype}"
    report.data["backend"] = backend
    exact = Determinism(
        ctx.device, wanted=False, reason="dynamo guards on it: the graphs would compile twice"
    )
    runner = RowRunner(ctx, bundle, batch, report, "dense", exact=exact)
    report.data["rows"] = runner.rows
    runner.start()
    runner.add_compile_floor("none compiled", backend)  # also what compiling alone changes
    report.write()
    for name in ctx.settings.compiled_presets:
        if name == "none":
            continue
        install = compiled_installer(config_installer(policy_config(name)), backend)
        runner.add(RowSpec(f"{name} compiled", install, "preset", compiled=True))
        report.write()
    rows = runner.finish()
    by_name = {r["name"]: r for r in rows}
    base = by_name.get("none compiled", {})
    others = [f"{name} compiled" for name in ctx.settings.compiled_presets if name != "none"]
    for name in others:
        r = by_name.get(name, {})
        if "ratio_to_none" in r and "ratio_to_none" in base:
            r["ratio_to_compiled_none"] = r["ratio_to_none"] / base["ratio_to_none"]
    parts = [
        f"{n} {by_name[n]['ratio_to_compiled_none']:.2f}x compiled none"
        for n in others
        if "ratio_to_compiled_none" in by_name.get(n, {})
    ]
    if "ratio_to_none" in base:
        parts.insert(0, f"compiled none {base['ratio_to_none']:.2f}x eager none")
    failed = [r["name"] for r in rows if not r.get("parity_ok", False)]
    verdict = "parity within the compile noise floor" if not failed else f"parity FAILED: {', '.join(failed)}"
    report.headline(f"{backend}: {verdict}; " + "; ".join(parts))
    report.markdown += rows_markdown(f"{report.data['model']} ({backend})", rows, ctx.cuda)
