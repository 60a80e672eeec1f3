"""Independent steps of an estimate run side by side, one worker process per core.

Each preset's step at a real shape is a separate run of the model on fake tensors: seconds to
a minute of pure Python (torch's fake-tensor dispatch) on one core, sharing nothing with the
next preset's. ``Workers`` hands such calls to worker processes, started with ``spawn`` (a
fresh interpreter: no inherited torch threads or process group; each imports torch once, and
the pool lives as long as the ``with`` block, so that import is paid once per worker). With one
worker there is no pool: each call runs here, when it is submitted. A worker's error is raised
here as it was raised there, and its warnings are warned again here when its result is taken
(``Workers.result``), at the user's line, not at the pool's; on the way out the calls not yet
started are dropped.

``default_workers`` is what ``actplan estimate --workers`` defaults to: the ``ACTPLAN_WORKERS``
environment variable when set (the test suite sets it to 1, as its own workers share the
cores), else the cores this process may run on. Imports ``actplan._callsite`` only.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from actplan._callsite import warn

__all__ = ["WORKERS_ENV", "Workers", "default_workers", "usable_cores"]

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


def _warning_capturing(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, list]:
    """``fn(*args, **kwargs)`` in a worker, with the warnings it raised (message, category)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        value = fn(*args, **kwargs)
    return value, [(str(w.message), w.category) for w in caught]


def _settle(outer: Future, inner: Future) -> None:
    # The worker's value becomes ``outer``'s result; its warnings wait on ``outer`` for
    # ``Workers.result`` to warn again here.
    if inner.cancelled():
        outer.cancel()
    elif inner.exception() is not None:
        outer.set_exception(inner.exception())
    else:
        value, outer.caught = inner.result()
        outer.set_result(value)


def _start_worker() -> None:
    # A fake-tensor step computes nothing worth threads; one per worker keeps the workers off
    # each other's cores.
    import torch

    torch.set_num_threads(1)


class Workers:
    """Up to ``count`` worker processes while the ``with`` block lasts (none with ``count`` 1).

    ::

        with Workers(2) as workers:
            rows = workers.run([(step, (job, "none"), {}), (step, (job, "full"), {})])
            later = workers.submit(step, job, "attn")  # a Future
    """

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"workers must be 1 or more processes, got {count}")
        self.count = count
        self._pool: ProcessPoolExecutor | None = None

    @property
    def parallel(self) -> bool:
        """Whether calls run in worker processes (and so may be waited on from several threads)."""
        return self._pool is not None

    def __enter__(self) -> Workers:
        if self.count > 1:
            self._pool = ProcessPoolExecutor(
                max_workers=self.count,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """``fn(*args, **kwargs)`` in a worker; without workers, run now. Its ``Future``."""
        if self._pool is not None:
            outer: Future = Future()
            inner = self._pool.submit(_warning_capturing, fn, args, kwargs)
            inner.add_done_callback(lambda done: _settle(outer, done))
            return outer
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as error:  # raised again by future.result(), as a worker's would be
            future.set_exception(error)
        return future

    @staticmethod
    def result(future: Future) -> Any:
        """A submitted call's result, or its error; a worker that died says what to check. The
        warnings a worker raised are warned here, once."""
        try:
            value = future.result()
            for message, category in getattr(future, "caught", ()):
                warn(message, category)
            future.caught = []
            return value
        except BrokenProcessPool as error:
            raise RuntimeError(
                "a worker process stopped before returning (out of memory, killed, or a script that "
                "starts work when imported: a worker imports the main module again, so a script "
                "asking for workers keeps its work under `if __name__ == \"__main__\":`); run with "
                "one worker (--workers 1, or workers=1) to see the step's own error"
            ) from error

    def run(self, calls: Sequence[Call], done: Callable[[int], None] | None = None) -> list[Any]:
        """Each call's result, in the calls' order; ``done(index)`` as each finishes. The first
        error raised stops the wait and is raised here."""
        futures = []
        for index, (fn, args, kwargs) in enumerate(calls):
            futures.append(self.submit(fn, *args, **kwargs))
            if self._pool is None:
                self.result(futures[-1])
                if done is not None:
                    done(index)
        if self._pool is not None:
            index_of = {id(future): index for index, future in enumerate(futures)}
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in sorted(finished, key=lambda f: index_of[id(f)]):
                    self.result(future)
                    if done is not None:
                        done(index_of[id(future)])
        return [self.result(future) for future in futures]
