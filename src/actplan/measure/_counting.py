"""``OpCounter``: how many times each op actually ran, counted at the dispatcher, to prove what a
plan reruns in backward and what it serves from memory. Imports ``_torch_internals`` only.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from actplan._torch_internals import OpOverload, TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts every op that actually executes while active, by ``OpOverload``.

    Enter it outside checkpointing: ops a selective-checkpoint cache serves in
    recompute never reach it, so the counts prove what was replayed and what was
    not. Counting at the dispatcher (not in Python) also sees ops that a replay
    reruns without rerunning the Python around them, e.g. collectives. Higher-order ops a
    compiled backward runs (``run_with_rng_state(state, op, ...)`` replaying a random op) count
    themselves and the op they run.
    """

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        if not isinstance(func, OpOverload) and len(args) > 1 and isinstance(args[1], OpOverload):
            self.counts[args[1]] += 1
        return func(*args, **(kwargs or {}))

    def __getitem__(self, func: Any) -> int:
        return self.counts[func]
