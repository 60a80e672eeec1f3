"""The estimate's rank on a fake process group against a real multi-process run: the same step
(``_rank_step.step_on_mesh``) on real tensors over real gloo ranks gives rank 0 the same bytes,
to the byte, at the end of forward and at the steady step's peak, and the same allocator
replay."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from actplan.models.shape import Shape
from actplan.planning._rank_step import rank_step
from twoproc import run_ranks

pytestmark = pytest.mark.ranks

WORKER = Path(__file__).parent / "dist" / "estimate_worker.py"
SHAPE = Shape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, seq=32, batch=2, dtype="fp32")


@pytest.mark.slow
@pytest.mark.parametrize(
    "fsdp,tp,preset",
    [(4, 1, "full"), (2, 1, "matmuls"), (1, 2, "full"), (2, 2, "titan-op-sac")],
    ids=["fsdp4-full", "fsdp2-matmuls", "tp2-full", "dp2tp2-titan-op-sac"],
)
def test_rank_zero_of_a_real_gloo_run_holds_what_the_fake_rank_holds(tmp_path, fsdp, tp, preset):
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps(SHAPE.to_dict()))
    real = run_ranks(WORKER, [str(shape), str(fsdp), str(tp), preset], tmp_path / "out.json", nproc=fsdp * tp)
    fake = dataclasses.asdict(rank_step(SHAPE, preset, fsdp, "h100", tp=tp))
    rank0 = real["ranks"][0]
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


OFFLOADS = {
    "full+offload": {"preset": "full", "offload": {"layer_input": True, "min_bytes": 0}},
    "matmuls+offload": {"preset": "matmuls", "offload": {"units": "kept", "min_bytes": 0}},
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "fsdp,tp,offload", [(2, 1, "full+offload"), (1, 2, "matmuls+offload")], ids=["fsdp2", "tp2"]
)
def test_offload_on_a_real_gloo_run_moves_what_the_fake_rank_moves(tmp_path, fsdp, tp, offload):
    """Offload through the real parallel path: the fake rank's device bytes, host tier and
    moved bytes equal rank 0's of real gloo ranks (the engine moves fake tensors as real ones)."""
    shape, config = tmp_path / "shape.json", tmp_path / "offload.json"
    shape.write_text(json.dumps(SHAPE.to_dict()))
    config.write_text(json.dumps(OFFLOADS[offload]))
    args = [str(shape), str(fsdp), str(tp), str(config)]
    real = run_ranks(WORKER, args, tmp_path / "out.json", nproc=fsdp * tp)
    fake = dataclasses.asdict(rank_step(SHAPE, str(config), fsdp, "h100", tp=tp))
    rank0 = real["ranks"][0]
    rank0.pop("routing")
    _drop_times(fake, rank0)
    assert fake["moved"]["offloaded_bytes"] > 0 and fake["moved"]["host_bytes"] > 0
    assert rank0 == fake


MOE = Shape(
    model="moe", layers=3, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, seq=32, batch=2,
    dtype="fp32", experts=4, top_k=2, expert_ffn=64, shared_ffn=32, first_k_dense=1,
)


@pytest.mark.slow
@pytest.mark.parametrize("preset,dtype", [("full", "fp32"), ("matmuls", "fp32"), ("full", "bf16")])
def test_expert_parallel_rank_zero_holds_what_the_fake_rank_holds_on_its_routing(tmp_path, preset, dtype):
    """MoE with its experts over 2 ranks: the fake rank, replaying the token counts rank 0
    recorded (its routers' and those the other rank sent it), holds what rank 0 held. In bf16
    the experts, which FSDP leaves out, compute in bf16 too (a real matmul refuses mixed
    dtypes, which a fake one lets through)."""
    moe = dataclasses.replace(MOE, dtype=dtype)
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps(moe.to_dict()))
    real = run_ranks(WORKER, [str(shape), "2", "1", preset, "2"], tmp_path / "out.json", nproc=2)
    rank0 = real["ranks"][0]
    routing = rank0.pop("routing")
    fake = dataclasses.asdict(rank_step(moe, preset, 2, "h100", ep=2, routing=routing))
    _drop_times(fake, rank0)
    assert rank0 == fake


def test_balanced_routing_on_the_fake_group_receives_what_it_sends():
    """Without recorded counts, every rank routes as rank 0 does: balanced counts, and an
    exchange that hands each rank as many tokens as it sends. Activations then do not depend
    on which rank is measured, and a layout the real path cannot run is refused."""
    full = rank_step(MOE, "none", 2, "h100", ep=2)
    assert full.activation_bytes > 0
    with pytest.raises(ValueError, match="splits experts over every rank"):
        rank_step(MOE, "none", 4, "h100", ep=2)
    with pytest.raises(ValueError, match="MoE reference model"):
        rank_step(SHAPE, "none", 2, "h100", ep=2)
