"""The one check that an optional extra is installed, with the ``pip install`` line that fixes it.

Used by the planning package (the ``plan`` extra: numpy, scipy) and its plot (the ``cli``
extra: matplotlib). Imports only the standard library.
"""

from __future__ import annotations

import importlib.util

_PURPOSE = {
    "plan": "planning under a budget",
    "cli": "plotting",
}


def require(*modules: str, extra: str = "plan") -> None:
    """Raise ``ImportError`` naming ``pip install 'actplan[<extra>]'`` when any of the top-level
    ``modules`` cannot be found. Nothing is imported: scipy stays unloaded until used."""
    missing = [name for name in modules if not _found(name)]
    if missing:
        raise ImportError(
            f"{_PURPOSE.get(extra, extra)} needs {' and '.join(missing)}, which is not installed: "
            f"pip install 'actplan[{extra}]'"
        )


def _found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # an import hook that blocks it, or a broken entry
        return False
