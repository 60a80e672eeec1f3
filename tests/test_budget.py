"""The profile cache, budget planning end to end, and ``actplan plan`` around them."""

from __future__ import annotations

import copy
import itertools
import json
import re

import pytest
import torch

import actplan
from actplan.cli import main
from actplan.config import RecomputeConfig
from actplan.models import build_model
from actplan.planning.budget import measure_config, plan_under_budget
from actplan.planning.cache import cache_key, load_cached
from actplan.planning.choose import config_for, picked
from actplan.planning.planner import minimum_peak

# One worker profiles conftest's long models once
pytestmark = pytest.mark.xdist_group("long-profiles")

CPU = torch.device("cpu")

# ---------------------------------------------------------------------------------------------
# Cache keys


def test_cache_key_follows_shapes_dtype_device_torch_threshold_and_bandwidth(monkeypatch):
    bundle = build_model("dense", "tiny")
    key = cache_key(bundle, "dense", CPU, 0)
    assert cache_key(bundle, "dense", CPU, 0) == key
    assert cache_key(build_model("dense", "tiny", batch_size=3), "dense", CPU, 0) != key
    assert cache_key(build_model("dense", "tiny", dim=96), "dense", CPU, 0) != key
    double = copy.deepcopy(bundle)
    double.model.double()
    assert cache_key(double, "dense", CPU, 0) != key
    assert cache_key(bundle, "dense", torch.device("meta"), 0) != key
    assert cache_key(bundle, "dense", CPU, 1024) != key
    # A forced copy bandwidth changes offload's charge: another profile, never the measured one.
    assert cache_key(bundle, "dense", CPU, 0, 25e9) not in {key, cache_key(bundle, "dense", CPU, 0, 5e9)}
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    assert cache_key(bundle, "dense", CPU, 0) != key


def test_a_damaged_cache_file_is_profiled_again(tmp_path):
    (tmp_path / "abc.json").write_text("{not json")
    assert load_cached(tmp_path, "abc") is None
    assert load_cached(tmp_path, "missing") is None


# ---------------------------------------------------------------------------------------------
# End to end


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dense", "moe"])
def test_plan_at_a_mid_budget_runs_under_it_as_predicted(which, dense, moe, cache, tmp_path):
    bundle, profile = {"dense": dense, "moe": moe}[which]
    lowest, _ = minimum_peak(profile.problem())
    budget = int((lowest + profile.none_peak_bytes) / 2)
    result = plan_under_budget(
        bundle,
        f"model_factories:{which}_long",
        budget,
        CPU,
        out=tmp_path / "plan.yaml",
        plot=tmp_path / "pareto.png",
        cache_dir=cache,
        repeats=3,
        min_bytes=0,
    )
    assert result.from_cache
    measured = result.measured
    assert measured["loss_identical"]
    assert measured["peak_bytes"] <= budget
    assert abs(result.prediction_error["peak"]) <= 0.10
    assert result.solution["predicted_peak_bytes"] <= budget
    # The file is an ordinary config that installs the chosen candidates.
    config = RecomputeConfig.from_file(tmp_path / "plan.yaml")
    plan = actplan.plan_for(bundle.model, config)
    chosen = [layer["candidate"] for layer in result.layers]
    assert [layer.mode for layer in plan.layers] == [
        next(c for c in profile.type_of(i).candidates if c.name == name).mode for i, name in enumerate(chosen)
    ]
    assert (tmp_path / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_host_budget_keeps_the_plan_off_the_host(dense, cache, tmp_path):
    bundle, profile = dense
    lowest, choices = minimum_peak(profile.problem(0))
    assert profile.problem().host_bytes(choices) == 0
    budget = int((lowest + profile.none_peak_bytes) / 2)
    result = plan_under_budget(
        bundle, "model_factories:dense_long", budget, CPU, out=tmp_path / "plan.yaml", plot=None,
        run=False, cache_dir=cache, repeats=3, min_bytes=0, host_budget_bytes=0,
    )  # fmt: skip
    assert result.solution["predicted_peak_bytes"] <= budget
    assert "offload" not in RecomputeConfig.from_file(tmp_path / "plan.yaml").to_dict()


@pytest.mark.slow
def test_config_for_round_trips_every_chosen_candidate(moe):
    bundle, profile = moe
    problem = profile.problem()
    _, choices = minimum_peak(problem)
    config = config_for(profile, choices)
    plan = actplan.plan_for(bundle.model, config)
    for layer, candidate in zip(plan.layers, picked(profile, choices), strict=True):
        assert layer.mode == candidate.mode
        assert [u.value for u in layer.kept_units] == candidate.kept_units
        assert layer.offload_input == candidate.offload
    assert measure_config(bundle, config, CPU, repeats=1, warmup=0).loss_identical


# ---------------------------------------------------------------------------------------------
# The CLI


@pytest.mark.slow
def test_cli_plan_writes_the_plan_and_the_plot(dense, cache, tmp_path, capsys):
    out, plot, report = tmp_path / "plan.yaml", tmp_path / "pareto.png", tmp_path / "plan.json"
    args = ["plan", "--model", "model_factories:dense_long", "--budget", "80%", "--min-bytes", "0"]
    args += ["--repeats", "3", "--cache-dir", str(cache), "--out", str(out), "--plot", str(plot)]
    assert main([*args, "--json", str(report), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "predicted" in printed and "measured" in printed and "prediction error" in printed
    # The hints name the model the plan was made for (once, they ran it on the default model).
    lines = [line.strip() for line in printed.splitlines()]
    assert f"actplan bench --model model_factories:dense_long --config {out}" in lines
    assert f"actplan verify --model model_factories:dense_long --config {out}" in lines
    assert RecomputeConfig.from_file(out)
    result = json.loads(report.read_text())
    assert result["measured"]["peak_bytes"] <= result["budget_bytes"]
    assert plot.exists()


def test_cli_plan_below_the_minimum_states_the_range_and_the_trade_off(dense, cache, capsys):
    args = ["plan", "--model", "model_factories:dense_long", "--budget", "1MiB", "--min-bytes", "0"]
    assert main([*args, "--cache-dir", str(cache), "--no-run", "--plot", "", "--quiet"]) == 2
    printed = " ".join(capsys.readouterr().out.split())
    assert "predicted peaks range from" in printed and "up to the no-checkpoint peak" in printed
    assert "What each budget buys" in printed
    assert re.search(r"MiB +\d+% +\d\.\d{3}x +0-1 ", printed)  # a row of the front: peak, share, time, plan


def test_cli_plan_above_the_no_checkpoint_peak_says_so(dense, cache, tmp_path, capsys):
    args = ["plan", "--model", "model_factories:dense_long", "--budget", "150%", "--min-bytes", "0"]
    args += ["--cache-dir", str(cache), "--out", str(tmp_path / "p.yaml")]
    assert main([*args, "--no-run", "--plot", "", "--quiet"]) == 0
    assert "at or above the predicted peak without checkpointing" in capsys.readouterr().out


def test_cli_plan_rejects_a_malformed_budget_before_any_work(tmp_path, capsys):
    # A fresh cache directory: profiling would take seconds and write a file there.
    args = ["plan", "--model", "model_factories:dense_long", "--budget", "lots", "--min-bytes", "0"]
    assert main([*args, "--cache-dir", str(tmp_path), "--no-run", "--plot", "", "--quiet"]) == 2
    assert "cannot read budget 'lots'" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_cli_plan_refuses_a_budget_without_a_unit_before_any_work(tmp_path, capsys):
    # '20' once became a budget of 20 bytes: "no plan fits a budget of 0.0 MiB".
    args = ["plan", "--model", "model_factories:dense_long", "--budget", "20", "--min-bytes", "0"]
    assert main([*args, "--cache-dir", str(tmp_path), "--no-run", "--plot", "", "--quiet"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "budget '20' has no unit" in out and "'20GiB'" in out and "'20%'" in out
    assert not list(tmp_path.iterdir())


def test_cli_plan_sweep_prints_the_front_without_running(dense, cache, tmp_path, capsys):
    report = tmp_path / "front.json"
    args = ["plan", "--model", "model_factories:dense_long", "--sweep", "--min-bytes", "0"]
    args += ["--cache-dir", str(cache), "--plot", "", "--json", str(report), "--quiet"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    front = json.loads(report.read_text())["front"]
    _, profile = dense
    assert front[0]["predicted_peak_bytes"] == pytest.approx(minimum_peak(profile.problem())[0])
    # The front ends at the fastest plan; with timing noise a kept set can tie `none` on time
    # and hold less, so the last point need not be `none` itself.
    assert front[-1]["share_of_none_peak"] <= 1.0 + 1e-9 and len(front[-1]["candidates"]) == 2
    assert all(a["predicted_ratio"] > b["predicted_ratio"] for a, b in itertools.pairwise(front))
    assert "every plan worth having" in printed
    with pytest.raises(SystemExit):
        main(["plan", "--model", "dense", "--sweep", "--budget", "50%"])  # one or the other
    assert main([*args, "--out", str(tmp_path / "x.yaml")]) == 2
    assert "--sweep writes no plan" in capsys.readouterr().out


@pytest.mark.slow
def test_a_reserved_budget_bounds_what_the_caching_allocator_reserves(dense, cache, tmp_path):
    # On a GPU a budget bounds the allocator's reserved segments (what a run runs out of), not
    # the bytes tensors request: the plan is stepped, its allocation trace replayed through the
    # allocator model, and a plan whose reserve does not fit is not offered as fitting.
    from actplan.measure import AllocatorSettings
    from actplan.planning._reserved import modelled_reserved
    from actplan.planning.planner import BudgetError, solve

    bundle, profile = dense
    lowest, _ = minimum_peak(profile.problem())
    least = config_for(profile, solve(profile.problem(), lowest).choices)
    least_reserved = modelled_reserved(bundle, least, CPU, AllocatorSettings()).peak_reserved_bytes
    assert least_reserved > lowest  # segments round the requests up

    def planned(budget, budget_of):
        out = tmp_path / f"{budget_of}-{budget}.yaml"
        result = plan_under_budget(bundle, "model_factories:dense_long", budget, CPU, out=out, plot=None,
                                   run=False, cache_dir=cache, min_bytes=0, budget_of=budget_of)  # fmt: skip
        return result, RecomputeConfig.from_file(out)

    between = (lowest + least_reserved) // 2  # the requested bytes fit, the reserve cannot
    result, written = planned(between, "requested")
    assert result.solution["predicted_peak_bytes"] <= between
    assert written.made_for.budget_of == "requested"
    assert result.solution["modelled_reserved_peak_bytes"] is None
    with pytest.raises(BudgetError, match=r"no plan fits .* once the allocator's reserve is counted"):
        planned(between, "reserved")
    roomy = int(least_reserved * 1.5)
    result, written = planned(roomy, "reserved")
    assert result.solution["modelled_reserved_peak_bytes"] <= roomy
    assert written.made_for.budget_of == "reserved"
    assert any("the budget bounds the caching allocator's reserved peak" in note for note in result.notes)


def test_cli_plan_refuses_budget_of_with_sweep_before_any_work(capsys):
    assert main(["plan", "--sweep", "--budget-of", "reserved"]) == 2
    printed = capsys.readouterr().out
    assert "--budget-of applies to a plan for --budget; --sweep plans for no budget" in printed
