"""The GPU suite's rows, run by ``actplan.evaluate.runner`` (parity against ``none`` within the
measured noise floor, activation bytes and peaks, interleaved step times in as many timing groups
as device memory needs), kept as the stage report's records and checks; the rows' headline and
the meter's check against the allocator.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from actplan._install.apply import find_layers
from actplan.evaluate import runner as evaluate_runner
from actplan.evaluate.bench import policy_config
from actplan.evaluate.contenders import Installer, PolicyRow, config_installer
from actplan.evaluate.report import rows_markdown as report_rows
from actplan.evaluate.runner import RowSpec
from actplan.models import ModelBundle
from bench.gpu.context import Determinism, StageContext, say
from bench.gpu.report import StageReport

METER_TOLERANCE = 0.02
"""The memory meter's peak must be within this fraction of ``torch.cuda.max_memory_allocated``."""


def compiled_installer(install: Installer, backend: str) -> Installer:
    """``install``, then every checkpointable layer compiled with ``fullgraph=True``."""

    def compile_layers(model: torch.nn.Module) -> str:
        description = install(model)
        for _, layer in find_layers(model):
            layer.compile(fullgraph=True, backend=backend)
        return f"{description}; layers compiled ({backend}, fullgraph)"

    return compile_layers


@dataclass
class RowRunner:
    """The suite's face of ``actplan.evaluate.runner.RowRunner``: rows against one ``none``,
    a second ``none`` for the noise floor, the eager parity steps under ``exact`` (deterministic
    algorithms where torch allows it: the floor is then 0 and parity bit-exact), compiled rows
    metered by what autograd saves, timing groups as device memory needs, a broken row recorded
    rather than ending the stage. Each row becomes a record in ``rows`` (kept in place, so the
    stage report written after every row shows it) and a parity check in the report."""

    ctx: StageContext
    bundle: ModelBundle
    batch: dict[str, Any]
    report: StageReport
    key: str
    exact: Determinism | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    _runner: evaluate_runner.RowRunner | None = None

    def __post_init__(self) -> None:
        if self.exact is None:
            self.exact = Determinism(self.ctx.device)
        self._runner = evaluate_runner.RowRunner(
            self.bundle,
            self.batch,
            self.ctx.device,
            repeats=self.ctx.settings.repeats,
            warmup=self.ctx.settings.warmup,
            parity_context=self.exact,
            saved_tensors=True,
            memory_groups=True,
            keep_going=True,
            say=lambda line: say(f"{self.key}: {line}"),
        )

    def start(self) -> None:
        say(f"{self.key}: deterministic parity steps: {self.exact.on}")
        self._runner.start(config_installer(policy_config("none")), noise_floor=True)
        self._record_noise()
        self._sync()

    def add_compile_floor(self, name: str, backend: str) -> dict[str, Any]:
        """Compiled ``none``: a row, and what compiling alone changes (the compiled rows' floor)."""
        record = self.add(
            RowSpec(
                name,
                compiled_installer(config_installer(policy_config("none")), backend),
                compiled=True,
                floor=True,
            )
        )
        self._record_noise()
        return record

    def _record_noise(self) -> None:
        self.report.data.setdefault("noise_floor", {})[self.key] = dict(self._runner.noise)

    def add(self, spec: RowSpec) -> dict[str, Any]:
        """Prepare one row (parity step, metered step, CUDA peak); failures are recorded."""
        row = self._runner.add(spec)
        if row is None:
            error = self._runner.errors[spec.name]
            record = {"name": spec.name, "kind": spec.kind, "compiled": spec.compiled, "error": error}
            self.rows.append(record)
            self.report.check(f"{self.key} {spec.name} runs", False, record["error"])
            return record
        self._sync()
        self.report.check(
            f"{self.key} {spec.name} parity",
            row.parity_ok,
            f"loss diff {row.loss_abs_diff:.2e}, grad diff {row.max_abs_grad_diff:.2e} "
            f"(allowed {row.grad_atol:.2e}), census {'match' if row.census_match else 'MISMATCH'}",
        )
        return self.rows[-1]

    def flush(self) -> None:
        """Time the rows prepared so far against ``none``, then free them."""
        self._runner.flush()
        self._sync()

    def finish(self) -> list[dict[str, Any]]:
        self._runner.finish()
        self._sync()
        self._runner.close()
        return self.rows

    def _sync(self) -> None:
        """The records of every row so far, in place, in the order rows were added."""
        records = {r["name"]: r for r in self.rows}
        for row in self._runner.rows:
            record = records.get(row.name)
            if record is None:
                record = {}
                self.rows.append(record)
            record.update(_record(row))
        self.report.data["deterministic"] = self.exact.record(
            "the parity steps of the eager rows (none twice, then each row's first step)"
        )


_TIMING = ("step_median_s", "step_q25_s", "step_q75_s", "ratio_to_none", "ratio_spread", "timing_group")


def _record(row: PolicyRow) -> dict[str, Any]:
    """A row as the suite's report keeps it: its fields, whether it is bit-exact, the timing
    keys only once timed (the stages read ``"ratio_to_none" in record`` as "timed"), and an
    ``error`` only when its plain CUDA step failed."""
    data = {k: v for k, v in asdict(row).items() if k not in (*_TIMING, "error") or v is not None}
    return {**data, "bit_exact": row.bit_exact}


def rows_markdown(title: str, rows: list[dict[str, Any]], cuda: bool) -> list[str]:
    """The stage's rows under ``title``, by the benches' one table (``evaluate.report``); a row
    that did not run is shown with its error."""
    ran = [PolicyRow.from_record(r) for r in rows if "parity_ok" in r]
    errors = {r["name"]: r["error"] for r in rows if "parity_ok" not in r}
    note = [] if cuda else ["(no CUDA: the allocator's peak is not measured)", ""]
    return [f"## {title}", "", *note, *report_rows(ran, errors), ""]


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
