"""A GPU-suite stage's report: checks, goals, skips and headline lines, written as
``gpu_<stage>.json`` and ``.md`` whenever something is added, so a killed stage leaves them."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu.context import StageContext


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
            # Where deterministic algorithms were on (``context.Determinism.record``).
            "deterministic": {"on": False, "where": "nowhere"},
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
        """Both files, each replaced whole: a stage killed mid-write leaves the previous version."""
        stem = self.ctx.out / f"gpu_{self.ctx.name}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(stem.with_suffix(".json"), json.dumps(json_safe(self.data), indent=2) + "\n")
        write_atomic(stem.with_suffix(".md"), self.to_markdown())

    def to_markdown(self) -> str:
        d = self.data
        lines = [
            f"# GPU suite, {d['stage']}: {d['title']}",
            "",
            f"- device: {d['device']}; torch {d['torch_version']}; scale {d['scale']}",
            f"- started {d['started']}",
            f"- {'complete' if d['complete'] else 'PARTIAL (the stage stopped before its end)'}",
            f"- deterministic algorithms: {deterministic_text(d['deterministic'])}",
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
                lines.append(f"- {verdict}: {g['goal']} (measured {fmt_value(g['value'])})")
        if d["skipped"]:
            lines += ["", "## Skipped", ""]
            lines += [f"- {s['what']}: {s['reason']}" for s in d["skipped"]]
        if self.markdown:
            lines += ["", *self.markdown]
        return "\n".join(lines) + "\n"


def deterministic_text(record: dict[str, Any]) -> str:
    if not record.get("on"):
        reason = record.get("reason_off")
        return "off" + (f" ({reason})" if reason else "")
    config = record.get("cublas_workspace_config")
    text = f"on for {record['where']} (warn_only; CUBLAS_WORKSPACE_CONFIG={config})"
    ops = record.get("nondeterministic_ops")
    return text + (f"; ran without a deterministic implementation: {', '.join(ops)}" if ops else "")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file a stage wrote, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def fmt_value(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda)"
    return f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads"
