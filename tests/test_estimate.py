"""``actplan estimate``: the fake-tensor step measures what the same step measures on real
tensors, the static memory follows its stated formula, shipped shapes load, and bad input gets
one line naming the problem."""

from __future__ import annotations

import json

import pytest

from actplan.cli import main
from actplan.evaluate.estimate import Shape, estimate, load_shape, preset_step, shape_names

SMALL = Shape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, seq=32, batch=2, dtype="fp32")
SMALL_MOE = Shape(
    model="moe", layers=3, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, seq=16, batch=2, dtype="fp32",
    experts=4, top_k=2, expert_ffn=64, shared_ffn=32, first_k_dense=1,
)  # fmt: skip


@pytest.mark.parametrize("preset", ["none", "full", "matmuls"])
def test_the_fake_step_measures_what_the_real_step_measures(preset):
    fake, params, largest = preset_step(SMALL, preset, "h100", fake=True)
    real, real_params, real_largest = preset_step(SMALL, preset, "h100", fake=False)
    assert (fake.activation_bytes, fake.step_peak_bytes) == (real.activation_bytes, real.step_peak_bytes)
    assert (fake.flops, params, largest) == (real.flops, real_params, real_largest)
    assert fake.activation_bytes > 0 and fake.flops > 0


def test_static_memory_follows_the_stated_formula_and_the_budget_picks_the_fastest_fit():
    result = estimate(SMALL, ("none", "full", "matmuls"), gpu="a100", fsdp=4, budget_bytes=10**12)
    assert result.static_bytes == 16 * result.parameters // 4
    none, full, matmuls = result.rows
    for row in result.rows:
        assert row.peak_bytes == result.static_bytes + result.gathered_bytes + row.step_peak_bytes
        assert row.fits
    assert none.ratio_to_none == 1.0 and full.ratio_to_none > matmuls.ratio_to_none >= 1.0
    assert full.activation_bytes < matmuls.activation_bytes < none.activation_bytes
    assert result.recommended.preset == "none"  # everything fits: the fastest
    tight = estimate(SMALL, ("none", "full"), fsdp=4, budget_bytes=full.peak_bytes)
    assert [r.fits for r in tight.rows] == [False, True] and tight.recommended.preset == "full"


def test_moe_estimate_routes_tokens_evenly():
    result = estimate(SMALL_MOE, ("none", "matmuls"))
    assert all(row.activation_bytes > 0 for row in result.rows)


def test_shipped_shapes_load_and_say_where_they_come_from():
    from importlib import resources

    assert {"llama3-8b", "llama3-70b", "mixtral-8x7b"} <= set(shape_names())
    for name in shape_names():
        shape = load_shape(name, seq=4096)
        assert shape.seq == 4096 and shape.name == name
        text = (resources.files("actplan.models") / "shapes" / f"{name}.yaml").read_text()
        assert "Source:" in text
    assert load_shape("llama3-70b").layers == 80


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shape", "llama-9b"], "unknown shape 'llama-9b'; known shapes: llama3-70b, llama3-8b"),
        (["--shape", "llama3-8b", "--heads", "30"], "heads (30) must divide hidden (4096)"),
        (["--shape", "llama3-8b", "--kv-heads", "5"], "kv_heads (5) must divide heads (32)"),
        (["--shape", "llama3-8b", "--experts", "8"], "apply to model 'moe' only"),
        (["--shape", "mixtral-8x7b", "--top-k", "9"], "top_k (9) must be between 1 and experts (8)"),
        (["--model", "moe", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
          "--ffn", "64", "--vocab", "64"], "model 'moe' needs experts, top_k, expert_ffn"),
        (["--model", "dense", "--layers", "2"], "--model dense needs --hidden"),
        ([], "give --shape NAME"),
        (["--shape", "llama3-8b", "--model", "dense"], "not both"),
        (["--shape", "llama3-8b", "--fsdp", "0"], "fsdp must be 1 or more"),
        (["--shape", "llama3-8b", "--budget", "80"], "under 1 MiB; write it with a unit"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_naming_the_problem(argv, message, capsys):
    assert main(["estimate", "--quiet", *argv]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert message in out, out


def test_unknown_gpu_lists_the_table(capsys):
    with pytest.raises(SystemExit):
        main(["estimate", "--shape", "llama3-8b", "--gpu", "v100"])
    error = capsys.readouterr().err
    assert "invalid choice: 'v100' (choose from 'a100', 'b200', 'h100', 'h200', 'mi300x')" in error


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "estimate.json"
    args = ["estimate", "--model", "dense", "--layers", "2", "--hidden", "64", "--heads", "4"]
    args += ["--kv-heads", "2", "--ffn", "128", "--vocab", "128", "--seq", "32", "--batch", "2"]
    assert main([*args, "--presets", "none,full", "--budget", "1GiB", "--json", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "estimated on fake tensors" in printed and "times are estimates" in printed
    assert "fastest preset under 1GiB: none" in printed
    data = json.loads(out.read_text())
    assert [row["preset"] for row in data["rows"]] == ["none", "full"]
