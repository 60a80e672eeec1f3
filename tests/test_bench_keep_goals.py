"""bench.keep_goals: the keep goals stated from bench reports."""

import json

from bench.keep_goals import evaluate, to_markdown


def _row(name, activation_bytes, held=None, parity=True):
    return {"name": name, "activation_bytes": activation_bytes, "parity_ok": parity, "held_by_unit": held}


def test_goals_flag_plans_above_none_and_units_above_autograd(tmp_path):
    units = {"mlp_up": {"held": 110, "autograd": 100}, "routing": {"held": 9, "autograd": 0}}
    rows = [
        _row("none", 1000),
        _row("full", 100),
        _row("matmuls", 1200, units),
        _row("attn", 300, parity=False),
    ]
    (tmp_path / "bench_dense_small.json").write_text(json.dumps({"rows": rows}))
    goals = {g["goal"]: g for g in evaluate(tmp_path)}
    assert not goals["dense_small: `matmuls` holds at most `none`, exact (loss, gradients, census)"]["met"]
    assert goals["dense_small: `full` holds at most `none`, exact (loss, gradients, census)"]["met"]
    assert not goals["dense_small: `attn` holds at most `none`, exact (loss, gradients, census)"]["met"]
    unit = goals["dense_small: `matmuls` unit mlp_up holds at most 1.05x what autograd keeps"]
    assert not unit["met"] and abs(unit["value"] - 1.1) < 1e-9
    assert not any("routing" in g for g in goals)  # routing is held by contract
    # No megatron-selective row in this report: no verdict is invented for it.
    assert "dense small: `megatron-selective` at most 0.90x `none`" not in goals
    assert "| NOT met |" in to_markdown(list(goals.values()))
