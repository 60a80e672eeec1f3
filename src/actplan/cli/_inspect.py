"""``actplan explain`` (the per-layer plan a config resolves to, optionally measured),
``actplan units`` (the recompute units, or those a model declares) and ``actplan verify``
(a plan's steps next to no checkpointing).

Imports the install layer, the models, ``actplan.evaluate.verify`` and the CLI's helpers.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from actplan.cli._console import model_options, progress_display, write_output
from actplan.cli._tables import held_table, layer_plan_table, verify_table
from actplan.devices import resolve_device
from actplan.integrations import hf
from actplan.models import ModelBundle, load_model, train_step


def explain(args: argparse.Namespace, console: Console) -> int:
    from actplan._install.apply import plan_for

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
            + f" (the module spans of each unit: `actplan units {model_options(args, device=False)}`)"
        )
    console.print(layer_plan_table(plan, f"plan for {bundle.description}", caption))
    return 0


def _explain_measured(bundle: ModelBundle, config: str, console: Console) -> int:
    # Two training steps: the first teaches each layer its path, the second is reported.
    from actplan._install.apply import apply, held_by_layer

    plan = apply(bundle.model, config)
    for seed in range(2):
        train_step(bundle.model, bundle.make_batch(seed))
        bundle.model.zero_grad(set_to_none=True)
    held = held_by_layer(bundle.model)
    console.print(plan.summary())
    console.print(held_table(held, f"held per kept unit, {bundle.description}, one training step"))
    return 0


def units(args: argparse.Namespace, console: Console) -> int:
    from actplan._install.apply import layer_specs
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
    # A Hugging Face model's units are module spans: name the modules, so the text is its own.
    modules = hf.unit_modules(model) if model is not None and hf.contains_transformers(model) else {}
    if modules:
        table.add_column("in this model")
    table.add_column("what it is; what keeping it costs and saves")
    for unit in RecomputeUnit:
        if args.model and unit not in declared:
            continue
        row = [unit.value, ", ".join(declared[unit])] if args.model else [unit.value]
        if modules:
            row.append(modules.get(unit, "-"))
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


def verify(args: argparse.Namespace, console: Console) -> int:
    from actplan.evaluate.verify import verify as verify_plan

    bundle = load_model(args.model, args.size)
    with progress_display(console, args.quiet, "verifying") as progress:
        report = verify_plan(
            bundle,
            args.config,
            steps=args.steps,
            device=resolve_device(args.device),
            atol=args.atol,
            check_recompute=args.check_recompute,
            progress=progress,
        )
    console.print(verify_table(args.config, report))
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
        write_output(args.json, json.dumps(report.to_dict(), indent=2) + "\n", console)
    return 0 if report.ok else 1
