"""``actplan._install.parallel.parallelize``: checkpointing composed with FSDP2 (and compile) on 2 ranks.

The 2-rank tests launch ``tests/dist/fsdp_worker.py`` under torchrun on gloo/CPU, once per
scenario, and assert on the JSON rank 0 writes. Input validation runs in-process on a
one-rank gloo group.

Tolerance against the single-process run: sharding changes only the order of reductions
(each rank's mean over its half of the batch, then FSDP's reduce-scatter average), so
gradients may differ by rounding. The measured floor, FSDP ``none`` against one process, is
1.7e-8 for a largest gradient of 0.10 (about 1.4 ulp of it; the loss is bit-identical).
``GRAD_ATOL`` = 1e-6 leaves 60x headroom and is still 100x below a missing or doubled
gradient path. Checkpointed runs are held to more than that: bit-identical to FSDP ``none``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import actplan
from actplan._engine.boundary import is_checkpointed
from actplan._install.parallel import parallelize
from actplan.config import ConfigError
from actplan.measure import capture_step, compare_steps
from actplan.models import build_model
from twoproc import run_two_ranks

pytestmark = pytest.mark.ranks

WORKER = Path(__file__).parent / "dist" / "fsdp_worker.py"
GRAD_ATOL = 1e-6
LOSS_ATOL = 1e-6
N_LAYERS = 2  # the tiny dense model
ALL_GATHER = "c10d._allgather_base_.default"
REDUCE_SCATTER = "c10d._reduce_scatter_base_.default"
CONFIGS = ("none", "full", "matmuls", "matmuls+offload", "none+offload")
MODES = {"none": "none", "full": "full", "matmuls": "selective", "matmuls+offload": "selective"}


def run_worker(scenario: str, tmp_path: Path, timeout: float = 120) -> dict:
    """Run the worker on 2 ranks; fail the test with the ranks' stderr if any rank fails."""
    return run_two_ranks(WORKER, [scenario], tmp_path / f"{scenario}.json", timeout=timeout)


# ---------------------------------------------------------------------------------------------
# Two ranks
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    return run_worker("parity", tmp_path_factory.mktemp("parity"))


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("config", CONFIGS)
def test_sharded_gradients_match_a_single_process(parity, config, reshard):
    assert parity["world_size"] == 2
    result = parity["results"][f"{config}/reshard={reshard}"]
    assert result["modes"] == [MODES.get(config, "none")] * N_LAYERS
    if "offload" in config:
        assert result["offloaded_bytes"] > 0
    else:
        assert result["offloaded_bytes"] is None
    assert result["grads_are_dtensors"]
    single = result["vs_single_process"]
    assert single["census_match"], single["census_diff"]
    assert result["reference_census_nonzero"] == 25  # every parameter: a detached path would show
    assert single["loss_abs_diff"] <= LOSS_ATOL
    assert single["max_abs_grad_diff"] <= GRAD_ATOL, single["worst_param"]
    # Checkpointing under FSDP changes nothing at all: bit-identical to FSDP without it.
    same_sharding = result["vs_sharded_none"]
    assert same_sharding["loss_identical"]
    assert same_sharding["max_abs_grad_diff"] == 0.0, same_sharding["worst_param"]
    assert same_sharding["census_match"]


@pytest.mark.slow
def test_noise_floor_is_rounding(parity):
    # The floor GRAD_ATOL is built on: FSDP without checkpointing against one process
    # differs by at most a few ulps of the largest gradient.
    floor = parity["results"]["none/reshard=True"]["vs_single_process"]
    ulp = torch.finfo(torch.float32).eps * floor["max_abs_grad"]
    assert floor["max_abs_grad_diff"] <= 8 * ulp


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("config", ["full", "matmuls", "matmuls+offload", "none+offload"])
def test_recompute_issues_no_extra_all_gather(parity, config, reshard):
    none = parity["results"][f"none/reshard={reshard}"]
    result = parity["results"][f"{config}/reshard={reshard}"]
    assert result["backward_collectives"] == none["backward_collectives"]
    assert result["forward_collectives"] == none["forward_collectives"]
    # One all-gather per FSDP group in forward (root + layers); in backward, one per layer
    # group when layers reshard after forward, none otherwise (the root never reshards).
    assert result["forward_collectives"][ALL_GATHER] == N_LAYERS + 1
    assert result["backward_collectives"].get(ALL_GATHER, 0) == (N_LAYERS if reshard else 0)
    assert result["backward_collectives"][REDUCE_SCATTER] == N_LAYERS + 1
    # The replay calls the layer's forward, not the module: no module hook fires in backward.
    assert result["layer_calls_in_forward"] == N_LAYERS
    assert result["layer_calls_in_backward"] == 0


@pytest.mark.slow
def test_layer_call_count_detects_a_replay_through_the_module(parity):
    # Control: checkpointing *around* already sharded layers replays through the module, and
    # the hook counter sees it. FSDP2 (torch 2.13) skips its pre-forward unshard while in
    # PRE_BACKWARD, so the all-gather count alone would not catch this wrong order.
    control = parity["results"]["control/outer-checkpoint"]
    assert control["layer_calls_in_forward"] == N_LAYERS
    assert control["layer_calls_in_backward"] == N_LAYERS
    assert control["backward_collectives"][ALL_GATHER] == N_LAYERS


@pytest.mark.slow
def test_memory_stays_flat_over_twenty_steps(tmp_path):
    results = run_worker("memory", tmp_path)["results"]
    for config, result in results.items():
        live = result["live_after_step"]
        assert len(live) == 20
        # Step 0 creates the optimizer state; every later step must end where it started.
        assert max(live[1:]) == min(live[1:]) == live[0], (config, live)
        # The meter saw the steps' activations come and go.
        assert result["peak_live_bytes"] > live[-1], config


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_layers_under_fsdp_match_and_add_no_all_gather(tmp_path):
    results = run_worker("compile", tmp_path, timeout=180)["results"]
    none, matmuls = results["none/reshard=True"], results["matmuls/reshard=True"]
    for result in (none, matmuls):
        # Both layers share one graph per plan, with no graph break (fullgraph=True).
        assert result["compiled_graphs"] == 1
        assert result["graph_breaks"] == 0
        assert result["vs_single_process"]["census_match"]
        assert result["vs_single_process"]["max_abs_grad_diff"] <= GRAD_ATOL
        assert result["layer_calls_in_backward"] == 0
    assert matmuls["vs_sharded_none"]["max_abs_grad_diff"] == 0.0
    assert matmuls["backward_collectives"] == none["backward_collectives"]
    assert matmuls["backward_collectives"][ALL_GATHER] == N_LAYERS


@pytest.mark.slow
def test_a_failing_rank_fails_the_test_with_its_traceback(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="rank 1 fails on purpose"):
        run_worker("fail", tmp_path, timeout=60)


# ---------------------------------------------------------------------------------------------
# One rank, in-process: structure and input validation
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def mesh(one_rank_mesh):
    return one_rank_mesh


def test_order_wrapper_inside_fsdp_and_root_last(mesh):
    model = build_model("dense", "tiny").model
    plan = parallelize(model, mesh, "matmuls")
    assert plan is actplan.lowlevel.installed_plan(model)
    assert isinstance(model, FSDPModule)
    for _, layer in actplan.lowlevel.find_layers(model):
        assert isinstance(layer, FSDPModule)
        # The wrapper is an instance forward: FSDP's module hooks run around it, not in it.
        assert is_checkpointed(layer) and "forward" in layer.__dict__
        assert layer._forward_pre_hooks


def test_one_rank_step_is_bit_identical_to_no_fsdp(mesh):
    bundle = build_model("dense", "tiny")
    batch = bundle.make_batch(0)
    baseline = bundle.model
    baseline_loss = baseline(**batch)["loss"]
    baseline_loss.backward()
    model = build_model("dense", "tiny").model
    parallelize(model, mesh, "matmuls")
    loss = model(**batch)["loss"]
    loss.backward()
    for param in model.parameters():
        param.grad = param.grad.full_tensor()
    report = compare_steps(capture_step(baseline, baseline_loss), capture_step(model, loss.detach()))
    assert report.ok, report.to_dict()


def test_bad_config_raises_config_error_and_leaves_the_model_alone(mesh):
    model = build_model("dense", "tiny").model
    with pytest.raises(ConfigError, match="no_such_unit"):
        parallelize(model, mesh, {"mode": "selective", "keep": ["no_such_unit"]})
    assert not isinstance(model, FSDPModule)
    assert not any(is_checkpointed(m) for m in model.modules())


def test_already_sharded_model_is_rejected_with_the_fix(mesh):
    model = build_model("dense", "tiny").model
    fully_shard(model.layers[0], mesh=mesh)
    with pytest.raises(ValueError, match=r"already sharded.*layers\.0.*unsharded model"):
        parallelize(model, mesh, "full")


def test_already_compiled_layer_is_rejected(mesh):
    model = build_model("dense", "tiny").model
    model.layers[1].compile()
    with pytest.raises(ValueError, match=r"layers\.1 is already compiled.*compile=True"):
        parallelize(model, mesh, "full")


def test_mesh_must_be_one_dimensional(one_rank_group):
    mesh_2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    with pytest.raises(ValueError, match=r"1-D mesh.*dp_replicate.*dp_shard"):
        parallelize(build_model("dense", "tiny").model, mesh_2d, "full")


def test_mesh_must_be_a_device_mesh():
    with pytest.raises(TypeError, match="init_device_mesh"):
        parallelize(build_model("dense", "tiny").model, "cpu", "full")


def test_compile_must_stay_fullgraph(mesh):
    with pytest.raises(ValueError, match="fullgraph=True"):
        parallelize(build_model("dense", "tiny").model, mesh, "full", compile={"fullgraph": False})
    with pytest.raises(TypeError, match="compile must be a bool"):
        parallelize(build_model("dense", "tiny").model, mesh, "full", compile="inductor")


@pytest.mark.compile
def test_parallelize_compiles_moe_layers_exactly_and_leaves_no_dynamo_flag_on(mesh):
    # parallelize(compile=...) sets the data-dependent-shape flags around the compiled layers'
    # calls (older torch needs them for the per-expert splits; 2.13 traces them without): the
    # compiled step is exact, and the flags are not left on for the rest of the process.
    import torch._dynamo

    bundle = build_model("moe", "tiny", n_layers=2, dropout=0.0)
    batch = bundle.make_batch(0)
    baseline = copy.deepcopy(bundle.model)
    expected_loss = baseline(**batch)["loss"]
    expected_loss.backward()
    torch._dynamo.reset()
    model = copy.deepcopy(bundle.model)
    parallelize(model, mesh, "matmuls", compile={"backend": "aot_eager"})
    loss = model(**batch)["loss"]
    loss.backward()
    assert torch.equal(loss.detach(), expected_loss.detach())
    grads = {name: p.grad for name, p in baseline.named_parameters()}
    for name, param in model.named_parameters():
        assert torch.equal(param.grad.full_tensor(), grads[name]), name
    assert not torch._dynamo.config.capture_scalar_outputs
    assert not torch._dynamo.config.capture_dynamic_output_shape_ops
    torch._dynamo.reset()

