"""``actplan profile`` and ``actplan plan`` (a budget, or ``--sweep`` for the whole predicted
front): profile the model's layer types, solve, write and check the plan.

When the profile's times did not settle (a busy machine), each command prints one warning
line naming the loose candidates and the fix, and ``plan`` gives its predicted ratio a ±.

Imports ``actplan.planning`` lazily (numpy and scipy come with it) and the CLI's helpers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import shlex
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from actplan._install.plan import format_indices
from actplan.cli._console import hint, model_options, progress_display, write_output
from actplan.cli._tables import plan_table, profile_table, sweep_table
from actplan.devices import resolve_device
from actplan.progress import ProgressCallback
from actplan.sizes import DEFAULT_OFFLOAD_MIN_BYTES, mib, parse_bytes, rounding_note


def _profile_inputs(args: argparse.Namespace):
    """The model, the device and the profiling options (shared by ``profile`` and ``plan``)."""
    from actplan.models import load_model

    bundle = load_model(args.model, args.size)
    device = resolve_device(args.device)
    options = {
        "cache_dir": Path(args.cache_dir) if args.cache_dir else None,
        "refresh": args.refresh,
        "repeats": args.repeats,
        "min_bytes": parse_bytes(args.min_bytes),
        "bandwidth": None if args.bandwidth is None else float(parse_bytes(args.bandwidth)),
    }
    return bundle, device, options


class _LooseTimingFilter(logging.Filter):
    """Drops the profiler's loose-timing warning: the command prints its own line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "actplan_loose_timing", False)


@contextlib.contextmanager
def _profiling(console: Console, quiet: bool) -> Iterator[ProgressCallback]:
    """The progress display while profiling, the profiler's logged timing warning held back
    (``_timing_warning`` prints it once, with the results)."""
    logger, held_back = logging.getLogger("actplan"), _LooseTimingFilter()
    logger.addFilter(held_back)
    try:
        with progress_display(console, quiet, "profiling") as progress:
            yield progress
    finally:
        logger.removeFilter(held_back)


def _timing_warning(console: Console, measured, plan_names: list[str] | None = None, ratio=None) -> None:
    """When the profile's times are loose: the plan's predicted ratio with its ± (given its
    candidates per layer) and one warning line; nothing when they settled."""
    warning = measured.timing_warning()
    if warning is None:
        return
    if plan_names is not None and ratio is not None:
        spread = measured.ratio_spread(plan_names)
        console.print(f"predicted step time {ratio:.3f}x ± {spread:.3f} (from loose timing)", soft_wrap=True)
    console.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)


def profile(args: argparse.Namespace, console: Console) -> int:
    from actplan.planning.cache import get_profile

    bundle, device, options = _profile_inputs(args)
    with _profiling(console, args.quiet) as progress:
        measured, cached = get_profile(bundle, args.model, device, **options, progress=progress)
    console.print(profile_table(measured))
    console.print(
        f"{'cached' if cached else 'measured in ' + format(measured.seconds_spent, '.1f') + ' s'}: "
        f"parameters {mib(measured.param_bytes)} MiB, optimizer state {mib(measured.optimizer_bytes)} MiB, "
        f"activations outside the layers {mib(measured.nonlayer_activation_bytes)} MiB; step without "
        f"checkpointing {measured.base_seconds:.3f} s, peak {mib(measured.none_peak_bytes)} MiB "
        f"(full: {mib(measured.full_peak_bytes)} MiB)"
    )
    _timing_warning(console, measured)
    if args.json:
        write_output(args.json, measured.to_json(), console)
    return 0


def plan(args: argparse.Namespace, console: Console) -> int:
    from actplan.planning.budget import plan_under_budget
    from actplan.planning.planner import parse_budget

    if args.sweep:
        return _sweep(args, console)
    parse_budget(args.budget, none_peak_bytes=1.0)  # a malformed budget fails before any work
    host = None if args.host_budget is None else parse_bytes(args.host_budget, round_down=True)
    if note := rounding_note(args.budget):
        console.print(f"note: --budget {note}")
    bundle, device, options = _profile_inputs(args)
    with _profiling(console, args.quiet) as progress:
        result = plan_under_budget(
            bundle,
            args.model,
            args.budget,
            device,
            out=output_path(args.out, "plan.yaml", "--out", console),
            plot=output_path(args.plot, "pareto.png", "--plot", console),
            run=not args.no_run,
            **options,
            progress=progress,
            sweep_command=f"actplan plan {profile_options(args)} --sweep",
            budget_of=args.budget_of,
            host_budget_bytes=host,
        )
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}")
    console.print(plan_table(result))
    measured = _cached_profile(bundle, args.model, device, options)
    if measured is not None:
        names = [layer["candidate"] for layer in sorted(result.layers, key=lambda layer: layer["index"])]
        _timing_warning(console, measured, names, result.solution["predicted_ratio"])
    _print_plan_outputs(result, args.json, console, model_options(args))
    if result.measured is not None and not result.measured["loss_identical"]:
        console.print("[red]the plan's loss differs from no checkpointing[/]")
        return 1
    return 0


def output_path(given: str | None, default: str, option: str, console: Console) -> str | None:
    """Where to write an output: the path given (an existing file there is replaced: it was
    named), none for ``''``, else ``default`` in this folder, numbered (``plan-1.yaml``, ...)
    when a file of that name exists, and said so: a file nobody named is never replaced."""
    if given is not None:
        return given or None
    path, number = Path(default), 0
    while path.exists():
        number += 1
        path = Path(f"{Path(default).stem}-{number}{Path(default).suffix}")
    if number:
        console.print(f"note: {default} exists and is kept; writing {path} (name the file with {option})")
    return str(path)


def _cached_profile(bundle, spec: str, device, options: dict):
    """The profile ``plan_under_budget`` just used (it stores every profile in the cache)."""
    from actplan.planning.cache import cache_key, default_cache_dir, load_cached

    key = cache_key(bundle, spec, device, options["min_bytes"], options["bandwidth"])
    return load_cached(options["cache_dir"] or default_cache_dir(), key)


def profile_options(args: argparse.Namespace) -> str:
    """``model_options`` and the profiling options given that change the profile or where it is
    cached (``--min-bytes``, ``--bandwidth``, ``--cache-dir``), for a hint to plan again."""
    options = model_options(args)
    if parse_bytes(args.min_bytes) != DEFAULT_OFFLOAD_MIN_BYTES:
        options += f" --min-bytes {shlex.quote(str(args.min_bytes))}"
    if args.bandwidth is not None:
        options += f" --bandwidth {shlex.quote(str(args.bandwidth))}"
    if args.cache_dir:
        options += f" --cache-dir {shlex.quote(str(args.cache_dir))}"
    return options


def _print_plan_outputs(result, json_path: str | None, console: Console, model: str) -> None:
    """The plan's layers by candidate, and the files it wrote (config, plot, ``--json``), with
    the commands that run and verify the plan on the model it was made for."""
    by_candidate: dict[str, list[int]] = {}
    for layer in result.layers:
        by_candidate.setdefault(layer["candidate"], []).append(layer["index"])
    for name, indices in by_candidate.items():
        console.print(f"  layers {format_indices(indices)}: {name}")
    if result.config_path:
        path = shlex.quote(str(result.config_path))
        console.print(f"wrote {result.config_path}; run it with", soft_wrap=True, markup=False)
        hint(console, f"actplan bench {model} --config {path}")
        hint(console, f"actplan verify {model} --config {path}")
    if result.plot_path:
        console.print(f"wrote {result.plot_path}")
    if json_path:
        write_output(json_path, json.dumps(result.to_dict(), indent=2) + "\n", console)


def _sweep(args: argparse.Namespace, console: Console) -> int:
    """``actplan plan --sweep``: the whole predicted front, nothing run."""
    from actplan.planning.budget import pareto_points, sweep
    from actplan.planning.cache import get_profile
    from actplan.planning.planner import pareto_front, plan_summary
    from actplan.planning.plot import write_pareto_plot

    if args.out or args.no_run:
        raise ValueError("--sweep writes no plan and runs nothing: drop --out and --no-run")
    bundle, device, options = _profile_inputs(args)
    with _profiling(console, args.quiet) as progress:
        measured, _ = get_profile(bundle, args.model, device, **options, progress=progress)
    host = None if args.host_budget is None else parse_bytes(args.host_budget, round_down=True)
    solutions = pareto_front(measured.problem(host))
    front = sweep(measured, solutions)
    console.print(sweep_table(measured.model, front, plan_summary))
    _timing_warning(console, measured)
    if front:
        # A budget a little above the middle point's peak, so that the command plans that point;
        # in tenths of a MB (10^6 bytes), which are whole bytes as --budget requires (tenths of
        # a MiB are not).
        peak = front[len(front) // 2]["predicted_peak_bytes"]
        console.print("pick a peak and give it as --budget to write and check that plan; the middle one:")
        hint(
            console,
            f"actplan plan {profile_options(args)} --budget {math.ceil(peak / 1e5) / 10:.1f}MB",
        )
    plot = output_path(args.plot, "pareto.png", "--plot", console)
    if plot:
        write_pareto_plot(
            pareto_points(measured, solutions), plot, f"{measured.model} on {measured.device}"
        )
        console.print(f"wrote {plot}")
    if args.json:
        text = json.dumps({"model": measured.model, "front": front}, indent=2) + "\n"
        write_output(args.json, text, console)
    return 0
