"""The ``actplan`` command line: ``bench`` (the main job), ``profile``, ``plan``, ``verify``,
``explain`` and ``units``.

Top of the import picture: it may use everything, nothing imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from actplan.config import PRESETS, ConfigError
from actplan.evaluate.bench import (
    DEFAULT_POLICIES,
    GOAL_SIZE,
    OFFLOAD_VARIANTS,
    BenchResult,
    mib,
    run_bench,
    to_markdown,
    write_json,
)
from actplan.integrations import hf
from actplan.models import MODELS, ModelBundle
from actplan.progress import PlainLines, ProgressCallback, ProgressEvent


def _bench(args: argparse.Namespace, console: Console) -> int:
    if args.ep > 1:
        return _bench_expert_parallel(args, console)
    return _run_and_report(args, console)


def _bench_expert_parallel(args: argparse.Namespace, console: Console) -> int:
    """Under torchrun: one rank per expert shard; rank 0 reports."""
    import os

    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        raise ValueError(
            f"--ep {args.ep} needs one process per rank: run "
            f"`torchrun --nproc-per-node {args.ep} -m actplan bench --model {args.model} --ep {args.ep}`"
        )
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        if dist.get_rank() != 0:
            args.quiet, args.json, args.markdown = True, None, None
            console = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - lives until exit
        code = _run_and_report(args, console)
        codes: list = [None] * dist.get_world_size()
        dist.all_gather_object(codes, code)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # torch 2.13 on gloo sometimes aborts in C++ while the interpreter shuts down
    # after functional all-to-alls ("terminate called without an active exception").
    # Everything is reported and the group is gone: exit before that can happen.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(max(codes))


def _run_and_report(args: argparse.Namespace, console: Console) -> int:
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    with _progress(console, args.quiet, "building") as progress:
        result = run_bench(
            args.model,
            args.size,
            policies,
            tuple(args.config),
            repeats=args.repeats,
            warmup=args.warmup,
            overhead_repeats=args.overhead_repeats,
            device=args.device,
            reference=not args.no_reference,
            ep=args.ep,
            progress=progress,
            command="actplan " + " ".join(sys.argv[1:]) if sys.argv[1:] else "actplan bench",
        )
    console.print(bench_table(result))
    held = {r.name: r.held_by_unit for r in result.rows if r.held_by_unit}
    if held:
        console.print(held_table(held, "held per kept unit at the end of forward, all layers"))
    if result.model_name == "dense" and result.size != GOAL_SIZE:
        console.print(
            f"[dim]performance goals are set for --size {GOAL_SIZE}; not evaluated at {result.size}[/]"
        )
    for goal in result.goals:
        style = "green" if goal["met"] else "red"
        console.print(
            f"[{style}]{'met' if goal['met'] else 'NOT met'}[/]: {goal['goal']} "
            f"(measured {goal['value']:.3f})"
        )
    if args.json:
        write_json(result, args.json)
        console.print(f"wrote {args.json}")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(to_markdown(result))
        console.print(f"wrote {args.markdown}")
    return 0 if all(r.parity_ok for r in result.rows) else 1


def bench_table(result: BenchResult) -> Table:
    table = Table(
        title=f"actplan bench — {result.model} — {result.device}, torch {result.torch_version}",
        caption=f"analytic activation floor {mib(result.floor_bytes)} MiB; "
        f"{result.warmup} warm-up + {result.repeats} interleaved rounds",
    )
    for column in (
        "policy",
        "loss identical",
        "max |Δgrad|",
        "grad census",
        "activations MiB",
        "vs none",
        "peak MiB",
        "floor MiB",
        "step s",
        "time vs none",
    ):
        table.add_column(column, justify="left" if column == "policy" else "right", no_wrap=True)
    expert_parallel = any(r.per_rank_memory for r in result.rows)
    if expert_parallel:
        table.add_column("per-rank act./peak MiB", justify="right", no_wrap=True)
    offloading = any(r.offloaded_bytes is not None for r in result.rows)
    if offloading:
        table.add_column("host peak MiB", justify="right", no_wrap=True)
        table.add_column("moved out/in MiB", justify="right", no_wrap=True)
    none = result.row("none")
    for r in result.rows:
        per_rank = [" | ".join(f"{mib(a)}/{mib(p)}" for a, p in r.per_rank_memory)] if expert_parallel else []
        if offloading:
            per_rank += (
                ["-", "-"]
                if r.offloaded_bytes is None
                else [mib(r.host_peak_bytes), f"{mib(r.offloaded_bytes)}/{mib(r.reloaded_bytes)}"]
            )
        table.add_row(
            r.name,
            "[green]yes[/]" if r.loss_identical else "[red]NO[/]",
            f"{r.max_abs_grad_diff:.1e}",
            "[green]match[/]" if r.census_match else "[red]MISMATCH[/]",
            mib(r.activation_bytes),
            f"{r.activation_bytes / none.activation_bytes:.2f}" if none else "-",
            mib(r.peak_bytes),
            mib(result.floor_bytes),
            f"{r.step_median_s:.3f}",
            f"{r.ratio_to_none:.3f} ± {r.ratio_spread:.3f}",
            *per_rank,
        )
    return table


def held_table(held: dict[str, dict[str, dict[str, int]]], title: str) -> Table:
    """Per row (policy or layer) and kept unit: bytes held against what autograd keeps."""
    table = Table(
        title=title,
        caption="autograd keeps: what the same ops hold without checkpointing (the tensors they save "
        "and those of their outputs any op saves); routing: routing and collective outputs",
    )
    for column in ("", "unit", "held KiB", "autograd keeps KiB", "ratio"):
        table.add_column(column, justify="left" if column in ("", "unit") else "right", no_wrap=True)
    for name, units in held.items():
        for unit, sizes in sorted(units.items()):
            kept, autograd = sizes["held"], sizes["autograd"]
            share = f"{kept / autograd:.2f}" if autograd else ("0" if not kept else "-")
            table.add_row(name, unit, f"{kept / 1024:.1f}", f"{autograd / 1024:.1f}", share)
    return table


def _explain(args: argparse.Namespace, console: Console) -> int:
    from actplan._install.apply import plan_for
    from actplan.models import load_model

    bundle = load_model(args.model, args.size)
    if args.measure:
        return _explain_measured(bundle, args.config, console)
    plan = plan_for(bundle.model, args.config)
    caption = plan.summary()
    offload = plan.config.offload
    if offload is not None:
        caption += (
            f"\noffload: tensors of at least {offload.min_bytes:,} bytes, host pool cap "
            f"{offload.host_cap:,} bytes, prefetch {offload.prefetch} layer(s) ahead"
        )
    if hf.contains_transformers(bundle.model):
        sources = {type(x.module).__name__: x.source for x in hf.find_decoder_layers(bundle.model)}
        caption += (
            "\nHugging Face layouts: "
            + ", ".join(f"{name} {source}" for name, source in sources.items())
            + f" (the module spans of each unit: actplan units --model {args.model})"
        )
    table = Table(title=f"plan for {bundle.description}", caption=caption)
    for column in ("layer", "module", "class", "mode", "kept units", "routing saved", "offloaded", "from"):
        table.add_column(column)
    for layer in plan.layers:
        kept = ", ".join(u.value for u in layer.kept_units) if layer.mode == "selective" else "-"
        routing = "-" if layer.mode == "none" else ("yes" if layer.routing_saved else "no")
        table.add_row(
            str(layer.index),
            layer.name,
            layer.class_name,
            layer.mode,
            kept or "(none)",
            routing,
            layer.describe_offload() or "-",
            layer.source,
        )
    console.print(table)
    return 0


def _explain_measured(bundle: ModelBundle, config: str, console: Console) -> int:
    # Two training steps: the first teaches each layer its path, the second is reported.
    import actplan

    plan = actplan.apply(bundle.model, config)
    for seed in range(2):
        out = bundle.model(**bundle.make_batch(seed))
        (out["loss"] if isinstance(out, dict) else out).backward()
        bundle.model.zero_grad(set_to_none=True)
    held = actplan.held_by_layer(bundle.model)
    console.print(plan.summary())
    console.print(held_table(held, f"held per kept unit, {bundle.description}, one training step"))
    return 0


def _units(args: argparse.Namespace, console: Console) -> int:
    from actplan._install.apply import layer_specs
    from actplan.models import load_model
    from actplan.units import UNIT_DESCRIPTIONS, RecomputeUnit

    declared: dict[RecomputeUnit, list[str]] = {}
    model = load_model(args.model, args.size).model if args.model else None
    if model is not None:
        for spec in layer_specs(model):
            for unit in spec.interval_map.units:
                classes = declared.setdefault(unit, [])
                if spec.class_name not in classes:
                    classes.append(spec.class_name)
    table = Table(title="recompute units" + (f" declared by model {args.model!r}" if args.model else ""))
    table.add_column("unit", no_wrap=True)
    if args.model:
        table.add_column("declared by", no_wrap=True)
    table.add_column("what it is; what keeping it costs and saves")
    for unit in RecomputeUnit:
        if args.model and unit not in declared:
            continue
        row = [unit.value, ", ".join(declared[unit])] if args.model else [unit.value]
        table.add_row(*row, UNIT_DESCRIPTIONS[unit])
    console.print(table)
    if model is not None and hf.contains_transformers(model):
        # Which module spans make up each unit, and whether actplan derived them.
        spans = Table(title=f"Hugging Face layouts of {args.model!r}: module spans per unit")
        for column in ("layer class", "layers", "layout", "unit", "spans"):
            spans.add_column(column)
        for row in hf.layout_rows(model):
            spans.add_row(*row)
        console.print(spans)
    return 0


@contextlib.contextmanager
def _progress(console: Console, quiet: bool, starting: str) -> Iterator[ProgressCallback]:
    """A ``progress=`` callback for the API's long calls: on a terminal a bar with stage,
    percentage, elapsed time and time left; otherwise (CI logs, pipes) one plain line per
    event on stderr, so stdout keeps only the results; nothing with ``--quiet``."""
    if quiet:
        yield lambda event: None
        return
    if not console.is_terminal:
        yield PlainLines(lambda line: print(line, file=sys.stderr, flush=True))
        return
    with Progress(
        TextColumn("[bold]{task.description:<44}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(starting, total=None)

        def update(event: ProgressEvent) -> None:
            bar.update(task, total=event.total, completed=event.done, description=event.stage)

        yield update


def _profile_inputs(args: argparse.Namespace):
    """The model, the device and the profiling options (shared by ``profile`` and ``plan``)."""
    import torch

    from actplan.evaluate.bench import _device
    from actplan.models import load_model
    from actplan.sizes import parse_bytes

    bundle = load_model(args.model, args.size)
    device: torch.device = _device(args.device)
    options = {
        "cache_dir": Path(args.cache_dir) if args.cache_dir else None,
        "refresh": args.refresh,
        "repeats": args.repeats,
        "min_bytes": parse_bytes(args.min_bytes),
        "bandwidth": None if args.bandwidth is None else float(parse_bytes(args.bandwidth)),
    }
    return bundle, device, options


def profile_table(profile) -> Table:
    table = Table(title=f"profile of {profile.model} on {profile.device}")
    for column in ("layers", "candidate", "retained MiB", "transient MiB", "offloaded MiB", "extra ms"):
        table.add_column(column, justify="left" if column in ("layers", "candidate") else "right")
    from actplan._install.plan import format_indices

    for layer_type in profile.layer_types:
        where = f"{layer_type.class_name} {format_indices(layer_type.layer_indices)}"
        for position, c in enumerate(layer_type.candidates):
            table.add_row(
                where if position == 0 else "",
                c.name,
                mib(c.retained_bytes),
                mib(c.transient_bytes),
                mib(c.offloaded_bytes) if c.offload else "-",
                f"{c.extra_seconds * 1e3:.2f}",
            )
    return table


def _profile(args: argparse.Namespace, console: Console) -> int:
    from actplan.planning.budget import get_profile

    bundle, device, options = _profile_inputs(args)
    with _progress(console, args.quiet, "profiling") as progress:
        profile, cached = get_profile(
            bundle, args.model, device, **options, progress=progress
        )
    console.print(profile_table(profile))
    console.print(
        f"{'cached' if cached else 'measured in ' + format(profile.seconds_spent, '.1f') + ' s'}: "
        f"parameters {mib(profile.param_bytes)} MiB, optimizer state {mib(profile.optimizer_bytes)} MiB, "
        f"activations outside the layers {mib(profile.nonlayer_activation_bytes)} MiB; step without "
        f"checkpointing {profile.base_seconds:.3f} s, peak {mib(profile.none_peak_bytes)} MiB "
        f"(full: {mib(profile.full_peak_bytes)} MiB)"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(profile.to_json())
        console.print(f"wrote {args.json}")
    return 0


def _plan(args: argparse.Namespace, console: Console) -> int:
    import json

    from actplan.planning.budget import plan_under_budget
    from actplan.planning.planner import parse_budget

    if args.sweep:
        return _sweep(args, console)
    parse_budget(args.budget, none_peak_bytes=1.0)  # a malformed budget fails before any work
    bundle, device, options = _profile_inputs(args)
    with _progress(console, args.quiet, "profiling") as progress:
        result = plan_under_budget(
            bundle,
            args.model,
            args.budget,
            device,
            out=args.out or "plan.yaml",
            plot=args.plot or None,
            run=not args.no_run,
            **options,
            progress=progress,
        )
    solution = result.solution
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}")
    table = Table(title=f"plan for {result.model} under {mib(result.budget_bytes)} MiB")
    for column in ("", "peak MiB", "step time / none"):
        table.add_column(column, justify="left" if not column else "right")
    table.add_row("predicted", mib(solution["predicted_peak_bytes"]), f"{solution['predicted_ratio']:.3f}")
    if result.measured is not None:
        measured, error = result.measured, result.prediction_error
        table.add_row(
            "measured",
            mib(measured["peak_bytes"]),
            f"{measured['ratio_to_none']:.3f} ± {measured['ratio_spread']:.3f}",
        )
        table.add_row("prediction error", f"{error['peak']:+.1%}", f"{error['time_ratio']:+.1%}")
    console.print(table)
    from actplan._install.plan import format_indices

    by_candidate: dict[str, list[int]] = {}
    for layer in result.layers:
        by_candidate.setdefault(layer["candidate"], []).append(layer["index"])
    for name, indices in by_candidate.items():
        console.print(f"  layers {format_indices(indices)}: {name}")
    if result.config_path:
        console.print(
            f"wrote {result.config_path} (run it with `actplan bench --config {result.config_path}`)"
        )
    if result.plot_path:
        console.print(f"wrote {result.plot_path}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        console.print(f"wrote {args.json}")
    if result.measured is not None and not result.measured["loss_identical"]:
        console.print("[red]the plan's loss differs from no checkpointing[/]")
        return 1
    return 0


def _sweep(args: argparse.Namespace, console: Console) -> int:
    """``actplan plan --sweep``: the whole predicted front, nothing run."""
    import json

    from actplan.planning.budget import get_profile, pareto_points, sweep, write_pareto_plot
    from actplan.planning.planner import pareto_front, plan_summary

    if args.out or args.no_run:
        raise ValueError("--sweep writes no plan and runs nothing: drop --out and --no-run")
    bundle, device, options = _profile_inputs(args)
    with _progress(console, args.quiet, "profiling") as progress:
        profile, _ = get_profile(
            bundle, args.model, device, **options, progress=progress
        )
    solutions = pareto_front(profile.problem())
    front = sweep(profile, solutions)
    table = Table(
        title=f"every plan worth having for {profile.model} (predicted, fastest at each peak)",
        caption="pick a peak, then `actplan plan --budget <peak>` writes and checks that plan",
    )
    for column in ("peak MiB", "of none", "step time / none", "plan (layers: candidate)"):
        table.add_column(column, justify="left" if column.startswith("plan") else "right")
    for point in front:
        share = point["share_of_none_peak"]
        table.add_row(
            mib(point["predicted_peak_bytes"]),
            f"{share:.0%}" if share is not None else "-",
            f"{point['predicted_ratio']:.3f}",
            plan_summary(point["candidates"]),
        )
    console.print(table)
    if args.plot:
        write_pareto_plot(
            pareto_points(profile, solutions), args.plot, f"{profile.model} on {profile.device}"
        )
        console.print(f"wrote {args.plot}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": profile.model, "front": front}, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def _verify(args: argparse.Namespace, console: Console) -> int:
    import json

    from actplan.evaluate.bench import _device
    from actplan.evaluate.verify import verify
    from actplan.models import load_model

    bundle = load_model(args.model, args.size)
    with _progress(console, args.quiet, "verifying") as progress:
        report = verify(
            bundle,
            args.config,
            steps=args.steps,
            device=_device(args.device),
            atol=args.atol,
            check_recompute=args.check_recompute,
            progress=progress,
        )
    table = Table(title=f"verify {args.config} on {report.model}")
    for column in ("step", "loss (no checkpointing)", "loss (plan)", "max |Δgrad|", "grad census", "routing"):
        table.add_column(column, justify="right")
    for s in report.steps:
        routing = "-" if not s.routing_decisions else ("match" if s.routing_match else "[red]DIFFERS[/]")
        table.add_row(
            str(s.step),
            f"{s.loss_baseline:.8g}",
            f"{s.loss_plan:.8g}" + ("" if s.loss_identical else " [red]≠[/]"),
            f"{s.max_abs_grad_diff:.1e}",
            "match" if s.census_match else "[red]MISMATCH[/]",
            routing,
        )
    console.print(table)
    if report.recompute_checked:
        console.print(
            f"recompute value check: {report.recompute_ops_compared} replayed ops compared with their "
            f"forward values, {len(report.recompute_mismatches)} differ"
        )
    for problem in report.problems():
        console.print(f"[red]✗[/] {problem}")
    tolerance = "bit-identical" if report.atol == 0 else f"within {report.atol:g}"
    if report.ok:
        console.print(f"[green]PASS[/]: the plan changes no loss, gradient or routing decision ({tolerance})")
    else:
        console.print(f"[red]FAIL[/]: the plan changes the training step ({tolerance} required)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0 if report.ok else 1


DEVICE_HELP = "auto (CUDA when there is one), cpu, cuda or cuda:<index>"
MODEL_HELP = (
    f"built-in ({', '.join(MODELS)}), hf-<kind> (a random-weight transformers model; kinds: "
    f"{', '.join(hf.REFERENCE_KINDS)}), or package.module:factory"
)


def _add_profile_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="dense", help=MODEL_HELP)
    parser.add_argument("--size", default="small", help="size of a built-in model (tiny, small)")
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per measurement")
    parser.add_argument("--min-bytes", default="64KiB", help="offload size threshold of offload candidates")
    parser.add_argument(
        "--bandwidth",
        help="host link bandwidth per direction, bytes/s (e.g. 25GB): replaces the measured figure "
        "in offload's charge",
    )
    parser.add_argument("--cache-dir", help="profile cache (default ~/.cache/actplan/profiles)")
    parser.add_argument("--refresh", action="store_true", help="profile again even if cached")
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress display")


class _HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to an option's help, where there is a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help
        if (
            help_text is None
            or "%(default)" in help_text
            or not action.option_strings
            or action.default in (None, False, [], argparse.SUPPRESS)
        ):
            return help_text
        return f"{help_text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    summary = " ".join(__doc__.split("\n\n")[0].split()).replace("``", "")
    parser = argparse.ArgumentParser(prog="actplan", description=summary, formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="measure every policy side by side on a reference model")
    bench.add_argument(
        "--model",
        default="dense",
        help=MODEL_HELP,
    )
    bench.add_argument("--size", default="small", help="model size preset (tiny, small)")
    bench.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"comma-separated presets (known: {', '.join(PRESETS)}) and offload rows "
        f"({', '.join(OFFLOAD_VARIANTS)})",
    )
    bench.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="add a row for a config file (repeatable)",
    )
    bench.add_argument("--repeats", type=int, default=7, help="timed interleaved rounds")
    bench.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    bench.add_argument(
        "--overhead-repeats",
        type=int,
        default=12,
        help="extra rounds timing full against plain torch.utils.checkpoint (0: none)",
    )
    bench.add_argument("--device", default="auto", help=DEVICE_HELP)
    bench.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks (moe only; launch with torchrun --nproc-per-node N -m actplan bench)",
    )
    bench.add_argument(
        "--no-reference", action="store_true", help="skip the plain torch.utils.checkpoint reference row"
    )
    bench.add_argument("--json", metavar="PATH", help="write the full result as JSON")
    bench.add_argument("--markdown", metavar="PATH", help="write a markdown report")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.set_defaults(run=_bench)

    explain = sub.add_parser("explain", help="print the per-layer plan a config resolves to")
    explain.add_argument(
        "--model",
        default="dense",
        help=MODEL_HELP,
    )
    explain.add_argument("--size", default="small", help="size of a built-in model (tiny, small)")
    explain.add_argument("--config", required=True, help="preset name or YAML/JSON file")
    explain.add_argument(
        "--measure",
        action="store_true",
        help="also run a training step and report, per layer and kept unit, the bytes held at the "
        "end of forward against what autograd keeps for the same ops without checkpointing",
    )
    explain.set_defaults(run=_explain)

    profile = sub.add_parser("profile", help="measure each layer type's keep/recompute/offload candidates")
    _add_profile_options(profile)
    profile.set_defaults(run=_profile)

    plan = sub.add_parser("plan", help="the fastest plan under a memory budget: solve, write, run, check")
    _add_profile_options(plan)
    target = plan.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--budget",
        help="bytes ('40GiB', '1.5GB') or a share of the no-checkpoint peak ('60%%')",
    )
    target.add_argument(
        "--sweep",
        action="store_true",
        help="print every plan on the predicted memory/time front (no budget needed; nothing is run)",
    )
    plan.add_argument("--out", help="where to write the plan (YAML or JSON; default plan.yaml)")
    plan.add_argument("--plot", default="pareto.png", help="Pareto plot (PNG); '' for none")
    plan.add_argument("--no-run", action="store_true", help="solve and write only")
    plan.set_defaults(run=_plan)

    check = sub.add_parser("verify", help="run a plan next to no checkpointing and compare every step")
    check.add_argument("--model", default="dense", help=MODEL_HELP)
    check.add_argument("--size", default="tiny", help="size of a built-in model (tiny, small)")
    check.add_argument("--config", required=True, help="preset name or YAML/JSON file")
    check.add_argument("--steps", type=int, default=3, help="optimizer steps to compare")
    check.add_argument("--device", default="auto", help=DEVICE_HELP)
    check.add_argument(
        "--atol", type=float, default=0.0, help="tolerance for losses and gradients (0: bit-identical)"
    )
    check.add_argument(
        "--check-recompute",
        action="store_true",
        help="also compare every replayed op with its forward value (keeps a copy of the layers' op outputs)",
    )
    check.add_argument("--json", metavar="PATH", help="write the report as JSON")
    check.add_argument("--quiet", action="store_true", help="no progress display")
    check.set_defaults(run=_verify)

    units = sub.add_parser("units", help="list the recompute units (all, or those a model declares)")
    units.add_argument("--model", help="only the units this model declares (any --model form)")
    units.add_argument(
        "--size", default="tiny", help="size of a built-in model given with --model (tiny, small)"
    )
    units.set_defaults(run=_units)
    for subparser in sub.choices.values():
        subparser.formatter_class = _HelpFormatter
    return parser


_OUTPUT_OPTIONS = (("json", "--json"), ("markdown", "--markdown"), ("out", "--out"), ("plot", "--plot"))


def _unwritable(path: Path) -> str | None:
    """Why ``path`` cannot be written (its missing folders are made on writing); None if it can."""
    if path.is_dir():
        return "it is a directory; give a file path"
    if path.exists():
        return None if os.access(path, os.W_OK) else "the file is not writable"
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{str(folder)!r} is a file, not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"no permission to write in {str(folder)!r}"
    return None


def _check_arguments(args: argparse.Namespace) -> None:
    """What can be checked before any work: the device and the output paths."""
    if getattr(args, "device", None) is not None:
        from actplan.evaluate.bench import _device

        _device(args.device)
    for attribute, option in _OUTPUT_OPTIONS:
        if getattr(args, attribute, None):
            why = _unwritable(Path(getattr(args, attribute)))
            if why is not None:
                raise ValueError(
                    f"cannot write {option} {getattr(args, attribute)!r}: {why}; choose another path "
                    "(checked before any work)"
                )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:
        # Logs and CI captures have no width; don't squeeze the table to 80 columns.
        console = Console(width=200)
    try:
        _check_arguments(args)
        return args.run(args, console)
    except (ConfigError, ValueError) as err:
        console.print(f"[red]error:[/] {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
