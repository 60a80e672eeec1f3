"""The planner bench end to end at tiny size: profile, plans at five budgets measured next to
the presets, prediction errors, solve time against layers, every file written."""

from __future__ import annotations

import json

import pytest

from bench.planner import main as bench_planner


def test_mixed_stack_holds_every_layer_type_in_blocks():
    from actplan.planning.planner import Candidate, PlanProblem

    a = (Candidate("none", 2, 1, 0.0), Candidate("full", 1, 2, 0.1))
    b = (Candidate("none", 5, 1, 0.0), Candidate("full", 1, 5, 0.3))
    first = PlanProblem(layers=(a, a), static_bytes=10, base_seconds=1.0, layer_grad_bytes=(1, 1))
    second = PlanProblem(layers=(b, a), static_bytes=99, base_seconds=2.0, layer_grad_bytes=(3, 1))
    stack = bench_planner.mixed([first, second], 6)
    assert stack.layers == (a, a, a, b, b, b) and stack.layer_grad_bytes == (1, 1, 1, 3, 3, 3)
    assert stack.static_bytes == 10
    assert bench_planner.stretched(second, 5).layers == (b, a, b, a, b)


def test_the_jittered_stack_has_no_two_layers_alike():
    problem = bench_planner.jittered_problem(30, seed=3)
    assert bench_planner.jittered_problem(30, seed=3) == problem  # seeded
    assert len(problem.layers) == 30 and {len(cs) for cs in problem.layers} == {24}
    assert len(set(problem.layers)) == 30 and len(set(problem.layer_extra_bytes)) == 30
    # Three types in blocks of ten: within a block every cost stays within 0.5% of the type's.
    for block in (problem.layers[:10], problem.layers[10:20], problem.layers[20:]):
        for costs in zip(*block, strict=True):
            for field in ("retained_bytes", "transient_bytes", "extra_seconds", "offloaded_bytes"):
                values = [getattr(c, field) for c in costs]
                assert max(values) <= min(values) * 1.0101 + 1e-12
    first, second = problem.layers[0][0], problem.layers[10][0]
    assert first.retained_bytes != pytest.approx(second.retained_bytes, rel=0.02)  # another type
    names = [c.name for c in problem.layers[0]]
    assert names[0] == "full" and "none" in names and sum(n.endswith("+offload") for n in names) == 11


@pytest.mark.slow
def test_planner_bench_writes_every_report(tmp_path):
    args = ["--models", "dense", "--size", "tiny", "--repeats", "1", "--layers", "16,32"]
    assert bench_planner.main([*args, "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]) == 0
    model = json.loads((tmp_path / "planner_dense_tiny.json").read_text())
    assert len(model["plans"]) == len(bench_planner.SHARES)
    for plan in model["plans"]:
        assert plan["parity_ok"] and abs(plan["peak_error"]) < 0.05
    summary = json.loads((tmp_path / "planner_predictions.json").read_text())
    assert {g["goal"].split(" ")[0] for g in summary["goals"]} >= {"predicted"}
    curve = json.loads((tmp_path / "planner_solve_time.json").read_text())
    assert set(curve["stacks"]) == {"dense", "random-32", "jittered"}
    assert [r["layers"] for r in curve["stacks"]["dense"]] == [16, 32]
    for name in (
        "planner_dense_tiny.md",
        "planner_dense_tiny.png",
        "planner_predictions.md",
        "planner_solve_time.png",
    ):
        assert (tmp_path / name).stat().st_size > 0
    # The solve-time part alone, on the profile the run above cached.
    alone = tmp_path / "alone"
    args = ["--models", "dense", "--size", "tiny", "--layers", "16", "--solve-time-only"]
    assert bench_planner.main([*args, "--out", str(alone), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert sorted(p.name for p in alone.iterdir()) == [
        "planner_solve_time.json",
        "planner_solve_time.md",
        "planner_solve_time.png",
    ]
    assert "jittered" in (alone / "planner_solve_time.md").read_text()
