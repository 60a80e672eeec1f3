"""The budget planner: exact against brute force, monotone in the budget, clear errors."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actplan.planning import _bounds, _frontier, _milp
from actplan.planning.planner import (
    BudgetError,
    Candidate,
    PlanProblem,
    Solution,
    front_table,
    least_host_bytes,
    minimum_peak,
    none_peak,
    pareto_front,
    parse_budget,
    plan_summary,
    solve,
)
from planner_oracle import brute_force

MIB = 2**20

candidates = st.builds(
    Candidate,
    name=st.sampled_from(["full", "none", "keep a", "keep a+b", "full+offload"]),
    retained_bytes=st.integers(0, 200).map(lambda m: float(m * MIB)),
    transient_bytes=st.integers(0, 100).map(lambda m: float(m * MIB)),
    extra_seconds=st.integers(0, 1000).map(lambda ms: ms / 1000),
    offloaded_bytes=st.integers(0, 100).map(lambda m: float(m * MIB)),
)
mib = st.integers(0, 300).map(lambda m: float(m * MIB))


def _costs_around(draw, layers: tuple, grads: tuple) -> PlanProblem:
    """``layers`` with drawn fixed costs, calibration terms and prefetch depth."""
    return PlanProblem(
        layers=layers,
        static_bytes=draw(mib),
        base_seconds=1.0,
        nonlayer_bytes=draw(mib),
        layer_grad_bytes=grads,
        other_grad_bytes=draw(mib),
        optimizer_step_bytes=draw(mib),
        head_transient_bytes=draw(mib),
        layer_extra_bytes=draw(st.one_of(st.just(()), st.tuples(*(mib for _ in layers)))),
        prefetch_layers=draw(st.integers(0, 2)),
    )


@st.composite
def problems(draw):
    layers = draw(st.lists(st.lists(candidates, min_size=1, max_size=4).map(tuple), min_size=1, max_size=4))
    return _costs_around(draw, tuple(layers), tuple(draw(mib) for _ in layers))


def _solved_both_ways(problem: PlanProblem, budget: float) -> tuple[Solution, Solution]:
    """``solve``, and ``solve`` with a one-state beam: small problems are often answered by the
    beam pass alone (exact when it never thins), this leaves them to the walks from both ends
    and their rising targets."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_frontier, "THIN", 1)
        walked = solve(problem, budget)
    return solve(problem, budget), walked


@settings(max_examples=80, deadline=None)
@given(problem=problems(), slack=st.floats(0.0, 1.5))
def test_solver_matches_brute_force(problem, slack):
    lowest, _ = minimum_peak(problem)
    budget = lowest * (1 + slack)
    expected = brute_force(problem, budget)
    assert expected is not None  # the minimum itself always fits
    for solution in _solved_both_ways(problem, budget):
        assert solution.predicted_seconds == pytest.approx(expected[0], abs=1e-9)
        assert solution.predicted_peak_bytes <= budget * (1 + 1e-6) + 1


@settings(max_examples=40, deadline=None)
@given(problem=problems(), steps=st.lists(st.floats(0.0, 2.0), min_size=2, max_size=6))
def test_a_larger_budget_is_never_slower_and_never_exceeded(problem, steps):
    lowest, _ = minimum_peak(problem)
    previous = None
    for budget in sorted(lowest * (1 + s) for s in steps):
        solution = solve(problem, budget)
        assert solution.predicted_peak_bytes <= budget * (1 + 1e-6) + 1
        if previous is not None:
            assert solution.predicted_seconds <= previous + 1e-9
        previous = solution.predicted_seconds


@st.composite
def stacks(draw):
    """Longer problems made of a few repeated layer types, as real models are (and as make
    the frontier's staircases long): checked against the MILP optimum."""
    types = draw(st.lists(st.lists(candidates, min_size=2, max_size=7).map(tuple), min_size=1, max_size=3))
    count = draw(st.integers(4, 24))
    order = draw(st.lists(st.integers(0, len(types) - 1), min_size=count, max_size=count))
    grads = tuple(draw(st.integers(0, 20)) * MIB for _ in order)
    return _costs_around(draw, tuple(types[t] for t in order), grads)


@settings(max_examples=60, deadline=None)
@given(problem=stacks(), slack=st.floats(0.0, 1.0))
def test_frontier_solver_matches_the_milp_optimum(problem, slack):
    _assert_milp_optimum(problem, slack)


@st.composite
def jittered_stacks(draw):
    """Stacks of a few layer types with every layer's costs drawn within 0.5% of its type's, as
    a profile taken per layer gives: no two layers alike, so partial plans almost never tie."""
    types = draw(st.lists(st.lists(candidates, min_size=2, max_size=7).map(tuple), min_size=1, max_size=3))
    count = draw(st.integers(4, 24))
    order = draw(st.lists(st.integers(0, len(types) - 1), min_size=count, max_size=count))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))

    def near(value: float) -> float:
        return value * (1 + rng.uniform(-0.005, 0.005))

    layers = tuple(
        tuple(
            replace(
                c,
                retained_bytes=near(c.retained_bytes),
                transient_bytes=near(c.transient_bytes),
                extra_seconds=near(c.extra_seconds),
                offloaded_bytes=near(c.offloaded_bytes),
            )
            for c in types[t]
        )
        for t in order
    )
    grads = tuple(near(draw(st.integers(1, 20)) * MIB) for _ in order)
    return replace(
        _costs_around(draw, layers, grads), layer_extra_bytes=tuple(near(draw(mib) + MIB) for _ in order)
    )


@settings(max_examples=60, deadline=None)
@given(problem=jittered_stacks(), slack=st.floats(0.0, 1.0))
def test_jittered_layers_get_the_milp_optimum(problem, slack):
    _assert_milp_optimum(problem, slack)


def _assert_milp_optimum(problem: PlanProblem, slack: float) -> None:
    """The least peak and, at a budget ``slack`` above it, the time both equal the MILP's."""
    lowest, _choices = minimum_peak(problem)
    assert lowest == pytest.approx(problem.peak(_milp.milp(problem, None)), rel=1e-9)
    budget = lowest * (1 + slack)
    milp = _milp.milp(problem, budget * (1 + 1e-9) + 1)
    assert milp is not None
    for solution in _solved_both_ways(problem, budget):
        assert solution.predicted_seconds == pytest.approx(problem.seconds(milp), abs=1e-9)
        assert solution.predicted_peak_bytes <= budget * (1 + 1e-6) + 1


def _with_host_budget(problem: PlanProblem, share: float) -> PlanProblem:
    """``problem`` with a host budget ``share`` of the way from the least any plan offloads to
    the most."""
    least = least_host_bytes(problem)
    most = sum(max(c.offloaded_bytes for c in cs) for cs in problem.layers)
    return replace(problem, host_budget_bytes=least + (most - least) * share)


def _least_peak_within_host(problem: PlanProblem) -> float:
    return min(
        problem.peak(c)
        for c in itertools.product(*(range(len(cs)) for cs in problem.layers))
        if problem.host_fits(c)
    )


@settings(max_examples=80, deadline=None)
@given(problem=problems(), share=st.floats(0.0, 1.0), slack=st.floats(0.0, 1.5))
def test_a_host_budget_is_kept_and_the_solver_matches_brute_force(problem, share, slack):
    problem = _with_host_budget(problem, share)
    lowest, choices = minimum_peak(problem)
    assert problem.host_fits(choices)
    assert lowest == pytest.approx(_least_peak_within_host(problem), rel=1e-12)
    budget = lowest * (1 + slack)
    expected = brute_force(problem, budget)
    assert expected is not None
    for solution in _solved_both_ways(problem, budget):
        assert solution.predicted_seconds == pytest.approx(expected[0], abs=1e-9)
        assert problem.host_fits(solution.choices)


@settings(max_examples=60, deadline=None)
@given(problem=problems(), share=st.floats(0.0, 1.0), slack=st.floats(0.0, 1.5))
def test_the_priced_search_alone_is_within_its_gap(problem, share, slack):
    """Where the exact walks give up (forced here), the priced search's plan fits both budgets
    and is no more than its stated gap slower than the fastest plan."""
    problem = _with_host_budget(problem, share)
    budget = minimum_peak(problem)[0] * (1 + slack)
    expected = brute_force(problem, budget)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_frontier, "HOSTED_LIMIT", 0)
        solution = solve(problem, budget)
    assert problem.host_fits(solution.choices)
    assert solution.predicted_peak_bytes <= budget * (1 + 1e-6) + 1
    assert solution.gap_seconds >= 0
    assert (
        solution.predicted_seconds - solution.gap_seconds
        <= expected[0] + 1e-9
        <= solution.predicted_seconds + 2e-9
    )


@settings(max_examples=40, deadline=None)
@given(problem=stacks(), share=st.floats(0.0, 1.0), slack=st.floats(0.0, 1.0))
def test_a_host_budget_on_long_stacks_gets_the_milp_optimum(problem, share, slack):
    problem = _with_host_budget(problem, share)
    _assert_milp_optimum(problem, slack)
    assert problem.host_fits(minimum_peak(problem)[1])


def test_a_host_budget_below_every_plan_names_the_least_it_needs():
    moved = (Candidate("full+offload", 1 * MIB, 0, 0.0, offloaded_bytes=8 * MIB),)
    problem = PlanProblem(layers=(moved, moved), static_bytes=0, base_seconds=1.0, host_budget_bytes=10 * MIB)
    with pytest.raises(BudgetError, match=r"host budget of 10\.0 MiB.*offloads least moves 16\.0 MiB"):
        minimum_peak(problem)
    with pytest.raises(ValueError, match="host_budget_bytes is -1"):
        replace(problem, host_budget_bytes=-1)


def test_a_host_budget_trades_offload_for_recompute():
    layer = (
        Candidate("full", 1 * MIB, 4 * MIB, 0.3),
        Candidate("matmuls+offload", 1 * MIB, 4 * MIB, 0.05, offloaded_bytes=30 * MIB),
        Candidate("none", 40 * MIB, 0, 0.0),
    )
    problem = PlanProblem(layers=(layer,) * 4, static_bytes=0, base_seconds=1.0)
    free = solve(problem, 20 * MIB)
    assert free.names == ("matmuls+offload",) * 4
    capped = solve(replace(problem, host_budget_bytes=70 * MIB), 20 * MIB)
    assert sorted(capped.names) == ["full", "full", "matmuls+offload", "matmuls+offload"]
    with pytest.raises(
        BudgetError, match=r"with at most 70\.0 MiB offloaded to the host.*raise the host budget"
    ):
        solve(replace(problem, host_budget_bytes=70 * MIB), 5 * MIB)


def _room_before(problem: PlanProblem, budget: float, first: int, tail: tuple[int, ...]) -> float:
    """The most bytes layers ``0..first-1`` may retain under ``tail`` (the choices of layers
    ``first..``): every phase from ``first`` on, and backward start, with reloads from before
    ``first`` taken as none."""
    picked = [problem.layers[first + k][c] for k, c in enumerate(tail)]
    fixed = problem.static_bytes + problem.backward_extra_bytes + problem.other_grad_bytes
    after, extras = problem.grads_after(), problem.extras()
    start = problem.static_bytes + problem.backward_extra_bytes + problem.nonlayer_bytes
    room = budget - start - problem.head_transient_bytes - sum(p.retained_bytes for p in picked)
    held = 0.0
    for k, p in enumerate(picked):
        held += p.retained_bytes
        reloaded = sum(q.offloaded_bytes for q in picked[max(k - problem.prefetch_layers, 0) : k])
        phase = fixed + after[first + k] + extras[first + k] + held + p.transient_bytes + reloaded
        room = min(room, budget - phase)
    return room


@settings(max_examples=80, deadline=None)
@given(problem=problems(), slack=st.floats(0.0, 1.5))
def test_the_bounds_never_exceed_what_the_rest_really_costs(problem, slack):
    """What the walks prune with, against brute force: for every prefix of every plan that fits,
    the seconds bound on the layers after it is at most the fastest fitting way to finish it and
    its bytes are under the completion cap; for every suffix, the bound on the layers before it
    (at the bytes it leaves them) is at most the fastest fitting way to start it; the bound on
    the whole plan is at most the optimum."""
    lowest, _ = minimum_peak(problem)
    budget = lowest * (1 + slack)
    bounds = _bounds.Bounds(_bounds.Costs(problem), budget)
    fitting = [
        c for c in itertools.product(*(range(len(cs)) for cs in problem.layers)) if problem.peak(c) <= budget
    ]
    layers = len(problem.layers)
    seconds = [[problem.layers[i][c].extra_seconds for i, c in enumerate(plan)] for plan in fitting]
    assert bounds.lowest <= min(sum(s) for s in seconds) + 1e-10
    rest: dict[tuple[int, ...], float] = {}
    head: dict[tuple[int, ...], float] = {}
    for plan, plan_seconds in zip(fitting, seconds, strict=True):
        for i in range(layers):
            rest[plan[: i + 1]] = min(rest.get(plan[: i + 1], np.inf), sum(plan_seconds[i + 1 :]))
            head[plan[i:]] = min(head.get(plan[i:], np.inf), sum(plan_seconds[:i]))
    for prefix, least in rest.items():
        i = len(prefix) - 1
        held = sum(problem.layers[k][c].retained_bytes for k, c in enumerate(prefix))
        assert held <= bounds.cap[i]
        assert bounds.after(i, np.array([held]))[0] <= least + 1e-10
    for suffix, least in head.items():
        first = layers - len(suffix)
        room = _room_before(problem, budget, first, suffix)
        assert bounds.before(first, np.array([room]))[0] <= least + 1e-10


@settings(max_examples=100, deadline=None)
@given(
    states=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 5), st.integers(0, 5)), max_size=40
    )
)
def test_dominance_keeps_exactly_the_undominated_states(states):
    """A state goes when another with no larger keys, bytes and score exists (one of identical
    states stays): against all pairs."""
    keys = np.array([s[:2] for s in states], dtype=float).reshape(-1, 2)
    worse = np.array([s[2] for s in states], dtype=float)
    score = np.array([s[3] for s in states], dtype=float)
    kept, _ = _frontier._pareto(keys, worse, score)

    def beats(a: int, b: int) -> bool:
        return all(x <= y for x, y in zip(states[a], states[b], strict=True))

    expected = [
        b
        for b in range(len(states))
        if not any(beats(a, b) and (states[a] != states[b] or a < b) for a in range(len(states)) if a != b)
    ]
    assert sorted(states[i] for i in kept) == sorted(states[i] for i in expected)


def test_a_frontier_past_its_limit_falls_back_to_the_milp(monkeypatch):
    layer = tuple(Candidate(f"c{i}", i * MIB, (9 - i) * MIB, (9 - i) / 100) for i in range(10))
    problem = PlanProblem(layers=(layer,) * 8, static_bytes=0, base_seconds=1.0)
    budget = 40 * MIB
    exact = solve(problem, budget)
    monkeypatch.setattr(_frontier, "FRONTIER_LIMIT", 2)
    with pytest.raises(_frontier._FrontierTooLarge):
        _frontier.search(_frontier.reduced(problem)[0], budget)
    assert solve(problem, budget).predicted_seconds == pytest.approx(exact.predicted_seconds, abs=1e-12)


def test_infeasible_budget_names_the_minimum():
    layer = (Candidate("full", 10 * MIB, 5 * MIB, 0.2), Candidate("none", 50 * MIB, 1 * MIB, 0.0))
    problem = PlanProblem(layers=(layer, layer), static_bytes=100 * MIB, base_seconds=1.0)
    lowest, choices = minimum_peak(problem)
    assert lowest == 125 * MIB and choices == (0, 0)
    with pytest.raises(
        BudgetError, match=r"peaks range from 125\.0 MiB \(131,072,000 bytes\) up to the no-che"
    ):
        solve(problem, 120 * MIB)
    assert solve(problem, 125 * MIB).names == ("full", "full")
    assert solve(problem, 170 * MIB).names in {("none", "full"), ("full", "none")}
    assert solve(problem, 1000 * MIB).names == ("none", "none")


@settings(max_examples=40, deadline=None)
@given(problem=stacks(), shares=st.lists(st.floats(0.0, 1.2), min_size=1, max_size=5))
def test_the_front_holds_the_fastest_plan_at_every_budget(problem, shares):
    front = pareto_front(problem)
    peaks = [s.predicted_peak_bytes for s in front]
    times = [s.predicted_seconds for s in front]
    assert peaks == sorted(peaks) and all(a > b for a, b in itertools.pairwise(times))
    assert peaks[0] == pytest.approx(minimum_peak(problem)[0], rel=1e-9)
    for share in shares:
        budget = peaks[0] + share * (peaks[-1] - peaks[0])
        best = max(
            (s for s in front if s.predicted_peak_bytes <= budget), key=lambda s: s.predicted_peak_bytes
        )
        assert solve(problem, budget).predicted_seconds == pytest.approx(best.predicted_seconds, abs=1e-9)


def test_the_front_as_a_table():
    layer = (Candidate("full", 10 * MIB, 5 * MIB, 0.2), Candidate("none", 50 * MIB, 1 * MIB, 0.0))
    problem = PlanProblem(layers=(layer, layer, layer), static_bytes=100 * MIB, base_seconds=1.0)
    front = pareto_front(problem)
    assert [s.names for s in front] == [
        ("full", "full", "full"),
        ("full", "full", "none"),  # the last layer's backward runs first: keeping it costs least
        ("full", "none", "none"),
        ("none", "none", "none"),
    ]
    assert none_peak(problem) == front[-1].predicted_peak_bytes == 251 * MIB
    lines = front_table(front, 1.0, none_peak(problem)).splitlines()
    assert lines[0].split()[:3] == ["peak", "share", "step"]
    assert lines[1].split() == ["135.0", "MiB", "54%", "1.600x", "0-2", "full"]
    assert lines[2].endswith("0-1 full; 2 none")
    assert lines[-1].endswith("0-2 none")
    assert plan_summary(("a", "a", "b", "a")) == "0-1 a; 2 b; 3 a"


def test_peak_follows_the_phases_of_backward():
    layer = (Candidate("a", 1, 7, 0), Candidate("b", 1, 3, 0))
    problem = PlanProblem(layers=(layer,) * 3, static_bytes=0, base_seconds=0)
    # Layer 0 runs its backward last, with only its own retained bytes left: 1 + 7.
    assert problem.peak((0, 1, 1)) == 8
    # Layer 2 runs first, with every layer's retained bytes alive: 3 + 7.
    assert problem.peak((1, 1, 0)) == 10
    with_grads = PlanProblem(
        layers=(layer,) * 3,
        static_bytes=100,
        base_seconds=0,
        nonlayer_bytes=20,
        layer_grad_bytes=(5, 5, 5),
        other_grad_bytes=2,
        optimizer_step_bytes=1,
    )
    # Backward start 100 + 20 + 3; layer 0: 100 + 2 + 1 + 7 + 10 grads of layers 1-2; optimizer 118.
    assert with_grads.peak((0, 1, 1)) == 123
    assert with_grads.optimizer_phase_bytes == 118
    # With prefetch, layer i's phase also holds what layer i-1 offloaded (reloaded early).
    moved = (Candidate("a", 1, 7, 0, offloaded_bytes=50), Candidate("b", 1, 3, 0))
    prefetching = PlanProblem(layers=(moved,) * 3, static_bytes=0, base_seconds=0, prefetch_layers=1)
    assert prefetching.peak((0, 1, 1)) == 2 + 3 + 50


@pytest.mark.parametrize(
    ("text", "expected"),
    [("40GiB", 40 * 2**30), ("1.5GB", 1.5e9), ("55%", 550.0), ("100 %", 1000.0), (4096, 4096.0)],
)
def test_budget_forms(text, expected):
    assert parse_budget(text, none_peak_bytes=1000) == expected


@pytest.mark.parametrize("text", ["40 GiBs", "-3GB", "abc", "0", "0%", "12%%"])
def test_malformed_budgets_are_errors(text):
    with pytest.raises(BudgetError, match="budget"):
        parse_budget(text, none_peak_bytes=1000)


def test_percentage_needs_the_no_checkpoint_peak():
    with pytest.raises(BudgetError, match="give the budget in bytes"):
        parse_budget("50%")


@pytest.mark.parametrize(
    ("make", "parts"),
    [
        (
            lambda c: PlanProblem(layers=(), static_bytes=0, base_seconds=1.0),
            ["at least one layer", "pass layers="],
        ),
        (
            lambda c: PlanProblem(layers=((c,), ()), static_bytes=0, base_seconds=1.0),
            ["layer 1 has no candidates", "'none'"],
        ),
        (
            lambda c: PlanProblem(
                layers=((c,),), static_bytes=0, base_seconds=1.0, layer_grad_bytes=(1.0, 2.0)
            ),
            ["2 entries for 1 layers", "one entry per layer"],
        ),
        (
            lambda c: PlanProblem(
                layers=((c, Candidate("full", 1.0, 0.0, float("nan"))),), static_bytes=0, base_seconds=1.0
            ),
            ["layer 0, candidate 'full': extra_seconds is nan", "--refresh"],
        ),
    ],
)
def test_malformed_plan_problems_say_what_to_give(make, parts):
    with pytest.raises(ValueError) as info:
        make(Candidate("none", 1.0, 0.0, 0.0))
    for part in parts:
        assert part in str(info.value)


def test_a_solver_failure_says_it_is_not_a_budget_problem():
    # Costs this large are finite but beyond what HiGHS can scale: it returns an unknown status.
    layer = (Candidate("none", 100.0, 0.0, 0.0), Candidate("full", 10.0, 5.0, 1e308))
    problem = PlanProblem(layers=(layer, layer), static_bytes=0, base_seconds=1.0)
    with pytest.raises(RuntimeError) as info:
        _milp.milp(problem, 150.0)
    assert "MILP solver" in str(info.value) and "not a budget one" in str(info.value)
    assert "upgrade scipy" in str(info.value)


def test_a_missing_plan_extra_names_the_pip_line(monkeypatch):
    layer = (Candidate("none", 1.0, 0.0, 0.0),)
    problem = PlanProblem(layers=(layer,), static_bytes=0, base_seconds=1.0)
    monkeypatch.setitem(sys.modules, "scipy", None)  # what find_spec reports for a missing package
    with pytest.raises(ImportError, match=r"pip install 'actplan\[plan\]'"):
        _milp.milp(problem, None)
    hidden = "import sys; sys.modules['numpy'] = None; import actplan.planning.planner"
    ran = subprocess.run([sys.executable, "-c", hidden], capture_output=True, text=True, check=False)
    assert ran.returncode != 0 and "pip install 'actplan[plan]'" in ran.stderr
