"""Every command the CLI prints for the user to run next works as written: each hint is parsed
with shlex and run through ``main`` in-process (bench and verify hints with fewer rounds), on
the model the hint names."""

from __future__ import annotations

import re
import shlex

import pytest

from actplan.cli import main
from actplan.cli._parser import build_parser

# One worker profiles conftest's long models once
pytestmark = pytest.mark.xdist_group("long-profiles")

FACTORY = "model_factories:dense_long"
# Fewer rounds than the defaults: the command is the one printed, run faster.
FASTER = {
    "bench": ["--repeats", "1", "--warmup", "0", "--overhead-repeats", "0", "--quiet"],
    "verify": ["--steps", "1"],
}


def printed_commands(out: str) -> list[str]:
    """The indented ``actplan ...`` lines a command printed for the user to run."""
    return [line.strip() for line in out.splitlines() if line.startswith("  actplan ")]


def quoted_commands(out: str, program: str = "actplan") -> list[str]:
    """Commands quoted in backticks in messages (wrapped lines joined first)."""
    return re.findall(rf"`({program} [^`]*)`", " ".join(out.split()))


def run_hint(command: str, capsys) -> str:
    """Run a printed ``actplan ...`` command in-process; its output, after checking it succeeded."""
    argv = shlex.split(command)
    assert argv[0] == "actplan", command
    code = main([*argv[1:], *FASTER.get(argv[1], [])])
    out = capsys.readouterr().out
    assert code == 0, f"{command} failed:\n{out}"
    return out


@pytest.mark.slow
def test_the_commands_actplan_plan_prints_run_as_written(dense, cache, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["plan", "--model", FACTORY, "--budget", "80%", "--min-bytes", "0", "--repeats", "3"]
    assert main([*args, "--cache-dir", str(cache), "--plot", "", "--no-run", "--quiet"]) == 0
    hints = printed_commands(capsys.readouterr().out)
    assert [shlex.split(h)[1] for h in hints] == ["bench", "verify"]
    for command in hints:
        assert f"--model {FACTORY}" in command and "--config plan.yaml" in command
        out = run_hint(command, capsys)
        assert "plan" in out  # the config's row (bench) or table (verify) ran


@pytest.mark.slow
def test_the_command_plan_sweep_prints_plans_at_the_peak_it_names(
    dense, cache, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    args = ["plan", "--model", FACTORY, "--sweep", "--min-bytes", "0"]
    assert main([*args, "--cache-dir", str(cache), "--plot", "", "--quiet"]) == 0
    (command,) = printed_commands(capsys.readouterr().out)
    assert f"--model {FACTORY} --min-bytes 0 --cache-dir {cache} --budget " in command
    out = run_hint(command, capsys)
    assert (tmp_path / "plan.yaml").exists() and (tmp_path / "pareto.png").exists() and "measured" in out
    for hint in printed_commands(out):  # and that run's own hints
        run_hint(hint, capsys)


@pytest.mark.slow
def test_the_sweep_command_a_budget_error_names_runs_as_written(dense, cache, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["plan", "--model", FACTORY, "--budget", "1MiB", "--min-bytes", "0", "--cache-dir", str(cache)]
    assert main([*args, "--no-run", "--plot", "", "--quiet"]) == 2
    (command,) = quoted_commands(capsys.readouterr().out)
    assert command == f"actplan plan --model {FACTORY} --min-bytes 0 --cache-dir {cache} --sweep"
    assert "every plan worth having" in run_hint(command, capsys)


def test_the_units_command_explain_names_runs_as_written(capsys):
    pytest.importorskip("transformers")
    assert main(["explain", "--model", "hf-llama", "--size", "tiny", "--config", "matmuls"]) == 0
    (command,) = quoted_commands(capsys.readouterr().out)
    assert command == "actplan units --model hf-llama --size tiny"
    assert "LlamaDecoderLayer" in run_hint(command, capsys)


def test_the_torchrun_command_bench_names_carries_the_run_options(capsys, monkeypatch):
    # Running it takes a process per rank (tests/test_moe_ep.py does that); here the command
    # is checked to be one: torchrun's part, and actplan's part through the real parser.
    monkeypatch.delenv("RANK", raising=False)
    args = [
        "bench",
        "--model",
        "moe",
        "--size",
        "tiny",
        "--ep",
        "2",
        "--repeats",
        "1",
        "--config",
        "a b.yaml",
    ]
    assert main(args) == 2
    (command,) = quoted_commands(capsys.readouterr().out, program="torchrun")
    argv = shlex.split(command)
    assert argv[:5] == ["torchrun", "--nproc-per-node", "2", "-m", "actplan"]
    parsed = build_parser().parse_args(argv[5:])
    assert (parsed.command, parsed.model, parsed.size, parsed.ep, parsed.repeats) == (
        "bench",
        "moe",
        "tiny",
        2,
        1,
    )
    assert parsed.config == ["a b.yaml"]
