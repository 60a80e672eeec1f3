"""PEFT / LoRA: a LoRA-wrapped Hugging Face model under every preset and an offload row is
bit-exact against no checkpointing, holds less than ``none``, and its kept units hold what
they should; the Trainer + LoRA example in docs/huggingface.md runs."""

from __future__ import annotations

import copy

import pytest
import torch

import actplan
from actplan.config import PRESETS
from actplan.config._presets import preset_kept_units
from actplan.integrations import hf
from actplan.measure import MemoryMeter, capture_step, compare_steps
from actplan.models import hf as hf_models
from doc_blocks import DOCS, run_trainer_example

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# PEFT asks the model whether HF checkpointing is on through the name transformers 5.24 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OFFLOAD = {
    "preset": "matmuls",
    "offload": {"units": "kept", "layer_input": True, "min_bytes": 0, "skip_last": 0},
}
# Every preset but `none` (the baseline), and one offload row.
CONFIGS = {name: name for name in PRESETS if name != "none"} | {"offload": OFFLOAD}


def lora_llama(before_wrapping=None):
    """A LoRA-wrapped tiny random Llama (2 layers) and its batch; lora_B starts random, not at
    zero, so every adapter weight gets a non-zero gradient. ``before_wrapping`` is applied to
    the plain model first."""
    model, make_batch = hf_models.reference_model("llama", "tiny", layers=2)
    if before_wrapping is not None:
        actplan.apply(model, before_wrapping)
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=PROJECTIONS, init_lora_weights=False
    )
    return peft.get_peft_model(model, config).train(), make_batch(0)


def _step(model, batch):
    # One metered training step: the capture and the activation bytes live at the forward's end.
    torch.manual_seed(3)
    model.zero_grad(set_to_none=True)
    with MemoryMeter(model) as meter:
        loss = model(**batch).loss
        meter.mark("forward_end")
        loss.backward()
    return capture_step(model, loss), meter.report().marks["forward_end"].activation_bytes


@pytest.fixture(scope="module")
def lora():
    model, batch = lora_llama()
    baseline, none_bytes = _step(copy.deepcopy(model), batch)
    return model, batch, baseline, none_bytes


def test_only_the_adapters_learn():
    model, batch = lora_llama()
    captured, _ = _step(model, batch)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in name for name in trainable)
    assert captured.census.nonzero == trainable
    # The decoder layers are found through the PEFT wrappers, with the built-in Llama layout.
    assert {layer.source for layer in hf.find_decoder_layers(model)} == {"built-in"}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_lora_model_is_exact_under_every_preset_and_offload(lora, config):
    model, batch, baseline, none_bytes = lora
    candidate = copy.deepcopy(model)
    plan = actplan.apply(candidate, CONFIGS[config])
    assert len(plan.checkpointed) == 2
    for _ in range(2):  # the learning call, then the learnt path
        captured, held = _step(candidate, batch)
        report = compare_steps(baseline, captured)
        assert report.loss_identical and report.max_abs_grad_diff == 0.0, (config, report.worst_param)
        assert report.census_match, report.census_diff
    assert held < none_bytes, (config, held, none_bytes)

    # What the kept units hold: only kept units hold anything, each less than autograd keeps
    # for the same ops without checkpointing (the adapters' inputs and outputs are inside the
    # units: a LoRA linear is the module the span names).
    by_unit = actplan.lowlevel.installed_plan(candidate).held_by_unit()
    kept = {u.value for layer in plan.layers for u in layer.kept_units}
    assert set(by_unit) <= kept, (config, set(by_unit) - kept)
    if PRESETS.get(config) is not None and PRESETS[config].mode == "full":
        assert by_unit == {}
    else:
        assert sum(u["held"] for u in by_unit.values()) > 0, (config, by_unit)
        assert all(u["held"] <= u["autograd"] for u in by_unit.values()), (config, by_unit)
        if config in PRESETS:
            declared = hf.find_decoder_layers(candidate)[0].interval_map.units
            assert {u.value for u in preset_kept_units(config, declared)} == kept
    if config == "offload":
        stats = actplan.lowlevel.installed_plan(candidate).offload_engine.stats
        assert stats.bytes_offloaded > 0 and stats.bytes_reloaded == stats.bytes_offloaded


def test_full_holds_the_least_of_the_presets(lora):
    model, batch, _, none_bytes = lora
    held = {}
    for name in ("full", "attn", "matmuls"):
        candidate = copy.deepcopy(model)
        actplan.apply(candidate, name)
        _step(candidate, batch)
        held[name] = _step(candidate, batch)[1]
    assert held["full"] < held["attn"] < held["matmuls"] < none_bytes, held


def test_a_plan_applied_before_wrapping_is_exact_too(lora):
    # PEFT moves the hooked projection to `base_layer`: the adapters run outside the units and
    # are recomputed, not kept. Still exact; removing the plan from the model it was applied to
    # takes every hook away.
    _, batch, baseline, none_bytes = lora
    model, _ = lora_llama(before_wrapping="matmuls")
    for _ in range(2):
        captured, held = _step(model, batch)
        assert compare_steps(baseline, captured).ok
    assert held < none_bytes
    actplan.remove(model.get_base_model())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


# ---------------------------------------------------------------------------------------------
# The Trainer + LoRA example in docs/huggingface.md

@pytest.mark.slow
def test_the_trainer_lora_example_runs_and_matches_training_without_the_plan(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)
    runs = run_trainer_example(DOCS / "huggingface.md", "peft.get_peft_model(")
    weights = [
        {k: p.detach().clone() for k, p in run["model"].named_parameters() if p.requires_grad} for run in runs
    ]
    with_plan, without = weights
    assert with_plan.keys() == without.keys() and with_plan
    changed = [k for k in without if not torch.equal(with_plan[k], without[k])]
    assert not changed, changed[:5]
