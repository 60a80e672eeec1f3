"""What every command shares on the terminal: the progress display for the API's long calls,
writing an output file with a "wrote" line, and the options that make a printed hint a command
that works as written. Imports rich and ``actplan.progress`` only."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
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

from actplan.progress import PlainLines, ProgressCallback, ProgressEvent

PIPED_WIDTH = 100
"""Columns of output that goes to a pipe or a file with no ``COLUMNS`` set: what a
100-column terminal shows when the output is pasted there."""


def make_console() -> Console:
    """The console every command prints to: a terminal's own width; ``COLUMNS`` when set (rich
    reads it); otherwise, piped or captured, ``PIPED_WIDTH`` columns."""
    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        console = Console(width=PIPED_WIDTH)
    return console


@contextlib.contextmanager
def progress_display(console: Console, quiet: bool, starting: str) -> Iterator[ProgressCallback]:
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


def write_output(path: str, text: str, console: Console) -> None:
    """Write ``text`` to ``path`` (making its folders) and say so."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    console.print(f"wrote {path}")


def model_options(args: argparse.Namespace, *, device: bool = True) -> str:
    """The options that name this run's model (``--model``, ``--size``; ``--device`` unless
    ``device`` is false or it is ``auto``), for a hint that must work as written."""
    options = f"--model {shlex.quote(args.model)}"
    if ":" not in args.model:  # a factory builds one size
        options += f" --size {shlex.quote(args.size)}"
    if device and getattr(args, "device", "auto") != "auto":
        options += f" --device {shlex.quote(args.device)}"
    return options


def hint(console: Console, command: str) -> None:
    """Print a command to run, indented, on one line (never wrapped, no markup)."""
    console.print(f"  {command}", soft_wrap=True, markup=False, highlight=False)
