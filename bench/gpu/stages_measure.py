"""The GPU suite's measuring stages: the CUDA tests, copy bandwidth and layer-input offload,
the bench rows on the dense and MoE models, and the rows with Inductor-compiled layers."""

from __future__ import annotations

import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

from actplan.evaluate.bench import OFFLOAD_VARIANTS, TORCH_CHECKPOINT, policy_config
from actplan.evaluate.contenders import config_installer, torch_checkpoint_installer
from actplan.sizes import mib
from bench.gpu.context import StageContext, say
from bench.gpu.models import batch_on
from bench.gpu.report import StageReport
from bench.gpu.rows import RowRunner, RowSpec, bench_headline, compiled_installer, meter_check, rows_markdown

BENCH_ROWS = ("none", "full", "attn", "matmuls", "megatron-selective", *OFFLOAD_VARIANTS)


def stage_tests(ctx: StageContext, report: StageReport) -> None:
    """``pytest -m cuda tests/test_cuda.py``, results parsed from its JUnit XML."""
    try:
        import pytest
    except ImportError:
        report.skip("CUDA tests", "pytest is not importable here: `pip install pytest` (or `-e '.[dev]'`)")
        report.data["nothing_ran"] = True
        return
    with tempfile.TemporaryDirectory() as scratch:
        xml = Path(scratch) / "junit.xml"
        args = ["-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "tests/test_cuda.py"]
        say("pytest " + " ".join(args))
        code = int(pytest.main(args))
        cases = _junit_cases(xml) if xml.exists() else []
    passed = [c for c in cases if c["outcome"] == "passed"]
    failed = [c for c in cases if c["outcome"] in ("failed", "error")]
    skipped = [c for c in cases if c["outcome"] == "skipped"]
    report.data.update(pytest_exit_code=code, cases=cases)
    report.headline(f"{len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped")
    for case in failed:
        report.check(case["name"], False, case["message"])
    if skipped:
        reasons = sorted({c["message"] for c in skipped})
        report.skip(f"{len(skipped)} CUDA tests", "; ".join(reasons))
    report.data["nothing_ran"] = bool(cases) and len(skipped) == len(cases)
    report.check("pytest -m cuda exit status (0: passed or all skipped)", code in (0, 5), f"exit {code}")
    report.markdown += ["## Tests", "", "| test | outcome | message |", "|---|---|---|"]
    report.markdown += [f"| {c['name']} | {c['outcome']} | {c['message']} |" for c in cases]


def _junit_cases(path: Path) -> list[dict[str, str]]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag == "failure" else child.tag
                message = (child.get("message") or child.text or "").strip().splitlines()[0][:300]
        cases.append({"name": case.get("name", "?"), "outcome": outcome, "message": message})
    return cases


def stage_offload(ctx: StageContext, report: StageReport) -> None:
    """Copy bandwidth, then the layer-input offload figures of ``bench.gpu.offload``."""
    from bench.gpu import offload as gpu_offload

    bandwidth = _copy_bandwidth(ctx, report)
    spec = ctx.spec("dense")
    min_bytes = "64KiB" if ctx.cuda else "0"
    result = gpu_offload.run_model(
        spec, ctx.device, ctx.settings.repeats + 2, ctx.settings.warmup, min_bytes, progress=say
    )
    figures = gpu_offload.overlap_figures(result, bandwidth)
    report.data["model"] = result["model"]
    report.data["rows"] = result["rows"]
    report.data["layer_input_offload"] = figures
    _offload_checks(ctx, report, result, figures)
    report.headline(
        f"layer-input offload at hidden size {result['hidden_size']}: "
        f"copy {figures['copy_seconds'] * 1e3:.1f} ms, "
        f"exposed {figures['exposed_seconds'] * 1e3:.1f} ms, hidden {figures['hidden_fraction']:.1%}; "
        f"peak cut {mib(figures['peak_cut_bytes'])} MiB for {mib(figures['offloaded_bytes'])} MiB offloaded"
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
    """Parity of every offload row, every offloaded byte back, and the overlap and peak-cut goals."""
    for label, row in result["rows"].items():
        report.check(
            f"{label}: loss identical to none, gradient norm within 1e-6",
            row["loss_identical"] and row["grad_norm_rel_diff"] < 1e-6,
            f"rel diff {row['grad_norm_rel_diff']:.1e}",
        )
    report.check(
        "full+offload moved bytes and brought every one back",
        figures["offloaded_bytes"] > 0
        and result["rows"]["full+offload"]["reloaded_bytes"]
        + result["rows"]["full+offload"]["reload_skipped_bytes"]
        == figures["offloaded_bytes"],
    )
    for goal in figures["goals"]:
        report.goal(goal["goal"], goal["value"], goal["met"] if ctx.cuda else None)
    if not ctx.cuda:
        report.skip("copy overlap and peak cut goals", "need CUDA streams and max_memory_allocated")


def _offload_markdown(result: dict[str, Any]) -> list[str]:
    lines = [
        f"## {result['model']}",
        "",
        "| row | peak (MiB) | moved out (MiB) | moved back (MiB) | step (s) | ratio to none |",
        "|---|---|---|---|---|---|",
    ]
    for label, row in result["rows"].items():
        lines.append(
            f"| {label} | {mib(row['peak_bytes'])} | {mib(row['offloaded_bytes'])} | "
            f"{mib(row['reloaded_bytes'])} | {row['step_median_s']:.3f} | {row['ratio_to_none']:.3f} |"
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
    """``none``, ``full``, ``matmuls`` with compiled layers, against eager ``none``."""
    backend = "inductor" if ctx.cuda else "aot_eager"
    if not ctx.cuda:
        report.skip("Inductor", "needs CUDA here; the rows run with the aot_eager backend instead")
    torch._dynamo.reset()
    bundle = ctx.spec("dense").build(ctx.device)
    batch = batch_on(bundle, ctx.device)
    report.data["model"] = f"{bundle.description}, {ctx.spec('dense').dtype}"
    report.data["backend"] = backend
    runner = RowRunner(ctx, bundle, batch, report, "dense")
    report.data["rows"] = runner.rows
    runner.start()
    runner.compile_floor(backend)
    report.write()
    for name in ("none", "full", "matmuls"):
        install = compiled_installer(config_installer(policy_config(name)), backend)
        runner.add(RowSpec(f"{name} compiled", install, "preset", compiled=True))
        report.write()
    rows = runner.finish()
    by_name = {r["name"]: r for r in rows}
    base = by_name.get("none compiled", {})
    for name in ("full compiled", "matmuls compiled"):
        r = by_name.get(name, {})
        if "ratio_to_none" in r and "ratio_to_none" in base:
            r["ratio_to_compiled_none"] = r["ratio_to_none"] / base["ratio_to_none"]
    parts = [
        f"{n} {by_name[n]['ratio_to_compiled_none']:.2f}x compiled none"
        for n in ("full compiled", "matmuls compiled")
        if "ratio_to_compiled_none" in by_name.get(n, {})
    ]
    if "ratio_to_none" in base:
        parts.insert(0, f"compiled none {base['ratio_to_none']:.2f}x eager none")
    failed = [r["name"] for r in rows if not r.get("parity_ok", False)]
    verdict = "parity within the compile noise floor" if not failed else f"parity FAILED: {', '.join(failed)}"
    report.headline(f"{backend}: {verdict}; " + "; ".join(parts))
    report.markdown += rows_markdown(f"{report.data['model']} ({backend})", rows, ctx.cuda)
