"""``checkpoint_record``: the marker model code places in ``forward``.

The marker is a registered torch custom op (``torch.ops.actplan.checkpoint_record``)
with no tensor arguments and no outputs. Being an op, it reaches the
selective-checkpoint policy through the dispatcher in program order, both in
eager mode and when a layer is traced by ``torch.compile(fullgraph=True)``.
Outside an active selective region (and outside compilation) the Python guard
returns before touching the dispatcher, so a marker costs one attribute read.

Imports only torch; the policy module imports this one, never the reverse.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
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


class _RegionDepth(threading.local):
    depth = 0


_ACTIVE = _RegionDepth()


def checkpoint_record(marker: str) -> None:
    """Mark a point in a layer's forward; ``MarkerInterval`` spans run between two marks.

    Emits the marker op only while a selective-checkpoint region is recording in
    this thread, or while ``torch.compile`` traces (the compiled graph must carry
    the marker for the policy that runs when the graph is partitioned).
    """
    if _ACTIVE.depth or torch.compiler.is_compiling():
        MARKER_OP(marker)


@contextmanager
def recording_markers() -> Iterator[None]:
    """Make ``checkpoint_record`` emit its op in this thread (nests)."""
    _ACTIVE.depth += 1
    try:
        yield
    finally:
        _ACTIVE.depth -= 1
