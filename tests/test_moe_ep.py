"""Expert parallelism on 2 ranks (gloo), alone and under ``actplan.parallelize`` (FSDP2), and
on 4 ranks with the experts over 2 of them (FSDP-sharded over the other 2, inside each layer):
exact against one process, no collective replayed, memory flat.

Tolerance: the 2-rank run sums the same products in a different order (each rank's
mean over its half of the batch, then an all-reduce average), so gradients may differ
by rounding; 1e-6 is far below any missing or doubled gradient path (the smallest
gradients that matter here are above 1e-4). The loss and routing must match exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actplan.evaluate.bench import OFFLOAD_VARIANTS
from twoproc import run_ranks, run_two_ranks

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

WORKER = Path(__file__).parent / "dist" / "moe_ep_worker.py"
GRAD_ATOL = 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every scenario's findings per rank, from one two-rank launch."""
    plans = {
        "none": "none",
        "full": "full",
        "matmuls": "matmuls",
        "experts": json.dumps({"mode": "selective", "keep": ["moe_experts"], "layers": "1-2"}),
        "full-rerouting": json.dumps({"mode": "full", "save_collectives": False}),
    }
    scenarios = {name: [plan, ""] for name, plan in plans.items()}
    scenarios |= {f"fsdp-{name}": [plans[name], "fsdp"] for name in ("none", "full", "matmuls")}
    # Each layer compiled (aot_eager) as well: the all-to-all splits are symbolic sizes in the graph.
    scenarios["compiled-matmuls"] = ["matmuls", "fsdp-compile"]
    out = tmp_path_factory.mktemp("ep") / "ep.json"
    ranks = run_two_ranks(WORKER, [json.dumps(scenarios)], out, timeout=600)
    found = {name: [rank[name] for rank in ranks] for name in scenarios}
    # Experts over 2 of 4 ranks: the experts' own FSDP unshard runs inside the checkpointed
    # layer, in forward and in the replay. With 2 experts, each rank's one expert is fewer rows
    # than its 2 FSDP ranks: parallelize splits it on another dimension, not into padding.
    quarter = {f"ep2of4-{name}": [plans[name], "fsdp-ep2"] for name in ("none", "full", "matmuls")}
    # FSDP over 2 tensor-parallel pairs with sequence parallelism: each rank routes its own half of
    # the sequence; the experts over each pair (FSDP-sharded over the pairs) or over every rank.
    # The memory check's 20 steps run in tp-ep2-full only (they cost 6 to 10 s a scenario here).
    once = {"steps": 0}
    quarter |= {f"tp-ep2-{name}": [plans[name], "tp-ep2", once] for name in ("none", "matmuls")}
    quarter["tp-ep2-full"] = [plans["full"], "tp-ep2"]
    # ... and without sequence parallelism: both ranks of a pair route the same tokens.
    quarter |= {f"tp-ep2-nosp-{name}": [plans[name], "tp-ep2-nosp", once] for name in ("none", "full")}
    four = {"config": {"n_experts": 4}, "steps": 0}  # one expert per rank
    quarter |= {f"tp-epall-{name}": [plans[name], "tp-epall", four] for name in ("none", "full")}
    out = out.with_name("ep2of4.json")
    two_experts = json.dumps({"n_experts": 2})
    ranks = run_ranks(WORKER, [json.dumps(quarter), two_experts], out, nproc=4, timeout=600)
    return found | {name: [rank[name] for rank in ranks] for name in quarter}


@pytest.mark.parametrize(
    "plan",
    [
        "none",
        "full",
        "matmuls",
        "experts",
        "fsdp-none",
        "fsdp-full",
        "fsdp-matmuls",
        "compiled-matmuls",
        "ep2of4-none",
        "ep2of4-full",
        "ep2of4-matmuls",
        "tp-ep2-none",
        "tp-ep2-full",
        "tp-ep2-matmuls",
        "tp-epall-none",
        "tp-epall-full",
        "tp-ep2-nosp-none",
        "tp-ep2-nosp-full",
    ],
)
def test_expert_parallel_matches_one_process(results, plan):
    for rank in results[plan]:
        assert rank["loss"] == pytest.approx(rank["reference_loss"], abs=1e-6)
        assert rank["max_grad_diff"] <= GRAD_ATOL, (rank["worst_param"], rank["max_grad_diff"])
        assert rank["missing_grads"] == []
        assert rank["routing_equal"]


def test_experts_fewer_than_their_fsdp_ranks_are_split_on_another_dimension(results):
    # One expert per rank, over 2 FSDP ranks: split on dim 0 it would leave rank 1 a shard of
    # padding as large as rank 0's.
    for rank in results["ep2of4-none"]:
        assert rank["expert_split_dims"] and 0 not in rank["expert_split_dims"]
    for rank in results["fsdp-none"]:
        assert rank["expert_split_dims"] == []  # experts over every rank: left out of FSDP


@pytest.mark.parametrize(
    "plan,baseline",
    [
        ("full", "none"),
        ("matmuls", "none"),
        ("experts", "none"),
        ("fsdp-full", "fsdp-none"),
        ("fsdp-matmuls", "fsdp-none"),
        ("ep2of4-full", "ep2of4-none"),
        ("ep2of4-matmuls", "ep2of4-none"),
        ("tp-ep2-full", "tp-ep2-none"),
        ("tp-ep2-matmuls", "tp-ep2-none"),
        ("tp-epall-full", "tp-epall-none"),
    ],
)
def test_recompute_replays_no_collective(results, plan, baseline):
    # With FSDP the counts include its all-gathers and reduce-scatters: the replay
    # must not re-fire the layer's (or the experts') unshard either.
    for base, rank in zip(results[baseline], results[plan], strict=True):
        assert rank["forward_collectives"] == base["forward_collectives"] > 0
        if plan.startswith("tp-") and plan.endswith("-full"):
            # Under sequence parallelism the dense first layer, which declares no routing unit,
            # reruns its gathers before the projections and the reduce-scatter after attention
            # (the one after its MLP lies past its last saved tensor), as `full` does in test_tp;
            # the MoE layers hold theirs, all-to-alls included.
            ops = rank["backward_collective_ops"]
            extra = {op: n - base["backward_collective_ops"].get(op, 0) for op, n in ops.items()}
            moved = {op: n for op, n in extra.items() if n and "wait" not in op and "wrap" not in op}
            assert moved == {
                "_c10d_functional.all_gather_into_tensor.default": 2,
                "_c10d_functional.reduce_scatter_tensor.default": 1,
            }
            assert rank["backward_topk"] == 0
            continue
        # Backward runs each all-to-all's transpose and nothing more.
        assert rank["backward_collectives"] == base["backward_collectives"] > 0
        assert rank["backward_topk"] == 0


def test_expert_parallel_layers_really_compiled(results):
    # fullgraph=True: one graph for the dense first layer, one the two MoE layers share.
    for rank in results["compiled-matmuls"]:
        assert rank["compiled_graphs"] == 2


def test_counting_catches_a_replayed_collective(results):
    # save_collectives: false lets the full replay rerun the router and the exchanges.
    for base, rank in zip(results["none"], results["full-rerouting"], strict=True):
        assert rank["backward_collectives"] > base["backward_collectives"]
        assert rank["backward_topk"] > 0


FLAT = ["none", "full", "matmuls", "fsdp-full", "fsdp-matmuls", "compiled-matmuls"]


@pytest.mark.parametrize("plan", [*FLAT, "ep2of4-full", "tp-ep2-full"])
def test_memory_stays_flat_over_20_steps(results, plan):
    for rank in results[plan]:
        live = rank["live_after_step"]
        assert rank["peak_live_bytes"] > 0  # the meter saw the steps' allocations
        # Flat: nothing accumulates step over step (a leak of one step's activations or
        # routing buffers would add a sizable fraction of the peak every step); a
        # transient tensor awaiting collection may show once.
        assert len(live) == 20 and live[-1] <= live[0]
        assert max(live) <= live[0] + 0.1 * rank["peak_live_bytes"]


def test_distributed_bench_reports_parity_and_per_rank_memory(tmp_path):
    # Offload under expert parallelism: the dispatched tokens and expert outputs of a layer
    # that is not checkpointed, and the kept units and input of selective layers.
    (tmp_path / "ep_units.yaml").write_text(
        "preset: none\noffload: {units: [moe_dispatch, moe_experts], layers: [1], min_bytes: 0}\n"
    )
    (tmp_path / "ep_kept.yaml").write_text(
        "preset: matmuls\noffload: {units: kept, layer_input: true, min_bytes: 0}\n"
    )
    args = [
        "bench",
        "--config",
        str(tmp_path / "ep_units.yaml"),
        "--config",
        str(tmp_path / "ep_kept.yaml"),
        "--model",
        "moe",
        "--size",
        "tiny",
        "--ep",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--quiet",
        "--json",
    ]
    result = run_two_ranks("-m actplan", args, tmp_path / "bench.json")
    rows = {row["name"]: row for row in result["rows"]}
    assert set(rows) == {
        "none",
        "full",
        "attn",
        "matmuls",
        "megatron-selective",
        *OFFLOAD_VARIANTS,
        "ep_units",
        "ep_kept",
    }
    for name in ("ep_units", "ep_kept"):
        assert rows[name]["offloaded_bytes"] > 0
        assert rows[name]["reloaded_bytes"] == rows[name]["offloaded_bytes"]
    assert rows["ep_kept"]["activation_bytes"] < rows["matmuls"]["activation_bytes"]
    for row in rows.values():
        assert row["loss_identical"] and row["census_match"] and row["max_abs_grad_diff"] == 0.0
        assert len(row["per_rank_memory"]) == 2 and all(act > 0 for act, _ in row["per_rank_memory"])
    assert rows["full"]["activation_bytes"] < rows["none"]["activation_bytes"]
