"""The profiler's timing on a busy machine: rounds where a run lost its CPU are left out, what
does not settle is reported with its spread, and the CLI warns. No timed assertions: the
timer is a fake clock that advances by a fixed cost per linear layer's forward (so recompute
costs time), plus, when noisy, seeded random stalls (another job taking the CPU)."""

from __future__ import annotations

import json
import logging
import random
import types

import pytest
import torch
from torch import nn

import actplan.measure._timing as timing_module
import actplan.planning._isolated as isolated_module
from actplan.cli import main
from actplan.measure import TimingStats
from actplan.measure._timing import median_spread, paired_differences, unstolen
from actplan.models import load_model
from actplan.planning._isolated import IsolatedLayer
from actplan.planning._records import PROFILE_FORMAT, CandidateProfile, LayerTypeProfile, ModelProfile
from actplan.planning.profile import profile_model

CPU = torch.device("cpu")
LINEAR_SECONDS = 1e-3


class FakeClock:
    """``perf_counter`` for the timer: 1 ms per ``nn.Linear`` forward (recompute included);
    with ``stall``, each forward may also wait a seeded random while (up to ``stall`` s)."""

    def __init__(self, stall: float = 0.0, seed: int = 0) -> None:
        self.now = 0.0
        self.stall = stall
        self.draws = random.Random(seed)

    def perf_counter(self) -> float:
        return self.now

    def on_forward(self, module: nn.Module, args, output) -> None:
        if isinstance(module, nn.Linear):
            self.now += LINEAR_SECONDS
            if self.stall and self.draws.random() < 0.5:
                self.now += self.draws.uniform(0.0, self.stall)


@pytest.fixture
def fake_clock(monkeypatch):
    """Installs a ``FakeClock`` in the timer's modules; call it with the stall to use."""
    handles = []

    def install(stall: float = 0.0) -> FakeClock:
        clock = FakeClock(stall)
        fake_time = types.SimpleNamespace(perf_counter=clock.perf_counter)
        monkeypatch.setattr(timing_module, "time", fake_time)
        monkeypatch.setattr(isolated_module, "time", fake_time)
        handles.append(torch.nn.modules.module.register_module_forward_hook(clock.on_forward))
        return clock

    yield install
    for handle in handles:
        handle.remove()


def _profile(repeats: int = 2) -> ModelProfile:
    bundle = load_model("dense", "tiny")
    return profile_model(bundle, spec="dense", device=CPU, repeats=repeats, progress=lambda event: None)


# ---------------------------------------------------------------------------------------------
# The statistics


def test_a_run_far_above_its_median_is_stolen():
    assert unstolen([10.0, 11.0, 16.0, 10.0]) == [True, True, False, True]
    assert unstolen([10.0, 40.0]) == [True, True]  # too few to judge
    # A round is left out when either of its runs was stolen; all are kept when too few remain.
    assert paired_differences([13.0, 14.0, 15.0, 13.0], [10.0, 10.0, 30.0, 10.0]) == [3.0, 4.0, 3.0]
    assert paired_differences([13.0, 13.0, 13.0], [10.0, 30.0, 10.0]) == [3.0, -17.0, 3.0]
    assert median_spread([1.0]) == float("inf")
    assert median_spread([3.0, 3.0, 3.0, 3.0]) == 0.0


def test_a_round_where_none_lost_its_cpu_is_left_out(monkeypatch):
    # Round 3: `none` ran 3x its median (another job had the CPU); `full` did not notice.
    none, full = [10.0, 10.0, 30.0, 10.0], [13.0, 14.0, 15.0, 13.0]
    seen = []

    def scripted(runs, *, settled, **options):
        seen.append(settled({"none": none, "full": full}))
        return {"none": TimingStats.from_samples(none), "full": TimingStats.from_samples(full)}

    monkeypatch.setattr(isolated_module, "interleaved_timing", scripted)
    layer = nn.Linear(4, 4)
    isolated = IsolatedLayer(layer, (torch.randn(2, 4),), {}, 0)
    monkeypatch.setattr(isolated, "_warm", lambda candidate: layer)
    candidates = [CandidateProfile("none", "none", [], False), CandidateProfile("full", "full", [], False)]
    isolated.measure_time(candidates, repeats=5)
    c_none, c_full = candidates
    assert seen == [True]  # settled: the stolen round does not count against it
    assert c_none.layer_seconds == 10.0 and c_none.timing_settled
    assert c_full.extra_seconds == 3.0 and c_full.timing_settled
    # Kept, the stolen round's -15 would have widened the spread past 5% of none's 10.
    assert c_full.extra_seconds_spread == pytest.approx(median_spread([3.0, 4.0, 3.0]))
    assert median_spread([3.0, 4.0, -15.0, 3.0]) > 0.05 * 10.0


def test_past_repeats_only_the_loose_candidates_are_timed_again(monkeypatch):
    # `a` settled in the first 3 rounds; `b` swings by 4 (of none's 10) each round and never does.
    reference = [10.0, 10.0, 10.0]
    pairs = {"a": ([13.0, 13.0, 13.0], list(reference)), "b": ([13.0, 17.0, 13.0], list(reference))}
    ran = []

    def one_round(runs, *, repeats, warmup):
        ran.append(sorted(runs))
        b = 17.0 if len(ran) % 2 else 13.0
        return {name: TimingStats.from_samples([{"none": 10.0, "b": b}[name]]) for name in runs}

    monkeypatch.setattr(isolated_module, "interleaved_timing", one_round)
    isolated_module._until_settled({"none": None, "a": None, "b": None}, reference, pairs, cap=9)
    assert ran == [["b", "none"]] * 6 and len(reference) == 9
    assert len(pairs["a"][0]) == 3 and len(pairs["b"][0]) == len(pairs["b"][1]) == 9


# ---------------------------------------------------------------------------------------------
# Whole profiles on the fake clock


def test_a_quiet_profile_settles_and_says_nothing(fake_clock, caplog):
    fake_clock(stall=0.0)
    with caplog.at_level(logging.WARNING, logger="actplan"):
        profile = _profile()
    assert profile.timing_settled and profile.timing_spread < 1e-9
    assert profile.timing_warning() is None and not caplog.records
    for c in profile.layer_types[0].candidates:
        assert c.timing_settled and c.extra_seconds_spread < 1e-12
    # Recompute costs the forwards of the linears it reruns: whole milliseconds, some of none's.
    (layer_type,) = profile.layer_types
    none, full = layer_type.candidate("none"), layer_type.candidate("full")
    reruns = full.extra_seconds / LINEAR_SECONDS
    assert reruns == pytest.approx(round(reruns)) and 0 < round(reruns) <= none.layer_seconds / LINEAR_SECONDS


def test_a_noisy_profile_reports_its_spread_and_warns(fake_clock, caplog):
    fake_clock(stall=0.02)
    with caplog.at_level(logging.WARNING, logger="actplan"):
        profile = _profile()
    (layer_type,) = profile.layer_types
    none = layer_type.candidate("none")
    loose = [c for c in layer_type.candidates if not c.timing_settled]
    assert loose and not profile.timing_settled
    for c in loose:
        assert c.extra_seconds_spread > 0.05 * none.layer_seconds
    assert profile.timing_spread == pytest.approx(
        max(c.extra_seconds_spread for c in layer_type.candidates) / none.layer_seconds
    )
    # An offloaded variant is as loose as the candidate it moves.
    for c in layer_type.candidates:
        if c.offload:
            twin = next(t for t in layer_type.candidates if t.key == (c.mode, tuple(c.kept_units), False))
            assert c.extra_seconds_spread == twin.extra_seconds_spread
            assert c.timing_settled == twin.timing_settled
    (record,) = [r for r in caplog.records if getattr(r, "actplan_loose_timing", False)]
    assert record.levelno == logging.WARNING
    assert "did not settle" in record.getMessage() and "--repeats" in record.getMessage()
    # The spread of a plan's ratio adds its layers' candidates' spreads.
    picked = layer_type.candidates[1]
    assert profile.ratio_spread([picked.name] * 2) >= 2 * picked.extra_seconds_spread / profile.base_seconds


def test_the_cli_prints_one_warning_line_and_the_plans_spread(fake_clock, tmp_path, capsys):
    fake_clock(stall=0.02)
    model = ["--model", "model_factories:dense_long", "--min-bytes", "0"]
    common = [*model, "--repeats", "2", "--cache-dir", str(tmp_path), "--quiet"]
    assert main(["profile", *common]) == 0
    out, err = capsys.readouterr()
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "did not settle" not in err  # the logged one is held back
    (line,) = warnings
    assert "±" in line and "of the layer's time" in line
    assert "The machine was busy: rerun when it is idle, or raise --repeats" in line
    plan = ["plan", *common, "--budget", "80%", "--no-run", "--plot", "", "--out", str(tmp_path / "p.yaml")]
    assert main(plan) == 0
    out = capsys.readouterr().out
    assert "x ± " in out and "(from loose timing)" in out
    assert sum(line.startswith("warning:") for line in out.splitlines()) == 1


def test_the_cli_prints_no_warning_when_timing_settled(fake_clock, tmp_path, capsys):
    fake_clock(stall=0.0)
    args = ["profile", "--model", "dense", "--size", "tiny", "--repeats", "2", "--cache-dir", str(tmp_path)]
    assert main([*args, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "warning" not in out and "±" not in out


# ---------------------------------------------------------------------------------------------
# Older profiles


def test_an_older_profile_without_the_spread_fields_still_loads():
    candidate = CandidateProfile("none", "none", [], False, 100, 10, 0.5, 0.0, 0)
    layer_type = LayerTypeProfile("t", "Block", [0], [candidate])
    profile = ModelProfile(
        *("m", "k", "cpu", "2", 1, 1, [1], 0, 0, 0, 1.0, 2, 2, {"device_to_host": 1.0}, False, 0),
        [layer_type],
        ["t"],
    )
    data = json.loads(profile.to_json())
    for key in ("timing_settled", "timing_spread", "base_seconds_spread"):
        del data[key]
    for layer_type in data["layer_types"]:
        for c in layer_type["candidates"]:
            del c["extra_seconds_spread"], c["timing_settled"]
    loaded = ModelProfile.from_json(json.dumps(data))
    assert loaded == profile and loaded.timing_settled and loaded.timing_warning() is None
    assert loaded.layer_types[0].candidates[0].extra_seconds_spread == 0.0
    assert loaded.ratio_spread(["none"]) == 0.0
    assert PROFILE_FORMAT >= 6  # cached profiles made before the spread are measured again
