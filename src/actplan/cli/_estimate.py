"""``actplan estimate``: memory per GPU and estimated step time of each preset at a real shape,
on fake tensors, before renting the hardware. Imports ``actplan.evaluate.estimate`` and the
CLI's helpers."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from actplan.cli._console import write_output
from actplan.sizes import parse_bytes

_SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
_MOE_FLAGS = ("experts", "top_k", "expert_ffn", "shared_ffn", "first_k_dense")


def shape_from_args(args: argparse.Namespace):
    """``--shape NAME`` with any flag overriding it, or ``--model`` with every number given."""
    from actplan.evaluate.estimate import Shape, load_shape, shape_names

    given = {name: getattr(args, name) for name in (*_SHAPE_FLAGS, *_MOE_FLAGS)}
    given |= {"seq": args.seq, "batch": args.batch, "dtype": args.dtype}
    if args.shape:
        if args.model:
            raise ValueError("give --shape or --model, not both (a shape names its model)")
        return load_shape(args.shape, **given)
    if not args.model:
        raise ValueError(
            f"give --shape NAME ({', '.join(shape_names())}) or --model dense|moe with "
            "--layers --hidden --heads --kv-heads --ffn --vocab"
        )
    missing = [f"--{name.replace('_', '-')}" for name in _SHAPE_FLAGS if given[name] is None]
    if missing:
        raise ValueError(f"--model {args.model} needs {', '.join(missing)} (or use --shape NAME)")
    shape = Shape(model=args.model, **{k: v for k, v in given.items() if v is not None})
    shape.check()
    return shape


def estimate(args: argparse.Namespace, console: Console) -> int:
    from actplan.evaluate.estimate import estimate as run_estimate

    shape = shape_from_args(args)
    budget = None if args.budget is None else parse_bytes(args.budget)
    if budget is not None and budget < 2**20:
        raise ValueError(f"--budget {args.budget!r} is under 1 MiB; write it with a unit, e.g. '80GiB'")
    presets = [name.strip() for name in args.presets.split(",") if name.strip()]
    progress = None if args.quiet else (lambda line: console.print(f"[dim]{line}[/]"))
    result = run_estimate(
        shape, presets, gpu=args.gpu, fsdp=args.fsdp, budget_bytes=budget, progress=progress
    )
    console.print(estimate_table(result))
    for note in result.notes:
        console.print(f"note: {note}")
    best = result.recommended
    if budget is not None:
        if best is None:
            console.print(f"[red]no preset fits {args.budget}[/]: shard further (--fsdp) or shorten --seq")
        else:
            console.print(
                f"fastest preset under {args.budget}: {best.preset} (estimated {best.ratio_to_none:.3f}x)"
            )
    if args.json:
        write_output(args.json, json.dumps(result.to_dict(), indent=2) + "\n", console)
    return 0 if budget is None or best is not None else 1


def estimate_table(result) -> Table:
    gib = 2**30
    table = Table(
        title=f"{result.description}\n{result.gpu}, FSDP over {result.fsdp}: "
        f"{result.parameters / 1e9:.2f} B parameters, static {result.static_bytes / gib:.1f} GiB "
        f"+ gathered {result.gathered_bytes / gib:.1f} GiB per GPU",
        caption=f"estimated on fake tensors in {result.seconds_taken:.0f} s; times are estimates",
    )
    for header in ("preset", "activations (end of fwd)", "step peak", "peak per GPU", "est. step", "vs none"):
        table.add_column(header, justify="left" if header == "preset" else "right")
    if result.budget_bytes is not None:
        table.add_column(f"fits {result.budget_bytes / gib:.0f} GiB", justify="center")
    for row in result.rows:
        cells = [
            row.preset,
            f"{row.activation_bytes / gib:,.2f} GiB",
            f"{row.step_peak_bytes / gib:,.2f} GiB",
            f"{row.peak_bytes / gib:,.2f} GiB",
            f"{row.seconds * 1e3:,.0f} ms",
            "-" if row.ratio_to_none is None else f"{row.ratio_to_none:.3f}x",
        ]
        if result.budget_bytes is not None:
            cells.append("yes" if row.fits else "no")
        table.add_row(*cells)
    return table
