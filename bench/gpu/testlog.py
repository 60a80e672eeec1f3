"""Per-test results of the GPU suite's ``tests`` stage, written as each test finishes.

``TestLog`` is a pytest plugin (``pytest.main(args, plugins=[TestLog(path, part)])``): it appends
one JSON line when a test starts and one when it ends (outcome, message, seconds, the
properties the test recorded), so a stage killed at its cap still leaves every finished test's
result, and the name of the one that was running. ``read_log`` turns the file back into cases.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu.context import NONDETERMINISTIC_ALERT

MESSAGE_CHARS = 300


class TestLog:
    """pytest plugin: ``{"event": "start" | "result" | "nondeterministic", ...}`` lines appended
    to ``path``."""

    __test__ = False  # not a test class, whatever pytest collects

    def __init__(self, path: Path, part: str, on_result: Callable[[dict[str, Any]], None] | None = None):
        self.path = path
        self.part = part
        self.on_result = on_result
        self._open: dict[str, dict[str, Any]] = {}
        self._finished: dict[str, dict[str, Any]] = {}

    def _append(self, record: dict[str, Any]) -> None:
        # Opened and closed per line: what is written is in the file even if the process is killed.
        with open(self.path, "a") as log:
            log.write(json.dumps(record) + "\n")

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self._open[nodeid] = {"outcome": "passed", "message": "", "seconds": 0.0, "when": "call"}
        self._append({"event": "start", "part": self.part, "nodeid": nodeid})

    def pytest_runtest_logreport(self, report: Any) -> None:
        case = self._open.setdefault(
            report.nodeid, {"outcome": "passed", "message": "", "seconds": 0.0, "when": "call"}
        )
        case["seconds"] += float(getattr(report, "duration", 0.0))
        case["properties"] = {str(k): v for k, v in getattr(report, "user_properties", [])}
        if report.passed or case["outcome"] != "passed":
            return  # the first phase that did not pass decides the outcome
        if report.skipped:
            case["outcome"] = "skipped"
        elif report.when == "call":
            case["outcome"] = "failed"
        else:
            case["outcome"] = "error"  # a failing setup or teardown
        case["when"] = report.when
        case["message"] = _message(report)

    def pytest_warning_recorded(self, warning_message: Any, when: str, nodeid: str, location: Any) -> None:
        """Ops that ran without a deterministic implementation while deterministic algorithms
        were on (torch warns, with ``warn_only``): why a test's noise floor is not 0. pytest
        reports a test's warnings after it has finished: added to its record, and logged."""
        text = str(warning_message.message)
        case = self._open.get(nodeid) or self._finished.get(nodeid)
        if case is None or NONDETERMINISTIC_ALERT not in text:
            return
        ops = case.setdefault("nondeterministic_ops", [])
        op = text.split(NONDETERMINISTIC_ALERT)[0].strip()[:200]
        if op not in ops:
            ops.append(op)
            if nodeid in self._finished:
                self._append({"event": "nondeterministic", "part": self.part, "nodeid": nodeid, "op": op})

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        case = self._open.pop(nodeid, None)
        if case is None:
            return
        record = {
            "event": "result",
            "part": self.part,
            "nodeid": nodeid,
            "name": nodeid.split("::", 1)[-1],
            **case,
        }
        self._finished[nodeid] = record
        self._append(record)
        if self.on_result is not None:
            self.on_result(record)


def _message(report: Any) -> str:
    """The first line that says why: a skip's reason, a failure's crash message."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        text = str(longrepr[2]).removeprefix("Skipped: ")
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = getattr(crash, "message", None) or str(longrepr or "")
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return (lines[0] if lines else "")[:MESSAGE_CHARS]


def read_log(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The finished tests' cases in the order they ran, and the test that had started without
    finishing (the one running when the stage was killed), if any. A torn last line is ignored."""
    cases: dict[str, dict[str, Any]] = {}
    running: str | None = None
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        event, nodeid = record.pop("event", None), record.get("nodeid")
        if event == "start":
            running = nodeid
        elif event == "result":
            cases[nodeid] = record
            running = None if running == nodeid else running
        elif event == "nondeterministic" and nodeid in cases:
            ops = cases[nodeid].setdefault("nondeterministic_ops", [])
            if record["op"] not in ops:
                ops.append(record["op"])
    return list(cases.values()), running
