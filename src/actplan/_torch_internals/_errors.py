"""``TorchInternalsError``, in a leaf of its own so that every module of
``actplan._torch_internals`` raises it without importing the package that re-exports them.
"""

from __future__ import annotations


class TorchInternalsError(RuntimeError):
    """A private torch API actplan relies on is missing or behaves differently in this torch."""
