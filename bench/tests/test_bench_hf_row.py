"""The bench's Hugging Face baseline: on a ``transformers`` model, a row that switches on the
model's own gradient checkpointing, parity-checked against ``none`` like every row, next to
``torch-checkpoint``; on other models, no such row."""

from __future__ import annotations

import copy

import pytest

from actplan.evaluate.bench import HF_CHECKPOINT, TORCH_CHECKPOINT, bench_entries, run_bench
from actplan.evaluate.contenders import has_hf_gradient_checkpointing, hf_checkpoint_installer
from actplan.evaluate.report import to_markdown
from actplan.models import build_model, load_model


def test_an_hf_model_gets_a_row_of_its_own_gradient_checkpointing_with_parity():
    pytest.importorskip("transformers")
    result = run_bench("hf-llama", "tiny", ("none", "full"), repeats=1, warmup=0, overhead_repeats=0)
    assert [row.name for row in result.rows] == ["none", "full", TORCH_CHECKPOINT, HF_CHECKPOINT]
    rows = {row.name: row for row in result.rows}
    hf = rows[HF_CHECKPOINT]
    assert hf.parity_ok and hf.loss_identical and hf.census_match and hf.max_abs_grad_diff == 0
    assert "checkpointing_enable(use_reentrant=False)" in hf.description
    # Whole-layer checkpointing, as torch.utils.checkpoint per layer and actplan's full keep it.
    assert hf.activation_bytes == rows[TORCH_CHECKPOINT].activation_bytes < rows["none"].activation_bytes
    assert f"| {HF_CHECKPOINT} | exact |" in to_markdown(result)


def _checkpointing(model) -> bool:
    # transformers releases that renamed gradient checkpointing deprecate the old property.
    if hasattr(type(model), "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def test_the_hf_row_switches_on_transformers_own_checkpointing():
    pytest.importorskip("transformers")
    bundle = load_model("hf-llama", "tiny")
    model = copy.deepcopy(bundle.model)
    assert has_hf_gradient_checkpointing(model) and not _checkpointing(model)
    hf_checkpoint_installer(model)
    assert _checkpointing(model)
    assert not _checkpointing(bundle.model)  # the bench's copy only


def test_only_hf_models_and_reference_runs_get_the_row():
    assert not has_hf_gradient_checkpointing(build_model("dense", "tiny").model)
    names = [name for name, _ in bench_entries(("none",), (), reference=True, hf_reference=True)]
    assert names == ["none", TORCH_CHECKPOINT, HF_CHECKPOINT]
    assert [name for name, _ in bench_entries(("none",), (), reference=False, hf_reference=True)] == ["none"]
    assert [name for name, _ in bench_entries(("none",), (), reference=True)] == ["none", TORCH_CHECKPOINT]
    result = run_bench("dense", "tiny", ("none",), repeats=1, warmup=0, overhead_repeats=0)
    assert [row.name for row in result.rows] == ["none", TORCH_CHECKPOINT]
