"""``checkpoint_record``: the marker model code places in ``forward``.

The marker is a registered torch custom op (``torch.ops.actplan.checkpoint_record``)
with no tensor arguments and no outputs. While ``torch.compile`` traces a layer
the op is emitted, so the compiled graph carries the markers, in program order,
to the selective-checkpoint policy that runs when the graph is partitioned. In
eager mode the same call goes straight to the region recording the layer (no
dispatcher round trip), and outside a checkpointed layer it returns after one
check.

Imports only torch; the policy module imports this one, never the reverse.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_LIB = torch.library.Library("actplan", "DEF")
_LIB.define("checkpoint_record(str marker) -> ()")


def _record_kernel(marker: str) -> None:
    # The op does nothing itself; a selective-checkpoint policy observes it.
    return None


_LIB.impl("checkpoint_record", _record_kernel, "CompositeExplicitAutograd")

MARKER_OP = torch.ops.actplan.checkpoint_record.default
"""The ``OpOverload`` a policy sees for each marker; its only argument is the name."""

LAYER_END = "actplan.layer_end"
"""Reserved marker the checkpoint boundary emits when a layer's forward returns."""


class _MarkerRoute(threading.local):
    # Where eager markers go in this thread: the recording region, or nowhere.
    sink: Callable[[str], None] | None = None


_ROUTE = _MarkerRoute()


def checkpoint_record(marker: str) -> None:
    """Mark a point in a layer's forward; ``MarkerInterval`` spans run between two marks.

    Under ``torch.compile`` it emits the marker op into the graph; in eager mode it
    tells the selective-checkpoint region recording this layer, if any.
    """
    if torch.compiler.is_compiling():
        MARKER_OP(marker)
        return
    sink = _ROUTE.sink
    if sink is not None:
        sink(marker)


@contextmanager
def routing_markers(sink: Callable[[str], None] | None) -> Iterator[None]:
    """Send this thread's eager ``checkpoint_record`` calls to ``sink`` (nests)."""
    previous = _ROUTE.sink
    _ROUTE.sink = sink
    try:
        yield
    finally:
        _ROUTE.sink = previous
