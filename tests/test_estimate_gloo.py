"""The estimate's rank on a fake process group against a real multi-process run: the same step
(``_rank_step.step_on_mesh``) on real tensors over real gloo ranks gives rank 0 the same bytes,
to the byte, at the end of forward and at the steady step's peak, and the same allocator
replay."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from actplan.models.shape import Shape
from actplan.planning._rank_step import rank_step
from twoproc import run_ranks

pytestmark = pytest.mark.ranks

WORKER = Path(__file__).parent / "dist" / "estimate_worker.py"
SHAPE = Shape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, seq=32, batch=2, dtype="fp32")
MOE = Shape(
    model="moe", layers=3, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, seq=32, batch=2,
    dtype="fp32", experts=4, top_k=2, expert_ffn=64, shared_ffn=32, first_k_dense=1,
)  # fmt: skip
OFFLOADS = {
    "full+offload": {"preset": "full", "offload": {"layer_input": True, "min_bytes": 0}},
    "matmuls+offload": {"preset": "matmuls", "offload": {"units": "kept", "min_bytes": 0}},
}
PLAIN = {  # id: (fsdp, tp, preset)
    "fsdp4-full": (4, 1, "full"),
    "fsdp2-matmuls": (2, 1, "matmuls"),
    "tp2-full": (1, 2, "full"),
    "dp2tp2-titan-op-sac": (2, 2, "titan-op-sac"),
}
OFFLOADED = {"fsdp2": (2, 1, "full+offload"), "tp2": (1, 2, "matmuls+offload")}
# torchtitan's own llama3 split by its own tensor parallelism, then FSDP2: id -> (fsdp, tp, preset)
TITAN = {"dp2tp2-titan-op-sac": (2, 2, "titan-op-sac")} if importlib.util.find_spec("torchtitan") else {}
EXPERTS = {  # id: (preset, dtype, fsdp); experts over 2 ranks
    "full-fp32": ("full", "fp32", 2),
    "matmuls-fp32": ("matmuls", "fp32", 2),
    "full-bf16": ("full", "bf16", 2),
    # experts over 2 of 4 ranks, sharded by FSDP over the other 2 inside each layer
    "of4-full-bf16": ("full", "bf16", 4),
    "of4-matmuls-fp32": ("matmuls", "fp32", 4),
}

# FSDP 2 x TP 2 with sequence parallelism, each rank routing its own sequence shard, the experts
# over each tensor-parallel pair (FSDP-sharded over the pairs) or over all 4: id -> (preset, ep)
EXPERTS_TP = {"full-ep2": ("full", 2), "matmuls-ep4": ("matmuls", 4)}


def _scenarios(folder: Path) -> dict[str, dict]:
    """Every scenario below: its shape, layout and preset (an offload config as a file's path,
    the same path the fake rank is given)."""
    scenarios = {}
    for name, (fsdp, tp, preset) in PLAIN.items():
        scenarios[name] = {"shape": SHAPE.to_dict(), "fsdp": fsdp, "tp": tp, "preset": preset}
    for name, (fsdp, tp, offload) in OFFLOADED.items():
        config = folder / f"{offload}.json"
        config.write_text(json.dumps(OFFLOADS[offload]))
        plan = {"shape": SHAPE.to_dict(), "fsdp": fsdp, "tp": tp, "preset": str(config)}
        scenarios[f"offload-{name}"] = plan
    for name, (fsdp, tp, preset) in TITAN.items():
        titan = _titan_shape().to_dict()
        scenarios[f"titan-{name}"] = {"shape": titan, "fsdp": fsdp, "tp": tp, "preset": preset}
    for name, (preset, dtype, fsdp) in EXPERTS.items():
        moe = dataclasses.replace(MOE, dtype=dtype).to_dict()
        scenarios[f"ep-{name}"] = {"shape": moe, "fsdp": fsdp, "tp": 1, "preset": preset, "ep": 2}
    for name, (preset, ep) in EXPERTS_TP.items():
        scenarios[f"tp-{name}"] = {"shape": MOE.to_dict(), "fsdp": 2, "tp": 2, "preset": preset, "ep": ep}
    return scenarios


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """Every scenario's real gloo run: one launch per world size, each running all of its
    scenarios in one process group; ``real(name)`` is rank 0's figures."""
    folder = tmp_path_factory.mktemp("gloo")
    scenarios = _scenarios(folder)
    results: dict[str, dict] = {}
    for world in sorted({s["fsdp"] * s["tp"] for s in scenarios.values()}):
        mine = {name: s for name, s in scenarios.items() if s["fsdp"] * s["tp"] == world}
        path = folder / f"scenarios-{world}.json"
        path.write_text(json.dumps(mine))
        results |= run_ranks(WORKER, [str(path)], folder / f"out-{world}.json", nproc=world, timeout=300)
    return lambda name: (results[name]["ranks"][0], scenarios[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", PLAIN)
def test_rank_zero_of_a_real_gloo_run_holds_what_the_fake_rank_holds(real, name):
    rank0, _ = real(name)
    fsdp, tp, preset = PLAIN[name]
    fake = dataclasses.asdict(rank_step(SHAPE, preset, fsdp, "h100", tp=tp))
    rank0.pop("routing")
    # Named difference: the roofline clock's time, which is not this test's subject (under TP
    # it prices a few ops more on real tensors; FLOPs are compared).
    _drop_times(fake, rank0)
    assert rank0 == fake


def _drop_times(*figures: dict) -> None:
    for each in figures:
        each.pop("seconds")
        each.pop("exposed_comm_seconds")  # follows the clock's times too; the bytes are compared
        if each.get("moved") is not None:
            each["moved"].pop("exposed_seconds")  # follows the clock's forward and backward times


@pytest.mark.slow
@pytest.mark.parametrize("name", OFFLOADED)
def test_offload_on_a_real_gloo_run_moves_what_the_fake_rank_moves(real, name):
    """Offload through the real parallel path: the fake rank's device bytes, host tier and
    moved bytes equal rank 0's of real gloo ranks (the engine moves fake tensors as real ones)."""
    rank0, scenario = real(f"offload-{name}")
    fsdp, tp, _ = OFFLOADED[name]
    fake = dataclasses.asdict(rank_step(SHAPE, scenario["preset"], fsdp, "h100", tp=tp))
    rank0.pop("routing")
    _drop_times(fake, rank0)
    assert fake["moved"]["offloaded_bytes"] > 0 and fake["moved"]["host_bytes"] > 0
    assert rank0 == fake


def _titan_shape() -> Shape:
    from actplan.models.titan import shape_from_titan

    return shape_from_titan("llama3:debugmodel", layers=2, seq=32, batch=2, dtype="fp32")


@pytest.mark.slow
@pytest.mark.parametrize("name", TITAN)
def test_torchtitans_own_tensor_parallelism_on_real_gloo_ranks_holds_what_the_fake_rank_holds(real, name):
    """torchtitan's llama3 split by its own sharding declarations (vocabulary-parallel embedding
    with its TP group, sequence-parallel norms, its loss-parallel cross-entropy) and sharded by
    actplan.parallelize's FSDP2: rank 0 of real gloo ranks holds what the fake rank holds."""
    rank0, _ = real(f"titan-{name}")
    fsdp, tp, preset = TITAN[name]
    fake = dataclasses.asdict(rank_step(_titan_shape(), preset, fsdp, "h100", tp=tp))
    rank0.pop("routing")
    _drop_times(fake, rank0)
    assert rank0 == fake


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERTS)
def test_expert_parallel_rank_zero_holds_what_the_fake_rank_holds_on_its_routing(real, name):
    """MoE with its experts over 2 ranks: the fake rank, replaying the token counts rank 0
    recorded (its routers' and those the other rank sent it), holds what rank 0 held. In bf16
    the experts, which FSDP leaves out, compute in bf16 too (a real matmul refuses mixed
    dtypes, which a fake one lets through). Over 4 ranks the experts are FSDP-sharded inside
    each layer: their all-gathers, reshards and reduce-scatters (and the replay's) agree too."""
    rank0, _ = real(f"ep-{name}")
    preset, dtype, fsdp = EXPERTS[name]
    routing = rank0.pop("routing")
    moe = dataclasses.replace(MOE, dtype=dtype)
    fake = dataclasses.asdict(rank_step(moe, preset, fsdp, "h100", ep=2, routing=routing))
    _drop_times(fake, rank0)
    assert rank0 == fake


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERTS_TP)
def test_experts_with_tensor_parallelism_on_real_gloo_ranks_hold_what_the_fake_rank_holds(real, name):
    """Each rank routes its own half of the sequence (sequence parallelism) to experts over 2 or
    4 of the ranks: the fake rank, replaying rank 0's token counts, holds what rank 0 held."""
    rank0, _ = real(f"tp-{name}")
    preset, ep = EXPERTS_TP[name]
    routing = rank0.pop("routing")
    fake = dataclasses.asdict(rank_step(MOE, preset, 2, "h100", tp=2, ep=ep, routing=routing))
    _drop_times(fake, rank0)
    assert rank0 == fake


def test_balanced_routing_on_the_fake_group_receives_what_it_sends():
    """Without recorded counts, every rank routes as rank 0 does: balanced counts, and an
    exchange that hands each rank as many tokens as it sends. Activations then do not depend
    on which rank is measured, and a layout the real path cannot run is refused."""
    full = rank_step(MOE, "none", 2, "h100", ep=2)
    assert full.activation_bytes > 0
    with pytest.raises(ValueError, match="splits experts over a divisor of the ranks"):
        rank_step(MOE, "none", 4, "h100", ep=3)
    with pytest.raises(ValueError, match="MoE reference model"):
        rank_step(SHAPE, "none", 2, "h100", ep=2)
