"""The harness's goals for ``actplan bench`` (``bench/goals.py``): stated from a bench JSON,
they reproduce the committed reports byte for byte, and apply only where they are set."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from actplan.evaluate.bench import BenchResult
from bench import goals

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
REPORTS = sorted(RESULTS.glob("bench_*.json"))


@pytest.mark.parametrize("report", REPORTS, ids=lambda p: p.stem)
def test_goals_rewrite_the_committed_reports_unchanged(report, tmp_path):
    copy = tmp_path / report.name
    shutil.copy(report, copy)
    # Without its goals, as the library writes it, then with the harness's.
    data = json.loads(copy.read_text())
    recorded = data.pop("goals")
    copy.write_text(json.dumps(data, indent=2) + "\n")
    assert goals.add_goals(copy) == recorded
    assert copy.read_text() == report.read_text()
    assert copy.with_suffix(".md").read_text() == report.with_suffix(".md").read_text()


def test_goals_apply_to_dense_at_their_size_only():
    data = json.loads((RESULTS / "bench_dense_small.json").read_text())
    result = BenchResult.from_dict(data)
    assert [g["met"] for g in goals.evaluate_goals(result)] == [True] * 4
    result.size = "tiny"
    assert goals.evaluate_goals(result) == [] and goals.goal_lines([]) == []
    moe = BenchResult.from_dict(json.loads((RESULTS / "bench_moe_small.json").read_text()))
    assert goals.evaluate_goals(moe) == []


def test_goals_command_line_prints_verdicts(tmp_path, capsys):
    copy = tmp_path / "bench_dense_small.json"
    shutil.copy(RESULTS / "bench_dense_small.json", copy)
    assert goals.main([str(copy)]) == 0
    out = capsys.readouterr().out
    assert out.count(": met: ") == 4 and "## Goals" in copy.with_suffix(".md").read_text()
