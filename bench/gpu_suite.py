"""One prepared GPU run: the CUDA tests, then every GPU measurement, each stage under its own time cap.

    python -m bench.gpu_suite                        # on CUDA: everything, under 8 minutes on one H200
    python -m bench.gpu_suite --out "$OUT"           # write the results somewhere else
    python -m bench.gpu_suite --stages offload,plan  # some stages only (e.g. those a short run missed)
    python -m bench.gpu_suite --scale tiny --device cpu   # the CPU rehearsal: CUDA-only parts skipped

It installs nothing. torch (a CUDA build) and actplan's dependencies must be importable;
actplan itself is used installed (``pip install -e .``) or from ``./src``. Run it from the
repository root.

Stages, in this order, each in its own process so that a crash or a hang ends that stage
only; a stage past its cap, or past what is left of ``--budget``, is killed and reported
as timed out, and the next one starts:

``tests``        ``pytest -m cuda tests/test_cuda.py``: parity of every preset and offload row on
                 dense and moe in fp32 and bf16, offload under stress, the memory meter against
                 ``torch.cuda.max_memory_allocated``, Inductor-compiled layers.
``offload``      pinned copy bandwidth both ways; layer-input offload at hidden size 4096: share
                 of copy time hidden (goal >= 90%), peak cut against bytes offloaded (goal: equal
                 within 5%). The rows of ``bench.gpu_offload`` on the dense model.
``bench_dense``  ``actplan bench`` rows on the GPU-sized dense model (``bench.gpu_models``):
                 parity, activation bytes, peak (``max_memory_allocated``), step-time ratios.
``compiled``     ``none``, ``full`` and ``matmuls`` with every layer compiled by Inductor
                 (``fullgraph=True``), against eager ``none``.
``plan``         ``actplan plan`` at two budgets on the dense model: predicted against measured
                 peak and step time.
``bench_moe``    the bench rows on the GPU-sized MoE model.
``peers``        ``bench.peers`` on the GPU: the peers, the presets and plans at each peer's peak.

Every stage writes ``gpu_<stage>.json`` and ``.md`` (and its output in ``gpu_<stage>.log``)
under ``--out`` as soon as it has a result, so a stage cut short still leaves what it
measured; the driver rewrites ``gpu_suite.json`` and ``gpu_suite.md`` (the one-screen summary)
after each stage. Exit status: 0 when every stage that ran passed its checks, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("actplan") is None and (REPO / "src" / "actplan").is_dir():
    sys.path.insert(0, str(REPO / "src"))  # not installed: use the checkout's

import torch  # noqa: E402

from actplan._install.apply import find_layers  # noqa: E402
from actplan.evaluate.bench import OFFLOAD_VARIANTS, TORCH_CHECKPOINT, policy_config  # noqa: E402
from actplan.evaluate.contenders import (  # noqa: E402
    Contender,
    Installer,
    PolicyRow,
    config_installer,
    prepare_contender,
    time_contenders,
    torch_checkpoint_installer,
)
from actplan.measure import (  # noqa: E402
    SavedTensorMeter,
    StepCapture,
    capture_step,
    compare_steps,
    ratio,
)
from actplan.models import ModelBundle, loss_of, train_step  # noqa: E402
from actplan.sizes import mib  # noqa: E402
from bench.gpu_models import SCALES, ModelSpec, batch_on  # noqa: E402

RESULTS = Path("bench/results")
BENCH_ROWS = ("none", "full", "attn", "matmuls", "megatron-selective", *OFFLOAD_VARIANTS)
NOISE_FACTOR = 4.0
"""A row's gradients may differ from ``none``'s by this many times the two-run noise floor."""
METER_TOLERANCE = 0.02
"""The memory meter's peak must be within this fraction of ``torch.cuda.max_memory_allocated``."""

# ---------------------------------------------------------------------------------------------
# Stage settings
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """Per scale: stage caps (seconds), the suite's total budget, timing rounds."""

    caps: dict[str, float]
    budget_s: float
    repeats: int
    warmup: int
    bandwidth_bytes: int
    profile_repeats: int
    peers_models: tuple[str, ...]


STAGE_ORDER = ("tests", "offload", "bench_dense", "compiled", "plan", "bench_moe", "peers")

SETTINGS: dict[str, Settings] = {
    # Estimated (not yet measured) on one H200, start-up included: tests 110 s (Inductor
    # compiles most of it), offload 35, bench_dense 45, compiled 110 (three Inductor
    # compiles), plan 60, bench_moe 40, peers 90: 8.2 minutes, so the budget may cut into
    # `peers`, the last stage, which keeps every row it finished. Caps are looser than the
    # estimates; a stage that needs its whole cap takes the time from the stages after it.
    "gpu": Settings(
        caps={
            "tests": 150,
            "offload": 60,
            "bench_dense": 75,
            "compiled": 150,
            "plan": 90,
            "bench_moe": 60,
            "peers": 120,
        },
        budget_s=465,
        repeats=5,
        warmup=1,
        bandwidth_bytes=1 << 30,
        profile_repeats=3,
        peers_models=("dense", "moe"),
    ),
    # Two shared CPU cores, tiny models: the rehearsal of every code path.
    "tiny": Settings(
        caps={name: 240 for name in STAGE_ORDER},
        budget_s=1200,
        repeats=2,
        warmup=0,
        bandwidth_bytes=1 << 20,
        profile_repeats=1,
        # The MoE profile alone takes minutes on two busy cores; bench_moe rehearses the MoE rows.
        peers_models=("dense",),
    ),
}


@dataclass
class StageContext:
    """What a stage process knows: where to write, which models, on which device."""

    name: str
    out: Path
    scale: str
    device: torch.device
    cache_dir: Path
    settings: Settings

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def spec(self, model: str) -> ModelSpec:
        return SCALES[self.scale][model]

    def profile_name(self, model: str) -> str:
        """The model's name in the profile cache; the same in every stage, so profiles are shared."""
        spec = self.spec(model)
        return f"{model}-{self.scale}-{spec.dtype}"


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# A stage's report: JSON and markdown, rewritten whenever something is added
# ---------------------------------------------------------------------------------------------


class StageReport:
    """The results of one stage. ``write()`` after each piece, so a killed stage leaves them."""

    def __init__(self, ctx: StageContext, title: str) -> None:
        self.ctx = ctx
        self.data: dict[str, Any] = {
            "stage": ctx.name,
            "title": title,
            "complete": False,
            "device": device_name(ctx.device),
            "scale": ctx.scale,
            "torch_version": torch.__version__,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "headline": [],
            "skipped": [],
            "checks": [],
        }
        self.markdown: list[str] = []

    def headline(self, line: str) -> None:
        """A line for the one-screen summary."""
        self.data["headline"].append(line)

    def skip(self, what: str, reason: str) -> None:
        self.data["skipped"].append({"what": what, "reason": reason})

    def check(self, what: str, ok: bool, detail: str = "") -> bool:
        """A pass/fail verdict; any failed check makes the stage exit with status 1."""
        self.data["checks"].append({"what": what, "ok": bool(ok), "detail": detail})
        return ok

    def goal(self, what: str, value: float, met: bool | None) -> None:
        """A performance goal; ``met`` None when it cannot be judged here (e.g. off CUDA)."""
        self.data.setdefault("goals", []).append({"goal": what, "value": value, "met": met})

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.data["checks"])

    def write(self) -> None:
        stem = self.ctx.out / f"gpu_{self.ctx.name}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(_json_safe(self.data), indent=2) + "\n")
        stem.with_suffix(".md").write_text(self.to_markdown())

    def to_markdown(self) -> str:
        d = self.data
        lines = [
            f"# GPU suite, {d['stage']}: {d['title']}",
            "",
            f"- device: {d['device']}; torch {d['torch_version']}; scale {d['scale']}",
            f"- started {d['started']}",
            f"- {'complete' if d['complete'] else 'PARTIAL (the stage stopped before its end)'}",
            "",
        ]
        lines += [f"- {line}" for line in d["headline"]]
        if d["checks"]:
            lines += ["", "## Checks", ""]
            lines += [
                f"- {'pass' if c['ok'] else 'FAIL'}: {c['what']}{': ' + c['detail'] if c['detail'] else ''}"
                for c in d["checks"]
            ]
        if d.get("goals"):
            lines += ["", "## Goals", ""]
            for g in d["goals"]:
                verdict = {True: "met", False: "NOT met", None: "not judged"}[g["met"]]
                lines.append(f"- {verdict}: {g['goal']} (measured {_fmt(g['value'])})")
        if d["skipped"]:
            lines += ["", "## Skipped", ""]
            lines += [f"- {s['what']}: {s['reason']}" for s in d["skipped"]]
        if self.markdown:
            lines += ["", *self.markdown]
        return "\n".join(lines) + "\n"


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda)"
    return f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads"


# ---------------------------------------------------------------------------------------------
# Rows: one way of checkpointing each, parity against `none`, memory, interleaved time
# ---------------------------------------------------------------------------------------------


@dataclass
class RowSpec:
    name: str
    install: Installer
    kind: str = "preset"  # baseline, preset, peer, plan
    compiled: bool = False


def compiled_installer(install: Installer, backend: str) -> Installer:
    """``install``, then every checkpointable layer compiled with ``fullgraph=True``."""

    def compile_layers(model: torch.nn.Module) -> str:
        description = install(model)
        for _, layer in find_layers(model):
            layer.compile(fullgraph=True, backend=backend)
        return f"{description}; layers compiled ({backend}, fullgraph)"

    return compile_layers


def _resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = [*model.parameters()]
    tensors += [
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    ]
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def cuda_step_peak(contender: Contender, batch: dict[str, Any], device: torch.device) -> int:
    """Peak device bytes of one plain training step (no meter): what the allocator saw grow,
    plus the row's own parameters and optimizer state. Other rows' bytes are not counted."""
    torch.cuda.synchronize(device)
    resident = _resident_bytes(contender.model, contender.optimizer)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    train_step(contender.model, batch, contender.optimizer, seed=3)
    torch.cuda.synchronize(device)
    return resident + torch.cuda.max_memory_allocated(device) - base


def fresh_capture(
    bundle: ModelBundle, install: Installer, batch: dict[str, Any], device: torch.device
) -> StepCapture:
    """One step's loss and gradients on a fresh copy (the same start as every row)."""
    model = copy.deepcopy(bundle.model).to(device)
    install(model)
    torch.manual_seed(0)
    out = model(**batch)
    loss = loss_of(out)
    loss.backward()
    captured = capture_step(model, loss)
    del model, out, loss
    return captured


def prepare_compiled(
    bundle: ModelBundle, name: str, install: Installer, batch: dict[str, Any], device: torch.device
) -> Contender:
    """``prepare_contender`` for compiled layers: the memory meter's dispatch mode cannot run
    inside a ``fullgraph=True`` graph, so the activation bytes are those autograd saves
    (``SavedTensorMeter``) over one forward, and the peak comes from ``cuda_step_peak`` alone."""
    model = copy.deepcopy(bundle.model).to(device)
    description = install(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    contender = Contender(name, description, model, optimizer)
    torch.manual_seed(0)
    out = model(**batch)
    loss = loss_of(out)
    loss.backward()
    contender.capture = capture_step(model, loss)
    del out, loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with SavedTensorMeter(model) as saved:
        out = model(**batch)
    contender.activation_bytes = saved.saved_bytes
    loss_of(out).backward()
    del out
    optimizer.zero_grad(set_to_none=True)
    return contender


@dataclass
class RowRunner:
    """Runs rows against one ``none`` baseline, in as many timing groups as device memory needs.

    Parity: loss and every gradient against ``none`` within ``NOISE_FACTOR`` times the noise
    floor (the difference between two ``none`` runs; for compiled rows, also that between
    compiled and eager ``none``), and an identical grad census. Memory: the meter's activation
    bytes at the end of forward and its peak; on CUDA the peak of a plain step by
    ``max_memory_allocated``. Time: interleaved rounds, each row against ``none`` in the same
    rounds.
    """

    ctx: StageContext
    bundle: ModelBundle
    batch: dict[str, Any]
    report: StageReport
    key: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    baseline: StepCapture | None = None
    noise: dict[str, float] = field(default_factory=dict)
    _none: Contender | None = None
    _group: list[tuple[Contender, dict[str, Any]]] = field(default_factory=list)
    _groups: int = 0

    def start(self) -> None:
        none_install = config_installer(policy_config("none"))
        say(f"{self.key}: none, and a second none for the noise floor")
        self._none = prepare_contender(self.bundle, "none", none_install, self.batch, self.ctx.device)
        self.baseline = self._none.capture
        again = fresh_capture(self.bundle, none_install, self.batch, self.ctx.device)
        floor = compare_steps(self.baseline, again)
        self.noise = {"loss": floor.loss_abs_diff, "grad": floor.max_abs_grad_diff}
        self.report.data.setdefault("noise_floor", {})[self.key] = dict(self.noise)
        self.rows.append(self._row_record(RowSpec("none", none_install, "baseline"), self._none))

    def compile_floor(self, backend: str) -> None:
        """The difference compiling alone makes: compiled ``none`` against eager ``none``."""
        install = compiled_installer(config_installer(policy_config("none")), backend)
        compiled = fresh_capture(self.bundle, install, self.batch, self.ctx.device)
        diff = compare_steps(self.baseline, compiled)
        self.noise["compile_loss"] = diff.loss_abs_diff
        self.noise["compile_grad"] = diff.max_abs_grad_diff
        self.report.data.setdefault("noise_floor", {})[self.key] = dict(self.noise)

    def tolerances(self, compiled: bool) -> tuple[float, float]:
        loss, grad = self.noise["loss"], self.noise["grad"]
        if compiled:
            loss, grad = max(loss, self.noise["compile_loss"]), max(grad, self.noise["compile_grad"])
        return NOISE_FACTOR * loss, NOISE_FACTOR * grad

    def add(self, spec: RowSpec) -> dict[str, Any]:
        """Prepare one row (parity step, metered step, CUDA peak); failures are recorded."""
        device = self.ctx.device
        say(f"{self.key}: {spec.name}")
        if self.ctx.cuda and self._group and not self._room_for_another():
            self.flush()
        try:
            prepare = prepare_compiled if spec.compiled else prepare_contender
            contender = prepare(self.bundle, spec.name, spec.install, self.batch, device)
        except Exception as err:  # one broken row must not end the stage
            record = {"name": spec.name, "kind": spec.kind, "compiled": spec.compiled, "error": _error(err)}
            self.rows.append(record)
            self.report.check(f"{self.key} {spec.name} runs", False, record["error"])
            _free(device)
            return record
        record = self._row_record(spec, contender)
        self.rows.append(record)
        self._group.append((contender, record))
        return record

    def _row_record(self, spec: RowSpec, contender: Contender) -> dict[str, Any]:
        loss_atol, grad_atol = self.tolerances(spec.compiled)
        parity = compare_steps(self.baseline, contender.capture, grad_atol=grad_atol, loss_atol=loss_atol)
        loss = float(contender.capture.loss.float())
        if contender is not self._none:
            contender.capture = None  # a copy of every gradient: not kept past the check
        host_peak, offloaded, reloaded = contender.moved or (None, None, None)
        record: dict[str, Any] = {
            "name": spec.name,
            "kind": spec.kind,
            "compiled": spec.compiled,
            "description": contender.description,
            "loss": loss,
            "loss_identical": parity.loss_identical,
            "loss_abs_diff": parity.loss_abs_diff,
            "max_abs_grad_diff": parity.max_abs_grad_diff,
            "worst_param": parity.worst_param,
            "grad_atol": grad_atol,
            "census_match": parity.census_match,
            "parity_ok": parity.ok,
            "activation_bytes": contender.activation_bytes,
            # Compiled rows have no meter peak: the meter cannot run inside their graphs.
            "peak_bytes": None if spec.compiled else contender.peak_bytes,
            "resident_bytes": _resident_bytes(contender.model, contender.optimizer),
            "cuda_max_allocated_bytes": contender.cuda_max_allocated_bytes,
            "cuda_peak_bytes": None,
            "host_peak_bytes": host_peak,
            "offloaded_bytes": offloaded,
            "reloaded_bytes": reloaded,
        }
        self.report.check(
            f"{self.key} {spec.name} parity",
            parity.ok,
            f"loss diff {parity.loss_abs_diff:.2e}, grad diff {parity.max_abs_grad_diff:.2e} "
            f"(allowed {grad_atol:.2e}), census {'match' if parity.census_match else 'MISMATCH'}",
        )
        if self.ctx.cuda:
            try:
                record["cuda_peak_bytes"] = cuda_step_peak(contender, self.batch, self.ctx.device)
            except torch.cuda.OutOfMemoryError as err:
                record["error"] = _error(err)
                _free(self.ctx.device)
        return record

    def _room_for_another(self) -> bool:
        """Room on the device for one more row's weights and optimizer state, and a step."""
        free, _ = torch.cuda.mem_get_info(self.ctx.device)
        none = self.rows[0]
        step = (none["cuda_peak_bytes"] or none["peak_bytes"]) - none["resident_bytes"]
        return free > none["resident_bytes"] + 1.3 * step + (2 << 30)

    def flush(self) -> None:
        """Time the rows prepared so far against ``none``, then free them."""
        if not self._group:
            return
        self._groups += 1
        contenders = [self._none] + [c for c, _ in self._group]
        say(f"{self.key}: timing {len(contenders)} rows (group {self._groups})")
        timings = time_contenders(
            contenders, self.batch, repeats=self.ctx.settings.repeats, warmup=self.ctx.settings.warmup
        )
        for contender, record in [(self._none, self.rows[0]), *self._group]:
            stats, rel = timings[contender.name], ratio(timings[contender.name], timings["none"])
            if contender is self._none and "step_median_s" in record:
                record.setdefault("other_groups_step_median_s", []).append(stats.median)
                continue
            record.update(
                step_median_s=stats.median,
                step_q25_s=stats.q25,
                step_q75_s=stats.q75,
                ratio_to_none=rel.median,
                ratio_spread=rel.spread,
                timing_group=self._groups,
            )
        self._group.clear()
        _free(self.ctx.device)

    def finish(self) -> list[dict[str, Any]]:
        self.flush()
        self._none = None
        _free(self.ctx.device)
        return self.rows


def _error(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) < 400 else text[:400] + " ..."


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def rows_markdown(title: str, rows: list[dict[str, Any]], cuda: bool) -> list[str]:
    lines = [
        f"## {title}",
        "",
        "| row | parity | max abs dgrad (allowed) | activations @ fwd end (MiB) | peak, meter (MiB) "
        "| peak, max_memory_allocated (MiB) | step (s) | ratio to none |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r and "parity_ok" not in r:
            lines.append(f"| {r['name']} | ERROR: {r['error']} | | | | | | |")
            continue
        step = f"{r['step_median_s']:.3f}" if "step_median_s" in r else "-"
        rel = f"{r['ratio_to_none']:.3f} ± {r['ratio_spread']:.3f}" if "ratio_to_none" in r else "-"
        cuda_peak = mib(r["cuda_peak_bytes"]) if cuda else "skipped (no CUDA)"
        lines.append(
            f"| {r['name']} | {'ok' if r['parity_ok'] else 'FAIL'} | {r['max_abs_grad_diff']:.1e} "
            f"({r['grad_atol']:.1e}) | {mib(r['activation_bytes'])} | {mib(r['peak_bytes'])} | {cuda_peak} "
            f"| {step} | {rel} |"
        )
    return [*lines, ""]


def bench_headline(rows: list[dict[str, Any]], key: str) -> str:
    by_name = {r["name"]: r for r in rows}
    parts = []
    for name in ("full", "matmuls", "full+offload"):
        r = by_name.get(name)
        if r and "ratio_to_none" in r and by_name["none"].get("activation_bytes"):
            share = r["activation_bytes"] / by_name["none"]["activation_bytes"]
            parts.append(f"{name} {share:.2f}x activations at {r['ratio_to_none']:.2f}x time")
    failed = [r["name"] for r in rows if not r.get("parity_ok", False)]
    verdict = "parity ok" if not failed else f"parity FAILED: {', '.join(failed)}"
    return f"{key}: {verdict}; " + "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------


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
    """Copy bandwidth, then the layer-input offload figures of ``bench.gpu_offload``."""
    from actplan.planning.profile import copy_bandwidth
    from bench import gpu_offload

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
    spec = ctx.spec("dense")
    min_bytes = "64KiB" if ctx.cuda else "0"
    result = gpu_offload.run_model(
        spec, ctx.device, ctx.settings.repeats + 2, ctx.settings.warmup, min_bytes, progress=say
    )
    figures = gpu_offload.overlap_figures(result, bandwidth)
    report.data["model"] = result["model"]
    report.data["rows"] = result["rows"]
    report.data["layer_input_offload"] = figures
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
    report.headline(
        f"layer-input offload at hidden size {result['hidden_size']}: "
        f"copy {figures['copy_seconds'] * 1e3:.1f} ms, "
        f"exposed {figures['exposed_seconds'] * 1e3:.1f} ms, hidden {figures['hidden_fraction']:.1%}; "
        f"peak cut {mib(figures['peak_cut_bytes'])} MiB for {mib(figures['offloaded_bytes'])} MiB offloaded"
    )
    report.markdown += [
        f"## {result['model']}",
        "",
        "| row | peak (MiB) | moved out (MiB) | moved back (MiB) | step (s) | ratio to none |",
        "|---|---|---|---|---|---|",
    ]
    for label, row in result["rows"].items():
        report.markdown.append(
            f"| {label} | {mib(row['peak_bytes'])} | {mib(row['offloaded_bytes'])} | "
            f"{mib(row['reloaded_bytes'])} | {row['step_median_s']:.3f} | {row['ratio_to_none']:.3f} |"
        )


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
    _meter_check(ctx, report, rows)
    report.markdown += rows_markdown(report.data["model"], rows, ctx.cuda)


def _meter_check(ctx: StageContext, report: StageReport, rows: list[dict[str, Any]]) -> None:
    """The meter's window peak against the allocator's, per eager row."""
    if not ctx.cuda:
        if not any(s["what"] == "memory meter against max_memory_allocated" for s in report.data["skipped"]):
            report.skip("memory meter against max_memory_allocated", "needs CUDA")
        return
    for r in rows:
        meter, cuda = r.get("peak_bytes"), r.get("cuda_peak_bytes")
        if meter and cuda and not r["compiled"]:
            off = abs(meter - cuda) / cuda
            report.goal(
                f"{r['name']}: meter peak within 2% of max_memory_allocated", off, off <= METER_TOLERANCE
            )


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


def stage_plan(ctx: StageContext, report: StageReport) -> None:
    """``actplan plan`` at two budgets between ``full``'s and ``none``'s peak; the two plans run
    side by side against ``none``."""
    from actplan.config import RecomputeConfig
    from actplan.planning.budget import get_profile, plan_under_budget

    spec = ctx.spec("dense")
    bundle = spec.build(ctx.device)
    batch = batch_on(bundle, ctx.device)
    name = ctx.profile_name("dense")
    profile, cached = get_profile(
        bundle,
        name,
        ctx.device,
        cache_dir=ctx.cache_dir,
        repeats=ctx.settings.profile_repeats,
        progress=lambda s: say(f"  {s}"),
    )
    report.data.update(model=f"{bundle.description}, {spec.dtype}", profile_seconds=profile.seconds_spent)
    report.headline(f"profile: {profile.seconds_spent:.0f} s{' (cached)' if cached else ''}")
    plans = []
    for share in (0.5, 0.15):
        budget = int(profile.full_peak_bytes + share * (profile.none_peak_bytes - profile.full_peak_bytes))
        result = plan_under_budget(
            bundle, name, str(budget), ctx.device, out=ctx.out / f"gpu_plan_{len(plans)}.yaml", run=False,
            cache_dir=ctx.cache_dir, repeats=ctx.settings.profile_repeats,
        )  # fmt: skip
        plans.append({"budget_bytes": budget, "full_to_none_share": share, **result.to_dict()})
        report.data["plans"] = plans
        report.write()
    runner = RowRunner(ctx, bundle, batch, report, "dense")
    report.data["rows"] = runner.rows
    runner.start()
    for index, plan in enumerate(plans):
        config = RecomputeConfig.from_dict(plan["config"], source=f"plan {index}")
        runner.add(RowSpec(f"plan {index} @{mib(plan['budget_bytes'])}MiB", config_installer(config), "plan"))
        report.write()
    rows = runner.finish()
    report.markdown += [
        "## Predicted against measured",
        "",
        "| budget (MiB) | candidates | peak predicted / meter / max_memory_allocated (MiB) "
        "| time ratio predicted / measured |",
        "|---|---|---|---|",
    ]
    for plan, row in zip(plans, rows[1:], strict=False):
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
            f"{_fmt(row.get('ratio_to_none'))} |"
        )
    _meter_check(ctx, report, rows)
    report.markdown += ["", *rows_markdown(report.data["model"], rows, ctx.cuda)]


@dataclass
class _MeasuredPeak:
    """What ``bench.peers.plan_rows`` reads of a peer: its name and metered peak."""

    name: str
    peak_bytes: int


def stage_peers(ctx: StageContext, report: StageReport) -> None:
    """``bench.peers`` on the device: peers, presets, and plans at each peer's metered peak."""
    from actplan.config import RecomputeConfig
    from actplan.planning.budget import get_profile
    from bench import peers

    if importlib.util.find_spec("torch_remat") is None:
        report.skip("torch_remat rows", "torch_remat is not importable here (`pip install torch_remat`)")
    report.data["models"] = {}
    for model in ctx.settings.peers_models:
        spec = ctx.spec(model)
        bundle = spec.build(ctx.device)
        batch = batch_on(bundle, ctx.device)
        entry: dict[str, Any] = {"model": f"{bundle.description}, {spec.dtype}"}
        report.data["models"][model] = entry
        runner = RowRunner(ctx, bundle, batch, report, f"{model} peers")
        entry["rows"] = runner.rows
        runner.start()
        for name, install in peers.peer_entries(model):
            if name.startswith("remat-") and importlib.util.find_spec("torch_remat") is None:
                continue
            runner.add(RowSpec(name, install, "peer"))
            report.write()
        for preset in peers.ACTPLAN_PRESETS:
            runner.add(RowSpec(preset, config_installer(policy_config(preset))))
            report.write()
        runner.flush()
        profile, _ = get_profile(
            bundle,
            ctx.profile_name(model),
            ctx.device,
            cache_dir=ctx.cache_dir,
            repeats=ctx.settings.profile_repeats,
            progress=lambda s: say(f"  {s}"),
        )
        measured = [
            _MeasuredPeak(r["name"], r["peak_bytes"])
            for r in runner.rows
            if r["kind"] == "peer" and "peak_bytes" in r
        ]
        planned, infeasible = peers.plan_rows(profile, measured)
        entry["budgets_without_a_plan"] = infeasible
        for plan in planned:
            config = RecomputeConfig.from_dict(plan.config, source=plan.name)
            runner.add(RowSpec(plan.name, config_installer(config), "plan"))
            report.write()
        rows = runner.finish()
        kinds = {r["name"]: r["kind"] for r in rows}
        policy_rows = [_policy_row(r) for r in rows if "ratio_to_none" in r]
        entry["at_same_peak"] = peers.compare(policy_rows, kinds, "peak_bytes")
        entry["at_same_activation_bytes"] = peers.compare(policy_rows, kinds, "activation_bytes")
        entry["goals"] = peers.evaluate_goals(entry["at_same_peak"])
        for goal in entry["goals"]:
            report.goal(f"{model}: {goal['goal']}", goal.get("value"), goal.get("met"))
        best = [c for c in entry["at_same_peak"] if c.get("best")]
        report.headline(
            f"{model}: {len(rows)} rows, {sum(not r.get('parity_ok', False) for r in rows)} parity failures; "
            + "; ".join(
                f"{c['peer']} {c['peer_ratio']:.2f}x vs {c['best']['name']} {c['best']['ratio']:.2f}x"
                for c in best
            )
        )
        _meter_check(ctx, report, rows)
        report.markdown += rows_markdown(entry["model"], rows, ctx.cuda)
        report.write()
        del bundle, runner
        _free(ctx.device)


def _policy_row(record: dict[str, Any]) -> PolicyRow:
    names = {f.name for f in fields(PolicyRow)}
    return PolicyRow(**{k: v for k, v in record.items() if k in names})


@dataclass(frozen=True)
class Stage:
    title: str
    run: Callable[[StageContext, StageReport], None]


STAGES: dict[str, Stage] = {
    "tests": Stage("CUDA tests (pytest -m cuda)", stage_tests),
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
        report.check("the stage ran to its end", False, _error(err))
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
    env = dict(os.environ)
    paths = [str(REPO), str(REPO / "src"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def launch_stage(name: str, args: argparse.Namespace, cache_dir: Path, cap: float) -> dict[str, Any]:
    """Run one stage in its own process group; kill the group at ``cap`` seconds."""
    out = Path(args.out)
    log_path = out / f"gpu_{name}.log"
    json_path = out / f"gpu_{name}.json"
    json_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "bench.gpu_suite", "--run-stage", name, "--out", str(out)]
    command += ["--scale", args.scale, "--device", args.device, "--cache-dir", str(cache_dir)]
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
    report = json.loads(json_path.read_text()) if json_path.exists() else None
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
        lines += [f"  - goal NOT met: {g['goal']} ({_fmt(g['value'])})" for g in missed[:3]]
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
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--run-stage", choices=sorted(STAGES), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if args.scale is None:
        args.scale = "gpu" if device.type == "cuda" else "tiny"
    if args.scale == "gpu" and device.type != "cuda":
        raise SystemExit(
            f"--scale gpu needs a CUDA device (got --device {args.device}): its models need tens of GiB; "
            "rehearse with --scale tiny"
        )
    settings = SETTINGS[args.scale]
    if args.run_stage:
        ctx = StageContext(args.run_stage, Path(args.out), args.scale, device, Path(args.cache_dir), settings)
        return run_stage(ctx)

    stages = parse_stages(args.stages)
    caps = {**settings.caps, **parse_caps(args.caps)}
    budget = args.budget if args.budget is not None else settings.budget_s
    if budget <= 0:
        raise SystemExit(f"--budget must be a positive number of seconds, got {budget}")
    out = Path(args.out).resolve()
    args.out = str(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    suite: dict[str, Any] = {
        "command": " ".join(["python -m bench.gpu_suite", *(sys.argv[1:] if argv is None else argv)]),
        "scale": args.scale,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "budget_s": budget,
        "device": check_device(device),
        "stages": [],
        "seconds": 0.0,
    }
    say(f"device: {suite['device']['name']}; stages: {', '.join(stages)}; budget {budget:.0f} s")
    cache_dir = Path(tempfile.mkdtemp(prefix="actplan-gpu-suite-"))
    try:
        for name in stages:
            left = budget - (time.perf_counter() - started)
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
    summary = write_suite(out, suite)
    print(summary)
    print(f"results: {out}/gpu_*.json, .md and .log")
    bad = {"error", "timed out", "checks failed"}
    return 1 if any(s["status"] in bad for s in suite["stages"]) else 0


def write_suite(out: Path, suite: dict[str, Any]) -> str:
    summary = summary_markdown(suite)
    (out / "gpu_suite.json").write_text(json.dumps(_json_safe(suite), indent=2) + "\n")
    (out / "gpu_suite.md").write_text(summary)
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
