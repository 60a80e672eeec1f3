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


def test_cpu_goals_take_engine_costs_median_over_processes_when_it_has_the_model(tmp_path):
    pairs = [
        {"actplan": "full", "peer": "torch-checkpoint", "ratio": 1.5},
        {"actplan": "matmuls", "peer": "op-sac-matmuls", "ratio": 0.8},
    ]
    for model in ("dense", "moe"):
        peers = {"cpu_overhead": {"pairs": pairs}, "at_same_peak": []}
        (tmp_path / f"peers_{model}_small.json").write_text(json.dumps(peers))
    after = [{"full/torch-checkpoint": r, "matmuls/op-sac-matmuls": 0.9} for r in (1.2, 1.05, 1.08)]
    engine = {"runs": {"moe": {"before": [], "after": after}}}
    (tmp_path / "engine_cost.json").write_text(json.dumps(engine))
    goals = {g["goal"]: g for g in evaluate(tmp_path)}
    moe_full = goals["CPU cost per layer, moe tiny: `full` / torch-checkpoint at most 1.1 "
                     "(engine_cost.json, median of 3 processes)"]
    assert moe_full["value"] == 1.08 and moe_full["met"]
    moe_sac = goals["CPU cost per layer, moe tiny: `matmuls` / op-sac-matmuls at most 0.85 "
                    "(engine_cost.json, median of 3 processes)"]
    assert moe_sac["value"] == 0.9 and not moe_sac["met"]
    # No dense runs in engine_cost.json: the peers report's own figure.
    dense_full = goals["CPU cost per layer, dense tiny: `full` / torch-checkpoint at most 1.03 "
                       "(peers_dense_small.json)"]
    assert dense_full["value"] == 1.5 and not dense_full["met"]
