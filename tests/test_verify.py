"""``actplan verify``: passes exact plans, catches a plan that changes the step and says where."""

from __future__ import annotations

import json

import pytest
import torch

from actplan.cli import main
from actplan.evaluate.verify import verify
from actplan.models import build_model, load_model


@pytest.mark.parametrize("config", ["full", "matmuls", {"mode": "selective", "keep": ["mlp_up"]}])
def test_exact_plans_pass_with_the_recompute_checked(config):
    report = verify(build_model("dense", "tiny", dropout=0.1), config, steps=2, check_recompute=True)
    assert report.ok, report.problems()
    assert report.recompute_ops_compared > 0 and not report.recompute_mismatches
    assert all(s.loss_identical and s.max_abs_grad_diff == 0.0 for s in report.steps)


def test_moe_routing_decisions_are_compared():
    report = verify(build_model("moe", "tiny"), "full", steps=2)
    assert report.ok, report.problems()
    assert all(s.routing_decisions > 0 and s.routing_match for s in report.steps)


def test_a_replay_that_draws_other_numbers_is_caught_and_located():
    report = verify(load_model("model_factories:noisy"), "full", steps=1, check_recompute=True)
    assert not report.ok
    problems = "\n".join(report.problems())
    assert "gradient of layers.0.up.weight differs" in problems
    assert "recompute of layers.0: op aten.mul.Tensor" in problems and "values differ" in problems
    # Forward values are untouched: only the backward goes wrong.
    assert report.steps[0].loss_identical


def test_cli_exit_code_and_json(tmp_path, capsys):
    out = tmp_path / "verify.json"
    args = ["verify", "--model", "dense", "--size", "tiny", "--config", "matmuls", "--json", str(out)]
    assert main([*args, "--quiet"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert json.loads(out.read_text())["ok"] is True
    assert (
        main(["verify", "--model", "model_factories:noisy", "--config", "full", "--steps", "1", "--quiet"])
        == 1
    )
    printed = capsys.readouterr().out
    assert "FAIL" in printed and "layers.0.up.weight" in printed


def test_steps_must_be_positive():
    with pytest.raises(ValueError, match="steps must be at least 1"):
        verify(build_model("dense", "tiny"), "full", steps=0)


def test_equal_infinities_and_nans_are_not_differences():
    from actplan.evaluate.verify import _value_difference

    inf, nan = float("inf"), float("nan")
    a = torch.tensor([1.0, -inf, nan, inf])
    assert _value_difference(a, a.clone()) == 0.0
    assert _value_difference(a, torch.tensor([1.5, -inf, nan, inf])) == 0.5
    assert _value_difference(a, torch.tensor([1.0, inf, nan, inf])) == inf
    assert _value_difference(a, torch.tensor([1.0, -inf, 2.0, inf])) == inf
