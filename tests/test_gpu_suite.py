"""The GPU suite rehearsed on CPU at tiny sizes: every stage runs in its own process, writes its
results, and reports what needs CUDA as skipped; so the one GPU run does not die on a typo."""

import json

import pytest

from bench.gpu import suite as gpu_suite


def _suite(out):
    return json.loads((out / "gpu_suite.json").read_text())


@pytest.mark.slow
def test_the_whole_suite_runs_on_cpu_and_reports_cuda_parts_as_skipped(tmp_path, capsys):
    code = gpu_suite.main(["--scale", "tiny", "--device", "cpu", "--out", str(tmp_path)])
    suite = _suite(tmp_path)
    by_stage = {s["stage"]: s for s in suite["stages"]}
    assert list(by_stage) == list(gpu_suite.STAGE_ORDER)
    errors = {
        name: s.get("log_tail")
        for name, s in by_stage.items()
        if s["status"] not in ("ok", "ok, parts skipped", "skipped")
    }
    assert not errors, errors
    assert code == 0
    # Every CUDA test was collected (so it imports) and skipped for want of a device.
    tests = by_stage["tests"]
    assert tests["status"] == "skipped"
    cases = tests["report"]["cases"]
    assert len(cases) >= 30 and all(c["outcome"] == "skipped" for c in cases)
    assert all("CUDA" in c["message"] for c in cases)
    for name in gpu_suite.STAGE_ORDER:
        report = json.loads((tmp_path / f"gpu_{name}.json").read_text())
        assert report["complete"], name
        assert (tmp_path / f"gpu_{name}.md").read_text().startswith("# GPU suite")
        assert all(c["ok"] for c in report["checks"]), (name, report["checks"])
    # What needs CUDA is named as skipped, never silently absent.
    skipped = {s["what"] for name in gpu_suite.STAGE_ORDER for s in by_stage[name]["report"]["skipped"]}
    assert {"memory meter against max_memory_allocated", "Inductor", "pinned copy bandwidth"} <= skipped
    dense = by_stage["bench_dense"]["report"]
    names = [r["name"] for r in dense["rows"]]
    assert names == [*gpu_suite.BENCH_ROWS, gpu_suite.TORCH_CHECKPOINT]
    assert all(
        r["parity_ok"] and "ratio_to_none" in r and r["cuda_peak_bytes"] is None for r in dense["rows"]
    )
    compiled = by_stage["compiled"]["report"]
    assert [r["name"] for r in compiled["rows"]] == [
        "none",
        "none compiled",
        "full compiled",
        "matmuls compiled",
    ]
    assert all(r["parity_ok"] for r in compiled["rows"])
    plan = by_stage["plan"]["report"]
    assert len(plan["plans"]) == 2 and all("predicted_peak_bytes" in p["solution"] for p in plan["plans"])
    peers = by_stage["peers"]["report"]["models"]
    assert set(peers) == set(gpu_suite.SETTINGS["tiny"].peers_models)
    assert all(entry["at_same_peak"] for entry in peers.values())
    summary = (tmp_path / "gpu_suite.md").read_text()
    assert len(summary.splitlines()) < 60
    assert summary in capsys.readouterr().out


@pytest.mark.slow
def test_a_stage_past_its_cap_is_reported_and_the_next_one_still_runs(tmp_path):
    args = ["--scale", "tiny", "--device", "cpu", "--out", str(tmp_path), "--stages", "tests,offload"]
    code = gpu_suite.main([*args, "--caps", "tests=1"])
    suite = _suite(tmp_path)
    tests, offload = suite["stages"]
    assert tests["status"] == "timed out" and tests["seconds"] < 10
    assert offload["status"] == "ok, parts skipped"
    assert code == 1
    assert "timed out" in (tmp_path / "gpu_suite.md").read_text()


def test_a_spent_budget_leaves_later_stages_not_run(tmp_path):
    args = ["--scale", "tiny", "--device", "cpu", "--out", str(tmp_path), "--stages", "offload,plan"]
    gpu_suite.main([*args, "--budget", "4"])
    statuses = [s["status"] for s in _suite(tmp_path)["stages"]]
    assert statuses == ["not run", "not run"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scale", "gpu", "--device", "cpu"], "rehearse with --scale tiny"),
        (["--stages", "offload,warp"], "unknown warp; stages: tests, offload"),
        (["--caps", "plan=fast"], "write stage=seconds"),
        (["--caps", "nap=3"], "names stage 'nap'"),
        (["--budget", "0", "--device", "cpu"], "positive number of seconds"),
    ],
)
def test_bad_arguments_name_the_problem_and_the_fix(tmp_path, args, message):
    with pytest.raises(SystemExit, match=message):
        gpu_suite.main([*args, "--out", str(tmp_path)])
