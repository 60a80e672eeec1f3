"""The GPU suite rehearsed on CPU at tiny sizes: every stage runs in its own process, writes its
results, and reports what needs CUDA as skipped; so the one GPU run does not die on a typo."""

import dataclasses
import json
import textwrap

import pytest

from bench.gpu import suite as gpu_suite
from bench.gpu.context import (
    DEVICE_RUN_S,
    MACHINE_START_S,
    SETTINGS,
    SETUP_S,
    STAGE_ORDER,
    check_settings,
    with_extra,
)


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
    # Every CUDA test was collected (so it imports) and skipped for want of a device, eager
    # ones first; each result also went to the results log as it finished.
    tests = by_stage["tests"]
    assert tests["status"] == "skipped"
    cases = tests["report"]["cases"]
    assert len(cases) >= 30 and all(c["outcome"] == "skipped" for c in cases)
    assert all("CUDA" in c["message"] for c in cases)
    parts = [c["part"] for c in cases]
    assert parts == sorted(parts, key=["eager", "compile"].index) and "compile" in parts
    logged = [json.loads(line) for line in (tmp_path / "gpu_tests.jsonl").read_text().splitlines()]
    assert [r["nodeid"] for r in logged if r["event"] == "result"] == [c["nodeid"] for c in cases]
    for name in gpu_suite.STAGE_ORDER:
        report = json.loads((tmp_path / f"gpu_{name}.json").read_text())
        assert report["complete"], name
        markdown = (tmp_path / f"gpu_{name}.md").read_text()
        assert markdown.startswith("# GPU suite") and "deterministic algorithms: " in markdown
        assert all(c["ok"] for c in report["checks"]), (name, report["checks"])
        # Every report says whether deterministic algorithms were on: everywhere but the
        # compiled stage, whose graphs would compile twice, and the allocator stage, which only
        # measures memory.
        assert report["deterministic"]["on"] is (name not in ("compiled", "allocator")), name
    # What needs CUDA is named as skipped, never silently absent.
    skipped = {s["what"] for name in gpu_suite.STAGE_ORDER for s in by_stage[name]["report"]["skipped"]}
    assert {"memory meter against max_memory_allocated", "Inductor", "pinned copy bandwidth"} <= skipped
    # Offload is judged at the end of forward, where the offloaded layer inputs would be alive:
    # off CUDA by the memory meter, whose cut is the bytes offloaded to the byte.
    offload = by_stage["offload"]["report"]
    figures = offload["layer_input_offload"]
    assert figures["forward_end_source"] == "memory meter at forward_end"
    assert figures["offloaded_bytes"] > 0 and figures["forward_end_cut_over_offloaded"] == 1.0
    cut_goal = next(g for g in offload["goals"] if "end of forward" in g["goal"])
    assert cut_goal["met"] is True
    assert offload["noise_floor"] == {"loss": 0.0, "grad": 0.0}
    assert all(row["bit_exact"] for row in offload["rows"].values())
    dense = by_stage["bench_dense"]["report"]
    names = [r["name"] for r in dense["rows"]]
    assert names == [*gpu_suite.BENCH_ROWS, gpu_suite.TORCH_CHECKPOINT]
    assert all(
        r["parity_ok"] and r["bit_exact"] and "ratio_to_none" in r and r["cuda_peak_bytes"] is None
        for r in dense["rows"]
    )
    compiled = by_stage["compiled"]["report"]
    presets = SETTINGS["tiny"].compiled_presets
    assert [r["name"] for r in compiled["rows"]] == ["none", *(f"{p} compiled" for p in presets)]
    assert all(r["parity_ok"] for r in compiled["rows"])
    plan = by_stage["plan"]["report"]
    assert len(plan["plans"]) == 2 and all("predicted_peak_bytes" in p["solution"] for p in plan["plans"])
    # The allocator model's predictions for every case (measured figures need CUDA).
    allocator = by_stage["allocator"]["report"]["rows"]
    assert len(allocator) == 10
    assert all(r["predicted_reserved_bytes"] >= r["predicted_allocated_bytes"] >= r["meter_peak_bytes"] > 0
               for r in allocator)  # fmt: skip
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


FAKE_CUDA_TESTS = """
    import time
    import warnings

    import pytest

    pytestmark = pytest.mark.cuda


    def test_passes():
        warnings.warn("index_add_cuda_ does not have a deterministic implementation, but you set ...")


    def test_fails():
        assert 1 == 2, "fails on purpose"


    @pytest.mark.compile
    def test_compiled_passes():
        pass


    @pytest.mark.compile
    def test_hangs():
        time.sleep(600)
"""


@pytest.mark.slow
def test_a_tests_stage_killed_at_its_cap_still_reports_every_test_that_finished(tmp_path):
    tests_file = tmp_path / "test_fake_cuda.py"
    tests_file.write_text(textwrap.dedent(FAKE_CUDA_TESTS))
    out = tmp_path / "out"
    args = ["--scale", "tiny", "--device", "cpu", "--out", str(out), "--stages", "tests"]
    code = gpu_suite.main([*args, "--caps", "tests=40", "--tests-file", str(tests_file)])
    (stage,) = _suite(out)["stages"]
    assert stage["status"] == "timed out" and code == 1
    report = stage["report"]
    outcomes = {c["name"]: (c["part"], c["outcome"]) for c in report["cases"]}
    # The eager call ended, then the compile call ran until the cap stopped it mid-test.
    assert outcomes == {
        "test_passes": ("eager", "passed"),
        "test_fails": ("eager", "failed"),
        "test_compiled_passes": ("compile", "passed"),
    }
    assert report["running_when_stopped"].endswith("test_hangs")
    # An op torch ran without a deterministic implementation is named with its test.
    passes = next(c for c in report["cases"] if c["name"] == "test_passes")
    assert passes["nondeterministic_ops"] == ["index_add_cuda_"]
    failed = {c["what"] for c in report["checks"] if not c["ok"]}
    assert {"test_fails", "test_hangs ended"} <= failed
    summary = (out / "gpu_suite.md").read_text()
    assert "2 passed, 1 failed, 0 skipped; stopped at the cap while running test_hangs" in summary
    assert "FAIL test_fails: AssertionError: fails on purpose" in summary


@pytest.mark.parametrize("scale", sorted(SETTINGS))
@pytest.mark.parametrize("extra", [False, True])
def test_stage_caps_add_up_to_the_budget_at_most(scale, extra):
    settings = with_extra(SETTINGS[scale]) if extra else SETTINGS[scale]
    check_settings(scale, settings)  # raises when they do not
    assert set(settings.caps) == set(settings.estimates) == set(STAGE_ORDER)
    assert sum(settings.caps.values()) <= settings.budget_s
    assert all(settings.estimates[name] <= settings.caps[name] for name in STAGE_ORDER)


def test_the_gpu_run_fits_one_ten_minute_device_command_with_the_machine_start():
    gpu = SETTINGS["gpu"]
    assert MACHINE_START_S + SETUP_S + gpu.budget_s <= DEVICE_RUN_S
    # A cap raised past what the budget leaves is refused.
    over = dataclasses.replace(gpu, caps={**gpu.caps, "plan": gpu.budget_s})
    with pytest.raises(ValueError, match="caps add up to"):
        check_settings("gpu", over)


def test_a_spent_budget_leaves_later_stages_not_run(tmp_path):
    args = ["--scale", "tiny", "--device", "cpu", "--out", str(tmp_path), "--stages", "offload,plan"]
    gpu_suite.main([*args, "--budget", "4"])
    statuses = [s["status"] for s in _suite(tmp_path)["stages"]]
    assert statuses == ["not run", "not run"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scale", "gpu", "--device", "cpu"], "rehearse with --scale tiny"),
        (["--stages", "offload,warp"], "unknown warp; stages: tests, allocator, offload"),
        (["--caps", "plan=fast"], "write stage=seconds"),
        (["--caps", "nap=3"], "names stage 'nap'"),
        (["--budget", "0", "--device", "cpu"], "positive number of seconds"),
    ],
)
def test_bad_arguments_name_the_problem_and_the_fix(tmp_path, args, message):
    with pytest.raises(SystemExit, match=message):
        gpu_suite.main([*args, "--out", str(tmp_path)])
