"""torchtitan 0.3's llama3 and deepseek_v3 under its own tensor parallelism (TP degree 2), with
``ActplanAC`` as the activation checkpointing, on gloo/CPU.

The multi-rank tests launch ``tests/dist/titan_tp_worker.py`` under torchrun, once per mesh with
both models: ``tp2`` (2 ranks, one tensor-parallel pair) and ``dp2tp2`` (4 ranks, FSDP2 over two
pairs; deepseek_v3's routed experts split over 2 ranks too, EP=2). Each config goes through
torchtitan's ``parallelize_llama`` / ``parallelize_deepseekv3`` with sequence parallelism on
(torchtitan's default), its ``partial_dtensor`` backend, and ``ActplanAC`` where torchtitan
applies its AC. It is held to the same parallel run without checkpointing, rank by rank: the
loss and every local gradient shard bit-identical, the same collectives in backward, no more
activation memory. Two runs without checkpointing are bit-identical (gloo/CPU/fp32 is
deterministic), so the noise floor is 0.

The configs: every preset, ``full`` with ``save_collectives``, ``test_torchtitan``'s planner-shaped
mix (a full layer, kept units, offload), and, for llama3, what actplan's planner picks for the
model at a budget half way between its lowest peak and no checkpointing's. (deepseek_v3 has no
planner row: profiling its MoE block takes about 40 s of CPU here, too long for this file.)

Under expert parallelism torchtitan's router scores are a DTensor on a strided shard, which torch
2.13 cannot rebuild from its flattened parts; the engine holds such an output rather than drop it
(the smallest case runs on one rank at the end of this file).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import actplan
import twoproc
from actplan.markers import checkpoint_record
from actplan.units import MarkerInterval, RecomputeIntervalMap

pytestmark = pytest.mark.ranks

pytest.importorskip("torchtitan", reason="the torchtitan extra (make setup installs it)")

from helpers.titan import planner_config  # noqa: E402 (needs torchtitan)

WORKER = Path(__file__).parent / "dist" / "titan_tp_worker.py"
MODELS = ("llama3", "deepseek_v3")
MESHES = ("tp2", "dp2tp2")
CONFIGS = ("full", "full+save_collectives", "attn", "matmuls", "megatron-selective", "mixed", "planner")
AG = "_c10d_functional.all_gather_into_tensor.default"
RS = "_c10d_functional.reduce_scatter_tensor.default"

# The engine serves a kept op's dropped output to the replay as a NaN placeholder, rebuilt
# around it with DTensor.__tensor_unflatten__. Under expert parallelism torchtitan's router
# scores the flattened sequence shard: placements (_StridedShard(0),) with an explicit shard
# order, which the unflatten refuses (ValueError: "DTensorSpec doesn't allow specify shard_order
# when use_strided_shard_as_shard_order is True"). Every plan that keeps moe_router fails in
# backward; full, attn and the mix (which recompute the router) pass.


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The planner's plan for llama3, made once in this process and handed to every rank."""
    made = planner_config("llama3")
    path = tmp_path_factory.mktemp("titan-plan") / "plans.json"
    path.write_text(json.dumps({"llama3": {"planner": made["config"]}}))
    return path, made


def run_ranks(nproc: int, args: list[str], out: Path, timeout: float = 300) -> dict:
    """``WORKER args... out`` on ``nproc`` gloo ranks; the JSON rank 0 wrote."""
    return twoproc.run_ranks(WORKER, args, out, nproc=nproc, timeout=timeout)


@pytest.fixture(scope="module")
def runs(planned, tmp_path_factory):
    out = tmp_path_factory.mktemp("titan-tp")
    cache: dict[str, list[dict]] = {}

    def get(model: str, mesh: str) -> list[dict]:
        if mesh not in cache:
            nproc = 4 if mesh == "dp2tp2" else 2
            found = run_ranks(nproc, [",".join(MODELS), mesh, str(planned[0])], out / f"{mesh}.json")
            assert found["world_size"] == nproc
            cache[mesh] = [rank["results"] for rank in found["ranks"]]
        return [rank[model] for rank in cache[mesh]]

    return get


def cases(configs):
    """(model, mesh, config), the planner for llama3 only."""
    return [
        (model, mesh, config)
        for model in MODELS
        for mesh in MESHES
        for config in configs
        if config != "planner" or model == "llama3"
    ]


def ran(result: dict) -> dict:
    assert "error" not in result, result.get("traceback", result.get("error"))
    return result


def full_layers_without_routing(model: str, config: str) -> int:
    """Layers that run ``full`` and declare no routing unit: those replay their collectives."""
    if config == "full":
        return 2 if model == "llama3" else 1  # deepseek_v3's second block is MoE
    return 1 if config == "mixed" else 0  # the mix's layer 0 is full


# ---------------------------------------------------------------------------------------------
# Several ranks
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model,mesh,config", cases(CONFIGS))
def test_checkpointing_under_torchtitan_tp_is_bit_identical_to_tp_without(runs, model, mesh, config):
    for rank in runs(model, mesh):
        result = ran(rank[config])
        assert result["dtensor_params"] > 0  # the model really is split
        if config.startswith("full"):
            assert result["modes"] == ["full", "full"]
        elif config == "mixed":
            assert result["modes"] == ["full", "selective"]
        elif config != "planner":
            assert result["modes"] == ["selective", "selective"]
        same = result["vs_none"]
        assert same["loss_identical"]
        assert not same["nonfinite_grads"], same["nonfinite_grads"]
        assert not same["placements_differ"], same["placements_differ"]
        assert same["grads_identical"], (same["differing_grads"], same["max_abs_grad_diff"])


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mesh", MESHES)
def test_two_runs_without_checkpointing_are_bit_identical(runs, model, mesh):
    for rank in runs(model, mesh):
        again = ran(rank["none-again"])["vs_none"]
        assert again["loss_identical"] and again["grads_identical"]
        assert again["max_abs_grad_diff"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("model,mesh,config", cases(CONFIGS))
def test_backward_replays_no_collective(runs, model, mesh, config):
    for rank in runs(model, mesh):
        none, result = rank["none"], ran(rank[config])
        assert result["forward_collectives"] == none["forward_collectives"]
        extra = {
            op: result["backward_collectives"].get(op, 0) - none["backward_collectives"].get(op, 0)
            for op in {*result["backward_collectives"], *none["backward_collectives"]}
        }
        # Documented: a `full` layer without a routing unit replays its tensor-parallel
        # collectives, as torch's checkpoint does: the all-gathers before attention and MLP, the
        # reduce-scatter after attention (the MLP's lies past the last saved tensor).
        # save_collectives keeps them; deepseek_v3's MoE block holds its own.
        layers = full_layers_without_routing(model, config)
        expected = {AG: 2 * layers, RS: layers} if layers else {}
        assert {op: n for op, n in extra.items() if n} == expected


@pytest.mark.slow
@pytest.mark.parametrize("model,mesh,config", cases(CONFIGS))
def test_activation_memory_at_or_below_no_checkpointing(runs, model, mesh, config):
    for rank in runs(model, mesh):
        result = ran(rank[config])
        floor = min(rank[name]["activation_bytes_at_forward_end"] for name in ("none", "none-again"))
        peak = min(rank[name]["peak_live_bytes"] for name in ("none", "none-again"))
        assert result["activation_bytes_at_forward_end"] <= floor
        assert result["peak_live_bytes"] <= peak
        if config == "full":
            assert result["activation_bytes_at_forward_end"] < 0.4 * floor


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mesh", MESHES)
def test_the_mix_offloads_under_tensor_parallelism(runs, model, mesh):
    for rank in runs(model, mesh):
        mixed = ran(rank["mixed"])
        assert mixed["offloaded_bytes"] > 0 and mixed["reloaded_bytes"] == mixed["offloaded_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_the_planners_plan_checkpoints_and_holds_less(runs, planned, mesh):
    _, made = planned
    assert made["lowest_peak_bytes"] <= made["predicted_peak_bytes"] < made["none_peak_bytes"]
    for rank in runs("llama3", mesh):
        result = ran(rank["planner"])
        assert len(result["modes"]) == 2 and set(result["modes"]) != {"none"}
        assert result["activation_bytes_at_forward_end"] < rank["none"]["activation_bytes_at_forward_end"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_torchtitan_splits_as_configured(runs, mesh):
    # Sequence parallel: the blocks reduce-scatter into sequence shards and all-gather them
    # back; FSDP2 gathers parameters on dp2tp2 only; the experts live on the EP mesh.
    for model in MODELS:
        for rank in runs(model, mesh):
            forward = rank["none"]["forward_collectives"]
            assert forward[RS] >= 4 and forward[AG] >= 4
            assert ("c10d._allgather_base_.default" in forward) == (mesh == "dp2tp2")
    deepseek = runs("deepseek_v3", mesh)[0]["none"]
    if mesh == "dp2tp2":
        assert deepseek["expert_meshes"] == ["efsdpxep"]
        assert deepseek["forward_collectives"]["_c10d_functional.all_to_all_single.default"] > 0
    else:
        assert deepseek["expert_meshes"] == ["fsdpxtp"]


# ---------------------------------------------------------------------------------------------
# One rank, in-process: a strided-shard DTensor output of a kept op
# ---------------------------------------------------------------------------------------------


class _Router(nn.Module):
    """torchtitan's router under sequence parallelism, reduced: scores of the flattened
    sequence shard (a DTensor placed (_StridedShard(0),)), read only by a kept op."""

    recompute_intervals = RecomputeIntervalMap(
        {"moe_router": MarkerInterval("a", "b"), "mlp_up": MarkerInterval("b", "end")}
    )

    def __init__(self, mesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.gate = nn.Parameter(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        checkpoint_record("a")
        tokens = DTensor.from_local(x, self.mesh, [Shard(1)]).flatten(0, 1)
        scores = F.linear(tokens, DTensor.from_local(self.gate, self.mesh, [Replicate()]))
        doubled = scores * 2  # the only reader of scores, which would be dropped
        checkpoint_record("b")
        out = doubled.to_local().sin()  # recomputed: reads the kept interval's output
        checkpoint_record("end")
        return out


class _RouterModel(nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Router(mesh)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x).sum()


def test_a_kept_strided_shard_output_that_cannot_be_rebuilt_is_held_not_dropped(tp_mesh):
    # Dropped, the scores would reach the replay as a placeholder rebuilt through
    # DTensor.__tensor_unflatten__, which torch 2.13 refuses for this placement (ValueError:
    # "DTensorSpec doesn't allow specify shard_order ..."): the engine holds them instead.
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    grads = {}
    for config in ("none", {"mode": "selective", "keep": ["moe_router"]}):
        model = _RouterModel(tp_mesh)
        if config != "none":
            actplan.apply(model, config)
        model(x).backward()
        grads["none" if config == "none" else "kept"] = model.layers[0].gate.grad
    assert torch.equal(grads["kept"], grads["none"])
