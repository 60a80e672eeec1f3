"""The GPU suite's rows: each way of checkpointing on its own copy of the model, parity against
``none`` within the measured noise floor, activation bytes and peaks, and interleaved step times,
in as many timing groups as device memory needs; and the rows' markdown table and headline.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from actplan._install.apply import find_layers
from actplan.evaluate.bench import policy_config
from actplan.evaluate.contenders import (
    Contender,
    Installer,
    config_installer,
    prepare_contender,
    time_contenders,
)
from actplan.measure import (
    SavedTensorMeter,
    StepCapture,
    capture_step,
    compare_steps,
    ratio,
)
from actplan.models import ModelBundle, loss_of, train_step
from actplan.sizes import mib
from bench.gpu.context import Determinism, StageContext, say
from bench.gpu.report import StageReport

NOISE_FACTOR = 4.0
"""A row's gradients may differ from ``none``'s by this many times the two-run noise floor."""
METER_TOLERANCE = 0.02
"""The memory meter's peak must be within this fraction of ``torch.cuda.max_memory_allocated``."""


@dataclass
class RowSpec:
    """One row to run: its name, how it installs checkpointing, its kind, whether layers compile."""

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
    compiled and eager ``none``), and an identical grad census. The eager parity steps run
    under ``exact`` (deterministic algorithms where torch allows it: the floor is then 0 and
    parity bit-exact); the metered, peak and timed steps outside it. Memory: the meter's activation
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
    exact: Determinism | None = None
    _group: list[tuple[Contender, dict[str, Any]]] = field(default_factory=list)
    _groups: int = 0

    def start(self) -> None:
        if self.exact is None:
            self.exact = Determinism(self.ctx.device)
        none_install = config_installer(policy_config("none"))
        say(f"{self.key}: none, and a second none for the noise floor (deterministic: {self.exact.on})")
        self._none = prepare_contender(
            self.bundle, "none", none_install, self.batch, self.ctx.device, parity_context=self.exact
        )
        self.baseline = self._none.capture
        with self.exact():
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
            if spec.compiled:
                contender = prepare_compiled(self.bundle, spec.name, spec.install, self.batch, device)
            else:
                contender = prepare_contender(
                    self.bundle, spec.name, spec.install, self.batch, device, parity_context=self.exact
                )
        except Exception as err:  # one broken row must not end the stage
            record = {
                "name": spec.name, "kind": spec.kind, "compiled": spec.compiled, "error": error_text(err)
            }  # fmt: skip
            self.rows.append(record)
            self.report.check(f"{self.key} {spec.name} runs", False, record["error"])
            release_cache(device)
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
            "bit_exact": parity.loss_identical and parity.max_abs_grad_diff == 0 and parity.census_match,
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
        self.report.data["deterministic"] = self.exact.record(
            "the parity steps of the eager rows (none twice, then each row's first step)"
        )
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
                record["error"] = error_text(err)
                release_cache(self.ctx.device)
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
        release_cache(self.ctx.device)

    def finish(self) -> list[dict[str, Any]]:
        self.flush()
        self._none = None
        release_cache(self.ctx.device)
        return self.rows


def error_text(err: BaseException) -> str:
    """The error's type and message, cut at 400 characters."""
    text = f"{type(err).__name__}: {err}"
    return text if len(text) < 400 else text[:400] + " ..."


def release_cache(device: torch.device) -> None:
    """Give the CUDA caching allocator's free blocks back to the device (a no-op elsewhere)."""
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


def meter_check(ctx: StageContext, report: StageReport, rows: list[dict[str, Any]]) -> None:
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
