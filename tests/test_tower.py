"""Boundary cases: a frozen encoder tower, and layers over a list of micro-batches.

The tower's layers are checkpointable and every plan wraps them, but with no
trainable parameters and no grad-requiring input they run once, unreplayed,
and their outputs stay detached. Micro-batch-list layers take and return lists
(of tensors / TypedDicts); gradients must reach every micro-batch exactly.
"""

import copy

import pytest
import torch

import tower
from actplan._engine.boundary import is_checkpointed
from actplan._install.apply import find_layers
from actplan.measure import OpCounter
from actplan.models.dense import DecoderLayer
from helpers import assert_exact, step_and_capture, with_plan
from tower import MicroBatchDecoderLayer

SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
SELECTIVE = {"mode": "selective", "keep": ["qkv_proj", "mlp_up"]}


# ---------------------------------------------------------------------------------------------
# Frozen tower
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tower_tiny():
    return tower.build_tower("tiny", dropout=0.1)


@pytest.fixture(scope="module")
def tower_baseline(tower_tiny):
    model, config = tower_tiny
    return step_and_capture(copy.deepcopy(model), tower.make_tower_batch(config))


def test_tower_is_frozen_and_the_rest_trains(tower_tiny, tower_baseline):
    model, _ = tower_tiny
    frozen = {f"tower.{name}" for name, _ in model.tower.named_parameters()}
    assert frozen and not any(p.requires_grad for p in model.tower.parameters())
    assert tower_baseline.census.none == frozen
    assert tower_baseline.census.nonzero == set(tower_baseline.grads) - frozen
    # apply() sees the tower layers: every plan below really wraps them.
    layers = [name for name, _ in find_layers(model)]
    assert layers == ["tower.layers.0", "tower.layers.1", "layers.0", "layers.1"]


class TowerProbe:
    """Counts tower sub-block calls (their hooks fire in replays too) and keeps the tower output."""

    def __init__(self, model):
        self.calls = 0
        self.outputs = []
        for layer in model.tower.layers:
            layer.attn.register_forward_pre_hook(self._count)
            layer.mlp.register_forward_pre_hook(self._count)
            layer.register_forward_hook(self._keep)
        model.tower.register_forward_hook(self._keep)

    def _count(self, module, args):
        self.calls += 1

    def _keep(self, module, args, output):
        self.outputs.append(output["hidden_states"] if isinstance(output, dict) else output)


@pytest.mark.parametrize("plan", ["full", "matmuls", "megatron-selective", SELECTIVE], ids=str)
def test_frozen_tower_is_not_replayed_and_stays_detached(tower_tiny, tower_baseline, plan):
    model, config = tower_tiny
    model = with_plan(model, plan)
    assert all(is_checkpointed(layer) for layer in model.tower.layers)
    probe = TowerProbe(model)
    with OpCounter() as counter:
        candidate = step_and_capture(model, tower.make_tower_batch(config))
    n_tower, n_decoder = config.tower_layers, config.n_layers
    assert probe.calls == 2 * n_tower  # one attention and one MLP per tower layer, never replayed
    assert len(probe.outputs) == n_tower + 1
    assert all(not out.requires_grad and out.grad_fn is None for out in probe.outputs)
    # Dispatch-level: the decoder's attention kernels are replayed unless attn_core is kept
    # (matmuls); the tower's never are.
    replayed = 0 if plan == "matmuls" else n_decoder
    assert counter[SDPA] == n_tower + n_decoder + replayed
    assert_exact(tower_baseline, candidate, plan)


def test_tower_input_that_needs_grad_is_checkpointed(tower_tiny):
    # The negative control: the same frozen layers, fed a grad-requiring input, are replayed.
    model, config = tower_tiny
    model = with_plan(model, "full")
    probe = TowerProbe(model)
    batch = tower.make_tower_batch(config)
    batch["image_features"].requires_grad_(True)
    step_and_capture(model, batch)
    assert probe.calls == 2 * 2 * config.tower_layers
    assert batch["image_features"].grad is not None


# ---------------------------------------------------------------------------------------------
# Micro-batch-list layers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def micro_tiny():
    return tower.build_micro_batch("tiny", dropout=0.1)


def micro_step(model, batch, seed=5):
    """A training step that also returns each micro-batch's embedding-output gradient."""
    embedded = []

    def keep(module, args, output):
        output.retain_grad()
        embedded.append(output)

    handle = model.embed.register_forward_hook(keep)
    try:
        capture = step_and_capture(model, batch, seed)
    finally:
        handle.remove()
    return capture, [e.grad for e in embedded]


@pytest.fixture(scope="module")
def micro_baseline(micro_tiny):
    model, config = micro_tiny
    return micro_step(copy.deepcopy(model), tower.make_micro_batches(config))


def test_micro_batch_model_shape(micro_tiny, micro_baseline):
    model, config = micro_tiny
    batch = tower.make_micro_batches(config)
    assert [ids.shape[1] for ids in batch["input_ids"]] == list(config.micro_seq_lens) == [16, 8, 12]
    assert [type(m) for _, m in find_layers(model)] == [MicroBatchDecoderLayer] * config.n_layers
    assert MicroBatchDecoderLayer.recompute_intervals == DecoderLayer.recompute_intervals
    capture, grads = micro_baseline
    assert len(capture.census.nonzero) == len(capture.grads)
    assert len(grads) == len(config.micro_seq_lens)


@pytest.mark.parametrize(
    "plan", ["none", "full", "attn", "matmuls", "megatron-selective", SELECTIVE], ids=str
)
def test_micro_batch_layers_are_exact_and_every_micro_batch_gets_gradients(micro_tiny, micro_baseline, plan):
    model, config = micro_tiny
    baseline, baseline_grads = micro_baseline
    capture, grads = micro_step(with_plan(model, plan), tower.make_micro_batches(config))
    assert_exact(baseline, capture, plan)
    assert len(grads) == len(config.micro_seq_lens)
    for i, (grad, expected) in enumerate(zip(grads, baseline_grads, strict=True)):
        assert grad is not None, f"micro-batch {i} got no gradient"
        assert bool((grad != 0).all(dim=-1).all()), f"micro-batch {i} has tokens without gradient"
        assert torch.equal(grad, expected), f"micro-batch {i} gradient differs"


def test_micro_batch_layers_are_really_replayed(micro_tiny):
    model, config = micro_tiny
    counts = {}
    for plan in (None, "full", "attn"):
        with OpCounter() as counter:
            micro_step(with_plan(model, plan), tower.make_micro_batches(config))
        counts[plan] = counter[SDPA]
    kernels = config.n_layers * len(config.micro_seq_lens)
    assert counts[None] == kernels
    assert counts["full"] == 2 * kernels  # every micro-batch's attention replays
    assert counts["attn"] == kernels  # kept: each micro-batch's kernel runs once


def test_builders_reject_unknown_sizes_and_bad_shapes():
    with pytest.raises(ValueError, match="unknown tower size"):
        tower.build_tower("huge")
    with pytest.raises(ValueError, match="unknown micro-batch size"):
        tower.build_micro_batch("huge")
    with pytest.raises(ValueError, match="max_seq_len"):
        tower.build_tower("tiny", image_tokens=60)
    with pytest.raises(ValueError, match="micro_seq_lens"):
        tower.build_micro_batch("tiny", micro_seq_lens=())
