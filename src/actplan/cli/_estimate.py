"""``actplan estimate``: memory per GPU and estimated step time of each preset and plan at a
real shape and parallel layout, on fake tensors, before renting the hardware. Imports
``actplan.planning.estimate``, the shapes and the CLI's helpers."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from actplan.cli._console import write_output
from actplan.sizes import parse_bytes, rounding_note

_SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
_MOE_FLAGS = ("experts", "top_k", "expert_ffn", "shared_ffn", "first_k_dense")


def shape_from_args(args: argparse.Namespace):
    """``--shape NAME`` or ``--hf-config PATH`` with any flag overriding it, ``--titan
    MODEL:FLAVOR`` with its sequence, batch, dtype and depth, or ``--model`` with every number
    given."""
    from actplan.models.shape import Shape, load_shape, shape_from_hf_config, shape_names

    given = {name: getattr(args, name) for name in (*_SHAPE_FLAGS, *_MOE_FLAGS, "head_dim")}
    given |= {"seq": args.seq, "batch": args.batch, "dtype": args.dtype}
    named = (("--shape", args.shape), ("--hf-config", args.hf_config), ("--titan", args.titan),
             ("--model", args.model))  # fmt: skip
    sources = [flag for flag, value in named if value]
    if len(sources) > 1:
        raise ValueError(f"give one of {', '.join(sources)}, not several (each names the model)")
    if args.shape:
        return load_shape(args.shape, **given)
    if args.hf_config:
        return shape_from_hf_config(args.hf_config, **given)
    if args.titan:
        from actplan.models.titan import shape_from_titan

        return shape_from_titan(args.titan, **given)
    if not args.model:
        raise ValueError(
            f"give --shape NAME ({', '.join(shape_names())}), --hf-config PATH, --titan MODEL:FLAVOR, "
            "or --model dense|moe with --layers --hidden --heads --kv-heads --ffn --vocab"
        )
    missing = [f"--{name.replace('_', '-')}" for name in _SHAPE_FLAGS if given[name] is None]
    if missing:
        raise ValueError(f"--model {args.model} needs {', '.join(missing)} (or use --shape NAME)")
    shape = Shape(model=args.model, **{k: v for k, v in given.items() if v is not None})
    shape.check()
    return shape


def estimate(args: argparse.Namespace, console: Console) -> int:
    from actplan.measure import AllocatorSettings, settings_from_env
    from actplan.planning._workers import default_workers
    from actplan.planning.estimate import TrainingSetup
    from actplan.planning.estimate import estimate as run_estimate

    shape = shape_from_args(args)
    shape.per_rank(args.tp, args.ep)  # a layout that does not divide fails before any work
    allocator = AllocatorSettings.parse(args.alloc_conf) if args.alloc_conf else settings_from_env()
    budget = None if args.budget is None else parse_bytes(args.budget, round_down=True)
    if budget is not None and (note := rounding_note(args.budget)):
        console.print(f"note: --budget {note}")
    if budget is not None and budget < 2**20:
        raise ValueError(f"--budget {args.budget!r} is under 1 MiB; write it with a unit, e.g. '80GiB'")
    if args.out and budget is None:
        raise ValueError("--out writes the plan for --budget; give --budget too (e.g. --budget 72GiB)")
    if args.plot and not args.frontier:
        raise ValueError("--plot draws the frontier; give --frontier too")
    host_budget = None if args.host_budget is None else parse_bytes(args.host_budget, round_down=True)
    gpu = _gpu_with_links(args)
    presets = [name.strip() for name in args.presets.split(",") if name.strip()]
    progress = None if args.quiet else (lambda line: console.print(f"[dim]{line}[/]"))
    result = run_estimate(
        shape,
        presets,
        gpu=gpu,
        fsdp=args.fsdp,
        tp=args.tp,
        ep=args.ep,
        budget_bytes=budget,
        plans=args.plan or bool(args.out),
        allocator=allocator,
        training=TrainingSetup(args.optimizer, args.optimizer_impl, args.grad_accum, args.freeze),
        progress=progress,
        workers=default_workers() if args.workers is None else args.workers,
        gpus_per_node=args.gpus_per_node,
        frontier=args.frontier,
        host_budget_bytes=host_budget,
    )
    console.print(estimate_table(result))
    console.print(time_table(result))
    if result.frontiers:
        console.print(frontier_table(result))
        for line in frontier_summary(result):
            console.print(line)
        if args.plot:
            write_frontier_plot(result, args.plot)
            console.print(f"wrote {args.plot}")
    for note in result.notes:
        console.print(f"note: {note}")
    best = result.recommended
    if budget is not None:
        if best is None:
            console.print(
                f"[red]nothing fits {args.budget}[/]: shard further (--fsdp, --tp) or shorten --seq"
            )
        else:
            console.print(f"fastest under {args.budget}: {best.preset} (estimated {best.ratio_to_none:.3f}x)")
    if args.out:
        plan = next((row for row in result.plans if row.fits), None)
        if plan is None:
            console.print(f"[red]no plan written[/]: no plan fits {args.budget}")
        else:
            header = f"actplan estimate plan for {result.description}; {result.gpu}, FSDP {result.fsdp}"
            text = "".join(f"# {line}\n" for line in header.splitlines()) + plan.plan_yaml
            write_output(args.out, text, console)
    if args.json:
        write_output(args.json, json.dumps(result.to_dict(), indent=2) + "\n", console)
    return 0 if budget is None or best is not None else 1


def _gpu_with_links(args: argparse.Namespace):
    """``--gpu``'s table entry with the links ``--host-link``, ``--gpu-link`` and ``--network``
    name, or its name when they name none."""
    from actplan.measure import accelerator, link_rate

    links = {
        "host_link_bytes_per_s": (args.host_link, "--host-link"),
        "intra_node_bytes_per_s": (args.gpu_link, "--gpu-link"),
        "inter_node_bytes_per_s": (args.network, "--network"),
    }
    given = {field: link_rate(text, flag) for field, (text, flag) in links.items() if text is not None}
    if not given:
        return args.gpu
    return replace(accelerator(args.gpu), **given)


def _host_cell(moved) -> str:
    return "-" if moved is None else f"{moved.host_bytes / 2**30:,.2f}"


def _label_column(table: Table) -> None:
    """The row names' column: a long plan name folds over lines rather than widening the table."""
    table.add_column("preset / plan", justify="left", max_width=30, overflow="fold")


def estimate_table(result) -> Table:
    gib = 2**30
    static = f"static {result.static_bytes / gib:.1f} GiB"
    if result.gathered_bytes:
        static += f" + gathered {result.gathered_bytes / gib:.1f} GiB"
    offloads = any(row.moved is not None for row in result.rows)
    plans = any(row.predicted_peak_bytes is not None for row in result.rows)
    legend = "GiB per GPU; act.: activations at the end of forward; peak: the step's live bytes"
    legend += "; allocated, reserved: the caching allocator's peaks"
    if offloads:
        legend += "; host: pinned host memory"
    if plans:
        legend += "; planner: its predicted peak and step"
    table = Table(
        title=f"{result.description}\n{result.gpu}, FSDP over {result.fsdp}: "
        f"{_count(result.parameters)} parameters {result.parameters_scope}, {static} per GPU\n"
        f"{result.method}; allocator: {result.allocator_settings}",
        caption=f"{legend}. Estimated on fake tensors in {result.seconds_taken:.0f} s; times are estimates",
    )
    _label_column(table)
    headers = ["act.", "peak", "allocated", "reserved", *(["host"] if offloads else []), "step", "× none"]
    headers += ["planner"] if plans else []
    for header in headers:
        table.add_column(header, justify="right")
    table.add_column("fits", justify="center")
    for row in result.rows:
        cells = [
            row.preset,
            f"{row.activation_bytes / gib:,.2f}",
            f"{row.step_peak_bytes / gib:,.2f}",
            f"{row.allocated_peak_bytes / gib:,.2f}",
            f"{row.reserved_peak_bytes / gib:,.2f}",
            *([] if not offloads else [_host_cell(row.moved)]),
            f"{row.seconds * 1e3:,.0f} ms",
            "-" if row.ratio_to_none is None else f"{row.ratio_to_none:.3f}x",
        ]
        if plans:
            cells.append(
                "-"
                if row.predicted_peak_bytes is None
                else f"{row.predicted_peak_bytes / gib:,.2f}, {row.predicted_ratio:.3f}x"
            )
        cells.append("-" if row.fits is None else ("yes" if row.fits else "no"))
        table.add_row(*cells)
    return table


def time_table(result) -> Table:
    """Where each row's estimated step time goes: compute, the communication and the offload
    copies the compute waits for; what the step trains per GPU."""
    table = Table(
        title="where the time goes (estimates)",
        caption="waits: what the compute stream waits for communication and for offload copies",
    )
    _label_column(table)
    for header in ("step", "compute", "waits: comm", "waits: copies", "tokens/s per GPU", "MFU"):
        table.add_column(header, justify="right")
    for row in result.rows:
        copies = row.moved.exposed_seconds if row.moved is not None else 0.0
        compute = row.seconds - row.exposed_comm_seconds - copies
        table.add_row(
            row.preset,
            f"{row.seconds * 1e3:,.0f} ms",
            f"{compute * 1e3:,.0f} ms",
            f"{row.exposed_comm_seconds * 1e3:,.0f} ms",
            "-" if row.moved is None else f"{copies * 1e3:,.0f} ms",
            f"{row.tokens_per_s:,.0f}" if row.tokens_per_s is not None else "-",
            f"{row.mfu:.0%}" if row.mfu is not None else "-",
        )
    return table


_SHARES = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)


def _fastest_within(points, share: float):
    within = [p for p in points if p.share_of_none <= share + 1e-9]
    return min(within, key=lambda p: p.ratio) if within else None


def frontier_table(result) -> Table:
    """The fastest predicted plan at each share of ``none``'s activations (bytes above parameters
    and optimizer state), keeping or recomputing only, and with offload too."""
    table = Table(
        title="the planner's frontier: fastest plan at each activation budget (predicted)",
        caption="activations: a share of none's; each kind's fastest step; host: GiB pinned per GPU",
    )
    table.add_column("activations ≤", justify="right")
    for kind in result.frontiers:
        table.add_column(kind, justify="right")
    table.add_column("host", justify="right")
    kinds = list(result.frontiers.values())
    lowest = min(p.share_of_none for points in kinds for p in points)
    for share in [*_SHARES, lowest]:
        if share < lowest - 1e-9:
            continue
        best = [_fastest_within(points, share) for points in kinds]
        cells = [f"{share:.0%}" if share != lowest else f"{share:.0%} (least)"]
        cells += ["-" if b is None else f"{b.ratio:.3f}x" for b in best]
        last = best[-1]
        cells.append("-" if last is None else f"{last.host_bytes / 2**30:,.2f}")
        table.add_row(*cells)
    return table


def frontier_summary(result) -> list[str]:
    """For each frontier kind, the least activations any plan predicted at most 1.03x holds."""
    from actplan.planning.estimate import FRONTIER_RATIO

    lines = []
    for kind, points in result.frontiers.items():
        fast = [p for p in points if p.ratio <= FRONTIER_RATIO]
        if fast:
            best = min(fast, key=lambda p: p.share_of_none)
            lines.append(
                f"{kind}: at most {FRONTIER_RATIO}x, the least activations are {best.share_of_none:.0%} of "
                f"none's ({best.ratio:.3f}x): {best.plan}"
            )
        else:
            lines.append(f"{kind}: no plan is predicted at {FRONTIER_RATIO}x or less")
    return lines


def write_frontier_plot(result, path: str) -> None:
    """Both frontiers as step curves, peak memory per GPU (MiB) against predicted step time."""
    from actplan.planning.plot import pareto_axes

    title = f"{result.description}; {result.gpu}, FSDP {result.fsdp}: the planner's frontier"
    with pareto_axes(path, title) as ax:
        for kind, points in result.frontiers.items():
            ax.plot(
                [p.peak_bytes / 2**20 for p in points],
                [p.ratio for p in points],
                "o-",
                markersize=3,
                drawstyle="steps-post",
                label=kind,
            )


def _count(parameters: int) -> str:
    """A parameter count in billions, or millions below one billion (a test shape's 0.00 B)."""
    return f"{parameters / 1e9:.2f} B" if parameters >= 1e9 else f"{parameters / 1e6:.2f} M"
