"""One prepared GPU run: the CUDA tests, then every GPU measurement, each stage under its own time cap.

    python -m bench.gpu.suite                        # on CUDA: everything, at most 7 minutes on one H200
    python -m bench.gpu.suite --out "$OUT"           # write the results somewhere else
    python -m bench.gpu.suite --stages offload,plan  # some stages only (e.g. those a short run missed)
    python -m bench.gpu.suite --stages compiled,peers --extra   # what was cut to fit, in a second run
    python -m bench.gpu.suite --scale tiny --device cpu   # the CPU rehearsal: CUDA-only parts skipped

It installs nothing. torch (a CUDA build) and actplan's dependencies must be importable;
actplan itself is used installed (``pip install -e .``) or from ``./src``. Run it from the
repository root.

Stages, in this order, each in its own process so that a crash or a hang ends that stage
only; a stage past its cap, or past what is left of ``--budget``, is killed and reported
as timed out, and the next one starts. The caps add up to the budget at most
(``context.check_settings``); ``docs/benchmarks.md`` gives each stage's planned time, so that
the run fits one 10-minute device command with the machine's start:

``tests``        ``pytest -m cuda tests/test_cuda.py`` in two calls, the eager tests, then the
                 Inductor ones: parity of every preset and offload row on dense and moe in fp32
                 and bf16, offload under stress, the memory meter against
                 ``torch.cuda.max_memory_allocated``, Inductor-compiled layers. Each test's result
                 is appended to ``gpu_tests.jsonl`` as it finishes, so a stage cut at its cap
                 still reports every test that finished.
``offload``      pinned copy bandwidth both ways; layer-input offload at hidden size 4096: share
                 of copy time hidden (goal >= 90%), device bytes at the end of forward cut by
                 the bytes offloaded (goal: equal within 5%). The rows of ``bench.gpu.offload``
                 on the dense model.
``bench_dense``  ``actplan bench`` rows on the GPU-sized dense model (``bench.gpu.models``):
                 parity, activation bytes, peak (``max_memory_allocated``), step-time ratios.
``compiled``     ``none`` and ``matmuls`` (``--extra``: and ``full``) with every layer compiled by
                 Inductor (``fullgraph=True``), against eager ``none``.
``plan``         ``actplan plan`` at two budgets on the dense model: predicted against measured
                 peak and step time.
``bench_moe``    the bench rows on the GPU-sized MoE model.
``peers``        ``bench.peers.main`` on the GPU: the peers, the presets and plans at each peer's
                 peak, on the dense model (``--extra``: and the MoE model).

Parity steps run with deterministic algorithms where torch allows it
(``CUBLAS_WORKSPACE_CONFIG`` is set for every stage process); each report says where they
were on. Timed and memory-measured steps run without them.

Every stage writes ``gpu_<stage>.json`` and ``.md`` (and its output in ``gpu_<stage>.log``)
under ``--out`` as soon as it has a result, so a stage cut short still leaves what it
measured, and the driver reports it (for ``tests``, from ``gpu_tests.jsonl``); the driver
rewrites ``gpu_suite.json`` and ``gpu_suite.md`` (the one-screen summary) after each stage.
Exit status: 0 when every stage that ran passed its checks, 1 otherwise.

This module is the driver (options, stage processes, the summary). The rest of the suite:
``bench.gpu.context`` (settings, stage context), ``bench.gpu.report`` (a stage's report),
``bench.gpu.rows`` (rows against ``none``), ``bench.gpu.stages_measure`` and
``bench.gpu.stages_plan`` (the stages).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if importlib.util.find_spec("actplan") is None and (REPO / "src" / "actplan").is_dir():
    sys.path.insert(0, str(REPO / "src"))  # not installed: use the checkout's

import torch  # noqa: E402

from actplan.devices import resolve_device  # noqa: E402
from actplan.evaluate.bench import TORCH_CHECKPOINT as TORCH_CHECKPOINT  # noqa: E402  (tests read it here)
from actplan.evaluate.runner import error_text  # noqa: E402
from bench.gpu.context import (  # noqa: E402
    DETERMINISTIC_ENV,
    SETTINGS,
    STAGE_ORDER,
    StageContext,
    say,
    with_extra,
)
from bench.gpu.report import StageReport, device_name, fmt_value, json_safe, read_json  # noqa: E402
from bench.gpu.stages_allocator import stage_allocator  # noqa: E402
from bench.gpu.stages_measure import BENCH_ROWS as BENCH_ROWS  # noqa: E402  (tests read it here)
from bench.gpu.stages_measure import (  # noqa: E402
    salvage_tests,
    stage_bench_dense,
    stage_bench_moe,
    stage_compiled,
    stage_offload,
    stage_tests,
)
from bench.gpu.stages_plan import stage_peers, stage_plan  # noqa: E402

RESULTS = Path("bench/results")


@dataclass(frozen=True)
class Stage:
    title: str
    run: Callable[[StageContext, StageReport], None]
    # Rebuilds the report of a stage that did not end (killed at its cap, or crashed) from what
    # it left under --out, beyond its last gpu_<stage>.json: (out, stage, that json or None).
    salvage: Callable[[Path, str, dict[str, Any] | None], dict[str, Any]] | None = None


STAGES: dict[str, Stage] = {
    "tests": Stage("CUDA tests (pytest -m cuda)", stage_tests, salvage_tests),
    "allocator": Stage("caching-allocator model against the CUDA allocator", stage_allocator),
    "offload": Stage("copy bandwidth and layer-input offload", stage_offload),
    "bench_dense": Stage("bench rows, dense", stage_bench_dense),
    "compiled": Stage("compiled layers (Inductor)", stage_compiled),
    "plan": Stage("actplan plan at two budgets", stage_plan),
    "bench_moe": Stage("bench rows, moe", stage_bench_moe),
    "peers": Stage("peers at equal memory", stage_peers),
}
assert tuple(STAGES) == STAGE_ORDER


def run_stage(ctx: StageContext) -> int:
    """One stage, in this process: 0 when its checks pass, 1 when one fails."""
    stage = STAGES[ctx.name]
    report = StageReport(ctx, stage.title)
    report.write()
    started = time.perf_counter()
    try:
        stage.run(ctx, report)
    except Exception as err:
        report.check("the stage ran to its end", False, error_text(err))
        raise
    finally:
        report.data["seconds"] = time.perf_counter() - started
        report.data["complete"] = True
        report.write()
    return 0 if report.ok else 1


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def check_device(device: torch.device) -> dict[str, Any]:
    """What this machine offers the suite; raises with the fix when the device is unusable."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_build": torch.version.cuda,
        "pytest": importlib.util.find_spec("pytest") is not None,
        "torch_remat": importlib.util.find_spec("torch_remat") is not None,
        "triton": importlib.util.find_spec("triton") is not None,
    }
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(
                f"--device {device} but torch {torch.__version__} sees no CUDA device (CUDA build: "
                f"{torch.version.cuda}); install a CUDA build of torch, "
                "or rehearse with --scale tiny --device cpu"
            )
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            total_bytes=total,
            free_bytes=free,
            bf16=torch.cuda.is_bf16_supported(),
        )
    else:
        info["name"] = device_name(device)
    return info


def _stage_env() -> dict[str, str]:
    env = {**DETERMINISTIC_ENV, **os.environ}  # CUBLAS_WORKSPACE_CONFIG, before CUDA initialises
    paths = [str(REPO), str(REPO / "src"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def launch_stage(name: str, args: argparse.Namespace, cache_dir: Path, cap: float) -> dict[str, Any]:
    """Run one stage in its own process group; kill the group at ``cap`` seconds."""
    out = Path(args.out)
    log_path = out / f"gpu_{name}.log"
    json_path = out / f"gpu_{name}.json"
    json_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "bench.gpu.suite", "--run-stage", name, "--out", str(out)]
    command += ["--scale", args.scale, "--device", args.device, "--cache-dir", str(cache_dir)]
    command += ["--tests-file", args.tests_file] + (["--extra"] if args.extra else [])
    started = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=_stage_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = process.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    seconds = time.perf_counter() - started
    result: dict[str, Any] = {"stage": name, "seconds": seconds, "cap_s": cap, "exit_code": code}
    report = read_json(json_path)
    salvage = STAGES[name].salvage
    if salvage is not None and (code not in (0, 1) or report is None or not report.get("complete")):
        report = salvage(out, name, report)  # what a killed or crashed stage left
    result["report"] = report
    if code is None:
        result["status"] = "timed out"
    elif code not in (0, 1) or report is None:
        result["status"] = "error"
        result["log_tail"] = log_path.read_text()[-1500:]
    elif code == 1:
        result["status"] = "checks failed"
    elif report.get("nothing_ran"):
        result["status"] = "skipped"
    else:
        result["status"] = "ok, parts skipped" if report["skipped"] else "ok"
    return result


def summary_markdown(suite: dict[str, Any]) -> str:
    """The one-screen summary."""
    device = suite["device"]
    lines = [
        "# actplan GPU suite",
        "",
        f"- `{suite['command']}`; {device['name']}; torch {device['torch']}; scale {suite['scale']}; "
        f"started {suite['started']}; {suite['seconds']:.0f} s of a {suite['budget_s']:.0f} s budget",
        "",
    ]
    for result in suite["stages"]:
        report = result.get("report") or {}
        head = f"- **{result['stage']}**: {result['status']}"
        if "seconds" in result:
            head += f" ({result['seconds']:.0f} s, cap {result['cap_s']:.0f} s)"
        if result.get("reason"):
            head += f": {result['reason']}"
        lines.append(head)
        lines += [f"  - {line}" for line in report.get("headline", [])]
        failed = [c for c in report.get("checks", []) if not c["ok"]]
        lines += [f"  - FAIL {c['what']}: {c['detail']}" for c in failed[:5]]
        if len(failed) > 5:
            lines.append(f"  - ... {len(failed) - 5} more failed checks in gpu_{result['stage']}.md")
        missed = [g for g in report.get("goals", []) if g["met"] is False]
        lines += [f"  - goal NOT met: {g['goal']} ({fmt_value(g['value'])})" for g in missed[:3]]
        skipped = report.get("skipped", [])
        lines += [f"  - skipped {s['what']}: {s['reason']}" for s in skipped[:3]]
        if result["status"] == "error":
            lines.append(f"  - see gpu_{result['stage']}.log")
    return "\n".join(lines) + "\n"


def parse_caps(text: str | None) -> dict[str, float]:
    caps: dict[str, float] = {}
    for item in filter(None, (text or "").split(",")):
        name, _, seconds = item.partition("=")
        if name not in STAGES:
            raise SystemExit(f"--caps names stage {name!r}; stages: {', '.join(STAGES)}")
        try:
            caps[name] = float(seconds)
        except ValueError:
            raise SystemExit(f"--caps {item!r}: write stage=seconds, e.g. plan=90") from None
    return caps


def parse_stages(text: str | None) -> list[str]:
    if not text:
        return list(STAGE_ORDER)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise SystemExit(f"--stages: unknown {', '.join(unknown)}; stages: {', '.join(STAGES)}")
    return [n for n in STAGE_ORDER if n in names]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(RESULTS), help="where results go (default bench/results)")
    parser.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda when present)")
    parser.add_argument(
        "--scale", choices=sorted(SETTINGS), help="model sizes (default: gpu on CUDA, tiny else)"
    )
    parser.add_argument("--stages", help=f"comma-separated subset of {', '.join(STAGE_ORDER)}")
    parser.add_argument("--budget", type=float, help="seconds for the whole suite (default per scale)")
    parser.add_argument("--caps", help="per-stage caps in seconds, e.g. 'tests=100,peers=60'")
    parser.add_argument(
        "--extra",
        action="store_true",
        help="also what was cut to fit one 10-minute run (full compiled, MoE peers, the fp32 "
        "compiled-plans test); caps and budget grow to fit it",
    )
    parser.add_argument("--tests-file", default="tests/test_cuda.py", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--run-stage", choices=sorted(STAGES), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = _resolve_device_and_scale(args)
    settings = with_extra(SETTINGS[args.scale]) if args.extra else SETTINGS[args.scale]
    if args.run_stage:
        ctx = StageContext(
            args.run_stage,
            Path(args.out),
            args.scale,
            device,
            Path(args.cache_dir),
            settings,
            args.tests_file,
        )
        return run_stage(ctx)

    stages = parse_stages(args.stages)
    caps = {**settings.caps, **parse_caps(args.caps)}
    budget = args.budget if args.budget is not None else settings.budget_s
    if budget <= 0:
        raise SystemExit(f"--budget must be a positive number of seconds, got {budget}")
    planned = sum(caps[name] for name in stages)
    if planned > budget:
        say(
            f"the chosen stages' caps add up to {planned:.0f} s against a {budget:.0f} s budget: "
            "the last ones may be cut short or not run"
        )
    out = Path(args.out).resolve()
    args.out = str(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    suite: dict[str, Any] = {
        "command": " ".join(["python -m bench.gpu.suite", *(sys.argv[1:] if argv is None else argv)]),
        "scale": args.scale,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "budget_s": budget,
        "device": check_device(device),
        "stages": [],
        "seconds": 0.0,
    }
    say(f"device: {suite['device']['name']}; stages: {', '.join(stages)}; budget {budget:.0f} s")
    _run_stages(args, suite, stages, caps, started)
    summary = write_suite(out, suite)
    print(summary)
    print(f"results: {out}/gpu_*.json, .md and .log (and gpu_tests.jsonl)")
    bad = {"error", "timed out", "checks failed"}
    return 1 if any(s["status"] in bad for s in suite["stages"]) else 0


def _resolve_device_and_scale(args: argparse.Namespace) -> torch.device:
    """``--device auto`` and a missing ``--scale`` made concrete; ``gpu`` sizes off CUDA refused."""
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        raise SystemExit(f"--device: {err}") from None
    args.device = str(device)
    if args.scale is None:
        args.scale = "gpu" if device.type == "cuda" else "tiny"
    if args.scale == "gpu" and device.type != "cuda":
        raise SystemExit(
            f"--scale gpu needs a CUDA device (got --device {args.device}): its models need tens of GiB; "
            "rehearse with --scale tiny"
        )
    return device


def _run_stages(
    args: argparse.Namespace, suite: dict[str, Any], stages: list[str], caps: dict[str, float], started: float
) -> None:
    """Each stage in turn under its cap, or what is left of the budget; the suite is rewritten after each."""
    out = Path(args.out)
    cache_dir = Path(tempfile.mkdtemp(prefix="actplan-gpu-suite-"))
    try:
        for name in stages:
            left = suite["budget_s"] - (time.perf_counter() - started)
            if left < 5:
                suite["stages"].append(
                    {"stage": name, "status": "not run", "reason": "the suite's budget is spent"}
                )
            else:
                cap = min(caps[name], left)
                say(f"stage {name} (cap {cap:.0f} s)")
                result = launch_stage(name, args, cache_dir, cap)
                suite["stages"].append(result)
                say(f"stage {name}: {result['status']} in {result['seconds']:.0f} s")
            suite["seconds"] = time.perf_counter() - started
            write_suite(out, suite)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def write_suite(out: Path, suite: dict[str, Any]) -> str:
    summary = summary_markdown(suite)
    (out / "gpu_suite.json").write_text(json.dumps(json_safe(suite), indent=2) + "\n")
    (out / "gpu_suite.md").write_text(summary)
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
