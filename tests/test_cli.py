"""The command line: bench on the tiny model, explain, and error exits."""

import json
from pathlib import Path

import pytest

from actplan.cli import main
from actplan.evaluate.bench import OFFLOAD_VARIANTS, TORCH_CHECKPOINT, run_bench
from actplan.evaluate.report import to_markdown
from bench.goals import evaluate_goals


@pytest.mark.slow
def test_bench_tiny_writes_json_and_markdown(tmp_path, capsys):
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    code = main(
        [
            "bench",
            "--size",
            "tiny",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--overhead-repeats",
            "2",
            "--quiet",
            "--json",
            str(out_json),
            "--markdown",
            str(out_md),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    expected = {"none", "full", "attn", "matmuls", "megatron-selective", *OFFLOAD_VARIANTS, TORCH_CHECKPOINT}
    for policy in expected:
        assert policy in printed
    result = json.loads(out_json.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == expected
    for row in rows.values():
        assert row["loss_identical"] and row["census_match"] and row["max_abs_grad_diff"] == 0
    act = {name: row["activation_bytes"] for name, row in rows.items()}
    assert act["full"] < act["matmuls"] < act["none"]
    assert rows["none"]["ratio_to_none"] == 1.0
    # Deterministic cost figures beside the measured ratio: keeping every matmul recomputes
    # no FLOP, recomputing whole layers does, and the roofline clock prices both.
    flops = {name: row["flops"] for name, row in rows.items()}
    assert flops["matmuls"] == flops["none"] < flops["full"]
    predicted = {name: row["predicted_ratio"] for name, row in rows.items()}
    assert predicted["none"] == 1.0 < predicted["matmuls"] < predicted["full"]
    assert result["marker_cost_ns"]["outside_region"] > 0
    assert result["overhead_vs_torch_checkpoint"]["pairs"] == 4
    assert "| matmuls | exact |" in out_md.read_text() and "est. ratio on GPU" in out_md.read_text()


def test_bench_accepts_config_files(tmp_path):
    plan = tmp_path / "qkv.yaml"
    plan.write_text("mode: selective\nkeep: [qkv_proj, attn_core]\nlayers: '0'\n")
    result = run_bench("dense", "tiny", ("none",), (plan,), repeats=1, warmup=0, reference=False)
    assert [r.name for r in result.rows] == ["none", "qkv"]
    assert result.row("qkv").parity_ok
    assert "qkv" in to_markdown(result)


def test_bench_offload_rows_report_host_tier_and_bytes_moved(tmp_path):
    plan = tmp_path / "inputs.yaml"
    plan.write_text("preset: full\noffload: {layer_input: true, min_bytes: 0, skip_last: 0}\n")
    result = run_bench("dense", "tiny", ("none", "full"), (plan,), repeats=1, warmup=0, reference=False)
    full, offloaded = result.row("full"), result.row("inputs")
    assert offloaded.parity_ok and full.offloaded_bytes is None
    assert offloaded.offloaded_bytes > 0 and offloaded.reloaded_bytes == offloaded.offloaded_bytes
    assert offloaded.host_peak_bytes >= offloaded.offloaded_bytes
    assert full.activation_bytes - offloaded.activation_bytes == offloaded.offloaded_bytes
    # The prediction times the copies on the clock's copy streams, as an estimate does: the
    # first reload backward meets is asked for where it is used, so the compute waits for it.
    assert offloaded.predicted_ratio > full.predicted_ratio
    assert "## Offload" in to_markdown(result)


@pytest.mark.parametrize("clash", ["policy", "file"])
def test_bench_rejects_rows_with_the_same_name(tmp_path, clash):
    if clash == "policy":
        with pytest.raises(ValueError, match="'full' appears more than once"):
            run_bench("dense", "tiny", ("none", "full", "full"), repeats=1, warmup=0)
    else:
        plan = tmp_path / "none.yaml"
        plan.write_text("preset: full\n")
        with pytest.raises(ValueError, match="'none' appears more than once"):
            run_bench("dense", "tiny", ("none",), (plan,), repeats=1, warmup=0)


def test_explain_prints_the_plan(capsys):
    assert main(["explain", "--model", "dense", "--size", "tiny", "--config", "matmuls"]) == 0
    out = capsys.readouterr().out
    assert "layers.0" in out and "layers.1" in out
    assert "qkv_proj, attn_core, attn_proj, mlp_up" in out


def test_explain_measure_reports_held_bytes_per_layer_and_unit(capsys):
    assert main(["explain", "--model", "dense", "--size", "tiny", "--config", "matmuls", "--measure"]) == 0
    out = capsys.readouterr().out
    assert "held per kept unit" in out and "autograd keeps KiB" in out
    for unit in ("qkv_proj", "attn_core", "attn_proj", "mlp_up"):
        assert unit in out
    assert "layers.1" in out


def test_explain_reports_config_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: selective\nkeep: [attn_core, moe_router]\n")
    assert main(["explain", "--size", "tiny", "--config", str(bad)]) == 2
    out = capsys.readouterr().out
    assert "moe_router" in out and "declares" in out

    broken = tmp_path / "broken.yaml"
    broken.write_text("mode: selective\nkeep: [attn_core\n")
    assert main(["explain", "--size", "tiny", "--config", str(broken)]) == 2
    out = capsys.readouterr().out
    assert "broken.yaml" in out and "line" in out


def test_unknown_unit_lists_valid_and_declared_units(tmp_path, capsys):
    bad = tmp_path / "typo.json"
    bad.write_text('{"mode": "selective", "keep": ["attn_cor"]}')
    assert main(["explain", "--size", "tiny", "--config", str(bad)]) == 2
    out = capsys.readouterr().out
    assert "typo.json" in out and "'attn_cor'" in out
    assert "valid units: attn_norm" in out and "sparse_indexer" in out
    assert "units this model declares: attn_norm, qkv_proj" in out


def test_units_lists_the_catalogue_and_a_models_units(capsys):
    assert main(["units"]) == 0
    out = capsys.readouterr().out
    assert "sparse_indexer" in out and "moe_router" in out
    assert main(["units", "--model", "dense"]) == 0
    out = capsys.readouterr().out
    assert "mlp_down" in out and "DecoderLayer" in out and "moe_router" not in out


def test_unknown_preset_is_an_error(capsys):
    assert main(["explain", "--size", "tiny", "--config", "matmul"]) == 2
    assert "matmul" in capsys.readouterr().out


def test_bench_passes_non_tensor_batch_values_through(tmp_path, capsys):
    # The batch holds a float beside its tensors; only tensors are moved to the device.
    out = tmp_path / "flags.json"
    argv = ["bench", "--model", "model_factories:with_flags", "--policies", "none,full", "--repeats", "2",
            "--warmup", "1", "--overhead-repeats", "2", "--quiet", "--json", str(out)]
    assert main(argv) == 0
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["full"]["loss_identical"] and rows["full"]["max_abs_grad_diff"] == 0


def test_a_factory_that_raises_is_named_in_the_error():
    from actplan.models import load_model

    with pytest.raises(RuntimeError, match=r"model factory 'model_factories:broken' raised KeyError") as info:
        load_model("model_factories:broken")
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(RuntimeError, match="model_factories:broken"):
        main(["units", "--model", "model_factories:broken"])


@pytest.mark.parametrize("device", ["tpu", "cuda", "cuda:7"])
def test_an_unknown_or_missing_device_is_one_clear_error(device, capsys, monkeypatch):
    import torch

    import actplan.cli._bench as cli_bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli_bench, "run_bench", lambda *a, **k: pytest.fail("ran before checking --device"))
    assert main(["bench", "--size", "tiny", "--device", device]) == 2
    out = capsys.readouterr().out
    assert f"'{device}'" in out and "cpu" in out and "Traceback" not in out
    assert ("valid choices: auto, cpu, cuda" if device == "tpu" else "is not available") in out
    for command in (["profile", "--size", "tiny"], ["verify", "--config", "full"]):
        assert main([*command, "--device", device]) == 2
        assert f"'{device}'" in capsys.readouterr().out


def test_unwritable_output_paths_fail_before_any_work(tmp_path, capsys, monkeypatch):
    import actplan.cli._bench as cli_bench

    monkeypatch.setattr(cli_bench, "run_bench", lambda *a, **k: pytest.fail("ran before checking paths"))
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    under_a_file = str(a_file / "sub" / "r.json")
    for option, path in (("--json", under_a_file), ("--markdown", str(tmp_path))):
        code = main(["bench", "--size", "tiny", option, path])
        out = " ".join(capsys.readouterr().out.split())
        assert code == 2 and f"cannot write {option} '{path}'" in out and "choose another path" in out
    assert main(["profile", "--size", "tiny", "--json", under_a_file]) == 2
    assert "is a file, not a folder" in " ".join(capsys.readouterr().out.split())
    assert main(["plan", "--size", "tiny", "--budget", "1GB", "--out", under_a_file]) == 2
    assert "cannot write --out" in " ".join(capsys.readouterr().out.split())


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs a /proc file system")
def test_every_output_flag_is_probed_by_writing_before_any_work(capsys, monkeypatch):
    # /proc refuses new files even to root, for whom permission bits say nothing.
    import actplan.cli._bench as cli_bench
    import actplan.cli._inspect as cli_inspect
    import actplan.cli._plan as cli_plan

    for module, name in ((cli_bench, "run_bench"), (cli_plan, "profile_model"), (cli_inspect, "verify_plan")):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("ran before checking paths"))
    commands = [
        (["bench", "--size", "tiny"], "--json"),
        (["bench", "--size", "tiny"], "--markdown"),
        (["profile", "--size", "tiny"], "--json"),
        (["plan", "--size", "tiny", "--budget", "1GB"], "--json"),
        (["plan", "--size", "tiny", "--budget", "1GB"], "--out"),
        (["plan", "--size", "tiny", "--budget", "1GB"], "--plot"),
        (["verify", "--config", "full"], "--json"),
    ]
    for command, option in commands:
        assert main([*command, option, "/proc/actplan-out"]) == 2, (command, option)
        out = " ".join(capsys.readouterr().out.split())
        assert f"cannot write {option} '/proc/actplan-out'" in out, out


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_help_shows_defaults_and_no_rest_markup(capsys):
    top = _help([], capsys)
    assert "``" not in top and "bench (every policy measured side by side)" in top
    bench = _help(["bench"], capsys)
    # The bench defaults to the size where activations dominate the peak (make demo's table).
    assert "(default: long)" in bench and "(default: 7)" in bench and "(default: auto)" in bench
    assert "(default: None)" not in bench and "(default: False)" not in bench
    explain = _help(["explain"], capsys)
    assert "--size SIZE size of a built-in model" in explain and "(default: small)" in explain
    # One --size default for every other command that builds a model.
    for command in (["units"], ["verify"], ["profile"], ["plan"]):
        assert "--size SIZE" in (text := _help(command, capsys)) and "(default: small)" in text, command


def test_units_takes_a_size(capsys):
    assert main(["units", "--model", "dense", "--size", "small"]) == 0
    assert "mlp_down" in capsys.readouterr().out
    assert main(["units", "--model", "dense", "--size", "huge"]) == 2
    assert "huge" in capsys.readouterr().out


def test_bench_quiet_about_its_own_offload_rows_and_goals_of_another_size(tmp_path):
    import warnings

    def moved_nothing(policies, configs=()):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run_bench(
                "dense", "tiny", policies, configs, repeats=1, warmup=0, overhead_repeats=0, reference=False
            )
        return result, [str(w.message) for w in caught if "moved nothing" in str(w.message)]

    result, warned = moved_nothing(("none", "full", "matmuls", "full+offload"))
    assert warned == []
    assert result.size == "tiny" and evaluate_goals(result) == []
    assert "NOT met" not in to_markdown(result)
    # A user's config with the same offload still hears that it moved nothing.
    mine = tmp_path / "mine.yaml"
    mine.write_text("preset: full\noffload: {layer_input: true}\n")
    _, warned = moved_nothing(("none",), (mine,))
    assert warned and "lower offload.min_bytes" in warned[0]


def test_without_rich_the_command_line_says_what_to_install(capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "rich", None)  # as if rich were not installed
    assert main(["units"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'actplan[cli]'" in err and len(err.strip().splitlines()) == 1


def test_plan_outputs_nobody_named_never_replace_a_file(tmp_path, monkeypatch, capsys):
    from rich.console import Console

    from actplan.cli._plan import output_path

    monkeypatch.chdir(tmp_path)
    console = Console(width=200)
    assert output_path(None, "plan.yaml", "--out", console) == "plan.yaml"
    (tmp_path / "plan.yaml").write_text("mine")
    (tmp_path / "plan-1.yaml").write_text("mine too")
    assert output_path(None, "plan.yaml", "--out", console) == "plan-2.yaml"
    said = capsys.readouterr().out
    assert "plan.yaml exists and is kept; writing plan-2.yaml (name the file with --out)" in said
    assert output_path("plan.yaml", "plan.yaml", "--out", console) == "plan.yaml"  # named: replaced
    assert output_path("", "pareto.png", "--plot", console) is None


def test_version_and_the_headline_command_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("actplan 0.")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "estimate (does a real-scale run fit" in " ".join(capsys.readouterr().out.split())


_BOX = set("│┃┏┗┡└┌")


def _table_widths(printed: str) -> list[int]:
    return [len(line.rstrip()) for line in printed.splitlines() if _BOX & set(line)]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*moved nothing in this call")  # the tiny shape's offload row
def test_tables_fit_a_100_column_terminal_when_piped_and_follow_columns(capsys, monkeypatch):
    # Piped output with no COLUMNS (the tests' conftest drops it) is 100 columns: a table never
    # breaks when pasted into a 100-column terminal. A run with COLUMNS gets that width.
    estimate = ["estimate", "--model", "dense", "--layers", "2", "--hidden", "64", "--heads", "4"]
    estimate += ["--kv-heads", "2", "--ffn", "128", "--vocab", "128", "--seq", "32", "--batch", "2"]
    estimate += ["--presets", "none,full,full+offload", "--budget", "1GiB", "--frontier", "--quiet"]
    for argv in (estimate, ["profile", "--model", "dense", "--size", "tiny", "--quiet"], ["units"]):
        assert main(argv) == 0
        widths = _table_widths(capsys.readouterr().out)
        assert widths and max(widths) <= 100, (argv[0], max(widths))
    monkeypatch.setenv("COLUMNS", "72")
    assert main(["units"]) == 0
    assert max(_table_widths(capsys.readouterr().out)) == 72
