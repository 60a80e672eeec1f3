"""actplan next to the tools its users reach for today, measured in one run.

    python -m bench.peers                      # dense small and moe small (about 15 minutes on 2 cores)
    python -m bench.peers --models dense --size tiny --repeats 2 --overhead-repeats 5   # quick
    python -m bench.peers --models titan-llama3 # torchtitan's own llama3 and its own AC classes

Per model, every row below trains on the same weights and batch: one step checks parity
against no checkpointing (loss, every gradient, grad census), one metered step gives the
activation bytes at the end of forward and the step's peak, then all rows are timed
interleaved (A B C, B C A, ...) after a warm-up.

- ``none``: no checkpointing.
- Peers: ``torch-checkpoint`` (whole layer, non-reentrant, as Hugging Face and most
  trainers do it); ``titan-sac`` (torchtitan's own SelectiveAC; where torchtitan does not
  import, ``titan-op-sac``, our re-statement of its rule); ``remat-{full,attn,matmuls}``
  (torch_remat with save regions matching actplan's presets); ``megatron[...]`` (Megatron
  ``--recompute-modules`` choices, run through actplan's config since Megatron itself is not
  in the picture).
- Automatic peers: ``compile[budget=B]``, each layer compiled (aot_eager) with
  ``torch._functorch.config.activation_memory_budget=B``; rockmate is tried and reported as
  not run, with the reason. Compiled rows pass parity within the compile noise floor.
- actplan's presets, with and without offload, and with compiled layers (``fullgraph=True``;
  MoE layers under dynamo's data-dependent-shape flags, ``capture_data_dependent_shapes``).
- Planner plans at each peer's measured peak: one free to offload, one recompute-only (and,
  at a compiled peer's peak, the recompute-only plan with compiled layers).

``--models titan-llama3`` runs torchtitan 0.3.0's own llama3 (``bench.peers.titan``, dense
small's shape, SDPA as its inner attention on CPU) with actplan installed by
``actplan.apply``; its peers are torchtitan's own ``FullAC`` (``titan-full``),
``SelectiveAC`` (``titan-sac``) and ``MemoryBudgetAC`` at each compile budget
(``titan-memory-budget[budget=B]``, blocks compiled with aot_eager), in place of the peers
that need our model classes.

Then, per peer: the fastest actplan row whose peak is within 0.5% of the peer's (and, as a
second view, whose activation bytes are), with the step-time ratios side by side.

Last, the CPU-side cost per checkpointed layer, on the tiny size of the model with 8
layers, where Python and dispatch overhead dominate the step.

Writes ``bench/results/peers_<model>_<size>.{json,md,png}`` (``--tag T``: ``..._<size>_T.*``, for a
run at reduced settings next to the committed full-setting one).

The bench's parts: ``bench.peers.rows`` (which rows), ``bench.peers.run`` (one model's run),
``bench.peers.compare`` (plans at the peers' peaks, equal-memory comparison, goals),
``bench.peers.overhead`` (CPU-side cost per layer) and ``bench.peers.report`` (markdown, plot).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from bench.peers.compare import SAME_MEMORY as SAME_MEMORY  # re-exported: the tests read them here
from bench.peers.compare import compare as compare
from bench.peers.compare import evaluate_goals as evaluate_goals
from bench.peers.methods import COMPILE_BUDGETS
from bench.peers.report import to_markdown, write_plot
from bench.peers.rows import MODEL_CHOICES
from bench.peers.rows import megatron_installer as megatron_installer
from bench.peers.run import run_model

RESULTS = Path("bench/results")


def main(argv: list[str] | None = None) -> int:
    args, models, budgets = _parse_args(argv)
    out_dir = Path(args.out)
    ok = True
    for model in models:
        out = run_model(
            model,
            args.size,
            repeats=args.repeats,
            warmup=args.warmup,
            overhead_repeats=args.overhead_repeats,
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
            progress=lambda s: print(s, file=sys.stderr, flush=True),
            compile_budgets=budgets,
        )
        out["settings_off_default"] = _off_default(args)
        out["stem"] = f"peers_{model}_{args.size}" + (f"_{args.tag}" if args.tag else "")
        _write(out, out_dir / out["stem"])
        ok = ok and all(r["parity_ok"] for r in out["rows"])
    return 0 if ok else 1


def _off_default(args: argparse.Namespace) -> list[str]:
    """The timing and compile settings this run changed from the defaults, as ``--option value
    (default d)``: a run reduced to fit the machine says so in its report."""
    changed = []
    for option in ("repeats", "warmup", "overhead_repeats", "compile_budgets"):
        value, default = getattr(args, option), _parser().get_default(option)
        if value != default:
            changed.append(f"--{option.replace('_', '-')} {value} (default {default})")
    return changed


def _write(out: dict[str, Any], stem: Path) -> None:
    """The run's JSON, plot and markdown under ``stem``; the markdown also on stdout."""
    stem.with_suffix(".json").parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    write_plot(out, stem.with_suffix(".png"))
    report = to_markdown(out)
    stem.with_suffix(".md").write_text(report)
    print(report)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default="dense,moe",
        help=f"comma-separated: {', '.join(MODEL_CHOICES)} (torchtitan's own llama3, on CPU)",
    )
    parser.add_argument("--size", default="small")
    parser.add_argument("--repeats", type=int, default=5, help="timed interleaved rounds")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--overhead-repeats",
        type=int,
        default=40,
        help="rounds of the tiny-shape CPU overhead timing (0: skip)",
    )
    parser.add_argument(
        "--compile-budgets",
        default=",".join(str(b) for b in COMPILE_BUDGETS),
        help="activation_memory_budget values of the torch.compile peers, comma-separated; 1.0 (the "
        "noise-floor row) is always added; an empty string skips every compiled row",
    )
    parser.add_argument("--cache-dir", help="profile cache (default ~/.cache/actplan/profiles)")
    parser.add_argument("--out", default=str(RESULTS), help="where the results go")
    parser.add_argument(
        "--tag",
        help="appended to the result files' stem (peers_<model>_<size>_<tag>.*), so a run at reduced "
        "settings does not replace the committed full-setting report",
    )
    return parser


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], tuple[float, ...]]:
    """The options, the models and the compile budgets, each checked."""
    parser = _parser()
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODEL_CHOICES]
    if unknown:
        parser.error(f"--models takes {', '.join(MODEL_CHOICES)}; got {', '.join(unknown)}")
    wrong_budgets = f"--compile-budgets takes numbers from 0 to 1, e.g. 0.1,0.5; got {args.compile_budgets!r}"
    try:
        budgets = tuple(float(b) for b in args.compile_budgets.split(",") if b.strip())
    except ValueError:
        parser.error(wrong_budgets)
    if any(not 0 <= b <= 1 for b in budgets):
        parser.error(wrong_budgets)
    if args.tag is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]*", args.tag):
        parser.error(
            f"--tag takes letters, digits, '.' and '-' (it becomes part of a file name); got {args.tag!r}"
        )
    return args, models, budgets


if __name__ == "__main__":
    raise SystemExit(main())
