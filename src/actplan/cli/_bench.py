"""``actplan bench``: run the bench (under torchrun for expert parallelism), print its tables,
write its JSON and markdown reports. Exit status 1 when a row's parity fails.

Imports ``actplan.evaluate`` and the CLI's console and table helpers and its parser (for
the defaults a rerun hint leaves out); the parser imports no command.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from rich.console import Console

from actplan.cli._console import model_options, progress_display, write_output
from actplan.cli._parser import build_parser
from actplan.cli._tables import bench_extra_table, bench_table, held_table
from actplan.evaluate.bench import run_bench
from actplan.evaluate.report import to_markdown


def bench(args: argparse.Namespace, console: Console) -> int:
    if args.ep > 1:
        return _bench_expert_parallel(args, console)
    return _run_and_report(args, console)


def _bench_expert_parallel(args: argparse.Namespace, console: Console) -> int:
    """Under torchrun: one rank per expert shard; rank 0 reports."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        raise ValueError(
            f"--ep {args.ep} needs one process per rank: run "
            f"`torchrun --nproc-per-node {args.ep} -m actplan bench {rerun_options(args)}`"
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


def rerun_options(args: argparse.Namespace) -> str:
    """This run's options as a command line: the model, size and ``--ep``, and every other
    option given a value other than its default (what a hint to run it again must carry)."""

    defaults = vars(build_parser().parse_args(["bench"]))
    options = [model_options(args), f"--ep {args.ep}"]
    for name, value in vars(args).items():
        if name in ("command", "run", "model", "size", "device", "ep") or value == defaults.get(name):
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            options.append(flag)
        elif isinstance(value, list):
            options += [f"{flag} {shlex.quote(str(item))}" for item in value]
        else:
            options.append(f"{flag} {shlex.quote(str(value))}")
    return " ".join(options)


def _run_and_report(args: argparse.Namespace, console: Console) -> int:
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    with progress_display(console, args.quiet, "building") as progress:
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
            roofline_gpu=args.gpu,
            command="actplan " + " ".join(sys.argv[1:]) if sys.argv[1:] else "actplan bench",
        )
    console.print(bench_table(result))
    extra = bench_extra_table(result)
    if extra is not None:
        console.print(extra)
    held = {r.name: r.held_by_unit for r in result.rows if r.held_by_unit}
    if held:
        console.print(held_table(held, "held per kept unit at the end of forward, all layers"))
    if args.json:
        write_output(args.json, json.dumps(result.to_dict(), indent=2) + "\n", console)
    if args.markdown:
        write_output(args.markdown, to_markdown(result), console)
    return 0 if all(r.parity_ok for r in result.rows) else 1
