"""torchtitan 0.3 models and nanoGPT-style blocks, unmodified: units derived from module names,
exact under every preset, below no checkpointing, ``ActplanAC`` in torchtitan's AC family, and
the errors for torchtitan's own AC, tensor parallelism applied after the plan and a layout
that cannot be derived.

On CPU: torchtitan's language models attend with FlexAttention (no CPU backward) or varlen
attention (CUDA), so each tiny model's ``inner_attention`` is torchtitan's own
``ScaledDotProductAttention`` instead (same call: q, k, v as B, L, N, H, ``attention_masks=``,
``scale=``, ``enable_gqa=``; causal SDPA; returns B, L, N, H). Everything else, from the
projections to the MoE token dispatch, is torchtitan's code. ``make test`` installs torchtitan
(``--no-deps``, with the ``torchtitan`` extra): these tests run in CI; the skip below is only
for a checkout without the extra.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import actplan
import actplan.integrations
from actplan.config import ConfigError
from actplan.integrations import blocks
from actplan.integrations import torchtitan as titan
from actplan.measure import MemoryMeter, capture_step, compare_steps

pytest.importorskip("torchtitan", reason="the torchtitan extra (make setup installs it)")

from torchtitan.distributed import activation_checkpoint as torchtitan_ac

from helpers.titan import KINDS, MIXED, WithLoss, build, llama3_bundle, make_batch


def step(model: nn.Module, batch: dict, metered: bool = False):
    """One training step: its capture and, metered, the activation bytes live after the forward."""
    torch.manual_seed(3)
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        # torchtitan's router asks for fp32 CPU autocast, which torch declines with a warning.
        warnings.filterwarnings("ignore", "In CPU autocast, but the target dtype is not supported")
        if not metered:
            loss = model(**batch)
            loss.backward()
            return capture_step(model, loss), None
        with MemoryMeter(model) as meter:
            loss = model(**batch)
            meter.mark("forward_end")
            loss.backward()
    return capture_step(model, loss), meter.report().marks["forward_end"].activation_bytes


@pytest.fixture(autouse=True)
def _no_dynamo_cache_switch(monkeypatch):
    # torchtitan's AC classes (ActplanAC too, as theirs do) turn dynamo's LRU cache off for the
    # whole process; the torch.compile tests elsewhere in this process should not inherit that.
    monkeypatch.setattr(torchtitan_ac, "_disable_dynamo_lru_cache", lambda: None)


# ---------------------------------------------------------------------------------------------
# Every model under every preset and a planner-like mixed plan: exact, at most none's bytes

CONFIGS = {name: name for name in ("full", "attn", "matmuls", "megatron-selective")} | {"mixed": MIXED}


@pytest.fixture(scope="module", params=KINDS)
def reference(request):
    model = build(request.param)
    batch = make_batch(0)
    baseline, none_bytes = step(copy.deepcopy(model), batch, metered=True)
    return request.param, model, batch, baseline, none_bytes


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_model_is_exact_and_holds_at_most_none(reference, config):
    kind, model, batch, baseline, none_bytes = reference
    candidate = copy.deepcopy(model)
    plan = actplan.apply(candidate, CONFIGS[config])
    assert len(plan.layers) == 2
    for call in range(2):  # the learning call, then the learnt path (metered)
        captured, held = step(candidate, batch, metered=call == 1)
        report = compare_steps(baseline, captured)
        assert report.loss_identical and report.max_abs_grad_diff == 0.0, (kind, config, report.worst_param)
        assert report.census_match, report.census_diff
    assert held <= none_bytes, (kind, config, held, none_bytes)
    if config == "mixed":
        stats = actplan.lowlevel.installed_plan(candidate).offload_engine.stats
        assert stats.bytes_offloaded > 0 and stats.bytes_reloaded == stats.bytes_offloaded


# ---------------------------------------------------------------------------------------------
# What is derived per model

ATTENTION = ["attn_norm", "qkv_proj", "rope", "attn_core", "attn_proj", "mlp_norm"]
QK_NORMED = ["attn_norm", "qkv_proj", "qk_norm", *ATTENTION[2:]]  # qwen3: q/k norms; MLA: q/kv norms
NANOGPT = ["attn_norm", "qkv_proj", "attn_core", "attn_proj", "mlp_norm", "mlp_up", "mlp_act", "mlp_down"]
MOE = ["moe_router", "moe_dispatch", "moe_experts", "moe_combine", "shared_experts"]
UNITS = {
    "llama3": {"Llama3TransformerBlock": [*ATTENTION, "mlp_up", "mlp_down"]},
    "qwen3": {"Qwen3TransformerBlock": [*QK_NORMED, "mlp_up", "mlp_down"]},
    # block 0 is dense, block 1 MoE: the union of the two
    "deepseek_v3": {"DeepSeekV3TransformerBlock": [*QK_NORMED, "mlp_up", "mlp_down", *MOE]},
    # no RoPE module; an activation module (GELU) between c_fc and c_proj
    "nanogpt": {"Block": [*NANOGPT]},
}


def _rows(model: nn.Module) -> dict[tuple[str, str], str]:
    source = titan.SOURCE if titan.SOURCE.recognises(model) else blocks.SOURCE
    return {(row[1], row[3]): row[4] for row in blocks.layout_rows(source.find(model))}


@pytest.mark.parametrize("kind", KINDS)
def test_units_are_derived_from_the_module_names(kind):
    model = build(kind)
    source = titan.SOURCE if kind != "nanogpt" else blocks.SOURCE
    assert actplan.integrations.recognising(model) == [source]
    found = source.find(model)
    assert [layer.name for layer in found] == [name for name, _ in actplan.lowlevel.find_layers(model)]
    assert {layer.source for layer in found} == {"derived"}
    ((class_name, units),) = UNITS[kind].items()
    assert {type(layer.module).__name__ for layer in found} == {class_name}
    union: list[str] = []
    for layer in found:
        union += [u.value for u in layer.interval_map.units if u.value not in union]
    assert union == units, (kind, union)


def test_the_module_spans_of_each_unit():
    rows = _rows(build("deepseek_v3"))
    dense, moe = "decoder.layers.0", "decoder.layers.1"
    assert rows[(dense, "qkv_proj")] == "attention.wq_a + attention.wq_b + attention.wkv_a + attention.wkv_b"
    assert rows[(dense, "qk_norm")] == "attention.q_norm + attention.kv_norm"
    assert rows[(dense, "attn_core")] == "[attention:projected, attention.wo:enter)"
    assert rows[(dense, "mlp_up")] == "feed_forward.w1 + feed_forward.w3"
    assert rows[(moe, "moe_router")] == "moe.router"
    assert rows[(moe, "moe_dispatch")] == "[moe.routed_experts:enter, moe.routed_experts.inner_experts:enter)"
    assert rows[(moe, "moe_experts")] == "moe.routed_experts.inner_experts"
    assert rows[(moe, "shared_experts")] == "moe.shared_experts"
    llama = _rows(build("llama3"))
    assert llama[("decoder.layers.0, decoder.layers.1", "qkv_proj")] == "attention.qkv_linear.wqkv"
    nanogpt = _rows(build("nanogpt"))
    where = "transformer.h.0, transformer.h.1"
    assert nanogpt[(where, "qkv_proj")] == "attn.c_attn" and nanogpt[(where, "attn_proj")] == "attn.c_proj"
    assert nanogpt[(where, "mlp_down")] == "mlp.c_proj" and nanogpt[(where, "attn_norm")] == "ln_1"


def test_cli_units_lists_a_torchtitan_models_units(capsys, monkeypatch):
    from actplan.cli import main

    monkeypatch.setenv("COLUMNS", "250")
    assert main(["units", "--model", "helpers.titan:deepseek_v3_bundle"]) == 0
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if "│" in line}
    for unit in UNITS["deepseek_v3"]["DeepSeekV3TransformerBlock"]:
        assert "DeepSeekV3TransformerBlock" in rows[unit], unit


@pytest.mark.slow
def test_verify_passes_on_a_torchtitan_llama3():
    from actplan.evaluate.verify import verify

    report = verify(llama3_bundle(), "matmuls", steps=2, check_recompute=True)
    assert report.ok, report.problems()


@pytest.mark.slow
def test_the_cpu_example_in_the_docs_runs():
    from doc_blocks import DOCS, block_with

    namespace: dict = {}
    example = block_with(DOCS / "torchtitan.md", "# where torchtitan applies its AC")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the example runs clean
        exec(compile(example, "docs/torchtitan.md", "exec"), namespace)
    assert len(namespace["plan"].checkpointed) == 6
    assert all(p.grad is not None for p in namespace["model"].parameters())


def test_remove_takes_the_hooks_away():
    model = build("llama3")
    actplan.apply(model, "matmuls")
    attention = model.decoder.layers["0"].attention
    assert attention.wo._forward_pre_hooks
    actplan.remove(model)
    assert not attention.wo._forward_pre_hooks and not attention.wo._forward_hooks
    assert "recompute_intervals" not in model.decoder.layers["0"].__dict__
    assert not titan.SOURCE.saved_layouts(model)


def test_a_plan_on_the_decoder_then_on_the_module_around_it_hooks_each_block_once():
    model, batch = build("llama3"), make_batch(0)
    baseline, _ = step(copy.deepcopy(model), batch)
    actplan.apply(model.decoder, "attn")  # what ActplanAC does inside parallelize_*
    hooks = dict(model.decoder.layers["0"].attention.wo._forward_pre_hooks)
    actplan.apply(model, "matmuls")
    assert model.decoder.layers["0"].attention.wo._forward_pre_hooks == hooks
    for _ in range(2):
        report = compare_steps(baseline, step(model, batch)[0])
        assert report.loss_identical and report.max_abs_grad_diff == 0.0


@pytest.mark.slow
@pytest.mark.compile
def test_blocks_compiled_by_torchtitan_after_the_plan_stay_exact():
    # torchtitan's apply_compile: each block, fullgraph=True, after AC. It sets two dynamo
    # flags for the whole process (the second lets the "projected" marker's bookkeeping run
    # inside a checkpoint); dynamo's own config.patch puts them back afterwards (pytest's
    # monkeypatch on dynamo's config module deletes them instead, breaking later tests).
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.compile import apply_compile

    flags = ("capture_scalar_outputs", "skip_fwd_side_effects_in_bwd_under_checkpoint")
    restore = torch._dynamo.config.patch({flag: getattr(torch._dynamo.config, flag) for flag in flags})
    with restore:
        _compile_after_the_plan_and_check(apply_compile, CompileConfig, ParallelDims)
    assert all(hasattr(torch._dynamo.config, flag) for flag in flags)


def _compile_after_the_plan_and_check(apply_compile, CompileConfig, ParallelDims) -> None:
    model, batch = build("llama3"), make_batch(0)
    baseline, _ = step(copy.deepcopy(model), batch)  # eager, no checkpointing
    actplan.apply(model.decoder, "matmuls")
    one = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    compile_config = CompileConfig(enable=True, components=["model"], backend="aot_eager")
    apply_compile(model.decoder, compile_config=compile_config, parallel_dims=ParallelDims(**one))
    for _ in range(2):
        report = compare_steps(baseline, step(model, batch)[0])
        assert report.loss_identical and report.max_abs_grad_diff == 0.0, report.worst_param


# ---------------------------------------------------------------------------------------------
# ActplanAC: a member of torchtitan's family, configured as theirs are


@pytest.mark.parametrize("reference", ["llama3", "qwen3", "deepseek_v3"], indirect=True)
def test_actplan_ac_is_exact_through_torchtitans_ac_interface(reference):
    from actplan.torchtitan import ActplanAC

    kind, model, batch, baseline, none_bytes = reference
    assert issubclass(ActplanAC, torchtitan_ac.ActivationCheckpointing)
    candidate = copy.deepcopy(model)
    # What parallelize_* does with the trainer's activation_checkpoint config.
    ActplanAC.Config(recompute_config=MIXED).build(dump_folder="").apply(candidate.decoder)
    for call in range(2):
        captured, held = step(candidate, batch, metered=call == 1)
        report = compare_steps(baseline, captured)
        assert report.loss_identical and report.max_abs_grad_diff == 0.0, (kind, report.worst_param)
    assert held < none_bytes


def test_actplan_ac_config_is_a_torchtitan_config_and_parses_on_its_command_line():
    import tyro

    from actplan.torchtitan import ActplanAC

    config = ActplanAC.Config(plan="attn", layouts={"Block": None})
    assert config.to_dict()["plan"] == "attn"
    assert "__slots__" in ActplanAC.Config.__dict__

    # A trainer config's field, typed as torchtitan types it; ActplanAC.Config the default,
    # as a config function would set it.
    from dataclasses import dataclass

    @dataclass
    class Trainer:
        activation_checkpoint: torchtitan_ac.ActivationCheckpointingConfig = None

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "<class .*ActplanAC.Config'> does not match any type in Union")
        parsed = tyro.cli(
            Trainer,
            args=["activation-checkpoint:config", "--activation-checkpoint.plan", "full"],
            default=Trainer(activation_checkpoint=config),
        )
    assert parsed.activation_checkpoint == ActplanAC.Config(plan="full", layouts={"Block": None})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"plan": "attn", "recompute_config": {"preset": "full"}}, "both plan='attn' and recompute_config"),
        ({"preserve_rng_state": False}, "preserve_rng_state set, and actplan has no such setting"),
    ],
)
def test_actplan_ac_settings_it_cannot_honour_are_errors(fields, message):
    from actplan.torchtitan import ActplanAC

    with pytest.raises(ConfigError, match=message):
        ActplanAC.Config(**fields).build(dump_folder="")


# ---------------------------------------------------------------------------------------------
# Bad input: torchtitan's own AC, TP after the plan, a layout that cannot be derived


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_blocks_torchtitan_already_checkpoints_are_refused(ac):
    model = build("llama3")
    config = torchtitan_ac.FullAC.Config() if ac == "full" else torchtitan_ac.SelectiveAC.Config()
    config.build().apply(model.decoder)
    with pytest.raises(ConfigError) as err:
        actplan.apply(model.decoder, "matmuls")
    message = str(err.value)
    assert "layers.0, layers.1 of Llama3Model are already wrapped by torch's checkpoint_wrapper" in message
    assert "activation_checkpoint=ActplanAC.Config(plan=...)" in message and "before torch.compile" in message


def test_a_checkpoint_wrapper_on_plain_blocks_is_refused():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = build("nanogpt")
    model.transformer.h[0] = checkpoint_wrapper(model.transformer.h[0])
    with pytest.raises(ConfigError, match=r"transformer\.h\.0 of NanoGPT are already wrapped"):
        actplan.apply(model, "matmuls")


def _renamed_output(model: nn.Module) -> nn.Module:
    # Each attention's output projection registered as `out` (its forward still calls self.wo).
    for block in model.decoder.layers.values():
        attention = block.attention
        wo = attention._modules.pop("wo")
        attention.add_module("out", wo)
        attention.__dict__["wo"] = wo
    return model


def test_a_layout_that_cannot_be_derived_names_what_is_unclear_and_how_to_pass_one():
    model = _renamed_output(build("llama3"))
    with pytest.raises(ConfigError) as err:
        actplan.apply(model, "matmuls")
    message = str(err.value)
    assert "cannot tell the units of WithLoss's torchtitan blocks from their module names" in message
    assert "Llama3TransformerBlock (decoder.layers.0 and 1 more)" in message
    assert "needs exactly one output projection" in message and "attention.out" in message
    assert "actplan.apply(model, config, layouts={'Llama3TransformerBlock': {" in message
    assert "docs/torchtitan.md" in message

    layout = {
        "attn_norm": ["attention_norm"],
        "qkv_proj": ["attention.qkv_linear.wqkv"],
        "attn_core": [("attention.qkv_linear.wqkv:exit", "attention.out:enter")],
        "attn_proj": ["attention.out"],
        "mlp_up": ["feed_forward.w1", "feed_forward.w3"],
        "mlp_down": ["feed_forward.w2"],
    }
    batch = make_batch(0)
    baseline, _ = step(copy.deepcopy(model), batch)
    plan = actplan.apply(model, "matmuls", layouts={"Llama3TransformerBlock": layout})
    assert {layer.class_name for layer in plan.layers} == {"Llama3TransformerBlock"}
    for _ in range(2):
        report = compare_steps(baseline, step(model, batch)[0])
        assert report.loss_identical and report.max_abs_grad_diff == 0.0
    actplan.apply(model, "attn")  # the layouts given before are kept
    assert titan.SOURCE.saved_layouts(model) == {"Llama3TransformerBlock": layout}


# Tensor parallelism: one rank (gloo), so DTensor parameters and TP's hooks are real while
# the arithmetic stays that of one process.


def _tensor_parallel(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    columns, rows = ColwiseParallel(), RowwiseParallel()
    plan = {f"attention.qkv_linear.{w}": columns for w in ("wq", "wk", "wv")}
    plan |= {
        "attention.wo": rows,
        "feed_forward.w1": columns,
        "feed_forward.w3": columns,
        "feed_forward.w2": rows,
    }
    for block in model.decoder.layers.values():
        parallelize_module(block, mesh, plan)
    return model


@pytest.mark.slow
def test_tensor_parallel_first_then_actplan_is_exact(one_rank_mesh):
    model, batch = build("qwen3"), make_batch(0)
    baseline, none_bytes = step(_tensor_parallel(copy.deepcopy(model), one_rank_mesh), batch, metered=True)
    candidate = _tensor_parallel(copy.deepcopy(model), one_rank_mesh)
    actplan.apply(candidate, "matmuls")
    for call in range(2):
        captured, held = step(candidate, batch, metered=call == 1)
        report = compare_steps(baseline, captured)
        assert report.loss_identical and report.max_abs_grad_diff == 0.0, report.worst_param
    assert held < none_bytes


@pytest.mark.slow
def test_tensor_parallel_after_actplan_names_the_order(one_rank_mesh):
    model = build("qwen3")
    actplan.apply(model, "matmuls")
    _tensor_parallel(model, one_rank_mesh)
    with pytest.raises(ConfigError) as err:
        step(model, make_batch(0))
    message = str(err.value)
    assert message.startswith("decoder.layers.0 (Qwen3TransformerBlock): its parameters became DTensors")
    assert "tensor parallelism (model.parallelize or parallelize_module) first, then actplan" in message


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["spmd_types", "partial_dtensor"])
def test_torchtitans_parallelize_with_actplan_ac_is_exact(one_rank_mesh, monkeypatch, backend):
    # torchtitan's own parallelize_llama: its DTensor model (spmd_types) or TP (none on one
    # rank, partial_dtensor: plain parameters at the plan), ActplanAC, then FSDP2.
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3.parallelize import parallelize_llama

    from actplan.torchtitan import ActplanAC

    monkeypatch.setattr(parallel_dims, "device_type", "cpu")  # its meshes default to CUDA
    model, batch = build("llama3"), make_batch(0)

    def parallelized(ac_config):
        parallelism = ParallelismConfig(spmd_backend=backend)
        decoder = parallelize_llama(
            copy.deepcopy(model.decoder),
            parallel_dims=parallel_dims.ParallelDims.from_config(parallelism, 1),
            training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=parallelism,
            compile_config=CompileConfig(),
            ac_config=ac_config,
            dump_folder="",
        )
        return WithLoss(decoder)

    reference = parallelized(None)
    step(reference, batch)
    baseline, none_bytes = step(reference, batch, metered=True)
    candidate = parallelized(ActplanAC.Config(plan="matmuls"))
    assert len(actplan.lowlevel.installed_plan(candidate.decoder).checkpointed) == 2
    for call in range(2):
        captured, held = step(candidate, batch, metered=call == 1)
        report = compare_steps(baseline, captured)
        assert report.loss_identical and report.max_abs_grad_diff == 0.0, report.worst_param
    assert held < none_bytes


# ---------------------------------------------------------------------------------------------
# The registry: torchtitan stays optional, and models that declare their own units keep them


@pytest.mark.slow
def test_import_actplan_and_a_plan_never_import_torchtitan():
    script = """
import sys, torch, actplan
from torch import nn
from actplan.integrations import torchtitan
from actplan.models import build_model
bundle = build_model('dense', 'tiny')
actplan.apply(bundle.model, 'matmuls')
bundle.model(**bundle.make_batch(0))['loss'].backward()
assert 'torchtitan' not in sys.modules, 'imported torchtitan'
from actplan.torchtitan import ActplanAC
assert 'torchtitan' in sys.modules
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_models_that_declare_their_units_are_not_derived():
    from actplan.models import build_model

    model = build_model("dense", "tiny").model
    assert not blocks.SOURCE.recognises(model) and not titan.SOURCE.recognises(model)
    assert not blocks.SOURCE.recognises(build("llama3"))  # torchtitan's own source takes it
