"""Warnings that point at the user's code: ``warn`` walks out of actplan's frames.

A warning's ``stacklevel`` names the frame Python reports it at. A fixed level is right for
one path only (``apply`` -> ``declare`` is not ``plan_for`` -> ``declare``), so ``warn``
counts frames instead: it reports the first frame outside actplan and outside the libraries a
call passes through on its way in (torch's module and autograd machinery, ``transformers``,
``accelerate``, ``peft``), which is the line of the user's that triggered it: ``actplan.apply``,
``model(...)``, ``loss.backward()`` or ``trainer.train()``. When no such frame is on the stack
(a backward on an autograd worker thread), it falls back to the first frame outside actplan.

Imports the standard library only.
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType

# Top-level packages whose frames are never the user's call site.
_OURS = "actplan"
_PASSED_THROUGH = frozenset({_OURS, "torch", "transformers", "accelerate", "peft"})


def _package(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__") or "").partition(".")[0]


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by this function's caller that reports
    the user's frame."""
    frame: FrameType | None = sys._getframe(1)
    level, first_outside_us = 1, None
    while frame is not None:
        package = _package(frame)
        if package not in _PASSED_THROUGH:
            return level
        if first_outside_us is None and package != _OURS:
            first_outside_us = level
        frame, level = frame.f_back, level + 1
    return first_outside_us or 1


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` reported at the user's line (see the module docstring)."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
