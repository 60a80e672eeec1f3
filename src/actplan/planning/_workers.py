"""Independent steps of an estimate run side by side, one worker process per core.

Each preset's step at a real shape is a separate run of the model on fake tensors: a few
seconds to a minute of pure Python (torch's fake-tensor dispatch), single-threaded, sharing
nothing with the next preset's. ``run_calls`` hands such calls to worker processes, started
with ``spawn`` (a fresh interpreter: no inherited torch threads or process group; each
imports torch once) and returns their results in the order given, whatever order they finish
in. A worker's error is raised here as it was raised there, and the calls not yet started are
dropped.

``default_workers`` is what ``actplan estimate --workers`` defaults to: the ``ACTPLAN_WORKERS``
environment variable when set (the test suite sets it to 1, as its own workers share the
cores), else the cores this process may run on. Imports nothing from actplan.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from typing import Any

__all__ = ["WORKERS_ENV", "default_workers", "run_calls", "usable_cores"]

WORKERS_ENV = "ACTPLAN_WORKERS"

Call = tuple[Callable[..., Any], tuple, dict]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system reports one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def default_workers() -> int:
    """``ACTPLAN_WORKERS`` when set, else ``usable_cores()``."""
    value = os.environ.get(WORKERS_ENV)
    if value is None:
        return usable_cores()
    try:
        workers = int(value)
    except ValueError:
        workers = 0
    if workers < 1:
        raise ValueError(f"{WORKERS_ENV}={value!r} must be a whole number of processes, 1 or more")
    return workers


def _start_worker() -> None:
    # A fake-tensor step computes nothing worth threads; one per worker keeps the workers off
    # each other's cores.
    import torch

    torch.set_num_threads(1)


def run_calls(calls: Sequence[Call], workers: int, done: Callable[[int], None] | None = None) -> list[Any]:
    """``fn(*args, **kwargs)`` for each call, in up to ``workers`` processes (here, in this
    process, with one worker or one call); the results in the calls' order. ``done(index)`` is
    told as each call finishes."""
    if workers < 1:
        raise ValueError(f"workers must be 1 or more, got {workers}")
    if workers == 1 or len(calls) <= 1:
        results = []
        for index, (fn, args, kwargs) in enumerate(calls):
            results.append(fn(*args, **kwargs))
            if done is not None:
                done(index)
        return results
    pool = ProcessPoolExecutor(
        max_workers=min(workers, len(calls)),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_start_worker,
    )
    futures: list[Future] = []
    try:
        futures = [pool.submit(fn, *args, **kwargs) for fn, args, kwargs in calls]
        index_of = {id(future): index for index, future in enumerate(futures)}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for future in sorted(finished, key=lambda f: index_of[id(f)]):
                future.result()  # raises a worker's error here
                if done is not None:
                    done(index_of[id(future)])
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
